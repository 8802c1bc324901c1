"""The module and autograd hooks of a tiered training: each block's forward pre- and post-hook, the
hook on its output's gradient that marks its backward, and each trainable parameter's
post-accumulate-grad hook that finds its block's gradients complete (NOTE [training transport] in
training/handle.py); and the guards on the caller's ``zero_grad`` and ``load_state_dict`` (NOTE
[zero_grad]). They bring blocks into slots, record what the traced step saw, and hand a block
whose gradients are complete to the step (training/stepping.py)."""
from __future__ import annotations

import logging
import weakref
from typing import Any

from ..errors import TierMemError
from ..pytorch.held import CopyGuard, InstancePatch
from .slots import Block, BlockSlots
from .stepstate import StepState

__all__ = ["BlockHooks"]

log = logging.getLogger("tiermem")


class BlockHooks:
    """The hooks of one training's blocks. ``steps`` is the training's step runner (its
    ``block_done`` and ``resident_grad_done``); ``handles`` the module and gradient hooks,
    ``guards`` the optimizer's and model's (kept when the plan is in capacity)."""

    def __init__(self, *, torch: Any, state: StepState, blocks: list[Block], stream: BlockSlots, meter: Any,
                 replays: Any, group: Any, min_swap: int, dev: Any, steps: Any):
        self.torch, self.state, self.blocks, self.stream, self.meter = torch, state, blocks, stream, meter
        self.replays, self.group, self.min_swap, self.dev, self.steps = replays, group, min_swap, dev, steps
        self.handles: list[Any] = []
        self.guards: list[Any] = []
        self.parts: list[tuple[Block, Any]] = []   # NOTE [recompute in parts]: (block, child) per part

    def register(self) -> None:
        """Each block's forward hooks, its parts' (NOTE [recompute in parts] in training/plan.py)
        and each trainable parameter's gradient hook."""
        for b in self.blocks:
            self.handles.append(b.module.register_forward_pre_hook(lambda m, a, b=b: self.fwd_pre(b, a)))
            self.handles.append(b.module.register_forward_hook(lambda m, a, out, b=b: self.fwd_post(b, out)))
        self.parts = [(b, child) for b in self.blocks if b.index in self.state.leaf
                      for child in _parts_of(b.module)]
        for k, (b, child) in enumerate(self.parts):
            self.handles.append(child.register_forward_pre_hook(
                lambda m, a, kw, k=k: self.part_pre(k, a, kw), with_kwargs=True))
            self.handles.append(child.register_forward_hook(lambda m, a, out, k=k: self.part_post(k)))
        for k, b in enumerate(self.blocks):
            for p in b.trainable:       # NOTE [hooks gc cannot see]
                self.handles.append(p.register_post_accumulate_grad_hook(_grad_done_hook(self, k)))

    def guard(self, model: Any, optimizer: Any, extra: list[Any]) -> None:
        """The guards on ``model`` and ``optimizer`` (NOTE [zero_grad], NOTE [held modules]), after
        ``extra`` (the optimizer states' hooks)."""
        self.guards = list(extra) + [model.register_load_state_dict_pre_hook(_model_loading(self)),
                                     _zero_grad_hook(optimizer, _zero_grad_called(self, "optimizer")),
                                     _zero_grad_hook(model, _zero_grad_called(self, "model")),
                                     CopyGuard(model)]       # NOTE [held modules]
        mine = {id(p) for b in self.blocks for p in b.trainable}
        for name, m in model.named_modules():
            params = [p for p in m.parameters() if id(p) in mine]
            if name and params:       # a submodule's own zero_grad (NOTE [zero_grad])
                self.guards.append(_zero_grad_hook(m, _zero_grad_called(self, f"model.{name}", params)))

    def remove(self, guards: bool = True) -> None:
        """Remove the module and gradient hooks, and with ``guards`` the guards too."""
        for h in self.handles + (self.guards if guards else []):
            h.remove()
        self.handles = []
        if guards:
            self.guards = []

    # -- forward -----------------------------------------------------------------------------------
    def segment(self) -> int:
        """The innermost block whose forward runs (-1: none)."""
        seg = self.state.seg
        return seg[-1] if seg else -1

    def part(self) -> int:
        """The part of the innermost block whose forward runs (-1: none; NOTE [recompute in parts])."""
        st = self.state
        if not st.part or not st.seg:
            return -1
        k = st.part[-1]
        return k if self.parts[k][0].index == st.seg[-1] else -1

    def part_pre(self, k: int, args: Any, kwargs: Any) -> None:
        st = self.state
        if not (st.in_step and st.tracing):
            return
        st.part.append(k)
        b = self.parts[k][0]
        seen = st.part_seen.setdefault(b.index, set())
        n = self.storages(list(args) + list(kwargs.values()), seen)
        st.part_inputs[k] = st.part_inputs.get(k, 0) + n

    def part_post(self, k: int) -> None:
        st = self.state
        if st.part and st.part[-1] == k:
            st.part.pop()

    def storages(self, values: list[Any], seen: set[int]) -> int:
        """Bytes of the device storages of tensors among ``values`` not in ``seen`` (added to it),
        parameters and storages the swap keeps on the device left out."""
        torch = self.torch
        n = 0
        for a in values:
            if not torch.is_tensor(a) or a.device != self.dev or a.numel() == 0:
                continue
            s = a.untyped_storage()
            ptr = s.data_ptr()
            if ptr in seen or ptr in self.stream.params or s.nbytes() < self.min_swap:
                continue
            seen.add(ptr)
            n += s.nbytes()
        return n

    def fwd_pre(self, b: Block, args: Any) -> None:
        st = self.state
        if not st.in_step:
            self.eval_pre(b)
            return
        if st.tracing:
            if b.index not in st.order:
                st.order.append(b.index)
            st.calls[b.index] = st.calls.get(b.index, 0) + 1
            st.boundary[b.index] = self.inputs(args)
            st.part_seen[b.index] = self.tensor_ptrs(args)   # a part's inputs that are the block's own
            if not b.resident:           # streamed blocks in use at once (NOTE [fewer slots])
                depth = 1 + sum(not self.blocks[i].resident for i in st.seg)
                st.nesting = max(st.nesting, depth)
        if not b.resident:
            pos = st.order.index(b.index) if b.index in st.order else len(st.order)
            upcoming = st.order[pos + 1:] if not st.tracing else []
            self.stream.ensure(b, states=False, upcoming=upcoming)
            if upcoming:
                self.stream.ahead(upcoming)
        st.seg.append(b.index)
        self.meter.mark(("block", b.index, "start"))

    # NOTE [evaluation between steps]
    #     A forward outside train.step() (an evaluation, under torch.no_grad() or not) read the
    #     streamed blocks' parameters from their pinned homes in place, over the link, as every
    #     kernel touching them needed them, many times over the bytes one pass over the link
    #     moves (docs/training.md, "Evaluating between steps"). So once a step has been traced, a forward outside a step streams the
    #     blocks through the slots as a step's forward does: each block is filled
    #     ahead of use, from the pre-hook of a block before it (a resident one too), after the
    #     work queued before that pre-hook (the caller's writes home), and when its forward ends
    #     its parameters are bound to their home again and the slot's copy is forgotten, so a
    #     write between forwards or steps reaches the next one (NOTE [training transport]). A forward that does
    #     not follow the traced order (one stopped part-way, a block called alone) first puts
    #     every parameter home and forgets every slot's copy; so does the next step.
    def eval_pre(self, b: Block) -> None:
        st = self.state
        order = st.order
        if st.tracing or not order or not self.stream.slots:
            return                         # not planned yet, or nothing streams: read in place
        pos = order.index(b.index) if b.index in order else -1
        if pos != st.eval_next:
            self.stream.reset()
        st.eval_next = (pos + 1) % len(order) if pos >= 0 else 0
        if pos < 0:
            return
        self.stream.mark_start()
        upcoming = order[pos + 1:]
        if not b.resident:
            self.stream.ensure(b, states=False, upcoming=upcoming)
        if upcoming:
            self.stream.ahead(upcoming)    # from a resident block too: the first streamed ones come in under it

    def tensor_ptrs(self, args: Any) -> set[int]:
        torch = self.torch
        return {a.untyped_storage().data_ptr() for a in args if torch.is_tensor(a) and a.device == self.dev}

    def inputs(self, args: Any) -> tuple[int, int]:
        """Bytes and storages a recomputed block would save: its positional tensor inputs that the
        swap would take (NOTE [recompute plan]; torch's checkpoint saves exactly those)."""
        seen: set[int] = set()
        n = self.storages(list(args), seen)
        return n, len(seen)

    def fwd_post(self, b: Block, out: Any) -> None:
        st = self.state
        if not st.in_step:
            self.stream.leave(b)
            return
        self.meter.mark(("block", b.index, "end"))
        if st.seg and st.seg[-1] == b.index:
            st.seg.pop()
        self.stream.done(b)
        if self.torch.is_grad_enabled():
            t = _first_grad_tensor(out)
            if t is not None:
                t.register_hook(lambda g, b=b: self.bwd_enter(b))

    # -- backward ----------------------------------------------------------------------------------
    def bwd_enter(self, b: Block, ahead: bool = True) -> None:
        """``b``'s backward begins: it comes into a slot with its states, its gradients there."""
        st = self.state
        if not self.stream.in_backward:
            self.meter.mark(("fwd", "end"))
            self.meter.mark(("bwd", "start"))
        self.stream.in_backward = True
        if b.resident or b.entered:
            return
        pos = st.order.index(b.index) if b.index in st.order else -1
        upcoming = list(reversed(st.order[:pos])) if pos >= 0 else []
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

    def on_param_read(self, p: Any) -> None:
        """The swap rebuilt a saved view of a streamed parameter: its block's backward is here."""
        b = self.stream.block_of.get(id(p))
        if b is not None and not b.resident and not b.entered:
            self.bwd_enter(b)

    def grad_done(self, b: Block, p: Any) -> None:
        st = self.state
        if self.replays.capturing:
            self.replays.hit.append(p)     # the capture's accumulation; its replays report it
            return
        if not st.in_step:
            return
        if b.resident:
            if self.group is not None and st.updating:
                self.steps.resident_grad_done(b, p)
            return
        if not b.entered:
            self.bwd_enter(b)    # a gradient with no backward entry seen (an output not tracked)
        if id(p) in st.got:
            raise TierMemError(f"a parameter of block {b.name} got its gradient twice in one step; tiermem "
                               "steps each block as soon as its gradients are complete, so run one backward "
                               "per train.step(): for gradient accumulation, wrap with accumulate=N and run "
                               "one micro-batch per step")
        st.got.add(id(p))
        b.waiting -= 1
        if b.waiting == 0:
            self.steps.block_done(b)

    def replayed(self, b: Block, hit: list[Any]) -> None:
        """A replayed backward added into ``hit``'s gradients, as autograd's accumulation would have."""
        for p in hit:
            self.grad_done(b, p)

    # -- guards ------------------------------------------------------------------------------------
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
    def zero_grad(self, owner: str, params: list[Any] | None = None) -> None:
        """Before the zero_grad of ``owner``: "optimizer", "model", or a submodule's name with
        its ``params`` (NOTE [zero_grad])."""
        st = self.state
        if st.in_step and (self.stream.in_backward or st.got or self.resident_grads_changed()):
            raise TierMemError(f"{owner}.zero_grad() after backward inside train.step() would drop gradients "
                               "before their optimizer step: drop it, the handle clears the gradients itself")
        if params is not None:
            if st.accumulated:
                ids = {id(p) for p in params}
                streamed = [b.name for b in self.blocks if not b.resident and any(id(p) in ids for p in b.trainable)]
                if streamed:
                    raise TierMemError(
                        f"{owner}.zero_grad() inside an accumulation window ({st.accumulated} micro-batch(es) "
                        f"in it) would drop only this submodule's gradients, and those of {streamed[0]} wait at "
                        "home with the rest of its block's: call model.zero_grad() or optimizer.zero_grad() "
                        "to drop the whole window, or this one after the window's optimizer step")
            return
        if st.accumulated:
            log.info("tiermem: zero_grad() inside an accumulation window drops its %d micro-batches' gradients",
                     st.accumulated)
            self.stream.drop_grads()
            st.accumulated = 0
            st.window = set()

    def resident_grads(self) -> dict[int, int | None]:
        """Each resident trainable parameter's gradient version (None: no gradient)."""
        return {id(p): (None if p.grad is None else p.grad._version)
                for b in self.blocks if b.resident for p in b.trainable}

    def resident_grads_changed(self) -> bool:
        """A backward reached a resident block since the step began (in capacity no hook tells)."""
        return self.resident_grads() != self.state.grads_at_begin

    def model_loading(self) -> None:
        """Before ``model.load_state_dict``: refused inside a step. Between steps every streamed
        parameter is bound to its home (NOTE [training transport]), so the load writes there."""
        if self.state.in_step:
            raise TierMemError("load the model's state between steps, not inside train.step()")


