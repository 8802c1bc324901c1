"""Can a recomputed block's backward replayed as a CUDA graph close the gap to the resident step?

Everything resident (no tiermem budget): the GPT-style model and the Qwen2-style transformers model
of bench/train_budget.py, fp32, fused AdamW, batch 4x512. Runs, from the same initial weights and
batch: resident; torch's non-reentrant checkpoint on every layer; tiermem's Replays on every
layer (NOTE [replayed recompute] in tiermem/training/replay.py). Step medians (CUDA events, after
warm-up), torch's peak reserved bytes, and whether each run's losses equal the resident run's
bitwise.

    python bench/probes/probe_replay.py [--models gpt,hf] [--steps 12]
"""
import argparse
import json
import os
import statistics

import _path  # noqa: F401 - bench/ and the repository root on sys.path
from _common import provenance  # noqa: E402
import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt,hf")
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    from _recompute_study import hf_loss, qwen2

    from tiermem.testing import GPT, GPTConfig
    from tiermem.training.replay import Replays
    args = argparse.Namespace(hf_vocab=8192, hf_d=1024, hf_ff=2816, hf_layers=20, hf_heads=16, hf_kv=4, seq=512)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": {}}

    def gpt():
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab=8192, seq=512, d=1024, layers=16, heads=16)).cuda()

    def gpt_loss(model, ids):
        logits = model(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    models = {"gpt": (gpt, gpt_loss, lambda m: list(m.blocks)),
              "hf": (lambda: qwen2(torch, args), hf_loss, lambda m: list(m.model.layers))}
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, 8192, (4, 513), device="cuda", generator=g) for _ in range(a.steps)]
    for name in a.models.split(","):
        build, loss_fn, layers = models[name]
        res = out["results"][name] = {}
        ref = None
        for mode in ("resident", "checkpoint", "replay"):
            model = build()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            rp = None
            if mode == "checkpoint":
                for blk in layers(model):
                    f = blk.forward
                    blk.forward = (lambda *x, f=f, **k:
                                   torch.utils.checkpoint.checkpoint(f, *x, use_reentrant=False, **k))
            elif mode == "replay":
                rp = Replays(torch, capture=True, params_of=lambda m: [p for p in m.parameters() if p.requires_grad])
                for blk in layers(model):
                    f = blk.forward
                    blk.forward = (lambda *x, f=f, blk=blk, **k: rp.run(blk, f, x, k))
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            times, losses = [], []
            for ids in batches:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                loss = loss_fn(model, ids)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=False)      # gradients keep their addresses (a graph adds into them)
                e.record()
                losses.append(loss.detach())
                e.synchronize()
                times.append(s.elapsed_time(e))
            losses = [x.item() for x in losses]
            ref = ref or losses
            res[mode] = {"step_ms": round(statistics.median(times[4:]), 2), "times": [round(t, 1) for t in times],
                         "peak_reserved_GB": round(torch.cuda.max_memory_reserved() / 1e9, 3),
                         "losses_equal_resident": losses == ref, "first_losses": losses[:3]}
            if rp is not None:
                res[mode].update(captured=rp.captured, replayed=rp.replayed, eager=len(rp.eager))
            print(name, mode, json.dumps(res[mode]), flush=True)
            del model, opt, rp
            torch.cuda.empty_cache()
        r = res["resident"]["step_ms"]
        print(f"{name}: checkpoint {res['checkpoint']['step_ms'] / r:.3f}x, replay {res['replay']['step_ms'] / r:.3f}x resident",
              flush=True)
    path = os.path.join(os.environ.get("OUT", "bench/results"), "probe_replay.json")
    with open(path, "w") as fh:
        json.dump({**provenance(), **out}, fh, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
