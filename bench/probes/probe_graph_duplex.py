"""Whether copies in both directions overlap when they are replayed from a CUDA graph, as they
do when launched eagerly: the link's rate, eager and replayed, one way and both ways at once.

The swapping plans' whole-step graphs replayed at 1.09-1.20x their bytes in both directions
taken one after the other at the one-way rate (bench/probes/probe_graph_plans.py, H100,
d16ed8c), where pinned copies run 84-94 GB/s both ways at once eagerly. This measures the link
alone: 1 GiB each way in 64 MiB pieces, host to device on one side stream and device to host on
another, forked from and joined to the capturing stream; pinned host memory; CUDA events;
medians of ``--reps`` after a warm-up. Modes: eager, one graph replayed, and (``pieces``) the
pieces of the two directions interleaved on one stream each with an event wait between
neighbours, as a step's copies wait for its compute.

    python bench/probes/probe_graph_duplex.py [--reps 10]
Writes $OUT/probe_graph_duplex.json (or bench/results/probe_graph_duplex-<date>.json).
"""
import argparse
import json
import os
import statistics
import time

import _path  # noqa: F401 - bench/ and the repository root on sys.path
from _common import provenance  # noqa: E402
import torch

GiB, MiB = 1 << 30, 1 << 20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--piece-mib", type=int, default=64)
    a = ap.parse_args()
    n, piece = GiB, a.piece_mib * MiB
    k = n // piece
    h_src = torch.empty(n, dtype=torch.uint8, pin_memory=True).random_(0, 255)
    h_dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d_src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    d_dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    s_in, s_out = torch.cuda.Stream(), torch.cuda.Stream()

    def h2d():
        for i in range(k):
            d_dst[i * piece:(i + 1) * piece].copy_(h_src[i * piece:(i + 1) * piece], non_blocking=True)

    def d2h():
        for i in range(k):
            h_dst[i * piece:(i + 1) * piece].copy_(d_src[i * piece:(i + 1) * piece], non_blocking=True)

    def on(streams_work):
        cur = torch.cuda.current_stream()
        for s, _ in streams_work:
            s.wait_stream(cur)
        for s, work in streams_work:
            with torch.cuda.stream(s):
                work()
        for s, _ in streams_work:
            cur.wait_stream(s)

    def chained():
        """Each direction's pieces on its own stream, each piece after the other direction's
        previous piece (as a step's copies wait on events of the other side)."""
        cur = torch.cuda.current_stream()
        s_in.wait_stream(cur)
        s_out.wait_stream(cur)
        for i in range(k):
            with torch.cuda.stream(s_in):
                d_dst[i * piece:(i + 1) * piece].copy_(h_src[i * piece:(i + 1) * piece], non_blocking=True)
                e_in = torch.cuda.Event()
                e_in.record(s_in)
            with torch.cuda.stream(s_out):
                h_dst[i * piece:(i + 1) * piece].copy_(d_src[i * piece:(i + 1) * piece], non_blocking=True)
                e_out = torch.cuda.Event()
                e_out.record(s_out)
            s_in.wait_event(e_out)
            s_out.wait_event(e_in)
        cur.wait_stream(s_in)
        cur.wait_stream(s_out)

    cases = {"h2d": lambda: on([(s_in, h2d)]), "d2h": lambda: on([(s_out, d2h)]),
             "both": lambda: on([(s_in, h2d), (s_out, d2h)]), "both_chained": chained}
    out = {"device": torch.cuda.get_device_name(), **provenance(),
           "date": time.strftime("%Y-%m-%d"), "piece_bytes": piece, "bytes_each_way": n, "GBps": {}}

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(a.reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1))
        return statistics.median(ts)

    for name, fn in cases.items():
        moved = (2 if name.startswith("both") else 1) * n
        eager = timed(fn)
        g = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            fn()
        replay = timed(g.replay)
        out["GBps"][name] = {"eager": round(moved / eager / 1e6, 2), "graph": round(moved / replay / 1e6, 2)}
        print(f"{name:<13} eager {moved / eager / 1e6:6.1f} GB/s   graph {moved / replay / 1e6:6.1f} GB/s", flush=True)
        del g
    assert torch.equal(d_dst[:piece].cpu(), h_src[:piece]) and torch.equal(h_dst[-piece:].cuda(), d_src[-piece:])
    dest = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "..", "results")
    name = "probe_graph_duplex.json" if os.environ.get("OUT") else f"probe_graph_duplex-{time.strftime('%Y%m%d')}.json"
    with open(os.path.join(dest, name), "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", os.path.join(dest, name))


if __name__ == "__main__":
    main()
