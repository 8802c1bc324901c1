"""A module across several GPUs (NOTE [layers across GPUs] in tiermem/inference/multidevice.py) and
replicas sharing one pinned home (NOTE [one home for replicas] in tiermem/inference/transport.py),
on the CPU over two fake backends standing for two devices: the cut, the parts' plans, budgets
and homes, the hooks, generate with a KV cache, and unwrap are the real ones; on the fakes every
"device" is host memory, so nothing crosses between them here (tests/test_gpu_multigpu.py runs
two GPUs)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from fakes import FakeBackend

import tiermem
from tiermem.inference.multidevice import SplitModule, split_runs

MiB = 1 << 20


def two_tiers(foreign: bool = False):
    """Two fakes standing for devices 0 and 1; ``foreign``: each views and copies memory the
    other allocated, as two GPUs of one process read the same portable pinned memory."""
    fakes = [FakeBackend(total=1 << 30, foreign_host=foreign), FakeBackend(total=1 << 30, foreign_host=foreign)]
    fakes[1].device = 1
    return fakes, [tiermem.Tier(backend=f) for f in fakes]


def gpt():
    from tiermem.testing import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=512, seq=64, d=128, layers=6, heads=4)).eval()


def weight_bytes(m) -> int:
    return sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))


def test_runs_are_contiguous_and_of_about_equal_bytes():
    assert split_runs([("a", 10), ("b", 10), ("c", 10), ("d", 10)], 2) == [["a", "b"], ["c", "d"]]
    assert split_runs([("emb", 40), *[(f"l{i}", 10) for i in range(8)], ("head", 40)], 2) == [
        ["emb", "l0", "l1", "l2", "l3"], ["l4", "l5", "l6", "l7", "head"]]
    assert split_runs([("a", 1), ("b", 100), ("c", 1), ("d", 1)], 3) == [["a"], ["b"], ["c", "d"]]
    with pytest.raises(tiermem.ConfigError, match="2 groups"):
        split_runs([("a", 1), ("b", 1)], 3)


def test_layers_over_two_devices_give_the_plain_outputs():
    fakes, tiers = two_tiers()
    m = gpt()
    ref = copy.deepcopy(m)
    budget = weight_bytes(m) // 6           # per device: each streams most of its half
    h = tiermem.wrap_module(m, budget, devices=[0, 1], tiers=tiers, max_group_bytes=256 << 10)
    assert isinstance(h, SplitModule) and h.devices == [0, 1]
    names = [n for p in h.parts for n in p._groups]
    assert [h.run_of[n] for n in names] == sorted(h.run_of[n] for n in names)      # contiguous
    assert h.run_of["wte"] == 0 and h.run_of["head"] == 1
    assert all(p.plan.streamed_bytes > 0 for p in h.parts)
    ids = torch.randint(0, 512, (2, 64))
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(m(ids), ref(ids))
    for p, t, f in zip(h.parts, tiers, fakes):
        assert t.stats()["resident_bytes.all.peak"] <= p.budget
        assert t.stats()["moved_bytes.all.h2d"] > 0                # each device streams its own
        # its home holds its own run's streamed groups, nothing of the other's
        assert f.peak_live["pinned"] >= p.stats()["pinned_bytes.home"] > 0
    homes = sum(p.stats()["pinned_bytes.home"] for p in h.parts)
    assert homes <= 1.05 * weight_bytes(m)                          # one copy of the weights in all
    assert h.stats()["pinned_bytes.home"] == homes
    with pytest.raises(tiermem.errors.WrapError, match="already adopted"):
        tiermem.wrap_module(m, budget, tier=tiers[0])
    h.unwrap()
    assert getattr(m, "_tiermem_handle", None) is None
    assert all(f.live()["pinned"] == 0 and f.live()["managed"] == 0 for f in fakes)
    with torch.no_grad():
        assert torch.equal(m(ids), ref(ids))


def test_groups_are_cut_for_the_per_gpu_budget_by_default():
    """With max_group_bytes left out, a budget too small to stream the module's groups whole cuts
    them finer (groups.fit_groups) before they are spread, so a small model still spreads and
    each part finds its run's groups whole: together they hold every tensor once."""
    _, tiers = two_tiers()
    m = gpt()
    ref = copy.deepcopy(m)
    budget = weight_bytes(m) // 6
    h = tiermem.wrap_module(m, budget, devices=[0, 1], tiers=tiers)
    held = [id(t) for p in h.parts for g in p._groups.values() for t in g.tensors]
    assert len(held) == len(set(held)) == len({id(t) for t in list(m.parameters()) + list(m.buffers())})
    assert all(len(p._groups) > 1 and p.plan.streamed_bytes > 0 for p in h.parts)
    ids = torch.randint(0, 512, (2, 64))
    with torch.no_grad():
        assert torch.equal(m(ids), ref(ids))
    h.unwrap()


