"""What stepping the optimizer once per block inside backward costs a host-bound step, with no
tiermem in it: the models of bench/train_budget.py part 4, every tensor resident, fused AdamW.

wrap_training steps each streamed block as soon as its gradients are complete (NOTE [training
transport] in tiermem/training/handle.py): one ``optimizer.step()`` a block, restricted to its parameters,
from a gradient hook. This probe runs that structure alone, so the host time it adds can be told
apart from the transport's own (the slots, the fills, the rebinding, the swap):

  resident              backward, one optimizer step
  checkpoint            torch's non-reentrant checkpoint on every layer, one optimizer step
  checkpoint, per block the same, each block stepped from a post-accumulate-grad hook, as
                        wrap_training does (blocks: each layer, and each top-level module
                        holding parameters)
  resident, per block   no checkpoint, stepped per block

The variants run in turn, round after round, in one process (the steps of one setting wander by
10-30% on these machines over a run; turns spread that over every variant alike), and each
variant's time is the median of its timed steps over all rounds (CUDA events, after warm-up).
Losses are checked equal across the variants (per-block steps give the same bits).

    python bench/probes/probe_per_block_step.py [--model gpt|hf] [--rounds 3] [--steps 6]
"""
import argparse
import json
import os
import statistics
import time

import _path  # noqa: F401 - bench/ and the repository root on sys.path
import torch
from torch.utils.checkpoint import checkpoint


def blocks_of(model, layers):
    """Parameter lists, one a block: each layer, then each top-level module with parameters
    outside the layers (as module_groups makes them for these models)."""
    in_layers = {id(p) for m in layers for p in m.parameters()}
    out = [list(m.parameters()) for m in layers]
    for _, m in model.named_children():
        rest = [p for p in m.parameters() if id(p) not in in_layers]
        if rest:
            out.append(rest)
    return out


class PerBlock:
    """Step each block's parameters as soon as all their gradients are in, as wrap_training does."""

    def __init__(self, opt, blocks):
        self.opt, self.blocks = opt, blocks
        self.block_of = {id(p): i for i, b in enumerate(blocks) for p in b}
        self.left = {}
        self.hooks = [p.register_post_accumulate_grad_hook(self._done) for b in blocks for p in b]

    def begin(self):
        self.left = {i: len(b) for i, b in enumerate(self.blocks)}

    def _done(self, p):
        i = self.block_of[id(p)]
        self.left[i] -= 1
        if self.left[i] == 0:
            self.step(self.blocks[i])

    def step(self, params):
        ids = {id(p) for p in params}
        groups = self.opt.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g in groups:
                g["params"] = [p for p in g["params"] if id(p) in ids]
            self.opt.step()
        finally:
            for g, ps in zip(groups, saved):
                g["params"] = ps
        for p in params:
            p.grad = None

    def remove(self):
        for h in self.hooks:
            h.remove()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt", choices=["hf", "gpt"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="timed steps a variant a round, after 2 untimed")
    a = ap.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    from _recompute_study import probe_model
    build, loss_fn, layers_of, ids = probe_model(torch, a.model)

    variants = {}
    for name, ckpt, per_block in (("resident", False, False), ("checkpoint", True, False),
                                  ("checkpoint, per block", True, True), ("resident, per block", False, True)):
        model = build()
        layers = layers_of(model)
        if ckpt:
            for m in layers:
                inner = m.forward
                m.forward = (lambda f: lambda *x, **k: checkpoint(lambda *y: f(*y, **k), *x, use_reentrant=False))(inner)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        pb = PerBlock(opt, blocks_of(model, layers)) if per_block else None
        variants[name] = (model, opt, pb)

    def step(model, opt, pb):
        if pb is not None:
            pb.begin()
        loss = loss_fn(model, ids)
        loss.backward()
        if pb is None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    times = {n: [] for n in variants}
    losses = {n: [] for n in variants}
    for r in range(a.rounds):
        for n, (model, opt, pb) in variants.items():
            for i in range(2 + a.steps):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                loss = step(model, opt, pb)
                e1.record()
                e1.synchronize()
                losses[n].append(float(loss))
                if i >= 2:
                    times[n].append(e0.elapsed_time(e1))
            print(f"round {r + 1}/{a.rounds} {n:24s} median {statistics.median(times[n][-a.steps:]):7.1f} ms", flush=True)
    res = {n: round(statistics.median(t), 1) for n, t in times.items()}
    from _common import provenance
    out = {"device": torch.cuda.get_device_name(0), **provenance(), "date": time.strftime("%Y-%m-%d"),
           "model": a.model, "rounds": a.rounds, "steps": a.steps,
           "median_ms": res, "over_resident": {n: round(v / res["resident"], 3) for n, v in res.items()},
           "per_block_cost_ms": {"checkpoint": round(res["checkpoint, per block"] - res["checkpoint"], 1),
                                 "resident": round(res["resident, per block"] - res["resident"], 1)},
           "losses_equal": all(v == losses["resident"] for v in losses.values()),
           "blocks": len(blocks_of(variants["resident"][0], layers_of(variants["resident"][0])))}
    print(json.dumps(out, indent=1))
    path = os.path.join(os.environ.get("OUT", "bench/results"), f"probe_per_block_step-{a.model}.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
