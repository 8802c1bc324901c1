"""tiermem: tiered GPU/host tensors on CUDA Unified Memory, placed by role, within a device budget.

    import tiermem as tier
    tier.configure(budget="8GiB")
    for p in model.parameters():
        tier.wrap(p, role="weight")

See README.md. A GPU is needed for everything that touches memory; ``python -m tiermem info``
says what this machine has.
"""
from ._api import (allocator, configure, default_tier, empty, evict, load_pretrained, memory_summary, policy_override,
                   prefetch, stats, synchronize, unwrap, use, wrap, wrap_module, wrap_training)
from ._module import Plan, TieredModule, plan_host, plan_residency
from ._load import Checkpoint
from ._train import TieredTraining
from ._trainplan import StepTrace, TrainPlan, plan_training
from ._cuda import Capabilities, RangeInfo
from ._cupy import current_role, using_role
from ._scoped import ArrayUse
from ._errors import (BuildError, CapExceededError, CheckpointError, ConfigError, ConfigTypeError, CUDAError,
                      CUDAOutOfMemoryError, CUDAUnavailableError, DeviceFullError, HostBudgetError, OutOfBudgetError,
                      RoleError, TierMemError, ViewError, WrapError)
from ._limits import parse_bytes
from ._tensor import TieredTensor
from ._tier import Tier
from ._torch import tiered_of
from ._transfer import Transfer
from ._torch_alloc import (ManagedAllocation, TorchAllocations, TorchAllocatorStats, build_torch_allocator, is_managed,
                           set_torch_managed_cap, torch_allocations, torch_allocator_stats, torch_managed_allocations)
from .roles import DEFAULT_POLICIES, Evict, Location, Policy, PolicyTable, Prefetch, Role

__version__ = "0.1.0"

__all__ = [
    "Tier", "TieredTensor", "Transfer", "Role", "Location", "Policy", "PolicyTable", "Prefetch", "Evict",
    "DEFAULT_POLICIES", "Capabilities", "RangeInfo",
    "configure", "default_tier", "empty", "wrap", "wrap_module", "wrap_training", "TieredTraining", "TrainPlan",
    "StepTrace", "plan_training", "unwrap", "TieredModule", "Plan", "plan_residency", "plan_host",
    "load_pretrained", "Checkpoint", "tiered_of", "prefetch", "evict", "allocator",
    "using_role", "current_role", "use", "ArrayUse", "policy_override", "stats", "memory_summary", "synchronize", "parse_bytes",
    "TierMemError", "ConfigError", "ConfigTypeError", "CUDAError", "CUDAOutOfMemoryError", "CUDAUnavailableError", "OutOfBudgetError", "CapExceededError", "DeviceFullError", "RoleError",
    "WrapError", "ViewError", "BuildError", "CheckpointError", "HostBudgetError", "__version__",
    "torch_allocations", "TorchAllocations", "is_managed", "torch_allocator_stats", "TorchAllocatorStats",
    "torch_managed_allocations", "ManagedAllocation", "set_torch_managed_cap", "build_torch_allocator",
]
