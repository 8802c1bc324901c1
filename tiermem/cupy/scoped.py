"""CuPy arrays over the budget: residency that agrees with the driver, and scoped moves.

    cupy.cuda.set_allocator(tier.allocator())
    with tier.using_role("activation"):          # arrays tiermem may evict (workspace never is)
        blocks = [cupy.random.random(n, dtype=cupy.float32) for _ in range(12)]
    nxt = tier.use(blocks[0], read_only=True)      # the moves start now, on tiermem's stream
    for i, a in enumerate(blocks):
        with nxt:                                  # the current stream waits for them (an event)
            if i + 1 < len(blocks):
                nxt = tier.use(blocks[i + 1], read_only=True)   # in flight while this one computes
            y = a @ w                              # a block read many times: worth moving
    for a in blocks:
        with tier.use(a, once=True):               # touched once: evicted ones are used in place
            a *= 1.0001

NOTE [allocator arrays in place]
    An array from tiermem's CuPy allocator holds a foreign view of its buffer (its memory object
    owns a view token), so its address never changes and tiermem evicts it only through Unified
    Memory's write-back (NOTE [views and the fast paths] in core/tensor.py). Left at that, the next
    kernel that touches it faults it back to the device (at the fault rate, a fraction of the
    link's: docs/facts.md), and tiermem's books still say "host": the budget held only in the
    books (issue 21).
    So an evicted allocator array gets advice to live on the host and be used in place: preferred
    location host, accessed-by the device (and the host), no read-mostly (``IN_PLACE``). A kernel
    that touches it then reads and writes the host pages over the link (reads at about the
    link's rate) without migrating them, and it stays where the books say. It comes back to the
    device when named in :meth:`Tier.use` (or prefetched), at the prefetch rate. The advice
    stays: from its first eviction on, the array's home is the host.
    What can still bring it back behind tiermem's back, and what tiermem does about each:
      - another prefetch or advice (cupy.cuda.runtime.memPrefetchAsync, memAdvise): the range
        attributes show it (last prefetch location, preferred location). A check (below) re-marks
        the array resident and counts it (``residency.faulted_back_*``); a budget check then
        evicts cold arrays until tiermem is within the budget again, counting
        ``residency.budget_overruns``.
      - the driver's access-counter migration, where it is enabled: no range attribute shows it.
        bench/cupy_budget.py measures whether it happens ("in_place_probe").
      - GPU atomics on a device without host-native atomics (hostNativeAtomicSupported = 0, as on
        the devices in docs/facts.md): the driver migrates the pages an atomic touches. Not
        visible either.
    Arrays under 2 MiB share pages with their neighbours (NOTE [size classes] in cuda/backend.py):
    their advice would change the neighbours' too, so they are left as they are, and a kernel
    may fault them back unseen (at most 2 MiB of pages each).
    On a device without concurrent managed access there is no in-place access and no advice:
    the budget cannot hold for allocator arrays there, and the module logs it once.
    Checks: at a CuPy allocation that would take tiermem over the budget, at :meth:`Tier.use`,
    and (re-marking only, never moving memory) in :meth:`Tier.stats`.

NOTE [retained pages]
    The driver does not take a managed range's device pages back when its data leaves the device:
    an array placed, then prefetched to the host, leaves the driver's used memory (cudaMemGetInfo)
    up by its size, a second array placed after it takes as much again, and a discard gives
    nothing back either. The pages stay with the range: the same array brought in again takes
    none. They are not lost to other allocators: a cudaMalloc beyond free memory succeeds after
    an eviction, and even with the data still resident: the driver evicts managed pages on
    demand (docs/data-paths.md, "CuPy arrays over the budget", has the figures). And tiermem
    cannot give them back itself: an allocator array's address is fixed (only cudaFree of the
    range would).
    So there are two honest figures, and tiermem keeps both:
      - ``resident_bytes``: live data tiermem placed on the device, what the budget limits;
      - ``residency.retained_bytes``: the spans of allocator arrays that have had device pages
        (placed, brought in by :meth:`Tier.use`, or found faulted back) and whose data is now
        elsewhere. Not under the budget: no data of tiermem's is in them.
    The driver's used memory, less a baseline taken in a fresh process, is then resident +
    staging + retained bytes. Not counted: pages of arrays already freed whose blocks the pool
    caches for reuse (``managed.pool_cached_bytes`` bounds them), pages shared by arrays under
    2 MiB, and evicted TieredTensors' ranges (their discards leave pages too).
    What this means for the budget: it holds for live data; the driver's figure rises to every
    byte that has ever been on the device, as it does for plain managed memory (bench/cupy_budget.py's
    "managed" rows). Arrays read or written in
    place (NOTE [touched once]) never take device pages, so they add nothing to it.

NOTE [scoped moves]
    ``Tier.use(a, b)`` brings the named arrays in through :meth:`Tier.prefetch` (one batched
    prefetch) after making room in the budget through ``Tier.make_room``, which evicts
    the coldest evictable buffers by their fastest safe path; arrays named by a live handle are
    never chosen. The moves of allocator arrays do not wait for the caller's stream: they go
    through Unified Memory, which keeps every address valid, so a kernel still running on one
    reads right data either way, and the next block's moves overlap this block's kernels. They
    do wait, on the device, for the evictions that made their room, so that the data on the
    device never exceeds the budget. (The driver does not hand the evicted pages on: NOTE
    [retained pages].)
    TieredTensors may move through their shadows (their address changes), so a call that names
    one orders its moves after the caller's stream, as ``Tier.prefetch`` does. The caller's
    stream waits for the moves, on the device, when the handle is entered (or ``wait``-ed); the
    host never blocks, except where a TieredTensor's shadow move discards pages (NOTE [discard
    fence] in cuda/backend.py).
    A dirty allocator array leaves the device through Unified Memory's write-back, at a fraction
    of the link's rate: it must keep its address, and the fast eviction paths move data to a new one. For arrays a
    pass touches once, leaving them in place is faster than naming them (NOTE [touched once]).

NOTE [touched once]
    ``Tier.use(..., once=True)`` says the block touches each named array's bytes about once, as a
    pass over an array set does. Arrays in place on the host then stay there: the block's kernels
    read and write them over the link, and nothing is moved, evicted or left on the device
    (NOTE [retained pages]). Resident ones are pinned as usual; TieredTensors in their shadow
    still come in (their managed range holds no data). Why that is faster for such a pass
    (docs/data-paths.md, "CuPy arrays over the budget", has the figures):
      - an update (``a *= 1.0001``): bringing the arrays in and writing them back costs several
        times what updating them in place does, since Unified Memory's write-back of dirty pages
        runs at a fraction of the link's rate: a dirty array at a fixed address costs several
        times its bytes at link rate to leave, and no scoped move comes near the link bound.
        In-place reads and writes share the link both ways.
      - a read (``a.sum()``): in-place reads run near the rate of pinned copies, so a pass in
        place lands near the link bound when exactly the bytes beyond the budget are read.
    Reading in place pays the link once per read, so for arrays a block reads several times
    (a blocked product's operand, the bench's "reuse") naming them without ``once`` is faster.

NOTE [read-only scopes]
    ``Tier.use(..., read_only=True)`` promises that the block only reads the named arrays. Those
    that live in place on the host come in as read-mostly duplicates: one advice call (the range
    already has IN_PLACE advice), then the prefetch. The host pages stay valid, and their later
    eviction is tiermem's "collapse" path, a host-side call that unsets read-mostly and moves
    nothing over the link (host time only: docs/data-paths.md, "CuPy arrays over the budget"),
    where a write-back moves every byte at a fraction of the link's rate. Read-mostly is lent for
    the stay on the device only (``Buffer.read_mostly_while_resident``): the collapse
    leaves plain IN_PLACE advice, since a read-mostly range that a later kernel writes in place
    would collapse onto the device behind the books, and ``_settle`` makes the books follow. A
    block that may write and names an array still resident as a read-only duplicate first
    collapses it, then brings it in as plain pages. A write inside a read-only block breaks the
    promise without breaking the data: the driver collapses the copies onto the device, at a
    cost, the collapse at eviction then leaves them there, and ``_verify`` finds the array on the
    device (its last prefetch went there) and re-marks it resident.

NOTE [collapse fence]
    The collapse is a host-side driver call, not ordered on any stream. Without a fence it runs
    as soon as a budget check chose the victim, while the kernels that read it are often still
    queued (the host runs ahead of the device). Those kernels then find no device copy, fault,
    and read-mostly duplicates the pages back one fault at a time, against the next collapse: a
    read-only pipeline ran dozens of times slower than the link bound (docs/data-paths.md, "CuPy
    arrays over the budget"). So a handle records an event on its stream when it closes
    (``Buffer.fence``: every kernel the block enqueued there is before it), and the collapse
    first waits for it on the host. In a pipeline the
    victim is the block before last, so the wait is short; the host then collapses while the
    next block's prefetch runs on the link. Kernels that read an array outside any scope, or on
    another stream, are not covered: a collapse may still race them (values stay right; only
    time is lost).
"""
from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..core.tensor import Buffer, TieredTensor, ViewToken
from ..errors import OutOfBudgetError, TierMemError
from ..roles import Advice, Location, Prefetch, Role, as_role

