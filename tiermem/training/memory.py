"""The memory a tiered training takes from its model and gives back: the model's host buffers
moved to the device for the run (NOTE [host models]), the plain copies ``unwrap()`` makes and
the device room they need, and the adoption's own bytes freed. tiermem.training.handle decides when.

NOTE [host models]
    A model bigger than the device cannot be moved there first, so wrap_training also takes
    one whose parameters are on the host: each is copied into its pinned home (or, for a
    resident block, into managed memory) as a device parameter's is, and the module's host
    buffers (rotary tables, masks: small) move to the device, so the forward runs there.
    unwrap() gives each parameter, its optimizer states and those buffers back where they
    came from unless told otherwise, so a model that came from the host, and would not fit
    the device plain, goes back to the host. A failed adoption puts the buffers back too.
    tests/test_gpu_train.py trains a transformers GPT-NeoX whose parameters alone are
    bigger than a really small GPU's free memory.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..errors import DeviceFullError
from .slots import Block, BlockSlots

__all__ = ["Cap", "HostBuffers", "PlainCopies", "plain_copies", "check_room", "free_adopted"]


# NOTE [outside memory]
#     What torch holds on the device when tiermem takes the model over (the caller's other
#     tensors: a batch, a second model) is not the step's: the cap adds it to the budget and
#     the step's peak leaves it out. It is the bytes of those tensors' blocks in torch's
#     segments, not the segments: free space inside them is the step's to use, so its peak
#     counts it. It is measured while the adoption still holds the parameters' old device
#     memory (a failed adoption gives it back to them), that memory left out; the handle frees
#     it once adopted. Counting it in let torch take the model's parameter bytes beyond the
#     budget, and resident_peak() reported that much less than the step held
#     (docs/training.md, "How it works").
class Cap:
    """torch's caching allocator capped at the budget less tiermem's resident managed bytes, plus
    what torch held outside the training (``outside``, NOTE [outside memory]). Sizes are bytes."""

    def __init__(self, mem: Any, tier: Any, budget: int, total: int):
        self.mem, self.tier, self.budget, self.total = mem, tier, budget, total
        self.outside = 0
        self.old_fraction: float | None = None     # torch's fraction before the training set one

    def room(self) -> int:
        """What torch's allocator may hold."""
        return max(self.budget - self.tier.resident_bytes, 0) + self.outside

    def set(self) -> None:
        """torch's allocator may use the budget minus tiermem's resident managed bytes."""
        self.mem.set_fraction(min(self.room() / self.total, 1.0))

    def graph_room(self, general_peak: int | None) -> int | None:
        """Bytes the recomputed blocks' graphs' pool may take (NOTE [replayed recompute]): what
        torch's allocator is capped at, less the last step's peak outside the pool
        (``general_peak``; a step before any graph recomputed eagerly: its peak holds the working
        set the pool now holds too, so this errs on the safe side), less 1/32 of the budget."""
        if general_peak is None:
            return None
        return self.room() - self.budget // 32 - general_peak

    def resident_peak(self, last_peak: int) -> int:
        """Device bytes a step kept at its peak: tiermem's resident managed bytes plus torch's peak
        reserved bytes (``last_peak``), less what torch held before wrap_training."""
        return self.tier.resident_bytes + last_peak - self.outside


class HostBuffers:
    """NOTE [host models]: a model's buffers that were on the host, moved to ``device`` while
    tiermem trains it (rotary tables, masks: small), so its forward runs there."""

    def __init__(self, device: Any):
        self.device = device
        self.moved: list[tuple[Any, str, Any]] = []      # (module, name, host tensor)

    def move_in(self, model: Any) -> None:
        for m in model.modules():
            for name, t in list(m._buffers.items()):
                if t is not None and t.device.type == "cpu" and t.device != self.device:
                    self.moved.append((m, name, t))
                    m._buffers[name] = t.to(self.device)

    def put_back(self) -> None:
        """A failed adoption: each buffer is its host tensor again."""
        for m, name, t in self.moved:
            m._buffers[name] = t
        self.moved = []

    def move_out(self, device: Any) -> None:
        """The buffers moved in go to ``device``, values and all."""
        for m, name, _ in self.moved:
            t = m._buffers.get(name)
            if t is not None:
                m._buffers[name] = t.to(device)
        self.moved = []


