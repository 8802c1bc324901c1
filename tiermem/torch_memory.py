"""torch's own CUDA allocations in managed memory, with a role's advice (NOTE [routing] in
pytorch/allocator.py): :func:`torch_allocations` routes them within a block; the rest inspects and
caps what was routed. Needs a C compiler and the CUDA headers at first use."""
from .pytorch.allocator import (
                           ManagedAllocation,
                           TorchAllocations,
                           TorchAllocatorStats,
                           build_torch_allocator,
                           is_managed,
                           set_torch_managed_cap,
                           torch_allocations,
                           torch_allocator_stats,
                           torch_managed_allocations,
)

__all__ = ["torch_allocations", "TorchAllocations", "is_managed", "torch_allocator_stats", "TorchAllocatorStats",
           "torch_managed_allocations", "ManagedAllocation", "set_torch_managed_cap", "build_torch_allocator"]