if TYPE_CHECKING:
    from ..core.engine import Engine as Tier  # what an adapter uses is the engine's interface
    from ..core.transfer import Transfer

__all__ = ["ArrayUse", "ArrayResidency", "residency", "tier_of_array", "IN_PLACE"]

log = logging.getLogger("tiermem")

# The advice an evicted allocator array gets (NOTE [allocator arrays in place]). Accessed-by the
# host too: Unified Memory's write-back of such a range runs faster with it than without
# (docs/facts.md, "Transfer ceilings"), and every later eviction of the array is one.
IN_PLACE = {"preferred_location": Location.HOST, "accessed_by_device": True, "accessed_by_host": True,
            "read_mostly": False}

_states: weakref.WeakKeyDictionary[Any, ArrayResidency] = weakref.WeakKeyDictionary()
_states_lock = threading.Lock()


def residency(tier: Tier) -> ArrayResidency:
    """The tier's allocator-array state, made on first use (one per Tier)."""
    with _states_lock:
        st = _states.get(tier)
        if st is None:
            st = _states[tier] = ArrayResidency(tier)
        return st


def _in_place(b: Buffer) -> bool:
    p = b.policy
    return p.preferred_location is Location.HOST and p.accessed_by_device and not p.read_mostly


class ArrayResidency:
    """One Tier's CuPy allocator arrays: their in-place advice once evicted, the checks that keep
    ``resident_bytes`` true to the driver, and the live :class:`ArrayUse` handles. Thread-safe:
    everything runs under the Tier's lock."""

    def __init__(self, tier: Tier):
        self._tier = weakref.ref(tier)      # the Tier owns this through _states' key: no cycle
        self.arrays: weakref.WeakSet[Buffer] = weakref.WeakSet()     # made by the allocator
        self.in_place: weakref.WeakSet[Buffer] = weakref.WeakSet()   # evicted, advised IN_PLACE
        self.handles: weakref.WeakSet[ArrayUse] = weakref.WeakSet()   # open ArrayUse handles
        # Arrays whose range has had device pages: the driver keeps them once the data leaves
        # (NOTE [retained pages]).
        self.backed: weakref.WeakSet[Buffer] = weakref.WeakSet()
        self._settled_at = -1         # the evictions count at the last _settle
        self._warned = False
        tier.accounting.add_refresher(self._refresh_for_stats)

    @property
    def tier(self) -> Tier:
        t = self._tier()
        if t is None:  # pragma: no cover - the state lives in a weak-keyed map of tiers
            raise TierMemError("this Tier is gone")
        return t

    # -- allocation -------------------------------------------------------------------------------
    def new_array(self, nbytes: int, role: Role | str) -> tuple[Buffer, ViewToken]:
        """A placed buffer for a CuPy allocation of ``nbytes``, and the foreign view token its
        memory object must own (NOTE [views and the fast paths]). Under budget pressure this is a
        budget check, and the evictions that make room finish, on the device, before the new
        array's pages are placed (NOTE [scoped moves], "hands the evicted pages on")."""
        tier = self.tier
        buf = tier.new_buffer(nbytes, as_role(role), None, {}, None)
        tier.apply_advice(buf)
        with tier.lock:
            self.arrays.add(buf)
            budget = tier.budget
            # _place_new_group leaves host-preferred and never-prefetched buffers unplaced.
            places = buf.policy.preferred_location is not Location.HOST and buf.policy.prefetch is not Prefetch.NEVER
            fits = True
            if budget is not None and places and tier.held_bytes() + buf.span > budget and not buf.owns_pages:
                # Under 2 MiB (a reduction's output, an index): evicting a whole array to make room
                # for it, or a check of every in-place range, would cost far more than the bytes.
                fits = False
            elif budget is not None and places and tier.held_bytes() + buf.span > budget:
                before = set(tier.inflight())
                self._check(exclude={buf})
                try:
                    tier.make_room(buf.span, exclude={buf} | self.pinned())
                except OutOfBudgetError:
                    fits = False
                for tr in tier.inflight():
                    if tr not in before:
                        tr.wait(None)   # the placement's stream waits for the current one
                self._settle()
            if fits:
                tier.place_new(buf)
                self._mark_backed([buf])
            elif buf.owns_pages:
                # What _place_new does with a buffer that cannot fit (it is used in place from
                # the host), done here since _place_new would evict arrays open handles pin. Its
                # first touch puts its pages on the host.
                tier.change_policy(buf, None, IN_PLACE)
                buf.where = Location.HOST
                buf.host_valid = True
                self.in_place.add(buf)
                self._count_in_place()
            else:
                # Under 2 MiB it shares pages with its neighbours (NOTE [size classes]): advice
                # would move theirs too, so it gets none, and a kernel may place it on the device
                # unseen (at most a 2 MiB page). Advised in place, it was re-marked "faulted back"
                # at every later check (the page's last prefetch was the device's), a budget
                # overrun each time (docs/data-paths.md, "CuPy arrays over the budget").
                buf.where = Location.HOST
                buf.host_valid = True
            self._settle()
        return buf, buf.token(internal=False)

    # -- residency --------------------------------------------------------------------------------
    def pinned(self) -> set[Buffer]:
        """Buffers named by open handles: budget checks never evict them."""
        out: set[Buffer] = set()
        for h in list(self.handles):
            out.update(h._bufs)
        return out

    def _settle(self) -> None:
        """Give allocator arrays that tiermem evicted since the last call the IN_PLACE advice
        (arrays a read-only scope made read-mostly lose it here too)."""
        tier = self.tier
        evictions = tier.accounting.all.evict_ops
        if evictions == self._settled_at:
            return      # nothing was evicted since the last call: a malloc's common case is O(1)
        self._settled_at = evictions
        if not tier.backend.capabilities().supports("advise"):
            if not self._warned and any(b.where is Location.HOST for b in list(self.arrays)):
                self._warned = True
                log.warning("tiermem: this device cannot read evicted CuPy arrays in place (no concurrent "
                            "managed access); kernels fault them back and the budget does not hold for them")
            return
        for b in list(self.arrays):
            if b.where is not Location.HOST or not b.owns_pages or b.in_shadow:
                continue
            if b.read_mostly_while_resident and b.host_valid:
                # Its eviction was a collapse that also unset read-mostly (NOTE [read-only
                # scopes]): the range has IN_PLACE advice again, only the books follow. The range's
                # last prefetch still says "device" (the scope's); one to the host, where every
                # page is, moves nothing and lets _verify tell a later prefetch to the device.
                b.read_mostly_while_resident = False
                b.policy = b.policy.replace(**IN_PLACE, read_only=False)
                tier.backend.prefetch([tier.page_range(b)], Location.HOST, tier.um_stream("d2h"))
                self.in_place.add(b)
                continue
            settled = _in_place(b) and not b.policy.read_only
            if settled and b in self.in_place:
                continue
            collapsed = b.policy.read_mostly
            if not settled:
                tier.change_policy(b, None, {**IN_PLACE, "read_only": False})
            if collapsed:
                # A read-mostly collapse moved nothing and left the range's last prefetch at the
                # device: a prefetch to the host, where every page already is, makes it say host,
                # so that _verify can tell a later prefetch to the device (NOTE [read-only scopes]).
                tier.backend.prefetch([tier.page_range(b)], Location.HOST, tier.um_stream("d2h"))
            self.in_place.add(b)

    def _verify(self) -> None:
        """Re-mark in-place arrays that someone else brought back to the device (NOTE [allocator
        arrays in place]): their range's last prefetch went to the device, or its advice changed."""
        tier = self.tier
        be = tier.backend
        back = []
        for b in list(self.in_place):
            if b.where is not Location.HOST:     # tiermem itself brought it in: still advised
                continue
            info = be.range_info(*tier.page_range(b))
            if info.last_prefetch is Location.DEVICE or info.preferred_location is not Location.HOST:
                back.append((b, info))
        for b, info in back:
            self.in_place.discard(b)
            if info.preferred_location is not Location.HOST:
                # Its advice was changed behind tiermem's back: the books follow the range.
                b.policy = b.policy.replace(preferred_location=info.preferred_location)
            b.where = Location.DEVICE
            b.host_valid = False
            b.last_use = tier.tick()
            self._mark_backed([b])
            tier.count_resident(b, b.span)
            tier.accounting.count_extra("residency.faulted_back_count")
            tier.accounting.count_extra("residency.faulted_back_bytes", b.span)
        if back:
            log.info("tiermem: %d evicted CuPy arrays (%d bytes) came back to the device behind tiermem's back",
                     len(back), sum(b.span for b, _ in back))
        self._count_in_place()

    def _count_in_place(self) -> None:
        acc = self.tier.accounting
        acc.set_extra("residency.in_place_bytes.current",
                      sum(b.nbytes for b in list(self.in_place) if b.where is Location.HOST))
        acc.set_extra("residency.retained_bytes.current",
                      sum(b.span for b in list(self.backed) if b.where is not Location.DEVICE))

    def _mark_backed(self, bufs: Iterable[Buffer]) -> None:
        """NOTE [retained pages]: these arrays have device pages now, and their range keeps them."""
        for b in bufs:
            if b.owns_pages and b.where is Location.DEVICE and b in self.arrays:   # not TieredTensors
                self.backed.add(b)

    def _check(self, exclude: Iterable[Buffer] = ()) -> None:
        """A budget check: settle, verify, and evict the coldest to fit if over the budget."""
        tier = self.tier
        self._settle()
        self._verify()
        budget = tier.budget
        over = tier.held_bytes() - budget if budget is not None else 0
        if over > 0:
            tier.accounting.count_extra("residency.budget_overruns")
            tier.accounting.count_extra("residency.budget_overrun_bytes", over)
            try:
                tier.make_room(0, exclude=set(exclude) | self.pinned())
            except OutOfBudgetError as e:
                log.warning("tiermem: %d bytes over the budget and nothing else to evict: %s", over, e)
            self._settle()

    def _refresh_for_stats(self) -> None:
        # Stats re-mark, never move memory: a monitoring thread calling stats() must not evict.
        tier = self._tier()
        if tier is None:
            return
        with tier.lock:
            self._settle()
            self._verify()     # recounts in-place and retained bytes

    # -- scoped moves -----------------------------------------------------------------------------
    def side_stream(self) -> int:
        """The stream the scoped moves of allocator arrays are ordered on (NOTE [scoped moves])."""
        return self.tier.side_stream("scoped")       # the tier's: close() destroys it

    def use(self, items: Iterable[Any], stream: Any = None, read_only: bool = False, once: bool = False) -> ArrayUse:
        tier = self.tier
        items = list(items)
        bufs: list[Buffer] = []
        for x in items:
            b = buffer_of(tier, x)
            if b not in bufs:
                bufs.append(b)
        # CuPy arrays are used on CuPy's current stream, which differs from torch's where a
        # program set one (the backend's current stream is torch's once torch runs CUDA).
        on_cupy = stream is None and any(_token_of(x) is not None for x in items)
        if on_cupy:
            stream = _cupy_stream()
        with tier.lock:
            tier.reap()
            handle = ArrayUse(self, bufs, _CUPY if on_cupy else stream)
            self.handles.add(handle)     # pinned from here on: the check below must not evict them
            try:
                lent = [b for b in bufs if b.read_mostly_while_resident and b.where is Location.DEVICE]
                if lent and not read_only:
                    # Resident read-mostly copies, named by a block that may write: a write would
                    # collapse them onto the device behind the books. They go (a collapse, nothing
                    # over the link) and come back below as plain pages.
                    tier.evict(lent, non_blocking=True)
                before = set(tier.inflight())
                self._check(exclude=set(bufs))
                todo = [b for b in bufs if b.where is not Location.DEVICE or b.in_shadow]
                stay = set()
                if once:    # NOTE [touched once]: what lives in place is used there
                    stay = {b for b in todo if not b.in_shadow and b in self.in_place}
                    todo = [b for b in todo if b not in stay]
                need = sum(b.span for b in todo if not b.parked)
                tier.make_room(need, exclude=set(bufs) | self.pinned())
                evictions = [tr for tr in tier.inflight() if tr not in before]
                self._settle()
                if read_only:
                    self._read_mostly([b for b in todo if b in self.in_place])
                in_place_only = all(b.foreign_views() for b in todo)
                if todo and in_place_only:
                    side = self.side_stream()
                    for tr in evictions:
                        tr.wait(side)
                    tr = tier.prefetch([b for b in bufs if b not in stay], stream=side, non_blocking=True)
                else:
                    tr = tier.prefetch([b for b in bufs if b not in stay], stream=stream, non_blocking=True)
            except BaseException:
                handle.close()
                raise
            handle._transfer = tr
            self._mark_backed(todo)
            tier.accounting.count_extra("use.calls")
            tier.accounting.count_extra("use.bytes", tr.nbytes)
            self._count_in_place()     # the arrays that just came in are in place no more
        return handle

    def _read_mostly(self, bufs: list[Buffer]) -> None:
        """NOTE [read-only scopes]: in-place arrays a scope only reads come in as read-mostly
        duplicates, so that their eviction collapses them onto the host copy and moves nothing.
        One advice call: the range has IN_PLACE advice already, and only read-mostly changes."""
        tier = self.tier
        if not tier.backend.capabilities().supports("advise"):
            return
        for b in bufs:
            if b.where is Location.HOST and b.host_valid and _in_place(b):
                b.policy = b.policy.replace(read_mostly=True, read_only=True)
                b.read_mostly_while_resident = True
                tier.backend.advise(*tier.page_range(b), Advice("read_mostly", True, Location.DEVICE))
                tier.accounting.count(b.role, "advice_applied")



