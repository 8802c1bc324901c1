"""Ranges of managed memory: how a group's members are laid out, and merging adjacent ranges so
that one CUDA call moves them all."""
from __future__ import annotations

from collections.abc import Iterable

from ..cuda.backend import LARGE

__all__ = ["GROUP_ALIGN", "member_span", "coalesce"]

GROUP_ALIGN = 64 << 10   # members of a group start on 64 KiB boundaries: no page is shared


def member_span(nbytes: int) -> tuple[int, int]:
    """(span, alignment) of a group member: members of 2 MiB or more take whole 2 MiB pages, so
    each can be discarded on its own (``Buffer.owns_pages``); smaller ones take 64 KiB."""
    step = LARGE if nbytes >= LARGE else GROUP_ALIGN
    return -(-max(int(nbytes), 1) // step) * step, step


def coalesce(ranges: Iterable[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """(alloc, ptr, nbytes) ranges, sorted, with ranges that touch inside one allocation merged.
    A group's members are adjacent slices of one allocation, so a whole group moves in one call
    (large calls run at link rate); a range spanning two allocations is refused by CUDA."""
    out: list[list[int]] = []
    for a, p, n in sorted(ranges, key=lambda r: (r[1], r[0])):
        if out and out[-1][0] == a and p == out[-1][1] + out[-1][2]:
            out[-1][2] += n
        else:
            out.append([a, p, n])
    return [(p, n) for _, p, n in out]
