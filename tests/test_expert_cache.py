"""The expert cache on a CPU (NOTE [expert cache] in tiermem/inference/experts.py): hits, misses
and the order of evictions and of what is brought in ahead, on experts routed by hand; greedy
tokens of tiny transformers mixtures of experts equal to the uncached path's; and the plan's
choice between bringing a layer's experts whole or one by one (NOTE [experts by expert])."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from helpers import share

import tiermem
import tiermem.inference.plan as planning
from tiermem.inference.plan import by_expert
from tiermem.testing import skew_router

H = 64


class Experts(nn.Module):
    """Called as transformers' experts modules are; each token adds its experts one by one, in
    the order of its picks, so the result does not depend on how experts are numbered."""

    def __init__(self, e: int = 8):
        super().__init__()
        self.num_experts = e
        self.w = nn.Parameter(torch.randn(e, H, H) / H ** 0.5)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for t in range(hidden_states.shape[0]):
            for j in range(top_k_index.shape[1]):
                out[t] += top_k_weights[t, j] * (hidden_states[t] @ self.w[int(top_k_index[t, j])])
        return out


class Toy(nn.Module):
    """Layers of a Linear and its experts, routed by ``self.route`` ([layer][token] -> experts)."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(H, H) for _ in range(layers))
        self.experts = nn.ModuleList(Experts() for _ in range(layers))
        self.route: list = []

    def forward(self, x):
        for lin, ex, picks in zip(self.lins, self.experts, self.route):
            idx = torch.tensor(picks)
            x = x + ex(lin(x), idx, torch.full(idx.shape, 1.0 / idx.shape[1]))
        return x


def _toy(tier, slots: int):
    torch.manual_seed(0)
    m = Toy().requires_grad_(False)
    ref = copy.deepcopy(m)
    one = H * H * 4
    h = tier.wrap_module(m, budget=share(m, 50) + slots * one, max_group_bytes=32 << 10, expert_cache=slots * one)
    assert h._cache is not None and h._cache.nslots == slots
    return m, ref, h


def _run(m, ref, route):
    m.route = ref.route = route
    x = torch.randn(len(route[0]), H)
    with torch.no_grad():
        assert torch.equal(m(x), ref(x))


def test_hits_misses_and_the_order_of_evictions_and_of_experts_brought_ahead(tier, fake):
    m, ref, h = _toy(tier, slots=2)
    c = h._cache
    g0, g1 = (next(g for g in h._groups.values() if g.tensors[0] is e.w) for e in m.experts)
    assert g0.cached and g1.cached and not g0.pinned and not g1.pinned
    loads = []
    real = c._load
    c._load = lambda g, e, slot: (loads.append((g.name, e, slot.index)), real(g, e, slot))[1]
    held = lambda: {(g.name, e): s for (gid, e), s in c.where.items() for g in (g0, g1) if id(g) == gid}

    _run(m, ref, [[[0, 1]], [[2, 2]]])          # layer 0 fills both slots; layer 1 takes the older
    assert h._fwd_mode == "decode"
    assert loads == [(g0.name, 0, 0), (g0.name, 1, 1), (g1.name, 2, 0)]
    assert held() == {(g0.name, 1): 1, (g1.name, 2): 0}
    # Layer 0 evicts both (least recently used first); then layer 1's last expert is brought in
    # ahead, over the older of layer 0's; after layer 1, layer 0's last two come back ahead for
    # the next token, each over the slot used longest ago.
    _run(m, ref, [[[3, 4]], [[2, 2]]])
    assert loads[3:] == [(g0.name, 3, 1), (g0.name, 4, 0), (g1.name, 2, 1), (g0.name, 3, 0), (g0.name, 4, 1)]
    assert held() == {(g0.name, 3): 0, (g0.name, 4): 1}
    s = h.stats()
    assert (s["expert_cache.hits"], s["expert_cache.misses"], s["expert_cache.prefetched"],
            s["expert_cache.prefetch_hits"], s["expert_cache.evictions"]) == (1, 5, 3, 1, 6)
    assert s["expert_cache.hit_rate"] == pytest.approx(1 / 6) and s["expert_cache.slots"] == 2
    _run(m, ref, [[[4, 4]], [[2, 2]]])          # 4 was brought ahead; 2 comes ahead over 3
    assert loads[8:] == [(g1.name, 2, 0)] and held() == {(g1.name, 2): 0, (g0.name, 4): 1}
    s = h.stats()
    assert (s["expert_cache.hits"], s["expert_cache.misses"], s["expert_cache.prefetch_hits"]) == (3, 5, 3)
    h.unwrap()


