"""wrap_training's options (:class:`TrainingOptions`) and wrap_fsdp's (:class:`FSDPOptions`),
documented and checked here once, before anything is adopted and before a GPU is looked for; the
process group a ``process_group`` names (:func:`averaging_group`), which needs
torch.distributed, is resolved at adoption."""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from ..base.keywords import check_names
from ..base.limits import check_bytes
from ..errors import ConfigError, ConfigTypeError
from .plan import RECOMPUTE_MODES

__all__ = ["TrainingOptions", "FSDPOptions", "BLOCK_BYTES", "check_options", "check_fsdp_options", "check_subjects",
           "states_dtype", "averaging_group", "on_every_rank"]

BLOCK_BYTES = 64 << 20    # the least parameter bytes per block (NOTE [block size]); a slot holds ~4x that


@dataclasses.dataclass(frozen=True)
class TrainingOptions:
    """How :func:`tiermem.wrap_training` trains (NOTE [training transport] in training/handle.py).
    Pass one as ``options=``, or its fields as keywords; an unknown keyword is a
    :class:`~tiermem.ConfigTypeError` that lists these. Every field is checked when the options
    are made, so a bad one is refused before anything is adopted. Sizes are bytes.

    lookahead: blocks brought into device slots ahead of use; the slots are ``lookahead + 1``
        (NOTE [fewer slots] in training/choice.py: the plan may lower it). At least 1.
    min_swap: saved storages smaller than this stay on the device (NOTE [activation swap]).
    window: bytes of activation copies in flight each way; None: 1/32 of the budget.
    swap: False never swaps activations (nor recomputes them): they stay on the device.
    block_bytes: parameter bytes per module block, the unit that is resident or streamed
        (a slot holds a block's parameters, gradients and optimizer states, ~4x that with Adam).
        None: the model's largest parameter's bytes, at least BLOCK_BYTES (NOTE [block size] in
        training/handle.py).
    margin: bytes the plan leaves free for what the trace could not see; None: 1/8 of the budget.
    process_group: None, True (torch.distributed's default group) or a group: data-parallel
        replicas, each block's gradients averaged before its step (NOTE [data parallel]).
    recompute: "auto" lets the plan choose per block between keeping, swapping and recomputing
        its activations (NOTE [recompute plan] in training/plan.py), "never" keeps or swaps
        only, "always" recomputes every block it can.
    link_GBps: the host link's rate each way that the plan assumes, GB/s; None: 55, pinned
        copies over PCIe Gen5 x16 (docs/facts.md).
    state_dtype: None keeps optimizer states as the optimizer made them; ``torch.bfloat16`` (or
        "bfloat16") holds streamed blocks' fp32 states as bf16 at home and over the link,
        rounded stochastically, stepped in fp32 (NOTE [bf16 moments] in training/states.py).
    accumulate: micro-batches per optimizer step, one per ``train.step()``; the optimizer
        steps in every ``accumulate``-th (NOTE [accumulation]). At least 1.
    max_grad_norm: clip the gradients to this global norm before each optimizer step, as
        ``torch.nn.utils.clip_grad_norm_`` does; ``train.grad_norm`` is the norm it found
        (NOTE [clipping] in training/clipping.py). None: no clipping.
    norm_type: the clipping norm's order (2: Euclidean).
    speculate: step the streamed blocks inside backward as if the clip will not bite, into a
        second pinned home, kept when it did not (NOTE [speculative clipping]); doubles their
        pinned bytes; needs ``max_grad_norm``, and Adam, AdamW or SGD.
    graphs: replay each recomputed block's backward as a CUDA graph where the budget leaves room
        for the graphs' pool (NOTE [replayed recompute] in training/replay.py); off by default.
    wide_blocks: the largest blocks (an embedding, a head) step at the step's end across the whole
        ring, so the slots are sized by the other blocks (NOTE [wide blocks] in training/floor.py).
        None: where the slots at the largest block's size would take more than a third of the
        budget; never with clipping or a process group.
    host_step: streamed blocks' Adam or AdamW steps run on the host in their pinned homes,
        beside backward, so their optimizer states never cross the link (NOTE [host stepping]
        in training/hoststep.py); not with ``state_dtype`` or ``speculate``. With a
        ``process_group`` the gradients are averaged before they go home.
    shard_steps: with a ``process_group``, each streamed block's optimizer step runs on one rank,
        which broadcasts the stepped parameters to the others, so a rank's link carries only its
        own blocks' optimizer states (NOTE [sharded steps] in training/shards.py). The caller's
        ``opt.state_dict()`` then needs ``train.gather_states()`` on every rank first, and
        ``unwrap()`` is collective. Not with ``state_dtype``.
    """

    lookahead: int = 2
    min_swap: int = 1 << 20
    window: int | None = None
    swap: bool = True
    block_bytes: int | None = None
    margin: int | None = None
    process_group: Any = None
    recompute: str = "auto"
    link_GBps: float | None = None
    state_dtype: Any = None
    accumulate: int = 1
    max_grad_norm: float | None = None
    norm_type: float = 2.0
    speculate: bool = False
    graphs: bool = False
    wide_blocks: bool | None = None
    host_step: bool = False
    shard_steps: bool = False

    def __post_init__(self) -> None:
        _int("lookahead", self.lookahead, least=1, unit="blocks ahead")
        _int("min_swap", self.min_swap, least=0, unit="bytes")
        if self.window is not None:
            _int("window", self.window, least=1, unit="bytes")
        if self.block_bytes is not None:
            _int("block_bytes", self.block_bytes, least=1, unit="bytes")
        if self.margin is not None:
            _int("margin", self.margin, least=0, unit="bytes")
        _int("accumulate", self.accumulate, least=1, unit="micro-batches per optimizer step")
        for name in ("swap", "speculate", "graphs", "host_step", "shard_steps"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigTypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.wide_blocks is not None and not isinstance(self.wide_blocks, bool):
            raise ConfigTypeError(f"wide_blocks must be None, True or False, got {self.wide_blocks!r}")
        if self.wide_blocks and (self.max_grad_norm is not None or self.process_group is not None):
            raise ConfigError("wide_blocks=True steps the largest blocks at the step's end, which clipping and a "
                              "process group do not allow: leave it None or False")
        if self.host_step:
            for name, why in (("state_dtype", "its states never cross the link, so nothing is narrowed"),
                              ("speculate", "its host steps wait for the total norm; nothing to speculate on")):
                if getattr(self, name) not in (None, False):
                    raise ConfigError(f"host_step=True does not take {name}: {why} (NOTE [host stepping])")
        if self.shard_steps and self.process_group is None:
            raise ConfigError("shard_steps=True shares the streamed blocks' optimizer steps over the ranks of a "
                              "process_group: give process_group=True or a group (NOTE [sharded steps])")
        if self.shard_steps and self.state_dtype is not None:
            raise ConfigError("shard_steps=True does not take state_dtype: its rounding would advance on the "
                              "owners only (NOTE [sharded steps])")
        if self.speculate and self.max_grad_norm is None:
            raise ConfigError("speculate=True speculates that clipping leaves the gradients alone: it needs "
                              "max_grad_norm")
        for name in ("max_grad_norm", "norm_type"):
            v = getattr(self, name)
            if v is None and name == "max_grad_norm":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigTypeError(f"{name} must be a number, got {v!r}")
            if not v > 0:
                raise ConfigError(f"{name} must be positive, got {v!r}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"recompute must be one of {', '.join(map(repr, RECOMPUTE_MODES))}, "
                              f"got {self.recompute!r}")
        v = self.link_GBps
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            raise ConfigError(f"link_GBps must be a positive number of GB/s, got {v!r}")
        states_dtype(self.state_dtype)

    @classmethod
    def of(cls, options: TrainingOptions | None = None, **kwargs: Any) -> TrainingOptions:
        """``options`` (None: the defaults) with ``kwargs`` replacing its fields; an unknown
        keyword raises :class:`~tiermem.ConfigTypeError` naming the valid ones."""
        if options is not None and not isinstance(options, cls):
            raise ConfigTypeError(f"options must be a tiermem TrainingOptions, got {type(options).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        for k in kwargs:
            if k not in names:
                close = difflib.get_close_matches(k, names, n=1)
                raise ConfigTypeError(f"wrap_training() got an unknown keyword argument {k!r}; "
                                      + (f"did you mean {close[0]!r}? " if close else "")
                                      + f"the options are: {', '.join(names)}")
        if options is None:
            return cls(**kwargs)
        return dataclasses.replace(options, **kwargs) if kwargs else options


@dataclasses.dataclass(frozen=True)
class FSDPOptions:
    """How :func:`tiermem.wrap_fsdp` holds a ``fully_shard`` model's shards and optimizer states
    in pinned host memory (NOTE [FSDP2 composition] in training/fsdp.py). Pass one as
    ``options=``, or its fields as keywords; an unknown keyword is a
    :class:`~tiermem.ConfigTypeError` that lists these. Checked when made, before a GPU is looked
    for. Data parallelism without sharding is wrap_training's ``process_group``
    (:class:`TrainingOptions`).

    lookahead: FSDP groups whose shards are brought in ahead of FSDP's all-gather, in the order
        the first step recorded (and in backward their optimizer states ahead of their step).
        0: each group's shards come in at its own all-gather.
    """

    lookahead: int = 2

    def __post_init__(self) -> None:
        _int("lookahead", self.lookahead, least=0, unit="FSDP groups ahead")

    @classmethod
    def of(cls, options: FSDPOptions | None = None, **kwargs: Any) -> FSDPOptions:
        """``options`` (None: the defaults) with ``kwargs`` replacing its fields; an unknown
        keyword raises :class:`~tiermem.ConfigTypeError` naming the valid ones."""
        if options is not None and not isinstance(options, cls):
            raise ConfigTypeError(f"options must be a tiermem.handles.FSDPOptions, got {type(options).__name__}")
        check_names("wrap_fsdp", [f.name for f in dataclasses.fields(cls)], kwargs)
        if options is None:
            return cls(**kwargs)
        return dataclasses.replace(options, **kwargs) if kwargs else options


def _int(name: str, v: Any, *, least: int, unit: str) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigTypeError(f"{name} must be an int ({unit}), got {v!r}")
    if v < least:
        raise ConfigError(f"{name} must be at least {least} ({unit}), got {v}")


def check_options(budget: int | str, options: TrainingOptions | None = None, **kwargs: Any) -> TrainingOptions:
    """The training budget (bytes, "2GiB" or a share of the device, "25%") and the options,
    checked without a GPU: :class:`~tiermem.ConfigError` for a bad value, ConfigTypeError for a
    bad type or an unknown option. Returns the options."""
    check_bytes(budget, what="training budget", max_percent=100, positive=True)
    return TrainingOptions.of(options, **kwargs)


def check_fsdp_options(budget: int | str | None, options: FSDPOptions | None = None, **kwargs: Any) -> FSDPOptions:
    """wrap_fsdp's budget (None: no cap; bytes, "40GiB" or a share of the device) and options,
    checked without a GPU, as :func:`check_options` does wrap_training's. Returns the options."""
    if budget is not None:
        check_bytes(budget, what="FSDP budget", max_percent=100, positive=True)
    return FSDPOptions.of(options, **kwargs)


def check_subjects(model: Any, optimizer: Any) -> None:
    """Raise :class:`ConfigTypeError` unless ``model`` is an ``nn.Module`` and ``optimizer`` a
    ``torch.optim.Optimizer``. Needs no GPU, so tiermem.wrap_training checks them before it
    looks for one."""
    try:
        import torch
    except ImportError as e:
        raise ConfigError("wrap_training needs torch; pip install 'tiermem[torch]'") from e
    if not isinstance(model, torch.nn.Module):
        raise ConfigTypeError(f"wrap_training takes a torch.nn.Module to train, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigTypeError(f"wrap_training takes a torch.optim.Optimizer over the model's parameters, got "
                              f"{type(optimizer).__name__}")


def states_dtype(state_dtype: Any) -> Any:
    """The torch dtype ``state_dtype`` names (None: states keep their own); ConfigError if bad."""
    if state_dtype is None:
        return None
    import torch
    if state_dtype is torch.bfloat16 or (isinstance(state_dtype, str) and state_dtype == "bfloat16"):
        return torch.bfloat16
    raise ConfigError(f"state_dtype must be None, torch.bfloat16 or \"bfloat16\", got {state_dtype!r}")


def averaging_group(arg: Any) -> Any:
    """The process group a ``process_group`` argument names: None (no averaging), True (the
    default group), or a group; one rank alone needs no averaging (NOTE [data parallel])."""
    if arg is None or arg is False:
        return None
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("process_group needs torch.distributed initialised first (init_process_group)")
    group = dist.group.WORLD if arg is True else arg
    return group if dist.get_world_size(group) > 1 else None


def on_every_rank(torch: Any, flags: list[bool], group: Any, device: Any) -> list[bool]:
    """Each flag, set where it is set on every rank of ``group``: one MIN all-reduce on ``device``
    (the group's backend's: NCCL's a GPU, gloo's the CPU)."""
    import torch.distributed as dist
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [bool(x) for x in t.tolist()]

