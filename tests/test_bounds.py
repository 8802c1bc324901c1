"""bench/bounds.py: the benches' lower bounds come from the model, the budgets and the measured
rates, never from the bytes a plan chose to move; and bench/_common.py's results say which code
they measured, or that they cannot say. No GPU."""
from __future__ import annotations

import json
import math
import os
import subprocess

import _common
import bounds
import pytest

GB = 10**9


def test_forward_bytes_is_what_the_budget_cannot_hold():
    # 5.3 GB of weights, a quarter of them in the budget, a 0.26 GB embedding read in place
    w, b, e = 5_300_000_000, 1_325_000_000, 262_144_000
    assert bounds.forward_bytes(w, b, e) == w - b - e
    assert bounds.forward_seconds(w, b, e, 53.0) == pytest.approx((w - b - e) / 53e9)
    assert bounds.forward_bytes(w, w, 0) == 0                  # in capacity: nothing must move
    assert bounds.forward_bytes(w, 2 * w, e) == 0
    assert bounds.forward_bytes(w, 0, 0) == w


def test_forward_bound_ignores_what_a_plan_moves():
    # Two plans of one model and budget: one moves 20% more than the other (a window in the
    # budget, a group kept off the device). The bound is one figure for both; only the plan's
    # own figure (which a bench names ..._vs_plan_bytes) differs.
    w, b, e = 4 * GB, GB, 0
    lean, heavy = 3 * GB, int(3.6 * GB)
    bound = bounds.forward_seconds(w, b, e, 50.0)
    assert bounds.ratio(heavy / 50e9, bound) == pytest.approx(1.2)
    assert bounds.ratio(lean / 50e9, bound) == pytest.approx(1.0)


def test_a_decode_steps_kv_bound_is_the_cache_the_budget_cannot_hold():
    # Llama-3-8B's cache at 128k tokens (128 KiB a token) under a 2 GB budget: whatever the design
    # keeps on the device (a ring of whole layers, or recent tokens), the rest crosses each step
    cache, budget = 131072 * (128 << 10), 2 * GB
    assert bounds.kv_decode_bytes(cache, budget) == cache - budget
    assert bounds.kv_decode_bytes(cache, 2 * cache) == 0          # the whole cache fits: nothing moves
    assert bounds.kv_decode_seconds(cache, budget, 0, 55.0) == pytest.approx((cache - budget) / 55e9)
    w = bounds.forward_bytes(16 * GB, 8 * GB, 0)                  # half the weights streamed besides
    assert bounds.kv_decode_seconds(cache, budget, w, 55.0) == pytest.approx((cache - budget + 8 * GB) / 55e9)
    with pytest.raises(ValueError):
        bounds.kv_decode_bytes(-1, budget)


@pytest.mark.parametrize("bad", [
    dict(weights=-1, budget=0), dict(weights=10, budget=-1), dict(weights=10, budget=0, embeddings=11),
    dict(weights=float("nan"), budget=0)])
def test_forward_bytes_refuses_nonsense(bad):
    with pytest.raises(ValueError):
        bounds.forward_bytes(**bad)


@pytest.mark.parametrize("rate", [0, -5, float("nan")])
def test_rates_must_be_positive(rate):
    with pytest.raises(ValueError, match="GB/s"):
        bounds.forward_seconds(GB, 0, 0, rate)
    with pytest.raises(ValueError, match="GB/s"):
        bounds.train_step(GB, 0, 50, 50, rate, 0.1)


def test_routed_decode_reads_only_the_picked_experts():
    w, e, experts = 10 * GB, GB, 8 * GB     # 1 GB dense, 8 experts of 1 GB, 2 picked a step
    assert bounds.routed_decode_bytes(w, 0, e, experts, 2 * GB) == 3 * GB
    assert bounds.routed_decode_bytes(w, GB, e, experts, 2 * GB) == 2 * GB
    assert bounds.routed_decode_bytes(w, 4 * GB, e, experts, 2 * GB) == 0
    with pytest.raises(ValueError):
        bounds.routed_decode_bytes(w, 0, e, experts, 9 * GB)    # more routed than there are experts


def test_disk_bound_splits_drive_and_link():
    # 12.5 GB, 2 GB device budget, 4 GB host budget, 0.6 GB embeddings read in place
    w, b, h, e = 12_500_000_000, 2 * GB, 4 * GB, 600_000_000
    d = bounds.disk_forward(w, b, h, e, link_GBps=54.0, disk_GBps=1.2)
    assert d.link_bytes == w - e - b
    assert d.disk_bytes == w - e - b - h
    assert d.link_seconds == pytest.approx(d.link_bytes / 54e9)
    assert d.disk_seconds == pytest.approx(d.disk_bytes / 1.2e9)
    assert d.seconds == max(d.link_seconds, d.disk_seconds) == d.disk_seconds
    assert d.serial_seconds == pytest.approx(d.link_seconds + d.disk_seconds)
    # a host budget that holds everything the device does not: nothing from the drive
    assert bounds.disk_forward(w, b, 20 * GB, e, 54.0, 1.2).disk_bytes == 0


