"""What one training's hooks, step and plan share from step to step (:class:`StepState`): the
step's phase, the gradients seen this step and in the open accumulation window, the blocks whose
forward runs, and what the traced step saw that the plan is made from."""
from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["StepState"]


@dataclasses.dataclass(eq=False)
class StepState:
    """The per-step state of a :class:`~tiermem.training.handle.TieredTraining`. Not thread-safe:
    one step at a time, as the handle's ``step()`` is."""

    # the step's phase
    in_step: bool = False
    tracing: bool = True          # this step is traced (the first, and after a divergence)
    failed: bool = False          # the last step failed (NOTE [kept exceptions] in training/stepping.py)
    capturing: bool = False       # a CUDA graph captures this step (NOTE [whole-step graphs])
    updating: bool = True         # this step steps the optimizer (NOTE [accumulation])
    # counts
    steps: int = 0                # steps taken
    updates: int = 0              # optimizer steps taken
    accumulated: int = 0          # micro-batches in the open window (NOTE [accumulation])
    # gradients
    got: set[int] = dataclasses.field(default_factory=set)       # ids of parameters with a gradient this step
    window: set[int] = dataclasses.field(default_factory=set)    # ... earlier in the open window
    resident_got: dict[int, set[int]] = dataclasses.field(default_factory=dict)   # NOTE [data parallel]
    averaged: set[int] = dataclasses.field(default_factory=set)  # resident blocks averaged this step
    grads_at_begin: dict[int, int | None] = dataclasses.field(default_factory=dict)   # NOTE [zero_grad]
    # forward
    seg: list[int] = dataclasses.field(default_factory=list)     # blocks whose forward runs, innermost last
    part: list[int] = dataclasses.field(default_factory=list)    # parts whose forward runs (NOTE [recompute in parts])
    eval_next: int = 0            # NOTE [evaluation between steps]: the block expected next
    # what the traced step saw (NOTE [recompute plan] in training/plan.py)
    order: list[int] = dataclasses.field(default_factory=list)   # blocks in forward order
    calls: dict[int, int] = dataclasses.field(default_factory=dict)     # forward calls per block
    boundary: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)   # block -> (bytes, saves) of its inputs
    part_inputs: dict[int, int] = dataclasses.field(default_factory=dict)   # part -> bytes of its inputs
    part_seen: dict[int, set[int]] = dataclasses.field(default_factory=dict)  # block -> input storages counted
    nesting: int = 1              # streamed blocks used at once (NOTE [fewer slots])
    leaf: frozenset[int] = frozenset()    # blocks that can be recomputed: no block inside, not checkpointed already
    # what the plan asks of the swap (NOTE [activation swap])
    keep_keys: frozenset[tuple[int, int]] = frozenset()
    expect: dict[int, tuple[int, ...]] | None = None
    need: list[tuple[int, int]] = dataclasses.field(default_factory=list)   # swapped keys in backward-read order
    boundary_saves: dict[int, int] = dataclasses.field(default_factory=dict)
    # measured
    moved: dict[str, int] = dataclasses.field(default_factory=lambda: {"h2d": 0, "d2h": 0})   # bytes, last step
    last_peak: int = 0            # torch's peak reserved bytes in the last step
    floor: int = 0                # the traced step's peak, everything moving
    budget_floor: Any = None      # NOTE [the floor]: the training's Floor (training/floor.py), once known
    may_wide: bool | None = False  # NOTE [wide blocks]: the option the floor is counted under
    general_peak: int | None = None   # the last step's peak outside the graphs' pool (NOTE [replayed recompute])
    changes_at_begin: int = 0     # the graphs' changes when the step began

    def came(self, p: Any) -> bool:
        """``p`` got a gradient in this step or earlier in the open window (NOTE [accumulation])."""
        return id(p) in self.got or id(p) in self.window
