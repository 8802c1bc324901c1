"""bench/offload_infer.py's architecture matrix and bench/infer_moe.py on the CPU: every
architecture is built (on the meta device) at the size asked, the tied one's embedding is larger
than the budget, the mixtures of experts are ones the expert cache serves and whose routers it
finds; how a decode through the cache is compared with the uncached one; the metrics and checks
derived from the per-architecture figures; what the plan check calls a collapse. No GPU."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

import infer_moe  # noqa: E402
import offload_infer  # noqa: E402

from tiermem.inference.experts import expert_module, router_of  # noqa: E402
from tiermem.inference.plan import Plan  # noqa: E402
from tiermem.testing import routers  # noqa: E402


def _meta(cfg):
    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(cfg)


def test_eight_architectures_at_the_size_asked():
    assert len(offload_infer.ARCHS) == len(set(offload_infer.ARCHS)) >= 8
    assert set(offload_infer.QUICK_ARCHS) <= set(offload_infer.ARCHS)
    for arch in offload_infer.ARCHS:
        m = _meta(offload_infer.arch_config(arch, 5.2))
        w = 2 * sum(p.numel() for p in m.parameters())          # fp16
        layer = next(x for x in m.modules() if isinstance(x, torch.nn.ModuleList))[0]
        per = 2 * sum(p.numel() for p in layer.parameters())
        assert abs(w - 5.2e9) <= 0.6 * per + 0.1e9, (arch, w)  # within about half a layer


def test_the_tied_embedding_is_larger_than_the_budget():
    m = _meta(offload_infer.arch_config("gemma", 5.2))
    assert m.get_output_embeddings().weight is m.get_input_embeddings().weight
    w = sum(p.numel() for p in m.parameters())
    assert m.get_input_embeddings().weight.numel() > 0.25 * w       # the bench's budget: 25% of the weights


@pytest.mark.parametrize("arch,experts,top_k,shared", [("qwen2_moe", 60, 4, True), ("olmoe", 64, 8, False),
                                                       ("mixtral", 8, 2, False)])
def test_the_mixtures_of_experts_are_ones_the_cache_serves(arch, experts, top_k, shared):
    m = _meta(offload_infer.arch_config(arch, 5.2))
    parent = {id(c): p for p in m.modules() for c in p.children()}
    found = [x for x in m.modules() if expert_module(x)]
    assert len(found) == m.config.num_hidden_layers
    for x in found:
        assert x.num_experts == experts and x.gate_up_proj.shape[0] == experts
        r = router_of(parent[id(x)], x)
        assert r is not None and r.top_k == top_k and r.weight.shape[0] == experts
    assert any("shared_expert" in n for n, _ in m.named_modules()) == shared
    assert len(routers(m)) == len(found)           # what skew_router skews


def test_a_decode_of_another_length_is_not_equal():
    """The bench once set a generate of 1 + n tokens against one of n: never equal, whatever the
    cache did (moe_cache_tokens_equal False at 1ec3b85)."""
    t = torch.arange(12).view(1, 12)
    logits = [torch.full((1, 5), float(i)) for i in range(3)]
    same = infer_moe.same_decode((t, logits), (t.clone(), [x.clone() for x in logits]))
    assert same == {"tokens_equal": True, "logits_equal": True, "first_step_differing": None, "steps": 3}
    shorter = infer_moe.same_decode((t, logits), (t[:, :-1], logits[:-1]))
    assert not shorter["tokens_equal"] and shorter["first_step_differing"] == 2
    off = [x.clone() for x in logits]
    off[1][0, 3] += 2 ** -10
    other = infer_moe.same_decode((t, logits), (t, off))
    assert other["tokens_equal"] and not other["logits_equal"] and other["first_step_differing"] == 1


def _c(dec, hit, equal=None, moved=3.0):
    x = {"decode_ms_per_token": dec, "dense_bound_ms": 100, "hit_rate": hit, "slots": 10, "hot_share": 0.8,
         "moved_experts_per_token": moved}
    if equal is not None:
        x["tokens_equal_uncached"] = equal
    return x


def test_moe_metrics_take_the_worst_mixture_of_experts():
    archs = {"llama": {},
             "mixtral": {"moe_cache": {"uniform": _c(66, 0.7), "skewed": _c(46, 0.81, True)}},
             "qwen2_moe": {"moe_cache": {"uniform": _c(15, 0.5), "skewed": _c(9, 0.97, True)}}}
    metrics, checks = {}, {}
    rows = infer_moe.add_metrics(archs, metrics, checks)
    assert metrics["moe_decode_vs_dense_bound_skewed"] == 0.46 and metrics["moe_decode_worst_arch_skewed"] == "mixtral"
    assert metrics["moe_decode_vs_dense_bound_uniform"] == 0.66 and metrics["moe_cache_hit_rate_uniform"] == 0.5
    assert metrics["moe_decode_vs_dense_bound_skewed.qwen2_moe"] == 0.09
    assert metrics["moe_cache_hit_rate_skewed.qwen2_moe"] == 0.97 and metrics["moe_cache_hit_rate_skewed"] == 0.81
    assert checks == {"moe_uniform_goal": False, "moe_skewed_goal": False, "moe_cache_tokens_equal": True}
    assert len(rows) == 4
    archs["qwen2_moe"]["moe_cache"]["skewed"]["tokens_equal_uncached"] = False
    del archs["mixtral"]
    metrics, checks = {}, {}
    infer_moe.add_metrics(archs, metrics, checks)
    assert checks == {"moe_uniform_goal": True, "moe_skewed_goal": True, "moe_cache_tokens_equal": False}


def _plan(**kw):
    base = dict(budget=100, total=1000, sizes=(("emb", 400), ("l0", 300), ("l1", 300)), pinned=frozenset(),
                window=0, zero_copy_only=False)
    base.update(kw)
    return Plan(**base)


def test_a_plan_read_wholly_in_place_is_a_collapse_where_a_slot_would_fit():
    collapsed = offload_infer.plan_shape(_plan(zero_copy_only=True), budget=400)
    assert collapsed["collapsed"] and collapsed["budget_holds_a_slot"]
    whole = offload_infer.plan_shape(_plan(oversized=frozenset({"emb", "l0", "l1"}), units=(("emb", 50),)), 100)
    assert whole["collapsed"] and whole["budget_holds_a_slot"]         # the embedding could stream in parts
    too_small = offload_infer.plan_shape(_plan(zero_copy_only=True), budget=100)
    assert too_small["collapsed"] and not too_small["budget_holds_a_slot"]
    streams = offload_infer.plan_shape(_plan(window=300, slot=150, split=frozenset({"emb"}), units=(("emb", 100),),
                                             oversized=frozenset({"l0"})), 300)
    assert not streams["collapsed"] and streams["split"] == 1


def test_the_cache_run_compares_decodes_of_one_length_on_the_fake_backend(monkeypatch):
    """run_moe_cache end to end on a tiny Qwen2-MoE in fp16 (the bench's shape shrunk), its Tier
    on the fake backend and generate() untimed: the skewed decode through the cache equals the
    uncached one, tokens and every step's logits, and the figures it reports are there."""
    import types

    from fakes import FakeBackend
    from helpers import share, tiny_qwen2_moe

    import tiermem
    import tiermem.inference.plan as planning
    monkeypatch.setattr(planning, "EXPERT_CALL_COST", 0)
    real = tiermem.Tier
    monkeypatch.setattr(tiermem, "Tier", lambda *a, **k: real(backend=FakeBackend(total=1 << 30)))
    m = tiny_qwen2_moe(tf)
    calls = []

    def timed_generate(model, ids, new, reps):
        calls.append(new)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        return 1e-3 * new, out

    out = infer_moe.run_moe_cache(m, torch.randint(0, 256, (1, 16)), types.SimpleNamespace(decode_tokens=12),
                                  share(m, 40), 0.05, timed_generate)
    assert calls == [1, 13, 1, 13]
    sk = out["skewed"]
    assert sk["tokens_equal"] and sk["logits_equal"] and sk["tokens_equal_uncached"] and sk["steps"] == 13
    assert sk["hot_share"] > out["uniform"]["hot_share"] and sk["slots"] > 0
    for r in (out["uniform"], sk):
        assert r["decode_ms_per_token"] == pytest.approx(1.0) and r["dense_bound_ms"] == 50
        assert 0 <= r["hit_rate"] <= 1 and r["moved_experts_per_token"] >= 0 and r["calls"] > 0
        assert r["rounds_per_call"] == 1.0 and r["slot_moves_per_token"] == 0     # grouped_mm: no order kept
    assert out["experts_implementation"] == "grouped_mm"
    assert [p.device.type for p in m.parameters()] == ["cpu"] * len(list(m.parameters()))
