"""Module-level adoption: a whole nn.Module in tiered memory, run within a device budget.

    handle = tier.wrap_module(model, budget="25%")   # 25% of the model's weights stay resident
    logits = model(ids)                                # no change inside the model
    print(handle.plan)

NOTE [streaming plan]
    Every module that owns parameters or buffers becomes one group: its tensors are adjacent
    slices of one managed allocation, so a group moves in one CUDA call at link rate. The plan
    keeps the largest groups resident for good, as many as fit in the budget after leaving a
    streaming window; the other groups stream: before a module runs, the next streamed groups in
    execution order are prefetched on a side stream into the window; after it runs, its streamed
    groups are evicted. Pinning the largest groups leaves the smallest to stream, so the window
    (the largest ``lookahead`` streamed groups together) is small and the pinned share large.

    Frozen weights are read-mostly with the host as preferred location: a prefetch makes a
    device copy and the host copy stays valid, so eviction moves nothing (bench/bandwidth.py).
    Collapsing those copies is a slow host-side driver call (~25 ms/GiB), so evictions run on a
    worker thread once the module's kernels are done, while the main thread keeps queuing work.

    Streaming moves each streamed byte once per forward. For a forward of very few tokens (batch-1
    decode) each weight is read once anyway, so the streamed groups are instead read in place,
    zero-copy, over the link (~51 GB/s for a kernel reading host pages); that needs their
    read-mostly advice off, since a read of a read-mostly range makes a device copy.

    The execution order is learned on the first forward (and again whenever a forward runs the
    modules in another order); until then groups come in on demand.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ._errors import TierMemError
from ._limits import parse_bytes
from .roles import Evict, Location, Role

if TYPE_CHECKING:
    from ._tensor import TieredTensor
    from ._tier import Tier

__all__ = ["Plan", "plan_residency", "TieredModule", "wrap_module", "module_groups"]

log = logging.getLogger("tiermem")

LINK_GBPS = 55.0  # pinned H2D on the H100 machine (docs/facts.md); plans quote time at this rate


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which groups stay resident within ``budget`` bytes and which stream (NOTE [streaming plan])."""

    budget: int
    total: int
    sizes: tuple[tuple[str, int], ...]     # (group, bytes) in module order
    pinned: frozenset[str]
    window: int                            # device bytes kept for streamed groups in flight
    zero_copy_only: bool                   # the budget cannot hold even the window: read in place
    lookahead: int = 1                     # streamed groups in flight (slots in the window)

    @property
    def pinned_bytes(self) -> int:
        return sum(n for g, n in self.sizes if g in self.pinned)

    @property
    def streamed_bytes(self) -> int:
        return self.total - self.pinned_bytes

    def predicted_seconds(self, link_GBps: float = LINK_GBPS) -> float:
        """Lower bound of one forward's transfer time: streamed bytes over the link rate."""
        return self.streamed_bytes / (link_GBps * 1e9)

    def table(self, link_GBps: float = LINK_GBPS, limit: int = 12) -> str:
        gb = lambda n: f"{n / 1e9:8.3f} GB"  # noqa: E731
        how = ("(read in place, zero-copy)" if self.zero_copy_only else
               f"through a {gb(self.window).strip()} window of {self.lookahead} slot(s)")
        lines = [f"budget {gb(self.budget)} of {gb(self.total)} weights: {len(self.pinned)} of {len(self.sizes)} groups "
                 f"resident ({gb(self.pinned_bytes)}), {gb(self.streamed_bytes)} streamed per forward {how}",
                 f"predicted transfer time per forward at {link_GBps:.1f} GB/s: {self.predicted_seconds(link_GBps) * 1e3:.1f} ms"]
        rows = [(g, n, "resident" if g in self.pinned else "streamed") for g, n in self.sizes]
        for g, n, what in rows[:limit]:
            lines.append(f"  {what:<9}{gb(n)}  {g}")
        if len(rows) > limit:
            rest = rows[limit:]
            lines.append(f"  ... {len(rest)} more groups: {sum(1 for r in rest if r[2] == 'resident')} resident, "
                         f"{sum(1 for r in rest if r[2] == 'streamed')} streamed")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def plan_residency(sizes: Iterable[tuple[str, int]], budget: int, lookahead: int = 2) -> Plan:
    """Choose the resident groups for ``budget`` bytes (NOTE [streaming plan]). Pure; no GPU.

    The window holds ``lookahead`` slots the size of the largest streamed group. For each k, the
    k largest groups are pinned, the window is sized for the rest, and smaller groups fill what
    budget is left; the k that pins the most bytes wins. If no window of ``lookahead`` slots fits,
    fewer slots are tried before nothing streams and every group is read in place.
    """
    sizes = tuple((str(g), int(n)) for g, n in sizes)
    if lookahead < 1:
        raise TierMemError(f"lookahead must be at least 1, got {lookahead}")
    total = sum(n for _, n in sizes)
    if budget >= total:
        return Plan(budget, total, sizes, frozenset(g for g, _ in sizes), 0, False, 0)
    order = sorted(sizes, key=lambda x: -x[1])
    for la in range(lookahead, 0, -1):
        best: tuple[int, list[str], int] | None = None
        for k in range(len(order)):
            head, rest = order[:k], order[k:]
            window = la * rest[0][1]
            room = budget - window - sum(n for _, n in head)
            if room < 0:
                continue
            pinned = [g for g, _ in head]
            got = sum(n for _, n in head)
            for g, n in rest[1:]:          # the largest streamed group sets the window: it stays out
                if n <= room:
                    pinned.append(g)
                    room -= n
                    got += n
            if best is None or got > best[0]:
                best = (got, pinned, window)
        if best is not None:
            return Plan(budget, total, sizes, frozenset(best[1]), best[2], False, la)
    # Not even one slot fits: nothing streams; every group is read in place.
    return Plan(budget, total, sizes, frozenset(), 0, True, 0)


