"""Exploration for issue 3: copies out of managed pages run at ~52 GB/s, out of cudaMalloc memory
at ~55, and a device-to-device copy costs next to nothing next to the link. So stage: copy the
managed range into plain device memory, discard it (the fence: the stream is idle), then copy the
staging buffer to the pinned shadow. And the other way for a refill. 1 GiB managed, 1 GiB pinned,
up to 1 GiB of staging. Every variant checks the bytes. Writes $OUT/probe_staged.json.

  direct               managed -> pinned, drain, discard (tiermem at 9ade760)
  staged_full          managed -> staging (all), drain, discard, staging -> pinned
  staged_ring_<s>      the same in rounds through two staging slots of s MiB
  in_direct            discard-and-prefetch, pinned -> managed
  in_staged_ring_<s>   discard-and-prefetch, then pinned -> slot -> managed through two slots
"""
from __future__ import annotations

import ctypes
import json
import os
import statistics
import time

import numpy as np
import torch
from _path import RESULTS  # first: puts bench/ and the repository on sys.path
from _common import device_view, progress, provenance  # noqa: E402

from tiermem import Location
from tiermem.cuda import runtime as _cuda

GiB, MiB = 1 << 30, 1 << 20
N = GiB
REPS = 7
X = _cuda.stream_create(0)
Y = _cuda.stream_create(0)
P = _cuda.host_alloc(N)
torch.cuda.set_stream(torch.cuda.Stream())
ref = torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda")
m = _cuda.managed_alloc(N, 0)
M = m.ptr
v = device_view(M, N)
staging = torch.empty(N, dtype=torch.uint8, device="cuda")
S = staging.data_ptr()
pinned = torch.from_numpy(np.ctypeslib.as_array(ctypes.cast(P, ctypes.POINTER(ctypes.c_uint8)), (N,)))
R: dict = {"device": torch.cuda.get_device_name()}


def sync():
    _cuda.stream_synchronize(X)
    _cuda.stream_synchronize(Y)


def fresh():
    """The managed range on the device, holding new bytes."""
    _cuda.discard_and_prefetch_batch([M], [N], Location.DEVICE, 0, X)
    sync()
    ref.add_(1)
    v.copy_(ref)
    torch.cuda.synchronize()


def direct():
    _cuda.memcpy_async(P, M, N, X)
    sync()
    _cuda.discard_batch([M], [N], X)
    sync()


def staged_full():
    _cuda.memcpy_async(S, M, N, X)
    sync()
    _cuda.discard_batch([M], [N], X)
    sync()
    _cuda.memcpy_async(P, S, N, X)
    sync()


def staged_ring(slot):
    def fn():
        # round k: stage piece k into slot k%2 (X), host-drain, discard piece k, then queue the
        # slot's copy out on Y; the next round's staging copy waits for the slot's last copy out
        done = [None, None]
        for k, off in enumerate(range(0, N, slot)):
            n = min(slot, N - off)
            s = S + (k % 2) * slot
            if done[k % 2] is not None:
                _cuda.stream_wait_event(X, done[k % 2])
            _cuda.memcpy_async(s, M + off, n, X)
            _cuda.stream_synchronize(X)
            _cuda.discard_batch([M + off], [n], X)
            _cuda.stream_synchronize(X)
            _cuda.memcpy_async(P + off, s, n, Y)
            ev = _cuda.event_create()
            _cuda.event_record(ev, Y)
            done[k % 2] = ev
        sync()
    return fn


def run(name, fn, prepare, check):
    ts, ok = [], True
    for rep in range(REPS + 1):
        prepare()
        t0 = time.perf_counter()
        fn()
        t = time.perf_counter() - t0
        ok = ok and check()
        if rep:
            ts.append(t)
    med = statistics.median(ts)
    R[name] = {"ms": round(med * 1e3, 3), "GBps": round(N / med / 1e9, 2), "intact": ok,
               "all_ms": [round(x * 1e3, 2) for x in ts]}
    progress(f"{name}: {R[name]['GBps']} GB/s ({R[name]['ms']} ms) intact={ok}")


out_ok = lambda: bool(torch.equal(pinned, ref.cpu()))  # noqa: E731
run("direct", direct, fresh, out_ok)
run("staged_full", staged_full, fresh, out_ok)
for slot in (64 * MiB, 128 * MiB, 256 * MiB):
    run(f"staged_ring_{slot >> 20}", staged_ring(slot), fresh, out_ok)


def evicted():
    fresh()
    direct()


def in_direct():
    _cuda.discard_and_prefetch_batch([M], [N], Location.DEVICE, 0, X)
    sync()
    _cuda.memcpy_async(M, P, N, X)
    sync()


def in_ring(slot):
    def fn():
        _cuda.discard_and_prefetch_batch([M], [N], Location.DEVICE, 0, X)
        sync()
        done = [None, None]
        for k, off in enumerate(range(0, N, slot)):
            n = min(slot, N - off)
            s = S + (k % 2) * slot
            if done[k % 2] is not None:
                _cuda.stream_wait_event(Y, done[k % 2])
            _cuda.memcpy_async(s, P + off, n, Y)      # over the link into the slot
            ev = _cuda.event_create()
            _cuda.event_record(ev, Y)
            _cuda.stream_wait_event(X, ev)
            _cuda.memcpy_async(M + off, s, n, X)      # slot -> managed, on the device
            ev2 = _cuda.event_create()
            _cuda.event_record(ev2, X)
            done[k % 2] = ev2
        sync()
    return fn


in_ok = lambda: bool(torch.equal(v, ref))  # noqa: E731
run("in_direct", in_direct, evicted, in_ok)
for slot in (64 * MiB, 128 * MiB, 256 * MiB):
    run(f"in_staged_ring_{slot >> 20}", in_ring(slot), evicted, in_ok)

dest = os.environ.get("OUT") or RESULTS
with open(os.path.join(dest, "probe_staged.json"), "w") as f:
    json.dump({**provenance(), **R}, f, indent=1)
