"""Where a tiered training step's time goes, against the resident step and torch's checkpointing:
the Qwen2-style model of bench/train_budget.py part 4 (eager attention, fp32, AdamW, batch 4x512).

For each run: the step's median time (CUDA events, after warm-up). Runs: resident; torch's
non-reentrant checkpoint on every layer, with and without preserve_rng_state; tiermem at 1/2.5 of
the training state with recompute="always" (and with torch's checkpoint made to skip the RNG
state), and "never". With ``--profile``, also the GPU's kernel time in one profiled step and the
top kernels; the profiler stays attached to CUDA once used (CUPTI), which slowed tiermem's later
runs, whose many CUDA calls each pay for it (on the H100 at 42516af, tiermem's recompute-everywhere
step took 169 and 328 ms after a profiled run, 147 and 254 ms without one): time without it.

With ``--trace``, a Chrome trace of one tiermem step (GPU activity only) in $OUT.
With ``--cprofile``, the host's top calls (cProfile) over tiermem's timed steps.
With ``--host-timers``, the host's time inside each of tiermem's per-block entry points (its
hooks, the slots' fills and write-backs, the optimizer's per-block steps, the swap's pack and
unpack), timed with perf_counter around each call (inclusive, a fraction of a microsecond each):
cProfile's overhead per call inflates small functions several times over.

    python bench/probes/probe_train_overhead.py [--model hf|gpt] [--profile] [--cprofile] [--modes "always;never"]
"""
import argparse
import json
import os
import statistics
import sys
import time

import _path  # noqa: F401 - bench/ and the repository root on sys.path
import torch
from torch.profiler import ProfilerActivity, profile


def steps(run, n):
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def kernels(run):
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    from torch.autograd import DeviceType
    ev = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    busy = sum(e.self_device_time_total for e in ev) / 1e3
    top = sorted(ev, key=lambda e: -e.self_device_time_total)[:8]
    return busy, [(e.key[:70], round(e.self_device_time_total / 1e3, 2), e.count) for e in top]


_TIMED = {"train": ("_fwd_pre", "_fwd_post", "_bwd_enter", "_grad_done", "_block_done", "_step_block"),
          "stream": ("ensure", "ahead", "fill", "write_back", "done", "bind", "begin", "end"),
          "states": ("step_block", "step"),
          "swap": ("pack", "unpack", "_host_wait")}


def host_timers(train, torch):
    """Wrap tiermem's per-block entry points on their instances; returns name -> seconds so far."""
    acc = {}
    objs = {"train": train, "stream": train.stream, "states": train.states, "swap": train.swap}
    for oname, names in _TIMED.items():
        obj = objs[oname]
        if obj is None:
            continue
        for n in names:
            fn = getattr(obj, n)
            key = f"{oname}.{n}"
            acc[key] = 0.0

            def timed(*args, _fn=fn, _key=key, **kw):
                t0 = time.perf_counter()
                try:
                    return _fn(*args, **kw)
                finally:
                    acc[_key] += time.perf_counter() - t0
            setattr(obj, n, timed)
    acc["opt.step (torch)"] = 0.0
    step = train.states.opt.step

    def opt_step(*args, **kw):
        t0 = time.perf_counter()
        try:
            return step(*args, **kw)
        finally:
            acc["opt.step (torch)"] += time.perf_counter() - t0
    train.states.opt.step = opt_step
    return acc


def restore_timers(train):
    for oname, names in _TIMED.items():
        obj = {"train": train, "stream": train.stream, "states": train.states, "swap": train.swap}[oname]
        for n in names:
            if obj is not None and n in vars(obj):
                delattr(obj, n)
    if "step" in vars(train.states.opt):
        del train.states.opt.step


