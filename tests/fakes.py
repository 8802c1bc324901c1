"""A backend that keeps "device" memory in host RAM, for the CPU tests.

It implements tiermem's Backend interface with NumPy buffers and records every call. It is a test
double for the CUDA layer only: the engine under test (budget, policies, eviction paths, views,
accounting) is the real one. To catch reads of discarded memory, a discard overwrites the range
with a poison byte, as the driver is free to (its contents become indeterminate).

Failure injection (what tests/test_faults.py sweeps; any other test may use it):

    fake.fail_at(n, "cuda")        # the n-th faultable call from now (1-based) raises, once
    with fake.counting() as seen:  # no failure: records the faultable calls an operation makes
        tier.evict(tt)
    len(seen), seen[0]             # how many, and the first one's name ("new_event", ...)
    fake.fired                     # the (n, call name, kind) of the last failure that fired

The faultable calls are the backend methods in ``tiermem.cuda.backend.FAULTABLE`` (every one that a
real CUDA call stands behind), counted by a ``tiermem.cuda.backend.FaultInjector`` (``fake.faults``;
the real backend takes the same injector, NOTE [failure injection] in cuda/backend.py). A failure is
raised when the call starts, before it has any effect. Its kind is one of ``FAULT_KINDS``:

    "cuda"       CUDAError("<call>", 719, "cudaErrorLaunchFailure"): a sticky device error;
    "oom"        CUDAOutOfMemoryError("<call>", 2, "cudaErrorMemoryAllocation");
    "interrupt"  KeyboardInterrupt (Ctrl-C arriving while the call runs).

``live()`` gives the bytes of live managed, pinned and device allocations, to compare with what
the Tier believes it holds (a leak shows as a difference).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import threading
from typing import Any

import numpy as np

from tiermem.base.limits import CapGuard, resolve_cap
from tiermem.cuda.backend import FAULTABLE, LARGE, Block, FaultInjector, HostBlock
from tiermem.cuda.runtime import Capabilities, RangeInfo
from tiermem.errors import CUDAOutOfMemoryError, ViewError
from tiermem.roles import Advice, Location

POISON = 0xDB

FAULT_KINDS = FaultInjector.KINDS
# What fresh memory holds: random bytes, repeated (drawing new ones for every allocation made
# the fault sweep's thousands of tiers slow).
_NOISE = np.random.default_rng(0xDB).integers(0, 256, size=(1 << 20) + 4099, dtype=np.uint8)


class _Held(np.ndarray):
    """An ndarray that can carry the view token (torch keeps the array alive with its storage)."""


class _State:
    def __init__(self) -> None:
        self.preferred: Location | None = None
        self.read_mostly = False
        self.accessed_by: set[Location] = set()
        self.last_prefetch: Location | None = None


class _Event:
    __slots__ = ("stream",)

    def __init__(self):
        self.stream: int | None = None


class FakeBackend:
    kind = "fake"

    def __init__(self, *, total: int = 8 << 30, free: int | None = None, cap: Any = None,
                 allow_oversubscribe: bool | None = None, concurrent: bool = True, batch: bool = True,
                 foreign_host: bool = False):
        self.device = 0
        # Training on the CPU keeps its slots in torch's CPU memory, as on a GPU it keeps them in
        # torch's device memory: with ``foreign_host`` the fake views and copies memory it did
        # not allocate (a wrong address then crashes instead of failing an assert).
        self.foreign_host = foreign_host
        self._caps = Capabilities(
            device=0, name="FakeGPU", total_memory=total, compute_capability=(9, 0), managed_memory=True,
            concurrent_managed_access=concurrent, pageable_memory_access=False,
            direct_managed_mem_access_from_host=False, host_native_atomic_supported=False,
            driver_version=13000 if batch else 12080, runtime_version=13000, batch_memory_ops=batch)
        limit, allow = resolve_cap(cap, allow_oversubscribe, free=total if free is None else free, total=total)
        self.guard = CapGuard(limit, allow)
        self.calls: list[tuple] = []
        self._lock = threading.Lock()
        self._arrays: dict[int, np.ndarray] = {}    # base ptr -> backing array (managed and pinned)
        self._kind: dict[int, str] = {}
        self.state: dict[int, _State] = {}
        self._streams = itertools.count(1)
        self.live_streams: set[int] = set()     # made by new_stream, not yet destroyed
        self.dead_streams: set[int] = set()
        self.live_blocks = 0
        self.device_full = False       # device_alloc then fails as cudaMalloc does on a full device
        self.events_pending = False    # query() then says no event is done yet (the work is, here)
        self.waits: list[tuple[int, int | None]] = []   # (waiting stream, stream the event was recorded on)
        self._live = {"managed": 0, "pinned": 0, "device": 0}
        self.peak_live = dict(self._live)   # the most of each kind live at once; tests may reset it
        self.faults = FaultInjector()

    # -- failure injection (see the module docstring) ------------------------------------------
    def fail_at(self, n: int, kind: str = "cuda", thread: str | None = None) -> None:
        """Make the ``n``-th faultable call from now (1-based; on ``thread`` only, if given) fail
        once with ``kind``."""
        self.faults.fail_at(n, kind, thread)

    def disarm(self) -> None:
        self.faults.disarm()

    @property
    def fired(self) -> tuple[int, str, str] | None:
        return self.faults.fired

    @contextlib.contextmanager
    def counting(self, thread: str | None = None):
        """Record the names of the faultable calls made inside the block (on ``thread`` only, if
        given); nothing fails."""
        inj, seen = self.faults, []
        armed = (inj._left, inj._n, inj._kind, inj.thread)
        inj._left, inj.seen, inj.thread = None, seen, thread
        try:
            yield seen
        finally:
            (inj._left, inj._n, inj._kind, inj.thread), inj.seen = armed, None

    def live(self) -> dict[str, int]:
        """Bytes of live allocations by kind: managed, pinned, device."""
        with self._lock:
            return dict(self._live)

    # -- memory ---------------------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        return self._caps

    def mem_info(self) -> tuple[int, int]:
        return self.guard.limit - self.guard.reserved, self._caps.total_memory

    def _new(self, nbytes: int, kind: str) -> tuple[int, np.ndarray]:
        # Large allocations come back 2 MiB-aligned, as the driver's do (probe_paths.json).
        align = 2 << 20 if nbytes >= 2 << 20 else 512
        size = max(nbytes, 1) + align
        # uninitialised is not zero; np.resize copies all of _NOISE before it cuts, 1 MiB for 1 byte
        raw = _NOISE[:size].copy() if size <= _NOISE.size else np.resize(_NOISE, size)
        off = (-raw.ctypes.data) % align
        arr = raw[off:off + max(nbytes, 1)]
        ptr = arr.ctypes.data
        with self._lock:
            self._arrays[ptr] = arr
            self._kind[ptr] = kind
            self._live[kind] += nbytes
            self.peak_live[kind] = max(self.peak_live[kind], self._live[kind])
            if kind == "managed":
                self.state[ptr] = _State()
        return ptr, arr

    def allocate(self, nbytes: int, pool_key: str) -> Block:
        self.guard.reserve(nbytes)
        ptr, arr = self._new(nbytes, "managed")
        self.calls.append(("allocate", nbytes, pool_key))
        with self._lock:
            self.live_blocks += 1
        return _FakeBlock(self, ptr, nbytes, pool_key, arr)

    def _free(self, ptr: int, nbytes: int, managed: bool) -> None:
        with self._lock:
            self._arrays.pop(ptr, None)
            kind = self._kind.pop(ptr, None)
            if kind is not None:
                self._live[kind] -= nbytes
            self.state.pop(ptr, None)
            if managed:
                self.live_blocks -= 1
        if managed:
            self.guard.release(nbytes)

    def release_cached(self) -> int:
        return 0

    def pool_bytes(self) -> dict[str, int]:
        return {"used": self.guard.reserved, "cached": 0, "reserved": self.guard.reserved}

    def host_alloc(self, nbytes: int, pooled: bool = True, fill=None) -> HostBlock:
        ptr, arr = self._new(nbytes, "pinned")
        self.calls.append(("host_alloc", nbytes))
        block = _FakeHostBlock(self, ptr, nbytes, arr)
        if fill is not None:        # the real backend's contract: what fill raises, with the block given back
            try:
                fill(ptr)
            except BaseException:
                block.release()
                raise
        return block

    def device_alloc(self, nbytes: int, pooled: bool = True) -> Block:
        if self.device_full:
            raise CUDAOutOfMemoryError("cudaMalloc", 2, "cudaErrorMemoryAllocation")
        ptr, arr = self._new(nbytes, "device")
        self.calls.append(("device_alloc", nbytes, pooled))
        return _FakeHostBlock(self, ptr, nbytes, arr)

    def _find(self, ptr: int) -> tuple[int, np.ndarray]:
        with self._lock:
            for base, arr in self._arrays.items():
                if base <= ptr < base + arr.nbytes:
                    return base, arr
        raise AssertionError(f"fake backend: address {ptr:#x} is not allocated")

    def _blocks_in(self, ptr: int, nbytes: int) -> list[_State]:
        with self._lock:
            return [st for base, st in self.state.items()
                    if base < ptr + max(nbytes, 1) and ptr < base + self._arrays[base].nbytes]

    # -- advice and moves -----------------------------------------------------------------------
    def advise(self, ptr: int, nbytes: int, advice: Advice) -> None:
        self.calls.append(("advise", ptr, nbytes, advice.kind, advice.set, advice.location))
        for st in self._blocks_in(ptr, nbytes):
            if advice.kind == "preferred_location":
                st.preferred = advice.location if advice.set else None
            elif advice.kind == "read_mostly":
                st.read_mostly = advice.set
            elif advice.set:
                st.accessed_by.add(advice.location)
            else:
                st.accessed_by.discard(advice.location)

    def prefetch(self, ranges, location: Location, stream: int) -> None:
        self._stream_ok(stream)
        self.calls.append(("prefetch", tuple(ranges), location, stream))
        for p, n in ranges:
            for st in self._blocks_in(p, n):
                st.last_prefetch = location

    @staticmethod
    def _whole_pages(ranges) -> None:
        # The driver maps managed memory on the device in 2 MiB pages: a discard of part of one
        # could take a neighbour's data with it, so the engine must never ask for one.
        for p, n in ranges:
            assert p % LARGE == 0 and n % LARGE == 0, f"discard of part of a 2 MiB page: {p:#x}+{n:#x}"

    def discard(self, ranges, stream: int) -> None:
        self._whole_pages(ranges)
        self.calls.append(("discard", tuple(ranges), stream))
        for p, n in ranges:
            ctypes.memset(p, POISON, n)

    def discard_and_prefetch(self, ranges, location: Location, stream: int) -> None:
        self._whole_pages(ranges)
        self.calls.append(("discard_and_prefetch", tuple(ranges), location, stream))
        for p, n in ranges:
            ctypes.memset(p, POISON, n)
            for st in self._blocks_in(p, n):
                st.last_prefetch = location

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._stream_ok(stream)
        self.calls.append(("copy", dst, src, nbytes, stream))
        if self._foreign(dst, nbytes) is None:
            self._find(dst)
        if self._foreign(src, nbytes) is None:
            self._find(src)
        ctypes.memmove(dst, src, nbytes)

    def enable_peer(self, peer: int) -> bool:
        """Every fake's memory is the host's: a peer's is reachable where ``foreign_host`` lets
        the fake copy memory it did not allocate."""
        self.calls.append(("enable_peer", peer))
        return self.foreign_host and peer != self.device

    def range_info(self, ptr: int, nbytes: int) -> RangeInfo:
        sts = self._blocks_in(ptr, nbytes)
        st = sts[0]
        return RangeInfo(read_mostly=st.read_mostly, preferred_location=st.preferred,
                         preferred_device=0 if st.preferred is Location.DEVICE else None,
                         accessed_by=tuple(sorted(st.accessed_by, key=lambda x: x.value)),
                         last_prefetch=st.last_prefetch)

    def pointer_kind(self, ptr: int) -> str:
        try:
            base, _ = self._find(ptr)
        except AssertionError:
            return "unregistered"
        return {"managed": "managed", "pinned": "host", "device": "device"}[self._kind[base]]

    # -- streams and events (all work is done at once, so every event is complete) --------------
    def current_stream(self) -> int:
        return 0

    def new_stream(self) -> int:
        s = next(self._streams)
        self.live_streams.add(s)
        return s

    def destroy_stream(self, stream: int) -> None:
        assert stream in self.live_streams, f"destroying stream {stream}, which is not live"
        self.live_streams.discard(stream)
        self.dead_streams.add(stream)

    def _stream_ok(self, stream: int) -> None:
        # The driver answers a destroyed stream with cudaErrorInvalidResourceHandle, or worse.
        assert stream not in self.dead_streams, f"work queued on destroyed stream {stream}"

    def new_event(self, timing: bool = False) -> Any:
        return _Event()

    def torch_stream(self, stream: int) -> Any:
        """Work is done at once here: every stream is the host's (torch's CPU ops)."""
        self._stream_ok(stream)
        self.calls.append(("torch_stream", stream))
        return contextlib.nullcontext()

    def record(self, event: Any, stream: int) -> None:
        self._stream_ok(stream)
        event.stream = stream

    def wait(self, stream: int, event: Any) -> None:
        self._stream_ok(stream)
        self.calls.append(("wait", stream))
        self.waits.append((stream, event.stream))

    def query(self, event: Any) -> bool:
        return not self.events_pending

    def synchronize(self, event: Any) -> None:
        pass

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return 1.0

    # -- views ----------------------------------------------------------------------------------
    def _foreign(self, ptr: int, nbytes: int) -> np.ndarray | None:
        """A byte array over ``nbytes`` at ``ptr`` when that is memory the fake did not allocate
        and ``foreign_host`` allows it, else None."""
        if not self.foreign_host:
            return None
        try:
            self._find(ptr)
            return None
        except AssertionError:
            return np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr))[:nbytes]

    def torch_view(self, ptr: int, nbytes: int, token: Any) -> Any:
        import torch
        raw = self._foreign(ptr, nbytes)
        if raw is not None:
            held = raw.view(_Held)
            held.token = token
            return torch.from_numpy(held)
        base, arr = self._find(ptr)
        held = arr[ptr - base: ptr - base + nbytes].view(_Held)
        held.token = token
        return torch.from_numpy(held)

    def host_view(self, ptr: int, nbytes: int, token: Any) -> Any:
        return self.torch_view(ptr, nbytes, token)      # the fake's device is the host

    def cupy_view(self, ptr: int, nbytes: int, token: Any) -> Any:
        raise ViewError("the fake backend has no CuPy")

    def dlpack_device(self) -> tuple[int, int]:
        return (1, 0)   # kDLCPU: the fake's memory is host memory


def _faultable(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def call(self: FakeBackend, *args: Any, **kwargs: Any) -> Any:
        self.faults(name)
        return fn(self, *args, **kwargs)
    return call


for _name in FAULTABLE:
    setattr(FakeBackend, _name, _faultable(_name, getattr(FakeBackend, _name)))


class _FakeBlock(Block):
    __slots__ = ("_fake", "_released")

    def __init__(self, fake: FakeBackend, ptr: int, nbytes: int, key: str, arr: np.ndarray):
        super().__init__(ptr, nbytes, key, arr)
        self._fake, self._released = fake, False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._fake._free(self.ptr, self.nbytes, managed=True)
        self._handle = None


class _FakeHostBlock(HostBlock):
    __slots__ = ("_fake", "_released")

    def __init__(self, fake: FakeBackend, ptr: int, nbytes: int, arr: np.ndarray):
        super().__init__(ptr, nbytes, "pinned", arr)
        self._fake, self._released = fake, False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._fake._free(self.ptr, self.nbytes, managed=False)
        self._handle = None


class PeakedHostMemory:
    """Host memory controls whose allocator reports a step's peak, as CUDA's caching allocator
    does on a GPU (torch's CPU allocator reports none): ``peak`` is bytes, or a function of
    nothing called when the step ends, so a test can set it from what the step made."""

    def __init__(self, inner: Any, peak: Any = 0):
        self.inner = inner
        self.device = inner.device
        self.peak = peak

    def max_reserved(self) -> int:
        return int(self.peak() if callable(self.peak) else self.peak)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
