"""The choice of a training's plan (NOTE [measured choice] in tiermem/training/choice.py), alone:
no model, no torch; a synthetic trace, the fake backend's events, the slots and graphs as small
stand-ins, and the steps' times given by the test."""
from __future__ import annotations

import types

import pytest
from fakes import FakeBackend
from test_trainplan import MiB, seg_trace

from tiermem.errors import OutOfBudgetError
from tiermem.training.choice import LATE_SLACK, LATE_STEPS, PROBE_STEPS, VERIFY_STEPS, PlanChoice


class _Slots:
    """What the choice reads of the blocks' slots: their number, the lookahead, a slot's size."""

    def __init__(self, nslots=3, slot=32 * MiB):
        self.nslots, self.lookahead, self.slot_bytes, self._slot = nslots, nslots - 1, slot, slot

    def needed_slot_bytes(self):
        return self._slot


class _Replays:
    reserve = 0

    def give_up(self, why):
        raise AssertionError(f"no graphs here: {why}")


def _choice(budget, mode="auto", nslots=3, resident_bytes=0):
    taken = []
    blocks = [types.SimpleNamespace(index=i, resident=False) for i in range(4)]
    per = (1.0,) * 4
    c = PlanChoice(backend=FakeBackend(), blocks=blocks, stream=_Slots(nslots), replays=_Replays(), budget=budget,
                   margin=0, mode=mode, link_GBps=55.0, clip=False, take=lambda old, new: taken.append(new),
                   timings=lambda: (per, 4.0, 8.0), resident_bytes=lambda: resident_bytes)
    return c, taken


def _steps(c, times):
    """Updating steps under the choice's plan, each timed ``times[k]`` ms (the phase's timed
    steps read the last one's), until the choice has settled or the times run out."""
    it = iter(times)
    for ms in it:
        c.last_step_ms = lambda ms=ms: ms
        metered = c.metering_next
        c.step_begun()
        c.step_ended(True)
        c.after_step(metered, graphs_changed=False)
        if c.settled:
            return list(it)
    return []


def test_the_probe_recomputes_everywhere_and_a_model_that_agrees_is_not_checked():
    # room for one 64 MiB segment beside the floor, cheap forwards: recomputing all is best
    c, taken = _choice(100 * MiB + 80 * MiB)
    c.replan(seg_trace(compute=(1.0, 2.0)), floor=100 * MiB, nesting=1)
    probe = c.plan
    assert probe.recompute == frozenset(range(4)) and taken == [probe]
    assert c.refine == PROBE_STEPS and not c.metering_next and not c.settled
    _steps(c, [5.0])                                     # the first pays for its allocations
    assert c.metering_next                               # the second is metered
    _steps(c, [5.0] * (PROBE_STEPS - 1))
    assert c.plan.recompute == frozenset(range(4)) and len(taken) == 1     # the same choices, not taken again
    assert c.verify == 0 and c.settled


def test_a_model_plan_that_runs_slower_than_the_probe_goes_back_to_recomputing_everywhere():
    c, taken = _choice(100 * MiB + 160 * MiB)
    t = seg_trace(fwd_ms=30.0, compute=(40.0, 80.0))     # dear forwards: the model swaps instead
    c.replan(t, floor=100 * MiB, nesting=1)
    assert c.plan.kind == "recompute"
    # the probe's steps: allocations, metered, then two timed at 10 ms
    _steps(c, [10.0] * PROBE_STEPS)
    model = c.plan
    assert model is taken[-1] and model.recompute != frozenset(range(4)) and c.verify == VERIFY_STEPS
    _steps(c, [30.0] * VERIFY_STEPS)                     # the model's plan, 3x the probe's time
    back = c.plan
    assert back.recompute == frozenset(range(4)) and back.measured["chosen_by"] == "measured"
    assert back.measured["checked_ms"] == 30.0 and back.measured["probe_ms"] == 10.0
    assert c.settled and taken[-1] is back


@pytest.mark.parametrize("late_ms", [10.0 * (1 + LATE_SLACK) * 1.5, 10.0])
def test_a_kept_plan_is_checked_once_more_on_its_later_steps(late_ms):
    c, taken = _choice(100 * MiB + 160 * MiB)
    c.replan(seg_trace(fwd_ms=30.0, compute=(40.0, 80.0)), floor=100 * MiB, nesting=1)
    _steps(c, [10.0] * PROBE_STEPS)
    model = c.plan
    _steps(c, [9.0] * VERIFY_STEPS)                      # faster than the probe: kept
    assert c.plan is model and not c.settled             # the late check is still to come
    c.step_ms.clear()
    for _ in range(LATE_STEPS):                          # the kept plan's steps, read from their events
        c.be.elapsed_ms = lambda a, b: late_ms
        c.step_begun()
        c.step_ended(True)
        c.read_times()
        c.after_step(False, graphs_changed=False)
    assert c.plan.measured["late_ms"] == late_ms
    if late_ms > 10.0 * (1 + LATE_SLACK):
        assert c.plan.recompute == frozenset(range(4)) and c.plan.measured["chosen_by"] == "late"
    else:
        assert c.plan is model
    assert c.settled


def test_the_slots_give_way_to_a_floor_that_needs_them_and_refuse_below_two():
    # NOTE [fewer slots]: a floor half a slot over the budget costs one slot, and a block of lookahead
    c, _ = _choice(100 * MiB, nslots=3)
    c.replan(seg_trace(floor=116 * MiB), floor=116 * MiB, nesting=1)
    assert c.stream.nslots == 2 and c.stream.lookahead == 1 and c.trace.floor_peak == 84 * MiB
    c, taken = _choice(100 * MiB, nslots=2)              # two slots are the least: refused, nothing taken
    with pytest.raises(OutOfBudgetError, match="fewer slots"):
        c.replan(seg_trace(floor=116 * MiB), floor=116 * MiB, nesting=1)
    assert c.stream.nslots == 2 and not taken


def test_never_takes_its_plan_without_a_probe_and_times_it_for_the_model():
    c, taken = _choice(100 * MiB + 80 * MiB, mode="never")
    c.replan(seg_trace(compute=(1.0, 2.0)), floor=100 * MiB, nesting=1)
    assert not c.plan.recompute and c.refine == PROBE_STEPS        # calibrating: measured, not chosen
    _steps(c, [7.0] * PROBE_STEPS)
    assert not c.plan.recompute and len(taken) == 1 and c.settled