MAX_GROUP = 160 << 20
LOOKAHEAD = 3            # groups in flight by default (the window's slots)


def module_groups(module: Any, max_group_bytes: int = MAX_GROUP) -> list[tuple[str, Any, list[tuple[str, Any]]]]:
    """(name, root module, [(tensor name, tensor)]) per group: a subtree whose tensors come to at
    most ``max_group_bytes`` is one group (one allocation, one CUDA call per move); a bigger one
    gives its own direct tensors a group and splits into its children. A tensor shared by several
    modules (tied weights) belongs to the first group that reaches it."""
    seen: set[int] = set()
    out: list[tuple[str, Any, list[tuple[str, Any]]]] = []

    def fresh(items: Any) -> list[tuple[str, Any]]:
        got = []
        for n, t in items:
            if t is not None and id(t) not in seen:
                got.append((n, t))
        return got

    def visit(m: Any, name: str) -> None:
        prefix = f"{name}." if name else ""
        sub = fresh(list(m.named_parameters(prefix=name, remove_duplicate=False)) +
                    list(m.named_buffers(prefix=name, remove_duplicate=False)))
        uniq = list({id(t): (n, t) for n, t in sub}.values())
        if not uniq:
            return
        children = list(m.named_children())
        if sum(_span(t) for _, t in uniq) <= max_group_bytes or not children:
            seen.update(id(t) for _, t in uniq)
            out.append((name or "<root>", m, uniq))
            return
        own = fresh([(prefix + n, t) for n, t in list(m._parameters.items()) + list(m._buffers.items())])
        if own:
            seen.update(id(t) for _, t in own)
            out.append((name or "<root>", m, own))
        for cname, child in children:
            visit(child, prefix + cname)

    visit(module, "")
    return out


