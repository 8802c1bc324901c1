"""bench/train_budget.py: training models bigger than the device budget, against their peers.

In one run, side by side (random data, fixed seeds, CUDA-event medians after warm-up steps):
  1. A GPT-2-style decoder with AdamW whose parameters, gradients and optimizer states are
     >= 2.5x the budget: resident PyTorch (no cap: the ceiling), torch's save_on_cpu for the
     activations (the usual peer; also uncapped, since its parameters and states stay resident),
     and tiermem.wrap_training under the budget. 30 steps each; the losses are compared bitwise.
     The bound comes from the model and the budget (bench/bounds.py train_step): the state that
     outlives a step (parameters and AdamW's moments) less the budget must come in and go out
     once a step, at the duplex rate measured here, and no step beats the resident one; the
     larger of the two. The bytes tiermem moved give ``..._vs_plan_bytes``, named apart.
     A sweep over budgets gives the plot of step time vs budget.
  2. In capacity (budget >= everything): tiermem against plain PyTorch.
  4. Keep, swap or recompute (bench/_recompute_study.py): the GPT and a transformers Qwen2-style
     model at 1/1.5, 1/2.5 and 1/4 of their training state, tiermem's swap-only plan and its new
     plan against resident, FSDP2's CPUOffloadPolicy, save_on_cpu and torch's checkpointing.
  3. The activation-swap study: at one fixed budget (torch's allocator capped to it for the
     resident runs), the largest batch that trains, resident vs tiermem, for ResNet-50 and a
     smaller GPT, with time per sample at each, against the same kind of bound per sample.

AdamW is torch's fused one (``--adamw fused``, the default) in every run, resident and peers
included: HF Trainer's default optimizer is ``adamw_torch_fused`` (transformers, for torch >= 2.8)
and nanoGPT picks fused AdamW on CUDA. ``--adamw foreach`` gives torch's own default, the runs
before 2026-11-24.

    python bench/train_budget.py [--quick] [--adamw fused|foreach] [--only 1234] [--ratios 1.5,2.5,4]
Writes bench/results/train_budget-<device>-<date>[-part<parts>].json and a plot.
"""
from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # deterministic cuBLAS: bitwise-comparable losses

import argparse
import gc
import sys
import time

import bounds
from _common import cuda_times, median, plot_path, progress, table, write_results

GiB, MiB = 1 << 30, 1 << 20
ADAMW = {"fused": True}            # main() sets it from --adamw


def adamw(torch, params):
    """The runs' AdamW: fused (HF Trainer's and nanoGPT's choice) or foreach, per --adamw."""
    return torch.optim.AdamW(params, lr=1e-4, **ADAMW)


def setup():
    import torch
    torch.use_deterministic_algorithms(True, warn_only=True)
    return torch


def gpt_loss(model, ids):
    import torch.nn.functional as F
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def resnet_loss(model, batch):
    import torch.nn.functional as F
    x, y = batch
    return F.cross_entropy(model(x), y)


def free():
    import torch
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def link_rates(torch):
    """Pinned copies of 1 GiB each way and both at once (GB/s), measured in this process."""
    n = GiB
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True).random_(0, 255)
    d = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    h2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn):
        return median(cuda_times(fn, reps=3, warmup=1))
    h2d = n / timed(lambda: d.copy_(h, non_blocking=True)) / 1e9
    d2h = n / timed(lambda: h2.copy_(d, non_blocking=True)) / 1e9

    def both():
        e = torch.cuda.Event()
        e.record()
        for s in (s1, s2):
            s.wait_event(e)
        with torch.cuda.stream(s1):
            d.copy_(h, non_blocking=True)
        with torch.cuda.stream(s2):
            h2.copy_(d, non_blocking=True)
        for s in (s1, s2):
            torch.cuda.current_stream().wait_stream(s)
    duplex = 2 * n / timed(both) / 1e9
    del h, d, h2
    free()
    return round(h2d, 2), round(d2h, 2), round(duplex, 2)


