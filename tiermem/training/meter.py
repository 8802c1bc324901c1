"""Compute time of a training step with its waits taken out (NOTE [recompute plan] in training/plan.py).

A step's GPU time is compute plus the time the compute stream stood still: waiting on the device
for a copy (a slot's fill, a swapped activation coming back) or waiting for the host while the
host waited (for the swap's window, a pinned allocation). Each such wait is bracketed by two
timing events on the compute stream; nothing runs on that stream between them, so the time
between the two is exactly the time it stood still. Marks (block starts and ends) are timing
events on the same stream, so a span between two marks less the waits recorded between them is
its compute.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["StallMeter"]


class StallMeter:
    """Times one step's marks and waits on the compute stream while ``on``; a plain wait when off."""

    def __init__(self, backend: Any):
        self.be = backend
        self.on = False
        self.items: list[tuple[str, Any, Any]] = []   # ("mark", name, event) or ("wait", start, end)

    def start(self) -> None:
        self.items = []
        self.on = True

    def stop(self) -> None:
        self.on = False

    def _event(self) -> Any:
        ev = self.be.new_event(timing=True)
        self.be.record(ev, self.be.current_stream())
        return ev

    def mark(self, name: Any) -> None:
        if self.on:
            self.items.append(("mark", name, self._event()))

    def wait(self, stream: int, event: Any) -> None:
        """``stream`` waits for ``event``; timed when ``stream`` is the compute stream."""
        if not self.on or stream != self.be.current_stream():
            self.be.wait(stream, event)
            return
        a = self._event()
        self.be.wait(stream, event)
        self.items.append(("wait", a, self._event()))

    @contextlib.contextmanager
    def host(self) -> Iterator[None]:
        """The host waits inside: the compute stream runs dry and stands still."""
        if not self.on:
            yield
            return
        a = self._event()
        try:
            yield
        finally:
            self.items.append(("wait", a, self._event()))

    def spans(self) -> dict[Any, float]:
        """Compute milliseconds between each mark and the next mark of the same name's end:
        for marks ``(name, "start")`` and ``(name, "end")`` the span between them, less the waits
        recorded between. Call after the last event has completed."""
        be = self.be
        waits = [0.0]              # prefix sums of wait time, in recording order
        marks: dict[Any, tuple[Any, float]] = {}
        out: dict[Any, float] = {}
        for kind, a, b in self.items:
            if kind == "wait":
                waits.append(waits[-1] + max(be.elapsed_ms(a, b), 0.0))
                continue
            name, ev = a, b
            if isinstance(name, tuple) and name[-1] == "end" and (name[:-1] + ("start",)) in marks:
                ev0, w0 = marks.pop(name[:-1] + ("start",))
                out[name[:-1]] = max(be.elapsed_ms(ev0, ev) - (waits[-1] - w0), 0.0)
            else:
                marks[name] = (ev, waits[-1])
        return out
