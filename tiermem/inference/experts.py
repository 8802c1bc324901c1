"""The expert cache of a mixture of experts in decode (NOTE [expert cache]): which groups it
serves (:func:`expert_module`, :func:`cacheable`), the cache itself (:class:`ExpertCache`: slots
of one expert each, least recently used first out, the next layer's experts brought in ahead),
and the experts module's forward through it (:func:`cached_forward`).

NOTE [expert cache]
    transformers 5 keeps a layer's experts stacked (``gate_up_proj`` [experts, 2 x inter,
    hidden], ``down_proj`` [experts, hidden, inter]) in an experts module called as
    ``experts(hidden_states, top_k_index, top_k_weights)``, whatever its implementation (the eager
    loop, batched_mm, grouped_mm) does inside. A decode step routes each token to a few experts,
    and a few experts are chosen far more often than others in trained models, so with
    ``expert_cache=`` bytes of the budget the experts a decode routes to are kept on the device:
    - The cache is one region per stacked parameter, ``slots`` experts long, laid out as the
      module's own parameter ([slots, 2 x inter, hidden], ...), so the module runs on it as it is:
      the parameters are bound to the cache for the call, ``num_experts`` is the slot count, and
      ``top_k_index`` is renumbered from experts to their slots. Every implementation computes
      each token's experts with the same weights; the eager loop adds a token's experts in the
      order of their slots instead of their numbers, so its sums may differ in the last bit
      (batched_mm and grouped_mm sum over a token's picks in their order: equal to the bit).
    - A call finds its experts (one host sync, as the eager loop has too); those not cached are
      copied in, each over the slot used longest ago that this call does not use, from the pinned
      home at the link rate (packed ones cross packed and are dequantized into their slot:
      NOTE [quantized streaming]); the forward waits on the device for their copies.
    - After a call, the experts the next layer (learned from the order of calls) chose the last
      time are brought in ahead, so their copies overlap this layer's compute and the next
      layer's attention.
    - A call that routes to more experts than there are slots runs in rounds of at most
      ``slots`` experts, each with the others' routing weights set to zero, and adds the rounds'
      outputs (equal to rounding).
    handle.stats() reports ``expert_cache.hits``, ``.misses``, ``.hit_rate``, ``.prefetched``,
    ``.prefetch_hits`` (a routed expert found because it was brought in ahead), ``.evictions``,
    ``.rounds`` and ``.slots``. A forward of many tokens (a prefill) does not use the cache: it
    streams the layers whole at the link rate (NOTE [experts by expert] in inference/plan.py).
"""
from __future__ import annotations

import collections
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..core.stream import SlotRing
from .transport import member_rows

if TYPE_CHECKING:
    from .transport import Group, PinnedTransport

__all__ = ["EXPERT_ARGS", "expert_module", "cacheable", "ExpertCache", "cached_forward", "top_k_of"]

EXPERT_ARGS = ("hidden_states", "top_k_index", "top_k_weights")
ALIGN = 256


def expert_module(m: Any) -> bool:
    """Whether ``m`` is called as transformers' experts modules are (NOTE [expert cache])."""
    try:
        params = list(inspect.signature(type(m).forward).parameters)[1:4]
    except (TypeError, ValueError):
        return False
    return tuple(params) == EXPERT_ARGS and isinstance(getattr(m, "num_experts", None), int)


def top_k_of(m: Any) -> int | None:
    """The experts a token is routed to, as ``m``'s config says (None where it does not say)."""
    k = getattr(getattr(m, "config", None), "num_experts_per_tok", None)
    return int(k) if isinstance(k, int) and k > 0 else None


def cacheable(groups: list[Group], roots: dict[int, Any]) -> list[Group]:
    """The groups of ``groups`` the cache can serve: stacked experts of an experts module
    (``roots[id(g)]``) with parameters only, one slice per expert, read from a home (not on
    disk, not gathered); of those, the ones that share the most common expert shape (one cache
    holds experts of one shape)."""
    import torch
    ok = []
    for g in groups:
        m = roots.get(id(g))
        if (m is None or not g.stacked or g.pinned or g.gathered or g.on_disk or not expert_module(m)
                or not all(isinstance(t, torch.nn.Parameter) and t.shape[0] == m.num_experts for t in g.tensors)):
            continue
        ok.append(g)
    shapes = collections.Counter(_signature(g) for g in ok)
    if not shapes:
        return []
    best = shapes.most_common(1)[0][0]
    return [g for g in ok if _signature(g) == best]


def _signature(g: Group) -> tuple:
    return tuple((tuple(t.shape[1:]), t.dtype) for t in g.tensors)


