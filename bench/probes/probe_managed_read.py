"""Exploration for issue 3: copies out of device-resident managed memory run at ~52 GB/s where the
same copy out of cudaMalloc memory runs at ~55 (docs/facts.md). Does how the managed pages were
populated or advised change that, and does it change what the discard after it costs?
1 GiB managed at a time, 1 GiB pinned. Writes $OUT/probe_managed_read.json.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch
from _path import RESULTS  # first: puts bench/ and the repository on sys.path
from _common import device_view, progress, provenance  # noqa: E402

from tiermem import Location
from tiermem.cuda import runtime as _cuda

GiB, MiB = 1 << 30, 1 << 20
N = GiB
REPS = 7
X = _cuda.stream_create(0)
P = _cuda.host_alloc(N)
torch.cuda.set_stream(torch.cuda.Stream())
ref = torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda")
R: dict = {"device": torch.cuda.get_device_name()}


def timed_copy(src, chunk):
    ts = []
    for rep in range(REPS + 1):
        a, b = _cuda.event_create(timing=True), _cuda.event_create(timing=True)
        _cuda.event_record(a, X)
        for o in range(0, N, chunk):
            _cuda.memcpy_async(P + o, src + o, min(chunk, N - o), X)
        _cuda.event_record(b, X)
        _cuda.event_synchronize(b)
        if rep:
            ts.append(_cuda.event_elapsed_ms(a, b))
    return round(N / statistics.median(ts) / 1e6, 2)


def blocking_drain():
    """What tiermem's fence used until this probe: a blocking-sync event."""
    from cuda.bindings import runtime as rt
    err, ev = rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming | rt.cudaEventBlockingSync)
    assert int(err) == 0
    _cuda.event_record(ev, X)
    assert int(rt.cudaEventSynchronize(ev)[0]) == 0
    rt.cudaEventDestroy(ev)


def spin_drain():
    ev = _cuda.event_create()
    _cuda.event_record(ev, X)
    while not _cuda.event_query(ev):
        pass


plain = torch.empty(N, dtype=torch.uint8, device="cuda")
plain.copy_(ref)
torch.cuda.synchronize()
R["plain"] = {"GBps_1call": timed_copy(plain.data_ptr(), N), "GBps_64MiB": timed_copy(plain.data_ptr(), 64 * MiB)}
progress(f"plain {R['plain']}")
del plain


def populate(how):
    m = _cuda.managed_alloc(N, 0)
    p = m.ptr
    if how in ("pref_device", "pref_and_accessed"):
        _cuda.advise(p, N, "preferred_location", True, Location.DEVICE, 0)
    if how in ("accessed_by", "pref_and_accessed"):
        _cuda.advise(p, N, "accessed_by", True, Location.DEVICE, 0)
    v = device_view(p, N)
    if how == "first_touch":
        pass
    elif how == "discard_prefetch":
        _cuda.discard_and_prefetch_batch([p], [N], Location.DEVICE, 0, X)
    else:
        _cuda.prefetch(p, N, Location.DEVICE, 0, X)
    _cuda.stream_synchronize(X)
    v.copy_(ref)
    torch.cuda.synchronize()
    return m, v


for how in ("prefetch", "first_touch", "discard_prefetch", "pref_device", "accessed_by", "pref_and_accessed"):
    m, v = populate(how)
    r = {"GBps_1call": timed_copy(m.ptr, N), "GBps_64MiB": timed_copy(m.ptr, 64 * MiB)}
    # the eviction's order, with a spinning and with a blocking-sync drain, then the discard
    for drain in ("blocking", "spin"):
        ts, dts = [], []
        for rep in range(REPS + 1):
            _cuda.discard_and_prefetch_batch([m.ptr], [N], Location.DEVICE, 0, X)
            _cuda.stream_synchronize(X)
            v.copy_(ref)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for o in range(0, N, 64 * MiB):
                _cuda.memcpy_async(P + o, m.ptr + o, 64 * MiB, X)
            (blocking_drain() if drain == "blocking" else spin_drain())
            t1 = time.perf_counter()
            _cuda.discard_batch([m.ptr], [N], X)
            (blocking_drain() if drain == "blocking" else spin_drain())
            t2 = time.perf_counter()
            if rep:
                ts.append(t2 - t0)
                dts.append(t2 - t1)
        r[f"evict_{drain}_GBps"] = round(N / statistics.median(ts) / 1e9, 2)
        r[f"discard_{drain}_ms"] = round(statistics.median(dts) * 1e3, 3)
    R[how] = r
    progress(f"{how} {r}")
    del v
    del m
    torch.cuda.synchronize()

dest = os.environ.get("OUT") or RESULTS
with open(os.path.join(dest, "probe_managed_read.json"), "w") as f:
    json.dump({**provenance(), **R}, f, indent=1)