_GC = {"ms": 0.0, "t0": 0.0}


def _gc_clock(phase, info):
    """Python's garbage collector's host time, summed (a collection's host time stalls a
    host-bound step: the bench reports it per step)."""
    if phase == "start":
        _GC["t0"] = time.perf_counter()
    else:
        _GC["ms"] += (time.perf_counter() - _GC["t0"]) * 1e3


gc.callbacks.append(_gc_clock)


class Stepper:
    """Runs training steps of one configuration and times each with CUDA events, and the
    garbage collector's host time in each."""

    def __init__(self, torch, model, opt, loss_fn, train=None, save_on_cpu=False):
        self.torch, self.model, self.opt, self.loss_fn, self.train = torch, model, opt, loss_fn, train
        self.save_on_cpu = save_on_cpu
        self.graphed = None               # train.graphed(...): the step as one captured graph
        self.losses, self.times, self.moved, self.gc_ms = [], [], [], []

    def step(self, batch):
        torch = self.torch
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        gc0 = _GC["ms"]
        a.record()
        if self.graphed is not None:          # NOTE [whole-step graphs] in tiermem/training/stepgraph.py
            loss = self.graphed(batch)
            self.moved.append(dict(self.train.moved))
        elif self.train is not None:
            with self.train.step():
                loss = self.loss_fn(self.model, batch)
                loss.backward()
            self.moved.append(dict(self.train.moved))
        else:
            ctx = torch.autograd.graph.save_on_cpu(pin_memory=True) if self.save_on_cpu else _null()
            with ctx:
                loss = self.loss_fn(self.model, batch)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        b.record()
        b.synchronize()
        self.times.append(a.elapsed_time(b) / 1e3)
        self.gc_ms.append(_GC["ms"] - gc0)
        self.losses.append(loss.detach())

    def run(self, batches, label):
        for i, bt in enumerate(batches):
            self.step(bt)
            if i in (0, len(batches) - 1) or (i + 1) % 10 == 0:
                progress(f"  {label}: step {i + 1}/{len(batches)} {self.times[-1] * 1e3:.1f} ms")
        return self

    def median_ms(self, skip=3):
        return median(self.times[skip:]) * 1e3

    def loss_values(self):
        return [float(x) for x in self.torch.stack(self.losses).cpu()]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def build_gpt(torch, cfg, seed=0):
    from tiermem.testing import GPT
    torch.manual_seed(seed)
    return GPT(cfg).cuda()


def gpt_batches(torch, cfg, n, batch, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), device="cuda", generator=g) for _ in range(n)]


def tiermem_run(torch, tiermem, build, loss_fn, batches, budget, label, **kw):
    model = build()
    opt = adamw(torch, model.parameters()) if kw.pop("adamw", True) else \
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    tier = shared_tier(tiermem)
    graph_loss = kw.pop("graphed", None)    # the loss the graphed step runs (NOTE [whole-step graphs])
    train = tier.wrap_training(model, opt, budget, **kw)
    st = Stepper(torch, model, opt, loss_fn, train=train)
    if graph_loss is not None:
        st.graphed = train.graphed(lambda b: graph_loss(model, b))
    peaks, plans = [], []
    try:
        for i, bt in enumerate(batches):
            st.step(bt)
            peaks.append(train.resident_peak())
            p = train.plan
            plans.append((p.kind, p.resident_blocks, p.recompute, p.keep) if p else None)
            if i in (0, len(batches) - 1) or (i + 1) % 10 == 0:
                progress(f"  {label}: step {i + 1}/{len(batches)} {st.times[-1] * 1e3:.1f} ms")
    except BaseException:
        try:
            train.unwrap()          # the cap and the lease go back, whatever the step left
        except Exception as e:
            progress(f"  unwrap after failure: {e!r}")
        raise
    plan = train.plan
    info = {"plan": plan.table() if plan else None, "resident_peak_bytes": max(peaks),
            "report": train.report(), "moved_last": st.moved[-1], "floor_bytes": train.floor,
            "streamed_blocks": len(plan.streamed_blocks) if plan else -1,
            "swapped_bytes": plan.swapped_bytes if plan else -1,
            "predicted_ms": plan.predicted_seconds() * 1e3 if plan else float("nan"),
            "recomputed": len(plan.recompute) if plan else 0, "kind": plan.kind if plan else "none",
            "measured": {k: v for k, v in plan.measured.items()} if plan else {}}
    if st.graphed is not None:
        g = st.graphed
        info["graphed"] = {"captures": g.captures, "replays": g.replays, "last_replays": g.last_replays,
                           "off": g.off, "drops": list(g.drops),
                           "reserved_after_bytes": torch.cuda.memory_reserved()}
        g.close()
    res = Result(st, plans)
    train.unwrap()
    del train, st, model, opt
    free()
    return res, info


