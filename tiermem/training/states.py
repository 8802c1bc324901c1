"""The optimizer's states of a trained model's blocks: where tiermem holds them, how a block's
step reaches them, and how they are narrowed to bf16 and loaded from a checkpoint.

NOTE [bf16 moments]
    A streamed parameter with fp32 AdamW moves 28 bytes a step (NOTE [training plan]), 16 of
    them its two moments. ``state_dtype=torch.bfloat16`` holds a streamed block's fp32 optimizer
    states as bf16 in its pinned home and in its slot, so they cross the link as half the bytes
    both ways (20 bytes a parameter). The arithmetic stays fp32: inside the block's step its
    slot's bf16 states are widened into fp32 temporaries from torch's allocator, the optimizer
    steps those, and they are narrowed back into the slot before the write-back home is queued.
    The traced step's peak already holds one block's fp32 states at a time (the optimizer makes
    them there), so the plan's floor covers the temporaries.

    Narrowing rounds stochastically. bf16 keeps 8 bits of mantissa: round-to-nearest drops every
    change below 2^-9 of a value, and exp_avg_sq changes by (1 - beta2) = 1e-3 of itself a step,
    so it would stop moving. Rounding up with the probability of the fraction cut off keeps the
    expected value the fp32 one (:func:`round_stochastic`: uniform random 16 bits added to the
    fp32 bit pattern, the low 16 then cleared; a few ops on the device). The bits come from a
    generator the handle owns (``train.rounding``, seeded with ROUND_SEED): the caller's RNG
    stream (dropout's masks) is never advanced, runs repeat, and data-parallel replicas round
    alike and stay equal. A resumed run must draw the bits the uninterrupted one would, so
    ``opt.state_dict()`` saves the generator's state under ROUNDING_KEY and ``load_state_dict``
    restores it (optimizer hooks until ``unwrap()``; without the key the generator is left as it
    is). Bitwise only if no block is resident: the resumed trace narrows all loaded states once.

    What does not move keeps its dtype: parameters, gradients, resident blocks' states (widened
    back to fp32 when a block becomes resident), states that are not fp32, and "step". Between
    steps ``opt.state[p][key]`` is the bf16 view of the home (or slot), as it is a view of them
    without the option: ``opt.state_dict()`` saves bf16 moments, which a plain optimizer's
    ``load_state_dict`` casts to the parameter's dtype, and ``unwrap()`` gives fp32 states back.
    Off by default: the moments lose bits each step, so the losses are close to the resident
    run's (tests/test_gpu_train.py), no longer bitwise equal to them.

NOTE [loaded states]
    ``opt.load_state_dict`` casts every loaded state to its parameter's device and dtype and
    points ``opt.state`` at the result. Under tiermem both are wrong: every parameter is a
    device tensor (a streamed one views its pinned home zero-copy), so torch would put the
    whole optimizer state on the device at once (past a budget, past a GPU smaller than the
    model), and the states a block's home, slot or managed memory holds would go on being
    stepped with their old values. So the optimizer's load runs between two hooks:
      - before it, the states of a shape of their parameter's (the moments; not "step",
        nor factored states, which torch loads itself) are taken out of the loaded dict;
      - after it, a block whose states tiermem holds gets them copied into that memory
        (round to nearest where its home holds bf16: a tiermem checkpoint's bf16 moments
        come back exactly), ``opt.state`` points there again, and a slot's copy is stale;
        a block whose parameters lack some of those states in the loaded dict starts them
        afresh, as a plain optimizer does (tiermem gives their home back);
      - states of blocks that hold none yet (no step since wrapping) stay where they were
        loaded, the host for ``map_location="cpu"``, and move to the device just before
        the block's first optimizer step, which adopts them as it adopts states the
        optimizer makes; a resident block's go to the device as torch would put them.
    So nothing of the checkpoint crosses to the device but into tiermem's own memory.
    The model's load needs nothing of this: between steps every streamed parameter is bound to
    its home (NOTE [training transport] in training/handle.py), so the load writes there. Load the
    checkpoint file itself with ``map_location="cpu"``: torch's allocator is capped at the
    budget, and a wrapped run's state dict holds device tensors. Loading either inside
    ``train.step()`` is refused. tests/test_train_resume.py checks resumed runs bitwise
    against the uninterrupted one on the CPU, tests/test_gpu_train.py on the GPU.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, TierMemError
from ..roles import Role
from .slots import Block, BlockSlots, TrainSlot, aligned

if TYPE_CHECKING:
    from ..core.engine import Engine as Tier

__all__ = ["OptimizerStates", "round_stochastic", "ROUND_SEED", "ROUNDING_KEY"]

ROUND_SEED = 0x7E57        # the stochastic rounding's generator (NOTE [bf16 moments])
ROUNDING_KEY = "tiermem_rounding"   # its state in opt.state_dict() (NOTE [bf16 moments])


class OptimizerStates:
    """The wrapped optimizer, stepped one block at a time, and the states tiermem holds for it.

    ``state_dtype``: None, or torch.bfloat16 to hold streamed blocks' fp32 states narrowed
    (NOTE [bf16 moments]). ``in_step`` says whether a step is running (a load is refused then)."""

    def __init__(self, tier: Tier, optimizer: Any, slots: BlockSlots, mem: Any, state_dtype: Any,
                 meter: Any, in_step: Callable[[], bool]):
        import torch
        self.torch, self.tier, self.opt, self.slots, self.mem = torch, tier, optimizer, slots, mem
        self.dev = mem.device
        self.state_dtype, self.meter, self.in_step = state_dtype, meter, in_step
        # NOTE [bf16 moments]: its own generator, so the caller's RNG stream is never advanced
        self.rounding = (torch.Generator(device=self.dev).manual_seed(ROUND_SEED)
                         if state_dtype is not None else None)
        self._pending: list[tuple[Any, str, Any]] = []   # states the optimizer's load left to us
        self.stepping = False         # tiermem's own optimizer.step() is running
        self.loads = 0                # state dicts loaded so far (NOTE [host stepping]: new states)
        # a block's parameters -> (the groups' lengths, each group's share, (group, place, parameter))
        self._restricted_of: dict[tuple[int, ...], tuple[tuple[int, ...], list[list[Any]], list[Any]]] = {}

    def hooks(self) -> list[Any]:
        """Register the optimizer's hooks (NOTE [bf16 moments], NOTE [loaded states]); returns
        their handles. They hold this object weakly, and the generator, so the optimizer keeps
        neither the handle nor the blocks alive."""
        out = []
        if self.rounding is not None:
            save, load = _rounding_hooks(self.rounding)
            out += [self.opt.register_state_dict_post_hook(save), self.opt.register_load_state_dict_pre_hook(load)]
        ref = weakref.ref(self)

        def before(opt: Any, sd: dict[str, Any]) -> dict[str, Any] | None:
            me = ref()
            return me.loading(sd) if me is not None else None

        def after(opt: Any) -> None:
            me = ref()
            if me is not None:
                me.loaded()

        def stepped(opt: Any, args: Any, kwargs: Any) -> None:
            me = ref()
            if me is not None and not me.stepping:
                raise TierMemError(
                    "optimizer.step() was called by the caller, but wrap_training steps the optimizer itself, "
                    "each block inside train.step() (a second step would update the parameters twice): drop "
                    "optimizer.step() and zero_grad() from the loop, or give a loop that steps it itself "
                    "train.stepped_optimizer(). For gradient clipping wrap with max_grad_norm=...; for "
                    "accumulation, accumulate=N. An fp16 GradScaler, whose step() calls it, is not supported: "
                    "train in bf16 or fp32")
        return out + [self.opt.register_load_state_dict_pre_hook(before),
                      self.opt.register_load_state_dict_post_hook(after),
                      self.opt.register_step_pre_hook(stepped)]

    # -- steps -------------------------------------------------------------------------------------
    def step(self, params: list[Any], block: bool = False) -> None:
        """The optimizer's own step, restricted to ``params`` (NOTE [training transport]);
        ``block``: they are a block's, stepped every step (their share of the groups is kept)."""
        groups = self.opt.param_groups
        saved = [g["params"] for g in groups]
        if block:
            restricted = self._restricted(params, saved)
        else:                   # the resident blocks' chunks change with which gradients came
            ids = {id(p) for p in params}
            restricted = [[p for p in g if id(p) in ids] for g in saved]
        try:
            for g, ps in zip(groups, restricted):
                g["params"] = ps
            self.stepping = True
            self.opt.step()
        finally:
            self.stepping = False
            for g, ps in zip(groups, saved):
                g["params"] = ps

    def _restricted(self, params: list[Any], groups: list[list[Any]]) -> list[list[Any]]:
        """Each group's parameters that are among ``params``, in the group's order. Each block
        steps once a step, and filtering every group's list each time cost the host a pass over
        the whole model per block; so the result is kept per ``params``, with where each of them
        stood, and used again while the groups keep their number and lengths and each kept
        parameter its place (a parameter moved to another group, or a list replaced by one of
        another length, is filtered again)."""
        key = tuple(map(id, params))
        lens = tuple(map(len, groups))
        hit = self._restricted_of.get(key)
        if hit is not None and hit[0] == lens and all(groups[i][j] is p for i, j, p in hit[2]):
            return hit[1]
        ids = set(key)
        at = [(i, j, p) for i, g in enumerate(groups) for j, p in enumerate(g) if id(p) in ids]
        out: list[list[Any]] = [[] for _ in groups]
        for i, _, p in at:
            out[i].append(p)
        self._restricted_of[key] = (lens, out, at)
        return out

    def step_block(self, b: Block, s: TrainSlot) -> None:
        """Step streamed block ``b`` in its slot ``s``. After its first, :meth:`adopt` gives the
        states the optimizer made (or the loaded ones) a pinned home."""
        sv = self.slots.slot_views(s, b)[2] if self.state_dtype is not None and s.has_states else []
        if not b.states:
            self.to_device(b)
        try:
            narrow = self._widen(b, s, sv)
            self.step(b.trainable, block=True)
            for x, v in narrow:
                round_stochastic(x, v, self.rounding)
        finally:
            if sv:
                self.slots.bind_states(b, sv)     # the slot's bf16 states again, stepped or not

    def _widen(self, b: Block, s: TrainSlot, views: list[Any]) -> list[tuple[Any, Any]]:
        """Point the optimizer at fp32 copies of the block's narrowed slot states ``views`` for its
        step (NOTE [bf16 moments]); returns (fp32 tensor, bf16 slot memory) pairs to narrow back
        after it. When every state of the block is narrowed (AdamW's two moments), the slot's
        whole state region is widened at once and each state is a slice of it: two kernels a
        block, not one widening and rounding per tensor, a few thousand launches a step
        (docs/history.md, "Measurements behind the code's notes")."""
        pairs = [(st, v) for st, (dt, held), v in zip(b.states, b.s_dtypes, views) if dt != held]
        if not pairs:
            return []
        dt = b.s_dtypes[0][0]
        if len(pairs) == len(b.states) and all(d == dt for d, _ in b.s_dtypes):
            held = b.s_dtypes[0][1]
            region = self.slots.state_region(s, b, held)
            wide = region.to(dt)        # alignment gaps come along: nothing reads them
            size = held.itemsize
            for (p, key, off), _ in pairs:
                self.opt.state[p][key] = wide[off // size: off // size + p.numel()].view(p.shape)
            return [(wide, region)]
        out = []
        for (p, key, off), v in pairs:
            self.opt.state[p][key] = w = v.to(dt)
            out.append((w, v))
        return out

    # -- homes -------------------------------------------------------------------------------------
    def adopt(self, b: Block) -> None:
        """The optimizer made its state tensors on the first step: give them a pinned home."""
        torch = self.torch
        off, full, states, dtypes = 0, 0, [], []
        for p in b.trainable:
            for key, v in self.opt.state[p].items():
                if torch.is_tensor(v) and v.device == self.dev and v.shape == p.shape and v.dtype.is_floating_point:
                    # "step" keeps its dtype as torch's load_state_dict keeps it (a fused
                    # AdamW's is an fp32 tensor, with a 0-d parameter's shape)
                    narrow = self.state_dtype is not None and v.dtype == torch.float32 and key != "step"
                    held = self.state_dtype if narrow else v.dtype
                    states.append((p, key, off))
                    dtypes.append((v.dtype, held))
                    off += aligned(v.numel() * held.itemsize)
                    full += aligned(v.numel() * v.element_size())
        if not off:
            return
        # All or nothing: a block whose states are half adopted would read a home never written
        # (tests/test_train_faults.py found NaN losses after a failed view here).
        with self.meter.host():             # a pinned allocation: the step waits, it does not compute
            self._adopt_into(b, states, dtypes, off)
        b.s_full = full

    def _adopt_into(self, b: Block, states: list[tuple[Any, str, int]], dtypes: list[tuple[Any, Any]],
                    off: int) -> None:
        torch = self.torch
        home = self.tier.backend.host_alloc(off, pooled=False)
        try:
            b.states, b.s_dtypes = states, dtypes
            views = self.slots.views(home.ptr, b, home, "s")
            with torch.no_grad():
                for (p, key, _), (dt, held), hv in zip(states, dtypes, views):
                    if dt != held:
                        round_stochastic(self.opt.state[p][key], hv, self.rounding)
                    else:
                        hv.copy_(self.opt.state[p][key])
            self.mem.sync_current()
        except BaseException:
            b.states, b.s_dtypes = [], []
            home.release()
            raise
        b.s_bytes, b.home_s, b.home_state_views = off, home, views
        self.slots.forget_views(b)            # a slot's views of the block were made without states
        self.slots.bind_states(b, views)
        self.slots.count("d2h", Role.OPTIMIZER_STATE, b.s_bytes)

    def forget(self, b: Block) -> None:
        """The loaded dict starts some of ``b``'s states afresh (NOTE [loaded states])."""
        if b.resident:
            # their managed memory stays with the block; the optimizer makes new ones in torch's
            b.states, b.s_dtypes, b.resident_state_views = [], [], []
            return
        self.slots.stale_states(b)
        b.states, b.s_dtypes, b.home_state_views = [], [], []
        b.s_bytes = b.s_full = 0
        b.host = False                        # stepped on the device again until its states are adopted
        self.slots.forget_views(b)
        if b.home_s is not None:
            b.home_s.release()
            b.home_s = None

    def to_device(self, b: Block) -> None:
        """States of ``b`` loaded but not adopted yet go to the device for its first optimizer
        step, which then adopts them (NOTE [loaded states])."""
        torch = self.torch
        for p in b.trainable:
            st = self.opt.state.get(p)
            for key, v in (st or {}).items():
                if (torch.is_tensor(v) and v.device != self.dev and v.shape == p.shape and v.dtype.is_floating_point
                        and key != "step"):
                    st[key] = v.to(self.dev)

    # -- loading (NOTE [loaded states]) ---------------------------------------------------------------
    def loading(self, sd: dict[str, Any]) -> dict[str, Any] | None:
        """Before the optimizer loads ``sd`` (torch's shallow copy): take out the states tiermem
        places itself; returns the dict for torch to load."""
        if self.in_step():
            raise TierMemError("load the optimizer's state between steps, not inside train.step(): "
                               "this step's blocks already stepped with the states they had")
        torch = self.torch
        blocks = self.slots.blocks
        self._pending = []
        saved = [i for g in sd.get("param_groups", []) for i in g["params"]]
        mine = [p for g in self.opt.param_groups for p in g["params"]]
        if len(saved) != len(mine):
            return None                      # torch refuses it, with its own message
        of = dict(zip(saved, mine))
        ours = {id(p) for b in blocks for p in b.trainable}
        held = {(id(p), key) for b in blocks for p, key, _ in b.states}
        state = {}
        for k, st in sd.get("state", {}).items():
            p = of.get(k)
            if p is None or id(p) not in ours:
                state[k] = st
                continue
            rest = {}
            for key, v in st.items():
                if torch.is_tensor(v) and key != "step" and v.shape == p.shape:
                    self._pending.append((p, key, v))
                elif (id(p), key) in held:
                    raise ConfigError(f"the loaded optimizer state {key!r} of a parameter of shape "
                                      f"{tuple(p.shape)} has shape {tuple(getattr(v, 'shape', ()))}: "
                                      "a checkpoint of another model?")
                else:
                    rest[key] = v
            state[k] = rest
        return {**sd, "state": state}

    def loaded(self) -> None:
        """After the optimizer loaded: place what :meth:`loading` took out."""
        torch = self.torch
        pending, self._pending = self._pending, []
        self.loads += 1
        loaded = {(id(p), key): v for p, key, v in pending}
        self.mem.synchronize()          # write-backs home are done before their homes are written
        with torch.no_grad():
            for b in self.slots.blocks:
                if not b.states:
                    continue
                if any((id(p), key) not in loaded for p, key, _ in b.states):
                    self.forget(b)
                    continue
                views = b.resident_state_views if b.resident else b.home_state_views
                for (p, key, _), dst in zip(b.states, views):
                    dst.copy_(loaded.pop((id(p), key)))
                self.slots.bind_states(b, views)
                self.slots.stale_states(b)
            for p, key, v in pending:
                if (id(p), key) in loaded:
                    b = self.slots.block_of[id(p)]
                    where = p.device if b.resident else v.device
                    self.opt.state[p][key] = v.to(device=where, dtype=p.dtype)
        self.mem.synchronize()


def round_stochastic(x: Any, out: Any, generator: Any) -> None:
    """Write fp32 ``x`` into bf16 ``out`` rounded stochastically (NOTE [bf16 moments]): up with
    the probability of the fraction of a bf16 step cut off, so the expected value is ``x``; values
    bf16 holds exactly stay exact. Random bits from ``generator`` alone; ``x`` is not changed."""
    import torch
    bits = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    bits.add_(x.view(torch.int32)).bitwise_and_(-(1 << 16))   # a carry into bit 16 is the rounding up
    r = bits.view(torch.float32)
    r.masked_fill_(x.isnan(), float("nan"))   # a NaN whose mantissa sits in the low bits would turn into inf
    out.copy_(r)                              # exact: the low 16 bits are zero


def _rounding_hooks(generator: Any) -> tuple[Any, Any]:
    """The optimizer's state_dict post-hook and load_state_dict pre-hook that save and restore
    ``generator``'s state under ROUNDING_KEY (NOTE [bf16 moments])."""
    def save(opt: Any, sd: dict[str, Any]) -> None:
        sd[ROUNDING_KEY] = generator.get_state()     # a CPU ByteTensor, whatever the generator's device

    def load(opt: Any, sd: dict[str, Any]) -> None:
        state = sd.pop(ROUNDING_KEY, None)           # from torch's shallow copy: the caller's dict keeps it
        if state is not None:
            generator.set_state(state.cpu())         # a checkpoint may have been loaded onto a GPU
    return save, load
