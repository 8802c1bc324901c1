"""Clipping a tiered training's gradients to a global norm (NOTE [clipping]), and stepping the
streamed blocks inside backward on the bet that the clip will not bite (NOTE [speculative
clipping]). tiermem.training.handle calls it where a step's gradients are complete and at the step's end.

NOTE [clipping]
    Clipping to a global norm (HF Trainer clips to 1.0 by default) needs every gradient before
    any parameter moves, where tiermem steps each streamed block inside backward as soon as
    its gradients are complete (NOTE [training transport] in training/handle.py). With
    ``max_grad_norm`` the updating step does what a micro-batch of an accumulation window does
    (NOTE [accumulation] in training/handle.py): each streamed block's gradients, complete, have their
    norms taken in the slot and go home. At the step's end the total norm is torch's (NOTE
    [clip arithmetic] in training/gradnorm.py), resident gradients are clipped in place, and the streamed
    blocks pass through the slots once more in forward order, parameters, states and
    gradients in, each clipped and stepped there and written back, the next blocks' fills
    running under each block's step. That pass is link-bound (a block's parameters and
    gradients cross once more than in a step that does not clip) and overlaps no compute; the
    plan counts it (``clip`` in training/plan.py), so its candidates are compared with it. The
    losses are clip_grad_norm_'s bitwise (tests/test_train_clip.py, the GPU test).
    ``train.grad_norm`` is the total norm, a device tensor, as clip_grad_norm_ returns it.
    Calling clip_grad_norm_ inside train.step() instead would see the resident blocks'
    gradients only, so it is not the way: tiermem cannot tell.

NOTE [speculative clipping]
    The pass of NOTE [clipping] costs a streamed block's parameters, states and gradients
    once more over the link, outside compute, and it is needed only when the clip bites:
    torch multiplies the gradients by min(max_norm / (total + 1e-6), 1), and by exactly 1.0
    the gradients keep their bits. With ``speculate=True`` a step that follows one whose
    clip did not bite steps each streamed block inside backward as a step without clipping
    does, its gradients' norms taken and the gradients sent home first, but writes the
    stepped parameters and states to a second pinned home, the home keeping the values
    before the step. At the step's end (the host waits for the total norm) a coefficient of
    1.0 keeps the speculation: each block's second home becomes its home, bitwise the
    clipped step. Anything else undoes it: the optimizer's small states the step advanced
    (AdamW's ``step``) and the bf16 rounding's generator are put back, and the pass runs
    from the homes as without speculation; the next step then does not speculate, until
    one's clip does not bite. The optimizer must leave the gradients alone, as the
    gradients' copy home runs beside its step: Adam, AdamW and SGD do (``leaves_grads``). It
    doubles the streamed blocks' pinned bytes (parameters and states).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .gradnorm import NormParts
from .slots import Block, BlockSlots
from .states import OptimizerStates

__all__ = ["Clipping", "leaves_grads"]


def leaves_grads() -> tuple[type, ...]:
    """The optimizers NOTE [speculative clipping] allows: their steps leave the gradients alone."""
    import torch
    return (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


class Clipping:
    """A training's clip to ``max_grad_norm`` (``norm_type``), with speculation when asked."""

    def __init__(self, torch: Any, optimizer: Any, stream: BlockSlots, states: OptimizerStates,
                 max_grad_norm: float, norm_type: float, speculate: bool):
        self.torch, self.opt, self.stream, self.states = torch, optimizer, stream, states
        self.max_grad_norm = float(max_grad_norm)
        self.norms = NormParts(torch, norm_type)
        self.grad_norm: Any = None            # the last optimizer step's total gradient norm
        self.speculate = speculate
        self.speculation = {"committed": 0, "redone": 0}
        self._ok = True                       # the last optimizer step did not clip: speculate on the next
        self.speculating = False
        self._saved: dict[int, dict[str, Any]] = {}
        self._rng: Any = None
        self.on_host: Callable[[Block, tuple[float, Any]], None] | None = None   # NOTE [host stepping]
        self.shards: Any = None               # ShardedSteps with shard_steps=True (NOTE [sharded steps])

    def begin(self, updating: bool, tracing: bool) -> None:
        """A step begins: it speculates if it updates, is planned, and the last clip did not bite."""
        self.speculating = self.speculate and updating and not tracing and self._ok
        self._saved, self._rng = {}, None

    def block_done(self, b: Block, got: list[Any]) -> None:
        """A streamed block's gradients (``got``: those that came) are complete in its slot: their
        norms are taken and they go home; speculating, the block steps into its second home."""
        self.norms.add(got)
        self.stream.write_grads(b)
        if self.speculating and b.states and (b.slot.has_states or b.peer):
            self._speculate(b, got)

    def _speculate(self, b: Block, got: list[Any]) -> None:
        """Step ``b`` in its slot into its second home (NOTE [speculative clipping]); where another
        rank steps it, take its stepped parameters from there (NOTE [sharded steps])."""
        if b.peer:
            self.shards.broadcast(b)
            self.stream.write_back_alt(b)
            return
        torch = self.torch
        rounding = self.states.rounding
        if self._rng is None and rounding is not None:
            self._rng = rounding.get_state()
        homed = {(id(p), key) for p, key, _ in b.states}
        for p in b.trainable:
            self._saved[id(p)] = {k: (v.clone() if torch.is_tensor(v) else v)
                                  for k, v in self.opt.state.get(p, {}).items() if (id(p), k) not in homed}
        ids = {id(p) for p in got}
        for p, g in zip(b.trainable, self.stream.slot_views(b.slot, b)[1]):
            p.grad = g if id(p) in ids else None
        self.states.step_block(b, b.slot)
        if self.shards is not None and self.shards.shares(b):
            self.shards.broadcast(b)
        self.stream.write_back_alt(b)

    def undo(self, blocks: Sequence[Block]) -> None:
        """The speculative steps do not stand: the homes still hold the values before them, the
        slots' stepped copies are forgotten, the small states and the rounding put back."""
        for b in blocks:
            if not b.speculated:
                continue
            b.speculated = False
            if b.slot is not None and b.slot.occupant is b:
                self.stream.unbind(b.slot)
            for p in b.trainable:
                self.opt.state[p].update(self._saved.get(id(p), {}))
        if self._rng is not None:
            self.states.rounding.set_state(self._rng)
        self._saved, self._rng = {}, None

    def clip_and_step(self, resident: list[Any], params: list[Any], todo: list[Block],
                      came: Callable[[Any], bool], step_block: Callable[[Block], None]) -> None:
        """Clip every gradient of the step to the global norm and step the streamed blocks
        ``todo`` (in forward order) whose gradients wait at home (NOTE [clipping]); the
        ``resident`` gradients are clipped in place and step after, as in any step. ``params``
        are the model's (the norm's device); ``came(p)``: p got a gradient in the step."""
        torch = self.torch
        self.norms.add(resident)
        total = self.norms.total(params)
        self.norms.clear()
        self.grad_norm = total
        torch.nn.utils.clip_grads_with_norm_(resident, self.max_grad_norm, total)
        if self.speculate:
            # torch's coefficient (clip_grads_with_norm_), read on the host: NOTE [speculative clipping]
            coef = torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)
            whole = float(coef) == 1.0
            self._ok = whole
            spec = [b for b in todo if b.speculated]
            if spec and whole:
                for b in spec:
                    self.stream.commit(b)
                    b.grads_home = False
                self.speculation["committed"] += 1
            elif spec:
                self.undo(spec)
                self.speculation["redone"] += 1
        if self.on_host is not None:
            mine = [b for b in todo if b.grads_home and b.host]
            clip = (self.max_grad_norm, total.to("cpu")) if mine else None   # the host reads the norm once
            for b in mine:
                self.on_host(b, clip)          # NOTE [host stepping]: clipped and stepped in its home
        todo = [b for b in todo if b.grads_home]
        self.stream.in_backward = True          # fills bring the states
        for k, b in enumerate(todo):
            upcoming = [x.index for x in todo[k + 1:]]
            s = self.stream.ensure(b, states=True, upcoming=upcoming)
            got = []
            for p, g in zip(b.trainable, self.stream.slot_views(s, b)[1]):
                if came(p):
                    p.grad = g
                    got.append(p)
            if upcoming:
                self.stream.ahead(upcoming)
            torch.nn.utils.clip_grads_with_norm_(got, self.max_grad_norm, total)
            step_block(b)
