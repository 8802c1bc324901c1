"""The backend: the one object the engine uses to allocate, advise, move and view memory.

:class:`Backend` is the interface. :class:`CudaBackend` implements it on real CUDA: per-role CuPy
memory pools over managed memory (cap-checked), cuda-bindings for advice and moves (``_cuda``),
and zero-copy views for torch and CuPy. Tests pass a fake backend with the same interface, so
policy, budget, accounting and error logic run on a CPU.

NOTE [size classes]
    The driver packs small managed allocations together, while allocations of 2 MiB multiples
    come back 2 MiB aligned (docs/facts.md, "API behaviour tiermem depends on"). Advice and
    migration work on whole pages, so a
    buffer that shares a page with another one is advised and moved with it. Requests of 2 MiB
    and more are therefore rounded up to 2 MiB multiples and served from a per-role pool that
    holds nothing else; they own their pages. Smaller requests share pages within a per-role
    small pool: their accounting is exact, their advice and residency follow their neighbours'.

NOTE [discard fence]
    cudaMemDiscardBatchAsync and cudaMemDiscardAndPrefetchBatchAsync are stream-ordered on paper,
    but a range that was copied out, discarded and refilled while other managed-memory work was
    still queued on the stream sometimes came back as zeros: the pinned copy was right, the
    refilled device pages were not (bench/probes/probe_stress.py, "bounce"; tests/test_gpu_stress.py
    found it). Draining the stream on the host before and after each discard removed every one
    of them; waiting only after the discard, or only after the refill, did not (docs/data-paths.md,
    "The data-loss bug (resolved)", has the rates, the runs and the driver). The driver documents
    that a discard racing any other access to the range is undefined; the drain makes sure none
    can. It costs little more than the discard itself: called on an idle stream, the discard
    waits for all work on the device anyway, and takes host time in the driver (docs/data-paths.md,
    "Why copy plus discard stopped at ~0.78"). The host waits by cudaStreamSynchronize, which spins
    under CUDA's default scheduling: a blocking-sync event wakes later (same section). Since
    tiermem's stream first waits for the caller's stream, the drain also waits for compute the
    caller queued before the eviction.
    tiermem moves managed memory on two streams, one per direction (UM_STREAMS in core/sidestreams.py); the
    Tier drains the other one too before each discard (``SideStreams.quiesce``), so no move of tiermem's
    runs on any stream around it.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from ..base.limits import CapGuard, resolve_cap
from ..errors import (
    CapExceededError,
    ConfigError,
    CUDAError,
    CUDAOutOfMemoryError,
    CUDAUnavailableError,
    TierMemError,
    ViewError,
)
from ..roles import Advice, Location
from . import runtime as _cuda
from .capture import CaptureEpochs
from .runtime import Capabilities, RangeInfo

__all__ = ["Backend", "Block", "HostBlock", "CudaBackend", "LARGE", "round_request", "FAULTABLE", "FaultInjector",
           "inject_faults"]

LARGE = 2 << 20      # see NOTE [size classes]
SMALL_ALIGN = 512    # CuPy's own rounding
PAGE = 4096
HOST_REGISTER_MIN = 64 << 20   # pinned blocks from this size are made by registration
HOST_THREADS = min(8, os.cpu_count() or 1)


def round_request(nbytes: int) -> tuple[int, str]:
    """(bytes to ask the pool for, size class) for a request of ``nbytes``."""
    n = max(int(nbytes), 1)
    if n >= LARGE:
        return -(-n // LARGE) * LARGE, "large"
    return -(-n // SMALL_ALIGN) * SMALL_ALIGN, "small"


class Block:
    """A managed allocation from a backend pool, or a slice of one (a group's member).
    ``release()`` returns it to the pool; idempotent. ``alloc`` names the underlying allocation:
    one CUDA call may span adjacent slices of one allocation, never two allocations."""

    __slots__ = ("ptr", "nbytes", "pool_key", "_handle", "alloc")

    def __init__(self, ptr: int, nbytes: int, pool_key: str, handle: Any, alloc: int | None = None):
        self.ptr, self.nbytes, self.pool_key, self._handle = ptr, nbytes, pool_key, handle
        self.alloc = ptr if alloc is None else alloc

    def release(self) -> None:
        self._handle = None


class HostBlock(Block):
    """Page-locked host memory (a pinned shadow copy). ``release()`` returns it to the pool."""

    __slots__ = ()


class Backend(Protocol):
    """What the engine needs from a device. Streams are ints; events are opaque."""

    device: int
    guard: CapGuard
    kind: str                                  # "cuda", or a test backend's name

    def capabilities(self) -> Capabilities: ...
    def mem_info(self) -> tuple[int, int]: ...
    def allocate(self, nbytes: int, pool_key: str) -> Block: ...
    def release_cached(self) -> int: ...
    def pool_bytes(self) -> dict[str, int]: ...
    def host_alloc(self, nbytes: int, pooled: bool = True, fill: Callable[[int], None] | None = None) -> HostBlock: ...
    def device_alloc(self, nbytes: int, pooled: bool = True) -> Block: ...
    def advise(self, ptr: int, nbytes: int, advice: Advice) -> None: ...
    def prefetch(self, ranges: Sequence[tuple[int, int]], location: Location, stream: int) -> None: ...
    def discard(self, ranges: Sequence[tuple[int, int]], stream: int) -> None: ...
    def discard_and_prefetch(self, ranges: Sequence[tuple[int, int]], location: Location, stream: int) -> None: ...
    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...
    def enable_peer(self, peer: int) -> bool: ...
    def range_info(self, ptr: int, nbytes: int) -> RangeInfo: ...
    def pointer_kind(self, ptr: int) -> str: ...
    def current_stream(self) -> int: ...
    def new_stream(self) -> int: ...
    def destroy_stream(self, stream: int) -> None: ...
    def new_event(self, timing: bool = False) -> Any: ...
    def record(self, event: Any, stream: int) -> None: ...
    def wait(self, stream: int, event: Any) -> None: ...
    def query(self, event: Any) -> bool: ...
    def synchronize(self, event: Any) -> None: ...
    def elapsed_ms(self, start: Any, end: Any) -> float: ...
    def torch_view(self, ptr: int, nbytes: int, token: Any) -> Any: ...
    def host_view(self, ptr: int, nbytes: int, token: Any) -> Any: ...
    def torch_stream(self, stream: int) -> Any: ...
    def cupy_view(self, ptr: int, nbytes: int, token: Any) -> Any: ...
    def dlpack_device(self) -> tuple[int, int]: ...
    # A "cuda" backend also captures: ``capturing()``, ``join_capture(into)``, ``replayed(stream)``
    # (NOTE [events across a capture] in cuda/capture.py); the training handle asks only that kind.


class _RawLease:
    """Owns one raw managed allocation for a CuPy pool; gives its bytes back to the cap when the
    pool drops it. Runs inside CuPy's deallocation path, so it must never raise."""

    __slots__ = ("mem", "nbytes", "guard")

    def __init__(self, mem: Any, nbytes: int, guard: CapGuard):
        self.mem, self.nbytes, self.guard = mem, nbytes, guard

    def __del__(self) -> None:
        try:
            self.guard.release(self.nbytes)
        except Exception:  # pragma: no cover - nothing may escape a destructor
            pass


class _ArrayInterface:
    """What torch.as_tensor reads to view device memory zero-copy. torch keeps this object (and
    so ``token``) alive for as long as the storage lives; that is how tiermem sees live views."""

    def __init__(self, ptr: int, nbytes: int, token: Any):
        self.token = token
        # No "stream" key: the consumer must not synchronise on our behalf (CAI v3).
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


class CudaBackend:
    """The real backend: managed memory through per-role CuPy pools, moves through cuda-bindings.

    Thread-safe: CuPy pools lock internally and the pool table is guarded by a lock.
    """

    kind = "cuda"

    def __init__(self, device: int | None = None, *, cap: int | str | None = None, allow_oversubscribe: bool | None = None):
        ok, why = _cuda.available()
        if not ok:
            raise CUDAUnavailableError(f"tiermem needs a CUDA GPU: {why}")
        try:
            import cupy
        except ImportError as e:
            raise CUDAUnavailableError("CuPy is not installed; pip install 'tiermem[cu13]'") from e
        self._cupy = cupy
        self.device = _cuda.current_device() if device is None else int(device)
        self._caps = _cuda.capabilities(self.device)
        free, total = _cuda.mem_get_info(self.device)
        limit, allow = resolve_cap(cap, allow_oversubscribe, free=free, total=total)
        self.guard = CapGuard(limit, allow)
        self._pools: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._pinned = cupy.cuda.PinnedMemoryPool()
        self.epochs = CaptureEpochs()       # NOTE [events across a capture] in cuda/capture.py
        self._external: dict[int, Any] = {}  # stream handle -> its torch.cuda.ExternalStream

    # -- memory ---------------------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        return self._caps

    def mem_info(self) -> tuple[int, int]:
        return _cuda.mem_get_info(self.device)

    def _upstream(self, size: int) -> Any:
        cupy = self._cupy
        try:
            self.guard.reserve(size)
        except CapExceededError as e:
            # CuPy's pool answers OutOfMemoryError by freeing its cached blocks and trying again.
            raise cupy.cuda.memory.OutOfMemoryError(size, self.guard.reserved, self.guard.limit) from e
        try:
            raw = _cuda.managed_alloc(size, self.device)
        except BaseException:
            self.guard.release(size)
            raise
        lease = _RawLease(raw, size, self.guard)
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(raw.ptr, size, lease, self.device), 0)

    def _pool(self, key: str) -> Any:
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = self._cupy.cuda.MemoryPool(self._upstream)
            return pool

    def allocate(self, nbytes: int, pool_key: str) -> Block:
        cupy = self._cupy
        pool = self._pool(pool_key)
        with cupy.cuda.Device(self.device):
            try:
                mp = pool.malloc(nbytes)
            except cupy.cuda.memory.OutOfMemoryError:
                # The cap is shared by all pools: other roles' caches may hold the bytes we need.
                self.release_cached()
                try:
                    mp = pool.malloc(nbytes)
                except cupy.cuda.memory.OutOfMemoryError:
                    if not self.guard.fits(nbytes):
                        raise self.guard.error(nbytes) from None
                    raise  # the driver itself is out of memory: CuPy's error says so
        return Block(mp.ptr, nbytes, pool_key, mp)

    def release_cached(self) -> int:
        """Free every pool's cached blocks, the pinned pool's too; returns the managed bytes given
        back to the driver."""
        before = self.guard.reserved
        with self._lock:
            pools = list(self._pools.values())
        for p in pools:
            p.free_all_blocks()
        self._pinned.free_all_blocks()   # pinned homes are large: host memory goes back too
        return before - self.guard.reserved

    def pool_bytes(self) -> dict[str, int]:
        with self._lock:
            pools = dict(self._pools)
        used = sum(p.used_bytes() for p in pools.values())
        total = sum(p.total_bytes() for p in pools.values())
        return {"used": used, "cached": total - used, "reserved": total}

    def host_alloc(self, nbytes: int, pooled: bool = True, fill: Callable[[int], None] | None = None) -> HostBlock:
        """Pinned host memory from CuPy's pinned pool, which keeps it for reuse when released; or,
        with ``pooled=False``, for memory that lives long (a module's or a training's home), a
        large block made by registration, ~8x faster to get than from cudaHostAlloc and given
        back to the host when released (NOTE [pinned by registration]). ``fill(ptr)`` writes the
        block's bytes (host writes only) before it is returned: for a block made by registration,
        before it is pinned (NOTE [filled before pinning]). Bytes it leaves alone are unspecified.
        What ``fill`` raises comes out, with the block given back."""
        if not pooled and nbytes >= HOST_REGISTER_MIN:
            with self._cupy.cuda.Device(self.device):
                reg = _cuda.host_register(nbytes, threads=HOST_THREADS, fill=fill)
            if reg is not None:
                return HostBlock(reg.ptr, nbytes, "pinned", reg)
        mp = self._pinned.malloc(nbytes)
        block = HostBlock(mp.ptr, nbytes, "pinned", mp)
        if fill is not None:
            try:
                fill(block.ptr)
            except BaseException:
                block.release()
                raise
        return block

    def device_alloc(self, nbytes: int, pooled: bool = True) -> Block:
        """Plain device memory: copies from pinned memory into it run at the full link rate, ~9%
        faster than into managed pages (docs/facts.md). From CuPy's default pool, or with
        ``pooled=False`` straight from the driver, to which ``release()`` then gives it back
        (cudaFree waits for the device's queued work). Raises MemoryError when the device is full."""
        if not pooled:
            mem = _cuda.device_malloc(nbytes, self.device)   # freed when the block lets go of it
            return Block(mem.ptr, nbytes, "device", mem)
        with self._cupy.cuda.Device(self.device):
            mp = self._cupy.cuda.alloc(nbytes)
        return Block(mp.ptr, nbytes, "device", mp)

    # -- advice and moves -----------------------------------------------------------------------
    def advise(self, ptr: int, nbytes: int, advice: Advice) -> None:
        _cuda.advise(ptr, nbytes, advice.kind, advice.set, advice.location, self.device)

    def prefetch(self, ranges: Sequence[tuple[int, int]], location: Location, stream: int) -> None:
        # The batched call refuses ranges that are not whole pages (cudaErrorInvalidValue, with
        # small buffers: docs/facts.md); those go one call each, as does a batch of one.
        whole = [(p, n) for p, n in ranges if p % PAGE == 0 and n % PAGE == 0]
        single = [(p, n) for p, n in ranges if p % PAGE or n % PAGE]
        if len(whole) > 1 and self._caps.supports("batch_prefetch"):
            _cuda.prefetch_batch([p for p, _ in whole], [n for _, n in whole], location, self.device, stream)
        else:
            single += whole
        for ptr, n in single:
            _cuda.prefetch(ptr, n, location, self.device, stream)

    def discard(self, ranges: Sequence[tuple[int, int]], stream: int) -> None:
        # NOTE [discard fence]: the host drains the stream before and after every discard.
        _cuda.stream_synchronize(stream)
        _cuda.discard_batch([p for p, _ in ranges], [n for _, n in ranges], stream)
        _cuda.stream_synchronize(stream)

    def discard_and_prefetch(self, ranges: Sequence[tuple[int, int]], location: Location, stream: int) -> None:
        _cuda.stream_synchronize(stream)
        _cuda.discard_and_prefetch_batch([p for p, _ in ranges], [n for _, n in ranges], location, self.device, stream)
        _cuda.stream_synchronize(stream)

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        if self.epochs.now and not _cuda.stream_is_capturing(stream):
            # It would run now, once, instead of in every replay: fail the capture instead.
            raise TierMemError("a copy was queued on a stream outside the running capture")
        _cuda.memcpy_async(dst, src, nbytes, stream)

    def enable_peer(self, peer: int) -> bool:
        """Copies on this device's streams reach device ``peer``'s memory directly; False where
        the two cannot (NOTE [two links into one GPU] in inference/multidevice.py)."""
        return _cuda.enable_peer_access(self.device, peer)

    def range_info(self, ptr: int, nbytes: int) -> RangeInfo:
        return _cuda.range_info(ptr, nbytes)

    def pointer_kind(self, ptr: int) -> str:
        return _cuda.pointer_kind(ptr)

    # -- streams and events ---------------------------------------------------------------------
    def current_stream(self) -> int:
        """torch's current stream once torch has started CUDA, else CuPy's current stream."""
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return int(torch.cuda.current_stream(self.device).cuda_stream)
        return int(self._cupy.cuda.get_current_stream(self.device).ptr)

    def new_stream(self) -> int:
        return _cuda.stream_create(self.device)

    def destroy_stream(self, stream: int) -> None:
        self._external.pop(stream, None)
        _cuda.stream_destroy(stream)

    def new_event(self, timing: bool = False) -> Any:
        return _cuda.event_create(timing, self.device)

    # Until a first capture (NOTE [events across a capture]) every event is itself: the calls
    # below take the direct path, as the eager steps' thousands of waits a step did before.
    def _device_of(self, stream: int) -> Any:
        """Where a call on ``stream`` must run. NOTE [the null stream is the current device's]:
        handle 0, torch's default stream on every GPU, names the *current* device's legacy
        stream, so a Tier on another GPU than the caller's records and waits on it with its own
        device current (an event of GPU 1 recorded on GPU 0's null stream is
        cudaErrorInvalidResourceHandle). Any other handle names its own device."""
        return _cuda.on_device(self.device) if stream == 0 and self.device != 0 else contextlib.nullcontext()

    def record(self, event: Any, stream: int) -> None:
        with self._device_of(stream):
            _cuda.event_record(event, stream)
        if self.epochs.count:
            self.epochs.stamp(event)
            if self.epochs.now:
                self.epochs.streams.add(stream)

    def wait(self, stream: int, event: Any) -> None:
        if not self.epochs.count:
            with self._device_of(stream):
                _cuda.stream_wait_event(stream, event)
            return
        how, ev = self.epochs.resolve(event)
        if how == "present":
            ev = _cuda.event_create(False, self.device)
            cur = self.current_stream()
            with self._device_of(cur):
                _cuda.event_record(ev, cur)
            self.epochs.stamp(ev)
        if ev is not None:
            with self._device_of(stream):
                _cuda.stream_wait_event(stream, ev)
            if self.epochs.now:
                self.epochs.streams.add(stream)

    def query(self, event: Any) -> bool:
        if not self.epochs.count:
            return _cuda.event_query(event)
        how, ev = self.epochs.resolve(event)
        if self.epochs.now:         # the host cannot wait for captured work: the GPU does
            if how == "use":
                _cuda.stream_wait_event(self.current_stream(), ev)
            return True
        return how == "done" or _cuda.event_query(ev)

    def synchronize(self, event: Any) -> None:
        if not self.epochs.count:
            _cuda.event_synchronize(event)
            return
        how, ev = self.epochs.resolve(event)
        if how != "use":
            return
        if self.epochs.now:
            _cuda.stream_wait_event(self.current_stream(), ev)
        else:
            _cuda.event_synchronize(ev)

    def elapsed_ms(self, start: Any, end: Any) -> float:
        if getattr(start, "capture", 0) or getattr(end, "capture", 0):
            raise TierMemError("a captured step's events have no times to read (NOTE [events across a capture])")
        return _cuda.event_elapsed_ms(start, end)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """The calls inside are being captured into a CUDA graph (NOTE [events across a capture]):
        events resolve for it, and a copy on a stream outside the capture is refused."""
        self.epochs.begin()
        try:
            yield
        finally:
            self.epochs.end()

    def join_capture(self, into: int) -> None:
        """Bring the captured work of every stream the capture used back into the capturing
        stream ``into``: a capture cannot end while another stream has work queued in it that
        ``into`` does not wait for (a copy queued ahead and never waited on, say)."""
        for s in sorted(self.epochs.streams):
            if s != into and _cuda.stream_is_capturing(s):
                ev = _cuda.event_create(False, self.device)
                _cuda.event_record(ev, s)
                self.epochs.stamp(ev)               # recorded in the capture: never pooled (NOTE [pooled events])
                _cuda.stream_wait_event(into, ev)

    def replayed(self, stream: int) -> None:
        """A captured graph was just launched on ``stream``: events recorded in captures stand
        for this launch's end from now on."""
        ev = _cuda.event_create(False, self.device)
        _cuda.event_record(ev, stream)
        self.epochs.after_replay = ev

    def torch_stream(self, stream: int) -> Any:
        """A context manager in which ``stream`` (a handle of :meth:`new_stream`) is torch's
        current stream: torch ops queued inside run there (a dequantization, NOTE [ordered
        copies] in core/stream.py). Thread-local, as torch's current stream is."""
        import torch
        ext = self._external.get(stream)
        if ext is None:
            ext = self._external[stream] = torch.cuda.ExternalStream(stream, device=f"cuda:{self.device}")
        return torch.cuda.stream(ext)

    # -- views ------------------------------------------------------------------------------------
    def torch_view(self, ptr: int, nbytes: int, token: Any) -> Any:
        try:
            import torch
        except ImportError as e:
            raise ViewError("torch is not installed; pip install 'tiermem[torch]'") from e
        return torch.as_tensor(_ArrayInterface(ptr, nbytes, token), device=f"cuda:{self.device}")

    def host_view(self, ptr: int, nbytes: int, token: Any) -> Any:
        """A CPU torch tensor of ``nbytes`` uint8 over pinned host memory at ``ptr`` (a
        :meth:`host_alloc` block's): the host's own reads and writes of it, a CPU optimizer's
        step (NOTE [host stepping] in training/hoststep.py). It keeps ``token`` alive."""
        import ctypes

        import torch
        if nbytes <= 0:
            return torch.empty(0, dtype=torch.uint8)
        buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
        buf.token = token                       # the tensor holds the buffer, the buffer the memory's owner
        return torch.frombuffer(buf, dtype=torch.uint8)

    def cupy_view(self, ptr: int, nbytes: int, token: Any) -> Any:
        cupy = self._cupy
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, token, self.device)
        return cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))

    def dlpack_device(self) -> tuple[int, int]:
        return (2, self.device)  # kDLCUDA: what torch accepts (NOTE [dlpack] in core/tensor.py)


