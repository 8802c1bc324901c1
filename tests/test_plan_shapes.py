"""The residency plan over generated model shapes (NOTE [no plan collapse] in
tiermem/inference/plan.py): one tensor bigger than the budget no longer makes the whole model read
in place, every group has one fate that fits the window, and a model with no big tensor gets the
plan it got before slots were chosen (the old rule is kept here as the reference)."""
from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tiermem.planning import plan_host, plan_residency


def _old_plan(sizes: list[tuple[str, int]], budget: int, lookahead: int) -> tuple[int, int] | None:
    """(slots, pinned bytes) of the rule before NOTE [no plan collapse]: the window holds
    ``lookahead`` slots of the largest streamed group, fewer if that does not fit; None when no
    slot fits (everything read in place)."""
    order = sorted(sizes, key=lambda x: -x[1])
    for la in range(lookahead, 0, -1):
        best = None
        for k in range(len(order)):
            head, rest = order[:k], order[k:]
            room = budget - la * rest[0][1] - sum(n for _, n in head)
            if room < 0:
                continue
            got = sum(n for _, n in head)
            for _, n in rest[1:]:
                if n <= room:
                    room -= n
                    got += n
            best = got if best is None else max(best, got)
        if best is not None:
            return la, best
    return None


@st.composite
def shapes(draw, cuttable: bool = True):
    """(sizes, units of the groups that can be cut, groups only embeddings read, budget, lookahead)."""
    n = draw(st.integers(1, 12))
    sizes = [(f"g{i}", draw(st.integers(1, 1 << 20))) for i in range(n)]
    units = {}
    if cuttable:
        for g, size in sizes:
            if draw(st.booleans()):
                units[g] = draw(st.integers(1, max(1, size // 4)))
    gathered = {g for g, _ in sizes if draw(st.integers(0, 9)) == 0}
    total = sum(s for _, s in sizes)
    budget = draw(st.integers(0, total + 10))
    return sizes, units, gathered, budget, draw(st.integers(1, 4))


def _check_fates(plan, sizes, units, gathered, budget, lookahead):
    size = dict(sizes)
    assert plan.pinned_bytes + plan.window <= budget
    assert plan.lookahead <= lookahead and plan.window == plan.lookahead * plan.slot
    for g, n in sizes:
        fates = [g in plan.pinned, g in gathered and g not in plan.pinned, g in plan.split, g in plan.oversized]
        assert sum(fates) <= 1, g
        streamed_whole = not any(fates)
        if plan.zero_copy_only:
            continue
        if streamed_whole:
            assert n <= plan.slot, (g, n, plan.slot)
        if g in plan.split:
            assert g in units and units[g] <= plan.slot < n
        if g in plan.oversized:
            assert n > plan.slot
    assert plan.split <= set(units) and not plan.split & gathered and not plan.oversized & gathered
    assert sum(n for g, n in sizes if g not in plan.pinned and g not in gathered) == plan.moved_bytes
    return size


@settings(max_examples=300, deadline=None)
@given(shapes())
def test_no_plan_collapse(shape):
    """No model is read wholly in place while its budget could hold a slot of the smallest piece
    that could stream (a group whole, or one part of a group that can be cut)."""
    sizes, units, gathered, budget, lookahead = shape
    plan = plan_residency(sizes, budget, lookahead, in_place=gathered, split=units, part_cost=0)
    _check_fates(plan, sizes, units, gathered, budget, lookahead)
    moving = [(g, n) for g, n in sizes if g not in gathered]
    if not moving or sum(n for _, n in moving) <= budget:
        assert not plan.zero_copy_only and all(g in plan.pinned for g, _ in moving)
        return
    smallest = min(min(n, units.get(g, n)) for g, n in moving)
    if budget >= smallest:
        # Something stays or streams; nothing streams only where a slot would hold no more
        # than what is pinned in its place.
        assert plan.window > 0 or plan.pinned & {g for g, _ in moving}, plan
        if plan.zero_copy_only:
            assert all(n > budget - plan.pinned_bytes for g, n in moving if g not in plan.pinned and g not in units)
    else:
        assert plan.zero_copy_only and not plan.pinned & {g for g, _ in moving}


@st.composite
def big_and_small(draw):
    """Layers that cannot be cut and tables that can, some bigger than the budget, and a budget
    that holds ``lookahead`` slots of the largest layer or part."""
    lookahead = draw(st.integers(1, 4))
    sizes = [(f"l{i}", draw(st.integers(1, 1000))) for i in range(draw(st.integers(0, 8)))]
    units = {}
    for i in range(draw(st.integers(1, 3))):
        sizes.append((f"t{i}", draw(st.integers(1, 1 << 20))))
        units[f"t{i}"] = draw(st.integers(1, 1000))
    need = max([n for g, n in sizes if g not in units] + list(units.values()))
    total = sum(n for _, n in sizes)
    assume(lookahead * need < total)
    return sizes, units, set(), draw(st.integers(lookahead * need, total - 1)), lookahead


@settings(max_examples=300, deadline=None)
@given(big_and_small())
def test_a_big_tensor_never_costs_the_slots_of_the_rest(shape):
    """Where every group that cannot be cut (and every part) fits ``lookahead`` slots, the plan
    keeps all of them, however big the groups that can be cut are, and reads none of the groups
    that cannot be cut in place."""
    sizes, units, gathered, budget, lookahead = shape
    moving = sizes
    plan = plan_residency(sizes, budget, lookahead, in_place=gathered, split=units, part_cost=0)
    assert plan.lookahead == lookahead and not plan.zero_copy_only
    assert not {g for g, _ in moving if g not in units} & plan.oversized


@settings(max_examples=300, deadline=None)
@given(shapes(cuttable=False))
def test_without_big_tensors_the_plan_is_the_one_before(shape):
    """Where the old rule read nothing in place, the new one keeps as many slots and pins at
    least as many bytes (and reads nothing in place either)."""
    sizes, _, _, budget, lookahead = shape
    assume(sum(n for _, n in sizes) > budget)
    old = _old_plan(sizes, budget, lookahead)
    plan = plan_residency(sizes, budget, lookahead)
    _check_fates(plan, sizes, {}, set(), budget, lookahead)
    if old is None:
        # The old rule read everything in place: a group too big for the budget left no slot for
        # the others. The new one streams what a slot holds and reads only the too big in place.
        assert all(n > plan.slot for g, n in sizes if g in plan.oversized)
        return
    assert plan.lookahead == old[0] and plan.pinned_bytes >= old[1] and not plan.oversized and not plan.zero_copy_only


def test_a_tied_table_bigger_than_the_budget_streams_in_parts_beside_the_layers():
    """The shape of issue 57: a 1.57 GB tied embedding against a 1.45 GB budget, and 64 layer
    groups of 66 MB. Before, no slot fitted and all 65 groups were read in place."""
    sizes = [("embed", 1_573_000_000)] + [(f"l{i}", 66_000_000) for i in range(64)]
    budget = 1_450_000_000
    assert _old_plan(sizes, budget, 3) is None
    plan = plan_residency(sizes, budget, 3, split={"embed": 6144})
    assert not plan.zero_copy_only and plan.lookahead == 3 and plan.split == {"embed"} and not plan.oversized
    assert plan.slot == 66_000_000 and len(plan.pinned) == (budget - 3 * 66_000_000) // 66_000_000
    # Without a way to cut it, the table is read in place whole and the layers still stream.
    plan = plan_residency(sizes, budget, 3)
    assert plan.oversized == {"embed"} and plan.lookahead == 3 and plan.pinned


def test_parts_that_cost_more_than_reading_in_place_are_not_made():
    """A table too big for the slots whose parts would be many and small is read in place: each
    part costs PART_COST (a copy call and a chunk's launches) beside its bytes."""
    sizes = [("embed", 1 << 20)] + [(f"l{i}", 1 << 16) for i in range(8)]
    plan = plan_residency(sizes, 600_000, 3, split={"embed": 256}, part_cost=4 << 20)
    assert plan.oversized == {"embed"} and not plan.split
    plan = plan_residency(sizes, 600_000, 3, split={"embed": 256}, part_cost=0)
    assert plan.split == {"embed"} and not plan.oversized
    # A group the slots could hold whole is never read in place by choice: it is cut instead.
    sizes = [("head", 100)] + [(f"l{i}", 10) for i in range(8)]
    plan = plan_residency(sizes, 330, 3, split={"head": 5}, part_cost=1000)
    assert "head" not in plan.oversized


def test_staging_holds_a_part_not_a_layer():
    """The disk tier's staging buffer is bounded by the slot: a layer of stacked experts bigger
    than a slot is staged a part at a time (issue 57: three buffers of a whole layer's experts)."""
    u = 1 << 16
    sizes = [("embed", 600 * u)] + [x for i in range(4) for x in ((f"attn{i}", 30 * u), (f"experts{i}", 1000 * u))]
    plan = plan_residency(sizes, 800 * u, 3, in_place={"embed"}, split={f"experts{i}": 10 * u for i in range(4)},
                          part_cost=0)
    assert plan.split and plan.slot < 1000 * u
    streamed = [(g, n) for g, n in sizes if g not in plan.pinned]
    host = plan_host(plan, streamed, 1800 * u, stages=3)
    assert host.on_disk and host.stage_bytes <= plan.slot and host.on_disk & plan.split
    assert host.pinned_host_bytes <= 1800 * u
    # Where parts cost more than reading in place, the experts are read in place, which needs
    # them in the home; with a host budget too small for that they stream their parts from disk.
    plan = plan_residency(sizes, 800 * u, 3, in_place={"embed"}, split={f"experts{i}": 10 * u for i in range(4)},
                          part_cost=1 << 40)
    assert plan.oversized and not plan.split
    streamed = [(g, n) for g, n in sizes if g not in plan.pinned]
    assert plan_host(plan, streamed, None).oversized == plan.oversized      # no disk tier: as planned
    host = plan_host(plan, streamed, 1800 * u, stages=3)
    assert host.split == plan.oversized and not host.oversized and host.on_disk
    assert host.stage_bytes <= plan.slot and host.pinned_host_bytes <= 1800 * u


@pytest.mark.parametrize("lookahead", [1, 3])
def test_a_budget_below_every_piece_reads_in_place(lookahead):
    plan = plan_residency([("a", 100), ("b", 100)], 50, lookahead, split={"a": 60})
    assert plan.zero_copy_only and not plan.pinned and plan.window == 0
    plan = plan_residency([("a", 100), ("b", 100)], 60, lookahead, split={"a": 60}, part_cost=0)
    assert not plan.zero_copy_only and plan.split == {"a"} and plan.oversized == {"b"}


def test_a_packed_plan_says_what_it_reads_in_place_and_what_it_packs():
    # Packing makes a group cross the link smaller; those saved bytes are not read in place. The
    # table names only the embedding as read in place, and the packed groups' size beside.
    sizes = [("emb", 400), ("l0", 1000), ("l1", 1000), ("l2", 1000), ("head", 400)]
    link = {"l0": 260, "l1": 260, "l2": 260, "head": 105}
    plan = plan_residency(sizes, 2200, lookahead=2, in_place=["emb"], link=link)
    streamed = [g for g, _ in sizes if g not in plan.pinned and g != "emb"]
    assert streamed and "emb" not in plan.pinned
    text = plan.table()
    assert f"{plan.moved_bytes / 1e9:8.3f} GB streamed" in text
    assert plan.moved_bytes == sum(link[g] for g in streamed)
    assert f"{400 / 1e9:.3f} GB read in place (embeddings)" in text
    assert f"packed from {sum(dict(sizes)[g] for g in streamed) / 1e9:.3f} GB in the model's dtype" in text
