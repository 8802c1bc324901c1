"""Checkpoints saved already quantized, one scale per row (NOTE [checkpoints already quantized] in
tiermem/inference/prequant.py), loaded on a CPU over the fake backend: a Llama whose layers'
Linears are saved as transformers' fbgemm_fp8 and compressed-tensors' int8 write them, read as
they are into the packed home (no quantization at load, bitwise the dequantized model's logits),
or dequantized where the home is in the model's dtype; other schemes refused by name."""
from __future__ import annotations

import json
import os

import pytest
import torch

save_file = pytest.importorskip("safetensors.torch").save_file
transformers = pytest.importorskip("transformers")

from tiermem import load_pretrained
from tiermem.errors import CheckpointError

QMAX = {"int8": 127.0, "fp8": 448.0}
DTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False, dtype="bfloat16")
    torch.manual_seed(0)
    # built in bf16 as load_pretrained builds it (a cast after would take the rotary buffer too)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def _quantized(fmt: str, scale_dtype=torch.float32):
    """(model, its state dict as the scheme saves it): each Linear weight (the head's too) as
    values and a scale per row, the model's own weights set to what they dequantize to."""
    m = _llama()
    sd = {}
    for name, t in m.state_dict().items():
        mod = name.rpartition(".")[0]
        if name.endswith(".weight") and (".layers." in name or name.startswith("lm_head")) and t.dim() == 2:
            w = t.float()
            s = (w.abs().amax(dim=1, keepdim=True) / QMAX[fmt]).to(scale_dtype)
            x = w / s.float()
            q = x.round().clamp(-127, 127).to(torch.int8) if fmt == "int8" else x.to(torch.float8_e4m3fn)
            sd[name], sd[f"{mod}.weight_scale"] = q, s
            sd[f"{mod}.input_scale_ub"] = torch.tensor([1200.0])        # activation scales: not used
            with torch.no_grad():
                t.copy_((q.float() * s.float()).to(t.dtype))
        else:
            sd[name] = t.clone()
    return m, sd


def _save(path, model, sd, quantization_config):
    model.config.save_pretrained(path)
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["quantization_config"] = quantization_config
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(path, "model.safetensors"))


FBGEMM = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}


def _ct(kind: str, strategy: str = "channel", fmt: str | None = None) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt or f"{kind}-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": kind, "strategy": strategy, "symmetric": True, "dynamic": False}}},
            "ignore": []}


CASES = {"fbgemm_fp8": ("fp8", FBGEMM, torch.float32), "ct_int8": ("int8", _ct("int"), torch.bfloat16),
         "ct_fp8": ("fp8", _ct("float"), torch.float32)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_checkpoint_quantized_per_row_streams_as_it_is_saved(tier, fake, tmp_path, case, monkeypatch):
    fmt, qc, scale_dtype = CASES[case]
    ref, sd = _quantized(fmt, scale_dtype)
    _save(tmp_path, ref, sd, qc)
    quantized = []
    import tiermem.inference.quant as quant
    real = quant.pack_into
    monkeypatch.setattr(quant, "pack_into", lambda src, p, *a: (quantized.append(p), real(src, p, *a))[1])
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
    budget = sum(t.numel() * t.element_size() for t in ref.state_dict().values()) // 3
    model, h = load_pretrained(tmp_path, budget=budget, tier=tier, stream_dtype=fmt, max_group_bytes=200_000)
    assert h.plan.streamed_bytes > 0
    assert not quantized                        # every streamed weight's bytes went in as the file holds them
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)   # no second rounding: bitwise the dequantized model
    h.unwrap()

    # Without stream_dtype every weight is dequantized as it is read: the same model.
    model, h = load_pretrained(tmp_path, budget=budget, tier=tier, max_group_bytes=200_000)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    h.unwrap()


