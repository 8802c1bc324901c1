"""Can one GPU take its streamed weights over two links? Two GPUs of one host, pinned host memory:
the rate of 1 GiB landing on GPU 0 straight over its own link, over both links at once (half
straight, half through GPU 1 and on over the GPUs' peer link, in pipelined chunks), and the
pieces that bound it (each link alone and both at once one way, the peer copy alone).

    python bench/probes/probe_stripe.py [chunk MiB]

Prints GB/s (medians of five after a warm-up, CUDA events) and writes probe_stripe-<device>-<date>.json.
"""
import statistics
import sys

import _path  # noqa: F401  (bench/ and the repository root on sys.path)
import torch
from _common import write_results

GiB = 1 << 30
CHUNK = int(sys.argv[1]) << 20 if len(sys.argv) > 1 else 64 << 20


def timed(streams, work, reps=5):
    """GB/s of 1 GiB by ``work()`` queued on ``streams`` (all joined to GPU 0's first)."""
    out = []
    for r in range(reps + 1):
        for s in streams:
            s.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(streams[0])
        for s in streams[1:]:
            s.wait_event(e0)
        ends = work()
        for e in ends:
            streams[0].wait_event(e)
        e1.record(streams[0])
        e1.synchronize()
        if r:
            out.append(GiB / (e0.elapsed_time(e1) / 1e3) / 1e9)
    return round(statistics.median(out), 1)


def main():
    assert torch.cuda.device_count() >= 2, "needs two GPUs"
    host = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    d0 = torch.empty(GiB, dtype=torch.uint8, device="cuda:0")
    d1 = torch.empty(GiB, dtype=torch.uint8, device="cuda:1")
    stage = torch.empty(2 * CHUNK, dtype=torch.uint8, device="cuda:1")     # GPU 1's two staging chunks
    s0a, s0b = torch.cuda.Stream("cuda:0"), torch.cuda.Stream("cuda:0")
    s1a, s1b = torch.cuda.Stream("cuda:1"), torch.cuda.Stream("cuda:1")
    res = {"peer_access": torch.cuda.can_device_access_peer(0, 1), "chunk_bytes": CHUNK}

    def h2d(dst, src, s):
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)
        e = torch.cuda.Event()
        e.record(s)
        return e

    res["h2d_gpu0_alone"] = timed([s0a], lambda: [h2d(d0, host, s0a)])
    res["h2d_gpu1_alone"] = timed([s1a], lambda: [h2d(d1, host, s1a)])

    def both():
        return [h2d(d0, host, s0a), h2d(d1, host2, s1a)]
    res["h2d_both_at_once_each"] = timed([s0a, s1a], both)      # GiB on GPU 0's clock; GPU 1's ran beside it

    def peer():
        with torch.cuda.stream(s0b):
            d0.copy_(d1, non_blocking=True)
        e = torch.cuda.Event()
        e.record(s0b)
        return [e]
    res["peer_1_to_0"] = timed([s0b], peer)

    def striped(share):
        """``share`` of the GiB through GPU 1 in chunks (H2D on s1a into one of two staging chunks,
        then GPU 1 -> GPU 0 on s1b), the rest straight on s0a."""
        via = int(GiB * share) // CHUNK * CHUNK
        ends = [h2d(d0[via:], host[via:], s0a)]
        free = [None, None]
        for k, at in enumerate(range(0, via, CHUNK)):
            b = stage[(k % 2) * CHUNK:(k % 2 + 1) * CHUNK]
            if free[k % 2] is not None:
                s1a.wait_event(free[k % 2])
            landed = h2d(b, host[at:at + CHUNK], s1a)
            s1b.wait_event(landed)
            with torch.cuda.stream(s1b):
                d0[at:at + CHUNK].copy_(b, non_blocking=True)
            free[k % 2] = torch.cuda.Event()
            free[k % 2].record(s1b)
        ends.append(free[(len(range(0, via, CHUNK)) - 1) % 2] or torch.cuda.Event())
        return ends
    for share in (0.25, 0.4, 0.5):
        res[f"striped_via_gpu1_{share}"] = timed([s0a, s1a, s1b], lambda share=share: striped(share))
    host.random_(0, 255)
    torch.cuda.synchronize()
    striped(0.5)
    torch.cuda.synchronize()
    res["striped_bytes_equal"] = bool(torch.equal(d0.cpu(), host))
    for k, v in res.items():
        print(f"{k:28s} {v}")
    write_results("probe_stripe", {k: v for k, v in res.items() if isinstance(v, float)},
                  {"striped_bytes_equal": res["striped_bytes_equal"]}, res)


if __name__ == "__main__":
    main()
