"""The residency plan of an adopted module: which of its groups stay resident within a device
budget and which stream (:func:`plan_residency`), and which streamed groups are read from disk
within a host budget (:func:`plan_host`, :func:`stay_home`). Pure functions; no GPU.

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
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import ConfigError, TierMemError

__all__ = ["Plan", "plan_residency", "plan_host", "stay_home", "LINK_GBPS", "LOOKAHEAD"]

LINK_GBPS = 55.0  # pinned H2D on the H100 machine (docs/facts.md); plans quote time at this rate
LOOKAHEAD = 3     # groups in flight by default (the window's slots)


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
    kv_budget: int = 0                      # device bytes beside ``budget`` kept for the KV cache (NOTE [kv plan])
    kv: Any = None                          # the KV cache's KVPlan (inference/kvplan.py), once it is known

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
        lines = [] if not self.kv_budget else [
            f"one budget of {gb(self.budget + self.kv_budget).strip()}: {gb(self.budget).strip()} for the weights, "
            f"{gb(self.kv_budget).strip()} for the KV cache"]
        if self.kv is not None:
            lines.append(self.kv.table(link_GBps))
        lines += [f"budget {gb(self.budget)} of {gb(self.total)} weights: {len(self.pinned)} of {len(self.sizes)} groups "
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
    from ..errors import HostBudgetError
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
        raise ConfigError(f"{total:,} streamed bytes do not fit host_budget={host_budget:,}, and groups on disk "
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
