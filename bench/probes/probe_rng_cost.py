"""What torch's checkpoint pays to keep the RNG state (preserve_rng_state=True), on the host.

Sections:
  calls   microseconds per call of what non-reentrant checkpoint does for the RNG state once per
          checkpointed forward (torch.get_rng_state, torch.utils.checkpoint.get_device_states of
          one CUDA tensor) and once per recompute (torch.random.fork_rng over one device, with
          set_device_states inside), against reading the CUDA generator's offset
  steps   the Qwen2-style model of bench/train_budget.py part 4 (eager attention, fp32, AdamW,
          batch 4x512), torch's checkpoint on every layer with and without the RNG state,
          alternated three times (median of each run's last 6 of 8 steps), so the machine's
          drift shows as spread within each setting rather than as a difference between them

    python bench/probes/probe_rng_cost.py
Writes $OUT/probe_rng_cost.json (or bench/results/probe_rng_cost-<date>.json).
"""
import argparse
import datetime
import json
import os
import statistics

import _path  # noqa: F401 - bench/ and the repository root on sys.path
import torch
import torch.utils.checkpoint as cp
from _common import cuda_times, host_us_per_call, provenance


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    R = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    x = torch.randn(4, 512, 1024, device="cuda")
    gen = torch.cuda.default_generators[0]
    devs, states = cp.get_device_states(x)

    def fork():
        with torch.random.fork_rng(devices=devs, enabled=True, device_type="cuda"):
            torch.set_rng_state(cpu)
            cp.set_device_states(devs, states, device_type="cuda")
    cpu = torch.get_rng_state()
    R["calls_us"] = {"torch.get_rng_state": host_us_per_call(torch.get_rng_state),
                     "get_device_states(x)": host_us_per_call(lambda: cp.get_device_states(x)),
                     "fork_rng+set_states": host_us_per_call(fork),
                     "cuda_generator.get_offset": host_us_per_call(gen.get_offset)}
    print(json.dumps(R["calls_us"]), flush=True)

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    from _recompute_study import hf_loss, qwen2
    args = argparse.Namespace(hf_vocab=8192, hf_d=1024, hf_ff=2816, hf_layers=20, hf_heads=16, hf_kv=4, seq=512)
    model = qwen2(torch, args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.hf_vocab, (4, 513), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    keep = {"rng": True}
    for blk in model.model.layers:
        f = blk.__class__.forward.__get__(blk)
        blk.forward = (lambda *xs, f=f, **k:
                       cp.checkpoint(f, *xs, use_reentrant=False, preserve_rng_state=keep["rng"], **k))

    def step():
        hf_loss(model, ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    runs = {"rng=True": [], "rng=False": []}
    for r in range(a.rounds):
        for rng in (True, False):
            keep["rng"] = rng
            t = cuda_times(step, reps=a.steps - 2, warmup=2)
            runs[f"rng={rng}"].append(round(statistics.median(t) * 1e3, 1))
            print(f"round {r} rng={rng}: {runs[f'rng={rng}'][-1]} ms", flush=True)
    R["hf_checkpoint_step_ms"] = runs
    R["hf_rng_cost_ms"] = round(statistics.median(runs["rng=True"]) - statistics.median(runs["rng=False"]), 1)
    print(json.dumps(R), flush=True)
    out = os.environ.get("OUT") or _path.RESULTS
    name = "probe_rng_cost.json" if os.environ.get("OUT") else f"probe_rng_cost-{datetime.date.today():%Y%m%d}.json"
    with open(os.path.join(out, name), "w") as f:
        json.dump({**provenance(), **R}, f, indent=1)


if __name__ == "__main__":
    main()