def _zero_grad_hook(obj: Any, before: Any) -> InstancePatch:
    """``obj``'s zero_grad (an optimizer's or a module's) wrapped on the instance so that
    ``before`` runs first (NOTE [zero_grad]); remove() puts it back."""
    inner = obj.zero_grad

    def zero_grad(*args: Any, **kwargs: Any) -> Any:
        before()
        return inner(*args, **kwargs)
    return InstancePatch(obj, {"zero_grad": zero_grad})


def _zero_grad_called(hooks: BlockHooks, owner: str, params: list[Any] | None = None) -> Any:
    """What the wrapped zero_grad of ``owner`` (with a submodule's ``params``) calls first; it
    holds the hooks weakly."""
    ref = weakref.ref(hooks)

    def before() -> None:
        h = ref()
        if h is not None:
            h.zero_grad(owner, params)
    return before


def _model_loading(hooks: BlockHooks) -> Any:
    """The model's load_state_dict pre-hook; it holds the hooks weakly."""
    ref = weakref.ref(hooks)

    def hook(module: Any, *_: Any) -> None:
        h = ref()
        if h is not None:
            h.model_loading()
    return hook


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


def _grad_done_hook(hooks: BlockHooks, k: int) -> Any:
    """The post-accumulate-grad hook of a trainable parameter of block ``k``: it holds the hooks
    weakly and the block by its place (NOTE [hooks gc cannot see]).

    NOTE [hooks gc cannot see]
        torch keeps a tensor's post-accumulate-grad hooks (``register_post_accumulate_grad_hook``)
        in C++, and a tensor's garbage-collector traversal does not visit them (a tensor's other
        hooks and a module's are visited). A hook whose closure reaches the parameter it is
        registered on is then a cycle the collector cannot free: a hook that held the training
        (whose model holds the parameter) or the block (whose ``trainable`` list does) kept a
        training dropped without unwrap alive for the rest of the process, with its model, its
        optimizer's states, its tier and every byte the tier holds. So these hooks hold their owner
        weakly; unwrap removes them as before. tests/test_release.py drops trainings and modules
        without unwrap and checks that their tiers go.
    """
    ref = weakref.ref(hooks)

    def hook(p: Any) -> None:
        h = ref()
        if h is not None:
            h.grad_done(h.blocks[k], p)
    return hook


def _parts_of(module: Any) -> list[Any]:
    """A block's parts (NOTE [recompute in parts] in training/plan.py): its direct children, where it
    has two or more."""
    kids = [m for _, m in module.named_children()]
    return kids if len(kids) >= 2 else []
