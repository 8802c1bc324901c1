"""Which plan a training's steps follow (NOTE [measured choice]): the plan made from the traced
step, the probe's steps that measure recomputing everywhere, the check of the model's plan
against them, and the graph's replays' verdict (NOTE [graph choice] in training/graphchoice.py). It
times the steps and decides; tiermem.training.handle runs them and applies the plan it is given.

NOTE [measured choice]
    The plan's model of a step (NOTE [recompute plan]) adds up measured compute and bytes over
    the link, but what it cannot see, the host's work in the swap's hooks and how the copies
    share the link with the fills, makes it wrong by tens of per cent, enough to choose a plan
    slower than recomputing every block (docs/history.md, "Measurements behind the code's
    notes"). So the model proposes, and a measurement decides, as
    cuDNN's benchmark mode does for kernels. After the trace, the probe's plan (recompute every
    block that can be) runs PROBE_STEPS steps: the first pays for its allocations, the second is
    metered (the plan's model reads its blocks' compute), and the fastest of the last two is the
    probe's time (their mean is what the model's compute is fitted to before the plan after it
    is made: NOTE [calibrated compute] in training/plan.py). The plan made after it runs
    VERIFY_STEPS steps and the fastest after the first
    is timed too (one slow step of a host-bound run can overturn a plan). A plan in capacity, which moves and
    recomputes nothing, is kept without the check: it does less than the probe. If the plan was
    more than VERIFY_SLACK slower than the probe, the steps go back to recomputing everywhere
    (planned again from the blocks now resident, if that still fits). A plan the check kept is
    checked once more, on the median of its next LATE_STEPS timed steps (read from the steps'
    own events as they complete, no wait): more than LATE_SLACK slower than the probe, and the
    steps go back to recomputing everywhere. The model's plan is not even tried unless it predicts
    a step at least MIN_GAIN faster than the probe's plan does (from the same fitted times): the
    model is optimistic about plans unlike the probe's, whose own prediction is fitted to the
    probe's steps, and a gain smaller than the steps' own spread is not one the check can see.
    Two timed steps a side decide on a host whose tiermem steps wander by tens of per cent
    within one run, which is why a kept plan is checked again on a median. ``train.plan.measured``
    keeps the times (``checked_ms``, ``probe_ms``, ``late_ms``). The probe is timed on its
    unmetered steps: the meter's events cost the host's time. The runs behind each of these are
    in docs/history.md, "Measurements behind the code's notes".

NOTE [fewer slots]
    The traced step holds its floor within the budget, but the steps after it hold more:
    the slots grow to bring each block's optimizer states in (the trace's first step made
    them). Where the traced step's peak with the grown slots, plus tiermem's resident
    bytes, would pass the budget, the ring gives up slots, one at a time, down to two
    (one in use, one filling) or to the streamed blocks the traced step used at once plus
    one: each slot fewer is one block's parameters, gradients and states fewer, and one
    block fewer brought in ahead of use. If that is not enough, the step is refused with
    what it needs, rather than torch's allocator running out in the next step (docs/history.md,
    "Measurements behind the code's notes").

NOTE [a slot for recompute]
    Recomputing a block holds its whole segment in its backward (NOTE [recompute plan]), so
    the plan recomputes only the blocks whose segment fits the room the floor leaves, and
    swaps the rest at twice their bytes over the link. A slot is a block's parameters,
    gradients and optimizer states; giving one up costs a block of lookahead. Where it lets
    recomputing everywhere recompute more blocks, the slot goes (docs/history.md,
    "Measurements behind the code's notes").
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import OutOfBudgetError
from .plan import StepTrace, TrainPlan, evaluate, fit_compute, fit_link, plan_training, scaled, slots_for_recompute
from .slots import Block, BlockSlots, aligned

__all__ = ["PlanChoice", "PROBE_STEPS", "VERIFY_STEPS", "LATE_STEPS", "LATE_SLACK"]

log = logging.getLogger("tiermem")

PROBE_STEPS = 4     # steps under the probe's plan: the second is metered, the last two timed (NOTE [measured choice])
RECAPTURE_STEPS = 4  # steps a probe or check may repeat because graphs changed in them (NOTE [replayed recompute])
VERIFY_STEPS = 3    # steps under the plan made after it; the fastest after the first is timed against the probe
VERIFY_SLACK = 0.02
MIN_GAIN = 0.05     # the model's plan is tried only if predicted this much faster than the probe's (NOTE [measured choice])
LATE_STEPS = 8      # timed steps of a kept plan whose median is checked against the probe once more
LATE_SLACK = 0.10


class PlanChoice:
    """The plan a :class:`~tiermem.training.handle.TieredTraining` follows, and the steps' times it is
    chosen by. ``take(old, new)`` applies a plan to the steps (the handle's); ``timings()``
    reads the metered step (per block forward, forward, backward ms); ``resident_bytes()`` is
    tiermem's resident managed bytes now."""

    def __init__(self, *, backend: Any, blocks: Sequence[Block], stream: BlockSlots, replays: Any, budget: int,
                 margin: int | None, mode: str, link_GBps: float, clip: bool,
                 take: Callable[[TrainPlan | None, TrainPlan], None],
                 timings: Callable[[], tuple[tuple[float, ...], float, float]],
                 resident_bytes: Callable[[], int]):
        self.be, self.blocks, self.stream, self.replays = backend, blocks, stream, replays
        self.budget, self.mode, self.link_GBps, self.clip = budget, mode, link_GBps, clip
        self.link_scale = 1.0                  # the link's time stretched to fit the steps (NOTE [calibrated compute])
        self.margin = budget // 8 if margin is None else margin
        self._apply, self._timings, self._resident_bytes = take, timings, resident_bytes
        self.plan: TrainPlan | None = None
        self.trace: StepTrace | None = None
        self.floor: Any = None                 # NOTE [the floor]: the training's Floor, once known
        self.streamed_only: frozenset[int] = frozenset()   # blocks no plan may keep resident (NOTE [sharded steps])
        self.no_recompute = False              # recompute moved other segments' saves: plan without it
        self.refine = 0                        # steps left under the probe's plan (NOTE [measured choice])
        self._calibrating = False              # ... measured only for its times (NOTE [calibrated compute])
        self._refined: StepTrace | None = None   # the trace with the metered probe step's compute
        self._probe_ms: list[float] = []       # the probe's timed steps, unmetered
        self.verify = 0                        # steps left before the plan is checked against the probe
        self._verify_ms: list[float] = []      # its timed steps
        self._recaptures = 0                   # probe or check steps repeated since graphs changed in them
        self._probe: tuple[TrainPlan, float] | None = None   # the probe's plan and its measured step (ms)
        self._late_probe_ms = 0.0              # the probe's time a kept plan is checked against again
        self._late_ms: list[float] | None = None   # that plan's timed steps since it was kept
        self._graph_try: Any = None            # NOTE [graph choice]: None, (first plan, its replay ms), "done"
        self._step_events: Any = None          # (start, end, timed) of the step running or just finished
        self._timing: list[tuple[Any, Any]] = []   # finished updating steps' events, not read yet
        self.step_ms: list[float] = []         # measured step times since the last plan (the last 64)

    # -- plans -------------------------------------------------------------------------------------
    def _resident(self) -> frozenset[int]:
        return frozenset(b.index for b in self.blocks if b.resident)

    def planned(self, trace: StepTrace, mode: str | None = None) -> TrainPlan:
        """The plan for ``trace`` (mode as plan_training's ``recompute``; None: the handle's own),
        with the graphs' pool held; no side effect (see plan_for)."""
        mode = mode or ("never" if self.no_recompute else self.mode)
        return plan_training(trace, self.budget, margin=self.margin, can_reside=self._can_reside(), recompute=mode,
                             link_GBps=self.link_GBps, clip=self.clip, graph_pool=self.replays.reserve)

    def plan_for(self, trace: StepTrace, mode: str | None = None) -> TrainPlan:
        mode = mode or ("never" if self.no_recompute else self.mode)
        plan = self.planned(trace, mode)
        if plan.graph_pool and plan.predicted_peak > self.budget - self.margin:
            # NOTE [replayed recompute]: the floor and the pool together pass the budget
            self.replays.give_up("the budget leaves no room for the graphs' pool beside the step's floor")
            plan = plan_training(trace, self.budget, margin=self.margin, can_reside=self._can_reside(),
                                 recompute=mode, link_GBps=self.link_GBps, clip=self.clip)
        return plan

    def _can_reside(self) -> list[bool] | None:
        if not self.streamed_only:
            return None
        return [i not in self.streamed_only for i in range(len(self.blocks))]

    def stream_only(self, blocks: frozenset[int], state_moved: tuple[int, ...]) -> None:
        """NOTE [sharded steps]: ``blocks`` stay streamed in every plan from now on, and each
        block moves ``state_moved`` bytes of optimizer states a step; the plan taken is predicted
        again with them."""
        self.streamed_only = frozenset(blocks)
        if self.trace is None:
            return
        self.trace = dataclasses.replace(self.trace, block_state_moved_bytes=state_moved)
        if self.plan is not None:
            plan = evaluate(self.trace, self.plan)
            plan.measured.update(self.plan.measured)
            self.plan = self._linked(self._floored(plan))

    def _floored(self, plan: TrainPlan) -> TrainPlan:
        """``plan`` with the training's floor, for its table (NOTE [the floor])."""
        f = self.floor
        if f is None or (plan.budget_floor, plan.floor_what) == (f.bytes, f.what):
            return plan
        return dataclasses.replace(plan, budget_floor=f.bytes, floor_what=f.what)

    def _linked(self, plan: TrainPlan) -> TrainPlan:
        """``plan`` with the link's fitted stretch in its measurements, for its table (NOTE
        [calibrated compute])."""
        if self.link_scale != 1.0:
            plan.measured["link_scale"] = self.link_scale
        return plan

    def take(self, plan: TrainPlan) -> None:
        """Make ``plan`` the one the next steps follow."""
        old, self.plan = self.plan, self._floored(plan)
        self._apply(old, plan)

    def replan(self, trace: StepTrace, floor: int, nesting: int) -> None:
        """The traced step's ``trace`` is in (``floor``: its peak, everything moving; ``nesting``:
        the streamed blocks it used at once): fit the slots, and take the probe's plan, or the
        plan itself where there is no choice to measure."""
        old = self.trace
        self.trace = trace
        new_slot = aligned(self.stream.needed_slot_bytes())
        self._fit_slots(new_slot, floor, nesting)
        if old is not None and old.key == trace.key and self.plan is not None and self.plan.recompute:
            # The same shapes diverged under a plan that recomputed: recomputing moved saves
            # from one segment to another. Plan without it from now on.
            log.info("tiermem: recomputing changed the step's saves; planning without recompute")
            self.no_recompute = True
        if self.mode != "never" and not self.no_recompute and trace.recomputable:
            self._slots_for_recompute(new_slot, nesting)
        # The next step is the probe (NOTE [recompute plan]): every block that can be recomputed
        # is, and its forward is timed without the swap's hooks; the plan after it uses both.
        probe = bool(self.trace.recomputable) and self.mode == "auto" and not self.no_recompute
        plan = self.plan_for(self.trace, "always" if probe else None)
        # NOTE [calibrated compute]: a plan with no choice to check is measured the same way,
        # for the times its prediction is made of, where it moves or recomputes anything
        self._calibrating = not probe and not plan.in_capacity
        self.refine = PROBE_STEPS if probe or self._calibrating else 0
        self._refined, self._probe_ms = None, []
        self.verify = 0
        self.take(plan)
        self.restart_timing()

    def _fit_slots(self, slot: int, floor: int, nesting: int) -> None:
        """NOTE [fewer slots]."""
        st = self.stream
        while True:
            need = self.trace.floor_peak + self._resident_bytes()     # measured, nothing kept
            if need <= self.budget:
                return
            least = max(2, nesting + 1)
            if st.nslots <= least:
                at_least = max(need, self.floor.bytes if self.floor is not None else 0)
                what = f"; this training's floor is {self.floor} (NOTE [the floor])" if self.floor is not None else ""
                raise OutOfBudgetError(need, 0, self.budget, hint=(
                    f"the traced step held {floor:,} bytes with every block streamed and every "
                    f"activation moved, and its {st.nslots} slots must grow to {slot:,} bytes each to bring "
                    f"the optimizer states in{what}; raise the budget to at least {at_least:,} bytes, or wrap "
                    "with a smaller block_bytes, or train on smaller batches (NOTE [fewer slots])"))
            log.warning("tiermem: a budget of %s bytes holds the step only with %d slots, not %d: lookahead "
                        "lowered to %d (NOTE [fewer slots])", f"{self.budget:,}", st.nslots - 1, st.nslots,
                        st.lookahead - 1)
            self._give_slot(slot)

    def _slots_for_recompute(self, slot: int, nesting: int) -> None:
        """NOTE [a slot for recompute]."""
        st = self.stream
        spare = st.nslots - max(2, nesting + 1)
        give = slots_for_recompute(self.trace, slot, spare, lambda t: self.planned(t, "always"))
        if give:
            before = len(self.planned(self.trace, "always").recompute)
            log.info("tiermem: %d slot(s) fewer let recomputing everywhere recompute more blocks than %d of %d: "
                     "lookahead lowered to %d (NOTE [a slot for recompute])", give, before,
                     len(self.trace.recomputable), st.lookahead - give)
        for _ in range(give):
            self._give_slot(slot)

    def _give_slot(self, slot: int) -> None:
        """One slot, and a block of lookahead, fewer; the floor the trace measured, one slot less."""
        st = self.stream
        st.nslots -= 1
        st.lookahead -= 1
        self.trace = dataclasses.replace(self.trace, floor_peak=max(self.trace.floor_peak - slot, 0))

    # -- the measured choice -----------------------------------------------------------------------
    @property
    def metering_next(self) -> bool:
        """The next step is the probe's metered one (NOTE [measured choice])."""
        return self.refine == PROBE_STEPS - 1

    @property
    def settled(self) -> bool:
        """No phase of the measured choice is left to run."""
        return not self.refine and not self.verify and self._late_ms is None and self._probe is None

    def after_step(self, metered: bool, graphs_changed: bool) -> None:
        """An updating step under the plan finished (``metered``: the meter ran in it;
        ``graphs_changed``: it captured, measured or gave up recompute graphs)."""
        if (self.refine or self.verify) and graphs_changed and self._recaptures < RECAPTURE_STEPS:
            # NOTE [replayed recompute]: a step that captured, measured or gave up graphs paid
            # for it; the phase's timed step runs again
            self._recaptures += 1
        elif (not self.refine and self.plan is not None
              and abs(self.replays.reserve - self.plan.graph_pool) > self.budget // 32):
            self._reserve_pool()
        elif self.refine:
            self._recaptures = 0
            self.refine -= 1
            if self.refine == PROBE_STEPS - 2:
                if metered:
                    self._measure_probe()
                else:
                    self.refine = 0          # nothing measured: the probe's plan stays
            elif self.refine < PROBE_STEPS - 2:
                self._probe_ms.append(self.last_step_ms())
                if not self.refine:
                    self._replan_measured()
        elif self.verify:
            self._recaptures = 0
            self.verify -= 1
            if self.verify < VERIFY_STEPS - 1:
                self._verify_ms.append(self.last_step_ms())
            if not self.verify:
                self._check_against_probe()
        elif self._late_ms is not None and len(self._late_ms) >= LATE_STEPS:
            self._check_late()

    def _check_against_probe(self) -> None:
        """NOTE [measured choice]: keep the model's plan only if it ran no slower than the probe's
        plan (recompute everywhere) did; else go back to recomputing everywhere."""
        probe, probe_ms = self._probe or (None, 0.0)
        self._probe = None
        timed, self._verify_ms = [x for x in self._verify_ms if x], []
        ms = min(timed, default=0.0)
        if probe is None or not ms or not probe_ms:
            return
        self.plan.measured.update(checked_ms=ms, probe_ms=probe_ms)
        p = self.plan
        if p.in_capacity:
            return                    # in capacity: it does less than the probe
        if ms > probe_ms * (1 + VERIFY_SLACK) and self._back_to_probe(ms, probe_ms):
            return
        # Kept: its next timed steps are checked once more (NOTE [measured choice]). This step's
        # time was read above; the ones after it count.
        self.read_times()
        self._late_probe_ms, self._late_ms = probe_ms, []

    def _check_late(self) -> None:
        """NOTE [measured choice]: the median of a kept plan's first LATE_STEPS timed steps after
        the check, against the probe's time; more than LATE_SLACK slower goes back to
        recomputing everywhere. Once: the plan is not checked again."""
        got, self._late_ms = sorted((self._late_ms or [])[:LATE_STEPS]), None
        ms = got[len(got) // 2]
        self.plan.measured["late_ms"] = ms
        if ms > self._late_probe_ms * (1 + LATE_SLACK):
            self._back_to_probe(ms, self._late_probe_ms, late=True)

    def _back_to_probe(self, ms: float, probe_ms: float, late: bool = False) -> bool:
        """Take the recompute-everywhere plan, made from the blocks now resident, where it still
        fits; ``ms`` is what the model's plan took, ``probe_ms`` what the probe's did."""
        t = dataclasses.replace(self.trace, resident_blocks=self._resident())
        back = self.plan_for(t, "always")
        if back.predicted_peak > self.budget - back.margin:
            return False              # blocks the model made resident leave no room for it
        log.info("tiermem: the plan's step took %.1f ms%s, the probe's (recompute everywhere) %.1f ms: "
                 "recomputing everywhere", ms, " over its later steps" if late else "", probe_ms)
        if late:
            back.measured.update(checked_ms=self.plan.measured["checked_ms"], late_ms=ms, probe_ms=probe_ms,
                                 chosen_by="late")
        else:
            back.measured.update(checked_ms=ms, probe_ms=probe_ms, chosen_by="measured")
        self.take(back)
        self.restart_timing()
        return True

    def _reserve_pool(self) -> None:
        """NOTE [replayed recompute]: the graphs' pool is not what the plan left room for (the
        first measured backward came under a plan made before it, or the graphs were given up):
        plan again, and time the check's steps again under the new plan."""
        log.info("tiermem: the graphs' pool needs %.0f MB, the plan left %.0f MB; planning again",
                 self.replays.reserve / 1e6, self.plan.graph_pool / 1e6)
        plan = self.plan_for(self.trace)
        if self.verify:
            self.verify, self._verify_ms = VERIFY_STEPS, []
        self.take(plan)
        self.restart_timing()

    def _measure_probe(self) -> None:
        """After the probe's metered step (NOTE [recompute plan]): its recomputed blocks' forwards
        are their compute alone; the trace's are the same forwards with the swap's hooks."""
        per, fwd, bwd = self._timings()
        t = self.trace
        probe = self.plan.recompute
        clean = tuple(per[i] if i in probe and per[i] >= 0 else old for i, old in enumerate(t.block_fwd_ms))
        self._refined = dataclasses.replace(t, block_fwd_ms=clean, block_swap_ms=t.block_fwd_ms, fwd_ms=fwd,
                                            bwd_ms=bwd, measured_recompute=probe)
        self._probe_ms = []

    def _replan_measured(self) -> None:
        """Plan again from the probe's metered step, once its unmetered steps are timed (NOTE
        [measured choice]); the plan is checked against the fastest of them."""
        timed, self._probe_ms = [x for x in self._probe_ms if x], []
        probe_ms = min(timed, default=0.0)
        refined, self._refined = self._refined, None
        calibrating, self._calibrating = self._calibrating, False
        if refined is None:
            return
        self.trace = dataclasses.replace(refined, resident_blocks=self._resident())
        if timed:
            # NOTE [calibrated compute]: the model's times, fitted to the probe's own steps: the
            # link's time stretched where that explains them, else the compute scaled
            mean = sum(timed) / len(timed)
            k = fit_link(evaluate(self.trace, self.plan), mean)
            self.link_GBps /= k
            self.link_scale *= k
            now = dataclasses.replace(self.plan, link_GBps=self.link_GBps)
            self.trace = scaled(self.trace, fit_compute(evaluate(self.trace, now), mean))
        now = dataclasses.replace(self.plan, link_GBps=self.link_GBps)
        if calibrating:
            # the same choices ("never", "always", nothing to recompute), predicted anew
            plan = evaluate(self.trace, now)
            plan.measured.update(self.plan.measured)
            self.plan = self._linked(self._floored(plan))
            return
        plan = self._linked(self.plan_for(self.trace))
        if (plan.resident_blocks, plan.recompute, plan.keep, plan.parts) != (
                self.plan.resident_blocks, self.plan.recompute, self.plan.keep, self.plan.parts):
            probe = self._linked(evaluate(self.trace, now))
            if not plan.in_capacity and plan.predicted_seconds() > probe.predicted_seconds() * (1 - MIN_GAIN):
                # NOTE [measured choice]: a gain this small is not worth trying
                probe.measured.update(self.plan.measured, model_ms=plan.predicted_seconds() * 1e3)
                self.plan = self._floored(probe)
                return
            self._probe = (self.plan, probe_ms)
            self.verify, self._verify_ms = VERIFY_STEPS, []
            self.take(plan)
            self.restart_timing()
        else:
            self.plan = self._floored(plan)

    # -- the graph's replays (NOTE [graph choice] in training/graphchoice.py) ------------------------------
    @property
    def graph_choice_open(self) -> bool:
        """A graph's replays still decide the plan (NOTE [graph choice]): the measured choice's
        plan was auto, moves something, and has not been judged by replays."""
        return (self._graph_try != "done" and self.mode == "auto" and not self.no_recompute
                and self.plan is not None and not self.plan.in_capacity)

    def graph_timed(self, replay_ms: float) -> TrainPlan | None:
        """The median of a captured plan's timed replays (NOTE [graph choice]): the plan to
        follow instead, or None. The caller drops its graph first (its pool and the new plan's
        slots would not both fit), then has the handle ``follow`` it; the steps run eagerly
        until it settles."""
        from .graphchoice import eager_refutes, graph_alternative, keep_tried
        if not self.graph_choice_open or not replay_ms > 0:
            return None
        trying, self._graph_try = self._graph_try, "done"
        p = self.plan
        p.measured["replay_ms"] = round(replay_ms, 3)
        resident = self._resident()
        if trying is None:
            t = dataclasses.replace(self.trace, resident_blocks=resident)
            _, alt = graph_alternative(t, p, replay_ms, self.plan_for, MIN_GAIN)
            if alt is None:
                return None
            alt = self._floored(alt)          # the plan handed out is the one take() keeps
            if eager_refutes(p, alt):
                p.measured["graph_refuted_ms"] = round(alt.predicted_seconds() * 1e3, 3)
                log.info("tiermem: the model fitted to the graph's replays (%.1f ms) predicts %.1f ms for a plan "
                         "recomputing fewer blocks, which the eager steps found slower: not tried (NOTE [graph "
                         "choice])", replay_ms, alt.predicted_seconds() * 1e3)
                return None
            alt.measured.update(graph_predicted_ms=round(alt.predicted_seconds() * 1e3, 3),
                                first_replay_ms=round(replay_ms, 3), chosen_by="graph")
            log.info("tiermem: the graph replayed its plan in %.1f ms; the model fitted to its replays "
                     "predicts %.1f ms for %s (%d blocks recomputed, %d before): trying it (NOTE [graph choice])",
                     replay_ms, alt.predicted_seconds() * 1e3, alt.kind, len(alt.recompute), len(p.recompute))
            self._graph_try = (p, replay_ms)
            return alt
        first, first_ms = trying
        if keep_tried(replay_ms, first_ms, VERIFY_SLACK) or not resident <= frozenset(first.resident_blocks):
            return None
        log.info("tiermem: the plan tried replayed in %.1f ms, the first in %.1f ms: back to the first "
                 "(NOTE [graph choice])", replay_ms, first_ms)
        first.measured.update(tried_replay_ms=round(replay_ms, 3),
                              tried_predicted_ms=p.measured.get("graph_predicted_ms"))
        return first

    # -- step times --------------------------------------------------------------------------------
    def step_begun(self) -> Any:
        """A step starts on the compute stream: its start event, recorded (what fills wait for)."""
        be = self.be
        start, end = be.new_event(timing=True), be.new_event(timing=True)
        be.record(start, be.current_stream())
        self._step_events = (start, end, False)
        return start

    def step_ended(self, updating: bool) -> None:
        """The step's work is queued: its end event; only updating steps are timed."""
        if self._step_events is not None:
            start, end, _ = self._step_events
            self.be.record(end, self.be.current_stream())
            self._step_events = (start, end, updating)

    def drop_step_events(self, pending: bool = False) -> None:
        """The step's events time nothing (it failed, or was captured, not run); with
        ``pending`` the finished steps' events not read yet go too."""
        self._step_events = None
        if pending:
            self._timing = []

    def read_times(self) -> None:
        """Finished steps' times on the compute stream, read once their end events have completed.
        The host runs ahead of the GPU, so the last step's has often not: it waits for a later
        step. (Read only when already complete, the times came from the steps the host had waited
        for, longer than the steps themselves: docs/history.md, "Measurements behind the code's
        notes".) Micro-batches that do not
        update are not what the plan predicts (NOTE [accumulation]): left out."""
        ev, self._step_events = self._step_events, None
        if ev is not None and ev[2]:
            self._timing.append((ev[0], ev[1]))
        be = self.be
        while self._timing and be.query(self._timing[0][1]):
            start, end = self._timing.pop(0)
            ms = be.elapsed_ms(start, end)
            self.step_ms.append(ms)
            if self._late_ms is not None:
                self._late_ms.append(ms)
        del self._timing[:-16]          # a GPU that far behind: its oldest are not waited for
        del self.step_ms[:-64]
        if self.step_ms and self.plan is not None:
            ms = sorted(self.step_ms[-10:])
            self.plan.measured["step_ms"] = ms[len(ms) // 2]

    def restart_timing(self) -> None:
        """A new plan: the steps timed so far, the one just finished too, were another plan's."""
        self.step_ms, self._timing = [], []
        self._late_ms = None
        if self._step_events is not None:
            self._step_events = (*self._step_events[:2], False)

    def last_step_ms(self) -> float:
        """The step just finished, on the compute stream (waits for it). 0 when not timed."""
        ev = self._step_events
        if ev is None or not ev[2]:
            return 0.0
        self.be.synchronize(ev[1])
        return float(self.be.elapsed_ms(ev[0], ev[1]))
