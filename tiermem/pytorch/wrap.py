"""PyTorch adoption: wrap a tensor or parameter in place, and unwrap it again.

``wrap`` moves a tensor's data into a tiered buffer and rebinds the tensor's ``.data`` to a
zero-copy view of it. The Python object stays the same, so a module that holds the parameter,
an optimizer that holds it, and autograd all keep working; ``requires_grad`` is untouched and
gradients arrive as usual.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..base import dtypes as _dtypes
from ..core.tensor import TieredTensor
from ..errors import OutOfBudgetError, ViewError, WrapError
from ..roles import Location, Policy, Role, as_role, check_policy

if TYPE_CHECKING:
    from ..core.engine import Engine as Tier  # what an adapter uses is the engine's interface

__all__ = ["wrap", "wrap_group", "unwrap", "tiered_of", "check_wrap", "check_unwrap"]

TIERED_ATTR = "_tiermem"   # the TieredTensor a wrapped tensor belongs to; keeps it alive with the tensor


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise WrapError("tiermem.wrap needs torch; pip install 'tiermem[torch]'") from e
    return torch


def tiered_of(tensor: Any) -> TieredTensor | None:
    """The TieredTensor a wrapped tensor or parameter belongs to, or None."""
    tt = getattr(tensor, TIERED_ATTR, None)
    return tt if isinstance(tt, TieredTensor) and not tt.freed else None


def check_wrap(tensor: Any, role: Role | str = Role.WEIGHT, *, name: str | None = None,
               policy: Policy | None = None, **policy_changes: Any) -> Role:
    """Raise what :func:`wrap` would for its arguments, as far as that needs no Tier: an unknown
    role or policy field (:class:`RoleError`), a tensor tiermem cannot hold (:class:`WrapError`).
    tiermem.wrap calls it before it looks for a GPU. Returns the role."""
    r = check_policy(role, policy, policy_changes)
    _check_tensor(tensor)
    return r


def _check_tensor(tensor: Any) -> None:
    torch = _torch()
    if not isinstance(tensor, torch.Tensor):
        raise WrapError(f"wrap takes a torch.Tensor or nn.Parameter, got {type(tensor).__name__}")
    if tiered_of(tensor) is not None:
        raise WrapError(f"this tensor is already wrapped ({tiered_of(tensor)!r}); unwrap it first")
    if tensor.layout != torch.strided:
        raise WrapError(f"cannot wrap a {tensor.layout} tensor: tiermem holds dense (strided) tensors only")
    if tensor.is_quantized:
        raise WrapError(f"cannot wrap a quantized tensor ({tensor.dtype}): its scale and zero point live outside "
                        "its bytes; wrap its int_repr() or the dequantized tensor")
    try:
        _dtypes.canonical(tensor.dtype)
    except ViewError:
        raise WrapError(f"cannot wrap a {str(tensor.dtype).replace('torch.', '')} tensor: tiermem holds "
                        f"{', '.join(_dtypes.names())}") from None
    if tensor.is_meta:
        raise WrapError("cannot wrap a meta tensor: it has no data. Materialise it first "
                        "(e.g. module.to_empty(device='cuda') and load its weights)")
    if not tensor.is_contiguous():
        raise WrapError(f"cannot wrap a non-contiguous tensor (strides {tuple(tensor.stride())}); "
                        "wrap the tensor it is a view of, or pass tensor.contiguous()")
    if tensor.device.type not in ("cpu", "cuda"):
        raise WrapError(f"cannot wrap a tensor on {tensor.device}; tiermem takes CPU or CUDA tensors")


def check_tensor(tier: Tier, tensor: Any) -> None:
    _check_tensor(tensor)
    if tensor.device.type == "cuda" and tensor.device.index != tier.device:
        raise WrapError(f"tensor is on {tensor.device} but this Tier manages cuda:{tier.device}")
    if tensor.numel() and tier.owner_of(tensor.data_ptr()) is not None:
        raise WrapError("this tensor is a view of tiered memory already; wrap the original instead")


def wrap(tier: Tier, tensor: Any, role: Role | str = Role.WEIGHT, *, name: str | None = None,
         policy: Policy | None = None, **policy_changes: Any) -> TieredTensor:
    """Move ``tensor``'s data into tiered memory and rebind it there; see tiermem.wrap."""
    _torch()                     # no torch: a clear error before anything else
    r = as_role(role)            # an unknown role raises before anything changes
    check_tensor(tier, tensor)
    if r is Role.WEIGHT and not tensor.requires_grad:
        r = Role.FROZEN_WEIGHT   # a weight nothing trains: read-mostly, and its eviction is free
    pol = tier.resolve_policy(r, policy, policy_changes)
    nbytes = tensor.numel() * tensor.element_size()
    buf = tier.new_buffer(nbytes, r, pol, {}, name)
    tt = TieredTensor(buf, tuple(tensor.shape), _dtypes.canonical(tensor.dtype))
    with _undone_on_error([tt], [tensor]):
        _adopt(tier, tt, tensor, pol)
    return tt


