"""CuPy arrays in tiered memory: the role the allocator gives new arrays (:func:`using_role`,
:func:`current_role`), and the handle :func:`tiermem.use` returns (:class:`ArrayUse`). The
allocator itself is :func:`tiermem.allocator`."""
from .cupy.allocator import current_role, using_role
from .cupy.scoped import ArrayUse

__all__ = ["using_role", "current_role", "ArrayUse"]
