"""TieredTensor: a managed buffer with a role, a shape, a dtype and a place.

NOTE [views and the fast paths]
    A view (``.torch()``, ``.cupy()``, DLPack) points at the buffer's managed range. Each view's
    storage keeps a small token object alive (torch and CuPy hold the object that describes the
    memory until the storage dies), so tiermem knows at any moment whether views exist and whether
    tiermem made them. Tensors that tiermem rebinds itself (a wrapped parameter's ``.data``) hold
    "internal" tokens; everything else is "foreign".

    Unified Memory alone writes device pages back to the host at a fraction of the link's rate.
    tiermem's fast eviction copies them to a pinned shadow at link rate and then discards the
    managed range (NOTE [eviction paths] in core/moves.py), so the data lives at another address
    until it is brought back. That is only safe when tiermem can re-point every tensor that refers to the range; so the
    fast path runs only when no foreign view is alive and, after re-pointing, no other reference to
    the old storage remains (an autograd graph that saved the tensor, a ``.detach()`` kept by the
    user). Otherwise the eviction goes through Unified Memory, which is slower but keeps every
    pointer valid. A view asked for while the data sits in the shadow first brings it back.
    Under a budget the range keeps its device pages meanwhile, and a refill may trade ranges with
    another shadowed buffer (NOTE [parked pages] in core/parking.py); the same rules make that safe.

NOTE [dlpack]
    A managed CuPy array exports DLPack device type 13 (kDLCUDAManaged), which torch.from_dlpack
    rejects. tiermem exports through a torch view of the range instead, as kDLCUDA: managed memory
    is device-accessible, and the consumer only reads it from the device. The exported capsule
    holds the torch view, which holds the buffer: the memory lives until the consumer lets go.
"""
from __future__ import annotations

import logging
import math
import weakref
from typing import TYPE_CHECKING, Any, Protocol

from ..base import dtypes as _dtypes
from ..cuda.backend import LARGE
from ..errors import ConfigTypeError, TierMemError, ViewError
from ..roles import Location, Policy, Role

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ..cuda.backend import Block, HostBlock
    from .transfer import Transfer

__all__ = ["TieredTensor", "tiered_list"]

log = logging.getLogger("tiermem")


class Tier(Protocol):
    """What a buffer and its tensors need of the tier that made them (the Engine): named here
    rather than imported, so imports point one way, from the engine down to its tensors."""

    backend: Any

    def materialize(self, b: Buffer, writable: bool = True) -> None: ...
    def prefetch(self, tensors: Any, to: Any = ..., *, stream: Any = None, non_blocking: bool = False) -> Transfer: ...
    def evict(self, tensors: Any, *, stream: Any = None, non_blocking: bool = False) -> Transfer: ...
    def change_policy(self, buf: Buffer, policy: Policy | None, changes: Mapping[str, Any]) -> Policy: ...
    def release_buffer(self, buf: Buffer) -> None: ...
    def buffer_gone(self, buf: Buffer) -> None: ...


class ViewToken:
    """Kept alive by a view's storage; keeps the buffer alive. See NOTE [views and the fast paths]."""

    __slots__ = ("buffer", "internal", "shadow", "__weakref__")

    def __init__(self, buffer: Buffer, internal: bool, shadow: bool):
        self.buffer, self.internal, self.shadow = buffer, internal, shadow


