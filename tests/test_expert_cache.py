"""The expert cache on a CPU (NOTE [expert cache] in tiermem/inference/experts.py): hits, misses
and the order of evictions and of what is brought in ahead, on experts routed by hand; greedy
tokens of tiny transformers mixtures of experts equal to the uncached path's; and the plan's
choice between bringing a layer's experts whole or one by one (NOTE [experts by expert])."""
from __future__ import annotations

import collections
import copy
import random

import pytest
import torch
import torch.nn as nn
from helpers import share, tiny_qwen2_moe
from hypothesis import given, settings
from hypothesis import strategies as st

import tiermem
import tiermem.inference.plan as planning
from tiermem.inference.expert_order import placement
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
    h = tier.wrap_module(m, budget=share(m, 50) + (slots + 1) * one, max_group_bytes=32 << 10,
                         expert_cache=(slots + 1) * one)     # and the zero slot
    assert h._cache is not None and h._cache.nslots == slots
    return m, ref, h


def _run(m, ref, route):
    m.route = ref.route = route
    x = torch.randn(len(route[0]), H)
    with torch.no_grad():
        assert torch.equal(m(x), ref(x))


def _loads(c):
    loads = []
    real = c._load
    c._load = lambda g, e, slot: (loads.append((g.name, e, slot.index)), real(g, e, slot))[1]
    return loads


def test_hits_misses_and_the_order_of_evictions_and_of_experts_brought_ahead(tier, fake):
    m, ref, h = _toy(tier, slots=2)
    c = h._cache
    g0, g1 = (next(g for g in h._groups.values() if g.tensors[0] is e.w) for e in m.experts)
    assert g0.cached and g1.cached and not g0.pinned and not g1.pinned
    assert c.routers == {}                        # the toy has no router: guesses are the last choices
    loads = _loads(c)
    held = lambda: {(g.name, e): s for (gid, e), s in c.where.items() for g in (g0, g1) if id(g) == gid}

    _run(m, ref, [[[0, 1]], [[2, 2]]])          # layer 0 fills both slots; layer 1 takes the older of equals
    assert h._fwd_mode == "decode"
    assert loads == [(g0.name, 0, 0), (g0.name, 1, 1), (g1.name, 2, 0)]
    assert held() == {(g0.name, 1): 1, (g1.name, 2): 0}
    # Layer 0's two new experts take both slots (each scores 1: the older first), so layer 1's
    # last expert has no slot to come ahead into; it comes back as a miss, over the older of
    # layer 0's.
    _run(m, ref, [[[3, 4]], [[2, 2]]])
    assert loads[3:] == [(g0.name, 3, 1), (g0.name, 4, 0), (g1.name, 2, 1)]
    assert held() == {(g0.name, 4): 0, (g1.name, 2): 1}
    s = h.stats()
    assert (s["expert_cache.hits"], s["expert_cache.misses"], s["expert_cache.prefetched"],
            s["expert_cache.evictions"]) == (0, 6, 0, 4)
    _run(m, ref, [[[4, 4]], [[2, 2]]])          # both cached: nothing moves
    assert loads[6:] == [] and held() == {(g0.name, 4): 0, (g1.name, 2): 1}
    s = h.stats()
    assert (s["expert_cache.hits"], s["expert_cache.misses"]) == (2, 6)
    assert s["expert_cache.hit_rate"] == pytest.approx(2 / 8) and s["expert_cache.slots"] == 2
    # Layer 1 moves on to expert 5: 4 and 2 score alike (3 picks each), so 5 goes over 2, used last.
    _run(m, ref, [[[4, 4]], [[5, 5]]])
    assert loads[6:] == [(g1.name, 5, 1)] and held() == {(g0.name, 4): 0, (g1.name, 5): 1}
    # Layer 0's 6 goes over 5 (1 pick against 4's 4). Neither 5 (brought ahead for layer 1, its
    # last choice) nor 6 (ahead for layer 0 in turn) may displace 4, which scores more than
    # either guess by AHEAD_BONUS: each comes as a miss over the other.
    _run(m, ref, [[[6, 6]], [[5, 5]]])
    assert loads[7:] == [(g0.name, 6, 1), (g1.name, 5, 1)] and held() == {(g0.name, 4): 0, (g1.name, 5): 1}
    s = h.stats()
    assert (s["expert_cache.prefetched"], s["expert_cache.evictions"]) == (0, 7)
    h.unwrap()


