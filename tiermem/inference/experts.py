"""The expert cache of a mixture of experts in decode (NOTE [expert cache]): which groups it
serves (:func:`expert_module`, :func:`cacheable`, :func:`router_of`), the cache itself
(:class:`ExpertCache`: slots of one expert each, the least often routed first out, a layer's
experts in slots in the order of their numbers, the next layer's experts guessed and brought
in ahead), and the experts module's forward through it
(:func:`cached_forward`).

NOTE [expert cache]
    transformers 5 keeps a layer's experts stacked (``gate_up_proj`` [experts, 2 x inter,
    hidden], ``down_proj`` [experts, hidden, inter]) in an experts module called as
    ``experts(hidden_states, top_k_index, top_k_weights)``, whatever its implementation (the eager
    loop, batched_mm, grouped_mm) does inside. A decode step routes each token to a few experts,
    and a few experts are chosen far more often than others in trained models, so with
    ``expert_cache=`` bytes of the budget the experts a decode routes to are kept on the device:
    - The cache is one region per stacked parameter, ``slots`` experts long and one more (the
      zero slot), laid out as the module's own parameter ([slots + 1, 2 x inter, hidden], ...),
      so the module runs on it as it is: the parameters are bound to the cache for the call,
      ``num_experts`` is the slot count (zero slot included), and ``top_k_index`` is renumbered
      from experts to their slots.
    - What is computed does not change, only where the weights are (NOTE [cached experts sum
      alike]).
    - A call finds its experts (one host sync, as the eager loop has too); those not cached are
      copied in, each whole (all its stacked members), over the slot holding none of this call's
      experts whose expert scores lowest, from the pinned home at the link rate (packed ones
      cross packed and are dequantized into their slot: NOTE [quantized streaming]); the forward
      waits on the device for their copies. Where a group's calls keep the order of its experts
      (NOTE [cached experts sum alike]), its cached experts' slots rise with their numbers,
      kept so by copies from slot to slot (NOTE [experts in number order] in expert_order.py).
    - Eviction is by frequency, not recency: an expert's score is the times it was routed to,
      halved every AGE_SLOTS x slots routed picks (so a router whose favourites drift is
      followed), ties going to the slot that moves fewest experts, then to the one used longest
      ago. Least recently used keeps only the
      last few layers' picks once a token's picks over all layers outnumber the slots, so a hot
      expert is copied in again every token; by frequency the hot ones stay and the rest pass
      through the slots left.
    - The next layer's experts (learned from the order of calls) are prefetched while this call
      runs, guessed two ways: by the next layer's router run on this call's hidden state (its
      own forward, hooks bypassed; where the router is known and its weight can be read at
      rest; its top-k ride the same host sync as this call's picks), since in trained models the
      residual stream changes little from one layer to the next; and as the experts the next
      layer chose the last time (which is what works in a model of random weights, where each
      layer rewrites the residual stream, and in a decode that repeats itself). Each way's
      guesses are scored against what the layer then routed to (a moving average per layer,
      GUESS_RATE), and the one right more often for that layer is used; while neither is right MIN_RIGHT of the time
      nothing is prefetched. A guessed expert is copied in only over an empty slot or one whose
      expert scores below the guess's score plus AHEAD_BONUS times that share, so a guess does
      not displace a hot expert (nor another expert of the same guess). The copies are queued on
      the copy lane after this call's misses and before its compute, so they overlap this
      layer's compute and the next layer's attention.
    - A call that routes to more experts than there are slots runs in rounds of at most
      ``slots`` experts, and adds the rounds' outputs. A round sends the picks it does not
      compute to the zero slot with a routing weight of zero: they add exact zeros, and they do
      not join a computed expert's rows (a GEMM of other rows may round a row otherwise).
    handle.stats() reports ``expert_cache.hits``, ``.misses``, ``.hit_rate``, ``.prefetched``,
    ``.prefetch_hits`` (a routed expert found because it was brought in ahead), ``.predicted``
    (prefetches guessed by the router on the hidden state), ``.evictions``, ``.rounds`` (the module's
    calls), ``.slot_moves`` (experts copied from slot to slot: NOTE [experts in number order]) and ``.slots``.
    A forward of many tokens (a prefill) does not use the cache: it streams the layers whole at
    the link rate (NOTE [experts by expert] in inference/plan.py).

NOTE [cached experts sum alike]
    The cache must change where an expert's weights are, never what is computed: greedy tokens
    through the cache equal the uncached path's. batched_mm and grouped_mm compute each (token,
    pick) row alone and sum a token's picks in the order of its picks, so renumbering experts to
    slots changes nothing. The eager loop (and any implementation tiermem does not know) walks
    the experts in the order of their numbers and adds each one's output into the token's sum
    in place, in the model's dtype: renumbered to slots it would add a token's experts in the
    order of their slots, and with three or more picks a token's sum rounds differently
    ((a + b) + c is not (a + c) + b in fp16), which a long greedy decode turns into other tokens.
    So where the order matters (more than two picks a token; two terms add alike either way) a
    group's cached experts are kept in slots that rise with their numbers (NOTE [experts in
    number order] in expert_order.py), and a call is one round, the module's own call. Where
    they do not rise all the same (a call of more experts than slots), a call runs in rounds
    that keep the order: the first round takes the experts, in number order, while their slots
    rise, and each later round one expert alone, its output added to the sum so far (the others
    weigh zero there, which adds exact zeros), so every token's sum is built in the order of its
    experts' numbers, as the eager loop builds it. Each computed expert gets the
    same rows as uncached (the others go to the zero slot), so its GEMMs are the same shapes.
    batched_mm's and grouped_mm's rounds past the slot count are the only sums that differ
    (they add partial sums; a call of one token routes to more experts than slots only with a
    cache of fewer slots than top-k).
"""
from __future__ import annotations

