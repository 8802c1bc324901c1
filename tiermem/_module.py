"""Module-level adoption: a whole nn.Module in tiered memory, run within a device budget.

    handle = tier.wrap_module(model, budget=weight_bytes(model) // 4)   # a quarter stays resident
    logits = model(ids)                                # no change inside the model
    print(handle.plan)

A module built on the meta device takes its bytes from ``weights=`` (NOTE [weight source]); with
``host_budget=`` what the pinned home cannot hold is read from disk (NOTE [disk tier], _disk.py).

NOTE [streaming plan]
    Every module that owns parameters or buffers becomes one group. The plan keeps the largest
    groups resident for good (adjacent slices of one managed allocation each, never evicted), as
    many as fit in the budget after leaving a streaming window; the other groups stream. Pinning
    the largest groups leaves the smallest to stream, so the window (the largest ``lookahead``
    streamed groups together) is small and the pinned share large.

    Streamed groups live in one pinned host buffer, their home, whatever their ``requires_grad``
    says: managed memory never holds more than the budget, so a model much bigger than the
    device's real free memory is adopted as long as host memory holds it. Before a module runs,
    the next streamed groups in execution order are copied from the home into device slots on
    tiermem's H2D stream (the full link rate, no driver page work); after it runs, its tensors
    point at their home again, which moves nothing.

    Streaming moves each streamed byte once per forward, at the link rate. Reading in place,
    zero-copy, moves only what kernels read, at ~51 GB/s (docs/facts.md), and batch-1 GEMV
    kernels reading host pages reached only 1.18-1.24x the link bound on five architectures
    (bench/results/offload_infer-*.json, first run of this design), so dense groups stream in
    every forward. Two kinds of group are read in place instead: groups that only embeddings use
    (a lookup reads the rows of its tokens; they take no slot and are pinned only with the budget
    left once the rest is planned), and, in a forward of few tokens (``zero_copy_max_tokens``,
    a decode step), groups of stacked expert weights, of which a decode reads only the experts
    its router picked. mode="zero_copy" reads every streamed group in place.

    The execution order is learned on the first forward (and again whenever a forward runs the
    modules in another order); until then groups come in on demand.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ._errors import CheckpointError, ConfigError, DeviceFullError, TierMemError, WrapError
from ._limits import parse_bytes
from ._disk import READERS, STAGES, DiskTier
from ._held import CopyGuard
from ._load import FileTensor, Reader, host_bytes
from ._stream import Lane, SlotRing, now
from .roles import Evict, Location, Policy, Role

if TYPE_CHECKING:
    from ._tensor import TieredTensor
    from ._engine import Engine as Tier   # what an adapter uses is the engine's interface

__all__ = ["Plan", "plan_residency", "plan_host", "stay_home", "TieredModule", "wrap_module", "module_groups",
           "weight_bytes"]

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
    in_place: frozenset[str] = frozenset()  # gathered from (embeddings): read in place, never streamed
    host_budget: int | None = None          # pinned bytes allowed (NOTE [disk tier]); None: no limit
    on_disk: frozenset[str] = frozenset()   # streamed groups read from their files ahead of use
    stage_bytes: int = 0                    # one staging buffer (the largest group on disk)
    stages: int = 0                         # staging buffers
    host_sizes: tuple[tuple[str, int], ...] = ()   # (streamed group, bytes in the pinned home's layout)

    @property
    def pinned_bytes(self) -> int:
        return sum(n for g, n in self.sizes if g in self.pinned)

    @property
    def streamed_bytes(self) -> int:
        """Bytes not resident: they live in pinned host memory."""
        return self.total - self.pinned_bytes

    @property
    def moved_bytes(self) -> int:
        """Bytes a forward moves over the link: the streamed groups, less those read in place
        (an embedding reads only the rows of its tokens)."""
        return sum(n for g, n in self.sizes if g not in self.pinned and g not in self.in_place)

    @property
    def disk_bytes(self) -> int:
        """Bytes a forward reads from disk: the groups on disk (NOTE [disk tier])."""
        return sum(n for g, n in self.sizes if g in self.on_disk)

    @property
    def home_bytes(self) -> int:
        """Pinned bytes of the home: the streamed groups not on disk, in the home's layout."""
        return sum(n for g, n in self.host_sizes if g not in self.on_disk)

    @property
    def pinned_host_bytes(self) -> int:
        """Pinned host memory the plan takes: the home and the staging buffers."""
        return self.home_bytes + self.stages * self.stage_bytes

    def predicted_seconds(self, link_GBps: float = LINK_GBPS, disk_GBps: float | None = None) -> float:
        """Lower bound of one forward's transfer time: the bytes streamed from the pinned home
        over the link rate, plus the bytes on disk over the disk rate. The two are added: the
        drive and the link are taken not to overlap, which is what the disk's reads allow once
        the drive is the slower (NOTE [disk tier]); a group on disk crosses the link too, but
        while the drive reads the next one."""
        host = (self.moved_bytes - self.disk_bytes) / (link_GBps * 1e9)
        if not self.disk_bytes:
            return host
        if not disk_GBps:
            raise TierMemError("this plan reads from disk: give the disk's read rate (disk_GBps)")
        return host + self.disk_bytes / (disk_GBps * 1e9)

    def table(self, link_GBps: float = LINK_GBPS, limit: int = 12) -> str:
        gb = lambda n: f"{n / 1e9:8.3f} GB"  # noqa: E731
        how = ("(read in place, zero-copy)" if self.zero_copy_only else
               f"through a {gb(self.window).strip()} window of {self.lookahead} slot(s)")
        here = self.streamed_bytes - self.moved_bytes
        lines = [f"budget {gb(self.budget)} of {gb(self.total)} weights: {len(self.pinned)} of {len(self.sizes)} groups "
                 f"resident ({gb(self.pinned_bytes)}), {gb(self.moved_bytes)} streamed per forward {how}"
                 + (f", {gb(here).strip()} read in place (embeddings)" if here else "")]
        if self.on_disk:
            lines.append(f"host budget {gb(self.host_budget or 0).strip()}: {gb(self.home_bytes).strip()} in the pinned home, "
                         f"{gb(self.disk_bytes).strip()} in {len(self.on_disk)} groups read from disk through "
                         f"{self.stages} staging buffers of {gb(self.stage_bytes).strip()}")
        else:
            lines.append(f"predicted transfer time per forward at {link_GBps:.1f} GB/s: "
                         f"{self.predicted_seconds(link_GBps) * 1e3:.1f} ms")
        rows = [(g, n, "resident" if g in self.pinned else "in place" if g in self.in_place else
                 "disk" if g in self.on_disk else "streamed") for g, n in self.sizes]
        for g, n, what in rows[:limit]:
            lines.append(f"  {what:<9}{gb(n)}  {g}")
        if len(rows) > limit:
            rest = rows[limit:]
            lines.append(f"  ... {len(rest)} more groups: {sum(1 for r in rest if r[2] == 'resident')} resident, "
                         f"{sum(1 for r in rest if r[2] == 'streamed')} streamed"
                         + (f", {sum(1 for r in rest if r[2] == 'disk')} on disk" if self.on_disk else ""))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def plan_residency(sizes: Iterable[tuple[str, int]], budget: int, lookahead: int = 2,
                   in_place: Iterable[str] = ()) -> Plan:
    """Choose the resident groups for ``budget`` bytes (NOTE [streaming plan]). Pure; no GPU.

    The window holds ``lookahead`` slots the size of the largest streamed group. For each k, the
    k largest groups are pinned, the window is sized for the rest, and smaller groups fill what
    budget is left; the k that pins the most bytes wins. If no window of ``lookahead`` slots fits,
    fewer slots are tried before nothing streams and every group is read in place. Groups named
    in ``in_place`` (gathered from, like an embedding) need no slot: they are pinned last, with
    the budget left over.
    """
    sizes = tuple((str(g), int(n)) for g, n in sizes)
    gathered = frozenset(in_place)
    if lookahead < 1:
        raise ConfigError(f"lookahead must be at least 1, got {lookahead}")
    total = sum(n for _, n in sizes)
    if budget >= total:
        return Plan(budget, total, sizes, frozenset(g for g, _ in sizes), 0, False, 0, gathered)
    moving = [x for x in sizes if x[0] not in gathered]
    plan = _plan_moving(sizes, moving, budget, lookahead, total)
    room = budget - plan.pinned_bytes - plan.window
    extra = []
    for g, n in sorted((x for x in sizes if x[0] in gathered), key=lambda x: -x[1]):
        if n <= room:
            extra.append(g)
            room -= n
    return dataclasses.replace(plan, pinned=plan.pinned | frozenset(extra), in_place=gathered)


