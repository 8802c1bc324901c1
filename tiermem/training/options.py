"""wrap_training's options, checked before anything is adopted: the budget and the knobs'
types and ranges (:func:`check_options`, which needs no GPU), the optimizer states' dtype, and
the process group a ``process_group`` argument names."""
from __future__ import annotations

from typing import Any

from ..base.limits import check_bytes
from ..errors import ConfigError, ConfigTypeError
from .plan import RECOMPUTE_MODES

__all__ = ["check_options", "check_subjects", "states_dtype", "averaging_group"]


def check_options(budget: int | str, *, lookahead: int = 2, recompute: str = "auto",
                  link_GBps: float | None = None, state_dtype: Any = None, accumulate: int = 1,
                  max_grad_norm: float | None = None, norm_type: float = 2.0, speculate: bool = False,
                  graphs: bool = False, **_: Any) -> None:
    """Raise :class:`ConfigError` for a bad budget, lookahead, recompute, link rate, state dtype,
    accumulate, max_grad_norm, norm_type or speculate of :func:`wrap_training`. Needs no GPU, so
    tiermem.wrap_training checks them before it looks for one; it takes all of wrap_training's
    options, and the others are checked where they are used."""
    check_bytes(budget, what="training budget", max_percent=100, positive=True)
    if isinstance(lookahead, bool) or not isinstance(lookahead, int):
        raise ConfigTypeError(f"lookahead must be an int, got {lookahead!r}")
    if lookahead < 1:
        raise ConfigError(f"lookahead must be at least 1, got {lookahead}")
    if isinstance(accumulate, bool) or not isinstance(accumulate, int):
        raise ConfigTypeError(f"accumulate must be an int (micro-batches per optimizer step), got {accumulate!r}")
    if accumulate < 1:
        raise ConfigError(f"accumulate must be at least 1 (micro-batches per optimizer step), got {accumulate}")
    if not isinstance(speculate, bool):
        raise ConfigTypeError(f"speculate must be True or False, got {speculate!r}")
    if not isinstance(graphs, bool):
        raise ConfigTypeError(f"graphs must be True or False, got {graphs!r}")
    if speculate and max_grad_norm is None:
        raise ConfigError("speculate=True speculates that clipping leaves the gradients alone: it needs max_grad_norm")
    for name, v in (("max_grad_norm", max_grad_norm), ("norm_type", norm_type)):
        if v is None and name == "max_grad_norm":
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigTypeError(f"{name} must be a number, got {v!r}")
        if not v > 0:
            raise ConfigError(f"{name} must be positive, got {v!r}")
    if recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"recompute must be one of {', '.join(map(repr, RECOMPUTE_MODES))}, got {recompute!r}")
    if link_GBps is not None and (isinstance(link_GBps, bool) or not isinstance(link_GBps, (int, float))
                                  or not link_GBps > 0):
        raise ConfigError(f"link_GBps must be a positive number of GB/s, got {link_GBps!r}")
    states_dtype(state_dtype)


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
