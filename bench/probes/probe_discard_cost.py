"""Exploration for issue 3: where the fenced dirty eviction loses its ~17% (NOTE [discard fence]),
and whether a pipelined order wins it back. 1 GiB of managed memory, 1 GiB pinned; prints every
variant. Writes $OUT/probe_discard_cost.json.

  copy_only         16 x 64 MiB copies to the pinned shadow, nothing else: the ceiling
  fenced_<k>        the engine's order: all copies, drain, one discard call of k ranges, drain
  discard_<k>       the discard call alone (host time of the call, then time until drained)
  pipe_<c>          copies on stream C, an event per c MiB; the host discards each piece on
                    stream D as soon as its copies are done, draining D after each one, so the
                    discard of piece i runs while piece i+1 is copied
Every variant refills through the fenced path and checks the bytes before the next rep.
The committed results (bench/results/probe_discard_cost-*.json) were taken at 22b267c, when the
fence waited on a blocking-sync event; it now spins in cudaStreamSynchronize.
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
from tiermem.cuda.backend import CudaBackend

GiB, MiB = 1 << 30, 1 << 20
N = GiB
REPS = 7
be = CudaBackend(0, cap="2GiB")
C = be.new_stream()
D = be.new_stream()
M = be.allocate(N, "probe/large").ptr
P = be.host_alloc(N)
torch.cuda.set_stream(torch.cuda.Stream())
view = device_view(M, N)
ref = torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda")
_cuda.prefetch(M, N, Location.DEVICE, 0, C)
_cuda.stream_synchronize(C)
view.copy_(ref)
torch.cuda.synchronize()
R: dict = {}


def pieces(size):
    return [(M + off, min(size, N - off)) for off in range(0, N, size)]


def copies(stream, size=64 * MiB):
    for p, n in pieces(size):
        be.copy(P.ptr + (p - M), p, n, stream)


def refill():
    be.discard_and_prefetch([(M, N)], Location.DEVICE, C)
    be.copy(M, P.ptr, N, C)
    _cuda.stream_synchronize(C)


def run(name, fn, evicts=True):
    times, extra, ok = [], [], True
    for rep in range(REPS + 1):
        view.add_(1)
        ref.add_(1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x = fn()
        _cuda.stream_synchronize(C)
        _cuda.stream_synchronize(D)
        t = time.perf_counter() - t0
        if rep:
            times.append(t)
            if x is not None:
                extra.append(x)
        if evicts:
            refill()
            ok = ok and bool(torch.equal(view, ref))
    med = statistics.median(times)
    R[name] = {"ms": round(med * 1e3, 3), "GBps": round(N / med / 1e9, 2),
               "all_ms": [round(t * 1e3, 2) for t in times], "intact": ok}
    if extra:
        R[name]["split_ms"] = [[round(v * 1e3, 3) for v in e] for e in extra]
    progress(f"{name}: {R[name]['GBps']} GB/s ({R[name]['ms']} ms) intact={ok} {R[name].get('split_ms', '')}")


run("copy_only", lambda: copies(C), evicts=False)


def fenced(k):
    def fn():
        copies(C)
        be.discard(pieces(N // k), C)
    return fn


for k in (1, 16, 512):
    run(f"fenced_{k}", fenced(k))


def discard_alone(k):
    def fn():
        copies(C)
        _cuda.stream_drain(C)
        t0 = time.perf_counter()
        rs = pieces(N // k)
        _cuda.discard_batch([p for p, _ in rs], [n for _, n in rs], C)
        t1 = time.perf_counter()
        _cuda.stream_drain(C)
        t2 = time.perf_counter()
        return (t1 - t0, t2 - t1)
    return fn


for k in (1, 16, 512):
    run(f"discard_{k}", discard_alone(k))


def pipe(piece):
    def fn():
        evs = []
        for p, n in pieces(piece):
            for q, m in [(p + o, min(64 * MiB, n - o)) for o in range(0, n, 64 * MiB)]:
                be.copy(P.ptr + (q - M), q, m, C)
            ev = _cuda.event_create()
            _cuda.event_record(ev, C)
            evs.append((ev, p, n))
        for ev, p, n in evs:
            _cuda.event_synchronize(ev)
            _cuda.discard_batch([p], [n], D)
            _cuda.stream_drain(D)
    return fn


for piece in (64 * MiB, 128 * MiB, 256 * MiB, 512 * MiB):
    run(f"pipe_{piece >> 20}", pipe(piece))

R["device"] = torch.cuda.get_device_name()
dest = os.environ.get("OUT") or RESULTS
with open(os.path.join(dest, "probe_discard_cost.json"), "w") as f:
    json.dump({**provenance(), **R}, f, indent=1)
