"""Probe for the stress test's rare mismatch (docs/data-paths.md, "The data-loss bug"): the same
random operations as tests/test_gpu_stress.py, over many seeds, with every backend call logged
and a device copy of each tensor's expected bytes. On a mismatch it reports which bytes differ,
what they hold now (zeros, an older version of the same tensor, another tensor's data) and
every logged move that touched the tensor's range since it was last written.

Since 8a4afbe the engine itself drains the stream around every discard (NOTE [discard fence] in
tiermem/cuda/backend.py), so every variant now runs fenced; the figures without the fence are in
the closing note of issue 3 and in docs/data-paths.md, "The data-loss bug".

Usage: python bench/probes/probe_stress.py [seconds] [variant]   (variants: see VARIANTS)
"""
from __future__ import annotations

import collections
import json
import os
import random
import sys
import time

from _path import RESULTS  # bench/ and the repository on sys.path
from _common import provenance, tier_staging_everything  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 2 * MiB, 3 * MiB + 8, 8 * MiB]
ROLES = ["weight", "activation", "gradient", "input", "workspace", "frozen_weight"]
BUDGET = 48 * MiB
BOUNCE = int(os.environ.get("PROBE_BOUNCE", "0"))   # weight of "evict, then read at once" (0: the test's mix)
VARIANTS = {
    "as_is": {},
    "blocking": {"blocking": True},           # every evict/prefetch waits
    "no_discard": {"no_discard": True},       # eviction only through Unified Memory
    "fence": {"fence": True},                 # the host waits for the stream before and after each discard
    "refill_prefetch": {"refill_prefetch": True},   # refill a discarded range by prefetch, not discard+prefetch
    "no_split": {"no_split": True},           # every large buffer its own cudaMallocManaged
    "sync_after_dp": {"sync_after": ("discard_and_prefetch",)},
    "sync_after_discard": {"sync_after": ("discard",)},
    # every shadow copy through an 8 MiB staging ring inside the budget (NOTE [staging ring])
    "staged": {"staging": "8MiB"},
}


