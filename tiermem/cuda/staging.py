"""The staging rings: shadow copies at the link's full rate (NOTE [staging ring]).

NOTE [staging ring]
    A copy between pinned host memory and device-resident managed pages runs measurably slower
    than the same copy to or from cudaMalloc memory, and splitting it over streams, or pulling it
    in with a kernel, did not close the gap. A copy between cudaMalloc memory and managed pages on
    the device runs far faster than the link, though. So the shadow copies go through a ring of
    cudaMalloc slots (two of 32 MiB): on the way in, tiermem's stream
    copies a slot's worth from the shadows into slot i over the link while a second stream copies
    slot i-1 on into the managed pages; on the way out the second stream fills the slots from the
    managed pages and tiermem's stream empties them over the link. The link never waits on a
    managed page, and the copies run at the cudaMalloc rate both ways. The figures, with the
    machine and the probes' JSON: docs/data-paths.md, "The staging rings".

    Two directions. Each direction has its own ring and its own tiermem stream (``um_h2d`` and
    ``um_d2h`` in core/sidestreams.py), so an eviction and a refill run at once: the link copies
    touch only pinned memory and the slots, and the two directions together run at nearly twice
    one direction's rate, where direct copies between pinned and managed memory on two streams,
    or both directions through one ring on one stream, run at one direction's (same section).

    Ordering. The second stream starts after everything queued on tiermem's stream before the
    session (the caller's work, fresh pages, earlier moves). A slot is refilled only after its
    last contents were copied on. A session ends with tiermem's stream after all of the second
    stream's work, so the transfer's end event, and every later drain of tiermem's stream (NOTE
    [discard fence] in cuda/backend.py), cover the whole copy. Sessions of one ring never overlap:
    the Tier's lock is held for a session's life, and every session ends with both its streams
    ordered, so the slots are free again for the next session on the same tiermem stream.

    Memory. A ring is device memory tiermem holds, allocated on first use and given back by
    ``Tier.trim()`` and ``close()``; under a budget it counts against the budget
    (``Tier.staging_bytes``). A prefetch makes room for the refills' ring only where the budget
    can hold it beside the tensors, and an eviction takes the evictions' ring only where the
    budget has room to spare. When tensors later need the room, the rings give way and stay off
    until the budget changes, so they never evict a tensor that the next move needs. "auto" keeps
    a ring out of budgets under 16 times its size (1 GiB for 64 MiB), where it costs too much of
    the room.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..base.limits import parse_bytes
from ..errors import ConfigError, TierMemError

__all__ = ["StagingRing", "Staging", "ring_slot", "SLOT", "MIN_STAGED", "DIRECTIONS"]

log = logging.getLogger("tiermem")
DIRECTIONS = ("h2d", "d2h")
PAGE = 4096
SLOT = 32 << 20        # two of these reached 0.98-1.00 (16 MiB: 0.97-0.98; 64 MiB: no better)
# Under this, a copy goes direct: the ring doubles the copy calls, and a few MiB gain microseconds.
MIN_STAGED = 4 << 20


class StagingRing:
    """``slots`` slots of ``slot`` bytes of plain device memory for one Tier's shadow copies."""

    def __init__(self, backend: Any, slot: int = SLOT, slots: int = 2):
        if slot <= 0 or slots < 2:
            raise ConfigError(f"a staging ring needs at least two slots of a positive size, got {slots} of {slot}")
        self.backend, self.slot, self.slots = backend, int(slot), int(slots)
        self.mem: Any = None
        self._stream: int | None = None

    @property
    def nbytes(self) -> int:
        return self.slot * self.slots

    @property
    def allocated(self) -> bool:
        return self.mem is not None

    def allocate(self) -> None:
        """Take the ring's device memory; raises MemoryError (the driver's) if there is none."""
        if self.mem is None:
            # The stream first: memory taken before a stream that then failed would leave a ring
            # that is allocated but has no stream of its own (tests/test_faults.py).
            if self._stream is None:
                self._stream = self.backend.new_stream()
            # From the driver, not a pool: trim() is there to hand device memory to others.
            self.mem = self.backend.device_alloc(self.nbytes, pooled=False)

    def drop_stream(self) -> list[int]:
        """Forget the ring's own stream (its memory must be released first); returns it, for the
        caller to destroy."""
        s, self._stream = self._stream, None
        return [] if s is None else [s]

    def release(self, side: int) -> None:
        """Give the memory back to the driver once the work queued on ``side`` (which is after
        every session's work, see the NOTE) is done."""
        if self.mem is None:
            return
        done = self.backend.new_event()
        self.backend.record(done, side)
        self.backend.synchronize(done)
        self.mem.release()
        self.mem = None

    def session(self, side: int, direction: str) -> "_Session":
        """Copies through the ring on ``side`` (tiermem's stream): ``direction`` "h2d" copies
        pinned sources into managed destinations, "d2h" the other way."""
        if self.mem is None:
            raise TierMemError("the staging ring holds no memory (not allocated yet, or released): no copy can go through it")
        if direction not in DIRECTIONS:
            raise ConfigError(f"direction is 'h2d' or 'd2h', not {direction!r}")
        return _Session(self, side, direction)


