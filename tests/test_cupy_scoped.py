"""CPU tests of the CuPy allocator's residency checks and of Tier.use, on the fake backend.

The fake has no CuPy, so an "array" here is what tiermem reads of one: a data pointer, and a
memory owner that holds the foreign view token (as CuPy's UnownedMemory does). Kernels are
played by the test: a prefetch or advice made behind tiermem's back goes straight to the fake.
"""
from __future__ import annotations

import ctypes
import gc
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import calls

import tiermem
from tiermem import Location, TierMemError
from tiermem.core.sidestreams import UM_STREAMS
from tiermem.cupy.scoped import residency
from tiermem.roles import Advice

MiB = 1 << 20
A = 4 * MiB   # every array here owns whole 2 MiB pages


class Arr:
    """A stand-in for a CuPy array from tiermem's allocator: ``data.ptr``, and ``data.mem._owner``
    (CuPy's UnownedMemory) holding the view token."""

    def __init__(self, tier, nbytes=A, role="activation"):
        buf, token = residency(tier).new_array(nbytes, role)
        self.nbytes = nbytes
        self.data = SimpleNamespace(ptr=buf.ptr, mem=SimpleNamespace(_owner=token))

    @property
    def ptr(self):
        return self.data.ptr

    @property
    def buf(self):
        return self.data.mem._owner.buffer

    def fill(self, seed):
        data = np.random.default_rng(seed).integers(0, 256, self.nbytes, dtype=np.uint8)
        ctypes.memmove(self.ptr, data.ctypes.data, self.nbytes)
        return data

    def read(self):
        return np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self.ptr)).copy()


@pytest.fixture
def btier(fake):
    """A Tier with room for two 4 MiB arrays."""
    return tiermem.Tier(backend=fake, budget=2 * A)


def stream(tier, direction):
    return tier.streams.named[UM_STREAMS[direction]]


def extra(tier):
    s = tier.stats()
    return {k: s[k] for k in ("residency.budget_overruns", "residency.budget_overrun_bytes",
                              "residency.faulted_back_count", "residency.faulted_back_bytes",
                              "residency.in_place_bytes.current", "residency.retained_bytes.current",
                              "use.calls", "use.bytes")}


def none_extra(**changes):
    out = {"residency.budget_overruns": 0, "residency.budget_overrun_bytes": 0, "residency.faulted_back_count": 0,
           "residency.faulted_back_bytes": 0, "residency.in_place_bytes.current": 0,
           "residency.retained_bytes.current": 0, "use.calls": 0, "use.bytes": 0}
    out.update({k.replace("__", "."): v for k, v in changes.items()})
    return out


def three(tier):
    """a, b, c of 4 MiB in a budget of two: c's placement evicts a, the coldest."""
    a, b = Arr(tier), Arr(tier)
    c = Arr(tier)
    return a, b, c


# -- allocation under pressure ----------------------------------------------------------------------

def test_evicted_array_is_advised_in_place_and_the_books_stay_within_budget(btier, fake):
    a, b, c = three(btier)
    assert (a.buf.where, b.buf.where, c.buf.where) == (Location.HOST, Location.DEVICE, Location.DEVICE)
    st = fake.state[a.ptr]
    assert (st.preferred, st.read_mostly, st.accessed_by) == (Location.HOST, False, {Location.DEVICE, Location.HOST})
    assert fake.state[b.ptr].preferred is Location.DEVICE or fake.state[b.ptr].preferred is None
    s = btier.stats()
    assert s["resident_bytes.all.current"] == 2 * A and s["resident_bytes.all.peak"] == 2 * A
    assert s["ops.activation.evict_um"] == 1 and s["ops.activation.evict_budget"] == 1
    assert extra(btier) == none_extra(residency__retained_bytes__current=A, residency__in_place_bytes__current=A)


