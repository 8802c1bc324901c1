"""bench/advice_study.py: which memory advice for which role, for PyTorch training on Unified Memory.

Replicates two claims (issue 6):
  - Choi, Yeom & Kim 2021: PyTorch on Unified Memory costs little while the data fits;
  - Choi & Lee 2021: advice per data type (parameters, intermediate results, input data) beats
    plain Unified Memory (by 9.4% in the paper).

For ResNet-50 (SGD with momentum) and a GPT-2-style decoder (AdamW), training steps with random
data, in capacity and under an emulated budget, side by side:
  plain        plain PyTorch (no managed memory)
  um           default UM: everything managed (model built in role weight, optimizer step in
               role optimizer_state, inputs in role input, forward+backward in role activation),
               a Policy() with nothing set and no prefetch. Under the budget, data comes back
               only by page faults.
  pref_dev     preferred-location device on every role's pool
  read_mostly  read-mostly on the weight and input pools. Not on activations: every write to a
               read-mostly range collapses its duplicates, and in the smoke run on the H100
               read-mostly activations made a ResNet-50 step ~100x slower (15.5 s) even in
               capacity, too slow to include
  accessed_by  accessed-by device on every role's pool
  three_type   our reading of Choi & Lee's scheme (their exact assignment not checked here):
               parameters (weights and optimizer state): preferred-location device;
               intermediate results (activations, gradients, workspace): accessed-by device;
               input data: read-mostly (the device only reads it)
  default      tiermem's DEFAULT_POLICIES per role, without prefetch
  adv@role     (under the budget) one advice on one role, no advice on the others: 3 advices x
               4 roles, less read-mostly activations
  best_per_role (under the budget) each role with the single advice that won its adv@role rows
  tiermem      tiermem.wrap_training (default policy with its traced prefetch plan); the model
               is plain torch memory, the trainer tiers it within the budget

The budget (NOTE [UM residency estimate] in bench/um_budget.py): the managed rows run under
um_budget.UMBudget, which evicts least-recently-used segments to the host by prefetch
when the estimated device bytes pass it. The budget is --ratio of the footprint the um row
reached in capacity (the enforcer's estimate with no limit). Each model runs in its own process,
because torch_allocations' pools live for the process: that keeps the managed memory of one
process to a few GiB (capped with set_torch_managed_cap), far below the card's free memory.

    python bench/advice_study.py [--quick]
Writes bench/results/advice_study-<device>-<date>.json and a plot.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile

from _common import cuda_times, median, plot_path, progress, table, write_results

GiB, MiB = 1 << 30, 1 << 20
MAIN_ROWS = ["plain", "um", "pref_dev", "read_mostly", "accessed_by", "three_type", "default", "tiermem"]
ADVICE_ROWS = ["pref_dev", "read_mostly", "accessed_by", "three_type", "default"]
STUDY_ROLES = ["weight", "optimizer_state", "activation", "input"]
# One advice on one role, the other roles with none (budget only). Read-mostly activations are
# left out: every write collapses the duplicates (~100x slower in the smoke run, module docstring).
SINGLE_ROWS = [f"{adv}@{r}" for adv in ("pref_dev", "read_mostly", "accessed_by") for r in STUDY_ROLES
               if (adv, r) != ("read_mostly", "activation")]
ROWS = MAIN_ROWS + ["best_per_role"] + SINGLE_ROWS
MANAGED_CAP = "8GiB"   # all pools of one model process together; far below the 78 GiB free


def policies(row, best=None):
    from tiermem import Location, Policy, Role
    from tiermem.roles import DEFAULT_POLICIES
    roles = [Role.WEIGHT, Role.OPTIMIZER_STATE, Role.ACTIVATION, Role.INPUT]
    one = {"um": Policy(), "pref_dev": Policy(preferred_location=Location.DEVICE),
           "read_mostly": Policy(read_mostly=True), "accessed_by": Policy(accessed_by_device=True)}
    if "@" in row:
        adv, role = row.split("@")
        return {r: one[adv] if r.value == role else Policy() for r in roles}
    if row == "best_per_role":     # best: role name -> the advice that won its single rows
        return {r: one[best.get(r.value, "um")] for r in roles}
    if row == "read_mostly":     # not on activations: see the module docstring
        return {r: one[row] if r in (Role.WEIGHT, Role.INPUT) else Policy() for r in roles}
    if row in one:
        return {r: one[row] for r in roles}
    if row == "three_type":
        p = Policy(preferred_location=Location.DEVICE)
        return {Role.WEIGHT: p, Role.OPTIMIZER_STATE: p, Role.ACTIVATION: Policy(accessed_by_device=True),
                Role.INPUT: Policy(read_mostly=True)}
    if row == "default":
        return {r: DEFAULT_POLICIES[r] for r in roles}
    raise ValueError(row)


class Spec:
    def __init__(self, torch, name, a):
        import torch.nn.functional as F

        from tiermem.testing import GPT, GPTConfig, resnet50
        self.name = name
        if name == "resnet50":
            self.desc = f"ResNet-50, batch {a.rbatch}, {a.img}x{a.img}, SGD"
            self.build = lambda: resnet50(num_classes=100).cuda()
            self.opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
            self.data = lambda: (torch.randn(a.rbatch, 3, a.img, a.img, device="cuda"),
                                 torch.randint(0, 100, (a.rbatch,), device="cuda"))
            self.loss = lambda m, b: F.cross_entropy(m(b[0]), b[1])
        else:
            cfg = GPTConfig(vocab=8192, seq=a.seq, d=a.d, layers=a.layers, heads=a.d // 64)
            self.desc = f"GPT d={a.d} x{a.layers}, seq {a.seq}, batch {a.gbatch}, AdamW"
            self.build = lambda: GPT(cfg).cuda()
            self.opt = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4)

            def data():
                ids = torch.randint(0, cfg.vocab, (a.gbatch, cfg.seq + 1), device="cuda")
                return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
            self.data = data

            def loss(m, b):
                logits = m(b[0])
                return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[1].reshape(-1))
            self.loss = loss


def free(torch):
    import gc
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def run_plain(torch, spec, a):
    torch.manual_seed(0)
    model, batch = spec.build(), spec.data()
    opt = spec.opt(model)

    def step():
        spec.loss(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    ts = cuda_times(step, reps=a.steps, warmup=a.warmup)
    del model, opt, batch
    free(torch)
    return ts, {}


def check_managed(torch, tiermem, model, opt, batch, spec):
    """Pointer types of the step's tensors: parameters, gradients, optimizer states, inputs, saved activations."""
    saved = []
    with tiermem.torch_memory.torch_allocations("activation", policy=tiermem.Policy(), prefetch=False):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = spec.loss(model, batch)
        loss.backward()
    kinds = {"params": [p for p in model.parameters()], "grads": [p.grad for p in model.parameters()],
             "opt_state": [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.is_cuda],
             "inputs": list(batch), "activations": [t for t in saved if t.is_cuda] + [loss]}
    # Empty tensors (BatchNorm's reserve space in eval-free cuDNN paths) have no memory at all.
    kinds = {k: [t for t in v if t is not None and t.numel() > 0 and t.data_ptr() != 0] for k, v in kinds.items()}
    out = {k: (sum(tiermem.torch_memory.is_managed(t) for t in v), len(v)) for k, v in kinds.items()}
    opt.zero_grad(set_to_none=True)
    del saved, loss
    return out