def ring_slot(setting: int | str | None) -> tuple[bool, int] | None:
    """(auto, slot bytes) of the rings a ``staging`` setting asks for, or None for no rings.
    Needs no device, so that Tier checks the setting before it looks for one."""
    if isinstance(setting, str) and setting.strip().lower() in ("auto", "off"):
        return (True, SLOT) if setting.strip().lower() == "auto" else None
    if setting is None:
        return None
    n = parse_bytes(setting, what="staging")
    if n == 0:
        return None
    if n < 2 << 20:
        raise ConfigError(f"staging={setting!r}: a ring needs at least 2 MiB (two slots of 1 MiB); "
                          "staging='off' turns the rings off")
    return False, n // 2 // PAGE * PAGE


class Staging:
    """A Tier's staging rings, one per direction, from Tier's ``staging`` setting: "auto" (two
    32 MiB slots per direction, kept out of small budgets), a size per direction (always on), or
    "off" (also 0 or None)."""

    def __init__(self, backend: Any, setting: int | str | None):
        self.auto, self.yielded, self.refused = False, False, 0
        self.min_bytes = MIN_STAGED
        self.rings: dict[str, StagingRing | None] = dict.fromkeys(DIRECTIONS)
        plan = ring_slot(setting)
        if plan is None:
            return
        self.auto, slot = plan
        self.rings = {d: StagingRing(backend, slot) for d in DIRECTIONS}

    @property
    def nbytes(self) -> int:
        """Device bytes the allocated rings hold."""
        return sum(r.nbytes for r in self.rings.values() if r is not None and r.allocated)

    def drop_streams(self) -> list[int]:
        """The rings' own streams, forgotten (see :meth:`StagingRing.drop_stream`)."""
        return [s for r in self.rings.values() if r is not None and not r.allocated for s in r.drop_stream()]

    def ring(self, direction: str) -> StagingRing | None:
        return self.rings[direction]

    def wanted(self, direction: str, nbytes: int, budget: int | None) -> bool:
        """Whether ``nbytes`` of shadow copies in ``direction`` should go through its ring."""
        r = self.rings[direction]
        if r is None or self.yielded or nbytes < self.min_bytes:
            return False
        return not self.auto or budget is None or budget >= 16 * r.nbytes

    def allocate(self, direction: str) -> bool:
        """Allocate a ring (the budget must have room for it already). False if the device is
        full, which turns that ring off: its copies then go direct, at ~0.92 of the link."""
        r = self.rings[direction]
        try:
            r.allocate()
        except MemoryError as e:
            # The message, not the error: a handler that keeps the record would keep the error's
            # frames, and the buffers they hold, alive.
            log.warning("tiermem: no device memory for the %d-byte %s staging ring (%s); its shadow copies "
                        "go direct from now on", r.nbytes, direction, str(e))
            self.rings[direction] = None
            self.refused += 1
            return False
        return True

    def release(self, side_of: Callable[[str], int], budget: int | None = None, unwanted_only: bool = False) -> int:
        """Give allocated rings back, once the work on their tiermem streams is done; with
        ``unwanted_only``, only those ``budget`` no longer wants. Returns the bytes."""
        freed = 0
        for d, r in self.rings.items():
            if r is None or not r.allocated:
                continue
            if unwanted_only and self.wanted(d, self.min_bytes, budget):
                continue
            r.release(side_of(d))
            freed += r.nbytes
        return freed


class _Session:
    """One batch of copies through the ring. ``add`` as many as needed, then ``close``.

    In each slot's cycle, the "link" stream does the copy across the link (tiermem's stream on
    the way in, as on the way out) and the "device" stream does the device-side copy; which one
    goes first depends on the direction.
    """

    def __init__(self, ring: StagingRing, side: int, direction: str):
        self.ring, self.side, self.inward = ring, side, direction == "h2d"
        self.stage = ring._stream
        self.base = ring.mem.ptr
        self.slot = 0           # the slot being filled
        self.fill = 0           # bytes in it so far
        self.pending: list[tuple[int, int, int]] = []   # (final destination, slot address, bytes)
        self.freed = [None] * ring.slots     # event: the slot's last contents moved on (None: unused)
        self.started = False

    # The stream that fills a slot, and the one that empties it.
    def _first(self) -> int:
        return self.side if self.inward else self.stage

    def _second(self) -> int:
        return self.stage if self.inward else self.side

    def add(self, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` from ``src`` to ``dst`` through the ring."""
        be, size = self.ring.backend, self.ring.slot
        if not self.started:
            go = be.new_event()
            be.record(go, self.side)
            be.wait(self.stage, go)
            self.started = True
        while nbytes > 0:
            if self.fill == 0 and self.freed[self.slot] is not None:
                be.wait(self._first(), self.freed[self.slot])
            k = min(nbytes, size - self.fill)
            at = self.base + self.slot * size + self.fill
            be.copy(at, src, k, self._first())
            self.pending.append((dst, at, k))
            self.fill += k
            dst, src, nbytes = dst + k, src + k, nbytes - k
            if self.fill == size:
                self._flush()

    def _flush(self) -> None:
        be = self.ring.backend
        landed = be.new_event()
        be.record(landed, self._first())
        be.wait(self._second(), landed)
        for dst, at, k in self.pending:
            be.copy(dst, at, k, self._second())
        freed = be.new_event()
        be.record(freed, self._second())
        self.freed[self.slot] = freed
        self.pending, self.fill = [], 0
        self.slot = (self.slot + 1) % self.ring.slots

    def close(self) -> None:
        """Enqueue what is left, and order tiermem's stream after all of it."""
        if not self.started:
            return
        if self.fill:
            self._flush()
        if self.inward:         # the last copies ran on the second stream
            be = self.ring.backend
            done = be.new_event()
            be.record(done, self.stage)
            be.wait(self.side, done)