def test_new_array_pages_wait_for_the_eviction_that_made_their_room(btier, fake):
    held = [Arr(btier), Arr(btier)]
    fake.calls.clear()
    fake.waits.clear()
    held.append(Arr(btier))
    d2h, h2d = stream(btier, "d2h"), stream(btier, "h2d")
    evict_at = next(i for i, c in enumerate(fake.calls) if c[0] == "prefetch" and c[2] is Location.HOST)
    place_at = next(i for i, c in enumerate(fake.calls) if c[0] == "prefetch" and c[2] is Location.DEVICE)
    assert fake.calls[evict_at][3] == d2h and fake.calls[place_at][3] == h2d
    # The current stream (0) waits for the eviction, and the placement's stream for the current one.
    assert fake.waits.index((0, d2h)) < fake.waits.index((h2d, 0))
    waits_before_place = [c for c in fake.calls[:place_at] if c[0] == "wait"]
    assert ("wait", 0) in waits_before_place and ("wait", h2d) in waits_before_place


def test_workspace_arrays_never_evict_and_overflow_in_place(btier, fake):
    a, b = Arr(btier, role="workspace"), Arr(btier, role="workspace")
    c = Arr(btier, role="workspace")
    assert (a.buf.where, b.buf.where, c.buf.where) == (Location.DEVICE, Location.DEVICE, Location.HOST)
    assert fake.state[c.ptr].preferred is Location.HOST
    assert btier.stats()["resident_bytes.all.current"] == 2 * A
    assert extra(btier) == none_extra(residency__in_place_bytes__current=A)
    assert not [x for x in calls(fake, "prefetch") if x[2] is Location.HOST]


# -- the books follow the driver --------------------------------------------------------------------

def test_array_prefetched_behind_tiermems_back_is_remarked_then_evicted_at_the_next_check(btier, fake):
    a, b, c = three(btier)
    fake.prefetch([(a.ptr, A)], Location.DEVICE, 0)           # e.g. cupy's memPrefetchAsync
    s = btier.stats()                                         # re-marks, moves nothing
    assert s["resident_bytes.all.current"] == 3 * A and a.buf.where is Location.DEVICE
    assert extra(btier) == none_extra(residency__faulted_back_count=1, residency__faulted_back_bytes=A)
    n_evict = len([x for x in calls(fake, "prefetch") if x[2] is Location.HOST])
    btier.stats()
    assert len([x for x in calls(fake, "prefetch") if x[2] is Location.HOST]) == n_evict
    # The next budget check evicts the coldest (b: a was just found, c is newer) to fit again.
    with btier.use(c):
        pass
    assert (a.buf.where, b.buf.where, c.buf.where) == (Location.DEVICE, Location.HOST, Location.DEVICE)
    assert btier.stats()["resident_bytes.all.current"] == 2 * A
    assert extra(btier) == none_extra(residency__retained_bytes__current=A,
                                      residency__faulted_back_count=1, residency__faulted_back_bytes=A,
                                      residency__budget_overruns=1, residency__budget_overrun_bytes=A,
                                      residency__in_place_bytes__current=A, use__calls=1)
    assert fake.state[b.ptr].preferred is Location.HOST


def test_array_readvised_behind_tiermems_back_follows_its_range(btier, fake):
    a, b, c = three(btier)
    fake.advise(a.ptr, A, Advice("preferred_location", True, Location.DEVICE))
    btier.stats()
    assert a.buf.where is Location.DEVICE and a.buf.policy.preferred_location is Location.DEVICE
    assert extra(btier)["residency.faulted_back_count"] == 1
    d = Arr(btier)         # an allocation under pressure is a budget check too
    s = btier.stats()
    assert d.buf.where is Location.DEVICE
    assert s["resident_bytes.all.current"] == 2 * A
    assert s["residency.budget_overruns"] == 1


def test_in_place_arrays_untouched_by_others_stay_host(btier, fake):
    a, b, c = three(btier)
    for _ in range(3):
        btier.stats()
    assert a.buf.where is Location.HOST
    assert extra(btier) == none_extra(residency__retained_bytes__current=A, residency__in_place_bytes__current=A)


# -- Tier.use -----------------------------------------------------------------------------------------

