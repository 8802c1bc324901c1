"""A tiered training's step, begun and ended, and its optimizer steps: each streamed block stepped
as soon as its gradients are complete (or its gradients sent home, NOTE [accumulation]), the
resident blocks stepped at the step's end, the gradients averaged over a process group (NOTE
[data parallel]), and a failed step cleared. The hooks (training/hooks.py) hand it the blocks;
the handle (training/handle.py) opens and closes the step around the caller's forward and
backward.

NOTE [kept exceptions]
    The cap on torch's allocator leaves the step the budget and no more. A step that raised
    leaves its activations referenced by the exception's traceback frames for as long as the
    caller keeps the exception (``except ... as e: saved = e``, pytest's ``raises(...) as
    ei``), and the next step then runs out of memory under the cap. Python cannot be told to
    let go of a caller's frames, so tiermem does not try: the caller drops the exception, or
    calls ``traceback.clear_frames(e.__traceback__)`` (bench/soak.py does after each injected
    failure, and then recovers from every one). A dropped exception is not always freed at
    once: ``with train.step():`` passes it through contextlib's ``__exit__``, whose frame holds
    the exception that holds the frame, a cycle that only the garbage collector frees. The
    step after a failed one therefore collects first (else the step after a backward that
    raised half-way ran past its cap while the failed step's graph waited for a collection).
    It also empties torch's cache: the cap is the traced step's reserved peak, and a step that
    failed part-way leaves the cache cut up as no traced step left it (docs/training.md).
"""
from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable
from typing import Any

from ..core.stream import Lane, now
from .plan import evaluate
from .slots import Block, BlockSlots
from .stepstate import StepState

__all__ = ["RESIDENT_STEP_BYTES", "StepRunner"]

log = logging.getLogger("tiermem")

RESIDENT_STEP_BYTES = 64 << 20   # parameter bytes per optimizer call for resident blocks


