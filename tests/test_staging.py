"""The staging ring (NOTE [staging ring] in tiermem/cuda/staging.py) on a CPU.

Its ordering is checked on a stream simulator: every copy, record and wait is queued on its
stream, and the queues then run in a random order that respects only what the streams promise
(in order on one stream, a wait holds its stream until the event's work is done). A missing wait
lets a slot be overwritten before it is emptied, or emptied before it is filled, on some orders;
the last test shows the simulator catching exactly that. The engine's use of the ring (when it
stages, the budget, the stats, running out of device memory) is checked on the fake backend.
"""
from __future__ import annotations

import ctypes
import logging
import random

import numpy as np
import pytest
import torch
from fakes import FakeBackend
from helpers import MiB, calls, fill_random, read

import tiermem
from tiermem import Location, TierMemError
from tiermem.cuda.staging import MIN_STAGED, StagingRing, _Session


class StreamSim:
    """The parts of a backend the ring uses, with real queues per stream."""

    def __init__(self):
        self.queues: dict[int, list] = {}
        self.done: dict[int, int] = {}          # stream -> ops executed
        self.arrays: list[np.ndarray] = []
        self.copies = 0

    def device_alloc(self, nbytes, pooled=True):
        arr = np.zeros(nbytes, np.uint8)
        self.arrays.append(arr)

        class Mem:
            ptr = arr.ctypes.data

            def release(self):
                pass
        return Mem()

    def new_stream(self):
        s = 100 + len(self.queues)
        self.queues[s], self.done[s] = [], 0
        return s

    def new_event(self, timing=False):
        return {"at": None}

    def record(self, ev, stream):
        ev["at"] = (stream, len(self.queues[stream]))   # done once the stream ran this far
        self.queues[stream].append(("nop",))

    def wait(self, stream, ev):
        self.queues[stream].append(("wait", ev["at"]))

    def copy(self, dst, src, n, stream):
        self.queues[stream].append(("copy", dst, src, n))

    def synchronize(self, ev):
        self.run(random.Random(0))

    def _ready(self, op) -> bool:
        if op[0] != "wait" or op[1] is None:
            return True
        s, pos = op[1]
        return self.done[s] > pos

    def run(self, rng: random.Random) -> None:
        while True:
            heads = [s for s, q in self.queues.items() if self.done[s] < len(q) and self._ready(q[self.done[s]])]
            if not heads:
                assert all(self.done[s] == len(q) for s, q in self.queues.items()), "deadlock"
                return
            s = rng.choice(heads)
            op = self.queues[s][self.done[s]]
            if op[0] == "copy":
                ctypes.memmove(op[1], op[2], op[3])
                self.copies += 1
            self.done[s] += 1


def _pieces(rng, sizes):
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    dsts = [np.zeros(n, np.uint8) for n in sizes]
    return srcs, dsts


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("slots", [2, 3])
def test_every_order_the_streams_allow_delivers_every_byte(direction, slots):
    rng = np.random.default_rng(slots)
    sizes = [5000, 1, 64 * 1024 + 7, 3 * 4096, 777, 40000]
    for seed in range(40):
        sim = StreamSim()
        side = sim.new_stream()
        ring = StagingRing(sim, slot=8192, slots=slots)
        ring.allocate()
        srcs, dsts = _pieces(rng, sizes)
        # two sessions back to back: the second reuses slots the first may still be emptying
        for half in (slice(0, 3), slice(3, 6)):
            sess = ring.session(side, direction)
            for src, dst in zip(srcs[half], dsts[half]):
                sess.add(dst.ctypes.data, src.ctypes.data, src.nbytes)
            sess.close()
        sim.queues[side].append(("nop",))
        end = (side, len(sim.queues[side]) - 1)
        sim.run(random.Random(seed))
        assert sim.done[side] > end[1]
        for src, dst in zip(srcs, dsts):
            assert np.array_equal(src, dst), f"seed {seed}"


