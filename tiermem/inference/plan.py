"""The residency plan of an adopted module: which of its groups stay resident within a device
budget and which stream (:func:`plan_residency`), and which streamed groups are read from disk
within a host budget (:func:`plan_host`, :func:`stay_home`). Pure functions; no GPU.

NOTE [streaming plan]
    Every module that owns parameters or buffers becomes one group. The plan keeps the largest
    groups resident for good (adjacent slices of one managed allocation each, never evicted), as
    many as fit in the budget after leaving a streaming window; the other groups stream. Pinning
    the largest groups leaves the smallest to stream, so the window (the largest ``lookahead``
    streamed groups together) is small and the pinned share large.

    Streamed groups live in one pinned host buffer, their home, whatever their ``requires_grad``
    says: managed memory never holds more than the budget, so a model much bigger than the
    device's real free memory is adopted as long as host memory holds it. Before a module runs,
    the next streamed groups in execution order are copied from the home into device slots on
    tiermem's H2D stream (the full link rate, no driver page work); after it runs, its tensors
    point at their home again, which moves nothing.

    Streaming moves each streamed byte once per forward, at the link rate. Reading in place,
    zero-copy, moves only what kernels read, at about the link rate (docs/facts.md), but batch-1
    GEMV kernels reading host pages ran well above the link bound (docs/history.md, "Inference"),
    so dense groups stream in every forward. Some groups are read in place instead: groups that
    only embeddings use (a lookup reads the rows of its tokens), and the own tensors of a module
    that encloses other groups (groups.enclosing_groups: a Mamba mixer's A_log, an attention's
    sinks), which its forward holds while its children take the slots; these take no slot and
    are pinned only with the budget left once the rest is planned. In a forward of few tokens
    (``zero_copy_max_tokens``, a decode step), groups of stacked expert weights are read in
    place, of which a decode reads only the experts its router picked. mode="zero_copy" reads
    every streamed group in place.

    The execution order is learned on the first forward (and again whenever a forward runs the
    modules in another order); until then groups come in on demand.

NOTE [no plan collapse]
    One tensor bigger than the budget once made the whole plan read in place: the window was
    sized by the largest streamed group, so a 1.57 GB tied embedding against a 1.45 GB budget
    left no room for even one slot, and all 67 groups of that model were read in place
    (issue 57). So the slot is chosen, not taken from the largest group: for each number of
    slots, from ``lookahead`` down, and each slot size among the groups' sizes (and their parts'),
    the groups that fit a slot stream whole; a group bigger than the slot must be pinned if
    slots of its own size would fit the budget (so that a model with no big tensor keeps its
    plan); one too big for that is streamed in parts if it can be cut (``split``: by rows for an
    embedding or head, by expert for stacked experts, inference/split.py), and any other is read
    in place whole (``oversized``). The pins that save the most are kept, as before. A plan is scored in streamed bytes: a byte read in place
    counts IN_PLACE_COST (batch-1 GEMV kernels reading host pages ran 1.18-1.24x the link
    bound: docs/history.md, "Inference"), and each part beyond a group's first PART_COST (a copy
    call, a chunk's kernel launches and a host sync in an experts loop: taken as ~0.1 ms, not
    measured yet), so a group too big for the slots is read in place instead where its parts would cost more (a
    small model's head: many parts of a few KiB). The most slots whose best plan reads in place
    no group that slots could hold whole wins, as the most slots that fit won before; where every
    number of slots reads one, the cheapest plan does. So the plan reads the whole model in place only when the
    budget cannot hold one slot of the smallest piece that could stream.

NOTE [experts by expert]
    A layer of stacked experts can reach its kernels two ways: whole (or in parts of several
    experts), one copy per stacked tensor through a slot at the link rate, or expert by expert,
    only the experts the router picked: read in place (IN_PLACE_COST per byte), or copied into
    the expert cache (NOTE [expert cache] in inference/experts.py), a copy and a dequantization
    call per expert (EXPERT_CALL_COST each, beside its bytes). Under uniform routing a forward of
    T tokens, each routed to k of E experts, is expected to pick E(1 - (1 - k/E)^T) of them, so
    :func:`by_expert` compares that many experts' cost with the whole layer's: a decode step
    (T = 1) goes expert by expert, a prefill (every expert picked) at the link rate, and the
    forward of a few tokens between them whichever costs less (read in place: up to 25 tokens
    for 60 experts and top-4, up to 6 for 8 experts and top-2). In mode "auto" a forward of at most
    ``zero_copy_max_tokens`` tokens that :func:`by_expert` sends expert by expert is a decode
    step; a model whose experts' top-k is not known keeps the token count alone.

NOTE [packed parts]
    A group both packed (NOTE [quantized streaming] in inference/quant.py) and cut (NOTE [split
    groups] in inference/split.py), a head or a layer of stacked experts bigger than a slot under
    ``stream_dtype``, streams packed in parts: a part is a range of the cut's rows (or experts),
    which is a range of each packed member's rows (a stacked member's rows are its experts' rows
    one after the other), so PinnedTransport.stream_packed brings exactly those rows from the
    packed home through the staging buffers and dequantizes them into the part's slot. The plan
    scores such a group at its packed bytes plus PART_COST a part, and its staging like any
    packed group's. A packed group has no copy in the model's dtype to read in place, so it is
    never ``oversized``: it streams (whole or in parts) or is pinned, and a slot size that would
    leave one read in place is not taken; with none left, the plan reads in place only (the
    module then refuses stream_dtype, raise the budget). A group read in place whole for any
    other reason (the disk tier cuts only what it can) keeps its home as it is, unpacked.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import ConfigError, TierMemError

__all__ = ["Plan", "plan_residency", "plan_host", "stay_home", "by_expert", "LINK_GBPS", "LOOKAHEAD", "IN_PLACE_COST",
           "PART_COST", "EXPERT_CALL_COST"]

LINK_GBPS = 55.0  # pinned H2D, as measured in docs/facts.md ("Transfer ceilings"); plans quote time at this rate
LOOKAHEAD = 3     # groups in flight by default (the window's slots)
IN_PLACE_COST = 1.2   # a byte read in place, in streamed bytes (NOTE [no plan collapse])
PART_COST = 4 << 20   # one more part of a split group, in streamed bytes: ~0.1 ms at the link rate (an estimate)
MAX_SLOT_SIZES = 16   # slot sizes tried per number of slots (the groups' sizes, thinned)
EXPERT_CALL_COST = 256 << 10   # one expert copied into the cache, beyond its bytes: ~5 us of calls at the link rate


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which groups stay resident within ``budget`` bytes and which stream (NOTE [streaming plan])."""

    budget: int
    total: int
    sizes: tuple[tuple[str, int], ...]     # (group, bytes) in module order
    pinned: frozenset[str]
    window: int                            # device bytes kept for streamed groups in flight
    zero_copy_only: bool                   # the budget cannot hold even the window: read in place
    lookahead: int = 1                     # streamed groups in flight (slots in the window)
    in_place: frozenset[str] = frozenset()  # gathered from (embeddings): read in place, never streamed
    host_budget: int | None = None          # pinned bytes allowed (NOTE [disk tier]); None: no limit
    on_disk: frozenset[str] = frozenset()   # streamed groups read from their files ahead of use
    stage_bytes: int = 0                    # one staging buffer (the largest group on disk)
    stages: int = 0                         # staging buffers
    host_sizes: tuple[tuple[str, int], ...] = ()   # (streamed group, bytes in the pinned home's layout)
    link_sizes: tuple[tuple[str, int], ...] = ()   # (group, bytes it moves over the link), where not its size
    staging: int = 0                        # of the window, device bytes packed groups cross into (NOTE [quantized streaming])
    slot: int = 0                           # bytes of one slot: the window is ``lookahead`` of them
    split: frozenset[str] = frozenset()     # streamed in parts of at most ``slot`` bytes (NOTE [no plan collapse])
    oversized: frozenset[str] = frozenset()  # bigger than a slot and not cut: read in place whole
    units: tuple[tuple[str, int], ...] = ()  # (group that can be cut, bytes of its smallest part)
    kv_budget: int = 0                      # device bytes beside ``budget`` kept for the KV cache (NOTE [kv plan])
    kv: Any = None                          # the KV cache's KVPlan (inference/kvplan.py), once it is known

    @property
    def pinned_bytes(self) -> int:
        return sum(n for g, n in self.sizes if g in self.pinned)

    @property
    def streamed_bytes(self) -> int:
        """Bytes not resident: they live in pinned host memory."""
        return self.total - self.pinned_bytes

    @property
    def moved_bytes(self) -> int:
        """Bytes a forward moves over the link: the streamed groups (whole, in parts, or read in
        place whole when too big for a slot; packed, where they are: NOTE [quantized streaming]
        in inference/quant.py), less those only embeddings read (a lookup reads only the rows of
        its tokens)."""
        return self.moved_bytes_but(())

    def moved_bytes_but(self, skip: Iterable[str]) -> int:
        """:attr:`moved_bytes` less the groups in ``skip`` (stacked experts, which a decode step
        reads by expert: NOTE [expert cache budget] in inference/module.py)."""
        skip = set(skip)
        link = dict(self.link_sizes)
        return sum(link.get(g, n) if g not in self.oversized else n for g, n in self.sizes
                   if g not in self.pinned and g not in self.in_place and g not in skip)

    @property
    def disk_bytes(self) -> int:
        """Bytes a forward reads from disk: the groups on disk (NOTE [disk tier]), as their files hold them."""
        return sum(n for g, n in self.sizes if g in self.on_disk)

    @property
    def home_bytes(self) -> int:
        """Pinned bytes of the home: the streamed groups not on disk, in the home's layout."""
        return sum(n for g, n in self.host_sizes if g not in self.on_disk)

    @property
    def pinned_host_bytes(self) -> int:
        """Pinned host memory the plan takes: the home and the staging buffers."""
        return self.home_bytes + self.stages * self.stage_bytes

    def predicted_seconds(self, link_GBps: float = LINK_GBPS, disk_GBps: float | None = None) -> float:
        """Lower bound of one forward's transfer time: the bytes streamed from the pinned home
        over the link rate, plus the bytes on disk over the disk rate. The two are added: the
        drive and the link are taken not to overlap, which is what the disk's reads allow once
        the drive is the slower (NOTE [disk tier]); a group on disk crosses the link too, but
        while the drive reads the next one."""
        host = (self.moved_bytes - self.disk_bytes) / (link_GBps * 1e9)
        if not self.disk_bytes:
            return host
        if not disk_GBps:
            raise TierMemError("this plan reads from disk: give the disk's read rate (disk_GBps)")
        return host + self.disk_bytes / (disk_GBps * 1e9)

    def table(self, link_GBps: float = LINK_GBPS, limit: int = 12) -> str:
        gb = lambda n: f"{n / 1e9:8.3f} GB"  # noqa: E731
        how = ("(read in place, zero-copy)" if self.zero_copy_only else
               f"through a {gb(self.window).strip()} window of {self.lookahead} slot(s)")
        here = sum(n for g, n in self.sizes if g in self.in_place and g not in self.pinned)
        link = dict(self.link_sizes)
        # Packed groups cross at their packed size (NOTE [quantized streaming]); what they would
        # be in the model's dtype is said beside, not counted as read in place.
        packed = sum(n for g, n in self.sizes if g in link and g not in self.pinned | self.in_place | self.oversized)
        lines = [] if not self.kv_budget else [
            f"one budget of {gb(self.budget + self.kv_budget).strip()}: {gb(self.budget).strip()} for the weights, "
            f"{gb(self.kv_budget).strip()} for the KV cache"]
        if self.kv is not None:
            lines.append(self.kv.table(link_GBps))
        lines += [f"budget {gb(self.budget)} of {gb(self.total)} weights: {len(self.pinned)} of {len(self.sizes)} groups "
                 f"resident ({gb(self.pinned_bytes)}), {gb(self.moved_bytes)} streamed per forward {how}"
                 + (f" (packed from {gb(packed).strip()} in the model's dtype)" if packed else "")
                 + (f", {gb(here).strip()} read in place (embeddings)" if here else "")
                 + (f"; {len(self.split)} group(s) bigger than a slot streamed in parts of {gb(self.slot).strip()}"
                    if self.split else "")
                 + (f"; {len(self.oversized)} group(s) bigger than a slot read in place whole "
                    f"({gb(sum(n for g, n in self.sizes if g in self.oversized)).strip()})" if self.oversized else "")]
        if self.on_disk:
            lines.append(f"host budget {gb(self.host_budget or 0).strip()}: {gb(self.home_bytes).strip()} in the pinned home, "
                         f"{gb(self.disk_bytes).strip()} in {len(self.on_disk)} groups read from disk through "
                         f"{self.stages} staging buffers of {gb(self.stage_bytes).strip()}")
        else:
            lines.append(f"predicted transfer time per forward at {link_GBps:.1f} GB/s: "
                         f"{self.predicted_seconds(link_GBps) * 1e3:.1f} ms")
        rows = [(g, n, "resident" if g in self.pinned else "in place" if g in self.in_place | self.oversized else
                 "disk" if g in self.on_disk else "parts" if g in self.split else "streamed") for g, n in self.sizes]
        for g, n, what in rows[:limit]:
            lines.append(f"  {what:<9}{gb(n)}  {g}")
        if len(rows) > limit:
            rest = rows[limit:]
            lines.append(f"  ... {len(rest)} more groups: {sum(1 for r in rest if r[2] == 'resident')} resident, "
                         f"{sum(1 for r in rest if r[2] in ('streamed', 'parts'))} streamed"
                         + (f", {sum(1 for r in rest if r[2] == 'disk')} on disk" if self.on_disk else ""))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def plan_residency(sizes: Iterable[tuple[str, int]], budget: int, lookahead: int = 2,
                   in_place: Iterable[str] = (), split: Mapping[str, int] | None = None,
                   part_cost: int | None = None, link: Mapping[str, int] | None = None,
                   staging: Mapping[str, int] | None = None, stages: int = 0,
                   part_staging: Mapping[str, tuple[int, int]] | None = None) -> Plan:
    """Choose the resident groups for ``budget`` bytes (NOTE [streaming plan]). Pure; no GPU.

    The window holds ``lookahead`` slots; the slot size is chosen (NOTE [no plan collapse]):
    groups that fit a slot stream whole, groups named in ``split`` (group -> bytes of its smallest
    part, a row or an expert) stream in parts of at most a slot, others bigger than a slot are
    read in place whole. For each slot size the costliest groups are pinned first (the k largest,
    then smaller ones into what is left, for each k), and the cheapest plan wins. Fewer slots are
    tried while every plan reads something in place; nothing streams (what fits is pinned, the
    rest read in place) only when no slot fits. Groups named in ``in_place`` (gathered from, like an
    embedding) need no slot: they are pinned last, with the budget left over. ``part_cost``
    defaults to PART_COST, read at call time. A group in ``link`` crosses the link at that many
    bytes (packed: NOTE [quantized streaming] in inference/quant.py), and one in ``staging``
    needs that many device bytes to cross into while it streams; the window holds ``stages`` of
    the largest beside its slots; one in ``part_staging`` too, (bytes per unit of its cut,
    bytes beside), needs no more than a part of it when it is split (NOTE [packed parts]).
    """
    sizes = tuple((str(g), int(n)) for g, n in sizes)
    gathered = frozenset(in_place)
    if lookahead < 1:
        raise ConfigError(f"lookahead must be at least 1, got {lookahead}")
    total = sum(n for _, n in sizes)
    links = tuple((str(g), int(n)) for g, n in (link or {}).items())
    if budget >= total:
        return Plan(budget, total, sizes, frozenset(g for g, _ in sizes), 0, False, 0, gathered, link_sizes=links)
    moving = [x for x in sizes if x[0] not in gathered]
    units = {str(g): max(1, int(u)) for g, u in (split or {}).items()}
    packed = _Packed(dict(links), {str(g): int(n) for g, n in (staging or {}).items()}, stages,
                     {str(g): (int(a), int(b)) for g, (a, b) in (part_staging or {}).items()})
    plan = _plan_moving(sizes, moving, budget, lookahead, total, units, PART_COST if part_cost is None else part_cost,
                        packed)
    plan = dataclasses.replace(plan, link_sizes=links)
    room = budget - plan.pinned_bytes - plan.window
    extra = []
    for g, n in sorted((x for x in sizes if x[0] in gathered), key=lambda x: -x[1]):
        if n <= room:
            extra.append(g)
            room -= n
    return dataclasses.replace(plan, pinned=plan.pinned | frozenset(extra), in_place=gathered,
                               units=tuple(sorted(units.items())))


