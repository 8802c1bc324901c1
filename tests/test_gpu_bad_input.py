"""tests/test_bad_input.py's sweep on a machine with a GPU: there the GPU check would succeed, so
"refused before the GPU check" is shown by what did not happen. A fresh process runs every bad
API call and loads every corrupt checkpoint; each must raise its own error, and afterwards no CUDA
context exists (torch's nor tiermem's runtime), and no default Tier was made. Then the same
process wraps a module for real, so the check is known to be able to see a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, os, shutil, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
from pathlib import Path
import torch
import tiermem
from tiermem.base import default
from tiermem.cuda import runtime
from tiermem.errors import CUDAUnavailableError, TierMemError
import test_bad_input as sweep

good, scratch = Path(sys.argv[2]), Path(sys.argv[3])
bad = []
for name, call, message in sweep.API_CASES:
    m = sweep._model()
    try:
        call(m, good)
        bad.append(f"{name}: no error")
    except TierMemError as e:
        if not isinstance(e, (ValueError, TypeError)) or isinstance(e, CUDAUnavailableError) or message not in str(e):
            bad.append(f"{name}: {e!r}")
for i, (name, (src, change, _, says)) in enumerate(sweep.CORRUPT.items()):
    d = scratch / f"bad{i}"
    shutil.copytree(good.parent / src, d)
    change(d)
    try:
        tiermem.load_pretrained(d, budget="1MB")
        bad.append(f"{name}: loaded")
    except TierMemError as e:
        if not isinstance(e, ValueError) or says not in str(e):
            bad.append(f"{name}: {e!r}")
state = {"bad": bad, "torch_cuda": torch.cuda.is_initialized(), "runtime": runtime._rt is not None,
         "default_tier": default.peek() is not None}
m = sweep._model().cuda()
h = tiermem.wrap_module(m, budget="1MB")
y = m(torch.ones(2, 8, device="cuda"))
h.unwrap()
state["then_wrapped"] = bool(torch.isfinite(y).all()) and default.peek() is not None
print(json.dumps(state))
"""


def test_bad_input_is_refused_before_cuda_starts(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch
    cfg = transformers.AutoConfig.for_model("llama", dtype="float32", hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                            vocab_size=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)       # on the host: this process starts no CUDA
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "shards", max_shard_size="100KB")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERMEM_")}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT), str(tmp_path / "one"), str(scratch)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    state = json.loads(r.stdout.strip().splitlines()[-1])
    assert state["bad"] == []
    assert not state["torch_cuda"] and not state["runtime"] and not state["default_tier"], state
    assert state["then_wrapped"], state
