"""The training planner (NOTE [training plan]): pure logic, no GPU."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiermem.planning import plan_training, StepTrace, TrainPlan
from tiermem._trainplan import SavedRecord

MiB = 1 << 20


def trace(saved=(), params=(10 * MiB,) * 4, states=None, floor=100 * MiB, resident=frozenset()):
    states = tuple(2 * p for p in params) if states is None else states
    recs = tuple(SavedRecord(i, n, len(saved) - 1 - i) for i, n in enumerate(saved))
    return StepTrace(recs, tuple(params), tuple(states), floor, frozenset(resident))


def test_a_budget_at_the_floor_keeps_nothing_and_moves_everything():
    t = trace(saved=[8 * MiB] * 5)
    p = plan_training(t, 100 * MiB, margin=0)
    assert p.resident_blocks == frozenset() and p.keep == frozenset()
    assert p.swapped_bytes == 40 * MiB
    # each streamed block: params in twice and states in once; out: params and states once
    assert p.h2d_bytes == 4 * (2 * 10 + 20) * MiB + 40 * MiB
    assert p.d2h_bytes == 4 * (10 + 20) * MiB + 40 * MiB
    assert p.predicted_peak == 100 * MiB


def test_blocks_come_first_then_the_latest_activations():
    t = trace(saved=[8 * MiB] * 5)
    # room for two blocks (30 MiB each) and two activations
    p = plan_training(t, 100 * MiB + 60 * MiB + 16 * MiB, margin=0)
    assert len(p.resident_blocks) == 2
    assert p.keep == frozenset({3, 4})            # saved last: read first in backward
    assert p.predicted_peak <= p.budget


def test_the_margin_is_left_free():
    t = trace(saved=[8 * MiB] * 5)
    p = plan_training(t, 100 * MiB + 16 * MiB, margin=8 * MiB)
    assert p.keep == frozenset({4})


def test_in_capacity_keeps_everything():
    t = trace(saved=[8 * MiB] * 5)
    p = plan_training(t, 1 << 34)
    assert len(p.resident_blocks) == 4 and p.swapped_bytes == 0
    assert p.h2d_bytes == p.d2h_bytes == 0 and p.predicted_seconds() == 0


def test_blocks_resident_while_tracing_stay_and_count_against_the_budget():
    t = trace(saved=[8 * MiB] * 2, resident={0})
    p = plan_training(t, 100 * MiB + 30 * MiB + 8 * MiB, margin=0)
    assert p.resident_blocks == frozenset({0})
    assert p.keep == frozenset({1})


def test_can_reside_keeps_blocks_streamed():
    t = trace()
    p = plan_training(t, 1 << 34, can_reside=[False, True, True, False])
    assert p.resident_blocks == frozenset({1, 2})


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        plan_training(trace(), 0)
    with pytest.raises(ValueError):
        plan_training(StepTrace((), (1, 2), (1,), 0), 10)


def test_the_table_says_what_is_kept_and_moved():
    p = plan_training(trace(saved=[8 * MiB] * 5), 200 * MiB)
    s = str(p)
    for word in ("blocks resident", "blocks streamed", "activations", "per step", "device peak"):
        assert word in s
    assert isinstance(p, TrainPlan)


@settings(max_examples=200, deadline=None)
@given(saved=st.lists(st.integers(1, 64 * MiB), max_size=30),
       params=st.lists(st.integers(1, 64 * MiB), min_size=1, max_size=12),
       floor=st.integers(0, 512 * MiB), budget=st.integers(1, 2048 * MiB), margin=st.integers(0, 64 * MiB))
def test_the_predicted_peak_never_passes_the_budget_when_the_floor_fits(saved, params, floor, budget, margin):
    t = trace(saved=saved, params=params, floor=floor)
    p = plan_training(t, budget, margin=margin)
    if floor + margin <= budget:
        assert p.predicted_peak + margin <= budget
    else:
        assert not p.keep and not p.resident_blocks      # nothing is added to a floor that does not fit
    assert p.kept_bytes == sum(t.saved[i].nbytes for i in p.keep)
    assert 0 <= p.swapped_bytes <= t.saved_bytes
