"""tiermem's side streams on one device, and the moves in flight on them.

Every move of managed memory goes on a side stream, ordered after its caller's stream (NOTE
[ordered copies] in core/stream.py), and stays in flight here until it is reaped. This part owns
the streams (made on first use, destroyed at ``close()``) and the list of moves; it is the owner
every :class:`Transfer` of the engine reports to (core/transfer.py's Owner).
"""
from __future__ import annotations

import threading
import types
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import ConfigTypeError
from ..roles import Role
from .stream import Lane, now
from .tensor import Buffer
from .transfer import Transfer

__all__ = ["SideStreams", "UM_STREAMS"]

# Moves of managed ranges go on one stream per direction: refills (prefetch, fresh pages, copies
# in from a shadow) on UM_STREAMS["h2d"], evictions (write-back, copies out, giving parked pages
# back) on UM_STREAMS["d2h"]. Direct moves that touch managed memory do not overlap across
# directions (both together run at one direction's rate), but through the staging rings the link
# copies touch only pinned memory and cudaMalloc slots, and the two directions overlap (NOTE
# [staging ring] in cuda/staging.py; docs/data-paths.md, "The staging rings"). A move waits
# for the other direction where it must: a buffer's earlier move (``begin``), and the eviction
# of a parked buffer whose pages a refill takes (``Moves.move_in``). Every discard drains both
# streams first (``quiesce``; NOTE [discard fence] in cuda/backend.py). Pinned copies (wrap_module's
# and wrap_training's slots) have streams of their own, "h2d" and "d2h".
UM_STREAMS = {"h2d": "um_h2d", "d2h": "um_d2h"}


class SideStreams:
    """Side streams by name, made on first use, and the moves enqueued on them and not yet
    reaped. Not locked itself: callers hold the books' lock (core/books.py) around changes."""

    def __init__(self, backend: Any, accounting: Any, lock: threading.RLock):
        self.backend = backend
        self.accounting = accounting
        self._lock = lock
        self._named: dict[str, int] = {}
        self._inflight: list[Transfer] = []

    def stream_handle(self, stream: Any) -> int:
        """A stream handle from None (the current stream), an int, a torch or a CuPy stream."""
        if stream is None:
            return self.backend.current_stream()
        if isinstance(stream, int):
            return stream
        for attr in ("cuda_stream", "ptr"):
            if hasattr(stream, attr):
                return int(getattr(stream, attr))
        raise ConfigTypeError(f"not a stream: {stream!r}")

    def side(self, name: str) -> int:
        """The side stream called ``name``, made now if it is not yet."""
        s = self._named.get(name)
        if s is None:
            s = self._named[name] = self.backend.new_stream()
        return s

    @property
    def named(self) -> Mapping[str, int]:
        """The side streams made so far, by name (a read-only view)."""
        return types.MappingProxyType(self._named)

    def um(self, direction: str) -> int:
        """The stream that moves managed ranges in ``direction`` ("h2d" or "d2h")."""
        return self.side(UM_STREAMS[direction])

    def quiesce(self) -> None:
        """NOTE [discard fence] with two streams: before a discard the host drains both of
        tiermem's managed-memory streams (the backend then drains the discard's own stream
        before and after it), so no tiermem move of managed memory runs anywhere around it."""
        be = self.backend
        for name in UM_STREAMS.values():
            s = self._named.get(name)
            if s is not None:
                ev = be.new_event()
                be.record(ev, s)
                be.synchronize(ev)

    def begin(self, bufs: Iterable[Buffer], cur: int, side: int) -> Any:
        """Order ``side`` after the caller's stream and after earlier moves of ``bufs``; returns the
        timing event that starts the transfer."""
        lane = Lane(self.backend, side)        # NOTE [ordered copies] in core/stream.py
        lane.after([now(cur)] + [b.pending.event for b in bufs
                                 if b.pending is not None and not b.pending.done() and b.pending.stream != side])
        return lane.mark(timing=True)

    def finish(self, direction: str, bufs: list[Buffer], cur: int, side: int, start: Any,
               moved: dict[Role, int], non_blocking: bool) -> Transfer:
        """The transfer of the moves queued on ``side`` since ``start``; unless ``non_blocking``,
        the caller's stream ``cur`` waits for it on the device."""
        be = self.backend
        end = Lane(be, side).mark(timing=True)
        tr = Transfer(self, direction, side, start, end, list(bufs), sum(moved.values()), moved)
        for b in bufs:
            b.pending = tr
        self._inflight.append(tr)
        if not non_blocking:
            be.wait(cur, end)
        return tr

    def reap(self) -> None:
        """Forget the moves that are done (they let go of the buffers they kept alive)."""
        self._inflight = [t for t in self._inflight if not t.done()]

    def inflight(self) -> list[Transfer]:
        """The moves enqueued and not yet reaped."""
        with self._lock:
            return list(self._inflight)

    def track(self, tr: Transfer) -> None:
        """Count a move an adapter enqueued itself (``synchronize`` then waits for it too)."""
        with self._lock:
            self._inflight.append(tr)

    def synchronize(self) -> None:
        """Block until every move enqueued here is done."""
        with self._lock:
            for t in self._inflight:
                t.synchronize()
            self._inflight = []

    def drop(self) -> list[int]:
        """Forget every side stream (a later move makes new ones); returns them, for the caller to
        destroy once their work is done."""
        streams = list(self._named.values())
        self._named.clear()
        return streams
