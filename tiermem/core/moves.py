"""Moves: refills onto the device and evictions off it, through the staging rings where they pay.

NOTE [eviction paths]
    Each buffer leaves the device by the fastest path that is safe for it (:meth:`Moves.evict_path`):
      - "copy": dirty data is copied to a pinned shadow, then the managed range is discarded.
        An explicit copy runs near the link's rate, where Unified Memory's own write-back runs
        at a fraction of it. The discard costs host time in the driver and cannot overlap the
        copies: it waits for all work on the device, on every stream, before it does its own.
        Discarding each piece right after its copy lost data now and then (NOTE [discard fence]
        in cuda/backend.py). So all of a call's copies go first, then one fenced discard; and
        under a budget there is no discard at all (NOTE [parked pages]).
      - "discard": a clean buffer whose shadow is still valid: the discard (or the parking)
        alone, nothing over the link.
      - "collapse": a read-mostly duplicate with the host as preferred location: unsetting
        read-mostly collapses the copies onto the host, a host-side call, nothing over the link.
      - "um": Unified Memory's own write-back, the fallback that keeps every pointer valid.
      - "skip": a device that cannot prefetch.
    The shadow paths need NOTE [views and the fast paths] (in core/tensor.py) to hold, a buffer
    that owns whole 2 MiB pages (or parks), and no read-mostly advice. The rate of each path,
    with the machine and the probes' JSON: docs/data-paths.md, "Why copy plus discard stopped at
    ~0.78" and "What tiermem does, and what it found on the way".

NOTE [failed moves]
    Any CUDA call can fail, and Ctrl-C can arrive during any of them (tests/test_faults.py fails
    each call of each operation in turn). A move that fails leaves every buffer as it found it,
    with the budget's books matching, until the one call that destroys data: the discard of
    managed pages whose data has been copied to the shadows. ``move_in`` and ``move_out``
    snapshot the state of the buffers they move (``_MOVE_STATE``) and put it back when anything
    before that discard fails, counters included (``_roll_back``); tensors tiermem bound follow
    the data back. That is safe because until the discard the managed range still holds the
    data (a refill never writes a shadow, an eviction's copies only write shadows), and because
    between two backend calls every counter agrees with every buffer's state. Shadows a failed
    eviction allocated stay with their buffers (counted, and marked stale): the next eviction
    uses them. A failure of the discard itself, or after it, leaves the eviction done: the
    discard may have dropped the pages (a Ctrl-C can land just as it returns), and the data is
    in the shadows, whose copies the stream runs before the discard. The error is raised as it
    came: tiermem's CUDAError with the call and the CUDA error's name, or the KeyboardInterrupt.
"""
from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from typing import Any

from ..roles import Advice, Location, Role
from .advice import Advisor
from .bindings import detach_for_discard, rebind
from .books import Books
from .parking import Parking
from .ranges import coalesce
from .sidestreams import SideStreams
from .tensor import Buffer
from .transfer import Transfer

__all__ = ["Moves"]

# What a move changes in a buffer, put back when it fails (NOTE [failed moves]).
_MOVE_STATE = ("block", "ptr", "where", "shadow_valid", "in_shadow", "parked", "host_valid")