def test_another_stream_format_goes_through_the_models_dtype(tier, tmp_path):
    """An fp8 checkpoint streamed as int4: dequantized, then packed again (a round trip, the
    only way between the two formats), close to the model."""
    ref, sd = _quantized("fp8")
    _save(tmp_path, ref, sd, FBGEMM)
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(1))
    budget = sum(t.numel() * t.element_size() for t in ref.state_dict().values()) // 3
    model, h = load_pretrained(tmp_path, budget=budget, tier=tier, stream_dtype="int4", max_group_bytes=200_000)
    with torch.no_grad():
        a, b = model(ids).logits.float().flatten(), ref(ids).logits.float().flatten()
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.9
    h.unwrap()


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "quant_method='fp8' is not read as it is"),
    (_ct("int", strategy="group"), "not one scale per row of 8-bit weights"),
    (_ct("int", fmt="pack-quantized"), "not one scale per row of 8-bit weights"),
    ({"quant_method": "awq", "bits": 4}, "quant_method='awq'")])
def test_other_schemes_are_refused_by_name_with_nothing_allocated(tier, fake, tmp_path, qc, match):
    ref, sd = _quantized("int8")
    _save(tmp_path, ref, sd, qc)
    with pytest.raises(CheckpointError, match=match):
        load_pretrained(tmp_path, budget=1 << 20, tier=tier)
    assert not fake._arrays


def test_a_scale_that_is_not_one_per_row_is_refused(tier, fake, tmp_path):
    ref, sd = _quantized("int8")
    name = next(k for k in sd if k.endswith("q_proj.weight_scale"))
    sd[name] = sd[name].reshape(-1)[:4].clone()
    _save(tmp_path, ref, sd, _ct("int"))
    with pytest.raises(CheckpointError, match="not one scale per row"):
        load_pretrained(tmp_path, budget=1 << 20, tier=tier)
    assert not fake._arrays


def test_plan_reads_a_quantized_checkpoint_as_load_pretrained_does(tmp_path):
    """``python -m tiermem plan`` shares load_pretrained's reading of the checkpoint: a quantized
    one is planned (its weights counted in the model's dtype), another scheme refused alike."""
    from tiermem.cli.plan import plan_model
    ref, sd = _quantized("int8")
    _save(tmp_path, ref, sd, _ct("int"))
    mp = plan_model(tmp_path, budget=1 << 20)
    assert mp.dtype == "bfloat16" and mp.plan.streamed_bytes > 0 and mp.source == str(tmp_path)
    _save(tmp_path, ref, sd, _ct("int", strategy="group"))
    with pytest.raises(CheckpointError, match="not one scale per row"):
        plan_model(tmp_path, budget=1 << 20)


def test_quantized_experts_saved_one_by_one_are_refused(tier, fake, tmp_path):
    """transformers stacks a mixture's experts from one tensor per expert, read in place as one
    range (NOTE [merged tensors]); quantized, each expert has a scale of its own, so they are not:
    refused by name, nothing allocated."""
    import glob

    from safetensors.torch import load_file
    from test_load import _moe
    ref = _moe("mixtral")
    ref.save_pretrained(tmp_path)
    sd = {}
    for f in glob.glob(str(tmp_path / "*.safetensors")):
        sd.update(load_file(f))
        os.remove(f)
    for p in glob.glob(str(tmp_path / "*.index.json")):
        os.remove(p)
    out = {}
    for name, t in sd.items():
        if ".experts." in name and name.endswith(".weight") and t.dim() == 2:
            s = t.float().abs().amax(dim=1, keepdim=True) / 127
            out[name] = (t.float() / s).round().clamp(-127, 127).to(torch.int8)
            out[name[:-len("weight")] + "weight_scale"] = s
        else:
            out[name] = t
    _save(tmp_path, ref, out, _ct("int"))
    with pytest.raises(CheckpointError, match="saved quantized, each with its own scale"):
        load_pretrained(tmp_path, budget=1 << 20, tier=tier)
    assert not fake._arrays
