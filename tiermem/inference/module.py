"""Module-level adoption: a whole nn.Module in tiered memory, run within a device budget.

    handle = tier.wrap_module(model, budget=weight_bytes(model) // 4)   # a quarter stays resident
    logits = model(ids)                                # no change inside the model
    print(handle.plan)

The module is cut into groups (inference/groups.py) and planned (NOTE [streaming plan],
inference/plan.py): the largest groups stay resident, the others stream from their pinned home
(inference/transport.py). A module built on the meta device takes its bytes from ``weights=``
(NOTE [weight source], inference/sources.py); with ``host_budget=`` what the pinned home cannot hold
is read from disk (NOTE [disk tier], inference/disk.py). This file holds the handle, :class:`TieredModule`:
the adoption (all or nothing), the hooks that bring groups in around each forward, and unwrap.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..base.limits import check_bytes, parse_bytes
from ..core.stats import count_delta
from ..errors import ConfigError, ConfigTypeError, DeviceFullError, TierMemError, WrapError
from ..pytorch.held import CopyGuard, InstancePatch
from ..roles import Evict, Role
from .disk import STAGES
from .experts import ExpertCache, auto_cache_bytes, cacheable, cached_forward, router_of, top_k_of
from .groups import (MAX_GROUP, enclosing_groups, fit_groups, gathered_groups, home_layout, is_stacked, module_groups,
                     span_of)
from .load import FileTensor
from .options import MODES, ModuleOptions
from .plan import Plan, by_expert, plan_host, plan_residency, stay_home
from .quant import QSTAGES, packing
from .sources import stand_ins, wrap_from
from .split import chunked_forward, find_cuts
from .transport import Group, Piece, PinnedTransport, home_size, packed_layout, part_staging, staging_bytes
from .weights import weight_sources

if TYPE_CHECKING:
    from ..core.engine import Engine as Tier  # what an adapter uses is the engine's interface
    from ..core.tensor import TieredTensor

__all__ = ["TieredModule", "Part", "wrap_module", "check_module", "check_module_options", "MODES"]

log = logging.getLogger("tiermem")

# Host bytes the fill buffers need beside a home being made (NOTE [home beside the resident groups]
# in inference/transport.py); with less left of the host budget, the home is made after.
MIN_FILL_ROOM = 64 << 20


@dataclasses.dataclass(frozen=True)
class Part:
    """The share of a module one :class:`TieredModule` adopts when several adopt it, one per GPU
    (NOTE [layers across GPUs] in inference/multidevice.py): the names of its groups (as
    ``module_groups`` names them at ``group_bytes``), and the stand-ins the caller gave the
    module's meta tensors (NOTE [weight source]). The part's handle hooks the whole module's
    forward and leaves the module's adoption mark and copy guard to the caller."""

    groups: frozenset[str]
    group_bytes: int
    stand_ins: frozenset[int] = frozenset()
    fit_budget: int | None = None   # the GPU's whole budget, the groups' fit (a relay's ring aside)