def test_the_side_stream_ends_after_all_of_the_second_streams_work():
    sim = StreamSim()
    side = sim.new_stream()
    ring = StagingRing(sim, slot=4096, slots=2)
    ring.allocate()
    src, dst = np.arange(20000, dtype=np.uint32).view(np.uint8), np.zeros(80000, np.uint8)
    sess = ring.session(side, "h2d")
    sess.add(dst.ctypes.data, src.ctypes.data, src.nbytes)
    sess.close()
    marker = {"at": None}
    sim.record(marker, side)       # what SideStreams.finish's end event sees
    # run the side stream as far as it can go, holding the second stream back where allowed:
    # it cannot pass the marker before the second stream has done every copy
    for seed in range(20):
        sim2 = StreamSim()
        sim2.queues = {s: list(q) for s, q in sim.queues.items()}
        sim2.done = dict.fromkeys(sim.queues, 0)
        rng = random.Random(seed)
        while sim2.done[side] <= marker["at"][1]:
            heads = [s for s, q in sim2.queues.items() if sim2.done[s] < len(q) and sim2._ready(q[sim2.done[s]])]
            s = side if side in heads else rng.choice(heads)
            op = sim2.queues[s][sim2.done[s]]
            if op[0] == "copy":
                ctypes.memmove(op[1], op[2], op[3])
            sim2.done[s] += 1
        stage = ring._stream
        assert sim2.done[stage] == len(sim2.queues[stage])
        assert np.array_equal(dst, src)


def test_the_simulator_catches_a_slot_refilled_before_it_was_emptied(monkeypatch):
    """Drop the wait on a slot's "emptied" event: some order then overwrites a slot before its
    contents moved on, and the test above would fail."""
    real_add = _Session.add

    def add_without_slot_wait(self, dst, src, nbytes):
        self.freed = [None] * len(self.freed)     # never waits for a slot to be emptied
        real_add(self, dst, src, nbytes)

    monkeypatch.setattr(_Session, "add", add_without_slot_wait)
    rng = np.random.default_rng(0)
    bad = 0
    for seed in range(40):
        sim = StreamSim()
        side = sim.new_stream()
        ring = StagingRing(sim, slot=4096, slots=2)
        ring.allocate()
        srcs, dsts = _pieces(rng, [3000] * 12)
        sess = ring.session(side, "h2d")
        for src, dst in zip(srcs, dsts):
            sess.add(dst.ctypes.data, src.ctypes.data, src.nbytes)
        sess.close()
        sim.run(random.Random(seed))
        bad += any(not np.array_equal(s, d) for s, d in zip(srcs, dsts))
    assert bad > 0


def test_a_ring_needs_two_slots_and_memory():
    with pytest.raises(ValueError):
        StagingRing(FakeBackend(), slot=MiB, slots=1)
    with pytest.raises(TierMemError, match="holds no memory"):
        StagingRing(FakeBackend()).session(1, "h2d")
    ring = StagingRing(FakeBackend())
    ring.allocate()
    with pytest.raises(ValueError):
        ring.session(1, "sideways")
    ring.release(1)
    with pytest.raises(TierMemError, match="holds no memory"):
        ring.session(1, "d2h")


# -- the engine's use of the rings (fake backend: all work done at once) -------------------------

def _kinds(fake, start=0):
    return [(fake.pointer_kind(c[2]), fake.pointer_kind(c[1])) for c in calls(fake, "copy")[start:]]


def _rings(t):
    """(refills' ring allocated, evictions' ring allocated)"""
    return tuple(t.staging.ring(d) is not None and t.staging.ring(d).allocated for d in ("h2d", "d2h"))


