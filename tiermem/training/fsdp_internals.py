"""Every private member of torch's FSDP2 (``fully_shard``) that tiermem's composition touches, in
one place (NOTE [FSDP2 composition] in training/fsdp.py). FSDP2 has no public surface for where a
shard lives or when it is read: ``OffloadPolicy`` has no extension points (``CPUOffloadPolicy`` is
checked with ``isinstance`` and moves whole shards to host memory, where a GPU step cannot reach
them), and ``set_custom_all_gather`` replaces the collective after the shards are read. So tiermem
reaches these, and :func:`check` refuses, naming the missing one, on a torch that lacks any:

    FSDPModule._get_fsdp_state()                 the module's FSDPState
    FSDPState._lazy_init()                       FSDP's lazy init, forced before the shards go
    FSDPState._fsdp_param_groups                 its parameter groups (torch >= 2.13; a list)
      or FSDPState._fsdp_param_group             (torch 2.11-2.12; one group or None)
    FSDPParamGroup.unshard                       wrapped per instance: every all-gather passes it
    FSDPParamGroup.fsdp_params, .modules         the group's parameters and modules
    FSDPParamGroup.comm_ctx.all_gather_copy_in_stream   the stream that reads the shards
    FSDPParamGroup.comm_ctx.all_gather_stream    the all-gather's stream (a reader to record)
    FSDPParamGroup.is_unsharded, ._all_gather_result    whether unshard() will read the shards
    FSDPParamGroup._training_state, TrainingState       forward or backward
    FSDPParamGroup.reduce_grads                  gradient sync on (set_requires_gradient_sync)
    FSDPParam._sharded_param_data                the padded 1-D shard the all-gather reads
    FSDPParam.sharded_param, .offload_to_cpu, ._param_fqn
    torch._C._current_graph_task_id()            inside backward (FSDP's own is_bw())
    Variable._execution_engine.queue_callback    a call at backward's end (as FSDP's own)

The public pieces used beside them: ``fully_shard``/``FSDPModule``, and
``register_post_accumulate_grad_hook`` on the sharded parameters, which FSDP2 runs itself right
after each reduce-scatter (torch's ``foreach_reduce``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from ..pytorch.held import InstancePatch

__all__ = ["check", "groups_of", "Group", "in_backward", "at_backward_end", "MIN_TORCH"]

MIN_TORCH = (2, 11)       # the oldest torch whose FSDP2 these names were read from


def _fsdp() -> Any:
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard import _fsdp_common, _fsdp_param, _fsdp_param_group
    except ImportError as e:
        raise ConfigError(f"tiermem's FSDP2 composition needs torch.distributed.fsdp's fully_shard "
                          f"(torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}): {e}") from e
    return FSDPModule, _fsdp_common, _fsdp_param, _fsdp_param_group


def _version(torch: Any) -> tuple[int, int]:
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def check(torch: Any, model: Any) -> None:
    """Refuse, with the reason, a torch whose FSDP2 lacks a member listed in this module's
    docstring, or a model that is not a ``fully_shard`` root."""
    if _version(torch) < MIN_TORCH:
        raise ConfigError(f"tiermem's FSDP2 composition needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}, "
                          f"this is {torch.__version__}")
    FSDPModule, common, _, group = _fsdp()
    if not isinstance(model, FSDPModule):
        raise ConfigError(f"wrap_fsdp takes the module fully_shard was applied to last (the root), got "
                          f"{type(model).__name__}: call fully_shard on each block, then on the model")
    missing = [f"{owner.__name__}.{name}" for owner, name in (
        (FSDPModule, "_get_fsdp_state"), (group.FSDPParamGroup, "unshard"), (group.FSDPParamGroup, "is_unsharded"),
        (common, "TrainingState"))
        if not hasattr(owner, name)]
    state = model._get_fsdp_state() if hasattr(model, "_get_fsdp_state") else None
    if state is not None and not hasattr(state, "_lazy_init"):
        missing.append("FSDPState._lazy_init")
    if state is not None and not (hasattr(state, "_fsdp_param_groups") or hasattr(state, "_fsdp_param_group")):
        missing.append("FSDPState._fsdp_param_groups")
    if not hasattr(getattr(torch.autograd, "Variable", None), "_execution_engine"):
        missing.append("torch.autograd.Variable._execution_engine")
    if not hasattr(torch._C, "_current_graph_task_id"):
        missing.append("torch._C._current_graph_task_id")
    if missing:
        raise ConfigError(f"torch {torch.__version__}'s FSDP2 lacks what tiermem's composition builds on "
                          f"({', '.join(missing)}); it was written against torch 2.11-2.13: train with FSDP2 "
                          "alone, or with tiermem.wrap_training per rank")


def groups_of(model: Any) -> list[Group]:
    """The FSDP parameter groups under ``model`` (a fully_shard root), in module order, after
    FSDP's lazy init (which pads and places the shards: NOTE [FSDP2 composition])."""
    model._get_fsdp_state()._lazy_init()
    out: list[Group] = []
    for mod in model.modules():
        get = getattr(mod, "_get_fsdp_state", None)
        if get is None:
            continue
        st = get()
        found = list(getattr(st, "_fsdp_param_groups", None) or [])
        if not found and not hasattr(st, "_fsdp_param_groups"):
            one = getattr(st, "_fsdp_param_group", None)
            found = [one] if one is not None else []
        for g in found:
            if all(g is not o.g for o in out):
                out.append(Group(g))
    return out


