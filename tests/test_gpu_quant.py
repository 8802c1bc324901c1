"""GPU tests of quantized streaming (NOTE [quantized streaming] in tiermem/inference/quant.py) and
of the expert cache (NOTE [expert cache] in tiermem/inference/experts.py): a Llama streamed in
int8, fp8 and int4 on a really small GPU, its slots the plain formula's dequantization to the bit,
its logits close to fp16 and its forwards moving the packed bytes; a mixture of experts whose
skewed router keeps its experts in the cache. Models of a few hundred MB at most."""
from __future__ import annotations

import copy

import pytest
from helpers import share

pytestmark = pytest.mark.gpu
MiB = 1 << 20

# Logits cosine against fp16 on the same inputs (tiermem.testing.logits_agreement). Random weights
# compound the weights' error through the layers (docs/inference.md, "What it costs in
# accuracy"): this model, streamed the same way over the CPU tests' fake backend in fp16, gave a
# minimum of 0.9994 (int8), 0.9943 (fp8) and 0.904 (int4), and moved 0.519 and 0.275 of fp16's bytes.
FLOORS = {"int8": 0.999, "fp8": 0.99, "int4": 0.88}
# Bytes a forward moves against fp16's: the packed weights and scales, and the norms kept.
MOVED = {"int8": 0.55, "fp8": 0.55, "int4": 0.3}


def _llama_cpu():
    import torch
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=16384, tie_word_embeddings=False, max_position_embeddings=512)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.LlamaForCausalLM(cfg).half().eval()       # requires_grad=True, as users get it
    return model, cfg


def _moved_per_forward(t, h, model, ids) -> int:
    import torch
    with torch.no_grad():
        model(ids, use_cache=False)                  # learns the order
        h.drain()
        before = t.stats()["moved_bytes.all.h2d"]
        model(ids, use_cache=False)
        h.drain()
    return t.stats()["moved_bytes.all.h2d"] - before