def test_megabytes_go_through_a_ring_each_way_and_a_small_move_goes_direct():
    fake = FakeBackend(total=1 << 30)
    t = tiermem.Tier(backend=fake)
    big = t.empty(40 * MiB, "uint8", role="gradient")
    small = t.empty(MIN_STAGED - 1, "uint8", role="gradient")
    data = [fill_random(big), fill_random(small)]
    t.evict(small)
    assert _kinds(fake) == [("managed", "host")] and t.staging_bytes == 0    # under MIN_STAGED
    t.evict(big)
    assert _rings(t) == (False, True) and t.staging_bytes == 64 * MiB
    n = len(calls(fake, "copy"))
    t.prefetch([big, small])
    assert set(_kinds(fake, n)) == {("host", "device"), ("device", "managed")}
    assert [c[3] for c in calls(fake, "copy")[n:] if fake.pointer_kind(c[1]) == "device"] == [32 * MiB, 8 * MiB, MIN_STAGED - 1]
    assert torch.equal(read(big), data[0]) and torch.equal(read(small), data[1])
    s = t.stats()
    assert (s["staged_bytes.gradient.h2d"], s["staged_bytes.gradient.d2h"]) == (40 * MiB + MIN_STAGED - 1, 40 * MiB)
    assert (t.staging_bytes, s["staging_bytes.current"], _rings(t)) == (128 * MiB, 128 * MiB, (True, True))
    assert [c for c in fake.calls if c[0] == "device_alloc"] == [("device_alloc", 64 * MiB, False)] * 2
    # each direction on its own stream, each ring's device copies on one more
    sides = {c[4] for c in calls(fake, "copy")[n:] if fake.pointer_kind(c[2]) == "host"}
    out_sides = {c[4] for c in calls(fake, "copy")[:n] if fake.pointer_kind(c[1]) == "host"}
    assert len(sides) == len(out_sides) == 1 and sides != out_sides


def test_staging_off_copies_direct():
    fake = FakeBackend(total=1 << 30)
    t = tiermem.Tier(backend=fake, staging="off")
    tt = t.empty(40 * MiB, "uint8", role="gradient")
    data = fill_random(tt)
    t.evict(tt)
    t.prefetch(tt)
    assert _kinds(fake) == [("managed", "host"), ("host", "managed")]
    assert torch.equal(read(tt), data) and t.staging_bytes == 0


def test_auto_stays_off_under_a_small_budget_and_a_size_turns_it_on_inside_the_budget():
    fake = FakeBackend(total=1 << 30)
    t = tiermem.Tier(backend=fake, budget=512 * MiB)          # under 16 x 64 MiB
    a = t.empty(40 * MiB, "uint8", role="gradient")
    fill_random(a)
    t.evict(a)
    t.prefetch(a)
    assert t.staging_bytes == 0 and ("host", "device") not in _kinds(fake)
    t2 = tiermem.Tier(backend=fake, budget=56 * MiB, staging="8MiB")
    b = t2.empty(40 * MiB, "uint8", role="gradient")
    data = fill_random(b)
    t2.evict(b, release=True)     # 40 + 8 fit: the evictions' ring
    t2.prefetch(b)                # 8 + 8 + 40 fit: the refills' ring
    assert (t2.staging_bytes, t2.resident_bytes, _rings(t2)) == (16 * MiB, 40 * MiB, (True, True))
    assert torch.equal(read(b), data)
    s = t2.stats()
    assert (s["staged_bytes.gradient.h2d"], s["staged_bytes.gradient.d2h"]) == (40 * MiB, 40 * MiB)


def test_the_rings_count_against_the_budget_and_are_skipped_when_there_is_no_room():
    fake = FakeBackend(total=1 << 30)
    t = tiermem.Tier(backend=fake, budget=40 * MiB, staging="8MiB")
    keep = t.empty(8 * MiB, "uint8", role="workspace")         # never evicted
    a = t.empty(32 * MiB, "uint8", role="gradient")
    data = fill_random(a)
    t.evict(a, release=True)   # 8 + 32 fill the budget: no room for a ring, the copy goes direct
    t.prefetch(a)              # and again
    assert (t.staging_bytes, t.resident_bytes) == (0, 40 * MiB)
    assert _kinds(fake) == [("managed", "host"), ("host", "managed")] and torch.equal(read(a), data)
    keep.free()
    t.evict(a, release=True)   # 32 + 8: the evictions' ring fits
    assert (t.staging_bytes, _rings(t)) == (8 * MiB, (False, True))
    t.prefetch(a)              # 8 + 32 + 8 > 40: no room for the refills' ring beside it
    assert (t.staging_bytes, t.resident_bytes, _rings(t)) == (8 * MiB, 32 * MiB, (False, True))
    t.empty(8 * MiB, "uint8", role="workspace")       # room comes from the tensor, not the ring
    assert (t.staging_bytes, t.resident_bytes, a.location) == (8 * MiB, 8 * MiB, Location.HOST)
    assert t.parked_bytes == 0 and torch.equal(read(a), data)


