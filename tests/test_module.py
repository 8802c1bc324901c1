"""Module adoption on a CPU: the residency plan, grouping, and the streaming controller over the
fake backend (the controller's hooks, window and modes are the real ones)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import tiermem
from tiermem import plan_residency
from tiermem._module import module_groups

MiB = 1 << 20


def test_everything_fits():
    p = plan_residency([("a", 10), ("b", 20)], 30)
    assert p.pinned == {"a", "b"} and p.window == 0 and p.streamed_bytes == 0 and not p.zero_copy_only


def test_largest_groups_are_pinned_and_the_window_holds_the_largest_streamed():
    sizes = [("emb", 100), ("l0", 40), ("l1", 40), ("l2", 40), ("l3", 40), ("head", 100)]
    p = plan_residency(sizes, 300, lookahead=2)
    # Pinning l0 too would need 240 + a window of 80 > 300.
    assert p.pinned == {"emb", "head"} and p.window == 80
    assert p.pinned_bytes + p.window <= 300 and p.streamed_bytes == 160
    assert p.predicted_seconds(1e-9) == pytest.approx(160)
    assert plan_residency(sizes, 320, lookahead=2).pinned_bytes == 240   # one 40-byte layer more


def test_budget_below_one_group_reads_in_place():
    p = plan_residency([("a", 100), ("b", 100)], 50)
    assert p.zero_copy_only and p.pinned == frozenset() and p.window == 0


def test_fewer_slots_when_the_window_does_not_fit():
    sizes = [("emb", 67), *[(f"l{i}", 27) for i in range(8)], ("head", 67)]
    p = plan_residency(sizes, 150, lookahead=3)
    assert not p.zero_copy_only and p.lookahead < 3 and p.pinned_bytes + p.window <= 150
    assert plan_residency(sizes, 1000, lookahead=3).lookahead == 0       # everything resident


def test_lookahead_must_be_positive():
    with pytest.raises(tiermem.TierMemError):
        plan_residency([("a", 1)], 1, lookahead=0)


def test_groups_follow_subtrees_and_tied_weights_belong_to_the_first():
    emb = nn.Embedding(1000, 64)
    head = nn.Linear(64, 1000, bias=False)
    head.weight = emb.weight
    m = nn.Sequential(emb, nn.Sequential(nn.Linear(64, 64), nn.ReLU()), head)
    g = module_groups(m, max_group_bytes=1 << 30)
    assert [name for name, _, _ in g] == ["<root>"]
    g = module_groups(m, max_group_bytes=300_000)
    assert [name for name, _, _ in g] == ["0", "1"]          # the head owns nothing of its own
    assert [n for n, _ in g[0][2]] == ["0.weight"]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)) for _ in range(6)],
                         nn.LayerNorm(256)).requires_grad_(False)


@pytest.mark.parametrize("transport,async_evict", [("pinned", True), ("um", True), ("um", False)])
def test_streamed_module_is_bitwise_equal_and_within_budget(tier, fake, transport, async_evict):
    m = _model()
    ref = copy.deepcopy(m)
    h = tier.wrap_module(m, budget="40%", max_group_bytes=1 * MiB, mode="stream", transport=transport,
                         async_evict=async_evict)
    assert h.transport == transport
    assert 0 < len(h.plan.pinned) < len(h.plan.sizes)
    x = torch.randn(8, 256)
    for _ in range(4):
        assert torch.equal(m(x), ref(x))
        assert tier.resident_bytes <= h.budget
    h.drain()
    s = tier.stats()
    assert s["resident_bytes.all.peak"] <= h.budget
    assert s["ops.frozen_weight.evict_clean"] > 0 and s["moved_bytes.frozen_weight.d2h"] == 0
    streamed = sum(t.numel() * t.element_size() for g in h._groups.values() if not g.pinned for t in g.tensors)
    assert s["moved_bytes.frozen_weight.h2d"] >= 4 * streamed      # every streamed byte, every forward
    assert len(h._trace) == len(h._units)       # every unit ran once per forward, in order
    assert h._trace == sorted(h._trace)
    h.unwrap()
    assert torch.equal(m(x), ref(x)) and tiermem.tiered_of(m[0][0].weight) is None


@pytest.mark.parametrize("transport", ["pinned"])
def test_auto_mode_reads_single_token_forwards_in_place(tier, fake, transport):
    m = _model()
    ref = copy.deepcopy(m)
    h = tier.wrap_module(m, budget="40%", max_group_bytes=1 * MiB, zero_copy_max_tokens=1, transport=transport)
    big, one = torch.randn(8, 256), torch.randn(1, 256)
    assert torch.equal(m(big), ref(big)) and h._fwd_mode == "stream"
    h.drain()
    before = tier.stats()["moved_bytes.all.h2d"]
    assert torch.equal(m(one), ref(one)) and h._fwd_mode == "zero_copy"
    assert tier.stats()["moved_bytes.all.h2d"] == before        # nothing moved: read in place
    streamed = [g for g in h._groups.values() if not g.pinned]
    if transport == "um":
        tts = [t for g in streamed for t in g.tiered]
        assert all(not t.policy.read_mostly and not t.is_resident for t in tts)
    else:   # the tensors point at their pinned home
        assert all(fake.pointer_kind(t.data_ptr()) == "host" for g in streamed for t in g.tensors)
    assert torch.equal(m(big), ref(big)) and h._fwd_mode == "stream"
    if transport == "um":
        assert all(t.policy.read_mostly for g in streamed for t in g.tiered)
    h.unwrap()
    assert all(fake.pointer_kind(p.data_ptr()) == "unregistered" for p in m.parameters())


def test_adopting_twice_or_an_empty_module_is_refused(tier):
    m = _model()
    h = tier.wrap_module(m, budget=None)
    with pytest.raises(tiermem.TierMemError, match="already adopted"):
        tier.wrap_module(m)
    with pytest.raises(tiermem.TierMemError, match="no parameters"):
        tier.wrap_module(nn.ReLU())
    h.unwrap()


def test_um_transport_refuses_zero_copy(tier):
    with pytest.raises(tiermem.TierMemError, match="transport='pinned'"):
        tier.wrap_module(_model(), budget=0, transport="um")
    m = _model()
    h = tier.wrap_module(m, budget="40%", max_group_bytes=1 * MiB, transport="um")   # auto mode: always streams
    m(torch.randn(1, 256))
    assert h._fwd_mode == "stream"
    h.unwrap()


@pytest.mark.parametrize("transport", ["pinned"])
def test_a_budget_of_zero_reads_everything_in_place(tier, transport):
    m = _model()
    ref = copy.deepcopy(m)
    h = tier.wrap_module(m, budget=0, transport=transport)
    assert h.plan.zero_copy_only and h.plan.pinned == frozenset()
    x = torch.randn(8, 256)
    assert torch.equal(m(x), ref(x)) and h._fwd_mode == "zero_copy"
    assert tier.stats()["resident_bytes.all.peak"] == 0 and tier.stats()["moved_bytes.all.h2d"] == 0
    h.unwrap()
