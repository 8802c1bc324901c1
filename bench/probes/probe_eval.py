"""An evaluation forward between training steps under wrap_training, against the resident model's:
the GPT model of bench/train_budget.py (16 layers of 1024, vocab 8192, batch 4x512, AdamW fp32)
at 1/2.5 of its training state, a forward under torch.no_grad() after a few training steps.

For each: the forward's median time (CUDA events, after a warm-up), its logits against the
resident model's (the weights are the same: both trained the same steps from the same seed),
and the tiered run's bytes of parameters the forward needs from the host.

    python bench/probes/probe_eval.py [--steps 6] [--evals 10]

Writes bench/results/probe_eval-<device>-<date>.json (or under $OUT).
"""
import argparse
import json
import os
import sys
import time

import _path  # noqa: F401 - bench/ and the repository root on sys.path
import torch
from _common import cuda_times, median, provenance


def timed(run, n):
    """Median ms of ``run`` over ``n`` calls after two warm-up calls."""
    return median(cuda_times(run, reps=n, warmup=2)) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6, help="training steps before the evaluation")
    ap.add_argument("--evals", type=int, default=10)
    a = ap.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    from train_budget import build_gpt  # the bench's GPT and its loss
    from train_budget import gpt_loss as loss_of

    import tiermem
    from tiermem.testing import GPTConfig
    cfg = GPTConfig(vocab=8192, seq=512, d=1024, layers=16, heads=16)
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, cfg.vocab, (4, 513), device="cuda", generator=g) for _ in range(a.steps)]
    probe = torch.randint(0, cfg.vocab, (4, 512), device="cuda", generator=g)

    def build():
        m = build_gpt(torch, cfg)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-4)

    out = {}
    model, opt = build()
    for ids in batches:
        loss_of(model, ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        want = model(probe).float()
        out["resident_eval_ms"] = round(timed(lambda: model(probe), a.evals), 2)
    state = sum(p.numel() * p.element_size() for p in model.parameters()) * 4
    del model, opt
    torch.cuda.empty_cache()

    model, opt = build()
    tier = tiermem.Tier(0, cap="12GiB")
    train = tier.wrap_training(model, opt, int(state / 2.5), block_bytes=64 << 20)
    for ids in batches:
        with train.step():
            loss_of(model, ids).backward()
    model.eval()
    streamed = sum(train.blocks[i].p_bytes for i in train.plan.streamed_blocks)
    with torch.no_grad():
        got = model(probe).float()
        out["tiermem_eval_ms"] = round(timed(lambda: model(probe), a.evals), 2)
    out["eval_over_resident"] = round(out["tiermem_eval_ms"] / out["resident_eval_ms"], 3)
    out["streamed_param_bytes"] = streamed
    out["streamed_bound_ms"] = round(streamed / 55e9 * 1e3, 2)
    out["logits_equal"] = bool(torch.equal(got, want))
    out["logits_max_abs_diff"] = float((got - want).abs().max())
    model.train()
    with train.step():                 # and training goes on after it
        loss_of(model, batches[0]).backward()
    out["plan"] = str(train.plan).split("\n")[:5]
    train.unwrap()
    tier.close()
    for k, v in out.items():
        print(f"{k:<28} {v}", flush=True)
    dev = torch.cuda.get_device_name(0).split()[1].lower()
    path = os.path.join(os.environ.get("OUT") or _path.RESULTS, f"probe_eval-{dev}-{time.strftime('%Y%m%d')}.json")
    with open(path, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(0), **provenance(),
                   "results": out}, fh, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    sys.exit(main())
