"""Quantized streaming on a CPU (NOTE [quantized streaming] in tiermem/inference/quant.py): the
packing and its dequantization against the plain formula, bitwise; a module streamed packed over
the fake backend, whose slots hold exactly that dequantization, whose logits stay close to the
model's own, and whose forwards move the packed bytes only."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from helpers import share, tiny_llama

import tiermem
from tiermem.inference import quant, transport
from tiermem.testing import linear_agreement, logits_agreement

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _packed(w: torch.Tensor, fmt: str) -> tuple[quant.Packing, torch.Tensor, torch.Tensor]:
    p = quant.packing(w, fmt)
    raw = torch.zeros(p.nbytes, dtype=torch.uint8)
    q, s = quant.views(p, raw)
    quant.pack_into(w, p, q, s, "cpu")
    return p, q, s


@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(96, 256), (3, 40, 96), (7, 130)], ids=["linear", "experts", "short_rows"])
@pytest.mark.long(keep=6)
def test_dequantization_is_the_plain_formula_bitwise(fmt, dtype, shape):
    torch.manual_seed(0)
    w = (torch.randn(shape) * 0.05).to(dtype)
    w.view(-1)[5] = 0.0
    p, q, s = _packed(w, fmt)
    out = torch.full_like(w, float("nan"))
    quant.dequantize(q, s, p, out, torch.empty(p.q_bytes, dtype=torch.uint8))
    assert torch.equal(out, quant.reference(q, s, p, dtype).view(shape))
    # ... and close to the weights it came from: per-tensor cosine and the largest error per row
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), w.float().flatten(), dim=0)
    assert cos >= {"int8": 0.9999, "fp8": 0.999, "int4": 0.99}[fmt]
    assert p.nbytes == quant.Packing(fmt, p.rows, p.cols, p.group).nbytes
    back = torch.empty_like(w)
    quant.unpack(q, s, p, back)
    assert torch.equal(back, out)


@pytest.fixture
def interpreted_kernel(monkeypatch):
    """The fused dequantization (NOTE [one dequantization kernel]) under Triton's CPU interpreter;
    skipped where Triton is not installed (it comes with torch's CUDA wheels, not the CPU ones)."""
    pytest.importorskip("triton")
    from tiermem.inference import dequant_kernel
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    dequant_kernel._kernel.cache_clear()
    dequant_kernel._many_kernel.cache_clear()
    yield dequant_kernel
    dequant_kernel._kernel.cache_clear()
    dequant_kernel._many_kernel.cache_clear()


@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(5, 256), (3, 1030), (4, 2304), (2, 3, 128)], ids=str)
def test_the_fused_kernel_writes_the_plain_formula_bitwise(interpreted_kernel, fmt, dtype, shape):
    # Columns past a block (1030, 2304), one scale a row (int4 at 1030) and per group, stacked
    # experts. bfloat16 is held to the bit on the GPU only: the interpreter truncates to it.
    torch.manual_seed(0)
    w = (torch.randn(shape) * 0.05).to(dtype)
    p, q, s = _packed(w, fmt)
    out = torch.full((p.rows, p.cols), float("nan"), dtype=dtype)
    assert interpreted_kernel.dequantize(q, s, p, out)
    assert torch.equal(out, quant.reference(q, s, p, dtype))
    # a staged range of rows is its own launch
    part = torch.full((2, p.cols), float("nan"), dtype=dtype)
    assert interpreted_kernel.dequantize(q[1:3], s[1:3], p, part)
    assert torch.equal(part, out[1:3])
    # a view that is not contiguous is left to torch's ops
    assert not interpreted_kernel.dequantize(q, s, p, torch.empty(p.cols, p.rows, dtype=dtype).t())