import collections
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..core.stream import SlotRing
from .expert_order import placement
from .transport import member_rows

if TYPE_CHECKING:
    from .transport import Group, PinnedTransport

__all__ = ["EXPERT_ARGS", "expert_module", "cacheable", "router_of", "ExpertCache", "cached_forward", "top_k_of",
           "ORDERED_IMPLEMENTATIONS", "auto_cache_bytes"]

EXPERT_ARGS = ("hidden_states", "top_k_index", "top_k_weights")
ALIGN = 256
AGE_SLOTS = 4          # scores halve every AGE_SLOTS x slots routed picks (NOTE [expert cache])
AHEAD_BONUS = 2.0      # x how often its way of guessing is right: what a guess adds to its expert's score
GUESS_RATE = 0.1       # weight of the latest call in each way of guessing's moving average of being right
MIN_RIGHT = 0.25       # no prefetch while neither way of guessing is right at least this often
# Experts implementations that sum a token's picks in the order of its picks, whatever the
# experts' numbers (NOTE [cached experts sum alike]); any other is run in order-keeping rounds.
ORDERED_IMPLEMENTATIONS = frozenset({"batched_mm", "grouped_mm"})


def expert_module(m: Any) -> bool:
    """Whether ``m`` is called as transformers' experts modules are (NOTE [expert cache])."""
    try:
        params = list(inspect.signature(type(m).forward).parameters)[1:4]
    except (TypeError, ValueError):
        return False
    return tuple(params) == EXPERT_ARGS and isinstance(getattr(m, "num_experts", None), int)


def auto_cache_bytes(plan_at: Callable[[int], Any], budget: int, experts: dict[str, int]) -> int:
    """``expert_cache='auto'`` (NOTE [expert cache budget] in inference/module.py): the largest
    cache, of the candidates below, that makes no group a decode step reads whole stream more than
    the plan of the whole ``budget`` streams (``plan_at(room)`` plans the weights within
    ``room``; ``experts``: stacked groups -> bytes of one expert). The candidates: what that plan
    leaves unused, with or without what it keeps for pinned experts, and halves of the budget; at
    least two experts and the zero slot. 0 where none is, or where that plan streams no experts."""
    full = plan_at(budget)
    if not experts or all(g in full.pinned or g in full.in_place for g in experts):
        return 0
    base = full.moved_bytes_but(experts)
    least = 3 * max(experts.values())
    spare = sum(n for g, n in full.sizes if g in experts and g in full.pinned)
    unused = max(budget - full.pinned_bytes - full.window, 0)
    for c in sorted({spare, unused, spare + unused} | {budget >> k for k in range(1, 11)}, reverse=True):
        if least <= c < budget and plan_at(budget - c).moved_bytes_but(experts) <= base:
            return c
    return 0


def top_k_of(m: Any) -> int | None:
    """The experts a token is routed to, as ``m``'s config says (None where it does not say)."""
    k = getattr(getattr(m, "config", None), "num_experts_per_tok", None)
    return int(k) if isinstance(k, int) and k > 0 else None


