"""The fused dequantization kernel of quantized streaming (NOTE [one dequantization kernel]):
:func:`available` says whether it can run, :func:`dequantize` runs it.

NOTE [one dequantization kernel]
    torch's own ops dequantize a packed weight in one pass for int8 (``torch.mul(values, scales,
    out=slot)``), two for fp8 and five for int4, and each mixes dtypes (int8 or fp8 values, fp32
    scales, a half slot): torch runs such an op through its slow casting path, element by element,
    and int4 writes its two nibbles' columns with a stride of two. Quantized forwards took up to
    5.6x the link's time for the bytes they moved (docs/inference.md; bench/quant_dequant.py
    times each kernel against the link). So on a GPU, where Triton is (torch's CUDA wheels bring
    it, and torch.compile uses it), one Triton kernel per staged range of rows reads the packed
    values and their scales once and writes the slot once, in its dtype, contiguous: a program
    per row and block of columns, each value multiplied by its scale in fp32 and rounded once
    (round to nearest even), which is exactly quant.reference's ``(values.float() *
    scale).to(dtype)``, bit for bit. Where Triton is not importable (the CPU, the fake backend),
    or a view is not contiguous, torch's ops run instead: the same bits, slower.

NOTE [one launch a chunk]
    A staged chunk holds a layer's members back to back (q, k, v, o, the MLP's three: seven
    weights), and a launch through Triton's Python launcher costs the host 30-60 us. At 1x128
    tokens a streamed forward of a 26-layer model is bound by the host, not by the link: on the
    H200, Qwen2's int4 prefill took 52 ms against 19 ms of copies, and its resident prefill 40 ms
    (docs/inference.md). So a chunk's members of one format and slot dtype dequantize in one
    launch (:func:`prepare_many`): a program per row and block of columns of all of them, as the
    kernel of one member has, which finds its member in a small table on the device (each
    member's first program, its values', scales' and slot's offsets from two bases, its columns
    and grouping). Each value is the same product rounded once as in the kernel of one member.
    The group is a constant (int4's grouped scales are of quant.INT4_GROUP columns), so a
    column's group is a shift: read from the table, it cost a 64-bit division a column, and
    int4's dequantization 3.5x the device time of the kernel of one member.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

__all__ = ["BLOCK", "available", "dequantize", "prepare", "prepare_many", "failed"]

BLOCK = 1024      # columns a program writes
log = logging.getLogger("tiermem")


@functools.cache
def _kernel() -> Any:
    """The jitted kernel, or None where Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except Exception:          # ImportError, or a Triton that does not load with this torch
        return None

    @triton.jit
    def dequant(q_ptr, s_ptr, out_ptr, cols, row_q, groups, group,
                INT4: tl.constexpr, PER_ROW: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = c < cols
        if INT4:
            # Column 2j is the low nibble of byte j, column 2j + 1 the high one; each is a
            # two's-complement value of -8..7.
            b = tl.load(q_ptr + row * row_q + c // 2, mask=mask).to(tl.int32)
            v = (b >> ((c % 2) * 4)) & 15
            x = tl.where(v >= 8, v - 16, v).to(tl.float32)
        else:
            x = tl.load(q_ptr + row * row_q + c, mask=mask).to(tl.float32)
        if PER_ROW:
            s = tl.load(s_ptr + row)
        else:
            s = tl.load(s_ptr + row * groups + c // group, mask=mask, other=0.0)
        # Rounded once to the slot's dtype, to nearest even (on a GPU; Triton's CPU interpreter
        # truncates to bfloat16, so tests/test_quant.py holds it to the bit in fp16 and fp32 only).
        tl.store(out_ptr + row * cols + c, (x * s).to(out_ptr.dtype.element_ty), mask=mask)

    return dequant


# The table of :func:`_many_kernel` has a row of _META int64 per member: its first program (a
# program per row and block of BLOCK columns), its values' and its scales' byte offsets from the
# input base, its slot's element offset from the output base, its columns, its values' bytes a
# row, its groups a row and a group's columns.
_META = 8


@functools.cache
def _many_kernel() -> Any:
    """The kernel of NOTE [one launch a chunk], or None where Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except Exception:
        return None

    @triton.jit
    def dequant_many(in_ptr, out_ptr, meta_ptr, members,
                     FMT: tl.constexpr, PER_ROW: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                     META: tl.constexpr):
        # A program per block of BLOCK columns of one row of one member, as the kernel of one
        # member has: its member is the last whose first program is at or before it.
        pid = tl.program_id(0)
        m = pid * 0
        for k in range(1, members):
            m = tl.where(pid >= tl.load(meta_ptr + k * META), k, m)
        at = meta_ptr + m * META
        cols = tl.load(at + 4).to(tl.int32)           # 32-bit divisions below: 64-bit ones are slow
        blocks = (cols + BLOCK - 1) // BLOCK
        tile = pid - tl.load(at).to(tl.int32)
        row = (tile // blocks).to(tl.int64)
        c = (tile % blocks) * BLOCK + tl.arange(0, BLOCK)
        mask = c < cols
        groups = tl.load(at + 6)
        base = in_ptr.to(tl.pointer_type(tl.uint8))
        q_ptr = base + tl.load(at + 1) + row * tl.load(at + 5)
        s_ptr = (base + tl.load(at + 2)).to(tl.pointer_type(tl.float32)) + row * groups
        if FMT == 2:        # int4: column 2j the low nibble of byte j, 2j + 1 the high one
            b = tl.load(q_ptr + c // 2, mask=mask).to(tl.int32)
            v = (b >> ((c % 2) * 4)) & 15
            x = tl.where(v >= 8, v - 16, v).to(tl.float32)
        elif FMT == 1:      # fp8 e4m3
            x = tl.load(q_ptr + c, mask=mask).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:               # int8
            x = tl.load(q_ptr + c, mask=mask).to(tl.int8, bitcast=True).to(tl.float32)
        if PER_ROW:
            sc = tl.load(s_ptr)
        else:
            sc = tl.load(s_ptr + c // GROUP, mask=mask, other=0.0)   # a shift: GROUP is a power of two
        tl.store(out_ptr + tl.load(at + 3) + row * cols + c, (x * sc).to(out_ptr.dtype.element_ty), mask=mask)

    return dequant_many


def available(out: Any) -> bool:
    """Whether the kernel can write ``out``: a CUDA tensor, and Triton importable."""
    return bool(getattr(out, "is_cuda", False)) and _kernel() is not None


_failed: set[tuple[str, Any, int]] = set()    # (format, slot dtype, device) the kernel did not compile for


def failed() -> list[tuple[str, str, int]]:
    """(format, slot dtype, device) the kernel did not compile for in this process: torch's ops
    dequantize those (a bench reports which path ran)."""
    return sorted((f, str(d), i) for f, d, i in _failed)


def dequantize(q: Any, s: Any, p: Any, out: Any) -> bool:
    """Write ``out`` (n rows of ``p.cols``, the model's dtype) from ``q`` and ``s`` (views of n
    packed rows, quant.views) with one kernel on torch's current stream; False (nothing
    queued) where a view is not contiguous, or the kernel does not compile for this format and
    dtype on this device (fp8 needs a GPU of compute capability 8.9 or more), for the caller's
    torch path."""
    run = prepare(q, s, p, out)
    return run is not None and run()


def prepare(q: Any, s: Any, p: Any, out: Any) -> Callable[[], bool] | None:
    """:func:`dequantize` of these views made once (NOTE [packed chunks made once] in
    inference/transport.py): the checks, the grid and the launch's arguments are computed now,
    and each call of what it returns launches the kernel and says whether it ran (False:
    it does not compile here, for the caller's torch path). None where it cannot run at all."""
    kernel = _kernel()
    if kernel is None or not (q.is_contiguous() and s.is_contiguous() and out.is_contiguous()):
        return None
    n = int(q.shape[0])
    key = (p.fmt, out.dtype, out.device.index if out.device.index is not None else -1)
    if n == 0:
        return lambda: key not in _failed
    import torch
    launch = kernel[(n, -(-p.cols // BLOCK))]
    args = (q, s, out, p.cols, p.row_q, p.groups, p.group)
    consts = {"INT4": p.fmt == "int4", "PER_ROW": p.groups == 1, "BLOCK": BLOCK}
    device = out.device

    def go() -> None:
        # Triton launches on the current device's current stream: the slot's device, whose
        # current stream the caller made the dequantization lane's.
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            launch(*args, **consts)
    return _guarded(key, go)


def _guarded(key: tuple[str, Any, int], go: Callable[[], None]) -> Callable[[], bool]:
    """``go`` (a launch) run by what this returns, which says whether it ran: False, and ``key``
    (format, slot dtype, device) never launched again, where it does not compile here."""
    def run() -> bool:
        if key in _failed:
            return False
        try:
            go()
        except Exception as e:     # Triton's compile errors have no common base; torch's ops do the same work
            _failed.add(key)
            log.warning("tiermem: the fused dequantization does not run for %s into %s here (%s: %s); torch's ops "
                        "dequantize instead (NOTE [one dequantization kernel])", key[0], key[1], type(e).__name__, e)
            return False
        return True
    return run


_FMT = {"int8": 0, "fp8": 1, "int4": 2}


def prepare_many(items: list[tuple[Any, Any, Any, Any]], group: int) -> Callable[[], bool] | None:
    """One launch that dequantizes every (q, s, p, out) of ``items`` (NOTE [one launch a
    chunk]): views of one staging buffer's packed rows and of one slot, all of one format, one
    scale layout (per row, or per ``group`` columns, a power of two) and one slot dtype. Its table is made now, on the
    slot's device; each call of what it returns launches the kernel on the current stream and
    says whether it ran (False: it does not compile here, for the caller's per-member path).
    None where it cannot run: Triton missing, a view not contiguous, the views not of one
    kind, or an offset that is not a whole number of the slot dtype's elements."""
    kernel = _many_kernel()
    if kernel is None or not items:
        return None
    q0, _, p0, o0 = items[0]
    kind = (p0.fmt, p0.groups == 1, o0.dtype, o0.device)
    if any((p.fmt, p.groups == 1, o.dtype, o.device) != kind for _, _, p, o in items):
        return None
    if not all(t.is_contiguous() for q, s, _, o in items for t in (q, s, o)):
        return None
    if group & (group - 1) or any(p.groups > 1 and p.group != group for _, _, p, _ in items):
        return None         # the kernel's group is a constant, a power of two: its division a shift
    import torch
    ins = [t for q, s, _, _ in items for t in (q, s)]
    src = min(ins, key=lambda t: t.data_ptr())
    dst = min((o for _, _, _, o in items), key=lambda t: t.data_ptr())
    size = dst.element_size()
    tiles, table = 0, []
    for q, s, p, o in items:
        gap = o.data_ptr() - dst.data_ptr()
        if gap % size:
            return None
        table.append([tiles, q.data_ptr() - src.data_ptr(), s.data_ptr() - src.data_ptr(), gap // size,
                      p.cols, p.row_q, p.groups, p.group])
        tiles += int(q.shape[0]) * -(-p.cols // BLOCK)
    # Its own key: where this kernel does not compile, the kernel of one member may still.
    key = (f"{p0.fmt} (a chunk)", o0.dtype, o0.device.index if o0.device.index is not None else -1)
    if tiles == 0:
        return lambda: key not in _failed
    # The table crosses on the stream the kernel runs on, at its first launch, from pinned
    # memory: a copy from pageable memory now would wait for the device's work queued so far,
    # and the expert cache prepares its chunks in the middle of a forward (NOTE [packed chunks
    # made once] in inference/transport.py).
    host = torch.tensor(table, dtype=torch.int64)
    on_gpu = o0.device.type == "cuda"
    if on_gpu:
        host = host.pin_memory()
    meta = torch.empty_like(host, device=o0.device)
    launch = kernel[(tiles,)]
    args = (src, dst, meta, len(items))
    consts = {"FMT": _FMT[p0.fmt], "PER_ROW": p0.groups == 1, "GROUP": group, "BLOCK": BLOCK, "META": _META}
    device = o0.device
    sent: list[Any] = [host]          # the table's host copy until it is sent

    def go() -> None:
        with torch.cuda.device(device) if on_gpu else contextlib.nullcontext():
            if sent:
                meta.copy_(sent.pop(), non_blocking=True)
                if on_gpu:      # made on another stream: kept until this one's kernels are done
                    meta.record_stream(torch.cuda.current_stream(device))
            launch(*args, **consts)
    return _guarded(key, go)