_TIER = []


def shared_tier(tiermem):
    """One Tier for the whole run: its pinned pool keeps the small pinned blocks of earlier runs,
    so a run does not pay cudaHostAlloc again (large homes are registered afresh, NOTE [pinned by
    registration] in tiermem/cuda/runtime.py)."""
    if not _TIER:
        _TIER.append(tiermem.Tier(0, cap="12GiB"))
    return _TIER[0]


class Result:
    """What a finished run leaves: numbers only, so its tensors can be freed."""

    def __init__(self, st, plans=()):
        self.times, self.moved, self.gc_ms = list(st.times), list(st.moved), list(st.gc_ms)
        self._losses = st.loss_values()
        self.plans = list(plans)          # per step, the plan the steps after it follow

    def settled(self, skip):
        """The first step to time: at least ``skip``, and past the last change of plan (NOTE
        [measured choice]: a kept plan is checked again after its first steps, and may give way
        then) and the new plan's first step, which pays for its allocations. Where that leaves
        fewer than three steps, ``skip``."""
        last = max((i for i in range(1, len(self.plans)) if self.plans[i] != self.plans[i - 1]), default=-1)
        start = max(skip, last + 2)
        return start if len(self.times) - start >= 3 else skip

    def median_ms(self, skip=3):
        return median(self.times[skip:]) * 1e3

    def mean_ms(self, skip=3):
        return sum(self.times[skip:]) / max(len(self.times[skip:]), 1) * 1e3

    def gc_ms_per_step(self, skip=3):
        """The garbage collector's mean host time a step."""
        return sum(self.gc_ms[skip:]) / max(len(self.gc_ms[skip:]), 1)

    def loss_values(self):
        return self._losses


