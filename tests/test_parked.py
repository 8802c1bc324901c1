"""Parked pages (NOTE [parked pages] in core/parking.py): under a budget, a shadow eviction keeps its
device pages, and a refill copies into kept pages with no discard, its own or another buffer's.

The fake backend poisons a discarded range with 0xDB, so data read back after a refill into
reused pages can only have come from the shadow copy.
"""
from __future__ import annotations

import pytest
import torch
from fakes import POISON
from helpers import MiB, calls, fill_random, read, role_stats
from torch import nn

import tiermem
from tiermem import Location


def moves(fake, start=0):
    """The calls that move data or pages since ``start`` (copies, prefetches, discards)."""
    return [c[0] for c in fake.calls[start:] if c[0] in ("copy", "prefetch", "discard", "discard_and_prefetch")]


def budgeted(fake, budget):
    return tiermem.Tier(backend=fake, budget=budget)


def test_dirty_eviction_under_a_budget_copies_and_keeps_the_pages(fake):
    t = budgeted(fake, 8 * MiB)
    tt = t.empty(2 * MiB, "uint8", role="activation")
    data = fill_random(tt)
    ptr = tt.data_ptr
    n = len(fake.calls)
    tr = tt.evict()
    assert moves(fake, n) == ["copy"]                    # no discard
    assert (tt.location, tt.in_shadow, tt.parked, tr.nbytes) == (Location.HOST, True, True, 2 * MiB)
    assert (t.resident_bytes, t.parked_bytes) == (2 * MiB, 2 * MiB)
    s = t.stats()
    assert (s["ops.activation.evict_park"], s["parked_bytes.current"], s["resident_bytes.activation.current"]) == (
        1, 2 * MiB, 2 * MiB)
    n = len(fake.calls)
    tt.prefetch()
    assert moves(fake, n) == ["copy"]                    # its own pages: no discard-and-prefetch
    assert (tt.location, tt.parked, tt.data_ptr, t.parked_bytes, t.resident_bytes) == (
        Location.DEVICE, False, ptr, 0, 2 * MiB)
    assert torch.equal(read(tt), data)
    assert t.stats()["ops.activation.refill_reuse"] == 1


@pytest.mark.parametrize("nbytes", [2 * MiB, 5000], ids=["whole_pages", "shared_pages"])
def test_read_only_parked_buffer_round_trips_with_nothing_moved(fake, nbytes):
    t = budgeted(fake, 8 * MiB)
    tt = t.empty(nbytes, "uint8", role="activation", read_only=True)
    data = fill_random(tt)
    tt.evict()                   # the first eviction copies: the shadow becomes valid
    tt.prefetch()
    n = len(fake.calls)
    assert (tt.evict().nbytes, tt.prefetch().nbytes) == (0, 0)
    assert moves(fake, n) == []
    assert torch.equal(read(tt), data)


def test_a_written_shadow_is_copied_back_into_the_parked_pages(fake):
    t = budgeted(fake, 8 * MiB)
    lin = nn.Linear(1024, 512)   # a 2 MiB weight
    w = t.wrap(lin.weight)
    w.evict()
    assert w.parked and fake.pointer_kind(lin.weight.data_ptr()) == "host"
    with torch.no_grad():
        lin.weight.add_(1)       # writes the shadow, through the rebound parameter
    expected = lin.weight.detach().clone()
    w.prefetch()
    assert fake.pointer_kind(lin.weight.data_ptr()) == "managed" and lin.weight.data_ptr() == w.data_ptr
    assert torch.equal(lin.weight.detach(), expected)


def test_a_refill_takes_the_pages_its_victim_leaves(fake):
    """The budget holds one of two 2 MiB buffers: bringing one in evicts the other into its own
    shadow and copies the incoming shadow into the same pages: no discard, no fresh pages."""
    t = budgeted(fake, 2 * MiB)
    a = t.empty(2 * MiB, "uint8", role="activation")
    da = fill_random(a)
    b = t.empty(2 * MiB, "uint8", role="activation")     # evicts a (released: a new buffer needs fresh pages)
    db = fill_random(b)
    assert a.location is Location.HOST and not a.parked
    a_ptr, b_ptr = a.data_ptr, b.data_ptr
    n = len(fake.calls)
    a.prefetch()                 # b out (parked), a in, into b's pages
    assert moves(fake, n) == ["copy", "copy"]
    assert (a.data_ptr, b.data_ptr) == (b_ptr, a_ptr)    # they traded ranges
    assert (a.location, b.location, b.in_shadow, b.parked) == (Location.DEVICE, Location.HOST, True, False)
    assert (t.resident_bytes, t.parked_bytes) == (2 * MiB, 0)
    assert torch.equal(read(a), da)
    n = len(fake.calls)
    b.prefetch()
    assert moves(fake, n) == ["copy", "copy"]
    assert torch.equal(read(b), db) and torch.equal(read(a), da)   # reading a brings it in: a third trade
    s = t.stats()
    assert (s["ops.activation.refill_reuse"], s["ops.activation.evict_park"], s["ops.activation.park_release"]) == (
        3, 3, 0)


