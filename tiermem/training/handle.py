"""Training within a device budget: parameters, gradients, optimizer states and activations tiered.

    train = tier.wrap_training(model, optimizer, budget="2GiB")
    for x, y in batches:
        with train.step():                 # the first step is traced, then planned
            loss = loss_fn(model(x), y)
            loss.backward()                # each block's optimizer step runs inside backward
    print(train.plan)                      # what stays on the device, what moves, predicted time

NOTE [training transport]
    The budget covers everything the step keeps on the GPU: tiermem's resident managed bytes plus
    what torch's caching allocator holds (``torch.cuda.set_per_process_memory_fraction`` caps the
    latter at the budget minus the former). Each module block (``module_groups``) is either
    *resident*, its parameters and optimizer states in managed memory kept on the device, or
    *streamed*:

      - its parameters and optimizer states live in a pinned host home;
      - a few device slots (torch memory, inside the cap) hold a block while it is in use:
        parameters for forward; parameters, gradients and states for backward;
      - slots are filled on tiermem's H2D stream ahead of use and written back on the D2H stream,
        plain copies at the link rate, both ways at once, where Unified Memory writes dirty
        pages back at a fraction of it and its prefetches serialise with each other
        (docs/facts.md);
      - gradients accumulate in place in the block's slot; as soon as every gradient of a block
        is complete (``register_post_accumulate_grad_hook``), the wrapped optimizer steps that
        block alone, and its parameters and states are written back while backward goes on.
        Gradients therefore never cross the link, and a block crosses it three times per step
        (in for forward, in with its states for backward, out after its update).

    The blocks' homes, the slots and the copies between them are training/slots.py's; the optimizer's
    states, their homes, bf16 narrowing and loading are training/states.py's. This module decides
    when: the step, its hooks, and the plan.

    The optimizer's own ``step()`` does every update, restricted to one block's parameters, so
    the arithmetic is the optimizer's: AdamW's update of a parameter does not depend on which
    other parameters share the call (elementwise kernels), and 30 steps give bitwise the losses
    of the resident run (tests/test_gpu_train.py). Resident blocks step together at the end.

    Inside a step a streamed parameter stays bound to its slot while the slot still holds it,
    then to its home, which the GPU can read in place (zero-copy): a tied weight used by another
    block reads correct data either way. Between steps every streamed parameter is bound to its
    home, so whatever the caller writes there (a re-initialised layer, a submodule's
    ``load_state_dict``, EMA weights copied in through ``p.data`` for an evaluation) is what the
    next step reads. Before, the blocks the last backward left in slots stayed bound to them: a
    write went into the slot alone, the next forward read it, the slot was reused, and the
    block's backward and update read its home's old values (tests/test_train_writes.py). A step
    begins by filling the first blocks' slots from their homes, after the work queued before it
    (the caller's writes); those blocks' parameters cross the link once more than before, in a
    forward that has the link to spare.

NOTE [data parallel]
    With ``process_group`` each rank trains its own replica, and a block's gradients are averaged
    over the group (``all_reduce``, then divided by its size) as soon as they are complete, just
    before that block's optimizer step inside backward, and a resident block's as soon as they
    are complete too (a block whose gradients are not all there by then: at the step's end, in
    block order, resident or not). So the all-reduces follow the blocks' completion, which is the
    graph's, not the plan's: ranks whose plans differ (budgets, or measured times that chose
    other blocks to keep resident) still run them in one order. Averaging resident blocks at the
    step's end, as before, made that order the plan's, and two gloo ranks with different budgets
    aborted on mismatched sizes (tests/test_train_dp.py). With a process group the hooks stay in
    capacity (the gradients' tell when a block is complete). Every rank runs the same graph, so
    the blocks complete in the same order on every rank. DDP does not compose: its reducer
    averages gradients at the end of backward, after tiermem has stepped the blocks, so wrap the
    bare replica and pass the group instead.

    The averages run on tiermem's reduce stream, beside the backward (training/stepping.py): it
    first waits for the compute stream's work so far (the block's gradients), the all-reduces
    are issued there with ``async_op`` and the stream (not the host) waits for each, and a
    streamed block's division, optimizer step and write-back home are queued after them. So the
    backward of the blocks that follow never waits for NCCL, and the link's copies wait only for
    what they read: a slot is filled again after its write-back, which is after the step.
    Before, each all-reduce held the compute stream, and with it the next block's backward and
    the fills that wait for it. The compute stream joins the reduce stream where it reads the
    averages: at the step's end, before the resident blocks step, with clipping after each
    average (the norms are taken on the compute stream), and after a failed step. On the CPU
    (gloo) the waits are the host's.

    Not handled: parameters that get a gradient on some ranks only (data-dependent routing)
    would leave the all-reduces out of step, and a rank whose step fails leaves the others
    waiting in theirs. tests/test_train_dp.py runs two ranks under
    gloo on the CPU, with one budget, with two, and with one rank in capacity;
    tests/test_gpu_train_dp.py two GPUs under NCCL.

NOTE [accumulation]
    With ``accumulate=N`` each ``train.step()`` is one micro-batch and the optimizer steps in
    every N-th (HF Trainer's ``gradient_accumulation_steps``); ``step(update=True)`` closes a
    short window. A plain loop keeps the window's gradients in ``p.grad`` on the device, which a
    streamed block has no room for. So in a micro-batch that does not update, a streamed block's
    backward fill brings its parameters and the gradients accumulated so far (none in the
    window's first; the slot's region is zeroed instead), autograd adds this micro-batch's to
    them in the slot as it would to ``p.grad``, and once they are complete they go home to a
    pinned buffer beside the block's parameters: no optimizer state crosses the link and nothing
    is stepped. The updating micro-batch fills the gradients with the states and steps each
    block inside backward as any step does, so the arithmetic is the plain loop's, bitwise
    (tests/test_train_accumulate.py, tests/test_gpu_train.py). A streamed block costs, per
    micro-batch that does not update, its gradients in and out (the first: out only) instead of
    its states in and parameters and states out; host memory grows by its trainable bytes.
    Resident blocks keep their gradients in ``p.grad`` through the window and step at its end.
    With a process group the gradients are averaged in the updating micro-batch only (DDP's
    ``no_sync``). A block that had gradients earlier in the window but none in its last
    micro-batch is filled and stepped when that step ends. The trace lasts until the first
    updating micro-batch, so the plan sees the optimizer's step; the measured choice times
    updating micro-batches. A micro-batch that fails drops the window's gradients (a plain loop
    would keep part of the failed one's), and ``unwrap()`` inside a window gives them back in
    ``p.grad``.

NOTE [block size]
    A block is what is resident or streamed, and its segment what is kept, swapped or
    recomputed. The slots are as large as the largest block with its gradients and states, and
    no block is smaller than its largest parameter, so blocks as large as that parameter cost
    the slots nothing. By default (``block_bytes=None``) blocks are that large, and at least
    BLOCK_BYTES: a language model's largest parameter is its embedding or head, and a decoder
    layer is then most often one block. Recomputing a whole layer recomputes all it saves;
    blocks of its sub-modules leave what runs between them (attention's core, the norms, the
    MLP's product) outside every block, kept or swapped. Recomputing a layer holds its whole
    segment in its backward, so at a budget too tight for that, smaller blocks recompute more;
    ``block_bytes`` chooses (docs/training.md, "Block size", has the measurements).

NOTE [measured choice], NOTE [fewer slots] and NOTE [a slot for recompute] are in training/choice.py, with
the choice of plan; NOTE [clipping] and NOTE [speculative clipping] in training/clipping.py.
NOTE [bf16 moments] and NOTE [loaded states] are in training/states.py, with the optimizer's states.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..base.limits import parse_bytes
from ..errors import (
    ConfigError,
    ConfigTypeError,
    OutOfBudgetError,
    TierMemError,
    WrapError,
)
from ..inference.groups import module_groups, span_of
from ..pytorch.devmem import device_memory
from .casts import autocast_cache_off
from .choice import PlanChoice
from .clipping import Clipping, leaves_grads
from .floor import WORKSPACE_BYTES, Floor, asked_bytes, at_wrap, nesting, trace_slots, wide_wanted, wrap_slot
from .hooks import BlockHooks
from .kvoff import kv_cache_configs, kv_cache_off
from .memory import Cap, HostBuffers, check_room, free_adopted, plain_copies
from .meter import StallMeter
from .options import BLOCK_BYTES, TrainingOptions, averaging_group, check_options, check_subjects, states_dtype
from .plan import LINK_GBPS, StepTrace, TrainPlan
from .planrun import PlanRunner
from .recompute import Recompute
from .replay import Replays
from .slots import Block, BlockSlots
from .hoststep import HostSteps
from .shards import ShardedSteps
from .states import OptimizerStates
from .stepping import StepRunner
from .stepstate import StepState
from .swap import ANOTHER_PATH, ActivationSwap

if TYPE_CHECKING:
    from ..core.engine import Engine as Tier  # what an adapter uses is the engine's interface

__all__ = ["TieredTraining", "wrap_training"]

log = logging.getLogger("tiermem")


class TieredTraining:
    """Handle of a model and optimizer trained by :func:`wrap_training` (NOTE [training transport]).

    ``budget``: bytes, "2GiB" or a share of the device ("25%"). ``options``: a
    :class:`~tiermem.training.options.TrainingOptions`, or its fields as keywords (where each
    is documented). Its parts: the blocks' slots and homes (``stream``), the optimizer's states
    (``states``), the hooks (``hooks``, training/hooks.py), the step and the optimizer steps
    (``runner``, training/stepping.py), the plan applied (``planner``, training/planrun.py) and
    chosen (``choice``, training/choice.py); what they share from step to step is ``state``
    (training/stepstate.py)."""

    def __init__(self, tier: Tier, model: Any, optimizer: Any, budget: int | str,
                 options: TrainingOptions | None = None, **kwargs: Any):
        import torch
        self.torch = torch
        o = self.options = check_options(budget, options, **kwargs)
        check_subjects(model, optimizer)
        if o.speculate and type(optimizer) not in leaves_grads():
            raise ConfigError(f"speculate=True needs an optimizer whose step leaves the gradients alone "
                              f"({', '.join(sorted(t.__name__ for t in leaves_grads()))}), got "
                              f"{type(optimizer).__name__} (NOTE [speculative clipping])")
        self.accumulate = o.accumulate
        self.state = StepState()
        self.state_dtype = states_dtype(o.state_dtype)
        self.recompute_mode = o.recompute if o.swap else "never"
        self.link_GBps = float(o.link_GBps) if o.link_GBps is not None else LINK_GBPS
        if getattr(model, "_tiermem_handle", None) is not None:
            raise WrapError("this model is already adopted by tiermem; unwrap it first")
        self.tier, self.model, self.opt = tier, model, optimizer
        if kv_cache_configs(model):            # NOTE [no KV cache in a step]
            log.warning("tiermem: %s's config has use_cache=True; inside train.step() it is False (a training "
                        "forward has no use for a KV cache, which would hold every layer's keys and values)",
                        type(model).__name__)
        self.group = averaging_group(o.process_group)      # NOTE [data parallel]
        be = tier.backend
        total = be.capabilities().total_memory
        self.budget = parse_bytes(budget, total=total, what="training budget", max_percent=100)
        self.total = total
        self.mem = device_memory(torch, be, tier.device)     # NOTE [device memory]
        self.dev = self.mem.device
        # NOTE [the floor]: a budget refused below its floor is a real device's (a test's fake
        # backend may say it emulates one; elsewhere its budgets are nominal, torch's CPU
        # allocator having no cap)
        self.enforced = bool(getattr(be, "enforces_budget", be.kind == "cuda"))
        self.blocks = _blocks(torch, model, optimizer, o.block_bytes, self.dev)
        room = tier.lease_room()                 # NOTE [budget leases]
        if room is not None and self.budget > room:
            log.warning("tiermem: a training budget of %s bytes does not fit the tier's configured budget (%s bytes "
                        "left for leases); training within that", f"{self.budget:,}", f"{room:,}")
            self.budget = room
        self.cap = Cap(self.mem, tier, self.budget, total)
        self.swap: ActivationSwap | None = None
        by_module = {id(b.module): b for b in self.blocks}
        st = self.state
        self.replays = Replays(torch, capture=o.graphs and be.kind == "cuda",
                               params_of=lambda m: by_module[id(m)].trainable,
                               after_replay=lambda m, hit: self.hooks.replayed(by_module[id(m)], hit))
        self.replays.room = self._graph_room
        self.recomputing = Recompute(torch, lambda: st.in_step, self.replays)
        self.meter = StallMeter(tier.backend)
        self.stream = BlockSlots(tier, self.blocks, optimizer, self.meter, o.lookahead, self.dev)
        self.states = OptimizerStates(tier, optimizer, self.stream, self.mem, self.state_dtype, self.meter,
                                      lambda: st.in_step)
        self.rounding = self.states.rounding      # NOTE [bf16 moments]
        self.clipping = (None if o.max_grad_norm is None else     # NOTE [clipping]
                         Clipping(torch, optimizer, self.stream, self.states, o.max_grad_norm, o.norm_type,
                                  o.speculate))
        self.choice = PlanChoice(backend=be, blocks=self.blocks, stream=self.stream, replays=self.replays,
                                 budget=self.budget, margin=o.margin, mode=self.recompute_mode,
                                 link_GBps=self.link_GBps, clip=o.max_grad_norm is not None and not o.host_step,
                                 take=lambda old, plan: self.planner.take(old, plan),
                                 timings=lambda: self.planner.timings(), resident_bytes=lambda: tier.resident_bytes)
        self.runner = StepRunner(torch=torch, state=st, blocks=self.blocks, stream=self.stream, states=self.states,
                                 clipping=self.clipping, meter=self.meter, replays=self.replays,
                                 recomputing=self.recomputing, choice=self.choice, mem=self.mem, group=self.group,
                                 model=model, tier=tier, budget=self.budget)
        self.hooks = BlockHooks(torch=torch, state=st, blocks=self.blocks, stream=self.stream, meter=self.meter,
                                replays=self.replays, group=self.group, min_swap=o.min_swap, dev=self.dev,
                                steps=self.runner)
        self.planner = PlanRunner(state=st, blocks=self.blocks, stream=self.stream, choice=self.choice,
                                  replays=self.replays, recomputing=self.recomputing, meter=self.meter, mem=self.mem,
                                  tier=tier, optimizer=optimizer, group=self.group)
        self.runner.hooks = self.planner.hooks = self.hooks
        # NOTE [host stepping]: refused here, before anything is adopted, for an optimizer it cannot step
        self.host = HostSteps(torch, optimizer, self.stream, lambda: self.states.loads) if o.host_step else None
        self.runner.host = self.planner.host = self.host
        if self.host is not None and self.clipping is not None:
            self.clipping.on_host = self.runner.step_on_host
        # NOTE [sharded steps]: with one rank (no group) there is nothing to share
        self.shards = (ShardedSteps(torch, self.group, self.stream, self.dev)
                       if o.shard_steps and self.group is not None else None)
        self.runner.shards = self.planner.shards = self.shards
        if self.clipping is not None:
            self.clipping.shards = self.shards
        self.runner.step_block = lambda b: self._step_block(b)     # the handle's, so a test can watch it
        self.runner.replan = self.planner.replan
        self.runner.set_cap = self.planner.set_cap = self.cap.set
        self.planner.graph_room = lambda: self._graph_room()
        self.planner.outside = lambda: self.cap.outside
        self._lease = tier.lease(self.budget, owner=f"wrap_training({type(model).__name__})")
        originals = [(p, p.data) for b in self.blocks for p in b.params]
        # NOTE [host models]: where each parameter came from, for unwrap's default
        self._origin = {id(p): p.device for b in self.blocks for p in b.params}
        self.host_buffers = HostBuffers(self.dev)     # NOTE [host models]
        try:
            self.host_buffers.move_in(model)
            self._adopt({d.untyped_storage().data_ptr() for _, d in originals if d.device == self.dev})
        except BaseException:
            self._rollback(originals)
            raise
        del originals
        self.mem.empty_cache()      # NOTE [outside memory]: the parameters' old memory goes back

    def _adopt(self, old: set[int]) -> None:
        """Give every block its home, the ring its slots, torch's allocator its cap (NOTE [outside
        memory] in training/memory.py: ``old`` are the parameters' old device storages), and
        install the swap and the hooks."""
        torch, o, tier = self.torch, self.options, self.tier
        self.mem.synchronize()
        with torch.no_grad():
            for b in self.blocks:
                self.stream.make_home(b)
                self.mem.synchronize()
                self.stream.bind_home(b)
        self.mem.empty_cache()
        self.cap.outside = self.mem.reserved_without(old)
        # NOTE [the floor]: the slots' part is known now; the activations' after the first step
        least = self.planner.least = self.stream.least = max(2, nesting(self.blocks) + 1)
        # NOTE [wide blocks]: never with clipping or a process group, whose steps need every block's
        may = self.state.may_wide = (self.options.wide_blocks if self.clipping is None and self.group is None
                                     and self.host is None else False)
        wide = may if may is not None else wide_wanted(self.blocks, self.opt, self.state_dtype, least, self.budget)
        self.stream.allow_wide = bool(wide)
        floor = self.state.budget_floor = at_wrap(self.blocks, self.opt, self.state_dtype, least,
                                                  WORKSPACE_BYTES if tier.backend.kind == "cuda" else 0,
                                                  wide=self.stream.allow_wide, may_wide=may)
        if self.budget < floor.bytes and self.enforced:
            raise OutOfBudgetError(floor.bytes, 0, self.budget, hint=(
                f"the floor of this training is {floor} (NOTE [the floor]); raise the budget to at least "
                f"{floor.bytes:,} bytes, or wrap with a smaller block_bytes"))
        if self.enforced:
            k = trace_slots(self.stream.nslots, least, floor.slot_bytes, self.budget)
            if k < self.stream.nslots:
                log.info("tiermem: the first step is traced through %d slots, not %d: those would take more than "
                         "half the budget (NOTE [the floor])", k, self.stream.nslots)
                self.stream.lookahead -= self.stream.nslots - k
                self.stream.nslots = k
            # NOTE [the floor]: the traced step streams through slots that hold the states the
            # optimizer makes in it, so its peak is what the steps after it hold
            self.stream.least_slot = wrap_slot(self.blocks, least)
        self.stream.alloc()
        self.cap.old_fraction = self.mem.fraction()
        self.cap.set()
        # Copies in flight hold device memory: 1/32 of the budget each way keeps the link busy
        # (a copy of 1/32 of the budget takes a few per cent of a step) and costs little capacity.
        window = max(1 << 20, self.budget // 32) if o.window is None else int(o.window)
        st = self.state
        if o.swap:
            self.swap = ActivationSwap(tier, self.stream.params, min_swap=o.min_swap, window=window, device=self.dev)
            self.swap.on_param = self.hooks.on_param_read
            self.swap.segment = self.hooks.segment
            self.swap.part = self.hooks.part
            self.swap.meter = self.meter
            self.swap.capturing = lambda: st.capturing
            self.swap.trained = {id(p): p for b in self.blocks for p in b.params}    # NOTE [saved casts]
        self.runner.swap = self.planner.swap = self.swap
        containers = {id(b.module) for b in self.blocks for o_ in self.blocks
                      if o_ is not b and any(m is o_.module for m in b.module.modules())}
        # A block can be recomputed when no other block runs inside it (its forward is its own
        # ops) and the user did not ask transformers to checkpoint it already.
        st.leaf = frozenset(b.index for b in self.blocks
                            if id(b.module) not in containers and not getattr(b.module, "gradient_checkpointing",
                                                                              False))
        self.hooks.register()
        self.hooks.guard(self.model, self.opt, self.states.hooks() + self._shard_hooks())
        self.model._tiermem_handle = weakref.ref(self)

    def _shard_hooks(self) -> list[Any]:
        """NOTE [sharded steps]: ``opt.state_dict()`` refuses while this rank lacks the states of
        the blocks the others step. The hook holds the sharing weakly."""
        if self.shards is None:
            return []
        ref = weakref.ref(self.shards)

        def before(opt: Any) -> None:
            me = ref()
            if me is not None:
                me.check_state_dict()
        return [self.opt.register_state_dict_pre_hook(before)]

    def gather_states(self) -> None:
        """With ``shard_steps=True``: bring every streamed block's optimizer states (and its
        parameters' ``step``) from the rank that steps it into this rank's homes, so that
        ``opt.state_dict()`` is whole (NOTE [sharded steps]). Collective: every rank of the group
        calls it, between steps. Without the option it does nothing."""
        if self.shards is None:
            return
        if self.state.in_step:
            raise ConfigError("gather_states() runs between steps, not inside train.step()")
        self.mem.synchronize()          # the last step's write-backs are home
        self.shards.gather(self.blocks, self.opt)

    def _rollback(self, originals: list[tuple[Any, Any]]) -> None:
        """Undo a failed adoption (NOTE [all or nothing] in inference/module.py): the parameters get their
        own memory back, and every byte, hook, cap and lease the adoption took is given back.
        Must not raise over the adoption's error."""
        self.hooks.remove()
        self.recomputing.set({})
        self.mem.synchronize()
        for p, data in originals:
            p.data = data
        self.host_buffers.put_back()
        if self.cap.old_fraction is not None:
            self.mem.set_fraction(self.cap.old_fraction)
        free_adopted(self.blocks, self.stream, self.replays, self.swap)
        self._lease.release()
        self.mem.empty_cache()

    # -- steps -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, update: bool | None = None) -> Iterator[TieredTraining]:
        """One training step: run forward and backward inside. On exit every block has taken its
        optimizer step and the gradients are cleared. With ``accumulate=N`` each step is one
        micro-batch, and the optimizer steps in every N-th (NOTE [accumulation]); ``update``
        True or False says whether this one steps (True at an epoch's end closes a short
        window). Not reentrant; not thread-safe."""
        torch, st = self.torch, self.state
        if st.in_step:
            raise TierMemError("train.step() is already open; steps do not nest")
        if update is not None and not isinstance(update, bool):
            raise ConfigTypeError(f"step(update=...) takes True, False or None, got {update!r}")
        st.in_step = True
        ok = False
        try:
            try:
                st.updating = st.accumulated + 1 >= self.accumulate if update is None else update
                self.runner.begin()
                hooks = (torch.autograd.graph.saved_tensors_hooks(self.swap.pack, self.swap.unpack)
                         if self.swap is not None and self.runner.swapping() else contextlib.nullcontext())
                with hooks, kv_cache_off(self.model), autocast_cache_off(torch):   # NOTE [autocast in a step]
                    yield self
                ok = True
            finally:
                try:
                    self.runner.finish(ok)
                finally:
                    st.in_step = False
        except torch.OutOfMemoryError as e:
            if hasattr(e, "add_note"):          # Python 3.11+; the error stays torch's, for code that catches it
                e.add_note(self.runner.budget_note())
                if st.tracing:                  # NOTE [the floor]: the step's peak never came
                    held = max(self.mem.max_reserved() - self.cap.outside, 0) + self.tier.resident_bytes
                    least = held + asked_bytes(str(e))
                    e.add_note(f"tiermem: the traced first step ran out before its peak was known: this training's "
                               f"floor is at least {least:,} bytes, what torch held and "
                               f"asked for; before the step it was {st.budget_floor} (NOTE [the floor])")
                    if st.budget_floor is not None and least > st.budget_floor.bytes:
                        st.budget_floor = dataclasses.replace(st.budget_floor, bytes=least, at_least=True)
            if self.replays.graphs:
                # NOTE [replayed recompute]: the graphs' pool held memory the step's own
                # allocations then lacked; the next steps recompute eagerly, without it
                self.replays.give_up(f"a step ran out of memory beside the graphs' pool: {e}")
            raise

    def _step_block(self, b: Block) -> None:
        """Step a streamed block whose gradients are complete, and write it back home (the step
        runner's, here so that a test can watch it)."""
        self.runner.step_streamed(b)

    def _capture_graphs(self) -> None:
        """NOTE [replayed recompute]: the step runner's, between steps."""
        self.runner.capture_graphs()

    def _graph_room(self) -> int | None:
        """Bytes the recomputed blocks' graphs' pool may take (NOTE [replayed recompute])."""
        return self.cap.graph_room(self.state.general_peak)

    # -- whole-step graphs (NOTE [whole-step graphs] in training/stepgraph.py) -----------------------------
    def graphed(self, fn: Any) -> Any:
        """``fn(*tensors) -> loss`` as a training step: ``loss = step(ids)`` runs forward,
        backward and every block's optimizer step, eagerly until the plan has settled, then as
        one captured CUDA graph replayed each step (NOTE [whole-step graphs] in training/stepgraph.py).
        The returned :class:`GraphedStep` says in ``off`` why its steps stay eager, if they do."""
        from .stepgraph import GraphedStep
        return GraphedStep(self, fn)

    def stepped_optimizer(self) -> Any:
        """The optimizer for a loop that calls ``optimizer.step()`` itself (transformers' Trainer,
        accelerate): its ``step()`` does nothing, the handle having stepped already; its groups and
        states are the wrapped optimizer's (NOTE [a loop's optimizer] in training/loopopt.py)."""
        from .loopopt import stepped_optimizer
        return stepped_optimizer(self)

    def follow(self, plan: TrainPlan) -> None:
        """Make ``plan`` the one the next steps follow (one ``choice.graph_timed`` gave)."""
        if self.state.in_step:
            raise TierMemError("a plan is changed between steps, not inside one")
        self.choice.take(plan)
        self.choice.restart_timing()

    @property
    def settled(self) -> bool:
        """The plan will not change by itself: the measured choice and its checks are done, and
        the last step neither failed nor traced."""
        st = self.state
        return (self.plan is not None and not st.tracing and not st.failed and self.choice.settled
                and not st.in_step and st.accumulated == 0 and not self.replays.pending)

    @property
    def active(self) -> bool:
        """This handle still trains its model (not unwrapped)."""
        ref = getattr(self.model, "_tiermem_handle", None)
        return ref is not None and ref() is self

    @property
    def layout(self) -> tuple[Any, ...]:
        """What a captured step's addresses rest on: the plan, the slots' memory, the resident
        blocks. A replay is valid only while it is the capture's."""
        mem = self.stream.slot_mem
        return (id(self.plan), 0 if mem is None else mem.data_ptr(), self.stream.slot_bytes,
                frozenset(b.index for b in self.blocks if b.resident))

    def graph_blockers(self) -> str:
        """Why this training's steps cannot be captured as a graph ("" when they can)."""
        if self.accumulate > 1:
            return "accumulate > 1: the micro-batches of a window differ in what they move"
        if self.clipping is not None:
            return "gradient clipping reads the total norm on the host before the blocks step"
        if self.group is not None:
            return "data parallel: the process group's collectives are not captured"
        if self.replays.capture:
            return "graphs=True replays the recomputed backwards as graphs of their own"
        if self.host is not None:
            return "host_step=True steps the streamed blocks on the host, which a CUDA graph cannot hold"
        if self.tier.backend.kind != "cuda":
            return "the backend cannot capture CUDA graphs (no GPU)"
        return ""

    # NOTE [another path under capture]
    #     A model may run other kernels while a CUDA graph captures than it runs eagerly, and then
    #     saves other tensors for backward: the captured step diverges from the trace the plan was
    #     made from (NOTE [activation swap]), swaps everything, and the step after it traces again
    #     and plans anew, which drops the graph; settled again, the next capture diverges again.
    #     A transformers Llama (SDPA, grouped-query attention, no mask passed) does so:
    #     transformers builds no mask eagerly, so torch's SDPA takes a path with the key/value
    #     heads as they are, and builds one while capturing, where it repeats the key/value heads
    #     and takes another kernel (docs/training.md, "Whole-step graphs"). So a captured step
    #     refuses itself at its first save that differs from the trace, before the swap takes
    #     anything the eager steps did not (a new piece of its pinned arena would be a
    #     cudaHostAlloc, which CUDA refuses while a stream captures: the capture would fail
    #     part-way), and fails like any capture CUDA refuses: graphs are off for the run with the
    #     reason, the step runs eagerly under the same plan, and nothing is lost.
    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """The step inside is captured, not run (NOTE [whole-step graphs]): the backend resolves
        events for the capture (NOTE [events across a capture]), and the step's timing events,
        which no time can be read from, are dropped. If the capture fails, the step counts as not
        taken, and the next one starts as after a failed step."""
        st = self.state
        steps, updates = st.steps, st.updates
        tracing = st.tracing
        st.capturing = True
        try:
            with self.tier.backend.capturing():
                yield
            if st.tracing and not tracing and self.swap is not None and self.swap.diverged:
                raise TierMemError(ANOTHER_PATH)     # NOTE [another path under capture]
        except BaseException:
            st.failed = True
            raise
        finally:
            st.capturing = False
            # nothing ran: the step is counted by its replay (``replayed``), or not at all
            st.steps, st.updates = steps, updates
            self.choice.drop_step_events(pending=True)

    def join_streams(self) -> None:
        """End of a captured step: the side streams' captured copies join the compute stream."""
        be = self.tier.backend
        be.join_capture(be.current_stream())

    def before_replay(self) -> None:
        """A captured step is about to replay: no block may be in a slot (an evaluation between
        steps leaves them there, NOTE [evaluation between steps])."""
        if self.state.in_step:
            raise TierMemError("a graphed step runs outside train.step(), not inside it")
        self.stream.reset()

    def replayed(self, moved: dict[str, int]) -> None:
        """A captured step replayed: it counts as a step, and moved what the capture queued."""
        st = self.state
        st.steps += 1
        st.updates += 1
        st.moved = dict(moved)

    # -- reporting ---------------------------------------------------------------------------------
    @property
    def plan(self) -> TrainPlan | None:
        """The plan the steps follow (None until the first step is traced): what stays on the
        device, what moves, what is recomputed, and the predicted against the measured step."""
        return self.choice.plan

    @property
    def trace(self) -> StepTrace | None:
        """What the traced step measured, which the plan is made from."""
        return self.choice.trace

    @property
    def step_ms(self) -> list[float]:
        """Measured times of the steps since the last plan (ms, the last 64)."""
        return self.choice.step_ms

    @property
    def grad_norm(self) -> Any:
        """The last optimizer step's total gradient norm, a device tensor (NOTE [clipping]); None
        without ``max_grad_norm``."""
        return None if self.clipping is None else self.clipping.grad_norm

    @property
    def speculation(self) -> dict[str, int]:
        """Speculative steps committed and redone (NOTE [speculative clipping])."""
        return {"committed": 0, "redone": 0} if self.clipping is None else self.clipping.speculation

    @property
    def steps(self) -> int:
        """Steps taken (micro-batches, with ``accumulate``)."""
        return self.state.steps

    @property
    def updates(self) -> int:
        """Optimizer steps taken."""
        return self.state.updates

    @property
    def accumulated(self) -> int:
        """Micro-batches in the open accumulation window (NOTE [accumulation])."""
        return self.state.accumulated

    @property
    def moved(self) -> dict[str, int]:
        """Bytes the last step moved each way ("h2d", "d2h")."""
        return self.state.moved

    @property
    def last_peak(self) -> int:
        """torch's peak reserved bytes in the last step."""
        return self.state.last_peak

    @property
    def floor(self) -> int:
        """The traced step's peak of torch's reserved bytes, everything moving."""
        return self.state.floor

    @property
    def mem(self) -> Any:
        """torch's caching-allocator controls for the device (NOTE [device memory]); a test may set
        others (fakes.PeakedHostMemory), which the step, the plan and the cap then use."""
        return self._mem

    @mem.setter
    def mem(self, controls: Any) -> None:
        self._mem = controls
        for part in (getattr(self, n, None) for n in ("runner", "planner", "cap")):
            if part is not None:
                part.mem = controls

    @property
    def budget_floor(self) -> Floor:
        """The smallest budget at which every step runs, and what sets it (NOTE [the floor]): its
        slots' part from wrap on, the activations' once the first step has been traced."""
        return self.state.budget_floor

    @property
    def outside(self) -> int:
        """What torch held on the device before wrap_training (NOTE [outside memory])."""
        return self.cap.outside

    @property
    def _tracing(self) -> bool:
        return self.state.tracing

    @property
    def _hooks(self) -> list[Any]:
        return self.hooks.handles

    def resident_peak(self) -> int:
        """Device bytes the last step kept at its peak: tiermem's resident managed bytes plus
        torch's peak reserved bytes, less what torch held before wrap_training. At most the budget."""
        return self.cap.resident_peak(self.state.last_peak)

    def report(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget, "resident_peak_bytes": self.resident_peak(),
                "torch_peak_reserved_bytes": self.last_peak, "managed_resident_bytes": self.tier.resident_bytes,
                "moved_h2d_bytes": self.moved["h2d"], "moved_d2h_bytes": self.moved["d2h"],
                "blocks": len(self.blocks), "resident_blocks": sum(b.resident for b in self.blocks),
                "recomputed_blocks": len(self.plan.recompute) if self.plan is not None else 0,
                "step_ms": self.plan.measured.get("step_ms", 0.0) if self.plan is not None else 0.0,
                "slots": len(self.stream.slots), "slot_bytes": self.slot_bytes,
                "accumulate": self.accumulate, "updates": self.updates,
                "graphs": len(self.replays.graphs), "replayed_backwards": self.replays.replayed,
                "eager_recomputed_blocks": len(self.replays.eager), "graphs_off": self.replays.off,
                "shared_blocks": len(self.shards.owner) if self.shards is not None else 0,
                "blocks_stepped_elsewhere": sum(b.peer for b in self.blocks)}

    @property
    def pinned_bytes(self) -> int:
        """Pinned host bytes of the streamed blocks' homes: parameters, optimizer states, an
        accumulation window's gradients, speculative second homes."""
        return sum(h.nbytes for b in self.blocks for h in (b.home_p, b.home_s, b.home_g, b.alt_p, b.alt_s)
                   if h is not None)

    @property
    def slot_bytes(self) -> int:
        """Bytes of each of the device slots streamed blocks go through (0: none streams)."""
        return self.stream.slot_bytes

    # -- lifecycle ---------------------------------------------------------------------------------
    def unwrap(self, device: Any = None) -> Any:
        """Give every parameter and optimizer state plain memory again, remove the hooks, restore
        torch's memory fraction and give the budget lease back. ``device`` (None: where each
        parameter came from, NOTE [host models]) is where the plain copies go, "cpu" or the
        device. All or nothing: the copies are made first, and a failure there leaves the model
        trained by tiermem as it was (tests/test_train_faults.py)."""
        torch = self.torch
        if device is not None:
            device = torch.device(device)
            if device.type == "cuda" and device.index is None:
                device = self.dev
            if device != self.dev and device.type != "cpu":
                raise ConfigError(f"unwrap(device={str(device)!r}): the plain copies go to {self.dev} or the host")
        where = {i: (device or d) for i, d in self._origin.items()}
        if self.shards is not None and self.shards.stale:
            self.gather_states()         # NOTE [sharded steps]: every rank unwraps
        check_room(torch, self.tier.backend, self.blocks, self.opt, where, self.dev)
        cap = self.mem.fraction()
        self.mem.set_fraction(self.cap.old_fraction)    # the plain copies are outside the budget
        try:
            self.stream.unbind_all()     # none after a step that finished; one that failed finishing
            self.mem.synchronize()
            copies = plain_copies(torch, self.blocks, self.opt, self.stream, where, self.state.window)
            self.mem.synchronize()
        except BaseException:
            self.mem.set_fraction(cap)      # check_room refused what would not fit; this is anything else
            raise
        # Nothing below calls the backend before the memory is given back.
        if self.host is not None:
            self.host.close()          # its CPU views hold the homes released below
        self.hooks.remove()
        self.recomputing.set({})
        copies.bind(self.opt, self.stream)
        self.host_buffers.move_out(device if device is not None else torch.device("cpu"))
        self.model._tiermem_handle = None
        free_adopted(self.blocks, self.stream, self.replays, self.swap)
        self.tier.synchronize()      # finished moves let go of the buffers they held
        self._lease.release()
        return self.model

    def __repr__(self) -> str:
        plan = self.plan.table() if self.plan is not None else "not planned yet (the first step is traced)"
        return f"<TieredTraining {type(self.model).__name__}, {len(self.blocks)} blocks: {plan}>"