def router_of(parent: Any, experts: Any) -> Any:
    """The router beside ``experts`` in ``parent`` (its mixture-of-experts block): a child with an
    int ``top_k`` and a 2-D ``weight`` of one row per expert, as transformers' routers are
    (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE: ``F.linear(hidden_states, self.weight)`` then top-k);
    None where there is not exactly one."""
    n = getattr(experts, "num_experts", None)
    found = [c for c in parent.children() if c is not experts and isinstance(getattr(c, "top_k", None), int)
             and getattr(getattr(c, "weight", None), "dim", lambda: 0)() == 2 and c.weight.shape[0] == n]
    return found[0] if len(found) == 1 else None


def _picked(out: Any, top_k: int) -> Any:
    """The top-k expert indices among a router's outputs (an integer tensor ending in ``top_k``), or None."""
    import torch
    items = out if isinstance(out, (tuple, list)) else (out,)
    for t in items:
        if isinstance(t, torch.Tensor) and not t.dtype.is_floating_point and t.dim() >= 1 and t.shape[-1] == top_k:
            return t
    return None


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


def _order_matters(module: Any, top_k_index: Any) -> bool:
    """Whether renumbering experts to slots could change ``module``'s sums (NOTE [cached experts
    sum alike]): more than two picks a token, and an implementation not known to sum in pick order."""
    if top_k_index.dim() == 0 or top_k_index.shape[-1] <= 2:
        return False
    impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
    return impl not in ORDERED_IMPLEMENTATIONS