# -- failure injection, for tests and the soak (NOTE [failure injection]) ------------------------

# NOTE [failure injection]
# Every backend method that stands for a CUDA call that can fail is in ``FAULTABLE``. A
# :class:`FaultInjector` counts calls to them and fails the n-th once: with tiermem's CUDAError
# carrying a real CUDA error name (cudaErrorLaunchFailure), an out-of-memory error, or a
# KeyboardInterrupt (Ctrl-C arriving while the call runs). The failure is raised as the call
# starts, before it has any effect. tests/fakes.py's FakeBackend has one built in;
# ``inject_faults(injector)`` puts one in front of every CudaBackend method until
# ``inject_faults(None)``. The hook replaces the class's methods only while it is set, so
# it costs nothing when off. Not thread-safe: set it while no other thread uses a backend.

FAULTABLE = ("allocate", "host_alloc", "device_alloc", "advise", "prefetch", "discard", "discard_and_prefetch",
             "copy", "range_info", "new_stream", "new_event", "record", "wait", "query", "synchronize",
             "elapsed_ms", "torch_view")


class FaultInjector:
    """Fails the n-th faultable backend call from ``fail_at`` on, once (NOTE [failure injection]).

    ``kind`` is "cuda" (CUDAError, cudaErrorLaunchFailure), "oom" (CUDAOutOfMemoryError,
    cudaErrorMemoryAllocation) or "interrupt" (KeyboardInterrupt). ``calls`` counts every
    faultable call seen; ``seen``, while a list, records their names; ``fired`` is (n, call,
    kind) of the last failure raised, ``injected`` how many were raised in all."""

    KINDS = ("cuda", "oom", "interrupt")

    def __init__(self) -> None:
        self.calls = 0
        self.injected = 0
        self.fired: tuple[int, str, str] | None = None
        self.seen: list[str] | None = None
        self.thread: str | None = None      # count (and fail) only calls made on this thread
        self._left: int | None = None
        self._n = 0
        self._kind = "cuda"
        self._lock = threading.Lock()        # the disk tier's reader thread calls too

    @property
    def armed(self) -> bool:
        return self._left is not None

    def fail_at(self, n: int, kind: str = "cuda", thread: str | None = None) -> None:
        """Fail the ``n``-th faultable call from now; with ``thread``, the n-th made on the thread
        of that name (the disk tier's reader is "tiermem-disk", the caller's thread "MainThread"),
        so that a sweep over one thread's calls does not depend on how threads interleave."""
        if n < 1 or kind not in self.KINDS:
            raise ConfigError(f"fail_at(n >= 1, kind in {self.KINDS}), got ({n}, {kind!r})")
        with self._lock:
            self._left, self._n, self._kind, self.fired, self.thread = n, n, kind, None, thread

    def disarm(self) -> None:
        with self._lock:
            self._left, self.thread = None, None

    def __call__(self, call: str) -> None:
        with self._lock:
            self.calls += 1
            if self.thread is not None and threading.current_thread().name != self.thread:
                return
            if self.seen is not None:
                self.seen.append(call)
            if self._left is None:
                return
            self._left -= 1
            if self._left > 0:
                return
            self._left = None
            self.fired = (self._n, call, self._kind)
            self.injected += 1
        if self._kind == "interrupt":
            raise KeyboardInterrupt(f"injected at {call}")
        if self._kind == "oom":
            raise CUDAOutOfMemoryError(call, 2, "cudaErrorMemoryAllocation")
        raise CUDAError(call, 719, "cudaErrorLaunchFailure")


def faultable(name: str, method: Any, hook: Any) -> Any:
    """``method`` with ``hook(name)`` called first (the hook raises to fail the call)."""
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        hook(name)
        return method(self, *args, **kwargs)
    call.__name__ = call.__qualname__ = name
    call.__doc__ = method.__doc__
    return call


_PLAIN = {name: getattr(CudaBackend, name) for name in FAULTABLE}


def inject_faults(hook: Any) -> None:
    """Call ``hook(name)`` (a :class:`FaultInjector`, or any callable that may raise) before every
    faultable method of every CudaBackend; None takes it away again (NOTE [failure injection])."""
    for name, method in _PLAIN.items():
        setattr(CudaBackend, name, method if hook is None else faultable(name, method, hook))
