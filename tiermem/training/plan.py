"""The training plan: what one step keeps on the device and what it moves, from a traced step.

NOTE [training plan]
    As in Zhang et al. 2019 (arXiv 1903.06631), the first step is traced: every tensor autograd
    saves for backward (its size, the order it was saved in, the order backward first reads it)
    and the peak of torch's caching allocator while everything that can move did move: every
    block's parameters and optimizer states streamed through the slots, every saved activation
    of at least ``min_swap`` bytes swapped to the host. That peak is the step's floor.

    The plan then spends what the budget leaves above that floor, greedily, on what saves the
    most bytes over the link per device byte:

      1. whole blocks resident (parameters and optimizer states, in managed memory kept on the
         device): a streamed block moves its parameters in twice (forward, backward) and out once
         (after its update), and its states in and out once: 28 bytes per parameter (fp32 Adam),
         for 12 bytes of device memory, ~2.3 bytes moved per byte kept (20 bytes, ~1.7, with
         states held in bf16: ``block_state_moved_bytes``, NOTE [bf16 moments] in training/states.py);
      2. saved activations kept on the device, latest saved first (backward reads those first,
         so swapping them would leave the least time to bring them back): 2 bytes moved per byte.

    Everything not kept moves at the link rate on tiermem's two copy streams while the GPU
    computes. The floor plus what was kept is the plan's predicted peak; a step that diverges
    from the trace (another batch shape) is traced again and re-planned.

NOTE [recompute plan]
    Swapping a saved activation costs its bytes twice over the link (out in forward, back in
    backward); recomputing it costs the forward ops that made it, run again in backward, and a
    transformer block's forward is several times shorter than its saves take over the link
    (docs/history.md, "Measurements behind the code's notes"). So, as Capuchin (ASPLOS 2020) does per tensor, the plan chooses per *block segment* (the
    activations one module block saves; a block that contains no other block) between keeping
    them on the device, swapping them, and recomputing them in backward.

    The traced step measures what the choice needs: each record's segment, each block's forward
    time (CUDA events around it, less every wait the step made inside it: the GPU's waits for
    copies and the host's waits for the swap window, each bracketed by events of its own), the
    step's forward and backward time with those waits taken out, and the bytes a recomputed
    block would still save (its inputs). What it cannot see is how long a block's forward
    takes when its saves do not go through the swap: the hooks' host work (events, copies, a
    dozen CUDA calls per save) starves the GPU, by several times a block's own forward. So the
    next steps are a probe: every block that can be recomputed is, and its forward, now the
    forward alone, is timed again. The steps after follow the plan made from both (and a timed
    check of it, NOTE [measured choice] in training/choice.py): a block's
    recompute costs its probe time, and swapping it costs what its hooks added (taken twice,
    for pack in forward and unpack in backward). The predicted step is two phases, each as
    slow as its slowest resource:

        forward   max(F,      streamed params in,  swapped activations out)
        backward  max(B + R,  streamed params, states and swapped activations in,
                              streamed params and states out)

    with F and B the measured compute, R the recomputed blocks' forward times, and the link
    rate per direction. The plan is chosen greedily by predicted time saved per device byte:
    recompute where it is faster than swapping, then whole blocks resident and whole segments
    kept, then single activations kept, latest first; a last pass flips any segment between
    swap and recompute where that is faster. Its predicted time is never above that of the
    swap-only and the recompute-everywhere plans, which are built too, and the fastest that fits
    is taken. A recomputed segment's activations are all alive at once in its backward: the
    predicted peak adds the largest of them.

NOTE [recompute in parts]
    A recomputed block holds its whole segment in its backward, and at a tight budget a decoder
    layer's (about a gigabyte for a 1.1B Llama at 4x2048 tokens) does not fit beside the slots:
    the plan then swapped those layers whole, at twice their saves over the link. Smaller blocks
    would recompute less of them: what runs between blocks (attention's core, the MLP's product)
    is outside every block and is swapped. So a block can instead be recomputed *in parts*: its
    forward is checkpointed as before, and so is each of its direct children (its parts), inside
    it, as torch's non-reentrant checkpoint allows nesting. Its backward runs the block's forward
    again, in which each part saves only its inputs, then each part's backward runs that part's
    forward once more: the block holds its parts' inputs and one part's saves at a time, not its
    whole segment, for one more forward of the block. The traced step records which part saved
    each storage and each part's tensor inputs (keyword arguments too: they are alive while the
    block's forward runs again); a block's peak in parts is what it saves outside its parts, its
    parts' inputs, and its largest part's saves. The plan chooses per block between swap,
    recompute and recompute in parts, as it chooses between the first two. The graphs of NOTE
    [replayed recompute] do not replay a block recomputed in parts.

NOTE [bytes bound]
    The fewest bytes a step within a budget moves, whatever its plan (``TrainPlan.bytes_bound``):
    every activation recomputed or kept (none swapped), and the room the budget leaves above the
    floor spent on resident blocks, those that save the most link bytes per device byte first,
    the last one in part. A streamed block moves its parameters in twice and out once and its
    optimizer states in and out (with clipping, its parameters and gradients twice more). It is
    a lower bound, not a plan: recomputing costs compute and its inputs still cross the link, and
    blocks are kept whole. A plan's bytes are judged against it (tests/test_train_finetune.py).

NOTE [calibrated compute]
    The model's compute times come from a metered step: CUDA events at every block's edges and
    around every wait, whose host work the GPU then waits for: a metered step is slower than
    the same plan's steps. And the model misses more than the meter: how the fills share the
    link with the swap, the host's work between kernels. So it errs both ways, by up to 30%
    (docs/history.md, "Measurements behind the code's notes").
    The probe's plan runs two unmetered steps after its metered one (NOTE [measured choice] in
    training/choice.py). Their mean is what the model should say for that plan, so every compute time of
    the trace (the step's forward and backward, each block's forward with and without the swap)
    is multiplied by the one factor under which it does (:func:`fit_compute`, :func:`scaled`),
    where the link does not explain the difference (below). Every plan after, the model's choice among them
    too, is predicted from the fitted times, and ``train.plan`` shows the factor. One factor for
    all compute keeps what the probe measured about each block relative to the others.

    A step slower than the model says is first laid to the link, not the compute
    (:func:`fit_link`): the metered times are the compute with the meter's host work in it, so
    more than they say, and a step that moves more than it computes waits on its copies (and
    the swap's hooks between them), which the meter does not see. Laid to the compute, a 1.1B
    Llama's swap-everything plan at 1/2.5 of its state read 469 ms of forward where its whole
    resident step takes 192 ms, and recomputing looked dearer than swapping 20 GB (H200). So the
    link's time is stretched, up to LINK_FIT_MAX times, until the probe's plan predicts its
    steps with its compute as metered, and every plan after is made at that rate (the plan's
    table shows it); only where that cannot explain the steps (a plan that moves too little) is
    the compute scaled as above.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..errors import ConfigError

__all__ = ["SavedRecord", "StepTrace", "TrainPlan", "plan_training", "RECOMPUTE_MODES", "bytes_bound", "evaluate", "fit_compute", "fit_link",
           "scaled", "slots_for_recompute"]

LINK_GBPS = 55.0   # pinned copies each way, PCIe Gen5 x16 (docs/facts.md)
RECOMPUTE_MODES = ("auto", "never", "always")


@dataclasses.dataclass(frozen=True)
class SavedRecord:
    """One storage autograd saved during the traced step."""

    index: int          # order of saving (forward order)
    nbytes: int
    use: int            # order of its first read in backward; -1: never read
    segment: int = -1   # the innermost block whose forward saved it; -1: outside every block
    part: int = -1      # the part of that block whose forward saved it (NOTE [recompute in parts]); -1: none


@dataclasses.dataclass(frozen=True)
class StepTrace:
    """What the traced step did. Sizes are bytes, times milliseconds of compute (NOTE [recompute plan])."""

    saved: tuple[SavedRecord, ...]
    block_param_bytes: tuple[int, ...]     # per block, forward order
    block_state_bytes: tuple[int, ...]     # optimizer-state bytes per block
    floor_peak: int                        # torch's peak allocated bytes, everything moving
    resident_blocks: frozenset[int] = frozenset()   # blocks already resident (in managed memory,
                                                    # outside torch's allocator) while tracing
    block_fwd_ms: tuple[float, ...] = ()   # per block: its forward's compute, recomputed; () when not measured
    block_swap_ms: tuple[float, ...] = ()  # per block: its forward with its saves through the swap (the
                                           # hooks' host time included); () when the same
    measured_recompute: frozenset[int] = frozenset()   # blocks recomputed when fwd_ms/bwd_ms were measured
    recomputable: frozenset[int] = frozenset()      # blocks whose segment can be recomputed
    boundary_bytes: tuple[int, ...] = ()   # per block: bytes a recomputed block still saves (its inputs)
    fwd_ms: float = 0.0                    # the step's forward compute
    bwd_ms: float = 0.0                    # the step's backward and optimizer compute
    block_names: tuple[str, ...] = ()
    block_state_moved_bytes: tuple[int, ...] = ()   # per block: its states' bytes as they cross the
                                                    # link (NOTE [bf16 moments]); (): block_state_bytes
    compute_scale: float = 1.0             # the factor the times above carry (NOTE [calibrated compute])
    part_block: tuple[int, ...] = ()       # per part (NOTE [recompute in parts]): the block it is a child of
    part_input_bytes: tuple[int, ...] = ()  # per part: its tensor inputs, not counted for a part before it
    wide_blocks: frozenset[int] = frozenset()   # blocks stepped across the ring at the step's end (NOTE [wide blocks])

    @property
    def saved_bytes(self) -> int:
        return sum(r.nbytes for r in self.saved)

    @property
    def key(self) -> tuple[int, ...]:
        """Sizes in saving order: a step whose saves differ from this needs another plan."""
        return tuple(r.nbytes for r in self.saved)

    def segment_bytes(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for r in self.saved:
            out[r.segment] = out.get(r.segment, 0) + r.nbytes
        return out


@dataclasses.dataclass(frozen=True)
class TrainPlan:
    """What each step keeps on the device, moves and recomputes; see NOTE [training plan] and
    NOTE [recompute plan]. Sizes are bytes."""

    budget: int
    floor_peak: int
    resident_blocks: frozenset[int]
    keep: frozenset[int]                    # saved-storage indices kept on the device
    block_param_bytes: tuple[int, ...]
    block_state_bytes: tuple[int, ...]
    saved_bytes: int
    kept_bytes: int
    margin: int
    recompute: frozenset[int] = frozenset()  # blocks whose segment is recomputed in backward
    recomputed_bytes: int = 0                # saved bytes of those segments, no longer saved
    boundary_bytes: int = 0                  # what the recomputed blocks save instead (swapped)
    recompute_peak: int = 0                  # the largest recomputed segment, alive in its backward
    parts: frozenset[int] = frozenset()      # recomputed blocks recomputed in parts (NOTE [recompute in parts])
    wide_blocks: frozenset[int] = frozenset()  # as in StepTrace
    graph_pool: int = 0                      # the replayed backwards' pool, held instead (NOTE [replayed recompute])
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0
    recompute_ms: float = 0.0
    link_GBps: float = LINK_GBPS
    kind: str = "swap"                       # which candidate won: "swap", "recompute" or "mixed"
    segment_modes: tuple[str, ...] = ()      # per block: "keep", "swap", "recompute", "mixed", "-"
    block_names: tuple[str, ...] = ()
    block_state_moved_bytes: tuple[int, ...] = ()   # as in StepTrace; block_state_bytes is what a
                                                    # resident block keeps on the device
    clip: bool = False                       # streamed blocks step in a pass after backward (NOTE [clipping])
    compute_scale: float = 1.0               # the trace's (NOTE [calibrated compute])
    budget_floor: int = 0                    # the smallest budget every step runs at (NOTE [the floor]); 0: not known
    floor_what: str = ""                     # what sets it
    measured: dict[str, float] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @property
    def streamed_blocks(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self.block_param_bytes)) if i not in self.resident_blocks)

    @property
    def in_capacity(self) -> bool:
        """Nothing streamed, swapped or recomputed: the step runs as plain PyTorch would."""
        return not (self.streamed_blocks or self.recompute or self.swapped_bytes)

    @property
    def _states_moved(self) -> tuple[int, ...]:
        return self.block_state_moved_bytes or self.block_state_bytes

    @property
    def resident_block_bytes(self) -> int:
        return sum(self.block_param_bytes[i] + self.block_state_bytes[i] for i in self.resident_blocks)

    @property
    def swapped_bytes(self) -> int:
        """Activation bytes swapped out (and back) per step."""
        return self.saved_bytes - self.kept_bytes - self.recomputed_bytes + self.boundary_bytes

    @property
    def h2d_bytes(self) -> int:
        """Bytes one step moves host -> device: streamed parameters twice, their states once,
        swapped activations once; when clipping, the pass's parameters, states and gradients too."""
        s, st = self.streamed_blocks, self._states_moved
        clip = sum(2 * self.block_param_bytes[i] for i in s) if self.clip else 0
        return sum(2 * self.block_param_bytes[i] + st[i] for i in s) + self.swapped_bytes + clip + self._wide_more()

    @property
    def d2h_bytes(self) -> int:
        return self._moved_out() + self.swapped_bytes + (self._params_in() if self.clip else 0) + self._wide_grads()

    def _wide_grads(self) -> int:
        """NOTE [wide blocks]: the streamed wide blocks' gradients, home and back."""
        return sum(self.block_param_bytes[i] for i in self.wide_blocks if i not in self.resident_blocks)

    def _wide_more(self) -> int:
        """NOTE [wide blocks]: what the streamed wide blocks bring in once more: parameters and gradients."""
        return 2 * self._wide_grads()

    @property
    def bytes_bound(self) -> int:
        """The fewest bytes (in and out together) a step of this budget moves, whatever the plan
        (NOTE [bytes bound])."""
        return bytes_bound(self.block_param_bytes, self.block_state_bytes, self._states_moved,
                           self.budget - self.margin - self.floor_peak, self.clip, self.wide_blocks)

    @property
    def predicted_peak(self) -> int:
        return self.floor_peak + self.kept_bytes + self.resident_block_bytes + self.recompute_peak

    def predicted_seconds(self, link_GBps: float | None = None) -> float:
        """The step's predicted time (NOTE [recompute plan]): forward and backward, each as slow
        as the busiest of compute and the two directions of the link."""
        rate = (self.link_GBps if link_GBps is None else link_GBps) * 1e9
        return _phases(self.fwd_ms, self.bwd_ms + self.recompute_ms, self._params_in(), self._moved_out(),
                       self.swapped_bytes, rate, self.clip) + _wide_tail(
            self.block_param_bytes, self._states_moved, self.wide_blocks - self.resident_blocks, rate)

    def _params_in(self) -> int:
        return sum(self.block_param_bytes[i] for i in self.streamed_blocks)

    def _moved_out(self) -> int:
        st = self._states_moved
        return sum(self.block_param_bytes[i] + st[i] for i in self.streamed_blocks)

    def table(self) -> str:
        gb = lambda n: f"{n / 1e9:.3f} GB"  # noqa: E731
        nb = len(self.block_param_bytes)
        pred = self.predicted_seconds() * 1e3
        lines = [
            f"training plan for a {gb(self.budget)} budget ({self.kind})",
            f"  blocks resident  {len(self.resident_blocks)}/{nb} ({gb(self.resident_block_bytes)} params+states)",
            f"  blocks streamed  {nb - len(self.resident_blocks)}/{nb}",
            f"  activations      {gb(self.saved_bytes)} saved: {gb(self.kept_bytes)} kept, "
            f"{gb(self.swapped_bytes)} swapped, {gb(self.recomputed_bytes)} recomputed "
            f"({len(self.keep)} storages kept, {len(self.recompute)} blocks recomputed"
            + (f", {len(self.parts)} of them in parts" if self.parts else "") + ")",
            f"  per step         {gb(self.h2d_bytes)} in, {gb(self.d2h_bytes)} out at {self.link_GBps:.0f} GB/s"
            + (f" (the link's {self.link_GBps * self.measured['link_scale']:.0f} GB/s over "
               f"{self.measured['link_scale']:.2f}, fitted to the probe's own steps)"
               if self.measured.get("link_scale", 1.0) != 1.0 else "") + "; "
            f"compute {self.fwd_ms:.1f} ms forward, {self.bwd_ms:.1f} ms backward, {self.recompute_ms:.1f} ms recomputed"
            + (f" (the metered step's times x{self.compute_scale:.2f}, fitted to the probe's own steps)"
               if self.compute_scale != 1.0 else ""),
            f"  bytes bound      {gb(self.bytes_bound)} a step at the least, whatever the plan"
            + (f" (this one moves {(self.h2d_bytes + self.d2h_bytes) / self.bytes_bound:.2f}x that)"
               if self.bytes_bound else "") + " (NOTE [bytes bound])",
            f"  step time        {pred:.1f} ms predicted" + (" (with the clipping pass)" if self.clip else "") + (
                f", {self.measured['step_ms']:.1f} ms measured ({self.measured['step_ms'] / pred:.2f}x)"
                if self.measured.get("step_ms") and pred > 0 else ""),
            f"  device peak      {gb(self.predicted_peak)} predicted (floor {gb(self.floor_peak)}, "
            f"margin {gb(self.margin)}" + (f", graphs' pool {gb(self.graph_pool)}" if self.graph_pool else "") + ")",
        ]
        if self.budget_floor:
            lines.append(f"  budget floor     {gb(self.budget_floor)}, the least budget every step runs at: "
                         f"{self.floor_what} (NOTE [the floor])")
        if self.measured.get("model_ms"):
            lines.append(f"  not tried        the model's own plan, {self.measured['model_ms']:.1f} ms predicted: "
                         "not enough faster to try (NOTE [measured choice])")
        if self.measured.get("probe_ms"):
            # NOTE [measured choice] in training/choice.py
            by = self.measured.get("chosen_by")
            lines.append(f"  checked          the model's plan took {self.measured['checked_ms']:.1f} ms a step, "
                         f"recomputing everywhere {self.measured['probe_ms']:.1f} ms: "
                         + ("recomputing everywhere" if by == "measured" else "the model's plan kept"))
            if "late_ms" in self.measured:
                lines.append(f"  checked again    the model's plan took {self.measured['late_ms']:.1f} ms a step "
                             "(median of its next steps): "
                             + ("recomputing everywhere" if by == "late" else "the model's plan kept"))
        lines += self._graph_lines()
        if self.segment_modes and self.block_names:
            lines.append("  per block        params / activations")
            for i, (name, mode) in enumerate(zip(self.block_names, self.segment_modes)):
                where = ("resident" if i in self.resident_blocks else
                         "wide" if i in self.wide_blocks else "streamed")     # NOTE [wide blocks]
                lines.append(f"    {name:<30} {where:<9} {mode}")
        return "\n".join(lines)

    def _graph_lines(self) -> list[str]:
        """NOTE [graph choice] in training/graphchoice.py: what the whole-step graph's replays measured
        and decided."""
        m = self.measured
        if not m.get("replay_ms"):
            return []
        line = f"  replayed         {m['replay_ms']:.1f} ms a step as one CUDA graph"
        if m.get("tried_replay_ms"):
            line += (f"; a plan tried on its replays' times, predicted {m['tried_predicted_ms']:.1f} ms, replayed "
                     f"{m['tried_replay_ms']:.1f} ms: this plan came back")
        elif m.get("graph_refuted_ms"):
            line += (f"; the model fitted to it predicts {m['graph_refuted_ms']:.1f} ms for a plan recomputing "
                     "fewer blocks, which the eager steps found slower: not tried")
        elif m.get("chosen_by") == "graph":
            line += (f", tried after the first plan's replays ({m['first_replay_ms']:.1f} ms), predicted "
                     f"{m['graph_predicted_ms']:.1f} ms")
        return [line]

    def __str__(self) -> str:
        return self.table()


