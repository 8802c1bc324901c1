"""bench/infer_quant.py on the CPU: the metrics and checks it derives from offload_infer's
per-architecture figures (against the fp16 bound). No GPU. (The mixtures of experts and the
expert cache's figures: tests/test_bench_moe.py.)"""
from __future__ import annotations

import pytest

tf = pytest.importorskip("transformers")

import infer_quant  # noqa: E402


def _q(pre, dec, bound, cos, top1=1.0):
    return {"prefill_ms": pre, "decode_ms_per_token": dec, "fp16_bound_ms": bound, "plan_bytes_ms": bound / 2,
            "logits": {"cosine_min": cos, "top1": top1}, "moved_GB_per_forward": 1.0}


def test_metrics_take_the_worst_architecture_against_the_fp16_bound():
    archs = {"llama": {"quant": {"int8": _q(50, 52, 100, 0.9995), "int4": _q(30, 33, 100, 0.95)}},
             "phi": {"quant": {"int8": _q(60, 50, 100, 0.9992), "int4": {"error": "TierMemError: no room"}}},
             "qwen2_moe": {"quant": {}}}
    metrics, checks, notes = {}, {}, []
    rows = infer_quant.add_metrics(archs, metrics, checks, notes)
    assert metrics["prefill_vs_bound_worst_int8"] == 0.6 and metrics["decode_vs_bound_worst_int8"] == 0.52
    assert metrics["logits_cosine_min_int8"] == 0.9992 and metrics["prefill_vs_bound_worst_int4"] == 0.3
    assert metrics["logits_cosine_min_int4"] == 0.95 and metrics["prefill_vs_bound.phi.int8"] == 0.6
    assert checks["quant_goal_int8"] is False and checks["logits_goal_int8"] is True
    assert checks["quant_goal_int4"] is True and checks["logits_goal_int4"] is False
    assert any("phi" in n and "int4" in n for n in notes)          # the run that did not happen is said
    assert len(rows) == 3


def test_each_linear_and_the_floor_of_the_resident_prefill_are_reported():
    def q(pre, cos, lin):
        return {**_q(pre, pre, 100, cos), "linear": {"cosine_min": lin, "worst": "lm_head", "linears": 3}}
    archs = {"llama": {"resident": {"prefill_ms": 10}, "quant": {"int8": q(60, 0.998, 0.99995), "int4": q(40, 0.8, 0.995)}},
             "phi": {"resident": {"prefill_ms": 40}, "quant": {"int8": q(70, 0.9995, 0.9999), "int4": q(45, 0.9, 0.989)}}}
    metrics, checks, notes = {}, {}, []
    infer_quant.add_metrics(archs, metrics, checks, notes)
    assert metrics["linear_cosine_min_int8"] == 0.9999 and metrics["linear_cosine_min_int4"] == 0.989
    assert checks["linear_goal_int8"] is True and checks["linear_goal_int4"] is False
    assert checks["logits_goal_int8"] is False
    # the floor: the resident prefill (phi: 40 ms) or the plan's bytes (llama: 50 ms), whichever is slower
    assert metrics["prefill_vs_floor.llama.int8"] == 1.2 and metrics["prefill_vs_floor.phi.int4"] == 0.9
    assert metrics["prefill_vs_floor_worst_int8"] == 1.4
    # phi resident takes 0.4 of the fp16 bound: above int4's goal (0.32), not int8's (0.55)
    assert any("phi" in n and "int4" in n and "resident" in n for n in notes)
    assert not any("int8" in n and "resident" in n for n in notes)


