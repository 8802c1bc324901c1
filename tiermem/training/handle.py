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
        plain copies at the link rate (55 GB/s each way, both at once), where Unified Memory
        writes dirty pages back at ~10 GB/s and its prefetches serialise with each other
        (bench/results/bandwidth-*.json, probe_paths2);
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

    The averages run on tiermem's reduce stream, beside the backward: it first waits for the
    compute stream's work so far (the block's gradients), the all-reduces are issued there
    with ``async_op`` and the stream (not the host) waits for each, and a streamed block's
    division, optimizer step and write-back home are queued after them. So the backward of the
    blocks that follow never waits for NCCL, and the link's copies wait only for what they
    read: a slot is filled again after its write-back, which is after the step. Before, each
    all-reduce held the compute stream, and with it the next block's backward and the fills
    that wait for it. The compute stream joins the reduce stream where it reads the averages:
    at the step's end, before the resident blocks step, and with clipping after each average
    (the norms are taken on the compute stream). On the CPU (gloo) the waits are the host's.

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

NOTE [measured choice], NOTE [fewer slots] and NOTE [a slot for recompute] are in training/choice.py, with
the choice of plan; NOTE [clipping] and NOTE [speculative clipping] in training/clipping.py.
NOTE [bf16 moments] and NOTE [loaded states] are in training/states.py, with the optimizer's states.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..base.limits import parse_bytes
from ..core.stream import Lane, now
from ..errors import ConfigError, ConfigTypeError, OutOfBudgetError, TierMemError, WrapError
from ..inference.groups import module_groups
from ..pytorch.devmem import device_memory
from ..pytorch.held import CopyGuard, InstancePatch
from .choice import PlanChoice
from .clipping import Clipping, leaves_grads
from .kvoff import kv_cache_configs, kv_cache_off
from .memory import HostBuffers, check_room, free_adopted, plain_copies
from .meter import StallMeter
from .options import averaging_group, check_options, states_dtype
from .plan import LINK_GBPS, SavedRecord, StepTrace, TrainPlan, evaluate
from .recompute import Recompute
from .replay import Replays
from .resident import make_resident
from .slots import Block, BlockSlots, aligned
from .states import OptimizerStates
from .swap import ActivationSwap

if TYPE_CHECKING:
    from ..core.engine import Engine as Tier  # what an adapter uses is the engine's interface

__all__ = ["TieredTraining", "wrap_training"]

log = logging.getLogger("tiermem")

BLOCK_BYTES = 64 << 20    # parameter bytes per block: a slot holds ~4x that (params, grads, Adam's two moments)
RESIDENT_STEP_BYTES = 64 << 20   # parameter bytes per optimizer call for resident blocks


