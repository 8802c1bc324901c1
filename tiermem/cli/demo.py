"""``python -m tiermem demo``: a Llama-shaped model bigger than its device budget.

On a GPU it builds the model (random fp16 weights, on the GPU: no download, no slow CPU init),
times a 1x128-token prefill fully resident and then adopted by tiermem within the budget, and
prints a short table. Without a GPU (or with --dry-run) it prints the plan tiermem would follow:
which groups stay resident, what streams per forward, and the time the link rate predicts.
"""
from __future__ import annotations

import statistics
import sys
from typing import Any

from ..base.limits import parse_bytes
from ..inference.plan import LINK_GBPS, LOOKAHEAD, plan_residency

__all__ = ["llama_shape", "build_llama", "llama_groups", "demo"]


def llama_shape(weights_gb: float) -> dict[str, int]:
    """A Llama-shaped config (fp16) whose weights come to about ``weights_gb`` GB."""
    if weights_gb >= 4:
        h, inter, heads = 4096, 11008, 32
    else:
        h, inter, heads = 2048, 5632, 16
    vocab = 32000
    per_layer = 2 * (4 * h * h + 3 * h * inter + 2 * h)
    fixed = 2 * (2 * vocab * h + h)
    layers = max(1, round((weights_gb * 1e9 - fixed) / per_layer))
    return {"hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": heads, "vocab_size": vocab, "max_position_embeddings": 4096}


def llama_groups(shape: dict[str, int], max_group_bytes: int | None = None) -> list[tuple[str, int]]:
    """(group, fp16 bytes) in execution order for LlamaForCausalLM, as tiermem.wrap_module would
    group it (one group per decoder layer up to ``max_group_bytes``), without building the model."""
    from ..inference.groups import MAX_GROUP, span_bytes
    cap = MAX_GROUP if max_group_bytes is None else max_group_bytes
    h, i, v, layers = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    g = [("model.embed_tokens", span_bytes(2 * v * h))]
    for n in range(layers):
        p = f"model.layers.{n}"
        parts = [(f"{p}.self_attn.q_proj", 2 * h * h), (f"{p}.self_attn.k_proj", 2 * h * kv),
                 (f"{p}.self_attn.v_proj", 2 * h * kv), (f"{p}.self_attn.o_proj", 2 * h * h),
                 (f"{p}.mlp.gate_proj", 2 * h * i), (f"{p}.mlp.up_proj", 2 * h * i), (f"{p}.mlp.down_proj", 2 * h * i),
                 (f"{p}.input_layernorm", 2 * h), (f"{p}.post_attention_layernorm", 2 * h)]
        whole = sum(span_bytes(b) for _, b in parts)
        g += [(p, whole)] if whole <= cap else [(name, span_bytes(b)) for name, b in parts]
    head_dim = h // shape["num_attention_heads"]
    g += [("model.norm", span_bytes(2 * h)), ("model.rotary_emb", span_bytes(4 * head_dim // 2)),
          ("lm_head", span_bytes(2 * v * h))]
    return g


def build_llama(shape: dict[str, int], device: str = "cuda") -> Any:
    """LlamaForCausalLM with random fp16 weights, built directly on ``device``."""
    import torch
    import transformers
    cfg = transformers.LlamaConfig(**shape, tie_word_embeddings=False)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()      # requires_grad stays True, as transformers leaves it


def _dry_run(weights_gb: float, budget: str | None, why: str) -> int:
    shape = llama_shape(weights_gb)
    groups = llama_groups(shape)
    total = sum(n for _, n in groups)
    # No device here: a percentage (a share of the GPU, NOTE [sizes]) cannot be resolved.
    b = total // 4 if budget is None else parse_bytes(budget, what="budget", max_percent=100)
    # The plan wrap_module would make: the embedding is only looked up, so it is read in place.
    plan = plan_residency(groups, b, LOOKAHEAD, in_place={"model.embed_tokens"})
    print(f"DRY RUN: no model is built and nothing runs ({why}).")
    print(f"Llama-shaped fp16 model: hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
          f"vocab {shape['vocab_size']}: {total / 1e9:.2f} GB of weights in {len(groups)} groups.")
    print(plan.table(LINK_GBPS, limit=8))
    print("On a GPU, `python -m tiermem demo` runs this model resident and within the budget and compares them.")
    return 0


def _median_ms(fn, reps: int = 5) -> float:
    import torch
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def demo(weights_gb: float | None = None, budget: str | None = None, dry_run: bool = False) -> int:
    """Run a Llama-shaped model of ``weights_gb`` GB resident and within ``budget`` (a size, or a
    share of the GPU; default a quarter of the weights), or print the plan without a GPU."""
    from ..cuda import runtime as _cuda
    ok, why = _cuda.available()
    weights_gb = weights_gb or 2.0
    if dry_run or not ok:
        return _dry_run(weights_gb, budget, "--dry-run" if dry_run else f"no GPU: {why}")
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"The demo needs torch and transformers ({e}); printing the plan instead.")
        return _dry_run(weights_gb, budget, "torch or transformers missing")
    import tiermem
    shape = llama_shape(weights_gb)
    print(f"building a Llama-shaped fp16 model of ~{weights_gb:.1f} GB on the GPU ...", flush=True)
    model = build_llama(shape)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, shape["vocab_size"], (1, 128), device="cuda")
    with torch.no_grad():
        resident_ms = _median_ms(lambda: model(ids))
        ref = model(ids).logits
    tier = tiermem.Tier(cap=f"{int(total * 1.2) + (256 << 20)}")
    handle = tier.wrap_module(model, budget=total // 4 if budget is None else budget,
                              mode="stream")   # prefill: stream (auto would too)
    torch.cuda.empty_cache()
    with torch.no_grad():
        model(ids)                       # learns the execution order
        before = tier.stats()
        tier_ms = _median_ms(lambda: model(ids))
        handle.drain()
        after = tier.stats()
        equal = bool(torch.equal(model(ids).logits, ref))
    handle.drain()
    moved = (after["moved_bytes.all.h2d"] - before["moved_bytes.all.h2d"]) / 6
    peak = tier.stats()["resident_bytes.all.peak"]
    bound_ms = handle.plan.streamed_bytes / (LINK_GBPS * 1e9) * 1e3
    print()
    print(handle.plan.table(LINK_GBPS, limit=0))
    print()
    print(f"{'prefill 1x128 tokens':<28}{'ms':>9}{'GB in / forward':>17}{'resident peak GB':>18}")
    print(f"{'fully resident':<28}{resident_ms:>9.1f}{0:>17.2f}{total / 1e9:>18.2f}")
    print(f"{'tiermem, budget ' + f'{handle.budget / 1e9:.2f} GB':<28}{tier_ms:>9.1f}{moved / 1e9:>17.2f}{peak / 1e9:>18.2f}")
    print(f"{'link bound':<28}{bound_ms:>9.1f}")
    print()
    print(f"logits bitwise equal to the resident model: {equal}; resident bytes within the budget: "
          f"{peak <= handle.budget} ({peak / 1e9:.2f} <= {handle.budget / 1e9:.2f} GB)")
    handle.unwrap()
    return 0 if equal and peak <= handle.budget else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(demo())