def test_a_call_with_more_experts_than_slots_runs_in_rounds(tier, fake):
    m, ref, h = _toy(tier, slots=2)
    m.route = ref.route = [[[0, 1], [2, 3], [4, 5]], [[1, 6], [7, 0], [3, 3]]]
    x = torch.randn(3, H)
    with torch.no_grad():
        got, want = m(x), ref(x)
    assert h._fwd_mode == "decode"
    assert h.stats()["expert_cache.rounds"] == 3 + 3 and torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    h.unwrap()


def test_the_cache_is_part_of_the_budget_and_given_back(tier, fake):
    m, ref, h = _toy(tier, slots=3)
    c = h._cache
    assert h.plan.pinned_bytes + h.plan.window + c.nbytes <= h.budget
    assert fake.live()["device"] == h._stream.window_bytes + c.nbytes
    assert tier.stats()["resident_bytes.all.peak"] <= h.budget          # the window and the cache are counted
    _run(m, ref, [[[0, 1]], [[2, 3]]])
    h.unwrap()
    assert fake.live()["device"] == 0
    x = torch.randn(1, H)
    with torch.no_grad():
        assert torch.equal(m(x), ref(x))


def test_a_prefill_streams_the_layers_whole_and_keeps_the_cache_out(tier, fake):
    m, ref, h = _toy(tier, slots=2)
    route = [[[t % 8, (t + 3) % 8] for t in range(32)], [[(t * 5) % 8, (t + 1) % 8] for t in range(32)]]
    _run(m, ref, route)                          # 32 tokens: more than zero_copy_max_tokens
    assert h._fwd_mode == "stream" and h.stats()["expert_cache.calls"] == 0
    h.unwrap()


def test_no_cache_reports_zeros_and_a_module_without_experts_ignores_it(tier):
    m = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).requires_grad_(False)
    h = tier.wrap_module(m, budget=share(m, 40), max_group_bytes=1 << 20, expert_cache=1 << 20)
    s = h.stats()
    assert h._cache is None and s["expert_cache.slots"] == 0 and s["expert_cache.hit_rate"] == 0.0
    h.unwrap()


def test_the_plan_brings_experts_one_by_one_only_where_it_costs_less():
    """NOTE [experts by expert]: expected picks E(1 - (1 - k/E)^T) against the whole layer."""
    big = 8 << 20
    assert by_expert(1, 4, 60, big) and by_expert(25, 4, 60, big) and not by_expert(26, 4, 60, big)
    assert by_expert(6, 2, 8, big) and not by_expert(7, 2, 8, big)
    assert not by_expert(128, 4, 60, big) and not by_expert(128, 4, 60, big, cached=True)   # a prefill
    assert by_expert(40, 4, 60, big, cached=True)          # copies at the link rate beat the layer whole
    # a tiny expert's calls cost more than its bytes: the whole layer goes at once
    assert not by_expert(1, 2, 8, 64 << 10, cached=True) and by_expert(1, 2, 8, 64 << 10)
    assert not by_expert(1, 0, 8, big) and not by_expert(1, 2, 0, big)