def part1(torch, tiermem, a, rates, out):
    from tiermem.testing import GPTConfig, gpt_param_count
    cfg = GPTConfig(vocab=a.vocab, seq=a.seq, d=a.d, layers=a.layers, heads=a.heads)
    n = gpt_param_count(cfg)
    footprint = 16 * n            # fp32 parameters, gradients, AdamW's two moments
    budget = int(footprint / a.ratio)
    progress(f"part 1: GPT {n / 1e6:.0f}M params, footprint {footprint / 1e9:.2f} GB, budget {budget / 1e9:.2f} GB, "
             f"batch {a.batch}x{a.seq}")
    batches = gpt_batches(torch, cfg, a.steps, a.batch)
    model = build_gpt(torch, cfg)
    opt = adamw(torch, model.parameters())
    torch.cuda.reset_peak_memory_stats()
    res = Result(Stepper(torch, model, opt, gpt_loss).run(batches, "resident"))
    res_peak = torch.cuda.max_memory_reserved()
    del model, opt
    free()
    model = build_gpt(torch, cfg)
    opt = adamw(torch, model.parameters())
    torch.cuda.reset_peak_memory_stats()
    soc = Result(Stepper(torch, model, opt, gpt_loss, save_on_cpu=True).run(batches[: a.soc_steps], "save_on_cpu"))
    soc_peak = torch.cuda.max_memory_reserved()
    del model, opt
    free()
    st, info = tiermem_run(torch, tiermem, lambda: build_gpt(torch, cfg), gpt_loss, batches, budget,
                           "tiermem", block_bytes=a.block_mib * MiB)
    peak_max = info["resident_peak_bytes"]
    progress("  plan:\n" + info["plan"])
    moved = st.moved[-1]
    losses_equal = st.loss_values() == res.loss_values()
    res_ms, t_ms, soc_ms = res.median_ms(), st.median_ms(), soc.median_ms(2)
    state = bounds.persistent_state_bytes(n)          # fp32 parameters and AdamW's two moments
    bound = bounds.train_step(state, budget, rates["h2d"], rates["d2h"], rates["duplex"], res_ms / 1e3)
    # the bytes tiermem's plan moved, at the same rates: the plan's own figure, not a bound
    plan_ms = max(res_ms, moved["h2d"] / (rates["h2d"] * 1e9) * 1e3, moved["d2h"] / (rates["d2h"] * 1e9) * 1e3,
                  (moved["h2d"] + moved["d2h"]) / (rates["duplex"] * 1e9) * 1e3)
    note = bounds.below_bound_note("gpt_step_vs_bound", t_ms / (bound.seconds * 1e3))
    if note:
        progress("BELOW THE BOUND: " + note)
        out.setdefault("notes", []).append(note)
    out["metrics"].update({
        "gpt_params": n, "footprint_bytes": footprint, "budget_bytes": budget,
        "footprint_over_budget": round(footprint / budget, 3), "gpt_state_bytes": state,
        "resident_step_ms": round(res_ms, 2), "gpt_step_ms": round(t_ms, 2), "save_on_cpu_step_ms": round(soc_ms, 2),
        "gpt_moved_h2d_bytes_per_step": moved["h2d"], "gpt_moved_d2h_bytes_per_step": moved["d2h"],
        "gpt_bound_ms": round(bound.seconds * 1e3, 2), "gpt_step_vs_bound": bounds.ratio(t_ms, bound.seconds * 1e3),
        "gpt_bound_cross_bytes": bound.cross_bytes, "gpt_bound_transfer_ms": round(bound.transfer_seconds * 1e3, 2),
        "gpt_bound_limited_by_link": int(bound.limited_by == "link"),
        "gpt_plan_bytes_ms": round(plan_ms, 2), "gpt_step_vs_plan_bytes": bounds.ratio(t_ms, plan_ms),
        "gpt_step_vs_resident": round(t_ms / res_ms, 3), "save_on_cpu_over_tiermem": round(soc_ms / t_ms, 3),
        "resident_peak_reserved_bytes": res_peak, "save_on_cpu_peak_reserved_bytes": soc_peak,
        "tiermem_resident_peak_bytes": peak_max,
    })
    out["checks"]["losses_equal_resident"] = losses_equal
    out["checks"]["resident_within_budget"] = peak_max <= budget
    out["raw"]["gpt"] = {"config": vars(cfg), "batch": a.batch, "plan": info["plan"], "report": info["report"],
                         "losses_resident": res.loss_values(), "losses_tiermem": st.loss_values(),
                         "step_ms_resident": [x * 1e3 for x in res.times], "step_ms_tiermem": [x * 1e3 for x in st.times],
                         "step_ms_save_on_cpu": [x * 1e3 for x in soc.times]}
    # the sweep: step time vs budget
    sweep = []
    for frac in a.sweep:
        b = int(footprint * frac)
        s2, inf2 = tiermem_run(torch, tiermem, lambda: build_gpt(torch, cfg), gpt_loss,
                               batches[: a.sweep_steps], b, f"sweep {frac:.2f}x footprint",
                               block_bytes=a.block_mib * MiB)
        sweep.append({"budget_bytes": b, "budget_over_footprint": frac, "step_ms": round(s2.median_ms(), 2),
                      "moved": s2.moved[-1], "resident_peak_bytes": inf2["resident_peak_bytes"], "plan": inf2["plan"]})
        out["checks"]["resident_within_budget"] &= inf2["resident_peak_bytes"] <= b
    out["raw"]["sweep"] = sweep
    return cfg, batches, res, budget, sweep