class Group:
    """One FSDPParamGroup, seen through the members this module names."""

    def __init__(self, g: Any):
        self.g = g
        _, common, _, _ = _fsdp()
        self._backward = common.TrainingState.PRE_BACKWARD
        for fp in g.fsdp_params:
            for name in ("_sharded_param_data", "sharded_param", "offload_to_cpu"):
                if not hasattr(fp, name):
                    raise ConfigError(f"torch's FSDPParam has no {name}: tiermem's composition cannot "
                                      "reach the shards on this torch")
        if not hasattr(g, "comm_ctx"):
            raise ConfigError("torch's FSDPParamGroup has no comm_ctx: tiermem's composition cannot order "
                              "its copies before FSDP's all-gather on this torch")

    @property
    def name(self) -> str:
        return getattr(self.g, "_module_fqn", "") or type(self.g.modules[0]).__name__

    @property
    def modules(self) -> tuple[Any, ...]:
        return tuple(self.g.modules)

    def params(self) -> list[tuple[str, Any, Any]]:
        """(name, the sharded parameter the optimizer holds, its FSDPParam) per parameter."""
        return [(getattr(fp, "_param_fqn", "") or str(i), fp.sharded_param, fp)
                for i, fp in enumerate(self.g.fsdp_params)]

    @staticmethod
    def shard(fp: Any) -> Any:
        """The padded 1-D shard FSDP all-gathers from; read it each time (FSDP replaces it when
        a load re-pads an uneven shard)."""
        return fp._sharded_param_data

    @staticmethod
    def offloads(fp: Any) -> bool:
        return bool(fp.offload_to_cpu)

    def copy_in_stream(self) -> Any:
        """The stream FSDP reads the shards on at world size > 1 (None before its lazy init)."""
        return getattr(self.g.comm_ctx, "all_gather_copy_in_stream", None)

    def comm_streams(self) -> list[Any]:
        """FSDP's streams that read the shards or follow that read at world size > 1 (the
        copy-in and the all-gather's; none before its lazy init or at world size 1)."""
        ctx = self.g.comm_ctx
        return [s for s in (getattr(ctx, "all_gather_copy_in_stream", None), getattr(ctx, "all_gather_stream", None))
                if s is not None]

    def in_backward_state(self) -> bool:
        return self.g._training_state == self._backward

    def will_gather(self) -> bool:
        """unshard() will read the shards (not already unsharded, nor pending)."""
        return not self.g.is_unsharded and getattr(self.g, "_all_gather_result", None) is None

    def syncs_grads(self) -> bool:
        return bool(getattr(self.g, "reduce_grads", True))

    def patch_unshard(self, before: Callable[[], None]) -> InstancePatch:
        """``unshard`` wrapped on the instance so that ``before`` runs first: every all-gather
        (forward, backward and its prefetch, explicit prefetch lists, a recompute, the user's
        ``unshard()``) passes through it."""
        inner = self.g.unshard

        def unshard(*args: Any, **kwargs: Any) -> Any:
            before()
            return inner(*args, **kwargs)
        return InstancePatch(self.g, {"unshard": unshard})


def in_backward(torch: Any) -> bool:
    """Autograd's engine is running a backward on this thread (FSDP's is_bw())."""
    return torch._C._current_graph_task_id() != -1


def at_backward_end(torch: Any, fn: Callable[[], None]) -> None:
    """Run ``fn`` when the running backward ends, after callbacks queued before it (FSDP's
    final callback, which fires the last groups' gradient hooks, is queued first)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)
