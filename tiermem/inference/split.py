"""Groups bigger than a slot, streamed in parts (NOTE [split groups]): which groups can be cut
(:func:`find_cuts`), how many rows a part takes (:func:`rows_per_part`), and the forwards that run a
head or a layer of stacked experts one part at a time (:func:`chunked_forward`).

NOTE [split groups]
    A plan whose slot is smaller than a group streams that group in parts when it can be cut
    (NOTE [no plan collapse] in inference/plan.py). Two kinds of group can:
    - by rows: tensors of one leading length (a table of rows, with its bias) that only
      embeddings and plain ``nn.Linear`` layers use, the group's root among them. An embedding
      reads the rows of its tokens in place from the pinned home, whether the group streams or
      not, so a tied embedding and head cross the link once per forward, for the head. A head
      bigger than a slot runs over parts of rows: each part is copied into a slot, multiplied,
      and written into its columns of the logits. A GEMM over fewer rows may sum in another
      order than over all of them, so the logits are equal only to rounding (tokens were equal
      in every test); a head that fits a slot is not cut.
    - by expert: a module holding stacked experts (``num_experts``, every parameter with that
      leading length), called as transformers' experts are, ``(hidden_states, top_k_index,
      top_k_weights)``. Each part is a range of experts: the module runs once per part with its
      parameters bound to the part in the slot, ``num_experts`` set to the part's count, and
      the routing renumbered: a choice of an expert outside the part goes to the part's first
      expert with a routing weight of zero, so it adds a zero. (transformers' "no expert"
      index, one past the last, is not skipped by every version's loop: 5.17's one-hot has
      no class for it.) The parts' outputs are summed in expert order. The result is the
      unsplit one to rounding: the unsplit loop adds a token's experts one at a time where the
      parts add their own sums, and a part's first expert multiplies more rows at once. The
      zero-weighted choices cost compute (the first expert of each part runs on every token
      routed elsewhere), not transfer. A forward of few tokens reads stacked experts in place
      (NOTE [streaming plan]) and never runs the parts.
    Any other group bigger than a slot is read in place whole. Parts of rows are whole multiples
    of ROW_ALIGN rows where the slot allows (GEMM tiles); a part's tensors lie back to back in
    the slot, each 256-byte aligned, as a group's do in its home.
"""
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["Cut", "find_cuts", "rows_per_part", "part_bytes", "chunked_forward", "ROW_ALIGN", "EXPERT_ARGS"]

ROW_ALIGN = 64
ALIGN = 256     # a tensor's alignment in the home, a slot and a staging buffer (groups.home_layout)
EXPERT_ARGS = ("hidden_states", "top_k_index", "top_k_weights")


@dataclasses.dataclass(frozen=True, eq=False)
class Cut:
    """How a group can be cut (NOTE [split groups]): ``kind`` "rows" or "experts", ``length``
    rows (or experts) in each of its ``members`` (the indices of its parameters; its buffers,
    an embedding's scale say, stay at home), ``unit`` the bytes one row takes in a slot, and
    ``runs`` the modules that run over its parts (the heads; the experts module)."""

    kind: str
    length: int
    unit: int
    runs: tuple[Any, ...]
    members: tuple[int, ...]
    gathers: tuple[Any, ...] = ()   # embeddings that read its rows in place