def _staged_members(fmt, dtype, shapes, device="cpu"):
    """Members of ``shapes`` packed back to back in one staging buffer, each with its rows'
    place in one slot (a gap between them) and its plain-formula weights: a staged chunk."""
    from tiermem.inference.quant import ALIGN
    torch.manual_seed(0)
    ws = [(torch.randn(sh, device=device) * 0.05).to(dtype) for sh in shapes]
    ps = [quant.packing(w, fmt) for w in ws]
    offs, at = [], 0
    for p in ps:
        offs.append(at)
        at += -(-p.nbytes // ALIGN) * ALIGN
    raw = torch.zeros(at, dtype=torch.uint8, device=device)
    slot = torch.full((sum(p.rows * p.cols + 8 for p in ps),), float("nan"), dtype=dtype, device=device)
    items, wants, o = [], [], 8
    for w, p, off in zip(ws, ps, offs):
        q, s = quant.views(p, raw[off:off + p.nbytes])
        quant.pack_into(w, p, q, s, torch.device(device))
        items.append((q, s, p, slot[o:o + p.rows * p.cols].view(p.rows, p.cols)))
        wants.append(quant.reference(q, s, p, dtype))
        o += p.rows * p.cols + 8
    return items, wants, slot


@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_one_launch_dequantizes_a_chunks_members_bitwise(interpreted_kernel, fmt, dtype):
    # NOTE [one launch a chunk]: members of several widths (past a block, one scale a row at
    # 1030 for int4, grouped at the others) in one staging buffer, into one slot, one launch a
    # scale layout; the slot's bytes between members are not written.
    items, wants, slot = _staged_members(fmt, dtype, [(5, 256), (3, 1030), (4, 2304), (7, 384)])
    kinds = {}
    for it in items:
        kinds.setdefault(it[2].groups == 1, []).append(it)
    for members in kinds.values():
        run = interpreted_kernel.prepare_many(members, quant.INT4_GROUP)
        assert run is not None and run()
    assert all(torch.equal(out, want) for (_, _, _, out), want in zip(items, wants))
    assert int(torch.isnan(slot).sum()) == 8 * (len(items) + 1) - 8
    # quant.prepare_many (on the CPU, torch's ops; int4's need scratch): the same bits
    for _, _, _, out in items:
        out.fill_(float("nan"))
    quant.prepare_many(items, torch.empty(max(p.q_bytes for _, _, p, _ in items), dtype=torch.uint8))()
    assert all(torch.equal(out, want) for (_, _, _, out), want in zip(items, wants))
    # members of two slot dtypes, or a view that is not contiguous, are not one launch
    other = torch.empty(items[0][2].rows, items[0][2].cols, dtype=torch.bfloat16)
    assert interpreted_kernel.prepare_many([items[0], items[0][:3] + (other,)], quant.INT4_GROUP) is None
    p = items[0][2]
    assert interpreted_kernel.prepare_many([items[0][:3] + (torch.empty(p.cols, p.rows, dtype=dtype).t(),)],
                                           quant.INT4_GROUP) is None


def test_quant_prepare_many_on_the_cpu_is_torchs_ops():
    items, wants, _ = _staged_members("int8", torch.float32, [(4, 256), (3, 512)])
    quant.prepare_many(items)()
    assert all(torch.equal(out, want) for (_, _, _, out), want in zip(items, wants))


@pytest.mark.parametrize("values", ["*i8", "*fp8e4nv", "*u8"], ids=["int8", "fp8", "int4"])
def test_the_fused_kernel_compiles_for_an_h200_and_rounds_once_to_nearest_even(values):
    """Compiled ahead of time for sm_90 (Triton's wheel carries ptxas; no GPU needed): every
    format into every slot dtype, a scale per row or per group; the PTX multiplies in fp32 with
    no flush of subnormals and rounds to the slot's dtype to nearest even, as torch does."""
    triton = pytest.importorskip("triton")
    import re

    from triton.backends.compiler import GPUTarget

    from tiermem.inference import dequant_kernel
    k = dequant_kernel._kernel()
    at = {n: (k.arg_names.index(n),) for n in ("INT4", "PER_ROW", "BLOCK")}
    for out, cvt in (("*fp16", "cvt.rn.f16.f32"), ("*bf16", "cvt.rn.bf16.f32"), ("*fp32", None)):
        for per_row in (True, False):
            sig = {"q_ptr": values, "s_ptr": "*fp32", "out_ptr": out, "cols": "i32", "row_q": "i32", "groups": "i32",
                   "group": "i32", "INT4": "constexpr", "PER_ROW": "constexpr", "BLOCK": "constexpr"}
            consts = {at["INT4"]: values == "*u8", at["PER_ROW"]: per_row, at["BLOCK"]: dequant_kernel.BLOCK}
            c = triton.compile(triton.compiler.ASTSource(fn=k, signature=sig, constexprs=consts),
                               target=GPUTarget("cuda", 90, 32))
            ptx = c.asm["ptx"]
            assert c.asm["cubin"] and "mul.f32" in ptx and ".ftz" not in ptx
            assert not re.search(r"\bfma\.", ptx)                    # one product, rounded once
            if cvt:
                assert cvt in ptx


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
def test_the_kernel_of_a_chunk_compiles_for_an_h200_and_rounds_once_to_nearest_even(fmt):
    """NOTE [one launch a chunk]'s kernel, compiled ahead of time for sm_90 as above."""
    triton = pytest.importorskip("triton")
    import re

    from triton.backends.compiler import GPUTarget

    from tiermem.inference import dequant_kernel
    k = dequant_kernel._many_kernel()
    at = {n: (k.arg_names.index(n),) for n in ("FMT", "PER_ROW", "GROUP", "BLOCK", "META")}
    for out, cvt in (("*fp16", "cvt.rn.f16.f32"), ("*bf16", "cvt.rn.bf16.f32"), ("*fp32", None)):
        for per_row in (True, False):
            sig = {"in_ptr": "*u8", "out_ptr": out, "meta_ptr": "*i64", "members": "i32", "FMT": "constexpr",
                   "PER_ROW": "constexpr", "GROUP": "constexpr", "BLOCK": "constexpr", "META": "constexpr"}
            consts = {at["FMT"]: dequant_kernel._FMT[fmt], at["PER_ROW"]: per_row, at["GROUP"]: quant.INT4_GROUP,
                      at["BLOCK"]: dequant_kernel.BLOCK, at["META"]: dequant_kernel._META}
            c = triton.compile(triton.compiler.ASTSource(fn=k, signature=sig, constexprs=consts),
                               target=GPUTarget("cuda", 90, 32))
            ptx = c.asm["ptx"]
            assert c.asm["cubin"] and "mul.f32" in ptx and ".ftz" not in ptx
            assert not re.search(r"\bfma\.", ptx)
            if cvt:
                assert cvt in ptx


def test_the_fused_kernel_is_asked_for_where_it_cannot_run():
    p, q, s = _packed(torch.randn(4, 256), "int8")
    out = torch.empty(4, 256)
    with pytest.raises(tiermem.ConfigError, match="fused"):
        quant.dequantize(q, s, p, out, kernel="fused")       # a CPU tensor
    with pytest.raises(tiermem.ConfigError, match="kernel"):
        quant.dequantize(q, s, p, out, kernel="triton")
    quant.dequantize(q, s, p, out, kernel="auto")               # torch's ops, here
    assert torch.equal(out, quant.reference(q, s, p, torch.float32))


def test_int4_packs_two_values_a_byte_with_a_scale_per_group():
    w = torch.zeros(2, 256)
    w[0, :128] = torch.arange(128) % 15 - 7          # -7..7: exact multiples of the group's absmax / 7
    w[0, 128:] = 0.5
    w[1] = -1.0
    p, q, s = _packed(w, "int4")
    assert (p.group, p.groups, p.row_q, p.row_s) == (128, 2, 128, 8)
    assert torch.equal(quant.reference(q, s, p, torch.float32), w)
    assert int(q[0, 0]) == ((int(w[0, 0]) & 15) | ((int(w[0, 1]) & 15) << 4))
    assert s.tolist()[0][0] == pytest.approx(1.0)
    # a row shorter than a group, or not a multiple of one, has one scale; an odd one is not packed
    assert quant.packing(torch.zeros(3, 130), "int4").group == 130
    assert quant.packing(torch.zeros(3, 131), "int4") is None
    assert quant.packing(torch.zeros(10), "int8") is None
    assert quant.packing(torch.zeros(4, 4, dtype=torch.int32), "int8") is None


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_a_run_of_rows_is_its_own_packing(fmt):
    """An expert's rows, copied on their own, dequantize to what the whole tensor gives them (the
    expert cache copies an expert so)."""
    torch.manual_seed(1)
    w = torch.randn(4, 32, 256).half()
    p, q, s = _packed(w, fmt)
    whole = quant.reference(q, s, p, torch.float16).view_as(w)
    raw = torch.zeros(p.nbytes, dtype=torch.uint8)
    raw_all = torch.cat([q.view(torch.uint8).flatten(), torch.zeros(p.s_offset - p.q_bytes, dtype=torch.uint8),
                         s.view(torch.uint8).flatten()])
    raw[: raw_all.numel()] = raw_all
    (qo, qn), (so, sn) = p.row_ranges(64, 96)                 # expert 2
    one = torch.zeros(p.rows_nbytes(32), dtype=torch.uint8)
    one[:qn] = raw[qo:qo + qn]
    at = p.rows_nbytes(32) - -(-sn // 256) * 256
    one[at:at + sn] = raw[so:so + sn]
    q2, s2 = quant.views(p, one, 32)
    out = torch.empty(32, 256, dtype=torch.float16)
    quant.dequantize(q2, s2, p, out, torch.empty(p.q_bytes, dtype=torch.uint8))
    assert torch.equal(out, whole[2])


def test_bad_formats_and_modes_are_refused(tier):
    m = _mlp()
    with pytest.raises(tiermem.ConfigError, match="stream_dtype"):
        tier.wrap_module(m, budget=share(m, 30), stream_dtype="int3")
    with pytest.raises(tiermem.ConfigError, match="zero_copy"):
        tier.wrap_module(m, budget=share(m, 30), stream_dtype="int8", mode="zero_copy")
    with pytest.raises(tiermem.TierMemError, match="no room for one slot"):
        tier.wrap_module(m, budget=1000, stream_dtype="int8")
    assert tiermem.tiered_of(m[0][0].weight) is None and tier.resident_bytes == 0      # nothing adopted


def _mlp(dtype=torch.float16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.LayerNorm(256))
                           for _ in range(6)]).to(dtype).requires_grad_(False)


