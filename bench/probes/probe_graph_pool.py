"""Why is the recomputed blocks' graphs' pool 1.4-1.8x the eager working set?

NOTE [replayed recompute] in tiermem/training/replay.py sizes the pool from the largest eager backward;
on bench/train_budget.py's models the pool came to 1.4-1.8x it (docs/training.md). This probe
takes the layers of the same GPT-style and Qwen2-style models, everything resident and no budget,
runs them under tiermem's Replays for three steps (the first eager and measured, the second
captures one graph per layer, the third replays), and after every capture reads the pool's
segments from torch's allocator snapshot: the bytes reserved, the bytes still allocated (tensors
a capture left alive) and the largest free block. It then captures every layer a second time
(new keys: the gradients moved) to see whether later captures reuse the first ones' memory.
Writes bench/results/probe_graph_pool-<device>-<date>.json (or $OUT).

    python bench/probes/probe_graph_pool.py [--models gpt,hf] [--layers 8]
"""
import argparse
import json
import os
import time

import _path  # noqa: F401 - bench/ and the repository root on sys.path
from _common import provenance  # noqa: E402
import torch

MB = 1e6


def pool_state(pool_id):
    """Reserved, allocated and largest free block (bytes) of the segments of one private pool."""
    segs = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", (0, 0))) == tuple(pool_id)]
    free = [b["size"] for s in segs for b in s["blocks"] if b["state"] == "inactive"]
    return {"segments": len(segs), "reserved": sum(s["total_size"] for s in segs),
            "allocated": sum(s["allocated_size"] for s in segs), "largest_free": max(free, default=0),
            "sizes_MB": sorted(round(s["total_size"] / MB, 1) for s in segs)}


def run(name, layers, x_shape, kw):
    from tiermem.training.replay import Replays
    r = Replays(torch, capture=True, params_of=lambda m: [p for p in m.parameters() if p.requires_grad])
    for p in layers.parameters():
        p.grad = torch.zeros_like(p)
    rows = []
    orig = r._capture

    def capture(*a, **k):
        before = torch.cuda.memory_reserved()
        g = orig(*a, **k)
        st = pool_state(r.pool)
        rows.append({"capture": len(rows) + 1, "reserved_growth": torch.cuda.memory_reserved() - before, **st})
        print(f"  {name} capture {len(rows):2d}: pool {st['reserved'] / MB:7.1f} MB in {st['segments']} segments, "
              f"{st['allocated'] / MB:6.1f} MB still allocated, largest free {st['largest_free'] / MB:6.1f} MB",
              flush=True)
        return g

    r._capture = capture
    g = torch.Generator(device="cuda").manual_seed(1)
    for step in range(5):
        if step == 3:            # new keys: every layer's .grad moves, so every layer captures again
            for p in layers.parameters():
                p.grad = torch.zeros_like(p)
        x = torch.randn(*x_shape, device="cuda", generator=g, requires_grad=True)
        h = x
        for m in layers:
            out = r.run(m, m.forward, (h,), kw)
            h = out[0] if isinstance(out, tuple) else out
        h.float().square().mean().backward()
        torch.cuda.synchronize()
        print(f"  {name} step {step + 1}: captured {r.captured}, replayed {r.replayed}, need {r.need / MB:.1f} MB, "
              f"off: {r.off or '-'}", flush=True)
    out = {"need_bytes": r.need, "captures": rows, "captured": r.captured, "replayed": r.replayed, "off": r.off}
    r.close()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt,hf")
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    res = {}
    for name in a.models.split(","):
        if name == "gpt":
            from tiermem.testing import GPT, GPTConfig
            torch.manual_seed(0)
            model = GPT(GPTConfig(vocab=8192, seq=512, d=1024, layers=a.layers, heads=16)).cuda()
            layers, kw = model.blocks, {}
        else:
            from _recompute_study import qwen2
            args = argparse.Namespace(hf_vocab=8192, hf_d=1024, hf_ff=2816, hf_layers=a.layers, hf_heads=16,
                                      hf_kv=4, seq=512)
            model = qwen2(torch, args)
            pos = torch.arange(512, device="cuda")[None]
            rot = model.model.rotary_emb(torch.zeros(1, device="cuda"), pos)
            mask = torch.full((512, 512), float("-inf"), device="cuda").triu(1)[None, None].expand(4, 1, 512, 512)
            layers, kw = model.model.layers, {"position_embeddings": rot, "attention_mask": mask}
        res[name] = run(name, layers, (4, 512, 1024), kw)
        del model, layers
        torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name(0).split()[1].lower()
    path = os.path.join(os.environ.get("OUT", os.path.join(_path.RESULTS)),
                        f"probe_graph_pool-{dev}-{time.strftime('%Y%m%d')}.json")
    with open(path, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(0), **provenance(), "results": res}, fh, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
