"""Exploration for issue 3: does a discard (or discard-and-prefetch) of managed pages slow copies
that run at the same time, and can several host threads share its work? probe_discard_cost
showed the discard is ~4 ms/GiB of host time in the driver and that issuing it beside
managed->pinned copies saved nothing. This asks why. 2 GiB managed, 2 GiB pinned.

  copy_<src>_alone        1 GiB to pinned, src: plain device memory, managed (copy engine), or
                          managed read by a kernel (sm)
  copy_<src>_w_discard    the same while the host discards another 1 GiB of managed pages
  discard_threads_<k>     1 GiB discarded by k host threads at once, each on its own stream
  dp_threads_<k>          the same for discard-and-prefetch to the device
  in_<how>                1 GiB back into a discarded range: d&p then copy engine, or then kernel
Writes $OUT/probe_discard_overlap.json.
"""
from __future__ import annotations

import ctypes
import json
import os
import statistics
import threading
import time

import cupy as cp
import numpy as np
import torch
from _path import RESULTS  # first: puts bench/ and the repository on sys.path
from _common import device_view, progress, provenance  # noqa: E402

from tiermem import Location
from tiermem.cuda import runtime as _cuda
from tiermem.cuda.backend import CudaBackend

GiB, MiB = 1 << 30, 1 << 20
N = GiB
REPS = 5
be = CudaBackend(0, cap="3GiB")
X = be.new_stream()
streams = [be.new_stream() for _ in range(8)]
M = be.allocate(N, "probe/large").ptr        # the range that gets discarded
M2 = be.allocate(N, "probe/large").ptr       # the range that gets copied
P2 = be.host_alloc(N)
torch.cuda.set_stream(torch.cuda.Stream())
dev = torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda")
mv = device_view(M, N)
m2v = device_view(M2, N)
for p in (M, M2):
    _cuda.prefetch(p, N, Location.DEVICE, 0, X)
_cuda.stream_synchronize(X)
mv.copy_(dev)
m2v.copy_(dev)
torch.cuda.synchronize()

_copy16 = cp.RawKernel(r'''
extern "C" __global__ void copy16(const ulonglong2* __restrict__ s, ulonglong2* __restrict__ d, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        d[i] = s[i];
}''', "copy16")


def sm_copy(dst, src, n, stream):
    with cp.cuda.ExternalStream(stream):
        _copy16((132 * 8,), (512,), (cp.uint64(src), cp.uint64(dst), cp.uint64(n // 16)))


dev_cpu = dev.cpu()


def pinned_view(ptr):
    return torch.from_numpy(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint8)), (N,)))


R: dict = {"device": torch.cuda.get_device_name()}


def repopulate():
    _cuda.discard_and_prefetch_batch([M], [N], Location.DEVICE, 0, X)
    _cuda.stream_synchronize(X)
    mv.copy_(dev)
    torch.cuda.synchronize()


def record(name, times, extra=None):
    med = statistics.median(times)
    R[name] = {"ms": round(med * 1e3, 3), "GBps": round(N / med / 1e9, 2), "all_ms": [round(t * 1e3, 2) for t in times]}
    if extra:
        R[name]["extra_ms"] = extra
    progress(f"{name}: {R[name]['GBps']} GB/s ({R[name]['ms']} ms) {extra or ''}")


def copy_fn(src):
    if src == "plain":
        return lambda: be.copy(P2.ptr, dev.data_ptr(), N, X)
    if src == "managed":
        return lambda: [be.copy(P2.ptr + o, M2 + o, 64 * MiB, X) for o in range(0, N, 64 * MiB)]
    return lambda: sm_copy(P2.ptr, M2, N, X)


for src in ("plain", "managed", "sm"):
    for with_discard in (False, True):
        times, dts = [], []
        for rep in range(REPS + 1):
            if with_discard:
                repopulate()
            torch.cuda.synchronize()
            a, b = _cuda.event_create(timing=True), _cuda.event_create(timing=True)
            _cuda.event_record(a, X)
            copy_fn(src)()
            _cuda.event_record(b, X)
            if with_discard:
                t0 = time.perf_counter()
                _cuda.discard_batch([M], [N], streams[0])
                dts.append(round((time.perf_counter() - t0) * 1e3, 2))
                _cuda.stream_synchronize(streams[0])
            _cuda.event_synchronize(b)
            if rep:
                times.append(_cuda.event_elapsed_ms(a, b) / 1e3)
        record(f"copy_{src}_{'w_discard' if with_discard else 'alone'}", times, {"discard_host": dts[1:]} if dts else None)
        R.setdefault("copies_correct", {})[src] = bool(torch.equal(pinned_view(P2.ptr), dev_cpu))


def threaded(fn_one, k):
    parts = [(M + i * (N // k), N // k) for i in range(k)]
    ths = [threading.Thread(target=fn_one, args=(p, n, streams[i])) for i, (p, n) in enumerate(parts)]
    t0 = time.perf_counter()
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    for s in streams[:k]:
        _cuda.stream_synchronize(s)
    return time.perf_counter() - t0


for k in (1, 2, 4, 8):
    times = []
    for rep in range(REPS + 1):
        repopulate()
        t = threaded(lambda p, n, s: _cuda.discard_batch([p], [n], s), k)
        if rep:
            times.append(t)
    record(f"discard_threads_{k}", times)
for k in (1, 2, 4, 8):
    times = []
    for rep in range(REPS + 1):
        repopulate()
        _cuda.discard_batch([M], [N], X)
        _cuda.stream_synchronize(X)
        t = threaded(lambda p, n, s: _cuda.discard_and_prefetch_batch([p], [n], Location.DEVICE, 0, s), k)
        if rep:
            times.append(t)
    record(f"dp_threads_{k}", times)

# back in: pinned -> a discarded range
src_pinned = torch.empty(N, dtype=torch.uint8, pin_memory=True)
src_pinned.copy_(dev_cpu)
for how in ("ce", "sm"):
    times, parts = [], []
    for rep in range(REPS + 1):
        repopulate()
        _cuda.discard_batch([M], [N], X)
        _cuda.stream_synchronize(X)
        t0 = time.perf_counter()
        _cuda.discard_and_prefetch_batch([M], [N], Location.DEVICE, 0, X)
        _cuda.stream_synchronize(X)
        t1 = time.perf_counter()
        if how == "ce":
            be.copy(M, src_pinned.data_ptr(), N, X)
        else:
            sm_copy(M, src_pinned.data_ptr(), N, X)
        _cuda.stream_synchronize(X)
        t2 = time.perf_counter()
        if rep:
            times.append(t2 - t0)
            parts.append([round((t1 - t0) * 1e3, 2), round((t2 - t1) * 1e3, 2)])
    R.setdefault("in_intact", {})[how] = bool(torch.equal(mv, dev))
    record(f"in_{how}", times, {"dp_then_copy": parts})

dest = os.environ.get("OUT") or RESULTS
with open(os.path.join(dest, "probe_discard_overlap.json"), "w") as f:
    json.dump({**provenance(), **R}, f, indent=1)
