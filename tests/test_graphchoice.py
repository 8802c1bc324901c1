"""NOTE [graph choice] in tiermem/training/graphchoice.py on the CPU: which plan a graphed step's replays
lead to, on synthetic traces, and the training's books through the fake backend (capturing and
replaying need a GPU: tests/test_gpu_stepgraph.py)."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_stepgraph import _tiered
from test_train import batches, loss_of
from test_trainplan import seg_trace

from tiermem.errors import TierMemError
from tiermem.planning import plan_training
from tiermem.training.graphchoice import eager_refutes, graph_alternative, keep_tried
from tiermem.training.plan import evaluate

MiB = 1 << 20
GAIN = 0.05


def _plan_for(budget):
    return lambda t, mode: plan_training(t, budget, margin=0, recompute=mode or "auto")


def test_a_swapping_plan_whose_replays_are_link_bound_gives_way_to_recomputing_everywhere():
    """The eager steps kept a plan that swaps every block (their host time hid the link); its
    replays take what its bytes take over the link, and the model fitted to them predicts
    recomputing everywhere well under that."""
    t = seg_trace(act=256 * MiB, fwd_ms=1.0, compute=(4.0, 8.0))
    budget = 100 * MiB + 300 * MiB
    swapping = plan_training(t, budget, margin=0, recompute="never")
    assert swapping.swapped_bytes > 0 and not swapping.recompute
    here, alt = graph_alternative(t, swapping, swapping.predicted_seconds() * 1e3, _plan_for(budget), GAIN)
    assert alt is not None
    assert alt.recompute == frozenset(range(4))
    assert alt.predicted_seconds() < here.predicted_seconds() * (1 - GAIN)
    assert alt.predicted_peak <= budget


def test_a_plan_already_the_models_best_under_its_replays_stays():
    t = seg_trace(act=4 * MiB, fwd_ms=50.0, compute=(200.0, 400.0))    # compute-bound, nothing to gain
    budget = 100 * MiB + 40 * MiB
    p = plan_training(t, budget, margin=0)
    here, alt = graph_alternative(t, p, p.predicted_seconds() * 1e3, _plan_for(budget), GAIN)
    assert alt is None
    assert here.predicted_seconds() * 1e3 == pytest.approx(p.predicted_seconds() * 1e3, rel=1e-6)


@settings(max_examples=60, deadline=None)
@given(act=st.sampled_from([4 * MiB, 64 * MiB, 256 * MiB]), fwd_ms=st.floats(0.1, 50.0),
       compute=st.tuples(st.floats(1.0, 200.0), st.floats(1.0, 400.0)),
       room=st.sampled_from([40 * MiB, 120 * MiB, 300 * MiB, 1200 * MiB]),
       mode=st.sampled_from(["never", "always", "auto"]), replay=st.floats(0.3, 3.0))
def test_an_alternative_is_predicted_the_gain_faster_and_fits_the_budget(act, fwd_ms, compute, room, mode, replay):
    """Whatever the replays took (``replay`` times the eager prediction): the plan as fitted
    keeps its choices, and an alternative, where one is given, is another plan within the
    budget, from the same fitted times: recomputing everywhere where that recomputes more
    blocks and swaps fewer bytes, else one predicted at least the gain faster."""
    t = seg_trace(act=act, fwd_ms=fwd_ms, compute=compute)
    budget = 100 * MiB + room
    p = plan_training(t, budget, margin=0, recompute=mode)
    here, alt = graph_alternative(t, p, p.predicted_seconds() * 1e3 * replay, _plan_for(budget), GAIN)
    assert (here.resident_blocks, here.recompute, here.keep) == (p.resident_blocks, p.recompute, p.keep)
    if alt is not None:
        assert (alt.resident_blocks, alt.recompute, alt.keep) != (p.resident_blocks, p.recompute, p.keep)
        everywhere = len(alt.recompute) > len(p.recompute) and alt.swapped_bytes < p.swapped_bytes
        if everywhere:
            assert alt.kind == "recompute"
        else:
            assert alt.predicted_seconds() <= here.predicted_seconds() * (1 - GAIN)
        assert alt.predicted_peak <= budget
        # predicted from the times fitted to the replays: the same compute scale as the plan's
        assert alt.compute_scale == pytest.approx(here.compute_scale)
        assert evaluate(t, alt).compute_scale == pytest.approx(t.compute_scale)


def test_recomputing_everywhere_is_tried_after_a_swapping_plan_whatever_the_model_predicts():
    """NOTE [graph choice]: the eager steps' compute prices a recomputed block at what it costs an
    eager step. The Qwen2 at d16ed8c: a plan swapping 4.7 GB replayed at 296 ms, the model
    fitted to it predicted 400 ms for recomputing everywhere, which replayed at 136 ms."""
    # recomputing costs far more than swapping, by the eager steps' times
    t = seg_trace(act=64 * MiB, fwd_ms=60.0, compute=(120.0, 170.0))
    budget = 100 * MiB + 100 * MiB
    p = plan_training(t, budget, margin=0)
    assert not p.recompute and p.swapped_bytes > 0
    here, alt = graph_alternative(t, p, p.predicted_seconds() * 1e3, _plan_for(budget), GAIN)
    assert alt is not None and alt.recompute == frozenset(range(4))
    assert alt.predicted_seconds() > here.predicted_seconds()      # the model says slower: tried anyway
    assert alt.swapped_bytes < p.swapped_bytes and alt.predicted_peak <= budget


def test_recomputing_everywhere_is_not_tried_after_a_plan_that_swaps_nothing():
    """Where the plan replayed keeps every activation, recomputing only adds compute."""
    t = seg_trace(act=4 * MiB, fwd_ms=50.0, compute=(200.0, 400.0))
    budget = 100 * MiB + 20 * MiB          # every activation kept, every block streamed
    p = plan_training(t, budget, margin=0, recompute="never")
    assert p.swapped_bytes == 0 and not p.recompute and not p.in_capacity
    assert graph_alternative(t, p, p.predicted_seconds() * 1e3, _plan_for(budget), GAIN)[1] is None


def test_the_plan_tried_stays_unless_its_replays_are_slower_than_the_slack():
    assert keep_tried(100.0, 100.0, 0.02)
    assert keep_tried(101.9, 100.0, 0.02)
    assert not keep_tried(102.1, 100.0, 0.02)


@pytest.mark.parametrize("chosen_by,fewer,refuted", [
    ("measured", True, True), ("late", True, True),        # the eager steps found fewer recomputed slower
    ("measured", False, False),                              # recomputing no fewer: not theirs to say
    (None, True, False), ("graph", True, False),             # no eager verdict against it
])
def test_an_alternative_recomputing_fewer_blocks_than_the_eager_steps_found_slower_is_not_tried(
        chosen_by, fewer, refuted):
    t = seg_trace(act=256 * MiB, fwd_ms=1.0, compute=(4.0, 8.0))
    budget = 100 * MiB + 300 * MiB
    everywhere = plan_training(t, budget, margin=0, recompute="always")
    assert len(everywhere.recompute) == 4
    if chosen_by:
        everywhere.measured.update(checked_ms=174.3, probe_ms=130.1, chosen_by=chosen_by)
    other = plan_training(t, budget, margin=0, recompute="never") if fewer else everywhere
    assert eager_refutes(everywhere, other) is refuted


def test_the_plan_table_says_what_the_replays_measured_and_decided():
    t = seg_trace(act=256 * MiB, fwd_ms=1.0, compute=(4.0, 8.0))
    p = plan_training(t, 400 * MiB, margin=0, recompute="always")
    assert "replayed" not in p.table()
    p.measured.update(replay_ms=117.2, graph_refuted_ms=107.7)
    assert "117.2 ms a step as one CUDA graph" in p.table() and "107.7 ms" in p.table()
    p.measured.update(tried_replay_ms=154.8, tried_predicted_ms=107.7)
    assert "replayed 154.8 ms: this plan came back" in p.table()
    q = plan_training(t, 400 * MiB, margin=0, recompute="never")
    q.measured.update(replay_ms=90.0, chosen_by="graph", graph_predicted_ms=88.0, first_replay_ms=117.2)
    assert "tried after the first plan's replays (117.2 ms), predicted 88.0 ms" in q.table()


def _settled(**kw):
    model, opt, train = _tiered(recompute="auto", **kw)
    for ids in batches(20):
        with train.step():
            loss_of(model, ids).backward()
    assert train.settled and train.choice.graph_choice_open
    return model, train


def _offering(monkeypatch, train):
    """The fake backend's steps take no compute time, so the model never prefers another plan:
    here it offers the settled plan less its kept activations (swapped instead)."""
    import tiermem.training.graphchoice as gc_mod
    offered = []

    def alternative(trace, plan, replay_ms, plan_for, min_gain):
        assert plan.keep, "the settled plan keeps something to swap instead"
        offered.append((plan, replay_ms))
        return evaluate(trace, plan), evaluate(trace, dataclasses.replace(plan, keep=frozenset()))
    monkeypatch.setattr(gc_mod, "graph_alternative", alternative)
    return offered


def test_replays_judge_the_plan_once_and_a_slower_plan_tried_gives_way_to_the_first(monkeypatch):
    model, train = _settled()
    offered = _offering(monkeypatch, train)
    first = train.plan
    tried = train.choice.graph_timed(100.0)
    assert offered == [(first, 100.0)] and first.measured["replay_ms"] == 100.0
    assert tried is not None and tried is not first
    assert tried.measured["chosen_by"] == "graph" and tried.measured["first_replay_ms"] == 100.0
    assert "graph_predicted_ms" in tried.measured
    layout = train.layout
    train.follow(tried)
    assert train.plan is tried and train.layout != layout        # a graph of the first plan drops
    for ids in batches(3):                                       # eager steps under it: no loss of a step
        with train.step():
            loss_of(model, ids).backward()
    back = train.choice.graph_timed(150.0)                              # its replays: 50% slower
    assert back is first and first.measured["tried_replay_ms"] == 150.0
    train.follow(back)
    assert train.plan is first
    assert not train.choice.graph_choice_open and train.choice.graph_timed(1.0) is None and len(offered) == 1


def test_a_plan_tried_that_replays_no_slower_stays_and_the_choice_closes(monkeypatch):
    _, train = _settled()
    _offering(monkeypatch, train)
    tried = train.choice.graph_timed(100.0)
    train.follow(tried)
    assert train.choice.graph_timed(101.0) is None                      # within VERIFY_SLACK of the first
    assert train.plan is tried and tried.measured["replay_ms"] == 101.0
    assert not train.choice.graph_choice_open


def test_no_alternative_closes_the_choice_after_one_look():
    _, train = _settled()
    first = train.plan
    assert train.choice.graph_timed(100.0) is None                      # no compute to fit: nothing better
    assert train.plan is first and first.measured["replay_ms"] == 100.0
    assert not train.choice.graph_choice_open


def test_a_plan_the_user_fixed_is_not_judged_by_replays():
    model, _, train = _tiered(recompute="never")
    for ids in batches(12):
        with train.step():
            loss_of(model, ids).backward()
    assert not train.choice.graph_choice_open and train.choice.graph_timed(1e6) is None


def test_follow_refuses_inside_a_step():
    model, train = _settled()
    with pytest.raises(TierMemError, match="between steps"), train.step():
        loss_of(model, batches(1)[0]).backward()
        train.follow(train.plan)


def test_an_alternative_the_eager_steps_refute_is_not_tried_and_the_choice_closes(monkeypatch):
    import tiermem.training.graphchoice as gc_mod
    _, train = _settled()
    _offering(monkeypatch, train)
    seen = []
    monkeypatch.setattr(gc_mod, "eager_refutes", lambda plan, alt: seen.append((plan, alt)) or True)
    first = train.plan
    assert train.choice.graph_timed(100.0) is None and train.plan is first
    assert len(seen) == 1 and seen[0][0] is first and seen[0][1] is not first
    assert first.measured["replay_ms"] == 100.0 and first.measured["graph_refuted_ms"] > 0
    assert not train.choice.graph_choice_open and "not tried" in first.table()