def test_wrapped_parameters_follow_their_data_across_traded_ranges(fake):
    t = budgeted(fake, 2 * MiB)
    torch.manual_seed(0)
    l1, l2 = nn.Linear(1024, 512), nn.Linear(1024, 512)
    x = torch.randn(4, 1024)
    with torch.no_grad():
        want = (l1(x), l2(x))
    w1 = t.wrap(l1.weight)
    w2 = t.wrap(l2.weight)       # evicts w1
    for _ in range(3):
        for lin, w in ((l1, w1), (l2, w2)):
            w.prefetch()         # evicts the other one, and takes its pages
            assert lin.weight.data_ptr() == w.data_ptr and fake.pointer_kind(w.data_ptr) == "managed"
    with torch.no_grad():
        assert torch.equal(l1(x), want[0]) and torch.equal(l2(x), want[1])
    assert t.stats()["ops.weight.refill_reuse"] >= 5


def test_pages_traded_across_roles_get_the_incoming_roles_advice(fake):
    t = budgeted(fake, 2 * MiB)
    g = t.empty(2 * MiB, "uint8", role="gradient")
    dg = fill_random(g)
    s = t.empty(2 * MiB, "uint8", role="optimizer_state")
    ds = fill_random(s)
    g.prefetch()                 # takes s's pages
    s.prefetch()                 # and back
    for tt, want, data in ((g, "gradient", dg), (s, "optimizer_state", ds)):
        pol = t.policies[want]
        info = tt.range_info()
        assert (info.read_mostly, info.preferred_location) == (pol.read_mostly, pol.preferred_location)
        assert (Location.DEVICE in info.accessed_by) == pol.accessed_by_device
        assert torch.equal(read(tt), data)


def test_a_live_view_keeps_its_range_through_budget_pressure(fake):
    t = budgeted(fake, 2 * MiB)
    a = t.empty(2 * MiB, "uint8", role="activation")
    data = fill_random(a)
    view = a.torch()
    ptr = a.data_ptr
    b = t.empty(2 * MiB, "uint8", role="activation")
    fill_random(b)
    a.prefetch()
    b.prefetch()
    assert a.data_ptr == ptr == view.data_ptr() and not a.parked
    assert torch.equal(view, data)


def test_other_room_drops_parked_pages_coldest_first(fake):
    t = budgeted(fake, 4 * MiB)
    a = t.empty(2 * MiB, "uint8", role="activation")
    b = t.empty(2 * MiB, "uint8", role="activation")
    da, db = fill_random(a), fill_random(b)
    a.evict()
    b.evict()
    assert t.parked_bytes == 4 * MiB
    n = len(fake.calls)
    c = t.empty(2 * MiB, "uint8", role="workspace")      # fresh pages: a's parked ones go back
    assert calls(fake, "discard")[-1][1] == ((a.data_ptr, 2 * MiB),)
    assert "discard" in moves(fake, n)
    assert (a.parked, b.parked, t.parked_bytes, t.resident_bytes) == (False, True, 2 * MiB, 4 * MiB)
    assert role_stats(t.stats(), "activation")["ops.park_release"] == 1
    assert c.location is Location.DEVICE
    a_old = a.data_ptr
    base, arr = fake._find(a_old)
    assert (arr[a_old - base:a_old - base + a.nbytes] == POISON).all()
    assert torch.equal(read(a), da) and torch.equal(read(b), db)


def test_trim_and_release_give_parked_pages_back(fake):
    t = budgeted(fake, 8 * MiB)
    a = t.empty(2 * MiB, "uint8", role="activation")
    b = t.empty(4 * MiB, "uint8", role="activation")
    da, db = fill_random(a), fill_random(b)
    t.evict([a, b])
    assert t.parked_bytes == 6 * MiB
    t.evict(a, release=True)     # already evicted: its parked pages go back
    assert (a.parked, t.parked_bytes, t.resident_bytes) == (False, 4 * MiB, 4 * MiB)
    assert t.trim() == 4 * MiB
    assert (t.parked_bytes, t.resident_bytes) == (0, 0)
    assert torch.equal(read(a), da) and torch.equal(read(b), db)
    b.prefetch()
    n = len(fake.calls)
    t.evict(b, release=True)     # resident: copied, then discarded at once
    assert moves(fake, n) == ["copy", "discard"] and not b.parked