def test_graphed_prefills_have_their_own_worst_figure_and_goal():
    """NOTE [graphed forwards]: a graphed prefill is its own figure beside the eager one, the
    goal's check takes it with the eager decode, and a run that stayed eager or whose logits
    differ from the eager forward's fails the graphed checks."""
    def q(pre, graphed, equal=True, off="", cos=1.0, top1=1.0, dec=None):
        d = None if dec is None else {"graphed_ms": dec, "eager_static_ms": 50, "captures": 1, "replays": 5, "off": ""}
        return {**_q(pre, 50, 100, 0.9995), "graphed": {"prefill_ms": graphed, "logits_equal_eager": equal,
                                                          "logits_cosine_min_eager": cos, "top1_eager": top1,
                                                          "captures": 0 if off else 1, "replays": 9, "off": off,
                                                          "decode": d}}
    archs = {"llama": {"quant": {"int8": q(70, 40)}}, "phi": {"quant": {"int8": q(80, 52)}}}
    metrics, checks, notes = {}, {}, []
    rows = infer_quant.add_metrics(archs, metrics, checks, notes)
    assert metrics["prefill_vs_bound_graphed.phi.int8"] == 0.52 and metrics["prefill_vs_bound_worst_graphed_int8"] == 0.52
    assert checks["quant_goal_int8"] is False and checks["quant_goal_graphed_int8"] is True
    assert checks["graphed_logits_equal_eager"] is True and checks["graphed_captured_all"] is True
    assert checks["graphed_logits_agree_eager"] is True
    assert rows[0][-3:] == [40, 0.4, "-"]
    # Rounding apart (torch's capture of the model's ops): agreeing, not equal.
    archs["llama"]["quant"]["int8"] = q(70, 40, equal=False, cos=0.999994)
    metrics, checks = {}, {}
    infer_quant.add_metrics(archs, metrics, checks, notes)
    assert checks["graphed_logits_agree_eager"] is True and checks["graphed_logits_equal_eager"] is False
    archs["phi"]["quant"]["int8"] = q(80, 80, off="the capture failed: RuntimeError: x")
    archs["llama"]["quant"]["int8"] = q(70, 40, equal=False, cos=0.99, top1=0.99)
    metrics, checks = {}, {}
    infer_quant.add_metrics(archs, metrics, checks, notes)
    assert checks["graphed_logits_agree_eager"] is False and checks["graphed_captured_all"] is False
    assert checks["quant_goal_graphed_int8"] is False
    # A graphed decode (over a static cache) takes the eager one's place in the goal's check.
    archs = {"llama": {"quant": {"int8": q(70, 50, dec=55)}}, "phi": {"quant": {"int8": q(80, 52, dec=58)}}}
    metrics, checks = {}, {}
    infer_quant.add_metrics(archs, metrics, checks, notes)
    assert metrics["decode_vs_bound_worst_graphed_int8"] == 0.58 and metrics["decode_vs_bound_worst_int8"] == 0.5
    assert checks["quant_goal_graphed_int8"] is True and checks["graphed_decode_captured_all"] is True
    archs["phi"]["quant"]["int8"]["graphed"]["decode"] = {"error": "TypeError: no static cache"}
    metrics, checks = {}, {}
    infer_quant.add_metrics(archs, metrics, checks, notes)
    assert checks["graphed_decode_captured_all"] is False and metrics["decode_vs_bound_worst_graphed_int8"] == 0.55
    # Only what was captured counts in the captured worst; a note says why the rest stayed eager.
    archs["phi"]["quant"]["int8"] = q(80, 90, off="the capture failed: RuntimeError: sync", dec=95)
    metrics, checks, notes = {}, {}, []
    infer_quant.add_metrics(archs, metrics, checks, notes)
    assert metrics["prefill_vs_bound_worst_graphed_int8"] == 0.9 and metrics["prefill_vs_bound_worst_captured_int8"] == 0.5
    assert metrics["decode_vs_bound_worst_captured_int8"] == 0.55
    assert any("phi" in n and "stayed eager" in n and "sync" in n for n in notes)


def test_a_graphed_prefill_is_set_against_the_resident_prefill_graphed():
    """The floor of a graphed prefill: the resident model's prefill captured by torch alone, or
    the plan's bytes, whichever is slower; the note on the goal says whether graphs could reach it."""
    def q(pre, graphed):
        return {**_q(pre, pre, 100, 0.9995), "graphed": {"prefill_ms": graphed, "logits_equal_eager": True,
                                                         "captures": 1, "replays": 9, "off": ""}}
    archs = {"qwen2": {"resident": {"prefill_ms": 45, "graphed": {"prefill_ms": 12}}, "quant": {"int4": q(90, 36)}},
             "phi": {"resident": {"prefill_ms": 40, "graphed": {"prefill_ms": 60}}, "quant": {"int4": q(90, 70)}},
             "gpt_neox": {"resident": {"prefill_ms": 40, "graphed": {"error": "RuntimeError: sync"}},
                          "quant": {"int4": q(90, 36)}}}
    metrics, checks, notes = {}, {}, []
    infer_quant.add_metrics(archs, metrics, checks, notes)
    # qwen2: the plan's bytes (50 ms) are slower than its graphed resident prefill (12 ms)
    assert metrics["prefill_vs_floor_graphed.qwen2.int4"] == 0.72
    assert metrics["prefill_vs_floor_graphed.phi.int4"] == round(70 / 60, 3)
    assert "prefill_vs_floor_graphed.gpt_neox.int4" not in metrics
    assert metrics["prefill_vs_floor_worst_graphed_int4"] == round(70 / 60, 3)
    qwen2 = [n for n in notes if n.startswith("qwen2") and "resident" in n]
    phi = [n for n in notes if n.startswith("phi") and "resident" in n]
    assert qwen2 and "no graphed one" not in qwen2[0] and phi and "no graphed one either" in phi[0]