def test_use_orders_moves_after_evictions_and_the_stream_after_moves(btier, fake):
    a, b, c = three(btier)
    fake.calls.clear()
    fake.waits.clear()
    h = btier.use(a)
    side = btier.side_stream("scoped")
    d2h, h2d = stream(btier, "d2h"), stream(btier, "h2d")
    assert (a.buf.where, b.buf.where) == (Location.DEVICE, Location.HOST)   # b was the coldest
    # The eviction waits for the current stream; the side stream for the eviction; the move for it.
    assert fake.waits.index((d2h, 0)) < fake.waits.index((side, d2h)) < fake.waits.index((h2d, side))
    ins = [x for x in calls(fake, "prefetch") if x[2] is Location.DEVICE]
    assert [x[3] for x in ins] == [h2d] and ins[0][1] == ((a.ptr, A),)
    assert (0, h2d) not in fake.waits            # the caller's stream waits only when it enters
    with h as entered:
        assert entered is h
        assert fake.waits[-1] == (0, h2d)
    assert h.closed and h.nbytes == A
    assert extra(btier) == none_extra(residency__retained_bytes__current=A,
                                      residency__in_place_bytes__current=A, use__calls=1, use__bytes=A)
    s = btier.stats()
    assert s["moved_bytes.activation.h2d"] == A and s["resident_bytes.all.current"] == 2 * A


def test_use_moves_wait_for_the_overrun_evictions_too(btier, fake):
    a, b, c, d = (Arr(btier) for _ in range(4))
    fake.prefetch([(a.ptr, A)], Location.DEVICE, 0)           # over the budget by one array
    fake.waits.clear()
    fake.events_pending = True      # moves still running: a finished one needs no wait
    with btier.use(b):
        pass
    fake.events_pending = False
    side, d2h = btier.side_stream("scoped"), stream(btier, "d2h")
    assert (c.buf.where, d.buf.where) == (Location.HOST, Location.HOST)    # one for the overrun, one for b
    assert fake.waits.count((side, d2h)) == 2
    assert btier.stats()["residency.budget_overruns"] == 1


def test_use_of_resident_arrays_moves_nothing(btier, fake):
    a, b = Arr(btier), Arr(btier)
    n = len(fake.calls)
    with btier.use(a, b, a) as h:
        pass
    assert h.nbytes == 0
    assert not [x for x in fake.calls[n:] if x[0] in ("prefetch", "copy", "discard")]


def test_pipelined_use_never_evicts_open_handles_and_holds_the_budget(fake):
    tier = tiermem.Tier(backend=fake, budget=3 * A)
    xs = [Arr(tier) for _ in range(6)]
    for x in xs:
        x.fill(1)
    for _ in range(2):
        nxt = tier.use(xs[0])
        for i, x in enumerate(xs):
            with nxt:
                assert x.buf.where is Location.DEVICE
                if i + 1 < len(xs):
                    nxt = tier.use(xs[i + 1])
                    assert x.buf.where is Location.DEVICE and xs[i + 1].buf.where is Location.DEVICE
                assert tier.stats()["resident_bytes.all.current"] <= 3 * A
    s = tier.stats()
    assert s["residency.budget_overruns"] == 0 and s["use.calls"] == 12
    assert s["residency.in_place_bytes.current"] == sum(x.nbytes for x in xs if x.buf.where is Location.HOST)


def test_use_that_cannot_fit_raises_and_pins_nothing(btier):
    a, b, c = three(btier)
    h = btier.use(b, c)
    with pytest.raises(tiermem.OutOfBudgetError):
        btier.use(a)                 # b and c are held by h: no room
    assert residency(btier).pinned() == {b.buf, c.buf}
    h.close()
    with btier.use(a):
        assert a.buf.where is Location.DEVICE
    with pytest.raises(TierMemError, match="closed"):
        with h:
            pass