def bytes_bound(param_bytes: Sequence[int], state_bytes: Sequence[int], state_moved: Sequence[int], room: int,
                clip: bool = False, wide: frozenset[int] = frozenset()) -> int:
    """NOTE [bytes bound]: the bytes a step moves with ``room`` device bytes spent on the blocks
    that save the most link bytes per device byte, a share of a block counted as its share of
    the bytes, and no activation swapped. A ``wide`` block streamed moves its gradients home and
    back and its parameters once more (NOTE [wide blocks])."""
    per = []
    for i, (p, s, m) in enumerate(zip(param_bytes, state_bytes, state_moved)):
        moved = 3 * p + 2 * m + (4 * p if clip else 0) + (3 * p if i in wide else 0)   # in twice, out once;
        # states in and out
        per.append((moved / max(p + s, 1), p + s, moved))
    left, total = max(int(room), 0), 0.0
    for ratio, size, moved in sorted(per, key=lambda x: -x[0]):
        kept = min(size, left)
        left -= kept
        total += moved - ratio * kept
    return int(total)


def _wide_tail(param_bytes: Sequence[int], states: Sequence[int], wide: Iterable[int], rate: float) -> float:
    """NOTE [wide blocks]: seconds the step's end takes for its streamed wide blocks, one after the
    other over the link, no compute beside: parameters, gradients and states in, parameters and
    states out."""
    return sum((2 * param_bytes[i] + states[i]) + (param_bytes[i] + states[i]) for i in wide) / rate