def test_no_budget_means_nothing_parks(fake):
    t = tiermem.Tier(backend=fake)
    a = t.empty(2 * MiB, "uint8", role="activation")
    fill_random(a)
    n = len(fake.calls)
    a.evict()
    assert moves(fake, n) == ["copy", "discard"] and not a.parked
    t2 = budgeted(fake, 8 * MiB)
    b = t2.empty(2 * MiB, "uint8", role="activation")
    data = fill_random(b)
    b.evict()
    assert b.parked
    t2.set_budget(None)          # dropping the budget gives parked pages back
    assert (b.parked, t2.parked_bytes, t2.resident_bytes) == (False, 0, 0)
    assert torch.equal(read(b), data)


def test_freeing_a_parked_tensor_leaves_the_accounting(fake):
    t = budgeted(fake, 8 * MiB)
    a = t.empty(2 * MiB, "uint8", role="activation")
    fill_random(a)
    a.evict()
    a.free()
    t.synchronize()
    import gc
    gc.collect()
    assert (t.parked_bytes, t.resident_bytes, t.stats()["resident_bytes.activation.current"]) == (0, 0, 0)


# -- small buffers (under 2 MiB, sharing pages): they park too, and nothing discards their pages --

def test_a_groups_small_members_park_and_move_by_copy_like_the_large_ones(fake):
    t = budgeted(fake, 16 * MiB)
    g = t.empty_group([((3 * MiB,), "uint8"), ((5000,), "uint8"), ((700,), "uint8")], role="activation")
    data = [fill_random(x) for x in g]
    n = len(fake.calls)
    tr = t.evict(g)
    assert moves(fake, n) == ["copy"] * 3                # no Unified Memory write-back, no discard
    assert tr.nbytes == 3 * MiB + 5700
    assert all(x.parked and x.in_shadow for x in g)
    assert t.stats()["ops.activation.evict_um"] == 0
    n = len(fake.calls)
    t.prefetch(g)
    assert moves(fake, n) == ["copy"] * 3                # back into their own pages
    assert all(torch.equal(read(x), d) for x, d in zip(g, data))


def test_small_parked_pages_go_back_by_migration_never_by_discard(fake):
    """The fake refuses a discard of part of a 2 MiB page, as the driver's 2 MiB mapping makes
    one unsafe; so trim() must move a small buffer's pages to the host instead, and its refill
    migrate pages in before the copy."""
    t = budgeted(fake, 8 * MiB)
    tt = t.empty(5000, "uint8", role="activation")
    data = fill_random(tt)
    tt.evict()
    n = len(fake.calls)
    assert t.trim() > 0
    assert moves(fake, n) == ["prefetch"] and fake.calls[-1][2] is Location.HOST
    assert (tt.parked, tt.in_shadow, t.parked_bytes, t.resident_bytes) == (False, True, 0, 0)
    n = len(fake.calls)
    tt.prefetch()
    assert moves(fake, n) == ["prefetch", "copy"]
    assert torch.equal(read(tt), data)


def test_a_small_buffer_released_at_once_goes_by_unified_memory(fake):
    t = budgeted(fake, 8 * MiB)
    tt = t.empty(5000, "uint8", role="activation")
    data = fill_random(tt)
    n = len(fake.calls)
    t.evict(tt, release=True)
    assert moves(fake, n) == ["prefetch"] and not tt.in_shadow and not tt.parked
    assert t.stats()["ops.activation.evict_um"] == 1
    assert torch.equal(read(tt), data)


def test_small_buffers_trade_pages_under_a_budget_that_holds_one(fake):
    a0 = tiermem.Tier(backend=fake).empty(5000, "uint8", role="activation")
    span = a0._b.span
    del a0
    t = budgeted(fake, span)
    a = t.empty(5000, "uint8", role="activation")
    da = fill_random(a)
    a.evict()                                            # parked
    b = t.empty(5000, "uint8", role="activation")        # a's pages go back: room for b
    db = fill_random(b)
    b_ptr = b.data_ptr
    n = len(fake.calls)
    a.prefetch()                                         # b parks, a takes b's pages
    assert moves(fake, n) == ["copy", "copy"]
    assert (a.data_ptr, a.parked, b.in_shadow, b.parked, t.resident_bytes) == (b_ptr, False, True, False, span)
    assert torch.equal(read(a), da)
    assert torch.equal(read(b), db)