class Buffer:
    """A managed allocation and where tiermem placed it. Owned by TieredTensors and view tokens;
    when the last owner goes, its memory returns to the pool and its bytes leave the accounting."""

    def __init__(self, tier: Tier, block: Block, nbytes: int, role: Role, policy: Policy, name: str | None):
        self.tier = tier
        self.block = block
        self.ptr = block.ptr
        self.nbytes = nbytes
        self.span = block.nbytes           # device bytes it occupies when resident (whole pages)
        self.role = role
        self.policy = policy
        self.name = name
        self.where: Location | None = None  # where tiermem last placed it; None: nowhere yet
        self.shadow: HostBlock | None = None
        self.shadow_valid = False           # the pinned shadow holds the current data
        self.in_shadow = False              # the data lives in the shadow, not the managed range
        self.parked = False                 # in the shadow, but the range's device pages are kept
                                            # for the next refill (NOTE [parked pages] in core/parking.py)
        self.host_valid = False             # a read-mostly host copy in the managed range is current
        self.read_mostly_while_resident = False   # lent read-mostly by a read-only scope: its
                                            # collapse unsets it (NOTE [read-only scopes], cupy/scoped.py)
        self.fence: Any = None              # event after the last scope that used it; a collapse
                                            # waits for it (NOTE [collapse fence] in cupy/scoped.py)
        self.tokens: weakref.WeakSet[ViewToken] = weakref.WeakSet()
        self.bindings: list[weakref.ref] = []
        self.last_use = 0
        self.pending: Transfer | None = None
        self.freed = False
        self.gone = False                   # its memory went back (NOTE [finalizer race] in core/placement.py)

    @property
    def owns_pages(self) -> bool:
        """True when the buffer covers whole 2 MiB pages that nothing else uses, so its pages may
        be discarded (NOTE [size classes] in cuda/backend.py). The driver maps device memory in 2 MiB
        pages; a discard of part of one could take a neighbour's data with it."""
        return self.block.pool_key.endswith("/large") and self.ptr % LARGE == 0 and self.span % LARGE == 0

    def token(self, internal: bool, shadow: bool = False) -> ViewToken:
        t = ViewToken(self, internal, shadow)
        self.tokens.add(t)
        return t

    def foreign_views(self) -> int:
        if not self.tokens:   # the common case, and iterating a WeakSet is slow
            return 0
        return sum(1 for t in list(self.tokens) if not t.internal)

    def __del__(self) -> None:
        # Runs from the garbage collector: must never raise (STYLE: destructors log, not raise).
        try:
            self.tier.buffer_gone(self)
        except Exception:  # pragma: no cover
            log.exception("tiermem: error while freeing a buffer")


