"""Every raw CUDA call tiermem makes, through cuda-bindings (and CuPy for the managed allocation).

Each wrapper checks the returned status and raises :class:`CUDAError` with the call, the numeric
status and the CUDA error name. Nothing else in tiermem talks to CUDA: the engine goes through a
backend object (``_backend.CudaBackend``), which goes through here.

Why cuda-bindings and not CuPy's runtime module: CuPy built for CUDA 13 turns every location into
a device, so it cannot advise or prefetch to the host (docs/facts.md). Locations here are real
``cudaMemLocation`` values of type Host or Device.

Streams are plain integers (a ``cudaStream_t`` value), so torch's and CuPy's streams can be passed
in as they are. Events are the cuda-bindings objects.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..base import hostpages as _hostpages
from ..errors import ConfigError, CUDAError, CUDAOutOfMemoryError, CUDAUnavailableError
from ..roles import Location

__all__ = ["Capabilities", "RangeInfo", "capabilities", "available"]

_rt: Any = None
_lock = threading.Lock()


def _runtime() -> Any:
    global _rt
    if _rt is None:
        try:
            from cuda.bindings import runtime
        except ImportError as e:
            raise CUDAUnavailableError(
                "cuda-bindings is not installed; install tiermem with the extra for your CUDA major "
                "version, e.g. pip install 'tiermem[cu13]'") from e
        _rt = runtime
    return _rt


def _name(err: Any) -> str:
    return getattr(err, "name", None) or str(err)


def _check(call: str, result: Any) -> Any:
    """Raise on a failed status; return the call's value(s) without the status."""
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise CUDAError(call, int(err), _name(err))
    if not isinstance(result, tuple) or len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def _loc(location: Location, device: int) -> Any:
    rt = _runtime()
    loc = rt.cudaMemLocation()
    if location is Location.HOST:
        loc.type = rt.cudaMemLocationType.cudaMemLocationTypeHost
        loc.id = 0
    else:
        loc.type = rt.cudaMemLocationType.cudaMemLocationTypeDevice
        loc.id = device
    return loc


# ---------------------------------------------------------------------------------------------
# Devices

