"""Recomputing a block's activations in backward, the way torch does it (NOTE [recompute plan]).

A recomputed block's ``forward`` runs under ``torch.utils.checkpoint.checkpoint`` with
``use_reentrant=False``: autograd saves nothing inside it but its positional inputs (through
the swap's hooks, so they are swapped like any other saved storage), and the first read of a
saved tensor in its backward runs the forward again. torch's checkpoint keeps the CPU and CUDA
RNG states of the first run and restores them for the second, so dropout draws the same mask.
Keyword arguments are passed to checkpoint positionally where they are tensors (or tuples of
them), so that they are saved through the hooks like the positional inputs, and are closed over
otherwise, so a module keyword never collides with one of checkpoint's own. A tensor closed
over would be held by checkpoint's recompute function until backward, out of the swap's sight:
a Llama layer's attention takes its hidden states as ``hidden_states=``, and a layer recomputed
in parts held that input, 67 MB a layer at 4x2048 tokens, through the whole forward.

The wrapper is an instance attribute ``forward`` over the module's own; removing it gives the
module back exactly what it had (its class's forward, or an instance ``forward`` somebody set
before, accelerate's hooks for one). Outside a training step, or with gradients off, the
wrapper calls the forward directly: evaluation does not pay for checkpoint.

A block recomputed in parts (NOTE [recompute in parts] in training/plan.py) has its parts'
forwards wrapped the same way, inside its own; its backward is never replayed as a graph.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..pytorch.held import InstancePatch

__all__ = ["Recompute"]


class Recompute:
    """The set of modules whose forward is checkpointed, changed with :meth:`set`."""

    def __init__(self, torch: Any, in_step: Callable[[], bool], replays: Any = None):
        self.torch = torch
        self.in_step = in_step
        self.replays = replays                 # a Replays: backward as CUDA graphs where it can be
        self.wrapped: dict[int, InstancePatch] = {}       # key -> the module's forward, set on the instance
        self.in_parts: dict[int, list[InstancePatch]] = {}   # key -> its parts' forwards, where in parts

    @property
    def keys(self) -> frozenset[int]:
        return frozenset(self.wrapped)

    @property
    def parts_keys(self) -> frozenset[int]:
        return frozenset(self.in_parts)

    def set(self, modules: dict[int, Any], parts: dict[int, list[Any]] | None = None) -> None:
        """Checkpoint exactly ``modules`` (key -> module) from now on, and within those keyed in
        ``parts`` each of the modules listed (NOTE [recompute in parts])."""
        parts = parts or {}
        for key in list(self.wrapped):
            if key not in modules or (key in parts) != (key in self.in_parts):
                self._unwrap(key)
        for key, m in modules.items():
            if key not in self.wrapped:
                self._wrap(key, m, parts.get(key))

    def _wrap(self, key: int, m: Any, parts: list[Any] | None = None) -> None:
        patches = []
        try:
            for child in parts or ():
                patches.append(InstancePatch(child, {"forward": self._forward(child, replayed=False)}))
            self.wrapped[key] = InstancePatch(m, {"forward": self._forward(m, replayed=not parts)})
        except BaseException:
            for p in reversed(patches):
                p.remove()
            raise
        if parts:
            self.in_parts[key] = patches

    def _forward(self, m: Any, replayed: bool) -> Any:
        inner = m.forward
        torch = self.torch
        in_step = self.in_step
        replays = self.replays if replayed else None

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not in_step() or not torch.is_grad_enabled():
                return inner(*args, **kwargs)
            if replays is not None and replays.capture:
                return replays.run(m, inner, args, kwargs)
            n = len(args)
            flat, rebuild = _tensor_kwargs(torch, kwargs)
            return torch.utils.checkpoint.checkpoint(lambda *a: inner(*a[:n], **rebuild(a[n:])), *args, *flat,
                                                     use_reentrant=False)

        forward.__wrapped__ = inner            # type: ignore[attr-defined]
        return forward

    def _unwrap(self, key: int) -> None:
        self.wrapped.pop(key).remove()
        for p in reversed(self.in_parts.pop(key, [])):
            p.remove()


def _tensor_kwargs(torch: Any, kwargs: dict[str, Any]) -> tuple[list[Any], Callable[[tuple[Any, ...]], dict[str, Any]]]:
    """The tensors among ``kwargs`` (values, and members of tuples and lists), in order, and a
    function that gives the keywords back from them. The function holds no tensor."""
    flat: list[Any] = []

    def take(x: Any) -> Any:
        if torch.is_tensor(x):
            flat.append(x)
            return _At(len(flat) - 1)
        return x
    rest = {k: _Seq(type(v), [take(x) for x in v]) if type(v) in (tuple, list) or _is_namedtuple(v) else take(v)
            for k, v in kwargs.items()}

    def put(x: Any, got: tuple[Any, ...]) -> Any:
        return got[x.i] if isinstance(x, _At) else x

    def rebuild(got: tuple[Any, ...]) -> dict[str, Any]:
        return {k: v.make([put(x, got) for x in v.items]) if isinstance(v, _Seq) else put(v, got)
                for k, v in rest.items()}
    return flat, rebuild


def _is_namedtuple(v: Any) -> bool:
    return isinstance(v, tuple) and hasattr(type(v), "_make")


class _At:
    """Where a keyword's tensor sits among checkpoint's positional inputs."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


class _Seq:
    """A keyword's tuple or list, its tensors as :class:`_At`."""

    __slots__ = ("kind", "items")

    def __init__(self, kind: type, items: list[Any]):
        self.kind, self.items = kind, items

    def make(self, items: list[Any]) -> Any:
        return self.kind._make(items) if hasattr(self.kind, "_make") else self.kind(items)
