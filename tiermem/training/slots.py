"""A trained model's blocks, their pinned homes, and the device slots that stream them (NOTE
[training transport] in training/handle.py): which memory each parameter and optimizer state is bound to,
and the copies between a block's home and a slot. The training handle decides when a block is
needed; this decides where its bytes are and moves them."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ..core.stream import Lane, Slot, SlotRing
from ..errors import TierMemError
from ..roles import Role

if TYPE_CHECKING:
    from ..core.engine import Engine as Tier

__all__ = ["ALIGN", "aligned", "Block", "TrainSlot", "BlockSlots", "ring_slot", "slot_with", "WIDE_MAX"]

ALIGN = 256
WIDE_MAX = 2            # blocks at most that step across the whole ring (NOTE [wide blocks])
WIDE_GAIN = 0.8         # ... and only where that makes the slots at most this share of the largest block


def aligned(n: int) -> int:
    return -(-max(int(n), 1) // ALIGN) * ALIGN


@dataclasses.dataclass(eq=False)
class Block:
    """A module block's parameters, where they live and what it holds this step."""

    index: int
    name: str
    module: Any
    params: list[Any]
    trainable: list[Any]
    p_off: list[int] = dataclasses.field(default_factory=list)
    p_bytes: int = 0
    g_off: list[int] = dataclasses.field(default_factory=list)
    g_bytes: int = 0
    states: list[tuple[Any, str, int]] = dataclasses.field(default_factory=list)   # (param, key, offset)
    s_dtypes: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)   # per state: (the optimizer's
                                  # dtype, the one held at home and in a slot); NOTE [bf16 moments]
    s_bytes: int = 0              # states' bytes at home and in a slot: what moves
    s_full: int = 0               # the same at the optimizer's dtypes: what a resident block keeps
    home_p: Any = None
    home_s: Any = None
    home_g: Any = None            # pinned gradients of an open accumulation window (NOTE [accumulation])
    grads_home: bool = False      # home_g holds this window's gradients so far
    # NOTE [speculative clipping] in training/clipping.py: a second home the speculative step writes, the
    # home keeping the values before the step until commit() swaps the two
    alt_p: Any = None
    alt_s: Any = None
    alt_s_bytes: int = 0
    alt_views: list[Any] = dataclasses.field(default_factory=list)
    alt_state_views: list[Any] = dataclasses.field(default_factory=list)
    speculated: bool = False      # stepped this step into its second home
    alt_has_states: bool = False  # ... with its states (not where another rank stepped it)
    home_views: list[Any] = dataclasses.field(default_factory=list)
    home_state_views: list[Any] = dataclasses.field(default_factory=list)
    resident_state_views: list[Any] = dataclasses.field(default_factory=list)   # a resident block's states
    home_ready: Any = None        # event after its last write-back
    resident: bool = False
    wide: bool = False            # steps at the step's end across the whole ring (NOTE [wide blocks])
    host: bool = False            # its optimizer steps on the host, its states never in a slot
                                  # (NOTE [host stepping] in training/hoststep.py)
    peer: bool = False            # another rank steps it, its states never in a slot here
                                  # (NOTE [sharded steps] in training/shards.py)
    need_before: int = 0          # slot bytes its states will need, before the optimizer has made them
    deferred: bool = False        # its gradients went home for that this step
    tiered: list[Any] = dataclasses.field(default_factory=list)
    slot: Any = None
    entered: bool = False         # bound for backward this step
    waiting: int = 0              # gradients still to come this step
    stepped: bool = False

    def lay_out(self) -> None:
        """Offsets of the parameters and of their gradients in a slot (and in the home)."""
        self.p_off, self.p_bytes = _offsets(self.params)
        self.g_off, self.g_bytes = _offsets(self.trainable)

    @property
    def slot_need(self) -> int:
        """Bytes of slot the block needs in backward: parameters, gradients, optimizer states
        (none where they step on the host or on another rank)."""
        return self.p_bytes + self.g_bytes + (0 if self.host or self.peer else self.s_bytes)