def _phases(fwd_ms: float, bwd_ms: float, params_in: int, out: int, swapped: int, rate: float,
            clip: bool = False) -> float:
    fwd = max(fwd_ms / 1e3, params_in / rate, swapped / rate)
    states_in = out - params_in
    if not clip:
        # backward: parameters again, states and swapped activations in; parameters and states out
        bwd = max(bwd_ms / 1e3, (params_in + states_in + swapped) / rate, out / rate)
        return fwd + bwd
    # NOTE [clipping] in training/clipping.py: backward brings the parameters in and sends the gradients (as
    # many bytes) home; the pass after it brings parameters, states and gradients in, overlapping
    # no compute, while fewer bytes (parameters and states) go out.
    bwd = max(bwd_ms / 1e3, (params_in + swapped) / rate, params_in / rate)
    return fwd + bwd + (2 * params_in + states_in) / rate


@dataclasses.dataclass
class _Choice:
    """A plan under construction (NOTE [recompute plan])."""

    resident: set[int]
    recompute: set[int]
    keep: set[int]               # record indices
    parts: set[int] = dataclasses.field(default_factory=set)   # of recompute: in parts (NOTE [recompute in parts])


class _Planner:
    def __init__(self, trace: StepTrace, budget: int, margin: int, can_reside: Sequence[bool] | None,
                 recompute: str, link_GBps: float, clip: bool = False, graph_pool: int = 0):
        self.t, self.budget, self.margin, self.rate = trace, budget, margin, link_GBps * 1e9
        self.graph_pool = graph_pool
        self.clip = clip
        nb = len(trace.block_param_bytes)
        self.nb = nb
        self.size = [trace.block_param_bytes[i] + trace.block_state_bytes[i] for i in range(nb)]   # resident
        states = trace.block_state_moved_bytes or trace.block_state_bytes
        self.moved = [trace.block_param_bytes[i] + states[i] for i in range(nb)]   # out, streamed
        self.already = frozenset(trace.resident_blocks)
        self.can_reside = [can_reside is None or bool(can_reside[i]) for i in range(nb)]
        self.seg_recs: dict[int, list[SavedRecord]] = {}
        for r in trace.saved:
            self.seg_recs.setdefault(r.segment, []).append(r)
        self.seg_bytes = {s: sum(r.nbytes for r in rs) for s, rs in self.seg_recs.items()}
        timed = len(trace.block_fwd_ms) == nb and len(trace.boundary_bytes) == nb
        swap_ms = trace.block_swap_ms if len(trace.block_swap_ms) == nb else trace.block_fwd_ms
        self.recomputable = sorted(i for i in trace.recomputable if 0 <= i < nb and (timed or recompute == "always")) \
            if recompute != "never" else []
        self.fwd_ms = [float(x) for x in trace.block_fwd_ms] if len(trace.block_fwd_ms) == nb else [0.0] * nb
        # the host time a block's saves cost when they go through the swap's hooks rather than
        # torch's checkpoint: in forward (pack) and, about as much, in backward (unpack)
        self.hook_ms = [max(float(a) - b, 0.0) for a, b in zip(swap_ms, self.fwd_ms)] if timed else [0.0] * nb
        self.probed = frozenset(trace.measured_recompute)
        self.boundary = list(trace.boundary_bytes) if len(trace.boundary_bytes) == nb else [0] * nb
        self.room = budget - margin - trace.floor_peak
        self.part_peak = _part_peaks(trace, self.seg_recs, self.seg_bytes, nb)

    def rec_peak(self, c: _Choice) -> int:
        """What the recomputed blocks hold in their backward: the largest segment (or part,
        NOTE [recompute in parts]) alive at once; with the graphs' pool, that and the largest
        of the blocks recomputed in parts, which the graphs do not replay."""
        parts = [self.part_peak[i] for i in c.parts if i in c.recompute]
        if self.graph_pool:
            return self.graph_pool + max(parts, default=0)
        whole = [self.seg_bytes.get(i, 0) for i in c.recompute if i not in c.parts]
        return max(whole + parts, default=0)

    # -- evaluation ----------------------------------------------------------------------------------
    def peak_extra(self, c: _Choice) -> int:
        """Bytes above the floor: resident blocks, kept activations, the largest recomputed segment
        (or the graphs' pool that holds every recomputed segment's backward, whatever the plan)."""
        kept = sum(self.t.saved[i].nbytes for i in c.keep)
        return sum(self.size[i] for i in c.resident) + kept + self.rec_peak(c)

    def fits(self, c: _Choice) -> bool:
        return self.peak_extra(c) <= self.room

    def swapped(self, c: _Choice) -> int:
        n = sum(r.nbytes for r in self.t.saved if r.index not in c.keep and r.segment not in c.recompute)
        return n + sum(self.boundary[i] for i in c.recompute)

    def compute(self, rec: set[int] | frozenset[int], keep: set[int] | frozenset[int] = frozenset(),
                parts: set[int] | frozenset[int] = frozenset()) -> tuple[float, float, float]:
        """Forward, backward (recompute excluded) and recompute ms with ``rec`` recomputed, from
        the step measured with ``trace.measured_recompute`` recomputed (NOTE [recompute plan]).
        A block whose saves are all kept pays no swap hooks' host time (``keep``: record indices);
        one recomputed in ``parts`` runs its forward twice in backward (NOTE [recompute in parts])."""
        kept = {s for s, recs in self.seg_recs.items() if recs and all(r.index in keep for r in recs)}
        more, fewer = set(rec) - self.probed, self.probed - set(rec) - kept
        fwd = self.t.fwd_ms - sum(self.hook_ms[i] for i in more) + sum(self.hook_ms[i] for i in fewer)
        bwd = self.t.bwd_ms - sum(self.fwd_ms[i] for i in self.probed)        # the measured recompute out
        bwd += sum(self.hook_ms[i] for i in fewer) - sum(self.hook_ms[i] for i in more)
        return (max(fwd, 0.0), max(bwd, 0.0),
                sum(self.fwd_ms[i] for i in rec) + sum(self.fwd_ms[i] for i in parts if i in rec))

    def seconds(self, c: _Choice) -> float:
        streamed = [i for i in range(self.nb) if i not in c.resident]
        params_in = sum(self.t.block_param_bytes[i] for i in streamed)
        out = sum(self.moved[i] for i in streamed)
        fwd, bwd, rec = self.compute(c.recompute, c.keep, c.parts)
        return (_phases(fwd, bwd + rec, params_in, out, self.swapped(c), self.rate, self.clip)
                + _wide_tail(self.t.block_param_bytes, self.t.block_state_moved_bytes or self.t.block_state_bytes,
                             self.t.wide_blocks - c.resident, self.rate))

    # -- candidates ----------------------------------------------------------------------------------
    def base(self) -> _Choice:
        return _Choice(set(self.already), set(), set())

    def nestable(self, i: int) -> bool:
        return self.part_peak[i] > 0

    def swap_only(self) -> _Choice:
        """Today's plan (NOTE [training plan]): blocks smallest first, then activations latest first."""
        c = self.base()
        self._blocks_smallest_first(c)
        self._fill_records(c)
        return c

    def recompute_all(self) -> _Choice:
        c = self.base()
        c.recompute = set(self.recomputable)
        while c.recompute and not self.fits(c):       # the largest recomputed segment must fit:
            big = max(c.recompute, key=lambda i: self.part_peak[i] if i in c.parts else self.seg_bytes.get(i, 0))
            if big not in c.parts and self.nestable(big):
                c.parts.add(big)                      # in parts (NOTE [recompute in parts])
            else:
                c.recompute.discard(big)
                c.parts.discard(big)
        self._blocks_smallest_first(c)
        self._fill_records(c)
        return c

    def mixed(self) -> _Choice:
        c = self.base()
        self._flip(c)
        while True:
            best, best_gain = None, 0.0
            now = self.seconds(c)
            for move in self._moves(c):
                after = move(c)
                if after is None or not self.fits(after):
                    continue
                dt = now - self.seconds(after)
                db = max(self.peak_extra(after) - self.peak_extra(c), 1)
                gain = dt / db
                if dt > 0 and gain > best_gain:
                    best, best_gain = after, gain
            if best is None:
                break
            c = best
            self._flip(c)
        self._fill_records(c)
        self._flip(c)
        return c

    def _moves(self, c: _Choice) -> list[Any]:
        moves: list[Any] = []
        for i in range(self.nb):
            if i not in c.resident and self.can_reside[i]:
                moves.append(lambda c, i=i: _Choice(c.resident | {i}, set(c.recompute), set(c.keep), set(c.parts)))
        for s, recs in self.seg_recs.items():
            idx = {r.index for r in recs}
            if not idx <= c.keep:
                moves.append(lambda c, s=s, idx=idx: _Choice(set(c.resident), c.recompute - {s}, c.keep | idx,
                                                             c.parts - {s}))
        return moves

    def _flip(self, c: _Choice) -> None:
        """Move segments between swap, recompute and recompute in parts while that is faster and fits."""
        for _ in range(3 * len(self.recomputable) + 1):
            best, best_t = None, self.seconds(c)
            for i in self.recomputable:
                recs = {r.index for r in self.seg_recs.get(i, [])}
                if recs and recs <= c.keep:
                    continue                               # kept: neither swapped nor recomputed
                trials = [_Choice(set(c.resident), c.recompute ^ {i}, c.keep - recs, c.parts - {i})]
                if self.nestable(i):
                    trials.append(_Choice(set(c.resident), c.recompute | {i}, c.keep - recs, c.parts ^ {i}))
                for trial in trials:
                    t = self.seconds(trial)
                    if t < best_t - 1e-9 and self.fits(trial):
                        best, best_t = trial, t
            if best is None:
                return
            c.resident, c.recompute, c.keep, c.parts = best.resident, best.recompute, best.keep, best.parts

    def _blocks_smallest_first(self, c: _Choice) -> None:
        for i in sorted((i for i in range(self.nb) if i not in c.resident and self.can_reside[i]),
                        key=lambda i: self.size[i]):
            c.resident.add(i)
            if not self.fits(c):
                c.resident.discard(i)

    def _fill_records(self, c: _Choice) -> None:
        left = self.room - self.peak_extra(c)
        for r in sorted(self.t.saved, key=lambda r: -r.index):
            if r.segment in c.recompute or r.index in c.keep:
                continue
            if r.nbytes <= left:
                c.keep.add(r.index)
                left -= r.nbytes


