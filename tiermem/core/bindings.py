"""Bindings: the torch tensors tiermem bound to a buffer (a wrapped parameter's ``.data``) follow
its data between the managed range and the pinned shadow (NOTE [views and the fast paths] in
core/tensor.py)."""
from __future__ import annotations

import weakref
from typing import Any

from .tensor import Buffer

__all__ = ["rebind", "detach_for_discard"]


def rebind(backend: Any, b: Buffer, shadow: bool) -> None:
    """Point every tensor tiermem bound to ``b`` at the managed range or at the shadow."""
    live = [t for t in (r() for r in b.bindings) if t is not None]
    b.bindings = [weakref.ref(t) for t in live]
    if not live:
        return
    ptr = b.shadow.ptr if shadow else b.ptr
    raw = backend.torch_view(ptr, b.nbytes, b.token(internal=True, shadow=shadow))
    base = raw.view(live[0].dtype).view(live[0].shape)
    for t in live:
        t.data = base


def detach_for_discard(backend: Any, b: Buffer) -> bool:
    """Re-point ``b``'s bindings at its shadow; True if nothing else still refers to the
    managed range, so it may be discarded (NOTE [views and the fast paths])."""
    if not b.tokens:      # no view of any kind: nothing else can point at the range
        rebind(backend, b, shadow=True)
        return True
    if b.foreign_views():
        return False
    old = [weakref.ref(t) for t in list(b.tokens) if not t.shadow]
    rebind(backend, b, shadow=True)
    if any(r() is not None for r in old):
        rebind(backend, b, shadow=False)
        return False
    return True
