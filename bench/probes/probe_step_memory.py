"""What holds device memory in a tiered training step: the GPT of tests/test_gpu_train.py (15.7M
parameters, batch 8x128, blocks of 1 MiB) under a tight budget, torch's allocation history
recorded; at the step's peak (or where it runs out) the live blocks are summed by the line of
tiermem, the model or torch that allocated them.

    python bench/probes/probe_step_memory.py [--budget-mib 128] [--steps 4]
"""
import argparse
import collections
import os

import _path  # noqa: F401 - bench/ and the repository root on sys.path
import torch

MiB = 1 << 20


def where(frames):
    """The innermost frame in tiermem or the model, else the innermost Python frame."""
    for f in frames:
        fn = f.get("filename", "")
        if "tiermem/" in fn and "_torch_alloc" not in fn:
            return f"{fn.split('tiermem/')[-1]}:{f['line']} {f.get('name', '')}"
    for f in frames:
        fn = f.get("filename", "")
        if fn.endswith(".py"):
            return f"{os.path.basename(fn)}:{f['line']} {f.get('name', '')}"
    return "?"


STACKS = {}


def live(snap):
    out = collections.Counter()
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                w = where(b.get("frames", []))
                out[w] += b["size"]
                STACKS.setdefault(w, [f"{os.path.basename(f.get('filename', ''))}:{f.get('line')} {f.get('name', '')}"
                                      for f in b.get("frames", [])[:14]])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-mib", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    import torch.nn.functional as F

    import tiermem
    from tiermem.testing import GPT, GPTConfig
    c = GPTConfig(vocab=2048, seq=128, d=384, layers=8, heads=4)
    torch.manual_seed(0)
    model = GPT(c).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, c.vocab, (8, c.seq + 1), device="cuda", generator=g) for _ in range(a.steps)]
    tier = tiermem.Tier(0, cap="1GiB")
    train = tier.wrap_training(model, opt, a.budget_mib * MiB, block_bytes=MiB, min_swap=256 << 10)
    print("outside", train.outside, "slots", train.slot_bytes, "reserved", torch.cuda.memory_reserved())
    torch.cuda.memory._record_memory_history(max_entries=200000)
    for i, ids in enumerate(batches):
        try:
            with train.step():
                logits = model(ids[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
                peak_fwd = live(torch.cuda.memory._snapshot())
                del logits
                loss.backward()
            print(f"step {i + 1}: ok, peak {train.resident_peak() / MiB:.1f} MiB, torch max reserved "
                  f"{torch.cuda.max_memory_reserved() / MiB:.1f} MiB")
            if i == 0:
                print("  live at the forward's end:", [(k, round(v / MiB, 1)) for k, v in peak_fwd.most_common(12)])
                top = peak_fwd.most_common(1)[0][0]
                print("  its stack:", "\n    ".join(STACKS.get(top, [])))
                sw = train.swap
                print("  swap: out_q", len(sw.out_q), "out_bytes", sw.out_bytes, "saved", len(sw.saved),
                      "kept", sum(x.keep for x in sw.saved), "holding", sum(x.storage is not None for x in sw.saved))
        except torch.OutOfMemoryError as e:
            print(f"step {i + 1}: out of memory: {str(e)[:300]}")
            snap = torch.cuda.memory._snapshot()
            tot = live(snap)
            print("  live at the failure (MiB):")
            for k, v in tot.most_common(25):
                print(f"    {v / MiB:8.1f}  {k}")
            break
    torch.cuda.memory._record_memory_history(enabled=None)


if __name__ == "__main__":
    main()
