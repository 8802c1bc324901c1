"""Eviction: room on the device within the budget, made by giving parked pages back (NOTE [parked
pages] in core/parking.py) and then evicting the coldest evictable buffers."""
from __future__ import annotations

import collections
import logging

from ..errors import OutOfBudgetError
from ..roles import Evict, Location
from .books import Books
from .moves import Moves
from .parking import Parking
from .sidestreams import SideStreams
from .tensor import Buffer

__all__ = ["Eviction"]

log = logging.getLogger("tiermem")


class Eviction:
    """Holds the books to their budget (``Books.budget``): makes room for what comes to the
    device, and holds to a new budget when the budget changes (:meth:`hold_to`). The caller holds
    the books' lock."""

    def __init__(self, books: Books, streams: SideStreams, parking: Parking, moves: Moves):
        self.books = books
        self.streams = streams
        self.parking = parking
        self.moves = moves

    def hold_to(self, new: int | None) -> None:
        """Hold to budget ``new`` from now on, evicting at once what no longer fits; a budget
        that cannot be met changes nothing (raises OutOfBudgetError)."""
        books = self.books
        with books.lock:
            self.streams.reap()             # finished moves let go of buffers freed meanwhile
            old, books.budget = books.budget, new
            books.staging.yielded = False
            books.staging.release(self.streams.um, new, unwanted_only=True)
            if new is None:   # nothing parks without a budget (NOTE [parked pages])
                self.parking.drop(books.parked_bufs())
            elif books.held() > new:
                try:
                    self.make_room(0, exclude=set())
                except OutOfBudgetError:
                    books.budget = old
                    raise

    def _yield_ring(self) -> int:
        """Give the rings' room to tensors that need it: tensors come first, the rings only make
        copies faster. They stay off until the budget changes, so that they never take the room
        back by evicting a tensor the next move needs (NOTE [staging ring])."""
        staging = self.books.staging
        staging.yielded = True
        log.info("tiermem: the staging rings give their %d bytes of the budget to tensors; shadow copies "
                 "go direct until the budget changes", staging.nbytes)
        return staging.release(self.streams.um)

    def make_room(self, need: int, exclude: set[Buffer]) -> None:
        """Make ``need`` more bytes fit the budget: give parked pages back first (NOTE [parked
        pages]), then evict the coldest evictable resident buffers, releasing their pages."""
        books = self.books
        if books.budget is None:
            return
        over = books.held() + need - books.budget
        if over <= 0:
            return
        over -= self.parking.drop(books.parked_bufs(exclude), over)
        if over > 0:
            try:
                victims = self._victims(over, need, exclude)
            except OutOfBudgetError:
                if not books.staging.nbytes:
                    raise
                over -= self._yield_ring()
                if over <= 0:
                    return
                victims = self._victims(over, need, exclude)
            self.moves.evict(victims, non_blocking=True, release=True, for_room=True)

    def _victims(self, over: int, need: int, exclude: set[Buffer]) -> list[Buffer]:
        """The coldest evictable resident buffers whose pages add up to ``over`` bytes."""
        cands = [b for b in self.books.live()
                 if b.where is Location.DEVICE and b not in exclude and b.policy.evict is not Evict.NEVER]
        cands.sort(key=lambda b: (b.policy.evict_priority, b.last_use))
        chosen, freed = [], 0
        for b in cands:
            if freed >= over:
                break
            chosen.append(b)
            freed += b.span
        if freed < over:
            raise OutOfBudgetError(
                need, self.books.resident, self.books.budget,
                "Everything else resident is in use or never evicted (Evict.NEVER); raise the "
                "budget or free tensors")
        self.books.accounting.count_many(collections.Counter((b.role, "evict_budget_ops") for b in chosen))
        return chosen

    def room_for(self, todo: list[Buffer], exclude: set[Buffer]) -> dict[Buffer, Buffer]:
        """Make room for a prefetch of ``todo`` within the budget. Shadowed buffers take parked
        pages where they can (NOTE [parked pages]), the victims' included: the victims' copies
        out and the refills' copies in then meet in the same pages with no discard between.
        Returns {incoming buffer: parked buffer whose pages it takes}. Makes room for the staging
        ring too where the refill will use it and it is not allocated yet (NOTE [staging ring]);
        if the budget has room for the tensors but not the ring as well, they copy direct."""
        books, staging = self.books, self.books.staging
        if books.budget is None:
            return self.parking.pair(todo, exclude, {})
        # The refills' ring, and the evictions' one for the victims to come (sized by the refill's
        # bytes, the victims' being unknown yet): both if they fit, else the refills' alone.
        n = self.moves.copy_in_bytes(todo)
        want = [d for d in ("h2d", "d2h") if staging.wanted(d, n, books.budget) and not staging.ring(d).allocated]
        if "h2d" in want:
            for rings in ([want, ["h2d"]] if len(want) > 1 else [want]):
                try:
                    pairs = self._room_within(todo, exclude, sum(staging.ring(d).nbytes for d in rings))
                except OutOfBudgetError:
                    continue
                for d in rings:
                    staging.allocate(d)
                return pairs
        try:
            return self._room_within(todo, exclude, 0)
        except OutOfBudgetError:
            if not staging.nbytes:
                raise
            self._yield_ring()
            return self._room_within(todo, exclude, 0)

    def _room_within(self, todo: list[Buffer], exclude: set[Buffer], extra: int) -> dict[Buffer, Buffer]:
        """``room_for`` with ``extra`` more bytes to fit (the ring's). Raises OutOfBudgetError
        before it evicts anything if they cannot fit."""
        books = self.books
        pairs = self.parking.pair(todo, exclude, {})

        def over() -> int:
            need = sum(b.span for b in todo if b.where is not Location.DEVICE and not b.parked and b not in pairs)
            return books.held() + extra + need - books.budget

        if over() > 0:   # parked pages no incoming buffer can take go back first
            self.parking.drop(books.parked_bufs([*exclude, *pairs.values()]), over())
        if over() > 0:
            need = sum(b.span for b in todo if b.where is not Location.DEVICE and not b.parked) + extra
            victims = self._victims(over(), need, exclude)
            self.moves.evict(victims, non_blocking=True, for_room=True)   # parks the ones that take a shadow path
            pairs = self.parking.pair(todo, exclude, pairs)
            if over() > 0:
                self.parking.drop([v for v in victims if v.parked and v not in pairs.values()], over())
        return pairs
