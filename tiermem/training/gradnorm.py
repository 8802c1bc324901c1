"""Global-norm gradient clipping for a training step whose gradients never all sit on the device
at once (NOTE [clipping] in training/clipping.py): the norm of each parameter's gradient is taken while it
is on the device, and the total and the clipping are torch's own arithmetic, so the result is
``torch.nn.utils.clip_grad_norm_``'s, bitwise.

NOTE [clip arithmetic]
    ``clip_grad_norm_(params, max_norm, norm_type)`` computes, per (device, dtype) group of the
    gradients, the norm of each gradient (``torch._foreach_norm`` where the device has foreach
    kernels, else ``torch.linalg.vector_norm``), stacks them group after group, takes the norm of
    that vector, and multiplies every gradient by ``min(max_norm / (total + 1e-6), 1)``. Each
    gradient's norm is its own reduction (a foreach kernel reduces each tensor of its list
    separately), so it is the same bits whether taken with the whole model's gradients or with
    one block's: :class:`NormParts` keeps them as the blocks complete. The order of the stacked
    vector is the one place the grouping shows: torch groups through a hash map, not in order of
    first appearance (bf16, fp32, bf16 gives the bf16 group first, fp16, fp32, bf16, fp16 the
    fp32 one). So :func:`stack_order` asks torch's own grouping for it, and only if that private
    helper is gone falls back to first appearance, which is the same for a model of one dtype.
    The multiplication is elementwise: ``torch.nn.utils.clip_grads_with_norm_`` applied a block
    at a time gives the whole model's bits.
"""
from __future__ import annotations

from typing import Any

__all__ = ["NormParts", "stack_order"]


def stack_order(torch: Any, tensors: list[Any]) -> list[int]:
    """Indices of ``tensors`` in the order torch's clip_grad_norm_ stacks their norms."""
    try:
        from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype as group
    except ImportError:           # torch moved it: first appearance, exact for one dtype
        seen: dict[tuple[Any, Any], list[int]] = {}
        for i, t in enumerate(tensors):
            seen.setdefault((t.device, t.dtype), []).append(i)
        return [i for idx in seen.values() for i in idx]
    stand_ins = [torch.empty(0, dtype=t.dtype, device=t.device) for t in tensors]
    return [i for _, (_, idx) in group([stand_ins], with_indices=True).items() for i in idx]


class NormParts:
    """Each gradient's norm, taken where the gradient is, then the total over all of them."""

    def __init__(self, torch: Any, norm_type: float):
        self.torch = torch
        self.norm_type = float(norm_type)
        self.norms: dict[int, Any] = {}          # id(param) -> its gradient's norm
        self._order: tuple[tuple[Any, ...], list[int]] = ((), [])   # the last stack_order, by its params

    def add(self, params: list[Any]) -> None:
        """The norms of ``params``' gradients (all of them present)."""
        torch = self.torch
        grads = [p.grad for p in params]
        if not grads:
            return
        if grads[0].device.type == "cuda":
            norms = torch._foreach_norm(grads, self.norm_type)
        else:
            norms = [torch.linalg.vector_norm(g, self.norm_type) for g in grads]
        for p, n in zip(params, norms):
            self.norms[id(p)] = n

    def total(self, params: list[Any]) -> Any:
        """The norm over every gradient taken, ``params`` giving the order (the model's)."""
        torch = self.torch
        ps = [p for p in params if id(p) in self.norms]
        if not ps:
            return torch.tensor(0.0)
        key = tuple((id(p), p.dtype) for p in ps)
        if self._order[0] != key:              # the same parameters step after step: asked once
            self._order = (key, stack_order(torch, ps))
        order = self._order[1]
        first = self.norms[id(ps[0])].device          # torch's: the first gradient's device
        norms = [self.norms[id(ps[i])] for i in order]
        return torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), self.norm_type)

    def clear(self) -> None:
        self.norms = {}