@dataclasses.dataclass(eq=False)
class _Group:
    name: str
    tensors: list[Any]            # the module's torch tensors (parameters and buffers)
    nbytes: int
    pinned: bool = False
    tiered: list[Any] = dataclasses.field(default_factory=list)   # TieredTensors (pinned, and UM transport)
    offset: int = 0               # pinned transport: where it starts in the pinned home
    member_offsets: list[int] = dataclasses.field(default_factory=list)
    transfer: Any = None          # UM transport: a prefetch in flight
    evicting: bool = False        # UM transport: an eviction queued on the worker


class _UMTransport:
    """Streamed groups as read-mostly managed memory: prefetched ahead through Unified Memory,
    evicted by collapsing the read-mostly copies (free over the link, ~25 ms/GiB of driver time,
    which the driver serialises with the prefetches), read in place with read-mostly off."""

    def __init__(self, owner: TieredModule, groups: list[_Group], async_evict: bool):
        self.o = owner
        self.tier = owner.tier
        flat = [t for g in groups for t in g.tensors]
        tts = _wrap_group(self.tier, flat, [f"{g.name}.{i}" for g in groups for i in range(len(g.tensors))],
                          on_host=True, policy=None)
        k = 0
        for g in groups:
            g.tiered = tts[k:k + len(g.tensors)]
            k += len(g.tensors)
        self.groups = groups
        self._cv = threading.Condition()
        self._in_window = 0
        self._read_mostly = True
        self._q: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._evict_worker, name="tiermem-evict", daemon=True) if async_evict else None
        if self._worker is not None:
            self._worker.start()

    def _resident(self, g: _Group) -> bool:
        return all(t.is_resident for t in g.tiered)

    def ensure(self, g: _Group) -> None:
        if g.transfer is not None:
            g.transfer.wait()       # the current stream waits on the device; the host goes on
            g.transfer = None
            return
        if self._resident(g) and not g.evicting:
            return
        with self._cv:
            while g.evicting or (self._in_window > 0 and self._in_window + g.nbytes > self.o.plan.window):
                self._cv.wait()
            self._in_window += g.nbytes
        self.tier.prefetch(g.tiered)

    def ahead(self, upcoming: list[_Group]) -> None:
        batch = []
        for g in upcoming:
            if g.transfer is not None or g.evicting or self._resident(g):
                continue
            with self._cv:
                if self._in_window + g.nbytes > self.o.plan.window:
                    break
                self._in_window += g.nbytes
            batch.append(g)
        if batch:   # adjacent in one allocation: the moves coalesce into few large calls
            tr = self.tier.prefetch([t for g in batch for t in g.tiered], non_blocking=True)
            for g in batch:
                g.transfer = tr

    def release(self, g: _Group) -> None:
        if g.evicting:
            return
        be = self.tier.backend
        done = be.new_event()
        be.record(done, be.current_stream())   # after the module's kernels
        g.evicting = True
        if self._worker is not None:
            self._q.put((g, done))
        else:
            self._evict_now(g, done)

    def _evict_now(self, g: _Group, done: Any) -> None:
        try:
            self.tier.backend.synchronize(done)
            self.tier.evict(g.tiered)
        finally:
            with self._cv:
                g.evicting = False
                self._in_window = max(0, self._in_window - g.nbytes)
                self._cv.notify_all()

    def _evict_worker(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            try:
                self._evict_now(*item)
            except Exception:  # a worker must not die silently: log and keep serving
                log.exception("tiermem: eviction failed")

    def drain(self) -> None:
        with self._cv:
            while any(g.evicting for g in self.groups):
                self._cv.wait()
        for g in self.groups:
            if g.transfer is not None:
                g.transfer.synchronize()
                g.transfer = None

    def set_mode(self, mode: str) -> None:
        want_rm = mode == "stream"
        if want_rm == self._read_mostly:
            return
        self.drain()
        streamed = [t for g in self.groups for t in g.tiered]
        self.tier.evict(streamed)
        with self._cv:
            self._in_window = 0
        for t in streamed:
            if t.role is Role.FROZEN_WEIGHT:
                t.advise(read_mostly=want_rm)
        self._read_mostly = want_rm

    def close(self) -> None:
        if self._worker is not None:
            self._q.put(None)
            self._worker.join()
            self._worker = None
        self.drain()
        for g in self.groups:
            for t in g.tiered:
                self.tier.unwrap(t)


class _PinnedTransport:
    """Streamed read-only groups in one pinned host buffer (their home, in execution order) and
    ``lookahead`` device slots the size of the largest: the next groups are copied into free slots
    on tiermem's H2D stream while the current one runs, at the full link rate, with no driver page
    work (NOTE [streaming plan]). Outside a slot, a group's tensors point at their home, which the
    GPU reads in place (zero-copy), so decode and unplanned reads need no move at all."""

    ALIGN = 256

    def __init__(self, owner: TieredModule, groups: list[_Group], lookahead: int):
        self.o = owner
        self.tier = tier = owner.tier
        be = tier.backend
        off = 0
        for g in groups:
            g.offset = off
            g.member_offsets = []
            n = 0
            for t in g.tensors:
                g.member_offsets.append(n)
                n += -(-max(t.numel() * t.element_size(), 1) // self.ALIGN) * self.ALIGN
            g.nbytes = n
            off += n
        self.groups = groups
        self.home = be.host_alloc(max(off, 1))
        self.slot_bytes = max(g.nbytes for g in groups)
        # A plan with no room for the window never streams: everything is read in place.
        self.nslots = 0 if owner.plan.zero_copy_only else owner.plan.lookahead
        self.window = be.device_alloc(self.slot_bytes * self.nslots) if self.nslots else None
        if self.nslots:
            tier._reserve(self.slot_bytes * self.nslots, Role.FROZEN_WEIGHT)
        self.origin: dict[int, Any] = {}
        import torch
        with torch.no_grad():
            for g in groups:
                for t in g.tensors:
                    self.origin[id(t)] = t.device
                home = self._views(g, None)
                for t, v in zip(g.tensors, home):
                    v.copy_(t)            # the GPU writes pinned pages straight over the link
                for t, v in zip(g.tensors, home):
                    t.data = v
        self.occupant: list[_Group | None] = [None] * self.nslots
        self.ready: list[Any] = [None] * self.nslots
        self.freed: list[Any] = [None] * self.nslots
        self.slot_of: dict[int, int] = {}
        self.count = 0                 # streamed group uses so far: use c runs in slot c % nslots

    def _views(self, g: _Group, slot: int | None) -> list[Any]:
        be = self.tier.backend
        base = self.home.ptr + g.offset if slot is None else self.window.ptr + slot * self.slot_bytes
        out = []
        for t, o in zip(g.tensors, g.member_offsets):
            n = t.numel() * t.element_size()
            raw = be.torch_view(base + o, n, self.home if slot is None else self.window)
            out.append(raw.view(t.dtype).view(t.shape))
        return out

    def _load(self, g: _Group, slot: int) -> None:
        from ._transfer import Transfer
        tier, be = self.tier, self.tier.backend
        side = tier._side("h2d")
        if self.freed[slot] is not None:
            be.wait(side, self.freed[slot])          # the slot's last user has finished with it
        else:
            dep = be.new_event()
            be.record(dep, be.current_stream())
            be.wait(side, dep)
        start, end = be.new_event(timing=True), be.new_event(timing=True)
        be.record(start, side)
        be.copy(self.window.ptr + slot * self.slot_bytes, self.home.ptr + g.offset, g.nbytes, side)
        be.record(end, side)
        with tier._lock:
            tier._inflight.append(Transfer(tier, "h2d", side, start, end, [], g.nbytes, {Role.FROZEN_WEIGHT: g.nbytes}))
        tier.accounting.on_move(Role.FROZEN_WEIGHT, "h2d", g.nbytes)
        tier.accounting.count(Role.FROZEN_WEIGHT, "prefetch_ops")
        self.ready[slot] = end
        if self.occupant[slot] is not None:
            self.slot_of.pop(id(self.occupant[slot]), None)
        self.occupant[slot] = g
        self.slot_of[id(g)] = slot

    def ensure(self, g: _Group) -> None:
        slot = self.count % self.nslots
        self.count += 1
        if self.slot_of.get(id(g)) != slot:
            self._load(g, slot)                      # not brought in ahead: bring it in now
        be = self.tier.backend
        be.wait(be.current_stream(), self.ready[slot])
        for t, v in zip(g.tensors, self._views(g, slot)):
            t.data = v

    def ahead(self, upcoming: list[_Group]) -> None:
        for d, g in enumerate(upcoming[: self.nslots - 1], start=0):
            slot = (self.count + d) % self.nslots
            if self.occupant[slot] is g and self.slot_of.get(id(g)) == slot:
                continue
            self._load(g, slot)

    def release(self, g: _Group) -> None:
        slot = self.slot_of.get(id(g))
        if slot is None:
            return
        be = self.tier.backend
        ev = be.new_event()
        be.record(ev, be.current_stream())
        self.freed[slot] = ev
        for t, v in zip(g.tensors, self._views(g, None)):
            t.data = v                               # back to its home: correct to read, zero-copy
        self.tier.accounting.count(Role.FROZEN_WEIGHT, "evict_ops")
        self.tier.accounting.count(Role.FROZEN_WEIGHT, "evict_clean_ops")

    def drain(self) -> None:
        self.tier.synchronize()

    def set_mode(self, mode: str) -> None:
        pass   # the tensors point at their pinned home between uses: zero-copy needs no change

    def close(self) -> None:
        import torch
        self.tier.synchronize()
        with torch.no_grad():
            for g in self.groups:
                for t, v in zip(g.tensors, self._views(g, None)):
                    plain = torch.empty(t.shape, dtype=t.dtype, device=self.origin[id(t)])
                    plain.copy_(v)
                    t.data = plain
        torch.cuda.synchronize() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        if self.window is not None:
            self.tier._unreserve(self.slot_bytes * self.nslots, Role.FROZEN_WEIGHT)
            self.window.release()
        self.home.release()


class TieredModule:
    """Handle of a module adopted by :func:`wrap_module`: its plan, its mode, and unwrap()."""

    def __init__(self, tier: Tier, module: Any, budget: int | str | None, *, mode: str = "auto",
                 transport: str = "auto", lookahead: int = LOOKAHEAD, zero_copy_max_tokens: int = 16,
                 async_evict: bool = True, max_group_bytes: int = MAX_GROUP):
        if mode not in ("auto", "stream", "zero_copy"):
            raise TierMemError(f"mode must be 'auto', 'stream' or 'zero_copy', got {mode!r}")
        if transport not in ("auto", "pinned", "um"):
            raise TierMemError(f"transport must be 'auto', 'pinned' or 'um', got {transport!r}")
        if getattr(module, "_tiermem_handle", None) is not None:
            raise TierMemError("this module is already adopted by tiermem; unwrap it first")
        self.tier = tier
        self.module = module
        self.mode = mode
        self.zero_copy_max_tokens = zero_copy_max_tokens
        found = module_groups(module, max_group_bytes)
        if not found:
            raise TierMemError("this module has no parameters or buffers to tier")
        for _, _, own in found:
            for _, t in own:
                from ._torch import _check
                _check(tier, t)
        sizes = [(mname, sum(_span(t) for _, t in own)) for mname, _, own in found]
        total = sum(n for _, n in sizes)
        self.budget = total if budget is None else parse_bytes(budget, total=total, what="module budget")
        self.plan = plan_residency(sizes, self.budget, lookahead)
        self.lookahead = max(self.plan.lookahead, 1)
        self._old_budget = tier.budget
        tier.set_budget(self.budget)       # before any fill: adoption itself stays within budget
        self._groups = {mname: _Group(mname, [t for _, t in own], n, pinned=mname in self.plan.pinned)
                        for (mname, _, own), (_, n) in zip(found, sizes)}
        self._unit_groups: dict[int, list[_Group]] = {id(m): [self._groups[mname]] for mname, m, _ in found}
        pinned = [g for g in self._groups.values() if g.pinned]
        streamed = [g for g in self._groups.values() if not g.pinned]
        if pinned:
            flat = [t for g in pinned for t in g.tensors]
            role = Role.WEIGHT if any(t.requires_grad for t in flat) else Role.FROZEN_WEIGHT
            tts = _wrap_group(tier, flat, [f"{g.name}.{i}" for g in pinned for i in range(len(g.tensors))],
                              on_host=False, policy=tier.policies[role].replace(evict=Evict.NEVER))
            k = 0
            for g in pinned:
                g.tiered = tts[k:k + len(g.tensors)]
                k += len(g.tensors)
        frozen = not any(t.requires_grad for g in streamed for t in g.tensors)
        self.transport = ("pinned" if frozen else "um") if transport == "auto" else transport
        if self.transport == "pinned" and not frozen:
            raise TierMemError("the pinned transport streams read-only weights; some require grad (use transport='um')")
        if self.transport == "um" and (mode == "zero_copy" or self.plan.zero_copy_only):
            # Measured on the H100: kernels reading host-preferred, accessed-by managed pages got
            # them migrated to the device (a later read ran at 446 GB/s), so the budget would not
            # hold. Pinned host memory cannot migrate.
            raise TierMemError("zero-copy reads need transport='pinned': the driver migrates managed pages "
                               "that kernels read in place, so the budget would not hold")
        self._stream: Any = None
        if streamed:
            self._stream = (_PinnedTransport(self, streamed, self.lookahead) if self.transport == "pinned"
                            else _UMTransport(self, streamed, async_evict))
        # A module that uses a tensor of a group outside its own subtree (tied weights) needs that
        # group too: it gets hooks of its own.
        owner = {id(t): g for g in self._groups.values() for t in g.tensors}
        inside: dict[int, _Group] = {}
        for mname, m, _ in found:
            for sub in m.modules():
                inside.setdefault(id(sub), self._groups[mname])
        for m in module.modules():
            for t in list(m._parameters.values()) + list(m._buffers.values()):
                g = owner.get(id(t)) if t is not None else None
                if g is not None and inside.get(id(m)) is not g:
                    gs = self._unit_groups.setdefault(id(m), [])
                    if g not in gs:
                        gs.append(g)
        pinned_tts = [t for g in pinned for t in g.tiered]
        if pinned_tts:
            tier.prefetch(pinned_tts).synchronize()
        self._trace: list[int] = []
        self._recording = True
        self._pos = -1
        self._fwd_mode = "stream"
        self._units = [m for m in module.modules() if id(m) in self._unit_groups]
        self._hooks = [module.register_forward_pre_hook(self._root_pre, with_kwargs=True),
                       module.register_forward_hook(self._root_post)]
        for i, m in enumerate(self._units):
            self._hooks.append(m.register_forward_pre_hook(lambda mod, args, i=i: self._pre(i)))
            self._hooks.append(m.register_forward_hook(lambda mod, args, out, i=i: self._post(i)))
        module._tiermem_handle = weakref.ref(self)

    # -- forward hooks ------------------------------------------------------------------------------
    def _tokens(self, args: tuple, kwargs: dict) -> int | None:
        vals = list(args) + list(kwargs.values())
        for a in vals:
            if hasattr(a, "dtype") and hasattr(a, "shape") and not a.dtype.is_floating_point and a.dim() >= 1:
                return int(a.numel())
        for a in vals:
            if hasattr(a, "shape") and a.dim() >= 2:
                return int(a.shape[:-1].numel())
        return None

    def _root_pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        mode = self.mode
        if mode == "auto":
            n = self._tokens(args, kwargs)
            few = n is not None and n <= self.zero_copy_max_tokens
            mode = "zero_copy" if few and self.transport == "pinned" else "stream"
        if self.plan.zero_copy_only:
            mode = "zero_copy"
        if self._stream is not None and mode != self._fwd_mode:
            self._stream.set_mode(mode)
        self._fwd_mode = mode
        self._pos = -1

    def _root_post(self, module: Any, args: tuple, out: Any) -> None:
        if self._recording and self._trace:
            self._recording = False
        if self._fwd_mode == "stream" and not self._recording and self._stream is not None:
            self._pos = -1
            self._stream.ahead(self._upcoming())   # the first streamed groups of the next forward

    def _upcoming(self) -> list[_Group]:
        out: list[_Group] = []
        for j in range(self._pos + 1, len(self._trace)):
            for g in self._unit_groups[id(self._units[self._trace[j]])]:
                if not g.pinned:
                    out.append(g)
            if len(out) >= self.lookahead:
                break
        return out[: self.lookahead]

    def _pre(self, i: int) -> None:
        if self._recording:
            self._trace.append(i)
        else:
            self._pos += 1
            if self._pos >= len(self._trace) or self._trace[self._pos] != i:
                # Another order than the one learned: learn it again on the next forward.
                self._recording, self._trace = True, []
        for g in self._unit_groups[id(self._units[i])]:
            if g.pinned:
                if not all(t.is_resident for t in g.tiered):
                    self.tier.prefetch(g.tiered)
            elif self._fwd_mode == "stream":
                self._stream.ensure(g)
        if self._fwd_mode == "stream" and not self._recording and self._stream is not None:
            self._stream.ahead(self._upcoming())

    def _post(self, i: int) -> None:
        if self._fwd_mode != "stream":
            return
        for g in self._unit_groups[id(self._units[i])]:
            if not g.pinned:
                self._stream.release(g)

    # -- lifecycle ------------------------------------------------------------------------------------
    def drain(self) -> None:
        """Wait until every move this module queued is done."""
        if self._stream is not None:
            self._stream.drain()
        self.tier.synchronize()

    @property
    def groups(self) -> dict[str, list[Any]]:
        """Group name -> its tensors (TieredTensors where tiermem holds them in managed memory)."""
        return {g.name: list(g.tiered or g.tensors) for g in self._groups.values()}

    def unwrap(self) -> Any:
        """Remove the hooks and give every tensor plain memory on its original device again."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self.tier.synchronize()
        for g in self._groups.values():
            if g.pinned:
                for t in g.tiered:
                    self.tier.unwrap(t)
        self._groups.clear()
        self.tier.set_budget(self._old_budget)
        self.module._tiermem_handle = None
        return self.module

    def __repr__(self) -> str:
        return f"<TieredModule {type(self.module).__name__} ({self.transport}): {self.plan.table(limit=0)}>"


def _span_bytes(nbytes: int) -> int:
    """Device bytes a tensor of ``nbytes`` takes as a group member (see member_span)."""
    from ._tier import member_span
    return member_span(nbytes)[0]


def _span(t: Any) -> int:
    return _span_bytes(t.numel() * t.element_size())


def _wrap_group(tier: Tier, tensors: list[Any], names: list[str], on_host: bool, policy: Any) -> list[TieredTensor]:
    from ._torch import wrap_group
    return wrap_group(tier, tensors, Role.WEIGHT, names=names, on_host=on_host, policy=policy)


def wrap_module(tier: Tier, module: Any, budget: int | str | None = None, **kwargs: Any) -> TieredModule:
    """Adopt every parameter and buffer of ``module``; see :class:`TieredModule` and NOTE
    [streaming plan]. ``budget`` is bytes, or a share of the module's weights like "25%"."""
    return TieredModule(tier, module, budget, **kwargs)