@contextlib.contextmanager
def _undone_on_error(tts: list[TieredTensor], tensors: list[Any]) -> Iterator[None]:
    """A wrap that fails (a CUDA error, an interrupt) leaves its tensors as they were: bound to
    their own memory again, not wrapped, and the tiered buffers freed (NOTE [failed moves] in
    core/moves.py). Their own memory is untouched: a wrap copies out of it and only rebinds."""
    old = [t.data for t in tensors]
    try:
        yield
    except BaseException:
        for t, data in zip(tensors, old):
            tt = getattr(t, TIERED_ATTR, None)
            if tt is not None and any(tt is x for x in tts):
                t.data = data
                delattr(t, TIERED_ATTR)
        for tt in tts:
            if not tt.freed:
                tt.buffer.bindings = []
                tt.free()
        raise


def _adopt(tier: Tier, tt: TieredTensor, tensor: Any, pol: Policy) -> None:
    """Fill ``tt`` from ``tensor`` and bind ``tensor`` to it (the body of :func:`wrap`)."""
    torch = _torch()
    buf = tt.buffer
    # Fill from the device side: a host-side first touch of managed memory runs at ~2 GB/s.
    # No read-mostly while filling: a write to a read-mostly range collapses its duplicates.
    tier.apply_advice(buf, Policy(preferred_location=Location.DEVICE))
    with tier.lock:
        try:
            tier.make_room(buf.span, exclude={buf})
            tier.move_in([buf], None, non_blocking=False)
        except OutOfBudgetError:
            # Larger than the budget: fill it in host pages and read it in place from there
            # (zero-copy), as Tier does for any new buffer that cannot fit.
            buf.policy = pol = pol.replace(preferred_location=Location.HOST, accessed_by_device=True, read_mostly=False)
            tier.apply_advice(buf)
            buf.where = Location.HOST
    with torch.no_grad():
        fill_and_bind(tier, tt, tensor)
    tier.apply_advice(buf)
    if buf.where is Location.HOST:
        buf.host_valid = True
    elif pol.preferred_location is Location.HOST or pol.prefetch.value == "never":
        # Host-preferred data leaves the device through Unified Memory so that its host pages hold
        # it: prefetches of it then run at link rate and read-mostly eviction moves nothing.
        tier.evict([buf], _path="um")


def fill_and_bind(tier: Tier, tt: TieredTensor, tensor: Any) -> None:
    """Copy ``tensor`` into ``tt``'s buffer from the device side and rebind ``tensor.data`` to it
    (an internal view tiermem can re-point), linking the two. Call under torch.no_grad()."""
    buf = tt.buffer
    view = tier.backend.torch_view(buf.ptr, buf.nbytes, buf.token(internal=True)).view(tensor.dtype).view(tensor.shape)
    view.copy_(tensor)
    tt._origin_device = tensor.device
    tensor.data = view
    buf.bindings.append(weakref.ref(tensor))
    setattr(tensor, TIERED_ATTR, tt)


