"""The training planner (NOTE [training plan]): pure logic, no GPU."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiermem import StepTrace, TrainPlan, plan_training
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


# -- keep, swap or recompute (NOTE [training plan], NOTE [step time model]) ----------------------------

from tiermem._trainplan import Segment  # noqa: E402

MS = 1e-3


def seg_trace(nseg=4, per=4, nbytes=8 * MiB, seg_fwd=2 * MS, outside=(), params=(10 * MiB,) * 4,
              floor=100 * MiB, fwd=10 * MS, bwd=20 * MS, input_bytes=2 * MiB, blocks_per_seg=1, slots=3):
    """Segments of ``per`` saved storages each, then ``outside`` storages saved after them (a head)."""
    recs, saves = [], []
    for s in range(nseg):
        for j in range(per):
            i = len(recs)
            recs.append(SavedRecord(i, nbytes, 0, s, seg_fwd * (j + 1) / per, 0.0))
            saves.append((i, s))
    for n in outside:
        i = len(recs)
        recs.append(SavedRecord(i, n, 0, -1, 0.0, 0.0))
        saves.append((i, -1))
    recs = [SavedRecord(r.index, r.nbytes, len(recs) - 1 - r.index, r.segment, r.recompute_s, 0.0) for r in recs]
    nb = len(params)
    segs = tuple(Segment(s, seg_fwd, input_bytes,
                         tuple(b for b in range(nb) if b * nseg // nb == s)[:blocks_per_seg]) for s in range(nseg))
    return StepTrace(tuple(recs), tuple(params), tuple(2 * p for p in params), floor, frozenset(),
                     segments=segs, saves=tuple(saves), fwd_s=fwd, bwd_s=bwd, slots=slots)


def test_the_step_time_model_by_hand():
    t = seg_trace(nseg=1, per=2, params=(10 * MiB,), fwd=1 * MS, bwd=2 * MS)
    p = plan_training(t, 100 * MiB, margin=0, mode="swap", link_GBps=10, duplex_GBps=15)
    # forward: max(1 ms, 10 MiB in / 10 GB/s, 16 MiB out / 10 GB/s, 26 MiB / 15 GB/s)
    f = max(1e-3, 10 * MiB / 10e9, 16 * MiB / 10e9, 26 * MiB / 15e9)
    # backward: in = params + states + swapped, out = params + states
    b = max(2e-3, 46 * MiB / 10e9, 30 * MiB / 10e9, 76 * MiB / 15e9)
    assert p.phases() == pytest.approx((f, b))
    assert p.predicted_seconds() == pytest.approx(f + b)


def test_a_slow_link_and_a_fast_forward_recompute_every_segment():
    t = seg_trace(seg_fwd=0.1 * MS, fwd=0.5 * MS, bwd=1 * MS)     # link-bound: 4.4 ms of copies
    p = plan_training(t, 100 * MiB + 4 * 2 * MiB + 32 * MiB, margin=0)
    assert p.recompute == frozenset(range(4))
    assert p.swapped_bytes == 0 and p.recomputed_bytes == t.saved_bytes
    assert set(p.choices().values()) == {"recompute"}
    assert p.recompute_s == pytest.approx(0.4 * MS)
    # inputs, plus one segment's saves at once less the largest, which the floor held already
    assert p.held_bytes == 4 * 2 * MiB + 3 * 8 * MiB
    assert p.predicted_peak <= p.budget


def test_a_slow_forward_swaps_instead():
    t = seg_trace(seg_fwd=500 * MS)
    p = plan_training(t, 1 << 31, margin=0)
    assert not p.recompute and p.recomputed_bytes == 0


def test_in_capacity_nothing_is_recomputed_or_swapped():
    p = plan_training(seg_trace(seg_fwd=0.01 * MS), 1 << 34)
    assert not p.recompute and p.swapped_bytes == 0 and len(p.resident_blocks) == 4


def test_recompute_mode_falls_back_to_swapping_when_it_does_not_fit():
    t = seg_trace(seg_fwd=0.1 * MS, input_bytes=64 * MiB)
    p = plan_training(t, 120 * MiB, margin=0, mode="recompute")
    assert not p.recompute
    p = plan_training(t, 1 << 31, margin=0, mode="recompute")
    assert p.recompute == frozenset(range(4))
    with pytest.raises(ValueError, match="mode"):
        plan_training(t, 1 << 31, mode="fast")


def test_a_storage_saved_in_a_recomputed_segment_and_again_outside_is_still_swapped():
    t = seg_trace(nseg=2, per=2)
    # record 1 (segment 0) is read again after segment 1, as a residual or a shared rotary table is
    t = StepTrace(t.saved, t.block_param_bytes, t.block_state_bytes, t.floor_peak, t.resident_blocks,
                  segments=t.segments, saves=t.saves[:2] + t.saves[2:] + ((1, -1),), fwd_s=t.fwd_s, bwd_s=t.bwd_s)
    assert t.visible(frozenset({0})) == (2, 3, 1)      # the swap first sees it after segment 1
    assert t.visible(frozenset({0, 1})) == (1,)
    assert t.visible(frozenset()) == (0, 1, 2, 3)
    # held: both inputs (2 x 2 MiB) and segment 1's two saves less one (8 MiB); nothing left to keep
    p = plan_training(t, 112 * MiB, margin=0, mode="recompute")
    assert p.choices() == {0: "recompute", 1: "swap", 2: "recompute", 3: "recompute"}
    assert p.held_bytes == 12 * MiB and p.swapped_bytes == 8 * MiB


def test_the_table_shows_each_segment_and_predicted_against_measured():
    import dataclasses
    p = plan_training(seg_trace(seg_fwd=0.1 * MS, fwd=0.5 * MS, bwd=1 * MS, outside=(8 * MiB,)),
                      100 * MiB + 48 * MiB, margin=0)
    s = p.table()
    assert "segment   0  recompute" in s and "outside" in s and "not measured yet" in s
    assert "predicted" in s
    s = dataclasses.replace(p, measured_s=0.0123).table()
    assert "12.3 ms measured" in s


@st.composite
def seg_traces(draw):
    nseg = draw(st.integers(0, 6))
    recs, saves = [], []
    for s in range(nseg):
        for _ in range(draw(st.integers(0, 5))):
            recs.append((draw(st.integers(1, 32 * MiB)), s))
    for _ in range(draw(st.integers(0, 5))):
        recs.append((draw(st.integers(1, 32 * MiB)), -1))
    saved = tuple(SavedRecord(i, n, len(recs) - 1 - i, s, 0.0) for i, (n, s) in enumerate(recs))
    saves = [(i, s) for i, (_, s) in enumerate(recs)]
    # some storages are saved again later, outside any segment
    for i in draw(st.lists(st.integers(0, max(len(recs) - 1, 0)), max_size=3)) if recs else []:
        saves.append((i, -1))
    nb = draw(st.integers(1, 8))
    params = tuple(draw(st.integers(1, 64 * MiB)) for _ in range(nb))
    segs = tuple(Segment(s, draw(st.floats(1e-6, 0.05)), draw(st.integers(0, 16 * MiB)),
                         tuple(draw(st.lists(st.integers(0, nb - 1), max_size=3, unique=True))))
                 for s in range(nseg))
    return StepTrace(saved, params, tuple(2 * p for p in params), draw(st.integers(0, 256 * MiB)), frozenset(),
                     segments=segs, saves=tuple(saves), fwd_s=draw(st.floats(0, 0.2)), bwd_s=draw(st.floats(0, 0.4)))


@settings(max_examples=300, deadline=None)
@given(t=seg_traces(), budget=st.integers(1, 1024 * MiB), margin=st.integers(0, 32 * MiB),
       link=st.floats(1, 100))
def test_the_chosen_plan_fits_and_is_never_predicted_slower_than_swap_only_or_recompute_only(t, budget, margin, link):
    kw = dict(margin=margin, link_GBps=link, duplex_GBps=1.6 * link)
    p = plan_training(t, budget, **kw)
    if t.floor_peak + margin <= budget:
        assert p.predicted_peak + margin <= budget
    else:
        assert not p.keep and not p.resident_blocks and not p.recompute
    swap_only = plan_training(t, budget, mode="swap", **kw)
    rc_only = plan_training(t, budget, mode="recompute", **kw)
    assert not swap_only.recompute
    assert p.predicted_seconds() <= swap_only.predicted_seconds() + 1e-12
    if t.segments and len(rc_only.recompute) == len(t.segments):
        assert p.predicted_seconds() <= rc_only.predicted_seconds() + 1e-12
    assert p.kept_bytes + p.swapped_bytes + p.recomputed_bytes == t.saved_bytes
    ch = p.choices()
    assert sum(t.saved[i].nbytes for i, c in ch.items() if c == "recompute") == p.recomputed_bytes
    assert all(t.saved[i].segment in p.recompute for i, c in ch.items() if c == "recompute")
    assert set(p.keep) <= set(p.visible)


def test_bf16_states_halve_the_state_bytes_moved_but_not_the_device_bytes_of_a_resident_block():
    t = seg_trace(nseg=0, per=0)
    t16 = StepTrace(t.saved, t.block_param_bytes, t.block_state_bytes, t.floor_peak,
                    block_state_moved=tuple(s // 2 for s in t.block_state_bytes))
    p32 = plan_training(t, 100 * MiB, margin=0)
    p16 = plan_training(t16, 100 * MiB, margin=0)
    assert p32.h2d_bytes - p16.h2d_bytes == 4 * 10 * MiB           # 20 MiB of states per block, halved
    assert p32.d2h_bytes - p16.d2h_bytes == 4 * 10 * MiB
    # residency still costs the fp32 states on the device
    r16 = plan_training(t16, 100 * MiB + 30 * MiB, margin=0)
    assert r16.resident_block_bytes == 30 * MiB
