"""The eviction paths (NOTE [eviction paths] in core/moves.py, NOTE [views and the fast paths] in
core/tensor.py): shadow copy, clean discard, read-mostly collapse and Unified Memory write-back.

The fake backend poisons a discarded range with 0xDB, so data that comes back equal after a
discard can only have come back from the shadow.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from fakes import POISON, FakeBackend
from helpers import MiB, calls, fill_random, read, role_stats
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from torch import nn

import tiermem
from tiermem import Location, OutOfBudgetError


def managed_bytes(fake, tt):
    """The raw bytes of ``tt``'s managed range, read behind tiermem's back."""
    base, arr = fake._find(tt.data_ptr)
    off = tt.data_ptr - base
    return arr[off:off + tt.nbytes].copy()


def moves(fake, start=0):
    """The data-moving and advising calls since ``start``, without allocations and stream waits."""
    return [c for c in fake.calls[start:] if c[0] not in ("allocate", "wait", "host_alloc")]


def linear_2mib():
    """A Linear whose weight is exactly 2 MiB (it owns its pages) and whose bias is small."""
    torch.manual_seed(0)
    return nn.Linear(1024, 512)


# -- the shadow paths -----------------------------------------------------------------------

def test_dirty_eviction_copies_to_the_shadow_and_round_trips(tier, fake):
    tt = tier.empty((512, 1024), "float32", role="activation")
    data = fill_random(tt)
    tr = tt.evict()
    assert tr.nbytes == 2 * MiB
    assert (tt.location, tt.in_shadow) == (Location.HOST, True)
    assert calls(fake, "discard") == [("discard", ((tt.data_ptr, 2 * MiB),), tr.stream)]
    assert (managed_bytes(fake, tt) == POISON).all()
    s = tier.stats()
    assert (s["moved_bytes.activation.d2h"], s["ops.activation.evict"], s["ops.activation.evict_um"],
            s["shadow_bytes.current"], tier.resident_bytes) == (2 * MiB, 1, 0, 2 * MiB, 0)
    tt.prefetch()
    assert (tt.location, tt.in_shadow, tier.resident_bytes) == (Location.DEVICE, False, 2 * MiB)
    assert torch.equal(read(tt), data)
    assert tier.stats()["moved_bytes.activation.h2d"] == 2 * MiB


@pytest.mark.parametrize("staging", ["off", "auto"])
def test_eviction_copies_each_buffer_before_one_discard(fake, staging):
    tier = tiermem.Tier(backend=fake, staging=staging)
    a = tier.empty(64 * MiB + 1, "uint8", role="gradient")     # its span is 66 MiB
    b = tier.empty(3 * MiB, "uint8", role="gradient")
    data = [fill_random(a), fill_random(b)]
    tier.evict([a, b])
    copies = calls(fake, "copy")
    if staging == "off":
        assert [fake.pointer_kind(c[1]) for c in copies] == ["host", "host"]
        assert sorted(c[2:4] for c in copies) == sorted([(a.data_ptr, 64 * MiB + 1), (b.data_ptr, 3 * MiB)])
    else:   # NOTE [staging ring]: managed -> ring slot -> shadow, a slot's worth at a time
        kinds = [(fake.pointer_kind(c[2]), fake.pointer_kind(c[1])) for c in copies]
        assert set(kinds) == {("managed", "device"), ("device", "host")}
        assert sum(c[3] for c in copies if fake.pointer_kind(c[1]) == "host") == 67 * MiB + 1
        assert max(c[3] for c in copies) == 32 * MiB
        assert tier.stats()["staged_bytes.gradient.d2h"] == 67 * MiB + 1
    # NOTE [discard fence]: every copy first, then a single discard call over both whole spans
    (disc,) = calls(fake, "discard")
    assert sorted(disc[1]) == sorted([(a.data_ptr, 66 * MiB), (b.data_ptr, 4 * MiB)])
    kinds = [c[0] for c in fake.calls if c[0] in ("copy", "discard")]
    assert kinds == ["copy"] * len(copies) + ["discard"]
    tier.prefetch([a, b])
    assert torch.equal(read(a), data[0]) and torch.equal(read(b), data[1])


@pytest.mark.parametrize("role, changes", [("input", {"read_mostly": False}), ("activation", {"read_only": True})])
def test_read_only_buffer_evicted_again_moves_nothing(tier, fake, role, changes):
    tt = tier.empty(2 * MiB, "uint8", role=role, **changes)
    data = fill_random(tt)
    tt.prefetch()
    tt.evict()                       # the first eviction copies: the shadow becomes valid
    tt.prefetch()
    before = role_stats(tier.stats(), role)
    n = len(fake.calls)
    tr = tt.evict()                  # nothing changed it since: discard only
    assert tr.nbytes == 0
    assert moves(fake, n) == [("discard", ((tt.data_ptr, 2 * MiB),), tr.stream)]
    after = role_stats(tier.stats(), role)
    assert after == {**before, "ops.evict": before["ops.evict"] + 1, "ops.evict_clean": before["ops.evict_clean"] + 1,
                     "resident_bytes.current": 0}
    tt.prefetch()
    assert torch.equal(read(tt), data)


def test_writable_buffer_evicted_again_copies_again(tier, fake):
    tt = tier.empty(2 * MiB, "uint8", role="weight")
    fill_random(tt)
    tt.evict()
    tt.prefetch()
    data = fill_random(tt)           # the device may write it: the shadow is stale now
    tr = tt.evict()
    assert tr.nbytes == 2 * MiB
    s = tier.stats()
    assert (s["moved_bytes.weight.d2h"], s["ops.weight.evict_clean"], len(calls(fake, "host_alloc"))) == (4 * MiB, 0, 1)
    tt.prefetch()
    assert torch.equal(read(tt), data)


def test_only_writable_views_make_a_read_only_buffer_dirty(tier):
    tt = tier.empty(2 * MiB, "uint8", role="input")
    data = fill_random(tt)
    tt.prefetch()
    tt.evict()
    tt.prefetch()
    assert torch.equal(tt.torch(writable=False), data)
    assert tt.evict().nbytes == 0        # a read-only view keeps the shadow valid
    tt.prefetch()
    data = fill_random(tt)              # a writable view: the shadow can no longer be trusted
    assert tt.evict().nbytes == 2 * MiB
    tt.prefetch()
    assert torch.equal(read(tt), data)


def test_dropping_read_only_invalidates_the_shadow(tier):
    x = torch.randint(0, 256, (2 * MiB,), dtype=torch.uint8)
    tt = tier.wrap(x, role="input")
    tt.prefetch()
    tt.evict()                          # copy: the shadow becomes valid
    tt.prefetch()
    tt.advise(read_only=False)          # from now on the device may write it ...
    data = torch.randint(0, 256, (2 * MiB,), dtype=torch.uint8)
    x.copy_(data)                       # ... as an optimizer writes a parameter, in place
    tt.evict()
    tt.prefetch()
    assert torch.equal(x, data)


# -- views force the Unified Memory path ----------------------------------------------------

def test_live_foreign_view_forces_unified_memory(tier, fake):
    tt = tier.empty(2 * MiB, "uint8", role="activation")
    data = fill_random(tt)
    view = tt.torch()
    tr = tt.evict()
    assert (tt.location, tt.in_shadow, tr.nbytes) == (Location.HOST, False, 2 * MiB)
    # Placed on the device when made, then written back by Unified Memory: no copy, no discard.
    assert [c[:3] for c in moves(fake) if c[0] != "advise"] == [
        ("prefetch", ((tt.data_ptr, 2 * MiB),), Location.DEVICE),
        ("prefetch", ((tt.data_ptr, 2 * MiB),), Location.HOST)]
    assert torch.equal(view, data)
    s = tier.stats()
    assert (s["ops.activation.evict_um"], s["ops.activation.evict_clean"], s["moved_bytes.activation.d2h"]) == (
        1, 0, 2 * MiB)


def test_kept_detach_alias_of_a_wrapped_parameter_forces_unified_memory(tier, fake):
    lin = linear_2mib()
    tt = tier.wrap(lin.weight)
    alias = lin.weight.detach()
    expected = alias.clone()
    tt.evict()
    assert lin.weight.data_ptr() == tt.data_ptr == alias.data_ptr()
    assert (tt.in_shadow, tier.stats()["ops.weight.evict_um"]) == (False, 1)
    assert calls(fake, "discard") == []
    assert torch.equal(alias, expected) and torch.equal(lin.weight, expected)


def test_wrapped_parameter_follows_its_data_to_the_shadow_and_back(tier, fake):
    lin = linear_2mib()
    x = torch.randn(8, 1024)
    with torch.no_grad():
        expected = lin(x)
    w = tier.wrap(lin.weight)
    b = tier.wrap(lin.bias)
    w.evict()
    assert (w.in_shadow, fake.pointer_kind(lin.weight.data_ptr())) == (True, "host")
    assert lin.weight.data_ptr() != w.data_ptr
    assert (managed_bytes(fake, w) == POISON).all()
    with torch.no_grad():
        assert torch.equal(lin(x), expected)
    w.prefetch()
    assert (w.in_shadow, lin.weight.data_ptr()) == (False, w.data_ptr)
    with torch.no_grad():
        assert torch.equal(lin(x), expected)
    assert b.location is Location.DEVICE and lin.bias.data_ptr() == b.data_ptr
    # And the parameter still trains.
    lin(x).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.shape == (512, 1024)


def test_frozen_weight_evicts_by_collapsing_read_mostly(tier, fake):
    lin = linear_2mib().requires_grad_(False)
    tt = tier.wrap(lin.weight)
    assert tt.role is tiermem.Role.FROZEN_WEIGHT
    expected = lin.weight.clone()
    tt.prefetch()
    before = role_stats(tier.stats(), "frozen_weight")
    n = len(fake.calls)
    tr = tt.evict()
    ptr = tt.data_ptr
    assert moves(fake, n) == [
        ("advise", ptr, 2 * MiB, "read_mostly", False, Location.DEVICE),
        ("advise", ptr, 2 * MiB, "read_mostly", True, Location.DEVICE),
    ]
    assert tr.nbytes == 0
    after = role_stats(tier.stats(), "frozen_weight")
    assert after == {**before, "ops.evict": before["ops.evict"] + 1, "ops.evict_clean": before["ops.evict_clean"] + 1,
                     "resident_bytes.current": 0, "advice.applied": before["advice.applied"] + 2}
    assert tt.range_info().read_mostly is True
    assert torch.equal(lin.weight, expected)


def test_every_advise_call_is_counted(tier, fake):
    lin = linear_2mib().requires_grad_(False)
    tt = tier.wrap(lin.weight)
    tt.prefetch()
    tt.evict()
    assert tier.stats()["advice.frozen_weight.applied"] == len(calls(fake, "advise"))


def test_small_tensors_never_take_the_discard_paths(tier, fake):
    tt = tier.empty(1000, "float32", role="activation")    # 4,000 bytes: shares its pages
    data = fill_random(tt)
    for _ in range(2):
        tr = tt.evict()
        assert tr.nbytes == 4000
        tt.prefetch()
    assert calls(fake, "discard") == calls(fake, "discard_and_prefetch") == calls(fake, "host_alloc") == []
    s = tier.stats()
    assert (s["ops.activation.evict_um"], s["ops.activation.evict"], s["shadow_bytes.current"]) == (2, 2, 0)
    assert torch.equal(read(tt), data)


def test_evicting_a_never_placed_host_preferred_tensor_moves_nothing(tier, fake):
    tt = tier.empty(2 * MiB, "uint8", role="input")
    before, n = tier.stats(), len(fake.calls)
    tr = tt.evict()
    assert (tr.nbytes, tr.done(), tr.seconds) == (0, True, 0.0)
    assert fake.calls[n:] == []
    assert tier.stats() == before
    assert tt.location is Location.HOST


def test_first_prefetch_of_a_host_filled_input_counts_its_bytes(tier):
    tt = tier.empty(2 * MiB, "uint8", role="input")
    fill_random(tt)                  # written by the host: its pages are host pages
    tr = tt.prefetch()
    assert (tr.nbytes, tier.stats()["moved_bytes.input.h2d"]) == (2 * MiB, 2 * MiB)


def test_view_of_a_shadowed_tensor_brings_it_back(tier, fake):
    tt = tier.empty(2 * MiB, "uint8", role="gradient")
    data = fill_random(tt)
    tt.evict()
    assert tt.in_shadow
    view = tt.torch()
    assert (tt.in_shadow, tt.location, view.data_ptr()) == (False, Location.DEVICE, tt.data_ptr)
    assert torch.equal(view, data)
    assert calls(fake, "discard_and_prefetch") == [
        ("discard_and_prefetch", ((tt.data_ptr, 2 * MiB),), Location.DEVICE, calls(fake, "discard_and_prefetch")[0][3])]


def test_view_of_a_shadowed_tensor_without_budget_room_comes_back_to_host_pages(fake):
    t = tiermem.Tier(backend=fake, budget=2 * MiB)
    tt = t.empty(2 * MiB, "uint8", role="gradient")
    data = fill_random(tt)
    tt.evict()
    ws = t.empty(2 * MiB, "uint8", role="workspace")        # takes the whole budget for good
    view = tt.torch()
    assert (tt.in_shadow, tt.location, view.data_ptr()) == (False, Location.HOST, tt.data_ptr)
    assert torch.equal(view, data)
    assert calls(fake, "discard_and_prefetch")[-1][1:3] == (((tt.data_ptr, 2 * MiB),), Location.HOST)
    assert (t.resident_bytes, ws.location) == (2 * MiB, Location.DEVICE)


# -- a property: the budget holds, residency adds up, and data survives every path ----------

ROLES = ["weight", "frozen_weight", "activation", "gradient", "optimizer_state", "input", "workspace"]
SIZES = [1, 700, 5000, 2 * MiB, 2 * MiB + 3, 3 * MiB]
BUDGET = 6 * MiB


class Entry:
    def __init__(self, tt, read_only):
        self.tt, self.read_only = tt, read_only
        self.data: np.ndarray | None = None
        self.views: list[torch.Tensor] = []


class TierMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.fake = FakeBackend(total=1 << 30)
        self.tier = self.make_tier()
        self.live: list[Entry] = []

    def make_tier(self):
        return tiermem.Tier(backend=self.fake, budget=BUDGET)   # "auto" staging: off at 6 MiB

    def pick(self, i):
        return self.live[i % len(self.live)]

    @precondition(lambda self: len(self.live) < 8)
    @rule(role=st.sampled_from(ROLES), size=st.sampled_from(SIZES), read_only=st.booleans())
    def allocate(self, role, size, read_only):
        tt = self.tier.empty(size, "uint8", role=role, **({"read_only": True} if read_only else {}))
        self.live.append(Entry(tt, tt.policy.read_only))

    @precondition(lambda self: len(self.live) < 6)
    @rule(role=st.sampled_from(ROLES), sizes=st.lists(st.sampled_from(SIZES), min_size=2, max_size=3),
          read_only=st.booleans())
    def allocate_group(self, role, sizes, read_only):
        # adjacent slices of one allocation; the small ones share 2 MiB pages with each other
        g = self.tier.empty_group([((n,), "uint8") for n in sizes], role=role,
                                  **({"read_only": True} if read_only else {}))
        self.live.extend(Entry(tt, tt.policy.read_only) for tt in g)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7))
    def free(self, i):
        e = self.live.pop(i % len(self.live))
        e.views.clear()
        e.tt.free()
        self.tier.synchronize()      # finished transfers let go of the buffer

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7), seed=st.integers(0, 2**32 - 1))
    def write(self, i, seed):
        e = self.pick(i)
        if e.read_only and e.data is not None:
            return                   # read-only: filled once, never written again (its contract)
        data = np.random.default_rng(seed).integers(0, 256, e.tt.nbytes, dtype=np.uint8)
        e.tt.torch().copy_(torch.from_numpy(data))
        e.data = data

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7))
    def evict(self, i):
        self.pick(i).tt.evict()
        assert self.pick(i).tt.location is Location.HOST

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7))
    def prefetch(self, i):
        tt = self.pick(i).tt
        before = [(e.tt.location, e.tt.in_shadow) for e in self.live]
        try:
            tt.prefetch()
        except OutOfBudgetError:
            assert [(e.tt.location, e.tt.in_shadow) for e in self.live] == before
        else:
            assert (tt.location, tt.in_shadow) == (Location.DEVICE, False)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7), writable=st.booleans())
    def hold_view(self, i, writable):
        e = self.pick(i)
        e.views.append(e.tt.torch(writable=writable))

    @precondition(lambda self: any(e.views for e in self.live))
    @rule()
    def drop_views(self):
        for e in self.live:
            e.views.clear()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7))
    def read(self, i):
        e = self.pick(i)
        if e.data is None:
            return
        assert np.array_equal(e.tt.torch(writable=False).numpy(), e.data)
        for v in e.views:                # a view held across moves never goes stale
            assert np.array_equal(v.numpy(), e.data)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7))
    def evict_release(self, i):
        tt = self.pick(i).tt
        tt.tier.evict(tt, release=True)
        assert (tt.location, tt.parked) == (Location.HOST, False)

    @rule()
    def trim(self):
        self.tier.trim()
        assert self.tier.parked_bytes == 0

    @invariant()
    def budget_holds_and_residency_adds_up(self):
        resident = self.tier.resident_bytes
        assert resident + self.tier.staging_bytes <= BUDGET
        span = lambda e: e.tt._b.span  # noqa: E731
        parked = [e for e in self.live if e.tt.parked]
        assert all(e.tt.in_shadow and e.tt.location is Location.HOST for e in parked)
        assert self.tier.parked_bytes == sum(span(e) for e in parked)
        assert resident == sum(span(e) for e in self.live if e.tt.location is Location.DEVICE) + self.tier.parked_bytes
        s = self.tier.stats()
        assert (s["resident_bytes.all.current"], s["parked_bytes.current"]) == (resident, self.tier.parked_bytes)


TierMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_tier_state_machine = TierMachine.TestCase


class StagedTierMachine(TierMachine):
    """The same with a 2 MiB staging ring (two 1 MiB slots) inside the budget, taking every shadow
    copy it has room for (NOTE [staging ring])."""

    def make_tier(self):
        t = tiermem.Tier(backend=self.fake, budget=BUDGET, staging="2MiB")
        t.staging.min_bytes = 1
        return t

    def teardown(self):
        s = self.tier.stats()
        StagedTierMachine.staged += s["staged_bytes.all.h2d"] + s["staged_bytes.all.d2h"]


StagedTierMachine.staged = 0
StagedTierMachine.TestCase.settings = TierMachine.TestCase.settings
test_staged_tier_state_machine = StagedTierMachine.TestCase


def test_the_staged_machine_staged_something():
    """Guards the test above against a ring that never gets room: its runs moved bytes through it.
    (Runs after it in file order; alone it runs the machine once more.)"""
    if StagedTierMachine.staged == 0:
        test_staged_tier_state_machine().runTest()
    assert StagedTierMachine.staged > 0