class Moves:
    """Enqueues the moves of buffers between the device and the host (their managed ranges'
    pages, or their pinned shadows), each all-or-nothing (NOTE [failed moves]). Making room for
    them under the budget is core/eviction.py's; this part moves what it is given."""

    def __init__(self, backend: Any, books: Books, streams: SideStreams, advisor: Advisor, parking: Parking):
        self.backend = backend
        self.books = books
        self.streams = streams
        self.advisor = advisor
        self.parking = parking

    # -- the staging rings --------------------------------------------------------------------------
    def _stage(self, nbytes: int, direction: str, grow: bool = True) -> Any:
        """A ring session for ``nbytes`` of shadow copies in ``direction``, or None to copy
        direct. Without a budget a ring is allocated here. Under one, a prefetch has made room
        for the refills' ring already (``Eviction.room_for``); an eviction the caller asked for
        (``grow``) takes its ring where the budget has room to spare, since parked pages keep
        counting. One that makes room for something else never does: the room is spoken for."""
        staging, budget = self.books.staging, self.books.budget
        if not staging.wanted(direction, nbytes, budget):
            return None
        ring = staging.ring(direction)
        if not ring.allocated:
            if budget is not None and (direction == "h2d" or not grow
                                       or self.books.held() + ring.nbytes > budget):
                return None
            if not staging.allocate(direction):
                return None
        return ring.session(self.streams.um(direction), direction)

    # -- all or nothing -----------------------------------------------------------------------------
    @staticmethod
    def _snapshot(bufs: Iterable[Buffer]) -> list[tuple[Buffer, tuple]]:
        return [(b, tuple(getattr(b, f) for f in _MOVE_STATE)) for b in bufs]

    def _roll_back(self, snap: list[tuple[Buffer, tuple]]) -> None:
        """Put the buffers of ``snap`` back as they were, with the counters (NOTE [failed
        moves]): each buffer's held pages and parked pages go back to what they were."""
        for b, vals in snap:
            held = b.span if (b.where is Location.DEVICE or b.parked) else 0
            parked = b.span if b.parked else 0
            for f, v in zip(_MOVE_STATE, vals):
                setattr(b, f, v)
            d = (b.span if (b.where is Location.DEVICE or b.parked) else 0) - held
            if d:
                self.books.on_resident(b.role, d)
            self.books.parked += (b.span if b.parked else 0) - parked
            if b.bindings:    # tensors tiermem bound follow the data back
                rebind(self.backend, b, shadow=b.in_shadow)

    # -- refills ------------------------------------------------------------------------------------
    def move_in(self, todo: list[Buffer], stream: Any, non_blocking: bool,
                pairs: Mapping[Buffer, Buffer] | None = None) -> Transfer:
        """Enqueue the moves of ``todo`` to the device; ``pairs`` maps shadowed buffers to the
        parked buffers whose pages they take (NOTE [parked pages]). On failure, nothing moved
        (NOTE [failed moves])."""
        snap = self._snapshot([*todo, *(pairs.values() if pairs else ())])
        try:
            return self._move_in(todo, stream, non_blocking, pairs)
        except BaseException:
            self._roll_back(snap)
            raise

    def _move_in(self, todo: list[Buffer], stream: Any, non_blocking: bool,
                 pairs: Mapping[Buffer, Buffer] | None) -> Transfer:
        be = self.backend
        caps = be.capabilities()
        books, acc = self.books, self.books.accounting
        cur, side = self.streams.stream_handle(stream), self.streams.um("h2d")
        start = self.streams.begin(todo, cur, side)
        for d in pairs.values() if pairs else ():
            # its eviction, on the other stream, must have copied out of the pages first
            if d.pending is not None and d.pending.stream != side and not d.pending.done():
                be.wait(side, d.pending.event)
        moved: dict[Role, int] = {}
        um = [b for b in todo if not b.in_shadow]
        shadowed = [b for b in todo if b.in_shadow]
        intact = {b for b in shadowed if self.intact(b)}
        pairs = pairs or {}
        fresh = [b for b in shadowed if not b.parked and b not in pairs]
        if um:
            if caps.supports("prefetch"):
                be.prefetch(coalesce((b.block.alloc, *self.advisor.page_range(b)) for b in um), Location.DEVICE, side)
            else:
                for b in um:
                    acc.count(b.role, "prefetch_skipped")
            for b in um:
                if b.where is Location.HOST:  # unplaced buffers only get pages: nothing crosses the link
                    moved[b.role] = moved.get(b.role, 0) + b.nbytes
        if fresh:   # device pages first, then the shadow's bytes
            self.fresh_pages(fresh, Location.DEVICE, side)
        stage = self._stage(self.copy_in_bytes(shadowed), "h2d")
        # Largest first, each taking its pages just before its copy: the link is busy while the
        # host does the rest (the host's work before the first copy is time the link stands idle).
        for b in sorted(shadowed, key=lambda b: -b.nbytes):
            if b in pairs:
                self.parking.take_pages(b, pairs[b])
            if b not in intact:
                if stage is not None:
                    stage.add(b.ptr, b.shadow.ptr, b.nbytes)
                else:
                    be.copy(b.ptr, b.shadow.ptr, b.nbytes, side)
                moved[b.role] = moved.get(b.role, 0) + b.nbytes
        if stage is not None:
            stage.close()
            acc.count_many(collections.Counter(
                {(r, "staged_h2d_bytes"): n for r, n in moved.items() if n}))
        for b in todo:
            if b.in_shadow:    # first, so that a failure finds the buffer untouched (NOTE [failed moves])
                rebind(be, b, shadow=False)
            was_host = b.where is Location.HOST and not b.in_shadow and b.host_valid
            if b.parked:   # its pages were counted all along
                books.unpark(b, pages_gone=False)
                b.where = Location.DEVICE
                acc.count(b.role, "refill_reuse_ops")
            b.in_shadow = False
            # A device write would invalidate host copies; only read-only buffers keep theirs.
            b.shadow_valid = b.shadow_valid and b.policy.read_only
            b.host_valid = b.policy.read_only and b.policy.read_mostly and (was_host or b.host_valid)
            if b.where is not Location.DEVICE:
                books.on_resident(b.role, b.span)
            b.where = Location.DEVICE
            acc.count(b.role, "prefetch_ops")
        for r, n in moved.items():
            acc.on_move(r, "h2d", n)
        return self.streams.finish("h2d", todo, cur, side, start, moved, non_blocking)

    @staticmethod
    def intact(b: Buffer) -> bool:
        """A parked buffer's own pages still hold its data if it is read-only (nothing may write its
        shadow) and its shadow is valid: the refill then moves nothing."""
        return b.in_shadow and b.parked and b.policy.read_only and b.shadow_valid

    @classmethod
    def copy_in_bytes(cls, todo: list[Buffer]) -> int:
        """Bytes a refill of ``todo`` copies from shadows."""
        return sum(b.nbytes for b in todo if b.in_shadow and not cls.intact(b))

    def fresh_pages(self, bufs: list[Buffer], location: Location, side: int) -> None:
        """Give shadowed buffers without pages new pages at ``location``; their old contents are
        stale (the data is in the shadow). Whole pages get them by discard-and-prefetch, with
        nothing migrated; shared pages cannot be discarded, so they migrate, stale contents and
        all (NOTE [parked pages], "Small buffers")."""
        whole = [b for b in bufs if b.owns_pages]
        shared = [b for b in bufs if not b.owns_pages]
        if whole:
            self.streams.quiesce()
            self.backend.discard_and_prefetch(coalesce((b.block.alloc, b.ptr, b.span) for b in whole), location, side)
        if shared:
            self.backend.prefetch(coalesce((b.block.alloc, *self.advisor.page_range(b)) for b in shared), location, side)

    # -- evictions ----------------------------------------------------------------------------------
    def evict(self, bufs: list[Buffer], *, stream: Any = None, non_blocking: bool = False,
              release: bool | None = None, path: str | None = None, for_room: bool = False) -> Transfer:
        """:meth:`Tier.evict` of ``bufs``: each by the fastest safe path (NOTE [eviction paths]),
        parking shadow evictions under a budget unless ``release`` (NOTE [parked pages]).
        ``path`` forces one path; ``for_room`` says the eviction makes room for something else,
        so it takes no staging ring of its own."""
        park = self.books.budget is not None and not release
        with self.books.lock:
            self.streams.reap()
            for b in bufs:
                if b.where is None:  # never placed: no pages anywhere, nothing to move
                    b.where = Location.HOST
            todo = [b for b in bufs if b.where is Location.DEVICE]
            if release:
                self.parking.drop([b for b in bufs if b.parked])
            if not todo:
                return Transfer.done_now("d2h")
            tr, collapse = self.move_out(todo, stream, non_blocking, path, park, grow_ring=not for_room)
        self.collapse(collapse)
        return tr

    def collapse(self, ranges: list[tuple[int, int, bool, Any]]) -> None:
        """Unset read-mostly on ``ranges`` (from :meth:`move_out`), so their copies collapse onto
        the host, and set it again where asked."""
        # Collapsing read-mostly copies is a host-side driver call that takes tens of ms per GiB
        # (docs/data-paths.md, "What tiermem does"); it runs outside the lock so that other threads
        # can keep enqueuing moves meanwhile. It moves no data. It is not stream-ordered, so it first
        # waits for the kernels a buffer's fence covers (NOTE [collapse fence] in cupy/scoped.py).
        fences = {id(f): f for *_, f in ranges if f is not None}
        for f in fences.values():
            if not self.backend.query(f):
                self.backend.synchronize(f)
        for ptr, n, again, _ in ranges:
            self.backend.advise(ptr, n, Advice("read_mostly", False, Location.DEVICE))
            if again:
                self.backend.advise(ptr, n, Advice("read_mostly", True, Location.DEVICE))

    def evict_path(self, b: Buffer, park: bool = False) -> str:
        """How ``b`` leaves the device (NOTE [eviction paths]): "skip", "collapse", "discard",
        "copy" or "um"."""
        caps = self.backend.capabilities()
        if not caps.supports("prefetch"):
            return "skip"
        pol = b.policy
        if pol.read_mostly and b.host_valid and pol.preferred_location is Location.HOST:
            return "collapse"
        # A buffer that shares 2 MiB pages may take the shadow path only when it parks: then
        # nothing is discarded (NOTE [parked pages], "Small buffers").
        if caps.supports("discard") and (b.owns_pages or park) and not pol.read_mostly:
            # Never on a read-mostly range: after a device write, a copy out, a discard and a
            # refill of one lost data (tests/test_gpu_stress.py found it; the driver's read
            # duplicates do not follow the discard; docs/data-paths.md, "What tiermem does").
            # Read-mostly data collapses or goes by UM.
            return "discard" if b.shadow_valid else "copy"
        return "um"

    def move_out(self, todo: list[Buffer], stream: Any, non_blocking: bool,
                 force: str | None = None, park: bool = False,
                 grow_ring: bool = True) -> tuple[Transfer, list[tuple[int, int, bool, Any]]]:
        """Enqueue the evictions of ``todo``; returns the transfer and the ranges whose read-mostly
        copies the caller must collapse (after releasing the lock), each with whether read-mostly
        is set again and the fence to wait for first. With ``park``, shadow
        evictions keep their pages (NOTE [parked pages]) instead of discarding them."""
        snap = self._snapshot(todo)
        discarded: list[bool] = []    # once the discard is asked for, the eviction stands (NOTE [failed moves])
        try:
            return self._move_out(todo, stream, non_blocking, force, park, grow_ring, discarded)
        except BaseException:
            if not discarded:
                self._roll_back(snap)
            raise

    def _move_out(self, todo: list[Buffer], stream: Any, non_blocking: bool, force: str | None,
                  park: bool, grow_ring: bool, discarded: list[bool]) -> tuple[Transfer, list[tuple[int, int]]]:
        be = self.backend
        books = self.books
        cur, side = self.streams.stream_handle(stream), self.streams.um("d2h")
        start = self.streams.begin(todo, cur, side)
        moved: dict[Role, int] = {}
        discards: list[Buffer] = []
        collapse: list[Buffer] = []
        # Counted once at the end: each count takes the stats lock, and under budget pressure
        # this loop runs on the host before the refill's first copy (link idle meanwhile).
        ops: collections.Counter[tuple[Role, str]] = collections.Counter()
        stage: Any = None    # the ring session, opened at the first copy (False: copies go direct)
        for b in todo:
            path = force or self.evict_path(b, park)
            if path in ("discard", "copy"):
                if b.foreign_views() or not (b.owns_pages or park):
                    path = "um"
                else:
                    if path == "copy" and b.shadow is None:
                        b.shadow = be.host_alloc(b.nbytes)
                        books.shadow_bytes += b.shadow.nbytes
                    if not detach_for_discard(be, b):
                        path = "um"
            if path == "skip":
                ops[b.role, "prefetch_skipped"] += 1
            elif path == "collapse":
                # Unset read-mostly: the copies collapse onto the preferred location, the host,
                # whose copy is current, so nothing moves; then read-mostly is set again, unless
                # a read-only scope only lent it (NOTE [read-only scopes] in cupy/scoped.py). (A
                # device write to a read-only buffer breaks that promise; see Policy.read_only.)
                collapse.append(b)
                ops[b.role, "advice_applied"] += 1 if b.read_mostly_while_resident else 2
                ops[b.role, "evict_clean_ops"] += 1
            elif path == "discard":
                if park:
                    books.park(b)
                    ops[b.role, "evict_park_ops"] += 1
                else:
                    discards.append(b)   # one batched discard for all of them, below
                b.in_shadow = True
                ops[b.role, "evict_clean_ops"] += 1
            elif path == "copy":
                # One call per buffer: copies out of managed memory run at one rate in any size
                # of piece (docs/data-paths.md, "Why copy plus discard stopped at ~0.78"), and
                # through the ring at the link's (NOTE [staging ring]).
                if stage is None:
                    stage = self._stage(sum(x.nbytes for x in todo), "d2h", grow_ring) or False
                if stage:
                    stage.add(b.shadow.ptr, b.ptr, b.nbytes)
                    ops[b.role, "staged_d2h_bytes"] += b.nbytes
                else:
                    be.copy(b.shadow.ptr, b.ptr, b.nbytes, side)
                if park:
                    books.park(b)
                    ops[b.role, "evict_park_ops"] += 1
                else:
                    discards.append(b)   # after every copy, in one fenced call (NOTE [discard fence])
                b.in_shadow = True
                b.shadow_valid = True
                moved[b.role] = moved.get(b.role, 0) + b.nbytes
            else:  # "um": Unified Memory's own write-back; every pointer stays valid
                be.prefetch([self.advisor.page_range(b)], Location.HOST, side)
                b.host_valid = True
                moved[b.role] = moved.get(b.role, 0) + b.nbytes
                ops[b.role, "evict_um_ops"] += 1
            if not b.parked:
                books.on_resident(b.role, -b.span)
            b.where = Location.HOST
            ops[b.role, "evict_ops"] += 1
        books.accounting.count_many(ops)
        if stage:
            stage.close()     # before the discards: their fence drains tiermem's stream
        if discards:
            self.streams.quiesce()
            # Before the call: one that fails, or a Ctrl-C that lands as it returns, may have
            # dropped the pages already, and the shadows hold the data (NOTE [failed moves]).
            discarded.append(True)
            be.discard(coalesce((b.block.alloc, b.ptr, b.span) for b in discards), side)
        for r, n in moved.items():
            books.accounting.on_move(r, "d2h", n)
        tr = self.streams.finish("d2h", todo, cur, side, start, moved, non_blocking)
        # (range, set read-mostly again, fence): a buffer lent read-mostly for a read-only scope
        # keeps it only while resident (NOTE [read-only scopes] in cupy/scoped.py). A group's members
        # still collapse in one call where they share both.
        same: dict[tuple[bool, int], tuple[bool, Any, list[Buffer]]] = {}
        for b in collapse:
            again = not b.read_mostly_while_resident
            same.setdefault((again, id(b.fence)), (again, b.fence, []))[2].append(b)
        return tr, [(p, n, again, fence) for again, fence, bs in same.values()
                    for p, n in coalesce((b.block.alloc, *self.advisor.page_range(b)) for b in bs)]
