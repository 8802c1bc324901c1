"""The objects tiermem's calls hand back, for annotations and isinstance checks: a move in flight
(:class:`Transfer`), the handles of :func:`tiermem.wrap_module` (:class:`TieredModule`, or
:class:`SplitModule` over several GPUs), :func:`tiermem.wrap_training` and :func:`tiermem.wrap_fsdp`
and their options (:class:`ModuleOptions`, :class:`TrainingOptions`, :class:`FSDPOptions`), the KV cache of :func:`tiermem.kv_cache`
(:class:`TieredKVCache`, a transformers ``Cache``: imported when first named, since it needs
transformers), a budget lease, a checkpoint's index, and what the driver reports about the device
and a range."""
from .core.leases import BudgetLease
from .core.transfer import Transfer
from .cuda.runtime import Capabilities, RangeInfo
from .inference.load import Checkpoint
from .inference.module import TieredModule
from .inference.multidevice import SplitModule
from .inference.options import ModuleOptions
from .training.fsdp import TieredFSDP
from .training.handle import TieredTraining
from .training.options import FSDPOptions, TrainingOptions

__all__ = ["Transfer", "TieredModule", "SplitModule", "ModuleOptions", "TieredTraining", "TrainingOptions", "TieredFSDP",
           "FSDPOptions", "TieredKVCache", "BudgetLease", "Checkpoint", "Capabilities", "RangeInfo"]


def __getattr__(name: str):
    if name == "TieredKVCache":
        from .inference.kvcache import TieredKVCache
        return TieredKVCache
    raise AttributeError(f"module 'tiermem.handles' has no attribute {name!r}")
