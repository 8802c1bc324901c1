"""The pinned transport of an adopted module (:class:`PinnedTransport`): its streamed groups in one
pinned host buffer, their home, copied ahead of use into a window of device slots on tiermem's H2D
stream and read in place from the home otherwise (NOTE [streaming plan] in inference/plan.py); and
:class:`Group`, a group's record, resident or streamed, which the handle and the transport share."""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..core.stream import Lane, SlotRing, now
from ..roles import Role
from . import quant
from .disk import DiskTier
from .groups import home_layout
from .load import FileTensor, Reader, host_bytes
from .plan import Plan
from .sources import materialize, origin
from .prequant import copy_packed
from .split import ALIGN, ROW_ALIGN, rows_per_part

if TYPE_CHECKING:
    from ..core.engine import Engine as Tier  # what an adapter uses is the engine's interface

__all__ = ["Group", "Piece", "PinnedTransport", "SharedHome", "packed_layout", "staging_bytes", "part_staging",
           "member_rows"]

log = logging.getLogger("tiermem")


@dataclasses.dataclass(eq=False)
class Group:
    """A group of the module's tensors, which move together (NOTE [streaming plan] in inference/plan.py):
    resident in one managed allocation (``tiered``), or streamed from ``offset`` in the pinned home."""

    name: str
    tensors: list[Any]            # the module's torch tensors (parameters and buffers)
    nbytes: int
    pinned: bool = False
    tiered: list[Any] = dataclasses.field(default_factory=list)   # TieredTensors of a resident group
    offset: int = 0               # where a streamed group starts in the pinned home
    member_offsets: list[int] = dataclasses.field(default_factory=list)
    in_slot: list[bool] = dataclasses.field(default_factory=list)   # members a slot serves while in use
    gathered: bool = False        # only embeddings read it: read in place, never given a slot
    stacked: bool = False         # one slice per expert: a decode reads it in place (routed experts only)
    on_disk: bool = False         # read from its files ahead of use (NOTE [disk tier]); it has no home
    oversized: bool = False       # bigger than a slot and not cut: read in place whole (NOTE [no plan collapse])
    cut: Any = None               # how it can be cut (inference/split.py's Cut), or None
    split: bool = False           # streamed in parts (NOTE [split groups])
    pieces: list[Piece] = dataclasses.field(default_factory=list)   # what slots hold of it: itself, or its parts
    # NOTE [quantized streaming] in inference/quant.py: per member, its quant.Packing or None
    # (kept as it is); empty when nothing of the group is packed. A packed group's home holds
    # its members back to back from ``packed_offsets``, ``packed_nbytes`` in all.
    packing: list[Any] = dataclasses.field(default_factory=list)
    packed_offsets: list[int] = dataclasses.field(default_factory=list)
    packed_nbytes: int = 0
    cached: bool = False          # stacked experts the expert cache serves in a decode (NOTE [expert cache])

    @property
    def packed(self) -> bool:
        return any(p is not None for p in self.packing)

    @property
    def dual(self) -> bool:
        """A packed group whose rows an embedding also reads in place (a tied table): its home
        holds it in the model's dtype too, before the packed bytes (NOTE [packed tied table])."""
        return self.packed and self.cut is not None and bool(self.cut.gathers)

    @property
    def home_offsets(self) -> list[int]:
        """Where each member starts in the group's home, in the model's dtype where it has that."""
        return self.packed_offsets if self.packed and not self.dual else self.member_offsets

    @property
    def link_bytes(self) -> int:
        """Bytes the group moves over the link when it streams."""
        return self.packed_nbytes if self.packed else self.nbytes

    def slot_in(self, mode: str) -> bool:
        """Whether a forward in ``mode`` brings this (streamed) group into a slot."""
        if self.gathered or self.oversized or mode == "zero_copy":
            return False
        if mode == "stream" or not self.stacked:
            return True
        # A decode: the routed experts are read in place, or come through the expert cache;
        # with no home in the model's dtype to read (on disk, packed) the group streams.
        return not self.cached and (self.on_disk or self.packed)


