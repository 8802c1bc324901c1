"""Probe: is the shadow round trip (copy out to pinned, discard, discard-and-prefetch back, copy in)
byte-exact when its calls follow each other on one stream with no host wait? The stress test's
rare mismatches (docs/data-paths.md, "The data-loss bug") all came from that sequence: zeros, on
the device, right after an eviction that was still in flight. Each variant does many round trips
on 2-8 MiB managed buffers and checks both the shadow and the data that came back.

Usage: python bench/probes/probe_discard.py [seconds per variant]
"""
from __future__ import annotations

import json
import os
import random
import sys
import time

from _path import RESULTS  # bench/ and the repository on sys.path

MiB = 1 << 20
NBUF = 16
MAXB = 8 * MiB


class _CAI:
    def __init__(self, ptr, n):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


def main() -> None:
    import torch

    from tiermem.cuda import runtime as C
    from tiermem.roles import Location
    per = float(sys.argv[1]) if len(sys.argv) > 1 else 20
    variants = sys.argv[2].split(",") if len(sys.argv) > 2 else [
        "base", "wait_event_before_discard", "sync_before_discard", "sync_after_discard", "prefetch_not_dp",
        "sync_before_refill", "like_engine"]
    dev = 0
    torch.cuda.init()
    bufs = [C.managed_alloc(MAXB, dev) for _ in range(NBUF)]
    for b in bufs:
        assert b.ptr % (2 * MiB) == 0
        C.advise(b.ptr, MAXB, "preferred_location", True, Location.DEVICE, dev)
        C.prefetch(b.ptr, MAXB, Location.DEVICE, dev, 0)
    shadows = [C.host_alloc(MAXB) for _ in range(NBUF)]
    views = [torch.as_tensor(_CAI(b.ptr, MAXB), device="cuda") for b in bufs]
    sviews = [torch.as_tensor(_CAI(s, MAXB), device="cuda") for s in shadows]   # mapped pinned memory
    s = C.stream_create(dev)
    cur = torch.cuda.current_stream().cuda_stream
    torch.cuda.synchronize()
    rng = random.Random(0)
    out = {}
    for var in variants:
        t0 = time.perf_counter()
        trips = shadow_bad = data_bad = zero_bad = 0
        while time.perf_counter() - t0 < per:
            order = list(range(NBUF))
            rng.shuffle(order)
            sizes = [rng.choice([2, 4, 6, 8]) * MiB for _ in range(NBUF)]
            refs = []
            for i in order:
                n = sizes[i]
                views[i][:n].random_(0, 256)
                refs.append((i, views[i][:n].clone()))
            ev = C.event_create()
            C.event_record(ev, cur)
            C.stream_wait_event(s, ev)
            for i in order:        # out and straight back, one buffer after another, nothing waits
                p, n = bufs[i].ptr, sizes[i]
                C.memcpy_async(shadows[i], p, n, s)
                if var == "wait_event_before_discard":
                    e2 = C.event_create()
                    C.event_record(e2, s)
                    C.stream_wait_event(s, e2)
                if var == "sync_before_discard":
                    C.stream_synchronize(s)
                C.discard_batch([p], [n], s)
                if var == "sync_after_discard":
                    C.stream_synchronize(s)
                if var == "like_engine":
                    # what the engine does between an eviction in flight and the read that brings it
                    # back: the compute stream waits for the eviction, the side stream for it; another
                    # buffer goes out through Unified Memory; a kernel faults host-resident pages in
                    e3 = C.event_create()
                    C.event_record(e3, s)
                    C.stream_wait_event(cur, e3)
                    j = (i + 1) % NBUF
                    C.prefetch(bufs[j].ptr, MAXB, Location.HOST, dev, s)
                    views[(i + 2) % NBUF].max()
                    e4 = C.event_create()
                    C.event_record(e4, cur)
                    C.stream_wait_event(s, e4)
                if var.startswith("gap"):
                    # the stress test's failures all refilled a range soon after its discard had run
                    e5 = C.event_create()
                    C.event_record(e5, s)
                    while not C.event_query(e5):
                        pass
                    if "sleep" in var:
                        time.sleep(float(var.split("sleep")[1]) * 1e-6)
                if var.endswith("_sync_dp"):
                    C.discard_and_prefetch_batch([p], [n], Location.DEVICE, dev, s)
                    C.stream_synchronize(s)
                elif var.endswith("_host_dp"):
                    C.discard_and_prefetch_batch([p], [n], Location.HOST, dev, s)
                    C.discard_and_prefetch_batch([p], [n], Location.DEVICE, dev, s)
                elif var == "prefetch_not_dp" or var.endswith("_prefetch"):
                    C.prefetch(p, n, Location.DEVICE, dev, s)
                else:
                    C.discard_and_prefetch_batch([p], [n], Location.DEVICE, dev, s)
                if var == "sync_before_refill":
                    C.stream_synchronize(s)
                C.memcpy_async(p, shadows[i], n, s)
            C.stream_synchronize(s)
            for i, ref in refs:
                n = ref.numel()
                trips += 1
                sb = not torch.equal(sviews[i][:n], ref)
                db = not torch.equal(views[i][:n], ref)
                shadow_bad += sb
                data_bad += db
                if db:
                    bad = views[i][:n] != ref
                    zero_bad += bool((views[i][:n][bad] == 0).all())
        out[var] = {"round_trips": trips, "shadow_bad": shadow_bad, "data_bad": data_bad,
                    "data_bad_all_zero": zero_bad, "seconds": round(time.perf_counter() - t0, 1)}
        print(var, out[var], flush=True)
    d = os.environ.get("OUT", RESULTS)
    with open(os.path.join(d, "probe_discard.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "variants": out}, f, indent=1)


if __name__ == "__main__":
    main()
