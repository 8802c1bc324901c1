"""Recomputing a segment's saved tensors in backward instead of keeping or swapping them.

NOTE [recompute]
    A *segment* is a module whose forward can run again in backward: by default each layer of the
    model's repeated stack (the children of its largest ``nn.ModuleList``: GPT blocks, the decoder
    layers of a transformers model). While a segment the plan recomputes runs forward, every
    tensor autograd saves is replaced by a reference (its index in the segment's saving order)
    and nothing is kept; the segment's inputs and its random-number state are held instead. The
    first time backward reads one of the references, the segment's forward runs again on the held
    inputs, under the same saved-tensor hooks, and each save is stored at its index; reads then
    take them one by one, and the inputs are let go once every reference has been read.

    This is torch.utils.checkpoint's non-reentrant scheme (saved-tensor hooks, a recompute on the
    first unpack, matching by saving order), kept as torch keeps it: the CPU RNG state and the
    states of the inputs' devices are saved before the forward and restored inside
    ``torch.random.fork_rng`` for the recompute (``get_device_states`` / ``set_device_states``
    from torch.utils.checkpoint), and autocast runs as it did. Dropout therefore draws the same
    mask twice, and gradients equal those of a run that kept everything, bit for bit.

    Why not call torch.utils.checkpoint itself: its recompute stores ``x.detach()`` of every
    saved tensor, a streamed parameter's too, and that is a view of the device slot the block
    sat in during the recompute. A segment has more blocks than there are slots, so by the time
    backward reads that weight the slot may hold another block. Here a streamed parameter is
    saved as the parameter itself and rebuilt from wherever it lives when backward reads it, as
    the swap does (NOTE [activation swap]). And one hook pair for keep, swap and recompute keeps
    the swap's saving order the trace's (StepTrace.visible).

    The segment's forward must save the same tensors the second time (torch's checkpoint asks
    the same); a segment that writes its own inputs in place cannot be recomputed.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ._errors import TierMemError

__all__ = ["Recompute", "repeated_layers"]


def repeated_layers(model: Any) -> list[Any]:
    """The children of the ``nn.ModuleList`` with the most parameters (at least two children),
    or [] where the model has none."""
    import torch.nn as nn
    best, size = None, 0
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) >= 2:
            n = sum(p.numel() for p in m.parameters())
            if n > size:
                best, size = m, n
    return list(best) if best is not None else []


def _map(x: Any, fn: Callable[[Any], Any]) -> Any:
    import torch
    if torch.is_tensor(x):
        return fn(x)
    if isinstance(x, tuple):
        return type(x)(*(_map(v, fn) for v in x)) if hasattr(x, "_fields") else tuple(_map(v, fn) for v in x)
    if isinstance(x, list):
        return [_map(v, fn) for v in x]
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    return x


def _tensors(x: Any) -> list[Any]:
    out: list[Any] = []
    _map(x, lambda t: out.append(t) or t)
    return out


def _detached(t: Any) -> Any:
    # Same values, no history; requires_grad as before, so each op saves what it saved.
    return t.detach().requires_grad_(t.requires_grad)


@dataclasses.dataclass(eq=False)
class _Run:
    """One forward of one segment."""

    seg: int
    module: Any
    active: bool                  # recomputed: its saves are references
    input_bytes: int
    args: Any = None
    kwargs: Any = None
    cpu_rng: Any = None
    devices: Any = None
    device_states: Any = None
    device_type: str = "cpu"
    autocast: Any = None
    n: int = 0                    # saves in forward
    values: dict[int, Any] | None = None
    replayed: int = 0             # saves in the recompute
    reads: int = 0


class _RcRef:
    __slots__ = ("run", "i")

    def __init__(self, run: _Run, i: int):
        self.run, self.i = run, i


class Recompute:
    """The recompute half of a training handle's saved-tensor hooks (NOTE [recompute]).

    ``segments``: the modules that can be recomputed, indexed by position. ``active``: the indices
    recomputed this step. ``on_segment(index, start)`` is called as a segment's first forward
    starts and ends (not its recompute), for the trace's timing. Not thread-safe.
    """

    def __init__(self, segments: Sequence[Any]):
        self.segments = list(segments)
        self.active: frozenset[int] = frozenset()
        self.on_segment: Callable[[int, bool], None] | None = None
        self.current: _Run | None = None      # the segment whose first forward is running
        self.replay: _Run | None = None       # the segment whose recompute is running
        self.input_bytes: dict[int, int] = {}
        # A streamed parameter's relocatable reference, or None for any other tensor; the swap
        # sets it (NOTE [activation swap]).
        self.param_ref: Callable[[Any], Any] = lambda t: None
        self._depth = 0
        self._hooks: list[Any] = []
        for i, m in enumerate(self.segments):
            self._hooks.append(m.register_forward_pre_hook(lambda m, a, k, i=i: self._pre(i, m, a, k),
                                                           with_kwargs=True))
            self._hooks.append(m.register_forward_hook(lambda m, a, o, i=i: self._post(i), always_call=True))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def begin(self, active: frozenset[int]) -> None:
        bad = [i for i in active if not 0 <= i < len(self.segments)]
        if bad:
            raise ValueError(f"no segments {bad}: there are {len(self.segments)}")
        self.active = frozenset(active)
        self.current = self.replay = None
        self._depth = 0

    def segment_now(self) -> int:
        """The segment whose first forward is running, or -1."""
        return self.current.seg if self.current is not None else -1

    # -- forward hooks -----------------------------------------------------------------------------
    def _pre(self, i: int, m: Any, args: Any, kwargs: Any) -> None:
        import torch
        if self.replay is not None or not torch.is_grad_enabled():
            return
        self._depth += 1
        if self._depth > 1:
            return                    # a segment inside a segment: the outer one decides
        seen: dict[int, int] = {}
        for t in _tensors((args, kwargs)):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        run = _Run(i, m, i in self.active, sum(seen.values()))
        self.input_bytes[i] = run.input_bytes
        if run.active:
            from torch.utils.checkpoint import get_device_states
            run.args, run.kwargs = _map(args, _detached), _map(kwargs, _detached)
            run.cpu_rng = torch.get_rng_state()
            run.devices, run.device_states = get_device_states(*_tensors((args, kwargs)))
            run.device_type = next((t.device.type for t in _tensors((args, kwargs)) if t.device.type != "cpu"), "cpu")
            if run.device_type != "cpu":
                run.autocast = (torch.is_autocast_enabled(run.device_type), torch.get_autocast_dtype(run.device_type))
        self.current = run
        if self.on_segment is not None:
            self.on_segment(i, True)

    def _post(self, i: int) -> None:
        if self.replay is not None or self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0 and self.current is not None:
            self.current = None
            if self.on_segment is not None:
                self.on_segment(i, False)

    # -- saved-tensor hooks ----------------------------------------------------------------------------
    def pack(self, t: Any) -> Any:
        """A reference for ``t`` when a recomputed segment's forward saves it, else None."""
        run = self.current
        if run is None or not run.active:
            return None
        ref = _RcRef(run, run.n)
        run.n += 1
        return ref

    def unpack(self, ref: _RcRef) -> Any:
        """The saved value behind ``ref``, recomputing its segment on the first read; a streamed
        parameter comes back as its reference, for the caller to rebuild."""
        run = ref.run
        if run.values is None or ref.i not in run.values:
            self._recompute(run)
        v = run.values.pop(ref.i)
        run.reads += 1
        if run.reads >= run.n:
            # Every reference read once: the inputs are no longer needed (a second read of the
            # same reference, as in a double backward, raises in _recompute).
            run.args = run.kwargs = None
            run.values = None
        return v

    def _recompute(self, run: _Run) -> None:
        import torch
        from torch.utils.checkpoint import set_device_states
        if run.args is None:
            raise TierMemError(f"segment {run.seg} ({type(run.module).__name__}) was read again after its "
                               "recompute let its inputs go; tiermem recomputes a segment for one backward")
        if self.replay is not None:
            raise TierMemError(f"segment {run.seg} needs recomputing while segment {self.replay.seg} is being "
                               "recomputed; segments must not read each other's saved tensors")
        run.values, run.replayed = {}, 0
        self.replay = run
        try:
            devices = run.devices if run.device_type != "cpu" else []
            with torch.random.fork_rng(devices=devices, device_type=run.device_type if devices else "cuda"):
                torch.set_rng_state(run.cpu_rng)
                if devices:
                    set_device_states(run.devices, run.device_states, device_type=run.device_type)
                amp = (torch.autocast(run.device_type, enabled=run.autocast[0], dtype=run.autocast[1])
                       if run.autocast is not None else _null())
                hooks = torch.autograd.graph.saved_tensors_hooks(self._replay_pack, _unreachable)
                with torch.enable_grad(), amp, hooks:
                    run.module(*run.args, **run.kwargs)
        finally:
            self.replay = None
        if run.replayed != run.n:
            raise TierMemError(f"segment {run.seg} ({type(run.module).__name__}) saved {run.n} tensors in "
                               f"forward but {run.replayed} when recomputed; a recomputed segment must save "
                               "the same tensors each time")


    def _replay_pack(self, t: Any) -> Any:
        r = self.replay
        v = self.param_ref(t)
        r.values[r.replayed] = v if v is not None else t.detach()
        r.replayed += 1
        return _DISCARDED


def _unreachable(x: Any) -> Any:
    # The recompute's own graph is dropped unread; reaching here means something kept it.
    raise TierMemError("a tensor saved while recomputing a segment was read; the recompute's graph is internal")


class _Discarded:
    """What a recompute's own graph keeps for each save: nothing (that graph is dropped)."""

    __slots__ = ()


_DISCARDED = _Discarded()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> bool:
        return False
