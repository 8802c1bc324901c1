"""bench/multi_gpu.py's figures from its runs' results, on the CPU: what each metric and check is
made of, for a whole run, a run of one part, and a run whose ranks failed part-way (what ran
is reported). The runs themselves need two GPUs."""
from __future__ import annotations

import argparse
import json

import pytest

torch = pytest.importorskip("torch")

import multi_gpu  # noqa: E402

A = argparse.Namespace(infer_share=1 / 3, prefill=2048, decode=32, dp_budget="6GiB", parts="train,infer")


def _ranks(fsdp: bool = True) -> list[dict]:
    out = []
    for r in range(2):
        moved = {"moved_h2d_bytes": 14, "moved_d2h_bytes": 11}
        res = {"dp2": {"step_s": 0.40 + 0.01 * r, "peak": 5e9, "budget": 6e9, "plan": "p", "pinned": 9,
                       "checksum": 1.5, "report": moved},
               "dp2_shard": {"step_s": 0.36 + 0.01 * r, "peak": 5e9, "budget": 6e9, "plan": "p", "pinned": 6,
                             "checksum": 2.5, "report": {"moved_h2d_bytes": 10, "moved_d2h_bytes": 7}},
               "dp2_host": {"step_s": 0.30 + 0.01 * r, "peak": 5e9, "budget": 6e9, "plan": "p", "pinned": 1}}
        if r == 0:
            res["dp1"] = {"step_s": 0.33, "peak": 5e9, "budget": 6e9, "plan": "p", "pinned": 1}
            res["dp1_host"] = {"step_s": 0.30, "peak": 5e9, "budget": 6e9, "plan": "p", "pinned": 1}
        if fsdp:
            for how, t, peak in (("plain", 0.18, 15e9), ("plain_again", 0.18, 15e9), ("offload", 0.9 + 0.1 * r, 9e9),
                                 ("tiermem", 0.36, 12e9)):
                res[how] = {"step_s": t, "losses": [10.0, 9.0], "peak_reserved": peak, "state_share": 6e9,
                            "pinned": 6e9 if how == "tiermem" else 0}
        out.append(res)
    return out


def _run(prefill, decode, tokens_ok=True):
    t = torch.tensor([[1, 2, 3]])
    return {"prefill_tok_s": prefill, "decode_tok_s": decode, "tokens": t if tokens_ok else t + 1, "peak_ok": True,
            "pinned": 2e9, "relayed_share": 0.5, "plans": []}


def _infs() -> dict:
    small = {"weight_bytes": 1.7e9, "budget_per_gpu": 0.57e9, "one": _run(100.0, 40.0), "two": _run(120.0, 38.0),
             "two_own_link": _run(110.0, 39.0), "want": torch.tensor([[1, 2, 3]]),
             "replicas": {"pinned": 1.5e9, "one_home": 1.5e9, "tokens_equal": True}}
    big = {**small, "weight_bytes": 4.8e9, "one": _run(50.0, 10.0), "two": _run(95.0, 19.0),
           "two_own_link": _run(60.0, 12.0)}
    big.pop("replicas")
    return {"0.85B": small, "2.4B": big}


def test_a_whole_run():
    metrics, checks, raw = multi_gpu.summary(torch, _ranks(), _infs(), {0: 100.0}, {0: 73.0, 1: 74.0}, A, None,
                                             {"train", "infer"}, 2)
    assert metrics["dp_scaling_2gpu"] == round(2 / 0.41 / (1 / 0.33), 3)
    assert metrics["dp_scaling_2gpu_sharded"] == round(2 * 0.33 / 0.37, 3)
    assert metrics["dp_host_mem_sharded_over_plain"] == round(6 / 9, 3)
    assert raw["dp_sharded"]["moved_h2d_d2h"] == [(10, 7), (10, 7)]
    assert metrics["dp_scaling_2gpu_host_step"] == round(2 * 0.30 / 0.31, 3)
    assert metrics["dp_host_step_speedup_2gpu"] == round(0.41 / 0.31, 3)
    assert raw["dp_host_step"]["two_gpu_step_s"] == [0.30, 0.31]
    assert metrics["dp_scaling_link_bound"] == 1.47
    assert metrics["fsdp2_offload_over_tiermem"] == round(1.0 / 0.36, 3)
    assert metrics["fsdp2_tiermem_peak_over_offload_peak"] == round(12 / 9, 3)
    assert metrics["host_mem_over_state"] == 1.0
    assert metrics["infer_scaling_2gpu"] == metrics["infer_scaling_2gpu_2.4B"] == 1.9     # the lower of the two
    assert metrics["infer_scaling_2gpu_0.85B"] == 0.95 and metrics["host_mem_ratio_shared_home"] == 1.0
    assert checks == {"resident_within_budget_all_ranks": True, "all_runs_finished": True, "losses_match": True,
                      "dp_replicas_equal": True, "tokens_equal": True}
    parted = _ranks()
    parted[1]["dp2_shard"]["checksum"] = 2.75          # the replicas parted
    assert not multi_gpu.summary(torch, parted, _infs(), {0: 100.0}, {0: 73.0, 1: 74.0}, A, None,
                                 {"train", "infer"}, 2)[1]["dp_replicas_equal"]
    assert raw["infer"]["2.4B"]["scaling_own_link"] == {"prefill": 1.2, "decode": 1.2}
    json.dumps({"metrics": metrics, "checks": checks, "raw": raw}, default=str)


def test_one_part_and_a_failed_one():
    metrics, checks, raw = multi_gpu.summary(torch, [{}, {}], _infs(), {0: 100.0}, {0: 73.0, 1: 74.0}, A, None,
                                             {"infer"}, 2)
    assert metrics["dp_scaling_2gpu"] is None and metrics["fsdp2_offload_over_tiermem"] is None
    assert metrics["dp_scaling_2gpu_host_step"] is None and raw["dp_host_step"] is None
    assert set(checks) == {"resident_within_budget_all_ranks", "all_runs_finished", "tokens_equal"}
    bad = _infs()
    bad["2.4B"]["two"] = _run(95.0, 19.0, tokens_ok=False)
    assert not multi_gpu.summary(torch, [{}, {}], bad, {0: 1.0}, {0: 1.0, 1: 1.0}, A, None, {"infer"}, 2)[1][
        "tokens_equal"]
    # the ranks failed in FSDP2: data parallel's figure stands, FSDP2's are missing, the run says so
    metrics, checks, raw = multi_gpu.summary(torch, _ranks(fsdp=False), {}, {0: 100.0}, {0: 73.0, 1: 74.0}, A,
                                             "ProcessExitedException", {"train"}, 2)
    assert metrics["dp_scaling_2gpu"] > 1 and metrics["fsdp2_offload_over_tiermem"] is None
    assert metrics["infer_scaling_2gpu"] is None
    assert checks["all_runs_finished"] is False and checks["losses_match"] is False
    assert checks["dp_replicas_equal"] is True             # what data parallel ran is checked
    short = _ranks(fsdp=False)
    for r in short:
        del r["dp2_shard"]                                 # failed before its sharded run
    metrics, checks, raw = multi_gpu.summary(torch, short, {}, {0: 100.0}, {0: 73.0, 1: 74.0}, A,
                                             "ProcessExitedException", {"train"}, 2)
    assert metrics["dp_scaling_2gpu_sharded"] is None and raw["dp_sharded"] is None
    assert checks["dp_replicas_equal"] is True