def _slot_sizes(moving: list[tuple[str, int]], units: dict[str, int], most: int) -> list[int]:
    """The slot sizes worth trying, largest first: every group's size and every split group's
    part, thinned evenly to ``most`` (the largest and smallest kept)."""
    got = sorted({n for _, n in moving} | {u for g, u in units.items() if any(g == h for h, _ in moving)},
                 reverse=True)
    if len(got) <= most:
        return got
    step = (len(got) - 1) / (most - 1)
    return sorted({got[round(i * step)] for i in range(most)}, reverse=True)


@dataclasses.dataclass(frozen=True)
class _Packed:
    """What packing changes in a plan (NOTE [packed parts]): a group's bytes over the link, the
    staging it crosses into, and how many staging buffers the window holds."""

    link: dict[str, int]
    staging: dict[str, int]
    stages: int
    parts: dict[str, tuple[int, int]]       # group -> (staged bytes per unit of its cut, bytes beside)

    def need(self, g: str, fate: tuple[str, int], unit: int | None, slot: int) -> int:
        """Staging bytes ``g`` needs as it moves (``fate``: how); a part of it holds at most
        ``slot`` bytes, so at most ``slot // unit`` units of its cut."""
        if fate[0] == "whole":
            return self.staging.get(g, 0)
        if fate[0] != "split":
            return 0
        whole = self.staging.get(g, 0)
        if g not in self.parts or not unit:
            return whole
        per, beside = self.parts[g]
        return min(whole, slot // unit * per + beside)


def _plan_moving(sizes: tuple, moving: list[tuple[str, int]], budget: int, lookahead: int, total: int,
                 units: dict[str, int], part_cost: int, packed: _Packed) -> Plan:
    if not moving:
        return Plan(budget, total, sizes, frozenset(), 0, False, 0)
    if budget >= sum(n for _, n in moving):
        return Plan(budget, total, sizes, frozenset(g for g, _ in moving), 0, False, 0)
    slots = _slot_sizes(moving, units, MAX_SLOT_SIZES)
    cheapest: tuple[float, Plan] | None = None
    for la in range(lookahead, 0, -1):
        best: tuple[tuple[float, int], Plan] | None = None
        for s in slots:
            if la * s > budget:
                continue
            got = _pins(moving, budget, la, s, units, part_cost, packed)
            if got is None:
                continue
            key, pinned, split, oversized, forced, slot, staging = got
            plan = Plan(budget, total, sizes, pinned, la * slot + staging, False, la, slot=slot, split=split,
                        oversized=oversized, staging=staging)
            if best is None or (forced, key) < (best[2], best[0]):
                best = (key, plan, forced)
        if best is None:
            continue
        if not best[2]:
            return best[1]
        if cheapest is None or best[0][0] < cheapest[0]:
            cheapest = (best[0][0], best[1])
    if cheapest is not None:
        return cheapest[1]
    # No slot fits beside what must stay: nothing streams. What the budget holds is pinned,
    # largest first, and the rest is read in place.
    pinned, room = set(), budget
    for g, n in sorted(moving, key=lambda x: -x[1]):
        if n <= room:
            pinned.add(g)
            room -= n
    return Plan(budget, total, sizes, frozenset(pinned), 0, True, 0)


def _pins(moving: list[tuple[str, int]], budget: int, la: int, s: int, units: dict[str, int], part_cost: int,
          packed: _Packed) -> Any:
    """The best pins within ``budget`` less ``la`` slots of ``s`` bytes and the staging of what
    streams packed: ((cost, -pinned bytes), pinned, split, oversized, whether a group is read in
    place that slots could hold whole, slot actually needed, staging), or None when nothing would
    stream. A group bigger than the slot must be pinned if ``la`` slots of its size would fit the
    budget; one too big for that is streamed in parts if it can be cut and its parts cost less
    than reading it in place, else read in place (and not packed: NOTE [packed parts])."""
    cost: dict[str, float] = {}
    fate: dict[str, tuple[str, int]] = {}       # group -> (how it moves, bytes it needs in a slot)
    for g, n in moving:
        u = units.get(g)
        whole = IN_PLACE_COST * n
        link = packed.link.get(g, n)            # bytes it crosses the link at when it streams
        if n <= s:
            cost[g], fate[g] = link, ("whole", n)
        elif la * n <= budget:
            # Slots of its own would fit: a smaller slot leaves it no way but pinned (or read in
            # place, which a plan with bigger slots avoids). It is never cut, so a model with
            # no big tensor keeps the plan (and the bitwise results) it had.
            cost[g], fate[g] = whole, ("forced", 0)
        elif u is not None and u <= s:
            per = (s // u) * u
            parts = link + part_cost * (-(-n // per) - 1)
            # A packed group has no copy in the model's dtype to read in place (NOTE [packed parts]).
            cut = parts <= whole or g in packed.link
            cost[g], fate[g] = (parts, ("split", per)) if cut else (whole, ("oversized", 0))
        else:
            cost[g], fate[g] = whole, ("forced" if n <= budget else "oversized", 0)
    order = sorted(moving, key=lambda x: -cost[x[0]])        # pin what costs the most first
    # The staging the rest may need: the largest of the streaming groups from k on (those pinned
    # into what is left are counted too, which errs on the safe side).
    stage = [0] * (len(order) + 1)
    for k in range(len(order) - 1, -1, -1):
        g = order[k][0]
        stage[k] = max(stage[k + 1], packed.stages * packed.need(g, fate[g], units.get(g), s))
    best = None
    prefix = 0
    for k in range(len(order) + 1):
        if k:
            prefix += order[k - 1][1]
        room0 = budget - la * s - stage[k]
        if prefix > room0:
            continue
        room = room0 - prefix
        pinned = {g for g, _ in order[:k]}
        for g, n in order[k:]:
            if n <= room:
                pinned.add(g)
                room -= n
        rest = [g for g, _ in moving if g not in pinned]
        if any(g in packed.link and fate[g][0] in ("forced", "oversized") for g in rest):
            continue                 # a packed group would be read in place (NOTE [packed parts])
        staging = packed.stages * max((packed.need(g, fate[g], units.get(g), s) for g in rest), default=0)
        slot = max((fate[g][1] for g in rest), default=0)
        # Slots that stream nothing (kept only for a disk tier's parts) are no reason to prefer
        # more of them: such a plan weighs as one that reads in place what slots could hold, so
        # fewer, bigger slots that do stream are tried too (NOTE [no plan collapse]).
        idle = not slot
        if not slot and any(units.get(g, s + 1) <= s for g in rest):
            slot = s                 # kept for the parts a disk tier would stream (plan_host)
        if not slot:
            continue                 # everything left is read in place: the window would be wasted
        key = (sum(cost[g] for g in rest), -(room0 - room))
        if best is None or key < best[0]:
            best = (key, frozenset(pinned), frozenset(g for g in rest if fate[g][0] == "split"),
                    frozenset(g for g in rest if fate[g][0] in ("oversized", "forced")),
                    idle or any(fate[g][0] == "forced" for g in rest), slot, staging)
    return best


def by_expert(tokens: int, top_k: int, experts: int, expert_bytes: int, cached: bool = False) -> bool:
    """Whether a forward of ``tokens`` tokens, each routed to ``top_k`` of ``experts`` experts of
    ``expert_bytes`` each, should bring a layer's experts expert by expert (read in place, or
    through the expert cache when ``cached``) rather than whole (NOTE [experts by expert]). Pure."""
    if experts <= 0 or top_k <= 0:
        return False
    picked = experts * (1.0 - (1.0 - min(top_k, experts) / experts) ** max(0, tokens))
    each = expert_bytes + EXPERT_CALL_COST if cached else IN_PLACE_COST * expert_bytes
    return picked * each < experts * expert_bytes


def plan_host(plan: Plan, host_sizes: Iterable[tuple[str, int]], host_budget: int | None, stages: int = 3,
              keep: Iterable[str] = (), disk_sizes: Mapping[str, int] | None = None) -> Plan:
    """Split ``plan``'s streamed groups between the pinned home and the disk within ``host_budget``
    pinned bytes (NOTE [disk tier]). Pure; no GPU. ``host_sizes`` gives each streamed group's bytes
    in the home's layout, in execution order; groups in ``keep`` (and those read in place) must
    stay in the home. The rest are kept in the home spread evenly along the order, so that reads
    from disk alternate with copies from the home, as far as the budget left after ``stages``
    staging buffers allows. A staging buffer holds what a slot does: the largest group that may
    go to disk, or one part of a split group, so a layer of stacked experts bigger than a slot
    is staged a part at a time. A group in ``disk_sizes`` takes that many bytes read from its
    files (a packed home holds it in fewer: NOTE [quantized streaming] in inference/quant.py).
    Raises :class:`OutOfBudgetError` when even that cannot fit."""
    from ..errors import HostBudgetError
    streamed = [(str(g), int(n)) for g, n in host_sizes if g not in plan.pinned]
    total = sum(n for _, n in streamed)
    plan = dataclasses.replace(plan, host_budget=host_budget, host_sizes=tuple(streamed))
    if host_budget is None or total <= host_budget:
        return plan
    # A group read in place has to stay in the home; one that can be cut streams its parts from
    # disk instead (NOTE [no plan collapse]: in place was chosen over parts only by their cost).
    cut = {g for g, u in plan.units if g in plan.oversized and u <= plan.slot}
    plan = dataclasses.replace(plan, split=plan.split | cut, oversized=plan.oversized - cut)
    fixed = set(keep) | set(plan.in_place) | set(plan.oversized)
    movable = [(g, n) for g, n in streamed if g not in fixed]
    kept = sum(n for g, n in streamed if g in fixed)
    # A staging buffer holds what a slot holds: a whole group, or one part of a split one, as
    # its files hold them.
    raw = dict(disk_sizes or {})
    piece = {g: min(raw.get(g, n), plan.slot) if g in plan.split else raw.get(g, n) for g, n in movable}
    stage = max(piece.values(), default=0)
    # A pinned block may take up to a page more than asked (the driver pins whole pages).
    room = host_budget - stages * stage - kept - (stages + 1) * 4096
    if plan.zero_copy_only:
        raise ConfigError(f"{total:,} streamed bytes do not fit host_budget={host_budget:,}, and groups on disk "
                          "must stream through a window the device budget has no room for; raise the budget")
    if not movable or room < 0:
        raise HostBudgetError(kept + stages * stage, 0, host_budget,
                               hint=f"host_budget is too small for a disk tier: the groups that must stay in pinned "
                               f"memory take {kept:,} bytes and {stages} staging buffers {stages * stage:,}")
    share = room / max(1, sum(n for _, n in movable))
    home, got, seen = set(), 0, 0
    for g, n in movable:                  # evenly along the order: disk reads and home copies alternate
        seen += n
        if got + n <= min(room, share * seen + 1):
            home.add(g)
            got += n
    for g, n in sorted(movable, key=lambda x: -x[1]):   # what room is left, largest first
        if g not in home and got + n <= room:
            home.add(g)
            got += n
    disk = frozenset(g for g, _ in movable if g not in home)
    stage = max((piece[g] for g in disk), default=0)
    # A group on disk crosses as its files hold it, and one cut here was read in place, so not
    # packed (NOTE [packed parts]).
    links = tuple((g, n) for g, n in plan.link_sizes if g not in disk and g not in cut)
    return dataclasses.replace(plan, on_disk=disk, stage_bytes=stage, stages=stages if disk else 0, link_sizes=links)


def stay_home(groups: Iterable[tuple[str, list[Any]]], in_files: Callable[[Any], bool]) -> set[str]:
    """The groups that cannot go to disk (NOTE [disk tier]): those with a buffer (a forward may
    write it), and those with a tensor ``in_files`` says is not in a file byte for byte."""
    import torch
    return {name for name, ts in groups if any(not isinstance(t, torch.nn.Parameter) or not in_files(t) for t in ts)}
