"""GPU tests of module adoption: transformers, nn.Sequential and custom modules within a budget,
bitwise-equal outputs, zero-copy decode, one-layer adoption, unwrap. Managed use stays small."""
from __future__ import annotations

import copy

import pytest

pytestmark = pytest.mark.gpu
KiB, MiB = 1 << 10, 1 << 20


def _llama():
    import torch
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=4, vocab_size=4096, max_position_embeddings=512)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).half().eval().requires_grad_(False)
    return model, cfg


@pytest.mark.parametrize("transport", ["pinned", "um"])
def test_transformers_model_streams_within_budget_bitwise_equal(transport):
    import torch
    import tiermem
    from tiermem import _cuda
    model, cfg = _llama()
    ref = copy.deepcopy(model)
    t = tiermem.Tier(0, cap="1GiB")
    h = t.wrap_module(model, budget="30%", max_group_bytes=2 * MiB, mode="stream", transport=transport, lookahead=2)
    assert 0 < len(h.plan.pinned) < len(h.plan.sizes) and not h.plan.zero_copy_only
    ids = torch.randint(0, cfg.vocab_size, (1, 64), device="cuda")
    with torch.no_grad():
        want = ref(ids).logits
        for _ in range(3):
            assert torch.equal(model(ids).logits, want)
    h.drain()
    s = t.stats()
    assert s["resident_bytes.all.peak"] <= h.budget
    assert s["moved_bytes.frozen_weight.h2d"] >= 2 * h.plan.streamed_bytes * 0.9
    assert s["ops.frozen_weight.evict_clean"] > 0 and s["moved_bytes.frozen_weight.d2h"] == 0
    kinds = {_cuda.pointer_kind(p.data_ptr()) for p in model.parameters()}
    assert kinds == ({"managed", "host"} if transport == "pinned" else {"managed"})   # host: the pinned home
    h.unwrap()
    assert _cuda.pointer_kind(next(model.parameters()).data_ptr()) == "device"
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)


@pytest.mark.parametrize("transport", ["pinned"])
def test_decode_reads_streamed_weights_in_place(transport):
    import torch
    import tiermem
    model, cfg = _llama()
    ref = copy.deepcopy(model)
    t = tiermem.Tier(0, cap="1GiB")
    h = t.wrap_module(model, budget="30%", max_group_bytes=2 * MiB, transport=transport, lookahead=2)   # mode auto
    ids = torch.randint(0, cfg.vocab_size, (1, 32), device="cuda")
    with torch.no_grad():
        out, out_ref = model(ids, use_cache=True), ref(ids, use_cache=True)
        assert torch.equal(out.logits, out_ref.logits)
        nxt = out.logits[:, -1:].argmax(-1)
        before = t.stats()
        for _ in range(3):
            d = model(nxt, past_key_values=out.past_key_values, use_cache=True)
            d_ref = ref(nxt, past_key_values=out_ref.past_key_values, use_cache=True)
            assert torch.equal(d.logits, d_ref.logits)
            nxt = d.logits.argmax(-1)
    assert h._fwd_mode == "zero_copy"
    after = t.stats()
    assert after["moved_bytes.all.h2d"] == before["moved_bytes.all.h2d"]   # read in place: nothing prefetched
    assert after["resident_bytes.all.peak"] <= h.budget
    # ... and still in place: a read of a streamed weight runs at link speed, not HBM speed
    big = max((p for g in h._groups.values() if not g.pinned for p in g.tensors), key=lambda p: p.numel())
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); big.float().sum(); b.record(); b.synchronize()
    assert big.numel() * big.element_size() / (a.elapsed_time(b) / 1e3) < 150e9
    h.unwrap()


def test_sequential_and_custom_module_and_single_layer():
    import torch
    import torch.nn as nn
    import tiermem

    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(256, 512)
            self.scale = nn.Parameter(torch.randn(512))
            self.register_buffer("shift", torch.randn(512))
            self.b = nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 64))

        def forward(self, x):
            return self.b(self.a(x) * self.scale + self.shift)

    torch.manual_seed(1)
    seq = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)]).cuda().requires_grad_(False)
    cus = Custom().cuda().requires_grad_(False)
    t = tiermem.Tier(0, cap="512MiB")
    x = torch.randn(16, 512, device="cuda")
    for model, inp, transport in ((seq, x, "um"), (cus, x[:, :256], "pinned")):
        want = model(inp)
        h = t.wrap_module(model, budget="40%", max_group_bytes=1 * MiB, mode="stream", transport=transport, lookahead=2)
        for _ in range(3):
            assert torch.equal(model(inp), want)
        h.drain()
        assert t.stats()["resident_bytes.all.current"] <= h.budget
        h.unwrap()
        assert torch.equal(model(inp), want)
    # one layer adopted on its own, the rest untouched
    want = seq(x)
    h = t.wrap_module(seq[3], budget=None)
    assert tiermem.tiered_of(seq[3].weight) is not None and tiermem.tiered_of(seq[2].weight) is None
    assert torch.equal(seq(x), want)
    h.unwrap()
