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
         for 12 bytes of device memory, ~2.3 bytes moved per byte kept;
      2. saved activations kept on the device, latest saved first (backward reads those first,
         so swapping them would leave the least time to bring them back): 2 bytes moved per byte.

    Everything not kept moves at the link rate on tiermem's two copy streams while the GPU
    computes. The floor plus what was kept is the plan's predicted peak; a step that diverges
    from the trace (another batch shape) is traced again and re-planned.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ._errors import ConfigError

__all__ = ["SavedRecord", "StepTrace", "TrainPlan", "plan_training"]

LINK_GBPS = 55.0   # pinned copies each way on the H100 machine (docs/facts.md)


@dataclasses.dataclass(frozen=True)
class SavedRecord:
    """One storage autograd saved during the traced step."""

    index: int          # order of saving (forward order)
    nbytes: int
    use: int            # order of its first read in backward; -1: never read


@dataclasses.dataclass(frozen=True)
class StepTrace:
    """What the traced step did. Sizes are bytes."""

    saved: tuple[SavedRecord, ...]
    block_param_bytes: tuple[int, ...]     # per block, forward order
    block_state_bytes: tuple[int, ...]     # optimizer-state bytes per block
    floor_peak: int                        # torch's peak allocated bytes, everything moving
    resident_blocks: frozenset[int] = frozenset()   # blocks already resident (in managed memory,
                                                    # outside torch's allocator) while tracing

    @property
    def saved_bytes(self) -> int:
        return sum(r.nbytes for r in self.saved)

    @property
    def key(self) -> tuple[int, ...]:
        """Sizes in saving order: a step whose saves differ from this needs another plan."""
        return tuple(r.nbytes for r in self.saved)


@dataclasses.dataclass(frozen=True)
class TrainPlan:
    """What each step keeps on the device; see NOTE [training plan]. Sizes are bytes."""

    budget: int
    floor_peak: int
    resident_blocks: frozenset[int]
    keep: frozenset[int]                    # saved-storage indices kept on the device
    block_param_bytes: tuple[int, ...]
    block_state_bytes: tuple[int, ...]
    saved_bytes: int
    kept_bytes: int
    margin: int

    @property
    def streamed_blocks(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self.block_param_bytes)) if i not in self.resident_blocks)

    @property
    def resident_block_bytes(self) -> int:
        return sum(self.block_param_bytes[i] + self.block_state_bytes[i] for i in self.resident_blocks)

    @property
    def swapped_bytes(self) -> int:
        return self.saved_bytes - self.kept_bytes

    @property
    def h2d_bytes(self) -> int:
        """Bytes one step moves host -> device: streamed parameters twice, their states once,
        swapped activations once."""
        s = self.streamed_blocks
        return sum(2 * self.block_param_bytes[i] + self.block_state_bytes[i] for i in s) + self.swapped_bytes

    @property
    def d2h_bytes(self) -> int:
        s = self.streamed_blocks
        return sum(self.block_param_bytes[i] + self.block_state_bytes[i] for i in s) + self.swapped_bytes

    @property
    def predicted_peak(self) -> int:
        return self.floor_peak + self.kept_bytes + self.resident_block_bytes

    def predicted_seconds(self, link_GBps: float = LINK_GBPS) -> float:
        """The step's transfer time if nothing else limits it: the busier direction at link rate."""
        return max(self.h2d_bytes, self.d2h_bytes) / (link_GBps * 1e9)

    def table(self) -> str:
        gb = lambda n: f"{n / 1e9:.3f} GB"  # noqa: E731
        nb = len(self.block_param_bytes)
        lines = [
            f"training plan for a {gb(self.budget)} budget",
            f"  blocks resident  {len(self.resident_blocks)}/{nb} ({gb(self.resident_block_bytes)} params+states)",
            f"  blocks streamed  {nb - len(self.resident_blocks)}/{nb}",
            f"  activations      {gb(self.saved_bytes)} saved: {gb(self.kept_bytes)} kept, "
            f"{gb(self.swapped_bytes)} swapped ({len(self.keep)} storages kept)",
            f"  per step         {gb(self.h2d_bytes)} in, {gb(self.d2h_bytes)} out, "
            f">= {self.predicted_seconds() * 1e3:.1f} ms at {LINK_GBPS:.0f} GB/s",
            f"  device peak      {gb(self.predicted_peak)} predicted (floor {gb(self.floor_peak)}, "
            f"margin {gb(self.margin)})",
        ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def plan_training(trace: StepTrace, budget: int, *, margin: int | None = None,
                  can_reside: Sequence[bool] | None = None) -> TrainPlan:
    """Plan the steps after ``trace`` within ``budget`` bytes (NOTE [training plan]).

    Blocks resident while tracing (``trace.resident_blocks``) stay resident; they live in managed
    memory, outside the floor, which counts torch's allocator only. ``can_reside[i]`` False keeps block i
    streamed. ``margin`` (default 1/16 of the budget) is left free for what the trace could not
    see (allocator rounding, a larger temporary on another step).
    """
    if budget <= 0:
        raise ConfigError(f"budget must be positive, got {budget}")
    margin = budget // 16 if margin is None else int(margin)
    nb = len(trace.block_param_bytes)
    if len(trace.block_state_bytes) != nb:
        raise ConfigError(f"block_param_bytes and block_state_bytes differ in length ({nb} and "
                          f"{len(trace.block_state_bytes)})")
    already = frozenset(trace.resident_blocks)
    size = lambda i: trace.block_param_bytes[i] + trace.block_state_bytes[i]  # noqa: E731
    left = budget - margin - trace.floor_peak - sum(size(i) for i in already)
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
    for r in sorted(trace.saved, key=lambda r: -r.index):
        if r.nbytes <= left:
            keep.add(r.index)
            kept += r.nbytes
            left -= r.nbytes
    plan = TrainPlan(budget=budget, floor_peak=trace.floor_peak,
                     resident_blocks=frozenset(resident), keep=frozenset(keep),
                     block_param_bytes=tuple(trace.block_param_bytes), block_state_bytes=tuple(trace.block_state_bytes),
                     saved_bytes=trace.saved_bytes, kept_bytes=kept, margin=margin)
    return plan
