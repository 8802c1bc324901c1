"""A whole wrap_training step as one CUDA graph (NOTE [whole-step graphs] in tiermem/training/stepgraph.py),
against the same steps run eagerly, on the models of bench/train_budget.py part 4 at a budget of
1/``--ratio`` of the training state (fp32 parameters, gradients, fused AdamW's two moments):

  resident           plain PyTorch, everything on the device
  tiermem eager      ``with train.step(): loss_fn(...).backward()``
  tiermem graphed    ``train.graphed(loss_fn)``: eager until the plan settles, then replayed

Each step is timed with CUDA events and a synchronize after it (the host's time counts, as in
the bench); times are medians of the steps after ``--settle``. Losses are compared bitwise with
the resident run's.

    python bench/probes/probe_step_graph.py [--model gpt|hf|both] [--ratio 2.5] [--steps 30]
"""
import argparse
import gc
import json
import os
import statistics

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import _path  # noqa: F401 - bench/ and the repository root on sys.path
from _common import provenance  # noqa: E402
import torch
from _recompute_study import causal_mask, hf_graph_loss, probe_model

import tiermem


def timed(fn, batches, label, mem=False):
    times, losses = [], []
    for i, ids in enumerate(batches):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        loss = fn(ids)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
        losses.append(loss.detach())
        if i in (0, len(batches) - 1) or (i + 1) % 10 == 0 or mem:
            extra = ""
            if mem:
                get = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: -1)
                extra = (f" reserved {torch.cuda.memory_reserved() / 1e9:.3f} GB, peak {torch.cuda.max_memory_reserved() / 1e9:.3f},"
                         f" allocated peak {torch.cuda.max_memory_allocated() / 1e9:.3f}, fraction {get(0):.4f}")
            print(f"  {label}: step {i + 1}/{len(batches)} {times[-1]:.1f} ms{extra}", flush=True)
    return times, [float(x) for x in losses]


def run(name, a, tier):
    build, loss_fn, _, ids = probe_model(torch, name)
    g = torch.Generator(device="cuda").manual_seed(2)
    batches = [ids] + [torch.randint(0, int(ids.max()) + 1, ids.shape, device="cuda", generator=g)
                       for _ in range(a.steps - 1)]
    out = {}
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    state = 16 * sum(p.numel() for p in model.parameters())

    def plain(x):
        loss = loss_fn(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    out["resident"] = timed(plain, batches, f"{name} resident")
    del model, opt, plain
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    budget = int(state / a.ratio)
    for mode in ("eager", "graphed"):
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        train = tier.wrap_training(model, opt, budget)
        if mode == "eager":
            def step(x):
                with train.step():
                    loss = loss_fn(model, x)
                    loss.backward()
                return loss
        else:
            fn = hf_graph_loss(causal_mask(torch, ids, torch.float32)) if name == "hf" else loss_fn
            step = train.graphed(lambda x: fn(model, x))
        torch.cuda.reset_peak_memory_stats()
        out[mode] = timed(step, batches, f"{name} 1/{a.ratio} {mode}", mem=a.mem and mode == "graphed")
        info = {"peak_reserved": torch.cuda.max_memory_reserved(), "budget": budget,
                "plan": train.plan.table().splitlines()[:8] if train.plan else None}
        if mode == "graphed":
            info.update(off=step.off, captures=step.captures, replays=step.replays, drops=step.drops)
            print(f"  {name} graphed: {step!r}", flush=True)
        out[mode + "_info"] = info
        train.unwrap()
        del model, opt, train, step
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    res = {}
    want = out["resident"][1]
    for mode in ("resident", "eager", "graphed"):
        t = out[mode][0][a.settle:]
        res[mode] = {"median_ms": round(statistics.median(t), 2), "min_ms": round(min(t), 2),
                     "losses_equal": out[mode][1] == want, "times": [round(x, 2) for x in out[mode][0]]}
    r = res["resident"]["median_ms"]
    for mode in ("eager", "graphed"):
        res[mode]["over_resident"] = round(res[mode]["median_ms"] / r, 3)
        res[mode + "_info"] = out[mode + "_info"]
    print(f"{name}: " + ", ".join(f"{m} {res[m]['median_ms']:.1f} ms" + (f" ({res[m]['over_resident']:.2f}x)" if m != "resident" else "")
                                  + ("" if res[m]["losses_equal"] else " LOSSES DIFFER") for m in ("resident", "eager", "graphed")), flush=True)
    if not res["graphed"]["losses_equal"]:
        print("  losses:", list(zip(want, out["graphed"][1]))[:40])
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="both")
    ap.add_argument("--ratio", type=float, default=2.5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--settle", type=int, default=15)
    ap.add_argument("--mem", action="store_true", help="torch's memory after every graphed step")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    torch.use_deterministic_algorithms(True, warn_only=True)
    tier = tiermem.Tier(0, cap="12GiB")
    result = {"device": torch.cuda.get_device_name(), "ratio": a.ratio, **provenance()}
    for name in (["gpt", "hf"] if a.model == "both" else [a.model]):
        result[name] = run(name, a, tier)
    path = os.path.join(a.out, f"probe_step_graph-{a.model}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