def test_experts_routed_often_stay_where_the_least_recently_used_would_go(tier, fake):
    """Layer 0 routes every token to expert 0 and a new one; layer 1 to a new one. Least recently
    used would evict expert 0 (used before the new one in layer 0's call) for layer 1's; by
    frequency it stays, and neither a miss nor a guess brought ahead displaces it."""
    m, ref, h = _toy(tier, slots=2)
    c = h._cache
    g0 = next(g for g in h._groups.values() if g.tensors[0] is m.experts[0].w)
    loads = _loads(c)
    for t in range(14):
        if t == 2:      # once it has been picked more often than the others (the first ties go by recency)
            loads.clear()
            hits = h.stats()["expert_cache.hits"]
        _run(m, ref, [[[0, 1 + t % 7]], [[(3 * t) % 8, (3 * t) % 8]]])
    assert (g0.name, 0) not in [ld[:2] for ld in loads] and len(loads) >= 12
    assert (id(g0), 0) in c.where and c.score[(id(g0), 0)] > 2
    assert h.stats()["expert_cache.hits"] - hits >= 12
    h.unwrap()


class Router(torch.nn.Module):
    """A router as transformers' are (top_k, a weight of a row per expert) that picks each of
    ``seq`` in turn, a call each."""

    def __init__(self, seq):
        super().__init__()
        self.top_k, self.num_experts = len(seq[0]), 8
        self.weight = torch.nn.Parameter(torch.zeros(8, H), requires_grad=False)
        self.seq, self.calls = seq, 0

    def forward(self, hidden_states):
        idx = torch.tensor([self.seq[self.calls % len(self.seq)]] * hidden_states.shape[0])
        self.calls += 1
        return hidden_states @ self.weight.t(), torch.ones(idx.shape), idx


def test_the_guess_that_is_right_more_often_is_brought_ahead(tier, fake):
    """Layer 1 routes to 5 and 6, then to 3 and 4, in turn: its last choices are always wrong,
    its router's guess on layer 0's hidden state always right. After a few tokens the cache
    brings the router's guess ahead, and every pick of layer 1 is found there."""
    m, ref, h = _toy(tier, slots=4)
    c = h._cache
    g1 = next(g for g in h._groups.values() if g.tensors[0] is m.experts[1].w)
    c.routers[id(g1)] = Router([[3, 4], [5, 6]])    # first called at the second token (layer 0 has no next before)
    routes = [[[[1, 2]], [[5, 6]]], [[[1, 2]], [[3, 4]]]]
    for t in range(6):
        _run(m, ref, routes[0])
        _run(m, ref, routes[1])
    assert c.right[id(g1)]["router"] > 0.5 > c.right[id(g1)]["last"]
    before = h.stats()
    _run(m, ref, routes[0])
    _run(m, ref, routes[1])
    s = h.stats()
    assert s["expert_cache.prefetch_hits"] - before["expert_cache.prefetch_hits"] == 4
    assert s["expert_cache.misses"] == before["expert_cache.misses"]
    assert s["expert_cache.predicted"] - before["expert_cache.predicted"] == 2
    h.unwrap()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 30), unique=True, max_size=8), st.data())
def test_a_new_expert_is_placed_in_number_order_by_moves_that_lose_nothing(taken, data):
    """NOTE [experts in number order]: a group's experts at rising ``slots`` (numbered 0, 10, 20,
    ... in that order), a new one whose number puts it ``below`` of them, slot ``v`` given up:
    after the moves, run in their order over a map of slot -> expert, every expert is still
    there, the new one takes a slot no expert holds, and the slots rise with the numbers; a
    move only where ``v`` lies outside its place."""
    slots = sorted(taken)
    v = data.draw(st.integers(0, 31).filter(lambda x: x not in slots))
    below = data.draw(st.integers(0, len(slots)))
    held = {c: 10 * i for i, c in enumerate(slots)}
    moves, at = placement(slots, below, v)
    for a, b in moves:
        assert a in held and b not in held          # each expert is copied out before its slot is written
        held[b] = held.pop(a)
    assert at not in held
    held[at] = 10 * below - 5
    order = [held[c] for c in sorted(held)]
    assert order == sorted(order) and len(held) == len(slots) + 1
    inside = (below == 0 or slots[below - 1] < v) and (below == len(slots) or v < slots[below])
    assert (moves == [] and at == v) == inside
    assert placement([3, 1], 1, 2) == ([], 2)          # slots that do not rise: no order to keep


