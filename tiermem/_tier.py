"""The public face: :class:`Tier` is the engine (core/engine.py) with the adapters' entry points.

The layers, lowest first; a module imports only from its own layer or below, and reaches into
no other module's private members (tests/test_layers.py holds the code to it):
  - base: errors, dtypes, sizes and limits, roles, the default tier's slot;
  - CUDA: the raw calls (cuda/runtime.py), the backend protocol (cuda/backend.py) with its books of events
    across a CUDA graph capture (cuda/capture.py), the staging rings;
  - core: the engine (core/engine.py), composed of its parts (books, budget, side streams,
    advice, parking, moves, eviction, placement), with its tensor, transfer, stats, leases and
    report, and the streaming primitive every mover shares (core/stream.py: ordered copies, a ring of device slots,
    a pinned arena);
  - adapters: torch (wrap, module offload, training and its whole-step graphs, activation swap,
    the torch allocator),
    checkpoints and the disk tier, CuPy (the allocator, scoped residency);
  - this face, then the module-level API, the CLI and the demo.
"""
from __future__ import annotations

from typing import Any

from .core.engine import Engine, check_empty
from .core.tensor import TieredTensor
from .cupy.allocator import make_allocator
from .cupy.scoped import residency
from .inference.module import wrap_module
from .inference.options import ModuleOptions
from .pytorch.wrap import unwrap, wrap
from .roles import Role
from .training.fsdp import wrap_fsdp
from .training.handle import wrap_training

__all__ = ["Tier", "check_empty"]


class Tier(Engine):
    __doc__ = Engine.__doc__

    def wrap(self, tensor: Any, role: Role | str = Role.WEIGHT, **kwargs: Any) -> TieredTensor:
        """Move a torch tensor or parameter into tiered memory in place (see tiermem.wrap)."""
        return wrap(self, tensor, role, **kwargs)

    def unwrap(self, tensor: Any) -> Any:
        """Give a wrapped tensor plain memory again (see tiermem.unwrap)."""
        return unwrap(self, tensor)

    def wrap_module(self, module: Any, budget: int | str | None = None, *, options: ModuleOptions | None = None,
                    **kwargs: Any) -> Any:
        """Adopt a whole nn.Module within a budget (see tiermem.wrap_module; the options:
        :class:`tiermem.handles.ModuleOptions`)."""
        return wrap_module(self, module, budget, options=options, **kwargs)

    def wrap_training(self, model: Any, optimizer: Any, budget: int | str, **kwargs: Any) -> Any:
        """Train a model within a device budget (see tiermem.wrap_training)."""
        return wrap_training(self, model, optimizer, budget, **kwargs)

    def wrap_fsdp(self, model: Any, optimizer: Any, budget: int | str | None = None, **kwargs: Any) -> Any:
        """Hold a fully_shard model's shards and optimizer states in pinned host memory (see
        tiermem.wrap_fsdp)."""
        return wrap_fsdp(self, model, optimizer, budget, **kwargs)

    def kv_cache(self, config: Any, max_tokens: int, kv_budget: int | str | None = None, **kwargs: Any) -> Any:
        """A transformers KV cache in tiers on this Tier (see tiermem.kv_cache)."""
        from .inference.kvcache import TieredKVCache   # imports transformers: only when asked for
        return TieredKVCache(config, max_tokens, kv_budget, tier=self, **kwargs)

    def allocator(self, role: Role | str | None = None) -> Any:
        """A CuPy allocator (size -> MemoryPointer) serving tiered managed memory (see
        tiermem.allocator)."""
        return make_allocator(self, role)

    def use(self, *arrays: Any, stream: Any = None, read_only: bool = False, once: bool = False) -> Any:
        """Bring ``arrays`` (CuPy arrays from this Tier's allocator, or TieredTensors) to the device
        ahead of use, on tiermem's stream, evicting the coldest to hold the budget (raises
        :class:`OutOfBudgetError` if they cannot all fit). Returns an :class:`ArrayUse` handle:
        the moves start at once; ``with handle:`` makes ``stream`` (default: CuPy's current
        stream for CuPy arrays, else the current stream) wait for them on the device, and until
        the block ends budget checks never evict them. Make the next block's
        handle inside this block's ``with`` to overlap its moves with this block's kernels.
        ``read_only=True`` promises the block only reads them: they then leave the device again
        without moving a byte. ``once=True`` says the block touches each array's bytes about once
        (a streaming pass): arrays that live in place on the host then stay there and kernels use
        them over the link, which is as fast as moving them and leaves nothing to evict (NOTE
        [touched once]). NOTE [scoped moves] and NOTE [read-only scopes] in cupy/scoped.py."""
        return residency(self).use(arrays, stream, read_only, once)
