"""A small device budget for torch's managed segments, kept by evicting to the host.

Used by bench/advice_study.py to emulate a smaller GPU for plain Unified Memory: the managed
segments of torch's allocations (``torch_allocations``) are evicted, least recently used first,
with a prefetch to the host whenever the bytes estimated on the device pass the budget. The data
then comes back by page faults, unless the caller prefetches.

    budget = UMBudget(512 << 20)
    handles = budget.attach(model, optimizer)       # module, saved-tensor and optimizer hooks
    with budget.saving():                           # backward reads are seen too
        loss_fn(model(x)).backward()
    optimizer.step()
    budget.detach(handles)

NOTE [UM residency estimate]
    Free memory does not drop back when managed pages leave the device (docs/facts.md), so
    residency is *estimated*, per whole segment, in stream order:

    - a segment is counted on the device from the moment it is first seen (torch made it to use
      it on the device) and whenever a tensor in it is touched: a module's parameters and inputs
      before its forward, its outputs after, a saved tensor when backward unpacks it, a gradient
      when it is accumulated, and every parameter, gradient and optimizer state at the optimizer
      step;
    - it stops being counted when the enforcer prefetches it to the host.

    The segment list is read again (a ctypes call) only when a touched address lies in no known
    segment, and at the optimizer step: a new segment no hook touches is counted from then on.

    Touches the hooks cannot see (a kernel reading a tensor that is neither a module input,
    output, parameter nor saved tensor) fault pages in without being counted, so the estimate can
    run under the truth between two hooks; the next touch of that segment counts it again.
    Eviction is per segment, not per page. For a read-mostly range a prefetch to the host makes a
    host copy but may leave the device duplicate in place: the estimate counts it as evicted.

Eviction is issued on the current stream, so it is ordered after the kernels that used the
segment, as the driver's own eviction would stall the work that needs the room. Not thread-safe:
hooks run on the thread running forward, and on autograd's thread for backward, one at a time.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from tiermem.errors import ConfigError, ConfigTypeError
from tiermem.pytorch.savedhooks import as_saved

__all__ = ["UMBudget", "UMBudgetStats"]


@dataclasses.dataclass
class UMBudgetStats:
    """Counters of one :class:`UMBudget`. Bytes are whole segments."""

    budget_bytes: int = 0
    resident_bytes: int = 0        # estimated on the device now
    peak_resident_bytes: int = 0   # the most estimated at once, after each enforcement
    peak_seen_bytes: int = 0       # the most estimated at once, before enforcement
    evictions: int = 0
    evicted_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        """Flat keys ``um_budget.<field>``."""
        return {f"um_budget.{k}": v for k, v in dataclasses.asdict(self).items()}


class UMBudget:
    """Hold the estimated device bytes of managed segments within ``budget`` bytes.

    segments  callable returning the live segments: objects with ``ptr``, ``nbytes`` and
              ``device`` (default: :func:`tiermem.torch_memory.torch_managed_allocations`).
    evict     callable ``(ptr, nbytes)`` that moves one segment to the host (default: a prefetch
              to the host through tiermem.cuda.runtime on torch's current stream).
    """

    def __init__(self, budget: int, device: int = 0, *, segments: Callable[[], Sequence[Any]] | None = None,
                 evict: Callable[[int, int], None] | None = None):
        if isinstance(budget, bool) or not isinstance(budget, int):
            raise ConfigTypeError(f"budget must be a number of bytes (an int), got {budget!r}")
        if budget < 0:
            raise ConfigError(f"budget must be a number of bytes >= 0, got {budget!r}")
        self.budget = budget
        self.device = device
        self._segments = segments if segments is not None else _torch_segments
        self._evict = evict if evict is not None else _prefetch_to_host(device)
        self._starts: list[int] = []          # sorted segment starts
        self._size: dict[int, int] = {}       # start -> bytes, every live segment
        self._resident: dict[int, int] = {}   # start -> last use clock, the ones counted on the device
        self._clock = 0
        self._used = 0                        # bytes of the segments in _resident
        self.stats = UMBudgetStats(budget_bytes=budget)

    # -- bookkeeping -----------------------------------------------------------------------------
    def refresh(self) -> None:
        """Take in new segments (counted on the device, just used) and drop freed ones."""
        live = {s.ptr: s.nbytes for s in self._segments() if s.device == self.device}
        if live.keys() == self._size.keys():
            return
        self._clock += 1
        for p in self._size.keys() - live.keys():
            if self._resident.pop(p, None) is not None:
                self._used -= self._size[p]
        for p in live.keys() - self._size.keys():
            self._resident[p] = self._clock
            self._used += live[p]
        self._size = live
        self._starts = sorted(live)

    def segment_of(self, ptr: int) -> int | None:
        """The start of the live segment holding address ``ptr``, or None."""
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            return None
        s = self._starts[i]
        return s if ptr < s + self._size[s] else None

    def touch_ptrs(self, ptrs: Iterable[int]) -> set[int]:
        """Count the segments holding these addresses on the device, as just used; their starts."""
        self._clock += 1
        hit = set()
        for p in ptrs:
            s = self.segment_of(p)
            if s is None:         # a segment made since the last refresh: take it in (NOTE above)
                self.refresh()
                s = self.segment_of(p)
            if s is not None:
                if s not in self._resident:
                    self._used += self._size[s]
                self._resident[s] = self._clock
                hit.add(s)
        return hit

    def touch(self, tensors: Iterable[Any]) -> set[int]:
        return self.touch_ptrs(p for p in (_ptr(t) for t in tensors) if p)

    @property
    def resident_bytes(self) -> int:
        return self._used

    def enforce(self, protect: Iterable[int] = ()) -> int:
        """Evict the least recently used segments, never those in ``protect`` (segment starts),
        until the estimate is within the budget or only protected ones are left. Returns the bytes
        evicted."""
        keep = set(protect)
        used = self.resident_bytes
        self.stats.peak_seen_bytes = max(self.stats.peak_seen_bytes, used)
        out = 0
        if used > self.budget:
            for s in sorted((s for s in self._resident if s not in keep), key=self._resident.__getitem__):
                if used <= self.budget:
                    break
                n = self._size[s]
                self._evict(s, n)
                del self._resident[s]
                self._used -= n
                used -= n
                out += n
                self.stats.evictions += 1
        self.stats.evicted_bytes += out
        self.stats.resident_bytes = used
        self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes, used)
        return out

    def use(self, tensors: Iterable[Any]) -> None:
        """Touch ``tensors`` and enforce the budget around them."""
        self.enforce(self.touch(tensors))

    # -- hooks -----------------------------------------------------------------------------------
    def attach(self, model: Any, optimizer: Any = None) -> list[Any]:
        """Hooks on every module with parameters or no children (before and after forward), on
        each parameter's gradient accumulation, and around ``optimizer.step``. Returns the handles
        for :meth:`detach`. Backward's reads of saved tensors are seen inside :meth:`saving`."""
        import torch
        hs = []
        for m in model.modules():
            if next(m.children(), None) is not None and not list(m.parameters(recurse=False)):
                continue
            own = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
            hs.append(m.register_forward_pre_hook(lambda m, args, own=own: self.use([*own, *_tensors(args)])))
            hs.append(m.register_forward_hook(lambda m, args, out: self.use(_tensors(out))))
        for p in model.parameters():
            if p.requires_grad:
                hs.append(p.register_post_accumulate_grad_hook(lambda p: self.use([p, p.grad])))
        if optimizer is not None:
            def opt_pre(opt: Any, args: Any, kwargs: Any) -> None:
                ts = [t for g in opt.param_groups for p in g["params"] for t in (p, p.grad)]
                ts += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
                self.refresh()
                self.touch(ts)
                self.enforce()     # the step needs all of it: what does not fit faults in
            hs.append(optimizer.register_step_pre_hook(opt_pre))
            hs.append(optimizer.register_step_post_hook(lambda opt, a, k: (self.refresh(), self.enforce())))
        return hs

    @staticmethod
    def detach(handles: list[Any]) -> None:
        for h in handles:
            h.remove()
        handles.clear()

    @contextlib.contextmanager
    def saving(self) -> Iterator[UMBudget]:
        """Within the block, tensors saved for backward are touched when backward reads them.
        Thread-local, as torch's saved_tensors_hooks are (the backward's unpack runs as set here)."""
        import torch

        def unpack(t: Any) -> Any:
            self.use([t])
            return t
        with torch.autograd.graph.saved_tensors_hooks(as_saved, unpack):   # NOTE [saved tensor cycle]
            yield self


def _ptr(t: Any) -> int:
    try:
        return t.data_ptr() if getattr(t, "is_cuda", False) else 0
    except RuntimeError:       # tensors without storage
        return 0


def _tensors(x: Any) -> list[Any]:
    if hasattr(x, "data_ptr"):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _torch_segments() -> Sequence[Any]:
    from tiermem.pytorch.allocator import torch_managed_allocations
    return torch_managed_allocations()


def _prefetch_to_host(device: int) -> Callable[[int, int], None]:
    def evict(ptr: int, nbytes: int) -> None:
        import torch

        from .cuda import runtime as _cuda
        from .roles import Location
        _cuda.prefetch(ptr, nbytes, Location.HOST, device, torch.cuda.current_stream(device).cuda_stream)
    return evict
