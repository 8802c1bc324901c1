"""Quantized streaming (NOTE [quantized streaming]): how a streamed weight is packed in the pinned
home (:class:`Packing`, :func:`packing`), quantized once at adoption (:func:`pack_into`), and
dequantized on the device into its slot (:func:`dequantize`); :func:`reference` is the plain
formula the tests hold the device path to, and :func:`unpack` what unwrap restores.

NOTE [quantized streaming]
    With ``stream_dtype`` ("int8", "fp8" or "int4"), the weights of the streamed groups are kept
    in their pinned home at that size and cross the link at it: a forward moves 2x (int8, fp8)
    or about 3.9x (int4) fewer bytes than fp16. Resident groups stay in the model's dtype, and so
    does every tensor that is not the floating weight of a plain ``nn.Linear`` (2-D) or a layer
    of stacked experts (3-D): norms, biases, embeddings (an embedding reads its rows in place;
    a table tied to a head is packed for the head beside it, NOTE [packed tied table] in
    inference/transport.py), routers and buffers cross as they are. Each quantized weight is a
    matrix of ``rows`` rows (a Linear's output rows; for stacked experts, every expert's rows one
    after the other) of ``cols`` columns, quantized symmetrically, with fp32 scales:
    - int8: one scale per row, absmax / 127, values rounded to -127..127;
    - fp8: one scale per row, absmax / 448, values cast to float8_e4m3fn;
    - int4: one scale per ``group`` columns of a row (INT4_GROUP, or the whole row when it is
      shorter or not a multiple), c x absmax / 7 with the clipping c of INT4_CLIPS that gives
      the group the least squared error, values rounded to -8..7, two to a byte: column 2j in
      the low nibble of byte j, column 2j + 1 in the high one.
    A row's bytes (its values, then its scales) do not depend on any other row, so a range of
    rows (an expert, a part of a head) is a range of each, and is copied on its own.

    The packed bytes of a group cross into a staging buffer of the window, and a dequantization
    writes the slot's weights in the model's dtype from it, on a stream of its own (tiermem's
    "dequant" lane) that waits for the copy: the link goes on with the next copy while the
    previous one is dequantized, and the forward waits only for the dequantized slot (NOTE
    [ordered copies] in core/stream.py: :meth:`SlotRing.transform`). Two staging buffers take
    turns (QSTAGES), so a copy never waits for a dequantization but the one two copies back. A
    group bigger than QSTAGE_BYTES packed crosses a chunk of rows at a time (rows are
    independent), so the staging stays small beside a slot of a whole layer of experts; the
    expert cache brings an expert's rows the same way. The dequantization multiplies in fp32
    and rounds once to the model's dtype, which is exactly :func:`reference`'s
    ``(values.float() * scale).to(dtype)``; on a GPU one fused kernel per staged range of rows
    does it (NOTE [one dequantization kernel] in inference/dequant_kernel.py), elsewhere
    torch's ops, and neither makes temporaries in torch's allocator (torch's int4 unpacks its
    nibbles into a scratch region of the window), so the window is all the device memory
    streaming takes.

    Quantization is lossy, so the plan of a quantized module has no home of its weights in the
    model's dtype: a quantized weight is never read in place. mode="zero_copy", a plan with no
    room for a slot, and forwards that record gradients are refused; stacked experts stream in a
    decode too (or go through the expert cache, NOTE [expert cache] in inference/experts.py);
    unwrap restores the dequantized weights. Groups the disk tier reads (NOTE [disk tier]) cross
    as the files hold them. Weights are quantized once, at adoption, from the module's own
    tensors or from the checkpoint's as they are read, one tensor at a time, on the device in
    pieces of at most QUANT_CHUNK elements, so no host or device copy of the model in fp16 is
    made. torchao's primitives return new tensors in fp32 and cannot write into a slot
    (docs/inference.md).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError

__all__ = ["FORMATS", "KERNELS", "INT4_GROUP", "QSTAGES", "Packing", "packing", "pack_into", "dequantize", "prepare", "prepare_many", "reference",
           "unpack", "check_format", "views", "QSTAGE_BYTES"]

FORMATS = ("int8", "fp8", "int4")
INT4_GROUP = 128          # int4: columns per scale
QSTAGES = 2               # staging buffers the packed bytes cross into, in turn
QSTAGE_BYTES = 32 << 20   # a staging buffer holds at most this much of a group: bigger ones cross in chunks
ALIGN = 256               # a region's alignment in the home, a staging buffer and a slot
QUANT_CHUNK = 1 << 22     # elements quantized at a time at adoption (16 MiB of fp32 temporaries each)
_QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}
INT4_CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8)   # int4: shares of a group's absmax tried as its largest value


def _up(n: int) -> int:
    return -(-max(int(n), 1) // ALIGN) * ALIGN


def check_format(value: Any) -> None:
    """Raise ConfigError unless ``value`` is None or one of FORMATS."""
    if value is not None and value not in FORMATS:
        raise ConfigError(f"stream_dtype must be None or one of {', '.join(map(repr, FORMATS))}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Packing:
    """One weight packed in ``fmt`` (NOTE [quantized streaming]): ``rows`` x ``cols`` values, one
    fp32 scale per ``group`` columns of a row. Its packed bytes are the values (``q_bytes``,
    from offset 0) then the scales (``s_bytes``, from ``s_offset``), each ALIGN-aligned."""

    fmt: str
    rows: int
    cols: int
    group: int

    @property
    def row_q(self) -> int:
        """Bytes of one row's values."""
        return self.cols // 2 if self.fmt == "int4" else self.cols

    @property
    def groups(self) -> int:
        return self.cols // self.group

    @property
    def row_s(self) -> int:
        """Bytes of one row's scales."""
        return 4 * self.groups

    @property
    def q_bytes(self) -> int:
        return self.rows * self.row_q

    @property
    def s_offset(self) -> int:
        return _up(self.q_bytes)

    @property
    def nbytes(self) -> int:
        return self.s_offset + _up(self.rows * self.row_s)

    def row_ranges(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """(offset, bytes) in the packed bytes of rows ``lo`` to ``hi``: their values, their scales."""
        return [(lo * self.row_q, (hi - lo) * self.row_q), (self.s_offset + lo * self.row_s, (hi - lo) * self.row_s)]

    def rows_nbytes(self, n: int) -> int:
        """Bytes ``n`` of its rows take packed on their own, as :func:`views` reads them."""
        return _up(n * self.row_q) + _up(n * self.row_s)


def packing(t: Any, fmt: str) -> Packing | None:
    """How ``t`` (a floating 2-D weight, or 3-D stacked experts) is packed in ``fmt``; None when
    it cannot be (int4 needs an even row)."""
    import torch
    if not t.dtype.is_floating_point or t.dim() < 2 or t.numel() == 0 or t.dtype in (
            torch.float8_e4m3fn, torch.float8_e5m2):
        return None
    cols = int(t.shape[-1])
    rows = t.numel() // cols
    if fmt == "int4":
        if cols % 2:
            return None
        group = INT4_GROUP if cols % INT4_GROUP == 0 else cols
    else:
        group = cols
    return Packing(fmt, rows, cols, group)


def _q_dtype(p: Packing) -> Any:
    import torch
    return {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}[p.fmt]


def views(p: Packing, raw: Any, rows: int | None = None) -> tuple[Any, Any]:
    """(values, scales) views of ``raw``, a byte tensor holding ``rows`` rows (default: all of
    them) packed as ``p`` lays them out (values [rows, row_q] in their dtype, then scales
    [rows, groups], each ALIGN-aligned): a home's whole weight, or an expert in a staging buffer."""
    return _views(p, raw, p.rows if rows is None else rows)


def _views(p: Packing, raw: Any, rows: int) -> tuple[Any, Any]:
    import torch
    sq = _up(rows * p.row_q)
    q = raw[: rows * p.row_q].view(_q_dtype(p)).view(rows, p.row_q)
    s = raw[sq: sq + rows * p.row_s].view(torch.float32).view(rows, p.groups)
    return q, s


def _quantize(x: Any, p: Packing) -> tuple[Any, Any]:
    """(values, scales) of the float rows ``x`` [n, cols], on ``x``'s device."""
    import torch
    n = x.shape[0]
    xf = x.float().view(n, p.groups, p.group)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / _QMAX[p.fmt], torch.ones_like(amax))
    if p.fmt == "int4":
        # Sixteen levels are few: each group takes the clipping of its absmax that gives the
        # least squared error (on Gaussian weights, 1 - relative error 0.9862 -> 0.9897).
        best = None
        for c in INT4_CLIPS:
            s = scale * c
            e = ((xf / s).round_().clamp_(-8, 7).mul_(s).sub_(xf)).square_().sum(dim=-1, keepdim=True)
            if best is None:
                best, chosen = e, s
            else:
                better = e < best
                best, chosen = torch.where(better, e, best), torch.where(better, s, chosen)
        scale = chosen
    v = xf / scale
    if p.fmt == "fp8":
        q = v.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(n, p.cols)
    elif p.fmt == "int8":
        q = v.round_().clamp_(-127, 127).to(torch.int8).view(n, p.cols)
    else:
        v = v.round_().clamp_(-8, 7).to(torch.int8).view(n, p.cols)
        lo = v[:, 0::2].to(torch.uint8) & 15
        hi = v[:, 1::2].to(torch.uint8) & 15
        q = lo | (hi << 4)
    return q, scale.view(n, p.groups)


