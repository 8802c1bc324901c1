"""The causal-LM architectures transformers ships, each as a tiny config (tests/tiny_configs.py)
saved with save_pretrained, loaded with load_pretrained on the fake backend within a budget of a
third of its weights (so that groups stream), and compared with the plain model: logits equal to
the bit in fp32, on the first forward (which learns the order) and the next (which reads ahead).

The list is taken from transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES. The GPU machine runs
transformers 5.17 and this one 5.24: every architecture here is in both (5.17's 178 model types
are all in 5.24's 196), and one missing from the installed transformers is skipped saying so.
CANNOT lists the architectures of the mapping that cannot run in this sweep, with the reason;
the others of the mapping are left out only to keep the sweep under two minutes on two cores.
"""
from __future__ import annotations

import pytest
import torch

from tiermem import load_pretrained
from tiermem.planning import weight_bytes

transformers = pytest.importorskip("transformers")
from tiny_configs import VOCAB, tiny_config  # noqa: E402

DENSE = ["llama", "mistral", "ministral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "cohere", "cohere2",
         "phi", "phi3", "gpt2", "gpt_bigcode", "gpt_neo", "gpt_neox", "opt", "bloom", "falcon", "mpt", "codegen",
         "starcoder2", "stablelm", "persimmon", "olmo", "olmo2", "granite", "helium", "glm4", "nemotron", "exaone4",
         "smollm3", "xglm", "biogpt", "seed_oss"]
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "granitemoe", "jetmoe", "deepseek_v3", "glm4_moe",
       "gpt_oss", "llama4_text", "ernie4_5_moe", "hunyuan_v1_moe", "minimax"]
RECURRENT = ["mamba", "falcon_mamba", "qwen3_next", "recurrent_gemma"]
SWEEP = DENSE + MOE + RECURRENT

# Architectures of the mapping that this sweep cannot run, and why (none of these reasons is
# tiermem's: each fails the same way without it, as built from the shrunk config).
_ENC_DEC = ("its causal LM is the decoder half of an encoder-decoder config (d_model, decoder_layers), which "
            "the shrink helper does not cut: the default layer counts break the tiny build")
_VISION = "a multimodal config whose vision or audio tower the shrink helper does not cut (over 60M parameters)"
_HYBRID_PATTERN = ("its attention layers are placed by period and offset fields: two layers give only state-space "
                   "layers, and transformers' cache then refuses the forward")
_STATE = "its state-space sizes are tied to fields the shrink helper does not set (the tiny build fails)"
CANNOT = {
    **dict.fromkeys(["bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus",
                     "plbart", "whisper"], _ENC_DEC),
    **dict.fromkeys(["gemma3", "gemma4", "gemma4_text", "git", "got_ocr2", "phi4_multimodal", "longcat_flash"],
                    _VISION),
    **dict.fromkeys(["jamba", "bamba", "granitemoehybrid"], _HYBRID_PATTERN),
    **dict.fromkeys(["mamba2", "zamba2", "falcon_h1", "rwkv", "xlstm"], _STATE),
    "gemma3n": "needs pillow (its vision tower, TimmWrapper), which is not installed",
    "blt": "its patcher, encoder and global configs stay at their default sizes (gigabytes)",
    "musicgen": "its causal LM needs the decoder sub-config (no dropout field on the top config)",
    "musicgen_melody": "its causal LM needs the decoder sub-config (no dropout field on the top config)",
    "reformer": "ReformerModelWithLMHead needs is_decoder=True and chunked-attention sizes of its own",
    "xmod": "needs a language set with set_default_language before a forward",
    "dbrx": "its default nested attention config has no rope_theta in transformers 5.24",
    "lfm2_moe": "its default config leaves a per-layer field None (the tiny build fails)",
    "glm_moe_dsa": "its sparse-attention indexer sizes are not cut by the shrink helper",
    "hy_v4": "its sparse-attention indexer sizes are not cut by the shrink helper",
    "cohere_compass_text": "its layer-type names are not ones its model builds (KeyError: 'full_attention')",
    "hrm_text": "its reasoning-cycle layer lists do not follow num_hidden_layers",
    "gemma3n_text": "its KV-sharing layers need more layers than the sweep's two",
    "gemma4_assistant": "an assistant config that validates a per-layer input width the shrink leaves set",
    "gemma4_unified_assistant": "its KV-sharing layers need more layers than the sweep's two",
}


def _cases():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names
    out = []
    for t in SWEEP:
        missing = f"{t} is not in transformers {transformers.__version__}"
        out.append(pytest.param(t, marks=[] if t in names else [pytest.mark.skip(reason=missing)], id=t))
    out += [pytest.param(t, marks=pytest.mark.skip(reason=f"cannot run here: {why}"), id=t)
            for t, why in CANNOT.items()]
    return out


def test_the_sweep_is_taken_from_the_mapping():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names
    assert len(SWEEP) >= 30 and len(set(SWEEP)) == len(SWEEP) and not set(SWEEP) & set(CANNOT)
    assert set(SWEEP) <= set(names) and set(CANNOT) <= set(names)


@pytest.mark.parametrize("arch", _cases())
@pytest.mark.long(keep=12)
def test_a_tiny_checkpoint_loads_and_streams_with_the_models_logits(tier, fake, tmp_path, arch):
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(tiny_config(arch)).eval()
    ref.save_pretrained(tmp_path)
    model, h = load_pretrained(tmp_path, budget=weight_bytes(ref) // 3, tier=tier)
    assert not h.plan.zero_copy_only and h.plan.window > 0, h.plan      # groups stream through slots
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        for _ in range(2):
            assert torch.equal(model(input_ids=ids).logits, want)
    h.unwrap()
    assert fake.live_bytes() == 0 if hasattr(fake, "live_bytes") else not fake._arrays