def part2(torch, tiermem, a, cfg, batches, out):
    """In capacity: the same GPT with a budget above everything it needs, interleaved with plain."""
    progress("part 2: in capacity")
    plain_ms, tm_ms = [], []
    for rnd in range(2):
        model = build_gpt(torch, cfg)
        opt = adamw(torch, model.parameters())
        p = Stepper(torch, model, opt, gpt_loss).run(batches[: a.cap_steps], f"plain round {rnd}")
        plain_ms.append(p.median_ms())
        del model, opt, p
        free()
        st, info = tiermem_run(torch, tiermem, lambda: build_gpt(torch, cfg), gpt_loss,
                               batches[: a.cap_steps], a.capacity_budget, f"tiermem round {rnd}",
                               block_bytes=a.block_mib * MiB)
        tm_ms.append(st.median_ms())
        progress("  plan:\n" + info["plan"])
        out["checks"]["in_capacity_nothing_moves"] = (out["checks"].get("in_capacity_nothing_moves", True)
                                                     and info["streamed_blocks"] == 0 and info["swapped_bytes"] == 0
                                                     and info["moved_last"] == {"h2d": 0, "d2h": 0})
    pm, tm = median(plain_ms), median(tm_ms)
    out["metrics"].update({"in_capacity_plain_ms": round(pm, 2), "in_capacity_tiermem_ms": round(tm, 2),
                           "in_capacity_vs_plain": round(tm / pm, 4)})
    out["raw"]["in_capacity"] = {"plain_ms": plain_ms, "tiermem_ms": tm_ms, "budget_bytes": a.capacity_budget}