def test_new_array_that_only_pinned_arrays_could_make_room_for_goes_in_place(btier, fake):
    a, b, c = three(btier)
    with btier.use(b, c):
        d = Arr(btier)
        assert (b.buf.where, c.buf.where, d.buf.where) == (Location.DEVICE, Location.DEVICE, Location.HOST)
    assert fake.state[d.ptr].preferred is Location.HOST
    assert extra(btier) == none_extra(residency__retained_bytes__current=A,
                                      residency__in_place_bytes__current=2 * A, use__calls=1)
    with btier.use(d):              # and it comes in like any other
        assert d.buf.where is Location.DEVICE
    assert btier.stats()["moved_bytes.all.h2d"] == A


def test_dropped_handle_unpins(btier):
    a, b, c = three(btier)
    btier.use(b, c)
    gc.collect()
    assert residency(btier).pinned() == set()
    btier.use(a).close()


def test_read_only_scope_comes_in_read_mostly_and_leaves_without_moving(btier, fake):
    a, b, c = three(btier)
    with btier.use(a, read_only=True):      # b goes, by write-back: it is not read-only
        assert fake.state[a.ptr].read_mostly and a.buf.host_valid
    moved_out = btier.stats()["moved_bytes.all.d2h"]
    clean = btier.stats()["ops.activation.evict_clean"]
    with btier.use(b, c):           # pressure: a goes, by collapsing onto its host copy
        pass
    s = btier.stats()
    assert a.buf.where is Location.HOST
    assert s["moved_bytes.all.d2h"] == moved_out and s["ops.activation.evict_clean"] == clean + 1
    # Back to plain in-place advice: read in place, a read-mostly range would grow duplicates.
    st = fake.state[a.ptr]
    assert (st.preferred, st.read_mostly) == (Location.HOST, False) and not a.buf.policy.read_only


def test_use_mixes_tiered_tensors_ordered_after_the_callers_stream(btier, fake):
    t = btier.empty(A, "uint8", role="activation")
    a = Arr(btier)
    Arr(btier)                      # t evicted through its shadow (no view), parked
    assert t.location is Location.HOST
    fake.waits.clear()
    with btier.use(t, a):
        assert t.location is Location.DEVICE and not t.in_shadow
    assert (stream(btier, "h2d"), 0) in fake.waits


def test_use_resolves_arrays_and_refuses_foreign_memory(btier, fake):
    a = Arr(btier)
    with pytest.raises(TierMemError, match="not memory of this Tier"):
        btier.use(np.zeros(4))
    raw = SimpleNamespace(__cuda_array_interface__={"data": (a.ptr + 512, False)})   # found by address
    with btier.use(raw) as h:
        assert h._bufs == [a.buf]
    other = tiermem.Tier(backend=fake)
    with pytest.raises(TierMemError, match="another Tier"):
        other.use(a)
    assert tiermem.use(a, tier=btier).nbytes == 0


def test_values_survive_every_mix_of_scoped_and_unscoped_use(fake):
    tier = tiermem.Tier(backend=fake, budget=2 * A)
    xs = [Arr(tier) for _ in range(4)]
    ref = [x.fill(i) for i, x in enumerate(xs)]
    for step in range(8):
        named = [xs[(step + k) % 4] for k in range(step % 3)]
        with tier.use(*named, read_only=step % 2 == 0):
            pass
        tier.stats()
        Arr(tier)                   # a temporary under pressure
        for x, r in zip(xs, ref):
            assert np.array_equal(x.read(), r)


def test_stats_keys_are_documented():
    from tiermem.core import stats as _stats
    from tiermem.core.stats import EXTRA_KEYS
    for key in EXTRA_KEYS:
        head = key.rsplit(".", 1)[0] if key.startswith("residency.faulted_back") else key
        assert head in (_stats.__doc__ or ""), key


