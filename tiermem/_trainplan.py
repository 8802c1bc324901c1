"""The training plan: what one step keeps on the device and what it moves, from a traced step.

NOTE [training plan]
    As in Zhang et al. 2019 (arXiv 1903.06631), a step is traced (the second: the first pays
    one-time costs, NOTE [step time model]): every tensor autograd
    saves for backward (its size, the order it was saved in, the order backward first reads it)
    and the peak of torch's caching allocator while everything that can move did move: every
    block's parameters and optimizer states streamed through the slots, every saved activation
    of at least ``min_swap`` bytes swapped to the host. That peak is the step's floor.

    The plan then spends what the budget leaves above that floor, greedily, on what saves the
    most bytes over the link per device byte:

      1. whole blocks resident (parameters and optimizer states, in managed memory kept on the
         device): a streamed block moves its parameters in twice (forward, backward) and out once
         (after its update), and its states in and out once: 28 bytes per parameter (fp32 Adam),
         for 12 bytes of device memory, ~2.3 bytes moved per byte kept;
      2. saved activations kept on the device, latest saved first (backward reads those first,
         so swapping them would leave the least time to bring them back): 2 bytes moved per byte.

    Everything not kept moves at the link rate on tiermem's two copy streams while the GPU
    computes. The floor plus what was kept is the plan's predicted peak; a step that diverges
    from the trace (another batch shape) is traced again and re-planned.

    A saved tensor has a third way to be there in backward: recomputed, by running the forward of
    its *segment* again (NOTE [recompute]). The plan chooses per segment (a layer of the model's
    repeated stack) whether to recompute it, and per saved tensor outside the recomputed segments
    whether to keep or swap it, minimising the predicted step time (NOTE [step time model]):

      - each recomputed segment costs its forward again in backward (timed in the trace, stalls
        excluded), its inputs held on the device from its forward to its backward, and one
        segment's saved tensors at once while its backward runs, less the largest of them,
        which the traced step's floor held already while backward read it;
      - it saves twice its saved bytes over the link, and the device bytes those would need if kept.

    Segments are tried in order of link time saved per recompute second; for every prefix of that
    order the memory left is filled as above, and the fastest predicted plan wins. The empty prefix
    is the swap-only plan and the full one the recompute-only plan, so the chosen plan is never
    predicted slower than either.

NOTE [step time model]
    A step is a forward phase then a backward phase. In each, the GPU computes while the two copy
    streams move bytes, and the phase lasts as long as the busiest of the three:

      forward   max(F, in_f / L, out_f / L, (in_f + out_f) / D)
                in_f: streamed parameters; out_f: swapped activations
      backward  max(B + R, in_b / L, out_b / L, (in_b + out_b) / D)
                in_b: streamed parameters, their states, swapped activations, and parameters
                      loaded again to recompute; out_b: streamed parameters and states
                R: the recomputed segments' forward seconds

    F and B are the traced step's forward and backward (block optimizer steps included) less the
    time the compute stream waited for a copy. The traced step is the second: the first creates
    the optimizer's states and their pinned homes, the swap's pinned arena (cudaHostAlloc, ~1 s
    per GB) and torch's cached blocks, and took 5.3 s against 0.25 s for a steady step
    (bench/results/train_budget-h100-20261122.log); the GPU idles through those, and its clock
    would charge them to compute. L is one direction's rate, D both at once. Two
    large copies reach 55 GB/s each way and 91 GB/s together on the H100 machine (docs/facts.md),
    but a training step's many block-sized copies do not overlap that well: the swap-only plan
    ran at 1.00x of (in + out) / 55 GB/s and 1.66x of the two-way bound
    (bench/results/train_budget-h100-20261122.json). D therefore defaults to L, one shared link;
    a caller who measured better passes its own. Overlap inside a phase is taken as perfect; what
    is not (a copy back that backward waits for at its start, a swap-out the window makes the
    host wait for) is what ``plan_error`` in bench/train_budget.py measures.

NOTE [bf16 states]
    Optimizer states are the largest thing a streamed block moves: AdamW's two fp32 moments are
    16 of the 28 bytes per parameter a step moves in and out. With ``states_bf16=True``
    (wrap_training; off by default) a streamed block's states live at home in bf16 and cross the
    link in bf16: the slot holds the fp32 states the optimizer steps and a bf16 copy beside them;
    after the copy in, the compute stream widens bf16 to fp32, and after the block's step it
    narrows fp32 to bf16 before the copy out. The optimizer's arithmetic stays fp32; what changes
    is that the moments are rounded to bf16 (8 bits of mantissa, round to nearest) once per step,
    so losses no longer equal the resident run's bit for bit. Resident blocks keep fp32 states.
    The plan counts the bytes that move (``block_state_moved``) apart from the device bytes a
    resident block's states take (``block_state_bytes``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ._errors import ConfigError

__all__ = ["SavedRecord", "Segment", "StepTrace", "TrainPlan", "plan_training"]

LINK_GBPS = 55.0     # pinned copies each way on the H100 machine (docs/facts.md)
DUPLEX_GBPS = LINK_GBPS   # both directions at once, in total, as a step sees it (NOTE [step time model])
MODES = ("auto", "swap", "recompute")


@dataclasses.dataclass(frozen=True)
class SavedRecord:
    """One storage autograd saved during the traced step. Seconds are the compute stream's."""

    index: int          # order of saving (forward order)
    nbytes: int
    use: int            # order of its first read in backward; -1: never read
    segment: int = -1   # the segment (NOTE [recompute]) whose forward first saved it; -1: none
    recompute_s: float = 0.0   # forward seconds from its segment's start to its saving: what
                               # recomputing it repeats, the segment's input being the last kept tensor
    use_s: float = -1.0        # seconds into backward of its first read; -1: never read


