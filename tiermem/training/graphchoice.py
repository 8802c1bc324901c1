"""Which plan a graphed training step replays (NOTE [graph choice]). Pure: plans and times in,
a plan out; tiermem.training.handle takes it, tiermem.training.stepgraph times the replays.

NOTE [graph choice]
    The measured choice (NOTE [measured choice] in training/choice.py) decides between the model's plan
    and recomputing everywhere on eager steps, and an eager step is host-bound: its time hides
    what the link costs under what the host costs. A replay has no host time; it costs the
    GPU's compute and the link's bytes, and a plan the eager steps kept can replay twice as
    slow as recomputing everywhere does (docs/history.md, "Measurements behind the code's
    notes"). So a graph's first REPLAYS_TIMED replays after the first are timed, the model's compute is
    fitted to their median (as NOTE [calibrated compute] fits it to eager steps; the link's
    terms stay at the measured rate), and the model predicts from the fitted times the other
    candidates: recomputing everywhere, and the model's own best plan. One predicted at least
    ``min_gain`` faster is taken: the graph drops, the steps run eagerly until the plan has
    settled, and the new plan is captured and its replays timed. If they are more than
    ``slack`` slower than the first plan's, the first plan comes back, where the blocks made
    resident since allow it. Once a run. The prediction of the plan tried, beside its measured
    replays (``graph_predicted_ms`` and ``replay_ms`` in ``train.plan.measured``), is the graphed
    step's plan error.

    Eager steps hide link and GPU time under host time, and recomputing adds host time (each
    recomputed block's forward runs again from Python); a plan that recomputes fewer blocks
    adds none. So where the measured choice timed the model's plan, which recomputes fewer
    blocks than recomputing everywhere, slower on eager steps and went back to recomputing
    everywhere, the eager steps' verdict stands for an alternative that recomputes fewer blocks
    still: it is not tried (``eager_refutes``; docs/history.md, "Measurements behind the code's
    notes"). Recomputing everywhere, the
    other way, is still tried: the eager steps' host time is what may have hidden its gain
    (the Qwen2 above).

    And it is tried whatever the model predicts for it, where it recomputes more blocks and
    swaps fewer bytes than the plan replayed: the model's compute is measured on eager steps,
    whose host time a recomputed block repeats, so it prices recomputing at what it costs an
    eager step, not a replay, and one factor fitted to the replays does not undo that
    (docs/history.md, "Measurements behind the code's notes"). A wrong try costs its steps once: its replays are timed and the first plan comes
    back (``keep_tried``).
"""
from __future__ import annotations

from collections.abc import Callable

from .plan import StepTrace, TrainPlan, evaluate, fit_compute, scaled

__all__ = ["REPLAYS_TIMED", "eager_refutes", "graph_alternative", "keep_tried"]

REPLAYS_TIMED = 5     # replays whose median a graph's plan is judged by, after its first


def _choices(plan: TrainPlan) -> tuple[frozenset[int], ...]:
    return frozenset(plan.resident_blocks), frozenset(plan.recompute), frozenset(plan.keep), frozenset(plan.parts)


def graph_alternative(trace: StepTrace, plan: TrainPlan, replay_ms: float,
                      plan_for: Callable[[StepTrace, str | None], TrainPlan],
                      min_gain: float) -> tuple[TrainPlan, TrainPlan | None]:
    """``plan`` as the model fitted to its replays (``replay_ms``) predicts it, and the candidate
    to try instead: recomputing everywhere where that recomputes more blocks and swaps fewer
    bytes than ``plan`` (NOTE [graph choice]), else the candidate predicted ``min_gain`` faster
    (None: none is). ``plan_for(trace, mode)`` makes a plan for ``trace``: mode "always"
    recomputes everywhere, None chooses."""
    fitted = scaled(trace, fit_compute(evaluate(trace, plan), replay_ms))
    here = evaluate(fitted, plan)
    mine = _choices(plan)
    everywhere = plan_for(fitted, "always")
    others = {}
    for c in (everywhere, plan_for(fitted, None)):
        if _choices(c) != mine:
            others.setdefault(_choices(c), c)
    if (_choices(everywhere) != mine and len(everywhere.recompute) > len(plan.recompute)
            and everywhere.swapped_bytes < plan.swapped_bytes):
        return here, everywhere        # the model cannot judge it: tried (NOTE [graph choice])
    best = min(others.values(), key=lambda c: c.predicted_seconds(), default=None)
    if best is None or best.predicted_seconds() > here.predicted_seconds() * (1 - min_gain):
        return here, None
    return here, best


def keep_tried(tried_ms: float, first_ms: float, slack: float) -> bool:
    """Whether the plan tried stays: its replays no more than ``slack`` slower than the first's."""
    return tried_ms <= first_ms * (1 + slack)


def eager_refutes(plan: TrainPlan, alt: TrainPlan) -> bool:
    """Whether the eager steps already found ``alt`` slower (NOTE [graph choice]): ``plan`` is
    recomputing everywhere, taken back because the model's plan ran slower on eager steps
    (``chosen_by`` "measured" or "late"), and ``alt`` recomputes fewer blocks than it."""
    return (plan.measured.get("chosen_by") in ("measured", "late")
            and frozenset(alt.recompute) < frozenset(plan.recompute))
