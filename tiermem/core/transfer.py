"""Transfers: moves enqueued on one of tiermem's side streams, and their completion."""
from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Transfer"]


class Owner(Protocol):
    """What a transfer needs of what enqueued it (the engine's side streams, core/sidestreams.py,
    or an adapter's tier): named here rather than imported, so imports point one way, from the
    engine down to its transfers."""

    backend: Any
    accounting: Any

    def stream_handle(self, stream: Any) -> int: ...


class Transfer:
    """The moves of one prefetch or evict call, enqueued on a tiermem stream.

    ``nbytes`` is what was copied over the link (0 for a clean eviction). ``wait(stream)`` makes a
    stream wait for completion on the device, without blocking the host; ``synchronize()`` blocks
    the host. Until it completes, the transfer keeps the buffers it moves alive, so a buffer freed
    meanwhile is not reused under a running copy. Not thread-safe; share the result, not the call.
    """

    def __init__(self, tier: Owner | None, direction: str, stream: int, start: Any, end: Any,
                 buffers: list[Any], nbytes: int, shares: dict[Any, int]):
        self._tier = tier
        self.direction = direction
        self.stream = stream
        self._start, self._end = start, end
        self._held_bufs = buffers
        self.nbytes = nbytes
        self._shares = shares
        self._seconds: float | None = None if end is not None else 0.0

    @classmethod
    def done_now(cls, direction: str) -> Transfer:
        return cls(None, direction, 0, None, None, [], 0, {})

    def done(self) -> bool:
        """True once every move has finished (polls; never blocks)."""
        if self._end is None or self._seconds is not None:
            return True
        if self._tier is not None and self._tier.backend.query(self._end):
            self._finish()
            return True
        return False

    def wait(self, stream: int | Any | None = None) -> None:
        """Make ``stream`` (default: the current stream) wait for this transfer, on the device."""
        if self._end is None or self._seconds is not None or self._tier is None:
            return
        self._tier.backend.wait(self._tier.stream_handle(stream), self._end)

    def synchronize(self) -> None:
        """Block the host until the transfer is done."""
        if self._end is None or self._seconds is not None or self._tier is None:
            return
        self._tier.backend.synchronize(self._end)
        self._finish()

    @property
    def seconds(self) -> float | None:
        """Device time of the moves, from CUDA events; None while running."""
        self.done()
        return self._seconds

    @property
    def event(self) -> Any:
        """The CUDA event recorded after the last move (None when nothing was enqueued)."""
        return self._end

    def _finish(self) -> None:
        if self._seconds is not None:
            return
        tier = self._tier
        self._seconds = tier.backend.elapsed_ms(self._start, self._end) / 1e3 if tier is not None else 0.0
        if tier is not None and self.nbytes:
            tier.accounting.on_move_time(self._shares, self.direction, self._seconds)
        self._held_bufs = []

    def __repr__(self) -> str:
        state = "done" if self._seconds is not None else "pending"
        return f"<Transfer {self.direction} {self.nbytes:,} bytes {state}>"
