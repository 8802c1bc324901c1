"""What a training step under wrap_training really holds on the device, against what its plan
predicted: the GPT model of bench/train_budget.py (16 layers of 1024, vocab 8192, fused AdamW
fp32, batch 4x512) at 1/2.5 and 1/4 of its training state.

Per step: the plan's kind and predicted peak (its floor, the traced step's peak, and what the
plan adds above it), tiermem's own count of the step's peak (``train.resident_peak()``), and
independent of tiermem's books torch's absolute peak reserved bytes plus tiermem's managed
resident bytes, less what torch held before wrap_training; the step's time.

    python bench/probes/probe_floor.py [--ratios 2.5,4] [--steps 12]

Writes bench/results/probe_floor-<device>-<date>.json (and under $OUT).
"""
import argparse
import json
import os
import sys

import _path  # noqa: F401 - bench/ and the repository root on sys.path
import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ratios", default="2.5,4")
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    from _common import device_name, device_slug, provenance
    from train_budget import build_gpt, gpt_loss

    import tiermem
    from tiermem.testing import GPTConfig
    cfg = GPTConfig(vocab=8192, seq=512, d=1024, layers=16, heads=16)
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, cfg.vocab, (4, 513), device="cuda", generator=g) for _ in range(a.steps)]
    tier = tiermem.Tier(0, cap="12GiB")
    out = {"device": device_name(), **provenance(), "runs": {}}
    for ratio in (float(x) for x in a.ratios.split(",")):
        torch.cuda.empty_cache()
        model = build_gpt(torch, cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        state = 16 * sum(p.numel() for p in model.parameters())
        budget = int(state / ratio)
        train = tier.wrap_training(model, opt, budget, block_bytes=64 << 20)
        before = train.outside
        rows = []
        for i, ids in enumerate(batches):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            with train.step():
                gpt_loss(model, ids).backward()
            e.record()
            e.synchronize()
            p = train.plan
            absolute = torch.cuda.max_memory_reserved() + tier.resident_bytes - before
            row = {"step": i + 1, "ms": round(s.elapsed_time(e), 1), "kind": p.kind if p else None,
                   "recomputed": len(p.recompute) if p else 0,
                   "predicted_peak_GB": round(p.predicted_peak / 1e9, 3) if p else None,
                   "floor_GB": round(p.floor_peak / 1e9, 3) if p else None,
                   "resident_peak_GB": round(train.resident_peak() / 1e9, 3),
                   "absolute_peak_GB": round(absolute / 1e9, 3),
                   "reserved_now_GB": round(torch.cuda.memory_reserved() / 1e9, 3),
                   "slots_GB": round(train.slot_bytes / 1e9, 3), "managed_resident_GB": round(tier.resident_bytes / 1e9, 3)}
            rows.append(row)
            print(f"1/{ratio:g}", row, flush=True)
        out["runs"][f"{ratio:g}"] = {"budget_GB": round(budget / 1e9, 3), "outside_GB": round(before / 1e9, 3),
                                     "steps": rows, "plan": train.plan.table()}
        print(train.plan.table())
        train.unwrap()
        del train, model, opt
        import gc
        gc.collect()
        torch.cuda.empty_cache()
    tier.close()
    import datetime

    from _path import RESULTS
    name = f"probe_floor-{device_slug(out['device'])}-{datetime.date.today():%Y%m%d}.json"
    for d in filter(None, (RESULTS, os.environ.get("OUT"))):
        with open(os.path.join(d, name), "w") as f:
            json.dump(out, f, indent=1)
    print("wrote", name, file=sys.stderr)


if __name__ == "__main__":
    main()