@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What one device offers for managed memory. Built once per device and cached."""

    device: int
    name: str
    total_memory: int
    compute_capability: tuple[int, int]
    managed_memory: bool
    concurrent_managed_access: bool
    pageable_memory_access: bool
    direct_managed_mem_access_from_host: bool
    host_native_atomic_supported: bool
    driver_version: int
    runtime_version: int
    batch_memory_ops: bool  # cudaMemPrefetchBatchAsync / cudaMemDiscard*BatchAsync (CUDA 13 driver)

    def supports(self, feature: str) -> bool:
        """Whether the device takes ``feature``: advise, prefetch, batch_prefetch or discard.

        Advice and prefetch to a GPU need concurrent managed access; without it the driver moves
        whole allocations at kernel launch and advice has no effect worth its calls.
        """
        cma = self.managed_memory and self.concurrent_managed_access
        if feature in ("advise", "prefetch"):
            return cma
        if feature in ("batch_prefetch", "discard"):
            return cma and self.batch_memory_ops
        raise ConfigError(f"unknown feature {feature!r}; features are advise, prefetch, batch_prefetch and discard")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def available() -> tuple[bool, str]:
    """Whether a CUDA device can be used, and if not, why (for messages and test skips)."""
    try:
        rt = _runtime()
    except CUDAUnavailableError as e:
        return False, str(e)
    err, count = rt.cudaGetDeviceCount()
    if int(err) != 0:
        return False, f"no usable CUDA driver or GPU ({_name(err)})"
    if count == 0:
        return False, "the CUDA driver reports no GPU"
    return True, f"{count} GPU(s)"


def device_count() -> int:
    return _check("cudaGetDeviceCount", _runtime().cudaGetDeviceCount())


def set_device(device: int) -> None:
    _check("cudaSetDevice", _runtime().cudaSetDevice(device))


def current_device() -> int:
    return _check("cudaGetDevice", _runtime().cudaGetDevice())


@contextlib.contextmanager
def on_device(device: int | None) -> Iterator[None]:
    """``device`` is the runtime's current device inside (None: leave it), the caller's again
    after. Streams, events and cudaMalloc belong to the current device; a Tier on another GPU
    than the caller's (NOTE [layers across GPUs] in inference/multidevice.py) must not move the caller's
    current device, which torch reads for every ``device="cuda"``."""
    if device is None:
        yield
        return
    before = current_device()
    if before != device:
        set_device(device)
    try:
        yield
    finally:
        if before != device:
            set_device(before)


@functools.cache
def capabilities(device: int) -> Capabilities:
    rt = _runtime()
    A = rt.cudaDeviceAttr

    def attr(name: str) -> int:
        return int(_check("cudaDeviceGetAttribute", rt.cudaDeviceGetAttribute(getattr(A, name), device)))

    props = _check("cudaGetDeviceProperties", rt.cudaGetDeviceProperties(device))
    name = props.name.decode(errors="replace").rstrip("\x00") if isinstance(props.name, bytes) else str(props.name)
    driver = int(_check("cudaDriverGetVersion", rt.cudaDriverGetVersion()))
    batch = driver >= 13000 and all(hasattr(rt, f) for f in (
        "cudaMemPrefetchBatchAsync", "cudaMemDiscardBatchAsync", "cudaMemDiscardAndPrefetchBatchAsync"))
    return Capabilities(
        device=device, name=name, total_memory=int(props.totalGlobalMem),
        compute_capability=(attr("cudaDevAttrComputeCapabilityMajor"), attr("cudaDevAttrComputeCapabilityMinor")),
        managed_memory=bool(attr("cudaDevAttrManagedMemory")),
        concurrent_managed_access=bool(attr("cudaDevAttrConcurrentManagedAccess")),
        pageable_memory_access=bool(attr("cudaDevAttrPageableMemoryAccess")),
        direct_managed_mem_access_from_host=bool(attr("cudaDevAttrDirectManagedMemAccessFromHost")),
        host_native_atomic_supported=bool(attr("cudaDevAttrHostNativeAtomicSupported")),
        driver_version=driver, runtime_version=int(_check("cudaRuntimeGetVersion", rt.cudaRuntimeGetVersion())),
        batch_memory_ops=batch,
    )


def mem_get_info(device: int) -> tuple[int, int]:
    """(free, total) bytes on ``device``. Free does not rise when managed pages leave the device."""
    with on_device(device):
        free, total = _check("cudaMemGetInfo", _runtime().cudaMemGetInfo())
    return int(free), int(total)


# ---------------------------------------------------------------------------------------------
# Managed and pinned memory

def managed_alloc(nbytes: int, device: int) -> Any:
    """A managed allocation through CuPy (cudaMallocManaged, attach-global). Returns CuPy's
    MemoryPointer; the memory is freed when the last reference to it goes."""
    import cupy
    with cupy.cuda.Device(device):
        try:
            return cupy.cuda.malloc_managed(nbytes)
        except cupy.cuda.runtime.CUDARuntimeError as e:
            raise CUDAError("cudaMallocManaged", e.status, cupy.cuda.runtime.getErrorName(e.status)) from None


class _Owned:
    """``nbytes`` at ``ptr`` that this object gives back once: at ``free()``, or when collected.
    A subclass says how (``_give_back``)."""

    __slots__ = ("ptr", "nbytes")

    def __init__(self, ptr: int, nbytes: int):
        self.ptr, self.nbytes = ptr, nbytes

    def free(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            self._give_back(ptr)

    def _give_back(self, ptr: int) -> None:
        raise NotImplementedError

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:  # pragma: no cover - destructors never raise (STYLE)
            pass


class DeviceMemory(_Owned):
    """Plain device memory straight from the driver (cudaMalloc), not from a pool: ``free()``
    (or collection) hands it back to the driver, for any allocator to use. cudaFree waits for
    the device to finish the work it has queued."""

    __slots__ = ()

    def _give_back(self, ptr: int) -> None:
        _check("cudaFree", _runtime().cudaFree(ptr))


def device_malloc(nbytes: int, device: int) -> DeviceMemory:
    """cudaMalloc on ``device``; raises CUDAOutOfMemoryError when the device is full."""
    rt = _runtime()
    with on_device(device):
        err, ptr = rt.cudaMalloc(nbytes)
    if int(err) == int(rt.cudaError_t.cudaErrorMemoryAllocation):
        raise CUDAOutOfMemoryError("cudaMalloc", int(err), _name(err))
    _check("cudaMalloc", (err,))
    return DeviceMemory(int(ptr), nbytes)


# NOTE [pinned by registration]
# cudaHostAlloc makes large pinned blocks slowly, a fraction of the link's rate, and loading a
# checkpoint's pinned home spent most of its time there. The same bytes as anonymous memory in
# transparent huge pages, written by 8 threads and then page-locked with cudaHostRegister, were
# ready several times sooner. Registering untouched memory instead faults every page in inside
# the driver, on one thread, several times slower than writing it first (docs/inference.md,
# "Loading a checkpoint", has the figures and their JSON). Registered memory is
# pinned memory to the copy engines and, mapped (cudaHostRegisterMapped) on a machine with
# unified addressing, the GPU reads it at the same address, as it does cudaHostAlloc's.
# So large host blocks are made this way; small ones keep CuPy's pinned pool, which reuses
# them. Unregistering is not documented to wait for copies still reading the memory, so
# ``free`` synchronizes the device first (as cudaFreeHost does).
#
# NOTE [filled before pinning]
# Memory that is about to be filled from a file (a checkpoint's pinned home) need not be zeroed
# first: the reads themselves fault its pages in, at a rate near the warm page cache's, and
# registering written memory afterwards is fast; zeroing, registering and then reading cost a
# load more (docs/inference.md, "Loading a checkpoint"). ``host_register(fill=...)`` maps the memory
# untouched, lets ``fill`` write it, then page-locks it. Pages ``fill`` leaves alone are faulted
# in (as zeros) by the registration, on one thread: correct, only slower, so ``fill`` should
# write most of the block. With this, all of a load's reads ran at the page cache's warm rate
# (docs/inference.md, "Loading a checkpoint"); registering is what is left.
class RegisteredHost(_Owned):
    """Host memory from :func:`_hostpages.map_pages`, page-locked and mapped for every device
    (NOTE [pinned by registration]). ``free()`` (or collection) unpins and unmaps it."""

    __slots__ = ()

    def _give_back(self, ptr: int) -> None:
        rt = _runtime()
        try:
            _check("cudaDeviceSynchronize", rt.cudaDeviceSynchronize())
            _check("cudaHostUnregister", rt.cudaHostUnregister(ptr))
        finally:
            _hostpages.unmap_pages(ptr, self.nbytes)


def host_register(nbytes: int, threads: int = 8, fill: Callable[[int], None] | None = None) -> RegisteredHost | None:
    """``nbytes`` of pinned host memory made by registration (NOTE [pinned by registration]), or
    None where that cannot stand in for cudaHostAlloc's: no anonymous mappings, or a device
    address that differs from the host address (no unified addressing for registered memory).
    ``fill(ptr)``, if given, writes the memory before it is page-locked: its writes fault the
    pages in, so they need no zeroing pass first (NOTE [filled before pinning]). Raises
    MemoryError when the host has no room, CUDAError when the driver refuses, and what ``fill``
    raises, with the memory given back."""
    if not _hostpages.available():
        return None
    rt = _runtime()
    ptr = _hostpages.map_pages(nbytes, threads, touch=fill is None)
    if fill is not None:
        try:
            fill(ptr)
        except BaseException:
            _hostpages.unmap_pages(ptr, nbytes)
            raise
    flags = rt.cudaHostRegisterPortable | rt.cudaHostRegisterMapped
    err = rt.cudaHostRegister(ptr, nbytes, flags)
    if isinstance(err, tuple):
        err = err[0]
    if int(err) != 0:
        _hostpages.unmap_pages(ptr, nbytes)
        if int(err) == int(rt.cudaError_t.cudaErrorMemoryAllocation):
            raise CUDAOutOfMemoryError("cudaHostRegister", int(err), _name(err))
        raise CUDAError("cudaHostRegister", int(err), _name(err))
    block = RegisteredHost(ptr, nbytes)
    err, dptr = rt.cudaHostGetDevicePointer(ptr, 0)
    if int(err) != 0 or int(dptr) != ptr:
        block.free()
        return None
    return block


def host_alloc(nbytes: int) -> int:
    """Page-locked host memory, mapped for every device (cudaHostAllocPortable | Mapped)."""
    rt = _runtime()
    flags = rt.cudaHostAllocPortable | rt.cudaHostAllocMapped
    return int(_check("cudaHostAlloc", rt.cudaHostAlloc(nbytes, flags)))


def host_free(ptr: int) -> None:
    _check("cudaFreeHost", _runtime().cudaFreeHost(ptr))


# ---------------------------------------------------------------------------------------------
# Advice, prefetch, discard

_ADVICE = {
    ("preferred_location", True): "cudaMemAdviseSetPreferredLocation",
    ("preferred_location", False): "cudaMemAdviseUnsetPreferredLocation",
    ("read_mostly", True): "cudaMemAdviseSetReadMostly",
    ("read_mostly", False): "cudaMemAdviseUnsetReadMostly",
    ("accessed_by", True): "cudaMemAdviseSetAccessedBy",
    ("accessed_by", False): "cudaMemAdviseUnsetAccessedBy",
}


def advise(ptr: int, nbytes: int, kind: str, set_: bool, location: Location, device: int) -> None:
    rt = _runtime()
    name = _ADVICE[(kind, set_)]
    _check(f"cudaMemAdvise({name})", rt.cudaMemAdvise(ptr, nbytes, getattr(rt.cudaMemoryAdvise, name), _loc(location, device)))


def prefetch(ptr: int, nbytes: int, location: Location, device: int, stream: int) -> None:
    _check("cudaMemPrefetchAsync", _runtime().cudaMemPrefetchAsync(ptr, nbytes, _loc(location, device), 0, stream))


def prefetch_batch(ptrs: Sequence[int], sizes: Sequence[int], location: Location, device: int, stream: int) -> None:
    """One cudaMemPrefetchBatchAsync for all ranges (all to one location)."""
    _check("cudaMemPrefetchBatchAsync", _runtime().cudaMemPrefetchBatchAsync(
        list(ptrs), list(sizes), len(ptrs), [_loc(location, device)], [0], 1, 0, stream))


def discard_batch(ptrs: Sequence[int], sizes: Sequence[int], stream: int) -> None:
    """cudaMemDiscardBatchAsync: the ranges' contents become indeterminate and their pages
    may be reclaimed without write-back. ``stream`` must not be the legacy default stream."""
    _check("cudaMemDiscardBatchAsync", _runtime().cudaMemDiscardBatchAsync(list(ptrs), list(sizes), len(ptrs), 0, stream))


def discard_and_prefetch_batch(ptrs: Sequence[int], sizes: Sequence[int], location: Location, device: int, stream: int) -> None:
    """Give the ranges fresh pages at ``location`` without moving their old contents."""
    _check("cudaMemDiscardAndPrefetchBatchAsync", _runtime().cudaMemDiscardAndPrefetchBatchAsync(
        list(ptrs), list(sizes), len(ptrs), [_loc(location, device)], [0], 1, 0, stream))


@dataclasses.dataclass(frozen=True)
class RangeInfo:
    """What CUDA reports for a managed range (cudaMemRangeGetAttribute).

    preferred_location and last_prefetch are None when unset or not the same over the range.
    accessed_by lists the processors with accessed-by advice over the whole range.
    """

    read_mostly: bool
    preferred_location: Location | None
    preferred_device: int | None
    accessed_by: tuple[Location, ...]
    last_prefetch: Location | None


def _loc_of(dev_id: int) -> Location | None:
    if dev_id == -1:       # cudaCpuDeviceId
        return Location.HOST
    if dev_id >= 0:
        return Location.DEVICE
    return None            # cudaInvalidDeviceId: unset, or mixed over the range


def range_info(ptr: int, nbytes: int) -> RangeInfo:
    rt = _runtime()
    RA = rt.cudaMemRangeAttribute

    def get(attr: str, size: int = 4) -> Any:
        return _check("cudaMemRangeGetAttribute", rt.cudaMemRangeGetAttribute(size, getattr(RA, attr), ptr, nbytes))

    pref = int(get("cudaMemRangeAttributePreferredLocation"))
    acc = [int(x) for x in get("cudaMemRangeAttributeAccessedBy", 4 * 8)]
    return RangeInfo(
        read_mostly=bool(get("cudaMemRangeAttributeReadMostly")),
        preferred_location=_loc_of(pref), preferred_device=pref if pref >= 0 else None,
        accessed_by=tuple(loc for loc in (_loc_of(a) for a in acc if a != -2) if loc is not None),
        last_prefetch=_loc_of(int(get("cudaMemRangeAttributeLastPrefetchLocation"))),
    )


def pointer_kind(ptr: int) -> str:
    """'managed', 'device', 'host' (pinned) or 'unregistered'."""
    attrs = _check("cudaPointerGetAttributes", _runtime().cudaPointerGetAttributes(ptr))
    return {0: "unregistered", 1: "host", 2: "device", 3: "managed"}.get(int(attrs.type), str(attrs.type))


# ---------------------------------------------------------------------------------------------
# Copies, streams, events

def memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    rt = _runtime()
    _check("cudaMemcpyAsync", rt.cudaMemcpyAsync(dst, src, nbytes, rt.cudaMemcpyKind.cudaMemcpyDefault, stream))


def enable_peer_access(device: int, peer: int) -> bool:
    """Let copies and kernels on ``device`` reach ``peer``'s memory directly (NVLink or PCIe peer
    to peer); False where the pair cannot. Without it a copy between the two still works, staged
    by the driver through host memory, at a fraction of the rate."""
    rt = _runtime()
    if device == peer or not _check("cudaDeviceCanAccessPeer", rt.cudaDeviceCanAccessPeer(device, peer)):
        return False
    with on_device(device):
        err = rt.cudaDeviceEnablePeerAccess(peer, 0)[0]
        if err == rt.cudaError_t.cudaErrorPeerAccessAlreadyEnabled:
            rt.cudaGetLastError()            # not sticky, but it stays the last error until read
            return True
        _check("cudaDeviceEnablePeerAccess", (err,))
    return True


def stream_create(device: int, priority: int = 0) -> int:
    """A non-blocking stream (it does not synchronise with the legacy default stream)."""
    rt = _runtime()
    with on_device(device):
        s = _check("cudaStreamCreateWithPriority", rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, priority))
    return int(s)


def stream_destroy(stream: int) -> None:
    _check("cudaStreamDestroy", _runtime().cudaStreamDestroy(stream))


def stream_synchronize(stream: int) -> None:
    _check("cudaStreamSynchronize", _runtime().cudaStreamSynchronize(stream))


def stream_is_capturing(stream: int) -> bool:
    """Whether ``stream`` is being captured into a CUDA graph now."""
    rt = _runtime()
    status = _check("cudaStreamIsCapturing", rt.cudaStreamIsCapturing(stream))
    return status == rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusActive


def device_synchronize() -> None:
    _check("cudaDeviceSynchronize", _runtime().cudaDeviceSynchronize())


# NOTE [pooled events]
#     A streamed forward makes an event for every copy it orders and every wait it hands across
#     streams: about 45 a decode token of a 0.85B Llama on one H200 and 150 over two with the
#     relay, at about 18 us each through cuda-bindings (the current-device switch, the create, and
#     later the destroy): 0.8 and 2.7 ms of host time a token, where the host is what bounds a
#     small model's decode. So the handle of a plain event (no timing, never recorded in a graph
#     capture) goes back to its device's pool when its Event is dropped, and the next event_create
#     of that device takes it again, as torch's CUDA caching allocator keeps its events. Reuse is
#     safe whatever the handle's record is doing: a stream's wait, or a query, concerns the record
#     before it, and a record made later does not change it (cudaStreamWaitEvent: "subsequent calls
#     will not have any effect on stream"); an Event is dropped only when nothing holds it to wait
#     on or query. A captured event is destroyed instead (NOTE [events across a capture]: the
#     driver refuses its use after a capture), and a pool keeps at most EVENT_POOL handles.
EVENT_POOL = 1024
_event_pools: dict[int, list[Any]] = {}


class Event:
    """A CUDA event whose handle is destroyed, or pooled (NOTE [pooled events]), when the last
    reference goes. A training step makes thousands of events; cuda-bindings' handles do not
    free themselves."""

    __slots__ = ("handle", "capture", "device")

    def __init__(self, handle: Any, device: int | None = None):
        self.handle = handle
        self.capture = 0       # the capture it was last recorded in (NOTE [events across a capture])
        self.device = device   # the device whose pool takes it back; None: destroyed, never pooled

    def __del__(self) -> None:
        # Destroying an event whose record is still pending is allowed: the driver frees it when
        # the work completes. Destructors never raise (STYLE).
        try:
            pool = None if self.device is None or self.capture else _event_pools.get(self.device)
            if pool is not None and len(pool) < EVENT_POOL:
                pool.append(self.handle)
                return
            _runtime().cudaEventDestroy(self.handle)
        except Exception:  # pragma: no cover
            pass


def _ev(event: Any) -> Any:
    return event.handle if isinstance(event, Event) else event


def event_create(timing: bool = False, device: int | None = None) -> Event:
    """An event of ``device`` (None: the current one); it can be recorded on that device's
    streams only, and waited for on any. A plain event of a named device comes from its pool
    where the pool has one (NOTE [pooled events])."""
    pooled = not timing and device is not None
    if pooled:
        pool = _event_pools.setdefault(device, [])
        try:
            return Event(pool.pop(), device)
        except IndexError:
            pass
    rt = _runtime()
    flags = rt.cudaEventDefault if timing else rt.cudaEventDisableTiming
    with on_device(device):
        return Event(_check("cudaEventCreateWithFlags", rt.cudaEventCreateWithFlags(flags)),
                     device if pooled else None)


def event_record(event: Any, stream: int) -> None:
    _check("cudaEventRecord", _runtime().cudaEventRecord(_ev(event), stream))


def event_query(event: Any) -> bool:
    """True when the event's work is done."""
    rt = _runtime()
    err = rt.cudaEventQuery(_ev(event))[0]
    if err == rt.cudaError_t.cudaErrorNotReady:
        return False
    _check("cudaEventQuery", (err,))
    return True


def event_synchronize(event: Any) -> None:
    _check("cudaEventSynchronize", _runtime().cudaEventSynchronize(_ev(event)))


def event_elapsed_ms(start: Any, end: Any) -> float:
    return float(_check("cudaEventElapsedTime", _runtime().cudaEventElapsedTime(_ev(start), _ev(end))))


def stream_wait_event(stream: int, event: Any) -> None:
    _check("cudaStreamWaitEvent", _runtime().cudaStreamWaitEvent(stream, _ev(event), 0))
