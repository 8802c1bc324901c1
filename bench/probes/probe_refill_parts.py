"""Probe: where does a group refill from the pinned shadow lose time against one big copy?

bench/bandwidth.py's prefetch_in_shadow (a 22-member activation group copied from its shadows back
into its parked pages) runs at ~0.89 of pinned H2D, where one 1 GiB copy into device-resident
managed pages runs at ~0.96 (probe_h2d_split.py). This times, in one process,
interleaved, on random data:
  tier          tier.prefetch(group) from the shadow into its parked pages (the bench's figure)
  raw22         the same 22 cudaMemcpyAsync calls (same pointers), without tiermem's bookkeeping
  raw_large     only the members of 2 MiB or more (scaled to their bytes)
  raw22_dap     raw22 after the group's pages were given back and made again by
                discard-and-prefetch (as a release=True refill leaves them)
  one_copy      one 1 GiB copy, CuPy pinned pool -> a fresh managed range prefetched to the device
  one_copy_dap  the same after discard-and-prefetch made its pages
and the host time of the tier.prefetch call. Medians of CUDA events after a warm-up.

    python bench/probes/probe_refill_parts.py [reps]
"""
from __future__ import annotations

import gc
import sys
import time

import _path  # noqa: F401  (bench/ and the repository on sys.path)
from _common import gbps, median, progress, table, write_results

GiB = 1 << 30
MiB = 1 << 20


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    import cupy
    import torch
    from bandwidth import piece_sizes

    import tiermem
    from tiermem import Location
    from tiermem.cuda import runtime as _cuda
    from tiermem.cuda.backend import _ArrayInterface

    N = GiB
    s = torch.cuda.Stream()
    sp = s.cuda_stream

    def timed(fn) -> float:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(s)
        fn()
        b.record(s)
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    tier = tiermem.Tier(0, cap="2GiB", budget="2GiB")
    sizes = piece_sizes(N)
    A = tier.empty_group([((n,), "uint8") for n in sizes], role="activation")
    for t in A:
        v = t.torch()
        v.copy_(torch.randint(0, 256, (t.nbytes,), dtype=torch.uint8, device="cuda"))
        del v
    gc.collect()
    tier.evict(A)
    torch.cuda.synchronize()
    assert all(t.parked for t in A)
    bufs = [t._b for t in A]
    pairs = [(b.ptr, b.shadow.ptr, b.nbytes) for b in bufs]
    large = [p for p in pairs if p[2] >= 2 * MiB]
    large_bytes = sum(p[2] for p in large)

    def raw(ps):
        for dst, src, n in ps:
            _cuda.memcpy_async(dst, src, n, sp)

    # one big copy, for the cap on this machine, into pages made two ways
    man = _cuda.managed_alloc(N, 0)
    pin = cupy.cuda.alloc_pinned_memory(N)
    pv = torch.as_tensor(_ArrayInterface(pin.ptr, N, None), device="cuda")
    pv.copy_(torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda"))
    _cuda.prefetch(man.ptr, N, Location.DEVICE, 0, sp)
    torch.cuda.synchronize()

    host_s, times = [], {k: [] for k in ("tier", "raw22", "raw_large", "raw22_dap", "one_copy", "one_copy_dap")}
    for rnd in range(reps + 1):
        progress(f"round {rnd + 1}/{reps + 1}")
        got = {}
        tier.evict(A)
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            t0 = time.perf_counter()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(s)
            tier.prefetch(A)
            h = time.perf_counter() - t0
            b.record(s)
            b.synchronize()
            got["tier"] = a.elapsed_time(b) / 1e3
        # A is resident again, its shadow holds the same bytes: copying it in again is harmless
        got["raw22"] = timed(lambda: raw(pairs))
        got["raw_large"] = timed(lambda: raw(large)) * N / large_bytes
        got["one_copy"] = timed(lambda: _cuda.memcpy_async(man.ptr, pin.ptr, N, sp))
        # pages made by discard-and-prefetch, as after a release
        tier.evict(A, release=True)
        tier.prefetch(A)
        _cuda.discard_and_prefetch_batch([man.ptr], [N], Location.DEVICE, 0, sp)
        torch.cuda.synchronize()
        got["raw22_dap"] = timed(lambda: raw([(b.ptr, b.shadow.ptr, b.nbytes) for b in bufs]))
        got["one_copy_dap"] = timed(lambda: _cuda.memcpy_async(man.ptr, pin.ptr, N, sp))
        if rnd > 0:
            host_s.append(h)
            for k, v in got.items():
                times[k].append(v)

    h2d = torch.empty(N, dtype=torch.uint8, device="cuda")
    ceiling = [timed(lambda: _cuda.memcpy_async(h2d.data_ptr(), pin.ptr, N, sp)) for _ in range(reps + 1)][1:]
    metrics = {f"{k}_GBps": gbps(N, median(v)) for k, v in times.items()}
    metrics["pinned_h2d_GBps"] = gbps(N, median(ceiling))
    for k in times:
        metrics[f"{k}_vs_pinned_h2d"] = round(metrics[f"{k}_GBps"] / metrics["pinned_h2d_GBps"], 3)
    metrics["tier_prefetch_host_ms"] = round(median(host_s) * 1e3, 3)
    print(table([[k, v] for k, v in metrics.items()], ["metric", "value"]))
    write_results("probe_refill_parts", metrics, {}, {"reps": reps, "times_s": times, "host_s": host_s,
                                                     "sizes": sizes})


if __name__ == "__main__":
    main()