def test_a_groups_cached_experts_keep_their_slots_in_number_order(tier, fake):
    """Three picks a token, so the toy's calls keep the order (it has no known implementation):
    each call is one round, since after every call each group's cached experts' slots rise with
    their numbers; the moves that keep them so are copies from slot to slot in the cache,
    counted, and lose nothing (every output equals the uncached one); expert 0 of layer 0,
    routed every time, is never brought in again (NOTE [experts in number order])."""
    m, ref, h = _toy(tier, slots=4)
    c = h._cache
    g0 = next(g for g in h._groups.values() if g.tensors[0] is m.experts[0].w)
    loads = _loads(c)
    lo, hi = c.block.ptr, c.block.ptr + c.nbytes
    rng = random.Random(0)
    for t in range(30):
        if t == 2:
            loads.clear()
            copies = len([x for x in fake.calls if x[0] == "copy" and lo <= x[1] < hi and lo <= x[2] < hi])
            start = h.stats()
        _run(m, ref, [[[0, *rng.sample(range(1, 8), 2)]], [rng.sample(range(8), 3)]])
        for gid in {gid for gid, _ in c.where}:
            mine = sorted((e, s) for (i, e), s in c.where.items() if i == gid)
            assert [s for _, s in mine] == sorted(s for _, s in mine), mine
    s = h.stats()
    assert s["expert_cache.rounds"] == s["expert_cache.calls"] == 60
    moves = s["expert_cache.slot_moves"] - start["expert_cache.slot_moves"]
    assert moves > 0 and s["expert_cache.evictions"] > start["expert_cache.evictions"]
    assert len([x for x in fake.calls if x[0] == "copy" and lo <= x[1] < hi and lo <= x[2] < hi]) - copies == moves
    assert (g0.name, 0) not in [ld[:2] for ld in loads] and (id(g0), 0) in c.where
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
        want = plain.generate(ids, max_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True)
        got = m.generate(ids, max_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    if stream_dtype is None:       # NOTE [cached experts sum alike]: every step's logits, to the bit
        assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    s = h.stats()
    assert s["expert_cache.calls"] > 0 and s["expert_cache.hits"] + s["expert_cache.misses"] > 0
    assert s["expert_cache.evictions"] > 0
    h.unwrap()
    h0.unwrap()
    t0.close()


@pytest.mark.parametrize(("impl", "skewed"), [(None, True), ("eager", True), ("eager", False)])
def test_a_long_greedy_decode_computes_the_same_logits_in_one_round_a_call(tier, fake, monkeypatch, impl, skewed):
    """offload_infer's mixture of experts shrunk (many small experts, top-4, a shared expert, fp16,
    the router skewed as the bench skews it or as its random weights route, the experts
    implementation transformers picks, or the eager loop), 40 greedy tokens through a cache that
    must evict: every step's logits equal the uncached path's to the bit (NOTE [cached experts
    sum alike]). The eager loop's differed at every step (the prompt's forward goes through the
    cache too here) before its rounds kept the order of a token's experts; and since a group's
    cached experts sit in slots in the order of their numbers (NOTE [experts in number order]),
    each decode step's call is one round, where it took 3.3 on average before, the slots'
    moves counted."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(planning, "EXPERT_CALL_COST", 0)
    m = tiny_qwen2_moe(transformers, impl)
    sk = skew_router(m, hot=8, bias=2.0) if skewed else None
    ids = torch.randint(0, 256, (1, 16))
    own = [(t, t.data) for t in m.parameters()]
    steps = collections.Counter()

    def decode(**kw):
        t = tiermem.Tier(backend=type(fake)(total=1 << 30))
        h = t.wrap_module(m, max_group_bytes=32 << 10, **kw)
        c = h._cache
        if c is not None:          # the decode steps' calls (of one token) and their rounds
            run = c.run

            def counted(g, module, own, hidden_states, *a):
                before = c.stats["rounds"]
                out = run(g, module, own, hidden_states, *a)
                if hidden_states.reshape(-1, hidden_states.shape[-1]).shape[0] == 1:
                    steps.update(calls=1, rounds=c.stats["rounds"] - before)
                return out
            c.run = counted
        try:
            with torch.no_grad():
                out = m.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            return out, h.stats()
        finally:
            h.unwrap()
            t.close()
            for p, d in own:
                p.data = d
    one = 3 * H * 48 * 2                      # an expert's gate_up and down, fp16
    want, _ = decode(budget=share(m, 28))
    got, s = decode(budget=share(m, 28) + 9 * one, expert_cache=9 * one)      # 8 slots and the zero slot
    if sk is not None:
        sk.remove()
    assert s["expert_cache.slots"] == 8 and s["expert_cache.calls"] > 100 and steps["calls"] > 100
    assert s["expert_cache.evictions"] > 0 and s["expert_cache.hits"] > 0 and s["expert_cache.rounds"] > 0
    assert torch.equal(got.sequences, want.sequences)
    differ = [i for i, (a, b) in enumerate(zip(got.logits, want.logits)) if not torch.equal(a, b)]
    assert differ == []
    assert steps["rounds"] == steps["calls"], steps          # one round a decode step's call
    if impl == "eager":
        assert s["expert_cache.slot_moves"] > 0               # its experts were moved to keep the order


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


def _moe_of(moe: int, shared: int):
    """A small fp32 Qwen2-MoE (hidden 256, 4 layers, top-4 of 12 experts of ``moe``, a shared
    expert of ``shared``) that generates to its length."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2MoeConfig(hidden_size=256, intermediate_size=256, moe_intermediate_size=moe,
                                      shared_expert_intermediate_size=shared, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=256, num_experts=12,
                                      num_experts_per_tok=4, decoder_sparse_step=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    m.generation_config.pad_token_id, m.generation_config.eos_token_id = 0, None
    return m


def test_a_cache_that_takes_budget_from_groups_every_step_reads_is_called_out(tier, caplog):
    """NOTE [expert cache budget] in tiermem/inference/module.py: a small Qwen2-MoE (4 layers,
    top-4 of 12 experts of 384 KB, shared experts of 12 MB). At 70% of its weights a cache of
    three quarters of the budget makes a step stream more bytes of the groups every step reads
    than the 16 experts it routes to, and the wrap says so; at 30% a cache of four experts costs
    a step less than that, and nothing is said."""
    m = _moe_of(moe=128, shared=4096)
    total = sum(p.numel() * p.element_size() for p in m.parameters())
    one = sum(p.numel() * p.element_size() for p in m.model.layers[0].mlp.experts.parameters()) // 12
    kw = {"max_group_bytes": 1 << 20}
    for share_, cache_of, said in ((0.7, lambda b: b * 3 // 4, True), (0.3, lambda b: 4 * one, False)):
        budget = int(total * share_)
        h = tier.wrap_module(m, budget=budget, **kw)
        experts = {g for g, _ in h.plan.sizes if g.endswith("mlp.experts")}
        without = h.plan.moved_bytes_but(experts)   # the groups every step reads that stream, no cache
        h.unwrap()
        caplog.clear()
        with caplog.at_level("WARNING", logger="tiermem"):
            h = tier.wrap_module(m, budget=budget, expert_cache=cache_of(budget), **kw)
            assert h._cache is not None
            extra = h.plan.moved_bytes_but(experts) - without
            h.unwrap()
        assert (extra > 16 * one) == said, (share_, extra, 16 * one)
        assert ("every decode step reads" in caplog.text) == said, (share_, caplog.text)


def test_an_auto_cache_takes_only_budget_the_groups_every_step_reads_do_not_need(tier, caplog):
    """expert_cache='auto' (NOTE [expert cache budget]): a small Qwen2-MoE whose expert layers
    (12 experts of 1.5 MB) are larger than a third of its budget gets a cache that makes no group
    every decode step reads stream more than without one, and greedy tokens equal the plain
    model's; where everything is resident, no cache."""
    m = _moe_of(moe=512, shared=2048)
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = m.generate(ids, max_new_tokens=8, do_sample=False)
    total = sum(p.numel() * p.element_size() for p in m.parameters())
    kw = {"max_group_bytes": 1 << 20}
    budget = int(total * 0.35)
    h = tier.wrap_module(m, budget=budget, **kw)
    experts = {g for g, _ in h.plan.sizes if g.endswith("mlp.experts")}
    without = h.plan.moved_bytes_but(experts)
    h.unwrap()
    with caplog.at_level("INFO", logger="tiermem"):
        h = tier.wrap_module(m, budget=budget, expert_cache="auto", **kw)
    assert "expert_cache='auto' is" in caplog.text and "every decode step reads" not in caplog.text
    assert h._cache is not None and h._cache.nslots >= 2 and h.plan.moved_bytes_but(experts) <= without
    with torch.no_grad():
        assert torch.equal(m.generate(ids, max_new_tokens=8, do_sample=False), want)
    assert h.stats()["expert_cache.calls"] > 0
    h.unwrap()
    h = tier.wrap_module(m, budget=total * 2, expert_cache="auto", **kw)     # everything resident: no cache
    assert h._cache is None and not h.plan.moved_bytes
    h.unwrap()
    with pytest.raises(tiermem.ConfigError, match="expert_cache"):
        tier.wrap_module(m, budget=budget, expert_cache="most")
