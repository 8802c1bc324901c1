"""Parked pages: device pages a shadow eviction keeps under a budget, for the next refill.

NOTE [parked pages]
    The discard is a large share of a dirty eviction's time, and giving pages back makes the next
    refill pay again for fresh ones (discard-and-prefetch); docs/data-paths.md, "Parked pages" and
    "Why copy plus discard stopped at ~0.78", has the figures. Under a budget those pages are
    tiermem's to hold anyway: the budget counts device memory tiermem keeps, not bytes of live
    data. So a shadow eviction under a budget *parks* the buffer: its data
    is in the shadow as before, but its managed range keeps its device pages, still counted in
    ``resident_bytes`` (and in ``parked_bytes``). A dirty eviction is then the copy alone, a clean
    one is nothing at all, and a refill reuses parked pages, copying the shadow in without a
    discard: its own pages if it still has them, else another parked buffer's of the same span.
    Then the two buffers trade ranges (``Block`` objects, with their ownership): the incoming one
    takes the pages and the parked one takes the incoming one's empty range. Its bound tensors
    follow the move (``rebind``). That is only safe for buffers that nothing else refers to, and
    the shadow paths already require that (NOTE [views and the fast paths]); a buffer with a live
    foreign view never moves, so ``data_ptr`` is stable while anyone holds a view.
    Parked pages go back to the driver (a fenced discard) when the budget needs room for anything
    else, on :meth:`Tier.trim`, on ``evict(..., release=True)``, and at ``close()``. Without a
    budget nothing parks: an eviction gives its pages back at once, as before.
    Small buffers (under 2 MiB, sharing pages with others) park too, since parking discards
    nothing: a group's small members then move by copy like the large ones. Before they parked they
    went through Unified Memory's write-back and came back by migration, a small share of a
    layer's bytes that cost a far larger share of its time (docs/data-paths.md, "Small buffers
    park too"). Their pages cannot be discarded, so giving them back moves them to the host,
    stale contents and all, and a refill without pages migrates them in before the copy.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..roles import Location
from .advice import Advisor, cached_plan
from .books import Books
from .ranges import coalesce
from .sidestreams import SideStreams
from .tensor import Buffer

__all__ = ["Parking"]


class Parking:
    """Which parked pages a refill takes, and giving parked pages back to the driver."""

    def __init__(self, backend: Any, books: Books, streams: SideStreams, advisor: Advisor):
        self.backend = backend
        self.books = books
        self.streams = streams
        self.advisor = advisor

    def pair(self, todo: Iterable[Buffer], exclude: Iterable[Buffer],
             pairs: dict[Buffer, Buffer]) -> dict[Buffer, Buffer]:
        """Match shadowed buffers of ``todo`` that have no pages with parked buffers of the same
        span outside ``exclude``, preferring one whose range has the same advice."""
        want = [b for b in todo if b.in_shadow and not b.parked and b not in pairs]
        if not want:
            return pairs
        donors: dict[int, list[Buffer]] = {}
        for d in self.books.parked_bufs([*exclude, *pairs.values()]):
            donors.setdefault(d.span, []).append(d)
        for c in want:
            ds = donors.get(c.span)
            if ds:
                plan = cached_plan(c.policy)
                same = [d for d in ds if d.policy == c.policy or cached_plan(d.policy) == plan]
                d = (same or ds)[0]
                ds.remove(d)
                pairs[c] = d
        return pairs

    def take_pages(self, c: Buffer, d: Buffer) -> None:
        """``c`` (in the shadow, without pages) takes parked ``d``'s range and its device pages;
        ``d`` keeps its shadow and takes ``c``'s range, which holds no pages (NOTE [parked
        pages]). Ranges keep the advice they were given, so it is given again if it differs."""
        c.block, d.block = d.block, c.block
        c.ptr, d.ptr = c.block.ptr, d.block.ptr
        c.parked, d.parked = True, False      # c's refill then unparks it like its own pages
        self.books.accounting.on_resident(d.role, -d.span)
        self.books.accounting.on_resident(c.role, c.span)
        if c.policy != d.policy and cached_plan(c.policy) != cached_plan(d.policy):
            self.advisor.apply(c)
            self.advisor.apply(d)

    def drop(self, cands: list[Buffer], amount: int | None = None) -> int:
        """Give back the pages of the coldest parked buffers in ``cands`` until ``amount`` bytes
        (all of them if None), in one fenced discard; returns the bytes given back."""
        chosen, freed = [], 0
        for b in sorted(cands, key=lambda b: b.last_use):
            if amount is not None and freed >= amount:
                break
            chosen.append(b)
            freed += b.span
        if not chosen:
            return 0
        side = self.streams.um("d2h")
        whole = [b for b in chosen if b.owns_pages]
        if whole:
            self.streams.quiesce()
            # Before the call, as an eviction counts its discard (NOTE [failed moves] in
            # core/moves.py): a parked buffer whose pages may be gone must not stay parked, or a
            # read-only one would be refilled from those pages (``Moves.intact``). Its data is in
            # its shadow.
            self._gave_back(whole)
            self.backend.discard(coalesce((b.block.alloc, b.ptr, b.span) for b in whole), side)
        shared = [b for b in chosen if not b.owns_pages]
        if shared:
            # Pages shared with other buffers cannot be discarded; Unified Memory moves them to
            # the host instead, as it evicts any small buffer (their contents are stale: the
            # data is in the shadow).
            self._gave_back(shared)
            self.backend.prefetch(coalesce((b.block.alloc, *self.advisor.page_range(b)) for b in shared),
                                  Location.HOST, side)
            for b in shared:
                self.books.accounting.on_move(b.role, "d2h", b.nbytes)
        return freed

    def _gave_back(self, bufs: list[Buffer]) -> None:
        for b in bufs:
            self.books.unpark(b, pages_gone=True)
            self.books.accounting.count(b.role, "park_release_ops")