def steps_for(row, cond, a):
    """(steps, warm-up) of a row: read-mostly rows take seconds a step, so they get few; the fast
    in-capacity rows get many, since their differences are a few percent."""
    if "read_mostly" in row:
        return 2, 1
    return (a.steps, a.warmup) if cond == "cap" else (a.budget_steps, 2)


def run_managed(torch, tiermem, spec, row, a, budget, best=None):
    from um_budget import UMBudget

    from tiermem import Role
    pol = policies(row, best)
    steps, warmup = steps_for(row, "cap" if budget is None else "budget", a)
    ta = tiermem.torch_memory.torch_allocations
    torch.manual_seed(0)
    with ta(Role.WEIGHT, policy=pol[Role.WEIGHT], prefetch=False):
        model = spec.build()
        opt = spec.opt(model)
    with ta(Role.INPUT, policy=pol[Role.INPUT], prefetch=False):
        batch = spec.data()
    # In capacity no enforcer runs (its Python hooks would be timed too); an untimed step
    # under one with no limit measures the footprint instead.
    ub = UMBudget(budget if budget is not None else 1 << 62)
    hs = ub.attach(model, opt) if budget is not None else []

    def step():
        with ta(Role.ACTIVATION, policy=pol[Role.ACTIVATION], prefetch=False), \
                (ub.saving() if hs else contextlib.nullcontext()):
            spec.loss(model, batch).backward()
            with ta(Role.OPTIMIZER_STATE, policy=pol[Role.OPTIMIZER_STATE], prefetch=False):
                opt.step()
            opt.zero_grad(set_to_none=True)
    ts = cuda_times(step, reps=steps, warmup=warmup)
    if budget is None and row == "um":
        hs = ub.attach(model, opt)
        step()
        torch.cuda.synchronize()
    info = {"um_budget": ub.stats.as_dict()}
    if row == "um" and budget is None:
        ub.detach(hs)
        info["managed_check"] = check_managed(torch, tiermem, model, opt, batch, spec)
    ub.detach(hs)
    del model, opt, batch
    free(torch)
    return ts, info


