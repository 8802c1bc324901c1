"""The KV cache's plan: which layers' keys and values stay on the device within a budget and
which stream from their pinned home through a ring of device slots (:func:`plan_kv`), and the
split of one device budget between a module's weights and its cache (:func:`split_budget`).
Pure functions; no GPU, no transformers.

NOTE [kv plan]
    Attention reads all of a layer's keys and values at once, so the cache is planned in whole
    layers (NOTE [kv cache in tiers] in inference/kvcache.py says why not a window of recent
    tokens). A layer takes ``layer_bytes`` on the device: keys and values for ``max_tokens``
    tokens of every sequence in the batch. The plan keeps ``resident`` layers on the device for
    good; the others live in pinned host memory (their home) and come in one layer ahead into a
    ring of ``slots`` device slots, each one layer big (plus its transit buffer with fp8, NOTE
    [fp8 in transit]). So a plan holds ``resident * layer_bytes + slots * slot_bytes`` device
    bytes, and a decode step at context ``n`` copies the streamed layers' ``n`` tokens over
    the link: the bound of a step is those bytes over the link rate.

    Two slots are the least that overlaps: one is read by the running layer's attention while
    the next layer's copy fills the other. The resident layers are spread evenly over the
    model, so that the copy of the next streamed layer also runs beside resident layers' work.

    One budget for weights and cache (:func:`split_budget`): every byte not on the device
    crosses the link once per decode step, a weight byte as a cache byte, so the split that
    moves the fewest bytes per step at ``max_tokens`` wins; each side's fixed cost (the weights'
    streaming window, the cache's ring) decides where the budget goes when it cannot hold both.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import ConfigError, OutOfBudgetError
from .plan import LINK_GBPS, Plan, plan_residency

# NOTE [pinned mapping]
#     Pinning host memory for the GPU costs device memory: the driver's free memory fell by 2 MiB
#     for every GiB pinned, whether through torch's pinned allocator, cudaHostAlloc or
#     cudaHostRegister (docs/facts.md, "Pinned memory's cost on the device"). A long context's
#     home is tens of GB, so its mapping is tens to hundreds of MiB of device memory, which the
#     cache's device budget counts beside its resident layers and its ring: 2 MiB for each whole
#     GiB of home (a home under a GiB is charged nothing; the driver's piece for it is within the
#     slack every measurement of free memory needs).
MAP_PER = 1 << 30               # pinned bytes...
MAP_GRAIN = 2 << 20             # ...for each of which the driver took this much of the device

__all__ = ["FP8_MAX", "SLOTS", "KVPlan", "KVShape", "kv_shape", "most_tokens", "pinned_map_bytes", "plan_kv", "split_budget"]

SLOTS = 2          # ring slots for streamed layers (NOTE [kv plan]: the least that overlaps)
ALIGN = 512        # every region of the device block and the home starts on this boundary (as in core/stream.py)
FP8_MAX = 448.0    # the largest float8_e4m3fn value (NOTE [fp8 in transit] in inference/kvcache.py)
SCALE_BYTES = 4    # one fp32 scale per (token, sequence, head) of keys and of values


def _align(n: int) -> int:
    return -(-int(n) // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True)
class KVShape:
    """The cache's shape: ``layers`` of ``kv_heads`` heads of ``head_dim`` (keys; values
    ``v_head_dim``), ``itemsize`` bytes an element, ``batch`` sequences."""

    layers: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    itemsize: int
    batch: int = 1

    @property
    def row_bytes(self) -> tuple[int, int]:
        """Bytes of one token of one layer, keys and values, all sequences (fp16/bf16)."""
        return (self.batch * self.kv_heads * self.head_dim * self.itemsize,
                self.batch * self.kv_heads * self.v_head_dim * self.itemsize)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token position in every layer, keys and values, all sequences."""
        return self.layers * sum(self.row_bytes)

    def layer_bytes(self, tokens: int) -> int:
        """Device bytes of one layer's keys and values for ``tokens`` tokens."""
        k, v = self.row_bytes
        return _align(k * tokens) + _align(v * tokens)

    def transit_row_bytes(self, fp8: bool) -> int:
        """Bytes one token of one layer takes at home and over the link."""
        if not fp8:
            return sum(self.row_bytes)
        heads = self.batch * self.kv_heads
        return heads * (self.head_dim + self.v_head_dim) + 2 * heads * SCALE_BYTES