def test_the_rings_give_way_only_when_the_tensors_need_the_room():
    fake = FakeBackend(total=1 << 30)
    t = tiermem.Tier(backend=fake, budget=48 * MiB, staging="8MiB")
    a = t.empty(32 * MiB, "uint8", role="gradient")
    data = fill_random(a)
    t.evict(a, release=True)
    t.prefetch(a)
    assert (t.staging_bytes, _rings(t)) == (16 * MiB, (True, True))
    t.set_budget(44 * MiB)   # the rings stay while an evictable tensor can make the room
    assert (t.staging_bytes, a.location) == (16 * MiB, Location.HOST)
    t.prefetch(a)            # 32 + 16 > 44: the tensor comes first, the rings go
    assert (t.staging_bytes, t.resident_bytes, a.location) == (0, 32 * MiB, Location.DEVICE)
    assert torch.equal(read(a), data)


def test_trim_and_a_small_budget_give_the_rings_back():
    fake = FakeBackend(total=1 << 30)
    t = tiermem.Tier(backend=fake)
    a = t.empty(40 * MiB, "uint8", role="gradient")
    fill_random(a)
    t.evict(a)
    t.prefetch(a)
    assert t.staging_bytes == 128 * MiB
    assert t.trim() == 128 * MiB and t.staging_bytes == 0
    t.evict(a)
    t.prefetch(a)
    assert t.staging_bytes == 128 * MiB
    t.set_budget(512 * MiB)        # "auto" stays out of budgets under 1 GiB
    assert t.staging_bytes == 0


def test_a_full_device_turns_a_ring_off_with_a_warning(caplog):
    fake = FakeBackend(total=1 << 30)
    fake.device_full = True
    t = tiermem.Tier(backend=fake)
    a = t.empty(40 * MiB, "uint8", role="gradient")
    data = fill_random(a)
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        t.evict(a)
        t.prefetch(a)
    assert caplog.text.count("staging ring") == 2
    assert torch.equal(read(a), data)
    assert (t.staging_bytes, t.stats()["staging.refused_count"]) == (0, 2)
    fake.device_full = False
    t.evict(a)
    t.prefetch(a)                  # off for good: no retry on every move
    assert t.staging_bytes == 0 and ("host", "device") not in _kinds(fake)


@pytest.mark.parametrize("value", ["1MiB", "lots", -1])
def test_bad_staging_sizes_are_refused(value):
    with pytest.raises(TierMemError):
        tiermem.Tier(backend=FakeBackend(), staging=value)


def test_a_group_refill_into_parked_pages_goes_through_the_ring():
    """bandwidth.py's stream-in: a group comes in where the group before it was."""
    fake = FakeBackend(total=1 << 30)
    t = tiermem.Tier(backend=fake, staging="64MiB")
    specs = [((n,), "uint8") for n in (64 * MiB, 8 * MiB, 300_000, 24 * MiB, 4096)]
    g1 = t.empty_group(specs, role="gradient")
    g2 = t.empty_group(specs, role="gradient")
    d1, d2 = [fill_random(x) for x in g1], [fill_random(x) for x in g2]
    t.evict(g2, release=True)
    t.set_budget(t.resident_bytes + 128 * MiB)          # one group and both rings
    for _ in range(3):
        t.prefetch(g2)
        assert all(x.location is Location.DEVICE for x in g2) and all(x.location is Location.HOST for x in g1)
        t.prefetch(g1)
    assert all(torch.equal(read(x), d) for x, d in zip(g1, d1))
    assert all(torch.equal(read(x), d) for x, d in zip(g2, d2))
    assert t.resident_bytes + t.staging_bytes <= t.budget
    s = t.stats()
    assert s["ops.gradient.refill_reuse"] >= 5 * 5 and s["staged_bytes.gradient.h2d"] >= 5 * 96 * MiB
    assert t.staging_bytes == 128 * MiB


