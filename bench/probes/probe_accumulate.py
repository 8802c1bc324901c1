"""Gradient accumulation and clipping under wrap_training (NOTE [accumulation], NOTE [clipping] in
tiermem/training/handle.py) against the resident loop: the GPT model of bench/train_budget.py (16 layers of 1024, vocab 8192, AdamW
fp32), micro-batches of 4x512, ``--accumulate`` of them per optimizer step, tiermem at 1/2.5 of
the training state.

For each run: the median time of one window (``--accumulate`` micro-batches and the optimizer
step; CUDA events after warm-up windows) and of its micro-batches that do not update and the one
that does; the bytes each kind moves; the losses against the resident loop's. With
``--max-grad-norm`` both clip to that global norm before each optimizer step (the resident loop
with ``clip_grad_norm_``). Also tiermem with accumulate=1 and no clipping over the same
micro-batches (an optimizer step each), to show what accumulating saves and clipping costs.

    python bench/probes/probe_accumulate.py [--accumulate 4] [--windows 4] [--max-grad-norm 1.0]

Writes bench/results/probe_accumulate-<device>-<date>[-clip].json (or under $OUT).
"""
import argparse
import json
import os
import sys
import time

import _path  # noqa: F401 - bench/ and the repository root on sys.path
import torch
from _common import median, provenance


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--accumulate", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=6, help="windows before timing (trace, probe, verify)")
    ap.add_argument("--windows", type=int, default=4, help="timed windows")
    ap.add_argument("--max-grad-norm", type=float, default=None)
    ap.add_argument("--speculate", action="store_true", help="the clipping run speculates (NOTE [speculative clipping])")
    a = ap.parse_args()
    n = a.accumulate
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    from train_budget import build_gpt  # the bench's GPT and its loss
    from train_budget import gpt_loss as loss_of

    import tiermem
    from tiermem.testing import GPTConfig
    cfg = GPTConfig(vocab=8192, seq=512, d=1024, layers=16, heads=16)
    g = torch.Generator(device="cuda").manual_seed(1)
    total = (a.warmup + a.windows) * n
    batches = [torch.randint(0, cfg.vocab, (4, 513), device="cuda", generator=g) for _ in range(total)]

    def build():
        m = build_gpt(torch, cfg)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-4)

    def run(micro, update_after):
        """Every micro-batch through ``micro(i, ids)``; times of each (ms) and of each window."""
        losses, times, windows = [], [], []
        w0 = None
        for i, ids in enumerate(batches):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if i % n == 0:
                w0 = s
            s.record()
            losses.append(micro(i, ids))
            e.record()
            times.append((s, e))
            if (i + 1) % n == 0:
                windows.append((w0, e))
        torch.cuda.synchronize()
        ms = [s.elapsed_time(e) for s, e in times]
        wms = [s.elapsed_time(e) for s, e in windows]
        first = a.warmup * n
        timed = range(first, total)
        acc = [ms[i] for i in timed if not update_after(i)]
        return ([float(x) for x in torch.stack(losses).cpu()],
                {"window_ms": round(median(wms[a.warmup:]), 2),
                 "micro_ms": round(median(acc), 2) if acc else None,     # none: every micro-batch updates
                 "update_micro_ms": round(median([ms[i] for i in timed if update_after(i)]), 2)})

    out = {}
    norms = []
    model, opt = build()
    state = sum(p.numel() * p.element_size() for p in model.parameters()) * 4

    def resident(i, ids):
        loss = loss_of(model, ids)
        (loss / n).backward()
        if (i + 1) % n == 0:
            if a.max_grad_norm is not None:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), a.max_grad_norm))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.detach()
    want, out["resident"] = run(resident, lambda i: (i + 1) % n == 0)
    model = opt = None
    torch.cuda.empty_cache()

    want_norms = torch.stack(norms).cpu() if norms else None
    runs = [(n, a.max_grad_norm, False), (1, None, False)]
    if a.speculate:
        runs.insert(1, (n, a.max_grad_norm, True))
    for k, clip, spec in runs:
        model, opt = build()
        tier = tiermem.Tier(0, cap="12GiB")
        train = tier.wrap_training(model, opt, int(state / 2.5), block_bytes=64 << 20, accumulate=k,
                                   max_grad_norm=clip, speculate=spec)
        norms = []
        moved = {"upd": [], "acc": []}

        def tiered(i, ids):
            with train.step():
                loss = loss_of(model, ids)
                (loss / n).backward()
            if i >= a.warmup * n:
                moved["upd" if (i + 1) % k == 0 else "acc"].append(train.moved["h2d"] + train.moved["d2h"])
            if clip is not None and (i + 1) % k == 0:
                norms.append(train.grad_norm)
            return loss.detach()
        name = f"tiermem_accumulate{k}" + ("_clip" if clip is not None else "") + ("_speculate" if spec else "")
        got, out[name] = run(tiered, lambda i: (i + 1) % k == 0)
        r = out[name]
        r["window_over_resident"] = round(r["window_ms"] / out["resident"]["window_ms"], 3)
        r["moved_GB_per_window"] = round(sum(moved["upd"] + moved["acc"]) / a.windows / 1e9, 3)
        if clip is not None:
            r["grad_norms_equal_resident"] = bool(torch.equal(torch.stack(norms).cpu(), want_norms))
            r["clip_bites"] = bool((want_norms > clip).any())
        if (k, clip) == (n, a.max_grad_norm):
            r["losses_equal_resident"] = got == want
        if spec:
            r["speculation"] = dict(train.speculation)
            r["peak_within_budget"] = train.resident_peak() <= train.budget
        r["plan"] = str(train.plan).split("\n")[:6]
        train.unwrap()
        tier.close()
        model = opt = train = None
        torch.cuda.empty_cache()
    out["accumulate"] = n
    out["max_grad_norm"] = a.max_grad_norm
    out["budget_over_state"] = round(1 / 2.5, 3)
    print(json.dumps(out, indent=1), flush=True)
    dev = torch.cuda.get_device_name(0).split()[1].lower()
    path = os.path.join(os.environ.get("OUT") or _path.RESULTS, f"probe_accumulate-{dev}-{time.strftime('%Y%m%d')}"
                        + ("-clip" if a.max_grad_norm is not None else "") + ("-speculate" if a.speculate else "")
                        + ".json")
    with open(path, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(0), **provenance(),
                   "results": out}, fh, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    sys.exit(main())