@dataclasses.dataclass(frozen=True)
class Segment:
    """One recomputable segment of the traced step (NOTE [recompute])."""

    index: int
    fwd_s: float              # its forward's compute seconds, waits for copies excluded
    input_bytes: int          # its inputs, held on the device from forward to backward if recomputed
    blocks: tuple[int, ...] = ()   # the tiermem blocks inside, in forward order


@dataclasses.dataclass(frozen=True)
class StepTrace:
    """What the traced step did. Sizes are bytes, times seconds."""

    saved: tuple[SavedRecord, ...]
    block_param_bytes: tuple[int, ...]     # per block, forward order
    block_state_bytes: tuple[int, ...]     # optimizer-state bytes per block
    floor_peak: int                        # torch's peak allocated bytes, everything moving
    resident_blocks: frozenset[int] = frozenset()   # blocks already resident (in managed memory,
                                                    # outside torch's allocator) while tracing
    segments: tuple[Segment, ...] = ()
    saves: tuple[tuple[int, int], ...] = ()   # (record, segment) of every save of a record, in
                                              # order; () means each record once, in its segment
    fwd_s: float = 0.0                     # forward compute (NOTE [step time model])
    bwd_s: float = 0.0                     # backward compute, block optimizer steps included
    step_s: float = 0.0                    # the traced step's wall time, waits included
    slots: int = 3                         # device slots streamed blocks go through
    block_state_moved: tuple[int, ...] = ()   # state bytes a streamed block moves each way, if not
                                              # block_state_bytes (NOTE [bf16 states])

    @property
    def saved_bytes(self) -> int:
        return sum(r.nbytes for r in self.saved)

    @property
    def key(self) -> tuple[int, ...]:
        """Sizes in saving order: a step whose saves differ from this needs another plan."""
        return tuple(r.nbytes for r in self.saved)

    def visible(self, recompute: frozenset[int]) -> tuple[int, ...]:
        """Records the swap still sees when ``recompute`` segments are recomputed, in the order it
        first sees them: a storage saved inside a recomputed segment and again outside it is seen
        at its first save outside."""
        saves = self.saves or tuple((r.index, r.segment) for r in self.saved)
        seen: dict[int, None] = {}
        for rec, seg in saves:
            if seg not in recompute and rec not in seen:
                seen[rec] = None
        return tuple(seen)