def block_size(model: Any, block_bytes: int | None) -> int:
    """``block_bytes``, or where it is None the largest parameter's bytes, at least BLOCK_BYTES
    (NOTE [block size])."""
    if block_bytes is not None:
        return block_bytes
    return max([BLOCK_BYTES] + [span_of(p) for p in model.parameters()])


def _blocks(torch: Any, model: Any, optimizer: Any, block_bytes: int | None, dev: Any) -> list[Block]:
    """The model's module blocks (``module_groups``), each with its parameters and the trainable
    ones among them, laid out; refuses parameters the training cannot take."""
    block_bytes = block_size(model, block_bytes)
    in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
    blocks: list[Block] = []
    seen: set[int] = set()
    for name, mod, own in module_groups(model, block_bytes):
        ps = [t for _, t in own if isinstance(t, torch.nn.Parameter)]
        if not ps:
            continue
        for p in ps:
            if (p.device != dev and p.device.type != "cpu") or not p.dtype.is_floating_point:
                raise WrapError(f"parameter {name} is {p.dtype} on {p.device}; wrap_training takes "
                                f"floating-point parameters on {dev} or on the host")
            seen.add(id(p))
        tr = [p for p in ps if p.requires_grad and id(p) in in_opt]
        blocks.append(Block(len(blocks), name, mod, ps, tr))
    missing = in_opt - seen
    if missing:
        raise ConfigError(f"{len(missing)} optimizer parameters are not parameters of the model")
    for b in blocks:
        b.lay_out()
    return blocks


def wrap_training(tier: Tier, model: Any, optimizer: Any, budget: int | str, options: TrainingOptions | None = None,
                  **kwargs: Any) -> TieredTraining:
    """Train ``model`` with ``optimizer`` within ``budget`` (see :class:`TieredTraining` and
    :class:`~tiermem.training.options.TrainingOptions`)."""
    return TieredTraining(tier, model, optimizer, budget, options, **kwargs)