def _row_bytes(t: Any) -> int:
    return (t.numel() // max(1, t.shape[0])) * t.element_size()


def part_bytes(tensors: list[Any], rows: int) -> int:
    """Bytes ``rows`` rows of each of ``tensors`` take in a slot, back to back, each aligned."""
    return sum(-(-max(rows * _row_bytes(t), 1) // ALIGN) * ALIGN for t in tensors)


def rows_per_part(tensors: list[Any], cap: int, length: int, align: int = 1) -> int:
    """The most rows whose part fits ``cap`` bytes (at least one), a multiple of ``align`` where
    that leaves one or more."""
    per = sum(_row_bytes(t) for t in tensors)
    k = max(1, min(length, (cap - ALIGN * len(tensors)) // max(1, per)))
    while k > 1 and part_bytes(tensors, k) > cap:
        k -= 1
    if k >= align > 1:
        k -= k % align
    return k


def _linear(m: Any) -> bool:
    import torch
    return isinstance(m, torch.nn.Linear) and type(m).forward is torch.nn.Linear.forward


def _expert_module(m: Any) -> bool:
    try:
        params = list(inspect.signature(type(m).forward).parameters)[1:4]
    except (TypeError, ValueError):
        return False
    return tuple(params) == EXPERT_ARGS


def find_cuts(module: Any, found: list) -> dict[str, Cut]:
    """The groups of ``found`` (module_groups' output) that can be cut, and how (NOTE [split groups])."""
    import torch
    users: dict[int, list[tuple[Any, str]]] = {}
    buffers: set[int] = set()
    for m in module.modules():
        for name, t in m._parameters.items():
            if t is not None:
                users.setdefault(id(t), []).append((m, name))
        for t in m._buffers.values():
            if t is not None:
                buffers.add(id(t))
    out: dict[str, Cut] = {}
    for gname, root, own in found:
        members = tuple(i for i, (_, t) in enumerate(own) if id(t) not in buffers)
        ts = [own[i][1] for i in members]
        if not ts or any(t.dim() < 1 for t in ts):
            continue
        length = ts[0].shape[0]
        if length < 2 or any(t.shape[0] != length for t in ts):
            continue
        uses = [u for t in ts for u in users.get(id(t), [])]
        unit = part_bytes(ts, 1)
        mine = {id(t) for t in ts}
        # A head runs over parts of its weight (and of its bias, if that is in the group too);
        # an embedding reads its rows in place. Any other use, or a head whose weight is elsewhere, rules it out.
        runs = tuple({id(m): m for m, name in uses if _linear(m) and id(m.weight) in mine}.values())
        gathers = tuple({id(m): m for m, name in uses if isinstance(m, torch.nn.Embedding) and name == "weight"
                         and m.max_norm is None}.values())
        if (runs and {id(m) for m, _ in uses} == {id(m) for m in runs + gathers}
                and any(root is m for m in runs + gathers) and all(t.dim() <= 2 for t in ts)):
            out[gname] = Cut("rows", length, unit, runs, members, gathers)
            continue
        experts = getattr(root, "num_experts", None)
        params = [p for p in root._parameters.values() if p is not None]
        if (isinstance(experts, int) and experts == length and _expert_module(root) and all(t.dim() >= 2 for t in ts)
                and all(m is root for m, _ in uses) and {id(p) for p in params} == mine and len(ts) == len(own)):
            out[gname] = Cut("experts", length, unit, (root,), members)
    return out


@dataclasses.dataclass(frozen=True)
class _Ctl:
    runs: Callable[[Any], bool]
    enter: Callable[[Any], list[Any]]
    leave: Callable[[Any], None]


def chunked_forward(module: Any, cut: Cut, group: Any, runs: Callable[[Any], bool],
                    enter: Callable[[Any], list[Any]], leave: Callable[[Any], None]) -> Callable[..., Any]:
    """A forward for ``module`` (one of ``cut.runs``) that runs over ``group.pieces`` (its parts)
    while ``runs(group)`` says they stream, and is the module's own forward otherwise.
    ``enter(part)`` brings a part into a slot and returns its members' views there (in the
    cut's order); ``leave(part)`` gives the slot back (NOTE [split groups])."""
    own, ctl = module.forward, _Ctl(runs, enter, leave)
    if cut.kind == "rows":
        return _rows_forward(module, group, ctl, own)
    return _experts_forward(module, cut, group, ctl, own)


def _rows_forward(module: Any, group: Any, ctl: _Ctl, own: Callable[..., Any]) -> Callable[..., Any]:
    import torch
    F = torch.nn.functional
    at = {id(group.tensors[i]): k for k, i in enumerate(group.cut.members)}   # a part's views: its members

    def forward(x: Any) -> Any:
        if not ctl.runs(group):
            return own(x)
        w_at, b_at = at[id(module.weight)], at.get(id(module.bias)) if module.bias is not None else None
        out = None
        for part in group.pieces:
            views = ctl.enter(part)
            try:
                bias = views[b_at] if b_at is not None else (
                    module.bias[part.lo:part.hi] if module.bias is not None else None)
                y = F.linear(x, views[w_at], bias)
                if out is None:
                    out = y.new_empty((*y.shape[:-1], module.out_features))
                out[..., part.lo:part.hi] = y
            finally:
                ctl.leave(part)
        return out
    return forward


def _experts_forward(module: Any, cut: Cut, group: Any, ctl: _Ctl, own: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    def forward(hidden_states: Any, top_k_index: Any, top_k_weights: Any, *args: Any, **kwargs: Any) -> Any:
        if not ctl.runs(group):
            return own(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        out = None
        try:
            for part in group.pieces:
                n = part.hi - part.lo
                inside = (top_k_index >= part.lo) & (top_k_index < part.hi)
                index = torch.where(inside, top_k_index - part.lo, torch.zeros_like(top_k_index))
                weights = torch.where(inside, top_k_weights, torch.zeros_like(top_k_weights))
                ctl.enter(part)
                try:
                    module.num_experts = n
                    y = own(hidden_states, index, weights, *args, **kwargs)
                finally:
                    module.num_experts = cut.length
                    ctl.leave(part)
                out = y if out is None else out + y
        finally:
            module.num_experts = cut.length
        return out
    return forward
