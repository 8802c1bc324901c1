"""Probe: is ~50 GB/s into managed pages a per-copy-engine limit that splitting beats?

docs/facts.md: pinned -> cudaMalloc memory runs at ~55 GB/s, pinned -> device-resident managed pages at
~50, a migration prefetch at ~49.5. This times 1 GiB of random data each way, split into k equal
pieces on k streams (k = 1, 2, 4), into and out of cudaMalloc memory and device-resident managed
pages, and a migration prefetch split the same way; plus torch's copy_ from the pinned buffer
(viewed as a CUDA tensor) into the managed one, a kernel that pulls over the link. Rounds are
interleaved; medians of CUDA events after a warm-up.

    python bench/probes/probe_h2d_split.py [reps]
"""
from __future__ import annotations

import sys

import _path  # noqa: F401  (bench/ and the repository on sys.path)
from _common import device_view, gbps, median, progress, table, write_results

GiB = 1 << 30


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    import torch

    from tiermem import Location
    from tiermem.cuda import runtime as _cuda

    N = GiB
    dev = torch.empty(N, dtype=torch.uint8, device="cuda")
    man = _cuda.managed_alloc(N, 0)
    mv = device_view(man.ptr, N)
    pin_ptr = _cuda.host_alloc(N)
    pv = device_view(pin_ptr, N)   # UVA view of pinned
    ref = torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda")
    pv.copy_(ref)
    streams = [torch.cuda.Stream() for _ in range(4)]
    main_s = torch.cuda.current_stream()
    _cuda.prefetch(man.ptr, N, Location.DEVICE, 0, main_s.cuda_stream)
    torch.cuda.synchronize()

    def split(k, op):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(main_s)
        ends = []
        piece = N // k
        for i in range(k):
            s = streams[i]
            s.wait_event(a)
            op(i * piece, piece, s.cuda_stream)
            e = torch.cuda.Event()
            e.record(s)
            ends.append(e)
        for e in ends:
            main_s.wait_event(e)
        b.record(main_s)
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    def to_host():
        _cuda.prefetch(man.ptr, N, Location.HOST, 0, main_s.cuda_stream)
        torch.cuda.synchronize()

    def to_dev():
        _cuda.prefetch(man.ptr, N, Location.DEVICE, 0, main_s.cuda_stream)
        torch.cuda.synchronize()

    variants = {}
    for k in (1, 2, 4):
        variants[f"h2d_cudaMalloc_k{k}"] = (None, lambda o, n, s: _cuda.memcpy_async(dev.data_ptr() + o, pin_ptr + o, n, s), k)
        variants[f"h2d_managed_k{k}"] = (to_dev, lambda o, n, s: _cuda.memcpy_async(man.ptr + o, pin_ptr + o, n, s), k)
        variants[f"d2h_cudaMalloc_k{k}"] = (None, lambda o, n, s: _cuda.memcpy_async(pin_ptr + o, dev.data_ptr() + o, n, s), k)
        variants[f"d2h_managed_k{k}"] = (to_dev, lambda o, n, s: _cuda.memcpy_async(pin_ptr + o, man.ptr + o, n, s), k)
        variants[f"migrate_in_k{k}"] = (to_host, lambda o, n, s: _cuda.prefetch(man.ptr + o, n, Location.DEVICE, 0, s), k)

    def pull(o, n, s):
        with torch.cuda.stream(torch.cuda.ExternalStream(s)):
            mv[o:o + n].copy_(pv[o:o + n])
    for k in (1, 2):
        variants[f"h2d_managed_pull_kernel_k{k}"] = (to_dev, pull, k)

    times: dict[str, list[float]] = {k: [] for k in variants}
    for rnd in range(reps + 1):
        progress(f"round {rnd + 1}/{reps + 1}")
        for name, (setup, op, k) in variants.items():
            if setup is not None:
                setup()
            torch.cuda.synchronize()
            t = split(k, op)
            if rnd > 0:
                times[name].append(t)
    # every h2d variant wrote the pinned data into its destination: check the last ones
    checks = {"managed_intact": bool(torch.equal(mv, ref)), "cudaMalloc_intact": bool(torch.equal(dev, ref))}
    metrics = {k: gbps(N, median(v)) for k, v in times.items()}
    base_in, base_out = metrics["h2d_cudaMalloc_k1"], metrics["d2h_cudaMalloc_k1"]
    for k in list(metrics):
        metrics[k + "_vs_pinned"] = round(metrics[k] / (base_out if k.startswith("d2h") else base_in), 3)
    print(table([[k, metrics[k], metrics[k + "_vs_pinned"]] for k in times], ["variant", "GB/s", "vs pinned k1"]))
    write_results("probe_h2d_split", metrics, checks, {"reps": reps, "times_s": times})
    _cuda.host_free(pin_ptr)


if __name__ == "__main__":
    main()
