"""Exploration: which copy+discard chunking makes dirty eviction fast every time, not just on average.
1 GiB of managed memory; prints every rep. Writes $OUT/probe_evict_chunks.json."""
from __future__ import annotations

import json
import os

import torch
from _common import gbps, progress
from _path import RESULTS  # bench/ and the repository on sys.path

from tiermem import Location
from tiermem.cuda import runtime as _cuda
from tiermem.cuda.backend import CudaBackend, _ArrayInterface

GiB, MiB = 1 << 30, 1 << 20
N = GiB
torch.cuda.set_stream(torch.cuda.Stream())   # discard refuses the legacy default stream
s = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
be = CudaBackend(0, cap="2GiB")
M = be.allocate(N, "probe/large").ptr
P = be.host_alloc(N)
view = torch.as_tensor(_ArrayInterface(M, N, None), device="cuda")
ref = torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda")
_cuda.prefetch(M, N, Location.DEVICE, 0, s())
view.copy_(ref)
R = {}


def timed(fn):
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); fn(); b.record(); b.synchronize()
    return a.elapsed_time(b) / 1e3


def interleaved(ch):
    def fn():
        for off in range(0, N, ch):
            be.copy(P.ptr + off, M + off, ch, s())
            be.discard([(M + off, ch)], s())
    return fn


def lagged(ch):
    """Discard chunk i after chunk i+1's copy is queued: the copy engine never waits on a discard."""
    def fn():
        prev = None
        for off in range(0, N, ch):
            be.copy(P.ptr + off, M + off, ch, s())
            if prev is not None:
                be.discard([(M + prev, ch)], s())
            prev = off
        be.discard([(M + prev, ch)], s())
    return fn


def refill():
    be.discard_and_prefetch([(M, N)], Location.DEVICE, s())
    be.copy(M, P.ptr, N, s())


for name, mk in (("interleaved", interleaved), ("lagged", lagged)):
    for ch in (16 * MiB, 32 * MiB, 64 * MiB, 128 * MiB):
        ev, rf, ok = [], [], True
        for rep in range(6):
            view.add_(1); ref.add_(1)
            ev.append(gbps(N, timed(mk(ch))))
            rf.append(gbps(N, timed(refill)))
            ok = ok and bool(torch.equal(view, ref))
        R[f"{name}_{ch >> 20}MiB"] = {"evict": ev, "refill": rf, "intact": ok}
        progress(f"{name} {ch >> 20} MiB: {R[f'{name}_{ch >> 20}MiB']}")
dest = os.environ.get("OUT") or RESULTS
with open(os.path.join(dest, "probe_evict_chunks.json"), "w") as f:
    json.dump(R, f, indent=1)