def _up(n: int) -> int:
    return -(-max(int(n), 1) // ALIGN) * ALIGN


class ExpertCache:
    """``slots`` experts of ``groups`` (one shape) on the device, for decode (NOTE [expert
    cache]). Copies go through the transport's H2D lane (and for packed groups its staging
    buffers and dequantization lane). Used from the forward's thread only."""

    def __init__(self, transport: PinnedTransport, groups: list[Group], nbytes: int):
        self.t = transport
        self.groups = groups
        g0 = groups[0]
        self.experts = int(g0.tensors[0].shape[0])
        self.per = [t.numel() // self.experts * t.element_size() for t in g0.tensors]    # bytes of one expert
        self.nslots = nbytes // max(1, sum(self.per)) if self.per else 0
        self.nbytes = sum(_up(self.nslots * n) for n in self.per)
        self.block: Any = None
        # The slots' bytes lie in one region per member (as the module's stacked parameters do),
        # so a slot has no one address: its ptr is 0 and its fills name addresses.
        self.ring = SlotRing(0, 0, self.nslots)
        self.where: dict[tuple[int, int], int] = {}  # (id(group), expert) -> slot
        self.last: dict[int, list[int]] = {}         # id(group) -> the experts its last call routed to
        self.next_of: dict[int, Group] = {}          # id(group) -> the group called after it
        self.prev: Group | None = None
        self.stats = collections.Counter()
        self._views: list[Any] = []
        self._ptrs: list[int] = []

    def allocate(self) -> None:
        """The device region (the caller reserved ``nbytes`` of the budget for it)."""
        be = self.t.tier.backend
        self.block = be.device_alloc(self.nbytes, pooled=False)
        at = self.block.ptr
        for t, n in zip(self.groups[0].tensors, self.per):
            self._ptrs.append(at)
            raw = be.torch_view(at, self.nslots * n, self.block)
            self._views.append(raw.view(t.dtype).view(self.nslots, *t.shape[1:]))
            at += _up(self.nslots * n)

    def release(self) -> None:
        self._views = []
        if self.block is not None:
            self.block.release()
            self.block = None

    # -- copies ---------------------------------------------------------------------------------
    def _load(self, g: Group, e: int, slot: Any) -> None:
        """Queue expert ``e`` of ``g``'s copy into ``slot`` (its bytes from the home)."""
        from ..core.transfer import Transfer
        t, tier = self.t, self.t.tier
        home = t.home.ptr + g.offset
        c = slot.index
        if not g.packed:
            parts = [(self._ptrs[k] + c * n, home + off + e * n, n)
                     for k, (off, n) in enumerate(zip(g.home_offsets, self.per))]
            start, end = self.ring.fill(t.lane, slot, parts, timed=True)
            moved = sum(self.per)
        else:
            # NOTE [quantized streaming]: the expert's rows of each member cross packed into the
            # staging buffers and are dequantized into the slot.
            def rows(k: int, lo: int, hi: int, c: int = c, e: int = e) -> Any:
                per = member_rows(g.tensors[k], g.packing[k]) // self.experts
                return self._views[k][c].view(per, -1)[lo - e * per:hi - e * per]
            ranges = []
            for k, (tt, p) in enumerate(zip(g.tensors, g.packing)):
                per = member_rows(tt, p) // self.experts
                ranges.append((k, e * per, (e + 1) * per))
            self.stats["bytes"] += t.stream_packed(g, ranges, self.ring, slot, rows)
            return
        tier.track(Transfer(tier, "h2d", t.lane.stream, start, end, [], moved, {t.role: moved}))
        tier.accounting.on_move(t.role, "h2d", moved)
        tier.accounting.count(t.role, "prefetch_ops")
        self.stats["bytes"] += moved

    def _bring(self, g: Group, experts: list[int]) -> dict[int, Any]:
        """Slots holding ``experts`` of ``g``, copying in those not cached over the slots used
        longest ago (not those of this call); each slot is held until :meth:`_done`."""
        got: dict[int, Any] = {}
        for e in experts:
            c = self.where.get((id(g), e))
            if c is not None:
                slot = self.ring[c]
                self.stats["hits"] += 1
                if slot.held == "ahead":
                    self.stats["prefetch_hits"] += 1
                    slot.held = None
            else:
                slot = self._evict_into(self.ring.pick())      # a round has at most a slot per expert
                self.stats["misses"] += 1
                self._load(g, e, slot)
                slot.occupant = (id(g), e)
                self.where[(id(g), e)] = slot.index
            self.ring.use(slot)
            got[e] = slot
        return got

    def _evict_into(self, slot: Any) -> Any:
        old = self.ring.vacate(slot)
        if old is not None:
            self.where.pop(old, None)
            self.stats["evictions"] += 1
        return slot

    def _done(self, slots: list[Any]) -> None:
        be = self.t.tier.backend
        for s in slots:
            self.ring.release(s, be)

    def _ahead(self, g: Group) -> None:
        """Bring in the experts the group after ``g`` routed to last time (NOTE [expert cache])."""
        nxt = self.next_of.get(id(g))
        if nxt is None:
            return
        for e in self.last.get(id(nxt), []):
            if (id(nxt), e) in self.where:
                continue
            slot = self.ring.pick()
            if slot is None:
                return
            self._evict_into(slot)
            self._load(nxt, e, slot)
            slot.occupant, slot.held = (id(nxt), e), "ahead"
            self.where[(id(nxt), e)] = slot.index
            self.ring.touch(slot)
            self.stats["prefetched"] += 1

    # -- a call ---------------------------------------------------------------------------------
    def run(self, g: Group, module: Any, own: Callable[..., Any], hidden_states: Any, top_k_index: Any,
            top_k_weights: Any, args: tuple, kwargs: dict) -> Any:
        """``module``'s forward (``own``) over its experts in the cache (NOTE [expert cache])."""
        import torch
        be = self.t.tier.backend
        if self.prev is not None and self.prev is not g:
            self.next_of[id(self.prev)] = g
        self.prev = g
        routed = torch.unique(top_k_index).tolist()          # the host waits here, as the eager loop does
        self.last[id(g)] = routed
        self.stats["calls"] += 1
        rest = self.t.rest_views(g)
        out = None
        for lo in range(0, len(routed), max(1, self.nslots)):
            part = routed[lo:lo + self.nslots]
            self.stats["rounds"] += 1
            slots = self._bring(g, part)
            cur = be.current_stream()
            for s in slots.values():
                if s.ready is not None:
                    be.wait(cur, s.ready)
            lut = [-1] * self.experts
            for e, s in slots.items():
                lut[e] = s.index
            mapped = torch.tensor(lut, dtype=top_k_index.dtype, device=top_k_index.device)[top_k_index]
            weights = top_k_weights
            if len(part) < len(routed):        # a round: the others weigh nothing here
                inside = mapped >= 0
                mapped = torch.where(inside, mapped, torch.full_like(mapped, next(iter(slots.values())).index))
                weights = torch.where(inside, top_k_weights, torch.zeros_like(top_k_weights))
            try:
                for t, v in zip(g.tensors, self._views):
                    t.data = v
                module.num_experts = self.nslots
                y = own(hidden_states, mapped, weights, *args, **kwargs)
            finally:
                module.num_experts = self.experts
                for t, v in zip(g.tensors, rest):
                    t.data = v
                self._done(list(slots.values()))
            out = y if out is None else out + y
        self._ahead(g)
        return out

    def summary(self) -> dict[str, Any]:
        """The ``expert_cache.*`` keys of handle.stats() (NOTE [expert cache])."""
        s = self.stats
        seen = s["hits"] + s["misses"]
        return {"expert_cache.slots": self.nslots, "expert_cache.bytes": self.nbytes,
                "expert_cache.hits": s["hits"], "expert_cache.misses": s["misses"],
                "expert_cache.hit_rate": s["hits"] / seen if seen else 0.0,
                "expert_cache.prefetched": s["prefetched"], "expert_cache.prefetch_hits": s["prefetch_hits"],
                "expert_cache.evictions": s["evictions"], "expert_cache.rounds": s["rounds"],
                "expert_cache.calls": s["calls"], "expert_cache.moved_bytes": s["bytes"]}

    @staticmethod
    def empty_summary() -> dict[str, Any]:
        """:meth:`summary`'s keys for a module with no cache: all 0."""
        return {k: (0.0 if k.endswith("hit_rate") else 0) for k in (
            "expert_cache.slots", "expert_cache.bytes", "expert_cache.hits", "expert_cache.misses",
            "expert_cache.hit_rate", "expert_cache.prefetched", "expert_cache.prefetch_hits", "expert_cache.evictions",
            "expert_cache.rounds", "expert_cache.calls", "expert_cache.moved_bytes")}


def cached_forward(module: Any, group: Group, serves: Callable[[Group], bool], cache: ExpertCache) -> Callable[..., Any]:
    """A forward for ``module`` that runs through ``cache`` while ``serves(group)`` (a decode
    step), and is the module's own forward otherwise (NOTE [expert cache])."""
    own = module.forward

    def forward(hidden_states: Any, top_k_index: Any, top_k_weights: Any, *args: Any, **kwargs: Any) -> Any:
        if not serves(group):
            return own(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        return cache.run(group, module, own, hidden_states, top_k_index, top_k_weights, args, kwargs)
    return forward