def _part_peaks(trace: StepTrace, seg_recs: dict[int, list[SavedRecord]], seg_bytes: dict[int, int],
                nb: int) -> list[int]:
    """Per block, what its backward holds at once when it is recomputed in parts (NOTE [recompute
    in parts]); 0 where that holds no less than recomputing it whole, or it has fewer than two parts."""
    out = [0] * nb
    parts_of: dict[int, list[int]] = {}
    for k, b in enumerate(trace.part_block):
        parts_of.setdefault(b, []).append(k)
    inputs = trace.part_input_bytes
    for i, ks in parts_of.items():
        if not 0 <= i < nb or len(ks) < 2 or len(inputs) != len(trace.part_block):
            continue
        mine = set(ks)
        per = {k: 0 for k in ks}
        outside = 0
        for r in seg_recs.get(i, []):
            if r.part in mine:
                per[r.part] += r.nbytes
            else:
                outside += r.nbytes
        peak = outside + sum(inputs[k] for k in ks) + max(per.values())
        if peak < seg_bytes.get(i, 0):
            out[i] = peak
    return out


def plan_training(trace: StepTrace, budget: int, *, margin: int | None = None,
                  can_reside: Sequence[bool] | None = None, recompute: str = "auto",
                  link_GBps: float = LINK_GBPS, clip: bool = False, graph_pool: int = 0) -> TrainPlan:
    """Plan the steps after ``trace`` within ``budget`` bytes (NOTE [training plan], NOTE
    [recompute plan]).

    Blocks resident while tracing (``trace.resident_blocks``) stay resident; they live in managed
    memory, outside the floor, which counts torch's allocator only. ``can_reside[i]`` False keeps block i
    streamed. ``margin`` (default 1/16 of the budget) is left free for what the trace could not
    see (allocator rounding, a larger temporary on another step). ``recompute``: "auto" chooses
    per block segment, "never" swaps or keeps only, "always" recomputes every recomputable
    segment that fits. ``link_GBps``: the link's rate each way. ``clip``: the streamed blocks
    step in a pass after backward (NOTE [clipping] in training/clipping.py), which streaming a block costs.
    ``graph_pool``: bytes the recomputed blocks' graphs hold between steps (NOTE [replayed
    recompute] in training/replay.py); the plan counts them in place of the largest recomputed segment.
    """
    if budget <= 0:
        raise ConfigError(f"budget must be positive, got {budget}")
    if recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
    if not link_GBps > 0:
        raise ConfigError(f"link_GBps must be positive, got {link_GBps}")
    margin = budget // 16 if margin is None else int(margin)
    if graph_pool < 0:
        raise ConfigError(f"graph_pool must not be negative, got {graph_pool}")
    nb = len(trace.block_param_bytes)
    if len(trace.block_state_bytes) != nb:
        raise ConfigError(f"block_param_bytes and block_state_bytes differ in length ({nb} and "
                          f"{len(trace.block_state_bytes)})")
    if trace.block_state_moved_bytes and len(trace.block_state_moved_bytes) != nb:
        raise ConfigError(f"block_param_bytes and block_state_moved_bytes differ in length ({nb} and "
                          f"{len(trace.block_state_moved_bytes)})")
    pl = _Planner(trace, budget, margin, can_reside, recompute, link_GBps, clip, int(graph_pool))
    if pl.room - pl.graph_pool - sum(pl.size[i] for i in pl.already) < 0:
        c, kind = pl.base(), "swap"          # nothing is added to a floor that does not fit
    elif recompute == "never" or not pl.recomputable:
        c, kind = pl.swap_only(), "swap"
    elif recompute == "always":
        c, kind = pl.recompute_all(), "recompute"
    else:
        cands = [(pl.swap_only(), "swap"), (pl.recompute_all(), "recompute"), (pl.mixed(), "mixed")]
        # the fastest; on a tie the one that recomputes least (then the earlier candidate)
        c, kind = min(cands, key=lambda ck: (round(pl.seconds(ck[0]), 9), len(ck[0].recompute)))
    return _make(pl, c, kind)


