"""Recomputing a block's activations in backward, the way torch does it (NOTE [recompute plan]).

A recomputed block's ``forward`` runs under ``torch.utils.checkpoint.checkpoint`` with
``use_reentrant=False``: autograd saves nothing inside it but its positional inputs (through
the swap's hooks, so they are swapped like any other saved storage), and the first read of a
saved tensor in its backward runs the forward again. torch's checkpoint keeps the CPU and CUDA
RNG states of the first run and restores them for the second, so dropout draws the same mask.
Keyword arguments (attention masks, rotary tables) are closed over rather than passed, so a
module keyword never collides with one of checkpoint's own.

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
            return torch.utils.checkpoint.checkpoint(lambda *a: inner(*a, **kwargs), *args, use_reentrant=False)

        forward.__wrapped__ = inner            # type: ignore[attr-defined]
        return forward

    def _unwrap(self, key: int) -> None:
        self.wrapped.pop(key).remove()
        for p in reversed(self.in_parts.pop(key, [])):
            p.remove()
