"""Whether a matmul captured in a CUDA graph gives the eager matmul's bits (NOTE [graphed forwards]
in tiermem/inference/graphed.py): fp16 and bf16 ``F.linear`` of the shapes a 128-token prefill of
bench/offload_infer.py's models runs, eager against captured (torch.cuda.graph, with tiermem's
own_workspaces around the capture as both of tiermem's captures do, and without), and each
one's max |difference|; also causal SDPA, and a two-layer transformers Llama resident, no tiermem.

    python bench/probes/probe_graphed_gemm.py
Writes $OUT/probe_graphed_gemm.json (or bench/results/probe_graphed_gemm-<date>.json).
"""
import datetime
import json
import os

import _path  # noqa: F401 - bench/ and the repository root on sys.path
import torch
import torch.nn.functional as F

from tiermem.pytorch.workspaces import own_workspaces

SHAPES = [(128, 1024, 2816), (128, 2816, 1024), (128, 4096, 4096), (128, 4096, 11008), (128, 11008, 4096),
          (128, 2048, 11008), (128, 2048, 151936), (128, 4096, 32000), (1, 4096, 11008)]


def captured(fn, own):
    g = torch.cuda.CUDAGraph()
    ctx = own_workspaces(torch) if own else torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x)
    torch.cuda.synchronize()
    with ctx, torch.cuda.graph(g):
        out = fn()
    g.replay()
    torch.cuda.synchronize()
    return out, g


def main():
    torch.manual_seed(0)
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
           "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"), "gemm": []}
    for dt in (torch.float16, torch.bfloat16):
        for m, k, n in SHAPES:
            x = torch.randn(m, k, device="cuda", dtype=dt)
            w = torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
            eager = F.linear(x, w)
            row = {"dtype": str(dt), "m": m, "k": k, "n": n}
            for own in (True, False):
                y, g = captured(lambda: F.linear(x, w), own)
                row[f"equal_own{int(own)}"] = bool(torch.equal(y, eager))
                row[f"max_abs_own{int(own)}"] = float((y.float() - eager.float()).abs().max())
                g.reset()
            again = F.linear(x, w)
            row["eager_repeat_equal"] = bool(torch.equal(again, eager))
            out["gemm"].append(row)
            print(json.dumps(row), flush=True)
    out["sdpa"] = []
    for heads, d in ((16, 64), (32, 128), (16, 128)):
        q, k, v = (torch.randn(1, heads, 128, d, device="cuda", dtype=torch.float16) for _ in range(3))
        eager = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y, g = captured(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), True)
        row = {"heads": heads, "head_dim": d, "equal": bool(torch.equal(y, eager)),
               "max_abs": float((y.float() - eager.float()).abs().max())}
        g.reset()
        out["sdpa"].append(row)
        print(json.dumps(row), flush=True)
    out["model"] = []
    import transformers as tf
    for h, i, heads, kv in ((1024, 2816, 16, 4), (4096, 11008, 32, 32)):
        cfg = tf.LlamaConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=2, num_attention_heads=heads,
                             num_key_value_heads=kv, vocab_size=32000, tie_word_embeddings=False)
        with torch.device("cuda"):
            model = tf.LlamaForCausalLM(cfg).half().eval()
        ids = torch.randint(0, 32000, (1, 128), device="cuda")
        with torch.no_grad():
            eager = model(ids, use_cache=False).logits
            y, g = captured(lambda: model(ids, use_cache=False).logits, True)
        row = {"hidden": h, "heads": heads, "equal": bool(torch.equal(y, eager)),
               "max_abs": float((y.float() - eager.float()).abs().max()),
               "attn_implementation": model.config._attn_implementation}
        g.reset()
        del model
        out["model"].append(row)
        print(json.dumps(row), flush=True)
    dest = os.environ.get("OUT") or _path.RESULTS
    name = "probe_graphed_gemm.json" if os.environ.get("OUT") else f"probe_graphed_gemm-{datetime.date.today():%Y%m%d}.json"
    with open(os.path.join(dest, name), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
