"""Activation swapping: what autograd saves for backward goes to pinned host memory and comes back.

NOTE [activation swap]
    A ``torch.autograd.graph.saved_tensors_hooks`` pair sees every tensor autograd saves. tiermem
    works per *storage*: views of one storage (q, k and v split from one projection) are saved
    once and rebuilt from it, so nothing is copied twice and non-contiguous views need no copy of
    their own. Three kinds of saved tensor:

      - a view of a streamed parameter: saved as (parameter, geometry) and rebuilt from wherever
        the parameter lives when backward reads it (its slot may hold another block by then);
      - a storage the plan keeps (NOTE [training plan]), or one under ``min_swap`` bytes: kept;
      - the rest: copied to a pinned host arena on tiermem's D2H stream as soon as it is saved,
        and copied back on the H2D stream ahead of backward's need, in the order the traced step
        read them (in the first step: latest saved first).

    The device storage of a swapped tensor is held until its copy has finished, then dropped, so
    torch's allocator reuses it. Holding is bounded: past ``window`` bytes in flight the host
    waits for the oldest copy, so a forward that makes activations faster than the link carries
    them cannot grow the device peak. Copies back are bounded the same way.

    A view of a resident block's parameter is saved as it is: it never leaves the device.

    A parameter's low-precision cast (autocast's copy of an fp32 weight, which a matmul's backward
    reads) is saved as the parameter and the dtype, and cast again from the parameter when
    backward reads it (NOTE [saved casts]).

NOTE [saved casts]
    Under ``torch.autocast`` a linear layer saves the bf16 copy of its weight for backward. As
    an activation it would cross the link twice a step, half the weight's bytes each way, for
    a copy of bytes the block brings back into its slot for its own backward anyway. So the
    swap knows a cast of one of the training's parameters by its autograd node (a ToCopy whose
    input is the parameter's AccumulateGrad) and keeps only which parameter and dtype it was:
    backward casts the parameter again. The parameter has not stepped by then (a block steps
    once its gradients are complete, after the backward that read the cast), and a cast is
    exact and deterministic, so the bits are the ones autocast made.

    Each saved storage is known by its *key*: the block whose forward saved it (its segment,
    -1 outside every block) and its place among that segment's saves. Keys, not places in the
    whole step, are what the plan names, so a segment that is recomputed (and saves only its
    inputs, NOTE [recompute plan]) leaves the other segments' keys as the trace saw them. A
    step whose sizes differ from the trace's, key by key, has another shape: it swaps
    everything and is traced again.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Any

from ..core.stream import ALIGN, Lane, PinnedArena, now
from ..errors import TierMemError
from ..pytorch.savedhooks import as_saved
from ..roles import Role

if TYPE_CHECKING:
    from ..core.engine import Engine as Tier  # what an adapter uses is the engine's interface

__all__ = ["ANOTHER_PATH", "ActivationSwap"]

# NOTE [another path under capture] in training/handle.py
ANOTHER_PATH = ("the step saved other tensors while captured than in its eager steps: the model takes another "
                "path under a CUDA graph capture (transformers' SDPA attention builds its mask only while "
                "capturing, and with grouped-query attention that changes its kernels): pass the attention "
                "mask as a 4-D tensor built once, or train with train.step()")

@dataclasses.dataclass(eq=False)
class _Saved:
    index: int
    nbytes: int
    keep: bool
    seg: int = -1                 # the block whose forward saved it; -1: outside every block
    part: int = -1                # the part of it that saved it (NOTE [recompute in parts] in training/plan.py)
    k: int = 0                    # its place among its segment's saves
    segs: set[int] = dataclasses.field(default_factory=set)   # segments that saved it
    refs: int = 0                 # saved tensors that are views of it
    reads: int = 0                # unpacks so far
    use: int = -1                 # order of its first unpack in backward
    storage: Any = None           # the device storage while kept or while its copy out runs
    ref: Any = None               # a weak reference to it once the copy is done (see pack)
    host: int = 0                 # address in the pinned arena
    out_event: Any = None
    dev: Any = None               # uint8 device tensor holding it again in backward
    in_event: Any = None


class _Ref:
    __slots__ = ("s", "dtype", "size", "stride", "offset")

    def __init__(self, s: Any, t: Any):
        self.s, self.dtype, self.size, self.stride, self.offset = s, t.dtype, t.size(), t.stride(), t.storage_offset()


class _ParamRef(_Ref):
    pass


class _CastRef(_Ref):
    """A view of parameter ``s`` cast to ``to`` (NOTE [saved casts])."""
    __slots__ = ("to",)

    def __init__(self, p: Any, t: Any):
        super().__init__(p, t)
        self.to = t.dtype


class ActivationSwap:
    """The saved-tensor hooks of one training handle (NOTE [activation swap])."""

    def __init__(self, tier: Tier, params: Any, *, min_swap: int, window: int, device: Any):
        self.tier = tier
        self.device = device          # where the step's tensors live (NOTE [device memory] in pytorch/devmem.py)
        self.params = params          # storage address -> parameter, for streamed parameters
        self.fixed: set[int] = set()  # storage addresses of resident parameters: saved as they are
        self.trained: dict[int, Any] = {}   # id -> the training's parameters, whose casts are saved as such
        self.min_swap = int(min_swap)
        self.window = int(window)
        self.arena = PinnedArena(tier.backend)
        self.out_lane = Lane(tier.backend, lambda: tier.side_stream("d2h"))
        self.in_lane = Lane(tier.backend, lambda: tier.side_stream("h2d"))
        self.expect: dict[int, tuple[int, ...]] | None = None   # per segment, sizes in saving order
        self.keep: frozenset[tuple[int, int]] = frozenset()      # keys kept on the device
        self.recompute: frozenset[int] = frozenset()            # segments recomputed in backward
        self.need: list[tuple[int, int]] = []                   # swapped keys in backward-read order
        self.diverged = False
        self.segment: Any = lambda: -1      # the innermost block in forward (set by the training handle)
        self.part: Any = lambda: -1         # its part in forward (NOTE [recompute in parts] in training/plan.py)
        self.capturing: Any = lambda: False  # a CUDA graph captures the step (set by the training handle)
        self.meter: Any = None              # times the step's waits (the training handle's StallMeter)
        self._begin_fields()

    def _begin_fields(self) -> None:
        self.saved: list[_Saved] = []
        self.by_ptr: dict[int, _Saved] = {}
        self.by_key: dict[tuple[int, int], _Saved] = {}
        self.count: dict[int, int] = {}
        self.out_q: collections.deque[_Saved] = collections.deque()
        self.out_bytes = 0
        self.in_bytes = 0
        self.cursor = 0
        self.reads = 0
        self.moved = {"h2d": 0, "d2h": 0}

    # -- per step --------------------------------------------------------------------------------
    def begin(self, expect: dict[int, tuple[int, ...]] | None, keep: frozenset[tuple[int, int]],
              need: list[tuple[int, int]], recompute: frozenset[int] = frozenset()) -> None:
        self._begin_fields()
        self.arena.reset()
        self.expect, self.keep, self.need, self.recompute = expect, keep, need, recompute
        self.diverged = False

    def end(self) -> None:
        be = self.tier.backend
        while self.out_q:
            s = self.out_q.popleft()
            be.synchronize(s.out_event)
            s.storage = None
        for s in self.saved:
            s.storage = s.dev = None
        self.by_ptr.clear()
        self.by_key.clear()

    def records(self) -> list[tuple[int, int, int, int, int]]:
        """(index, nbytes, first read, segment, part) of each saved storage this step."""
        return [(s.index, s.nbytes, s.use, s.seg, s.part) for s in self.saved]

    def shared_segments(self) -> set[int]:
        """Segments that saved a storage another segment saved too: recomputing one would move
        that save to the other segment and change its keys."""
        return {g for s in self.saved if len(s.segs) > 1 for g in s.segs}

    # -- hooks -------------------------------------------------------------------------------------
    def pack(self, t: Any) -> Any:
        # what stays on the device goes to autograd as an alias (NOTE [saved tensor cycle])
        if t.device != self.device or t.numel() == 0:
            return as_saved(t)
        st = t.untyped_storage()
        ptr = st.data_ptr()
        p = self.params.get(ptr)
        if p is not None:
            return _ParamRef(p, t)
        if ptr in self.fixed:
            # A resident block's parameter: it stays on the device, and saving it as an
            # activation would swap a weight and give the step keys the trace never saw.
            return as_saved(t)
        p = _cast_of(t, self.trained)
        if p is not None:
            return _CastRef(p, t)          # NOTE [saved casts]
        n = st.nbytes()
        if n < self.min_swap:
            return as_saved(t)
        s = self.by_ptr.get(ptr)
        if s is not None and s.storage is None and (s.ref is None or s.ref.expired() or s.ref.cdata != st._cdata):
            s = None                     # the address was handed out again: a new storage, a new save
        seg = self.segment()
        if s is None or s.nbytes != n:
            k = self.count.get(seg, 0)
            self.count[seg] = k + 1
            if self.expect is None or self.diverged:
                keep = False
            elif seg in self.recompute:
                keep = False             # a recomputed block's inputs (NOTE [recompute plan])
            else:
                sizes = self.expect.get(seg, ())
                if k < len(sizes) and sizes[k] == n:
                    keep = (seg, k) in self.keep
                else:
                    self.diverged = True     # another step shape: swap everything, trace again
                    keep = False
                    if self.capturing():
                        # NOTE [another path under capture]: refused before the capture queues
                        # anything the eager steps did not (a new piece of the pinned arena is a
                        # cudaHostAlloc, which CUDA refuses while a stream captures)
                        raise TierMemError(ANOTHER_PATH)
            s = _Saved(len(self.saved), n, keep, seg, k=k, part=self.part())
            self.saved.append(s)
            self.by_ptr[ptr] = s
            self.by_key[(seg, k)] = s
            if keep:
                s.storage = st
            else:
                self._out(s, st, ptr)
        s.segs.add(seg)
        s.refs += 1
        if s.keep:
            return as_saved(t)
        return _Ref(s, t)

    def unpack(self, ref: Any) -> Any:
        import torch
        if not isinstance(ref, _Ref):
            return ref
        if isinstance(ref, _ParamRef):
            p = ref.s
            self.on_param(p)
            return torch.as_strided(p.data, ref.size, ref.stride, ref.offset)
        if isinstance(ref, _CastRef):     # NOTE [saved casts]
            p = ref.s
            self.on_param(p)
            return torch.as_strided(p.data.to(ref.to), ref.size, ref.stride, ref.offset)
        s = ref.s
        if s.use < 0:
            s.use = self.reads
            self.reads += 1
        be = self.tier.backend
        cur = be.current_stream()
        if s.dev is None:
            self._in(s, cur)
        self._ahead(cur)
        self._wait(cur, s.in_event)
        dev = s.dev
        s.reads += 1
        if s.reads >= s.refs:
            s.dev = None               # autograd holds the view until it is done with it
            self.in_bytes -= s.nbytes
        return torch.as_strided(dev.view(ref.dtype), ref.size, ref.stride, ref.offset)

    def on_param(self, p: Any) -> None:
        """Called when backward reads a streamed parameter (the training handle loads it)."""

    def _wait(self, stream: int, event: Any) -> None:
        if self.meter is not None:
            self.meter.wait(stream, event)
        else:
            self.tier.backend.wait(stream, event)

    def _host_wait(self, event: Any) -> None:
        if self.meter is not None:
            with self.meter.host():
                self.tier.backend.synchronize(event)
        else:
            self.tier.backend.synchronize(event)

    # -- moves -------------------------------------------------------------------------------------
    def _out(self, s: _Saved, st: Any, ptr: int) -> None:
        tier = self.tier
        if self.capturing() and not _arena_holds(self.arena, s.nbytes):
            raise TierMemError(ANOTHER_PATH)     # the same: the eager steps never swapped this much
        self.out_lane.after([now()])
        s.host = self.arena.take(s.nbytes, self.meter.host() if self.meter is not None else None)
        _, s.out_event = self.out_lane.run([(s.host, ptr, s.nbytes)], after=())
        s.storage = st                 # held until the copy is done (see _reap)
        self.out_q.append(s)
        self.out_bytes += s.nbytes
        self.moved["d2h"] += s.nbytes
        tier.accounting.on_move(Role.ACTIVATION, "d2h", s.nbytes)
        tier.accounting.count(Role.ACTIVATION, "evict_ops")
        self._reap(block=self.out_bytes > self.window)

    def _reap(self, block: bool) -> None:
        be = self.tier.backend
        while self.out_q:
            s = self.out_q[0]
            if not be.query(s.out_event):
                if not block:
                    return
                self._host_wait(s.out_event)
            self.out_q.popleft()
            self.out_bytes -= s.nbytes
            # Once dropped, its address may be handed out again, and a new storage there is a new
            # save; while the storage lives, a save of it is the same save whenever the copy ended
            # (a step's keys must not depend on the link's timing: NOTE [activation swap]).
            from torch.multiprocessing.reductions import StorageWeakRef
            s.ref = StorageWeakRef(s.storage)
            s.storage = None
            block = block and self.out_bytes > self.window

    def _in(self, s: _Saved, cur: int) -> None:
        import torch
        tier, be = self.tier, self.tier.backend
        if s.out_event is not None and not be.query(s.out_event):
            self._host_wait(s.out_event)
        # Allocated on the compute stream; the copy waits for that stream so the memory's last
        # user there is done, and the compute stream waits for the copy before reading it.
        s.dev = torch.empty(s.nbytes, dtype=torch.uint8, device=self.device)
        _, s.in_event = self.in_lane.run([(s.dev.data_ptr(), s.host, s.nbytes)], after=[now(cur)])
        self.in_bytes += s.nbytes
        self.moved["h2d"] += s.nbytes
        tier.accounting.on_move(Role.ACTIVATION, "h2d", s.nbytes)
        tier.accounting.count(Role.ACTIVATION, "prefetch_ops")

    def _ahead(self, cur: int) -> None:
        """Start copies back for the next swapped storages backward will read, up to ``window``."""
        order = self.need if self.need and not self.diverged else None
        if order is None:
            # No trace yet: backward reads roughly in reverse order of saving.
            order = [(s.seg, s.k) for s in reversed(self.saved) if not s.keep]
            self.need = order
        while self.cursor < len(order) and self.in_bytes < self.window:
            key = order[self.cursor]
            self.cursor += 1
            s = self.by_key.get(key)
            if s is None:
                continue
            if s.keep or s.dev is not None or s.reads >= s.refs:
                continue
            self._in(s, cur)


def _arena_holds(arena: PinnedArena, nbytes: int) -> bool:
    """Whether ``arena`` hands out ``nbytes`` more from the chunks it has (no new allocation)."""
    n = -(-nbytes // ALIGN) * ALIGN
    c, off = arena.at
    while c < len(arena.chunks) and off + n > arena.chunks[c].nbytes:
        c, off = c + 1, 0
    return c < len(arena.chunks)


_TO_COPY: list[Any] = []


def _cast_of(t: Any, params: dict[int, Any]) -> Any:
    """The parameter of ``params`` whose dtype cast ``t`` is a view of, or None (NOTE [saved casts]).
    A cast's autograd node is a ToCopy whose one input is the parameter's AccumulateGrad; its
    type is read from a cast made once, not from a name."""
    if not params:
        return None
    # torch's Tensor._base (what a view was made from), read by name: the package's own members
    # named so are another matter (tests/test_layers.py)
    base = getattr(t, "_base", None)  # noqa: B009
    if base is None:
        base = t
    fn = base.grad_fn
    if fn is None:
        return None
    if not _TO_COPY:
        import torch
        with torch.enable_grad():         # hooks run with autograd off
            _TO_COPY.append(type(torch.zeros(1, requires_grad=True).to(torch.float64).grad_fn))
    if type(fn) is not _TO_COPY[0]:
        return None
    nxt = fn.next_functions
    acc = nxt[0][0] if len(nxt) == 1 else None
    p = getattr(acc, "variable", None)
    if p is None or params.get(id(p)) is not p or p.dtype == t.dtype or base.shape != p.shape \
            or not base.is_contiguous() or base.storage_offset() != 0:
        return None
    return p
