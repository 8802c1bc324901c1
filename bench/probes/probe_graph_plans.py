"""How long a whole-step graph of each kind of plan replays, with what the plan's model was given:
data to check the model of a step (NOTE [recompute plan] in tiermem/training/plan.py) where no host
time hides the link (NOTE [whole-step graphs] in tiermem/training/stepgraph.py).

For each model of bench/train_budget.py part 4 (the GPT, the Qwen2-style), each budget 1/x of the
training state (``--ratios``) and each recompute mode (``--modes``: "never" swaps and keeps only,
"always" recomputes every block it can, "auto" chooses and lets the replays judge), one
``wrap_training`` runs ``train.graphed(loss)`` for ``--steps`` steps. Every step is timed with
CUDA events and a synchronize after it. Written per run: the trace the plan was made from (every
saved storage, the blocks' bytes and measured times), every plan the steps followed (its
choices, its predicted time and table), and each step's time, plan and whether it was a replay.

    python bench/probes/probe_graph_plans.py [--models gpt,hf] [--ratios 1.5,2.5,4] [--modes never,always,auto]

Writes $OUT/probe_graph_plans-<models>.json (or bench/results/).
"""
import argparse
import dataclasses
import gc
import json
import os
import statistics
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import _path  # noqa: F401 - bench/ and the repository root on sys.path
from _common import provenance  # noqa: E402
import torch
from _recompute_study import causal_mask, hf_graph_loss, probe_model
from train_budget import link_rates

import tiermem


def plain(x):
    """A dataclass as JSON-able values: sets sorted, tuples as lists."""
    if dataclasses.is_dataclass(x):
        return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (set, frozenset)):
        return sorted(x)
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    return x


def plan_record(p):
    return {"kind": p.kind, "resident_blocks": sorted(p.resident_blocks), "recompute": sorted(p.recompute),
            "keep": sorted(p.keep), "predicted_ms": round(p.predicted_seconds() * 1e3, 3),
            "compute_scale": p.compute_scale, "h2d_bytes": p.h2d_bytes, "d2h_bytes": p.d2h_bytes,
            "swapped_bytes": p.swapped_bytes, "fwd_ms": p.fwd_ms, "bwd_ms": p.bwd_ms,
            "recompute_ms": p.recompute_ms, "link_GBps": p.link_GBps, "budget": p.budget, "margin": p.margin,
            "floor_peak": p.floor_peak, "measured": dict(p.measured), "table": p.table()}


def one(name, ratio, mode, a, tier, rate):
    build, loss_fn, _, ids = probe_model(torch, name)
    g = torch.Generator(device="cuda").manual_seed(2)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    budget = int(16 * sum(p.numel() for p in model.parameters()) / ratio)
    if a.warm:      # a matmul and its backward first: cuBLAS's workspaces exist before the wrap
        x = torch.randn(64, 64, device="cuda", requires_grad=True)
        (x @ x).sum().backward()
        torch.cuda.synchronize()
    kw = {} if a.lookahead is None else {"lookahead": a.lookahead}
    if a.window_mib:
        kw["window"] = a.window_mib << 20
    train = tier.wrap_training(model, opt, budget, block_bytes=64 << 20, recompute=mode, link_GBps=rate, **kw)
    fn = hf_graph_loss(causal_mask(torch, ids, torch.float32)) if name == "hf" else loss_fn
    step = train.graphed(lambda x: fn(model, x))
    plans, steps, traces = [], [], []
    n = a.steps + (a.auto_extra if mode == "auto" else 0)
    t0 = time.perf_counter()
    try:
        for i in range(n):
            x = ids if i == 0 else torch.randint(0, int(ids.max()) + 1, ids.shape, device="cuda", generator=g)
            r0, c0 = step.replays, step.captures
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            step(x)
            e1.record()
            e1.synchronize()
            p = train.plan
            if not plans or plans[-1] is not p:
                plans.append(p)
            if train.trace is not None and (not traces or traces[-1] is not train.trace):
                traces.append(train.trace)
            steps.append({"ms": round(e0.elapsed_time(e1), 3), "plan": len(plans) - 1, "trace": len(traces) - 1,
                          "replay": step.replays == r0 + 1 and step.captures == c0,
                          "capture": step.captures != c0})
            if (i + 1) % 10 == 0 or i + 1 == n:
                print(f"  {name} 1/{ratio:g} {mode}: step {i + 1}/{n} {steps[-1]['ms']:.1f} ms"
                      f" ({'replay' if steps[-1]['replay'] else 'eager'}) {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        off, drops = step.off, list(step.drops)
        step.close()
        train.unwrap()
    by_plan = {}
    for s in steps:
        if s["replay"]:
            by_plan.setdefault(s["plan"], []).append(s["ms"])
    for k, v in by_plan.items():
        tail = v[1:] or v
        print(f"  {name} 1/{ratio:g} {mode}: plan {k} ({plans[k].kind}, {len(plans[k].recompute)} recomputed) "
              f"predicted {plans[k].predicted_seconds() * 1e3:.1f} ms, replayed {statistics.median(tail):.1f} ms "
              f"over {len(tail)}", flush=True)
    out = {"model": name, "ratio": ratio, "mode": mode, "budget": budget, "lookahead": a.lookahead, "warm": a.warm, "window_mib": a.window_mib, "off": off, "drops": drops,
           "plans": [plan_record(p) for p in plans], "traces": [plain(t) for t in traces], "steps": steps,
           "replay_median_ms": {str(k): round(statistics.median(v[1:] or v), 3) for k, v in by_plan.items()}}
    del step, train, model, opt
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt,hf")
    ap.add_argument("--ratios", default="1.5,2.5,4")
    ap.add_argument("--modes", default="never,always,auto")
    ap.add_argument("--steps", type=int, default=26)
    ap.add_argument("--auto-extra", type=int, default=20, help="more steps for auto: its replays may try a plan")
    ap.add_argument("--lookahead", type=int, default=None, help="wrap_training's lookahead (default: its own)")
    ap.add_argument("--warm", action="store_true", help="a matmul before each wrap (cuBLAS's workspaces made outside it)")
    ap.add_argument("--window-mib", type=int, default=0, help="the swap's window (default: its own, budget/32)")
    ap.add_argument("--tag", default="", help="added to the JSON's name")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "..", "results"))
    a = ap.parse_args()
    torch.use_deterministic_algorithms(True, warn_only=True)
    h2d, d2h, duplex = link_rates(torch)
    rate = min(h2d, d2h)
    print(f"link {h2d} / {d2h} GB/s, both ways {duplex}", flush=True)
    tier = tiermem.Tier(0, cap="12GiB")
    result = {"device": torch.cuda.get_device_name(), **provenance(),
              "date": time.strftime("%Y-%m-%d"), "link": {"h2d": h2d, "d2h": d2h, "duplex": duplex}, "runs": []}
    path = os.path.join(a.out, f"probe_graph_plans-{a.models.replace(',', '-')}{a.tag}.json")
    for name in a.models.split(","):
        for ratio in (float(x) for x in a.ratios.split(",")):
            for mode in a.modes.split(","):
                try:
                    result["runs"].append(one(name, ratio, mode, a, tier, rate))
                except Exception as e:      # one run's failure is data too; the others still run
                    print(f"  {name} 1/{ratio:g} {mode}: failed: {e!r}", flush=True)
                    result["runs"].append({"model": name, "ratio": ratio, "mode": mode, "error": repr(e)})
                    gc.collect()
                    torch.cuda.empty_cache()
                with open(path, "w") as f:
                    json.dump(result, f)
    print("wrote", path)


if __name__ == "__main__":
    main()