def test_generate_with_a_kv_cache_over_two_devices():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    ref = copy.deepcopy(m)
    _, tiers = two_tiers()
    h = tiermem.wrap_module(m, weight_bytes(m) // 8, devices=[0, 1], tiers=tiers, max_group_bytes=64 << 10)
    assert {h.run_of[n] for n in h.run_of if n.startswith("model.layers.")} == {0, 1}
    ids = torch.randint(0, 256, (1, 12))
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = ref.generate(ids, **kw)
        got = m.generate(ids, **kw)
    assert torch.equal(got, want)
    h.unwrap()


def test_a_tied_head_computes_where_its_weight_is_and_other_ties_are_refused():
    """A head with nothing of its own, tied to the embedding, computes on the first device (the
    hidden state crosses back for it); a head with a bias of its own on the second device,
    whose weight is the first's, is refused before anything changes."""
    _, tiers = two_tiers()

    def model(bias: bool):
        torch.manual_seed(0)
        emb, head = nn.Embedding(512, 64), nn.Linear(64, 512, bias=bias)
        head.weight = emb.weight
        return nn.Sequential(emb, *[nn.Linear(64, 64) for _ in range(4)], head)
    m = model(False)
    ref = copy.deepcopy(m)
    h = tiermem.wrap_module(m, 1 << 16, devices=[0, 1], tiers=tiers, max_group_bytes=1 << 14)
    assert h.run_of["0"] == 0 and h.run_of["4"] == 1
    ids = torch.randint(0, 512, (3, 7))
    with torch.no_grad():
        assert torch.equal(m(ids), ref(ids))
    h.unwrap()
    m = model(True)
    with pytest.raises(tiermem.ConfigError, match="tied"):
        tiermem.wrap_module(m, 1 << 16, devices=[0, 1], tiers=tiers, max_group_bytes=1 << 14)
    assert getattr(m, "_tiermem_handle", None) is None and all(t.stats()["allocated_bytes.all.current"] == 0
                                                               for t in tiers)
    for bad in ([0], [1, 1], "01", [0, -1]):
        with pytest.raises((tiermem.ConfigError, TypeError)):
            tiermem.wrap_module(m, 1 << 16, devices=bad)
    with pytest.raises(tiermem.ConfigError, match="disagree"):
        tiermem.wrap_module(m, 1 << 16, devices=[1, 0], tiers=tiers)


def test_replicas_on_two_devices_share_one_home():
    fakes, tiers = two_tiers(foreign=True)
    a = gpt()
    b, c, ref = copy.deepcopy(a), copy.deepcopy(a), copy.deepcopy(a)
    budget = weight_bytes(a) // 3
    ha = tiers[0].wrap_module(a, budget, max_group_bytes=256 << 10)
    with pytest.raises(tiermem.ConfigError, match="other groups"):
        tiers[1].wrap_module(c, budget // 2, max_group_bytes=256 << 10, share_home=ha)
    assert fakes[1].live()["pinned"] == 0
    hb = tiers[1].wrap_module(b, budget, max_group_bytes=256 << 10, share_home=ha)
    sa, sb = ha.stats(), hb.stats()
    assert sa["pinned_bytes.home"] > 0 and sb["pinned_bytes.home"] == 0
    assert sb["pinned_bytes.home_shared"] == sa["pinned_bytes.home"]
    assert fakes[1].live()["pinned"] == 0                           # the second device pinned nothing
    streamed = [g for g in hb._groups.values() if not g.pinned]
    assert streamed and all(ha._stream.home.ptr <= t.data_ptr() < ha._stream.home.ptr + ha._stream.size
                            for g in streamed for t in g.tensors)
    ids = torch.randint(0, 512, (2, 64))
    with torch.no_grad():
        want = ref(ids)
        for _ in range(2):
            assert torch.equal(a(ids), want) and torch.equal(b(ids), want)
    ha.unwrap()                                   # the other replica still reads the home
    assert fakes[0].live()["pinned"] > 0
    with torch.no_grad():
        assert torch.equal(b(ids), want)
    hb.unwrap()
    assert fakes[0].live()["pinned"] == 0
    with torch.no_grad():
        assert torch.equal(a(ids), want) and torch.equal(b(ids), want)


def test_each_part_also_streams_over_the_next_devices_link():
    """NOTE [two links into one GPU]: with the relay (the default, where the devices reach each
    other's memory) half of each streamed piece crosses the other device's link, into its
    staging ring and on into the part's slot, on that device's own two streams; the outputs are
    the plain model's, each device's peak stays within the budget the caller gave, the relays
    carry about half the bytes streamed, and unwrap gives their rings back. Without peer
    access, or with relay=False, nothing is relayed."""
    fakes, tiers = two_tiers(foreign=True)
    m = gpt()
    ref = copy.deepcopy(m)
    budget = weight_bytes(m) // 6
    h = tiermem.wrap_module(m, budget, devices=[0, 1], tiers=tiers, max_group_bytes=256 << 10)
    assert [c for c in fakes[1].calls if c[0] == "enable_peer"] == [("enable_peer", 0)]
    assert [c for c in fakes[0].calls if c[0] == "enable_peer"] == [("enable_peer", 1)]
    assert all(p.budget == budget - 2 * (budget // 32 // 4096 * 4096) for p in h.parts)
    ids = torch.randint(0, 512, (2, 64))
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(m(ids), ref(ids))
    streamed = sum(t.stats()["moved_bytes.all.h2d"] for t in tiers)
    assert 0.4 * streamed <= h.stats()["relayed_bytes"] <= 0.6 * streamed
    for i, (t, f) in enumerate(zip(tiers, fakes)):
        assert t.stats()["resident_bytes.all.peak"] <= budget
        # the ring's own lease beside its part's, so a part that fills its budget leaves it room
        assert sorted(x.nbytes for x in t.leases) == sorted([h.parts[i].budget, budget - h.parts[i].budget])
        relay_in, relay_out = t.side_stream("relay-in"), t.side_stream("relay-out")
        # the other part's bytes land in this device's ring and go on from it, on its own streams
        ins = [c for c in f.calls if c[0] == "copy" and c[4] == relay_in]
        outs = [c for c in f.calls if c[0] == "copy" and c[4] == relay_out]
        assert ins and len(ins) == len(outs)
        assert all(f._foreign(c[1], c[3]) is not None for c in outs)      # into the other device's slot
    h.unwrap()
    assert all(f.live()["device"] == 0 for f in fakes) and not any(t.leases for t in tiers)
    with torch.no_grad():
        assert torch.equal(m(ids), ref(ids))

    for foreign, relay in ((False, True), (True, False)):
        fakes, tiers = two_tiers(foreign=foreign)
        m = gpt()
        h = tiermem.wrap_module(m, budget, devices=[0, 1], tiers=tiers, max_group_bytes=256 << 10, relay=relay)
        with torch.no_grad():
            m(ids)
        assert h.stats()["relayed_bytes"] == 0
        assert all(p.budget == budget for p in h.parts)              # no ring taken from it
        h.unwrap()


def test_the_relays_ring_does_not_cut_the_groups_finer():
    """NOTE [two links into one GPU]: the ring's bytes come out of a part's budget, but the groups
    are cut for the GPU's whole budget: at a budget just above a layer's cliff (groups.fit_cap)
    the relay keeps the groups relay=False has, where cutting for the part's budget made each
    layer several groups (the 0.85B Llama's 9 groups a part became 33)."""
    from tiermem.inference.groups import MAX_GROUP, fit_cap, module_groups
    from tiermem.inference.options import ModuleOptions
    la = ModuleOptions().lookahead

    def stack():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128)) for _ in range(16)]).eval()
    m0 = stack()
    found = module_groups(m0, MAX_GROUP)

    def count(b):
        return len(module_groups(m0, fit_cap(found, b, la) or MAX_GROUP))

    def ring(b):
        return 2 * (b // 32 // 4096 * 4096)
    budget = next(b for b in range(4096, 4 * weight_bytes(m0), 4096) if ring(b) and count(b) < count(b - ring(b)))   # the ring's cut crosses the cliff
    x = torch.randn(4, 128)
    names = {}
    for relay in (True, False):
        fakes, tiers = two_tiers(foreign=True)
        m = stack()
        ref = copy.deepcopy(m)
        h = tiermem.wrap_module(m, budget, devices=[0, 1], tiers=tiers, relay=relay)
        assert bool(h._relay_slot) == relay
        names[relay] = [sorted(p._groups) for p in h.parts]
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(m(x), ref(x))
        assert all(t.stats()["resident_bytes.all.peak"] <= budget for t in tiers)
        assert (h.stats()["relayed_bytes"] > 0) == relay
        h.unwrap()
    assert names[True] == names[False]
    assert sum(map(len, names[True])) == count(budget) < count(budget - ring(budget))


def test_no_run_boundary_falls_inside_a_layer():
    """A budget small enough to cut each block into several groups: the runs still end at
    whole blocks (an element of the model's ModuleList), whose forward adds its residual on
    the device it began on, and the outputs are the plain model's."""
    from tiermem.inference.multidevice import split_units, unit_of
    m = gpt()
    assert unit_of(m, "blocks.2.attn") == "blocks.2" and unit_of(m, "wte") == "wte"
    sizes = [("wte", 10), ("blocks.0.attn", 10), ("blocks.0.mlp", 10), ("blocks.1.attn", 10), ("blocks.1.mlp", 10),
             ("head", 1)]
    units = {n: unit_of(m, n) for n, _ in sizes}
    assert split_units(sizes, units, 2) == [["wte", "blocks.0.attn", "blocks.0.mlp"],
                                            ["blocks.1.attn", "blocks.1.mlp", "head"]]
    ref = copy.deepcopy(m)
    _, tiers = two_tiers()
    h = tiermem.wrap_module(m, weight_bytes(m) // 6, devices=[0, 1], tiers=tiers, max_group_bytes=32 << 10)
    inner = [n for n in h.run_of if n.count(".") >= 2]
    assert inner                                                  # the blocks were cut into groups
    for name in inner:
        u = unit_of(m, name)
        assert len({h.run_of[g] for g in h.run_of if unit_of(m, g) == u}) == 1
    # each cut block moves its own inputs too: its forward keeps the residual it was given
    assert all(len(m.get_submodule(unit_of(m, n))._forward_pre_hooks) == 1 for n in inner)
    ids = torch.randint(0, 512, (2, 64))
    with torch.no_grad():
        assert torch.equal(m(ids), ref(ids))
    h.unwrap()
    assert all(not b._forward_pre_hooks for b in m.blocks)



def test_no_relay_where_every_streamed_group_is_packed():
    """Packed (quantized) groups cross their own link through the staging buffers, which the
    relay does not serve: a stack of Linears streamed as int8 declines its relays, and no ring
    or lease of one stays."""
    fakes, tiers = two_tiers(foreign=True)
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)]).eval()
    ref = copy.deepcopy(m)
    h = tiermem.wrap_module(m, weight_bytes(m) // 6, devices=[0, 1], tiers=tiers, max_group_bytes=1100 << 10,
                            stream_dtype="int8")
    assert h._relay_slot and [c for c in fakes[1].calls if c[0] == "enable_peer"]      # a relay was on offer
    assert all(p.plan.streamed_bytes > 0 for p in h.parts)
    x = torch.randn(4, 512)
    with torch.no_grad():
        assert torch.allclose(m(x), ref(x), atol=0.1)
    assert h.stats()["relayed_bytes"] == 0 and not any("relay" in x.owner for t in tiers for x in t.leases)
    h.unwrap()
