"""Exploration: which eviction/refill pattern through a pinned shadow stays fast rep after rep.
Prints every rep (not medians). 1 GiB managed. Writes $OUT/probe_refill2.json."""
from __future__ import annotations

import json
import os

import torch
from _common import gbps, progress
from _path import RESULTS  # bench/ and the repository on sys.path

from tiermem import Location
from tiermem.cuda import runtime as _cuda
from tiermem.cuda.backend import CudaBackend

GiB, MiB = 1 << 30, 1 << 20
N, CH = GiB, 64 * MiB
torch.cuda.set_stream(torch.cuda.Stream())   # discard refuses the legacy default stream
s = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
be = CudaBackend(0, cap="2GiB")
blk = be.allocate(N, "probe/large")
M = blk.ptr
P = be.host_alloc(N)
view = torch.as_tensor(__import__("tiermem.cuda.backend", fromlist=["x"])._ArrayInterface(M, N, None), device="cuda")
ref = torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda")
_cuda.prefetch(M, N, Location.DEVICE, 0, s())
view.copy_(ref)
R = {}


def timed(fn):
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); fn(); b.record(); b.synchronize()
    return a.elapsed_time(b) / 1e3


def ev_chunked():
    for off in range(0, N, CH):
        be.copy(P.ptr + off, M + off, CH, s())
        be.discard([(M + off, CH)], s())


def ev_copy_sync_discard_whole():
    be.copy(P.ptr, M, N, s()); torch.cuda.synchronize(); be.discard([(M, N)], s())


def ev_copy_only():
    be.copy(P.ptr, M, N, s())


def rf_dp_whole():
    be.discard_and_prefetch([(M, N)], Location.DEVICE, s()); be.copy(M, P.ptr, N, s())


def rf_dp_chunked():
    for off in range(0, N, CH):
        be.discard_and_prefetch([(M + off, CH)], Location.DEVICE, s()); be.copy(M + off, P.ptr + off, CH, s())


def rf_copy_only():
    be.copy(M, P.ptr, N, s())


def rf_prefetch_chunked_copy():
    for off in range(0, N, CH):
        _cuda.prefetch(M + off, CH, Location.DEVICE, 0, s()); be.copy(M + off, P.ptr + off, CH, s())


cases = [("chunked", ev_chunked, rf_dp_whole), ("chunked", ev_chunked, rf_dp_chunked),
         ("sync_whole", ev_copy_sync_discard_whole, rf_dp_whole), ("sync_whole", ev_copy_sync_discard_whole, rf_dp_chunked),
         ("copy_only", ev_copy_only, rf_copy_only), ("chunked", ev_chunked, rf_prefetch_chunked_copy)]
for ev_name, ev, rf in cases:
    key = f"{ev_name}+{rf.__name__}"
    outs, ins, ok = [], [], True
    for rep in range(6):
        view.add_(1); ref.add_(1)           # dirty, different data every rep
        outs.append(gbps(N, timed(ev)))
        ins.append(gbps(N, timed(rf)))
        ok = ok and bool(torch.equal(view, ref))
    R[key] = {"evict": outs, "refill": ins, "intact": ok}
    progress(f"{key}: {R[key]}")

dest = os.environ.get("OUT") or RESULTS
with open(os.path.join(dest, "probe_refill2.json"), "w") as f:
    json.dump(R, f, indent=1)
