"""The streaming primitive (NOTE [ordered copies] in tiermem/core/stream.py) on the fake backend: what
a fill, a drain and a release wait for, the ring's choice of slot, and the pinned arena's reuse.
Module offload, training and activation swap move their bytes through these."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
import torch.nn as nn

import tiermem
from tiermem.core.stream import Lane, PinnedArena, SlotRing, now
from tiermem.planning import parse_bytes, weight_bytes

MiB = 1 << 20


def _fill_bytes(ptr: int, data: bytes) -> None:
    ctypes.memmove(ptr, data, len(data))


def _bytes(ptr: int, n: int) -> bytes:
    return ctypes.string_at(ptr, n)


@pytest.fixture
def parts(fake):
    side = fake.new_stream()
    window = fake.device_alloc(4 * 4096, pooled=False)
    home = fake.host_alloc(4 * 4096)
    _fill_bytes(home.ptr, bytes(np.random.default_rng(0).integers(0, 256, 4 * 4096, dtype=np.uint8)))
    yield Lane(fake, side), SlotRing(window.ptr, 4096, 4), home, side
    window.release()
    home.release()


def test_a_fill_waits_for_the_slots_last_user_then_marks_it_ready(fake, parts):
    lane, ring, home, side = parts
    s = ring[1]
    fake.waits.clear()
    start, end = ring.fill(lane, s, [(0, home.ptr, 1000), (2048, home.ptr + 4096, 512)], timed=True)
    # Never used: the fill waits for the work queued on the current stream so far.
    assert fake.waits == [(side, fake.current_stream())]
    assert s.ready is end and end.stream == side and start.stream == side
    assert _bytes(s.ptr, 1000) == _bytes(home.ptr, 1000)
    assert _bytes(s.ptr + 2048, 512) == _bytes(home.ptr + 4096, 512)
    ring.use(s)
    assert s.busy and ring.pick() is not s
    ring.release(s, fake)                 # its user is the compute stream
    assert not s.busy and s.free.stream == fake.current_stream()
    fake.waits.clear()
    ring.fill(lane, s, [(0, home.ptr, 64)], after=[None])
    assert fake.waits == [(side, fake.current_stream())]     # the release's event, nothing for None


def test_a_drain_home_frees_the_slot_only_when_its_copy_ends(fake, parts):
    lane, ring, home, side = parts
    out = Lane(fake, fake.new_stream())
    s = ring[0]
    ring.fill(lane, s, [(0, home.ptr, 4096)])
    _fill_bytes(s.ptr, b"\x07" * 100)                         # the compute stream wrote it
    end = ring.drain(out, s, [(home.ptr + 3 * 4096, 0, 100)])
    assert s.free is end and end.stream == out.stream
    assert _bytes(home.ptr + 3 * 4096, 100) == b"\x07" * 100
    fake.waits.clear()
    ring.fill(lane, s, [(0, home.ptr, 64)])
    assert fake.waits == [(side, out.stream)]                 # the next fill waits for the write-back


def test_the_ring_picks_an_empty_slot_first_then_the_one_used_longest_ago(parts):
    _, ring, _, _ = parts
    a, b, c, d = ring
    for s, who in zip((a, b, c), ("A", "B", "C")):
        s.occupant = who
    assert ring.pick() is d
    d.occupant = "D"
    for s in (c, a, d, b):
        ring.use(s)
        s.busy = False
    assert ring.pick() is c
    assert ring.pick(lambda occ: occ in {"C", "A"}) is d
    c.busy = a.busy = d.busy = b.busy = True
    assert ring.pick() is None
    assert ring.vacate(a) == "A" and a.occupant is None and a.held is None


def test_a_fill_that_fails_part_way_marks_nothing_ready(fake, parts):
    lane, ring, home, _ = parts
    s = ring[2]
    with fake.counting() as seen:
        ring.fill(lane, s, [(0, home.ptr, 64), (64, home.ptr + 64, 64)])
    assert "copy" in seen
    before = s.ready
    fake.fail_at(seen.index("copy") + 2, "cuda")              # the second copy
    with pytest.raises(tiermem.CUDAError):
        ring.fill(lane, s, [(0, home.ptr, 64), (64, home.ptr + 64, 64)])
    assert s.ready is before


def test_a_lane_orders_after_any_stream_it_is_told(fake, parts):
    lane, _, home, side = parts
    other = fake.new_stream()
    dev = fake.device_alloc(256, pooled=False)
    fake.waits.clear()
    _, end = lane.run([(dev.ptr, home.ptr, 256)], after=[now(other), None])
    assert fake.waits == [(side, other)] and end.stream == side
    assert _bytes(dev.ptr, 256) == _bytes(home.ptr, 256)
    dev.release()


def test_the_arena_hands_out_the_same_bytes_again_after_a_reset(fake):
    arena = PinnedArena(fake, chunk=MiB)
    a, b = arena.take(1000), arena.take(3000)
    assert b - a == 1024 and arena.nbytes == MiB            # aligned to 512, one chunk
    big = arena.take(MiB + 1)                               # a new chunk, whole multiples of the chunk
    assert arena.nbytes == 3 * MiB and big not in range(a, a + MiB)
    arena.reset()
    assert arena.take(1000) == a and arena.nbytes == 3 * MiB
    assert fake.live()["pinned"] == 3 * MiB
    arena.release()
    assert fake.live()["pinned"] == 0 and arena.nbytes == 0


def test_a_percentage_budget_is_a_share_of_the_device_and_weight_bytes_a_share_of_the_model(tier, fake):
    # NOTE [sizes]: one rule everywhere. The fake device has 1 GiB; the model 2.4 MB.
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(256, 256) for _ in range(9)])
    w = weight_bytes(m)
    assert w >= sum(p.numel() * p.element_size() for p in m.parameters())    # spans as laid out
    h = tier.wrap_module(m, budget="1%", max_group_bytes=MiB // 4)     # 10.7 MB: all of it resident
    assert h.budget == parse_bytes("1%", total=1 << 30) and not h.plan.streamed_bytes
    assert h.plan.total == w
    h.unwrap()
    h = tier.wrap_module(m, budget=w // 4, max_group_bytes=MiB // 4)  # a quarter of the weights
    assert h.budget == w // 4 and h.plan.streamed_bytes > 0
    h.unwrap()
