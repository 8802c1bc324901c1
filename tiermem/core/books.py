"""The books: what tiermem holds on one device, and the budget it holds to.

Every part of the engine (core/engine.py) reads and changes these under the one lock they share
(``Books.lock``): the live buffers and their use clock, the device pages tiermem holds
(``resident``, of which ``parked``), the pinned shadows, and the budget enforced (``budget``, set
by core/budget.py's leases and settings through core/eviction.py's ``hold_to``). The staging
rings count beside the pages (``held``). Between two backend calls every counter agrees with every
buffer's state: NOTE [failed moves] in core/moves.py relies on it, and tests/test_faults.py checks it
after every failure.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterable
from typing import Any

from ..roles import Role
from .tensor import Buffer

__all__ = ["Books"]


class Books:
    """The counters the budget checks and the buffers they count, for one device. The caller
    holds ``lock`` around a read-then-change of them; the methods here do not take it, except
    :meth:`add`, which a new buffer calls from outside any move."""

    def __init__(self, accounting: Any, staging: Any, budget: int | None):
        self.lock = threading.RLock()
        self.accounting = accounting
        self.staging = staging           # the rings (cuda/staging.py): their bytes count beside the pages
        self.budget = budget             # bytes enforced (NOTE [budget leases] in core/leases.py); None: none
        self.resident = 0                # device bytes tiermem holds, whole pages (NOTE [device budget])
        self.parked = 0                  # of resident: pages kept for refills (NOTE [parked pages] in core/parking.py)
        self.shadow_bytes = 0            # pinned shadows the buffers own
        self._bufset: weakref.WeakSet[Buffer] = weakref.WeakSet()
        self._tick = itertools.count(1)

    def tick(self) -> int:
        """The next value of the use clock (``last_use``: the coldest is evicted first)."""
        return next(self._tick)

    def add(self, buf: Buffer) -> None:
        with self.lock:
            self._bufset.add(buf)

    def forget(self, buf: Buffer) -> None:
        """``buf`` is gone (NOTE [finalizer race] in core/placement.py); call with the lock held."""
        self._bufset.discard(buf)

    def live(self) -> list[Buffer]:
        """The buffers not yet gone (NOTE [finalizer race] in core/placement.py); call with the lock held."""
        return [b for b in list(self._bufset) if not b.gone]

    def parked_bufs(self, exclude: Iterable[Buffer] = ()) -> list[Buffer]:
        skip = set(exclude)
        return [b for b in self.live() if b.parked and b not in skip]

    def held(self) -> int:
        """What the budget limits: tensors' pages and the staging rings."""
        return self.resident + self.staging.nbytes

    def on_resident(self, role: Role, delta: int) -> None:
        """``delta`` bytes of ``role``'s pages came to (> 0) or left the device."""
        self.resident += delta
        self.accounting.on_resident(role, delta)

    def park(self, b: Buffer) -> None:
        b.parked = True
        self.parked += b.span

    def unpark(self, b: Buffer, pages_gone: bool) -> None:
        """``b`` is parked no more: its pages hold its live data again, or (``pages_gone``) they
        leave tiermem's hands and the budget's count."""
        b.parked = False
        self.parked -= b.span
        if pages_gone:
            self.on_resident(b.role, -b.span)