@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_slot_holds_the_reference_dequantization_of_its_home(tier, fake, fmt, dtype):
    m = _mlp(dtype)
    h = tier.wrap_module(m, budget=share(m, 35), max_group_bytes=300_000, stream_dtype=fmt, mode="stream")
    packed = [g for g in h._groups.values() if g.packed]
    assert packed and all(not g.pinned for g in packed)
    assert not any(g.packing for g in h._groups.values() if g.pinned)          # resident groups stay as they are
    seen: dict[int, torch.Tensor] = {}
    linears = [x for x in m.modules() if isinstance(x, nn.Linear)]
    hooks = [x.register_forward_pre_hook(lambda mod, a: seen.__setitem__(id(mod), mod.weight.clone())) for x in linears]
    x = torch.randn(4, 256).to(dtype)
    m(x)
    m(x)
    for hk in hooks:
        hk.remove()
    st = h._stream
    checked = 0
    for g in packed:
        for t, p, v in zip(g.tensors, g.packing, st._packed_views(g)):
            if p is None:
                continue
            q, s = v
            owner = next(x for x in linears if x.weight is t)
            assert torch.equal(seen[id(owner)], quant.reference(q, s, p, dtype).view(t.shape))
            checked += 1
        # biases and norms are kept as they are, in the model's dtype, at their home
        assert all(fake.pointer_kind(t.data_ptr()) == "host" for t, p in zip(g.tensors, g.packing) if p is None)
    assert checked == sum(1 for g in packed for p in g.packing if p is not None) > 0
    h.unwrap()
    for g_t in (x.weight for x in linears):
        assert g_t.dtype == dtype