def test_a_llama_streams_int8_fp8_and_int4_on_a_really_small_gpu():
    import gc

    import torch
    from test_gpu_module import _take_device

    import tiermem
    from tiermem.testing import logits_agreement
    model, cfg = _llama_cpu()
    ids = torch.randint(0, cfg.vocab_size, (1, 64), device="cuda")
    with torch.no_grad():
        want = model(ids, use_cache=False).logits.float()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    model.cpu()
    gc.collect()
    torch.cuda.empty_cache()
    blob = _take_device(share(model, 25) + 128 * MiB)   # the budget, and room for the activations
    try:
        free = torch.cuda.mem_get_info()[0]
        assert free < weights
        budget = share(model, 25)
        moved = {}
        for fmt in (None, "int8", "fp8", "int4"):
            m = copy.deepcopy(model)                 # unwrap gives back the dequantized weights: a fresh copy each
            t = tiermem.Tier(0)                      # the default cap: the memory free now
            h = t.wrap_module(m, budget=budget, stream_dtype=fmt, max_group_bytes=8 * MiB)   # sublayers: groups
            assert t.backend.guard.reserved <= free
            moved[fmt] = _moved_per_forward(t, h, m, ids)
            assert moved[fmt] == h.moved_bytes
            with torch.no_grad():
                got = m(ids, use_cache=False).logits.float()
            h.drain()
            assert t.stats()["resident_bytes.all.peak"] <= h.budget
            agree = logits_agreement(want, got)
            if fmt is None:
                assert agree["cosine_min"] == pytest.approx(1.0, abs=1e-6) and torch.equal(got, want)
            else:
                assert agree["cosine_min"] >= FLOORS[fmt], (fmt, agree)
                assert moved[fmt] <= MOVED[fmt] * moved[None], (fmt, moved)
            h.unwrap()
            t.close()
            del m, h, t
            gc.collect()
    finally:
        del blob
        torch.cuda.empty_cache()


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_slot_holds_the_plain_formula_dequantization_to_the_bit(fmt, dtype):
    import torch
    import torch.nn as nn

    import tiermem
    from tiermem.inference import quant
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    m = nn.Sequential(*[nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512)) for _ in range(8)])
    m = m.to("cuda", dt).requires_grad_(False)
    t = tiermem.Tier(0, cap="512MiB")
    h = t.wrap_module(m, budget=share(m, 30), max_group_bytes=2 * MiB, stream_dtype=fmt, mode="stream", lookahead=2)
    linears = [x for x in m.modules() if isinstance(x, nn.Linear)]
    seen = {}
    hooks = [x.register_forward_pre_hook(lambda mod, a: seen.__setitem__(id(mod), mod.weight.clone())) for x in linears]
    x = torch.randn(16, 512, device="cuda", dtype=dt)
    with torch.no_grad():
        m(x)
        m(x)
    for hk in hooks:
        hk.remove()
    h.drain()
    checked = 0
    for g in h._groups.values():
        if not g.packed:
            continue
        for tns, p, v in zip(g.tensors, g.packing, h._stream._packed_views(g)):
            if p is not None:
                owner = next(x for x in linears if x.weight is tns)
                assert torch.equal(seen[id(owner)], quant.reference(v[0], v[1], p, dt).view(tns.shape))
                checked += 1
    assert checked > 0
    h.unwrap()
    t.close()


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_fused_kernel_and_torchs_ops_write_the_plain_formula_to_the_bit(fmt, dtype):
    # NOTE [one dequantization kernel]: the Triton kernel the transport runs on a GPU, and the
    # torch ops it falls back on, against quant.reference; kernel="fused" raises where the
    # kernel did not run (Triton missing, or it did not compile for this format and dtype).
    import torch
    pytest.importorskip("triton")

    from tiermem.inference import quant
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    for shape in [(96, 4096), (37, 1030), (5, 11008), (3, 4, 2048)]:
        w = (torch.randn(shape, device="cuda") * 0.05).to(dt)
        p = quant.packing(w, fmt)
        raw = torch.zeros(p.nbytes, dtype=torch.uint8, device="cuda")
        q, s = quant.views(p, raw)
        quant.pack_into(w, p, q, s, torch.device("cuda"))
        want = quant.reference(q, s, p, dt)
        scratch = torch.empty(p.q_bytes, dtype=torch.uint8, device="cuda")
        for kernel in ("fused", "torch"):
            out = torch.full((p.rows, p.cols), float("nan"), dtype=dt, device="cuda")
            quant.dequantize(q, s, p, out, scratch, kernel=kernel)
            assert torch.equal(out, want), (kernel, shape)
        part = torch.full((2, p.cols), float("nan"), dtype=dt, device="cuda")     # a staged range of rows
        quant.dequantize(q[1:3], s[1:3], p, part, kernel="fused")
        assert torch.equal(part, want[1:3])


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_one_launch_writes_a_chunks_members_to_the_bit(fmt, dtype):
    # NOTE [one launch a chunk]: a layer's members back to back in one staging buffer, into one
    # slot with gaps between them, in one launch a scale layout, against quant.reference.
    import torch
    pytest.importorskip("triton")

    from tiermem.inference import dequant_kernel, quant
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    shapes = [(2048, 2048), (256, 2048), (96, 4096), (37, 1030), (11008, 2048), (2048, 11008)]
    ws = [(torch.randn(sh, device="cuda") * 0.05).to(dt) for sh in shapes]
    ps = [quant.packing(w, fmt) for w in ws]
    at = [0]
    for p in ps:
        at.append(at[-1] + -(-p.nbytes // quant.ALIGN) * quant.ALIGN)
    raw = torch.zeros(at[-1], dtype=torch.uint8, device="cuda")
    slot = torch.full((sum(p.rows * p.cols + 64 for p in ps),), float("nan"), dtype=dt, device="cuda")
    items, wants, o = [], [], 64
    for w, p, a in zip(ws, ps, at):
        q, s = quant.views(p, raw[a:a + p.nbytes])
        quant.pack_into(w, p, q, s, torch.device("cuda"))
        items.append((q, s, p, slot[o:o + p.rows * p.cols].view(p.rows, p.cols)))
        wants.append(quant.reference(q, s, p, dt))
        o += p.rows * p.cols + 64
    layouts = {it[2].groups == 1 for it in items}
    for per_row in layouts:
        run = dequant_kernel.prepare_many([it for it in items if (it[2].groups == 1) == per_row], quant.INT4_GROUP)
        assert run is not None and run()
    torch.cuda.synchronize()
    assert all(torch.equal(out, want) for (_, _, _, out), want in zip(items, wants))
    assert int(torch.isnan(slot).sum()) == 64 * len(items)       # nothing written between members
    assert not [f for f in dequant_kernel.failed() if f[0].startswith(fmt)]


def _qwen2_moe():
    import torch
    tf = pytest.importorskip("transformers")
    cfg = tf.Qwen2MoeConfig(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                            shared_expert_intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=4, vocab_size=8192, num_experts=16, num_experts_per_tok=4,
                            decoder_sparse_step=1, max_position_embeddings=512)
    cfg._experts_implementation = "batched_mm"     # each token's picks summed in their order: equal to the bit
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(cfg).half().eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model, cfg


@pytest.mark.parametrize("stream_dtype", [None, "int8"])
def test_a_skewed_router_keeps_its_experts_in_the_cache(stream_dtype):
    import torch

    import tiermem
    from tiermem.testing import skew_router
    model, cfg = _qwen2_moe()
    ids = torch.randint(0, cfg.vocab_size, (1, 8), device="cuda")
    hot = 2 * cfg.num_experts_per_tok
    rates = {}
    for skewed in (False, True):
        # The uncached path (the experts read in place, or streamed whole when packed) against the
        # cache, with the same plan: the cache's bytes come on top of the same budget. Groups of
        # at most 4 MiB: each layer's experts (12.6 MB) stream on their own.
        base = copy.deepcopy(model).cpu()
        sk0 = skew_router(base, hot=hot, bias=3.0) if skewed else None
        t0 = tiermem.Tier(0, cap="1GiB")
        h0 = t0.wrap_module(base, budget=share(base, 45), stream_dtype=stream_dtype, max_group_bytes=4 * MiB)
        with torch.no_grad():
            want = base.generate(ids, max_new_tokens=24, do_sample=False)
        h0.unwrap()
        t0.close()
        m = copy.deepcopy(model).cpu()
        sk1 = skew_router(m, hot=hot, bias=3.0) if skewed else None
        t = tiermem.Tier(0, cap="1GiB")
        # 35 experts of 786 KB: 34 slots (the 8 hot ones of each of the 4 layers, and 2 more) and
        # the zero slot (NOTE [cached experts sum alike])
        cache = 35 * 3 * cfg.moe_intermediate_size * cfg.hidden_size * 2
        h = t.wrap_module(m, budget=share(m, 45) + cache, stream_dtype=stream_dtype, expert_cache=cache,
                          max_group_bytes=4 * MiB)
        assert h._cache is not None and h._cache.nslots == 34 and h.plan.pinned == h0.plan.pinned
        with torch.no_grad():
            got = m.generate(ids, max_new_tokens=24, do_sample=False)
        assert torch.equal(got, want), skewed
        s = h.stats()
        assert s["expert_cache.calls"] > 0
        rates[skewed] = s["expert_cache.hit_rate"]
        assert t.stats()["resident_bytes.all.peak"] <= h.budget
        h.unwrap()
        t.close()
        for x in (sk0, sk1):
            if x is not None:
                x.remove()
    # Greedy decoding of random weights repeats its tokens, and so its routing: the routing as it
    # comes hits the cache often too (0.93 in a CPU run of this model), so only the skewed rate
    # has a floor.
    assert rates[True] >= 0.8, rates


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_tied_table_bigger_than_the_budget_streams_packed_to_its_head(fmt):
    """NOTE [packed tied table] in tiermem/inference/transport.py: a tied fp16 table of 64 MiB
    against a 16 MiB budget keeps its home as it is, which the embedding reads in place, and
    crosses packed, in parts, for the head: the logits are those of the model whose head alone
    is dequantized (to the GEMM's summing order), a forward moves the packed bytes, and unwrap
    gives the table back bit for bit."""
    import torch
    import torch.nn as nn

    import tiermem
    from tiermem.inference import quant
    from tiermem.testing import logits_agreement

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(65536, 512)
            self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
                                          for _ in range(4)])
            self.head = nn.Linear(512, 65536, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.layers(self.emb(ids)))

    torch.manual_seed(0)
    m = LM().half().requires_grad_(False)
    ref = copy.deepcopy(m)
    table = m.emb.weight.detach().clone()
    t = tiermem.Tier(0, cap="1GiB")
    h = t.wrap_module(m, budget=16 * MiB, stream_dtype=fmt)
    g = h._groups["emb"]
    assert g.split and g.packed and g.dual and len(g.pieces) > 1, h.plan
    names = {id(p): n for n, p in m.named_parameters()}
    plain = dict(ref.named_parameters())
    with torch.no_grad():
        for x in h._groups.values():
            for tns, p, v in zip(x.tensors, x.packing, h._stream._packed_views(x) if x.packed else []):
                if p is not None:
                    plain[names[id(tns)]].copy_(quant.reference(v[0], v[1], p, tns.dtype).view(tns.shape))
    ref.head.weight = nn.Parameter(ref.emb.weight.detach().clone())     # the head's: dequantized
    ref.emb.weight = nn.Parameter(table.clone())                         # the embedding's: the table
    ref.cuda()
    ids = torch.randint(0, 65536, (1, 32), device="cuda")
    with torch.no_grad():
        want = ref(ids).float()
        m(ids)                                   # learns the order
        h.drain()
        before = t.stats()["moved_bytes.all.h2d"]
        got = m(ids).float()
        h.drain()
    agree = logits_agreement(want, got)
    assert agree["cosine_min"] >= 0.9999, agree
    assert t.stats()["moved_bytes.all.h2d"] - before == h.moved_bytes
    assert g.link_bytes < table.numel() * table.element_size() * (0.55 if fmt == "int8" else 0.3)
    h.unwrap()
    t.close()
    assert torch.equal(m.emb.weight.cpu(), table.cpu()) and m.head.weight is m.emb.weight