def _plan_moving(sizes: tuple, moving: list[tuple[str, int]], budget: int, lookahead: int, total: int) -> Plan:
    if not moving:
        return Plan(budget, total, sizes, frozenset(), 0, False, 0)
    if budget >= sum(n for _, n in moving):
        return Plan(budget, total, sizes, frozenset(g for g, _ in moving), 0, False, 0)
    order = sorted(moving, key=lambda x: -x[1])
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


def plan_host(plan: Plan, host_sizes: Iterable[tuple[str, int]], host_budget: int | None, stages: int = 3,
              keep: Iterable[str] = ()) -> Plan:
    """Split ``plan``'s streamed groups between the pinned home and the disk within ``host_budget``
    pinned bytes (NOTE [disk tier]). Pure; no GPU. ``host_sizes`` gives each streamed group's bytes
    in the home's layout, in execution order; groups in ``keep`` (and those read in place) must
    stay in the home. The rest are kept in the home spread evenly along the order, so that reads
    from disk alternate with copies from the home, as far as the budget left after ``stages``
    staging buffers (each the size of the largest group that may go to disk) allows.
    Raises :class:`OutOfBudgetError` when even that cannot fit."""
    from ._errors import HostBudgetError
    streamed = [(str(g), int(n)) for g, n in host_sizes if g not in plan.pinned]
    total = sum(n for _, n in streamed)
    plan = dataclasses.replace(plan, host_budget=host_budget, host_sizes=tuple(streamed))
    if host_budget is None or total <= host_budget:
        return plan
    fixed = set(keep) | set(plan.in_place)
    movable = [(g, n) for g, n in streamed if g not in fixed]
    kept = sum(n for g, n in streamed if g in fixed)
    stage = max((n for _, n in movable), default=0)
    # A pinned block may take up to a page more than asked (the driver pins whole pages).
    room = host_budget - stages * stage - kept - (stages + 1) * 4096
    if plan.zero_copy_only:
        raise TierMemError(f"{total:,} streamed bytes do not fit host_budget={host_budget:,}, and groups on disk "
                           "must stream through a window the device budget has no room for; raise the budget")
    if not movable or room < 0:
        raise HostBudgetError(kept + stages * stage, 0, host_budget,
                               hint=f"host_budget is too small for a disk tier: the groups that must stay in pinned "
                               f"memory take {kept:,} bytes and {stages} staging buffers {stages * stage:,}")
    share = room / max(1, sum(n for _, n in movable))
    home, got, seen = set(), 0, 0
    for g, n in movable:                  # evenly along the order: disk reads and home copies alternate
        seen += n
        if got + n <= min(room, share * seen + 1):
            home.add(g)
            got += n
    for g, n in sorted(movable, key=lambda x: -x[1]):   # what room is left, largest first
        if g not in home and got + n <= room:
            home.add(g)
            got += n
    disk = frozenset(g for g, _ in movable if g not in home)
    stage = max((n for g, n in movable if g in disk), default=0)
    return dataclasses.replace(plan, on_disk=disk, stage_bytes=stage, stages=stages if disk else 0)


def stay_home(groups: Iterable[tuple[str, list[Any]]], in_files: Callable[[Any], bool]) -> set[str]:
    """The groups that cannot go to disk (NOTE [disk tier]): those with a buffer (a forward may
    write it), and those with a tensor ``in_files`` says is not in a file byte for byte."""
    import torch
    return {name for name, ts in groups if any(not isinstance(t, torch.nn.Parameter) or not in_files(t) for t in ts)}


MAX_GROUP = 160 << 20
LOOKAHEAD = 3            # groups in flight by default (the window's slots)


def module_groups(module: Any, max_group_bytes: int = MAX_GROUP) -> list[tuple[str, Any, list[tuple[str, Any]]]]:
    """(name, root module, [(tensor name, tensor)]) per group: a subtree whose tensors come to at
    most ``max_group_bytes`` is one group (one allocation, one CUDA call per move); a bigger one
    gives its own direct tensors a group and splits into its children. A tensor shared by several
    modules (tied weights) belongs to the first group that reaches it."""
    # One walk in named_modules' order (pre-order, shared modules at each place): a subtree is
    # then a run of it, and its tensors in named_parameters' then named_buffers' order are
    # slices; asking each module for its subtree's tensors walked the model once per level
    # (60-100 ms for the 73 layers of bench/offload_disk.py's Qwen2, on a CPU machine).
    order: list[tuple[str, Any]] = []
    ends: list[int] = []
    params: list[tuple[str, Any]] = []
    buffers: list[tuple[str, Any]] = []
    p_at: list[int] = []        # per walk position: where its own parameters start in ``params``
    b_at: list[int] = []
    span: dict[int, int] = {}    # each tensor's bytes as a group member, reckoned once

    def walk(m: Any, name: str) -> None:
        i = len(order)
        order.append((name, m))
        ends.append(0)
        p_at.append(len(params))
        b_at.append(len(buffers))
        prefix = f"{name}." if name else ""
        params.extend((prefix + n, t) for n, t in m._parameters.items() if t is not None)
        buffers.extend((prefix + n, t) for n, t in m._buffers.items() if t is not None)
        for t in itertools.chain(m._parameters.values(), m._buffers.values()):
            if t is not None and id(t) not in span:
                span[id(t)] = span_of(t)
        for cname, child in m._modules.items():
            if child is not None:
                walk(child, prefix + cname)
        ends[i] = len(order)

    walk(module, "")
    p_at.append(len(params))
    b_at.append(len(buffers))
    seen: set[int] = set()
    out: list[tuple[str, Any, list[tuple[str, Any]]]] = []

    def fresh(items: Any) -> list[tuple[str, Any]]:
        return [(n, t) for n, t in items if id(t) not in seen]

    def visit(i: int) -> None:
        name, m = order[i]
        j = ends[i]
        sub = fresh(params[p_at[i]:p_at[j]] + buffers[b_at[i]:b_at[j]])
        uniq = list({id(t): (n, t) for n, t in sub}.values())
        if not uniq:
            return
        if sum(span[id(t)] for _, t in uniq) <= max_group_bytes or j == i + 1:
            seen.update(id(t) for _, t in uniq)
            out.append((name or "<root>", m, uniq))
            return
        own = fresh(params[p_at[i]:p_at[i + 1]] + buffers[b_at[i]:b_at[i + 1]])
        if own:
            seen.update(id(t) for _, t in own)
            out.append((name or "<root>", m, own))
        k = i + 1
        while k < j:                 # each child's subtree, in order
            visit(k)
            k = ends[k]

    visit(0)
    return out


@dataclasses.dataclass(eq=False)
class _Group:
    name: str
    tensors: list[Any]            # the module's torch tensors (parameters and buffers)
    nbytes: int
    pinned: bool = False
    tiered: list[Any] = dataclasses.field(default_factory=list)   # TieredTensors of a resident group
    offset: int = 0               # where a streamed group starts in the pinned home
    member_offsets: list[int] = dataclasses.field(default_factory=list)
    in_slot: list[bool] = dataclasses.field(default_factory=list)   # members a slot serves while in use
    gathered: bool = False        # only embeddings read it: read in place, never given a slot
    stacked: bool = False         # one slice per expert: a decode reads it in place (routed experts only)
    on_disk: bool = False         # read from its files ahead of use (NOTE [disk tier]); it has no home

    def slot_in(self, mode: str) -> bool:
        """Whether a forward in ``mode`` brings this (streamed) group into a slot."""
        if self.gathered or mode == "zero_copy":
            return False
        return mode == "stream" or not self.stacked or self.on_disk


