"""Telemetry: a stats record per role, and one flat dict with documented keys.

Keys of :func:`tiermem.stats` (ROLE is a role name, or ``all`` for the sum over roles; ``all``
peaks are peaks of the sum, not sums of peaks):

    allocated_bytes.ROLE.{current,peak,total,freed}   bytes of live tiered buffers (requested
                                                      sizes), their peak, and all ever allocated
                                                      and freed
    allocation_count.ROLE.{current,peak,total,freed}  the same, counted in buffers
    resident_bytes.ROLE.{current,peak}                device bytes tiermem holds (whole pages:
                                                      what counts against the budget), parked
                                                      pages of evicted tensors included
    moved_bytes.ROLE.{h2d,d2h}                        bytes tiermem moved each way
    moved_seconds.ROLE.{h2d,d2h}                      device time of those moves, from CUDA events
                                                      (only moves that have completed)
    ops.ROLE.{prefetch,evict,evict_clean,evict_um,evict_budget}
                                                      buffers prefetched; evicted; evicted with no
                                                      data moved; evicted through Unified Memory's
                                                      own write-back (slow path); evicted to make
                                                      room in the budget
    ops.ROLE.{evict_park,refill_reuse,park_release}   evictions that kept their device pages;
                                                      refills into kept pages (no discard, no fresh
                                                      pages); kept pages given back to the driver
                                                      (NOTE [parked pages] in core/parking.py)
    staged_bytes.ROLE.{h2d,d2h}                       of moved bytes, those that went through the
                                                      staging ring (NOTE [staging ring])
    advice.ROLE.{applied,skipped}                     cudaMemAdvise calls made, and skipped because
                                                      the device lacks the capability
    prefetch.ROLE.skipped                             prefetches skipped for the same reason
    managed.reserved_bytes.{current,peak}             raw managed bytes from the driver (pools'
                                                      caches included): what the cap limits
    managed.cap_bytes, managed.refused_count          the cap, and allocations it refused
    managed.pool_cached_bytes                         bytes pools hold for reuse
    budget_bytes                                      the device budget (-1: none)
    shadow_bytes.current                              pinned host memory held as shadow copies
    parked_bytes.current                              of resident bytes, device pages kept from
                                                      evictions for the next refill
    staging_bytes.current                             device bytes of the staging rings (0 until
                                                      first used; count against the budget)
    staging.refused_count                             rings the device had no memory for (0-2;
                                                      their copies then go direct)

Keys that belong to no role (NOTE [allocator arrays in place] in cupy/scoped.py):

    residency.budget_overruns                         budget checks (a CuPy allocation under
                                                      pressure, Tier.use) that found tiermem's device
                                                      memory above the budget, because arrays came back
                                                      behind its back; each check then evicts to fit
    residency.budget_overrun_bytes                    the bytes those checks found above the budget
    residency.faulted_back_{count,bytes}              evicted allocator arrays found on the device again
                                                      (prefetched or re-advised by someone else), and
                                                      their bytes; re-marked resident when found
    residency.in_place_bytes.current                  bytes of evicted allocator arrays that kernels read
                                                      and write in place on the host, without migrating
    residency.retained_bytes.current                  device pages the driver keeps for allocator arrays
                                                      whose data left the device (NOTE [retained pages]):
                                                      not live data and not under the budget; the driver's
                                                      used memory is resident + staging + retained bytes
    use.calls, use.bytes                              Tier.use scopes, and the bytes they brought in
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ..roles import Role

__all__ = ["RoleStats", "Accounting", "EXTRA_KEYS", "count_delta"]

log = logging.getLogger("tiermem")

# The flat keys that belong to no role, documented above.
EXTRA_KEYS = ("residency.budget_overruns", "residency.budget_overrun_bytes", "residency.faulted_back_count",
              "residency.faulted_back_bytes", "residency.in_place_bytes.current", "residency.retained_bytes.current",
              "use.calls", "use.bytes")


@dataclasses.dataclass
class RoleStats:
    """Counters for one role (or for all). Byte counts in bytes, times in seconds."""

    allocated_current: int = 0
    allocated_peak: int = 0
    allocated_total: int = 0
    allocated_freed: int = 0
    count_current: int = 0
    count_peak: int = 0
    count_total: int = 0
    count_freed: int = 0
    resident_current: int = 0
    resident_peak: int = 0
    moved_h2d_bytes: int = 0
    moved_d2h_bytes: int = 0
    moved_h2d_seconds: float = 0.0
    moved_d2h_seconds: float = 0.0
    prefetch_ops: int = 0
    evict_ops: int = 0
    evict_clean_ops: int = 0
    evict_um_ops: int = 0
    evict_budget_ops: int = 0
    evict_park_ops: int = 0
    refill_reuse_ops: int = 0
    park_release_ops: int = 0
    staged_h2d_bytes: int = 0
    staged_d2h_bytes: int = 0
    advice_applied: int = 0
    advice_skipped: int = 0
    prefetch_skipped: int = 0

    def flat(self, role: str) -> dict[str, float]:
        return {
            f"allocated_bytes.{role}.current": self.allocated_current,
            f"allocated_bytes.{role}.peak": self.allocated_peak,
            f"allocated_bytes.{role}.total": self.allocated_total,
            f"allocated_bytes.{role}.freed": self.allocated_freed,
            f"allocation_count.{role}.current": self.count_current,
            f"allocation_count.{role}.peak": self.count_peak,
            f"allocation_count.{role}.total": self.count_total,
            f"allocation_count.{role}.freed": self.count_freed,
            f"resident_bytes.{role}.current": self.resident_current,
            f"resident_bytes.{role}.peak": self.resident_peak,
            f"moved_bytes.{role}.h2d": self.moved_h2d_bytes,
            f"moved_bytes.{role}.d2h": self.moved_d2h_bytes,
            f"moved_seconds.{role}.h2d": self.moved_h2d_seconds,
            f"moved_seconds.{role}.d2h": self.moved_d2h_seconds,
            f"ops.{role}.prefetch": self.prefetch_ops,
            f"ops.{role}.evict": self.evict_ops,
            f"ops.{role}.evict_clean": self.evict_clean_ops,
            f"ops.{role}.evict_um": self.evict_um_ops,
            f"ops.{role}.evict_budget": self.evict_budget_ops,
            f"ops.{role}.evict_park": self.evict_park_ops,
            f"ops.{role}.refill_reuse": self.refill_reuse_ops,
            f"ops.{role}.park_release": self.park_release_ops,
            f"staged_bytes.{role}.h2d": self.staged_h2d_bytes,
            f"staged_bytes.{role}.d2h": self.staged_d2h_bytes,
            f"advice.{role}.applied": self.advice_applied,
            f"advice.{role}.skipped": self.advice_skipped,
            f"prefetch.{role}.skipped": self.prefetch_skipped,
        }


class Accounting:
    """Thread-safe counters per role, plus the sum over roles with its own peaks."""

    def __init__(self) -> None:
        # Re-entrant: a buffer's destructor updates these counters, and the garbage collector can
        # run it in the middle of a locked section of this same thread.
        self._lock = threading.RLock()
        self.by_role: dict[Role, RoleStats] = {r: RoleStats() for r in Role}
        self.all = RoleStats()
        self.extra: dict[str, int] = dict.fromkeys(EXTRA_KEYS, 0)
        self._refreshers: list[Callable[[], None]] = []

    def add_refresher(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` before every :meth:`flat`, so that state the driver may have changed behind
        tiermem's back (NOTE [allocator arrays in place] in cupy/scoped.py) is brought up to date first.
        ``fn`` runs without this object's lock held; an error in it is logged, never raised."""
        with self._lock:
            self._refreshers.append(fn)

    def count_extra(self, key: str, n: int = 1) -> None:
        """Add ``n`` to a key that belongs to no role (``EXTRA_KEYS``)."""
        with self._lock:
            self.extra[key] += n

    def set_extra(self, key: str, value: int) -> None:
        with self._lock:
            self.extra[key] = value

    def _both(self, role: Role) -> tuple[RoleStats, RoleStats]:
        return self.by_role[role], self.all

    def on_alloc(self, role: Role, nbytes: int) -> None:
        with self._lock:
            for s in self._both(role):
                s.allocated_current += nbytes
                s.allocated_total += nbytes
                s.allocated_peak = max(s.allocated_peak, s.allocated_current)
                s.count_current += 1
                s.count_total += 1
                s.count_peak = max(s.count_peak, s.count_current)

    def on_free(self, role: Role, nbytes: int) -> None:
        with self._lock:
            for s in self._both(role):
                s.allocated_current -= nbytes
                s.allocated_freed += nbytes
                s.count_current -= 1
                s.count_freed += 1

    def on_resident(self, role: Role, delta: int) -> None:
        with self._lock:
            for s in self._both(role):
                s.resident_current += delta
                s.resident_peak = max(s.resident_peak, s.resident_current)

    def on_move(self, role: Role, direction: str, nbytes: int) -> None:
        with self._lock:
            for s in self._both(role):
                setattr(s, f"moved_{direction}_bytes", getattr(s, f"moved_{direction}_bytes") + nbytes)

    def on_move_time(self, shares: dict[Role, int], direction: str, seconds: float) -> None:
        """Split a completed transfer's device time over roles by the bytes each moved."""
        total = sum(shares.values())
        if total <= 0:
            return
        with self._lock:
            for role, n in shares.items():
                s = self.by_role[role]
                setattr(s, f"moved_{direction}_seconds", getattr(s, f"moved_{direction}_seconds") + seconds * n / total)
            setattr(self.all, f"moved_{direction}_seconds", getattr(self.all, f"moved_{direction}_seconds") + seconds)

    def count(self, role: Role, field: str, n: int = 1) -> None:
        with self._lock:
            for s in self._both(role):
                setattr(s, field, getattr(s, field) + n)

    def count_many(self, counts: Mapping[tuple[Role, str], int]) -> None:
        """Many ``count`` calls under one lock: {(role, field): n}."""
        with self._lock:
            for (role, field), n in counts.items():
                for s in self._both(role):
                    setattr(s, field, getattr(s, field) + n)

    def snapshot(self) -> tuple[dict[Role, RoleStats], RoleStats]:
        with self._lock:
            return ({r: dataclasses.replace(s) for r, s in self.by_role.items()}, dataclasses.replace(self.all))

    def flat(self) -> dict[str, Any]:
        with self._lock:
            refreshers = list(self._refreshers)
        for fn in refreshers:
            try:
                fn()
            except Exception:  # stats must always answer; the stale figures are still the books'
                log.exception("tiermem: error while refreshing residency for the stats")
        by_role, total = self.snapshot()
        out: dict[str, Any] = {}
        for r, s in by_role.items():
            out.update(s.flat(r.value))
        out.update(total.flat("all"))
        with self._lock:
            out.update(self.extra)
        return out


def count_delta(before: tuple[dict[Role, RoleStats], RoleStats],
                after: tuple[dict[Role, RoleStats], RoleStats]) -> dict[tuple[Role, str], int]:
    """{(role, field): n} of the move counters (bytes and operations) that grew between two
    :meth:`Accounting.snapshot` s: what a captured graph's replay adds with ``count_many``."""
    out: dict[tuple[Role, str], int] = {}
    for role, s in after[0].items():
        b = before[0][role]
        for f in dataclasses.fields(s):
            if not (f.name.startswith("moved_") and f.name.endswith("_bytes")) and not f.name.endswith("_ops"):
                continue
            x, y = getattr(b, f.name), getattr(s, f.name)
            if isinstance(y, int) and y != x:
                out[(role, f.name)] = y - x
    return out