_TIER = []


def run_tiermem(torch, tiermem, spec, a, budget):
    if not _TIER:
        _TIER.append(tiermem.Tier(0, cap="4GiB"))
    torch.manual_seed(0)
    model, batch = spec.build(), spec.data()
    opt = spec.opt(model)
    train = _TIER[0].wrap_training(model, opt, budget if budget is not None else 16 * GiB)

    def step():
        with train.step():
            spec.loss(model, batch).backward()
    steps, warmup = steps_for("tiermem", "cap" if budget is None else "budget", a)
    ts = cuda_times(step, reps=steps, warmup=warmup)
    info = {"report": train.report(), "plan": train.plan.table() if train.plan else None}
    train.unwrap()
    del model, opt, batch, train
    free(torch)
    return ts, info


def child(a):
    """One model, every row, in this process; results to a.out as JSON."""
    import torch

    import tiermem
    tiermem.torch_memory.set_torch_managed_cap(MANAGED_CAP)
    spec = Spec(torch, a.model, a)
    progress(f"{spec.name}: {spec.desc}")
    res = {"desc": spec.desc, "cap": {}, "budget": {}, "info": {}}

    def record(cond, row, fn):
        try:
            ts, info = fn()
        except Exception as e:       # reported, not hidden: the row shows nan
            progress(f"  {spec.name} {cond} {row} FAILED: {type(e).__name__}: {e}")
            free(torch)
            ts, info = [float("nan")], {"error": f"{type(e).__name__}: {e}"}
        res[cond][row] = median(ts) * 1e3
        res["info"][f"{cond}/{row}"] = {"times_ms": [t * 1e3 for t in ts], **info}
        progress(f"  {spec.name} {cond:6s} {row:11s} {res[cond][row]:8.1f} ms/step")
        return info
    record("cap", "plain", lambda: run_plain(torch, spec, a))
    info = record("cap", "um", lambda: run_managed(torch, tiermem, spec, "um", a, None))
    footprint = info["um_budget"]["um_budget.peak_seen_bytes"]
    budget = int(footprint * a.ratio)
    res.update(footprint_bytes=footprint, budget_bytes=budget)
    progress(f"  {spec.name}: managed footprint {footprint / MiB:.0f} MiB (estimate), budget {budget / MiB:.0f} MiB")
    for row in ADVICE_ROWS:
        record("cap", row, lambda: run_managed(torch, tiermem, spec, row, a, None))
    record("cap", "tiermem", lambda: run_tiermem(torch, tiermem, spec, a, None))
    for row in ["um", *ADVICE_ROWS, *SINGLE_ROWS]:
        record("budget", row, lambda: run_managed(torch, tiermem, spec, row, a, budget))
    # Per role, the single advice that beat no advice by the most (or none).
    best = {}
    for r in STUDY_ROLES:
        cands = {adv: res["budget"].get(f"{adv}@{r}", float("nan")) for adv in ("pref_dev", "read_mostly", "accessed_by")}
        adv, t = min(((k, v) for k, v in cands.items() if math.isfinite(v)), key=lambda kv: kv[1], default=("um", 0))
        best[r] = adv if t < res["budget"]["um"] else "um"
    res["best_per_role"] = best
    progress(f"  {spec.name}: best single advice per role under the budget: {best}")
    record("budget", "best_per_role", lambda: run_managed(torch, tiermem, spec, "best_per_role", a, budget, best))
    record("budget", "tiermem", lambda: run_tiermem(torch, tiermem, spec, a, budget))
    st = tiermem.torch_memory.torch_allocator_stats()
    res["allocator"] = st.as_dict()
    progress(f"  {spec.name}: managed peak {st.peak_bytes / GiB:.2f} GiB live in this process, {st.refused} refused")
    with open(a.out, "w") as f:
        json.dump(res, f, default=str)