def test_handles_of_cupy_arrays_order_cupys_current_stream(btier, fake, monkeypatch):
    a, b, c = three(btier)
    current = SimpleNamespace(ptr=77)
    cupy = SimpleNamespace(cuda=SimpleNamespace(get_current_stream=lambda: current))
    monkeypatch.setitem(__import__("sys").modules, "cupy", cupy)
    h = btier.use(a)
    current.ptr = 78                 # CuPy's current stream changed since: the wait follows it
    with h:
        assert fake.waits[-1] == (78, stream(btier, "h2d"))
    t = btier.empty(A, "uint8", role="activation")
    t.evict()
    with btier.use(t):               # a TieredTensor alone: the backend's current stream
        assert fake.waits[-1] == (0, stream(btier, "h2d"))


def test_stats_answer_when_a_refresher_fails(tier, caplog):
    def broken():
        raise RuntimeError("driver query failed")
    tier.accounting.add_refresher(broken)
    s = tier.stats()
    assert s["use.calls"] == 0 and "driver query failed" in caplog.text


# -- fences, once, retained pages (issue 21, second round) --------------------------------------

class SyncLog:
    """Wraps the fake's synchronize so that a test sees when the host waited on which event, in
    order with the fake's other calls (the fake does all work at once, so a wait never blocks)."""

    def __init__(self, fake):
        self.fake = fake
        inner = fake.synchronize

        def synchronize(event):
            fake.calls.append(("synchronize", event))
            inner(event)
        fake.synchronize = synchronize


def test_collapse_waits_for_the_fence_of_the_scope_that_read_the_array(btier, fake):
    a, b, c = three(btier)
    SyncLog(fake)
    h = btier.use(a, read_only=True)
    with h:
        pass
    fence = a.buf.fence
    assert fence is not None and fence.stream == 0      # recorded on the stream the block used
    fake.events_pending = True                          # the block's kernels are still queued
    fake.calls.clear()
    with btier.use(b, c):                               # pressure: a collapses
        pass
    waited = fake.calls.index(("synchronize", fence))
    unset = next(i for i, x in enumerate(fake.calls)
                 if x[0] == "advise" and x[1] == a.ptr and x[3] == "read_mostly" and x[4] is False)
    assert waited < unset
    # Read-mostly was lent for the stay: one unset, not set again, and the books follow.
    assert not [x for x in calls(fake, "advise") if x[1] == a.ptr and x[3] == "read_mostly" and x[4]]
    assert not fake.state[a.ptr].read_mostly and not a.buf.policy.read_mostly
    assert a.buf.where is Location.HOST and a.buf in residency(btier).in_place


def test_collapse_does_not_wait_for_a_fence_already_passed(btier, fake):
    a, b, c = three(btier)
    SyncLog(fake)
    with btier.use(a, read_only=True):
        pass
    fake.calls.clear()
    with btier.use(b, c):
        pass
    assert not calls(fake, "synchronize")


def test_read_only_scope_lends_read_mostly_with_one_advice_call(btier, fake):
    a, b, c = three(btier)
    fake.calls.clear()
    with btier.use(a, read_only=True):
        mine = [x for x in calls(fake, "advise") if x[1] == a.ptr]
        assert mine == [("advise", a.ptr, A, "read_mostly", True, Location.DEVICE)]
        assert a.buf.read_mostly_while_resident and a.buf.host_valid


def test_writable_scope_collapses_a_resident_read_only_copy_before_bringing_it_in(btier, fake):
    a, b, c = three(btier)
    with btier.use(a, read_only=True):
        pass
    fake.calls.clear()
    with btier.use(a):                      # may write: a plain page, not a duplicate
        assert a.buf.where is Location.DEVICE and not a.buf.read_mostly_while_resident
        assert not fake.state[a.ptr].read_mostly and not a.buf.host_valid
    kinds = [(x[0], x[3], x[4]) if x[0] == "advise" else (x[0], x[2]) for x in fake.calls
             if x[0] in ("advise", "prefetch") and x[1] in (a.ptr, ((a.ptr, A),))]
    assert kinds.index(("advise", "read_mostly", False)) < kinds.index(("prefetch", Location.DEVICE))


