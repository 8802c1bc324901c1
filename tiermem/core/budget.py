"""The budget: the one the user configured and the handles' leases on it (NOTE [budget leases] in
core/leases.py), which together decide the budget the books hold to (NOTE [device budget] in
base/limits.py)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..base.limits import parse_bytes
from ..errors import OutOfBudgetError
from .books import Books
from .leases import BudgetLease, Leases

__all__ = ["Budget"]

log = logging.getLogger("tiermem")


class Budget:
    """The configured budget (bytes, or None) and the live leases. Every change is held to at
    once through ``hold_to`` (core/eviction.py's :meth:`Eviction.hold_to`), which evicts what no
    longer fits; a change that cannot be held to changes nothing."""

    def __init__(self, backend: Any, books: Books, configured: int | None, hold_to: Callable[[int | None], None]):
        self.backend = backend
        self.books = books
        self._configured = configured
        self._leases = Leases()
        self._hold_to = hold_to

    @property
    def configured(self) -> int | None:
        return self._configured

    def set(self, budget: int | str | None) -> int | None:
        """Change the configured budget, evicting at once what no longer fits. Returns the old
        configured budget. A budget smaller than the live leases is refused
        (:class:`OutOfBudgetError`), changing nothing."""
        total = self.backend.capabilities().total_memory
        new = None if budget is None else parse_bytes(budget, total=total, what="device budget", max_percent=100)
        with self.books.lock:
            if new is not None and self._leases.nbytes > new:
                raise OutOfBudgetError(self._leases.nbytes, self.books.resident, new,
                                       "handles hold leases on more than that ("
                                       + ", ".join(f"{x.owner}: {x.nbytes:,} B" for x in self._leases)
                                       + "); unwrap them first")
            old, self._configured = self._configured, new
            try:
                self._hold_to(self._leases.enforced(new))
            except BaseException:
                self._configured = old
                raise
        return old

    def room(self) -> int | None:
        """Bytes a new lease may take (NOTE [budget leases]): the configured budget less the live
        leases; None where no budget is configured, so that any lease fits."""
        with self.books.lock:
            return self._leases.room(self._configured)

    def lease(self, nbytes: int, owner: str) -> BudgetLease:
        """Take ``nbytes`` of the budget for ``owner`` (a handle), until the returned lease is
        released (NOTE [budget leases]). Without a configured budget, the enforced budget grows
        by ``nbytes``; with one, the lease must fit its room (:meth:`room`), else
        :class:`OutOfBudgetError`."""
        nbytes = self._leases.check(nbytes)
        with self.books.lock:
            room = self._leases.room(self._configured)
            if room is not None and nbytes > room:
                raise OutOfBudgetError(nbytes, self._configured - room, self._configured,
                                       f"the configured budget has {room:,} B left for leases")
            lease = self._leases.add(nbytes, owner, self._end_lease)
            try:
                self._hold_to(self._leases.enforced(self._configured))
            except BaseException:
                lease.release()
                raise
        return lease

    @property
    def leases(self) -> tuple[BudgetLease, ...]:
        """The live budget leases, in the order taken."""
        with self.books.lock:
            return tuple(self._leases)

    def _end_lease(self, lease: BudgetLease) -> None:
        with self.books.lock:
            self._leases.remove(lease)
            try:
                self._hold_to(self._leases.enforced(self._configured))
            except OutOfBudgetError as e:
                # What is left cannot all leave the device now (never-evicted tensors, or tensors
                # in use): the smaller budget holds from the next placement on. Giving a lease back
                # runs on unwrap and on a failed adoption, which must not fail over it.
                self.books.budget = self._leases.enforced(self._configured)
                log.warning("tiermem: a lease given back leaves more on the device than the budget: %s", e)
