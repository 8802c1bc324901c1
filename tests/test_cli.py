"""``python -m tiermem info`` on this machine (no GPU is needed: it says what is missing)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tiermem

ROOT = Path(__file__).resolve().parents[1]


def _has_cuda_bindings() -> bool:
    # Looked up without importing it, so collecting this file never starts CUDA.
    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except ModuleNotFoundError:
        return False


def run_info(**env_changes: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERMEM_")}
    env.update(PYTHONPATH=str(ROOT), **env_changes)
    return subprocess.run([sys.executable, "-m", "tiermem", "info"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(_has_cuda_bindings(), reason="cuda-bindings is installed: this test checks the report of a "
                                                   "machine that cannot use CUDA")
def test_info_without_a_gpu():
    out = run_info()
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.splitlines()[0] == f"tiermem {tiermem.__version__}"
    assert re.search(r"no usable GPU here: cuda-bindings is not installed", text), text
    assert "\nsettings\n" in text
    for name in ("TIERMEM_MANAGED_CAP", "TIERMEM_ALLOW_OVERSUBSCRIBE", "TIERMEM_BUDGET"):
        assert name in text
    assert re.search(r"oversubscribe\s+refused \(default\)", text)
    assert re.search(r"device budget\s+none \(default\)", text)


def test_info_shows_settings_from_the_environment():
    out = run_info(TIERMEM_BUDGET="3GiB", TIERMEM_MANAGED_CAP="20GiB", TIERMEM_ALLOW_OVERSUBSCRIBE="1")
    assert out.returncode == 0, out.stderr
    assert re.search(r"managed cap\s+20GiB\s+\(TIERMEM_MANAGED_CAP\)", out.stdout)
    assert re.search(r"oversubscribe\s+allowed\s+\(TIERMEM_ALLOW_OVERSUBSCRIBE\)", out.stdout)
    assert re.search(r"device budget\s+3GiB\s+\(TIERMEM_BUDGET\)", out.stdout)


def test_cli_without_a_command_fails_with_usage():
    out = subprocess.run([sys.executable, "-m", "tiermem"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "usage: python -m tiermem" in out.stderr