def run_seed(seed: int, variant: dict, log_limit: int = 200_000) -> dict:
    import torch

    import tiermem
    kw = dict(device=0, cap="1GiB", budget=BUDGET, staging=variant.get("staging", "auto"))
    t = tier_staging_everything(tiermem, **kw) if "staging" in variant else tiermem.Tier(**kw)
    be = t.backend
    calls: list[tuple] = []     # (step, what, ranges, stream)
    step_box = [0]

    def logged(name):
        orig = getattr(be, name)

        def f(*a, **k):
            if name == "copy":
                dst, src, n, s = a
                calls.append((step_box[0], "copy", [(dst, n)], src, s))
            else:
                calls.append((step_box[0], name, list(a[0]), a[1:]))
            if len(calls) > log_limit:
                del calls[: log_limit // 2]
            return orig(*a, **k)
        setattr(be, name, f)

    for name in ("prefetch", "discard", "discard_and_prefetch", "copy"):
        logged(name)
    orig_dp = be.discard_and_prefetch
    if variant.get("refill_prefetch"):
        from tiermem.roles import Location as _L
        be.discard_and_prefetch = lambda ranges, loc, stream: (be.prefetch(ranges, loc, stream) if loc is _L.DEVICE
                                                               else orig_dp(ranges, loc, stream))
    for name in variant.get("sync_after", ()):
        from tiermem.cuda import runtime as C

        def after(name):
            orig = getattr(be, name)

            def f(ranges, *a):
                orig(ranges, *a)
                C.stream_synchronize(a[-1])
            setattr(be, name, f)
        after(name)
    if variant.get("no_split"):
        from tiermem.cuda.backend import Block
        orig_alloc = be.allocate

        def alloc(nbytes, key):
            if not key.endswith("/large"):
                return orig_alloc(nbytes, key)
            mp = be._upstream(nbytes)
            return Block(mp.ptr, nbytes, key, mp)
        be.allocate = alloc
    if variant.get("fence"):
        from tiermem.cuda import runtime as C

        def fenced(name):
            orig = getattr(be, name)

            def f(ranges, *a):
                stream = a[-1]
                C.stream_synchronize(stream)
                orig(ranges, *a)
                C.stream_synchronize(stream)
            setattr(be, name, f)
        fenced("discard")
        fenced("discard_and_prefetch")
    if variant.get("no_discard"):
        t.moves.evict_path = lambda b, park=False, _orig=t.moves.evict_path: "um" if _orig(b, park) in ("discard", "copy") else _orig(b, park)

    rng = random.Random(seed)
    weights = torch.randint(-(2**62), 2**62, (SIZES[-1] // 8,), dtype=torch.int64, device="cuda")

    def checksum(x) -> int:
        w = x.view(torch.int64)
        return int((w * weights[: w.numel()]).sum())

    live: list[list] = []   # [TieredTensor, checksum, held view, expected bytes, previous bytes, last write step]
    history: dict[int, list] = collections.defaultdict(list)
    found = []
    nops = 0
    blocking = variant.get("blocking", False)

    def describe(x, e, got) -> dict:
        b = x.buffer
        exp = e[3]
        diff = (got != exp).nonzero().flatten()
        lo, hi = int(diff[0]), int(diff[-1])
        bad = got[diff]
        info = {"step": step_box[0], "repr": repr(x), "nbytes": x.nbytes, "span": b.span, "ptr": b.ptr,
                "ptr_mod_2MiB": b.ptr % (2 * MiB), "owns_pages": b.owns_pages, "role": b.role.value,
                "policy": str(b.policy), "shadow_ptr": b.shadow.ptr if b.shadow is not None else None,
                "n_diff": int(diff.numel()), "diff_lo": lo, "diff_hi": hi,
                "diff_pages_4k": sorted({int(i) // 4096 for i in diff[:100000].tolist()})[:40],
                "bad_all_zero": bool((bad == 0).all()),
                "bad_equals_previous_version": bool(e[4] is not None and torch.equal(got[diff], e[4][diff])),
                "history": [str(h) for h in history[id(x)][-14:]]}
        # does the bad region hold another live tensor's expected bytes (at the same offset)?
        others = []
        for o in live:
            if o is e or o[3] is None:
                continue
            m = min(o[3].numel(), exp.numel())
            if hi < m and torch.equal(got[lo:hi + 1], o[3][lo:hi + 1]):
                others.append(repr(o[0]))
        info["bad_equals_other_tensor_same_offset"] = others
        if b.shadow is not None:
            torch.cuda.synchronize()
            shadow = be.torch_view(b.shadow.ptr, b.nbytes, None)
            info["shadow_matches_expected"] = bool(torch.equal(shadow, exp))
            info["shadow_matches_got"] = bool(torch.equal(shadow, got))
        last_w = e[5]
        rs = b.ptr, b.ptr + b.span
        sh = (b.shadow.ptr, b.shadow.ptr + b.nbytes) if b.shadow is not None else (0, 0)

        def touches(c):
            for p, n in c[2]:
                if p < rs[1] and rs[0] < p + n:
                    return "range"
                if p < sh[1] and sh[0] < p + n:
                    return "shadow"
            if c[1] == "copy" and (rs[0] <= c[3] < rs[1] or sh[0] <= c[3] < sh[1]):
                return "copy-src"
            return None
        last_ev = max((h[0] for h in history[id(x)] if h[1] == "evict"), default=last_w)
        info["all_calls_since_last_evict"] = [f"{c[0]} {c[1]} {[(hex(p), n) for p, n in c[2]]} {c[3:]}"
                                             for c in calls if c[0] >= last_ev][:40]
        info["calls_since_write"] = [f"{c[0]} {c[1]} {touches(c)} {[(hex(p), n) for p, n in c[2]]} {c[3:]}"
                                    for c in calls if c[0] >= last_w and touches(c)][-30:]
        torch.cuda.synchronize()
        again = x.torch(writable=False).view(torch.uint8).flatten()
        info["reread_still_bad"] = not torch.equal(again, exp)
        return info

    def state(x) -> str:
        b = x.buffer
        return (f"{b.where} shadow={b.in_shadow} sv={b.shadow_valid} hv={b.host_valid} "
                f"foreign={b.foreign_views()} pend={'-' if b.pending is None or b.pending.done() else 'busy'}")

    step = 0
    while nops < 10_000:
        step += 1
        step_box[0] = step
        op = rng.choices(["alloc", "group", "free", "write", "evict", "prefetch", "read", "hold", "drop", "bounce"],
                         weights=[10, 2, 8, 16, 14, 14, 24, 3, 3, BOUNCE])[0]
        if op in ("alloc", "group") and len(live) < 40:
            role = rng.choice(ROLES)
            if op == "alloc":
                try:
                    live.append([t.empty(rng.choice(SIZES), "uint8", role=role), None, None, None, None, 0])
                except tiermem.OutOfBudgetError:
                    pass
            else:
                members = [((rng.choice(SIZES[:4]),), "uint8") for _ in range(rng.randint(2, 4))]
                live.extend([x, None, None, None, None, 0] for x in t.empty_group(members, role=role))
        elif not live:
            op = "alloc"
            live.append([t.empty(rng.choice(SIZES), "uint8", role=rng.choice(ROLES)), None, None, None, None, 0])
        else:
            e = rng.choice(live)
            x = e[0]
            history[id(x)].append((step, op, state(x)))
            if op == "free":
                live.remove(e)
                e[2] = None
                x.free()
            elif op == "write":
                v = x.torch()
                v.random_(0, 256)
                e[1] = checksum(v)
                e[4] = e[3]
                e[3] = v.view(torch.uint8).flatten().clone()
                e[5] = step
                del v
            elif op == "evict":
                tr = x.evict(non_blocking=not blocking and rng.random() < 0.3)
                history[id(x)][-1] += (repr(tr),)
            elif op == "prefetch":
                try:
                    x.prefetch(non_blocking=not blocking and rng.random() < 0.3)
                except tiermem.OutOfBudgetError:
                    pass
            elif op == "bounce":      # out without waiting, and straight back: the failing pattern
                x.evict(non_blocking=True)
                op = "read"
            if op == "read" and e[1] is not None:
                v = x.torch(writable=False)
                if checksum(v) != e[1]:
                    got = v.view(torch.uint8).flatten().clone()
                    del v
                    found.append(describe(x, e, got))
                    e[1] = checksum(x.torch(writable=False))   # carry on from what is there now
                    e[3] = x.torch(writable=False).view(torch.uint8).flatten().clone()
                else:
                    del v
            elif op == "hold":
                e[2] = x.torch()
            elif op == "drop":
                e[2] = None
            history[id(x)][-1] += (state(x),) if not x.freed else ()
        nops += 1
    live.clear()
    t.close()
    return {"seed": seed, "ops": nops, "mismatches": found, "stats": {k: v for k, v in t.stats().items()
                                                                     if k.startswith(("ops.all", "staged_bytes.all"))}}


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 120
    variant_name = sys.argv[2] if len(sys.argv) > 2 else "as_is"
    variant = VARIANTS[variant_name]
    t0 = time.perf_counter()
    seeds, bad = [], []
    seed = 1000
    while time.perf_counter() - t0 < seconds:
        r = run_seed(seed, variant)
        seeds.append(seed)
        print(f"[{time.perf_counter() - t0:6.1f}s] {variant_name} seed {seed}: {len(r['mismatches'])} mismatches "
              f"{r['stats']}", flush=True)
        for m in r["mismatches"]:
            print(json.dumps(m, indent=1, default=str), flush=True)
            bad.append({"seed": seed, **m})
        seed += 1
    out = {"variant": variant_name, "seeds": seeds, "mismatches": bad}
    d = os.environ.get("OUT", RESULTS)
    with open(os.path.join(d, f"probe_stress-{variant_name}.json"), "w") as f:
        json.dump({**provenance(), **out}, f, indent=1, default=str)
    print(f"{variant_name}: {len(bad)} mismatches in {len(seeds)} seeds x 10,000 ops")


if __name__ == "__main__":
    main()
