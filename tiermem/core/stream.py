"""The streaming primitive: ordered copies with events, a ring of device slots, a pinned arena.

Module offload (inference/transport.py), training (training/handle.py), activation swap (training/swap.py) and the engine's
moves of managed memory all move bytes through these three pieces, so the ordering rules below are
written once.

NOTE [ordered copies]
    A copy on a side stream must not start before the work that wrote its source, or last used
    its destination, is done; and nothing may read its destination before the copy ends. CUDA
    orders work across streams only through events, so every batch of copies is: the side
    stream waits for the events it is given (:func:`now` records one on a compute stream at that
    moment: "after everything queued there so far"), the copies are queued, one end event is
    recorded. Readers wait for that end event on their own stream, on the device, never on the
    host. A slot's ``free`` event is the end of its last use (a compute stream's work, or a copy
    back home); a fill waits for it, so bytes are never overwritten under a reader.

    A batch that fails part-way (a copy refused, Ctrl-C) records no end event, so nothing is
    ever told that half-copied bytes are ready: owners set a slot's occupant only after
    :meth:`SlotRing.fill` returns (tests/test_module_faults.py found the bug this prevents).

    Device work that turns copied bytes into a slot's contents (a dequantization: NOTE
    [quantized streaming] in inference/quant.py) is ordered the same way: :meth:`Lane.apply`
    queues it on its lane's stream after the events it is given and records one end event,
    and :meth:`SlotRing.transform` makes that the slot's ``ready``, after the slot's ``free``
    and the fills of the slots it reads, whose ``free`` it becomes.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["Now", "now", "Lane", "Slot", "SlotRing", "Relay", "PinnedArena"]

ALIGN = 512              # a piece of the arena starts on this boundary
CHUNK_MIN = 256 << 20    # the arena grows by whole multiples of this


class Now:
    """"After the work queued on ``stream`` so far" (None: the current stream)."""

    __slots__ = ("stream",)

    def __init__(self, stream: int | None = None):
        self.stream = stream


def now(stream: int | None = None) -> Now:
    return Now(stream)


class Lane:
    """Ordered copies on one stream (NOTE [ordered copies]). ``stream`` is a handle, or a callable
    that gives one: a tier makes its side streams again after ``close()``, so a lane asks each time."""

    def __init__(self, backend: Any, stream: int | Callable[[], int]):
        self.backend = backend
        self._stream = stream

    @property
    def stream(self) -> int:
        return self._stream() if callable(self._stream) else self._stream

    def after(self, events: Iterable[Any], stream: int | None = None) -> None:
        """Make the lane's stream (or ``stream``) wait for each of ``events``: an event, a
        :class:`Now`, or None (nothing to wait for)."""
        side = self.stream if stream is None else stream
        for ev in events:
            if ev is not None:
                self.backend.wait(side, self.resolve(ev))

    def resolve(self, ev: Any) -> Any:
        """``ev`` as an event: a :class:`Now` is recorded on its stream of this lane's device now
        (an event another device's stream can wait for); anything else is returned as it is."""
        if not isinstance(ev, Now):
            return ev
        be = self.backend
        dep = be.new_event()
        be.record(dep, be.current_stream() if ev.stream is None else ev.stream)
        return dep

    def mark(self, timing: bool = False) -> Any:
        """Record a new event on the lane now."""
        ev = self.backend.new_event(timing=timing)
        self.backend.record(ev, self.stream)
        return ev

    def run(self, parts: Iterable[tuple[int, int, int]], *, after: Iterable[Any] = (Now(),),
            timed: bool = False) -> tuple[Any, Any]:
        """Queue the copies ``parts`` ((dst, src, nbytes) each) after ``after``; returns the
        (start, end) events, start None unless ``timed``."""
        side = self.stream
        self.after(after, side)
        start = self.mark(timing=True) if timed else None
        for dst, src, n in parts:
            if n:
                self.backend.copy(dst, src, n, side)
        return start, self.mark(timing=timed)

    def apply(self, fn: Callable[[], None], *, after: Iterable[Any] = (Now(),)) -> Any:
        """Queue the device work ``fn`` does (torch ops, run with the lane's stream as torch's
        current stream) after ``after``; returns its end event (NOTE [ordered copies])."""
        side = self.stream
        self.after(after, side)
        with self.backend.torch_stream(side):
            fn()
        return self.mark()


@dataclasses.dataclass(eq=False)
class Slot:
    """One slot of a :class:`SlotRing`. ``held`` is the owner's note of what the slot's bytes
    are (a group's versions when copied in, which parts of a block)."""

    index: int
    ptr: int
    occupant: Any = None
    ready: Any = None             # event: its last fill is done
    free: Any = None              # event: its last user (compute or a copy back home) is done
    busy: bool = False            # in use by the running block: never picked
    last: int = 0                 # the ring's clock at its last use
    held: Any = None


class SlotRing:
    """``n`` device slots of ``slot_bytes`` each, back to back from ``base`` (NOTE [ordered copies])."""

    def __init__(self, base: int, slot_bytes: int, n: int, make: Callable[[int, int], Slot] = Slot):
        self.slot_bytes = int(slot_bytes)
        self.slots = [make(i, base + i * self.slot_bytes) for i in range(n)]
        self.clock = 0

    def __len__(self) -> int:
        return len(self.slots)

    def __iter__(self) -> Iterator[Slot]:
        return iter(self.slots)

    def __getitem__(self, i: int) -> Slot:
        return self.slots[i]

    def vacate(self, slot: Slot) -> Any:
        """Forget the slot's occupant (before its bytes change); returns who it was."""
        old, slot.occupant, slot.held = slot.occupant, None, None
        return old

    def pick(self, protect: Callable[[Any], bool] = lambda occupant: False) -> Slot | None:
        """A slot not in use whose occupant is not protected: an empty one first, else the one
        used longest ago. None when there is none."""
        free = [s for s in self.slots if not s.busy and (s.occupant is None or not protect(s.occupant))]
        return min(free, key=lambda s: (s.occupant is not None, s.last), default=None)

    def fill(self, lane: Lane, slot: Slot, parts: Iterable[tuple[int, int, int]], *,
             after: Iterable[Any] = (), timed: bool = False, relay: Relay | None = None,
             relayed: Iterable[tuple[int, int, int]] = ()) -> tuple[Any, Any]:
        """Copy ``parts`` ((offset in the slot, src, nbytes) each) into ``slot`` on ``lane``, after
        its last user and after ``after``; the slot's ``ready`` becomes the end event. ``relayed``
        parts (the same form) go through ``relay``, another device's link, beside them, and the
        end event is after both (NOTE [two links into one GPU] in inference/multidevice.py)."""
        first = slot.free if slot.free is not None else Now()
        relayed = [(slot.ptr + o, src, n) for o, src, n in relayed]
        if relay is None or not relayed:
            start, end = lane.run([(slot.ptr + o, src, n) for o, src, n in parts], after=(first, *after),
                                  timed=timed)
        else:
            deps = [lane.resolve(e) for e in (first, *after) if e is not None]   # events both devices wait for
            start, _ = lane.run([(slot.ptr + o, src, n) for o, src, n in parts], after=deps, timed=timed)
            lane.after([relay.run(relayed, after=deps)])
            end = lane.mark(timing=timed)
        slot.ready = end
        return start, end

    def transform(self, lane: Lane, slot: Slot, fn: Callable[[], None], *, after: Iterable[Any] = (),
                  reads: Iterable[Slot] = ()) -> Any:
        """Write ``slot`` by the device work ``fn`` on ``lane`` (:meth:`Lane.apply`), after its last
        user, after ``after`` and after the fills of ``reads`` (slots, of any ring, that ``fn``
        reads). The end event becomes ``slot``'s ``ready`` and each of ``reads``' ``free``, and
        is returned."""
        reads = list(reads)
        first = slot.free if slot.free is not None else Now()
        end = lane.apply(fn, after=(first, *after, *(r.ready for r in reads)))
        slot.ready = end
        for r in reads:
            r.free = end
        return end

    def move(self, lane: Lane, src: Slot, dst: Slot, parts: Iterable[tuple[int, int, int]]) -> Any:
        """Copy ``parts`` ((offset in ``dst``, offset in ``src``, nbytes) each) from ``src`` into
        ``dst`` on ``lane``, after ``dst``'s last user and ``src``'s last fill. The end event
        becomes ``dst``'s ``ready`` and ``src``'s ``free`` (a later fill of ``src`` waits for the
        copy out), and is returned."""
        first = dst.free if dst.free is not None else Now()
        _, end = lane.run([(dst.ptr + o, src.ptr + p, n) for o, p, n in parts], after=(first, src.ready))
        dst.ready = end
        src.free = end
        return end

    def drain(self, lane: Lane, slot: Slot, parts: Iterable[tuple[int, int, int]]) -> Any:
        """Copy ``parts`` ((dst, offset in the slot, nbytes) each) out of ``slot`` on ``lane`` after
        the work queued so far; the copy's end becomes the slot's ``free`` event, and is returned."""
        _, end = lane.run([(dst, slot.ptr + o, n) for dst, o, n in parts])
        slot.free = end
        return end

    def touch(self, slot: Slot) -> None:
        """Count a use of the slot now (it is picked after those used before), without holding it."""
        self.clock += 1
        slot.last = self.clock

    def use(self, slot: Slot) -> None:
        """The slot is in use by the running block: it is not picked until :meth:`release`."""
        self.clock += 1
        slot.busy, slot.last = True, self.clock

    def release(self, slot: Slot, backend: Any, stream: int | None = None) -> None:
        """The slot's user is done once ``stream``'s work queued so far is (default: current)."""
        slot.busy = False
        ev = backend.new_event()
        backend.record(ev, backend.current_stream() if stream is None else stream)
        slot.free = ev


class Relay:
    """Copies from pinned host memory to another device's memory over this device's link: each
    piece of at most a staging slot crosses into one of ``ring``'s slots (on this device) on the
    ``inbound`` lane, then on to its destination over the devices' peer link on the ``onward``
    lane, the two lanes overlapping piece by piece (NOTE [two links into one GPU] in
    inference/multidevice.py). The lanes and the ring are this device's; the events it is given
    and returns may be of any device."""

    def __init__(self, inbound: Lane, onward: Lane, ring: SlotRing):
        if len(ring) < 2:
            raise ValueError("a relay overlaps its two lanes through at least two staging slots")
        self.inbound, self.onward, self.ring = inbound, onward, ring
        self._turn = 0
        self.moved = 0

    def run(self, parts: Iterable[tuple[int, int, int]], *, after: Iterable[Any] = ()) -> Any:
        """Queue the copies ``parts`` ((dst on the other device, pinned src, nbytes) each); the
        onward copies wait for ``after`` (events: the destination's last user). Returns the end
        event of the last onward copy."""
        after, end, size = list(after), None, self.ring.slot_bytes
        for dst, src, n in parts:
            for at in range(0, n, size):
                k = min(size, n - at)
                st = self.ring[self._turn]
                self._turn = (self._turn + 1) % len(self.ring)
                _, st.ready = self.inbound.run([(st.ptr, src + at, k)], after=(st.free,))   # after its last onward copy
                _, end = self.onward.run([(dst + at, st.ptr, k)], after=(st.ready, *after))
                after = []                   # the onward lane's order covers the later pieces
                st.free = end
                self.moved += k
        return end


class PinnedArena:
    """Pinned host memory handed out in aligned pieces, bump style, from chunks kept for reuse:
    ``reset()`` hands the same bytes out again (once per step, say)."""

    def __init__(self, backend: Any, chunk: int = CHUNK_MIN):
        self.backend = backend
        self.chunk = int(chunk)
        self.chunks: list[Any] = []
        self.at = (0, 0)          # (chunk, offset)

    def reset(self) -> None:
        self.at = (0, 0)

    def take(self, nbytes: int, wait: Any = None) -> int:
        """The address of ``nbytes`` of pinned memory. A new chunk is a whole multiple of the
        chunk size, so a later step or run of another size finds the same sizes cached in the
        pinned pool (cudaHostAlloc costs ~1 s/GB). ``wait`` is a context manager that brackets the
        allocation (the training meter counts it as a wait, not as compute)."""
        n = -(-nbytes // ALIGN) * ALIGN
        c, off = self.at
        while c < len(self.chunks) and off + n > self.chunks[c].nbytes:
            c, off = c + 1, 0
        if c == len(self.chunks):
            with wait if wait is not None else contextlib.nullcontext():
                self.chunks.append(self.backend.host_alloc(-(-n // self.chunk) * self.chunk))
        self.at = (c, off + n)
        return self.chunks[c].ptr + off

    @property
    def nbytes(self) -> int:
        return sum(ch.nbytes for ch in self.chunks)

    def release(self) -> None:
        for ch in self.chunks:
            ch.release()
        self.chunks = []
        self.at = (0, 0)