def test_a_head_bigger_than_the_budget_streams_int8_in_parts():
    """NOTE [packed parts] in tiermem/inference/plan.py: an untied fp16 head of 64 MiB against a
    16 MiB budget under stream_dtype='int8' is cut into parts of rows, each crossing packed and
    dequantized into its slot on the dequant lane: the logits are the dequantized model's (to the
    GEMM's summing order), and a forward moves the packed bytes the plan says."""
    import torch
    import torch.nn as nn

    import tiermem
    from tiermem.inference import quant
    from tiermem.testing import logits_agreement

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(65536, 512)
            self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
                                          for _ in range(4)])
            self.head = nn.Linear(512, 65536, bias=False)

        def forward(self, ids):
            return self.head(self.layers(self.emb(ids)))

    torch.manual_seed(0)
    m = LM().half().requires_grad_(False)
    ref = copy.deepcopy(m)
    t = tiermem.Tier(0, cap="1GiB")
    h = t.wrap_module(m, budget=16 * MiB, stream_dtype="int8")
    g = h._groups["head"]
    assert g.split and g.packed and len(g.pieces) > 1 and "head" not in h.plan.oversized, h.plan
    names = {id(p): n for n, p in m.named_parameters()}
    plain = dict(ref.named_parameters())
    with torch.no_grad():
        for x in h._groups.values():
            for tns, p, v in zip(x.tensors, x.packing, h._stream._packed_views(x) if x.packed else []):
                if p is not None:
                    plain[names[id(tns)]].copy_(quant.reference(v[0], v[1], p, tns.dtype).view(tns.shape))
    ref.cuda()
    ids = torch.randint(0, 65536, (1, 32), device="cuda")
    with torch.no_grad():
        want = ref(ids).float()
        m(ids)                                   # learns the order
        h.drain()
        before = t.stats()["moved_bytes.all.h2d"]
        got = m(ids).float()
        h.drain()
    agree = logits_agreement(want, got)
    assert agree["cosine_min"] >= 0.9999, agree
    assert t.stats()["moved_bytes.all.h2d"] - before == h.moved_bytes
    assert h.moved_bytes < 0.6 * sum(x.nbytes for x in h._groups.values() if not x.pinned and not x.gathered)
    assert t.stats()["resident_bytes.all.peak"] <= h.budget
    h.unwrap()
    t.close()