@dataclasses.dataclass(frozen=True)
class TrainPlan:
    """What each step keeps, swaps and recomputes; see NOTE [training plan]. Sizes are bytes,
    times seconds."""

    budget: int
    floor_peak: int
    resident_blocks: frozenset[int]
    keep: frozenset[int]                    # saved-storage indices kept on the device
    block_param_bytes: tuple[int, ...]
    block_state_bytes: tuple[int, ...]
    saved_bytes: int
    kept_bytes: int
    margin: int
    recompute: frozenset[int] = frozenset()   # segments recomputed in backward
    visible: tuple[int, ...] = ()           # records the swap sees, in its order (StepTrace.visible)
    recomputed_bytes: int = 0               # saved bytes that are recomputed instead
    held_bytes: int = 0                     # recomputed segments' inputs plus the largest one's saves
    reload_bytes: int = 0                   # streamed parameters loaded again to recompute
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    recompute_s: float = 0.0
    link_GBps: float = LINK_GBPS
    duplex_GBps: float = DUPLEX_GBPS
    mode: str = "auto"
    segments: tuple[Segment, ...] = ()
    segment_of: tuple[int, ...] = ()        # each record's segment (SavedRecord.segment)
    record_bytes: tuple[int, ...] = ()
    alternatives: tuple[tuple[str, float], ...] = ()   # (what, predicted seconds) of plans not chosen
    block_state_moved: tuple[int, ...] = ()    # as StepTrace.block_state_moved
    measured_s: float | None = None         # median wall time of the planned steps so far

    @property
    def streamed_blocks(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self.block_param_bytes)) if i not in self.resident_blocks)

    @property
    def resident_block_bytes(self) -> int:
        return sum(self.block_param_bytes[i] + self.block_state_bytes[i] for i in self.resident_blocks)

    @property
    def swapped_bytes(self) -> int:
        return self.saved_bytes - self.kept_bytes - self.recomputed_bytes

    def _streamed(self) -> tuple[int, int]:
        s = self.streamed_blocks
        st = self.block_state_moved or self.block_state_bytes
        return sum(self.block_param_bytes[i] for i in s), sum(st[i] for i in s)

    @property
    def h2d_bytes(self) -> int:
        """Bytes one step moves host -> device: streamed parameters twice, their states once,
        swapped activations once, parameters loaded again to recompute."""
        p, st = self._streamed()
        return 2 * p + st + self.swapped_bytes + self.reload_bytes

    @property
    def d2h_bytes(self) -> int:
        p, st = self._streamed()
        return p + st + self.swapped_bytes

    @property
    def predicted_peak(self) -> int:
        return self.floor_peak + self.kept_bytes + self.resident_block_bytes + self.held_bytes

    def phases(self) -> tuple[float, float]:
        """Predicted (forward, backward) seconds (NOTE [step time model])."""
        p, st = self._streamed()
        sw = self.swapped_bytes
        f = _phase(self.fwd_s, p, sw, self.link_GBps, self.duplex_GBps)
        b = _phase(self.bwd_s + self.recompute_s, p + st + sw + self.reload_bytes, p + st,
                   self.link_GBps, self.duplex_GBps)
        return f, b

    def predicted_seconds(self, link_GBps: float | None = None) -> float:
        """The predicted step time (NOTE [step time model]); with ``link_GBps``, at that rate
        each way and twice it both ways."""
        if link_GBps is not None:
            return dataclasses.replace(self, link_GBps=link_GBps, duplex_GBps=2 * link_GBps).predicted_seconds()
        return sum(self.phases())

    def choices(self) -> dict[int, str]:
        """Each saved record's fate: "keep", "swap" or "recompute"."""
        vis = set(self.visible) if self.visible or self.recompute else set(range(len(self.record_bytes)))
        return {i: ("keep" if i in self.keep else "swap" if i in vis else "recompute")
                for i in range(len(self.record_bytes))}

    def table(self) -> str:
        gb = lambda n: f"{n / 1e9:.3f} GB"  # noqa: E731
        ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
        nb = len(self.block_param_bytes)
        fwd, bwd = self.phases()
        lines = [
            f"training plan for a {gb(self.budget)} budget ({self.mode})",
            f"  blocks resident  {len(self.resident_blocks)}/{nb} ({gb(self.resident_block_bytes)} params+states)",
            f"  blocks streamed  {nb - len(self.resident_blocks)}/{nb}",
            f"  activations      {gb(self.saved_bytes)} saved: {gb(self.kept_bytes)} kept, "
            f"{gb(self.swapped_bytes)} swapped, {gb(self.recomputed_bytes)} recomputed "
            f"({len(self.keep)} storages kept)",
            f"  segments         {len(self.recompute)}/{len(self.segments)} recomputed "
            f"({ms(self.recompute_s)} of forward again, {gb(self.held_bytes)} held, "
            f"{gb(self.reload_bytes)} loaded again)",
            f"  per step         {gb(self.h2d_bytes)} in, {gb(self.d2h_bytes)} out",
            f"  step time        {ms(fwd + bwd)} predicted (forward {ms(fwd)}, backward {ms(bwd)}; "
            f"compute {ms(self.fwd_s)} + {ms(self.bwd_s)}, link {self.link_GBps:.0f} GB/s each way, "
            f"{self.duplex_GBps:.0f} both), "
            + (f"{ms(self.measured_s)} measured" if self.measured_s is not None else "not measured yet"),
            f"  device peak      {gb(self.predicted_peak)} predicted (floor {gb(self.floor_peak)}, "
            f"margin {gb(self.margin)})",
        ]
        for what, s in self.alternatives:
            lines.append(f"  not chosen       {what}: {ms(s)} predicted")
        if self.segments:
            lines.append("  choices per segment (saved storages: kept/swapped/recomputed)")
            ch = self.choices()
            for sg in self.segments:
                mine = [i for i, s in enumerate(self.segment_of) if s == sg.index]
                n = {c: sum(1 for i in mine if ch[i] == c) for c in ("keep", "swap", "recompute")}
                b = sum(self.record_bytes[i] for i in mine)
                what = "recompute" if sg.index in self.recompute else "keep/swap"
                lines.append(f"    segment {sg.index:3d}  {what:9s}  {n['keep']}/{n['swap']}/{n['recompute']} "
                             f"of {gb(b)}, forward {ms(sg.fwd_s)}")
            out = [i for i, s in enumerate(self.segment_of) if s < 0]
            if out:
                n = {c: sum(1 for i in out if ch[i] == c) for c in ("keep", "swap")}
                lines.append(f"    outside      keep/swap  {n['keep']}/{n['swap']}/0 "
                             f"of {gb(sum(self.record_bytes[i] for i in out))}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _phase(compute: float, inb: int, outb: int, link: float, duplex: float) -> float:
    return max(compute, inb / (link * 1e9), outb / (link * 1e9), (inb + outb) / (duplex * 1e9))


def plan_training(trace: StepTrace, budget: int, *, margin: int | None = None,
                  can_reside: Sequence[bool] | None = None, mode: str = "auto",
                  link_GBps: float = LINK_GBPS, duplex_GBps: float = DUPLEX_GBPS) -> TrainPlan:
    """Plan the steps after ``trace`` within ``budget`` bytes (NOTE [training plan]).

    Blocks resident while tracing (``trace.resident_blocks``) stay resident; they live in managed
    memory, outside the floor, which counts torch's allocator only. ``can_reside[i]`` False keeps block i
    streamed. ``margin`` (default 1/16 of the budget) is left free for what the trace could not
    see (allocator rounding, a larger temporary on another step). ``mode``: "swap" never
    recomputes, "recompute" recomputes every segment (when that fits, else it is "swap"), "auto"
    picks the faster predicted plan among every prefix of the segments ordered by benefit.
    """
    if budget <= 0:
        raise ConfigError(f"budget must be positive, got {budget}")
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
    if link_GBps <= 0 or duplex_GBps <= 0:
        raise ConfigError(f"link rates must be positive, got {link_GBps} and {duplex_GBps}")
    margin = budget // 16 if margin is None else int(margin)
    nb = len(trace.block_param_bytes)
    if len(trace.block_state_bytes) != nb:
        raise ConfigError(f"block_param_bytes and block_state_bytes differ in length ({nb} and "
                          f"{len(trace.block_state_bytes)})")
    segs = trace.segments
    link = link_GBps * 1e9

    def benefit(sg: Segment) -> float:
        b = sum(r.nbytes for r in trace.saved if r.segment == sg.index)
        return 2 * b / link / max(sg.fwd_s, 1e-9)

    order = sorted(segs, key=lambda sg: -benefit(sg))
    if mode == "swap":
        prefixes = [0]
    elif mode == "recompute":
        prefixes = [len(order), 0]
    else:
        prefixes = list(range(len(order) + 1))
    best: TrainPlan | None = None
    alts: list[tuple[str, float]] = []
    for k in prefixes:
        p = _fill(trace, budget, margin, can_reside, frozenset(sg.index for sg in order[:k]), mode,
                  link_GBps, duplex_GBps)
        if p is None:
            continue
        t = p.predicted_seconds()
        if mode == "recompute" and k == len(order) and best is None:
            best = p
            break
        if best is None or t < best.predicted_seconds() - 1e-12:
            if best is not None:
                alts.append((_what(best), best.predicted_seconds()))
            best = p
        elif k in (0, len(order)):
            alts.append((_what(p), t))
    assert best is not None       # the empty prefix always plans
    return dataclasses.replace(best, alternatives=tuple(a for a in alts if a[0] != _what(best))[-4:])


def _what(p: TrainPlan) -> str:
    n = len(p.recompute)
    return "swap only" if n == 0 else ("recompute every segment" if n == len(p.segments) else
                                       f"{n} segments recomputed")


def _fill(trace: StepTrace, budget: int, margin: int, can_reside: Sequence[bool] | None,
          rc: frozenset[int], mode: str, link_GBps: float, duplex_GBps: float) -> TrainPlan | None:
    """The plan that recomputes ``rc`` and spends what is left on blocks, then activations; None
    when recomputing ``rc`` alone does not fit."""
    nb = len(trace.block_param_bytes)
    already = frozenset(trace.resident_blocks)
    size = lambda i: trace.block_param_bytes[i] + trace.block_state_bytes[i]  # noqa: E731
    left = budget - margin - trace.floor_peak - sum(size(i) for i in already)
    visible = trace.visible(rc)
    vis = set(visible)
    segs = {sg.index: sg for sg in trace.segments}
    held = 0
    if rc:
        # A recompute brings back its whole segment's saves at once, where the traced step held
        # at least the largest of them while backward read it: the floor has that one already.
        extra = []
        for i in rc:
            inner = [r.nbytes for r in trace.saved if r.segment == i and r.index not in vis]
            extra.append(sum(inner) - max(inner, default=0))
        held = sum(segs[i].input_bytes for i in rc) + max(extra)
        if held > left:
            return None
        left -= held
    resident = set(already)
    # 1. whole blocks, smallest first: many small blocks save more traffic than one big one
    #    that does not fit, and each saves ~2.3 bytes moved per byte kept.
    order = sorted((i for i in range(nb) if i not in already and (can_reside is None or can_reside[i])),
                   key=size)
    for i in order:
        n = size(i)
        if n <= left:
            resident.add(i)
            left -= n
    # 2. activations, latest saved first.
    keep: set[int] = set()
    kept = 0
    for r in sorted((r for r in trace.saved if r.index in vis), key=lambda r: -r.index):
        if r.nbytes <= left:
            keep.add(r.index)
            kept += r.nbytes
            left -= r.nbytes
    # Recomputing a segment brings its streamed blocks in again, except those still in a slot
    # when its backward starts: the last ``slots`` it ran.
    reload = 0
    for i in rc:
        streamed = [b for b in segs[i].blocks if b not in resident]
        reload += sum(trace.block_param_bytes[b] for b in streamed[: max(len(streamed) - trace.slots, 0)])
    recomputed = sum(r.nbytes for r in trace.saved if r.index not in vis)
    return TrainPlan(budget=budget, floor_peak=trace.floor_peak,
                     resident_blocks=frozenset(resident), keep=frozenset(keep),
                     block_param_bytes=tuple(trace.block_param_bytes), block_state_bytes=tuple(trace.block_state_bytes),
                     saved_bytes=trace.saved_bytes, kept_bytes=kept, margin=margin, recompute=rc,
                     visible=visible, recomputed_bytes=recomputed, held_bytes=held, reload_bytes=reload,
                     fwd_s=trace.fwd_s, bwd_s=trace.bwd_s, recompute_s=sum(segs[i].fwd_s for i in rc),
                     link_GBps=link_GBps, duplex_GBps=duplex_GBps, mode=mode, segments=trace.segments,
                     segment_of=tuple(r.segment for r in trace.saved), block_state_moved=trace.block_state_moved,
                     record_bytes=tuple(r.nbytes for r in trace.saved))