# Logits against the model's own on a tiny random Llama (fp32 on the CPU). Random weights compound
# the weights' error through the layers more than trained ones do (docs/inference.md, "What it
# costs in accuracy"); these floors are the measured values less a margin.
FLOORS = {"int8": 0.999, "fp8": 0.99, "int4": 0.90}
# Each quantized Linear's output against its fp weight's on the same input: the goals.
LINEAR_GOALS = {"int8": 0.999, "fp8": 0.999, "int4": 0.99}
GROUP = 512 << 10        # max_group_bytes: the tiny Llama's sublayers are groups of their own


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_tiny_llama_logits_stay_close_and_forwards_move_the_packed_bytes(tier, fmt):
    model, cfg = tiny_llama()
    ref = copy.deepcopy(model)
    plain = copy.deepcopy(model)
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        want = ref(ids).logits
    budget = share(model, 40)
    t0 = tiermem.Tier(backend=type(tier.backend)(total=1 << 30))
    h0 = t0.wrap_module(plain, budget=budget, mode="stream", max_group_bytes=GROUP)
    h = tier.wrap_module(model, budget=budget, stream_dtype=fmt, mode="stream", max_group_bytes=GROUP)
    weights = {n: m.weight for n, m in ref.named_modules() if isinstance(m, nn.Linear)}
    with torch.no_grad():
        for tt, hh, mm in ((t0, h0, plain), (tier, h, model)):
            mm(ids)                                          # learns the order
            hh.drain()
            before = tt.stats()["moved_bytes.all.h2d"]
            with linear_agreement(mm, weights) as lin:
                got = mm(ids).logits
            hh.drain()
            hh.moved = tt.stats()["moved_bytes.all.h2d"] - before
        again = model(ids).logits
    agree = logits_agreement(want, got)
    assert agree["cosine_min"] >= FLOORS[fmt], agree
    # Each Linear against its own weight on the same input: the goals hold there
    # (docs/inference.md, "What it costs in accuracy": the logits of random weights compound it).
    assert lin["linears"] == len(weights) and lin["cosine_min"] >= LINEAR_GOALS[fmt], lin["worst"]
    assert lin["cosine_min"] < 0.99999                           # the quantized ones do differ
    assert torch.equal(again, got)                               # the same dequantized slots every time
    # The forward moved what the plan says, and the quantized weights at their packed size: 4x
    # (int8, fp8) or ~7.5x (int4) fewer bytes than fp32, plus the scales and what stays fp32.
    assert h.moved == h.moved_bytes == sum(g.link_bytes for g in h._groups.values() if not g.pinned and not g.gathered)
    assert h0.moved == h0.moved_bytes
    packed = [g for g in h._groups.values() if g.packed]
    quantized = sum(t.numel() * 4 for g in packed for t, p in zip(g.tensors, g.packing) if p is not None)
    kept = h.moved - sum(p.nbytes for g in packed for p in g.packing if p is not None)
    assert kept < 0.05 * h.moved + 4096 * len(packed)            # norms and biases: a few KiB
    ratio = sum(p.nbytes for g in packed for p in g.packing if p is not None) / quantized
    assert ratio < {"int8": 0.26, "fp8": 0.26, "int4": 0.14}[fmt]
    assert h.moved < {"int8": 0.3, "fp8": 0.3, "int4": 0.17}[fmt] * h0.moved
    assert tier.stats()["resident_bytes.all.peak"] <= h.budget
    h.unwrap()
    h0.unwrap()
    t0.close()


def test_streamed_windows_fit_the_budget_with_their_staging(tier, fake):
    model, cfg = tiny_llama(torch.float16)
    h = tier.wrap_module(model, budget=share(model, 40), stream_dtype="int4", max_group_bytes=GROUP)
    st = h._stream
    assert st.stage_bytes == max(min(g.packed_nbytes, quant.QSTAGE_BYTES) for g in h._groups.values() if g.packed)
    assert st.window_bytes <= h.plan.window and h.plan.staging >= quant.QSTAGES * st.stage_bytes
    assert h.plan.pinned_bytes + h.plan.window <= h.budget
    assert fake.live()["device"] == st.window_bytes
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (1, 8)))
    h.unwrap()
    assert fake.live()["device"] == 0


