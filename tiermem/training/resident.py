"""A streamed block made resident: its parameters and optimizer states moved from their pinned
homes into managed memory kept on the device (NOTE [training transport] in training/handle.py), when a
plan keeps it there."""
from __future__ import annotations

from typing import Any

from ..roles import Evict, Location, Prefetch, Role
from .slots import Block, BlockSlots

__all__ = ["make_resident"]


def make_resident(tier: Any, stream: BlockSlots, optimizer: Any, mem: Any, b: Block) -> list[int]:
    """Move ``b`` into managed memory kept on the device; its parameters' new storages'
    addresses. All or nothing: the states' new memory is filled first, the parameters are
    wrapped (itself all or nothing), and only then does anything point at the new memory."""
    import torch

    from ..pytorch.wrap import wrap_group
    if b.slot is not None and b.slot.occupant is b:
        stream.unbind(b.slot)
    mem.synchronize()
    views: list[Any] = []
    tts: list[Any] = []
    if b.states:
        # Filled below by a device copy; prefetch NEVER leaves the group unplaced until then
        # (the plan counts these bytes itself, NOTE [training plan]), whatever the role's
        # default prefetch is.
        spol = tier.policies[Role.OPTIMIZER_STATE].replace(preferred_location=Location.DEVICE,
                                                           accessed_by_device=False, evict=Evict.NEVER,
                                                           prefetch=Prefetch.NEVER)
        # at the optimizer's dtypes: what does not move is not narrowed (NOTE [bf16 moments])
        specs = [(tuple(p.shape), dt) for (p, _, _), (dt, _) in zip(b.states, b.s_dtypes)]
        tts = tier.empty_group([(sh, str(dt).replace("torch.", "")) for sh, dt in specs],
                               role=Role.OPTIMIZER_STATE, policy=spol)
        with torch.no_grad():
            for (p, key, _), (dt, _), tt, hv in zip(b.states, b.s_dtypes, tts, b.home_state_views):
                v = tt.torch().view(dt).view(p.shape)
                v.copy_(hv)
                views.append(v)
    grads = [g.to(mem.device, copy=True) for g in stream.home_grads(b)] if b.grads_home else []
    olds = [p.data.untyped_storage().data_ptr() for p in b.params]
    pol = tier.policies[Role.WEIGHT].replace(evict=Evict.NEVER)
    b.tiered = wrap_group(tier, b.params, Role.WEIGHT, names=[f"{b.name}.{i}" for i in range(len(b.params))],
                          policy=pol)
    b.resident = True
    b.host = False                  # NOTE [host stepping]: a resident block steps on the device
    for p, old in zip(b.params, olds):
        stream.forget(p, old)
    for (p, key, _), v in zip(b.states, views):
        optimizer.state[p][key] = v
    for p, g in zip(b.trainable, grads):      # the open window's, as a resident block keeps them
        p.grad = g
    stream.release_grads(b)
    stream.release_alt(b)
    b.resident_state_views = views
    b.tiered += tts
    mem.synchronize()
    b.home_views, b.home_state_views = [], []
    for h in (b.home_p, b.home_s):
        if h is not None:
            h.release()
    b.home_p = b.home_s = None
    return [p.data.untyped_storage().data_ptr() for p in b.params]