def ring_slot(needs: dict[int, int], fwd: dict[int, int], least: int, wide: bool) -> tuple[int, frozenset[int]]:
    """The slots' size for blocks needing ``needs`` bytes in backward (parameters, gradients,
    states) and ``fwd`` of them outside their step (parameters and gradients), streamed through at
    least ``least`` slots, and the blocks that step across the whole ring (NOTE [wide blocks]):
    with ``wide``, up to WIDE_MAX of the largest, where the slots then shrink to WIDE_GAIN of the
    largest block or less."""
    if not needs:
        return 0, frozenset()
    whole = aligned(max(needs.values()))
    if not wide or least < 2:
        return whole, frozenset()
    order = sorted(needs, key=lambda i: -needs[i])
    best, which = whole, frozenset()
    for k in range(1, min(WIDE_MAX, len(order)) + 1):
        slot = slot_with(needs, fwd, frozenset(order[:k]), least)
        if slot <= WIDE_GAIN * max(needs.values()) and slot < best:
            best, which = slot, frozenset(order[:k])
    return best, which


def slot_with(needs: dict[int, int], fwd: dict[int, int], wide: frozenset[int], least: int) -> int:
    """The slots' size with the blocks ``wide`` stepping across the ring of ``least`` slots: the
    largest of the others, a ``least``-th of the largest wide one, and the wide ones' parameters
    and gradients (they come into one slot outside their step)."""
    rest = max((n for i, n in needs.items() if i not in wide), default=0)
    big = max((needs[i] for i in wide), default=0)
    return aligned(max(rest, -(-big // max(least, 1)), max((fwd[i] for i in wide), default=0)))


def _offsets(tensors: list[Any]) -> tuple[list[int], int]:
    out, off = [], 0
    for t in tensors:
        out.append(off)
        off += aligned(t.numel() * t.element_size())
    return out, off


@dataclasses.dataclass(eq=False)
class TrainSlot(Slot):
    """A slot of the training ring (NOTE [ordered copies] in core/stream.py): its occupant is a block."""
    has_params: bool = False
    has_states: bool = False
    has_grads: bool = False


class BlockSlots:
    """The blocks' pinned homes and the ring of device slots (``lookahead + 1`` of them, torch
    memory inside the budget's cap) that a step streams them through.

    ``params`` maps a streamed parameter's storage address to it, for the activation swap (a
    saved parameter is not an activation). ``in_backward`` is set by the step: outside backward,
    reusing a slot waits for its occupant's write-back on the compute stream (see :meth:`unbind`).
    ``moved`` counts the bytes of the step's copies each way."""

    def __init__(self, tier: Tier, blocks: list[Block], optimizer: Any, meter: Any, lookahead: int, device: Any):
        import torch
        self.torch, self.tier, self.blocks, self.opt, self.meter = torch, tier, blocks, optimizer, meter
        self.dev = device
        self.lookahead, self.nslots = lookahead, lookahead + 1
        self.block_of = {id(p): b for b in blocks for p in b.params}
        self.params: dict[int, Any] = {}
        self._bound: dict[int, int] = {}   # id(parameter) -> the address bind() registered in params
        self.slots: SlotRing | list[TrainSlot] = []
        self.slot_mem: Any = None
        self.slot_bytes = 0
        self.least_slot = 0           # NOTE [the floor]: while the first step is traced, a slot holds the
                                      # largest block's states too, before the optimizer has made them
        self._views_of: dict[tuple[int, int], tuple[list, list, list]] = {}
        self.h2d = Lane(tier.backend, lambda: tier.side_stream("h2d"))   # fills of the slots
        self.d2h = Lane(tier.backend, lambda: tier.side_stream("d2h"))   # write-backs home
        self.in_backward = False
        self.allow_wide = False       # NOTE [wide blocks]: the largest blocks may step across the ring
        self.least = 2                # the fewest slots a step streams through (NOTE [the floor])
        self.updating = True          # the step steps the optimizer: backward fills bring states
        self.begun: Any = None        # event: the running step's start; fills wait for it
        self.moved = {"h2d": 0, "d2h": 0}
        self.written: list[Block] = []   # blocks written back home this step

    # -- homes and views ---------------------------------------------------------------------------
    def make_home(self, b: Block) -> None:
        """A pinned home for ``b``'s parameters, filled from them; they are bound to it."""
        be = self.tier.backend
        b.home_p = be.host_alloc(b.p_bytes, pooled=False)
        b.home_views = self.views(b.home_p.ptr, b, b.home_p, "p")
        for p, v in zip(b.params, b.home_views):
            v.copy_(p.data)

    def bind_home(self, b: Block) -> None:
        for p, v in zip(b.params, b.home_views):
            self.bind(p, v)

    def views(self, base: int, b: Block, owner: Any, what: str, host: bool = False) -> list[Any]:
        """Tensors over ``b``'s parameters ("p"), gradients ("g") or states ("s") laid out from
        ``base``; with ``host``, CPU tensors over a pinned home (NOTE [host stepping])."""
        be = self.tier.backend
        view = be.host_view if host else be.torch_view
        if what == "p":
            items = [(p, p.dtype, o) for p, o in zip(b.params, b.p_off)]
        elif what == "g":
            items = [(p, p.dtype, o) for p, o in zip(b.trainable, b.g_off)]
        else:
            items = [(p, held, o) for (p, _, o), (_, held) in zip(b.states, b.s_dtypes)]
        out = []
        for p, dt, o in items:
            n = p.numel() * dt.itemsize
            out.append(view(base + o, n, owner).view(dt).view(p.shape))
        return out

    def slot_views(self, s: TrainSlot, b: Block) -> tuple[list, list, list]:
        key = (s.index, b.index)
        v = self._views_of.get(key)
        if v is None:
            # a wide block's states fit only from the ring's start (NOTE [wide blocks]): none elsewhere
            # (a block stepped on the host never binds them: NOTE [host stepping])
            fits = s.ptr - self.slot_mem.data_ptr() + b.p_bytes + b.g_bytes + b.s_bytes <= self.slot_mem.numel()
            v = (self.views(s.ptr, b, self.slot_mem, "p"),
                 self.views(s.ptr + b.p_bytes, b, self.slot_mem, "g"),
                 self.views(s.ptr + b.p_bytes + b.g_bytes, b, self.slot_mem, "s") if fits else [])
            self._views_of[key] = v
        return v

    def forget_views(self, b: Block) -> None:
        """Drop the slots' views of ``b``: its states changed (adopted, forgotten)."""
        self._views_of = {k: v for k, v in self._views_of.items() if k[1] != b.index}

    def state_region(self, s: TrainSlot, b: Block, dtype: Any) -> Any:
        """The slot's whole states region of ``b``, as one tensor of ``dtype``."""
        return self.tier.backend.torch_view(s.ptr + b.p_bytes + b.g_bytes, b.s_bytes, self.slot_mem).view(dtype)

    def param_region(self, s: TrainSlot, b: Block) -> Any:
        """The slot's parameter bytes of ``b``, as one uint8 tensor."""
        return self.slot_mem[s.ptr - self.slot_mem.data_ptr():][: b.p_bytes]

    def grad_region(self, s: TrainSlot, b: Block) -> Any:
        """The slot's gradient bytes of ``b``, as one uint8 tensor."""
        return self.slot_mem[s.ptr - self.slot_mem.data_ptr() + b.p_bytes:][: b.g_bytes]

    def bind(self, p: Any, v: Any) -> None:
        """Point ``p`` at ``v``, keeping ``params`` right."""
        self.forget(p)
        p.data = v
        b = self.block_of.get(id(p))
        if b is not None and not b.resident:
            ptr = v.untyped_storage().data_ptr()
            self.params[ptr] = p
            self._bound[id(p)] = ptr

    def forget(self, p: Any, old: int | None = None) -> None:
        """``p``'s memory at ``old``, and where :meth:`bind` last registered it, is no longer a
        streamed parameter's. The registered address is remembered rather than read back from
        ``p.data``: a step binds every streamed parameter four times, and reading it back made a
        new tensor and storage object each time."""
        for ptr in (self._bound.pop(id(p), None), old):
            if ptr is not None and self.params.get(ptr) is p:
                del self.params[ptr]

    def bind_states(self, b: Block, views: list[Any]) -> None:
        for (p, key, _), v in zip(b.states, views):
            self.opt.state[p][key] = v

    # -- slots -------------------------------------------------------------------------------------
    def needed_slot_bytes(self) -> int:
        """The slots' size for the streamed blocks as they are now; marks the wide ones (NOTE
        [wide blocks])."""
        streamed = [b for b in self.blocks if not b.resident]
        fwd = {b.index: b.p_bytes + b.g_bytes for b in streamed}
        # which blocks are wide follows the states they will have (the trace's first step makes them)
        _, wide = ring_slot({b.index: b.slot_need if b.states else max(b.slot_need, b.need_before)
                             for b in streamed}, fwd, self.least, self.allow_wide)
        for b in self.blocks:
            b.wide = b.index in wide
        return slot_with({b.index: b.slot_need for b in streamed}, fwd, wide, self.least) if streamed else 0

    def alloc(self) -> None:
        """(Re)make the ring for the streamed blocks as they are now."""
        torch = self.torch
        self.unbind_all()
        self.slot_mem = None
        self.slots = []
        self._views_of = {}
        self.slot_bytes = (aligned(max(self.needed_slot_bytes(), self.least_slot))
                           if any(not b.resident for b in self.blocks) else 0)
        if not self.slot_bytes:
            return
        self.slot_mem = torch.empty(self.nslots * self.slot_bytes, dtype=torch.uint8, device=self.dev)
        self.slots = SlotRing(self.slot_mem.data_ptr(), self.slot_bytes, self.nslots, make=TrainSlot)

    def too_small(self) -> bool:
        """The slots no longer hold the largest streamed block (its states were adopted since)."""
        if all(b.resident for b in self.blocks):
            return False
        return not self.slots or aligned(self.needed_slot_bytes()) > self.slot_bytes

    def unbind(self, s: TrainSlot) -> None:
        """Point the slot's occupant back at its home before the slot is reused.

        Outside backward the compute stream then waits for the occupant's last write-back, so a
        read of its home (a tied weight, an evaluation) sees the update. Inside backward it does
        not: nothing reads a block's parameters after its update there, and the wait would
        serialise the next block's backward behind this block's write-back; the step's end waits
        for every write-back instead."""
        b = s.occupant
        be = self.tier.backend
        if b.home_ready is not None and not self.in_backward:
            self.meter.wait(be.current_stream(), b.home_ready)
        self.bind_home(b)
        if b.states:
            self.bind_states(b, b.home_state_views)
        b.slot = None
        s.occupant, s.has_params, s.has_states, s.has_grads = None, False, False, False

    def unbind_all(self) -> None:
        for s in self.slots:
            if s.occupant is not None:
                self.unbind(s)

    def stale_states(self, b: Block) -> None:
        """The states ``b``'s slot holds are no longer the block's (loaded or forgotten)."""
        if b.slot is not None and b.slot.occupant is b:
            b.slot.has_states = False

    def fill(self, b: Block, states: bool, protect: set[int]) -> bool:
        """Start bringing ``b`` into a slot on the H2D stream: its parameters, and for backward
        (``states``) its optimizer states when the step updates and the gradients accumulated so
        far (NOTE [accumulation] in training/handle.py). Returns False when no slot is free."""
        s = b.slot
        want_states = states and self.updating and bool(b.states) and not b.wide and not b.host and not b.peer
        want_grads = states and b.grads_home
        if (s is not None and s.has_params and (s.has_states or not want_states)
                and (s.has_grads or not want_grads)):
            return True
        if s is None:
            s = self.slots.pick(lambda occ: occ.index in protect or occ is b)
            if s is None:
                return False
            if s.occupant is not None:
                self.unbind(s)
            s.occupant, b.slot = b, s
        parts, got = [], []
        if not s.has_params:
            parts.append((0, b.home_p.ptr, b.p_bytes))
            got.append(("has_params", Role.WEIGHT, b.p_bytes))
        if want_grads and not s.has_grads:
            parts.append((b.p_bytes, b.home_g.ptr, b.g_bytes))
            got.append(("has_grads", Role.GRADIENT, b.g_bytes))
        if want_states and not s.has_states:
            if b.slot_need > self.slot_bytes:    # never copy past a slot's end
                raise TierMemError(f"block {b.name} needs {b.slot_need:,} bytes of slot, the "
                                   f"slots have {self.slot_bytes:,}: a tiermem bug, please report it")
            parts.append((b.p_bytes + b.g_bytes, b.home_s.ptr, b.s_bytes))
            got.append(("has_states", Role.OPTIMIZER_STATE, b.s_bytes))
        # After the slot's last user, the block's last write-back home (NOTE [ordered copies]),
        # and the step's start: what the caller wrote home between steps.
        self.slots.fill(self.h2d, s, parts, after=(b.home_ready, self.begun))
        for what, role, n in got:
            self.count("h2d", role, n)
            setattr(s, what, True)
        return True

    def ensure(self, b: Block, states: bool, upcoming: list[int]) -> TrainSlot:
        """``b`` in a slot, bound to it, the compute stream waiting for its fill."""
        if not self.fill(b, states, set(upcoming[: self.lookahead])):
            raise TierMemError(f"no free slot for block {b.name}: every slot is in use "
                               f"(nesting deeper than lookahead={self.lookahead}); raise lookahead")
        s = b.slot
        be = self.tier.backend
        self.meter.wait(be.current_stream(), s.ready)
        self.slots.use(s)
        pv, gv, sv = self.slot_views(s, b)
        if b.params[0].data.data_ptr() != pv[0].data_ptr():
            for p, v in zip(b.params, pv):
                self.bind(p, v)
        if states and self.updating and b.states and not b.wide and not b.host and not b.peer:
            self.bind_states(b, sv)
        return s

    def fill_wide(self, b: Block) -> TrainSlot:
        """Bring wide block ``b`` across the whole ring for its step (NOTE [wide blocks]): its
        parameters, the gradients it sent home, its states; no slot may be in use. Bound to it,
        the compute stream waiting for the copy."""
        if any(s.busy for s in self.slots):
            raise TierMemError(f"block {b.name} steps across every slot, and one is in use: a tiermem bug, "
                               "please report it")
        need = b.p_bytes + b.g_bytes + b.s_bytes
        if need > len(self.slots) * self.slot_bytes:
            raise TierMemError(f"block {b.name} needs {need:,} bytes, the {len(self.slots)} slots have "
                               f"{len(self.slots) * self.slot_bytes:,}: a tiermem bug, please report it")
        others = [t.free for t in self.slots[1:] if t.free is not None]
        for t in self.slots:
            if t.occupant is not None:
                self.unbind(t)
        s = self.slots[0]
        s.occupant, b.slot = b, s
        parts = [(0, b.home_p.ptr, b.p_bytes), (b.p_bytes, b.home_g.ptr, b.g_bytes)]
        got = [(Role.WEIGHT, b.p_bytes), (Role.GRADIENT, b.g_bytes)]
        if b.states:
            parts.append((b.p_bytes + b.g_bytes, b.home_s.ptr, b.s_bytes))
            got.append((Role.OPTIMIZER_STATE, b.s_bytes))
        self.slots.fill(self.h2d, s, parts, after=(b.home_ready, self.begun, *others))
        for role, n in got:
            self.count("h2d", role, n)
        s.has_params, s.has_grads, s.has_states = True, True, bool(b.states)
        be = self.tier.backend
        self.meter.wait(be.current_stream(), s.ready)
        self.slots.use(s)
        pv, gv, sv = self.slot_views(s, b)
        for p, v in zip(b.params, pv):
            self.bind(p, v)
        for p, g in zip(b.trainable, gv):
            p.grad = g
        if b.states:
            self.bind_states(b, sv)
        return s

    def wide_done(self, b: Block) -> None:
        """``b`` stepped across the ring and its write-back is queued: every slot is free once that
        copy is done, and none keeps a block (NOTE [wide blocks])."""
        end = b.slot.free
        for t in self.slots:
            t.free = end
        self.unbind(b.slot)
        b.grads_home = False

    def ahead(self, order: list[int]) -> None:
        """Fill slots with the next streamed blocks of ``order`` (blocks' indices, next first);
        with their states in backward."""
        nxt = [i for i in order if not self.blocks[i].resident][: self.lookahead]
        for i in nxt:
            if not self.fill(self.blocks[i], states=self.in_backward, protect=set(nxt)):
                break

    def done(self, b: Block) -> None:
        """``b``'s forward is done with its slot."""
        if not b.resident and b.slot is not None:
            self.slots.release(b.slot, self.tier.backend)

    def leave(self, b: Block) -> None:
        """An evaluation's forward is done with ``b``: its slot is free, and its parameters are
        its home's again, the slot's copy forgotten (NOTE [evaluation between steps] in training/hooks.py)."""
        s = b.slot
        if s is not None and s.occupant is b and s.busy:
            self.slots.release(s, self.tier.backend)
            self.unbind(s)

    def mark_start(self) -> None:
        """Fills from now on wait for the work queued so far on the compute stream (the caller's
        writes home)."""
        be = self.tier.backend
        ev = be.new_event()
        be.record(ev, be.current_stream())
        self.begun = ev

    def reset(self) -> None:
        """No block in use, every parameter its home's, no slot's copy kept."""
        self.idle()
        self.unbind_all()

    def write_back(self, b: Block) -> None:
        """Queue the copy of ``b``'s stepped parameters (and states) home; it frees the slot."""
        s = b.slot
        parts = [(b.home_p.ptr, 0, b.p_bytes)]
        if b.states and s.has_states:
            parts.append((b.home_s.ptr, b.p_bytes + b.g_bytes, b.s_bytes))
        b.home_ready = self.slots.drain(self.d2h, s, parts)
        self.count("d2h", Role.WEIGHT, b.p_bytes)
        if len(parts) > 1:
            self.count("d2h", Role.OPTIMIZER_STATE, b.s_bytes)
        self.written.append(b)
        s.busy = False

    def write_grads(self, b: Block) -> None:
        """Queue the copy of ``b``'s gradients home, where the next micro-batch's backward finds
        them (NOTE [accumulation] in training/handle.py); it frees the slot. The parameters did not change."""
        s = b.slot
        if b.home_g is None:
            b.home_g = self.tier.backend.host_alloc(b.g_bytes, pooled=False)
        b.home_ready = self.slots.drain(self.d2h, s, [(b.home_g.ptr, b.p_bytes, b.g_bytes)])
        self.count("d2h", Role.GRADIENT, b.g_bytes)
        b.grads_home = True
        self.written.append(b)
        s.busy = False

    def stale_params(self, b: Block) -> None:
        """The parameters ``b``'s slot holds are no longer the block's: its home is being stepped
        on the host (NOTE [host stepping]); a later fill copies them afresh."""
        if b.slot is not None and b.slot.occupant is b:
            b.slot.has_params = b.slot.has_grads = False

    def write_back_alt(self, b: Block) -> None:
        """Queue the copy of ``b``'s stepped parameters and states to its second home; its home
        keeps their values before the step until :meth:`commit` (NOTE [speculative clipping] in
        training/clipping.py). Frees the slot."""
        be = self.tier.backend
        if b.alt_p is None:
            b.alt_p = be.host_alloc(b.p_bytes, pooled=False)
            b.alt_views = self.views(b.alt_p.ptr, b, b.alt_p, "p")
        s = b.slot
        states = bool(b.states) and s.has_states     # not a block another rank stepped (NOTE [sharded steps])
        if states and (b.alt_s is None or b.alt_s_bytes != b.s_bytes):
            if b.alt_s is not None:
                b.alt_s.release()
            b.alt_s, b.alt_s_bytes = be.host_alloc(b.s_bytes, pooled=False), b.s_bytes
            b.alt_state_views = self.views(b.alt_s.ptr, b, b.alt_s, "s")
        parts = [(b.alt_p.ptr, 0, b.p_bytes)]
        if states:
            parts.append((b.alt_s.ptr, b.p_bytes + b.g_bytes, b.s_bytes))
        b.home_ready = self.slots.drain(self.d2h, s, parts)
        self.count("d2h", Role.WEIGHT, b.p_bytes)
        if states:
            self.count("d2h", Role.OPTIMIZER_STATE, b.s_bytes)
        self.written.append(b)
        b.speculated, b.alt_has_states = True, states
        s.busy = False

    def commit(self, b: Block) -> None:
        """The speculative step of ``b`` stands: its second home becomes its home."""
        b.home_p, b.alt_p = b.alt_p, b.home_p
        b.home_views, b.alt_views = b.alt_views, b.home_views
        if b.states and b.alt_has_states:
            b.home_s, b.alt_s = b.alt_s, b.home_s
            b.home_state_views, b.alt_state_views = b.alt_state_views, b.home_state_views
            b.alt_s_bytes = b.s_bytes
        b.speculated = False
        if b.slot is None or b.slot.occupant is not b:     # bound to the old home since its slot went
            self.bind_home(b)
            if b.states:
                self.bind_states(b, b.home_state_views)

    def release_alt(self, b: Block) -> None:
        for h in (b.alt_p, b.alt_s):
            if h is not None:
                h.release()
        b.alt_p = b.alt_s = None
        b.alt_s_bytes, b.alt_views, b.alt_state_views, b.speculated = 0, [], [], False

    def home_grads(self, b: Block) -> list[Any]:
        """Views of ``b``'s gradients accumulated at home (the block must have them)."""
        return self.views(b.home_g.ptr, b, b.home_g, "g")

    def drop_grads(self) -> None:
        """The open window's gradients are gone: no block has any at home."""
        for b in self.blocks:
            b.grads_home = False

    def release_grads(self, b: Block) -> None:
        b.grads_home = False
        if b.home_g is not None:
            b.home_g.release()
            b.home_g = None

    def begin(self, started: Any) -> None:
        self.reset()                  # what an evaluation left (NOTE [evaluation between steps])
        self.in_backward = False
        self.begun = started
        self.written = []
        self.moved = {"h2d": 0, "d2h": 0}

    def end(self) -> None:
        """The step's write-backs come before anything queued after it; then every streamed
        parameter is bound to its home (NOTE [training transport])."""
        be = self.tier.backend
        for b in self.written:
            self.meter.wait(be.current_stream(), b.home_ready)
        self.in_backward = False
        self.unbind_all()

    def idle(self) -> None:
        """A failed step: no block is using its slot."""
        for b in self.blocks:
            if b.slot is not None:
                b.slot.busy = False

    def count(self, direction: str, role: Role, n: int) -> None:
        self.moved[direction] += n
        self.tier.accounting.on_move(role, direction, n)

    def release(self) -> None:
        """Forget the slots (their memory is torch's, freed with the last reference)."""
        self.slots, self.slot_mem, self._views_of = [], None, {}