class TieredTensor:
    """A tensor in managed memory that tiermem places on the device or the host by its role.

    Thread-safety: placement calls (prefetch, evict, advise, free) lock the tier and may be made
    from any thread; views are independent objects.
    """

    def __init__(self, buffer: Buffer, shape: tuple[int, ...], dtype: str):
        self._buf: Buffer | None = buffer
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype

    # -- description --------------------------------------------------------------------------
    @property
    def _b(self) -> Buffer:
        if self._buf is None:
            raise TierMemError("this TieredTensor was freed")
        return self._buf

    @property
    def buffer(self) -> Buffer:
        """The internal buffer (for tiermem's adapters; raises :class:`TierMemError` once freed)."""
        return self._b

    @property
    def tier(self) -> Tier:
        return self._b.tier

    @property
    def role(self) -> Role:
        return self._b.role

    @property
    def policy(self) -> Policy:
        return self._b.policy

    @property
    def name(self) -> str | None:
        return self._b.name

    @property
    def nbytes(self) -> int:
        return self._b.nbytes

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def data_ptr(self) -> int:
        """Address of the managed range that holds the data on the device. Stable while a foreign
        view (``.torch()``, ``.cupy()``, DLPack) is alive; otherwise a refill may give the tensor
        the device pages another tensor left behind, at another address (NOTE [parked pages] in
        core/parking.py). tiermem re-points the tensors it bound itself (wrapped parameters)."""
        return self._b.ptr

    @property
    def location(self) -> Location | None:
        """Where tiermem last placed the data: Location.DEVICE, Location.HOST, or None if nowhere yet."""
        return self._b.where

    @property
    def is_resident(self) -> bool:
        return self._b.where is Location.DEVICE

    @property
    def in_shadow(self) -> bool:
        """True while the data lives in the pinned shadow copy (NOTE [views and the fast paths])."""
        return self._b.in_shadow

    @property
    def parked(self) -> bool:
        """True while evicted to the shadow with its device pages kept, under the budget, for the
        next refill (NOTE [parked pages] in core/parking.py)."""
        return self._b.parked

    @property
    def freed(self) -> bool:
        return self._buf is None

    def __repr__(self) -> str:
        if self._buf is None:
            return "<TieredTensor freed>"
        b = self._buf
        where = b.where.value if b.where else "unplaced"
        if b.in_shadow:
            where += " (shadow, pages parked)" if b.parked else " (shadow)"
        label = f" {b.name!r}" if b.name else ""
        return f"<TieredTensor{label} {self.dtype}{list(self.shape)} role={b.role.value} {where}>"

    # -- views --------------------------------------------------------------------------------
    def torch(self, *, writable: bool = True) -> Any:
        """A torch tensor on this memory, zero-copy: writes through it are seen through every view.

        While the view lives, tiermem moves this tensor only through Unified Memory, so the view
        never goes stale (NOTE [views and the fast paths]). A writable view may change the data,
        so tiermem stops trusting its clean host copies; pass ``writable=False`` to promise you
        only read, and a later eviction of a read-only tensor stays free.
        """
        buf = self._b
        self.tier.materialize(buf, writable)
        return self._typed(self.tier.backend.torch_view(buf.ptr, buf.nbytes, buf.token(internal=False)))

    def _typed(self, raw: Any) -> Any:
        """Reinterpret a uint8 torch view as this tensor's dtype and shape (no copy)."""
        return raw.view(_dtypes.to_torch(self.dtype)).view(self.shape)

    def cupy(self, *, writable: bool = True) -> Any:
        """A CuPy array on this memory, zero-copy. Same rules as :meth:`torch`."""
        buf = self._b
        np_dtype = _dtypes.to_numpy(self.dtype)
        self.tier.materialize(buf, writable)
        raw = self.tier.backend.cupy_view(buf.ptr, buf.nbytes, buf.token(internal=False))
        return raw.view(np_dtype).reshape(self.shape)

    def __dlpack__(self, **kwargs: Any) -> Any:
        """Export through a torch view (NOTE [dlpack]); without torch, through CuPy."""
        try:
            view = self.torch()
        except ViewError:
            return self.cupy().__dlpack__(**kwargs)
        return view.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        try:
            import torch  # noqa: F401
        except ImportError:
            return self.cupy().__dlpack_device__()
        return self.tier.backend.dlpack_device()

    # -- placement ----------------------------------------------------------------------------
    def prefetch(self, to: Location | str = Location.DEVICE, *, stream: Any = None, non_blocking: bool = False) -> Transfer:
        """Bring the data to ``to`` (see :meth:`Tier.prefetch`)."""
        return self.tier.prefetch([self], to=to, stream=stream, non_blocking=non_blocking)

    def evict(self, *, stream: Any = None, non_blocking: bool = False) -> Transfer:
        """Take the data off the device (see :meth:`Tier.evict`)."""
        return self.tier.evict([self], stream=stream, non_blocking=non_blocking)

    def advise(self, policy: Policy | None = None, **changes: Any) -> Policy:
        """Give this tensor its own policy (or change fields of its current one) and apply its
        advice now. Returns the policy now in force."""
        return self.tier.change_policy(self._b, policy, changes)

    def range_info(self) -> Any:
        """What CUDA reports for this range (preferred location, read-mostly, accessed-by, last
        prefetch location): a :class:`tiermem.handles.RangeInfo`."""
        return self.tier.backend.range_info(self._b.ptr, self._b.span if self._b.owns_pages else self._b.nbytes)

    def free(self) -> None:
        """Let go of the memory. Views still alive keep it until they go; then it returns to the pool."""
        buf, self._buf = self._buf, None
        if buf is not None:
            buf.tier.release_buffer(buf)


def tiered_list(tensors: Any, call: str, also: tuple[type, ...] = ()) -> list[Any]:
    """``tensors``, one TieredTensor or an iterable of them, as a list; anything else raises
    :class:`ConfigTypeError` naming ``call`` and what it got (``also``: other types let through,
    the engine's own Buffers). Needs no Tier, so the module-level prefetch and evict check their
    argument before they look for one."""
    kinds = (TieredTensor, *also)
    if isinstance(tensors, kinds):
        return [tensors]
    # A string is iterable, and so is a torch tensor (over its rows): neither is what is meant.
    if isinstance(tensors, (str, bytes)) or not hasattr(tensors, "__iter__") or hasattr(tensors, "__dlpack__"):
        raise ConfigTypeError(f"{call} takes a TieredTensor or an iterable of them, got {_kind(tensors)}")
    out = list(tensors)
    for t in out:
        if not isinstance(t, kinds):
            raise ConfigTypeError(f"{call} takes TieredTensors, got {_kind(t)} among them")
    return out


def _kind(x: Any) -> str:
    text = repr(x)
    return f"{type(x).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