@dataclasses.dataclass
class PlainCopies:
    """What unwrap() gives the model: plain parameters, optimizer states and gradients."""

    params: list[tuple[Any, Any]]
    states: list[tuple[Any, str, Any]]
    grads: list[tuple[Any, Any]]

    def bind(self, optimizer: Any, stream: BlockSlots) -> None:
        """Point the model and the optimizer at the copies. Calls no backend."""
        from ..pytorch.wrap import rebind_plain
        for p, key, v in self.states:
            optimizer.state[p][key] = v
        for p, _ in self.grads:
            p.grad = None                 # torch refuses a .data of another device under a grad
        for p, plain in self.params:
            stream.forget(p)
            rebind_plain(p, plain)
        for p, g in self.grads:
            p.grad = g


def plain_copies(torch: Any, blocks: Sequence[Block], optimizer: Any, stream: BlockSlots, where: dict[int, Any],
                 window: set[int]) -> PlainCopies:
    """Plain copies of every parameter, its optimizer states, and the open accumulation window's
    gradients (``window``: ids of the parameters with one), each on ``where[id(p)]``."""
    with torch.no_grad():
        params = [(p, torch.empty(p.shape, dtype=p.dtype, device=where[id(p)]).copy_(p.data))
                  for b in blocks for p in b.params]
        states = [(p, key, optimizer.state[p][key].to(where[id(p)], dt, copy=True))     # NOTE [bf16 moments]
                  for b in blocks for (p, key, _), (dt, _) in zip(b.states, b.s_dtypes)]
        states += [(p, key, v.to(where[id(p)]))      # resident blocks' states, where they were made
                   for b in blocks if b.resident and not b.states for p in b.trainable
                   for key, v in optimizer.state.get(p, {}).items()
                   if torch.is_tensor(v) and v.device != where[id(p)] and key != "step"]
        # An open accumulation window's gradients, as plain torch would hold them
        # (NOTE [accumulation]): streamed blocks' from home, resident ones' from p.grad.
        grads = [(p, g.to(where[id(p)], copy=True)) for b in blocks if b.grads_home
                 for p, g in zip(b.trainable, stream.home_grads(b)) if id(p) in window]
        grads += [(p, p.grad.to(where[id(p)])) for b in blocks for p in b.trainable
                  if p.grad is not None and id(p) not in {id(q) for q, _ in grads}]
    return PlainCopies(params, states, grads)


def check_room(torch: Any, backend: Any, blocks: Sequence[Block], optimizer: Any, where: dict[int, Any],
               device: Any) -> None:
    """Refuse, changing nothing, an unwrap whose plain copies do not fit the device: checked
    first, since torch's allocator may be tiermem's own over managed memory, which would take
    them past the device's size (NOTE [host models])."""
    if backend.kind != "cuda":
        return
    need = sum(p.numel() * p.element_size() + sum(v.numel() * v.element_size()
                                                  for v in optimizer.state.get(p, {}).values()
                                                  if torch.is_tensor(v) and v.dim() > 0)
               for b in blocks for p in b.params if where[id(p)].type == "cuda")
    cuda = torch.cuda
    free = backend.mem_info()[0] + cuda.memory_reserved(device) - cuda.memory_allocated(device)
    if need > free:
        raise DeviceFullError(need, 0, free, hint="unwrap needs that much free device memory for the plain "
                              "parameters and optimizer states; call unwrap(device='cpu') to restore onto "
                              "the host, or free device memory first")


def free_adopted(blocks: Sequence[Block], stream: BlockSlots, replays: Any, swap: Any) -> None:
    """Free the memory the adoption took, once no parameter points at it: resident blocks'
    managed memory, the pinned homes, the slots, the graphs' pool and the swap's arena."""
    for b in blocks:
        for tt in b.tiered:
            if not tt.freed:
                tt.free()
        for h in (b.home_p, b.home_s):
            if h is not None:
                h.release()
        b.tiered, b.home_p, b.home_s = [], None, None
        stream.release_grads(b)
        stream.release_alt(b)
        b.resident_state_views = []     # views of the memory just freed
    stream.release()
    replays.close()               # the graphs' pool and buffers go back to torch's allocator
    if swap is not None:
        swap.arena.release()
