"""The smallest budget at which every step of a tiered training runs (NOTE [the floor]).

NOTE [the floor]
    At or above its floor a training runs every step, the traced first one included; torch
    running out of memory inside a step above the floor is a tiermem bug. The floor has two
    parts, known at different times, and it is stated as soon as each is known:

    * At wrap: the slots. A step streams its blocks through at least two slots (one in use,
      one filling), or the nesting of blocks inside blocks plus one, each as large as the
      largest streamed block's parameters, gradients and optimizer states. Before the first
      step the states may not exist yet: their bytes are the optimizer's (Adam and AdamW keep
      two moments of each parameter's dtype and size, SGD with momentum one, Adagrad one, any
      other optimizer is counted as two; ``state_dtype=bfloat16`` holds fp32 ones in half).
      With cuBLAS's workspaces (WORKSPACE_BYTES), that is the floor wrap_training checks: a
      budget below it is refused at once with OutOfBudgetError naming the block.
    * At the first step: the activations and temporaries. What the forward and the loss hold
      at once (most often the logits and the loss over [batch, tokens, vocab]) depends on the
      batch, which wrap_training does not see. The first step is traced under the most frugal
      policy: every saved activation of ``min_swap`` bytes or more is swapped to the host,
      autocast caches nothing (NOTE [autocast in a step]), and where the configured slots
      would take more than half the budget the trace streams through the fewest slots (the
      steps after get the rest back where the plan has room: NOTE [fewer slots]). Its slots are
      as large as the floor at wrap counted, the states the optimizer makes in that step
      included: the steps after it hold them, and a trace through slots of the parameters and
      gradients alone, grown after it, measured a peak below theirs (a 1.1B Llama at 1/4 of its
      state traced within the budget, then could not grow its slots). Its peak of torch's
      reserved bytes, less the slots it held, is the step's activations; the floor is those, a
      FLOOR_SLACK share more (the allocator cuts a cache up differently from step to step), the
      fewest slots of the largest block with its states, and tiermem's resident bytes. A budget
      below it ends the traced step with OutOfBudgetError (its update is kept; the next step
      traces again), and the plan (``train.plan``) prints it beside what sets it. Where torch
      runs out inside the traced step, before its peak is known, its OutOfMemoryError carries
      a note that the floor is at least what torch held then plus what it asked for, and
    ``train.budget_floor`` says so too (``at_least``), with those bytes, until a step is traced
    to its end.
    A step's activations are the caller's: a larger batch or sequence raises the floor, and
    that step is traced again, as any step of another shape is. Where the loss sets the floor
    (its fp32 log-probabilities over the vocabulary, and their gradient, are live at once in
    backward) a smaller batch or a loss computed in chunks lowers it: a model's own loss is the
    model's, and tiermem.training.lmloss.chunked_lm_loss is one to call in its place (NOTE
    [chunked loss]).

NOTE [wide blocks]
    The slots are as large as the largest streamed block with its gradients and optimizer states,
    and in a language model that is most often the embedding or the head: a 1.1B Llama's are 1.05
    GB each with AdamW, its decoder layers 0.70 GB, so two slots hold 0.7 GB that only those two
    blocks use, once a step each. With wide blocks (``wide_blocks=True``, or None where slots of
    the largest block would take more than WIDE_SHARE of the budget) up to WIDE_MAX of the largest
    blocks step otherwise: the slots are sized by the rest (and at least half the largest, and
    its parameters and gradients), a wide block comes into one slot for its forward and its
    backward (parameters, and gradients there), its gradients go home when complete, as in an
    accumulation window (NOTE [accumulation] in training/handle.py), and at the step's end it
    comes across the whole ring, parameters, gradients and states, steps, and goes home. It costs
    its gradients out and its parameters and gradients in once more, outside compute; what it
    gives is the floor lower by the slots' difference, room the plan spends on recomputing or
    keeping. The arithmetic is the plain loop's (tests/test_train_wide.py). Clipping and data
    parallel step every block at once or average in backward: no wide blocks with them.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from .slots import Block, aligned, ring_slot, slot_with

__all__ = ["FLOOR_SLACK", "WORKSPACE_BYTES", "WIDE_SHARE", "Floor", "after_trace", "asked_bytes", "at_wrap",
           "floor_slot", "nesting", "state_bytes", "trace_slots", "wide_wanted", "wrap_slot"]

WORKSPACE_BYTES = 64 << 20   # cuBLAS's and cuBLASLt's workspaces of the streams a step uses (docs/facts.md)
FLOOR_SLACK = 1 / 32         # of the traced activations: a later step's cache is cut up otherwise
WIDE_SHARE = 1 / 3           # of the budget: slots larger than that make wide_blocks=None step the largest wide

# optimizer class name -> states of a parameter's size it keeps (NOTE [the floor])
_STATES = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "SGD": 1, "Adagrad": 1, "RMSprop": 1,
           "Adadelta": 2, "Rprop": 2, "ASGD": 2, "LBFGS": 2}


@dataclasses.dataclass(frozen=True)
class Floor:
    """The smallest budget, in bytes, at which every step runs (NOTE [the floor]), and what sets it.
    ``activations`` is None until the first step has been traced."""

    bytes: int
    slots: int                       # slots counted
    slot_bytes: int                  # each: the largest streamed block's parameters, gradients, states
    block: str                       # that block's name
    workspace: int                   # cuBLAS's workspaces (at wrap; after the trace they are in activations)
    resident: int = 0                # tiermem's resident managed bytes
    activations: int | None = None   # the traced step's activations and temporaries
    largest: int = 0                 # the largest activation the traced step saved
    largest_where: str = ""          # ... and the block that saved it
    wide: tuple[str, ...] = ()       # blocks that step across the whole ring (NOTE [wide blocks])
    at_least: bool = False           # a lower bound: the traced step ran out before its peak was known

    @property
    def what(self) -> str:
        gb = _gb
        wide = f"; {', '.join(self.wide)} step across them at the step's end" if self.wide else ""
        parts = [f"{self.slots} slots of {gb(self.slot_bytes)} (block {self.block}: parameters, gradients and "
                 f"optimizer states{wide})"]
        if self.activations is None:
            parts.append((f"{gb(self.workspace)} for cuBLAS's workspaces; " if self.workspace else "")
                         + "the activations are known after the first step")
        else:
            act = f"{gb(self.activations)} of activations and temporaries at the traced step's peak"
            if self.largest:
                act += f" (the largest saved, {gb(self.largest)}, {self.largest_where})"
            parts.append(act)
        if self.resident:
            parts.append(f"{gb(self.resident)} resident")
        return " + ".join(parts)

    def __str__(self) -> str:
        if self.at_least:
            return (f"at least {self.bytes:,} bytes ({_gb(self.bytes)}): what torch held and asked for when the "
                    f"traced step ran out; {self.what}")
        return f"{self.bytes:,} bytes ({_gb(self.bytes)}): {self.what}"


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB"


def nesting(blocks: Sequence[Block]) -> int:
    """The most blocks whose forwards run at once: a block inside a block inside ..."""
    inside: dict[int, list[int]] = {b.index: [] for b in blocks}
    for a in blocks:
        mods = {id(m) for m in a.module.modules()}
        for b in blocks:
            if b is not a and id(b.module) in mods:
                inside[b.index].append(a.index)      # b runs inside a
    depth: dict[int, int] = {}

    def d(i: int) -> int:
        if i not in depth:
            depth[i] = 1 + max((d(j) for j in inside[i]), default=0)
        return depth[i]
    return max((d(b.index) for b in blocks), default=1)


def state_bytes(optimizer: Any, b: Block, state_dtype: Any) -> int:
    """Bytes of ``b``'s optimizer states in a slot: as held (``b.s_bytes``) once they exist, else
    what the optimizer will make (NOTE [the floor])."""
    if b.states:
        return b.s_bytes
    per = _STATES.get(type(optimizer).__name__, 2)
    n = 0
    for p in b.trainable:
        size = p.element_size()
        if state_dtype is not None and p.dtype.is_floating_point and size == 4:
            size = state_dtype.itemsize       # NOTE [bf16 moments]: fp32 states held narrowed
        n += per * aligned(p.numel() * size)
    return n


def _needs(blocks: Sequence[Block], optimizer: Any, state_dtype: Any) -> tuple[dict[int, int], dict[int, int]]:
    """Per streamed block: the slot bytes it needs with its states (as held, else as the optimizer
    will make them), and those it needs outside its step (parameters and gradients)."""
    streamed = [b for b in blocks if not b.resident]
    need = {b.index: b.p_bytes + b.g_bytes + state_bytes(optimizer, b, state_dtype) for b in streamed}
    return need, {b.index: b.p_bytes + b.g_bytes for b in streamed}


def floor_slot(need: dict[int, int], fwd: dict[int, int], least: int, wide: bool | None,
               rest: int) -> tuple[int, frozenset[int]]:
    """The slots' size the floor counts, and the blocks that step wide at it (NOTE [wide blocks]).
    ``wide``: the option as the training may use it (False where clipping or a process group rule
    it out). None is the rule of ``wide_blocks=None`` taken at the floor itself, where ``rest``
    bytes (workspaces, activations, resident blocks) sit beside the slots: a floor read at a
    larger budget, which steps no block wide, is still the least budget the same options run at."""
    if not need:
        return 0, frozenset()
    whole = aligned(max(need.values()))
    if wide is False:
        return whole, frozenset()
    slot, wide_set = ring_slot(need, fwd, least, True)
    if not wide_set or (wide is None and least * whole <= WIDE_SHARE * (least * slot + rest)):
        return whole, frozenset()
    return slot, wide_set


def at_wrap(blocks: Sequence[Block], optimizer: Any, state_dtype: Any, least: int,
            workspace: int = WORKSPACE_BYTES, wide: bool = False, may_wide: bool | None = False) -> Floor:
    """The floor before the first step: ``least`` slots of the largest block with its states (of
    the largest that is not wide, where ``may_wide`` has some step wide: :func:`floor_slot`), and
    ``workspace`` bytes for cuBLAS (none where the step runs on the host). Marks the blocks wide
    that ``wide``, the training's choice at its budget, makes so."""
    need, fwd = _needs(blocks, optimizer, state_dtype)
    if not need:
        return Floor(workspace, 0, 0, "-", workspace)
    _, wide_now = ring_slot(need, fwd, least, wide)
    for b in blocks:
        b.wide = b.index in wide_now
        b.need_before = need.get(b.index, 0)
    slot, wide_set = floor_slot(need, fwd, least, may_wide, workspace)
    big = max((i for i in need if i not in wide_set), key=lambda i: need[i], default=max(need, key=need.get))
    return Floor(least * slot + workspace, least, slot, blocks[big].name, workspace,
                 wide=tuple(blocks[i].name for i in sorted(wide_set)))


