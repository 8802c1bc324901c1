"""A transformers KV cache in tiers (:class:`TieredKVCache`): every layer's keys and values within
a device budget, the layers that do not fit streamed from pinned host memory one layer ahead.

    cache = tiermem.kv_cache(model, max_tokens=131072, kv_budget="2GB")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64)   # cache= from transformers 5.24
    cache.close()

or, with the weights in the same budget, ``handle = tiermem.wrap_module(model, budget, kv_budget=...)``
and ``handle.kv_cache(max_tokens=...)``. The plan is NOTE [kv plan] in inference/kvplan.py.

NOTE [kv cache in tiers]
    Attention reads all of a layer's keys and values at once (transformers hands the tensors
    ``update`` returns to SDPA, flash or eager attention whole), so the device must hold a whole
    layer when its attention runs: a window of recent tokens would change the outputs. So the
    cache keeps whole layers on the device: ``plan.resident`` layers for good, the others in a
    pinned home, copied into a ring of device slots one layer ahead. In ``update(layer)``:

    1. the layer's slot must hold its tokens so far: it was filled while the layer before ran
       (else it is filled now, and the compute stream waits);
    2. the slot the previous streamed layer used is released (its attention is queued before
       this point) and the streamed layer ``slots - 1`` uses ahead is copied into it, on the
       h2d stream, wrapping into the next forward;
    3. the new tokens are written into the slot on the compute stream, and only they are copied
       home on the d2h stream: nothing makes a round trip, and nothing is allocated per step;
    4. attention reads the slot's first ``length + new`` rows.
    Resident layers take the new tokens into their device buffer and have no home.

    The layout is token-major, ``[max_tokens, batch, kv_heads, head_dim]`` for keys and for
    values, in the home and in every slot, so a layer's first ``n`` tokens are one contiguous
    range: a fill or an append is one copy for keys and one for values (torch's own strided
    copies between pinned and device memory go through a pageable temporary and are not
    asynchronous). ``update`` returns the ``[batch, heads, tokens, dim]`` view of it, the
    layout the projections' ``transpose(1, 2)`` gives attention anyway.

NOTE [kv copy order]
    The ordering rules of NOTE [ordered copies] in core/stream.py, for the cache:
    - a fill into a slot waits for the slot's ``free`` event (the compute stream after the
      attention that last read it), for its ``drained`` event (the append that last read it)
      and for the ``written`` event of the layer it brings in (the last append to that home);
    - the compute stream waits for the slot's ``ready`` and ``drained`` events before it writes
      into or reads the slot;
    - an append waits for the compute stream (after the new tokens were written into the slot).
    Host code touches a home only after every copy queued is done (``synchronize``): beam
    search's reorder, close.

NOTE [kv forward as a transaction]
    A forward appends a token to every layer, one layer after another; an exception or Ctrl-C
    in the middle leaves some layers ahead of the others. So the new rows are ``pending`` until
    the last layer's ``update`` commits them all: until then ``get_seq_length`` and the next
    forward see the tokens of the last whole forward, and a forward that starts again simply
    writes the same rows again. A slot's ``held`` names the layer, rows and epoch it holds;
    anything else (an interrupted fill, a crop, a reorder) makes it miss, and it is filled
    again. After a failure inside ``update`` the next one first waits for every copy queued,
    so that copies left behind by the failed one never run under new work.

NOTE [fp8 in transit]
    With ``fp8=True`` (off by default) a streamed layer lives at home, and crosses the link, as
    float8_e4m3fn with one fp32 scale per (token, sequence, head) of keys and of values
    (``amax / 448``): about half the bytes of fp16. A fill copies the fp8 rows and scales into
    the slot's transit buffer; the compute stream turns them into the slot's fp16 rows (an fp8
    to fp16 copy is exact, and the multiply by the scale runs in fp32). New tokens are written
    as their fp8 round trip, so a streamed layer's keys and values are the same whichever way
    they reach attention. Resident layers stay exact. bench/long_context.py reports the logits'
    cosine and top-1 agreement against fp16.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import weakref
from typing import Any

import torch

try:
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as e:    # pragma: no cover - the message is the point
    raise ImportError("tiermem's KV cache is a transformers Cache: pip install 'transformers>=5'") from e

from ..base.hostpages import available_bytes
from ..core.stream import Lane, Slot, SlotRing
from ..errors import ConfigError, DeviceFullError, HostBudgetError, TierMemError
from ..roles import Role
from .kvplan import ALIGN, FP8_MAX, SLOTS, KVPlan, KVShape, kv_shape, most_tokens, plan_kv

__all__ = ["TieredKVCache", "TieredKVLayer", "check_tokens"]

log = logging.getLogger("tiermem")

ROLE = Role.ACTIVATION          # what the cache's device bytes count as in the tier's books
HOST_SHARE = 0.9                # of the host's available memory, the default host budget
FP8 = getattr(torch, "float8_e4m3fn", None)


def _align(n: int) -> int:
    return -(-int(n) // ALIGN) * ALIGN


def check_tokens(max_tokens: Any) -> None:
    """Raise :class:`ConfigError` unless ``max_tokens`` is a number of tokens >= 1. Needs no Tier:
    tiermem.kv_cache checks it before it looks for a GPU."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(f"max_tokens must be a number of tokens >= 1, got {max_tokens!r}")


