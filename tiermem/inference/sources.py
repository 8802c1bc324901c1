"""Where an adopted module's bytes come from (NOTE [weight source]): stand-ins for its meta
tensors (:func:`stand_ins`), and resident groups filled from their sources, a checkpoint's tensors
read through a few pinned buffers (:func:`wrap_from`). Each source is checked against the module
first, in inference/weights.py."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..core.stream import Lane
from ..roles import Location, Policy, Role
from .load import FileTensor, Reader, host_bytes

if TYPE_CHECKING:
    from ..core.engine import Engine as Tier  # what an adapter uses is the engine's interface
    from ..core.tensor import TieredTensor

__all__ = ["stand_ins", "origin", "materialize", "wrap_from", "FILL_CHUNK", "FILL_BUFFERS"]


# NOTE [weight source]
#     ``weights`` (a Mapping from the module's state-dict names to tensors, or to the FileTensors of
#     a Checkpoint) gives each tensor's bytes in place of the tensor itself, so a module built on
#     the meta device (no memory) can be adopted: resident groups are filled from the source one
#     tensor at a time, streamed groups are written straight into their pinned home (a checkpoint's
#     bytes are read from the file into it, NOTE [reading a checkpoint]), and no full host copy of
#     the model is ever made. A tensor known under several names (tied weights) takes the first of
#     its names the source has. A tensor the source lacks keeps its own bytes; a meta tensor the
#     source lacks is refused before anything is allocated, as is a source tensor whose shape or
#     dtype is not the module's (convert the source first; load_pretrained does with ``dtype=``).
#     A meta tensor had no device of its own: unwrap restores it onto the host (or the device
#     asked for). Adoption stays all or nothing (NOTE [all or nothing] in inference/module.py).


def stand_ins(module: Any) -> list[tuple[dict, str, Any, Any]]:
    """Give every meta parameter and buffer of ``module`` a stand-in of its shape and dtype that
    holds one element (an expanded host tensor), which adoption then rebinds to real memory;
    (container, name, meta tensor, stand-in) each. A tensor under several names (tied weights)
    gets one stand-in."""
    import torch
    made: dict[int, Any] = {}
    out = []
    for m in module.modules():
        for box in (m._parameters, m._buffers):
            for name, t in list(box.items()):
                if t is None or not t.is_meta:
                    continue
                new = made.get(id(t))
                if new is None:
                    one = torch.empty((), dtype=t.dtype) if t.dim() == 0 else torch.empty(1, dtype=t.dtype).expand(t.shape)
                    new = torch.nn.Parameter(one, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else one
                    made[id(t)] = new
                box[name] = new
                out.append((box, name, t, new))
    return out


def origin(t: Any) -> Any:
    """Where unwrap puts a tensor back by default: its own device (a meta tensor's stand-in is on
    the host)."""
    return t.device


def materialize(src: Any) -> Any:
    """A source's data as a torch tensor: the tensor itself, or a checkpoint tensor read now."""
    import torch
    return src if isinstance(src, torch.Tensor) else src.tensor()


FILL_CHUNK = 256 << 20   # host bytes resident tensors are read through, reused: a full tensor could be 1 GB
FILL_BUFFERS = 2


