"""Module-level functions over a default :class:`Tier`, so ``import tiermem as tier`` reads well:

    tier.wrap(param, role="weight")
    tier.stats()

Each function checks its arguments before it makes the default Tier, which needs a GPU: on a
machine without one, a wrong role, a tensor tiermem cannot hold or a bad size raises its own
error (a ValueError or TypeError, see tiermem/errors.py), not CUDAUnavailableError.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from ._tier import Tier, check_empty
from .base import default as _default
from .base.keywords import check_keywords
from .core.tensor import TieredTensor, tiered_list
from .core.transfer import Transfer
from .errors import ConfigError, ConfigTypeError
from .inference.options import ModuleOptions
from .roles import Location, Policy, Role, as_location, as_role, check_policy

__all__ = ["default_tier", "configure", "empty", "wrap", "wrap_module", "wrap_training", "wrap_fsdp", "unwrap", "prefetch",
           "evict", "allocator", "stats", "memory_summary", "policy_override", "synchronize", "use", "load_pretrained",
           "kv_cache"]

def default_tier() -> Tier:
    """The process-wide Tier, made on first use on the current CUDA device with settings from the
    environment (TIERMEM_BUDGET, TIERMEM_MANAGED_CAP, TIERMEM_ALLOW_OVERSUBSCRIBE)."""
    return _default.get(Tier)


def configure(device: int | None = None, **settings: Any) -> Tier:
    """Replace the default Tier with one built from ``settings`` (the arguments of :class:`Tier`).
    Tensors of the old Tier keep working; new ones come from the new Tier."""
    check_keywords("configure", Tier.__init__, settings)
    t = Tier(device, **settings)
    _default.replace(t)
    return t


def empty(shape: int | Iterable[int], dtype: Any = "float32", *, role: Role | str, policy: Policy | None = None,
          name: str | None = None, **policy_changes: Any) -> TieredTensor:
    """A new uninitialised tiered tensor (see :meth:`Tier.empty`)."""
    check_empty(shape, dtype, role, policy, policy_changes)
    return default_tier().empty(shape, dtype, role=role, policy=policy, name=name, **policy_changes)


def wrap(tensor: Any, role: Role | str = Role.WEIGHT, **kwargs: Any) -> TieredTensor:
    """Move a torch tensor's or parameter's data into tiered memory, in place; returns its TieredTensor.

    The tensor object stays the same: modules, optimizers and autograd keep working, parameters
    keep ``requires_grad`` and get gradients. The data is filled from the device side (no
    host-side first touch). A weight that does not require grad is tiered as ``frozen_weight``.
    Raises :class:`WrapError`, changing nothing, for a tensor already wrapped, an unknown role
    (:class:`RoleError`), or a sparse, meta or non-contiguous tensor. Keyword arguments: ``name``,
    ``policy`` (replaces the role's policy), and policy fields to change (``read_mostly=True``).
    """
    from .pytorch.wrap import check_wrap
    check_wrap(tensor, role, **kwargs)
    return _tier_of(tensor).wrap(tensor, role, **kwargs)


def wrap_training(model: Any, optimizer: Any, budget: int | str, options: Any = None, *, tier: Tier | None = None,
                  **kwargs: Any) -> Any:
    """Train ``model`` with ``optimizer`` within ``budget`` bytes of device memory (bytes, "2GiB"
    or "25%" of the device): parameters, optimizer states and saved activations are tiered, each
    block steps inside backward, and the plan comes from the first step. Use ``with
    handle.step(): ...forward and backward...``. The model may be on the device or, bigger than
    it, on the host (NOTE [host models] in training/memory.py). ``options``: a
    :class:`tiermem.handles.TrainingOptions`, or its fields as keywords (``lookahead=``,
    ``recompute=``, ``accumulate=``, ``max_grad_norm=``, ...: each is documented there), checked
    before a GPU is looked for. ``tier``: the Tier to train on (default: the process's).
    Returns a :class:`TieredTraining`. The handle steps the optimizer itself: a caller's
    ``optimizer.step()`` is refused."""
    from .training.options import check_options, check_subjects
    tier = _given(tier)
    opts = check_options(budget, options, **kwargs)
    check_subjects(model, optimizer)
    return (tier or default_tier()).wrap_training(model, optimizer, budget, options=opts)


def wrap_fsdp(model: Any, optimizer: Any, budget: int | str | None = None, options: Any = None, *,
              tier: Tier | None = None, **kwargs: Any) -> Any:
    """Hold the shards of a ``fully_shard`` model (torch FSDP2, the root module, after
    ``fully_shard`` on each block and on the model, with no CPUOffloadPolicy) and its optimizer's
    states in pinned host memory, one copy per host across the ranks, on the device only while
    FSDP all-gathers them or the optimizer steps them; each parameter steps inside backward,
    right after its reduce-scatter (NOTE [FSDP2 composition] in training/fsdp.py). ``budget``
    caps torch's allocator on the rank's device (None: no cap; refused with more than one rank,
    where it hung FSDP2's collectives under NCCL). ``options``: a
    :class:`tiermem.handles.FSDPOptions`, or its fields as keywords (``lookahead=``), checked
    before a GPU is looked for. ``tier``: default, the default tier, on the current device.
    Returns a :class:`tiermem.handles.TieredFSDP` (``materialized()`` for checkpoints,
    ``unwrap()``). The handle steps the optimizer itself: a caller's ``optimizer.step()`` is
    refused."""
    from .training.options import check_fsdp_options
    tier = _given(tier)
    opts = check_fsdp_options(budget, options, **kwargs)
    return (tier or default_tier()).wrap_fsdp(model, optimizer, budget, options=opts)


def wrap_module(module: Any, budget: int | str | None = None, *, options: ModuleOptions | None = None,
                tier: Tier | None = None, tiers: Any = None, **kwargs: Any) -> Any:
    """Adopt every parameter and buffer of ``module`` and run it within ``budget`` (bytes, "8GB",
    or a share of the device like "25%"; ``tiermem.planning.weight_bytes(module) // 4`` is a
    quarter of its weights: NOTE [sizes] in base/limits.py; 0, nothing resident, only with
    ``mode="zero_copy"``): the largest groups stay resident, the rest stream in ahead
    of use and out behind it, or are read in place for single-token forwards. Returns a
    :class:`TieredModule` (its ``plan``; ``unwrap()`` restores the module). The options are the
    fields of :class:`tiermem.handles.ModuleOptions` (documented there: ``mode``, ``lookahead``,
    ``kv_budget`` and ``kv_tokens`` for a KV cache in the same budget, NOTE [kv plan] in
    tiermem/inference/kvplan.py, ``share_home`` for a replica on another GPU reading this one's
    pinned home, ...), given as keyword arguments or as ``options=``, keywords changing its
    fields; ``tier`` defaults to the default Tier. ``devices=[0, 1]`` spreads the module's layers
    over those GPUs, each within ``budget`` on its own (NOTE [layers across GPUs] in
    tiermem/inference/multidevice.py), and returns a :class:`tiermem.handles.SplitModule`;
    ``tiers`` may give the devices' Tiers instead (default: ``tier`` or the default Tier where it
    is on one of the devices, a new Tier on each other)."""
    from .inference.module import check_module, check_module_options
    tier = _given(tier)
    options = check_module_options(budget, kwargs, given=options)
    check_module(module)
    if options.devices is None and tiers is None:
        return (tier or default_tier()).wrap_module(module, budget, options=options)
    from .inference.multidevice import SplitModule
    return SplitModule(_device_tiers(options.devices, tiers, tier), module, budget, options=options)


def _device_tiers(devices: tuple[int, ...] | None, tiers: Any, tier: Tier | None) -> list[Tier]:
    """The Tiers a module spread over ``devices`` (checked by ModuleOptions) runs on: ``tiers``
    as given, which must sit on ``devices`` where both are given, or ``tier`` (else the default
    Tier, if made) where it is on one of them and a new Tier on each other."""
    if tiers is None:
        base = tier or _default.peek()
        return [base if base is not None and base.device == d else Tier(d) for d in devices or ()]
    if isinstance(tiers, (str, bytes)) or not all(isinstance(t, Tier) for t in tiers):
        raise ConfigTypeError(f"tiers must be a list of tiermem.Tier, one per device, got {tiers!r}")
    tiers = list(tiers)
    if devices is not None and list(devices) != [t.device for t in tiers]:
        raise ConfigError(f"devices {list(devices)!r} and tiers on {[t.device for t in tiers]} disagree")
    return tiers


def kv_cache(model: Any, max_tokens: int, kv_budget: int | str | None = None, **kwargs: Any) -> Any:
    """A transformers ``Cache`` for ``model`` (or its config) that keeps its keys and values
    within ``kv_budget`` device bytes ("2GB", or a share of the device): the layers that do not fit
    live in pinned host memory and come in one layer ahead (NOTE [kv cache in tiers] in
    tiermem/inference/kvcache.py). ``max_tokens`` is the most tokens a sequence may reach; a
    context whose home does not fit the host is refused here. Pass it to ``generate``
    (``past_key_values=``, or ``cache=`` from transformers 5.24) and ``close()`` it after. Keyword
    arguments: ``batch_size``, ``dtype``, ``slots``, ``fp8`` (NOTE [fp8 in transit]),
    ``host_budget``, ``tier``. Needs transformers 5. With the weights under one budget:
    ``wrap_module(model, budget, kv_budget=...)`` and ``handle.kv_cache()``."""
    from .base.limits import check_bytes
    from .inference.kvcache import TieredKVCache, check_tokens
    tier = _given(kwargs.pop("tier", None))
    check_keywords("kv_cache", TieredKVCache.__init__, kwargs, skip=("config", "max_tokens", "kv_budget", "tier"))
    check_tokens(max_tokens)
    if kv_budget is not None and kv_budget != "auto":
        check_bytes(kv_budget, what="kv_budget")
    return (tier or default_tier()).kv_cache(model, max_tokens, kv_budget, **kwargs)


def unwrap(tensor: Any) -> Any:
    """Restore a wrapped tensor to plain memory on its original device (see tiermem.pytorch.wrap.unwrap)."""
    from .pytorch.wrap import check_unwrap
    return check_unwrap(tensor).tier.unwrap(tensor)


def _tier_of(x: Any) -> Tier:
    from .pytorch.wrap import tiered_of
    if isinstance(x, TieredTensor):
        return x.tier
    tt = tiered_of(x)
    return tt.tier if tt is not None else default_tier()


def prefetch(tensors: TieredTensor | Iterable[TieredTensor], to: Location | str = Location.DEVICE, **kwargs: Any) -> Transfer:
    """Move tensors to the device (or host) in one transfer (see :meth:`Tier.prefetch`)."""
    ts = tiered_list(tensors, "prefetch")
    as_location(to)
    check_keywords("prefetch", Tier.prefetch, kwargs, skip=("tensors", "to"))
    return (ts[0].tier if ts else default_tier()).prefetch(ts, to, **kwargs)


def evict(tensors: TieredTensor | Iterable[TieredTensor], **kwargs: Any) -> Transfer:
    """Take tensors off the device by the fastest safe path (see :meth:`Tier.evict`)."""
    ts = tiered_list(tensors, "evict")
    check_keywords("evict", Tier.evict, kwargs, skip=("tensors",))
    return (ts[0].tier if ts else default_tier()).evict(ts, **kwargs)


def allocator(role: Role | str | None = None, tier: Tier | None = None) -> Any:
    """A CuPy allocator on tiered managed memory, for ``cupy.cuda.set_allocator`` or
    ``cupy.cuda.using_allocator``. With no ``role``, arrays take the role of the innermost
    :func:`using_role` in the allocating thread, else ``workspace``."""
    if role is not None:
        as_role(role)
    return (_given(tier) or default_tier()).allocator(role)


def stats(tier: Tier | None = None) -> dict[str, Any]:
    """The flat stats dict (keys documented in tiermem/core/stats.py)."""
    return (_given(tier) or default_tier()).stats()


def memory_summary(tier: Tier | None = None) -> str:
    return (_given(tier) or default_tier()).memory_summary()


def synchronize(tier: Tier | None = None) -> None:
    (_given(tier) or default_tier()).synchronize()


@contextlib.contextmanager
def policy_override(role: Role | str, policy: Policy | None = None, *, tier: Tier | None = None,
                    **changes: Any) -> Iterator[Policy]:
    """Within the block, tensors of ``role`` allocated by ``tier`` (default tier) get ``policy``,
    or the role's policy with ``changes``. Process-wide for that Tier (not thread-local): all
    threads allocating in the block see it. Nested overrides restore in order."""
    r = check_policy(role, policy, changes)
    t = _given(tier) or default_tier()
    previous = t.policies.set(r, policy, **changes)
    try:
        yield t.policies[r]
    finally:
        t.policies.set(r, previous)


def use(*arrays: Any, stream: Any = None, read_only: bool = False, once: bool = False,
        tier: Tier | None = None) -> Any:
    """Bring ``arrays`` (CuPy arrays from a tiermem allocator, or TieredTensors) to the device
    ahead of use, making room in the budget; :meth:`Tier.use` says what ``stream``,
    ``read_only`` and ``once`` do, and what the returned :class:`ArrayUse` is. The Tier is
    ``tier``, else the first array's, else the default one."""
    from .cupy.scoped import tier_of_array
    if _given(tier) is None:
        tier = next((t for t in map(tier_of_array, arrays) if t is not None), None)
    return (tier or default_tier()).use(*arrays, stream=stream, read_only=read_only, once=once)


def load_pretrained(path: Any, budget: int | str | None = None, host_budget: int | str | None = None,
                    dtype: Any = None, *, tier: Tier | None = None, options: ModuleOptions | None = None,
                    **kwargs: Any) -> Any:
    """A transformers causal LM from a local checkpoint folder, adopted within ``budget``: see
    :func:`tiermem.inference.load.load_pretrained`. The options and the files are checked before
    the default Tier (which needs a GPU) is made."""
    from .inference.load import load_pretrained as load
    from .inference.module import check_module_options
    opts = {k: v for k, v in kwargs.items() if k != "model_class"}
    checked = check_module_options(budget, {**opts, **({} if host_budget is None else {"host_budget": host_budget})},
                                   call="load_pretrained", taken=("weights",), given=options)
    if checked.devices is not None:
        raise ConfigError("load_pretrained adopts the model on one GPU: leave devices out; to spread a model over "
                          "several, build it and call tiermem.wrap_module(model, budget, devices=..., weights=...)")
    return load(path, budget, host_budget, dtype, tier=_given(tier), make_tier=default_tier, options=options, **kwargs)


def _given(tier: Any) -> Tier | None:
    """A ``tier=`` argument, checked: None (the default Tier) or a Tier."""
    if tier is not None and not isinstance(tier, Tier):
        raise ConfigTypeError(f"tier must be a tiermem.Tier or None, got {type(tier).__name__}")
    return tier

