"""A lifetime-planned arena for a training step's temporaries: where each would sit in one device
arena, from the sizes and lifetimes a traced step shows (NOTE [lifetime arena]). Pure Python and
numpy; the trace comes from torch's allocator history (:func:`temps_from_trace`).

NOTE [lifetime arena]
    torch's caching allocator places each tensor when it is asked for, knowing nothing of what
    comes next, so its reserved bytes run above the bytes live at any moment (rounding, blocks
    split and cached per size and stream). A traced step knows every temporary's size and when
    it is allocated and freed; SmartPool (arXiv 1903.06631, 13.3% less memory than the default
    pool) lays them out ahead of time. This is the greedy-by-size heuristic for that layout (the
    dynamic storage allocation problem): largest first, each at the lowest offset, best fit among
    the gaps, that no temporary alive at the same time occupies. Its peak is never below the
    live peak (the most bytes alive at once), which bounds any layout from below.
    What is built: the plan and its measure (bench/train_budget.py's ``arena`` figures, against
    torch's reserved peak on the same step). Not built: running the step's allocations from
    such an arena (torch would need a pluggable allocator that replays the plan), and spending
    the bytes it saves on kept activations.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["Temp", "ArenaPlan", "plan_arena", "live_peak", "temps_from_trace"]

ALIGN = 512     # torch's caching allocator rounds every block to 512 bytes


@dataclasses.dataclass(frozen=True)
class Temp:
    """A temporary of ``size`` bytes, alive from event ``start`` to event ``end`` (exclusive)."""

    size: int
    start: int
    end: int


@dataclasses.dataclass(frozen=True)
class ArenaPlan:
    """Each temporary's offset in the arena, the arena's bytes (``peak``), and the most bytes
    alive at once (``live_peak``, a lower bound for any layout)."""

    offsets: tuple[int, ...]
    peak: int
    live_peak: int


def _aligned(n: int, align: int) -> int:
    return -(-int(n) // align) * align


def live_peak(temps: Iterable[Temp], align: int = ALIGN) -> int:
    """The most bytes (each size aligned) alive at one time."""
    events = []
    for t in temps:
        if t.end > t.start and t.size > 0:
            events.append((t.start, 1, _aligned(t.size, align)))
            events.append((t.end, 0, -_aligned(t.size, align)))   # frees sort before allocations at a tie
    cur = best = 0
    for _, _, d in sorted(events):
        cur += d
        best = max(best, cur)
    return best


def plan_arena(temps: Sequence[Temp], align: int = ALIGN) -> ArenaPlan:
    """Offsets for ``temps`` in one arena (NOTE [lifetime arena]): no two temporaries alive at the
    same time share a byte. Greedy by size, best fit."""
    import numpy as np
    n = len(temps)
    size = np.array([_aligned(t.size, align) for t in temps], dtype=np.int64)
    start = np.array([t.start for t in temps], dtype=np.int64)
    end = np.array([t.end for t in temps], dtype=np.int64)
    offsets = np.full(n, -1, dtype=np.int64)
    placed = np.zeros(n, dtype=bool)
    order = sorted(range(n), key=lambda i: (-size[i], start[i], i))
    peak = 0
    for i in order:
        if size[i] == 0 or end[i] <= start[i]:
            offsets[i] = 0
            continue
        clash = placed & (start < end[i]) & (end > start[i])
        best, best_gap, top = None, None, 0
        for j in np.argsort(offsets[clash], kind="stable"):
            k = np.flatnonzero(clash)[j]
            gap = offsets[k] - top
            if gap >= size[i] and (best_gap is None or gap < best_gap):
                best, best_gap = top, gap
            top = max(top, offsets[k] + size[k])
        offsets[i] = top if best is None else best
        placed[i] = True
        peak = max(peak, int(offsets[i] + size[i]))
    return ArenaPlan(tuple(int(x) for x in offsets), peak, live_peak(temps, align))


def temps_from_trace(events: Iterable[dict[str, Any]]) -> tuple[list[Temp], int]:
    """The temporaries of one window of torch's allocator history (the ``device_traces`` entries
    of ``torch.cuda.memory._snapshot()``): each ``alloc`` paired with the ``free_requested`` of
    its address; one never freed in the window lives to its end, and one freed in the window but
    allocated before it (last step's gradients, say) lives from its start. Returns them and the
    bytes of the latter, which the memory allocated at the window's start already counts."""
    temps: list[Temp] = []
    open_: dict[int, tuple[int, int]] = {}
    before = 0
    t = 0
    for ev in events:
        action = ev.get("action")
        if action == "alloc":
            open_[ev["addr"]] = (t, int(ev["size"]))
        elif action == "free_requested":
            got = open_.pop(ev["addr"], None)
            if got is None:
                before += int(ev["size"])
                temps.append(Temp(int(ev["size"]), 0, t))
            else:
                temps.append(Temp(got[1], got[0], t))
        else:
            continue
        t += 1
    temps.extend(Temp(size, start, t) for start, size in open_.values())
    return temps, before
