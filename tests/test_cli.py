"""The command line on this machine: ``info`` and ``demo`` need no GPU (``info`` says what is missing,
``demo`` prints a dry-run plan), and a user error is one line on stderr with exit status 2."""
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


def run_cli(*args: str, **env_changes: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERMEM_")}
    env.update(PYTHONPATH=str(ROOT), **env_changes)
    return subprocess.run([sys.executable, "-m", "tiermem", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def run_info(**env_changes: str) -> subprocess.CompletedProcess:
    return run_cli("info", **env_changes)


def assert_user_error(out: subprocess.CompletedProcess, *fragments: str) -> None:
    """Exit status 2, nothing on stdout, one line on stderr that holds each fragment."""
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stdout == ""
    assert out.stderr.endswith("\n") and out.stderr.count("\n") == 1, out.stderr
    assert "Traceback" not in out.stderr
    for f in fragments:
        assert f in out.stderr, (f, out.stderr)


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
    assert_user_error(out, "python -m tiermem: error: the following arguments are required")


def test_version():
    out = run_cli("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"tiermem {tiermem.__version__}\n"


def test_help_names_the_commands():
    out = run_cli("--help")
    assert out.returncode == 0, out.stderr
    assert "info" in out.stdout and "demo" in out.stdout and "--version" in out.stdout
    out = run_cli("demo", "--help")
    assert out.returncode == 0, out.stderr
    assert "--budget" in out.stdout and "--weights-gb" in out.stdout


@pytest.mark.parametrize("args, reason", [
    (["demo", "--budget", "150%"], "budget='150%' is more than 100%"),
    (["demo", "--budget", "100.5%"], "is more than 100%"),
    (["demo", "--budget", "0"], "budget must be more than 0 bytes"),
    (["demo", "--budget", "0%"], "budget must be more than 0 bytes"),
    (["demo", "--budget", "-5"], "sizes are not negative"),
    (["demo", "--budget=-1GiB"], "sizes are not negative"),   # "--budget -1GiB" reads as an option
    (["demo", "--budget", "lots"], "budget='lots' is not a size"),
    (["demo", "--weights-gb", "0"], "positive size in GB, got 0"),
    (["demo", "--weights-gb", "-1"], "positive size in GB, got -1"),
    (["demo", "--weights-gb=-0.5"], "positive size in GB, got -0.5"),
    (["demo", "--weights-gb", "nan"], "positive size in GB, got nan"),
    (["demo", "--weights-gb", "inf"], "positive size in GB, got inf"),
    (["demo", "--weights-gb", "two"], "'two' is not a number of GB"),
    (["demo", "--weights-gb", "5000"], "more than the demo's 1000 GB"),
    (["bogus"], "invalid choice: 'bogus'"),
    (["demo", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_user_errors_are_one_line_with_exit_status_2(args, reason):
    out = run_cli(*args)
    assert_user_error(out, "error:", reason, "usage: python -m tiermem")
    if args[0] == "demo" and args[1] != "--bogus":
        assert out.stderr.startswith("python -m tiermem demo: error: argument " + args[1].split("=")[0])


def test_demo_dry_run_prints_a_labelled_plan():
    out = run_cli("demo", "--dry-run", "--weights-gb", "1", "--budget", "0.5GB")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("DRY RUN: no model is built and nothing runs (--dry-run)")
    assert re.search(r"Llama-shaped fp16 model: .*: \d\.\d\d GB of weights in \d+ groups", lines[1])
    assert re.search(r"groups resident", out.stdout) and "streamed" in out.stdout
    assert lines[2].startswith("budget    0.500 GB of    0.985 GB weights")
    default = run_cli("demo", "--dry-run", "--weights-gb", "1")       # a quarter of the weights
    assert default.returncode == 0 and re.search(r"^budget\s+0\.246 GB of\s+0\.985 GB", default.stdout, re.M), default.stdout
    # A percentage is a share of the GPU (NOTE [sizes]): a dry run has none to take it of.
    pct = run_cli("demo", "--dry-run", "--budget", "50%")
    assert pct.returncode == 2 and "share of the device's memory" in pct.stderr and "Traceback" not in pct.stderr


@pytest.mark.skipif(_has_cuda_bindings(), reason="cuda-bindings is installed: this test checks the demo of a "
                                                   "machine that cannot use CUDA")
def test_demo_without_a_gpu_is_a_dry_run():
    out = run_cli("demo")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("DRY RUN: no model is built and nothing runs (no GPU: ")
    assert "2.01 GB of weights" in out.stdout     # the default size


def test_info_says_a_bad_setting_is_invalid():
    out = run_info(TIERMEM_BUDGET="150%", TIERMEM_MANAGED_CAP="lots")
    assert out.returncode == 0, out.stderr
    assert re.search(r"device budget\s+150%\s+\(TIERMEM_BUDGET\)\s+invalid: .*more than 100%", out.stdout)
    assert re.search(r"managed cap\s+lots\s+\(TIERMEM_MANAGED_CAP\)\s+invalid: .*is not a size", out.stdout)
    good = run_info(TIERMEM_BUDGET="50%")
    assert "invalid" not in good.stdout