class _Filler:
    """Writes checkpoint tensors into device memory through FILL_BUFFERS pinned buffers of up to
    FILL_CHUNK bytes taken in turn, so that one buffer is read from the files while the last one
    crosses the link, and the host never holds a whole tensor. Tensors are packed end to end
    into a buffer (a large one spans several), and each buffer is read in one go on the reader's
    threads: read a tensor at a time, through 64 MiB buffers, most tensors were too small to keep
    the reader's threads busy (docs/inference.md, "Loading a checkpoint"). ``close()`` reads what is queued, waits for the copies and
    gives the buffers back; call it in every case (``discard()`` after a failure)."""

    def __init__(self, tier: Tier, sources: list[Any], room: int | None = None):
        self.be = tier.backend
        total = sum(x.nbytes for x in sources if isinstance(x, FileTensor))
        # Within ``room`` host bytes: what the budget leaves beside the home (NOTE [home beside
        # the resident groups] in inference/transport.py), or all of it when the home is made after.
        cap = FILL_CHUNK if room is None else max(4096, min(FILL_CHUNK, room // FILL_BUFFERS))
        self.size = min(cap, total)
        self.lane = Lane(self.be, self.be.current_stream)   # the stream later fills and reads use
        self.bufs: list[Any] = []
        self.done: list[Any] = [None] * FILL_BUFFERS     # per buffer: its last copy's end event
        self.turn = 0
        self.queued: list[tuple[FileTensor, int, int, int, int]] = []   # (src, start, n, dst, at)
        self.used = 0

    def add(self, dst: int, src: FileTensor) -> None:
        """Queue ``src``'s bytes for the device memory at ``dst``."""
        s = 0
        while s < src.nbytes:
            n = min(src.nbytes - s, self.size - self.used)
            self.queued.append((src, s, n, dst + s, self.used))
            self.used += n
            s += n
            if self.used == self.size:
                self._flush()

    def _flush(self) -> None:
        if not self.queued:
            return
        i, self.turn = self.turn, (self.turn + 1) % FILL_BUFFERS
        buf = self._buffer(i)
        if self.done[i] is not None:
            self.be.synchronize(self.done[i])   # its last bytes have crossed: reuse it
        queued, self.queued, self.used = self.queued, [], 0
        reader = Reader.shared()
        # In pieces that keep every reader thread busy: a buffer made small by a host budget
        # (140 MB for bench/offload_disk.py) is otherwise read in a few of the reader's chunks.
        piece = max(1 << 20, -(-self.size // reader.threads))
        reader.read_parts([(src, s + o, host_bytes(buf.ptr + at + o, min(piece, n - o)))
                           for src, s, n, _, at in queued for o in range(0, n, piece)])
        self.done[i] = self.lane.run([(dst, buf.ptr + at, n) for _, _, n, dst, at in queued])[1]

    def prepare(self) -> None:
        """Make the pinned buffers now (NOTE [home beside the resident groups]: before a thread
        starts faulting in the home's pages, which slows the mappings made beside it)."""
        if self.size:
            for i in range(FILL_BUFFERS):
                self._buffer(i)

    def _buffer(self, i: int) -> Any:
        while i >= len(self.bufs):
            self.bufs.append(self.be.host_alloc(self.size, pooled=False))
        return self.bufs[i]

    def close(self) -> None:
        """Read and copy what is queued, and wait for every copy."""
        try:
            self._flush()
        finally:
            self.discard()

    def discard(self) -> None:
        """Wait for the copies under way and give the buffers back; what is queued is dropped."""
        self.queued, self.used = [], 0
        try:
            for ev in self.done:
                if ev is not None:
                    self.be.synchronize(ev)
        finally:
            for b in self.bufs:
                b.release()
            self.bufs, self.done = [], [None] * FILL_BUFFERS


def _view_of(tier: Tier, b: Any, t: Any) -> Any:
    """A torch view of buffer ``b`` shaped as ``t``."""
    return tier.backend.torch_view(b.ptr, b.nbytes, b.token(internal=True)).view(t.dtype).view(t.shape)


def wrap_from(tier: Tier, tensors: list[Any], sources: list[Any], names: list[str], policy: Policy,
               room: int | None = None, ready: Callable[[], None] | None = None) -> list[TieredTensor]:
    """wrap_group's steps (one managed allocation, filled from the device side, each tensor rebound)
    with each tensor's bytes taken from its source (or itself): checkpoint tensors read through
    a few pinned buffers (:class:`_Filler`, within ``room`` host bytes), others one at a time, so
    the host never holds more than one tensor of a resident group (NOTE [weight source]).
    ``ready()``, if given, is called once the fill buffers exist, before any read."""
    import torch

    from ..base.dtypes import canonical
    from ..pytorch.wrap import fill_and_bind
    role = Role.WEIGHT if any(t.requires_grad for t in tensors) else Role.FROZEN_WEIGHT
    specs = [(tuple(t.shape), canonical(t.dtype)) for t in tensors]
    tts = tier.empty_group(specs, role=role, names=names, policy=Policy(preferred_location=Location.DEVICE))
    filler = _Filler(tier, sources, room)
    views: list[Any] = []
    try:
        if ready is not None:
            filler.prepare()
            ready()
        with torch.no_grad():
            views += [_view_of(tier, tt.buffer, t) for tt, t in zip(tts, tensors)]
            for tt, src in zip(tts, sources):
                if isinstance(src, FileTensor):
                    filler.add(tt.buffer.ptr, src)
            filler.close()
            for tt, t, src, view in zip(tts, tensors, sources, views):
                home = origin(t)
                if src is not None:
                    if not isinstance(src, FileTensor):
                        view.copy_(materialize(src))
                    # Bound to its own filled memory, so fill_and_bind's copy is one of the memory
                    # onto itself; the caller's rollback rebinds the original on failure.
                    t.data = view
                fill_and_bind(tier, tt, t)
                tt._origin_device = home
        tier.change_policies([tt.buffer for tt in tts], policy)
    except BaseException:
        filler.discard()
        views.clear()      # a traceback keeps this frame: its views must not keep the memory
        view = None        # noqa: F841
        for tt in tts:
            tt.buffer.bindings = []
            tt.free()
        raise
    return tts