def pack_into(src: Any, p: Packing, q_out: Any, s_out: Any, device: Any) -> None:
    """Quantize ``src`` (a tensor of ``p``'s shape, anywhere) into ``q_out`` and ``s_out`` (views
    from :func:`views`), a piece of at most QUANT_CHUNK elements at a time on ``device``."""
    flat = src.reshape(p.rows, p.cols)
    step = max(1, QUANT_CHUNK // max(1, p.cols))
    for lo in range(0, p.rows, step):
        hi = min(p.rows, lo + step)
        q, s = _quantize(flat[lo:hi].to(device, non_blocking=False), p)
        q_out[lo:hi].copy_(q)
        s_out[lo:hi].copy_(s)


KERNELS = ("auto", "fused", "torch")


def dequantize(q: Any, s: Any, p: Packing, out: Any, scratch: Any = None, kernel: str = "auto") -> None:
    """Write the weights of ``q`` and ``s`` (views of n packed rows) into ``out`` (n rows, in the
    model's dtype), on the current stream, making no temporaries on a GPU: each value is
    multiplied by its scale in fp32 and rounded once, as :func:`reference` does. ``kernel``:
    "fused" the one Triton kernel (NOTE [one dequantization kernel] in
    inference/dequant_kernel.py; ConfigError where it cannot run), "torch" torch's ops (int4
    needs ``scratch``: a byte tensor of at least n x row_q bytes), "auto" the first where it can."""
    prepare(q, s, p, out, scratch, kernel)()


def prepare(q: Any, s: Any, p: Packing, out: Any, scratch: Any = None, kernel: str = "auto") -> Callable[[], None]:
    """:func:`dequantize` of these views made once: the checks, views and launch arguments are
    made now, and each call of what it returns queues the same work on the current stream
    (NOTE [packed chunks made once] in inference/transport.py: a streamed chunk is dequantized
    from and into the same views every forward)."""
    from . import dequant_kernel
    n = q.shape[0]
    o = out.view(n, p.cols)
    if kernel not in KERNELS:
        raise ConfigError(f"kernel must be one of {', '.join(map(repr, KERNELS))}, got {kernel!r}")
    fused = dequant_kernel.prepare(q, s, p, o) if kernel != "torch" and dequant_kernel.available(o) else None
    if kernel == "fused":
        if fused is None:
            raise ConfigError(_NO_FUSED)

        def strict() -> None:
            if not fused():
                raise ConfigError(_NO_FUSED)
        return strict
    ops = _torch_ops(q, s, p, o, scratch)
    if fused is None:
        return ops

    def either() -> None:
        if not fused():
            ops()
    return either


def prepare_many(items: list[tuple[Any, Any, Packing, Any]], scratch: Any = None) -> Callable[[], None]:
    """:func:`prepare` of each (q, s, p, out) of ``items``, the rows of one staged chunk (views of
    one staging buffer and of one slot), made once: on a GPU the members of each format, scale
    layout and slot dtype dequantize in one launch (NOTE [one launch a chunk] in
    inference/dequant_kernel.py), each member on its own ("auto") where that launch cannot run."""
    from . import dequant_kernel
    kinds: dict[tuple[Any, ...], list[Any]] = {}
    for q, s, p, out in items:
        kinds.setdefault((p.fmt, p.groups == 1, out.dtype), []).append((q, s, p, out.view(q.shape[0], p.cols)))
    # [one launch or None, each member's own (made where the launch cannot run), the members]
    plans: list[list[Any]] = []
    for members in kinds.values():
        fused = dequant_kernel.prepare_many(members, INT4_GROUP) if dequant_kernel.available(members[0][3]) else None
        plans.append([fused, None, members])

    def run() -> None:
        for plan in plans:
            fused, singles, members = plan
            if fused is not None and fused():
                continue
            if singles is None:
                singles = plan[1] = [prepare(q, s, p, out, scratch) for q, s, p, out in members]
            for one in singles:
                one()
    return run


_NO_FUSED = ("the fused dequantization needs a CUDA tensor, contiguous views and Triton importable; "
             "pass kernel='auto' to fall back on torch's ops")


def _torch_ops(q: Any, s: Any, p: Packing, o: Any, scratch: Any) -> Callable[[], None]:
    """torch's ops writing ``o`` ([n, cols]) from ``q`` and ``s``, their views made now."""
    import torch
    n = q.shape[0]
    if p.fmt == "int8":
        return lambda: torch.mul(q, s, out=o)       # int8 x fp32 per row -> the model's dtype
    if p.fmt == "fp8":
        def fp8() -> None:
            o.copy_(q)                              # exact: every e4m3 value is a half, bfloat16 or float
            o.mul_(s)
        return fp8
    if scratch is None:
        def refuse() -> None:      # raised when the ops are needed: the fused kernel needs no scratch
            raise ConfigError("dequantizing int4 with torch's ops needs scratch: a byte tensor of at least "
                              f"{n * p.row_q} bytes")
        return refuse
    gb = p.group // 2
    qi = q.view(torch.int8).view(n, p.groups, gb)
    a = scratch[: n * p.row_q].view(torch.int8).view(n, p.groups, gb)
    sv = s.view(n, p.groups, 1)
    pair = o.view(n, p.groups, gb, 2)
    hi, lo = pair[..., 1], pair[..., 0]

    def int4() -> None:
        torch.bitwise_right_shift(qi, 4, out=a)      # the high nibble, sign-extended: column 2j + 1
        torch.mul(a, sv, out=hi)
        torch.bitwise_left_shift(qi, 4, out=a)       # the low nibble to the top, then back down
        a.bitwise_right_shift_(4)
        torch.mul(a, sv, out=lo)
    return int4


def reference(q: Any, s: Any, p: Packing, dtype: Any) -> Any:
    """The weights of ``q`` and ``s`` (n packed rows) by the plain formula, [n, cols] in ``dtype``:
    ``(values.float() * scale).to(dtype)``, the values unpacked with no shifts."""
    import torch
    n = q.shape[0]
    if p.fmt == "int4":
        b = q.view(torch.uint8).to(torch.int16)
        lo, hi = b & 15, b >> 4
        lo = torch.where(lo >= 8, lo - 16, lo)
        hi = torch.where(hi >= 8, hi - 16, hi)
        vals = torch.stack([lo, hi], dim=-1).view(n, p.cols).float()
    else:
        vals = q.float()
    scale = s.float().repeat_interleave(p.group, dim=1)
    return (vals * scale).to(dtype)


def unpack(q: Any, s: Any, p: Packing, out: Any) -> None:
    """``out`` (``p``'s shape, any device) gets the weights of ``q`` and ``s`` by :func:`reference`,
    a piece of rows at a time (unwrap's restore)."""
    flat = out.view(p.rows, p.cols)
    step = max(1, QUANT_CHUNK // max(1, p.cols))
    for lo in range(0, p.rows, step):
        hi = min(p.rows, lo + step)
        flat[lo:hi].copy_(reference(q[lo:hi], s[lo:hi], p, out.dtype))