class TieredModule:
    """Handle of a module adopted by :func:`wrap_module`: its plan, its mode, stats() and unwrap().

    ``options`` (a :class:`ModuleOptions`, in inference/options.py, which documents each), or
    its fields as keyword arguments; ``options`` is the checked record the handle runs by.
    ``stream_dtype`` keeps the streamed groups' weights packed (NOTE [quantized streaming] in
    inference/quant.py), ``expert_cache`` keeps a decode's experts on the device (NOTE [expert
    cache] in inference/experts.py).
    """

    def __init__(self, tier: Tier, module: Any, budget: int | str | None, *, options: ModuleOptions | None = None,
                 part: Part | None = None, **kwargs: Any):
        check_module(module)
        opts = check_module_options(budget, kwargs, given=options)
        if opts.devices is not None:
            raise ConfigError(f"devices={list(opts.devices)!r} spreads a module over several GPUs, which "
                              "tiermem.wrap_module(module, budget, devices=...) does; a Tier's wrap_module (and "
                              "load_pretrained) adopts it on that Tier's device: leave devices out")
        share = opts.share_home
        if share is not None and not isinstance(share, TieredModule):
            raise ConfigTypeError(f"share_home takes the TieredModule of another replica, got {type(share).__name__}")
        self.options = opts
        self.disk_reader = opts.disk_reader
        self.stream_dtype = opts.stream_dtype
        self.expert_cache = opts.expert_cache
        self._cache: ExpertCache | None = None
        self.part = part
        self._share = share
        self.tier = tier
        self.module = module
        self.mode = opts.mode
        self.zero_copy_max_tokens = opts.zero_copy_max_tokens
        self.kv_tokens = opts.kv_tokens
        self._kv_asked = opts.kv_budget
        self._kv_live: Any = None      # the live cache kv_cache() made
        weights = opts.weights
        # A meta tensor cannot be rebound to memory (torch refuses set_data across the two), so
        # the module gets a memory-less stand-in in its place first (NOTE [weight source]); a
        # failure puts the meta tensors back.
        swaps = stand_ins(module) if weights is not None and part is None else []
        made = {id(new) for *_, new in swaps} | (set(part.stand_ins) if part is not None else set())
        try:
            self._setup(module, budget, opts.lookahead, opts.max_group_bytes, weights, made, opts.host_budget)
        except BaseException:
            for owner, name, old, _ in reversed(swaps):
                owner[name] = old
            raise

    def _setup(self, module: Any, budget: int | str | None, lookahead: int, max_group_bytes: int | None,
               weights: Mapping[str, Any] | None, empty: set[int], host_budget: int | str | None) -> None:
        tier = self.tier
        if self.part is None:
            found = module_groups(module, MAX_GROUP if max_group_bytes is None else max_group_bytes)
        else:               # NOTE [layers across GPUs] in inference/multidevice.py
            found = [f for f in module_groups(module, self.part.group_bytes) if f[0] in self.part.groups]
        if not found:
            raise WrapError("this module has no parameters or buffers to tier")
        from ..pytorch.wrap import check_tensor
        self._sources = weight_sources(module, found, weights, empty)     # NOTE [weight source]
        for _, _, own in found:
            for _, t in own:
                if id(t) not in empty:
                    check_tensor(tier, t)
        sizes = [(mname, sum(span_of(t) for _, t in own)) for mname, _, own in found]
        total = sum(n for _, n in sizes)
        # NOTE [sizes] in base/limits.py: a percentage is a share of the device, as everywhere.
        asked = total if budget is None else parse_bytes(budget, total=tier.backend.capabilities().total_memory,
                                                         what="module budget", max_percent=100)
        self.budget = self._within_device(asked, [t for _, _, own in found for _, t in own])
        if max_group_bytes is None:
            fit_for = self.budget
            if self.part is not None and self.part.fit_budget is not None and self.budget >= asked:
                # NOTE [two links into one GPU]: a relay's ring must not cut the groups finer
                fit_for = self.part.fit_budget
            fitted = fit_groups(module, found, fit_for, lookahead)
            found = _within(fitted, found) if self.part is not None and fitted is not found else fitted
            sizes = [(mname, sum(span_of(t) for _, t in own)) for mname, _, own in found]
        cuts = find_cuts(module, found)            # NOTE [split groups] in inference/split.py
        units = {g: c.unit for g, c in cuts.items()}
        in_place = gathered_groups(module, found) | enclosing_groups(found)
        packs = _packings(module, found, self.stream_dtype, in_place, cuts)     # NOTE [quantized streaming]
        packed = {g: packed_layout([t for _, t in own], packs[g])[1] for g, _, own in found if g in packs}
        staged = {g: staging_bytes([t for _, t in own], packs[g]) for g, _, own in found if g in packs}
        parted = {g: part_staging([t for _, t in own], packs[g], cuts[g]) for g, _, own in found
                  if g in packs and g in cuts}          # NOTE [packed parts] in inference/plan.py
        # NOTE [expert cache] in inference/experts.py: its bytes come out of the budget, if a
        # group it could serve streams.
        expert_cache = self.expert_cache

        def plan_at(room: int) -> Plan:
            return self._plan_split(module, sizes, lookahead, in_place, units, room, link=packed, staging=staged,
                                    stages=QSTAGES + (self.stream_dtype == "int4"), part_staging=parted)
        if expert_cache == "auto":
            stacked = {mname: n // int(own[0][1].shape[0]) for (mname, _, own), (_, n) in zip(found, sizes)
                       if is_stacked([t for _, t in own])}
            cache_bytes = auto_cache_bytes(plan_at, self.budget, stacked)
            log.info("tiermem: expert_cache='auto' is %s bytes (NOTE [expert cache budget])", f"{cache_bytes:,}")
        else:
            cache_bytes = 0 if expert_cache is None else parse_bytes(
                expert_cache, total=tier.backend.capabilities().total_memory, what="expert_cache", max_percent=100)
        for room in ([self.budget - cache_bytes] if 0 < cache_bytes < self.budget else []) + [self.budget]:
            self.plan = plan_at(room)
            # A group read in place whole is read in the model's dtype: it is not packed (NOTE [packed parts]).
            self._groups = {mname: Group(mname, [t for _, t in own], n, pinned=mname in self.plan.pinned,
                                          gathered=mname in self.plan.in_place, stacked=is_stacked([t for _, t in own]),
                                          oversized=mname in self.plan.oversized, cut=cuts.get(mname),
                                          split=mname in self.plan.split,
                                          packing=[] if mname in self.plan.pinned | self.plan.oversized
                                          else packs.get(mname, []))
                            for (mname, _, own), (_, n) in zip(found, sizes)}
            roots = {id(self._groups[mname]): m for mname, m, _ in found}
            self._cached = cacheable(list(self._groups.values()), roots) if room < self.budget else []
            if self._cached or not cache_bytes:
                break
        if cache_bytes and not self._cached and expert_cache != "auto":
            log.warning("tiermem: expert_cache=%r is not used: no layer of stacked experts (as transformers' experts "
                        "modules hold them) streams within this budget", expert_cache)
        self._cache_bytes = cache_bytes if self._cached else 0
        if self._cached and expert_cache != "auto":
            self._check_cache_cost(expert_cache, roots, plan_at)
        self._roots = roots
        self.lookahead = max(self.plan.lookahead, 1)
        self._unit_groups: dict[int, list[Group]] = {id(m): [self._groups[mname]] for mname, m, _ in found}
        self.host_budget = None if host_budget is None else parse_bytes(host_budget, what="host_budget")
        if self.host_budget is not None:
            self.plan = plan_host(self.plan, [(g.name, home_size(g.tensors, g.packing, g.dual))
                                              for g in self._groups.values()],
                                  self.host_budget, STAGES,
                                  keep=stay_home([(g.name, g.tensors) for g in self._groups.values()],
                                                 lambda t: isinstance(self._sources.get(id(t)), FileTensor))
                                  | {g.name for g in self._groups.values() if g.cut is not None and g.cut.gathers},
                                  disk_sizes={g.name: home_layout(g.tensors)[1] for g in self._groups.values()})
            for g in self._groups.values():     # plan_host streams from disk what it can cut
                g.split, g.oversized = g.name in self.plan.split, g.name in self.plan.oversized
            if self.plan.on_disk and self.mode == "zero_copy":
                raise TierMemError("mode='zero_copy' reads every weight in place, and a disk tier has weights with "
                                   "no place to read: raise host_budget or use mode='auto'")
            if self.plan.on_disk and self.disk_reader == "kvikio":
                from .kvikio import require
                require()                # refused before anything is allocated, with the reason
        self._cached = [g for g in self._cached if g.name not in self.plan.on_disk]
        # Two experts at least: one slot and the zero slot (NOTE [cached experts sum alike]).
        if self._cached and self._cache_bytes // sum(t.numel() * t.element_size() // t.shape[0]
                                                     for t in self._cached[0].tensors) < 2:
            log.warning("tiermem: expert_cache=%r holds fewer than two experts (one takes %s bytes, and one more "
                        "holds zeros for its rounds); it is not used", expert_cache,
                        f"{sum(t.numel() * t.element_size() // t.shape[0] for t in self._cached[0].tensors):,}")
            self._cached = []
        # NOTE [experts by expert] in inference/plan.py: what a decode step's choice weighs.
        self._moe = [(k, int(g.tensors[0].shape[0]), g.nbytes // int(g.tensors[0].shape[0]), g in self._cached)
                     for g in self._groups.values() if g.stacked and not g.pinned
                     for k in [top_k_of(roots[id(g)])] if k is not None]
        streamed = [g for g in self._groups.values() if not g.pinned]
        if self.plan.zero_copy_only and any(g.packing for g in streamed):
            raise TierMemError(f"a budget of {self.budget:,} bytes has no room for one slot, so every streamed weight "
                               f"would be read in place, and stream_dtype={self.stream_dtype!r} keeps them packed "
                               "(NOTE [quantized streaming]); raise the budget or leave stream_dtype=None")
        self._trainable = any(t.requires_grad for g in streamed for t in g.tensors)
        self.transport = "pinned"
        self._stream: PinnedTransport | None = None
        self._hooks: list[Any] = []
        self._trace: list[int] = []
        self._recording = True
        self._pos = -1
        self._cur = -1                # the last piece brought in, in this forward's sequence (_sequence)
        self._seqs: dict[str, tuple[list[Piece], list[int]]] = {}
        self._uses: dict[int, list[tuple[Group, str]]] = {}
        self._fwd_mode = "stream"
        self._graph_mode = False      # NOTE [graphed forwards] in inference/graphed.py
        self._graphs: weakref.WeakSet = weakref.WeakSet()   # its GraphedForwards, dropped at unwrap
        self.order_epoch = 0          # orders learned again so far: a graph captured under one is stale
        self._lease: Any = None       # its share of the tier's budget (NOTE [budget leases])
        # NOTE [all or nothing]
        #     Adoption, like unwrap, either completes or leaves the module exactly as it was, with
        #     every byte it took given back and its budget lease released. The original tensors
        #     stay referenced until the adoption is done (a failure rebinds them), and the streamed
        #     tensors are bound to their home only in the last step, which cannot fail. unwrap makes
        #     every plain copy before it rebinds anything, after checking the device has room.
        originals = [(t, t.data) for g in self._groups.values() for t in g.tensors]
        try:
            self._adopt(found, streamed)
        except BaseException:
            self._rollback(originals)
            raise

    def _check_cache_cost(self, asked: Any, roots: dict[int, Any], plan_at: Any) -> None:
        """NOTE [expert cache budget]: warn where the cache's bytes cost a decode step more link
        bytes, in groups read every step that now stream, than the cache could ever save it."""
        # NOTE [expert cache budget]
        #     A byte of the budget that keeps a group read every decode step (attention, a
        #     shared expert, a dense MLP) saves one byte of link traffic every step; a byte of the
        #     expert cache saves at most that, and only in the steps that route to its expert. So
        #     the cache pays only with budget the plan cannot spend on such groups: where it takes
        #     budget from them, each step moves those bytes, and it can save at most the experts a
        #     step routes to (top-k a layer, one token), however often it hits. tiermem does not
        #     shrink a cache it was asked for; it says so.
        experts = {g.name for g in self._groups.values() if g.stacked}
        full = plan_at(self.budget)
        extra = self.plan.moved_bytes_but(experts) - full.moved_bytes_but(experts)
        most = 0
        for g in self._cached:
            k = top_k_of(roots[id(g)])
            if k is None:
                return                       # the picks a step makes are not known
            most += k * (g.nbytes // int(g.tensors[0].shape[0]))
        if extra > most:
            log.warning("tiermem: expert_cache=%r takes %s bytes of the budget from groups every decode step reads: "
                        "a step streams %s bytes more of them, more than the %s bytes of experts it can route to, "
                        "which is the most the cache can save it; a smaller cache, a larger budget or none is "
                        "faster (NOTE [expert cache budget] in tiermem/inference/module.py)", asked,
                        f"{self._cache_bytes:,}", f"{extra:,}", f"{most:,}")

    def _plan_split(self, module: Any, sizes: list[tuple[str, int]], lookahead: int, gathered: set[str],
                    units: dict[str, int], budget: int, **planning: Any) -> Plan:
        """The weights' plan within ``budget`` (the module's, less the expert cache's: NOTE [expert
        cache]), less the KV cache's share (NOTE [kv plan]); ``units`` are the groups that can be
        cut (NOTE [split groups] in inference/split.py), ``planning`` goes to plan_residency (the
        packed sizes: NOTE [quantized streaming])."""
        asked = self._kv_asked
        if asked is None:
            return plan_residency(sizes, budget, lookahead, in_place=gathered, split=units, **planning)
        from .kvplan import kv_shape, plan_kv, split_budget
        if asked == "auto":
            shape = kv_shape(self._config(), self._dtype())
            weights, kv = split_budget(sizes, budget, shape, self.kv_tokens, lookahead=lookahead,
                                       in_place=gathered, split=units, **planning)
            return dataclasses.replace(weights, kv_budget=kv.device_bytes, kv=kv)
        kvb = parse_bytes(asked, total=self.tier.backend.capabilities().total_memory, what="kv_budget",
                          max_percent=100)
        if kvb > budget:
            raise ConfigError(f"kv_budget={kvb:,} bytes is more than the whole budget ({budget:,} bytes), which "
                              "holds the weights and the KV cache together")
        kv = None
        if self.kv_tokens is not None:
            kv = plan_kv(kv_shape(self._config(), self._dtype()), self.kv_tokens, kvb)  # refused here if it cannot
        weights = plan_residency(sizes, budget - kvb, lookahead, in_place=gathered, split=units, **planning)
        return dataclasses.replace(weights, kv_budget=kvb, kv=kv)

    def _config(self) -> Any:
        config = getattr(self.module, "config", None)
        if config is None:
            raise ConfigError(f"a KV cache is sized from the model's config, and this {type(self.module).__name__} has "
                              "no .config; pass config= to kv_cache()")
        return config

    def _dtype(self) -> Any:
        return getattr(self.module, "dtype", None)

    def kv_cache(self, max_tokens: int | None = None, *, batch_size: int = 1, config: Any = None, fp8: bool = False,
                 slots: int | None = None, host_budget: int | str | None = None) -> Any:
        """A :class:`~tiermem.inference.kvcache.TieredKVCache` for this module within the budget's KV share
        (``kv_budget``, NOTE [kv plan]), for ``max_tokens`` tokens a sequence (default
        ``kv_tokens``); pass it to ``generate``. One at a time: ``close()`` it before asking for
        another. Its home counts against ``host_budget`` (default: the module's, less its own
        pinned home)."""
        from .kvcache import TieredKVCache
        from .kvplan import SLOTS
        if not self._groups:
            raise WrapError("this module was unwrapped; a KV cache needs the adopted module")
        if not self.plan.kv_budget:
            raise ConfigError("this module has no KV share of its budget: wrap_module(model, budget, kv_budget=...) "
                              "sets it aside, or use tiermem.kv_cache() with a budget of its own")
        if self._kv_live is not None:
            raise TierMemError("this module's KV cache is still open: close() it before asking for another")
        tokens = max_tokens if max_tokens is not None else self.kv_tokens
        if tokens is None:
            raise ConfigError("give max_tokens: the most tokens a sequence may reach, prompt and generated")
        if host_budget is None and self.host_budget is not None:
            host_budget = max(self.host_budget - (self._stream.pinned_bytes if self._stream is not None else 0), 0)
        cache = TieredKVCache(config if config is not None else self._config(), tokens, self.plan.kv_budget,
                              batch_size=batch_size, dtype=self._dtype(), slots=slots or SLOTS, fp8=fp8,
                              host_budget=host_budget, tier=self.tier, _owner=self)
        self._kv_live = cache
        self.plan = dataclasses.replace(self.plan, kv=cache.plan)
        return cache

    def cache_closed(self, cache: Any) -> None:
        """A cache :meth:`kv_cache` made was closed: another may be made."""
        if self._kv_live is cache:
            self._kv_live = None

    def stats(self) -> dict[str, Any]:
        """A flat dict of the module's host-side figures (bytes, seconds, counts):
        ``pinned_bytes.current`` (the home, staging buffers and gradients' home, together) and
        ``pinned_bytes.home`` / ``.staging``; ``host_budget`` (-1: none); ``disk_bytes.per_forward``
        (the bytes a forward reads from the files);
        and the disk tier's totals since adoption: ``disk.read_bytes``, ``disk.read_seconds`` (the
        reader's time), ``disk.wait_seconds`` (the forward's time waiting on the reader),
        ``disk.reads``, ``disk.stage_reuse`` (reads into a staging buffer used before),
        ``disk.resyncs``, ``disk.dropped`` (reads thrown away when a forward changed order) and
        ``disk.retries`` (failed reads made again; NOTE [disk read errors]); the expert cache's
        (NOTE [expert cache], all 0 without one): ``expert_cache.slots``, ``.bytes``, ``.hits``,
        ``.misses``, ``.hit_rate``, ``.prefetched``, ``.prefetch_hits``, ``.evictions``,
        ``.rounds``, ``.calls`` and ``.moved_bytes``."""
        st = self._stream
        disk = st.disk if st is not None else None
        out: dict[str, Any] = {
            "pinned_bytes.current": st.pinned_bytes if st is not None else 0,
            "pinned_bytes.home": st.home.nbytes if st is not None and st.home is not None and not st.shared else 0,
            "pinned_bytes.home_shared": st.home.nbytes if st is not None and st.home is not None and st.shared else 0,
            "pinned_bytes.staging": disk.pinned_bytes if disk is not None else 0,
            "host_budget": -1 if self.host_budget is None else self.host_budget,
            "disk_bytes.per_forward": sum(n for fs in disk.files.values() for _, _, n, _ in fs) if disk else 0,
        }
        for k in ("read_bytes", "read_seconds", "wait_seconds", "reads", "stage_reuse", "resyncs", "dropped",
                  "retries"):
            out[f"disk.{k}"] = disk.stats[k] if disk is not None else 0
        out.update(self._cache.summary() if self._cache is not None else ExpertCache.empty_summary())
        return out

    def _serves(self, g: Group) -> bool:
        """Whether the expert cache serves ``g`` in the forward running now (a decode step)."""
        return self._fwd_mode == "decode" and g.cached

    def _within_device(self, asked: int, tensors: list[Any]) -> int:
        """The budget the device can really hold: resident groups live in managed memory, which
        the cap keeps within the device's real free memory (NOTE [managed cap]); asking for more
        would be refused there. Weights already on this device count as room: they are freed once
        adopted. A budget that must shrink says so, and the plan streams the rest."""
        be = self.tier.backend
        lease_room = self.tier.lease_room()      # NOTE [budget leases]
        if lease_room is not None and asked > lease_room:
            log.warning("tiermem: a module budget of %s bytes does not fit the tier's configured budget (%s bytes "
                        "left for leases); planning for that, the rest streams from pinned host memory",
                        f"{asked:,}", f"{lease_room:,}")
            asked = lease_room
        room = be.guard.limit - be.guard.reserved
        on_device = sum(t.numel() * t.element_size() for t in tensors
                        if t.device.type == "cuda" and t.device.index == self.tier.device)
        free = be.mem_info()[0] + on_device
        fit = max(0, min(room, free))
        if asked > fit:
            log.warning("tiermem: a module budget of %s bytes does not fit this device (%s bytes of managed room, "
                        "%s free); planning for %s bytes, the rest streams from pinned host memory",
                        f"{asked:,}", f"{room:,}", f"{free:,}", f"{fit:,}")
            return fit
        return asked

    def _adopt(self, found: list, streamed: list[Group]) -> None:
        tier, module = self.tier, self.module
        # before any fill: adoption itself stays within budget
        self._lease = tier.lease(self.budget, owner=f"wrap_module({type(module).__name__})")
        pinned = [g for g in self._groups.values() if g.pinned]
        room, ready = self.plan.host_budget, None
        if streamed:
            other = self._share._stream if self._share is not None else None
            if self._share is not None and other is None:
                raise ConfigError("share_home: that handle streams nothing, so it has no home to share")
            self._stream = PinnedTransport(tier, self.plan, streamed, self.lookahead,
                                           Role.WEIGHT if self._trainable else Role.FROZEN_WEIGHT,
                                           self._sources, self.disk_reader, share=other)
            left = None if room is None else room - self._stream.host_planned
            if self._stream.reads_files and pinned and (left is None or left >= MIN_FILL_ROOM):
                # NOTE [home beside the resident groups] in inference/transport.py
                room, ready = left, self._stream.start
        if pinned:
            flat = [t for g in pinned for t in g.tensors]
            role = Role.WEIGHT if any(t.requires_grad for t in flat) else Role.FROZEN_WEIGHT
            names = [f"{g.name}.{i}" for g in pinned for i in range(len(g.tensors))]
            policy = tier.policies[role].replace(evict=Evict.NEVER)
            if self._sources:
                tts = wrap_from(tier, flat, [self._sources.get(id(t)) for t in flat], names, policy, room=room,
                                 ready=ready)
            else:
                tts = _wrap_group(tier, flat, names, on_host=False, policy=policy)
            k = 0
            for g in pinned:
                g.tiered = tts[k:k + len(g.tensors)]
                k += len(g.tensors)
            del tts    # a traceback keeps this frame: only the groups may hold the buffers
        if self._stream is not None:
            self._stream.finish()
        if self._cached:
            self._cache = ExpertCache(self._stream, self._cached, self._cache_bytes, self._routers(module))
            tier.reserve(self._cache.nbytes, self._stream.role)
            try:
                self._cache.allocate()
            except BaseException:
                tier.unreserve(self._cache.nbytes, self._stream.role)
                self._cache = None
                raise
        # A module that uses a tensor of a group outside its own subtree (tied weights) needs that
        # group too: it gets hooks of its own.
        owner = {id(t): g for g in self._groups.values() for t in g.tensors}
        inside: dict[int, Group] = {}
        for mname, m, _ in found:
            for sub in m.modules():
                inside.setdefault(id(sub), self._groups[mname])
        for m in module.modules():
            for t in list(m._parameters.values()) + list(m._buffers.values()):
                g = owner.get(id(t)) if t is not None else None
                if g is not None and inside.get(id(m)) is not g:
                    gs = self._unit_groups.setdefault(id(m), [])
                    if g not in gs:
                        gs.append(g)
        pinned_tts = [t for g in pinned for t in g.tiered]
        if pinned_tts:
            tier.prefetch(pinned_tts).synchronize()
        self._units = [m for m in module.modules() if id(m) in self._unit_groups]
        self._uses = {id(m): [(g, _use(m, g)) for g in self._unit_groups[id(m)]] for m in self._units}
        self._hooks = [module.register_forward_pre_hook(self._root_pre, with_kwargs=True),
                       module.register_forward_hook(self._root_post)]
        for i, m in enumerate(self._units):
            self._hooks.append(m.register_forward_pre_hook(lambda mod, args, i=i: self._pre(i)))
            self._hooks.append(m.register_forward_hook(lambda mod, args, out, i=i: self._post(i)))
        if self._stream is not None:
            for g in streamed:
                for i, t in enumerate(g.tensors):
                    if t.requires_grad and hasattr(t, "register_post_accumulate_grad_hook"):
                        self._hooks.append(t.register_post_accumulate_grad_hook(_offload_grad_hook(self, g.name, i)))
                if g.split:                 # NOTE [split groups] in inference/split.py
                    for m in g.cut.runs:
                        self._hooks.append(InstancePatch(m, {"forward": chunked_forward(
                            m, g.cut, g, self._runs_parts, self._enter, self._leave)}))
            if self._cache is not None:     # NOTE [expert cache] in inference/experts.py
                # After the chunked forwards: a decode the cache serves runs the module's own
                # forward (a cached group takes no slot in a decode), any other its parts.
                for g in self._cached:
                    g.cached = True
                    m = self._roots[id(g)]
                    self._hooks.append(InstancePatch(m, {"forward": cached_forward(m, g, self._serves, self._cache)}))
            self._stream.bind_home()       # the last step; it cannot fail
        if self.part is None:
            self._hooks.append(CopyGuard(module))   # NOTE [held modules]
            module._tiermem_handle = weakref.ref(self)

    def _routers(self, module: Any) -> dict[int, Any]:
        """id(group) -> the router beside each cached group's experts module, where its weight can
        be read between its own layer's turns (NOTE [expert cache] in inference/experts.py): resident,
        or streamed whole from a home in the model's dtype (at rest its tensors point there)."""
        parent = {id(c): m for m in module.modules() for c in m.children()}
        owner = {id(t): g for g in self._groups.values() for t in g.tensors}
        out = {}
        for g in self._cached:
            m = self._roots[id(g)]
            r = router_of(parent[id(m)], m) if id(m) in parent else None
            w = owner.get(id(getattr(r, "weight", None)))
            if r is None or w is None:
                continue
            i = next(k for k, t in enumerate(w.tensors) if t is r.weight)
            if w.pinned or not (w.on_disk or w.split or w.oversized or (w.packing and w.packing[i] is not None)):
                out[id(g)] = r
        return out

    def _rollback(self, originals: list[tuple[Any, Any]]) -> None:
        """Undo a failed adoption: the module's tensors get their original data back, and every
        byte tiermem took for them is given back. Must not raise over the adoption's error."""
        from ..pytorch.wrap import TIERED_ATTR
        for h in reversed(self._hooks):      # last first: a forward patched twice gets its own back
            h.remove()
        self._hooks = []
        for t, data in originals:
            t.data = data
            if hasattr(t, TIERED_ATTR):
                delattr(t, TIERED_ATTR)
        self._give_back()
        self.tier.backend.release_cached()   # the freed groups' managed memory back to the driver

    # -- forward hooks ------------------------------------------------------------------------------
    def _tokens(self, args: tuple, kwargs: dict) -> int | None:
        # Hugging Face models take their tokens by name; the other integer tensors they get
        # (attention mask, cache positions) span the whole sequence, not the new tokens.
        ids = kwargs.get("input_ids")
        if ids is not None and hasattr(ids, "numel"):
            return int(ids.numel())
        emb = kwargs.get("inputs_embeds")
        if emb is not None and hasattr(emb, "shape") and emb.dim() >= 2:
            return int(emb.shape[:-1].numel())
        vals = list(args) + list(kwargs.values())
        for a in vals:
            if hasattr(a, "dtype") and hasattr(a, "shape") and not a.dtype.is_floating_point and a.dim() >= 1:
                return int(a.numel())
        for a in vals:
            if hasattr(a, "shape") and a.dim() >= 2:
                return int(a.shape[:-1].numel())
        return None

    def _root_pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        import torch
        mode = self.mode
        if self._stream is None or not self._stream.nslots or (self._trainable and torch.is_grad_enabled()):
            mode = "zero_copy"       # NOTE [trainable weights in the pinned home] in inference/transport.py
            if self._stream is not None and self._stream.disk is not None:
                raise TierMemError("this module reads weights from disk (host_budget), so a forward that records "
                                   "gradients cannot read them in place; run it under torch.no_grad() or "
                                   "torch.inference_mode() (NOTE [disk tier])")
            if self._stream is not None and any(g.packed for g in self._stream.groups):
                raise TierMemError(f"this module streams its weights packed (stream_dtype={self.stream_dtype!r}), so a "
                                   "forward that records gradients cannot read them in place; run it under "
                                   "torch.no_grad() or torch.inference_mode() (NOTE [quantized streaming])")
        elif mode == "auto":
            n = self._tokens(args, kwargs)
            # NOTE [experts by expert] in inference/plan.py
            few = n is not None and n <= self.zero_copy_max_tokens
            mode = "decode" if few and all(by_expert(n, k, e, per, c) for k, e, per, c in self._moe) else "stream"
        self._fwd_mode = mode
        self._pos = -1
        if self._graph_mode and self._stream is not None and self._stream.nslots:
            self._stream.restart()            # NOTE [graphed forwards]: its first piece in slot 0

    def _root_post(self, module: Any, args: tuple, out: Any) -> None:
        if self._recording and self._trace:
            self._recording = False
            self._seqs = {}
            if self._stream is not None and self._stream.disk is not None:
                # What a forward reads from disk, in order: the same in every mode that streams
                # (a group on disk always takes a slot).
                self._stream.disk.set_sequence([p for p in self._sequence("stream")[0] if p.group.on_disk])
        if self._fwd_mode != "zero_copy" and not self._recording and self._stream is not None:
            self._cur = -1
            if self._graph_mode and self._stream.nslots:
                self._stream.restart()        # NOTE [graphed forwards]: where the next one starts
            self._stream.ahead(self._upcoming())   # the first streamed pieces of the next forward

    def _pieces(self, m: Any, mode: str) -> tuple[list[Piece], list[Piece]]:
        """What unit ``m`` brings into slots in a forward in ``mode``: whole groups (its pre-hook
        does) and parts of split groups (its chunked forward does, NOTE [split groups])."""
        whole, parts = [], []
        for g, use in self._uses[id(m)]:
            if g.pinned or use == "rows" or not g.slot_in(mode):
                continue
            if use == "parts":
                parts.extend(g.pieces)
            else:
                whole.append(g.pieces[0])
        return whole, parts

    def _sequence(self, mode: str) -> tuple[list[Piece], list[int]]:
        """The pieces a forward in ``mode`` brings into slots, in order, and where each position
        of the learned order starts in that list."""
        got = self._seqs.get(mode)
        if got is None:
            flat: list[Piece] = []
            starts: list[int] = []
            for i in self._trace:
                starts.append(len(flat))
                whole, parts = self._pieces(self._units[i], mode)
                flat += whole + parts
            got = self._seqs[mode] = (flat, starts)
        return got

    def _upcoming(self) -> list[Piece]:
        flat, _ = self._sequence(self._fwd_mode)
        return flat[self._cur + 1:self._cur + 1 + self.lookahead]

    def _pre(self, i: int) -> None:
        if self._recording:
            self._trace.append(i)
        else:
            self._pos += 1
            if self._pos >= len(self._trace) or self._trace[self._pos] != i:
                # Another order than the one learned: learn it again on the next forward.
                self._recording, self._trace, self._seqs = True, [], {}
                self.order_epoch += 1
        ahead = self._fwd_mode != "zero_copy" and not self._recording and self._stream is not None
        if ahead:
            self._cur = self._sequence(self._fwd_mode)[1][self._pos] - 1
        for g, _ in self._uses[id(self._units[i])]:
            if g.pinned and not all(t.is_resident for t in g.tiered):
                self.tier.prefetch(g.tiered)
        for p in self._pieces(self._units[i], self._fwd_mode)[0]:
            self._stream.ensure(p)
            self._cur += 1
        if ahead:
            self._stream.ahead(self._upcoming())

    def _post(self, i: int) -> None:
        if self._fwd_mode == "zero_copy":
            return
        for p in self._pieces(self._units[i], self._fwd_mode)[0]:
            self._stream.release(p)

    def _runs_parts(self, g: Group) -> bool:
        """Whether this forward streams ``g`` in parts (else its user runs as it would unsplit)."""
        return self._stream is not None and self._stream.nslots > 0 and g.slot_in(self._fwd_mode)

    def _enter(self, p: Piece) -> list[Any]:
        """Bring part ``p`` into its slot, for a chunked forward (NOTE [split groups]); its views."""
        views = self._stream.ensure(p)
        self._cur += 1
        if self._fwd_mode != "zero_copy" and not self._recording:
            self._stream.ahead(self._upcoming())
        return views

    def _leave(self, p: Piece) -> None:
        self._stream.release(p)

    def attach_relay(self, relay: Any, share: float) -> bool:
        """Copy the last ``share`` of each streamed piece through ``relay`` (another GPU's link,
        core/stream.py's :class:`Relay`) beside this GPU's own copy; False (nothing attached)
        where this module streams nothing a relay carries: only whole copies from the pinned
        home go through one, not packed groups or the disk tier's (NOTE [two links into one GPU]
        in inference/multidevice.py). None detaches."""
        st = self._stream
        if relay is not None and (st is None or not st.nslots
                                  or all(g.packed or g.on_disk for g in st.groups)):
            return False
        if st is None:
            return False
        st.relay, st.relay_share = relay, (share if relay is not None else 0.0)
        return True

    # -- graphed forwards (NOTE [graphed forwards] in inference/graphed.py) ---------------------------
    def graphed(self, fn: Callable[..., Any]) -> Any:
        """``fn(*tensors)`` (a forward of the module; it returns a tensor or a tuple, list or dict
        of them) run under ``torch.no_grad()``: eagerly until the module's order is learned and
        one forward of the same shapes has run, then captured once as a CUDA graph and replayed,
        the host's work a single launch. Returns a :class:`~tiermem.inference.graphed.GraphedForward`;
        its ``off`` says why its forwards stay eager, where they do."""
        from .graphed import GraphedForward
        g = GraphedForward(self, fn)
        self._graphs.add(g)
        return g

    def graph_blockers(self) -> str:
        """Why this module's forwards cannot be captured ("" when they can)."""
        if not self._groups:
            return "the module was unwrapped"
        if self.tier.backend.kind != "cuda":
            return f"the {self.tier.backend.kind!r} backend does not capture CUDA graphs"
        if self.part is not None:
            return "its layers are spread over several GPUs (NOTE [layers across GPUs])"
        st = self._stream
        if st is not None and st.disk is not None:
            return "it reads weights from disk on host threads (NOTE [disk tier])"
        if st is not None and st.relay is not None:
            return "a relay brings part of its weights over another GPU's link"
        if self._cache is not None:
            return "its expert cache chooses the experts to move on the host, token by token"
        if self._kv_live is not None:
            return ("its KV cache (kv_cache()) grows by each forward's tokens: a replay would write the "
                    "captured rows again")
        return ""

    @property
    def order_learned(self) -> bool:
        """Whether the module's order of use is known (the hooks then bring pieces in ahead)."""
        return not self._recording and bool(self._trace)

    @contextlib.contextmanager
    def graph_mode(self) -> Iterator[None]:
        """Forwards inside start at slot 0, and each one's tail brings the next one's first pieces
        into slots 0, 1, ... (NOTE [graphed forwards])."""
        before, self._graph_mode = self._graph_mode, True
        try:
            yield
        finally:
            self._graph_mode = before

    @property
    def forward_mode(self) -> str:
        """How the last forward moved its streamed groups: "stream", "decode" or "zero_copy"."""
        return self._fwd_mode

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """A forward inside is being captured (NOTE [events across a capture] in cuda/capture.py):
        in graph mode, its copies untimed and untracked. A capture that fails ran the forward's
        Python and none of its copies: the slots are forgotten and its moves uncounted."""
        st = self._stream
        acc = self.tier.accounting
        before = acc.snapshot()
        with self.graph_mode(), self.tier.backend.capturing():
            if st is not None:
                st.capturing = True
            try:
                yield
            except BaseException:
                if st is not None and st.nslots:
                    st.forget_slots()
                acc.count_many({k: -n for k, n in count_delta(before, acc.snapshot()).items()})
                raise
            finally:
                if st is not None:
                    st.capturing = False

    def before_replay(self, stream: int, mode: str) -> None:
        """A graph of a forward in ``mode`` is launched on ``stream`` next (NOTE [graphed
        forwards]): the forward's first pieces are brought into the slots the graph reads them
        from, where a forward since moved them, and ``stream`` waits for every copy queued."""
        st = self._stream
        if st is None or not st.nslots:
            return
        if mode != "zero_copy":
            st.restart()
            st.ahead(self._sequence(mode)[0][:self.lookahead])
        st.settle_into(stream)

    # -- lifecycle ------------------------------------------------------------------------------------
    def drain(self) -> None:
        """Wait until every move this module queued is done."""
        if self._stream is not None:
            self._stream.drain()
        self.tier.synchronize()

    @property
    def moved_bytes(self) -> int:
        """Bytes a streaming forward copies over the link: the streamed groups in their pinned
        home's layout (256-byte aligned; packed, NOTE [quantized streaming]), less those read in
        place."""
        return sum(g.link_bytes for g in self._groups.values() if not g.pinned and not g.gathered)

    @property
    def groups(self) -> dict[str, list[Any]]:
        """Group name -> its tensors (TieredTensors where tiermem holds them in managed memory)."""
        return {g.name: list(g.tiered or g.tensors) for g in self._groups.values()}

    def unwrap(self, device: Any = None) -> Any:
        """Give every tensor plain memory again and remove the hooks; returns the module.

        ``device`` (e.g. "cpu") restores every tensor there; by default each goes back to the
        device it came from. The device memory this needs is checked first: if it is not free,
        :class:`DeviceFullError` (a MemoryError) is raised and nothing changes; ``unwrap("cpu")``
        then restores onto the host. All or nothing: the plain copies are made before anything is
        rebound.
        """
        import torch
        if not self._groups:
            raise WrapError("this module was unwrapped already")
        if device is not None:
            device = torch.device(device)
        origin: dict[int, Any] = {}
        for g in self._groups.values():
            for t, tt in zip(g.tensors, g.tiered):
                origin[id(t)] = getattr(tt, "_origin_device", None)
        if self._stream is not None:
            origin.update(self._stream.origin)
        dev_of = lambda t: device if device is not None else (origin.get(id(t)) or t.device)  # noqa: E731
        self._check_room(dev_of)
        for g in list(self._graphs):          # they replay into the window given back below
            g.close("the module was unwrapped")
        if self._stream is not None:
            self._stream.drain()
        plain = list(self._stream.restored(dev_of)) if self._stream is not None else []
        with torch.no_grad():
            for g in self._groups.values():
                if g.pinned:
                    for t in g.tensors:
                        p = torch.empty(t.shape, dtype=t.dtype, device=dev_of(t))
                        p.copy_(t.data)
                        grad = getattr(t, "grad", None)
                        grad = grad.to(p.device, copy=True) if grad is not None and grad.device != p.device else None
                        plain.append((t, p, grad))
        # Everything is copied: from here on nothing can fail.
        for h in reversed(self._hooks):      # last first: a forward patched twice gets its own back
            h.remove()
        self._hooks = []
        self._rebind_plain(plain)
        if self.part is None:
            self.module._tiermem_handle = None
        return self.module

    def _rebind_plain(self, plain: list[tuple[Any, Any, Any]]) -> None:
        from ..pytorch.wrap import TIERED_ATTR
        for t, p, grad in plain:
            t.data = p
            if grad is not None:
                t.grad = grad
            if hasattr(t, TIERED_ATTR):
                delattr(t, TIERED_ATTR)
        self.tier.synchronize()
        self._give_back()

    def _give_back(self) -> None:
        """Free what the adoption took once the tensors no longer point at it: the resident
        groups, the streaming window and pinned home, the KV cache, and the budget lease."""
        if self._kv_live is not None:
            self._kv_live.close()     # its device bytes are inside the module's lease
        for g in self._groups.values():
            for tt in g.tiered:
                tt.buffer.bindings = []
                tt.free()
            g.tiered = []
        if self._cache is not None:
            if self.tier.backend.kind == "cuda":
                import torch
                torch.cuda.synchronize(self.tier.device)
            self._cache.release()
            self.tier.unreserve(self._cache.nbytes, self._stream.role if self._stream is not None else Role.FROZEN_WEIGHT)
            self._cache = None
        if self._stream is not None:
            self._stream.discard()
            self._stream = None
        self._groups.clear()
        if self._lease is not None:
            self._lease.release()

    def _check_room(self, dev_of: Callable[[Any], Any]) -> None:
        """Refuse, changing nothing, an unwrap whose plain copies do not fit their device."""
        import torch
        need = sum(t.numel() * t.element_size() for g in self._groups.values() for t in g.tensors
                   if dev_of(t).type == "cuda")
        if not need or self.tier.backend.kind != "cuda":
            return
        free = self.tier.backend.mem_info()[0]
        if torch.cuda.is_initialized():
            free += torch.cuda.memory_reserved(self.tier.device) - torch.cuda.memory_allocated(self.tier.device)
        if need > free:
            raise DeviceFullError(need, 0, free, hint="unwrap needs that much free device memory for the plain "
                                   "copies and the device has less; call unwrap(device='cpu') to restore onto "
                                   "the host, or free device memory first")

    def __repr__(self) -> str:
        return f"<TieredModule {type(self.module).__name__} ({self.transport}): {self.plan.table(limit=0)}>"


def _packings(module: Any, found: list, fmt: str | None, in_place: set[str],
              cuts: dict[str, Any] | None = None) -> dict[str, list[Any]]:
    """Group -> per member, how it is packed in ``fmt`` (a quant.Packing) or None, for the groups
    with a member to pack (NOTE [quantized streaming]): a floating 2-D weight that only plain
    Linear layers use (transformers' Conv1D too), or that embeddings also read where the group is
    a table cut by rows for its head (``cuts``: NOTE [packed tied table] in inference/transport.py),
    or a stacked group's 3-D experts."""
    if fmt is None:
        return {}
    import sys

    import torch
    linear: tuple[type, ...] = (torch.nn.Linear,)
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    if isinstance(conv1d, type):
        linear += (conv1d,)
    users: dict[int, list[tuple[Any, str]]] = {}
    for m in module.modules():
        for name, t in m._parameters.items():
            if t is not None:
                users.setdefault(id(t), []).append((m, name))
    out = {}
    for gname, _, own in found:
        if gname in in_place:
            continue
        ts = [t for _, t in own]
        stacked = is_stacked(ts)
        cut = (cuts or {}).get(gname)
        gathers = {id(m) for m in cut.gathers} if cut is not None else set()
        packs = []
        for t in ts:
            us = users.get(id(t), [])
            heads = [(m, n) for m, n in us if id(m) not in gathers]
            fit = (isinstance(t, torch.nn.Parameter) and bool(heads) and
                   ((t.dim() == 2 and all(isinstance(m, linear) and n == "weight" for m, n in heads))
                    or (stacked and t.dim() == 3)))
            packs.append(packing(t, fmt) if fit else None)
        if any(p is not None for p in packs):
            out[gname] = packs
    return out


def _use(m: Any, g: Group) -> str:
    """How unit ``m`` uses group ``g``: "rows" (an embedding: reads the rows of its tokens in
    place), "parts" (runs over the parts of a split group) or "whole" (a slot holds it whole)."""
    cut = g.cut
    if cut is not None and any(m is x for x in cut.gathers):
        return "rows"
    if g.split and cut is not None and any(m is x for x in cut.runs):
        return "parts"
    return "whole"


def _wrap_group(tier: Tier, tensors: list[Any], names: list[str], on_host: bool, policy: Any) -> list[TieredTensor]:
    from ..pytorch.wrap import wrap_group
    return wrap_group(tier, tensors, Role.WEIGHT, names=names, on_host=on_host, policy=policy)


def _within(finer: list, coarse: list) -> list:
    """The groups of ``finer`` (module_groups of the whole module at a smaller size) that hold
    the tensors of ``coarse`` (a part's groups: NOTE [layers across GPUs] in
    inference/multidevice.py). A smaller size only cuts a group into groups inside it, so none
    holds tensors of both."""
    mine = {id(t) for _, _, own in coarse for _, t in own}
    out = []
    for name, m, own in finer:
        inside = [id(t) in mine for _, t in own]
        if all(inside):
            out.append((name, m, own))
        elif any(inside):
            raise WrapError(f"group {name} holds tensors of two devices' runs; give max_group_bytes")
    return out


def check_module(module: Any) -> None:
    """Raise :class:`ConfigTypeError` for what is not an ``nn.Module``, :class:`WrapError` for a
    module already adopted. Needs no Tier: tiermem.wrap_module calls it before it looks for one."""
    try:
        import torch
    except ImportError as e:
        raise WrapError("wrap_module needs torch; pip install 'tiermem[torch]'") from e
    if not isinstance(module, torch.nn.Module):
        raise ConfigTypeError(f"wrap_module takes a torch.nn.Module, got {type(module).__name__}")
    if getattr(module, "_tiermem_handle", None) is not None:
        raise WrapError("this module is already adopted by tiermem; unwrap it first")


def check_module_options(budget: Any, options: Mapping[str, Any], call: str = "wrap_module",
                         taken: tuple[str, ...] = (), given: ModuleOptions | None = None) -> ModuleOptions:
    """The checked :class:`ModuleOptions` of ``given`` with the keyword ``options`` changing its
    fields, once ``budget`` and they are known to be what :class:`TieredModule` takes, as far as
    that needs no Tier: an unknown keyword (:class:`ConfigTypeError`; ``taken`` names those
    ``call`` sets itself), each option's type and range (ModuleOptions checks itself), a budget
    that is not a size or is more than the device, a budget of 0 outside mode="zero_copy"
    (:class:`ConfigError`). The module-level wrap_module and load_pretrained call it before they
    look for a GPU, and TieredModule when it is made."""
    opts = ModuleOptions.of(given, call, taken, **options)
    mode = opts.mode
    if budget is not None:
        check_bytes(budget, what="module budget", max_percent=100)
        if mode != "zero_copy":
            try:
                check_bytes(budget, what="module budget", positive=True)
            except ConfigError:
                raise ConfigError(f"module budget={budget!r} keeps no weight on the device, so every forward would "
                                  "read them all over the link: pass mode='zero_copy' if that is meant, else a budget "
                                  "above 0") from None
    return opts


def wrap_module(tier: Tier, module: Any, budget: int | str | None = None, *, options: ModuleOptions | None = None,
                **kwargs: Any) -> TieredModule:
    """Adopt every parameter and buffer of ``module``; see :class:`TieredModule` and NOTE
    [streaming plan] in inference/plan.py. ``budget`` is bytes, "8GB", or a share of the device like
    "25%" (NOTE [sizes] in base/limits.py); :func:`weight_bytes` (inference/groups.py) sizes a share of the
    module's weights. ``options`` and ``kwargs``: :class:`ModuleOptions`."""
    return TieredModule(tier, module, budget, options=options, **kwargs)


def _offload_grad_hook(handle: TieredModule, group: str, i: int) -> Any:
    """The post-accumulate-grad hook of tensor ``i`` of the streamed group named ``group``: it holds
    the handle weakly and the group by name, since torch keeps these hooks where the garbage
    collector cannot see them (NOTE [hooks gc cannot see] in training/hooks.py)."""
    ref = weakref.ref(handle)

    def hook(p: Any) -> None:
        h = ref()
        if h is not None:
            h._stream.offload_grad(h._groups[group], i, p)
    return hook
