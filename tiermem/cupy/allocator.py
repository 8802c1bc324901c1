"""CuPy integration: a drop-in allocator serving tiered managed memory, and a role scope.

    import cupy, tiermem
    cupy.cuda.set_allocator(tiermem.allocator())            # every CuPy array is tiered
    with tiermem.arrays.using_role("activation"):                   # ... and counted under a role
        x = cupy.empty(1 << 20)
    with cupy.cuda.using_allocator(tiermem.allocator("input")):
        batch = cupy.asarray(host_batch)                     # thread-local, CuPy's own scope
    with tiermem.use(x):                                     # brought in at link rate (cupy/scoped.py)
        x *= 2
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..roles import Role, as_role

if TYPE_CHECKING:
    from ..core.engine import Engine as Tier  # what an adapter uses is the engine's interface

__all__ = ["make_allocator", "using_role", "current_role"]

_scope = threading.local()


@contextlib.contextmanager
def using_role(role: Role | str) -> Iterator[Role]:
    """Within the block, in this thread, arrays from a tiermem allocator made without a fixed role
    are counted under ``role``. Thread-local; nests (the previous role comes back on exit)."""
    r = as_role(role)
    prev = getattr(_scope, "role", None)
    _scope.role = r
    try:
        yield r
    finally:
        _scope.role = prev


def current_role() -> Role | None:
    """The role set by the innermost :func:`using_role` in this thread, or None."""
    return getattr(_scope, "role", None)


def make_allocator(tier: Tier, role: Role | str | None = None) -> Any:
    from .scoped import residency
    fixed = None if role is None else as_role(role)
    state = residency(tier)

    def tiermem_malloc(nbytes: int) -> Any:
        """size in bytes -> cupy.cuda.MemoryPointer on tiered managed memory."""
        import cupy
        r = fixed or current_role() or Role.WORKSPACE
        # Placed within the budget; a budget check when it would not fit (NOTE [allocator arrays
        # in place] in cupy/scoped.py).
        buf, token = state.new_array(nbytes, r)
        # The array's memory object owns a foreign token, which owns the buffer: the buffer and
        # its accounting live exactly as long as the array (NOTE [views and the fast paths]).
        mem = cupy.cuda.UnownedMemory(buf.ptr, nbytes, token, tier.device)
        return cupy.cuda.MemoryPointer(mem, 0)

    tiermem_malloc.tier = tier          # type: ignore[attr-defined]
    tiermem_malloc.role = fixed         # type: ignore[attr-defined]
    return tiermem_malloc