class TieredTraining:
    """Handle of a model and optimizer trained by :func:`wrap_training` (NOTE [training transport]).

    ``budget``: bytes, "2GiB" or a share of the device ("25%"). ``lookahead``: blocks brought in
    ahead of use (the slots are ``lookahead + 1``). ``min_swap``: saved storages smaller than this
    stay on the device. ``window``: bytes of activation copies in flight each way (default
    budget/32). ``swap=False`` never swaps activations (nor recomputes them). ``margin``: bytes
    the plan leaves free (default budget/8). ``recompute``: "auto" lets the plan choose per block
    between keeping, swapping and recomputing its activations (NOTE [recompute plan]), "never"
    keeps or swaps only, "always" recomputes every block it can. ``link_GBps``: the link's rate
    each way that the plan assumes (default 55, the H100 machine's). ``state_dtype``: None (the
    default) keeps optimizer states as the optimizer made them; ``torch.bfloat16`` (or
    "bfloat16") holds streamed blocks' fp32 states as bf16 at home and over the link, rounded
    stochastically, stepped in fp32 (NOTE [bf16 moments]). ``accumulate``: micro-batches per
    optimizer step, one per ``train.step()``; the optimizer steps in every ``accumulate``-th
    (NOTE [accumulation]). ``max_grad_norm``: clip the gradients to this global norm
    (``norm_type``, default 2) before each optimizer step, as ``torch.nn.utils.clip_grad_norm_``
    does; ``train.grad_norm`` is the norm it found (NOTE [clipping]). ``speculate``: step the
    streamed blocks inside backward as if the clip will not bite, into a second pinned home, and
    keep that step when it did not (NOTE [speculative clipping]); it doubles their pinned bytes.
    ``graphs``: replay each recomputed block's backward as a CUDA graph where the budget leaves
    room for the graphs' pool (NOTE [replayed recompute]); off by default, when torch's
    checkpoint recomputes every step.
    """

    def __init__(self, tier: Tier, model: Any, optimizer: Any, budget: int | str, *, lookahead: int = 2,
                 min_swap: int = 1 << 20, window: int | None = None, swap: bool = True,
                 block_bytes: int = BLOCK_BYTES, margin: int | None = None, process_group: Any = None,
                 recompute: str = "auto", link_GBps: float | None = None, state_dtype: Any = None,
                 accumulate: int = 1, max_grad_norm: float | None = None, norm_type: float = 2.0,
                 speculate: bool = False, graphs: bool = False):
        import torch
        self.torch = torch
        check_options(budget, lookahead=lookahead, recompute=recompute, link_GBps=link_GBps, state_dtype=state_dtype,
                      accumulate=accumulate, max_grad_norm=max_grad_norm, norm_type=norm_type, speculate=speculate,
                      graphs=graphs)
        if speculate and type(optimizer) not in leaves_grads():
            raise ConfigError(f"speculate=True needs an optimizer whose step leaves the gradients alone "
                              f"({', '.join(sorted(t.__name__ for t in leaves_grads()))}), got "
                              f"{type(optimizer).__name__} (NOTE [speculative clipping])")
        self.accumulate = accumulate
        self.accumulated = 0                  # micro-batches in the open window (NOTE [accumulation])
        self.updates = 0                      # optimizer steps taken
        self._updating = True
        self._window: set[int] = set()        # parameters with a gradient in the open window
        self.state_dtype = states_dtype(state_dtype)
        self.recompute_mode = recompute if swap else "never"
        self.link_GBps = float(link_GBps) if link_GBps is not None else LINK_GBPS
        if getattr(model, "_tiermem_handle", None) is not None:
            raise WrapError("this model is already adopted by tiermem; unwrap it first")
        self.tier, self.model, self.opt = tier, model, optimizer
        if kv_cache_configs(model):            # NOTE [no KV cache in a step]
            log.warning("tiermem: %s's config has use_cache=True; inside train.step() it is False (a training "
                        "forward has no use for a KV cache, which would hold every layer's keys and values)",
                        type(model).__name__)
        self.group = averaging_group(process_group)      # NOTE [data parallel]
        be = tier.backend
        total = be.capabilities().total_memory
        self.budget = parse_bytes(budget, total=total, what="training budget", max_percent=100)
        self.total = total
        self.mem = device_memory(torch, be, tier.device)     # NOTE [device memory]
        self.dev = self.mem.device
        in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self.blocks: list[Block] = []
        seen: set[int] = set()
        for name, mod, own in module_groups(model, block_bytes):
            ps = [t for _, t in own if isinstance(t, torch.nn.Parameter)]
            if not ps:
                continue
            for p in ps:
                if (p.device != self.dev and p.device.type != "cpu") or not p.dtype.is_floating_point:
                    raise WrapError(f"parameter {name} is {p.dtype} on {p.device}; wrap_training takes "
                                    f"floating-point parameters on {self.dev} or on the host")
                seen.add(id(p))
            tr = [p for p in ps if p.requires_grad and id(p) in in_opt]
            self.blocks.append(Block(len(self.blocks), name, mod, ps, tr))
        missing = in_opt - seen
        if missing:
            raise ConfigError(f"{len(missing)} optimizer parameters are not parameters of the model")
        for b in self.blocks:
            b.lay_out()
        room = tier.lease_room()                 # NOTE [budget leases]
        if room is not None and self.budget > room:
            log.warning("tiermem: a training budget of %s bytes does not fit the tier's configured budget (%s bytes "
                        "left for leases); training within that", f"{self.budget:,}", f"{room:,}")
            self.budget = room
        self._hooks: list[Any] = []
        self._state_hooks: list[Any] = []    # the optimizer's; _take's in-capacity removal keeps them
        self._old_fraction: float | None = None
        self.swap: ActivationSwap | None = None
        by_module = {id(b.module): b for b in self.blocks}
        self.replays = Replays(torch, capture=graphs and be.kind == "cuda",
                               params_of=lambda m: by_module[id(m)].trainable,
                               after_replay=lambda m, hit: self._replayed(by_module[id(m)], hit))
        self.replays.room = self._graph_room
        self.recomputing = Recompute(torch, lambda: self._in_step, self.replays)
        self.meter = StallMeter(tier.backend)
        self.stream = BlockSlots(tier, self.blocks, optimizer, self.meter, lookahead, self.dev)
        self._reduce = Lane(tier.backend, lambda: tier.side_stream("reduce"))    # NOTE [data parallel]
        self.states = OptimizerStates(tier, optimizer, self.stream, self.mem, self.state_dtype, self.meter,
                                      lambda: self._in_step)
        self.rounding = self.states.rounding      # NOTE [bf16 moments]
        self.clipping = (None if max_grad_norm is None else     # NOTE [clipping]
                         Clipping(torch, optimizer, self.stream, self.states, max_grad_norm, norm_type, speculate))
        self.choice = PlanChoice(backend=be, blocks=self.blocks, stream=self.stream, replays=self.replays,
                                 budget=self.budget, margin=margin, mode=self.recompute_mode,
                                 link_GBps=self.link_GBps, clip=max_grad_norm is not None, take=self._take,
                                 timings=self._timings, resident_bytes=lambda: tier.resident_bytes)
        self._lease = tier.lease(self.budget, owner=f"wrap_training({type(model).__name__})")
        originals = [(p, p.data) for b in self.blocks for p in b.params]
        # NOTE [host models]: where each parameter came from, for unwrap's default
        self._origin = {id(p): p.device for b in self.blocks for p in b.params}
        self.host_buffers = HostBuffers(self.dev)     # NOTE [host models]
        try:
            self.host_buffers.move_in(model)
            self._adopt(tier, model, min_swap, window, swap,
                        {d.untyped_storage().data_ptr() for _, d in originals if d.device == self.dev})
        except BaseException:
            self._rollback(originals)
            raise
        del originals
        self.mem.empty_cache()      # NOTE [outside memory]: the parameters' old memory goes back

    # NOTE [outside memory]
    #     What torch holds on the device when tiermem takes the model over (the caller's other
    #     tensors: a batch, a second model) is not the step's: the cap adds it to the budget and
    #     the step's peak leaves it out. It is the bytes of those tensors' blocks in torch's
    #     segments, not the segments: free space inside them is the step's to use, so its peak
    #     counts it. It is measured while the adoption still holds the parameters' old device
    #     memory (a failed adoption gives it back to them), that memory left out; the handle frees
    #     it once adopted. Counting it in let torch take the model's parameter bytes beyond the budget,
    #     and resident_peak() reported that much less than the step held: on the H100 the GPT of
    #     bench/train_budget.py at 1/2.5 of its state (budget 1.40 GB) reported 0.26-0.33 GB for
    #     steps that held 1.14-1.21 GB (bench/probes/probe_floor.py at 471d2c8).
    def _adopt(self, tier: Tier, model: Any, min_swap: int, window: int | None, swap: bool, old: set[int]) -> None:
        torch = self.torch
        self.mem.synchronize()
        with torch.no_grad():
            for b in self.blocks:
                self.stream.make_home(b)
                self.mem.synchronize()
                self.stream.bind_home(b)
        self.mem.empty_cache()
        self.outside = self.mem.reserved_without(old)
        nslots = self.stream.nslots
        slots = nslots * aligned(self.stream.needed_slot_bytes())
        # On the device only: the CPU tests' budgets are nominal, torch's CPU allocator has no cap.
        if slots > self.budget and tier.backend.kind == "cuda":
            big = max(self.blocks, key=lambda b: b.p_bytes + b.g_bytes)
            raise OutOfBudgetError(slots, 0, self.budget, hint=(
                f"the {nslots} slots a step streams blocks through need that much before any "
                f"activation (the largest block, {big.name}, with its gradients); raise the budget, or "
                "wrap with a smaller block_bytes or lookahead"))
        self.stream.alloc()
        self._old_fraction = self._fraction()
        self._set_cap()
        # Copies in flight hold device memory: 1/32 of the budget each way keeps the link busy
        # (a copy of 1/32 of a 1.4 GB budget takes ~0.8 ms) and costs little capacity.
        window = max(1 << 20, self.budget // 32) if window is None else int(window)
        self.swap = ActivationSwap(tier, self.stream.params, min_swap=min_swap, window=window, device=self.dev) if swap else None
        if self.swap is not None:
            self.swap.on_param = self._on_param_read
            self.swap.segment = self._segment
            self.swap.meter = self.meter
        self.min_swap = min_swap
        self._seg: list[int] = []              # blocks whose forward is running, innermost last
        self._calls: dict[int, int] = {}       # forward calls per block in the traced step
        self._boundary: dict[int, tuple[int, int]] = {}   # block -> (bytes, saves) of its inputs
        self._keep_keys: frozenset[tuple[int, int]] = frozenset()
        self._boundary_saves: dict[int, int] = {}
        self._expect: dict[int, tuple[int, ...]] | None = None
        self._nesting = 1                      # streamed blocks the traced step used at once
        self._general_peak: int | None = None   # the last step's peak outside the graphs' pool
        self._changes_at_begin = 0
        containers = {id(b.module) for b in self.blocks for o in self.blocks
                      if o is not b and any(m is o.module for m in b.module.modules())}
        # A block can be recomputed when no other block runs inside it (its forward is its own
        # ops) and the user did not ask transformers to checkpoint it already.
        self._leaf = {b.index for b in self.blocks
                      if id(b.module) not in containers and not getattr(b.module, "gradient_checkpointing", False)}
        self._order: list[int] = []            # blocks in forward order, from the traced step
        self._need: list[tuple[int, int]] = []   # swapped keys in backward-read order
        self._tracing = True
        self._in_step = False
        self._failed = False
        self._got = set()
        self._resident_got: dict[int, set[int]] = {}     # NOTE [data parallel]: per step
        self._averaged: set[int] = set()
        self._grads_at_begin: dict[int, int | None] = {}
        self._eval_next = 0                    # NOTE [evaluation between steps]: the block expected next
        self.moved = {"h2d": 0, "d2h": 0}      # bytes moved in the last step
        self.last_peak = 0                     # torch's peak reserved bytes in the last step
        self.floor = 0                         # the traced step's peak, everything moving
        self.steps = 0
        for b in self.blocks:
            self._hooks.append(b.module.register_forward_pre_hook(lambda m, a, b=b: self._fwd_pre(b, a)))
            self._hooks.append(b.module.register_forward_hook(lambda m, a, out, b=b: self._fwd_post(b, out)))
            for p in b.trainable:
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda p, b=b: self._grad_done(b, p)))
        self._state_hooks = self.states.hooks() + [model.register_load_state_dict_pre_hook(_model_loading(self)),
                                                   _zero_grad_hook(self.opt, _zero_grad_called(self, "optimizer")),
                                                   _zero_grad_hook(model, _zero_grad_called(self, "model")),
                                                   CopyGuard(model)]       # NOTE [held modules]
        mine = {id(p) for b in self.blocks for p in b.trainable}
        for name, m in model.named_modules():
            params = [p for p in m.parameters() if id(p) in mine]
            if name and params:       # a submodule's own zero_grad (NOTE [zero_grad])
                self._state_hooks.append(_zero_grad_hook(m, _zero_grad_called(self, f"model.{name}", params)))
        model._tiermem_handle = weakref.ref(self)

    def _rollback(self, originals: list[tuple[Any, Any]]) -> None:
        """Undo a failed adoption (NOTE [all or nothing] in inference/module.py): the parameters get their
        own memory back, and every byte, hook, cap and lease the adoption took is given back.
        Must not raise over the adoption's error."""
        for h in self._hooks + self._state_hooks:
            h.remove()
        self._hooks, self._state_hooks = [], []
        self.recomputing.set({})
        self.mem.synchronize()
        for p, data in originals:
            p.data = data
        self.host_buffers.put_back()
        if self._old_fraction is not None:
            self.mem.set_fraction(self._old_fraction)
        free_adopted(self.blocks, self.stream, self.replays, self.swap)
        self._lease.release()
        self.mem.empty_cache()

    # -- memory ------------------------------------------------------------------------------------
    def _fraction(self) -> float:
        return self.mem.fraction()

    # NOTE [kept exceptions]
    # The cap on torch's allocator leaves the step the budget and no more. A step that raised
    # leaves its activations referenced by the exception's traceback frames for as long as the
    # caller keeps the exception (``except ... as e: saved = e``, pytest's ``raises(...) as
    # ei``), and the next step then runs out of memory under the cap. Python cannot be told to
    # let go of a caller's frames, so tiermem does not try: the caller drops the exception, or
    # calls ``traceback.clear_frames(e.__traceback__)``. The soak (bench/soak.py) does the
    # latter after each injected failure; on the H100 it then recovered from 279 of 279.
    # A dropped exception is not always freed at once: ``with train.step():`` passes it through
    # contextlib's ``__exit__``, whose frame holds the exception that holds the frame, a cycle
    # that only the garbage collector frees. The step after a failed one therefore collects
    # first (seen on the H100 at f215f40: the step after a backward that raised half-way ran
    # 20 MiB over its cap while the failed step's graph waited for a collection). It also
    # empties torch's cache: the cap is the traced step's reserved peak, and a step that failed
    # part-way leaves the cache cut up as no traced step left it (on the H200 at 5ccef39 the
    # next step asked for 20 MiB with 14 MiB reserved and unallocated, 226 MiB allowed).
    def _set_cap(self) -> None:
        """torch's allocator may use the budget minus tiermem's resident managed bytes."""
        room = max(self.budget - self.tier.resident_bytes, 0) + self.outside
        self.mem.set_fraction(min(room / self.total, 1.0))

    # -- hooks -------------------------------------------------------------------------------------
    def _segment(self) -> int:
        return self._seg[-1] if self._seg else -1

    def _fwd_pre(self, b: Block, args: Any) -> None:
        if not self._in_step:
            self._eval_pre(b)
            return
        if self._tracing:
            if b.index not in self._order:
                self._order.append(b.index)
            self._calls[b.index] = self._calls.get(b.index, 0) + 1
            self._boundary[b.index] = self._inputs(args)
            if not b.resident:           # streamed blocks in use at once (NOTE [fewer slots])
                depth = 1 + sum(not self.blocks[i].resident for i in self._seg)
                self._nesting = max(self._nesting, depth)
        if not b.resident:
            pos = self._order.index(b.index) if b.index in self._order else len(self._order)
            upcoming = self._order[pos + 1:] if not self._tracing else []
            self.stream.ensure(b, states=False, upcoming=upcoming)
            if upcoming:
                self.stream.ahead(upcoming)
        self._seg.append(b.index)
        self.meter.mark(("block", b.index, "start"))

    # NOTE [evaluation between steps]
    #     A forward outside train.step() (an evaluation, under torch.no_grad() or not) read the
    #     streamed blocks' parameters from their pinned homes in place, over the link, as every
    #     kernel touching them needed them: on the H100 an evaluation forward of the GPT model of
    #     bench/train_budget.py at 1/2.5 of its state took 618 ms against 28 ms resident, where
    #     its 0.84 GB of streamed parameters take 15 ms over the link (bench/probes/probe_eval.py).
    #     So once a step has been traced, a forward outside a step streams the blocks through the
    #     slots as a step's forward does (31-33 ms there now, 1.10x resident): each block is filled
    #     ahead of use, from the pre-hook of a block before it (a resident one too), after the
    #     work queued before that pre-hook (the caller's writes home), and when its forward ends
    #     its parameters are bound to their home again and the slot's copy is forgotten, so a
    #     write between forwards or steps reaches the next one (NOTE [training transport]). A forward that does
    #     not follow the traced order (one stopped part-way, a block called alone) first puts
    #     every parameter home and forgets every slot's copy; so does the next step.
    def _eval_pre(self, b: Block) -> None:
        order = self._order
        if self._tracing or not order or not self.stream.slots:
            return                         # not planned yet, or nothing streams: read in place
        pos = order.index(b.index) if b.index in order else -1
        if pos != self._eval_next:
            self.stream.reset()
        self._eval_next = (pos + 1) % len(order) if pos >= 0 else 0
        if pos < 0:
            return
        self.stream.mark_start()
        upcoming = order[pos + 1:]
        if not b.resident:
            self.stream.ensure(b, states=False, upcoming=upcoming)
        if upcoming:
            self.stream.ahead(upcoming)    # from a resident block too: the first streamed ones come in under it

    def _inputs(self, args: Any) -> tuple[int, int]:
        """Bytes and storages a recomputed block would save: its positional tensor inputs that the
        swap would take (NOTE [recompute plan]; torch's checkpoint saves exactly those)."""
        torch = self.torch
        seen: set[int] = set()
        n = 0
        for a in args:
            if not torch.is_tensor(a) or a.device != self.dev or a.numel() == 0:
                continue
            st = a.untyped_storage()
            ptr = st.data_ptr()
            if ptr in seen or ptr in self.stream.params or st.nbytes() < self.min_swap:
                continue
            seen.add(ptr)
            n += st.nbytes()
        return n, len(seen)

    def _fwd_post(self, b: Block, out: Any) -> None:
        if not self._in_step:
            self.stream.leave(b)
            return
        self.meter.mark(("block", b.index, "end"))
        if self._seg and self._seg[-1] == b.index:
            self._seg.pop()
        self.stream.done(b)
        if self.torch.is_grad_enabled():
            t = _first_grad_tensor(out)
            if t is not None:
                t.register_hook(lambda g, b=b: self._bwd_enter(b))

    def _peak(self) -> int:
        """torch's peak reserved bytes in this step (NOTE [replayed recompute]: a measured
        backward resets the device's counter, and keeps the peak before it)."""
        return max(self.mem.max_reserved(), self.replays.peak_carry)

    def _graph_room(self) -> int | None:
        """Bytes the recomputed blocks' graphs' pool may take (NOTE [replayed recompute]): what
        torch's allocator is capped at, less the last step's peak outside the pool (a step before
        any graph recomputed eagerly: its peak holds the working set the pool now holds too, so
        this errs on the safe side), less 1/32 of the budget."""
        if self._general_peak is None:
            return None
        cap = max(self.budget - self.tier.resident_bytes, 0) + self.outside
        return cap - self.budget // 32 - self._general_peak

    def _bwd_enter(self, b: Block, ahead: bool = True) -> None:
        if not self.stream.in_backward:
            self.meter.mark(("fwd", "end"))
            self.meter.mark(("bwd", "start"))
        self.stream.in_backward = True
        if b.resident or b.entered:
            return
        pos = self._order.index(b.index) if b.index in self._order else -1
        upcoming = list(reversed(self._order[:pos])) if pos >= 0 else []
        s = self.stream.ensure(b, states=True, upcoming=upcoming)
        b.entered = True
        b.waiting = len(b.trainable)
        if b.trainable:
            if not b.grads_home:          # else the fill brought the window's gradients so far
                self.stream.grad_region(s, b).zero_()
            for p, g in zip(b.trainable, self.stream.slot_views(s, b)[1]):
                p.grad = g
        if upcoming and ahead:
            self.stream.ahead(upcoming)

    def _on_param_read(self, p: Any) -> None:
        b = self.stream.block_of.get(id(p))
        if b is not None and not b.resident and not b.entered:
            self._bwd_enter(b)

    def _grad_done(self, b: Block, p: Any) -> None:
        if self.replays.capturing:
            self.replays.hit.append(p)     # the capture's accumulation; its replays report it
            return
        if not self._in_step:
            return
        if b.resident:
            if self.group is not None and self._updating:
                self._resident_grad_done(b, p)
            return
        if not b.entered:
            self._bwd_enter(b)    # a gradient with no backward entry seen (an output not tracked)
        if id(p) in self._got:
            raise TierMemError(f"a parameter of block {b.name} got its gradient twice in one step; tiermem "
                               "steps each block as soon as its gradients are complete, so run one backward "
                               "per train.step(): for gradient accumulation, wrap with accumulate=N and run "
                               "one micro-batch per step")
        self._got.add(id(p))
        b.waiting -= 1
        if b.waiting == 0:
            self._block_done(b)

    def _resident_grad_done(self, b: Block, p: Any) -> None:
        """NOTE [data parallel]: a resident block's gradients are averaged as soon as they are
        complete, as a streamed block's are, so the all-reduces keep one order on every rank
        whichever blocks each rank's plan keeps resident."""
        got = self._resident_got.setdefault(b.index, set())
        got.add(id(p))
        if len(got) == len(b.trainable):
            self._average_resident(b)

    def _average_resident(self, b: Block) -> None:
        if b.index not in self._averaged:
            self._averaged.add(b.index)
            self._average([p for p in b.trainable if p.grad is not None])

    def _replayed(self, b: Block, hit: list[Any]) -> None:
        """A replayed backward added into ``hit``'s gradients, as autograd's accumulation would have."""
        for p in hit:
            self._grad_done(b, p)

    def _block_done(self, b: Block) -> None:
        """A streamed block's gradients of this micro-batch are complete: step it when the step
        updates, else send its gradients home for the next micro-batch (NOTE [accumulation]);
        when clipping, take their norms and send them home for the step's end (NOTE [clipping])."""
        if self._updating:
            got = [p for p in b.trainable if self._came(p)]
            if self.clipping is None:
                self._average(got, step=lambda: self._step_block(b))
                return
            self._average(got, join=True)       # the norms are taken on the compute stream
            for p in b.trainable:
                if not self._came(p):
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

    def _came(self, p: Any) -> bool:
        """``p`` got a gradient in this step or earlier in the open window (NOTE [accumulation])."""
        return id(p) in self._got or id(p) in self._window

    # -- optimizer ---------------------------------------------------------------------------------
    def _average(self, params: list[Any], step: Any = None, join: bool = False) -> None:
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
        lane = self._reduce
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
            self._join_reduce()

    def _join_reduce(self) -> None:
        """The compute stream waits for the work queued on the reduce stream so far."""
        if self.group is not None:
            be = self.tier.backend
            be.wait(be.current_stream(), self._reduce.mark())

    def _step_block(self, b: Block) -> None:
        """Step a streamed block whose gradients are complete, and write it back home."""
        for p in b.trainable:
            if not self._came(p):
                p.grad = None     # no gradient reached it: the optimizer skips it, as it would resident
        self.states.step_block(b, b.slot)
        b.stepped = True
        b.grads_home = False
        if not b.states and b.trainable:
            self.states.adopt(b)
        self.stream.write_back(b)
        for p in b.trainable:
            p.grad = None

    # NOTE [zero_grad]
    #     Plain loops call optimizer.zero_grad(), and transformers' Trainer calls model.zero_grad()
    #     after each optimizer step; a loop ported to train.step() keeps either. Before backward it
    #     is harmless, except inside an accumulation window, where it drops the window's
    #     gradients: then it drops the streamed blocks' too, which wait at home where zero_grad
    #     cannot see them, as a plain loop's zero_grad would (NOTE [accumulation]). After backward
    #     inside a step it would drop the resident blocks' gradients before their step at the
    #     step's end, while the streamed blocks stepped already: refused. tiermem wraps the
    #     zero_grad of the optimizer and of the model on the instance for that, as torch's LR
    #     schedulers wrap the optimizer's step, and unwrap() puts them back. A submodule's own
    #     zero_grad (``model.layers[3].zero_grad()``) is wrapped too: after backward inside a
    #     step it is refused as the model's is; inside an accumulation window it would drop that
    #     submodule's gradients only, which a streamed block keeps at home as one buffer with the
    #     rest of its block's, so it is refused where any of its parameters streams, and runs as
    #     it would in a plain loop where all of them are resident (their gradients are in .grad).
    #     Between windows every gradient is clear already: it does nothing, as in a plain loop.
    #     A copy of the optimizer leaves the wrapper out (torch's
    #     Optimizer.__getstate__ keeps its state and groups only); the model refuses copies
    #     while tiermem holds it (NOTE [held modules] in pytorch/held.py).
    def _zero_grad(self, owner: str, params: list[Any] | None = None) -> None:
        """Before the zero_grad of ``owner``: "optimizer", "model", or a submodule's name with
        its ``params`` (NOTE [zero_grad])."""
        if self._in_step and (self.stream.in_backward or self._got or self._resident_grads_changed()):
            raise TierMemError(f"{owner}.zero_grad() after backward inside train.step() would drop gradients "
                               "before their optimizer step: drop it, the handle clears the gradients itself")
        if params is not None:
            if self.accumulated:
                ids = {id(p) for p in params}
                streamed = [b.name for b in self.blocks if not b.resident and any(id(p) in ids for p in b.trainable)]
                if streamed:
                    raise TierMemError(
                        f"{owner}.zero_grad() inside an accumulation window ({self.accumulated} micro-batch(es) "
                        f"in it) would drop only this submodule's gradients, and those of {streamed[0]} wait at "
                        "home with the rest of its block's: call model.zero_grad() or optimizer.zero_grad() "
                        "to drop the whole window, or this one after the window's optimizer step")
            return
        if self.accumulated:
            log.info("tiermem: zero_grad() inside an accumulation window drops its %d micro-batches' gradients",
                     self.accumulated)
            self.stream.drop_grads()
            self.accumulated = 0
            self._window = set()

    def _resident_grads(self) -> dict[int, int | None]:
        """Each resident trainable parameter's gradient version (None: no gradient)."""
        return {id(p): (None if p.grad is None else p.grad._version)
                for b in self.blocks if b.resident for p in b.trainable}

    def _resident_grads_changed(self) -> bool:
        """A backward reached a resident block since the step began (in capacity no hook tells)."""
        return self._resident_grads() != self._grads_at_begin

    def _model_loading(self) -> None:
        """Before ``model.load_state_dict``: refused inside a step. Between steps every streamed
        parameter is bound to its home (NOTE [training transport]), so the load writes there."""
        if self._in_step:
            raise TierMemError("load the model's state between steps, not inside train.step()")

    # -- steps -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, update: bool | None = None) -> Iterator[TieredTraining]:
        """One training step: run forward and backward inside. On exit every block has taken its
        optimizer step and the gradients are cleared. With ``accumulate=N`` each step is one
        micro-batch, and the optimizer steps in every N-th (NOTE [accumulation]); ``update``
        True or False says whether this one steps (True at an epoch's end closes a short
        window). Not reentrant; not thread-safe."""
        torch = self.torch
        if self._in_step:
            raise TierMemError("train.step() is already open; steps do not nest")
        if update is not None and not isinstance(update, bool):
            raise ConfigTypeError(f"step(update=...) takes True, False or None, got {update!r}")
        self._in_step = True
        ok = False
        try:
            try:
                self._updating = self.accumulated + 1 >= self.accumulate if update is None else update
                self._begin_step()
                hooks = (torch.autograd.graph.saved_tensors_hooks(self.swap.pack, self.swap.unpack)
                         if self.swap is not None and self._swapping() else contextlib.nullcontext())
                with hooks, kv_cache_off(self.model):
                    yield self
                ok = True
            finally:
                try:
                    self._finish_step(ok)
                finally:
                    self._in_step = False
        except torch.OutOfMemoryError as e:
            if hasattr(e, "add_note"):          # Python 3.11+; the error stays torch's, for code that catches it
                e.add_note(self._budget_note())
            if self.replays.graphs:
                # NOTE [replayed recompute]: the graphs' pool held memory the step's own
                # allocations then lacked; the next steps recompute eagerly, without it
                self.replays.give_up(f"a step ran out of memory beside the graphs' pool: {e}")
            raise

    # -- whole-step graphs (NOTE [whole-step graphs] in training/stepgraph.py) -----------------------------
    def graphed(self, fn: Any) -> Any:
        """``fn(*tensors) -> loss`` as a training step: ``loss = step(ids)`` runs forward,
        backward and every block's optimizer step, eagerly until the plan has settled, then as
        one captured CUDA graph replayed each step (NOTE [whole-step graphs] in training/stepgraph.py).
        The returned :class:`GraphedStep` says in ``off`` why its steps stay eager, if they do."""
        from .stepgraph import GraphedStep
        return GraphedStep(self, fn)

    def follow(self, plan: TrainPlan) -> None:
        """Make ``plan`` the one the next steps follow (one ``choice.graph_timed`` gave)."""
        if self._in_step:
            raise TierMemError("a plan is changed between steps, not inside one")
        self.choice.take(plan)
        self.choice.restart_timing()

    @property
    def settled(self) -> bool:
        """The plan will not change by itself: the measured choice and its checks are done, and
        the last step neither failed nor traced."""
        return (self.plan is not None and not self._tracing and not self._failed and self.choice.settled
                and not self._in_step
                and self.accumulated == 0 and not self.replays.pending)

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
        if self.tier.backend.kind != "cuda":
            return "the backend cannot capture CUDA graphs (no GPU)"
        return ""

    # NOTE [another path under capture]
    #     A model may run other kernels while a CUDA graph captures than it runs eagerly, and then
    #     saves other tensors for backward: the captured step diverges from the trace the plan was
    #     made from (NOTE [activation swap]), swaps everything, and the step after it traces again
    #     and plans anew, which drops the graph; settled again, the next capture diverges again.
    #     On the H100 at 63119d0 a transformers Llama (5.17.0, SDPA, grouped-query attention, no
    #     mask passed) did so: transformers builds no mask eagerly, so torch's SDPA took its math
    #     path with the key/value heads as they are (saving 2 MiB attention weights), and builds
    #     one while capturing, where it repeats the key/value heads and takes the memory-efficient
    #     kernel; its graphed steps were captured twice and replayed twice in 32 steps. So a
    #     capture whose step diverged fails like any capture CUDA refuses: graphs are off for the
    #     run with the reason, the step runs eagerly (and traces), and nothing is lost.
    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """The step inside is captured, not run (NOTE [whole-step graphs]): the backend resolves
        events for the capture (NOTE [events across a capture]), and the step's timing events,
        which no time can be read from, are dropped. If the capture fails, the step counts as not
        taken, and the next one starts as after a failed step."""
        steps, updates = self.steps, self.updates
        tracing = self._tracing
        try:
            with self.tier.backend.capturing():
                yield
            if self._tracing and not tracing and self.swap is not None and self.swap.diverged:
                # NOTE [another path under capture]
                raise TierMemError(
                    "the step saved other tensors while captured than in its eager steps: the model takes "
                    "another path under a CUDA graph capture (transformers' SDPA attention builds its mask "
                    "only while capturing, and with grouped-query attention that changes its kernels): "
                    "pass the attention mask as a 4-D tensor built once, or train with train.step()")
        except BaseException:
            self._failed = True
            raise
        finally:
            # nothing ran: the step is counted by its replay (``replayed``), or not at all
            self.steps, self.updates = steps, updates
            self.choice.drop_step_events(pending=True)

    def join_streams(self) -> None:
        """End of a captured step: the side streams' captured copies join the compute stream."""
        be = self.tier.backend
        be.join_capture(be.current_stream())

    def before_replay(self) -> None:
        """A captured step is about to replay: no block may be in a slot (an evaluation between
        steps leaves them there, NOTE [evaluation between steps])."""
        if self._in_step:
            raise TierMemError("a graphed step runs outside train.step(), not inside it")
        self.stream.reset()

    def replayed(self, moved: dict[str, int]) -> None:
        """A captured step replayed: it counts as a step, and moved what the capture queued."""
        self.steps += 1
        self.updates += 1
        self.moved = dict(moved)

    def _budget_note(self) -> str:
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
                     + (" (this was the traced first step: the plan is made after it)." if self._tracing else "."))
        return " ".join(lines)

    def _begin_step(self) -> None:
        if self._failed:                 # NOTE [kept exceptions]: free the failed step's cycle
            self._failed = False
            gc.collect()
            self.mem.empty_cache()
            # Blocks whose states were adopted in a traced step that failed before its replan
            # need slots the replan would have grown: a fill would run past a slot's end
            # (tests/test_train_faults.py crashed on the CPU; on a GPU it writes over torch's memory).
            if self.stream.too_small():
                self.stream.alloc()
            self._set_cap()
        self.choice.read_times()
        self._got: set[int] = set()
        self._resident_got, self._averaged = {}, set()     # NOTE [data parallel]
        self._grads_at_begin = self._resident_grads()       # NOTE [zero_grad]
        self._changes_at_begin = self.replays.changes
        self._seg = []
        self._eval_next = 0
        self.moved = {"h2d": 0, "d2h": 0}
        for b in self.blocks:
            b.entered, b.stepped, b.waiting = False, False, 0
        self.mem.reset_peak()
        self.replays.peak_carry = 0
        if self._tracing:
            self._calls, self._boundary = {}, {}
            self.recomputing.set({})             # the trace sees every block's own saves
        if self.swap is not None:
            if self._tracing or self.plan is None:
                self.swap.begin(None, frozenset(), [])
            else:
                self.swap.begin(self._expect, self._keep_keys, list(self._need), self.plan.recompute)
        if self._tracing or (self.choice.metering_next and self._updating):
            self.meter.start()
        self.meter.mark(("fwd", "start"))
        self.stream.begin(self.choice.step_begun())   # fills wait for it: the caller's writes home come before
        self.stream.updating = self._updating
        if self.clipping is not None:
            self.clipping.begin(self._updating, self._tracing)
        if not self._tracing:
            self.stream.ahead(self._order)    # NOTE [training transport]: the first blocks, from their homes

    def _swapping(self) -> bool:
        return self._tracing or self.plan is None or self.plan.swapped_bytes > 0

    def _finish_step(self, ok: bool) -> None:
        try:
            self._close_step(ok)
        except BaseException:
            # A failure while finishing (an optimizer step, a wait; Ctrl-C lands here as well)
            # fails the step as one inside it does.
            self.meter.stop()
            self._clear_failed_step()
            raise
        metered = self.meter.on
        self.meter.stop()
        if not ok:
            self._clear_failed_step()
            return
        self.steps += 1
        self.last_peak = self._peak()
        self._general_peak = self.last_peak - self.replays.held_bytes     # NOTE [replayed recompute]
        diverged = self.swap is not None and self.swap.diverged
        if self._updating:
            self.updates += 1
            self.accumulated = 0
            self._window = set()
        else:
            self.accumulated += 1
            self._window |= self._got
        if self._tracing and not self._updating:
            pass          # NOTE [accumulation]: the trace goes on to the window's optimizer step
        elif self._tracing:
            # Reserved, not allocated: the cap applies to what torch reserves, fragmentation included.
            try:
                self._replan(self._peak())
            except BaseException:
                # The plan did not take: trace again, and let the next step set the slots and the
                # cap for the blocks as they are (some may have become resident).
                self._tracing, self._failed = True, True
                raise
        elif diverged:
            log.info("tiermem: the step's saved tensors changed (another shape?); tracing the next step")
            self._tracing = True
            self.choice.restart_timing()
        elif not self._updating:
            pass          # the plan's choice is timed on steps that update
        elif self.stream.too_small():
            log.info("tiermem: optimizer states appeared after the plan; tracing the next step")
            self._tracing = True
            self.choice.restart_timing()
        else:
            self.choice.after_step(metered, self.replays.changes != self._changes_at_begin)
        self._capture_graphs()

    def _capture_graphs(self) -> None:
        """NOTE [replayed recompute]: the graphs this step's eager backwards asked for, captured
        between steps, when the step's tensors are gone, if the plan with the pool still holds
        the budget less its margin; else the choice plans again with room for the pool (its
        ``after_step``) or gives the graphs up, and later steps ask again."""
        r = self.replays
        if not r.pending:
            return
        if self.plan is None or self._tracing:
            r.drop_pending()
            return
        if r.reserve > self.plan.graph_pool:
            with_pool = evaluate(self.trace, dataclasses.replace(self.plan, graph_pool=r.reserve))
            if with_pool.predicted_peak > self.budget - self.plan.margin:
                r.drop_pending()
                return
        r.capture_pending()

    def _close_step(self, ok: bool) -> None:
        """Step what is left to step (when ``ok``), and end the step's moves and swap."""
        for b in self.blocks:
            if ok and self._updating and b.grads_home and not b.entered:
                self._bwd_enter(b, ahead=False)   # gradients from earlier micro-batches only: step it too
            if b.entered and not b.stepped and ok:
                self._block_done(b)
            elif b.slot is not None:
                b.slot.busy = False
            if ok and self._updating and b.resident and self.group is not None:
                self._average_resident(b)          # NOTE [data parallel]: in block order, with the streamed
        self._join_reduce()         # NOTE [data parallel]: the averages before the resident steps
        res = [p for b in self.blocks if b.resident for p in b.trainable if p.grad is not None]
        if ok and self._updating and self.clipping is not None:
            ordered = [self.blocks[i] for i in self._order]
            ordered += [b for b in self.blocks if b.index not in self._order]     # not in the traced order
            self.clipping.clip_and_step(res, list(self.model.parameters()), ordered, self._came, self._step_block)
        self.stream.end()           # this step's write-backs; every parameter its home's again
        if ok and res and self._updating:
            # A foreach step makes temporaries as large as the parameters it updates, which the
            # traced step (every block stepped alone) never saw: step the resident blocks a few
            # at a time. With no hooks left (in capacity) it is one call, as plain PyTorch does.
            for chunk in _chunks(res, RESIDENT_STEP_BYTES if self._hooks else None):
                self.states.step(chunk)
            for p in res:
                p.grad = None
        self.meter.mark(("bwd", "end"))
        if ok:
            self.choice.step_ended(self._updating)
        self.moved = dict(self.stream.moved)
        if self.swap is not None:
            self.swap.end()
            for d in ("h2d", "d2h"):
                self.moved[d] += self.swap.moved[d]

    def _clear_failed_step(self) -> None:
        """A step that raised (in forward, part-way through backward, or while finishing) leaves
        no gradients: the next step would add its own to them. Blocks whose backward had finished
        took their optimizer step already, as in any step (NOTE [training transport])."""
        self._failed = True
        try:
            self._join_reduce()      # the reduce stream may still use the gradients dropped below
        except Exception as e:       # a broken device: the step's own error is the one to see
            log.warning("tiermem: could not order the reduce stream after a failed step: %s", e)
        self.replays.drop_pending()
        self.stream.in_backward = False
        self._seg = []
        self.choice.drop_step_events()
        self.stream.idle()
        for b in self.blocks:
            for p in b.trainable:
                p.grad = None
        if self.accumulated or not self._updating:
            log.warning("tiermem: a step failed inside an accumulation window; the window's gradients "
                        "(%d micro-batches before it) are dropped and the next step opens a new one",
                        self.accumulated)
        if self.clipping is not None:
            self.clipping.undo(self.blocks)     # blocks stepped into their second homes did not step
            self.clipping.norms.clear()
        self.stream.drop_grads()
        self.accumulated = 0
        self._window = set()
        if self.swap is not None:
            self.swap.end()

    # -- plans -------------------------------------------------------------------------------------
    def _timings(self) -> tuple[tuple[float, ...], float, float]:
        """Per block forward compute, forward and backward compute of the metered step (ms),
        waits taken out (NOTE [recompute plan]). Blocks not seen get -1."""
        self.mem.synchronize()
        spans = self.meter.spans()
        per = tuple(spans.get(("block", b.index), -1.0) for b in self.blocks)
        return per, spans.get(("fwd",), 0.0), spans.get(("bwd",), 0.0)

    def _replan(self, floor: int) -> None:
        recs = self.swap.records() if self.swap is not None else []
        saved = tuple(SavedRecord(i, n, u, g) for i, n, u, g in recs)
        per, fwd, bwd = self._timings()
        shared = self.swap.shared_segments() if self.swap is not None else set()
        segs = {r.segment for r in saved}
        recomputable = frozenset(
            i for i in self._leaf
            if self._calls.get(i) == 1 and i not in shared and i in segs and per[i] >= 0
            and self._boundary.get(i, (0, 0))[1] <= sum(r.segment == i for r in saved))
        floor = max(floor - self.outside, 0)
        self.floor = floor
        new_slot = aligned(self.stream.needed_slot_bytes())
        floor += self.stream.nslots * max(new_slot - self.stream.slot_bytes, 0)     # the slots grow to hold states
        trace = StepTrace(saved, tuple(b.p_bytes for b in self.blocks),
                           tuple(b.s_full for b in self.blocks), floor,
                           frozenset(b.index for b in self.blocks if b.resident),
                           block_fwd_ms=tuple(max(x, 0.0) for x in per), recomputable=recomputable,
                           boundary_bytes=tuple(self._boundary.get(b.index, (0, 0))[0] for b in self.blocks),
                           fwd_ms=fwd, bwd_ms=bwd, block_names=tuple(b.name for b in self.blocks),
                           block_state_moved_bytes=tuple(b.s_bytes for b in self.blocks))
        self._boundary_saves = {b.index: self._boundary.get(b.index, (0, 0))[1] for b in self.blocks}
        self.choice.replan(trace, self.floor, self._nesting)
        self._tracing = False

    def _take(self, old: TrainPlan | None, plan: TrainPlan) -> None:
        """Apply ``plan``, which the choice now follows, to the steps (``old``: the plan before)."""
        t = self.trace
        self.replays.drop_pending()         # asked for at the old plan's slots
        if (self.replays.graphs and old is not None and self._general_peak is not None
                and self.replays.reserve > self._graph_room() - max(0, _general(plan) - _general(old))):
            # NOTE [replayed recompute]: the new plan keeps more on the device than the pool leaves room for
            self.replays.give_up("the new plan leaves no room for the graphs' pool")
        key: dict[int, tuple[int, int]] = {}
        count: dict[int, int] = {}
        for r in t.saved:                        # the swap's keys (NOTE [activation swap])
            key[r.index] = (r.segment, count.get(r.segment, 0))
            count[r.segment] = key[r.index][1] + 1
        self._keep_keys = frozenset(key[i] for i in plan.keep)
        self._expect = {}
        for r in t.saved:
            self._expect.setdefault(r.segment, ())
            self._expect[r.segment] += (r.nbytes,)
        # Swapped storages in the order backward first read them; a recomputed segment's inputs
        # are read when its backward begins, just before its own saves were.
        need: list[tuple[int, int]] = []
        done: set[int] = set()
        for r in sorted((r for r in t.saved if r.use >= 0), key=lambda r: r.use):
            if r.segment in plan.recompute:
                if r.segment not in done:
                    done.add(r.segment)
                    need += [(r.segment, k) for k in range(self._boundary_saves.get(r.segment, 0))]
            else:
                need.append(key[r.index])
        self._need = need
        for i in sorted(plan.resident_blocks):
            if not self.blocks[i].resident:
                self._make_resident(self.blocks[i])
        self.stream.alloc()
        self._set_cap()
        self.mem.empty_cache()
        self.recomputing.set({i: self.blocks[i].module for i in plan.recompute})
        if plan.in_capacity and self.group is None:
            # In capacity: nothing moves, so no hook is needed, and a module with hooks takes
            # torch's slower call path. Steps are then plain steps on managed memory. (With a
            # process group the hooks stay: NOTE [data parallel].)
            for h in self._hooks:
                h.remove()
            self._hooks = []
        log.info("tiermem: %s", plan.table())

    def _make_resident(self, b: Block) -> None:
        """Move ``b`` into managed memory kept on the device (NOTE [training transport])."""
        fixed = make_resident(self.tier, self.stream, self.opt, self.mem, b)
        if self.swap is not None:
            self.swap.fixed.update(fixed)

    # -- reporting and lifecycle ---------------------------------------------------------------------
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

    def resident_peak(self) -> int:
        """Device bytes the last step kept at its peak: tiermem's resident managed bytes plus
        torch's peak reserved bytes, less what torch held before wrap_training. At most the budget."""
        return self.tier.resident_bytes + self.last_peak - self.outside

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
                "eager_recomputed_blocks": len(self.replays.eager), "graphs_off": self.replays.off}

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
        check_room(torch, self.tier.backend, self.blocks, self.opt, where, self.dev)
        cap = self.mem.fraction()
        self.mem.set_fraction(self._old_fraction)    # the plain copies are outside the budget
        try:
            self.stream.unbind_all()     # none after a step that finished; one that failed finishing
            self.mem.synchronize()
            copies = plain_copies(torch, self.blocks, self.opt, self.stream, where, self._window)
            self.mem.synchronize()
        except BaseException:
            self.mem.set_fraction(cap)      # check_room refused what would not fit; this is anything else
            raise
        # Nothing below calls the backend before the memory is given back.
        for h in self._hooks + self._state_hooks:
            h.remove()
        self._hooks, self._state_hooks = [], []
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