class ExpertCache:
    """``slots`` experts of ``groups`` (one shape) on the device, for decode (NOTE [expert
    cache]). Copies go through the transport's H2D lane (and for packed groups its staging
    buffers and dequantization lane). ``routers`` maps id(group) to the router that picks its
    experts, where the module found one it can read at rest. Used from the forward's thread only."""

    def __init__(self, transport: PinnedTransport, groups: list[Group], nbytes: int,
                 routers: dict[int, Any] | None = None):
        self.t = transport
        self.groups = groups
        g0 = groups[0]
        self.experts = int(g0.tensors[0].shape[0])
        self.per = [t.numel() // self.experts * t.element_size() for t in g0.tensors]    # bytes of one expert
        # One slot more than the experts it holds: the zero slot, all zeros, where a round sends the
        # picks it does not compute (NOTE [cached experts sum alike]).
        self.nslots = max(0, nbytes // max(1, sum(self.per)) - 1) if self.per else 0
        self.zero = self.nslots
        self.nbytes = sum(_up((self.nslots + 1) * n) for n in self.per)
        self.block: Any = None
        # The slots' bytes lie in one region per member (as the module's stacked parameters do),
        # so a slot has no one address: its ptr is 0 and its fills name addresses.
        self.ring = SlotRing(0, 0, self.nslots)
        self.where: dict[tuple[int, int], int] = {}  # (id(group), expert) -> slot
        self.last: dict[int, list[int]] = {}         # id(group) -> the experts its last call routed to
        self.next_of: dict[int, Group] = {}          # id(group) -> the group called after it
        self.routers = dict(routers or {})
        # NOTE [expert cache]: per group, how often each way of guessing its experts was right (a
        # moving average of the share of a guess it then routed to); the guesses to score.
        self.right: dict[int, dict[str, float]] = collections.defaultdict(lambda: {"router": 0.5, "last": 0.5})
        self.pending: dict[int, dict[str, list[int]]] = {}
        self.score: dict[tuple[int, int], float] = {}   # (id(group), expert) -> routed picks, aged
        self.age_every = max(16, AGE_SLOTS * self.nslots)
        self.picks = 0
        self.prev: Group | None = None
        self.stats = collections.Counter()
        self.in_order: set[int] = set()              # id(group) of groups whose calls keep the order
        self._views: list[Any] = []
        self._ptrs: list[int] = []

    def allocate(self) -> None:
        """The device region (the caller reserved ``nbytes`` of the budget for it)."""
        be = self.t.tier.backend
        self.block = be.device_alloc(self.nbytes, pooled=False)
        at = self.block.ptr
        for t, n in zip(self.groups[0].tensors, self.per):
            self._ptrs.append(at)
            raw = be.torch_view(at, (self.nslots + 1) * n, self.block)
            self._views.append(raw.view(t.dtype).view(self.nslots + 1, *t.shape[1:]))
            at += _up((self.nslots + 1) * n)
        for v in self._views:
            v[self.zero].zero_()
        # Zeroed on the current stream: done before a forward on any stream reads it.
        done = be.new_event()
        be.record(done, be.current_stream())
        be.synchronize(done)

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

    def _count(self, key: tuple[int, int]) -> None:
        """One routed pick of ``key``; every ``age_every`` picks all scores halve (NOTE [expert cache])."""
        self.score[key] = self.score.get(key, 0.0) + 1.0
        self.picks += 1
        if self.picks % self.age_every == 0:
            self.score = {k: v / 2 for k, v in self.score.items() if v >= 1 / 64}

    def _choose(self, g: Group, e: int, keep: set[tuple[int, int]] = frozenset()) -> tuple[Any, list, int] | None:
        """The slot to give up for expert ``e`` of ``g``: an empty one, else of those not in use
        (nor holding an expert of ``keep``) the one whose expert scores lowest; among equals
        the one that moves fewest experts (NOTE [experts in number order]), then the one used
        longest ago. Returns it, the moves and the slot ``e`` takes (:func:`placement`), or None."""
        free = [s for s in self.ring if not s.busy and s.occupant not in keep]
        if not free:
            return None
        rank = {id(s): (s.occupant is not None, self.score.get(s.occupant, 0.0)) for s in free}
        low = min(rank.values())
        mine = sorted((x, c) for (gid, x), c in self.where.items() if gid == id(g)) if id(g) in self.in_order else []

        def plan(s: Any) -> tuple[list, int]:
            rest = [(x, c) for x, c in mine if c != s.index]        # its own expert leaves
            return placement([c for _, c in rest], sum(x < e for x, _ in rest), s.index)
        plans = {id(s): plan(s) for s in free if rank[id(s)] == low}
        best = min((s for s in free if id(s) in plans), key=lambda s: (len(plans[id(s)][0]), s.last))
        return best, *plans[id(best)]

    def _make_room(self, victim: Any, moves: list[tuple[int, int]], at: int) -> Any:
        """Evict ``victim``'s expert, queue ``moves`` (each expert's slot follows it: where, use,
        the note of what it is) and return the empty slot ``at``."""
        self._evict_into(victim)
        lane = self.t.lane
        for a, b in moves:
            src, dst = self.ring[a], self.ring[b]
            self.ring.move(lane, src, dst, [(self._ptrs[k] + b * n, self._ptrs[k] + a * n, n)   # slots' ptr is 0
                                            for k, n in enumerate(self.per)])
            dst.occupant, dst.held, dst.busy, dst.last = src.occupant, src.held, src.busy, src.last
            self.where[dst.occupant] = b
            src.occupant, src.held, src.busy = None, None, False
            self.stats["moves"] += 1
        return self.ring[at]

    def _bring(self, g: Group, experts: list[int]) -> dict[int, Any]:
        """Slots holding ``experts`` of ``g``, copying in those not cached over the slots whose
        experts score lowest (not those of this call); each slot is held until :meth:`_done`."""
        keys = {(id(g), e) for e in experts}
        for e in experts:
            key = (id(g), e)
            self._count(key)
            c = self.where.get(key)
            if c is not None:
                slot = self.ring[c]
                self.stats["hits"] += 1
                if slot.held == "ahead":
                    self.stats["prefetch_hits"] += 1
                    slot.held = None
            else:
                slot = self._make_room(*self._choose(g, e, keep=keys))    # a chunk has at most a slot per expert
                self.stats["misses"] += 1
                self._load(g, e, slot)
                slot.occupant = key
                self.where[key] = slot.index
            self.ring.use(slot)
        # Where they are now: a later miss may have moved an earlier one (NOTE [experts in number order]).
        return {e: self.ring[self.where[(id(g), e)]] for e in experts}

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

    def _guess(self, nxt: Group | None, hidden_states: Any) -> Any:
        """The next group's picks for ``hidden_states`` by its router (a device tensor, read at
        the call's host sync), or None where its router is not known (NOTE [expert cache])."""
        router = self.routers.get(id(nxt)) if nxt is not None else None
        if router is None:
            return None
        import torch
        with torch.no_grad():
            # Its own forward, not its __call__: the router's hooks (tiermem's among them) are
            # for its own layer's turn.
            return _picked(router.forward(hidden_states.reshape(-1, hidden_states.shape[-1])), router.top_k)

    def _score_guesses(self, g: Group, routed: list[int]) -> None:
        """Score the guesses made for ``g`` against what it ``routed`` to (NOTE [expert cache])."""
        made = self.pending.pop(id(g), None)
        if not made:
            return
        got, right = set(routed), self.right[id(g)]
        for how, guess in made.items():
            if guess:
                right[how] += GUESS_RATE * (len(got.intersection(guess)) / len(guess) - right[how])

    def _ahead(self, g: Group, guesses: dict[str, list[int]]) -> None:
        """Bring in the experts the group after ``g`` is expected to route to, by the way of
        guessing (``guesses``: the router's on this call's hidden state, the last call's choices)
        that has been right more often, most likely first; each over an empty slot or one whose
        expert scores lower than the guess's with AHEAD_BONUS x that share (NOTE [expert cache])."""
        nxt = self.next_of.get(id(g))
        if nxt is None:
            return
        self.pending[id(nxt)] = guesses
        right = self.right[id(nxt)]
        how = max(guesses, key=lambda k: (right[k], k == "router"))
        if right[how] < MIN_RIGHT:
            return                           # a guess would mostly move experts no call reads
        if how == "router":
            self.stats["predicted"] += 1
        bonus = AHEAD_BONUS * right[how]
        # The best scored first: the victims only score higher as the guess goes on (the lowest
        # goes first), so where one guess stops the rest would too.
        guess = sorted(guesses[how], key=lambda e: -self.score.get((id(nxt), e), 0.0))
        keep = {(id(nxt), e) for e in guess}
        for e in guess:
            key = (id(nxt), e)
            if key in self.where:
                continue
            choice = self._choose(nxt, e, keep=keep)       # not over the guess's own experts
            if choice is None:
                return
            victim = choice[0]
            if victim.occupant is not None and self.score.get(victim.occupant, 0.0) >= self.score.get(key, 0.0) + bonus:
                return
            slot = self._make_room(*choice)
            self._load(nxt, e, slot)
            slot.occupant, slot.held = key, "ahead"
            self.where[key] = slot.index
            self.ring.touch(slot)
            self.stats["prefetched"] += 1

    # -- a call ---------------------------------------------------------------------------------
    def run(self, g: Group, module: Any, own: Callable[..., Any], hidden_states: Any, top_k_index: Any,
            top_k_weights: Any, args: tuple, kwargs: dict) -> Any:
        """``module``'s forward (``own``) over its experts in the cache (NOTE [expert cache])."""
        import torch
        if self.prev is not None and self.prev is not g:
            self.next_of[id(self.prev)] = g
        self.prev = g
        nxt = self.next_of.get(id(g))
        guessed = self._guess(nxt, hidden_states)
        flat = top_k_index.reshape(-1)
        if guessed is not None:
            both = torch.cat([flat, guessed.reshape(-1).to(flat.dtype)]).tolist()   # the one host sync
            picks, by_router = both[:flat.numel()], both[flat.numel():]
        else:
            picks, by_router = flat.tolist(), []        # the host waits here, as the eager loop does
        routed = sorted(set(picks))
        self._score_guesses(g, routed)
        self.stats["calls"] += 1
        guesses = {"last": self.last.get(id(nxt), []) if nxt is not None else []}
        if guessed is not None:
            guesses["router"] = [e for e, _ in collections.Counter(by_router).most_common()]
        self.last[id(g)] = routed
        ordered = _order_matters(module, top_k_index)
        if ordered:
            self.in_order.add(id(g))          # NOTE [experts in number order]
        rest = self.t.rest_views(g)
        out = None
        chunks = [routed[lo:lo + max(1, self.nslots)] for lo in range(0, len(routed), max(1, self.nslots))]
        for n, chunk in enumerate(chunks):
            slots = self._bring(g, chunk)
            if n == len(chunks) - 1:
                self._ahead(g, guesses)    # queued after this call's misses, before its compute
            try:
                for rnd in self._rounds(chunk, slots, ordered, first=n == 0):
                    y = self._call(module, own, g, hidden_states, top_k_index, top_k_weights, args, kwargs,
                                   {e: slots[e] for e in rnd}, whole=len(rnd) == len(routed))
                    out = y if out is None else out + y
            finally:
                for t, v in zip(g.tensors, rest):
                    t.data = v
                self._done(list(slots.values()))
        return out

    @staticmethod
    def _rounds(chunk: list[int], slots: dict[int, Any], ordered: bool, first: bool) -> list[list[int]]:
        """The experts of ``chunk`` (in number order) each call computes (NOTE [cached experts sum
        alike]): all at once, or where the order matters the first ones while their slots rise
        (all of them where the slots keep the numbers' order: NOTE [experts in number order];
        only in the call's first chunk) and then one by one."""
        if not ordered:
            return [chunk]
        k = 0
        if first:
            k = 1
            while k < len(chunk) and slots[chunk[k]].index > slots[chunk[k - 1]].index:
                k += 1
        return ([chunk[:k]] if k else []) + [[e] for e in chunk[k:]]

    def _call(self, module: Any, own: Callable[..., Any], g: Group, hidden_states: Any, top_k_index: Any,
              top_k_weights: Any, args: tuple, kwargs: dict, slots: dict[int, Any], whole: bool) -> Any:
        """One round: ``own`` over ``slots``' experts, the others' routing weights zero."""
        import torch
        be = self.t.tier.backend
        self.stats["rounds"] += 1
        cur = be.current_stream()
        for s in slots.values():
            if s.ready is not None:
                be.wait(cur, s.ready)
        lut = [-1] * self.experts
        for e, s in slots.items():
            lut[e] = s.index
        # From pinned memory, not blocking: a copy from pageable memory synchronizes the stream,
        # so the host waited here for this call's misses to land before it queued any compute.
        # torch's caching host allocator keeps the block until the copy is done.
        table = torch.tensor(lut, dtype=top_k_index.dtype)
        if top_k_index.is_cuda:
            table = table.pin_memory()
        mapped = table.to(top_k_index.device, non_blocking=True)[top_k_index]
        weights = top_k_weights
        if not whole:                      # a round: the others go to the zero slot and weigh nothing
            inside = mapped >= 0
            mapped = torch.where(inside, mapped, torch.full_like(mapped, self.zero))
            weights = torch.where(inside, top_k_weights, torch.zeros_like(top_k_weights))
        try:
            for t, v in zip(g.tensors, self._views):
                t.data = v
            module.num_experts = self.nslots + 1
            return own(hidden_states, mapped, weights, *args, **kwargs)
        finally:
            module.num_experts = self.experts

    def summary(self) -> dict[str, Any]:
        """The ``expert_cache.*`` keys of handle.stats() (NOTE [expert cache])."""
        s = self.stats
        seen = s["hits"] + s["misses"]
        return {"expert_cache.slots": self.nslots, "expert_cache.bytes": self.nbytes,
                "expert_cache.hits": s["hits"], "expert_cache.misses": s["misses"],
                "expert_cache.hit_rate": s["hits"] / seen if seen else 0.0,
                "expert_cache.prefetched": s["prefetched"], "expert_cache.prefetch_hits": s["prefetch_hits"],
                "expert_cache.predicted": s["predicted"],
                "expert_cache.evictions": s["evictions"], "expert_cache.rounds": s["rounds"],
                "expert_cache.slot_moves": s["moves"],
                "expert_cache.calls": s["calls"], "expert_cache.moved_bytes": s["bytes"]}

    @staticmethod
    def empty_summary() -> dict[str, Any]:
        """:meth:`summary`'s keys for a module with no cache: all 0."""
        return {k: (0.0 if k.endswith("hit_rate") else 0) for k in (
            "expert_cache.slots", "expert_cache.bytes", "expert_cache.hits", "expert_cache.misses",
            "expert_cache.hit_rate", "expert_cache.prefetched", "expert_cache.prefetch_hits", "expert_cache.predicted",
            "expert_cache.evictions", "expert_cache.rounds", "expert_cache.slot_moves", "expert_cache.calls",
            "expert_cache.moved_bytes")}


def cached_forward(module: Any, group: Group, serves: Callable[[Group], bool], cache: ExpertCache) -> Callable[..., Any]:
    """A forward for ``module`` that runs through ``cache`` while ``serves(group)`` (a decode
    step), and is the module's own forward otherwise (NOTE [expert cache])."""
    own = module.forward

    def forward(hidden_states: Any, top_k_index: Any, top_k_weights: Any, *args: Any, **kwargs: Any) -> Any:
        if not serves(group):
            return own(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        return cache.run(group, module, own, hidden_states, top_k_index, top_k_weights, args, kwargs)
    return forward