@pytest.mark.parametrize("stage", [None, 40_000], ids=["whole", "chunked"])
def test_a_group_crosses_in_as_few_chunks_as_its_staging_allows(tier, monkeypatch, stage):
    """A packed group no bigger than a staging buffer crosses in one chunk (one copy, one
    dequantization: the chunks were cut two alignments short, so every such group took two); a
    bigger one in chunks that each fit, covering its rows once, in order."""
    if stage is not None:
        monkeypatch.setattr(quant, "QSTAGE_BYTES", stage)
    model, cfg = tiny_llama(torch.float16)
    h = tier.wrap_module(model, budget=share(model, 40), stream_dtype="int8", max_group_bytes=GROUP)
    st = h._stream
    applied = []
    real = st._unpack
    monkeypatch.setattr(st, "_unpack", lambda g, jobs: (applied.append(g), real(g, jobs)))
    streamed = [g for g in h._groups.values() if g.packed and not g.pinned]
    split = 0
    for g in streamed:
        for piece in g.pieces:
            rows = st._piece_rows(piece)
            chunks = st._chunks(g, rows)
            if stage is None or g.packed_nbytes <= st.stage_bytes:
                assert len(chunks) == 1, g.name
            split += len(chunks) > 1
            for c in chunks:
                assert sum(g.packing[i].rows_nbytes(hi - lo) if g.packing[i] is not None else
                           transport._up((hi - lo) * transport._row_bytes(g.tensors[i]))
                           for i, lo, hi in c) <= st.stage_bytes
            flat = [r for c in chunks for r in c]
            for i, lo, hi in rows:          # each member's rows, once, in order
                mine = [(a, b) for j, a, b in flat if j == i]
                assert mine[0][0] == lo and mine[-1][1] == hi
                assert all(x[1] == y[0] for x, y in zip(mine, mine[1:]))
    assert (split > 0) == (stage is not None)
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    with torch.no_grad():
        model(ids)
        applied.clear()
        got = model(ids).logits
    if stage is None:        # every streamed group came in once a forward: one dequantization each
        assert sorted(id(g) for g in applied) == sorted(id(g) for g in streamed)
    h.unwrap()
    assert torch.isfinite(got).all()


def test_each_chunk_is_dequantized_after_its_copy_and_its_buffer_refilled_after_that(tier, monkeypatch):
    """NOTE [quantized streaming]'s order, chunk by chunk (the fake backend runs work at once, so
    the events are what is checked): a chunk's dequantization runs on the dequantization lane
    after its copy's end; a staging buffer is filled again only after the dequantization that
    read it last; a slot is ready once its last chunk is dequantized."""
    monkeypatch.setattr(quant, "QSTAGE_BYTES", 40_000)          # several chunks a group
    model, cfg = tiny_llama(torch.float16)
    h = tier.wrap_module(model, budget=share(model, 40), stream_dtype="int4", max_group_bytes=GROUP)
    st = h._stream
    assert st.dq.stream != st.lane.stream
    log = []
    fill, transform = st.stages.fill, st.ring.transform

    def spy_fill(lane, slot, parts, **kw):
        before = slot.free
        out = fill(lane, slot, parts, **kw)
        log.append(("fill", slot.index, before, out[1]))
        return out

    def spy_transform(lane, slot, fn, *, after=(), reads=()):
        reads = list(reads)
        ready = [r.ready for r in reads]
        end = transform(lane, slot, fn, after=after, reads=reads)
        log.append(("dequant", [r.index for r in reads], ready, end, lane is st.dq, slot.index, slot.ready is end))
        return end
    monkeypatch.setattr(st.stages, "fill", spy_fill)
    monkeypatch.setattr(st.ring, "transform", spy_transform)
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (1, 8)))
    assert sum(1 for e in log if e[0] == "fill") > 2 * len(st.stages)    # the buffers were reused
    last_fill, last_read = {}, {}
    for e in log:
        if e[0] == "fill":
            _, k, waited, end = e
            assert waited is last_read.get(k), "a staging buffer was refilled before its dequantization ended"
            last_fill[k] = end
        else:
            _, ks, ready, end, on_lane, _, became_ready = e
            assert on_lane and became_ready
            assert len(ks) == 1 and ready[0] is last_fill[ks[0]], "dequantized before its copy ended"
            last_read[ks[0]] = end
    h.unwrap()


def test_a_forward_that_records_gradients_is_refused_and_unwrap_restores_the_dequantized_weights(tier):
    model, cfg = tiny_llama()
    model.requires_grad_(True)
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    h = tier.wrap_module(model, budget=share(model, 40), stream_dtype="int8", max_group_bytes=GROUP)
    with pytest.raises(tiermem.TierMemError, match="records gradients"):
        model(ids)
    with torch.no_grad():
        got = model(ids).logits
    st = h._stream
    want = {id(t): quant.reference(v[0], v[1], p, t.dtype).view(t.shape)
            for g in h._groups.values() if g.packed
            for t, p, v in zip(g.tensors, g.packing, st._packed_views(g)) if p is not None}
    h.unwrap()
    params = {id(p): p for p in model.parameters()}
    assert want and all(torch.equal(params[k].data, v) for k, v in want.items())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, got)        # the dequantized weights, now plain