def _make(pl: _Planner, c: _Choice, kind: str) -> TrainPlan:
    t = pl.t
    kept = sum(t.saved[i].nbytes for i in c.keep)
    parts = c.parts & c.recompute
    fwd, bwd, rec = pl.compute(c.recompute, c.keep, parts)
    modes = []
    for i in range(pl.nb):
        recs = pl.seg_recs.get(i, [])
        if i in c.recompute:
            modes.append("recompute in parts" if i in parts else "recompute")
        elif not recs:
            modes.append("-")
        else:
            k = sum(r.index in c.keep for r in recs)
            modes.append("keep" if k == len(recs) else "swap" if k == 0 else "mixed")
    return TrainPlan(budget=pl.budget, floor_peak=t.floor_peak,
                     resident_blocks=frozenset(c.resident), keep=frozenset(c.keep),
                     block_param_bytes=tuple(t.block_param_bytes), block_state_bytes=tuple(t.block_state_bytes),
                     block_state_moved_bytes=tuple(t.block_state_moved_bytes),
                     saved_bytes=t.saved_bytes, kept_bytes=kept, margin=pl.margin,
                     recompute=frozenset(c.recompute),
                     recomputed_bytes=sum(pl.seg_bytes.get(i, 0) for i in c.recompute),
                     boundary_bytes=sum(pl.boundary[i] for i in c.recompute),
                     recompute_peak=pl.rec_peak(c), parts=frozenset(parts), wide_blocks=t.wide_blocks,
                     graph_pool=pl.graph_pool,
                     fwd_ms=fwd, bwd_ms=bwd, recompute_ms=rec,
                     link_GBps=pl.rate / 1e9, kind=kind, segment_modes=tuple(modes), clip=pl.clip,
                     block_names=tuple(t.block_names), compute_scale=t.compute_scale)