def kv_shape(config: Any, dtype: Any = None, batch: int = 1) -> KVShape:
    """The :class:`KVShape` of a transformers config (its text decoder's, for a multimodal one);
    ``dtype`` defaults to the config's (fp16 when it names none)."""
    import torch
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    if not layers or not heads:
        raise ConfigError(f"{type(config).__name__} names no num_hidden_layers/num_attention_heads: not a "
                          "decoder config tiermem can size a KV cache for")
    if getattr(text, "num_kv_shared_layers", 0):
        raise ConfigError("this model shares KV caches between layers (num_kv_shared_layers); tiermem's KV cache "
                          "holds one cache per layer: use transformers' own cache for it")
    types = getattr(text, "layer_types", None) or ()
    if any(t != "full_attention" for t in types):
        raise ConfigError(f"this model has layers of type {sorted(set(types) - {'full_attention'})}; tiermem's KV "
                          "cache holds full-attention layers only")
    kv = getattr(text, "num_key_value_heads", None) or heads
    hd = getattr(text, "head_dim", None) or text.hidden_size // heads
    if dtype is None:
        dtype = getattr(text, "dtype", None) or torch.float16
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, torch.float16)
    if not getattr(dtype, "is_floating_point", False):
        raise ConfigError(f"the KV cache holds floating-point keys and values, got dtype {dtype!r}")
    if int(batch) < 1:
        raise ConfigError(f"batch_size must be at least 1, got {batch!r}")
    return KVShape(int(layers), int(kv), int(hd), int(getattr(text, "v_head_dim", None) or hd),
                   torch.empty((), dtype=dtype).element_size(), int(batch))


@dataclasses.dataclass(frozen=True)
class KVPlan:
    """Which layers of a KV cache stay on the device within ``budget`` bytes (NOTE [kv plan])."""

    budget: int
    max_tokens: int
    shape: KVShape
    resident: frozenset[int]      # layer indices kept on the device
    slots: int                    # ring slots for the streamed layers (0: none streams)
    fp8: bool = False             # streamed layers travel and live at home as fp8 (NOTE [fp8 in transit])

    @property
    def layer_bytes(self) -> int:
        return self.shape.layer_bytes(self.max_tokens)

    @property
    def slot_bytes(self) -> int:
        """Device bytes of one ring slot: a layer, plus its transit buffer with fp8."""
        return self.layer_bytes + (self.home_layer_bytes if self.fp8 else 0)

    @property
    def streamed(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.shape.layers) if i not in self.resident)

    @property
    def held_bytes(self) -> int:
        """Device bytes the cache allocates: the resident layers and the ring."""
        return len(self.resident) * self.layer_bytes + self.slots * self.slot_bytes

    @property
    def device_bytes(self) -> int:
        """Device bytes the plan takes: what the cache allocates (:attr:`held_bytes`), and what the
        driver takes on the device to map the pinned home (NOTE [pinned mapping])."""
        return self.held_bytes + pinned_map_bytes(self.home_bytes)

    @property
    def home_layer_bytes(self) -> int:
        """Pinned bytes of one streamed layer's home (keys, values, and fp8's scales)."""
        s = self.shape
        k, v = s.row_bytes
        if not self.fp8:
            return _align(k * self.max_tokens) + _align(v * self.max_tokens)
        heads = s.batch * s.kv_heads
        return (_align(heads * s.head_dim * self.max_tokens) + _align(heads * s.v_head_dim * self.max_tokens)
                + 2 * _align(heads * SCALE_BYTES * self.max_tokens))

    @property
    def home_bytes(self) -> int:
        """Pinned host bytes of every streamed layer's home."""
        return len(self.streamed) * self.home_layer_bytes

    def moved_bytes(self, tokens: int | None = None) -> int:
        """Bytes a decode step copies over the link at a context of ``tokens`` (default: the
        most the cache holds): the streamed layers' keys and values."""
        n = self.max_tokens if tokens is None else int(tokens)
        return len(self.streamed) * n * self.shape.transit_row_bytes(self.fp8)

    def predicted_seconds(self, tokens: int | None = None, link_GBps: float = LINK_GBPS) -> float:
        """Lower bound of a decode step's cache traffic at ``tokens`` of context."""
        return self.moved_bytes(tokens) / (link_GBps * 1e9)

    def table(self, link_GBps: float = LINK_GBPS) -> str:
        gb = lambda n: f"{n / 1e9:.3f} GB"  # noqa: E731
        s = self.shape
        how = ("all of it resident" if not self.streamed else
               f"{len(self.resident)} of {s.layers} layers resident, {len(self.streamed)} streamed through "
               f"{self.slots} slots of {gb(self.slot_bytes)}")
        return (f"KV cache budget {gb(self.budget)} for {self.max_tokens:,} tokens x {s.batch}: {how} "
                f"({gb(self.device_bytes)} on the device, {gb(self.home_bytes)} pinned at home"
                f"{', fp8 at home and in transit' if self.fp8 else ''}); "
                f"{gb(self.moved_bytes())} copied per decode step at full context, "
                f"{self.predicted_seconds(link_GBps=link_GBps) * 1e3:.1f} ms at {link_GBps:.1f} GB/s")

    def __str__(self) -> str:
        return self.table()