def waited_for(ev, least_us=20.0):
    """What the compute stream's idle time (gaps over ``least_us``) waited for, split by the
    launch of the kernel that ended each gap (its CUDA runtime call, joined by correlation id):
    launched after the stream ran dry, the GPU waited for the host ("host_late_ms"); launched
    before, it waited on the device, for an event (a copy) it was ordered after
    ("device_wait_ms"). A kernel launched part-way through a gap splits it."""
    launch = {e["args"]["correlation"]: e["ts"] + e["dur"] for e in ev
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    work = [e for e in ev if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    if not work:
        return {}
    streams = [e["args"].get("stream") for e in work if e.get("cat") == "kernel"]
    compute = max(set(streams), key=streams.count)
    ks = sorted((e for e in work if e["args"].get("stream") == compute), key=lambda e: e["ts"])
    host = dev = 0.0
    end = ks[0]["ts"]
    for e in ks:
        gap = e["ts"] - end
        at = launch.get(e["args"].get("correlation"))
        if gap > least_us and at is not None:
            late = min(max(at - end, 0.0), gap)
            host += late
            dev += gap - late
        end = max(end, e["ts"] + e["dur"])
    return {"host_late_ms": round(host / 1e3, 1), "device_wait_ms": round(dev / 1e3, 1)}


def host_profile(run, steps):
    """cProfile over ``steps`` steps: (wall ms a step, the Profile)."""
    import cProfile
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    for _ in range(steps):
        run()
    torch.cuda.synchronize()
    pr.disable()
    return (time.perf_counter() - t0) / steps * 1e3, pr


def per_function(stats, steps):
    """{function: (calls, own time in ms) a step} of a pstats.Stats over ``steps`` steps."""
    per = {}
    for (f, line, fn), (_, nc, tt, _, _) in stats.stats.items():
        where = f.split("site-packages/")[-1].split("/work/main/")[-1]
        per[f"{where}:{line}:{fn}"] = (nc / steps, tt / steps * 1e3)
    return per


def profile_diff(base, other, top=30):
    """The functions whose own host time a step (cProfile's tottime) grew most from ``base``."""
    keys = set(base) | set(other)
    rows = [(other.get(k, (0, 0.0))[1] - base.get(k, (0, 0.0))[1], k, base.get(k, (0, 0.0)), other.get(k, (0, 0.0)))
            for k in keys]
    rows.sort(reverse=True)
    return [{"fn": k[-90:], "delta_ms": round(d, 2), "calls": (round(b[0], 1), round(o[0], 1)),
             "ms": (round(b[1], 2), round(o[1], 2))} for d, k, b, o in rows[:top]]


def lag_of(run, blocks, steps=4):
    """How far the host runs ahead of the GPU through a step, without a profiler: at each block's
    forward (a forward pre-hook, after any of tiermem's) and at each block's backward (a hook on its
    output's gradient), the host's time since the step began and the GPU's time when it reached a
    CUDA event recorded there; the step begins with the GPU idle. Their difference is how much
    queued work the GPU had left when the host got there: near 0, the GPU was waiting for the host.
    Medians over ``steps`` steps, per phase: the lag at the forward's and backward's marks, and the
    host's and the GPU's end of the step."""
    marks = []

    def mark(name):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((name, time.perf_counter(), ev))

    def pre(m, args, i):
        mark(("f", i))

    def post(m, args, out, i):
        t = out[0] if isinstance(out, tuple) else out
        if torch.is_tensor(t) and t.requires_grad and torch.is_grad_enabled():
            t.register_hook(lambda g, i=i: mark(("b", i)))
    hooks = [h for i, m in enumerate(blocks) for h in (m.register_forward_pre_hook(lambda m, a, i=i: pre(m, a, i)),
                                                        m.register_forward_hook(lambda m, a, o, i=i: post(m, a, o, i)))]
    per = {"forward": [], "backward": [], "host_end": [], "gpu_end": []}
    try:
        for _ in range(steps):
            torch.cuda.synchronize()
            marks.clear()
            mark(("step", 0))
            run()
            mark(("end", 0))
            torch.cuda.synchronize()
            (_, h0, e0) = marks[0]
            lags = {"f": [], "b": []}
            for (kind, _), h, ev in marks[1:-1]:
                lags[kind].append(e0.elapsed_time(ev) - (h - h0) * 1e3)
            per["forward"].append(statistics.median(lags["f"]) if lags["f"] else 0.0)
            per["backward"].append(statistics.median(lags["b"]) if lags["b"] else 0.0)
            per["host_end"].append((marks[-1][1] - h0) * 1e3)
            per["gpu_end"].append(e0.elapsed_time(marks[-1][2]))
    finally:
        for h in hooks:
            h.remove()
    return {k + ("_lag_ms" if k in ("forward", "backward") else "_ms"): round(statistics.median(v), 1)
            for k, v in per.items()}


def trace_summary(path):
    """From a Chrome trace of one step: the compute stream's kernel time, its idle gaps (over
    50 us) and how much of them the copy engines were busy, each copy stream's busy time (ms)."""
    import gzip
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as fh:
        ev = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]
    who = waited_for(ev)
    named = sorted((e["ts"], e["ts"] + e["dur"], e.get("name", "")) for e in ev if e.get("cat") in ("kernel", "gpu_memset"))
    kern = [(a, b) for a, b, _ in named]
    copies = {}
    for e in ev:
        if e.get("cat") == "gpu_memcpy":
            copies.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("bytes", 0)))
    gaps = [(a1, b0) for (_, a1), (b0, _) in zip(kern, kern[1:]) if b0 - a1 > 50]

    def during(iv):
        return sum(max(0, min(b, y) - max(a, x)) for x, y, _ in iv for a, b in gaps) / 1e3
    # backward starts after the loss: the first kernel of cross-entropy's backward, else the middle
    split = next((a for a, _, n in named if "nll_loss_backward" in n or "log_softmax_backward" in n),
                 named[len(named) // 2][0])
    gi = [(i, named[i + 1][0] - named[i][1]) for i in range(len(named) - 1) if named[i + 1][0] - named[i][1] > 50]

    def phase(lo, hi):
        ks = [(a, b) for a, b, _ in named if lo <= a < hi]
        gs = [g for i, g in gi if lo <= named[i][1] < hi]
        return {"kernel_ms": round(sum(b - a for a, b in ks) / 1e3, 1), "span_ms": round((ks[-1][1] - ks[0][0]) / 1e3, 1)
                if ks else 0.0, "gaps": len(gs), "gap_ms": round(sum(gs) / 1e3, 1)}
    # the idle time by the kernel that ends it: what the GPU waited for the host to launch
    by_next = {}
    for i, g in gi:
        k = named[i + 1][2][:70]
        n, t = by_next.get(k, (0, 0.0))
        by_next[k] = (n + 1, t + g)
    top_next = sorted(by_next.items(), key=lambda kv: -kv[1][1])[:15]
    return {"forward": phase(named[0][0], split), "backward": phase(split, named[-1][1] + 1),
            "gaps_by_next_kernel": [(k, n, round(t / 1e3, 2)) for k, (n, t) in top_next],
            "largest_gaps": [(round(g / 1e3, 2), named[i][2][:50], named[i + 1][2][:50])
                             for i, g in sorted(gi, key=lambda x: -x[1])[:12]],
            "idle_by_cause_ms": who,
            "span_ms": round((max(b for _, b in kern) - kern[0][0]) / 1e3, 1),
            "kernel_ms": round(sum(b - a for a, b in kern) / 1e3, 1), "kernels": len(kern),
            "gaps": len(gaps), "gap_ms": round(sum(b - a for a, b in gaps) / 1e3, 1),
            "copies": {str(t): {"n": len(v), "busy_ms": round(sum(b - a for a, b, _ in v) / 1e3, 1),
                                "MB": round(sum(n for *_, n in v) / 1e6, 1), "busy_in_gaps_ms": round(during(v), 1)}
                       for t, v in copies.items()}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="hf", choices=["hf", "gpt"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cprofile", action="store_true", help="tiermem's runs only: the host's top calls over the timed steps")
    ap.add_argument("--trace", action="store_true", help="tiermem's runs and torch's checkpointed one: a "
                    "Chrome trace of one step each (GPU activity only) in $OUT, summarised by phase; the profiler stays "
                    "attached (CUPTI), so steps timed after it are slower")
    ap.add_argument("--summarize", metavar="TRACE", help="only print trace_summary of a saved trace (.json or .json.gz)")
    ap.add_argument("--modes", default="always;always, no rng;never",
                    help="tiermem's runs, ';' between; each a recompute mode, then options after commas: "
                         "'no rng', 'graphs', 'la=N' (lookahead), 'window=MiB' (the swap's copies in flight), "
                         "'bf16' (state_dtype), 'margin=F' (the graphs' "
                         "pool estimate's margin, tiermem.training.replay.RESERVE_MARGIN), 'credit' (the graphs' room "
                         "counts the eager working set the pool replaces: an experiment)")
    ap.add_argument("--adamw", choices=("fused", "foreach"), default="foreach",
                    help="AdamW's implementation (bench/train_budget.py runs fused)")
    ap.add_argument("--host-timers", action="store_true", help="tiermem's runs: host ms a step in its entry points")
    ap.add_argument("--settle", type=int, default=10, help="untimed steps first: the trace, the probe, the check")
    ap.add_argument("--ratio", type=float, default=2.5, help="tiermem's budget: the training state / this")
    ap.add_argument("--block-mib", type=int, default=64, help="wrap_training's block_bytes in MiB: 64 makes a "
                    "layer of these models one block; 40 splits a Qwen2 layer into its attention and its MLP, "
                    "a GPT layer into its Linears")
    ap.add_argument("--lag", action="store_true", help="torch's checkpointed run and tiermem's: how far the host runs "
                    "ahead of the GPU at each block, from CUDA events (no profiler)")
    ap.add_argument("--log", action="store_true", help="tiermem's log at INFO: its plans, checks and switches")
    a = ap.parse_args()
    if a.log:
        import logging
        logging.basicConfig(level=logging.INFO, format="%(relativeCreated)9.0f ms %(message)s")
        logging.getLogger("tiermem").setLevel(logging.INFO)
    if a.summarize:
        print(json.dumps(trace_summary(a.summarize), indent=1))
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    from _recompute_study import probe_model

    import tiermem
    build, loss_fn, layers, ids = probe_model(torch, a.model)
    out = {}

    def plain(model, opt):
        def run():
            loss_fn(model, ids).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run

    def trace_step(name, run):
        """A Chrome trace of one step of ``run`` (GPU activity only) in $OUT, and its summary."""
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        tag = name.replace("tiermem ", "").replace(" ", "").replace(",", "-").replace("=", "")
        tpath = os.path.join(os.environ.get("OUT", "bench/results"), f"trace-{a.model}-{tag}.json")
        prof.export_chrome_trace(tpath)
        out[f"{name} trace"] = trace_summary(tpath)
        print("wrote", tpath, json.dumps(out[f"{name} trace"]), flush=True)

    def record(name, run, extra=None):
        keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
        before = torch.cuda.memory_stats()
        t = steps(run, a.steps)
        after = torch.cuda.memory_stats()
        med = statistics.median(t[2:])
        # torch's allocator under the cap: a retry frees its cache (a device sync) and asks again
        alloc = {k: (after.get(k, 0) - before.get(k, 0)) / a.steps for k in keys}
        out[name] = {"step_ms": round(med, 1), "allocator_per_step": alloc, **(extra or {})}
        if a.trace and name.startswith("checkpoint rng=True"):
            trace_step(name, run)
        if a.cprofile and name.startswith("checkpoint rng=True"):
            import pstats
            wall, pr = host_profile(run, a.steps)
            prof_base["per"] = per_function(pstats.Stats(pr), a.steps)
            print(f"{name}: {wall:.1f} ms a step under cProfile", flush=True)
        if a.lag and lag_blocks is not None and not name.startswith("checkpoint rng=False"):
            out[name]["lag"] = lag_of(run, lag_blocks())
            print(f"{name:<32} lag {json.dumps(out[name]['lag'])}", flush=True)
        print(f"{name:<32} allocator per step: " + ", ".join(f"{k} {v:.1f}" for k, v in alloc.items()), flush=True)
        if not a.profile:
            print(f"{name:<32} step {med:7.1f} ms", flush=True)
            return
        busy, top = kernels(run)
        out[name].update(kernel_ms=round(busy, 1), idle_ms=round(med - busy, 1), top=top)
        print(f"{name:<32} step {med:7.1f} ms  kernels {busy:7.1f} ms  idle {med - busy:6.1f} ms", flush=True)
        for k in top[:5]:
            print(f"      {k[1]:8.2f} ms x{k[2]:<5} {k[0]}", flush=True)

    prof_base = {}
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=a.adamw == "fused")
    lag_blocks = lambda: layers(model)   # noqa: E731 - the model of the run being recorded
    record("resident", plain(model, opt))
    for keep_rng in (True, False):
        for blk in layers(model):
            f = blk.__class__.forward.__get__(blk)
            blk.forward = (lambda *x, f=f, r=keep_rng, **k:
                           torch.utils.checkpoint.checkpoint(f, *x, use_reentrant=False, preserve_rng_state=r, **k))
        record(f"checkpoint rng={keep_rng}", plain(model, opt))
    for blk in layers(model):
        del blk.forward
    n = sum(p.numel() for p in model.parameters())
    del model, opt
    torch.cuda.empty_cache()
    import functools

    import tiermem.training.replay as replay
    default_margin = replay.RESERVE_MARGIN
    plain_ckpt = torch.utils.checkpoint.checkpoint
    for mode in a.modes.split(";"):
        torch.utils.checkpoint.checkpoint = (functools.partial(plain_ckpt, preserve_rng_state=False)
                                             if mode.endswith("no rng") else plain_ckpt)
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=a.adamw == "fused")
        tier = tiermem.Tier(0, cap="12GiB")
        opts = [x.strip() for x in mode.split(",")]
        kw = {"graphs": "graphs" in opts}
        kw.update(("lookahead", int(x[3:])) for x in opts if x.startswith("la="))
        kw.update(("window", int(x[7:]) << 20) for x in opts if x.startswith("window="))
        if "bf16" in opts:
            kw["state_dtype"] = torch.bfloat16
        replay.RESERVE_MARGIN = next((float(x[7:]) for x in opts if x.startswith("margin=")), default_margin)
        train = tier.wrap_training(model, opt, int(16 * n / a.ratio), block_bytes=a.block_mib << 20, recompute=opts[0], **kw)
        if "credit" in opts:
            room0 = train._graph_room
            train._graph_room = lambda: (None if (r := room0()) is None else r + train.replays.need)
            train.replays.room = train._graph_room

        def run():
            with train.step():
                loss_fn(model, ids).backward()
        settle, alloc = [], []
        keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
        for _ in range(a.settle):        # the trace, the probe and the plan's check settle ("auto")
            before = torch.cuda.memory_stats()
            try:
                t = steps(run, 1)[0]
            except torch.OutOfMemoryError as e:     # a lost step: said, and the run goes on
                print(f"tiermem {mode}: a step ran out of memory: {str(e)[:300]}", flush=True)
                t = -1.0
            after = torch.cuda.memory_stats()
            settle.append((round(t, 1), train.plan.kind, len(train.plan.recompute)))
            # torch's allocator in each settling step: a retry empties its cache (a device sync)
            alloc.append(tuple(int(after.get(k, 0) - before.get(k, 0)) for k in keys))
        print(f"tiermem {mode}: settling steps (ms, the plan after each): {settle}", flush=True)
        print(f"tiermem {mode}: settling steps' allocator ({', '.join(keys)}): {alloc}", flush=True)
        if a.host_timers:
            timers = host_timers(train, torch)
            timers["run() until it returns"] = 0.0
            for _ in range(a.steps):
                t0 = time.perf_counter()
                run()
                timers["run() until it returns"] += time.perf_counter() - t0
                torch.cuda.synchronize()
            got = {k: round(v / a.steps * 1e3, 2) for k, v in sorted(timers.items(), key=lambda kv: -kv[1])}
            out[f"tiermem {mode} host_ms_per_step"] = got
            print(f"tiermem {mode}: host ms a step, inclusive: " + json.dumps(got), flush=True)
            restore_timers(train)
        if a.cprofile:
            import io
            import pstats
            wall, pr = host_profile(run, a.steps)
            buf = io.StringIO()
            st = pstats.Stats(pr, stream=buf)
            st.sort_stats("tottime").print_stats(25)
            st.sort_stats("cumulative").print_stats(30)
            st.sort_stats("tottime").print_stats("tiermem/", 40)    # tiermem's own host time
            st.sort_stats("cumulative").print_stats("tiermem/", 40)
            out[f"tiermem {mode} cprofile"] = {"step_ms_profiled": round(wall, 1), "stats": buf.getvalue()[-30000:]}
            print(f"tiermem {mode}: {wall:.1f} ms a step under cProfile", flush=True)
            print(buf.getvalue()[-14000:], flush=True)
            if prof_base.get("per"):
                diff = profile_diff(prof_base["per"], per_function(st, a.steps))
                out[f"tiermem {mode} cprofile_over_checkpoint"] = {"step_ms_profiled": round(wall, 1), "top": diff}
                print(f"tiermem {mode}: own host time a step over torch's checkpoint (cProfile tottime, ms; "
                      f"calls and ms checkpoint -> tiermem), {wall:.1f} ms a step profiled:", flush=True)
                for r in diff:
                    print(f"  {r['delta_ms']:7.2f}  {str(r['calls']):>16} {str(r['ms']):>18}  {r['fn']}", flush=True)
        if a.trace:
            trace_step(f"tiermem {mode}", run)
        rp = train.replays
        record(f"tiermem {mode}", run, {"plan": str(train.plan).split("\n"), "slots": train.stream.nslots,
                                        "graphs": {"captured": rp.captured, "replayed": rp.replayed,
                                                   "pool_MB": round(rp.pool_bytes / 1e6),
                                                   "pool_peak_MB": round(rp.pool_peak / 1e6), "need_MB": round(rp.need / 1e6),
                                                   "off": rp.off[:200]},
                                        "settling": settle, "settling_allocator": alloc})
        print(f"  slots {train.stream.nslots}; graphs: {out[f'tiermem {mode}']['graphs']}", flush=True)
        print(str(train.plan), flush=True)
        train.unwrap()
        del train, model, opt
        tier.close()
        torch.cuda.empty_cache()
    path = os.path.join(os.environ.get("OUT", "bench/results"),
                        f"probe_train_overhead-{a.model}-{a.adamw}-{time.strftime('%Y%m%d')}.json")
    with open(path, "w") as fh:
        from _common import provenance
        json.dump({"device": torch.cuda.get_device_name(0), **provenance(), "date": time.strftime("%Y-%m-%d"),
                   "results": out}, fh, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    sys.exit(main())
