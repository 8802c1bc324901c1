"""The training planner (NOTE [training plan]): pure logic, no GPU."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiermem.planning import StepTrace, TrainPlan, plan_training
from tiermem.training.plan import SavedRecord, evaluate, fit_compute, fit_link, scaled

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


# -- recompute (NOTE [recompute plan]) ---------------------------------------------------------------

def seg_trace(blocks=4, act=64 * MiB, saves=4, fwd_ms=1.0, param=10 * MiB, floor=100 * MiB,
              boundary=8 * MiB, compute=(4.0, 8.0), recomputable=None, other=0):
    """``blocks`` blocks whose forwards each save ``saves`` storages of ``act`` bytes in all and
    take ``fwd_ms``; ``other`` bytes saved outside every block (the loss's inputs)."""
    recs, i = [], 0
    for b in range(blocks):
        for _ in range(saves):
            recs.append((i, act // saves, b))
            i += 1
    if other:
        recs.append((i, other, -1))
        i += 1
    n = len(recs)
    saved = tuple(SavedRecord(j, nb, n - 1 - j, g) for j, nb, g in recs)
    rc = frozenset(range(blocks)) if recomputable is None else frozenset(recomputable)
    return StepTrace(saved, (param,) * blocks, (2 * param,) * blocks, floor, frozenset(),
                     block_fwd_ms=(fwd_ms,) * blocks, recomputable=rc, boundary_bytes=(boundary,) * blocks,
                     fwd_ms=compute[0], bwd_ms=compute[1], block_names=tuple(f"layer{b}" for b in range(blocks)))


def test_a_link_bound_step_recomputes_its_blocks_rather_than_swap_them():
    # 256 MiB of activations: ~5 ms over the link each way, 4 ms to recompute, 3 ms of other compute
    t = seg_trace(compute=(1.0, 2.0))
    p = plan_training(t, 100 * MiB + 80 * MiB, margin=0)
    assert len(p.recompute) >= 3 and p.kind in ("recompute", "mixed")
    never = plan_training(t, 100 * MiB + 80 * MiB, margin=0, recompute="never")
    assert not never.recompute
    assert p.predicted_seconds() < never.predicted_seconds()
    assert p.swapped_bytes < never.swapped_bytes / 2     # the recomputed blocks' inputs move, not their saves
    assert p.recomputed_bytes == len(p.recompute) * 64 * MiB
    assert p.recompute_ms == pytest.approx(len(p.recompute) * 1.0)
    assert p.predicted_peak <= p.budget


def test_an_expensive_forward_is_swapped_not_recomputed():
    t = seg_trace(act=4 * MiB, fwd_ms=50.0, compute=(200.0, 400.0))
    p = plan_training(t, 100 * MiB + 20 * MiB, margin=0)
    assert p.recompute == frozenset()


def test_recompute_needs_room_for_the_largest_segment_at_once():
    t = seg_trace()
    p = plan_training(t, 100 * MiB + 32 * MiB, margin=0)    # a 64 MiB segment does not fit
    assert p.recompute == frozenset()
    assert p.predicted_peak <= p.budget


def test_only_recomputable_blocks_are_recomputed_and_always_recomputes_them_all():
    t = seg_trace(recomputable={1, 2}, fwd_ms=30.0)
    p = plan_training(t, 100 * MiB + 80 * MiB, margin=0, recompute="always")
    assert p.recompute == frozenset({1, 2}) and p.kind == "recompute"
    assert plan_training(t, 100 * MiB + 80 * MiB, margin=0, recompute="never").recompute == frozenset()


def test_an_untimed_trace_plans_as_before():
    t = trace(saved=[8 * MiB] * 5)         # no segments, no timings: the swap-only plan
    p = plan_training(t, 100 * MiB + 60 * MiB + 16 * MiB, margin=0)
    assert p.kind == "swap" and p.recompute == frozenset() and p.keep == frozenset({3, 4})


def test_the_table_names_each_blocks_choice_and_the_measured_time():
    p = plan_training(seg_trace(compute=(1.0, 2.0)), 100 * MiB + 80 * MiB, margin=0)
    p.measured["step_ms"] = 20.0
    s = str(p)
    assert "layer0" in s and "recompute" in s and "predicted" in s and "measured" in s


def test_a_bad_recompute_mode_or_link_rate_is_a_value_error():
    with pytest.raises(ValueError, match="recompute"):
        plan_training(seg_trace(), 1 << 30, recompute="sometimes")
    with pytest.raises(ValueError, match="link_GBps"):
        plan_training(seg_trace(), 1 << 30, link_GBps=0)


@settings(max_examples=300, deadline=None)
@given(blocks=st.integers(1, 10), act=st.integers(1, 256 * MiB), saves=st.integers(1, 6),
       fwd_ms=st.floats(0.0, 40.0), param=st.integers(1, 64 * MiB), floor=st.integers(0, 512 * MiB),
       budget=st.integers(1, 4096 * MiB), margin=st.integers(0, 64 * MiB), boundary=st.integers(0, 32 * MiB),
       fwd=st.floats(0.0, 100.0), bwd=st.floats(0.0, 200.0), other=st.integers(0, 64 * MiB),
       rc=st.sets(st.integers(0, 9)), link=st.floats(1.0, 100.0),
       pool=st.sampled_from([0, 0, 1, 64 * MiB, 512 * MiB]))
def test_the_chosen_plan_fits_and_is_never_slower_than_swap_only_or_recompute_only(
        blocks, act, saves, fwd_ms, param, floor, budget, margin, boundary, fwd, bwd, other, rc, link, pool):
    t = seg_trace(blocks, act, saves, fwd_ms, param, floor, boundary, (fwd, bwd), rc, other)
    p = plan_training(t, budget, margin=margin, link_GBps=link, graph_pool=pool)
    swap = plan_training(t, budget, margin=margin, link_GBps=link, recompute="never", graph_pool=pool)
    rec = plan_training(t, budget, margin=margin, link_GBps=link, recompute="always", graph_pool=pool)
    if floor + margin + pool <= budget:
        assert p.predicted_peak + margin <= budget
        assert rec.predicted_peak + margin <= budget
    else:
        assert not p.keep and not p.resident_blocks and not p.recompute
    assert p.recompute <= t.recomputable
    assert p.predicted_seconds() <= swap.predicted_seconds() + 1e-9
    assert p.predicted_seconds() <= rec.predicted_seconds() + 1e-9
    assert not (p.keep & {r.index for r in t.saved if r.segment in p.recompute})   # recomputed: not kept too
    assert p.kept_bytes == sum(t.saved[i].nbytes for i in p.keep)
    assert p.swapped_bytes >= 0


def test_the_graphs_pool_is_held_whatever_the_plan_and_leaves_less_to_keep():
    """NOTE [replayed recompute]: the pool holds every recomputed block's backward, in place of
    the largest recomputed segment, and stays between steps, so a plan that keeps activations
    keeps fewer by the pool."""
    t = seg_trace(compute=(1.0, 2.0))
    budget = 100 * MiB + 200 * MiB
    bare = plan_training(t, budget, margin=0)
    held = plan_training(t, budget, margin=0, graph_pool=96 * MiB)
    assert held.graph_pool == held.recompute_peak == 96 * MiB
    assert held.predicted_peak <= budget and bare.predicted_peak <= budget
    assert held.kept_bytes + held.resident_block_bytes < bare.kept_bytes + bare.resident_block_bytes
    assert "graphs' pool" in str(held) and "graphs' pool" not in str(bare)
    # a pool the floor leaves no room for: nothing is kept, made resident or recomputed
    none = plan_training(t, 100 * MiB + 32 * MiB, margin=0, graph_pool=64 * MiB)
    assert not (none.keep or none.resident_blocks or none.recompute)
    with pytest.raises(ValueError, match="graph_pool"):
        plan_training(t, budget, graph_pool=-1)


def test_a_probe_measured_with_every_block_recomputed_predicts_its_own_compute_and_prices_the_hooks():
    """The probe step (NOTE [recompute plan]) measured forward and backward with blocks 0-3
    recomputed; the trace saw each block take 4.5 ms with its saves through the swap, 1.6 ms
    without (the GPT on the H100 at 2ed0d69)."""
    base = seg_trace(fwd_ms=1.6, compute=(30.0, 90.0))
    t = StepTrace(base.saved, base.block_param_bytes, base.block_state_bytes, base.floor_peak,
                  block_fwd_ms=(1.6,) * 4, block_swap_ms=(4.5,) * 4, measured_recompute=frozenset(range(4)),
                  recomputable=base.recomputable, boundary_bytes=base.boundary_bytes, fwd_ms=30.0, bwd_ms=90.0)
    always = plan_training(t, 1 << 34, margin=0, recompute="always")
    assert always.recompute == frozenset(range(4))
    assert always.fwd_ms == pytest.approx(30.0) and always.bwd_ms + always.recompute_ms == pytest.approx(90.0)
    never = plan_training(t, 100 * MiB + 80 * MiB, margin=0, recompute="never")
    assert never.fwd_ms == pytest.approx(30.0 + 4 * 2.9)                       # the hooks' host time, in forward
    assert never.bwd_ms == pytest.approx(90.0 - 4 * 1.6 + 4 * 2.9)              # no recompute; unpack's host time
    auto = plan_training(t, 100 * MiB + 80 * MiB, margin=0)
    assert auto.recompute and auto.predicted_seconds() < never.predicted_seconds()


def test_in_capacity_after_a_probe_everything_is_kept_and_nothing_recomputed():
    """Seen on the H100 at 877d8b9: in capacity, the plan after the probe recomputed a block
    because kept blocks were priced with the swap hooks' host time."""
    base = seg_trace(fwd_ms=1.6, compute=(30.0, 90.0))
    t = StepTrace(base.saved, base.block_param_bytes, base.block_state_bytes, base.floor_peak,
                  block_fwd_ms=(1.6,) * 4, block_swap_ms=(4.5,) * 4, measured_recompute=frozenset(range(4)),
                  recomputable=base.recomputable, boundary_bytes=base.boundary_bytes, fwd_ms=30.0, bwd_ms=90.0)
    p = plan_training(t, 1 << 34)
    assert p.recompute == frozenset() and p.swapped_bytes == 0 and len(p.resident_blocks) == 4


def test_clipping_counts_its_pass_in_the_predicted_step_and_the_bytes():
    """NOTE [clipping]: a streamed block's parameters, states and gradients cross in a pass after
    backward that overlaps no compute; the plan's step time and bytes count it."""
    t = seg_trace(act=4 * MiB, compute=(40.0, 80.0))         # compute-bound: the link is hidden
    budget = 100 * MiB + 70 * MiB
    plain = plan_training(t, budget, margin=0, recompute="never")
    clip = plan_training(t, budget, margin=0, recompute="never", clip=True)
    assert clip.clip and not plain.clip and "clipping pass" in clip.table()
    assert clip.resident_blocks == plain.resident_blocks and plain.streamed_blocks
    p = sum(clip.block_param_bytes[i] for i in clip.streamed_blocks)
    s = sum(clip.block_state_bytes[i] for i in clip.streamed_blocks)
    rate = clip.link_GBps * 1e9
    assert clip.predicted_seconds() == pytest.approx(plain.predicted_seconds() + (2 * p + s) / rate)
    assert clip.h2d_bytes == plain.h2d_bytes + 2 * p and clip.d2h_bytes == plain.d2h_bytes + p
    assert clip.predicted_peak <= budget


# -- calibrated compute (NOTE [calibrated compute]) -----------------------------------------------

@settings(max_examples=200, deadline=None)
@given(fwd=st.floats(0.5, 200.0), bwd=st.floats(0.5, 400.0), fwd_ms=st.floats(0.1, 20.0),
       act=st.integers(1 * MiB, 256 * MiB), budget=st.integers(100 * MiB, 2048 * MiB),
       link=st.floats(1.0, 100.0), target=st.floats(0.05, 20.0), mode=st.sampled_from(["always", "never", "auto"]),
       clip=st.booleans())
def test_the_fitted_compute_predicts_the_probes_time_or_the_nearest_a_factor_can(
        fwd, bwd, fwd_ms, act, budget, link, target, mode, clip):
    """A plan evaluated on the trace scaled by fit_compute's factor predicts the time it was
    fitted to, unless the link alone takes longer (the least factor then) or the factor would
    pass its bound; the choices stay the plan's, and only compute times change."""
    t = seg_trace(act=act, fwd_ms=fwd_ms, compute=(fwd, bwd))
    p = plan_training(t, budget, margin=0, link_GBps=link, recompute=mode, clip=clip)
    want = p.predicted_seconds() * 1e3 * target      # the probe's steps: faster or slower than the model
    f = fit_compute(p, want)
    q = evaluate(scaled(t, f), p)
    assert (q.resident_blocks, q.recompute, q.keep, q.kind) == (p.resident_blocks, p.recompute, p.keep, p.kind)
    assert (q.h2d_bytes, q.d2h_bytes, q.predicted_peak) == (p.h2d_bytes, p.d2h_bytes, p.predicted_peak)
    assert q.compute_scale == pytest.approx(f)
    got = q.predicted_seconds() * 1e3
    if 0.25 < f < 4.0:
        assert got == pytest.approx(want, rel=1e-6)
    elif f == 0.25:
        assert got >= want - 1e-9        # the link bounds the step above what was measured
    else:
        assert got <= want + 1e-9


def test_a_probe_slower_than_the_model_scales_every_plan_and_the_table_says_so():
    """The model predicts 40 ms of a compute-bound step; the probe's steps took 60: every plan
    made from the fitted trace carries 1.5x the compute, and the plan's table shows the factor."""
    t = seg_trace(act=4 * MiB, compute=(10.0, 30.0))
    budget = 100 * MiB + 200 * MiB
    p = plan_training(t, budget, margin=0, recompute="always")
    assert p.predicted_seconds() * 1e3 == pytest.approx(44.0)     # 40 ms, and 4 blocks of 1 ms recomputed
    f = fit_compute(p, 66.0)
    assert f == pytest.approx(1.5)
    base, again = plan_training(t, budget, margin=0), plan_training(scaled(t, f), budget, margin=0)
    assert again.compute_scale == pytest.approx(1.5) and base.compute_scale == 1.0
    assert (again.fwd_ms, again.bwd_ms, again.recompute_ms) == pytest.approx(
        (1.5 * base.fwd_ms, 1.5 * base.bwd_ms, 1.5 * base.recompute_ms))
    assert "x1.50, fitted to the probe's own steps" in again.table()
    assert "fitted" not in p.table()
    assert fit_compute(p, 0.0) == 1.0
    with pytest.raises(ValueError, match="compute scale"):
        scaled(t, 0.0)


def test_slots_for_recompute_gives_the_fewest_slots_that_recompute_the_most_blocks():
    """NOTE [a slot for recompute] in tiermem/training/choice.py, on a synthetic trace: segments of 64 MiB,
    slots of 40 MiB, a room of 30 MiB above the floor."""
    from tiermem.training.plan import slots_for_recompute
    t = seg_trace(act=64 * MiB, floor=100 * MiB)
    budget = 130 * MiB

    def everywhere(tr):
        return plan_training(tr, budget, margin=0, recompute="always")
    assert not everywhere(t).recompute                      # no segment fits the room
    assert slots_for_recompute(t, 40 * MiB, 3, everywhere) == 1     # 70 MiB of room: every block
    assert slots_for_recompute(t, 20 * MiB, 3, everywhere) == 2     # 50 MiB, then 70 MiB
    assert slots_for_recompute(t, 20 * MiB, 1, everywhere) == 0     # one spare slot is not enough
    assert slots_for_recompute(t, 40 * MiB, 0, everywhere) == 0
    roomy = dataclasses.replace(t, floor_peak=50 * MiB)
    assert len(everywhere(roomy).recompute) == 4
    assert slots_for_recompute(roomy, 40 * MiB, 3, everywhere) == 0   # nothing more to recompute


def test_a_step_slower_than_the_model_is_laid_to_the_link_first_and_then_recomputing_pays():
    """NOTE [calibrated compute]: the swap plan's steps took 1.6x what the model says. Laid to the
    compute (the metered times x1.6), recomputing looks dearer still and no block is recomputed;
    laid to the link (its time x1.6, the compute as metered), the plan made at that rate
    recomputes blocks rather than swap their saves. A compute-bound plan's slowness is not the
    link's: fit_link gives 1 and the compute is scaled as before."""
    t = seg_trace(act=64 * MiB, fwd_ms=2.0, compute=(2.0, 4.0))
    budget = 100 * MiB + 80 * MiB
    swap = plan_training(t, budget, margin=0, link_GBps=55, recompute="never")
    assert not plan_training(t, budget, margin=0, link_GBps=55).recompute
    want = swap.predicted_seconds() * 1e3 * 1.6
    k = fit_link(swap, want)
    assert k == pytest.approx(1.6)
    assert swap.predicted_seconds(55 / k) * 1e3 == pytest.approx(want)
    f = fit_compute(swap, want)
    assert f > 1 and not plan_training(scaled(t, f), budget, margin=0, link_GBps=55).recompute
    linked = plan_training(t, budget, margin=0, link_GBps=55 / k)
    assert len(linked.recompute) >= 2 and linked.predicted_seconds() < evaluate(
        t, dataclasses.replace(swap, link_GBps=55 / k)).predicted_seconds()
    linked.measured["link_scale"] = k
    assert "over 1.60, fitted to the probe's own steps" in linked.table()
    # compute-bound: no stretch of the link explains it
    c = plan_training(seg_trace(act=4 * MiB, compute=(10.0, 30.0)), 100 * MiB + 200 * MiB, margin=0,
                      recompute="always")
    assert fit_link(c, 66.0) == 1.0 and fit_compute(c, 66.0) == pytest.approx(1.5)
    assert fit_link(swap, 0.0) == 1.0 and fit_link(swap, swap.predicted_seconds() * 1e3 * 0.5) == 1.0


def parts_trace(blocks=4, part_saves=(16 * MiB, 40 * MiB, 8 * MiB), part_inputs=(4 * MiB, 4 * MiB, 4 * MiB),
                fwd_ms=1.0, **kw):
    """``seg_trace``'s blocks, each made of parts that save ``part_saves`` (NOTE [recompute in parts])."""
    recs, i = [], 0
    nparts = len(part_saves)
    for b in range(blocks):
        for k, n in enumerate(part_saves):
            recs.append((i, n, b, b * nparts + k))
            i += 1
    saved = tuple(SavedRecord(j, nb, len(recs) - 1 - j, g, k) for j, nb, g, k in recs)
    t = seg_trace(blocks=blocks, fwd_ms=fwd_ms, **kw)
    return dataclasses.replace(t, saved=saved, part_block=tuple(b for b in range(blocks) for _ in part_saves),
                               part_input_bytes=tuple(part_inputs) * blocks)


def test_a_block_whose_segment_does_not_fit_is_recomputed_in_parts():
    t = parts_trace(compute=(1.0, 2.0))
    # 64 MiB a segment does not fit in 60 MiB; in parts a block holds 12 MiB of inputs + its 40 MiB part
    p = plan_training(t, 100 * MiB + 60 * MiB, margin=0, recompute="always")
    assert p.recompute == frozenset(range(4)) and p.parts == frozenset(range(4))
    assert p.recompute_peak == 52 * MiB and p.predicted_peak <= p.budget
    assert p.recompute_ms == pytest.approx(8.0)      # the block's forward twice in its backward
    assert all(m == "recompute in parts" for m in p.segment_modes)
    assert "4 of them in parts" in p.table()
    auto = plan_training(t, 100 * MiB + 60 * MiB, margin=0)
    assert auto.parts and auto.predicted_peak <= auto.budget
    assert auto.predicted_seconds() < plan_training(t, 100 * MiB + 60 * MiB, margin=0,
                                                    recompute="never").predicted_seconds()
    # with room for a whole segment, a block is recomputed whole: in parts costs a forward more
    roomy = plan_training(t, 100 * MiB + 70 * MiB, margin=0, recompute="always")
    assert roomy.recompute == frozenset(range(4)) and not roomy.parts


def test_parts_that_hold_no_less_than_the_whole_segment_are_not_a_choice():
    # the inputs of the parts alone pass the segment's bytes: recomputing in parts saves nothing
    t = parts_trace(part_inputs=(30 * MiB, 30 * MiB, 30 * MiB))
    p = plan_training(t, 100 * MiB + 60 * MiB, margin=0, recompute="always")
    assert p.recompute == frozenset() and not p.parts
    one = dataclasses.replace(parts_trace(), part_block=(0,), part_input_bytes=(0,))   # one part: not a choice
    assert not plan_training(one, 100 * MiB + 60 * MiB, margin=0, recompute="always").parts


def test_wide_blocks_cost_their_gradients_home_and_back_and_a_pass_at_the_steps_end():
    # NOTE [wide blocks]: a streamed wide block's gradients go home and come back with its
    # parameters once more, and its step at the end overlaps nothing
    t = seg_trace(compute=(1.0, 2.0))
    wide = dataclasses.replace(t, wide_blocks=frozenset({0}))
    a = plan_training(t, 100 * MiB + 20 * MiB, margin=0, recompute="never", can_reside=[False] * 4)
    b = plan_training(wide, 100 * MiB + 20 * MiB, margin=0, recompute="never", can_reside=[False] * 4)
    p = 10 * MiB
    assert b.h2d_bytes - a.h2d_bytes == 2 * p and b.d2h_bytes - a.d2h_bytes == p
    tail = ((2 * p + 2 * p) + (p + 2 * p)) / (b.link_GBps * 1e9)
    assert b.predicted_seconds() == pytest.approx(a.predicted_seconds() + tail)
    assert "wide" in b.table()
    resident = plan_training(wide, 100 * MiB + 200 * MiB, margin=0, recompute="never")
    assert 0 in resident.resident_blocks and resident.h2d_bytes == plan_training(
        t, 100 * MiB + 200 * MiB, margin=0, recompute="never").h2d_bytes      # a resident block is not wide