def check_unwrap(x: Any) -> TieredTensor:
    """The TieredTensor :func:`unwrap` would restore ``x`` from: ``x`` itself, or the one a wrapped
    torch tensor belongs to. Anything else raises :class:`WrapError`. Needs no Tier, so
    tiermem.unwrap calls it before it looks for one."""
    if isinstance(x, TieredTensor):
        return x
    tt = tiered_of(x)
    if tt is not None:
        return tt
    torch = _torch()
    if isinstance(x, torch.Tensor):
        raise WrapError(f"this tensor ({str(x.dtype).replace('torch.', '')}, {list(x.shape)}, on {x.device}) is not "
                        "wrapped by tiermem: there is nothing to unwrap")
    raise WrapError(f"unwrap takes a tensor tiermem wrapped or a TieredTensor, got {type(x).__name__}")


def unwrap(tier: Tier, x: Any) -> Any:
    """Copy a wrapped tensor's data back to plain memory on its original device and rebind it
    there; returns the tensor. A TieredTensor that nothing is bound to comes back as a new plain
    tensor. The tiered buffer is freed."""
    torch = _torch()
    tt = check_unwrap(x)
    if tt.tier is not tier:
        raise WrapError("this tensor belongs to another Tier")
    buf = tt.buffer
    device = getattr(tt, "_origin_device", None) or torch.device("cuda", tier.device)
    bound = [t for t in (r() for r in buf.bindings) if t is not None]
    if bound:
        for t in bound:
            plain = torch.empty(t.shape, dtype=t.dtype, device=device)
            with torch.no_grad():
                plain.copy_(t.data)
            t.data = plain
            if getattr(t, TIERED_ATTR, None) is tt:
                delattr(t, TIERED_ATTR)
        buf.bindings = []
        out = bound[0]
    else:
        out = tt.torch().to(device, copy=True)
    tt.free()
    return out


def rebind_plain(t: Any, plain: Any) -> None:
    """Point ``t`` at ``plain`` and, if it was wrapped, forget its tiered buffer (which lives on
    until it is freed). Makes no backend call, so it cannot fail half-way."""
    tt = getattr(t, TIERED_ATTR, None)
    t.data = plain
    if isinstance(tt, TieredTensor):
        buf = tt.buffer
        buf.bindings = [r for r in buf.bindings if r() is not None and r() is not t]
        delattr(t, TIERED_ATTR)


def wrap_group(tier: Tier, tensors: list[Any], role: Role | str, *, names: list[str] | None = None,
               on_host: bool = False, policy: Policy | None = None) -> list[TieredTensor]:
    """Wrap several tensors of one role as one group: adjacent slices of a single allocation that
    move in one CUDA call (see Tier.empty_group), each filled from the device side and rebound
    like :func:`wrap`. With ``on_host`` the group is written straight into host pages (a GPU
    kernel writing mapped host pages runs at link rate, where Unified Memory's own write-back
    runs at ~10 GB/s) and never takes device budget; otherwise it is filled on the device and
    stays there. The group is ``frozen_weight`` if none of the weights requires grad."""
    torch = _torch()
    r = as_role(role)
    for t in tensors:
        check_tensor(tier, t)
    if r is Role.WEIGHT and not any(t.requires_grad for t in tensors):
        r = Role.FROZEN_WEIGHT
    pol = policy if policy is not None else tier.policies[r]
    # No read-mostly while writing: a write to a read-mostly range collapses its copies.
    fill = (Policy(preferred_location=Location.HOST, accessed_by_device=True) if on_host
            else Policy(preferred_location=Location.DEVICE))
    specs = [(tuple(t.shape), _dtypes.canonical(t.dtype)) for t in tensors]
    tts = tier.empty_group(specs, role=r, names=names, policy=fill)
    with _undone_on_error(tts, tensors):
        with torch.no_grad():
            for tt, t in zip(tts, tensors):
                fill_and_bind(tier, tt, t)
        for tt in tts:
            tt.advise(policy=pol)
            if tt.buffer.where is not Location.DEVICE:
                tt.buffer.where = Location.HOST
                tt.buffer.host_valid = True      # its host pages hold the data
    return tts
