"""From a traced step to the steps after it: the trace the plan is made from (what the swap saw,
what the hooks saw, the metered times), and a plan the choice takes applied to the steps (the
swap's keys, the blocks made resident, the slots, the cap, the recomputed blocks). Which plan is
training/choice.py's; the model of a step is training/plan.py's."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .floor import after_trace
from .plan import SavedRecord, StepTrace, TrainPlan
from .resident import make_resident
from .slots import Block, BlockSlots, aligned
from .stepstate import StepState

__all__ = ["PlanRunner"]

log = logging.getLogger("tiermem")


class PlanRunner:
    """Traces to plans and plans to steps, for one training. ``swap`` and ``hooks`` are set once
    the adoption has made them; ``set_cap()`` caps torch's allocator, ``graph_room()`` is the room
    the graphs' pool has (None before a step), ``outside()`` what torch held before wrapping."""

    def __init__(self, *, state: StepState, blocks: list[Block], stream: BlockSlots, choice: Any, replays: Any,
                 recomputing: Any, meter: Any, mem: Any, tier: Any, optimizer: Any, group: Any):
        self.state, self.blocks, self.stream, self.choice, self.replays = state, blocks, stream, choice, replays
        self.recomputing, self.meter, self.mem, self.tier, self.opt, self.group = (recomputing, meter, mem, tier,
                                                                                   optimizer, group)
        self.swap: Any = None
        self.hooks: Any = None
        self.host: Any = None                # HostSteps with host_step=True (NOTE [host stepping])
        self.shards: Any = None              # ShardedSteps with shard_steps=True (NOTE [sharded steps])
        self.configured = stream.nslots      # the slots the options ask for (the trace may stream through fewer)
        self.least = 2                       # the fewest a step streams through (NOTE [the floor])
        self.set_cap: Callable[[], None] = lambda: None
        self.graph_room: Callable[[], int | None] = lambda: None
        self.outside: Callable[[], int] = lambda: 0

    def timings(self) -> tuple[tuple[float, ...], float, float]:
        """Per block forward compute, forward and backward compute of the metered step (ms),
        waits taken out (NOTE [recompute plan]). Blocks not seen get -1."""
        self.mem.synchronize()
        spans = self.meter.spans()
        per = tuple(spans.get(("block", b.index), -1.0) for b in self.blocks)
        return per, spans.get(("fwd",), 0.0), spans.get(("bwd",), 0.0)

    def replan(self, floor: int) -> None:
        """The traced step is done, ``floor`` its peak: the trace, and the choice's plan from it."""
        st = self.state
        recs = self.swap.records() if self.swap is not None else []
        saved = tuple(SavedRecord(i, n, u, g, k) for i, n, u, g, k in recs)
        per, fwd, bwd = self.timings()
        shared = self.swap.shared_segments() if self.swap is not None else set()
        segs = {r.segment for r in saved}
        recomputable = frozenset(
            i for i in st.leaf
            if st.calls.get(i) == 1 and i not in shared and i in segs and per[i] >= 0
            and st.boundary.get(i, (0, 0))[1] <= sum(r.segment == i for r in saved))
        floor = max(floor - self.outside(), 0)
        st.floor = floor
        if self.host is not None:           # NOTE [host stepping]: before the slots are sized for the plan
            self.host.choose(self.blocks, list(st.order), bwd)
            if self.group is not None:
                self.host.agree(self.blocks, self.group, self.mem.device)
        self.stream.least_slot = 0           # NOTE [the floor]: the trace's slots were sized for states it made
        new_slot = aligned(self.stream.needed_slot_bytes())
        held = self.stream.nslots * self.stream.slot_bytes
        # the slots are as large as the largest streamed block with its states from now on: grown
        # where the optimizer made more than the floor at wrap counted, smaller where it made less
        floor = max(floor + self.stream.nslots * (new_slot - self.stream.slot_bytes), 0)
        st.budget_floor = after_trace(self.blocks, self.least, st.floor, held, self.tier.resident_bytes, saved,
                                      st.may_wide)
        self.choice.floor = st.budget_floor
        grow = self.configured - self.stream.nslots
        if grow > 0:
            # NOTE [the floor]: the trace streamed through the fewest slots; the plan gives the
            # steps after the rest where the budget holds them (NOTE [fewer slots])
            floor += grow * new_slot
            self.stream.nslots += grow
            self.stream.lookahead += grow
        trace = StepTrace(saved, tuple(b.p_bytes for b in self.blocks),
                          tuple(b.s_full for b in self.blocks), floor,
                          frozenset(b.index for b in self.blocks if b.resident),
                          block_fwd_ms=tuple(max(x, 0.0) for x in per), recomputable=recomputable,
                          boundary_bytes=tuple(st.boundary.get(b.index, (0, 0))[0] for b in self.blocks),
                          fwd_ms=fwd, bwd_ms=bwd, block_names=tuple(b.name for b in self.blocks),
                          block_state_moved_bytes=tuple(0 if b.host or b.peer else b.s_bytes for b in self.blocks),
                          part_block=tuple(b.index for b, _ in self.hooks.parts),
                          part_input_bytes=tuple(st.part_inputs.get(k, 0) for k in range(len(self.hooks.parts))),
                          wide_blocks=frozenset(b.index for b in self.blocks if b.wide))
        st.boundary_saves = {b.index: st.boundary.get(b.index, (0, 0))[1] for b in self.blocks}
        self.choice.replan(trace, st.floor, st.nesting)
        st.tracing = False

    def take(self, old: TrainPlan | None, plan: TrainPlan) -> None:
        """Apply ``plan``, which the choice now follows, to the steps (``old``: the plan before)."""
        st = self.state
        t = self.choice.trace
        self.replays.drop_pending()         # asked for at the old plan's slots
        if (self.replays.graphs and old is not None and st.general_peak is not None
                and self.replays.reserve > self.graph_room() - max(0, _general(plan) - _general(old))):
            # NOTE [replayed recompute]: the new plan keeps more on the device than the pool leaves room for
            self.replays.give_up("the new plan leaves no room for the graphs' pool")
        key: dict[int, tuple[int, int]] = {}
        count: dict[int, int] = {}
        for r in t.saved:                        # the swap's keys (NOTE [activation swap])
            key[r.index] = (r.segment, count.get(r.segment, 0))
            count[r.segment] = key[r.index][1] + 1
        st.keep_keys = frozenset(key[i] for i in plan.keep)
        st.expect = {}
        for r in t.saved:
            st.expect.setdefault(r.segment, ())
            st.expect[r.segment] += (r.nbytes,)
        # Swapped storages in the order backward first read them; a recomputed segment's inputs
        # are read when its backward begins, just before its own saves were.
        need: list[tuple[int, int]] = []
        done: set[int] = set()
        for r in sorted((r for r in t.saved if r.use >= 0), key=lambda r: r.use):
            if r.segment in plan.recompute:
                if r.segment not in done:
                    done.add(r.segment)
                    need += [(r.segment, k) for k in range(st.boundary_saves.get(r.segment, 0))]
            else:
                need.append(key[r.index])
        st.need = need
        for i in sorted(plan.resident_blocks):
            if not self.blocks[i].resident:
                self.make_resident(self.blocks[i])
        if self.shards is not None and not self.shards.agreed:
            # NOTE [sharded steps]: at the first plan, which every rank takes after its traced step
            shared = self.shards.agree(self.blocks)
            self.shards.drop(self.blocks, self.opt)
            self.choice.stream_only(shared, tuple(0 if b.host or b.peer else b.s_bytes for b in self.blocks))
        self.stream.alloc()
        self.set_cap()
        self.mem.empty_cache()
        self.recomputing.set({i: self.blocks[i].module for i in plan.recompute},
                             {i: [m for b, m in self.hooks.parts if b.index == i] for i in plan.parts})
        if plan.in_capacity and self.group is None:
            # In capacity: nothing moves, so no hook is needed, and a module with hooks takes
            # torch's slower call path. Steps are then plain steps on managed memory. (With a
            # process group the hooks stay: NOTE [data parallel].)
            self.hooks.remove(guards=False)
        log.info("tiermem: %s", (self.choice.plan or plan).table())

    def make_resident(self, b: Block) -> None:
        """Move ``b`` into managed memory kept on the device (NOTE [training transport])."""
        fixed = make_resident(self.tier, self.stream, self.opt, self.mem, b)
        if self.swap is not None:
            self.swap.fixed.update(fixed)


def _general(plan: TrainPlan) -> int:
    """A plan's predicted peak outside the graphs' pool (NOTE [replayed recompute])."""
    return plan.predicted_peak - plan.recompute_peak
