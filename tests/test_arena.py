"""The lifetime-planned arena (tiermem/training/arena.py, NOTE [lifetime arena]): no two temporaries
alive together share a byte, the peak never falls below the live peak, and a trace of torch's
allocator history becomes lifetimes."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiermem.planning import Temp, live_peak, plan_arena, temps_from_trace


def _check(temps, plan, align=512):
    sizes = [-(-t.size // align) * align if t.end > t.start else 0 for t in temps]   # never alive: no bytes
    for i, a in enumerate(temps):
        assert plan.offsets[i] % align == 0 and plan.offsets[i] + sizes[i] <= plan.peak
        for j in range(i):
            b = temps[j]
            if a.start < b.end and b.start < a.end and sizes[i] and sizes[j]:
                assert (plan.offsets[i] + sizes[i] <= plan.offsets[j] or
                        plan.offsets[j] + sizes[j] <= plan.offsets[i]), (i, j)
    assert plan.live_peak <= plan.peak <= sum(sizes)


temp = st.builds(lambda s, a, d: Temp(s, a, a + d), st.integers(0, 1 << 22), st.integers(0, 60), st.integers(0, 30))


@settings(max_examples=200, deadline=None)
@given(st.lists(temp, max_size=40))
def test_no_two_live_temporaries_overlap_and_the_peak_is_bounded(temps):
    _check(temps, plan_arena(temps))


def test_a_chain_of_lifetimes_reuses_the_same_bytes():
    # each temporary freed as the next is made (activations in a forward, say): one slot's worth
    temps = [Temp(1 << 20, i, i + 2) for i in range(10)]
    plan = plan_arena(temps)
    assert plan.peak == plan.live_peak == 2 << 20


def test_best_fit_puts_a_small_temporary_in_the_gap_a_freed_one_left():
    temps = [Temp(4096, 0, 10), Temp(8192, 0, 3), Temp(4096, 0, 10), Temp(8192, 4, 10)]
    plan = plan_arena(temps)
    _check(temps, plan)
    assert plan.peak == plan.live_peak == 16384


def test_on_random_steps_the_peak_stays_near_the_live_peak():
    rng = random.Random(3)
    temps = []
    for i in range(400):                  # a forward's saved tensors, then backward frees them in reverse
        temps.append(Temp(rng.choice([1, 2, 4, 16]) << 20, i, 800 - i))
    for i in range(300):                  # short-lived temporaries in between
        s = rng.randrange(800)
        temps.append(Temp(rng.randrange(1, 8 << 20), s, s + rng.randrange(1, 5)))
    plan = plan_arena(temps)
    _check(temps, plan)
    assert plan.peak <= 1.1 * plan.live_peak


def test_live_peak_counts_a_free_and_an_alloc_at_one_time_as_a_handover():
    assert live_peak([Temp(1000, 0, 5), Temp(1000, 5, 9)]) == 1024
    assert live_peak([Temp(1000, 0, 6), Temp(1000, 5, 9)]) == 2048
    assert live_peak([Temp(0, 0, 5), Temp(10, 3, 3)]) == 0


def test_a_trace_becomes_lifetimes():
    events = [
        {"action": "segment_alloc", "addr": 0, "size": 1 << 21},
        {"action": "alloc", "addr": 100, "size": 512},
        {"action": "alloc", "addr": 700, "size": 1024},
        {"action": "free_requested", "addr": 100, "size": 512},
        {"action": "free_completed", "addr": 100, "size": 512},
        {"action": "free_requested", "addr": 9000, "size": 2048},   # allocated before the window
        {"action": "alloc", "addr": 100, "size": 512},               # the address again
    ]
    temps, before = temps_from_trace(events)
    assert before == 2048
    assert sorted(temps, key=lambda t: (t.start, t.size)) == [Temp(512, 0, 2), Temp(2048, 0, 3), Temp(1024, 1, 5),
                                                              Temp(512, 4, 5)]


@pytest.mark.parametrize("align", [1, 512, 4096])
def test_offsets_keep_the_alignment(align):
    temps = [Temp(1000 + i, i % 3, i % 3 + 2) for i in range(12)]
    _check(temps, plan_arena(temps, align), align)