def test_a_refill_into_a_parked_victims_pages_waits_for_its_eviction_on_the_other_stream():
    fake = FakeBackend(total=1 << 30)
    t = tiermem.Tier(backend=fake, budget=32 * MiB, staging="off")
    a = t.empty(32 * MiB, "uint8", role="gradient")
    data_a = fill_random(a)
    t.evict(a, release=True)
    b = t.empty(32 * MiB, "uint8", role="gradient")
    data_b = fill_random(b)
    t.synchronize()                   # a's eviction is over: the refill has nothing of its own to wait for
    fake.events_pending = True        # moves look unfinished, as they are on a GPU
    t.prefetch(a)                     # b is the victim: copied out and parked; a takes its pages
    out_side, in_side = t.streams.named["um_d2h"], t.streams.named["um_h2d"]
    assert (b.location, b.parked, a.location) == (Location.HOST, False, Location.DEVICE)
    assert (in_side, out_side) in fake.waits       # the refill waited for b's eviction
    fake.events_pending = False
    assert torch.equal(read(a), data_a) and torch.equal(read(b), data_b)


def test_a_ring_that_gave_way_stays_off_until_the_budget_changes():
    fake = FakeBackend(total=1 << 30)
    t = tiermem.Tier(backend=fake, budget=40 * MiB, staging="8MiB")
    a = t.empty(8 * MiB, "uint8", role="gradient")
    data = fill_random(a)
    t.evict(a, release=True)
    t.prefetch(a)
    w = t.empty(16 * MiB, "uint8", role="workspace", evict="never")
    assert (t.staging_bytes, t.resident_bytes) == (16 * MiB, 24 * MiB)
    x = t.empty(18 * MiB, "uint8", role="workspace", evict="never")   # a alone is not enough room
    assert (t.staging_bytes, t.resident_bytes, a.location) == (0, 34 * MiB, Location.HOST)
    x.free()
    t.prefetch(a)            # there is room for it now, but it stays off: no ring/tensor ping-pong
    assert (t.staging_bytes, a.location) == (0, Location.DEVICE)
    t.set_budget(40 * MiB)
    t.evict(a, release=True)
    t.prefetch(a)
    assert (t.staging_bytes, t.resident_bytes) == (16 * MiB, 24 * MiB)
    assert torch.equal(read(a), data) and w.location is Location.DEVICE


def test_close_destroys_every_stream_the_tier_made_and_later_moves_make_new_ones():
    """A Tier's streams (its move streams and its rings') are the driver's: close() destroys
    them, and a tier used after close() makes new ones, never queueing work on a dead one."""
    fake = FakeBackend(total=1 << 30)
    t = tiermem.Tier(backend=fake, staging="8MiB")
    g = t.empty_group([((n,), "uint8") for n in (16 * MiB, 8 * MiB, 4096)], role="gradient")
    data = [fill_random(x) for x in g]
    t.evict(g)
    t.prefetch(g)
    assert len(fake.live_streams) >= 3          # both directions' move streams and a ring's
    t.close()
    assert fake.live_streams == set()
    t.evict(g)                                  # the fake refuses work on a destroyed stream
    t.prefetch(g)
    assert all(torch.equal(read(x), d) for x, d in zip(g, data))
    assert fake.live_streams and not (fake.live_streams & fake.dead_streams)
    t.close()
    assert fake.live_streams == set()

