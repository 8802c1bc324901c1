"""``python -m tiermem plan`` and plan_model on a CPU: the plan printed is the plan adoption makes
(wrap_module and load_pretrained on the fake backend, same budget, same host budget), for
several architectures, and its predicted times follow from its bytes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import checkpoint_share, share

import tiermem
from tiermem import load_pretrained
from tiermem.cli.plan import plan_model

ROOT = Path(__file__).resolve().parents[1]

SMALL = {
    "llama": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=1024, tie_word_embeddings=False),
    "qwen2": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False),
    "gpt_neox": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                     vocab_size=1024, use_parallel_residual=True),
    "mixtral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=1024, num_local_experts=8, num_experts_per_tok=2,
                    tie_word_embeddings=False),
}
GROUP = 100_000      # bytes: small groups, so that these small models have many


def _config(arch: str):
    import transformers
    return transformers.AutoConfig.for_model(arch, dtype="float32", **SMALL[arch])


@pytest.mark.parametrize("arch", list(SMALL))
def test_the_plan_is_the_one_wrap_module_makes(tier, arch):
    import transformers
    cfg = _config(arch)
    budget = plan_model(cfg, 1 << 50).plan.total * 30 // 100     # 30% of the weights, in bytes
    mp = plan_model(cfg, budget, max_group_bytes=GROUP)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    h = tier.wrap_module(model, budget=share(model, 30), max_group_bytes=GROUP)
    assert h.plan == mp.plan
    assert 0 < len(mp.plan.pinned) < len(mp.plan.sizes) and mp.plan.in_place
    assert mp.prefill_seconds == pytest.approx(mp.plan.moved_bytes / 55e9)
    if arch == "mixtral":            # a decode step reads 2 of 8 experts in place
        assert mp.routed_share == 0.25 and mp.decode_seconds < 0.6 * mp.prefill_seconds
    else:
        assert mp.routed_share == 1.0 and mp.decode_seconds == pytest.approx(mp.prefill_seconds)
    h.unwrap()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
def test_the_plan_with_a_disk_tier_is_the_one_load_pretrained_makes(tier, tmp_path, arch):
    import transformers
    cfg = _config(arch)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    budget = checkpoint_share(tmp_path, 30)
    whole = plan_model(tmp_path, budget, 1 << 40, max_group_bytes=GROUP).plan
    assert not whole.on_disk
    host = int(0.6 * whole.home_bytes)
    mp = plan_model(tmp_path, budget, host, link_GBps=50, disk_GBps=4, max_group_bytes=GROUP)
    p = mp.plan
    assert p.on_disk and p.pinned_host_bytes <= host
    assert mp.prefill_seconds == pytest.approx((p.moved_bytes - p.disk_bytes) / 50e9 + p.disk_bytes / 4e9)
    model, h = load_pretrained(tmp_path, budget=budget, host_budget=host, tier=tier, max_group_bytes=GROUP)
    assert h.plan == p
    s = h.stats()
    assert s["pinned_bytes.current"] <= host and s["pinned_bytes.staging"] == p.stages * p.stage_bytes
    h.unwrap()


def test_plan_tokens_of_a_decode_step_predict_the_decode(tmp_path):
    mp = plan_model(_config("mixtral"), "1MB", tokens=1, max_group_bytes=GROUP)
    assert mp.prefill_seconds == mp.decode_seconds


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERMEM_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "tiermem", "plan", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_plan_command_takes_a_model_type_with_overrides_and_a_checkpoint(tmp_path):
    r = _cli("qwen2", "hidden_size=2048", "intermediate_size=11008", "num_hidden_layers=36", "num_attention_heads=16",
             "num_key_value_heads=2", "vocab_size=151936", "tie_word_embeddings=false",
             "--budget", "2GB", "--host-budget", "4GB", "--disk-gbps", "3", "--groups", "0")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "Qwen2ForCausalLM" in out and "float16" in out
    assert "from disk:" in out and "staging" in out and "disk 3 GB/s" in out
    assert "prefill 1x128" in out and "ms per token" in out
    import transformers
    _config("llama").save_pretrained(tmp_path)
    # The 3 MB model in one group: 50% of an 8 MB device holds it. 50% of a 2 MB one does not: the
    # model is cut into smaller groups, some resident and the others streamed through three slots
    # (groups.fit_groups; it was one group read in place).
    r = _cli(str(tmp_path / "config.json"), "--budget", "50%", "--device-memory", "8MB", "--tokens", "8")
    assert r.returncode == 0, r.stderr
    assert "LlamaForCausalLM" in r.stdout and "from disk" not in r.stdout and "groups (module order)" in r.stdout
    assert "resident    0.003 GB" in r.stdout, r.stdout
    r = _cli(str(tmp_path / "config.json"), "--budget", "50%", "--device-memory", "2MB", "--tokens", "8")
    assert r.returncode == 0 and "window of 3 slots" in r.stdout, r.stdout + r.stderr
    assert "  resident " in r.stdout and "  streamed " in r.stdout and "read in place (zero-copy)" not in r.stdout
    assert transformers  # the import above is the one the command makes


def test_a_percentage_is_a_share_of_the_device_and_the_plan_command_needs_its_size():
    # NOTE [sizes]: "25%" of an 8 MB device is 2 MB, whatever the model's size.
    cfg = _config("llama")
    assert plan_model(cfg, "25%", device_memory="8MB").plan == plan_model(cfg, 2_000_000).plan
    with pytest.raises(tiermem.errors.ConfigError, match="share of the device's memory"):
        plan_model(cfg, "25%")
    r = _cli("llama", "hidden_size=64", "--budget", "25%")
    assert r.returncode == 2 and "share of the device's memory" in r.stderr and "Traceback" not in r.stderr


def test_the_plan_command_refuses_what_it_cannot_read():
    r = _cli("not_a_model_type", "--budget", "1GB")
    assert r.returncode == 2 and "'not_a_model_type' is not a model type transformers" in r.stderr
    r = _cli("llama", "hidden_size", "--budget", "1GB")
    assert r.returncode == 2 and "field=value" in r.stderr