class ArrayUse:
    """Arrays named in :meth:`Tier.use`, on their way in on tiermem's stream.

    The moves are enqueued when the handle is made. ``with handle:`` (or :meth:`wait`) makes the
    current stream wait for them on the device (an event; the host does not block). Until the
    handle is closed (on leaving the ``with`` block, by :meth:`close`, or when it is dropped),
    budget checks never evict its arrays. Not thread-safe: one thread uses one handle.
    """

    def __init__(self, state: ArrayResidency, bufs: list[Buffer], stream: Any = None):
        self._state = state
        self._bufs = bufs
        self._stream = stream
        self._transfer: Transfer | None = None
        self.closed = False

    @property
    def nbytes(self) -> int:
        """Bytes the moves brought over the link (0 when everything was resident)."""
        return self._transfer.nbytes if self._transfer is not None else 0

    @property
    def transfer(self) -> Transfer | None:
        return self._transfer

    def done(self) -> bool:
        """True once the moves have finished (polls; never blocks)."""
        return self._transfer is None or self._transfer.done()

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` wait for the moves, on the device. Default: the stream given to
        :meth:`Tier.use`, else CuPy's current stream (at this call) where CuPy arrays were named,
        else the current stream."""
        if self._transfer is None:
            return
        if stream is None:
            stream = _cupy_stream() if self._stream is _CUPY else self._stream
        self._transfer.wait(stream)

    def synchronize(self) -> None:
        """Block the host until the moves are done."""
        if self._transfer is not None:
            self._transfer.synchronize()

    def close(self) -> None:
        """Let budget checks evict these arrays again (they stay resident until one needs room).
        Records the fence their collapse waits for (NOTE [collapse fence])."""
        if not self.closed:
            self.closed = True
            tier = self._state._tier()
            if tier is not None:
                with tier.lock:     # another thread may be reading the pins in a budget check
                    self._state.handles.discard(self)
                    if self._bufs:
                        be = tier.backend
                        stream = _cupy_stream() if self._stream is _CUPY else self._stream
                        fence = be.new_event()
                        be.record(fence, tier.stream_handle(stream))
                        for b in self._bufs:
                            b.fence = fence
            self._bufs = []

    def __enter__(self) -> ArrayUse:
        if self.closed:
            raise TierMemError("this Tier.use handle is closed; call Tier.use again")
        self.wait()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("done" if self.done() else "moving")
        return f"<ArrayUse {len(self._bufs)} arrays {self.nbytes:,} bytes {state}>"


_CUPY = object()   # an ArrayUse's stream: CuPy's current one when it is waited on


def _cupy_stream() -> int | None:
    """CuPy's current stream in this thread, or None if CuPy is not loaded."""
    cupy = sys.modules.get("cupy")
    return None if cupy is None else int(cupy.cuda.get_current_stream().ptr)


def _data_ptr(x: Any) -> int | None:
    """The device address of an array-like: CuPy's ``data.ptr``, torch's ``data_ptr()``, or the
    CUDA array interface."""
    data = getattr(x, "data", None)
    if data is not None and isinstance(getattr(data, "ptr", None), int):
        return int(data.ptr)
    if callable(getattr(x, "data_ptr", None)):
        return int(x.data_ptr())
    cai = getattr(x, "__cuda_array_interface__", None)
    if isinstance(cai, dict) and "data" in cai:
        return int(cai["data"][0])
    return None


def _token_of(x: Any) -> ViewToken | None:
    """The view token a CuPy array's memory object owns, if it is on tiermem memory."""
    owner = getattr(getattr(getattr(x, "data", None), "mem", None), "_owner", None)
    return owner if isinstance(owner, ViewToken) else None


def buffer_of(tier: Tier, x: Any) -> Buffer:
    """The buffer behind ``x``: a TieredTensor, or an array on memory from ``tier`` (a CuPy array
    from its allocator, a view of a TieredTensor). Raises TierMemError for anything else."""
    if isinstance(x, TieredTensor):
        b = x.buffer
    elif isinstance(x, Buffer):
        b = x
    elif (tok := _token_of(x)) is not None:
        b = tok.buffer
    else:
        ptr = _data_ptr(x)
        found = tier.owner_of(ptr) if ptr is not None else None
        if found is None:
            raise TierMemError(
                f"{type(x).__name__} at {ptr if ptr is None else hex(ptr)} is not memory of this Tier; allocate it "
                "under cupy.cuda.using_allocator(tier.allocator()) or pass TieredTensors")
        b = found
    if b.tier is not tier:
        raise TierMemError(f"{type(x).__name__} at {b.ptr:#x} belongs to another Tier")
    return b


def tier_of_array(x: Any) -> Tier | None:
    """The Tier whose memory ``x`` is on, from the view token CuPy's memory object owns, if any."""
    if isinstance(x, TieredTensor):
        return x.tier
    tok = _token_of(x)
    return tok.buffer.tier if tok is not None else None