def slots_for_recompute(trace: StepTrace, slot_bytes: int, spare: int,
                        plan_everywhere: Callable[[StepTrace], TrainPlan]) -> int:
    """How many of ``spare`` slots (each ``slot_bytes`` of the floor) to give up so that recomputing
    everywhere (``plan_everywhere``) recomputes the most blocks it can: the fewest slots that
    reach that most, 0 where giving up slots recomputes no more (NOTE [a slot for recompute] in
    training/choice.py)."""
    best, give = len(plan_everywhere(trace).recompute), 0
    for k in range(1, max(int(spare), 0) + 1):
        got = len(plan_everywhere(dataclasses.replace(trace, floor_peak=max(trace.floor_peak - k * slot_bytes, 0)))
                  .recompute)
        if got > best:
            best, give = got, k
        if best >= len(trace.recomputable):
            break
    return give


def scaled(trace: StepTrace, factor: float) -> StepTrace:
    """``trace`` with every compute time ``factor`` times as long (NOTE [calibrated compute])."""
    f = float(factor)
    if not f > 0:
        raise ConfigError(f"a compute scale must be positive, got {factor}")
    return dataclasses.replace(trace, fwd_ms=trace.fwd_ms * f, bwd_ms=trace.bwd_ms * f,
                               block_fwd_ms=tuple(x * f for x in trace.block_fwd_ms),
                               block_swap_ms=tuple(x * f for x in trace.block_swap_ms),
                               compute_scale=trace.compute_scale * f)


