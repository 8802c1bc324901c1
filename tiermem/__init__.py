"""tiermem: tiered GPU/host tensors on CUDA Unified Memory, placed by role, within a device budget.

    import tiermem as tier
    tier.configure(budget="8GiB")
    for p in model.parameters():
        tier.wrap(p, role="weight")

See README.md. A GPU is needed for everything that touches memory; ``python -m tiermem info``
says what this machine has.
"""
from . import arrays, errors, handles, planning, roles, torch_memory
from ._api import (
    allocator,
    configure,
    default_tier,
    empty,
    evict,
    kv_cache,
    load_pretrained,
    memory_summary,
    policy_override,
    prefetch,
    stats,
    synchronize,
    unwrap,
    use,
    wrap,
    wrap_fsdp,
    wrap_module,
    wrap_training,
)
from ._tier import Tier
from .core.tensor import TieredTensor
from .cupy.allocator import using_role
from .errors import ConfigError, CUDAError, OutOfBudgetError, TierMemError
from .pytorch.allocator import torch_allocations
from .pytorch.wrap import tiered_of
from .roles import Location, Policy, Role

__version__ = "0.1.0"

# The names most code needs; the rest live in named submodules (NOTE [public names]).
__all__ = [
    "Tier", "TieredTensor", "Role", "Policy", "Location",
    "configure", "default_tier", "policy_override",
    "empty", "wrap", "unwrap", "tiered_of", "wrap_module", "wrap_training", "wrap_fsdp", "load_pretrained",
    "kv_cache",
    "prefetch", "evict", "synchronize", "allocator", "using_role", "use", "torch_allocations",
    "stats", "memory_summary",
    "TierMemError", "ConfigError", "OutOfBudgetError", "CUDAError",
]

# NOTE [public names]
#     The top level keeps what most code calls; everything else has a home named for what it
#     holds: tiermem.errors, .planning, .handles, .arrays (CuPy), .torch_memory, .roles. The names
#     that stood at the top level before keep working from there, with a DeprecationWarning that
#     says where each one lives now.
_MOVED = {
    **{n: "errors" for n in errors.__all__},
    **{n: "planning" for n in planning.__all__},
    **{n: "handles" for n in handles.__all__},
    **{n: "arrays" for n in arrays.__all__},
    **{n: "torch_memory" for n in torch_memory.__all__},
    **{n: "roles" for n in ("PolicyTable", "Prefetch", "Evict", "DEFAULT_POLICIES")},
}


def __getattr__(name: str):
    home = _MOVED.get(name)
    if home is None or name in __all__:
        raise AttributeError(f"module 'tiermem' has no attribute {name!r}")
    import warnings
    warnings.warn(f"tiermem.{name} is now tiermem.{home}.{name}", DeprecationWarning, stacklevel=2)
    return getattr(globals()[home], name)
