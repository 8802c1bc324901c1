"""A module's tensors matched to their sources in ``weights=`` (NOTE [weight source] in
inference/sources.py), checked before anything is allocated: a meta tensor the weights lack, or a
source of another shape or dtype, is refused with :class:`CheckpointError`.

wrap_module matches them as it adopts (:func:`weight_sources`); load_pretrained and ``python -m
tiermem plan`` run the same check on the model they built on the meta device
(:func:`check_weights`) before a Tier is made, so a checkpoint that is not the model's is refused
alike by both, with no GPU needed. Reads no tensor's bytes."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..base.dtypes import canonical
from ..errors import CheckpointError
from .groups import MAX_GROUP, module_groups

__all__ = ["weight_sources", "check_weights"]


def weight_sources(module: Any, found: list, weights: Mapping[str, Any] | None, empty: set[int]) -> dict[int, Any]:
    """id(tensor) -> its source in ``weights`` for each tensor of ``found`` (module_groups' groups);
    a tensor of ``empty`` (ids of tensors with no data of their own) must have one. Checked,
    allocates nothing."""
    if weights is None:
        return {}
    names: dict[int, list[str]] = {}
    for n, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), []).append(n)
    out: dict[int, Any] = {}
    missing, bad = [], []
    where = getattr(weights, "path", "")
    for _, _, own in found:
        for n, t in own:
            aliases = names.get(id(t), [n])
            name = next((a for a in aliases if a in weights), None)
            if name is None:
                if id(t) in empty:
                    missing.append(" = ".join(aliases))
                continue
            src = weights[name]
            shape, dtype = tuple(src.shape), canonical(src.dtype)
            if shape != tuple(t.shape) or dtype != canonical(t.dtype):
                bad.append((name, f"{dtype} {list(shape)} where the module has {canonical(t.dtype)} {list(t.shape)}",
                            shape == tuple(t.shape)))
                where = where or getattr(src, "path", "")
                continue
            out[id(t)] = src
    if missing:
        unknown = sorted(set(weights) - {a for aliases in names.values() for a in aliases})
        raise CheckpointError(f"the weights lack {len(missing)} tensor(s) the module needs (and has no data for): "
                              f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}"
                              + (f"; they have {len(unknown)} name(s) the module does not ({', '.join(unknown[:3])}"
                                 f"{' ...' if len(unknown) > 3 else ''}): are they this module's?" if unknown else ""),
                              where)
    if bad:
        hint = ("; only their dtypes differ: convert them first (load_pretrained does with dtype=, python -m tiermem "
                "plan with --dtype)" if all(same_shape for *_, same_shape in bad) else "")
        raise CheckpointError(f"{len(bad)} tensor(s) in the weights do not match the module: "
                              f"{'; '.join(f'{n}: {why}' for n, why, _ in bad[:4])}{' ...' if len(bad) > 4 else ''}{hint}",
                              where)
    return out


def check_weights(module: Any, weights: Mapping[str, Any]) -> None:
    """Raise what adopting ``module`` with ``weights`` would for the match of its tensors to them
    (:func:`weight_sources`), for a module built on the meta device: its meta tensors are the
    ones with no data of their own."""
    found = module_groups(module, MAX_GROUP)     # every tensor is in one group, whatever their size
    empty = {id(t) for _, _, own in found for _, t in own if t.is_meta}
    weight_sources(module, found, weights, empty)