def geomean(xs):
    xs = [x for x in xs if x and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("no matplotlib: no plot")
        return None
    groups = [(m, c) for m in results for c in ("cap", "budget")]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(15, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    rows = MAIN_ROWS + ["best_per_role"]
    w = 0.8 / len(rows)
    for i, row in enumerate(rows):
        ys = [results[m][c]["um"] / results[m][c][row] if row in results[m][c] else 0 for m, c in groups]
        ax.bar([g + i * w for g in range(len(groups))], ys, w, label=row)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([g + 0.4 - w / 2 for g in range(len(groups))])
    ax.set_xticklabels([f"{m}\n{'in capacity' if c == 'cap' else 'under budget'}" for m, c in groups])
    ax.set_ylabel("speed relative to default UM (higher is better)")
    ax.set_title("Advice per role for PyTorch training on Unified Memory")
    ax.legend(ncol=3, fontsize=7)
    models = list(results)
    w2 = 0.8 / max(len(models), 1)
    for k, m in enumerate(models):
        ys = [results[m]["budget"]["um"] / results[m]["budget"][row] if row in results[m]["budget"] else 0
              for row in SINGLE_ROWS]
        ax2.barh([i + k * w2 for i in range(len(SINGLE_ROWS))], ys, w2, label=m)
    ax2.axvline(1.0, color="k", lw=0.8)
    ax2.set_yticks([i + 0.4 - w2 / 2 for i in range(len(SINGLE_ROWS))])
    ax2.set_yticklabels(SINGLE_ROWS, fontsize=7)
    ax2.set_xscale("log")
    ax2.set_xlabel("speed relative to default UM, under the budget (log)")
    ax2.set_title("One advice on one role")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--models", default="resnet50,gpt", help="comma-separated: resnet50, gpt")
    p.add_argument("--model", choices=["resnet50", "gpt"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=None, help="timed steps per in-capacity row")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--budget-steps", type=int, default=None, help="timed steps per row under the budget")
    p.add_argument("--child-timeout", type=float, default=330, help="seconds per model")
    p.add_argument("--ratio", type=float, default=0.5, help="budget as a share of the in-capacity footprint")
    p.add_argument("--rbatch", type=int, default=64)
    p.add_argument("--img", type=int, default=None)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--gbatch", type=int, default=4)
    a = p.parse_args()
    a.steps = a.steps or (4 if a.quick else 15)
    a.warmup = a.warmup or (2 if a.quick else 5)
    a.budget_steps = a.budget_steps or (2 if a.quick else 5)
    a.img = a.img or (64 if a.quick else 80)
    if a.model:
        return child(a)
    results = {}
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    bad = [m for m in models if m not in ("resnet50", "gpt")]
    if bad or not models:
        p.error(f"--models takes resnet50 and/or gpt, got {a.models!r}")
    for m in models:
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        args = [sys.executable, os.path.abspath(__file__), "--model", m, "--out", path, "--steps", str(a.steps),
                "--warmup", str(a.warmup), "--budget-steps", str(a.budget_steps), "--ratio", str(a.ratio), "--rbatch", str(a.rbatch), "--img", str(a.img),
                "--d", str(a.d), "--layers", str(a.layers), "--seq", str(a.seq), "--gbatch", str(a.gbatch)]
        try:
            rc = subprocess.run(args, timeout=a.child_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if rc != 0:
            progress(f"{m} failed (exit {rc}): left out")
            continue
        with open(path) as f:
            results[m] = json.load(f)
        os.unlink(path)

    rows = []
    for row in ROWS:
        rows.append([row] + [results[m][c]["um"] / results[m][c][row] if row in results[m][c] else "-"
                             for m in results for c in ("cap", "budget")])
    heads = ["time/iter: default UM over row (>1 faster)"] + [f"{m} {'cap' if c == 'cap' else 'budget'}"
                                                              for m in results for c in ("cap", "budget")]
    print()
    print(table(rows, heads))
    ms = [[row] + [results[m][c].get(row, float("nan")) for m in results for c in ("cap", "budget")] for row in ROWS]
    print()
    print(table(ms, ["ms/iter (median)"] + heads[1:]))
    for m, r in results.items():
        print(f"{m}: {r['desc']}; footprint {r['footprint_bytes'] / MiB:.0f} MiB, budget {r['budget_bytes'] / MiB:.0f} MiB")

    over = {m: r["cap"]["um"] / r["cap"]["plain"] for m, r in results.items()}
    cand_rows = [*ADVICE_ROWS, "best_per_role", *SINGLE_ROWS]
    best = {m: max((row for row in cand_rows if math.isfinite(r["budget"].get(row, float("nan")))),
                   key=lambda row: r["budget"]["um"] / r["budget"][row]) for m, r in results.items()}
    adv = {m: r["budget"]["um"] / r["budget"][best[m]] for m, r in results.items()}
    tm = {m: r["budget"]["um"] / r["budget"]["tiermem"] for m, r in results.items()}
    checks_raw = {m: r["info"]["cap/um"].get("managed_check", {}) for m, r in results.items()}
    managed_ok = all(n == total and total > 0 for c in checks_raw.values() for k, (n, total) in c.items()
                     if k != "opt_state" or total > 0)
    metrics = {"um_in_capacity_overhead": round(geomean(over.values()), 4),
               "role_advice_speedup_over_default_um_budget": round(geomean(adv.values()), 4),
               "tiermem_speedup_over_default_um_budget": round(geomean(tm.values()), 4)}
    for m in results:
        metrics[f"um_in_capacity_overhead.{m}"] = round(over[m], 4)
        metrics[f"role_advice_speedup_over_default_um_budget.{m}"] = round(adv[m], 4)
        metrics[f"tiermem_speedup_over_default_um_budget.{m}"] = round(tm[m], 4)
    checks = {"torch_allocations_managed": managed_ok}
    print()
    print(f"best role-advice set under the budget: {best}")
    print(f"managed pointer check (managed/total per kind): {checks_raw}")
    for k, v in metrics.items():
        print(f"  {k}: {v}")
    print(f"  torch_allocations_managed: {managed_ok}")
    png = plot(results, plot_path("advice_study"))
    print(f"best single advice per role: { {m: r.get('best_per_role') for m, r in results.items()} }")
    raw = {"results": results, "best_advice_row": best, "managed_check": checks_raw,
           "args": vars(a), "metric_note": "geometric means over the two models; per model under metric.<model>",
           "plot": os.path.basename(png) if png else None}
    models = "-".join(sorted(results))
    write_results("advice_study", metrics, checks, raw, extra_files=[png] if png else [],
                  tag="" if models == "gpt-resnet50" else models)   # a model run alone keeps its own file


if __name__ == "__main__":
    main()