def wrap_slot(blocks: Sequence[Block], least: int) -> int:
    """The slots the first step streams through, as :func:`at_wrap` marked the blocks: sized for
    the states the optimizer makes in it (NOTE [the floor])."""
    streamed = [b for b in blocks if not b.resident]
    if not streamed:
        return 0
    return slot_with({b.index: b.need_before for b in streamed}, {b.index: b.p_bytes + b.g_bytes for b in streamed},
                     frozenset(b.index for b in streamed if b.wide), least)


def wide_wanted(blocks: Sequence[Block], optimizer: Any, state_dtype: Any, least: int, budget: int) -> bool:
    """NOTE [wide blocks]: whether ``wide_blocks=None`` steps the largest blocks across the ring: where
    that shrinks the slots, and slots at the largest block's size would take more than WIDE_SHARE
    of ``budget``."""
    need, fwd = _needs(blocks, optimizer, state_dtype)
    if not need:
        return False
    _, wide_set = ring_slot(need, fwd, least, True)
    return bool(wide_set) and least * aligned(max(need.values())) > WIDE_SHARE * budget


def after_trace(blocks: Sequence[Block], least: int, peak: int, held: int, resident: int,
                saved: Sequence[Any], may_wide: bool | None = False) -> Floor:
    """The floor once the first step is traced: its ``peak`` of torch's reserved bytes less the
    ``held`` bytes of the slots it streamed through is its activations; ``least`` slots sized by
    the blocks' states as they are now (:func:`floor_slot`, with ``may_wide``) and ``resident``
    bytes are added. ``saved``: the trace's saved records, for the largest."""
    act = max(peak - held, 0)
    act += -(-int(act * FLOOR_SLACK) // 1)
    streamed = [b for b in blocks if not b.resident]
    largest = max(saved, key=lambda r: r.nbytes, default=None)
    where = ""
    if largest is not None:
        seg = largest.segment
        where = f"saved in block {blocks[seg].name}" if 0 <= seg < len(blocks) else \
            "saved outside every block (the loss, the logits: the model's own head and loss)"
    big_saved = largest.nbytes if largest is not None else 0
    if not streamed:
        return Floor(act + resident, 0, 0, "-", 0, resident, act, big_saved, where)
    # a step that made no states yet (an accumulation window's first) counts those the optimizer will make
    need = {b.index: b.slot_need if b.states else max(b.slot_need, b.need_before) for b in streamed}
    slot, wide_set = floor_slot(need, {b.index: b.p_bytes + b.g_bytes for b in streamed}, least, may_wide,
                                act + resident)
    big = max((i for i in need if i not in wide_set), key=lambda i: need[i], default=max(need, key=need.get))
    return Floor(least * slot + act + resident, least, slot, blocks[big].name, 0, resident, act, big_saved, where,
                 wide=tuple(blocks[i].name for i in sorted(wide_set)))


def trace_slots(configured: int, least: int, slot_estimate: int, budget: int) -> int:
    """How many slots the traced step streams through: the configured ones, or the fewest where
    those would take more than half the budget (NOTE [the floor])."""
    if configured * slot_estimate <= budget // 2:
        return configured
    return min(configured, least)


_ASKED = re.compile(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)")


def asked_bytes(message: str) -> int:
    """The bytes a torch OutOfMemoryError's message says were asked for (0 if it says none)."""
    m = _ASKED.search(message)
    if m is None:
        return 0
    unit = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}[m.group(2)]
    return int(float(m.group(1)) * unit)