def max_batch(trial, start, limit):
    """Largest b in [1, limit] for which trial(b) is True, by doubling then bisection."""
    lo, hi, b = 0, None, start
    while b <= limit:
        if trial(b):
            lo, b = b, b * 2
        else:
            hi = b
            break
    if hi is None:
        return lo
    while hi - lo > max(1, lo // 24):
        mid = (lo + hi) // 2
        if trial(mid):
            lo = mid
        else:
            hi = mid
    return lo


def study(torch, tiermem, name, build, make_batch, loss_fn, budget, a, rates, use_adamw, out):
    total = torch.cuda.get_device_properties(0).total_memory
    timings = {}

    def resident(b):
        free()
        torch.cuda.set_per_process_memory_fraction(budget / total)
        try:
            model = build()
            opt = (adamw(torch, model.parameters()) if use_adamw else
                   torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
            st = Stepper(torch, model, opt, loss_fn)
            for _ in range(a.study_steps):
                st.step(make_batch(b))
            timings[("resident", b)] = (st.median_ms(skip=2), 0, 0)
            ok = True
        except torch.OutOfMemoryError:
            ok = False
        finally:
            model = opt = st = None
            torch.cuda.set_per_process_memory_fraction(1.0)
            free()
        progress(f"  {name} resident batch {b}: {'ok' if ok else 'out of memory'}")
        return ok

    def tiered(b):
        free()
        train = tier = None
        try:
            model = build()
            opt = (adamw(torch, model.parameters()) if use_adamw else
                   torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
            tier = shared_tier(tiermem)
            train = tier.wrap_training(model, opt, budget, block_bytes=a.block_mib * MiB)
            st = Stepper(torch, model, opt, loss_fn, train=train)
            for _ in range(a.study_steps):
                st.step(make_batch(b))
            ok = train.resident_peak() <= budget
            mv = st.moved[-1]
            timings[("tiermem", b)] = (st.median_ms(skip=2), mv["h2d"], mv["d2h"])
        except torch.OutOfMemoryError:
            ok = False
        finally:
            if train is not None:
                try:
                    train.unwrap()
                except Exception as e:  # an OOM mid-step can leave a half-done step; unwrap what it can
                    progress(f"  unwrap after failure: {e!r}")
            model = opt = st = train = None
            free()
        progress(f"  {name} tiermem batch {b}: {'ok' if ok else 'out of memory'}")
        return ok

    progress(f"part 3: {name} at a {budget / GiB:.1f} GiB budget")
    rb = max_batch(resident, a.study_start, a.study_limit)
    tb = max_batch(tiered, max(rb, 1), a.study_limit * 8)
    shared_tier(tiermem).backend.release_cached()   # give the host its pinned memory back
    r_ms = timings.get(("resident", rb), (float("nan"), 0, 0))[0]
    t_ms, h2d, d2h = timings.get(("tiermem", tb), (float("nan"), 0, 0))
    r_ps, t_ps = r_ms / max(rb, 1), t_ms / max(tb, 1)
    bytes_ps = (h2d + d2h) / max(tb, 1)
    # the bound from the model (bench/bounds.py train_step): its persistent state less the budget
    # crosses in and out once a step, and a sample costs at least resident's time per sample;
    # activations add nothing, since a design may recompute them instead of moving them
    model = build()
    n = sum(p.numel() for p in model.parameters())
    del model
    free()
    state = bounds.persistent_state_bytes(n, states_per_param=2 if use_adamw else 1)
    compute = r_ps * max(tb, 1) / 1e3 if r_ps == r_ps else 0.0       # no resident batch trained: the link alone
    step = bounds.train_step(state, budget, rates["h2d"], rates["d2h"], rates["duplex"], compute)
    bound_ps = step.seconds * 1e3 / max(tb, 1)
    plan_ps = max(r_ps, h2d / max(tb, 1) / (rates["h2d"] * 1e9) * 1e3, d2h / max(tb, 1) / (rates["d2h"] * 1e9) * 1e3,
                  bytes_ps / (rates["duplex"] * 1e9) * 1e3)
    note = bounds.below_bound_note(f"{name}_time_per_sample_vs_bound", t_ps / bound_ps)
    if note:
        progress("BELOW THE BOUND: " + note)
        out.setdefault("notes", []).append(note)
    out["metrics"].update({
        f"{name}_resident_max_batch": rb, f"{name}_tiermem_max_batch": tb,
        f"{name}_max_batch_gain": round(tb / max(rb, 1), 3),
        f"{name}_resident_ms_per_sample": round(r_ps, 3), f"{name}_tiermem_ms_per_sample": round(t_ps, 3),
        f"{name}_time_per_sample_vs_resident": round(t_ps / r_ps, 3),
        f"{name}_swapped_bytes_per_sample": int(bytes_ps), f"{name}_state_bytes": state,
        f"{name}_time_per_sample_bound_ms": round(bound_ps, 3),
        f"{name}_time_per_sample_vs_bound": bounds.ratio(t_ps, bound_ps),
        f"{name}_time_per_sample_vs_plan_bytes": bounds.ratio(t_ps, plan_ps),
    })
    out["raw"][f"{name}_trials"] = {f"{k[0]}@{k[1]}": v for k, v in timings.items()}


def part3(torch, tiermem, a, rates, out):
    from tiermem.testing import GPTConfig, resnet50
    budget = int(a.study_gib * GiB)

    def build_resnet():
        torch.manual_seed(0)
        return resnet50().cuda()

    def resnet_batch(b):
        g = torch.Generator(device="cuda").manual_seed(b)
        return (torch.randn(b, 3, 224, 224, device="cuda", generator=g),
                torch.randint(0, 1000, (b,), device="cuda", generator=g))
    study(torch, tiermem, "resnet50", build_resnet, resnet_batch, resnet_loss, budget, a, rates, False, out)
    cfg = GPTConfig(vocab=a.vocab, seq=a.seq, d=a.small_d, layers=a.small_layers, heads=a.heads)

    def gpt_batch(b):
        return gpt_batches(torch, cfg, 1, b, seed=b)[0]
    study(torch, tiermem, "gpt", lambda: build_gpt(torch, cfg), gpt_batch, gpt_loss, budget, a, rates, True, out)


def plot(out, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib missing: no plot")
        return None
    m = out["metrics"]
    sw = out["raw"].get("sweep", [])
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    xs = [s["budget_bytes"] / 1e9 for s in sw] + [m["budget_bytes"] / 1e9]
    ys = [s["step_ms"] for s in sw] + [m["gpt_step_ms"]]
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ax[0].plot([xs[i] for i in order], [ys[i] for i in order], "o-", label="tiermem")
    ax[0].axhline(m["resident_step_ms"], color="g", ls="--", label="resident (no budget)")
    ax[0].axhline(m["save_on_cpu_step_ms"], color="r", ls=":", label="save_on_cpu (no budget)")
    ax[0].axvline(m["footprint_bytes"] / 1e9, color="gray", lw=0.8, label="params+grads+AdamW")
    ax[0].set_xlabel("device budget (GB)")
    ax[0].set_ylabel("step time (ms)")
    ax[0].set_title("GPT step time vs budget")
    ax[0].legend(fontsize=8)
    names = ["resnet50", "gpt"]
    rb = [m.get(f"{n}_resident_max_batch", 0) for n in names]
    tb = [m.get(f"{n}_tiermem_max_batch", 0) for n in names]
    ax[1].bar([0, 3], rb, label="resident")
    ax[1].bar([1, 4], tb, label="tiermem")
    ax[1].set_xticks([0.5, 3.5], names)
    ax[1].set_ylabel("largest batch that trains")
    ax[1].set_title(f"batch at a {out['raw'].get('study_gib', 0)} GiB budget")
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run in about a minute")
    p.add_argument("--only", default="1234", help="parts to run: 1 budget, 2 in capacity, 3 batch study, "
                   "4 keep/swap/recompute study; 'finetune' alone: a 1B Llama fine-tuned as users do "
                   "(bench/finetune.py)")
    p.add_argument("--ratios", default="1.5,2.5,4", help="part 4's budgets, as fractions 1/x of the training "
                   "state (2.5 must be among them)")
    p.add_argument("--bf16-states", action="store_true", help="part 4 also runs the 1/2.5 plan with "
                   "state_dtype=torch.bfloat16 (NOTE [bf16 moments])")
    p.add_argument("--arena", action="store_true", help="part 4 also lays out a resident step's temporaries "
                   "in a lifetime-planned arena (NOTE [lifetime arena])")
    p.add_argument("--arena-only", action="store_true", help="part 4 does only that")
    p.add_argument("--adamw", choices=("fused", "foreach"), default="fused", help="AdamW's implementation in "
                   "every run (fused: HF Trainer's default, adamw_torch_fused)")
    p.add_argument("--ft-block-mib", type=int, default=None, help="finetune: tiermem's block_bytes in MiB "
                   "(default: wrap_training's)")
    p.add_argument("--ft-runs", default="eager_2.5,graphed_2.5,host_2.5,eager_4,host_4,eager_6",
                   help="finetune: tiermem's runs, KIND_RATIO: eager, graphed or host (host_step=True)")
    p.add_argument("--ft-snapshot", default=None, metavar="PREFIX",
                   help="finetune: where a run fails, torch's memory snapshot goes to PREFIX-<run>.pickle")
    p.add_argument("--ft-seq", type=int, default=None, help="finetune: tokens a sequence (default 2048); "
                   "another length is written under its own name (-seq<n>)")
    a = p.parse_args()
    ADAMW.clear()
    ADAMW[a.adamw] = True
    a.arena = a.arena or a.arena_only
    a.ratios = tuple(float(x) for x in a.ratios.split(","))
    # peer_steps: the peers' medians are of the steps after the first two. FSDP2's CPU offload steps
    # AdamW on the host, so its time follows the host: over six steps it was 181.9 and 264.1 ms on
    # two H100 machines (docs/history.md, Training); twelve steady it a little.
    big = dict(vocab=8192, seq=512, d=1024, layers=16, heads=16, batch=4, ratio=2.5, steps=30, soc_steps=8,
               block_mib=16, sweep=[0.6, 0.8, 1.0], sweep_steps=8, cap_steps=10, capacity_budget=30 * GiB,
               study_gib=3.0, study_start=8, study_limit=512, study_steps=4, small_d=768, small_layers=8,
               hf_vocab=8192, hf_d=1024, hf_ff=2816, hf_layers=20, hf_heads=16, hf_kv=4, peer_steps=14,
               plan_steps=28, block4_mib=64)
    small = dict(vocab=2048, seq=128, d=384, layers=8, heads=4, batch=8, ratio=2.5, steps=14, soc_steps=6,
                 block_mib=1, sweep=[0.8], sweep_steps=6, cap_steps=6, capacity_budget=4 * GiB,
                 study_gib=0.5, study_start=4, study_limit=64, study_steps=3, small_d=256, small_layers=4,
                 hf_vocab=2048, hf_d=384, hf_ff=1024, hf_layers=6, hf_heads=6, hf_kv=2, peer_steps=5,
                 plan_steps=12, block4_mib=16)
    for k, v in (small if a.quick else big).items():
        setattr(a, k, v)
    torch = setup()
    import tiermem
    h2d, d2h, duplex = link_rates(torch)
    rates = {"h2d": h2d, "d2h": d2h, "duplex": duplex}
    progress(f"link: {h2d} GB/s in, {d2h} GB/s out, {duplex} GB/s both ways")
    out = {"metrics": {"link_h2d_GBps": h2d, "link_d2h_GBps": d2h, "link_duplex_GBps": duplex},
           "checks": {}, "raw": {"args": {k: v for k, v in vars(a).items()}, "study_gib": a.study_gib,
                                 "bound": "max(resident step, (parameters + optimizer states - budget) in and out "
                                          "once at the rates measured here) (bench/bounds.py train_step); "
                                          "..._plan_bytes: the bytes tiermem moved at the same rates"}}
    if "1" in a.only or "2" in a.only:
        cfg, batches, res, budget, sweep = part1(torch, tiermem, a, rates, out)
        if "2" in a.only:
            part2(torch, tiermem, a, cfg, batches, out)
        del batches, res
        free()
    if "3" in a.only:
        part3(torch, tiermem, a, rates, out)
    p4 = None
    if "4" in a.only:
        from _recompute_study import part4, plot4
        part4(sys.modules[__name__], torch, tiermem, a, rates, out)
        p4 = plot4(out, plot_path("train_budget_recompute")) if "recompute_runs" in out["raw"] else None
    if "finetune" in a.only:
        from finetune import part_finetune
        part_finetune(sys.modules[__name__], torch, tiermem, a, rates, out)
    m = out["metrics"]
    rows = [[k, v] for k, v in m.items()]
    print(table(rows, ["metric", "value"]))
    print(out["checks"])
    pp = plot(out, plot_path("train_budget")) if "1" in a.only else None
    for n in out.get("notes", []):
        print("BELOW THE BOUND: " + n)
    parts = "".join(sorted(set(a.only)))
    write_results("train_budget", m, out["checks"], out["raw"], extra_files=[f for f in (pp, p4) if f],
                  tag=("" if parts == "1234" else f"part{parts}") + (f"-seq{a.ft_seq}" if a.ft_seq else ""),
                  notes=out.get("notes", []))


if __name__ == "__main__":
    main()