def _moe(arch: str, impl: str):
    transformers = pytest.importorskip("transformers")
    if arch == "mixtral":
        cfg = transformers.MixtralConfig(hidden_size=H, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=256, num_local_experts=8,
                                         num_experts_per_tok=2)
    else:
        cfg = transformers.Qwen2MoeConfig(hidden_size=H, intermediate_size=128, moe_intermediate_size=48,
                                          shared_expert_intermediate_size=96, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=256, num_experts=12,
                                          num_experts_per_tok=4, decoder_sparse_step=1)
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    m.generation_config.pad_token_id = 0
    m.generation_config.eos_token_id = None
    return m, cfg


def test_a_forward_of_few_tokens_chooses_by_the_cost_model(tier):
    m, cfg = _moe("mixtral", "eager")
    h = tier.wrap_module(m, budget=share(m, 40), max_group_bytes=32 << 10)
    per = h._moe[0][2]
    with torch.no_grad():
        for n in (1, 2, 6, 7, 12):
            m(torch.randint(0, 256, (1, n)))
            assert h._fwd_mode == ("decode" if by_expert(n, 2, 8, per) else "stream"), n
    assert {n for n in range(1, 17) if by_expert(n, 2, 8, per)} == set(range(1, 7))
    h.unwrap()


@pytest.mark.parametrize("stream_dtype", [None, "int8"])
@pytest.mark.parametrize("impl", ["eager", "batched_mm"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
@pytest.mark.long(keep=2)
def test_greedy_tokens_through_the_cache_equal_the_uncached_path(tier, fake, monkeypatch, arch, impl, stream_dtype):
    # The tiny experts (tens of KiB) cost less whole than one by one by the plan's measure
    # (EXPERT_CALL_COST); this test is of the cache, so a decode goes one by one.
    monkeypatch.setattr(planning, "EXPERT_CALL_COST", 0)
    m, cfg = _moe(arch, impl)
    plain = copy.deepcopy(m)
    t0 = tiermem.Tier(backend=type(fake)(total=1 << 30))
    h0 = t0.wrap_module(plain, budget=share(m, 30), max_group_bytes=32 << 10, stream_dtype=stream_dtype)
    h = tier.wrap_module(m, budget=share(m, 42), max_group_bytes=32 << 10, stream_dtype=stream_dtype,
                         expert_cache=share(m, 12))
    assert h._cache is not None and all(g.cached for g in h._cache.groups)
    assert (h._cache.nslots < h._cache.experts * len(h._cache.groups))       # it must evict
    ids = torch.randint(0, 256, (2, 5))
    with torch.no_grad():
        want = plain.generate(ids, max_new_tokens=10, do_sample=False)
        got = m.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(got, want)
    s = h.stats()
    assert s["expert_cache.calls"] > 0 and s["expert_cache.hits"] + s["expert_cache.misses"] > 0
    assert s["expert_cache.evictions"] > 0
    h.unwrap()
    h0.unwrap()
    t0.close()


def test_a_skewed_router_hits_the_cache_more(tier, monkeypatch):
    monkeypatch.setattr(planning, "EXPERT_CALL_COST", 0)
    rates = {}
    for skewed in (False, True):
        m, cfg = _moe("qwen2_moe", "batched_mm")
        sk = skew_router(m, hot=4, bias=3.0) if skewed else None
        # Two slots: every layer's experts stream whole, so the three layers share the cache, as
        # the rates below assume (with three, the plan reads two layers in place whole).
        h = tier.wrap_module(m, budget=share(m, 42), max_group_bytes=32 << 10, expert_cache=share(m, 12),
                             lookahead=2)
        assert len(h._cached) == 3
        with torch.no_grad():
            m.generate(torch.randint(0, 256, (1, 4)), max_new_tokens=12, do_sample=False)
        rates[skewed] = h.stats()["expert_cache.hit_rate"]
        h.unwrap()
        if sk is not None:
            sk.remove()
    assert rates[True] > 0.8 and rates[True] > rates[False] + 0.3, rates