def test_few_token_forwards_stream_packed_experts_whole(tier, fake):
    """Stacked experts kept packed have no home in the model's dtype to read in place: a decode
    streams them whole (NOTE [quantized streaming])."""
    from test_module import _MoE
    torch.manual_seed(0)
    m = _MoE().requires_grad_(False)
    ref = copy.deepcopy(m)
    h = tier.wrap_module(m, budget=share(m, 45), max_group_bytes=64 << 10, zero_copy_max_tokens=2, stream_dtype="int8")
    experts = [g for g in h._groups.values() if g.stacked and not g.pinned]
    assert experts and all(g.packed for g in experts)
    x, idx = torch.randn(1, 64), torch.tensor([1, 5])
    m(x, idx)
    h.drain()
    before = tier.stats()["moved_bytes.all.h2d"]
    got = m(x, idx)
    assert h._fwd_mode == "decode"
    assert tier.stats()["moved_bytes.all.h2d"] - before >= sum(g.packed_nbytes for g in experts)
    assert torch.nn.functional.cosine_similarity(got.flatten(), ref(x, idx).flatten(), dim=0) > 0.999
    h.unwrap()


def test_load_pretrained_quantizes_the_checkpoint_as_it_reads_it(tier, fake, tmp_path):
    model, cfg = tiny_llama(torch.float16)
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    t0 = tiermem.Tier(backend=type(fake)(total=1 << 30))
    wrapped = copy.deepcopy(model)
    h0 = t0.wrap_module(wrapped, budget=share(model, 40), stream_dtype="int8", max_group_bytes=GROUP)
    got_model, h = tiermem.load_pretrained(tmp_path, budget=share(model, 40), tier=tier, stream_dtype="int8",
                                           max_group_bytes=GROUP)
    plain, hp = tiermem.load_pretrained(tmp_path, budget=share(model, 40), tier=t0, max_group_bytes=GROUP)
    packed = {g.name: g for g in h._groups.values() if g.packed}
    assert packed and set(packed) == {g.name for g in h0._groups.values() if g.packed}
    for g0 in h0._groups.values():
        if g0.packed:                  # the file's bytes packed as the module's own: byte for byte
            for a, b in zip(h0._stream._packed_views(g0), h._stream._packed_views(packed[g0.name])):
                assert all(torch.equal(x, y) for x, y in zip(a, b)) if isinstance(a, tuple) else torch.equal(a, b)
    with torch.no_grad():
        agree = logits_agreement(plain(ids).logits, got_model(ids).logits)
    assert agree["cosine_min"] >= FLOORS["int8"], agree
    for x in (h, h0, hp):
        x.unwrap()
    t0.close()


