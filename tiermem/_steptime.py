"""Timing one training step on the compute stream, for the plan (NOTE [step time model]).

A mark is a CUDA event recorded on the current stream (a host clock reading where no CUDA runs,
as in the CPU tests); marks are read only after the step, so timing never makes the host wait.
A *stall* is a pair of marks around a wait of the compute stream for a copy: nothing is queued
between them, so their distance is time the compute stream spent waiting, not computing.
``compute(a, b)`` is the time between two marks less the stalls inside it.

Not thread-safe: one step at a time, as the training handle runs them.
"""
from __future__ import annotations

import time
from typing import Any

__all__ = ["StepClock"]


class StepClock:
    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.reset()

    def reset(self) -> None:
        self._marks: list[Any] = []
        self._stalls: list[tuple[int, int]] = []
        self._times: list[float] | None = None

    def mark(self) -> int:
        """Record a mark now; returns its id (an index)."""
        if self.cuda:
            import torch
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self._marks.append(e)
        else:
            self._marks.append(time.perf_counter())
        self._times = None
        return len(self._marks) - 1

    def stall(self, wait: Any) -> None:
        """Run ``wait()`` (which makes the compute stream wait) between two marks."""
        a = self.mark()
        wait()
        self._stalls.append((a, self.mark()))

    def ready(self) -> bool:
        """Whether every mark so far has been reached (reading them then does not block)."""
        if not self._marks or not self.cuda:
            return True
        return bool(self._marks[-1].query())

    def times(self) -> list[float]:
        """Seconds from the first mark to each mark; waits for the last mark on CUDA."""
        if self._times is None:
            if not self._marks:
                self._times = []
            elif self.cuda:
                first = self._marks[0]
                self._marks[-1].synchronize()
                self._times = [first.elapsed_time(e) / 1e3 for e in self._marks]
            else:
                t0 = self._marks[0]
                self._times = [t - t0 for t in self._marks]
        return self._times

    def between(self, a: int, b: int) -> float:
        t = self.times()
        return max(t[b] - t[a], 0.0)

    def compute(self, a: int, b: int) -> float:
        """Seconds from mark ``a`` to mark ``b`` less the stalls between them."""
        t = self.times()
        lo, hi = t[a], t[b]
        waited = 0.0
        for sa, sb in self._stalls:
            waited += max(0.0, min(t[sb], hi) - max(t[sa], lo))
        return max(hi - lo - waited, 0.0)