def _spread(n: int, layers: int) -> frozenset[int]:
    """``n`` of ``layers`` indices spread evenly (NOTE [kv plan])."""
    if n >= layers:
        return frozenset(range(layers))
    return frozenset((2 * i + 1) * layers // (2 * n) for i in range(n)) if n else frozenset()


def pinned_map_bytes(pinned: int) -> int:
    """Device memory the driver takes to map ``pinned`` bytes of pinned host memory for the GPU
    (NOTE [pinned mapping])."""
    return (max(0, int(pinned)) // MAP_PER) * MAP_GRAIN


def _fits(shape: KVShape, max_tokens: int, resident: int, slots: int, fp8: bool) -> int:
    """Device bytes of ``resident`` layers plus the ring the rest need."""
    p = KVPlan(0, max_tokens, shape, _spread(resident, shape.layers), 0 if resident >= shape.layers else slots, fp8)
    return dataclasses.replace(p, slots=min(p.slots, len(p.streamed))).device_bytes


def plan_kv(shape: KVShape, max_tokens: int, budget: int, slots: int = SLOTS, fp8: bool = False) -> KVPlan:
    """The most resident layers that fit ``budget`` device bytes beside the ring of ``slots``
    slots the other layers stream through (NOTE [kv plan]). Raises :class:`OutOfBudgetError`
    when even the ring does not fit, saying what would."""
    if int(max_tokens) < 1:
        raise ConfigError(f"max_tokens must be at least 1, got {max_tokens!r}")
    if int(slots) < 2:
        raise ConfigError(f"slots must be at least 2 (one read by attention while the next fills), got {slots!r}")
    max_tokens, budget, slots = int(max_tokens), int(budget), int(slots)
    for r in range(shape.layers, -1, -1):
        need = _fits(shape, max_tokens, r, slots, fp8)
        if need <= budget:
            resident = _spread(r, shape.layers)
            ring = 0 if r >= shape.layers else min(slots, shape.layers - r)
            return KVPlan(budget, max_tokens, shape, resident, ring, fp8)
    need = _fits(shape, max_tokens, 0, slots, fp8)
    ring = min(slots, shape.layers)
    bare = KVPlan(0, max_tokens, shape, (), ring, fp8)
    fit = most_tokens(lambda t: _fits(shape, t, 0, slots, fp8), budget, max_tokens)
    raise OutOfBudgetError(need, 0, budget, hint=(
        f"a KV cache of {max_tokens:,} tokens x {shape.batch} streams its layers through {ring} device slots of "
        f"{bare.slot_bytes:,} bytes each, and mapping its {bare.home_bytes:,}-byte pinned home takes "
        f"{pinned_map_bytes(bare.home_bytes):,} bytes of the device (NOTE [pinned mapping]); raise kv_budget to "
        f"{need:,} bytes"
        + (f" or lower max_tokens to {fit:,}" if fit else "")))


def most_tokens(size: Any, limit: int, hi: int) -> int:
    """The most tokens ``t`` in 0..``hi`` with ``size(t) <= limit`` (``size`` grows with ``t``)."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if size(mid) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def split_budget(sizes: Iterable[tuple[str, int]], budget: int, shape: KVShape, max_tokens: int, *,
                 lookahead: int = 2, in_place: Iterable[str] = (), slots: int = SLOTS,
                 fp8: bool = False, split: Mapping[str, int] | None = None, **planning: Any) -> tuple[Plan, KVPlan]:
    """Split ``budget`` device bytes between a module's weights (``sizes``, as
    :func:`plan_residency` takes them, with ``split`` and ``planning``'s keywords: the packed
    sizes, NOTE [quantized streaming]) and its KV cache of ``max_tokens`` tokens so that a
    decode step at that context moves the fewest bytes over the link (NOTE [kv plan]). Returns
    the weights' plan (its ``budget`` is their share) and the cache's. Raises
    :class:`OutOfBudgetError` when the budget cannot hold even the cache's ring."""
    sizes = tuple(sizes)
    gathered = tuple(in_place)
    best: tuple[int, int, Plan, KVPlan] | None = None
    for r in range(shape.layers + 1):
        need = _fits(shape, max_tokens, r, slots, fp8)
        if need > budget:
            break
        kv = plan_kv(shape, max_tokens, need, slots, fp8)
        weights = plan_residency(sizes, budget - need, lookahead, in_place=gathered, split=split, **planning)
        moved = weights.moved_bytes + kv.moved_bytes()
        # Ties go to the weights: a context shorter than max_tokens moves fewer cache bytes.
        if best is None or moved < best[0]:
            best = (moved, r, weights, kv)
    if best is None:
        plan_kv(shape, max_tokens, budget, slots, fp8)      # raises, saying what the ring needs
        raise AssertionError("unreachable")
    return best[2], best[3]
