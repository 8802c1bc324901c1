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
from .base.limits import check_bytes
from .core.tensor import TieredTensor
from .core.transfer import Transfer
from .errors import ConfigError
from .roles import Location, Policy, Role, as_role, check_policy

__all__ = ["default_tier", "configure", "empty", "wrap", "wrap_module", "wrap_training", "wrap_fsdp", "unwrap", "prefetch", "evict", "allocator",
           "stats", "memory_summary", "policy_override", "synchronize", "use", "load_pretrained"]

def default_tier() -> Tier:
    """The process-wide Tier, made on first use on the current CUDA device with settings from the
    environment (TIERMEM_BUDGET, TIERMEM_MANAGED_CAP, TIERMEM_ALLOW_OVERSUBSCRIBE)."""
    return _default.get(Tier)


def configure(device: int | None = None, **settings: Any) -> Tier:
    """Replace the default Tier with one built from ``settings`` (the arguments of :class:`Tier`).
    Tensors of the old Tier keep working; new ones come from the new Tier."""
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


def wrap_training(model: Any, optimizer: Any, budget: int | str, **kwargs: Any) -> Any:
    """Train ``model`` with ``optimizer`` within ``budget`` bytes of device memory (bytes, "2GiB"
    or "25%" of the device): parameters, optimizer states and saved activations are tiered, each
    block steps inside backward, and the plan comes from the first step. Use ``with
    handle.step(): ...forward and backward...``. The model may be on the device or, bigger than
    it, on the host (NOTE [host models] in training/memory.py). Returns a :class:`TieredTraining`. Keyword
    arguments: ``lookahead``, ``min_swap``, ``window``, ``swap``, ``block_bytes``, ``margin``,
    ``recompute``, ``link_GBps``, ``process_group`` (True or a torch.distributed group:
    data-parallel replicas, each block's gradients averaged before its step, NOTE [data parallel]
    in training/handle.py), ``state_dtype`` (None, or torch.bfloat16 to hold and move streamed blocks'
    fp32 optimizer states as bf16, off by default: NOTE [bf16 moments] in training/states.py),
    ``accumulate`` (micro-batches per optimizer step, one per ``handle.step()``: NOTE
    [accumulation] in training/handle.py), ``max_grad_norm`` and ``norm_type`` (clip the gradients to a
    global norm before each optimizer step, as clip_grad_norm_ does: NOTE [clipping]), ``speculate``
    (step inside backward as if the clip will not bite, kept when it did not: NOTE [speculative
    clipping]), ``tier``.
    The handle steps the optimizer itself: a caller's ``optimizer.step()`` is refused."""
    from .training.options import check_options
    tier = kwargs.pop("tier", None)
    check_options(budget, **kwargs)
    return (tier or default_tier()).wrap_training(model, optimizer, budget, **kwargs)


def wrap_fsdp(model: Any, optimizer: Any, **kwargs: Any) -> Any:
    """Hold the shards of a ``fully_shard`` model (torch FSDP2, the root module, after
    ``fully_shard`` on each block and on the model, with no CPUOffloadPolicy) and its optimizer's
    states in pinned host memory, one copy per host across the ranks, on the device only while
    FSDP all-gathers them or the optimizer steps them; each parameter steps inside backward,
    right after its reduce-scatter (NOTE [FSDP2 composition] in training/fsdp.py). Keyword
    arguments: ``lookahead`` (groups brought in ahead), ``budget`` (caps torch's allocator on the
    rank's device), ``tier`` (default: the default tier, on the current device). Returns a
    :class:`TieredFSDP` (``materialized()`` for checkpoints, ``unwrap()``). The handle steps the
    optimizer itself: a caller's ``optimizer.step()`` is refused."""
    tier = kwargs.pop("tier", None)
    return (tier or default_tier()).wrap_fsdp(model, optimizer, **kwargs)