def _up(n: int) -> int:
    return -(-max(int(n), 1) // quant.ALIGN) * quant.ALIGN


# NOTE [packed tied table]
#     A table tied to its head (Gemma's, Llama 3.2's) is read two ways: the embedding looks up
#     the rows of its tokens in place, in the model's dtype, and the head reads every row. Kept
#     as it is, its home streamed to the head unpacked, so Gemma's int4 forward moved 2.40 GB, of
#     which 1.57 GB was that table. Packed, it keeps both: the table as it is (the embedding's,
#     and what unwrap restores, exactly), then its packed bytes, which are what crosses the link
#     for the head. The home grows by the packed bytes (a quarter of the table for int4, half for
#     int8); the link carries them instead of the table.
def home_size(tensors: list[Any], packing: list[Any], dual: bool) -> int:
    """Bytes of a group's home: its members as they are, packed, or both (NOTE [packed tied table])."""
    plain = home_layout(tensors)[1]
    if not any(p is not None for p in packing):
        return plain
    packed = packed_layout(tensors, packing)[1]
    return _up(plain) + packed if dual else packed


def member_rows(t: Any, p: Any) -> int:
    """The rows a member of a packed group is streamed by: its packing's, else its leading dimension's."""
    return p.rows if p is not None else (int(t.shape[0]) if t.dim() >= 1 and t.shape[0] else 1)


def _row_bytes(t: Any) -> int:
    return t.numel() * t.element_size() // member_rows(t, None)


def staging_bytes(tensors: list[Any], packing: list[Any]) -> int:
    """The staging buffer a packed group needs (NOTE [quantized streaming]): its packed bytes, or
    QSTAGE_BYTES when they are more (it then crosses a chunk of rows at a time), never less than
    its largest row and two alignments."""
    rows = max((p.row_q + p.row_s if p is not None else _row_bytes(t) for t, p in zip(tensors, packing)), default=0)
    return min(packed_layout(tensors, packing)[1], max(quant.QSTAGE_BYTES, rows + 2 * quant.ALIGN))


def part_staging(tensors: list[Any], packing: list[Any], cut: Any) -> tuple[int, int]:
    """(bytes one unit of ``cut``, a row or an expert, takes staged, bytes beside) of a packed
    group that can be cut: a part of k units needs at most k times the first plus the second
    (NOTE [packed parts] in inference/plan.py; :func:`_piece_staging` is the exact need)."""
    per = sum(member_rows(tensors[i], packing[i]) // cut.length
              * (packing[i].row_q + packing[i].row_s if packing[i] is not None else _row_bytes(tensors[i]))
              for i in cut.members)
    return per, 2 * quant.ALIGN * (len(cut.members) + 1)


def _piece_staging(p: Piece) -> int:
    """The staging buffer piece ``p`` of a packed group needs to cross in one chunk, or the
    group's (:func:`staging_bytes`) when that is less."""
    g = p.group
    whole = staging_bytes(g.tensors, g.packing)
    if p.whole:
        return whole
    n = 2 * quant.ALIGN
    for i in p.members:
        t, q = g.tensors[i], g.packing[i]
        k = member_rows(t, q) // g.cut.length * (p.hi - p.lo)
        n += q.rows_nbytes(k) if q is not None else _up(k * _row_bytes(t))
    return min(whole, n)


def _merged(parts: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``parts`` ((dst offset, src address, bytes), in order) with neighbours that lie alike on
    both sides (the same gap, less than an alignment, after the one before) made one copy that
    also carries the gap's padding: a whole member's values and scales, and the whole members
    after it, lie in a staging buffer as in their home, so a chunk of them is one copy."""
    out: list[tuple[int, int, int]] = []
    for d, src, n in parts:
        if out:
            pd, ps, pn = out[-1]
            gap = d - (pd + pn)
            if 0 <= gap < quant.ALIGN and src - (ps + pn) == gap:
                out[-1] = (pd, ps, pn + gap + n)
                continue
        out.append((d, src, n))
    return out


def split_parts(parts: list[tuple[int, int, int]], keep: int,
                align: int = 4096) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """``parts`` ((offset, src, nbytes)) cut after about ``keep`` bytes, on an ``align`` boundary
    of the parts' running total: (the first ``keep``, the rest)."""
    keep = -(-keep // align) * align
    head, tail, at = [], [], 0
    for o, src, n in parts:
        k = min(max(keep - at, 0), n)
        if k:
            head.append((o, src, k))
        if n - k:
            tail.append((o + k, src + k, n - k))
        at += n
    return head, tail


def packed_layout(tensors: list[Any], packing: list[Any]) -> tuple[list[int], int]:
    """(offset of each member, bytes) of a packed group's home: members back to back, a packed
    one as its quant.Packing lays it out, the others as they are, each 256-byte aligned."""
    offs, n = [], 0
    for t, p in zip(tensors, packing):
        offs.append(n)
        n += p.nbytes if p is not None else -(-max(t.numel() * t.element_size(), 1) // quant.ALIGN) * quant.ALIGN
    return offs, n


@dataclasses.dataclass(eq=False)
class Piece:
    """What one slot holds: a streamed group whole, or rows ``lo`` to ``hi`` of each of its
    cut's members (a part, NOTE [split groups]). ``members`` are the indices of the group's
    tensors it holds; ``ranges`` their bytes as (offset in the slot, offset in the group's home
    layout, bytes) and ``shapes`` their shapes in the slot. A disk tier's staging buffer holds a
    piece as the slot does."""

    group: Group
    nbytes: int
    members: list[int]
    ranges: list[tuple[int, int, int]]
    shapes: list[tuple[int, ...]]
    lo: int = 0
    hi: int = 0                   # 0: the whole group

    @property
    def whole(self) -> bool:
        return self.hi == 0

    @property
    def name(self) -> str:
        return self.group.name if self.whole else f"{self.group.name}[{self.lo}:{self.hi}]"

    def slot_offsets(self) -> list[int]:
        """Where each tensor starts in the slot."""
        if self.whole:
            return list(self.group.member_offsets)
        return [so for so, _, _ in self.ranges]


def pieces_of(g: Group, cap: int) -> list[Piece]:
    """``g`` whole, or, if it is split, its parts of at most ``cap`` bytes (NOTE [split groups])."""
    if not g.split:
        return [Piece(g, g.nbytes, list(range(len(g.tensors))), [(0, 0, g.nbytes)],
                      [tuple(t.shape) for t in g.tensors])]
    length, members = g.cut.length, list(g.cut.members)
    ts = [g.tensors[i] for i in members]
    rows = rows_per_part(ts, cap, length, ROW_ALIGN if g.cut.kind == "rows" else 1)
    out = []
    for lo in range(0, length, rows):
        hi = min(length, lo + rows)
        ranges, at = [], 0
        for t, i in zip(ts, members):
            per = (t.numel() // length) * t.element_size()
            n = (hi - lo) * per
            ranges.append((at, g.member_offsets[i] + lo * per, n))
            at += -(-max(n, 1) // ALIGN) * ALIGN
        out.append(Piece(g, at, members, ranges, [(hi - lo, *t.shape[1:]) for t in ts], lo, hi))
    return out


def _spans(p: Piece) -> list[tuple[int, int, int]]:
    """(offset in the slot, offset in the group's home layout, bytes) per member of ``p``."""
    if not p.whole:
        return p.ranges
    g = p.group
    return [(o, o, t.numel() * t.element_size()) for t, o in zip(g.tensors, g.member_offsets)]


def _versions(g: Group) -> tuple[int, ...]:
    # autograd's version counters: every in-place write through the tensor (an optimizer step,
    # load_state_dict, a BatchNorm running-stat update) bumps them; rebinding .data does not.
    return tuple(t._version for t in g.tensors)


# NOTE [trainable weights in the pinned home]
#     transformers builds every parameter with requires_grad=True, also for inference, so the
#     flag says nothing about the use. The use decides: a forward under torch.no_grad() or
#     inference_mode() only reads the weights and streams them through the slots; a forward that
#     records gradients reads the streamed weights in place from their pinned home (zero-copy,
#     ~51 GB/s), because autograd saves the weights (and views of them, e.g. the transposed
#     weight a linear layer saves) for backward, and a slot is overwritten by the next group long
#     before backward reads it: the gradients would be silently wrong. The home stays put, so what
#     autograd saved is right whenever backward runs. A streamed parameter's gradient is moved to
#     pinned host memory beside its home as soon as autograd has accumulated it, so backward keeps
#     no more device memory than the budget allows; optimizers then update weights and read
#     gradients in place. Writes to a weight bump its version counter; a slot loaded before the
#     write is loaded again, and a write made in a slot during a forward is copied home. Writes
#     through ``.data`` bypass the version counter and are not seen. Training within a budget at
#     speed is wrap_training's job (it plans gradients and optimizer states too); this path is
#     correct and never refuses.


class SharedHome:
    """A pinned home that several transports read (NOTE [one home for replicas]): given back
    when the last of them releases it."""

    def __init__(self, block: Any):
        self.block, self.ptr, self.nbytes = block, block.ptr, block.nbytes
        self.users = 1

    def share(self) -> SharedHome:
        self.users += 1
        return self

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            self.block.release()


# NOTE [one home for replicas]
#     Handles of the same weights on several GPUs of one process (a replica per GPU serving
#     requests side by side) would each pin a home of their own: n copies of the streamed
#     weights in host memory. With ``share_home=`` a handle whose plan streams the same groups
#     laid out alike (the same budget on a device of the same size) reads the other's home
#     instead: tiermem's pinned memory is portable and mapped for every device (cudaHostAlloc
#     and cudaHostRegister with the Portable and Mapped flags, cuda/runtime.py), so each GPU
#     copies from it over its own link, or reads it in place, and the host holds one copy. The
#     caller says the weights are the same: the home is not filled again (a replica's own
#     tensors are dropped once adopted). The home goes when the last handle lets go of it. A
#     write through one replica's streamed weights (an optimizer's, a load) is seen by every
#     replica. Not with a disk tier (host_budget). Ranks in separate processes do not share
#     one: a home in shared memory registered in each process is not built.


class PinnedTransport:
    """Streamed groups in one pinned host buffer (their home, in execution order) and
    ``lookahead`` device slots the size of the largest: the next groups are copied into free slots
    on tiermem's H2D stream while the current one runs, at the full link rate, with no driver page
    work (NOTE [streaming plan]). Outside a slot, a group's tensors point at their home, which the
    GPU reads in place (zero-copy), so decode, unplanned reads and forwards that record gradients
    need no move at all (NOTE [trainable weights in the pinned home])."""

    def __init__(self, tier: Tier, plan: Plan, groups: list[Group], lookahead: int, role: Role,
                 sources: dict[int, Any], disk_reader: str, share: PinnedTransport | None = None):
        self.tier = tier
        self.role = role
        self.sources = sources         # id(tensor) -> its source (NOTE [weight source] in inference/sources.py)
        be = tier.backend
        off = 0
        import torch
        for g in groups:
            g.on_disk = g.name in plan.on_disk
            if g.on_disk or g.gathered or g.oversized:
                g.packing = []          # read as they are: from the files, or in place (NOTE [packed parts])
            g.offset = -1 if g.on_disk else off
            # Buffers stay at home, read in place: a forward may write them (BatchNorm's running
            # stats) without bumping their version counter, and they are small.
            g.in_slot = [isinstance(t, torch.nn.Parameter) for t in g.tensors]
            g.member_offsets, n = home_layout(g.tensors)
            g.nbytes = n
            g.pieces = pieces_of(g, plan.slot)
            if g.packed:
                g.packed_offsets, g.packed_nbytes = packed_layout(g.tensors, g.packing)
                if g.dual:                          # NOTE [packed tied table]: after the table as it is
                    g.packed_offsets = [o + _up(n) for o in g.packed_offsets]
            off += 0 if g.on_disk else home_size(g.tensors, g.packing, g.dual)
        self.groups = groups
        self.size = max(off, 1)
        self.slot_bytes = max((p.nbytes for g in groups if not g.gathered and not g.oversized for p in g.pieces),
                              default=0)
        # A plan with no room for the window never streams: everything is read in place.
        self.nslots = 0 if plan.zero_copy_only or not self.slot_bytes else plan.lookahead
        # NOTE [quantized streaming]: packed bytes cross into QSTAGES staging buffers of the
        # window, a chunk of rows at a time, and int4 unpacks through a scratch region.
        packed = [g for g in groups if g.packed]
        self.stage_bytes = max((_piece_staging(p) for g in packed for p in g.pieces), default=0) if self.nslots else 0
        self.scratch_bytes = min(self.stage_bytes, max((quant.ALIGN * -(-p.q_bytes // quant.ALIGN) for g in packed
                                                        for p in g.packing if p is not None and p.fmt == "int4"),
                                                       default=0))
        self.window_bytes = self.slot_bytes * self.nslots + quant.QSTAGES * self.stage_bytes + self.scratch_bytes
        self.home: Any = None
        self.shared = share is not None       # NOTE [one home for replicas]: the home is another's
        if share is not None:
            _check_same_layout(self, share)
        self.window: Any = None
        self.grad_home: Any = None
        self._view_cache: dict[tuple[int, int | None, bool], list[Any]] = {}
        self._plans: dict[Any, Any] = {}     # NOTE [packed chunks made once]
        self._reserved = 0
        self.origin: dict[int, Any] = {id(t): origin(t) for g in groups for t in g.tensors}
        self.disk: DiskTier | None = None
        on_disk = [g for g in groups if g.on_disk]
        stage = max((p.nbytes for g in on_disk for p in g.pieces), default=0)   # a piece: bounded by a slot
        hb = plan.host_budget
        if hb is not None and self.size + (plan.stages * stage if on_disk else 0) > hb:
            from ..errors import HostBudgetError  # plan_host's sizes are these: a bug if it happens
            raise HostBudgetError(self.size + plan.stages * stage, 0, hb, hint="the plan's home and staging "
                                  "do not fit the host budget")
        # The checkpoint's bytes are read into the home before it is pinned (NOTE [filled before
        # pinning] in cuda/runtime.py); other sources are copied in after, by the GPU over the
        # link, and packed members are quantized in after, one tensor at a time.
        files = [(sources[id(t)], g.offset + o) for g in groups if not g.on_disk
                 for i, (t, o) in enumerate(zip(g.tensors, g.home_offsets))
                 if isinstance(sources.get(id(t)), FileTensor)
                 and not (g.packing and g.packing[i] is not None and not g.dual)]
        # A piece's bytes in its staging buffer lie as in its slot: (file tensor, from byte, bytes, at).
        disk_files = {p: [(sources[id(g.tensors[i])], ho - g.member_offsets[i], n, so)
                          for i, (so, ho, n) in zip(p.members, _spans(p))]
                      for g in on_disk for p in g.pieces}

        def fill(base: int) -> None:  # straight from the file (NOTE [reading a checkpoint])
            jobs = [(src, host_bytes(base + o, src.nbytes)) for src, o in files]
            if self._host_thread is None:
                Reader.shared().read(jobs)
                return
            # Beside the resident groups, on threads of its own (NOTE [home beside the resident groups]).
            own = Reader(threads=max(1, Reader.shared().threads // 2))
            try:
                own.read(jobs)
            finally:
                own.close()
                Reader.shared().account(own.bytes_read, own.seconds)

        def host_side() -> None:
            if share is not None:
                self.home = share.home.share()
                return
            self.home = SharedHome(be.host_alloc(self.size, pooled=False, fill=fill if files else None))
            if on_disk:
                self.disk = DiskTier(be, disk_files, stage, plan.stages, reader=disk_reader)

        self._host_fn: Callable[[], None] | None = host_side
        self._host_error: BaseException | None = None
        self._host_thread: threading.Thread | None = None
        self.reads_files = bool(files) and share is None
        self.host_planned = self.size + (plan.stages * stage if on_disk else 0)

    def start(self) -> None:
        """Make the home (and the disk tier's staging) on a thread of its own from now, beside
        the adopting thread's work (NOTE [home beside the resident groups]); ``finish`` waits."""
        if self._host_fn is not None and self._host_thread is None:
            self._host_thread = threading.Thread(target=self._run_host_side, name="tiermem-home", daemon=True)
            self._host_thread.start()

    # NOTE [home beside the resident groups]
    # A checkpoint's load has two host-bound parts: the resident groups (read through pinned
    # fill buffers and copied to the device) and the pinned home (read, then page-locked), of
    # about the same length; one after the other, they were most of a load (docs/inference.md, "Loading a checkpoint").
    # So the home is filled and registered, and the disk tier's staging made, on a thread of its
    # own while the adopting thread loads the resident groups; ``finish`` waits for it. Only host
    # work runs there: its own memory, a thread-safe Reader, the backend's host_alloc. What
    # bench/probes/probe_register.py and probe_load.py found on the way:
    # - The driver serializes a registration with other CUDA calls, registering in pieces on
    #   several threads is no faster, and a copy may not span two registrations
    #   (cudaErrorInvalidValue), so the home stays one block, registered once its reads are done.
    # - The home therefore reads on a Reader of its own with half the shared reader's threads,
    #   so that the resident groups' reads and copies run beside its reads instead of queueing
    #   behind them into the registration. With as many threads again, they starved, and the
    #   load took longer (docs/inference.md, "Loading a checkpoint").
    # - The fill buffers are made before the thread starts: made beside a thread faulting in the
    #   home's pages, they took several times as long to map and to register (same section).
    # - Under a host budget the fill buffers live beside the home, so they get what the home and
    #   the staging leave of the budget; with less than MIN_FILL_ROOM (inference/module.py) left, the home is made
    #   after the resident groups, as before.
    # What stays serial is the driver's: the registration (0.1-0.19 s for the 3.86 GB home) and
    # the resident groups' advice (0.05-0.09 s).
    def _run_host_side(self) -> None:
        fn, self._host_fn = self._host_fn, None
        if fn is None:
            return
        try:
            fn()
        except BaseException as e:  # noqa: B036 - the adopting thread raises it in finish
            self._host_error = e

    def _join_host_side(self) -> None:
        """Wait for the host side ``start`` began, or run it here: the home and the disk tier's
        staging (NOTE [home beside the resident groups]); raise what it raised."""
        if self._host_thread is not None:
            self._host_thread.join()
            self._host_thread = None
        else:
            self._run_host_side()
        err, self._host_error = self._host_error, None
        if err is not None:
            raise err

    def finish(self) -> None:
        """The rest of the adoption, after the resident groups: the home (waited for or made
        now), the window, the copies of sources that are not files."""
        tier, be = self.tier, self.tier.backend
        import torch
        try:
            self._join_host_side()
            if self.nslots:
                tier.reserve(self.window_bytes, self.role)
                self._reserved = self.window_bytes
                # Straight from the driver, so unwrap (or a failed adoption) gives it back.
                self.window = be.device_alloc(self._reserved, pooled=False)
            with torch.no_grad():
                for g in self.groups:
                    if g.on_disk or self.shared:
                        continue                          # its home is its file, or another's
                    if g.packed and not g.dual:
                        self._pack_home(g)
                        continue
                    for t, v in zip(g.tensors, self._views(g, None)):
                        src = self.sources.get(id(t), t)
                        if not isinstance(src, FileTensor):
                            v.copy_(materialize(src))    # the GPU writes pinned pages straight over the link
                    if g.dual:
                        self._pack_home(g, from_home=True)   # NOTE [packed tied table]
            if be.kind == "cuda":
                torch.cuda.synchronize(tier.device)   # the home is whole before the originals may go
        except BaseException:
            self.discard()
            raise
        # A slot's ``held`` is its group's versions when copied in (NOTE [ordered copies] in core/stream.py).
        self.ring = SlotRing(self.window.ptr if self.window is not None else 0, self.slot_bytes, self.nslots)
        self.lane = Lane(be, lambda: tier.side_stream("h2d"))
        # NOTE [quantized streaming]: the staging buffers after the slots, then the scratch.
        base = self.ring.slots[0].ptr + self.slot_bytes * self.nslots if self.nslots else 0
        self.stages = SlotRing(base, self.stage_bytes, quant.QSTAGES if self.stage_bytes else 0)
        self.scratch_ptr = base + quant.QSTAGES * self.stage_bytes
        self._stage_raw = [be.torch_view(st.ptr, self.stage_bytes, self.window) for st in self.stages]
        self._scratch = be.torch_view(self.scratch_ptr, self.scratch_bytes, self.window) if self.scratch_bytes else None
        self.dq = Lane(be, lambda: tier.side_stream("dequant"))
        self._turn = 0                 # the staging buffer the next packed copy takes
        self.last_dq: Any = None       # the end of the last dequantization queued
        self.slot_of: dict[int, int] = {}
        self.relay: Any = None         # NOTE [two links into one GPU] in inference/multidevice.py
        self.relay_share = 0.0         # of each whole piece's bytes, the last, through the relay
        self.in_use: dict[int, tuple[int, ...]] = {}    # group -> versions when bound to its slot
        self.count = 0                 # streamed group uses so far: use c runs in slot c % nslots
        self.capturing = False         # NOTE [graphed forwards] in inference/graphed.py: copies untimed, untracked

    def forget_slots(self) -> None:
        """Forget what every slot holds (after a capture that failed: its forward's Python ran,
        so the books name pieces whose copies never did); the next forward brings in what it
        uses. The slots' events stay: a fill still waits for the last reader."""
        for i in range(len(self.ring)):
            self._vacate(i)
        self.restart()

    def restart(self) -> None:
        """The next piece used goes to slot 0, the next packed copy to the first staging buffer
        (NOTE [graphed forwards] in inference/graphed.py): every forward in graph mode, and its
        tail's prefetch of the next, use the same slots in the same order."""
        self.count = 0
        self._turn = 0

    def settle_into(self, stream: int) -> None:
        """Make ``stream`` wait for every copy and dequantization queued so far: a graph launched
        on it next rewrites the slots and staging buffers those may still be writing."""
        be = self.tier.backend
        be.wait(stream, self.lane.mark())
        if self.stage_bytes:
            be.wait(stream, self.dq.mark())

    def bind_home(self) -> None:
        """Point every streamed tensor at its home (the adoption's last step: cannot fail)."""
        for g in self.groups:
            for t, v in zip(g.tensors, self._views(g, None)):
                t.data = v

    def _views(self, g: Group, slot: int | None, base: Any = None) -> list[Any]:
        """Views of ``g``'s tensors in their home (or ``base``, laid out as the home), or of
        ``g.pieces[0]``'s in ``slot``."""
        return self._piece_views(g.pieces[0], slot, base)

    def _piece_views(self, p: Piece, slot: int | None, base: Any = None) -> list[Any]:
        # Made once per (piece, place): a view costs ~20 us of host time, and a forward binds
        # every streamed group twice; on a model whose layers sync the host (a mixture of
        # experts) that time lands on the critical path.
        key = (id(p) if slot is not None else id(p.group), slot, base is not None)
        got = self._view_cache.get(key)
        if got is None:
            got = self._view_cache[key] = self._make_views(p, slot, base)
        return got

    def _make_views(self, p: Piece, slot: int | None, base: Any = None) -> list[Any]:
        be = self.tier.backend
        g = p.group
        if slot is None and base is None and (g.on_disk or (g.packed and not g.dual)):
            # No home in the model's dtype: at rest it points at a slot (NOTE [disk tier], NOTE
            # [quantized streaming]); a split group does not fit one, so its tensors are one
            # element of slot 0 seen at their shape (stride 0). A packed group's members kept
            # as they are point at their home.
            if g.split:
                raw = be.torch_view(self.window.ptr, self.slot_bytes, self.window)
                rest = [raw[:t.element_size()].view(t.dtype).expand(t.shape) for t in g.tensors]
            else:
                rest = self._make_views(g.pieces[0], 0)
            if not g.packed:
                return rest
            return [r if q is not None else h.view(t.dtype).view(t.shape)
                    for t, q, r, h in zip(g.tensors, g.packing, rest, self._raw_home(g))]
        if slot is None:
            block = base if base is not None else self.home
            start, offsets, shapes = block.ptr + g.offset, g.member_offsets, [tuple(t.shape) for t in g.tensors]
            tensors = g.tensors
        else:
            block = self.window
            start, offsets, shapes = block.ptr + slot * self.slot_bytes, p.slot_offsets(), p.shapes
            tensors = [g.tensors[i] for i in p.members]
        out = []
        for t, o, shape in zip(tensors, offsets, shapes):
            n = math.prod(shape) * t.element_size()
            raw = be.torch_view(start + o, n, block)
            out.append(raw.view(t.dtype).view(shape))
        return out

    def _raw_home(self, g: Group, stage: int | None = None) -> list[Any]:
        """Byte views of each member of ``g`` in its (packed) home, or in staging buffer ``stage``,
        which holds the group as its home does."""
        be = self.tier.backend
        block = self.home if stage is None else self.window
        start = block.ptr + g.offset if stage is None else self.stages[stage].ptr
        sizes = [p.nbytes if p is not None else t.numel() * t.element_size()
                 for t, p in zip(g.tensors, g.packing or [None] * len(g.tensors))]
        offsets = g.packed_offsets if g.packed else g.member_offsets
        if stage is not None and g.dual:          # a staging buffer holds the packed bytes alone
            offsets = [o - _up(g.nbytes) for o in offsets]
        return [be.torch_view(start + o, n, block) for o, n in zip(offsets, sizes)]

    def _packed_views(self, g: Group, stage: int | None = None) -> list[Any]:
        """Per member of a packed group, in its home or staging buffer ``stage``: (values, scales)
        of a packed member, or the member's bytes viewed as it is."""
        key = ("packed", id(g), stage)
        got = self._view_cache.get(key)
        if got is None:
            got = self._view_cache[key] = [quant.views(p, raw) if p is not None else raw.view(t.dtype).view(t.shape)
                                           for t, p, raw in zip(g.tensors, g.packing, self._raw_home(g, stage))]
        return got

    def _pack_home(self, g: Group, from_home: bool = False) -> None:
        """Fill a packed group's home: each member quantized from its source (a checkpoint
        tensor read now, one at a time) or copied as it is (NOTE [quantized streaming]); with
        ``from_home``, from the group's home in the model's dtype, filled already (NOTE [packed
        tied table])."""
        import torch
        dev = torch.device("cuda", self.tier.device) if self.tier.backend.kind == "cuda" else torch.device("cpu")
        plain = self._views(g, None) if from_home else [None] * len(g.tensors)
        for t, p, v, h in zip(g.tensors, g.packing, self._packed_views(g), plain):
            src = h if from_home else self.sources.get(id(t), t)
            if p is not None:
                # NOTE [checkpoints already quantized] in inference/prequant.py: copied as it is
                if not copy_packed(src, p, v[0], v[1]):
                    quant.pack_into(materialize(src), p, v[0], v[1], dev)
            elif not isinstance(src, FileTensor):        # a file's bytes were read in before pinning
                v.copy_(materialize(src))

    def _chunks(self, g: Group, ranges: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
        """``ranges`` ((member, first row, end row) of a packed group) cut into chunks that each fit
        a staging buffer packed (NOTE [quantized streaming])."""
        out: list[list[tuple[int, int, int]]] = [[]]
        used = 0
        for i, lo, hi in ranges:
            t, p = g.tensors[i], g.packing[i]
            per = p.row_q + p.row_s if p is not None else _row_bytes(t)

            def staged(n: int, p: Any = p, per: int = per) -> int:
                return p.rows_nbytes(n) if p is not None else _up(n * per)
            while lo < hi:
                room = self.stage_bytes - used
                # All that is left when it fits (a group no bigger than a staging buffer crosses
                # in one chunk), else as many rows as surely fit beside their two alignments.
                n = hi - lo if staged(hi - lo) <= room else min(hi - lo, max(0, (room - 2 * quant.ALIGN) // per))
                if n == 0:
                    out.append([])
                    used = 0
                    continue
                out[-1].append((i, lo, lo + n))
                used += staged(n)
                lo += n
        return [c for c in out if c]

    def stream_packed(self, g: Group, ranges: list[tuple[int, int, int]], ring: SlotRing, slot: Any,
                      dst: Callable[[int, int, int], Any], key: Any = None) -> int:
        """Copy rows ``ranges`` ((member, first row, end row)) of packed group ``g`` from its home
        into the staging buffers a chunk at a time, each dequantized (or, for a member kept as it
        is, copied) into ``dst(member, first row, end row)`` on the dequantization lane; ``slot``
        of ``ring`` is ready once the last is (NOTE [quantized streaming]). Returns the bytes
        that crossed the link. With ``key`` (a piece and its slot, whose rows and ``dst`` are
        the same every time), the chunks, their copies and their views are made once and kept
        (NOTE [packed chunks made once])."""
        from ..core.transfer import Transfer
        tier, moved = self.tier, 0
        chunks = self._plans.get(key) if key is not None else None
        if chunks is None:
            chunks = self._chunks(g, ranges)
            if key is not None:
                self._plans[key] = chunks
        for c, chunk in enumerate(chunks):
            st = self.take_stage()
            made = self._plans.get((key, c, st.index)) if key is not None else None
            if made is None:
                made = self._chunk_work(g, chunk, st.index, dst)
                if key is not None:
                    self._plans[(key, c, st.index)] = made
            parts, n, jobs = made
            start, end = self.stages.fill(self.lane, st, parts, timed=not self.capturing)
            if not self.capturing:      # a captured copy's events have no times (NOTE [events across a capture])
                tier.track(Transfer(tier, "h2d", self.lane.stream, start, end, [], n, {self.role: n}))
            tier.accounting.on_move(self.role, "h2d", n)
            moved += n
            self.last_dq = ring.transform(self.dq, slot, lambda jobs=jobs: self._unpack(g, jobs), reads=[st])
        tier.accounting.count(self.role, "prefetch_ops")
        return moved

    # NOTE [packed chunks made once]
    #     A packed piece streams the same rows into the same slot every forward, and a chunk's
    #     bytes land in one of the two staging buffers: its copies (home address, offset in the
    #     buffer, bytes) and the views its dequantization reads and writes are the same each time
    #     it lands in that buffer. Making them took most of the host's time per chunk (a view costs
    #     microseconds; a forward of a 30-layer model streams hundreds of chunks, on the thread
    #     that also launches the forward's kernels), so they are made once per (piece, slot,
    #     chunk, staging buffer) and kept with the transport's views. So is each range's device
    #     work (quant.prepare): the dequantization's views, checks and the fused kernel's grid
    #     and arguments, so a forward runs prepared launches only. The copies of a chunk whose
    #     ranges lie in the staging buffer as in the home (a whole member's values and scales,
    #     and whole members back to back) are one copy (:func:`_merged`): a group that fits a
    #     staging buffer crosses in one copy. tests/test_quant.py counts a forward's host calls
    #     per streamed piece. The expert cache's copies (a varying set of experts into a varying
    #     slot) are made each time.

    def _chunk_work(self, g: Group, chunk: list[tuple[int, int, int]], stage: int,
                    dst: Callable[[int, int, int], Any]) -> tuple[list[tuple[int, int, int]], int, list[Callable[[], Any]]]:
        """(copies (offset in the staging buffer, home address, bytes), bytes, jobs) of one chunk
        of ``g`` landing in staging buffer ``stage``; a job is device work made once: the
        dequantization of the chunk's packed ranges (quant.prepare_many: views and launch
        arguments made, one launch a format on a GPU), or the copy of a range kept as it is
        into its place."""
        home, raw = self.home.ptr + g.offset, self._stage_raw[stage]
        parts, jobs, packed, at = [], [], [], 0
        for i, lo, hi in chunk:
            p, off, out = g.packing[i], home + g.packed_offsets[i], dst(i, lo, hi)
            if p is not None:
                (qo, qn), (so, sn) = p.row_ranges(lo, hi)
                parts += [(at, off + qo, qn), (at + _up(qn), off + so, sn)]
                q, s = quant.views(p, raw[at:at + p.rows_nbytes(hi - lo)], hi - lo)
                packed.append((q, s, p, out))
                at += p.rows_nbytes(hi - lo)
            else:
                t = g.tensors[i]
                per = _row_bytes(t)
                parts.append((at, off + lo * per, (hi - lo) * per))
                jobs.append(functools.partial(out.copy_, raw[at:at + (hi - lo) * per].view(t.dtype).view(out.shape)))
                at += _up((hi - lo) * per)
        if packed:       # NOTE [one launch a chunk] in inference/dequant_kernel.py
            jobs.insert(0, quant.prepare_many(packed, self._scratch))
        return _merged(parts), sum(x for _, _, x in parts), jobs

    def _unpack(self, g: Group, jobs: list[Callable[[], Any]]) -> None:
        """The device work of one staged chunk of ``g``: each range dequantized or copied into its
        place, by the jobs :meth:`_chunk_work` made."""
        for job in jobs:
            job()

    def _piece_rows(self, p: Piece) -> list[tuple[int, int, int]]:
        """(member, first row, end row) of the rows of a packed group's members that piece ``p``
        holds (NOTE [packed parts]): all of them for the group whole (less its buffers, read at
        home), else the part's range of the cut, which is a range of each member's rows (a
        stacked member's rows are its experts' rows one after the other)."""
        g = p.group
        if p.whole:
            return [(i, 0, member_rows(t, q)) for i, (t, q, keep) in enumerate(zip(g.tensors, g.packing, g.in_slot))
                    if keep]
        out = []
        for i in p.members:
            rows = member_rows(g.tensors[i], g.packing[i])
            per = rows // g.cut.length            # rows of one row (or expert) of the cut
            out.append((i, p.lo * per, p.hi * per))
        return out

    def slot_rows(self, p: Piece, slot: int) -> Callable[[int, int, int], Any]:
        """``dst`` for :meth:`stream_packed` into piece ``p``'s slot: a member's rows there."""
        views = dict(zip(p.members, self._piece_views(p, slot)))
        held = {i: (lo, hi - lo) for i, lo, hi in self._piece_rows(p)}    # first row, rows the slot holds

        def rows(i: int, lo: int, hi: int) -> Any:
            first, n = held[i]
            return views[i].view(n, -1)[lo - first:hi - first]
        return rows

    def _copy_in(self, p: Piece, s: Any, stage: int | None) -> tuple[Any, Any]:
        """Queue the copy of ``p``'s bytes into slot ``s``, from the pinned home or from a
        staging buffer that holds them as the slot will; returns the copy's (start, end) events.
        The one place where a streamed piece's bytes reach the device."""
        if stage is None:
            base = self.home.ptr + p.group.offset
            parts = [(so, base + ho, n) for so, ho, n in p.ranges]
            if self.relay is not None:      # NOTE [two links into one GPU] in inference/multidevice.py
                mine, theirs = split_parts(parts, p.nbytes - int(p.nbytes * self.relay_share))
                return self.ring.fill(self.lane, s, mine, timed=True, relay=self.relay, relayed=theirs)
        else:
            parts = [(0, self.disk.stages[stage].ptr, p.nbytes)]
        return self.ring.fill(self.lane, s, parts, timed=not self.capturing)

    def _load(self, p: Piece, slot: int, wait: bool = True) -> bool:
        """Queue ``p``'s copy into ``slot``; False (nothing queued) when ``p`` is on disk, not read
        yet, and ``wait`` is off."""
        from ..core.transfer import Transfer
        tier = self.tier
        if p.group.packed:
            self._load_packed(p, slot)
            return True
        stage = None
        if p.group.on_disk:
            stage = self.disk.take(p, wait)
            if stage is None:
                return False
        s = self.ring[slot]
        # The slot holds nothing from here until the copy is queued and its event recorded: a
        # failure in between must not leave the old occupant's name on new bytes (a later
        # forward would compute with them; tests/test_module_faults.py).
        self._vacate(slot)
        start, end = self._copy_in(p, s, stage)
        if stage is not None:
            self.disk.give_back(stage, end)
        if not self.capturing:
            tier.track(Transfer(tier, "h2d", self.lane.stream, start, end, [], p.nbytes, {self.role: p.nbytes}))
        tier.accounting.on_move(self.role, "h2d", p.nbytes)
        tier.accounting.count(self.role, "prefetch_ops")
        s.occupant, s.held = p, _versions(p.group)
        self.slot_of[id(p)] = slot
        return True

    def _vacate(self, slot: int) -> None:
        """Forget ``slot``'s occupant before its bytes change. Its record of where it lies goes
        only if it still says this slot: a piece brought into another slot since (a forward in
        graph mode starts at slot 0, NOTE [graphed forwards]) is found there."""
        old = self.ring.vacate(self.ring[slot])
        if old is not None and self.slot_of.get(id(old)) == slot:
            del self.slot_of[id(old)]

    def take_stage(self) -> Any:
        """The staging buffer the next packed copy crosses into (NOTE [quantized streaming]): they
        take turns; a fill waits for the dequantization that last read it."""
        k, self._turn = self._turn, (self._turn + 1) % len(self.stages)
        return self.stages[k]

    def rest_views(self, g: Group) -> list[Any]:
        """The views ``g``'s tensors point at outside a forward: its home, or slot 0 for what has no
        home in the model's dtype (NOTE [disk tier], NOTE [quantized streaming])."""
        return self._views(g, None)

    def _load_packed(self, p: Piece, slot: int) -> None:
        """Queue a packed piece's copies into the staging buffers and their dequantization into
        ``slot`` (NOTE [quantized streaming] in inference/quant.py, NOTE [packed parts] in
        inference/plan.py)."""
        s = self.ring[slot]
        self._vacate(slot)                 # as in _load: nothing names the slot's bytes until queued
        key = (id(p), slot)                # NOTE [packed chunks made once]: made the first times only
        rows = self._piece_rows(p) if key not in self._plans else []

        def dst(i: int, lo: int, hi: int) -> Any:
            return self.slot_rows(p, slot)(i, lo, hi)
        self.stream_packed(p.group, rows, self.ring, s, dst, key=key)
        s.occupant, s.held = p, _versions(p.group)
        self.slot_of[id(p)] = slot

    def ensure(self, p: Piece) -> list[Any]:
        """Bring ``p`` into the next slot (if it is not there already) and make the compute
        stream wait for it; returns its tensors' views there. A whole group's parameters are
        bound to them, as are a part's of stacked experts (the experts module reads them by
        name); a part of rows is read through the views (NOTE [split groups])."""
        g = p.group
        slot = self.count % self.nslots
        self.count += 1
        now = _versions(g)
        # Not brought in ahead, or written at home since (an optimizer step between forwards).
        if self.slot_of.get(id(p)) != slot or self.ring[slot].held != now:
            self._load(p, slot)
        be = self.tier.backend
        be.wait(be.current_stream(), self.ring[slot].ready)
        views = self._piece_views(p, slot)
        if p.whole or g.cut.kind == "experts":
            for i, v in zip(p.members, views):
                if g.in_slot[i]:
                    g.tensors[i].data = v
        self.in_use[id(p)] = now
        return views

    def ahead(self, upcoming: list[Piece]) -> None:
        for d, p in enumerate(upcoming[: self.nslots - 1], start=0):
            slot = (self.count + d) % self.nslots
            s = self.ring[slot]
            if s.occupant is p and self.slot_of.get(id(p)) == slot and s.held == _versions(p.group):
                continue
            self._load(p, slot, wait=False)     # a piece still being read from disk comes in at ensure()

    def release(self, p: Piece) -> None:
        slot = self.slot_of.get(id(p))
        if slot is None:
            return
        be = self.tier.backend
        g = p.group
        home = self._views(g, None)
        before = self.in_use.pop(id(p), None)
        if before is not None and before != _versions(g) and (g.on_disk or g.packed or not p.whole):
            log.warning("tiermem: a forward wrote to %s, which is %s; the write is not kept", p.name,
                        "read from disk" if g.on_disk else "streamed in parts" if not p.whole else
                        "kept packed (NOTE [quantized streaming])")
        elif before is not None and before != _versions(g):
            # The forward wrote into the slot (a running-stat buffer, say): keep it at home. Later
            # loads of this group read home on tiermem's stream, which waits for this copy.
            for t, h, old, new, s in zip(g.tensors, home, before, _versions(g), g.in_slot):
                if old != new and s:
                    h.copy_(t.data)
            self.lane.after([now()])
        self.ring.release(self.ring[slot], be)
        if p.whole or g.cut.kind == "experts":
            for i in p.members:
                if g.in_slot[i]:
                    g.tensors[i].data = home[i]      # back to its home: correct to read, zero-copy
        self.tier.accounting.count(self.role, "evict_ops")
        self.tier.accounting.count(self.role, "evict_clean_ops")

    def offload_grad(self, g: Group, i: int, p: Any) -> None:
        """A streamed parameter's gradient lives in pinned host memory beside its home, so a
        backward through the module keeps no more device memory than the budget allows
        (NOTE [trainable weights in the pinned home]). Runs in autograd's post-accumulate hook."""
        grad = p.grad
        if grad is None:
            return
        if self.grad_home is None:
            self.grad_home = self.tier.backend.host_alloc(self.size, pooled=False)
        view = self._views(g, None, base=self.grad_home)[i]
        if grad.data_ptr() == view.data_ptr():
            return                                    # accumulated in place, at home already
        view.copy_(grad)
        p.grad = view

    def drain(self) -> None:
        self.tier.synchronize()
        if self.last_dq is not None:
            self.tier.backend.synchronize(self.last_dq)

    def restored(self, device_of: Callable[[Any], Any]) -> list[tuple[Any, Any, Any]]:
        """(tensor, plain copy, plain grad or None) for every streamed tensor, on the device
        ``device_of(tensor)`` names; binds nothing, so a failure here changes nothing."""
        import torch
        self.tier.synchronize()
        out = []
        with torch.no_grad():
            for g in self.groups:
                packed = self._packed_views(g) if g.packed else [None] * len(g.tensors)
                for t, v, p, pv in zip(g.tensors, self._views(g, None), g.packing or packed, packed):
                    plain = torch.empty(t.shape, dtype=t.dtype, device=device_of(t))
                    if p is not None and not g.dual:
                        quant.unpack(pv[0], pv[1], p, plain)       # lossy: the weights it streamed
                    else:
                        plain.copy_(materialize(self.sources[id(t)]) if g.on_disk else v)
                    grad = getattr(t, "grad", None)
                    if grad is not None and (self._in_grad_home(grad) or grad.device != plain.device):
                        grad = grad.to(plain.device, copy=True)
                    else:
                        grad = None
                    out.append((t, plain, grad))
        return out

    @property
    def pinned_bytes(self) -> int:
        """Pinned host bytes held: the home, the disk tier's staging buffers, the gradients' home."""
        home = self.home if not self.shared else None       # NOTE [one home for replicas]: the owner's
        return sum(b.nbytes for b in (home, self.grad_home) if b is not None) + (
            self.disk.pinned_bytes if self.disk is not None else 0)

    def _in_grad_home(self, x: Any) -> bool:
        if self.grad_home is None:
            return False
        p = x.data_ptr()
        return self.grad_home.ptr <= p < self.grad_home.ptr + self.size

    def discard(self) -> None:
        """Give back the window, the home and the gradients' home. The caller has rebound every
        tensor away from them first (or never bound any)."""
        if self._host_thread is not None:
            self._host_thread.join()           # what it made is given back below; its error is not ours
            self._host_thread = None
        self._host_fn = None
        if self.tier.backend.kind == "cuda":
            import torch
            torch.cuda.synchronize(self.tier.device)
        self._view_cache.clear()       # the views hold the blocks
        self._plans.clear()
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        if self.window is not None:
            self.window.release()
            self.window = None
        if self._reserved:
            self.tier.unreserve(self._reserved, self.role)
            self._reserved = 0
        for name in ("home", "grad_home"):
            block = getattr(self, name)
            if block is not None:
                block.release()
                setattr(self, name, None)
        self.tier.backend.release_cached()   # the pinned pool keeps what it is given back


def _check_same_layout(mine: PinnedTransport, other: PinnedTransport) -> None:
    """Refuse to share ``other``'s home unless every streamed group sits there alike."""
    from ..errors import ConfigError

    def layout(t: PinnedTransport) -> list[tuple]:
        return [(g.name, g.offset, g.nbytes, tuple(g.member_offsets),
                 tuple((tuple(x.shape), x.dtype) for x in g.tensors)) for g in t.groups]
    if other.home is None or other.disk is not None or any(g.on_disk for g in mine.groups):
        raise ConfigError("share_home needs a handle with a pinned home of its own and no disk tier (host_budget)")
    if mine.size != other.size or layout(mine) != layout(other):
        a, b = [g.name for g in mine.groups], [g.name for g in other.groups]
        raise ConfigError(f"share_home: this plan streams other groups than the shared handle's ({len(a)} against "
                          f"{len(b)}, from {a[:1]} and {b[:1]}); give both the same budget on devices of one size")

