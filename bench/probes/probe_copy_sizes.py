"""Pinned host <-> device copies by piece size, alone and while the GPU computes.

The training plan (NOTE [recompute plan] in tiermem/training/plan.py) prices every byte it moves at
one link rate, measured with large buffers. A step's swap moves saved activations one storage at
a time (1-64 MiB each), and its moves run while the GPU computes. A plan that swaps more and
recomputes less replayed 30% slower than the model predicted (docs/training.md, "Whole-step
graphs"). This measures the two things that rate leaves out: the size of each copy, and a
compute stream busy beside it (bf16 matmuls on the default stream).

Each case copies about 1 GiB of random bytes in pieces of one size, on a side stream, timed with
CUDA events after a warm-up; medians of three. Directions: in (pinned -> device), out
(device -> pinned), both (one stream each, at once).

    python bench/probes/probe_copy_sizes.py
"""
import statistics
import sys

import _path  # noqa: F401 - bench/ and the repository root on sys.path
import torch
from _common import progress, write_results

MiB = 1 << 20
TOTAL = 1024 * MiB
SIZES_MIB = [1, 2, 4, 8, 16, 64, 256]


def _copies(stream, pairs):
    with torch.cuda.stream(stream):
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)


def _buffers():
    """Random bytes to send each way, and where they land (made once: pinning takes a while)."""
    return (torch.randint(0, 255, (TOTAL,), dtype=torch.uint8).pin_memory(),
            torch.randint(0, 255, (TOTAL,), dtype=torch.uint8, device="cuda"),
            torch.empty(TOTAL, dtype=torch.uint8).pin_memory(),
            torch.empty(TOTAL, dtype=torch.uint8, device="cuda"),
            torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16))


def _time(bufs, direction, size, busy):
    host, dev, host2, dev2, a = bufs
    pieces = [slice(i * size, (i + 1) * size) for i in range(TOTAL // size)]
    s_in, s_out = torch.cuda.Stream(), torch.cuda.Stream()
    out = []
    for rep in range(4):
        torch.cuda.synchronize()
        if busy:                        # the default stream computes all the while (~90 ms on an H100)
            for _ in range(60):
                a @ a
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(s_in)
        s_out.wait_event(start)
        if direction in ("in", "both"):
            _copies(s_in, [(dev2[p], host[p]) for p in pieces])
        if direction in ("out", "both"):
            _copies(s_out, [(host2[p], dev[p]) for p in pieces])
        s_in.wait_stream(s_out)
        end.record(s_in)
        torch.cuda.synchronize()
        if rep:
            moved = TOTAL * (2 if direction == "both" else 1)
            out.append(moved / (start.elapsed_time(end) / 1e3) / 1e9)
    return round(statistics.median(out), 2)


def main():
    if not torch.cuda.is_available():
        print("probe_copy_sizes: no CUDA GPU", file=sys.stderr)
        return 2
    metrics, bufs = {}, _buffers()
    for direction in ("in", "out", "both"):
        for busy in (False, True):
            key = f"{direction}_{'busy' if busy else 'idle'}"
            got = {s: _time(bufs, direction, s * MiB, busy) for s in SIZES_MIB}
            metrics.update({f"{key}_{s}MiB_GBps": v for s, v in got.items()})
            progress(f"{key:10s} GB/s by piece (MiB): {got}")
    write_results("probe_copy_sizes", metrics, {})
    return 0


if __name__ == "__main__":
    sys.exit(main())
