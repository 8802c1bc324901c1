"""Where an expert coming into the expert cache goes, so that a group's cached experts sit in
slots in the order of their numbers (NOTE [experts in number order]).

NOTE [experts in number order]
    The eager experts loop adds a token's experts in the order of their numbers, renumbered to
    slots in the order of their slots (NOTE [cached experts sum alike] in experts.py): a call
    whose routed experts' slots do not rise with their numbers runs in several rounds, each a
    full pass of the module's loop (its one-hot, its host syncs, the zero slot too). So for a
    group whose calls keep the order, every cached expert's slot rises with its number, over
    all of that group's cached experts (other groups' experts may sit anywhere between): then
    any call's hits are in order, and a call is one round whatever it routes to.
    A new expert takes the slot the eviction chooses (the least often routed: NOTE [expert
    cache]); moves only break ties between slots that score alike. Where that slot lies
    outside the new expert's place among its group's slots (between the slots of its cached
    neighbours by number), the group's experts from its place up to the slot shift by one of
    the group's slots towards it: the last into the slot, each of the others into the slot of
    the one before, and the new expert into the one freed at its place. Each shift is one
    copy of an expert from slot to slot on the device (microseconds for an expert of tens of
    MB), queued on the copy lane in that order, so no slot is written before it is copied out
    (SlotRing.move orders each after its destination's last reader and its source's fill).
    A round of the module costs a host sync and dozens of launches; a move, two launches.
"""
from __future__ import annotations

import bisect
import itertools

__all__ = ["placement"]


def placement(slots: list[int], below: int, v: int) -> tuple[list[tuple[int, int]], int]:
    """Where a new expert goes when slot ``v`` is given up for it: ``slots`` are the slots of
    its group's cached experts (``v``'s own occupant left out) in the order of their numbers,
    ``below`` how many of them have lower numbers than the new one. Returns the moves (from
    slot, to slot), in the order they must run, and the slot the new expert takes, so that
    the group's slots rise with their numbers after (NOTE [experts in number order]). Where
    ``slots`` do not rise already, no move can keep an order there is not: ``([], v)``."""
    if any(a >= b for a, b in itertools.pairwise(slots)) or v in slots or not 0 <= below <= len(slots):
        return [], v
    lo = slots[below - 1] if below > 0 else -1
    hi = slots[below] if below < len(slots) else None
    if lo < v and (hi is None or v < hi):
        return [], v
    j = bisect.bisect_left(slots, v)
    if lo < v:          # v lies above the place: the experts from the place up to v shift up
        chain = slots[below:j]
        return [(chain[-1], v)] + [(chain[k - 1], chain[k]) for k in range(len(chain) - 1, 0, -1)], chain[0]
    chain = slots[j:below]   # below the place: the experts from v up to the place shift down
    return [(chain[0], v)] + [(chain[k + 1], chain[k]) for k in range(len(chain) - 1)], chain[-1]