def wrap_module(module: Any, budget: int | str | None = None, **kwargs: Any) -> Any:
    """Adopt every parameter and buffer of ``module`` and run it within ``budget`` (bytes, "8GB",
    or a share of the device like "25%"; ``tiermem.planning.weight_bytes(module) // 4`` is a
    quarter of its weights: NOTE [sizes] in base/limits.py): the largest groups stay resident, the rest stream in ahead
    of use and out behind it, or are read in place for single-token forwards. Returns a
    :class:`TieredModule` (its ``plan``; ``unwrap()`` restores the module). Keyword arguments:
    ``mode`` ("auto", "stream", "zero_copy"), ``lookahead`` (groups in flight),
    ``zero_copy_max_tokens``, ``share_home`` (the handle of a replica of the same weights on
    another GPU, whose pinned home this one reads: NOTE [one home for replicas] in
    inference/transport.py), ``tier``. ``devices=[0, 1]`` spreads the module's layers over those GPUs,
    contiguous runs of about equal bytes, each within ``budget`` on its own GPU and streaming
    over its own link, the activations crossing once per boundary (NOTE [layers across GPUs] in
    inference/split.py); it returns a :class:`SplitModule`, and ``tiers`` may give the devices'
    Tiers (default: the default tier where it is on one of them, a new Tier on each other)."""
    tier = kwargs.pop("tier", None)
    devices, tiers = kwargs.pop("devices", None), kwargs.pop("tiers", None)
    if budget is not None:
        check_bytes(budget, what="module budget")
    if devices is None and tiers is None:
        return (tier or default_tier()).wrap_module(module, budget, **kwargs)
    from .inference.split import SplitModule, check_devices
    if "share_home" in kwargs:
        raise ConfigError("share_home is for replicas on one GPU each; a module spread over devices has one "
                          "home already (its layers are split, not copied)")
    if tiers is None:
        devices = check_devices(devices)
        base = tier or _default.peek()
        tiers = [base if base is not None and base.device == d else Tier(d) for d in devices]
    elif devices is not None and list(devices) != [t.device for t in tiers]:
        raise ConfigError(f"devices {devices!r} and tiers on {[t.device for t in tiers]} disagree")
    return SplitModule(list(tiers), module, budget, **kwargs)


def unwrap(tensor: Any) -> Any:
    """Restore a wrapped tensor to plain memory on its original device (see tiermem.pytorch.wrap.unwrap)."""
    return _tier_of(tensor).unwrap(tensor)


def _tier_of(x: Any) -> Tier:
    from .pytorch.wrap import tiered_of
    if isinstance(x, TieredTensor):
        return x.tier
    tt = tiered_of(x)
    return tt.tier if tt is not None else default_tier()


def prefetch(tensors: TieredTensor | Iterable[TieredTensor], to: Location | str = Location.DEVICE, **kwargs: Any) -> Transfer:
    """Move tensors to the device (or host) in one transfer (see :meth:`Tier.prefetch`)."""
    ts = [tensors] if isinstance(tensors, TieredTensor) else list(tensors)
    return (ts[0].tier if ts else default_tier()).prefetch(ts, to, **kwargs)


def evict(tensors: TieredTensor | Iterable[TieredTensor], **kwargs: Any) -> Transfer:
    """Take tensors off the device by the fastest safe path (see :meth:`Tier.evict`)."""
    ts = [tensors] if isinstance(tensors, TieredTensor) else list(tensors)
    return (ts[0].tier if ts else default_tier()).evict(ts, **kwargs)


def allocator(role: Role | str | None = None, tier: Tier | None = None) -> Any:
    """A CuPy allocator on tiered managed memory, for ``cupy.cuda.set_allocator`` or
    ``cupy.cuda.using_allocator``. With no ``role``, arrays take the role of the innermost
    :func:`using_role` in the allocating thread, else ``workspace``."""
    if role is not None:
        as_role(role)
    return (tier or default_tier()).allocator(role)


def stats(tier: Tier | None = None) -> dict[str, Any]:
    """The flat stats dict (keys documented in tiermem/core/stats.py)."""
    return (tier or default_tier()).stats()


def memory_summary(tier: Tier | None = None) -> str:
    return (tier or default_tier()).memory_summary()


def synchronize(tier: Tier | None = None) -> None:
    (tier or default_tier()).synchronize()


@contextlib.contextmanager
def policy_override(role: Role | str, policy: Policy | None = None, *, tier: Tier | None = None,
                    **changes: Any) -> Iterator[Policy]:
    """Within the block, tensors of ``role`` allocated by ``tier`` (default tier) get ``policy``,
    or the role's policy with ``changes``. Process-wide for that Tier (not thread-local): all
    threads allocating in the block see it. Nested overrides restore in order."""
    r = check_policy(role, policy, changes)
    t = tier or default_tier()
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
    if tier is None:
        tier = next((t for t in map(tier_of_array, arrays) if t is not None), None)
    return (tier or default_tier()).use(*arrays, stream=stream, read_only=read_only, once=once)


def load_pretrained(path: Any, budget: int | str | None = None, host_budget: int | str | None = None,
                    dtype: Any = None, *, tier: Tier | None = None, **kwargs: Any) -> Any:
    """A transformers causal LM from a local checkpoint folder, adopted within ``budget``: see
    :func:`tiermem.inference.load.load_pretrained`. The files are checked before the default Tier (which
    needs a GPU) is made."""
    from .inference.load import load_pretrained as load
    return load(path, budget, host_budget, dtype, tier=tier, make_tier=default_tier, **kwargs)

