"""Module adoption on a CPU: the residency plan, grouping, and the streaming controller over the
fake backend (the controller's hooks, window and modes are the real ones)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from helpers import share

import tiermem
from tiermem.inference.groups import module_groups
from tiermem.planning import plan_residency

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


def test_streamed_module_is_bitwise_equal_and_within_budget(tier, fake):
    m = _model()
    ref = copy.deepcopy(m)
    h = tier.wrap_module(m, budget=share(m, 40), max_group_bytes=1 * MiB, mode="stream")
    assert h.transport == "pinned"
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


class _Experts(nn.Module):
    def __init__(self, e: int = 8, h: int = 64):
        super().__init__()
        self.w = nn.Parameter(torch.randn(e, h, h) / h ** 0.5)

    def forward(self, x, idx):
        return sum(x @ self.w[i] for i in idx.tolist())


class _MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.experts = nn.ModuleList(_Experts() for _ in range(4))

    def forward(self, x, idx):
        for lin, ex in zip(self.lins, self.experts):
            x = ex(lin(x), idx)
        return x


def test_few_token_forwards_stream_dense_groups_and_read_stacked_experts_in_place(tier, fake):
    torch.manual_seed(0)
    m = _MoE().requires_grad_(False)
    ref = copy.deepcopy(m)
    h = tier.wrap_module(m, budget=share(m, 30), max_group_bytes=64 << 10, zero_copy_max_tokens=2)
    experts = [g for g in h._groups.values() if g.stacked]
    assert len(experts) == 4 and not any(g.stacked for g in h._groups.values() if g.name.startswith("lins"))
    assert all(not g.pinned for g in experts)
    x, idx = torch.randn(1, 64), torch.tensor([1, 5])
    assert torch.equal(m(x, idx), ref(x, idx))                  # learns the order
    h.drain()
    dense = sum(g.nbytes for g in h._groups.values() if not g.pinned and not g.stacked)
    before = tier.stats()["moved_bytes.all.h2d"]
    assert torch.equal(m(x, idx), ref(x, idx)) and h._fwd_mode == "decode"
    moved = tier.stats()["moved_bytes.all.h2d"] - before
    assert 0 < moved <= dense                                    # the dense groups; no expert was copied
    assert all(fake.pointer_kind(t.data_ptr()) == "host" for g in experts for t in g.tensors)
    big, many = torch.randn(8, 64), torch.arange(8)
    before = tier.stats()["moved_bytes.all.h2d"]
    assert torch.equal(m(big, many), ref(big, many)) and h._fwd_mode == "stream"
    assert tier.stats()["moved_bytes.all.h2d"] - before >= sum(g.nbytes for g in experts)   # a prefill streams them
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


def test_a_budget_of_zero_reads_everything_in_place(tier):
    m = _model()
    ref = copy.deepcopy(m)
    with pytest.raises(tiermem.errors.ConfigError, match="pass mode='zero_copy' if that is meant"):
        tier.wrap_module(m, budget=0)        # most likely a share that rounded down: said, not assumed
    h = tier.wrap_module(m, budget=0, mode="zero_copy")
    assert h.plan.zero_copy_only and h.plan.pinned == frozenset()
    x = torch.randn(8, 256)
    assert torch.equal(m(x), ref(x)) and h._fwd_mode == "zero_copy"
    assert tier.stats()["resident_bytes.all.peak"] == 0 and tier.stats()["moved_bytes.all.h2d"] == 0
    h.unwrap()


class _LM(nn.Module):
    def __init__(self, vocab: int = 16384, h: int = 128, tied: bool = False):
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)) for _ in range(4)])
        self.head = nn.Linear(h, vocab if tied else 1024, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.layers(self.emb(ids)))


def test_an_embedding_is_read_in_place_and_never_takes_a_slot(tier, fake):
    torch.manual_seed(0)
    m = _LM()
    ref = copy.deepcopy(m)
    h = tier.wrap_module(m, budget=share(m, 30), max_group_bytes=1 * MiB, mode="stream")
    assert h.plan.in_place == {"emb"} and "emb" not in h.plan.pinned
    assert h.plan.moved_bytes == h.plan.streamed_bytes - dict(h.plan.sizes)["emb"]
    assert h._stream.slot_bytes < dict(h.plan.sizes)["emb"]        # the window is sized without it
    ids = torch.randint(0, 16384, (2, 32))
    with torch.no_grad():
        m(ids)
        before = tier.stats()["moved_bytes.all.h2d"]
        assert torch.equal(m(ids), ref(ids))
    assert tier.stats()["moved_bytes.all.h2d"] - before == h.plan.moved_bytes
    h.unwrap()
    # Tied to the head, the table is read whole by the head: it is planned as the head's (it
    # streams, or is cut by rows: tests/test_split.py), and the lookup reads its rows in place.
    tied = _LM(tied=True)
    h = tier.wrap_module(tied, budget=share(tied, 30), max_group_bytes=1 * MiB, mode="stream")
    assert h.plan.in_place == frozenset() and h._groups["emb"].cut.gathers == (tied.emb,)
    h.unwrap()


def test_in_place_groups_are_pinned_last_with_what_the_budget_leaves():
    sizes = [("emb", 100), ("l0", 20), ("l1", 20), ("head", 100)]
    p = plan_residency(sizes, 160, lookahead=2, in_place={"emb"})
    assert "head" in p.pinned and "emb" not in p.pinned and p.moved_bytes == 40 - sum(
        n for g, n in sizes if g in p.pinned and g.startswith("l"))
    assert plan_residency(sizes, 240, lookahead=2, in_place={"emb"}).pinned == {"emb", "l0", "l1", "head"}


def test_a_held_module_refuses_copies_until_unwrap(tier, fake):
    """NOTE [held modules]: copy.deepcopy or pickling of a module wrap_module holds would carry
    the handle's hooks and the streamed weights' memory: refused, saying what to do; after
    unwrap() it copies and pickles as any module, with its values."""
    import pickle
    m = _model()
    h = tier.wrap_module(m, budget=share(m, 40), max_group_bytes=1 * MiB, mode="stream")
    for copier in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(tiermem.errors.WrapError, match="before wrapping or after unwrap"):
            copier(m)
    sd = {k: v.clone() for k, v in m.state_dict().items()}     # what to use instead
    x = torch.randn(8, 256)
    y = m(x)
    h.unwrap()
    twin = pickle.loads(pickle.dumps(copy.deepcopy(m)))
    assert torch.equal(twin(x), y)
    assert all(torch.equal(v, twin.state_dict()[k]) for k, v in sd.items())