def test_load_pretrained_of_a_tied_checkpoint_packs_the_table_from_the_file_it_read(tier, fake, tmp_path):
    """A tied checkpoint (transformers saves the table once): the table's home as it is comes from
    the file before pinning, and its packed copy is made from that home, byte for byte as the
    module's own packs it (NOTE [packed tied table])."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=8192, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float16).eval()
    model.save_pretrained(tmp_path)
    table = model.model.embed_tokens.weight.detach().clone()
    budget = table.numel() * table.element_size() // 2           # the table does not fit: it streams, in parts
    t0 = tiermem.Tier(backend=type(fake)(total=1 << 30))
    h0 = t0.wrap_module(copy.deepcopy(model), budget=budget, stream_dtype="int8")
    got, h = tiermem.load_pretrained(tmp_path, budget=budget, tier=tier, stream_dtype="int8")
    g0, g = h0._groups["model.embed_tokens"], h._groups["model.embed_tokens"]
    assert g.dual and g0.dual and g.split
    for a, b in zip(h0._stream._packed_views(g0), h._stream._packed_views(g)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)) if isinstance(a, tuple) else torch.equal(a, b)
    assert torch.equal(got.model.embed_tokens.weight, table)     # the embedding reads the file's rows
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    with torch.no_grad():
        agree = logits_agreement(model(ids).logits.float(), got(ids).logits.float())
    assert agree["cosine_min"] >= FLOORS["int8"], agree
    h.unwrap()
    assert torch.equal(got.model.embed_tokens.weight, table) and got.lm_head.weight is got.model.embed_tokens.weight
    h0.unwrap()
    t0.close()


# -- packed and cut (NOTE [packed parts] in tiermem/inference/plan.py) ---------------------------

@pytest.fixture
def cheap_parts(monkeypatch):
    """A part costs what it would to a model a thousand times bigger (as in tests/test_split.py)."""
    import tiermem.inference.plan
    monkeypatch.setattr(tiermem.inference.plan, "PART_COST", 4096)


class _LM(nn.Module):
    def __init__(self, vocab: int = 16384, h: int = 128, tied: bool = False):
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
                                      for _ in range(4)])
        self.head = nn.Linear(h, vocab, bias=True)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.layers(self.emb(ids)))


def _dequantized(h, model: nn.Module, ref: nn.Module) -> nn.Module:
    """``ref`` (a plain copy of ``model`` made before it was wrapped) with the packed weights set
    to what their slots get: the reference dequantization of their packed home."""
    names = {id(t): n for n, t in model.named_parameters()}
    got = dict(ref.named_parameters())
    with torch.no_grad():
        for g in h._groups.values():
            if not g.packed:
                continue
            for t, p, v in zip(g.tensors, g.packing, h._stream._packed_views(g)):
                if p is not None:
                    got[names[id(t)]].copy_(quant.reference(v[0], v[1], p, t.dtype).view(t.shape))
    return ref


def test_a_head_bigger_than_the_budget_streams_packed_in_parts(tier, fake, cheap_parts):
    """An untied head four times the budget under stream_dtype='int8': cut into parts of rows,
    each part's rows cross packed (values and scales) and are dequantized into its slot, so the
    logits are the dequantized model's to rounding and a forward moves the packed bytes."""
    torch.manual_seed(0)
    m = _LM().requires_grad_(False)
    plain = copy.deepcopy(m)
    head = m.head.weight.numel() * 4
    h = tier.wrap_module(m, budget=head // 4, stream_dtype="int8")
    g = h._groups["head"]
    assert h.plan.split == {"head"} and not h.plan.oversized and not h.plan.zero_copy_only
    assert g.split and g.packed and len(g.pieces) > 1
    assert g.packing[list(g.cut.members).index(0)] is not None          # the weight packed, its bias as it is
    assert all(p.nbytes <= h._stream.slot_bytes for p in g.pieces)
    assert g.link_bytes < g.nbytes / 3                                   # int8 of fp32, and the scales
    assert h._stream.stage_bytes <= quant.QSTAGE_BYTES
    assert not h._groups["emb"].packed                                  # the embedding reads its rows in place
    ref = _dequantized(h, m, plain)
    assert fake.pointer_kind(m.head.weight.data_ptr()) != "host"        # at rest: it has no home in fp32
    for ids in (torch.randint(0, 16384, (2, 24)), torch.randint(0, 16384, (1, 1))):   # a prefill, a decode step
        with torch.no_grad():
            want = ref(ids)
            m(ids)                                   # learns the order
            h.drain()
            before = tier.stats()["moved_bytes.all.h2d"]
            got = m(ids)
            h.drain()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert tier.stats()["moved_bytes.all.h2d"] - before == h.moved_bytes == h.plan.moved_bytes
    assert tier.stats()["resident_bytes.all.peak"] <= h.budget
    h.unwrap()
    assert "forward" not in vars(m.head)
    assert torch.equal(m.head.weight, ref.head.weight)                   # unwrap restores the dequantized weights


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_tied_table_bigger_than_the_budget_streams_packed_to_its_head(tier, cheap_parts, fmt):
    """Tied, the table keeps its home as it is, which the embedding reads its rows from in place,
    and a packed copy beside it, which is what crosses the link for the head, in parts (NOTE
    [packed tied table]): the logits are those of the model whose head alone is dequantized,
    a forward moves the packed bytes, and unwrap gives the table back exactly."""
    torch.manual_seed(0)
    m = _LM(tied=True).requires_grad_(False)
    plain = copy.deepcopy(m)
    table = m.emb.weight.detach().clone()
    h = tier.wrap_module(m, budget=m.emb.weight.numel(), stream_dtype=fmt)
    g = h._groups["emb"]
    assert g.split and g.packed and g.dual and len(g.pieces) > 1
    assert any(x.packed for x in h._groups.values() if not x.pinned and x is not g)
    # The embedding's rows at rest are the table's, exactly; the head streams the packed copy.
    assert torch.equal(m.emb.weight, table)
    ref = _dequantized(h, m, plain)                      # the head's dequantized table, untied below
    ref.head.weight = nn.Parameter(ref.emb.weight.detach().clone())
    ref.emb.weight = nn.Parameter(table.clone())
    ids = torch.randint(0, 16384, (2, 24))
    with torch.no_grad():
        m(ids)
        before = tier.stats()["moved_bytes.all.h2d"]
        got = m(ids)
        moved = tier.stats()["moved_bytes.all.h2d"] - before
        torch.testing.assert_close(got, ref(ids), rtol=1e-5, atol=1e-5)
    # The head's table crossed packed: 4x (int8) or ~7.5x (int4) fewer bytes than fp32.
    assert moved == h.moved_bytes and g.link_bytes < table.numel() * table.element_size() // 3
    h.unwrap()
    assert torch.equal(m.emb.weight, table) and m.head.weight is m.emb.weight


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_stacked_experts_bigger_than_a_slot_stream_packed_a_range_of_experts_at_a_time(tier, cheap_parts, kind):
    """A part of stacked experts is a range of each packed member's rows (an expert's rows one
    after the other): the parts' slots hold the dequantized experts, in a prefill and in a decode
    step (packed experts have no fp32 home to read in place)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                         num_local_experts=16, num_experts_per_tok=2)
    else:
        cfg = transformers.Qwen2MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                                          shared_expert_intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                          num_experts=16, num_experts_per_tok=4)
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    plain = copy.deepcopy(m)
    experts = m.model.layers[0].mlp.experts
    layer = sum(p.numel() * 4 for p in experts.parameters())
    h = tier.wrap_module(m, budget=layer, stream_dtype="int8")
    groups = [g for g in h._groups.values() if g.cut is not None and g.cut.kind == "experts"]
    assert groups and all(g.split and g.packed and len(g.pieces) > 1 for g in groups), h.plan
    ref = _dequantized(h, m, plain)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for x in (ids, ids[:, :2]):
            want = ref(x).logits
            m(x)
            torch.testing.assert_close(m(x).logits, want, rtol=1e-5, atol=1e-5)
    assert h._fwd_mode == "decode"
    h.unwrap()
    assert "forward" not in vars(experts) and experts.num_experts == 16


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_forward_queues_few_host_calls_per_streamed_piece(tier, fake, monkeypatch, fmt):
    """The host's work to queue a quantized forward (issue 57: it, not the link, bounded the
    forwards): once the chunks are made (NOTE [packed chunks made once]), a forward makes no
    views and prepares no dequantization, and a piece that crosses in one chunk costs one copy
    (its members lie in the staging buffer as in their home), one dequantization job for
    its packed members, and four events."""
    model, cfg = tiny_llama(torch.float16)
    h = tier.wrap_module(model, budget=share(model, 40), stream_dtype=fmt, max_group_bytes=GROUP, mode="stream")
    st = h._stream
    pieces = [p for g in h._groups.values() if g.packed and not g.pinned for p in g.pieces]
    assert pieces and all(len(st._chunks(p.group, st._piece_rows(p))) == 1 for p in pieces)
    calls: dict[str, int] = {}

    def counting(obj, name):
        real = getattr(obj, name)

        def spy(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            return real(*a, **k)
        monkeypatch.setattr(obj, name, spy)
    for name in ("copy", "new_event", "record", "wait"):
        counting(fake, name)
    for name in ("prepare", "views", "dequantize"):
        counting(quant, name)
    jobs = []
    real_unpack = st._unpack
    monkeypatch.setattr(st, "_unpack", lambda g, js: (jobs.append(len(js)), real_unpack(g, js)))
    ids = torch.randint(0, cfg.vocab_size, (1, 1))
    with torch.no_grad():
        model(ids)
        model(ids)
        calls.clear()
        jobs.clear()
        model(ids)
    n = len(pieces)
    # One dequantization lane run a piece; in it one job for its packed members (one launch a
    # format on a GPU: NOTE [one launch a chunk]) and one a member kept as it is.
    want = [any(p.group.packing[i] is not None for i, _, _ in st._piece_rows(p))
            + sum(p.group.packing[i] is None for i, _, _ in st._piece_rows(p)) for p in pieces]
    assert len(jobs) == n and sorted(jobs) == sorted(want), (jobs, want)
    assert "prepare" not in calls and "views" not in calls and "dequantize" not in calls, calls
    # Values, scales and members: one copy a piece, as a piece kept as it is (the norms) takes.
    slotted = [p for g in h._groups.values() if not g.pinned and g.slot_in("stream") for p in g.pieces]
    assert calls["copy"] == len(slotted), calls
    # The copy's start (timed) and end, the dequantization's end (or the compute stream's now for
    # a piece kept as it is), the slot's release: four events and four waits a piece, at most.
    assert calls["new_event"] <= 4 * len(slotted) and calls["wait"] <= 4 * len(slotted), (len(slotted), calls)
    h.unwrap()


def test_linear_agreement_checks_a_weight_a_range_of_rows_at_a_time(monkeypatch):
    # A head bigger than the budget is checked without its reference weight whole on the device:
    # in ranges of rows the cosine is the one of the whole weight, and it does see a difference.
    import tiermem.testing.quality as quality
    torch.manual_seed(0)
    lin = nn.Linear(24, 40, bias=True)
    ref = {"": lin.weight.detach().clone() + 0.05 * torch.randn(40, 24)}
    x = torch.randn(3, 5, 24)
    want = nn.functional.cosine_similarity(nn.functional.linear(x, ref[""], lin.bias).reshape(-1, 40),
                                           lin(x).reshape(-1, 40), dim=-1).min()
    seen = {}
    for check_bytes in (1 << 30, 7 * 24 * 4):           # whole, and 7 rows a time (the last range 5)
        monkeypatch.setattr(quality, "CHECK_BYTES", check_bytes)
        with torch.no_grad(), linear_agreement(lin, ref) as got:
            lin(x)
        seen[check_bytes] = got["cosine_min"]
    assert seen[1 << 30] == pytest.approx(float(want), abs=1e-6)
    assert seen[7 * 24 * 4] == pytest.approx(float(want), abs=1e-6)
    assert float(want) < 0.9999
