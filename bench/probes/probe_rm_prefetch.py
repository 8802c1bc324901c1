"""Probe: which part of a read-mostly prefetch-in is slow on this machine (docs/data-paths.md,
"Frozen weights and read-mostly")?

One 1 GiB managed range of random data, host-resident before each timed prefetch to the device,
under four kinds of advice. Each variant is timed twice, in interleaved rounds, in one process.
  plain        no advice; written back to the host by a prefetch to the host (a migration in)
  pref_host    preferred location host; the same write-back (a migration in)
  rm           read-mostly; the device copy dropped by unsetting and setting read-mostly (duplication in)
  rm_pref_host read-mostly + preferred location host, dropped the same way: frozen_weight's policy,
               what bench/bandwidth.py's prefetch_in times
Medians of CUDA events after a warm-up. Writes bench/results/probe_rm_prefetch-<device>-<date>.json.

    python bench/probes/probe_rm_prefetch.py [reps]
"""
from __future__ import annotations

import gc
import sys

import _path  # noqa: F401  (bench/ and the repository on sys.path)
from _common import cuda_times, device_view, gbps, median, progress, table, write_results

GiB = 1 << 30


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    import torch

    from tiermem import Location
    from tiermem.cuda import runtime as _cuda

    N = GiB
    cur = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    m = _cuda.managed_alloc(N, 0)
    v = device_view(m.ptr, N)
    ref = torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda")
    _cuda.prefetch(m.ptr, N, Location.DEVICE, 0, cur())
    v.copy_(ref)
    torch.cuda.synchronize()

    def advise(kind, on, where=Location.DEVICE):
        _cuda.advise(m.ptr, N, kind, on, where, 0)

    def set_variant(name):
        advise("read_mostly", False)
        advise("preferred_location", False)
        _cuda.prefetch(m.ptr, N, Location.HOST, 0, cur())      # every variant starts on the host
        torch.cuda.synchronize()
        if name in ("pref_host", "rm_pref_host"):
            advise("preferred_location", True, Location.HOST)
        if name in ("rm", "rm_pref_host"):
            advise("read_mostly", True)

    def to_host(name):
        if name.startswith("rm"):
            advise("read_mostly", False)    # the copies collapse onto the host (preferred or last)
            advise("read_mostly", True)
        else:
            _cuda.prefetch(m.ptr, N, Location.HOST, 0, cur())
        torch.cuda.synchronize()

    variants = ["plain", "pref_host", "rm", "rm_pref_host"]
    runs: dict[str, list[float]] = {k: [] for k in variants}
    intact: dict[str, bool] = {}
    for rnd in range(2):
        for name in variants:
            progress(f"round {rnd + 1}: {name}")
            set_variant(name)
            ts = cuda_times(lambda: _cuda.prefetch(m.ptr, N, Location.DEVICE, 0, cur()), reps,
                            setup=lambda: to_host(name))
            runs[name].append(gbps(N, median(ts)))
            intact[name] = bool(torch.equal(v, ref))
    h = torch.empty(N, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(N, dtype=torch.uint8, device="cuda")
    h.copy_(ref)
    pinned = gbps(N, median(cuda_times(lambda: d.copy_(h, non_blocking=True), reps)))
    metrics = {f"{k}_GBps": runs[k] for k in variants}
    metrics["pinned_h2d_GBps"] = pinned
    for k in variants:
        metrics[f"{k}_vs_pinned_h2d"] = [round(x / pinned, 3) for x in runs[k]]
    print(table([[k, *runs[k], *metrics[f"{k}_vs_pinned_h2d"]] for k in variants] + [["pinned_h2d", pinned, "", "", ""]],
                ["variant", "GB/s round 1", "GB/s round 2", "vs pinned 1", "vs pinned 2"]))
    del v, m
    gc.collect()
    write_results("probe_rm_prefetch", metrics, {"data_intact": all(intact.values())}, {"reps": reps, "intact": intact})


if __name__ == "__main__":
    main()