def _versions(g: _Group) -> tuple[int, ...]:
    # autograd's version counters: every in-place write through the tensor (an optimizer step,
    # load_state_dict, a BatchNorm running-stat update) bumps them; rebinding .data does not.
    return tuple(t._version for t in g.tensors)


class _PinnedTransport:
    """Streamed groups in one pinned host buffer (their home, in execution order) and
    ``lookahead`` device slots the size of the largest: the next groups are copied into free slots
    on tiermem's H2D stream while the current one runs, at the full link rate, with no driver page
    work (NOTE [streaming plan]). Outside a slot, a group's tensors point at their home, which the
    GPU reads in place (zero-copy), so decode, unplanned reads and forwards that record gradients
    need no move at all (NOTE [trainable weights in the pinned home])."""

    def __init__(self, owner: TieredModule, groups: list[_Group], lookahead: int, role: Role):
        self.o = owner
        self.tier = tier = owner.tier
        self.role = role
        be = tier.backend
        off = 0
        import torch
        for g in groups:
            g.on_disk = g.name in owner.plan.on_disk
            g.offset = -1 if g.on_disk else off
            # Buffers stay at home, read in place: a forward may write them (BatchNorm's running
            # stats) without bumping their version counter, and they are small.
            g.in_slot = [isinstance(t, torch.nn.Parameter) for t in g.tensors]
            g.member_offsets, n = home_layout(g.tensors)
            g.nbytes = n
            off += 0 if g.on_disk else n
        self.groups = groups
        self.size = max(off, 1)
        self.slot_bytes = max((g.nbytes for g in groups if not g.gathered), default=0)
        # A plan with no room for the window never streams: everything is read in place.
        self.nslots = 0 if owner.plan.zero_copy_only or not self.slot_bytes else owner.plan.lookahead
        self.home: Any = None
        self.window: Any = None
        self.grad_home: Any = None
        self._view_cache: dict[tuple[int, int | None, bool], list[Any]] = {}
        self._reserved = 0
        self.origin: dict[int, Any] = {id(t): _origin(t) for g in groups for t in g.tensors}
        self.disk: DiskTier | None = None
        on_disk = [g for g in groups if g.on_disk]
        stage = max((g.nbytes for g in on_disk), default=0)
        hb = owner.plan.host_budget
        if hb is not None and self.size + (owner.plan.stages * stage if on_disk else 0) > hb:
            from ._errors import HostBudgetError   # plan_host's sizes are these: a bug if it happens
            raise HostBudgetError(self.size + owner.plan.stages * stage, 0, hb, hint="the plan's home and staging "
                                  "do not fit the host budget")
        # The checkpoint's bytes are read into the home before it is pinned (NOTE [filled before
        # pinning] in _cuda.py); other sources are copied in after, by the GPU over the link.
        files = [(owner._sources[id(t)], g.offset + o) for g in groups if not g.on_disk
                 for t, o in zip(g.tensors, g.member_offsets) if isinstance(owner._sources.get(id(t)), FileTensor)]
        disk_files = {g: [(owner._sources[id(t)], o) for t, o in zip(g.tensors, g.member_offsets)]
                      for g in on_disk}

        def fill(base: int) -> None:  # straight from the file (NOTE [reading a checkpoint])
            jobs = [(src, host_bytes(base + o, src.nbytes)) for src, o in files]
            if self._host_thread is None:
                Reader.shared().read(jobs)
                return
            # Beside the resident groups, on threads of its own (NOTE [home beside the resident groups]).
            own = Reader(threads=max(1, Reader.shared().threads // 2))
            try:
                own.read(jobs)
            finally:
                own.close()
                Reader.shared().account(own.bytes_read, own.seconds)

        def host_side() -> None:
            self.home = be.host_alloc(self.size, pooled=False, fill=fill if files else None)
            if on_disk:
                self.disk = DiskTier(be, disk_files, stage, owner.plan.stages, reader=owner.disk_reader)

        self._host_fn: Callable[[], None] | None = host_side
        self._host_error: BaseException | None = None
        self._host_thread: threading.Thread | None = None
        self.reads_files = bool(files)
        self.host_planned = self.size + (owner.plan.stages * stage if on_disk else 0)

    def start(self) -> None:
        """Make the home (and the disk tier's staging) on a thread of its own from now, beside
        the adopting thread's work (NOTE [home beside the resident groups]); ``finish`` waits."""
        if self._host_fn is not None and self._host_thread is None:
            self._host_thread = threading.Thread(target=self._run_host_side, name="tiermem-home", daemon=True)
            self._host_thread.start()

    # NOTE [home beside the resident groups]
    # A checkpoint's load has two host-bound parts: the resident groups (read through pinned
    # fill buffers and copied to the device) and the pinned home (read, then page-locked). On
    # the H100 machine, for the 12.5 GB Qwen2 of bench/offload_disk.py, they took 0.23 s and
    # 0.32 s of a 0.83 s load, one after the other (bench/results/probe_load-h100-20261124-68986dc.json).
    # So the home is filled and registered, and the disk tier's staging made, on a thread of its
    # own while the adopting thread loads the resident groups; ``finish`` waits for it. Only host
    # work runs there: its own memory, a thread-safe Reader, the backend's host_alloc. What
    # bench/probes/probe_register.py and probe_load.py found on the way:
    # - The driver serializes a registration with other CUDA calls: 1.4 GB of copies took
    #   0.025 s alone and 0.097 s beside one. Registering in pieces on several threads is no
    #   faster (38-48 GB/s either way), and a copy may not span two registrations
    #   (cudaErrorInvalidValue), so the home stays one block, registered once its reads are done.
    # - The home therefore reads on a Reader of its own with half the shared reader's threads,
    #   so that the resident groups' reads and copies run beside its reads instead of queueing
    #   behind them into the registration. With as many threads again, they starved: loads of
    #   0.69-0.80 s against 0.58-0.64 s (probe_load-h100-20261125-16threads.json, -7e90d36.json).
    # - The fill buffers are made before the thread starts: made beside a thread faulting in the
    #   home's pages, their 140 MB took 0.12 s to map and 0.2 s to register.
    # - Under a host budget the fill buffers live beside the home, so they get what the home and
    #   the staging leave of the budget; with less than MIN_FILL_ROOM left, the home is made
    #   after the resident groups, as before.
    # What stays serial is the driver's: the registration (0.1-0.19 s for the 3.86 GB home) and
    # the resident groups' advice (0.05-0.09 s).
    def _run_host_side(self) -> None:
        fn, self._host_fn = self._host_fn, None
        if fn is None:
            return
        try:
            fn()
        except BaseException as e:  # noqa: B036 - the adopting thread raises it in finish
            self._host_error = e

    def _join_host_side(self) -> None:
        """Wait for the host side ``start`` began, or run it here: the home and the disk tier's
        staging (NOTE [home beside the resident groups]); raise what it raised."""
        if self._host_thread is not None:
            self._host_thread.join()
            self._host_thread = None
        else:
            self._run_host_side()
        err, self._host_error = self._host_error, None
        if err is not None:
            raise err

    def finish(self) -> None:
        """The rest of the adoption, after the resident groups: the home (waited for or made
        now), the window, the copies of sources that are not files."""
        tier, be, owner = self.tier, self.tier.backend, self.o
        import torch
        try:
            self._join_host_side()
            if self.nslots:
                tier.reserve(self.slot_bytes * self.nslots, self.role)
                self._reserved = self.slot_bytes * self.nslots
                # Straight from the driver, so unwrap (or a failed adoption) gives it back.
                self.window = be.device_alloc(self._reserved, pooled=False)
            with torch.no_grad():
                for g in self.groups:
                    if g.on_disk:
                        continue                          # its home is its file
                    for t, v in zip(g.tensors, self._views(g, None)):
                        src = owner._sources.get(id(t), t)
                        if not isinstance(src, FileTensor):
                            v.copy_(_materialize(src))    # the GPU writes pinned pages straight over the link
            if be.kind == "cuda":
                torch.cuda.synchronize(tier.device)   # the home is whole before the originals may go
        except BaseException:
            self.discard()
            raise
        # A slot's ``held`` is its group's versions when copied in (NOTE [ordered copies] in _stream.py).
        self.ring = SlotRing(self.window.ptr if self.window is not None else 0, self.slot_bytes, self.nslots)
        self.lane = Lane(be, lambda: tier.side_stream("h2d"))
        self.slot_of: dict[int, int] = {}
        self.in_use: dict[int, tuple[int, ...]] = {}    # group -> versions when bound to its slot
        self.count = 0                 # streamed group uses so far: use c runs in slot c % nslots

    def bind_home(self) -> None:
        """Point every streamed tensor at its home (the adoption's last step: cannot fail)."""
        for g in self.groups:
            for t, v in zip(g.tensors, self._views(g, None)):
                t.data = v

    def _views(self, g: _Group, slot: int | None, base: Any = None) -> list[Any]:
        # Made once per (group, place): a view costs ~20 us of host time, and a forward binds
        # every streamed group twice; on a model whose layers sync the host (a mixture of
        # experts) that time lands on the critical path.
        key = (id(g), slot, base is not None)
        got = self._view_cache.get(key)
        if got is None:
            got = self._view_cache[key] = self._make_views(g, slot, base)
        return got

    def _make_views(self, g: _Group, slot: int | None, base: Any = None) -> list[Any]:
        be = self.tier.backend
        if slot is None and base is None and g.on_disk:
            slot = 0                 # no home: at rest it points at a slot (NOTE [disk tier])
        block = base if base is not None else (self.home if slot is None else self.window)
        start = block.ptr + g.offset if slot is None else block.ptr + slot * self.slot_bytes
        out = []
        for t, o in zip(g.tensors, g.member_offsets):
            n = t.numel() * t.element_size()
            raw = be.torch_view(start + o, n, block)
            out.append(raw.view(t.dtype).view(t.shape))
        return out

    def _load(self, g: _Group, slot: int, wait: bool = True) -> bool:
        """Queue ``g``'s copy into ``slot``; False (nothing queued) when ``g`` is on disk, not read
        yet, and ``wait`` is off."""
        from ._transfer import Transfer
        tier = self.tier
        stage = None
        if g.on_disk:
            stage = self.disk.take(g, wait)
            if stage is None:
                return False
        src = self.home.ptr + g.offset if stage is None else self.disk.stages[stage].ptr
        s = self.ring[slot]
        # The slot holds nothing from here until the copy is queued and its event recorded: a
        # failure in between must not leave the old occupant's name on new bytes (a later
        # forward would compute with them; tests/test_module_faults.py).
        old = self.ring.vacate(s)
        if old is not None:
            self.slot_of.pop(id(old), None)
        start, end = self.ring.fill(self.lane, s, [(0, src, g.nbytes)], timed=True)
        if stage is not None:
            self.disk.give_back(stage, end)
        tier.track(Transfer(tier, "h2d", self.lane.stream, start, end, [], g.nbytes, {self.role: g.nbytes}))
        tier.accounting.on_move(self.role, "h2d", g.nbytes)
        tier.accounting.count(self.role, "prefetch_ops")
        s.occupant, s.held = g, _versions(g)
        self.slot_of[id(g)] = slot
        return True

    def ensure(self, g: _Group) -> None:
        slot = self.count % self.nslots
        self.count += 1
        now = _versions(g)
        # Not brought in ahead, or written at home since (an optimizer step between forwards).
        if self.slot_of.get(id(g)) != slot or self.ring[slot].held != now:
            self._load(g, slot)
        be = self.tier.backend
        be.wait(be.current_stream(), self.ring[slot].ready)
        for t, v, s in zip(g.tensors, self._views(g, slot), g.in_slot):
            if s:
                t.data = v
        self.in_use[id(g)] = now

    def ahead(self, upcoming: list[_Group]) -> None:
        for d, g in enumerate(upcoming[: self.nslots - 1], start=0):
            slot = (self.count + d) % self.nslots
            s = self.ring[slot]
            if s.occupant is g and self.slot_of.get(id(g)) == slot and s.held == _versions(g):
                continue
            self._load(g, slot, wait=False)     # a group still being read from disk comes in at ensure()

    def release(self, g: _Group) -> None:
        slot = self.slot_of.get(id(g))
        if slot is None:
            return
        be = self.tier.backend
        home = self._views(g, None)
        before = self.in_use.pop(id(g), None)
        if before is not None and before != _versions(g) and g.on_disk:
            log.warning("tiermem: a forward wrote to %s, which is read from disk; the write is not kept", g.name)
        elif before is not None and before != _versions(g):
            # The forward wrote into the slot (a running-stat buffer, say): keep it at home. Later
            # loads of this group read home on tiermem's stream, which waits for this copy.
            for t, h, old, new, s in zip(g.tensors, home, before, _versions(g), g.in_slot):
                if old != new and s:
                    h.copy_(t.data)
            self.lane.after([now()])
        self.ring.release(self.ring[slot], be)
        for t, v, s in zip(g.tensors, home, g.in_slot):
            if s:
                t.data = v                           # back to its home: correct to read, zero-copy
        self.tier.accounting.count(self.role, "evict_ops")
        self.tier.accounting.count(self.role, "evict_clean_ops")

    def offload_grad(self, g: _Group, i: int, p: Any) -> None:
        """A streamed parameter's gradient lives in pinned host memory beside its home, so a
        backward through the module keeps no more device memory than the budget allows
        (NOTE [trainable weights in the pinned home]). Runs in autograd's post-accumulate hook."""
        grad = p.grad
        if grad is None:
            return
        if self.grad_home is None:
            self.grad_home = self.tier.backend.host_alloc(self.size, pooled=False)
        view = self._views(g, None, base=self.grad_home)[i]
        if grad.data_ptr() == view.data_ptr():
            return                                    # accumulated in place, at home already
        view.copy_(grad)
        p.grad = view

    def drain(self) -> None:
        self.tier.synchronize()

    def restored(self, device_of: Callable[[Any], Any]) -> list[tuple[Any, Any, Any]]:
        """(tensor, plain copy, plain grad or None) for every streamed tensor, on the device
        ``device_of(tensor)`` names; binds nothing, so a failure here changes nothing."""
        import torch
        self.tier.synchronize()
        out = []
        with torch.no_grad():
            for g in self.groups:
                for t, v in zip(g.tensors, self._views(g, None)):
                    plain = torch.empty(t.shape, dtype=t.dtype, device=device_of(t))
                    plain.copy_(_materialize(self.o._sources[id(t)]) if g.on_disk else v)
                    grad = getattr(t, "grad", None)
                    if grad is not None and (self._in_grad_home(grad) or grad.device != plain.device):
                        grad = grad.to(plain.device, copy=True)
                    else:
                        grad = None
                    out.append((t, plain, grad))
        return out

    @property
    def pinned_bytes(self) -> int:
        """Pinned host bytes held: the home, the disk tier's staging buffers, the gradients' home."""
        return sum(b.nbytes for b in (self.home, self.grad_home) if b is not None) + (
            self.disk.pinned_bytes if self.disk is not None else 0)

    def _in_grad_home(self, x: Any) -> bool:
        if self.grad_home is None:
            return False
        p = x.data_ptr()
        return self.grad_home.ptr <= p < self.grad_home.ptr + self.size

    def discard(self) -> None:
        """Give back the window, the home and the gradients' home. The caller has rebound every
        tensor away from them first (or never bound any)."""
        if self._host_thread is not None:
            self._host_thread.join()           # what it made is given back below; its error is not ours
            self._host_thread = None
        self._host_fn = None
        if self.tier.backend.kind == "cuda":
            import torch
            torch.cuda.synchronize(self.tier.device)
        self._view_cache.clear()       # the views hold the blocks
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        if self.window is not None:
            self.window.release()
            self.window = None
        if self._reserved:
            self.tier.unreserve(self._reserved, self.role)
            self._reserved = 0
        for name in ("home", "grad_home"):
            block = getattr(self, name)
            if block is not None:
                block.release()
                setattr(self, name, None)
        self.tier.backend.release_cached()   # the pinned pool keeps what it is given back


# NOTE [trainable weights in the pinned home]
#     transformers builds every parameter with requires_grad=True, also for inference, so the
#     flag says nothing about the use. The use decides: a forward under torch.no_grad() or
#     inference_mode() only reads the weights and streams them through the slots; a forward that
#     records gradients reads the streamed weights in place from their pinned home (zero-copy,
#     ~51 GB/s), because autograd saves the weights (and views of them, e.g. the transposed
#     weight a linear layer saves) for backward, and a slot is overwritten by the next group long
#     before backward reads it: the gradients would be silently wrong. The home stays put, so what
#     autograd saved is right whenever backward runs. A streamed parameter's gradient is moved to
#     pinned host memory beside its home as soon as autograd has accumulated it, so backward keeps
#     no more device memory than the budget allows; optimizers then update weights and read
#     gradients in place. Writes to a weight bump its version counter; a slot loaded before the
#     write is loaded again, and a write made in a slot during a forward is copied home. Writes
#     through ``.data`` bypass the version counter and are not seen. Training within a budget at
#     speed is wrap_training's job (it plans gradients and optimizer states too); this path is
#     correct and never refuses.


class TieredModule:
    """Handle of a module adopted by :func:`wrap_module`: its plan, its mode, stats() and unwrap().

    Keyword arguments beside the budget: ``mode`` ("auto", "stream", "zero_copy"), ``lookahead``
    (streamed groups in flight), ``zero_copy_max_tokens`` (forwards of at most this many tokens
    are decode steps), ``max_group_bytes``; ``weights``, a Mapping from state-dict names to the
    tensors' bytes (NOTE [weight source]: a module built on the meta device can be adopted); and
    ``host_budget``, the pinned host bytes allowed, beyond which streamed groups are read from
    their checkpoint files ahead of use (NOTE [disk tier]; needs ``weights`` from a Checkpoint),
    by ``disk_reader``: "posix" (threads of ``os.preadv``) or "kvikio" (NOTE [kvikio reader]).
    """

    def __init__(self, tier: Tier, module: Any, budget: int | str | None, *, mode: str = "auto",
                 lookahead: int = LOOKAHEAD, zero_copy_max_tokens: int = 16, max_group_bytes: int = MAX_GROUP,
                 weights: Mapping[str, Any] | None = None, host_budget: int | str | None = None,
                 disk_reader: str = READERS[0]):
        if mode not in ("auto", "stream", "zero_copy"):
            raise ConfigError(f"mode must be 'auto', 'stream' or 'zero_copy', got {mode!r}")
        if disk_reader not in READERS:
            raise ConfigError(f"disk_reader must be one of {', '.join(map(repr, READERS))}, got {disk_reader!r}")
        self.disk_reader = disk_reader
        if getattr(module, "_tiermem_handle", None) is not None:
            raise WrapError("this module is already adopted by tiermem; unwrap it first")
        self.tier = tier
        self.module = module
        self.mode = mode
        self.zero_copy_max_tokens = zero_copy_max_tokens
        # A meta tensor cannot be rebound to memory (torch refuses set_data across the two), so
        # the module gets a memory-less stand-in in its place first (NOTE [weight source]); a
        # failure puts the meta tensors back.
        swaps = _stand_ins(module) if weights is not None else []
        try:
            self._setup(module, budget, lookahead, max_group_bytes, weights, {id(new) for *_, new in swaps}, host_budget)
        except BaseException:
            for owner, name, old, _ in reversed(swaps):
                owner[name] = old
            raise

    def _setup(self, module: Any, budget: int | str | None, lookahead: int, max_group_bytes: int,
               weights: Mapping[str, Any] | None, empty: set[int], host_budget: int | str | None) -> None:
        tier = self.tier
        found = module_groups(module, max_group_bytes)
        if not found:
            raise WrapError("this module has no parameters or buffers to tier")
        from ._torch import check_tensor
        self._sources = _sources(module, found, weights, empty)     # NOTE [weight source]
        for _, _, own in found:
            for _, t in own:
                if id(t) not in empty:
                    check_tensor(tier, t)
        sizes = [(mname, sum(span_of(t) for _, t in own)) for mname, _, own in found]
        total = sum(n for _, n in sizes)
        # NOTE [sizes] in _limits.py: a percentage is a share of the device, as everywhere.
        asked = total if budget is None else parse_bytes(budget, total=tier.backend.capabilities().total_memory,
                                                         what="module budget", max_percent=100)
        self.budget = self._within_device(asked, [t for _, _, own in found for _, t in own])
        self.plan = plan_residency(sizes, self.budget, lookahead, in_place=gathered_groups(module, found))
        self.lookahead = max(self.plan.lookahead, 1)
        self._groups = {mname: _Group(mname, [t for _, t in own], n, pinned=mname in self.plan.pinned,
                                      gathered=mname in self.plan.in_place, stacked=is_stacked([t for _, t in own]))
                        for (mname, _, own), (_, n) in zip(found, sizes)}
        self._unit_groups: dict[int, list[_Group]] = {id(m): [self._groups[mname]] for mname, m, _ in found}
        self.host_budget = None if host_budget is None else parse_bytes(host_budget, what="host_budget")
        if self.host_budget is not None:
            self.plan = plan_host(self.plan, [(g.name, home_layout(g.tensors)[1]) for g in self._groups.values()],
                                  self.host_budget, STAGES,
                                  keep=stay_home([(g.name, g.tensors) for g in self._groups.values()],
                                                 lambda t: isinstance(self._sources.get(id(t)), FileTensor)))
            if self.plan.on_disk and self.mode == "zero_copy":
                raise TierMemError("mode='zero_copy' reads every weight in place, and a disk tier has weights with "
                                   "no place to read: raise host_budget or use mode='auto'")
            if self.plan.on_disk and self.disk_reader == "kvikio":
                from ._kvikio import require
                require()                # refused before anything is allocated, with the reason
        streamed = [g for g in self._groups.values() if not g.pinned]
        self._trainable = any(t.requires_grad for g in streamed for t in g.tensors)
        self.transport = "pinned"
        self._stream: _PinnedTransport | None = None
        self._hooks: list[Any] = []
        self._trace: list[int] = []
        self._recording = True
        self._pos = -1
        self._fwd_mode = "stream"
        self._lease: Any = None       # its share of the tier's budget (NOTE [budget leases])
        # NOTE [all or nothing]
        #     Adoption, like unwrap, either completes or leaves the module exactly as it was, with
        #     every byte it took given back and its budget lease released. The original tensors
        #     stay referenced until the adoption is done (a failure rebinds them), and the streamed
        #     tensors are bound to their home only in the last step, which cannot fail. unwrap makes
        #     every plain copy before it rebinds anything, after checking the device has room.
        originals = [(t, t.data) for g in self._groups.values() for t in g.tensors]
        try:
            self._adopt(found, streamed)
        except BaseException:
            self._rollback(originals)
            raise

    def stats(self) -> dict[str, Any]:
        """A flat dict of the module's host-side figures (bytes, seconds, counts):
        ``pinned_bytes.current`` (the home, staging buffers and gradients' home, together) and
        ``pinned_bytes.home`` / ``.staging``; ``host_budget`` (-1: none); ``disk_bytes.per_forward``
        (the bytes a forward reads from the files);
        and the disk tier's totals since adoption: ``disk.read_bytes``, ``disk.read_seconds`` (the
        reader's time), ``disk.wait_seconds`` (the forward's time waiting on the reader),
        ``disk.reads``, ``disk.stage_reuse`` (reads into a staging buffer used before),
        ``disk.resyncs``, ``disk.dropped`` (reads thrown away when a forward changed order) and
        ``disk.retries`` (failed reads made again; NOTE [disk read errors])."""
        st = self._stream
        disk = st.disk if st is not None else None
        out: dict[str, Any] = {
            "pinned_bytes.current": st.pinned_bytes if st is not None else 0,
            "pinned_bytes.home": st.home.nbytes if st is not None and st.home is not None else 0,
            "pinned_bytes.staging": disk.pinned_bytes if disk is not None else 0,
            "host_budget": -1 if self.host_budget is None else self.host_budget,
            "disk_bytes.per_forward": sum(ft.nbytes for fs in disk.files.values() for ft, _ in fs) if disk else 0,
        }
        for k in ("read_bytes", "read_seconds", "wait_seconds", "reads", "stage_reuse", "resyncs", "dropped",
                  "retries"):
            out[f"disk.{k}"] = disk.stats[k] if disk is not None else 0
        return out

    def _within_device(self, asked: int, tensors: list[Any]) -> int:
        """The budget the device can really hold: resident groups live in managed memory, which
        the cap keeps within the device's real free memory (NOTE [managed cap]); asking for more
        would be refused there. Weights already on this device count as room: they are freed once
        adopted. A budget that must shrink says so, and the plan streams the rest."""
        be = self.tier.backend
        lease_room = self.tier.lease_room()      # NOTE [budget leases]
        if lease_room is not None and asked > lease_room:
            log.warning("tiermem: a module budget of %s bytes does not fit the tier's configured budget (%s bytes "
                        "left for leases); planning for that, the rest streams from pinned host memory",
                        f"{asked:,}", f"{lease_room:,}")
            asked = lease_room
        room = be.guard.limit - be.guard.reserved
        on_device = sum(t.numel() * t.element_size() for t in tensors
                        if t.device.type == "cuda" and t.device.index == self.tier.device)
        free = be.mem_info()[0] + on_device
        fit = max(0, min(room, free))
        if asked > fit:
            log.warning("tiermem: a module budget of %s bytes does not fit this device (%s bytes of managed room, "
                        "%s free); planning for %s bytes, the rest streams from pinned host memory",
                        f"{asked:,}", f"{room:,}", f"{free:,}", f"{fit:,}")
            return fit
        return asked

    def _adopt(self, found: list, streamed: list[_Group]) -> None:
        tier, module = self.tier, self.module
        # before any fill: adoption itself stays within budget
        self._lease = tier.lease(self.budget, owner=f"wrap_module({type(module).__name__})")
        pinned = [g for g in self._groups.values() if g.pinned]
        room, ready = self.plan.host_budget, None
        if streamed:
            self._stream = _PinnedTransport(self, streamed, self.lookahead,
                                            Role.WEIGHT if self._trainable else Role.FROZEN_WEIGHT)
            left = None if room is None else room - self._stream.host_planned
            if self._stream.reads_files and pinned and (left is None or left >= MIN_FILL_ROOM):
                room, ready = left, self._stream.start      # NOTE [home beside the resident groups]
        if pinned:
            flat = [t for g in pinned for t in g.tensors]
            role = Role.WEIGHT if any(t.requires_grad for t in flat) else Role.FROZEN_WEIGHT
            names = [f"{g.name}.{i}" for g in pinned for i in range(len(g.tensors))]
            policy = tier.policies[role].replace(evict=Evict.NEVER)
            if self._sources:
                tts = _wrap_from(tier, flat, [self._sources.get(id(t)) for t in flat], names, policy, room=room,
                                 ready=ready)
            else:
                tts = _wrap_group(tier, flat, names, on_host=False, policy=policy)
            k = 0
            for g in pinned:
                g.tiered = tts[k:k + len(g.tensors)]
                k += len(g.tensors)
            del tts    # a traceback keeps this frame: only the groups may hold the buffers
        if self._stream is not None:
            self._stream.finish()
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
        self._units = [m for m in module.modules() if id(m) in self._unit_groups]
        self._hooks = [module.register_forward_pre_hook(self._root_pre, with_kwargs=True),
                       module.register_forward_hook(self._root_post)]
        for i, m in enumerate(self._units):
            self._hooks.append(m.register_forward_pre_hook(lambda mod, args, i=i: self._pre(i)))
            self._hooks.append(m.register_forward_hook(lambda mod, args, out, i=i: self._post(i)))
        if self._stream is not None:
            for g in streamed:
                for i, t in enumerate(g.tensors):
                    if t.requires_grad and hasattr(t, "register_post_accumulate_grad_hook"):
                        self._hooks.append(t.register_post_accumulate_grad_hook(
                            lambda p, g=g, i=i: self._stream.offload_grad(g, i, p)))
            self._stream.bind_home()       # the last step; it cannot fail
        self._hooks.append(CopyGuard(module))   # NOTE [held modules]
        module._tiermem_handle = weakref.ref(self)

    def _rollback(self, originals: list[tuple[Any, Any]]) -> None:
        """Undo a failed adoption: the module's tensors get their original data back, and every
        byte tiermem took for them is given back. Must not raise over the adoption's error."""
        from ._torch import TIERED_ATTR
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for t, data in originals:
            t.data = data
            if hasattr(t, TIERED_ATTR):
                delattr(t, TIERED_ATTR)
        self._give_back()
        self.tier.backend.release_cached()   # the freed groups' managed memory back to the driver

    # -- forward hooks ------------------------------------------------------------------------------
    def _tokens(self, args: tuple, kwargs: dict) -> int | None:
        # Hugging Face models take their tokens by name; the other integer tensors they get
        # (attention mask, cache positions) span the whole sequence, not the new tokens.
        ids = kwargs.get("input_ids")
        if ids is not None and hasattr(ids, "numel"):
            return int(ids.numel())
        emb = kwargs.get("inputs_embeds")
        if emb is not None and hasattr(emb, "shape") and emb.dim() >= 2:
            return int(emb.shape[:-1].numel())
        vals = list(args) + list(kwargs.values())
        for a in vals:
            if hasattr(a, "dtype") and hasattr(a, "shape") and not a.dtype.is_floating_point and a.dim() >= 1:
                return int(a.numel())
        for a in vals:
            if hasattr(a, "shape") and a.dim() >= 2:
                return int(a.shape[:-1].numel())
        return None

    def _root_pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        import torch
        mode = self.mode
        if self._stream is None or not self._stream.nslots or (self._trainable and torch.is_grad_enabled()):
            mode = "zero_copy"       # NOTE [trainable weights in the pinned home]
            if self._stream is not None and self._stream.disk is not None:
                raise TierMemError("this module reads weights from disk (host_budget), so a forward that records "
                                   "gradients cannot read them in place; run it under torch.no_grad() or "
                                   "torch.inference_mode() (NOTE [disk tier])")
        elif mode == "auto":
            n = self._tokens(args, kwargs)
            mode = "decode" if n is not None and n <= self.zero_copy_max_tokens else "stream"
        self._fwd_mode = mode
        self._pos = -1

    def _root_post(self, module: Any, args: tuple, out: Any) -> None:
        if self._recording and self._trace:
            self._recording = False
            if self._stream is not None and self._stream.disk is not None:
                self._stream.disk.set_sequence([g for i in self._trace for g in self._unit_groups[id(self._units[i])]
                                                if g.on_disk])
        if self._fwd_mode != "zero_copy" and not self._recording and self._stream is not None:
            self._pos = -1
            self._stream.ahead(self._upcoming())   # the first streamed groups of the next forward

    def _upcoming(self) -> list[_Group]:
        out: list[_Group] = []
        for j in range(self._pos + 1, len(self._trace)):
            for g in self._unit_groups[id(self._units[self._trace[j]])]:
                if not g.pinned and g.slot_in(self._fwd_mode):
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
            elif g.slot_in(self._fwd_mode):
                self._stream.ensure(g)
        if self._fwd_mode != "zero_copy" and not self._recording and self._stream is not None:
            self._stream.ahead(self._upcoming())

    def _post(self, i: int) -> None:
        if self._fwd_mode == "zero_copy":
            return
        for g in self._unit_groups[id(self._units[i])]:
            if not g.pinned and g.slot_in(self._fwd_mode):
                self._stream.release(g)

    # -- lifecycle ------------------------------------------------------------------------------------
    def drain(self) -> None:
        """Wait until every move this module queued is done."""
        if self._stream is not None:
            self._stream.drain()
        self.tier.synchronize()

    @property
    def moved_bytes(self) -> int:
        """Bytes a streaming forward copies over the link: the streamed groups in their pinned
        home's layout (256-byte aligned), less those read in place."""
        return sum(g.nbytes for g in self._groups.values() if not g.pinned and not g.gathered)

    @property
    def groups(self) -> dict[str, list[Any]]:
        """Group name -> its tensors (TieredTensors where tiermem holds them in managed memory)."""
        return {g.name: list(g.tiered or g.tensors) for g in self._groups.values()}

    def unwrap(self, device: Any = None) -> Any:
        """Give every tensor plain memory again and remove the hooks; returns the module.

        ``device`` (e.g. "cpu") restores every tensor there; by default each goes back to the
        device it came from. The device memory this needs is checked first: if it is not free,
        :class:`DeviceFullError` (a MemoryError) is raised and nothing changes; ``unwrap("cpu")``
        then restores onto the host. All or nothing: the plain copies are made before anything is
        rebound.
        """
        import torch
        if not self._groups:
            raise WrapError("this module was unwrapped already")
        if device is not None:
            device = torch.device(device)
        origin: dict[int, Any] = {}
        for g in self._groups.values():
            for t, tt in zip(g.tensors, g.tiered):
                origin[id(t)] = getattr(tt, "_origin_device", None)
        if self._stream is not None:
            origin.update(self._stream.origin)
        dev_of = lambda t: device if device is not None else (origin.get(id(t)) or t.device)  # noqa: E731
        self._check_room(dev_of)
        if self._stream is not None:
            self._stream.drain()
        plain = list(self._stream.restored(dev_of)) if self._stream is not None else []
        with torch.no_grad():
            for g in self._groups.values():
                if g.pinned:
                    for t in g.tensors:
                        p = torch.empty(t.shape, dtype=t.dtype, device=dev_of(t))
                        p.copy_(t.data)
                        grad = getattr(t, "grad", None)
                        grad = grad.to(p.device, copy=True) if grad is not None and grad.device != p.device else None
                        plain.append((t, p, grad))
        # Everything is copied: from here on nothing can fail.
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._rebind_plain(plain)
        self.module._tiermem_handle = None
        return self.module

    def _rebind_plain(self, plain: list[tuple[Any, Any, Any]]) -> None:
        from ._torch import TIERED_ATTR
        for t, p, grad in plain:
            t.data = p
            if grad is not None:
                t.grad = grad
            if hasattr(t, TIERED_ATTR):
                delattr(t, TIERED_ATTR)
        self.tier.synchronize()
        self._give_back()

    def _give_back(self) -> None:
        """Free what the adoption took once the tensors no longer point at it: the resident
        groups, the streaming window and pinned home, and the budget lease."""
        for g in self._groups.values():
            for tt in g.tiered:
                tt.buffer.bindings = []
                tt.free()
            g.tiered = []
        if self._stream is not None:
            self._stream.discard()
            self._stream = None
        self._groups.clear()
        if self._lease is not None:
            self._lease.release()

    def _check_room(self, dev_of: Callable[[Any], Any]) -> None:
        """Refuse, changing nothing, an unwrap whose plain copies do not fit their device."""
        import torch
        need = sum(t.numel() * t.element_size() for g in self._groups.values() for t in g.tensors
                   if dev_of(t).type == "cuda")
        if not need or self.tier.backend.kind != "cuda":
            return
        free = self.tier.backend.mem_info()[0]
        if torch.cuda.is_initialized():
            free += torch.cuda.memory_reserved(self.tier.device) - torch.cuda.memory_allocated(self.tier.device)
        if need > free:
            raise DeviceFullError(need, 0, free, hint="unwrap needs that much free device memory for the plain "
                                   "copies and the device has less; call unwrap(device='cpu') to restore onto "
                                   "the host, or free device memory first")

    def __repr__(self) -> str:
        return f"<TieredModule {type(self.module).__name__} ({self.transport}): {self.plan.table(limit=0)}>"


def is_stacked(tensors: list[Any]) -> bool:
    """Parameters stacked along one leading dimension, a slice per expert (a mixture-of-experts
    layer's expert weights): a forward of few tokens indexes the slices its router picked."""
    import torch
    ps = [t for t in tensors if isinstance(t, torch.nn.Parameter)]
    return bool(ps) and all(p.dim() >= 3 and p.shape[0] == ps[0].shape[0] > 1 for p in ps)


def gathered_groups(module: Any, found: list) -> set[str]:
    """The groups only embeddings use: a lookup reads the rows of its tokens, so reading them in
    place moves a few KiB where a slot would move the whole table (NOTE [streaming plan])."""
    import torch
    owner = {id(t): mname for mname, _, own in found for _, t in own}
    users: dict[str, list[Any]] = {}
    for m in module.modules():
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None and id(t) in owner:
                users.setdefault(owner[id(t)], []).append(m)
    return {g for g, ms in users.items() if all(isinstance(m, torch.nn.Embedding) for m in ms)}


def home_layout(tensors: list[Any], align: int = 256) -> tuple[list[int], int]:
    """(offset of each tensor, bytes) of a streamed group in the pinned home, a slot or a staging
    buffer: the tensors back to back, each ``align``-byte aligned."""
    offs, n = [], 0
    for t in tensors:
        offs.append(n)
        n += -(-max(t.numel() * t.element_size(), 1) // align) * align
    return offs, n


def span_bytes(nbytes: int) -> int:
    """Device bytes a tensor of ``nbytes`` takes as a group member (see member_span)."""
    from ._engine import member_span
    return member_span(nbytes)[0]


def weight_bytes(module: Any) -> int:
    """The bytes of ``module``'s parameters and buffers as wrap_module lays them out (each
    tensor once, tied weights too): ``budget=weight_bytes(model) // 4`` keeps about a quarter of
    them resident. Meta tensors count too, so a model built on the meta device can be sized."""
    return sum(span_of(t) for _, _, own in module_groups(module) for _, t in own)


def span_of(t: Any) -> int:
    return span_bytes(t.numel() * t.element_size())


def _wrap_group(tier: Tier, tensors: list[Any], names: list[str], on_host: bool, policy: Any) -> list[TieredTensor]:
    from ._torch import wrap_group
    return wrap_group(tier, tensors, Role.WEIGHT, names=names, on_host=on_host, policy=policy)


# NOTE [weight source]
#     ``weights`` (a Mapping from the module's state-dict names to tensors, or to the FileTensors of
#     a Checkpoint) gives each tensor's bytes in place of the tensor itself, so a module built on
#     the meta device (no memory) can be adopted: resident groups are filled from the source one
#     tensor at a time, streamed groups are written straight into their pinned home (a checkpoint's
#     bytes are read from the file into it, NOTE [reading a checkpoint]), and no full host copy of
#     the model is ever made. A tensor known under several names (tied weights) takes the first of
#     its names the source has. A tensor the source lacks keeps its own bytes; a meta tensor the
#     source lacks is refused before anything is allocated, as is a source tensor whose shape or
#     dtype is not the module's (convert the source first; load_pretrained does with ``dtype=``).
#     A meta tensor had no device of its own: unwrap restores it onto the host (or the device
#     asked for). Adoption stays all or nothing (NOTE [all or nothing]).


def _stand_ins(module: Any) -> list[tuple[dict, str, Any, Any]]:
    """Give every meta parameter and buffer of ``module`` a stand-in of its shape and dtype that
    holds one element (an expanded host tensor), which adoption then rebinds to real memory;
    (container, name, meta tensor, stand-in) each. A tensor under several names (tied weights)
    gets one stand-in."""
    import torch
    made: dict[int, Any] = {}
    out = []
    for m in module.modules():
        for box in (m._parameters, m._buffers):
            for name, t in list(box.items()):
                if t is None or not t.is_meta:
                    continue
                new = made.get(id(t))
                if new is None:
                    one = torch.empty((), dtype=t.dtype) if t.dim() == 0 else torch.empty(1, dtype=t.dtype).expand(t.shape)
                    new = torch.nn.Parameter(one, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else one
                    made[id(t)] = new
                box[name] = new
                out.append((box, name, t, new))
    return out


def _sources(module: Any, found: list, weights: Mapping[str, Any] | None, empty: set[int]) -> dict[int, Any]:
    """id(tensor) -> its source in ``weights`` (NOTE [weight source]); checked, allocates nothing."""
    if weights is None:
        return {}
    names: dict[int, list[str]] = {}
    for n, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), []).append(n)
    out: dict[int, Any] = {}
    missing, bad = [], []
    where = getattr(weights, "path", "")
    for _, _, own in found:
        for n, t in own:
            aliases = names.get(id(t), [n])
            name = next((a for a in aliases if a in weights), None)
            if name is None:
                if id(t) in empty:
                    missing.append(" = ".join(aliases))
                continue
            src = weights[name]
            shape, dtype = tuple(src.shape), _dtype_name(src.dtype)
            if shape != tuple(t.shape) or dtype != _dtype_name(t.dtype):
                bad.append(f"{name}: {dtype} {list(shape)} where the module has {_dtype_name(t.dtype)} {list(t.shape)}")
                where = where or getattr(src, "path", "")
                continue
            out[id(t)] = src
    if missing:
        raise CheckpointError(f"the weights lack {len(missing)} tensor(s) the module needs (and has no data for): "
                              f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}", where)
    if bad:
        raise CheckpointError(f"{len(bad)} tensor(s) in the weights do not match the module: {'; '.join(bad[:4])}"
                              f"{' ...' if len(bad) > 4 else ''}", where)
    return out


def _dtype_name(dt: Any) -> str:
    from ._dtypes import canonical
    return canonical(dt)


def _origin(t: Any) -> Any:
    """Where unwrap puts a tensor back by default: its own device (a meta tensor's stand-in is on
    the host)."""
    return t.device


def _materialize(src: Any) -> Any:
    """A source's data as a torch tensor: the tensor itself, or a checkpoint tensor read now."""
    import torch
    return src if isinstance(src, torch.Tensor) else src.tensor()


FILL_CHUNK = 256 << 20   # host bytes resident tensors are read through, reused: a full tensor could be 1 GB
FILL_BUFFERS = 2
MIN_FILL_ROOM = 64 << 20  # host bytes the fill buffers need beside a home being made (NOTE [home beside the resident groups])


class _Filler:
    """Writes checkpoint tensors into device memory through FILL_BUFFERS pinned buffers of up to
    FILL_CHUNK bytes taken in turn, so that one buffer is read from the files while the last one
    crosses the link, and the host never holds a whole tensor. Tensors are packed end to end
    into a buffer (a large one spans several), and each buffer is read in one go on the reader's
    threads: read a tensor at a time, through 64 MiB buffers, 2 GB of resident groups took
    0.29-0.31 s on the H100, most tensors too small to keep the 16 threads busy
    (bench/probes/probe_load.py). ``close()`` reads what is queued, waits for the copies and
    gives the buffers back; call it in every case (``discard()`` after a failure)."""

    def __init__(self, tier: Tier, sources: list[Any], room: int | None = None):
        self.be = tier.backend
        total = sum(x.nbytes for x in sources if isinstance(x, FileTensor))
        # Within ``room`` host bytes: what the budget leaves beside the home (NOTE [home beside
        # the resident groups]), or all of it when the home is made after.
        cap = FILL_CHUNK if room is None else max(4096, min(FILL_CHUNK, room // FILL_BUFFERS))
        self.size = min(cap, total)
        self.lane = Lane(self.be, self.be.current_stream)   # the stream later fills and reads use
        self.bufs: list[Any] = []
        self.done: list[Any] = [None] * FILL_BUFFERS     # per buffer: its last copy's end event
        self.turn = 0
        self.queued: list[tuple[FileTensor, int, int, int, int]] = []   # (src, start, n, dst, at)
        self.used = 0

    def add(self, dst: int, src: FileTensor) -> None:
        """Queue ``src``'s bytes for the device memory at ``dst``."""
        s = 0
        while s < src.nbytes:
            n = min(src.nbytes - s, self.size - self.used)
            self.queued.append((src, s, n, dst + s, self.used))
            self.used += n
            s += n
            if self.used == self.size:
                self._flush()

    def _flush(self) -> None:
        if not self.queued:
            return
        i, self.turn = self.turn, (self.turn + 1) % FILL_BUFFERS
        buf = self._buffer(i)
        if self.done[i] is not None:
            self.be.synchronize(self.done[i])   # its last bytes have crossed: reuse it
        queued, self.queued, self.used = self.queued, [], 0
        reader = Reader.shared()
        # In pieces that keep every reader thread busy: a buffer made small by a host budget
        # (140 MB for bench/offload_disk.py) is otherwise read in a few of the reader's chunks.
        piece = max(1 << 20, -(-self.size // reader.threads))
        reader.read_parts([(src, s + o, host_bytes(buf.ptr + at + o, min(piece, n - o)))
                           for src, s, n, _, at in queued for o in range(0, n, piece)])
        self.done[i] = self.lane.run([(dst, buf.ptr + at, n) for _, _, n, dst, at in queued])[1]

    def prepare(self) -> None:
        """Make the pinned buffers now (NOTE [home beside the resident groups]: before a thread
        starts faulting in the home's pages, which slows the mappings made beside it)."""
        if self.size:
            for i in range(FILL_BUFFERS):
                self._buffer(i)

    def _buffer(self, i: int) -> Any:
        while i >= len(self.bufs):
            self.bufs.append(self.be.host_alloc(self.size, pooled=False))
        return self.bufs[i]

    def close(self) -> None:
        """Read and copy what is queued, and wait for every copy."""
        try:
            self._flush()
        finally:
            self.discard()

    def discard(self) -> None:
        """Wait for the copies under way and give the buffers back; what is queued is dropped."""
        self.queued, self.used = [], 0
        try:
            for ev in self.done:
                if ev is not None:
                    self.be.synchronize(ev)
        finally:
            for b in self.bufs:
                b.release()
            self.bufs, self.done = [], [None] * FILL_BUFFERS


def _view_of(tier: Tier, b: Any, t: Any) -> Any:
    """A torch view of buffer ``b`` shaped as ``t``."""
    return tier.backend.torch_view(b.ptr, b.nbytes, b.token(internal=True)).view(t.dtype).view(t.shape)


def _wrap_from(tier: Tier, tensors: list[Any], sources: list[Any], names: list[str], policy: Policy,
               room: int | None = None, ready: Callable[[], None] | None = None) -> list[TieredTensor]:
    """wrap_group's steps (one managed allocation, filled from the device side, each tensor rebound)
    with each tensor's bytes taken from its source (or itself): checkpoint tensors read through
    a few pinned buffers (:class:`_Filler`, within ``room`` host bytes), others one at a time, so
    the host never holds more than one tensor of a resident group (NOTE [weight source]).
    ``ready()``, if given, is called once the fill buffers exist, before any read."""
    import torch
    from ._dtypes import canonical
    from ._torch import fill_and_bind
    role = Role.WEIGHT if any(t.requires_grad for t in tensors) else Role.FROZEN_WEIGHT
    specs = [(tuple(t.shape), canonical(t.dtype)) for t in tensors]
    tts = tier.empty_group(specs, role=role, names=names, policy=Policy(preferred_location=Location.DEVICE))
    filler = _Filler(tier, sources, room)
    views: list[Any] = []
    try:
        if ready is not None:
            filler.prepare()
            ready()
        with torch.no_grad():
            views += [_view_of(tier, tt.buffer, t) for tt, t in zip(tts, tensors)]
            for tt, src in zip(tts, sources):
                if isinstance(src, FileTensor):
                    filler.add(tt.buffer.ptr, src)
            filler.close()
            for tt, t, src, view in zip(tts, tensors, sources, views):
                home = _origin(t)
                if src is not None:
                    if not isinstance(src, FileTensor):
                        view.copy_(_materialize(src))
                    # Bound to its own filled memory, so fill_and_bind's copy is one of the memory
                    # onto itself; the caller's rollback rebinds the original on failure.
                    t.data = view
                fill_and_bind(tier, tt, t)
                tt._origin_device = home
        tier.change_policies([tt.buffer for tt in tts], policy)
    except BaseException:
        filler.discard()
        views.clear()      # a traceback keeps this frame: its views must not keep the memory
        view = None        # noqa: F841
        for tt in tts:
            tt.buffer.bindings = []
            tt.free()
        raise
    return tts


def wrap_module(tier: Tier, module: Any, budget: int | str | None = None, **kwargs: Any) -> TieredModule:
    """Adopt every parameter and buffer of ``module``; see :class:`TieredModule` and NOTE
    [streaming plan]. ``budget`` is bytes, "8GB", or a share of the device like "25%" (NOTE [sizes]
    in _limits.py); :func:`weight_bytes` sizes a share of the module's weights."""
    return TieredModule(tier, module, budget, **kwargs)
