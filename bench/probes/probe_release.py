"""Exploration for issue 3: which call gives device-resident managed pages back fastest once their
bytes are safe in a pinned copy, and what bringing them back then costs. 1 GiB managed, 1 GiB
pinned; host times of each call (the call returns once its work is done: probe_discard_overlap).

  discard            cudaMemDiscardBatchAsync
  dp_host            cudaMemDiscardAndPrefetchBatchAsync to the host
Then each is refilled by discard-and-prefetch to the device plus a copy from the pinned bytes.
Writes $OUT/probe_release.json.
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
m = _cuda.managed_alloc(N, 0)
v = device_view(m.ptr, N)
R: dict = {"device": torch.cuda.get_device_name()}


def host_ms(fn):
    _cuda.stream_synchronize(X)
    t0 = time.perf_counter()
    fn()
    _cuda.stream_synchronize(X)
    return (time.perf_counter() - t0) * 1e3


release = {
    "discard": lambda: _cuda.discard_batch([m.ptr], [N], X),
    "dp_host": lambda: _cuda.discard_and_prefetch_batch([m.ptr], [N], Location.HOST, 0, X),
}
for name, fn in release.items():
    rel, dp, cp, ok = [], [], [], True
    free0 = None
    for rep in range(REPS + 1):
        _cuda.discard_and_prefetch_batch([m.ptr], [N], Location.DEVICE, 0, X)
        _cuda.stream_synchronize(X)
        ref.add_(1)
        v.copy_(ref)
        torch.cuda.synchronize()
        _cuda.memcpy_async(P, m.ptr, N, X)
        _cuda.stream_synchronize(X)
        free_before = _cuda.mem_get_info(0)[0]
        r = host_ms(fn)
        free_after = _cuda.mem_get_info(0)[0]
        d = host_ms(lambda: _cuda.discard_and_prefetch_batch([m.ptr], [N], Location.DEVICE, 0, X))
        c = host_ms(lambda: _cuda.memcpy_async(m.ptr, P, N, X))
        ok = ok and bool(torch.equal(v, ref))
        if rep:
            rel.append(r), dp.append(d), cp.append(c)
            free0 = (free_after - free_before) / N
    R[name] = {"release_ms": round(statistics.median(rel), 3), "refill_dp_ms": round(statistics.median(dp), 3),
               "refill_copy_ms": round(statistics.median(cp), 3), "intact": ok,
               "free_gain_per_byte": round(free0, 3), "all_release_ms": [round(x, 2) for x in rel]}
    progress(f"{name}: {R[name]}")

dest = os.environ.get("OUT") or RESULTS
with open(os.path.join(dest, "probe_release.json"), "w") as f:
    json.dump({**provenance(), **R}, f, indent=1)