def _zero_grad_hook(obj: Any, before: Any) -> InstancePatch:
    """``obj``'s zero_grad (an optimizer's or a module's) wrapped on the instance so that
    ``before`` runs first (NOTE [zero_grad]); remove() puts it back."""
    inner = obj.zero_grad

    def zero_grad(*args: Any, **kwargs: Any) -> Any:
        before()
        return inner(*args, **kwargs)
    return InstancePatch(obj, {"zero_grad": zero_grad})


def _zero_grad_called(handle: TieredTraining, owner: str, params: list[Any] | None = None) -> Any:
    """What the wrapped zero_grad of ``owner`` (with a submodule's ``params``) calls first; it
    holds the handle weakly."""
    ref = weakref.ref(handle)

    def before() -> None:
        h = ref()
        if h is not None:
            h._zero_grad(owner, params)
    return before


def _model_loading(handle: TieredTraining) -> Any:
    """The model's load_state_dict pre-hook; it holds the handle weakly."""
    ref = weakref.ref(handle)

    def hook(module: Any, *_: Any) -> None:
        h = ref()
        if h is not None:
            h._model_loading()
    return hook


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


def _first_grad_tensor(out: Any) -> Any:
    import torch
    if torch.is_tensor(out):
        return out if out.requires_grad else None
    if isinstance(out, (tuple, list)):
        for o in out:
            t = _first_grad_tensor(o)
            if t is not None:
                return t
    if isinstance(out, dict):
        for o in out.values():
            t = _first_grad_tensor(o)
            if t is not None:
                return t
    return None


def wrap_training(tier: Tier, model: Any, optimizer: Any, budget: int | str, **kwargs: Any) -> TieredTraining:
    """Train ``model`` with ``optimizer`` within ``budget`` (see :class:`TieredTraining`)."""
    return TieredTraining(tier, model, optimizer, budget, **kwargs)


def _general(plan: TrainPlan) -> int:
    """A plan's predicted peak outside the graphs' pool (NOTE [replayed recompute])."""
    return plan.predicted_peak - plan.recompute_peak
