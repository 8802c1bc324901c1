"""Placement: new buffers (alone, or a group sharing one allocation), their first place within the
budget, the device memory counted outside them, and their end."""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..cuda.backend import Block, round_request
from ..errors import OutOfBudgetError
from ..roles import Location, Policy, Prefetch, Role, as_role
from .advice import Advisor
from .books import Books
from .eviction import Eviction
from .moves import Moves
from .ranges import member_span
from .tensor import Buffer, Tier

__all__ = ["Placement"]

log = logging.getLogger("tiermem")


class _SharedBlock:
    """Owns the one allocation a group's buffers are slices of; gives it back when the last goes."""

    __slots__ = ("block",)

    def __init__(self, block: Any):
        self.block = block

    def __del__(self) -> None:
        try:
            self.block.release()
        except Exception:  # pragma: no cover - destructors log, never raise
            log.exception("tiermem: error while freeing a group")


class Placement:
    """Allocates buffers for ``tier`` (the engine their tensors call back), places them, and
    gives their memory back when the last owner goes."""

    def __init__(self, backend: Any, books: Books, advisor: Advisor, eviction: Eviction, moves: Moves):
        self.backend = backend
        self.books = books
        self.advisor = advisor
        self.eviction = eviction
        self.moves = moves

    def new_buffer(self, tier: Tier, nbytes: int, role: Role | str, policy: Policy | None,
                   changes: Mapping[str, Any], name: str | None) -> Buffer:
        """A buffer of ``nbytes`` with its own allocation, not yet advised or placed."""
        r = as_role(role)
        pol = self.advisor.resolve_policy(r, policy, changes)
        request, size_class = round_request(nbytes)
        block = self.backend.allocate(request, f"{r.value}/{size_class}")
        buf = Buffer(tier, block, nbytes, r, pol, name)
        buf.last_use = self.books.tick()
        self.books.accounting.on_alloc(r, nbytes)
        self.books.add(buf)
        return buf

    def new_group(self, tier: Tier, sizes: list[int], role: Role | str, names: list[str | None],
                  policy: Policy | None, changes: Mapping[str, Any]) -> list[Buffer]:
        """Buffers of ``sizes`` bytes as adjacent slices of one allocation (:meth:`Tier.empty_group`),
        advised and placed."""
        r = as_role(role)
        pol = self.advisor.resolve_policy(r, policy, changes)
        offsets, spans, off = [], [], 0
        for n in sizes:
            span, align = member_span(n)
            off = -(-off // align) * align
            offsets.append(off)
            spans.append(span)
            off += span
        request, size_class = round_request(off)
        block = self.backend.allocate(request, f"{r.value}/{size_class}")
        group = _SharedBlock(block)
        bufs = []
        for n, span, name, off in zip(sizes, spans, names, offsets):
            sub = Block(block.ptr + off, span, block.pool_key, group, alloc=block.alloc)
            buf = Buffer(tier, sub, n, r, pol, name)
            buf.last_use = self.books.tick()
            self.books.accounting.on_alloc(r, n)
            bufs.append(buf)
        with self.books.lock:     # all of the group at once: no walk of the books sees part of it
            for b in bufs:
                self.books.add(b)
        for b in bufs:
            self.advisor.apply(b)
        self.place(bufs)
        return bufs

    def place(self, bufs: list[Buffer]) -> None:
        """Give new buffers their first place, so the budget counts them before anything writes them.

        Host-preferred buffers stay unplaced: the preferred-location rule puts their pages on the
        host at first touch, so nothing is moved and nothing is resident. Others get device pages
        now, within the budget; buffers that cannot fit are made host-preferred and read in place
        (zero-copy), since a device write would otherwise take pages the budget never counted.
        """
        pol = bufs[0].policy
        if pol.preferred_location is Location.HOST or pol.prefetch is Prefetch.NEVER:
            return
        try:
            with self.books.lock:
                self.eviction.make_room(sum(b.span for b in bufs), exclude=set(bufs))
                big = [b for b in bufs if b.owns_pages]
                if big:
                    self.moves.move_in(big, None, non_blocking=False)
                for b in bufs:
                    if not b.owns_pages:
                        # Shared pages (NOTE [size classes]): the first device touch places them
                        # by the preferred-location rule; a prefetch per small array costs more.
                        b.where = Location.DEVICE
                        self.books.on_resident(b.role, b.span)
        except OutOfBudgetError:
            log.debug("tiermem: %s bytes do not fit the budget; reading them in place", sum(b.nbytes for b in bufs))
            for b in bufs:
                self.advisor.change_policy(b, None, {"preferred_location": Location.HOST, "accessed_by_device": True,
                                                     "read_mostly": False})

    def reserve(self, nbytes: int, role: Role) -> None:
        """Count device memory tiermem uses outside managed buffers (a streaming window) against
        the budget, making room first; raises OutOfBudgetError if it cannot fit."""
        with self.books.lock:
            self.eviction.make_room(nbytes, exclude=set())
            self.books.on_resident(role, nbytes)

    def unreserve(self, nbytes: int, role: Role) -> None:
        with self.books.lock:
            self.books.on_resident(role, -nbytes)

    def owner_of(self, ptr: int) -> Buffer | None:
        """The live buffer whose managed range or shadow holds address ``ptr``, if any."""
        with self.books.lock:
            for b in self.books.live():
                if b.ptr <= ptr < b.ptr + max(b.nbytes, 1):
                    return b
                if b.shadow is not None and b.shadow.ptr <= ptr < b.shadow.ptr + max(b.nbytes, 1):
                    return b
        return None

    # NOTE [finalizer race]
    # CPython runs a finalizer (``Buffer.__del__``) *before* it clears the object's weak
    # references, and the finalizer waits here for the lock. Meanwhile another thread that holds
    # the lock can still find the buffer in the books' set of buffers (a WeakSet) and evict it, or
    # find it after this method ran: the buffer was then counted off twice (the concurrency test in
    # tests/test_engine.py saw resident_bytes at -64 KiB in CI). So a gone buffer leaves the set
    # here, under the lock, is marked ``gone``, and every walk of the set skips gone buffers
    # (``Books.live``).
    def gone(self, buf: Buffer) -> None:
        """The last owner of ``buf`` went: give its memory back. Called from __del__."""
        books = self.books
        with books.lock:
            if buf.gone:
                return
            buf.gone = True
            books.forget(buf)
            if buf.parked:
                books.unpark(buf, pages_gone=True)
            elif buf.where is Location.DEVICE:
                books.on_resident(buf.role, -buf.span)
            buf.where = None
            if buf.shadow is not None:
                books.shadow_bytes -= buf.shadow.nbytes
                buf.shadow.release()
        books.accounting.on_free(buf.role, buf.nbytes)
        buf.block.release()