def test_once_leaves_in_place_arrays_in_place_and_pins_resident_ones(btier, fake):
    a, b, c = three(btier)                  # a in place; b, c resident
    ref = a.fill(1)
    fake.calls.clear()
    with btier.use(a, b, once=True) as h:
        assert h.nbytes == 0 and a.buf.where is Location.HOST
        assert residency(btier).pinned() == {a.buf, b.buf}
        d = Arr(btier)                       # pressure: c goes, b is pinned
        assert (b.buf.where, c.buf.where, d.buf.where) == (Location.DEVICE, Location.HOST, Location.DEVICE)
    assert not [x for x in calls(fake, "prefetch") if x[2] is Location.DEVICE and x[1] == ((a.ptr, A),)]
    assert np.array_equal(a.read(), ref)
    s = btier.stats()
    assert s["use.calls"] == 1 and s["use.bytes"] == 0 and s["residency.in_place_bytes.current"] == 2 * A


def test_once_still_brings_a_tiered_tensor_out_of_its_shadow(btier, fake):
    t = btier.empty(A, "uint8", role="activation")
    Arr(btier), Arr(btier)                   # t evicted through its shadow
    assert t.in_shadow
    with btier.use(t, once=True):
        assert t.location is Location.DEVICE and not t.in_shadow


def test_retained_bytes_count_arrays_that_had_device_pages_and_left(btier, fake):
    a, b, c = three(btier)                   # all three placed; a left
    assert btier.stats()["residency.retained_bytes.current"] == A
    with btier.use(a):                       # a back (its own pages), b out
        pass
    s = btier.stats()
    assert s["residency.retained_bytes.current"] == A and s["resident_bytes.all.current"] == 2 * A
    with btier.use(a, c):
        pass
    # An array that never had device pages (born in place under pinned arrays) retains none.
    with btier.use(a, c):
        d = Arr(btier)
    assert d.buf.where is Location.HOST and d.buf not in residency(btier).backed
    s = btier.stats()
    assert s["residency.retained_bytes.current"] == A     # b only
    # The driver's figure: live data plus retained pages, every array that has been on the device.
    assert s["resident_bytes.all.current"] + s["residency.retained_bytes.current"] == 3 * A
    del b
    gc.collect()
    assert btier.stats()["residency.retained_bytes.current"] == 0


def test_a_small_array_that_does_not_fit_gets_no_advice_and_is_never_faulted_back(btier, fake):
    a, b = Arr(btier), Arr(btier)
    with btier.use(a, b):
        fake.calls.clear()
        small = Arr(btier, nbytes=512)
        assert small.buf.where is Location.HOST
        # Its role's advice only (as every new array gets), never the in-place one: that would
        # move its neighbours' pages to the host too.
        assert not [x for x in calls(fake, "advise") if x[1] == small.ptr and x[5] is Location.HOST and x[4]]
    fake.prefetch([(small.ptr, 512)], Location.DEVICE, 0)     # its page, placed by a neighbour
    s = btier.stats()
    assert s["residency.faulted_back_count"] == 0 and s["residency.budget_overruns"] == 0


def test_a_small_array_over_the_budget_evicts_nothing(btier, fake):
    a, b = Arr(btier), Arr(btier)               # the budget is full, nothing pinned
    before = btier.stats()
    fake.calls.clear()
    small = Arr(btier, nbytes=4096)
    s = btier.stats()
    assert (a.buf.where, b.buf.where, small.buf.where) == (Location.DEVICE, Location.DEVICE, Location.HOST)
    assert s["ops.all.evict"] == before["ops.all.evict"] and not calls(fake, "prefetch")
    assert s["resident_bytes.all.current"] == 2 * A


def test_module_level_use_takes_what_tier_use_takes(btier, fake):
    a, b, c = three(btier)
    with tiermem.use(a, read_only=True, tier=btier):
        assert fake.state[a.ptr].read_mostly
    with tiermem.use(a, b, once=True) as h:        # the Tier found from the array's token
        assert h.nbytes == 0
    import inspect
    assert set(inspect.signature(btier.use).parameters) <= set(inspect.signature(tiermem.use).parameters)