def test_persistent_state_leaves_gradients_out():
    n = 219_000_000
    assert bounds.persistent_state_bytes(n) == 12 * n             # fp32 parameters and AdamW's two moments
    assert bounds.persistent_state_bytes(n, states_per_param=1) == 8 * n   # SGD with momentum
    assert bounds.persistent_state_bytes(n, param_bytes=2, states_per_param=0) == 2 * n
    with pytest.raises(ValueError):
        bounds.persistent_state_bytes(n, param_bytes=0)


def test_train_step_bound_is_the_slower_of_link_and_compute():
    state, budget = 12 * 219_000_000, 1_400_000_000
    s = bounds.train_step(state, budget, h2d_GBps=54.0, d2h_GBps=55.0, duplex_GBps=91.0, compute_seconds=0.0796)
    cross = state - budget
    assert s.cross_bytes == cross
    assert s.transfer_seconds == pytest.approx(max(cross / 54e9, cross / 55e9, 2 * cross / 91e9))
    assert s.seconds == 0.0796 and s.limited_by == "compute"
    slow = bounds.train_step(state, budget, 5.0, 5.0, 8.0, 0.0796)
    assert slow.limited_by == "link" and slow.seconds == pytest.approx(2 * cross / 8e9)
    # a duplex rate no better than one direction: in and out take twice one way
    serial = bounds.train_step(state, budget, 50.0, 50.0, 50.0, 0.0)
    assert serial.seconds == pytest.approx(2 * cross / 50e9)
    fits = bounds.train_step(state, state, 50.0, 50.0, 90.0, 0.05)
    assert fits.cross_bytes == 0 and fits.seconds == 0.05


def test_ratio_and_the_below_bound_note():
    assert bounds.ratio(0.2135, 0.0796) == pytest.approx(2.682, abs=1e-3)
    assert math.isinf(bounds.ratio(1.0, 0.0))
    assert bounds.below_bound_note("prefill_vs_bound.llama", 0.99) is None
    note = bounds.below_bound_note("prefill_vs_bound.llama", 0.953)
    assert note and "prefill_vs_bound.llama = 0.953" in note and "below" in note


# -- provenance: a result names its commit or says it cannot --------------------------------------


def _in_git() -> bool:
    return _common._git("rev-parse", "--is-inside-work-tree") == "true"


@pytest.mark.parametrize("made_up", ["wip9", "wip-replay", "940e2c7-dirty", "471d2c8+probe_floor", ""])
def test_a_made_up_commit_is_refused(monkeypatch, made_up):
    monkeypatch.setenv("TIERMEM_COMMIT", made_up)
    p = _common.provenance()
    assert p["commit"] is None and "not a commit hash" in p["commit_note"]


def test_a_hash_is_taken_and_looked_up_in_the_repository(monkeypatch):
    if not _in_git():
        pytest.skip("not a git checkout: the hash cannot be checked")
    head = _common._git("rev-parse", "--short", "HEAD")
    monkeypatch.setenv("TIERMEM_COMMIT", head)
    assert _common.provenance() == {"commit": head}
    # a hash this copy's .git does not hold (the device's copy is older than what it runs): taken, and said
    monkeypatch.setenv("TIERMEM_COMMIT", "0123456789abcdef0123")
    p = _common.provenance()
    assert p["commit"] == "0123456789abcdef0123" and "could not look it up" in p["commit_note"]


def test_without_the_variable_git_head_unless_the_tree_differs(monkeypatch, tmp_path):
    monkeypatch.delenv("TIERMEM_COMMIT", raising=False)
    if not _in_git():
        p = _common.provenance()
        assert p["commit"] is None and "unknown" in p["commit_note"]
        return
    # a throwaway repository holding a copy of bench/_common.py, so the check runs on a tree this
    # test may change
    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    (repo / "tiermem").mkdir()
    src = open(_common.__file__).read()
    (repo / "bench" / "_common.py").write_text(src)
    (repo / "tiermem" / "x.py").write_text("x = 1\n")

    def git(*a):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *a], cwd=repo, check=True,
                       capture_output=True)
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "a")
    monkeypatch.setattr(_common, "HERE", str(repo / "bench"))
    head = _common._git("rev-parse", "--short", "HEAD")
    assert _common.provenance() == {"commit": head}
    (repo / "bench" / "results").mkdir()
    (repo / "bench" / "results" / "new.json").write_text("{}")     # a result written: still clean
    assert _common.provenance() == {"commit": head}
    (repo / "tiermem" / "x.py").write_text("x = 2\n")
    p = _common.provenance()
    assert p["commit"] is None and head in p["commit_note"] and "tiermem/x.py" in p["commit_note"]


def test_write_results_keeps_the_provenance_and_the_notes(monkeypatch, tmp_path):
    monkeypatch.setattr(_common, "RESULTS", str(tmp_path))
    monkeypatch.setattr(_common, "device_name", lambda: "NVIDIA H200")
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setenv("TIERMEM_COMMIT", "wip10")
    path = _common.write_results("probe_x", {"a": 1.0}, {"ok": True}, {"r": 1}, tag="part4", notes=["why"])
    assert os.path.basename(path).startswith("probe_x-h200-") and path.endswith("-part4.json")
    d = json.load(open(path))
    assert d["commit"] is None and "wip10" in d["commit_note"]
    assert d["notes"] == ["why"] and d["metrics"] == {"a": 1.0} and d["checks"] == {"ok": True}
    assert {"bench", "device", "date", "raw"} <= set(d)