def evaluate(trace: StepTrace, plan: TrainPlan) -> TrainPlan:
    """``plan``'s choices (its resident blocks, recomputed segments and kept activations) with
    the times and peak ``trace`` gives them: a plan made from another measurement of the same step."""
    mode = "always" if plan.recompute else "never"
    pl = _Planner(trace, plan.budget, plan.margin, None, mode, plan.link_GBps, plan.clip, plan.graph_pool)
    return _make(pl, _Choice(set(plan.resident_blocks), set(plan.recompute), set(plan.keep), set(plan.parts)),
                 plan.kind)


LINK_FIT_MAX = 4.0      # the most the link's time is stretched to explain a step (NOTE [calibrated compute])


def fit_link(plan: TrainPlan, measured_ms: float, hi: float = LINK_FIT_MAX) -> float:
    """The factor (at least 1) on ``plan``'s link time under which, its compute as measured, it
    predicts ``measured_ms`` a step (NOTE [calibrated compute]); 1 where it predicts as much
    already, or where no factor up to ``hi`` does (the compute is what is missing, not the link)."""
    if not measured_ms > 0:
        return 1.0

    def ms(k: float) -> float:
        return plan.predicted_seconds(plan.link_GBps / k) * 1e3
    if ms(1.0) >= measured_ms or ms(hi) < measured_ms:
        return 1.0
    a, b = 1.0, hi
    for _ in range(60):            # ms() never falls as the factor grows
        m = (a * b) ** 0.5
        a, b = (m, b) if ms(m) < measured_ms else (a, m)
    return (a * b) ** 0.5


def fit_compute(plan: TrainPlan, measured_ms: float, lo: float = 0.25, hi: float = 4.0) -> float:
    """The factor on ``plan``'s compute times under which it predicts ``measured_ms`` a step,
    within [lo, hi] (NOTE [calibrated compute]). The link's terms stay: a factor only moves the
    compute, so a plan whose link alone takes longer than ``measured_ms`` gets ``lo``."""
    if not measured_ms > 0:
        return 1.0

    def ms(f: float) -> float:
        return dataclasses.replace(plan, fwd_ms=plan.fwd_ms * f, bwd_ms=plan.bwd_ms * f,
                                   recompute_ms=plan.recompute_ms * f).predicted_seconds() * 1e3
    if ms(lo) >= measured_ms:
        return lo
    if ms(hi) <= measured_ms:
        return hi
    a, b = lo, hi
    for _ in range(60):            # ms() never falls as the factor grows
        m = (a * b) ** 0.5
        a, b = (m, b) if ms(m) < measured_ms else (a, m)
    return (a * b) ** 0.5