@dataclasses.dataclass(eq=False)
class _KVSlot(Slot):
    drained: Any = None           # event: the last append that read the slot is done (NOTE [kv copy order])
    k: Any = None                 # views [max_tokens, batch, heads, dim] of its keys and values
    v: Any = None
    k8: Any = None                # fp8 transit buffers and their scales (NOTE [fp8 in transit])
    v8: Any = None
    ks: Any = None
    vs: Any = None
    held_fp8: bool = False        # its rows are in the transit buffer, not yet dequantized


class TieredKVLayer(CacheLayerMixin):
    """One layer of a :class:`TieredKVCache`: its committed length, and where its keys and values
    are (a device buffer when resident, else offsets in the pinned home). The cache does the
    work; this is the record transformers' Cache API walks over."""

    is_compileable = False       # generate() would otherwise torch.compile the forward
    is_croppable = True
    is_sliding = False

    def __init__(self, cache: TieredKVCache, index: int):
        super().__init__()
        self._cache = weakref.ref(cache)
        self.index = index
        self.length = 0              # committed tokens (NOTE [kv forward as a transaction])
        self.pending: int | None = None
        self.written: Any = None     # event: the last append to its home is done
        self.resident = False
        self.dev: tuple[Any, Any] | None = None   # resident: views of its keys and values
        self.home: tuple[int, ...] = ()           # streamed: addresses of keys, values (and scales)

    @property
    def batch_size(self) -> int:
        return self._cache().shape.batch

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._cache().allocate(key_states, value_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self._cache().update(key_states, value_states, self.index)

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0     # what update returns: every token so far, from 0

    def get_max_length(self) -> int:
        return -1                     # grows like a dynamic layer's (up to the cache's max_tokens)

    def offload(self) -> None:
        pass                          # the cache moves its own bytes (transformers' offloading is not used)

    def prefetch(self) -> None:
        pass

    def reset(self) -> None:
        self.length, self.pending = 0, None
        self._cache().forget_slots()

    def crop(self, tokens_to_remove: int) -> None:
        n = int(tokens_to_remove)
        keep = n if n > 0 else max(self.length + n, 0)    # a positive count is 5.17's "keep that many"
        self.length, self.pending = min(self.length, keep), None
        self._cache().forget_slots()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        cache = self._cache()
        cache.synchronize()
        cache.reorder_layer(self, beam_idx)
        cache.forget_slots()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._cache().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._cache().batch_select_indices(indices)


class _Held:
    """What the cache holds that must be given back: the device block and its reservation, the
    pinned home, its own budget lease. ``free`` runs on close or when the cache is collected;
    it never raises."""

    def __init__(self, tier: Any, lease: Any):
        self.tier = tier
        self.lease = lease
        self.device: Any = None
        self.home: Any = None
        self.reserved = 0

    def free(self) -> None:
        self.free_memory()
        lease, self.lease = self.lease, None
        if lease is not None:
            try:
                lease.release()
            except Exception:  # noqa: BLE001
                log.exception("tiermem: error while releasing the KV cache's budget lease")

    def free_memory(self) -> None:
        if self.tier.backend.kind == "cuda" and (self.device is not None or self.home is not None):
            try:       # copies may still read or write them (a cache collected without close)
                torch.cuda.synchronize(self.tier.device)
            except Exception:  # noqa: BLE001 - a destructor path: log, never raise
                log.exception("tiermem: error while waiting for the KV cache's copies")
        for name in ("device", "home"):
            block = getattr(self, name)
            setattr(self, name, None)
            if block is not None:
                try:
                    block.release()
                except Exception:  # noqa: BLE001 - a destructor path: log, never raise
                    log.exception("tiermem: error while freeing the KV cache's %s memory", name)
        if self.reserved:
            n, self.reserved = self.reserved, 0
            try:
                self.tier.unreserve(n, ROLE)
            except Exception:  # noqa: BLE001
                log.exception("tiermem: error while giving back the KV cache's reservation")


class TieredKVCache(Cache):
    """A transformers ``Cache`` whose layers live within ``kv_budget`` device bytes (NOTE [kv cache
    in tiers], NOTE [kv plan] in inference/kvplan.py): pass it to ``generate`` (``past_key_values=``;
    ``cache=`` from transformers 5.24) or to a forward.

    ``config`` is the model's config (or the model); ``max_tokens`` the most tokens a sequence
    may reach (prompt and generated), for which the home and the slots are sized; ``kv_budget``
    device bytes ("2GB", or a share of the device like "5%"); ``batch_size`` the sequences it
    plans for (the first forward's batch is what it holds; beam search counts each beam);
    ``slots`` the ring's slots (at least 2); ``fp8`` keeps streamed layers as fp8 at home and in
    transit (NOTE [fp8 in transit]); ``host_budget`` the pinned host bytes its home may take
    (default: 90% of the host's available memory). A context that does not fit is refused here,
    before any prefill, with the number of tokens that would. The cache takes a lease on the
    tier's budget (NOTE [budget leases]) unless a module handle made it inside its own.
    ``close()`` (or ``with cache:``) gives everything back. Not thread-safe.
    """

    def __init__(self, config: Any, max_tokens: int, kv_budget: int | str | None = None, *,
                 batch_size: int = 1, dtype: Any = None, slots: int = SLOTS, fp8: bool = False,
                 host_budget: int | str | None = None, tier: Any = None, _owner: Any = None):
        from ..base.limits import parse_bytes
        if hasattr(config, "config"):                       # a model stands for its config and dtype
            dtype = dtype if dtype is not None else getattr(config, "dtype", None)
            config = config.config
        check_tokens(max_tokens)
        if fp8 and FP8 is None:
            raise ConfigError("fp8=True needs torch.float8_e4m3fn (torch >= 2.1)")
        if tier is None:
            from ..base import default
            tier = default.peek()
            if tier is None:
                raise ConfigError("no tier: pass tier=, or make the cache with tiermem.kv_cache(), which uses the "
                                  "default tier")
        self.tier = tier
        self.max_tokens = int(max_tokens)
        self.slots = int(slots)
        self.fp8 = bool(fp8)
        shape = kv_shape(config, dtype, batch_size)
        if kv_budget is None:
            raise ConfigError("kv_budget is required: the device bytes the cache may hold (bytes, '2GB' or '5%'); "
                              "tiermem.wrap_module(..., kv_budget=...) plans it with the weights")
        total = tier.backend.capabilities().total_memory
        budget = parse_bytes(kv_budget, total=total, what="kv_budget", max_percent=100)
        lease = None
        if _owner is None:
            room = tier.lease_room()
            if room is not None and budget > room:
                log.warning("tiermem: a kv_budget of %s bytes does not fit the tier's configured budget (%s bytes "
                            "left for leases); planning for that", f"{budget:,}", f"{room:,}")
                budget = room
        self.host_budget = None if host_budget is None else parse_bytes(host_budget, what="host_budget")
        self.plan = self._plan(shape, budget)                # refuses before anything is taken
        if _owner is None:
            lease = tier.lease(budget, owner="TieredKVCache")
        self._owner = _owner
        self._held = _Held(tier, lease)
        self._finalizer = weakref.finalize(self, self._held.free)
        self.shape = shape
        self._allocated = False
        self._closed = False
        self._dirty = False           # NOTE [kv forward as a transaction]: a failed update left copies behind
        self._epoch = 0
        self._uses = 0
        self.ring: SlotRing | None = None
        self._pos: dict[int, int] = {}
        self.counts = dict.fromkeys(("h2d_bytes", "d2h_bytes", "fills", "fills_late", "appends"), 0)
        be = tier.backend
        self.h2d = Lane(be, lambda: tier.side_stream("h2d"))
        self.d2h = Lane(be, lambda: tier.side_stream("d2h"))
        super().__init__(layers=[TieredKVLayer(self, i) for i in range(shape.layers)])

    # -- planning --------------------------------------------------------------------------------
    def _plan(self, shape: KVShape, budget: int) -> KVPlan:
        plan = plan_kv(shape, self.max_tokens, budget, self.slots, self.fp8)
        limit = self.host_budget
        if limit is None:
            avail = available_bytes()
            limit = None if avail is None else int(avail * HOST_SHARE)
        if limit is not None and plan.home_bytes > limit:
            fit = most_tokens(lambda t: dataclasses.replace(plan, max_tokens=max(t, 1)).home_bytes, limit,
                              self.max_tokens)
            what = "host_budget" if self.host_budget is not None else f"{HOST_SHARE:.0%} of the host's available memory"
            raise HostBudgetError(plan.home_bytes, 0, limit, hint=(
                f"a context of {self.max_tokens:,} tokens x {shape.batch} needs {plan.home_bytes:,} bytes of pinned "
                f"host memory for the KV cache's {len(plan.streamed)} streamed layers ({what}); at most "
                f"{fit:,} tokens fit: lower max_tokens, raise kv_budget or the host budget"))
        return plan

    # -- memory ----------------------------------------------------------------------------------
    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Take the device block and the home, for the batch, heads and dtype of the first keys
        and values (the plan is made again if they differ from the config's). All or nothing."""
        if self._closed:
            raise TierMemError("this KV cache was closed; make a new one")
        if self._allocated:
            return
        be, tier = self.tier.backend, self.tier
        dev = key_states.device
        ours = "cuda" if be.kind == "cuda" else "cpu"
        if dev.type != ours or (ours == "cuda" and dev.index not in (None, tier.device)):
            raise ConfigError(f"the model's keys are on {dev}, the KV cache's tier on "
                              f"{'cuda:%d' % tier.device if ours == 'cuda' else 'the host (a test backend)'}: "
                              "build the cache on the model's device")
        b, h, _, d = key_states.shape
        shape = KVShape(self.shape.layers, int(h), int(d), int(value_states.shape[-1]), key_states.element_size(),
                        int(b))
        plan = self.plan if shape == self.plan.shape else self._plan(shape, self.plan.budget)
        self.dtype = key_states.dtype
        held = self._held
        try:
            need = plan.device_bytes
            if be.kind == "cuda" and need > be.mem_info()[0]:
                raise DeviceFullError(need, 0, be.mem_info()[0], hint="the KV cache's resident layers and slots do "
                                      "not fit the device's free memory; lower kv_budget or max_tokens")
            tier.reserve(need, ROLE)
            held.reserved = need
            # the lease counts the home's mapping too; the block holds the layers and the ring
            held.device = be.device_alloc(max(plan.held_bytes, 1), pooled=False)
            if plan.home_bytes:
                held.home = be.host_alloc(plan.home_bytes, pooled=False)
            self._lay_out(plan, shape)
        except BaseException:
            held.free_memory()        # the lease stays until close: the cache may be tried again
            self._unlay()
            raise
        self.plan, self.shape = plan, shape
        self._allocated = True

    def _lay_out(self, plan: KVPlan, shape: KVShape) -> None:
        """Views of the device block (resident layers, then the ring's slots) and the home's
        addresses, each region token-major (NOTE [kv cache in tiers])."""
        be = self.tier.backend
        cap, b, h = self.max_tokens, shape.batch, shape.kv_heads
        dev, home = self._held.device, self._held.home
        dt = self.dtype

        def tensor(block: Any, at: int, dim: int, dtype: Any) -> tuple[torch.Tensor, int]:
            n = cap * b * h * dim * torch.empty((), dtype=dtype).element_size()
            t = be.torch_view(block.ptr + at, n, block).view(dtype).view(cap, b, h, dim)
            return t, at + _align(n)

        at = 0
        self._pos = {}
        for lay in self.layers:
            lay.resident = lay.index in plan.resident
            lay.length, lay.pending, lay.written = 0, None, None
            if lay.resident:
                k, at = tensor(dev, at, shape.head_dim, dt)
                v, at = tensor(dev, at, shape.v_head_dim, dt)
                lay.dev, lay.home = (k, v), ()
            else:
                self._pos[lay.index] = len(self._pos)
        ring_at = at
        self.ring = SlotRing(dev.ptr + ring_at, plan.slot_bytes, plan.slots, make=_KVSlot)
        for s in self.ring:
            off = s.ptr - dev.ptr
            s.k, off = tensor(dev, off, shape.head_dim, dt)
            s.v, off = tensor(dev, off, shape.v_head_dim, dt)
            if self.fp8:
                s.k8, off = tensor(dev, off, shape.head_dim, FP8)
                s.v8, off = tensor(dev, off, shape.v_head_dim, FP8)
                s.ks, off = tensor(dev, off, 1, torch.float32)
                s.vs, off = tensor(dev, off, 1, torch.float32)
        at = 0
        for lay in self.layers:
            if lay.resident:
                continue
            parts = []
            for dim, dtype in self._home_parts(shape):
                parts.append(home.ptr + at)
                at += _align(cap * b * h * dim * torch.empty((), dtype=dtype).element_size())
            lay.home = tuple(parts)
        for lay in self.layers:
            lay.is_initialized = True

    def _home_parts(self, shape: KVShape) -> list[tuple[int, Any]]:
        """(dim, dtype) of each part of a streamed layer, in the home and in transit: keys and
        values, or with fp8 their fp8 bytes and scales."""
        if self.fp8:
            return [(shape.head_dim, FP8), (shape.v_head_dim, FP8), (1, torch.float32), (1, torch.float32)]
        return [(shape.head_dim, self.dtype), (shape.v_head_dim, self.dtype)]

    def _transit(self, s: _KVSlot) -> list[torch.Tensor]:
        """The slot's views that a fill writes and an append reads, matching ``_home_parts``."""
        return [s.k8, s.v8, s.ks, s.vs] if self.fp8 else [s.k, s.v]

    def _unlay(self) -> None:
        self.ring = None
        for lay in self.layers:
            lay.dev, lay.home, lay.is_initialized = None, (), False

    # -- the forward ------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a forward's new keys and values to layer ``layer_idx`` and return all of its
        keys and values on the device, ``[batch, heads, tokens, dim]`` (NOTE [kv cache in
        tiers]). Called by the model's attention; ``kwargs`` (transformers 5.24 passes some) are
        not used."""
        if self._closed:
            raise TierMemError("this KV cache was closed; make a new one")
        if not self._allocated:
            self.allocate(key_states, value_states)
        if self._dirty:
            self.synchronize()        # NOTE [kv forward as a transaction]
            self._dirty = False
        try:
            return self._update(key_states, value_states, layer_idx)
        except BaseException:
            self._dirty = True
            raise

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> tuple[Any, Any]:
        lay = self.layers[layer_idx]
        n = int(key_states.shape[-2])
        if layer_idx == 0:
            for other in self.layers:
                other.pending = None  # rows an interrupted forward left (NOTE [kv forward as a transaction])
        if tuple(key_states.shape[:2]) != (self.shape.batch, self.shape.kv_heads):
            raise ConfigError(f"keys of shape {tuple(key_states.shape)} for a KV cache of batch {self.shape.batch} and "
                              f"{self.shape.kv_heads} heads; make a cache for this batch")
        start, end = lay.length, lay.length + n
        if end > self.max_tokens:
            raise ConfigError(f"a context of {end:,} tokens is past this KV cache's max_tokens={self.max_tokens:,}; "
                              f"make a cache with max_tokens >= {end:,} (the cache still holds its {start:,} tokens)")
        kn, vn = key_states.permute(2, 0, 1, 3), value_states.permute(2, 0, 1, 3)   # token-major
        if lay.resident:
            k, v = lay.dev
            k[start:end].copy_(kn)
            v[start:end].copy_(vn)
        else:
            k, v = self._streamed(lay, start, end, kn, vn)
        lay.pending = end
        if layer_idx == len(self.layers) - 1:
            for other in self.layers:
                if other.pending is not None:
                    other.length, other.pending = other.pending, None
        return k[:end].permute(1, 2, 0, 3), v[:end].permute(1, 2, 0, 3)

    def _streamed(self, lay: TieredKVLayer, start: int, end: int, kn: torch.Tensor, vn: torch.Tensor) -> tuple[Any, Any]:
        be = self.tier.backend
        ring = self.ring
        u = self._uses
        self._uses += 1
        s = ring[u % len(ring)]
        # 1. the slot holds the layer's first ``start`` rows: filled ahead, or now
        filled = start > 0 and s.held != (lay.index, start, self._epoch)
        if filled:
            self._fill(s, lay, start)
            self.counts["fills_late"] += 1
        # 2. the previous use's attention is queued: its slot takes the layer ``slots - 1`` uses ahead
        self._ahead(u, lay)
        compute = be.current_stream()
        for ev in (s.ready, s.drained):
            if ev is not None:
                be.wait(compute, ev)
        ring.use(s)
        if self.fp8 and start > 0 and s.held_fp8:
            self._dequantize(s, 0, start)
        # 3. the new tokens into the slot, then home
        ring.vacate(s)
        s.held_fp8 = False
        self._put(s, start, end, kn, vn)
        parts = [(home + start * w, t.data_ptr() + start * w, (end - start) * w)
                 for home, t, w in zip(lay.home, self._transit(s), self._row_bytes())]
        _, done = self.d2h.run(parts)
        lay.written = s.drained = done
        moved = sum(p[2] for p in parts)
        self.counts["d2h_bytes"] += moved
        self.counts["appends"] += 1
        self.tier.accounting.on_move(ROLE, "d2h", moved)
        s.occupant, s.held = lay, (lay.index, end, self._epoch)
        return s.k, s.v

    def _row_bytes(self) -> list[int]:
        sh = self.shape
        return [sh.batch * sh.kv_heads * dim * torch.empty((), dtype=dt).element_size()
                for dim, dt in self._home_parts(sh)]

    def _fill(self, s: _KVSlot, lay: TieredKVLayer, rows: int) -> None:
        """Copy ``lay``'s first ``rows`` rows from home into slot ``s`` on the h2d stream (NOTE
        [kv copy order]). The slot names no occupant until the copies are queued."""
        self.ring.vacate(s)
        parts = [(t.data_ptr() - s.ptr, home, rows * w) for home, t, w in zip(lay.home, self._transit(s), self._row_bytes())]
        self.ring.fill(self.h2d, s, parts, after=(s.drained, lay.written))
        moved = sum(p[2] for p in parts)
        self.counts["h2d_bytes"] += moved
        self.counts["fills"] += 1
        self.tier.accounting.on_move(ROLE, "h2d", moved)
        s.occupant, s.held = lay, (lay.index, rows, self._epoch)
        s.held_fp8 = self.fp8        # with fp8 the rows are in the transit buffer until dequantized

    def _ahead(self, u: int, lay: TieredKVLayer) -> None:
        ring, be = self.ring, self.tier.backend
        n = len(ring)
        if u == 0:
            return
        prev = ring[(u - 1) % n]
        ring.release(prev, be)        # its attention is queued before this point
        streamed = [i for i in sorted(self._pos)]
        nxt = self.layers[streamed[(self._pos[lay.index] + n - 1) % len(streamed)]]
        rows = nxt.pending if nxt.pending is not None else nxt.length
        if rows == 0 or prev.held == (nxt.index, rows, self._epoch):
            return
        self._fill(prev, nxt, rows)

    def _put(self, s: _KVSlot, start: int, end: int, kn: torch.Tensor, vn: torch.Tensor) -> None:
        """Write new rows into the slot on the compute stream; with fp8 as their fp8 round trip:
        fp8 and scales into the transit buffer (what goes home), and the rows dequantized from
        them (NOTE [fp8 in transit])."""
        if not self.fp8:
            s.k[start:end].copy_(kn)
            s.v[start:end].copy_(vn)
            return
        for x, q, scale in ((kn, s.k8, s.ks), (vn, s.v8, s.vs)):
            amax = x.abs().amax(-1, keepdim=True).float()
            sc = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
            scale[start:end].copy_(sc)
            q[start:end].copy_(x.float() / sc)
        self._dequantize(s, start, end)

    def _dequantize(self, s: _KVSlot, start: int, end: int) -> None:
        for q, scale, out in ((s.k8, s.ks, s.k), (s.v8, s.vs, s.v)):
            out[start:end].copy_(q[start:end])           # fp8 -> fp16 is exact
            out[start:end].mul_(scale[start:end])         # in fp32, rounded once

    # -- the Cache API beside update -------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self._closed:
            raise TierMemError("this KV cache was closed; make a new one")
        return self.layers[layer_idx].length if layer_idx < len(self.layers) else 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def synchronize(self) -> None:
        """Block until every copy the cache queued is done, and the compute stream's work too."""
        be = self.tier.backend
        evs = [lay.written for lay in self.layers]
        if self.ring is not None:
            evs += [e for s in self.ring for e in (s.ready, s.drained)]
        for lane in (self.h2d, self.d2h):
            evs.append(lane.mark())
        cur = be.new_event()
        be.record(cur, be.current_stream())
        evs.append(cur)
        for ev in evs:
            if ev is not None:
                be.synchronize(ev)

    def forget_slots(self) -> None:
        """What the slots hold is stale (a crop, a reset, a reorder): each is filled again."""
        self._epoch += 1

    def reset(self) -> None:
        """Forget every token; the memory stays for the next use."""
        for lay in self.layers:
            lay.reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention); a positive
        value keeps that many tokens (transformers 5.17's older one)."""
        for lay in self.layers:
            lay.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: sequence ``i`` becomes sequence ``beam_idx[i]``, in every layer. Resident
        layers are reordered on the device, homes on the host once every copy is done."""
        if not self._allocated or self.layers[0].length == 0:
            return
        self.synchronize()
        for lay in self.layers:
            self.reorder_layer(lay, beam_idx)
        self.forget_slots()

    def reorder_layer(self, lay: TieredKVLayer, beam_idx: torch.LongTensor) -> None:
        """Reorder one layer's committed rows (the caller synchronized first)."""
        n, chunk = lay.length, 4096       # in chunks: a whole layer's temporary would pass the budget
        views = lay.dev if lay.resident else self._home_views(lay)
        for t in views or ():
            idx = beam_idx.to(t.device)
            for a in range(0, n, chunk):
                b = min(a + chunk, n)
                t[a:b].copy_(t[a:b].index_select(1, idx))

    def _home_views(self, lay: TieredKVLayer) -> list[torch.Tensor]:
        """Host views of a streamed layer's home parts, [max_tokens, batch, heads, dim]."""
        sh, out = self.shape, []
        for ptr, (dim, dtype) in zip(lay.home, self._home_parts(sh)):
            n = self.max_tokens * sh.batch * sh.kv_heads * dim * torch.empty((), dtype=dtype).element_size()
            raw = torch.frombuffer((ctypes.c_uint8 * n).from_address(ptr), dtype=torch.uint8)
            out.append(raw.view(dtype).view(self.max_tokens, sh.batch, sh.kv_heads, dim))
        return out

    def read_layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of layer ``layer_idx``'s committed keys and values, ``[batch, heads, tokens,
        dim]``, read from where they live (the device, or the home: dequantized with fp8); for
        inspection and tests, not for speed (it waits for every copy first)."""
        lay = self.layers[layer_idx]
        if not self._allocated:
            return (torch.empty(0),) * 2
        self.synchronize()
        n = lay.length
        if lay.resident:
            k, v = (t[:n].clone() for t in lay.dev)
        else:
            parts = [t[:n].clone() for t in self._home_views(lay)]
            k, v = parts[:2]
            if self.fp8:
                k, v = (q.to(self.dtype).mul_(sc) for q, sc in ((parts[0], parts[2]), (parts[1], parts[3])))
        return k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.layers[0].length and repeats != 1:
            raise TierMemError("tiermem's KV cache holds the batch it was filled with; this generation mode "
                               "repeats the batch of a filled cache (contrastive search, say): not supported")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.layers[0].length:
            raise TierMemError("tiermem's KV cache holds the batch it was filled with; this generation mode "
                               "selects sequences of a filled cache: not supported")

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def device_bytes(self) -> int:
        """Device bytes the cache holds (its resident layers and slots), 0 before the first forward."""
        return self._held.reserved

    @property
    def home_bytes(self) -> int:
        """Pinned host bytes of the home, 0 before the first forward."""
        return self._held.home.nbytes if self._held.home is not None else 0

    def stats(self) -> dict[str, int]:
        """Bytes copied each way, fills (``fills_late``: made when the layer was needed, not
        ahead), appends, and the memory held."""
        return {**self.counts, "device_bytes": self.device_bytes, "home_bytes": self.home_bytes,
                "tokens": self.layers[0].length}

    def close(self) -> None:
        """Wait for the copies in flight, then give back the device block, the home and the
        budget lease. Idempotent; the cache cannot be used after."""
        if self._closed:
            return
        try:
            if self._allocated:
                self.synchronize()
        finally:
            self._closed = True
            for lay in self.layers:
                lay.length, lay.pending = 0, None
            self._unlay()
            self._held.free()
            self._allocated = False
            if self._owner is not None:
                self._owner.cache_closed(self)

    def __enter__(self) -> TieredKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.layers[0].length:,} tokens"
        return f"<TieredKVCache {state}: {self.plan.table()}>"