class StepRunner:
    """The begin and end of one training's steps and its optimizer steps. Its collaborators are
    the training's; ``swap`` is set once the adoption has made it, ``step_block`` is what steps
    a streamed block (the handle's, so a test can watch it), ``replan(peak)`` plans from the
    traced step (training/planrun.py), ``set_cap()`` caps torch's allocator at the budget."""

    def __init__(self, *, torch: Any, state: StepState, blocks: list[Block], stream: BlockSlots, states: Any,
                 clipping: Any, meter: Any, replays: Any, recomputing: Any, choice: Any, mem: Any, group: Any,
                 model: Any, tier: Any, budget: int):
        self.torch, self.state, self.blocks, self.stream, self.states = torch, state, blocks, stream, states
        self.clipping, self.meter, self.replays, self.recomputing = clipping, meter, replays, recomputing
        self.choice, self.mem, self.group, self.model, self.tier, self.budget = (choice, mem, group, model, tier,
                                                                                 budget)
        self.swap: Any = None
        self.hooks: Any = None
        self.host: Any = None        # HostSteps with host_step=True (NOTE [host stepping])
        self.shards: Any = None      # ShardedSteps with shard_steps=True (NOTE [sharded steps])
        self.reduce = Lane(tier.backend, lambda: tier.side_stream("reduce"))    # NOTE [data parallel]
        self.step_block: Callable[[Block], None] = self.step_streamed
        self.replan: Callable[[int], None] = lambda peak: None
        self.set_cap: Callable[[], None] = lambda: None

    # -- the step's begin --------------------------------------------------------------------------
    def begin(self) -> None:
        st = self.state
        if st.failed:                 # NOTE [kept exceptions]: free the failed step's cycle
            st.failed = False
            gc.collect()
            self.mem.empty_cache()
            # Blocks whose states were adopted in a traced step that failed before its replan
            # need slots the replan would have grown: a fill would run past a slot's end
            # (tests/test_train_faults.py crashed on the CPU; on a GPU it writes over torch's memory).
            if self.stream.too_small():
                self.stream.alloc()
            self.set_cap()
        self.choice.read_times()
        if self.host is not None:
            self.host.begin()
        if self.shards is not None and self.shards.agreed:
            self.shards.drop(self.blocks, self.states.opt)     # NOTE [sharded steps]: a gather's homes
        st.got = set()
        st.resident_got, st.averaged = {}, set()              # NOTE [data parallel]
        st.grads_at_begin = self.hooks.resident_grads()       # NOTE [zero_grad]
        st.changes_at_begin = self.replays.changes
        st.seg, st.part = [], []
        st.eval_next = 0
        st.moved = {"h2d": 0, "d2h": 0}
        for b in self.blocks:
            b.entered, b.stepped, b.waiting = False, False, 0
        self.mem.reset_peak()
        self.replays.peak_carry = 0
        plan = self.choice.plan
        if st.tracing:
            st.calls, st.boundary = {}, {}
            st.part_inputs, st.part_seen = {}, {}
            self.recomputing.set({})             # the trace sees every block's own saves
        if self.swap is not None:
            if st.tracing or plan is None:
                self.swap.begin(None, frozenset(), [])
            else:
                self.swap.begin(st.expect, st.keep_keys, list(st.need), plan.recompute)
        if st.tracing or (self.choice.metering_next and st.updating):
            self.meter.start()
        self.meter.mark(("fwd", "start"))
        self.stream.begin(self.choice.step_begun())   # fills wait for it: the caller's writes home come before
        self.stream.updating = st.updating
        if self.clipping is not None:
            self.clipping.begin(st.updating, st.tracing)
        if not st.tracing:
            self.stream.ahead(st.order)    # NOTE [training transport]: the first blocks, from their homes

    def swapping(self) -> bool:
        """The step swaps activations: it is traced, or its plan swaps some."""
        plan = self.choice.plan
        return self.state.tracing or plan is None or plan.swapped_bytes > 0

    def peak(self) -> int:
        """torch's peak reserved bytes in this step (NOTE [replayed recompute]: a measured
        backward resets the device's counter, and keeps the peak before it)."""
        return max(self.mem.max_reserved(), self.replays.peak_carry)

    # -- the step's end ----------------------------------------------------------------------------
    def finish(self, ok: bool) -> None:
        st = self.state
        try:
            self.close(ok)
        except BaseException:
            # A failure while finishing (an optimizer step, a wait; Ctrl-C lands here as well)
            # fails the step as one inside it does.
            self.meter.stop()
            self.clear_failed()
            raise
        metered = self.meter.on
        self.meter.stop()
        if not ok:
            self.clear_failed()
            return
        st.steps += 1
        st.last_peak = self.peak()
        st.general_peak = st.last_peak - self.replays.held_bytes     # NOTE [replayed recompute]
        diverged = self.swap is not None and self.swap.diverged
        if st.updating:
            st.updates += 1
            st.accumulated = 0
            st.window = set()
        else:
            st.accumulated += 1
            st.window |= st.got
        if st.tracing and not st.updating:
            pass          # NOTE [accumulation]: the trace goes on to the window's optimizer step
        elif st.tracing:
            # Reserved, not allocated: the cap applies to what torch reserves, fragmentation included.
            try:
                self.replan(self.peak())
            except BaseException:
                # The plan did not take: trace again, and let the next step set the slots and the
                # cap for the blocks as they are (some may have become resident).
                st.tracing, st.failed = True, True
                raise
        elif diverged:
            log.info("tiermem: the step's saved tensors changed (another shape?); tracing the next step")
            st.tracing = True
            self.choice.restart_timing()
        elif not st.updating:
            pass          # the plan's choice is timed on steps that update
        elif self.stream.too_small():
            log.info("tiermem: optimizer states appeared after the plan; tracing the next step")
            st.tracing = True
            self.choice.restart_timing()
        else:
            self.choice.after_step(metered, self.replays.changes != st.changes_at_begin)
        self.capture_graphs()

    def capture_graphs(self) -> None:
        """NOTE [replayed recompute]: the graphs this step's eager backwards asked for, captured
        between steps, when the step's tensors are gone, if the plan with the pool still holds
        the budget less its margin; else the choice plans again with room for the pool (its
        ``after_step``) or gives the graphs up, and later steps ask again."""
        r = self.replays
        plan = self.choice.plan
        if not r.pending:
            return
        if plan is None or self.state.tracing:
            r.drop_pending()
            return
        if r.reserve > plan.graph_pool:
            with_pool = evaluate(self.choice.trace, dataclasses.replace(plan, graph_pool=r.reserve))
            if with_pool.predicted_peak > self.budget - plan.margin:
                r.drop_pending()
                return
        r.capture_pending()

    def close(self, ok: bool) -> None:
        """Step what is left to step (when ``ok``), and end the step's moves and swap."""
        st = self.state
        for b in self.blocks:
            if ok and st.updating and b.grads_home and not b.entered:
                self.hooks.bwd_enter(b, ahead=False)   # gradients from earlier micro-batches only: step it too
            if b.entered and not b.stepped and ok:
                self.block_done(b)
            elif b.slot is not None:
                b.slot.busy = False
            if ok and st.updating and b.resident and self.group is not None:
                self.average_resident(b)          # NOTE [data parallel]: in block order, with the streamed
        self.join_reduce()          # NOTE [data parallel]: the averages before the resident steps
        for b in self.blocks:
            if b.deferred:
                b.deferred = False
                if ok:                  # NOTE [wide blocks]: across the whole ring, each in turn
                    self.stream.fill_wide(b)
                    self.step_block(b)
                    self.stream.wide_done(b)
        res = [p for b in self.blocks if b.resident for p in b.trainable if p.grad is not None]
        if ok and st.updating and self.clipping is not None:
            ordered = [self.blocks[i] for i in st.order]
            ordered += [b for b in self.blocks if b.index not in st.order]     # not in the traced order
            self.clipping.clip_and_step(res, list(self.model.parameters()), ordered, st.came, self.step_block)
        self.stream.end()           # this step's write-backs; every parameter its home's again
        if ok and res and st.updating:
            # A foreach step makes temporaries as large as the parameters it updates, which the
            # traced step (every block stepped alone) never saw: step the resident blocks a few
            # at a time. With no hooks left (in capacity) it is one call, as plain PyTorch does.
            for chunk in _chunks(res, RESIDENT_STEP_BYTES if self.hooks.handles else None):
                self.states.step(chunk)
            for p in res:
                p.grad = None
        if self.host is not None and ok:
            with self.meter.host():            # NOTE [host stepping]: the next forward needs them done
                self.host.finish()
        self.meter.mark(("bwd", "end"))
        if ok:
            self.choice.step_ended(st.updating)
        st.moved = dict(self.stream.moved)
        if self.swap is not None:
            self.swap.end()
            for d in ("h2d", "d2h"):
                st.moved[d] += self.swap.moved[d]

    def clear_failed(self) -> None:
        """A step that raised (in forward, part-way through backward, or while finishing) leaves
        no gradients: the next step would add its own to them. Blocks whose backward had finished
        took their optimizer step already, as in any step (NOTE [training transport])."""
        st = self.state
        st.failed = True
        if self.host is not None:
            self.host.abandon()     # NOTE [host stepping]: what the host began of the step ends first
        try:
            self.join_reduce()      # the reduce stream may still use the gradients dropped below
        except Exception as e:      # a broken device: the step's own error is the one to see
            log.warning("tiermem: could not order the reduce stream after a failed step: %s", e)
        self.replays.drop_pending()
        self.stream.in_backward = False
        st.seg, st.part = [], []
        self.choice.drop_step_events()
        self.stream.idle()
        for b in self.blocks:
            for p in b.trainable:
                p.grad = None
        if st.accumulated or not st.updating:
            log.warning("tiermem: a step failed inside an accumulation window; the window's gradients "
                        "(%d micro-batches before it) are dropped and the next step opens a new one",
                        st.accumulated)
        if self.clipping is not None:
            self.clipping.undo(self.blocks)     # blocks stepped into their second homes did not step
            self.clipping.norms.clear()
        self.stream.drop_grads()
        for b in self.blocks:
            b.deferred = False              # NOTE [wide blocks]: its gradients are dropped with the rest
        st.accumulated = 0
        st.window = set()
        if self.swap is not None:
            self.swap.end()

    def budget_note(self) -> str:
        """Why torch's allocator ran out inside a step: what the budget had to hold."""
        gb = lambda n: f"{n / 1e9:.3f} GB"  # noqa: E731
        streamed = [b for b in self.blocks if not b.resident]
        big = max(streamed, key=lambda b: b.slot_need, default=None)
        lines = [f"tiermem: this step runs within a budget of {gb(self.budget)}: torch's allocator is capped "
                 f"at the budget less tiermem's resident {gb(self.tier.resident_bytes)}."]
        if big is not None:
            n = self.stream.nslots
            lines.append(f"Its {n} slots take {gb(n * self.stream.slot_bytes)} (the largest streamed "
                         f"block, {big.name}, holds {gb(big.p_bytes)} of parameters with their gradients and "
                         "optimizer states); activations, temporaries and copies in flight need the rest.")
        lines.append("Raise the budget, or wrap with a smaller block_bytes or lookahead"
                     + (" (this was the traced first step: the plan is made after it)." if self.state.tracing
                        else "."))
        return " ".join(lines)

    # -- optimizer steps ---------------------------------------------------------------------------
    def block_done(self, b: Block) -> None:
        """A streamed block's gradients of this micro-batch are complete: step it when the step
        updates, else send its gradients home for the next micro-batch (NOTE [accumulation]);
        when clipping, take their norms and send them home for the step's end (NOTE [clipping])."""
        st = self.state
        if st.updating and b.wide and self.clipping is None and self.group is None:
            self.stream.write_grads(b)          # NOTE [wide blocks]: stepped at the step's end
            b.deferred = b.stepped = True
            for p in b.trainable:
                p.grad = None
        elif st.updating:
            got = [p for p in b.trainable if st.came(p)]
            if self.clipping is None:
                self.average(got, step=lambda: self.step_block(b))
                return
            self.average(got, join=True)        # the norms are taken on the compute stream
            for p in b.trainable:
                if not st.came(p):
                    p.grad = None
            self.clipping.block_done(b, got)
            b.stepped = True
            for p in b.trainable:
                p.grad = None
        else:
            self.stream.write_grads(b)
            b.stepped = True
            for p in b.trainable:
                p.grad = None

    def step_streamed(self, b: Block) -> None:
        """Step a streamed block whose gradients are complete, and write it back home."""
        st = self.state
        for p in b.trainable:
            if not st.came(p):
                p.grad = None     # no gradient reached it: the optimizer skips it, as it would resident
        if b.host and self.host is not None:
            self.step_on_host(b)
            return
        if not (b.peer and b.states):       # NOTE [sharded steps]: another rank steps it, where it has states
            self.states.step_block(b, b.slot)
        b.stepped = True
        b.grads_home = False
        if not b.states and b.trainable:
            self.states.adopt(b)
            b.host = self.host is not None and self.host.takes(b)     # NOTE [host stepping]: as chosen
        if self.shards is not None and self.shards.shares(b):
            self.shards.broadcast(b)        # the owner's stepped parameters, to every rank's slot
        self.stream.write_back(b)
        for p in b.trainable:
            p.grad = None

    def step_on_host(self, b: Block, clip: tuple[float, Any] | None = None) -> None:
        """NOTE [host stepping]: ``b``'s complete gradients go home (with ``clip``, clipping's
        pass sent them already) and the host steps its home; the slot's parameters are stale
        from now on."""
        st = self.state
        if clip is None:
            self.stream.write_grads(b)
        got = [p for p in b.trainable if st.came(p)]
        self.stream.stale_params(b)
        b.grads_home = False
        b.stepped = True
        self.host.submit(b, got, clip)
        for p in b.trainable:
            p.grad = None

    def average(self, params: list[Any], step: Callable[[], None] | None = None, join: bool = False) -> None:
        """Average ``params``' gradients over the process group on tiermem's reduce stream, then
        run ``step`` (a streamed block's optimizer step and write-back) there; with ``join`` the
        compute stream waits for the averages (NOTE [data parallel]). Without a group, ``step``
        runs on the compute stream."""
        if self.group is None:
            if step is not None:
                step()
            return
        import torch.distributed as dist
        size = dist.get_world_size(self.group)
        grads = [p.grad for p in params if p.grad is not None]
        lane = self.reduce
        lane.after([now()])                 # the reduce stream after the gradients' backward
        with self.mem.stream(lane.stream):
            works = [dist.all_reduce(g, group=self.group, async_op=True) for g in grads]
            for w in works:
                w.wait()                    # the reduce stream (not the host) waits for NCCL
            for g in grads:
                g.div_(size)
            if step is not None:
                step()
        if join:
            self.join_reduce()

    def join_reduce(self) -> None:
        """The compute stream waits for the work queued on the reduce stream so far."""
        if self.group is not None:
            be = self.tier.backend
            be.wait(be.current_stream(), self.reduce.mark())

    def resident_grad_done(self, b: Block, p: Any) -> None:
        """NOTE [data parallel]: a resident block's gradients are averaged as soon as they are
        complete, as a streamed block's are, so the all-reduces keep one order on every rank
        whichever blocks each rank's plan keeps resident."""
        got = self.state.resident_got.setdefault(b.index, set())
        got.add(id(p))
        if len(got) == len(b.trainable):
            self.average_resident(b)

    def average_resident(self, b: Block) -> None:
        st = self.state
        if b.index not in st.averaged:
            st.averaged.add(b.index)
            self.average([p for p in b.trainable if p.grad is not None])


def _chunks(params: list[Any], limit: int | None) -> list[list[Any]]:
    if limit is None:
        return [params]
    out: list[list[Any]] = [[]]
    n = 0
    for p in params:
        size = p.numel() * p.element_size()
        if out[-1] and n + size > limit:
            out.append([])
            n = 0
        out[-1].append(p)
        n += size
    return out

