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

LINK_GBPS = 55.0  # pinned H2D on the H100 machine (shared/FACTS.md); plans quote time at this rate


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which groups stay resident within ``budget`` bytes and which stream (NOTE [streaming plan])."""

    budget: int
    total: int
    sizes: tuple[tuple[str, int], ...]     # (group, bytes) in module order
    pinned: frozenset[str]
    window: int                            # device bytes kept for streamed groups in flight
    zero_copy_only: bool                   # the budget cannot hold even the window: read in place

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
        lines = [f"budget {gb(self.budget)} of {gb(self.total)} weights: {len(self.pinned)} of {len(self.sizes)} groups "
                 f"resident ({gb(self.pinned_bytes)}), {gb(self.streamed_bytes)} streamed per forward "
                 f"{'(read in place, zero-copy)' if self.zero_copy_only else f'through a {gb(self.window).strip()} window'}",
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
    """Choose the resident groups for ``budget`` bytes (NOTE [streaming plan]). Pure; no GPU."""
    sizes = tuple((str(g), int(n)) for g, n in sizes)
    if lookahead < 1:
        raise TierMemError(f"lookahead must be at least 1, got {lookahead}")
    total = sum(n for _, n in sizes)
    if budget >= total:
        return Plan(budget, total, sizes, frozenset(g for g, _ in sizes), 0, False)
    order = sorted(sizes, key=lambda x: -x[1])
    pinned: list[str] = []
    pinned_bytes = 0
    rest = list(order)
    while rest:
        g, n = rest[0]
        window_after = sum(m for _, m in rest[1:1 + lookahead])
        if pinned_bytes + n + window_after > budget:
            break
        pinned.append(g)
        pinned_bytes += n
        rest.pop(0)
    window = sum(m for _, m in rest[:lookahead])
    if pinned_bytes + window > budget:
        # Not even the window fits: stream nothing; read every non-resident group in place.
        window = 0
        if not pinned and rest and rest[0][1] > budget:
            return Plan(budget, total, sizes, frozenset(), 0, True)
    return Plan(budget, total, sizes, frozenset(pinned), window, window == 0)


MAX_GROUP = 512 << 20   # a decoder layer of a 7B model (~400 MB) moves as one group


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
    tensors: list[TieredTensor]
    nbytes: int
    pinned: bool = False
    transfer: Any = None          # a prefetch in flight
    evicting: bool = False        # an eviction queued on the worker


class TieredModule:
    """Handle of a module adopted by :func:`wrap_module`: its plan, its mode, and unwrap()."""

    def __init__(self, tier: Tier, module: Any, budget: int | str | None, *, mode: str = "auto",
                 lookahead: int = 2, zero_copy_max_tokens: int = 16, async_evict: bool = True,
                 max_group_bytes: int = MAX_GROUP):
        import torch
        if mode not in ("auto", "stream", "zero_copy"):
            raise TierMemError(f"mode must be 'auto', 'stream' or 'zero_copy', got {mode!r}")
        if getattr(module, "_tiermem_handle", None) is not None:
            raise TierMemError("this module is already adopted by tiermem; unwrap it first")
        self.tier = tier
        self.module = module
        self.mode = mode
        self.lookahead = lookahead
        self.zero_copy_max_tokens = zero_copy_max_tokens
        found = module_groups(module, max_group_bytes)
        if not found:
            raise TierMemError("this module has no parameters or buffers to tier")
        sizes = []
        for mname, _, own in found:
            sizes.append((mname, sum(_span(t) for _, t in own)))
        total = sum(n for _, n in sizes)
        self.budget = total if budget is None else parse_bytes(budget, total=total, what="module budget")
        self.plan = plan_residency(sizes, self.budget, lookahead)
        self._old_budget = tier.budget
        tier.set_budget(self.budget)       # before any fill: adoption itself stays within budget
        self._groups: dict[str, _Group] = {}
        self._unit_groups: dict[int, list[_Group]] = {}
        # Streamed groups share one allocation, in module order (which is execution order for
        # most models), so consecutive groups move in one coalesced call; pinned ones share another.
        role = Role.WEIGHT
        for pinned in (True, False):
            part = [(mname, m, own) for mname, m, own in found if (mname in self.plan.pinned) == pinned]
            if not part:
                continue
            flat = [t for _, _, own in part for _, t in own]
            pol = None
            if pinned:
                base = tier.policies[Role.FROZEN_WEIGHT if not any(t.requires_grad for t in flat) else role]
                pol = base.replace(evict=Evict.NEVER)
            tts = _wrap_group(tier, flat, [n for _, _, own in part for n, _ in own], on_host=not pinned, policy=pol)
            k = 0
            for mname, m, own in part:
                mine = tts[k:k + len(own)]
                k += len(own)
                g = _Group(mname, mine, sum(tt._b.span for tt in mine), pinned=pinned)
                self._groups[mname] = g
                self._unit_groups[id(m)] = [g]
        # A module that uses a tensor of a group outside its own subtree (tied weights) needs that
        # group too: it gets hooks of its own.
        owner = {id(t._b): g for g in self._groups.values() for t in g.tensors}
        inside: dict[int, _Group] = {}
        for mname, m, _ in found:
            for sub in m.modules():
                inside.setdefault(id(sub), self._groups[mname])
        for m in module.modules():
            for t in list(m._parameters.values()) + list(m._buffers.values()):
                tt = getattr(t, "_tiermem", None) if t is not None else None
                g = owner.get(id(tt._b)) if tt is not None else None
                if g is not None and inside.get(id(m)) is not g:
                    gs = self._unit_groups.setdefault(id(m), [])
                    if g not in gs:
                        gs.append(g)
        pinned = [t for g in self._groups.values() if g.pinned for t in g.tensors]
        if pinned:
            tier.prefetch(pinned).synchronize()
        self._trace: list[int] = []
        self._recording = True
        self._pos = -1
        self._fwd_mode = "stream"
        self._read_mostly = True
        self._cv = threading.Condition()
        self._in_window = 0
        self._async = async_evict
        self._q: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._evict_worker, name="tiermem-evict", daemon=True) if async_evict else None
        if self._worker is not None:
            self._worker.start()
        self._units = [m for m in module.modules() if id(m) in self._unit_groups]
        self._hooks = [module.register_forward_pre_hook(self._root_pre, with_kwargs=True),
                       module.register_forward_hook(self._root_post)]
        for i, m in enumerate(self._units):
            self._hooks.append(m.register_forward_pre_hook(lambda mod, args, i=i: self._pre(i)))
            self._hooks.append(m.register_forward_hook(lambda mod, args, out, i=i: self._post(i)))
        module._tiermem_handle = weakref.ref(self)
        self._torch = torch

    # -- forward hooks ------------------------------------------------------------------------------
    def _tokens(self, args: tuple, kwargs: dict) -> int | None:
        for a in list(args) + list(kwargs.values()):
            if hasattr(a, "dtype") and hasattr(a, "shape") and not a.dtype.is_floating_point and a.dim() >= 1:
                return int(a.numel())
        for a in list(args) + list(kwargs.values()):
            if hasattr(a, "shape") and a.dim() >= 2:
                return int(a.shape[:-1].numel())
        return None

    def _root_pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        mode = self.mode
        if mode == "auto":
            n = self._tokens(args, kwargs)
            mode = "zero_copy" if n is not None and n <= self.zero_copy_max_tokens else "stream"
        if self.plan.zero_copy_only:
            mode = "zero_copy"
        self._set_forward_mode(mode)
        self._pos = -1

    def _root_post(self, module: Any, args: tuple, out: Any) -> None:
        if self._recording and self._trace:
            self._recording = False
        if self._fwd_mode == "stream" and not self._recording:
            self._pos = -1
            self._ahead()       # the first streamed groups of the next forward

    def _pre(self, i: int) -> None:
        if self._recording:
            self._trace.append(i)
        else:
            self._pos += 1
            if self._pos >= len(self._trace) or self._trace[self._pos] != i:
                # Another order than the one learned: learn it again on the next forward.
                self._recording, self._trace = True, []
        for g in self._unit_groups[id(self._units[i])]:
            self._ensure(g)
        if self._fwd_mode == "stream" and not self._recording:
            self._ahead()

    def _post(self, i: int) -> None:
        if self._fwd_mode != "stream":
            return
        for g in self._unit_groups[id(self._units[i])]:
            if not g.pinned and not g.evicting:
                self._evict(g)

    # -- moves ----------------------------------------------------------------------------------------
    def _resident(self, g: _Group) -> bool:
        return all(t.is_resident for t in g.tensors)

    def _ensure(self, g: _Group) -> None:
        if g.pinned:
            if not self._resident(g):
                self.tier.prefetch(g.tensors)
            return
        if self._fwd_mode == "zero_copy":
            return
        if g.transfer is not None:
            g.transfer.wait()       # the current stream waits on the device; the host goes on
            g.transfer = None
            return
        if self._resident(g) and not g.evicting:
            return
        self._wait_for(g)
        with self._cv:
            self._in_window += g.nbytes
        self.tier.prefetch(g.tensors)

    def _wait_for(self, g: _Group) -> None:
        """Block until ``g`` is not being evicted and the window has room for it."""
        with self._cv:
            while g.evicting or (self._in_window > 0 and self._in_window + g.nbytes > self.plan.window):
                self._cv.wait()

    def _ahead(self) -> None:
        """Prefetch the next streamed groups in execution order that fit in the window, in one call
        (they are adjacent in one allocation, so the moves coalesce into few large ranges)."""
        batch: list[_Group] = []
        seen = 0
        for j in range(self._pos + 1, len(self._trace)):
            for g in self._unit_groups[id(self._units[self._trace[j]])]:
                if g.pinned or g in batch:
                    continue
                seen += 1
                if seen > self.lookahead:
                    break
                if g.transfer is not None or g.evicting or self._resident(g):
                    continue
                with self._cv:
                    if self._in_window + g.nbytes > self.plan.window:
                        break
                    self._in_window += g.nbytes
                batch.append(g)
            else:
                continue
            break
        if batch:
            tr = self.tier.prefetch([t for g in batch for t in g.tensors], non_blocking=True)
            for g in batch:
                g.transfer = tr

    def _evict(self, g: _Group) -> None:
        be = self.tier.backend
        done = be.new_event()
        be.record(done, be.current_stream())   # after the module's kernels
        g.evicting = True
        if self._async:
            self._q.put((g, done))
        else:
            self._evict_now(g, done)

    def _evict_now(self, g: _Group, done: Any) -> None:
        try:
            self.tier.backend.synchronize(done)
            self.tier.evict(g.tensors)
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
            except Exception:  # a worker must not die silently: log, keep serving
                import logging
                logging.getLogger("tiermem").exception("tiermem: eviction failed")

    def drain(self) -> None:
        """Wait until every queued eviction and prefetch is done."""
        with self._cv:
            while any(g.evicting for g in self._groups.values()):
                self._cv.wait()
        for g in self._groups.values():
            if g.transfer is not None:
                g.transfer.synchronize()
                g.transfer = None

    # -- modes ----------------------------------------------------------------------------------------
    def _set_forward_mode(self, mode: str) -> None:
        """Switch between streaming and zero-copy reads (NOTE [streaming plan])."""
        self._fwd_mode = mode
        want_rm = mode == "stream"
        if want_rm == self._read_mostly:
            return
        self.drain()
        streamed = [t for g in self._groups.values() if not g.pinned for t in g.tensors]
        self.tier.evict(streamed)
        with self._cv:
            self._in_window = 0
        for t in streamed:
            if t.role is Role.FROZEN_WEIGHT:
                t.advise(read_mostly=want_rm)
        self._read_mostly = want_rm

    # -- lifecycle ------------------------------------------------------------------------------------
    @property
    def groups(self) -> dict[str, list[TieredTensor]]:
        return {g.name: list(g.tensors) for g in self._groups.values()}

    def unwrap(self) -> Any:
        """Remove the hooks and give every tensor plain memory on its original device again."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._worker is not None:
            self._q.put(None)
            self._worker.join()
            self._worker = None
        self.drain()
        self.tier.synchronize()
        for g in self._groups.values():
            for t in g.tensors:
                self.tier.unwrap(t)
        self._groups.clear()
        self.tier.set_budget(self._old_budget)
        self.module._tiermem_handle = None
        return self.module

    def __repr__(self) -> str:
        return f"<TieredModule {type(self.module).__name__}: {self.plan.table(limit=0)}>"


def _span_bytes(nbytes: int) -> int:
    """Device bytes a tensor of ``nbytes`` takes as a group member (64 KiB-aligned, Tier.empty_group)."""
    from ._tier import GROUP_ALIGN
    return -(-max(int(nbytes), 1) // GROUP_ALIGN) * GROUP_ALIGN


def _span(t: Any) -> int:
    return _span_bytes(t.numel() * t.element_size())


def _wrap_group(tier: Tier, tensors: list[Any], names: list[str], on_host: bool, policy: Any) -> list[TieredTensor]:
    from ._torch import wrap_group
    return wrap_group(tier, tensors, Role.WEIGHT, names=names, on_host=on_host, policy=policy)


def wrap_module(tier: Tier, module: Any, budget: int | str | None = None, **kwargs: Any) -> TieredModule:
    """Adopt every parameter and buffer of ``module``; see :class:`TieredModule` and NOTE
    [streaming plan]. ``budget`` is bytes, or a share of the module's weights like "25%"."""
    return TieredModule(tier, module, budget, **kwargs)
