"""Tiny configs of transformers' causal LMs, for the architecture sweep (tests/test_arch_sweep.py):
each config class's defaults with the common size fields shrunk, so that any architecture builds
in a few milliseconds with 2 layers, a 64-wide hidden state and a small vocabulary."""
from __future__ import annotations

from typing import Any

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
LAYERS = 2
VOCAB = 512
POSITIONS = 256

# field -> value, each set only where the config has the field (directly or through its
# attribute_map): the size fields most architectures share, under their several names.
SIZES: dict[str, Any] = {
    "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN, "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
    "vocab_size": VOCAB, "max_position_embeddings": POSITIONS, "n_positions": POSITIONS,
    "ffn_dim": 2 * HIDDEN, "n_inner": 2 * HIDDEN, "d_ff": 2 * HIDDEN, "ffn_hidden_size": 2 * HIDDEN,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "top_k": 2,
    "moe_intermediate_size": HIDDEN, "expert_intermediate_size": HIDDEN,
    "shared_expert_intermediate_size": HIDDEN, "n_shared_experts": 1, "num_shared_experts": 1,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "sliding_window": 32, "attention_window": 32, "window_size": 32, "rotary_dim": 8, "partial_rotary_factor": 0.5,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "ssm_state_size": 8, "state_size": 8, "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_head_dim": 16,
    "mamba_d_conv": 4, "conv_kernel": 4, "mamba_expand": 2, "expand": 2, "time_step_rank": 8,
    "global_attn_every_n_layers": 2, "num_global_key_value_heads": KV_HEADS,
}
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id",
             "image_token_id", "boi_token_id", "eoi_token_id")
LAYER_LISTS = ("layer", "layers_", "block_type", "attn_layer", "hybrid", "attention_layers")


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """``model_type``'s default config rebuilt with SIZES where it has the fields, its per-layer
    lists cut to LAYERS (one layer of each kind a hybrid has), its token ids within the
    vocabulary, and ``overrides`` last. Rebuilt rather than edited, so that what its class derives
    at init (layer types from the layer count, say) follows the new sizes."""
    import transformers
    base = transformers.AutoConfig.for_model(model_type)
    kw = _fields(base)
    kw.update(overrides)
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **kw)
    except (ValueError, TypeError):       # a class that refuses some field at init: set them after
        cfg = base
        for k, v in kw.items():
            setattr(cfg, k, v)
    text = getattr(cfg, "text_config", None)
    if text is not None and text is not cfg:
        for k, v in _fields(text).items():
            setattr(text, k, v)
    return cfg


def _has(cfg: Any, name: str) -> bool:
    return name in vars(cfg) or name in getattr(cfg, "attribute_map", {})


def _fields(cfg: Any) -> dict[str, Any]:
    kw = {k: v for k, v in SIZES.items() if _has(cfg, k)}
    if _has(cfg, "qk_rope_head_dim") and _has(cfg, "head_dim"):
        kw["head_dim"] = SIZES["qk_rope_head_dim"]    # multi-head latent attention: the rotary part's width
    for k in TOKEN_IDS:
        v = getattr(cfg, k, None) if _has(cfg, k) else None
        if isinstance(v, int) and v >= VOCAB:
            kw[k] = VOCAB - 1
        elif isinstance(v, list):
            kw[k] = [min(x, VOCAB - 1) for x in v]
    layers = LAYERS if "num_hidden_layers" in kw else getattr(cfg, "num_hidden_layers", LAYERS)
    for k, v in vars(cfg).items():
        if k == "attention_types" and isinstance(v, list) and v and isinstance(v[0], list):
            kw[k] = [[v[0][0], max(1, layers // len(v[0][0]))]]      # GPT-Neo's [[kinds], repeats]
        elif isinstance(v, (list, tuple)) and len(v) > layers and k.startswith(LAYER_LISTS):
            # Per-layer lists follow the layer count, keeping one layer of each kind a hybrid has
            # (a linear-attention and a full-attention layer).
            kinds = list(dict.fromkeys(v)) if all(isinstance(x, str) for x in v) else list(v)
            kw[k] = type(v)((kinds * layers)[:layers] if len(kinds) <= layers else v[:layers])
    return kw
