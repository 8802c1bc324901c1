"""Groups bigger than a slot streamed in parts, on a CPU over the fake backend (NOTE [split groups]
in tiermem/inference/split.py): a tied table whose head runs over parts of rows while the
embedding reads its rows in place, stacked experts run a range of experts at a time, from the
pinned home and from disk through staging buffers no bigger than a slot."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn

from tiermem import load_pretrained
from tiermem.inference.load import Checkpoint, empty_weights
from tiermem.planning import weight_bytes


@pytest.fixture
def cheap_parts(monkeypatch):
    """A part costs what it would to a model a thousand times bigger, so that a model of a few
    MB is cut as a big one would be (PART_COST, ~0.1 ms of link time per part, is a thousandth of
    a 6 GB model's bytes; against a few MB it would make every table read in place)."""
    import tiermem.inference.plan
    monkeypatch.setattr(tiermem.inference.plan, "PART_COST", 4096)


class _LM(nn.Module):
    def __init__(self, vocab: int = 16384, h: int = 128, bias: bool = False, layers: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
                                      for _ in range(layers)])
        self.head = nn.Linear(h, vocab, bias=bias)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.layers(self.emb(ids)))


def _moved(tier) -> int:
    return tier.stats()["moved_bytes.all.h2d"]


@pytest.mark.parametrize("bias", [False, True])
def test_a_tied_table_bigger_than_the_budget_streams_its_head_in_parts(tier, fake, cheap_parts, bias):
    """The shape of issue 57 in small: the table (8 MiB) is four times the budget. The plan still
    streams the layers through three slots; the head runs over parts of rows, each no bigger than
    a slot; the embedding reads its rows in place; a forward copies the table once."""
    torch.manual_seed(0)
    m = _LM(bias=bias).requires_grad_(False)
    ref = copy.deepcopy(m)
    table = m.emb.weight.numel() * 4
    h = tier.wrap_module(m, budget=table // 4)
    plan = h.plan
    assert not plan.zero_copy_only and plan.lookahead == 3 and plan.split == {"emb"} and not plan.oversized
    assert any(not g.pinned and not g.split for g in h._groups.values())       # the layers stream too
    pieces = h._groups["emb"].pieces
    assert len(pieces) > 1 and all(p.nbytes <= h._stream.slot_bytes for p in pieces)
    assert [(p.lo, p.hi) for p in pieces] == [(a, min(a + pieces[0].hi, 16384)) for a in range(0, 16384, pieces[0].hi)]
    assert pieces[0].hi % 64 == 0                                   # whole GEMM tiles of rows
    for ids in (torch.randint(0, 16384, (2, 40)), torch.randint(0, 16384, (1, 1))):   # a prefill, a decode step
        with torch.no_grad():
            want = ref(ids)
            m(ids)                                  # learns the order (a decode step: the same units)
            before = _moved(tier)
            got = m(ids)
        # A GEMM over fewer rows may sum in another order: equal to rounding, the same tokens.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert _moved(tier) - before == h.moved_bytes          # the table crosses once, for the head
        assert fake.pointer_kind(m.emb.weight.data_ptr()) == "host"    # between uses it is at home
    m.head.forward(torch.zeros(3, 128))         # the chunked forward outside a forward of the model
    h.unwrap()
    assert "forward" not in vars(m.head)
    with torch.no_grad():
        assert torch.equal(m(ids), ref(ids))
    assert fake.pointer_kind(m.emb.weight.data_ptr()) == "unregistered"


def test_a_tied_table_that_fits_a_slot_crosses_once_per_forward(tier):
    """Streamed whole, the table is copied for the head only: the embedding reads the rows of
    its tokens in place (it was copied twice, once for each)."""
    torch.manual_seed(0)
    m = _LM(vocab=512, layers=8).requires_grad_(False)
    ref = copy.deepcopy(m)
    layer = weight_bytes(m.layers[0])            # a group's bytes as the plan counts them
    h = tier.wrap_module(m, budget=3 * layer + layer // 4, mode="stream", max_group_bytes=1 << 20)
    g = h._groups["emb"]
    assert not g.pinned and not g.split and g.cut.kind == "rows" and not h.plan.oversized
    assert sum(not g.pinned for g in h._groups.values()) > h._stream.nslots     # the slots take turns
    ids = torch.randint(0, 512, (2, 8))
    with torch.no_grad():
        m(ids)
        before = _moved(tier)
        assert torch.equal(m(ids), ref(ids))
    assert _moved(tier) - before == h.moved_bytes
    h.unwrap()


def _moe(kind: str, experts: int = 8, seed: int = 0, layers: int = 2):
    import transformers as tf
    torch.manual_seed(seed)
    if kind == "mixtral":
        cfg = tf.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=256, num_local_experts=experts, num_experts_per_tok=2)
    else:
        cfg = tf.Qwen2MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                                shared_expert_intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=256, num_experts=experts, num_experts_per_tok=4)
    return tf.AutoModelForCausalLM.from_config(cfg).eval()


def _experts_groups(h):
    return [g for g in h._groups.values() if g.cut is not None and g.cut.kind == "experts"]


@pytest.mark.parametrize("impl", ["eager", "default"])
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
@pytest.mark.long
def test_stacked_experts_bigger_than_a_slot_run_a_range_of_experts_at_a_time(tier, fake, cheap_parts, kind, impl,
                                                                             monkeypatch):
    """A layer's stacked experts bigger than a slot stream in parts of whole experts, giving the
    unsplit logits to rounding and the same tokens, in transformers' eager loop and its default
    kernel; a decode step reads the routed experts in place and never runs the parts."""
    m = _moe(kind, experts=16)
    if impl == "eager":
        m.config._experts_implementation = "eager"
    ref = copy.deepcopy(m)
    experts = m.model.layers[0].mlp.experts
    seen: list[int] = []
    own = type(experts).forward

    @functools.wraps(own)                     # its signature is the experts' (split.EXPERT_ARGS)
    def counted(self, *a, **k):
        if self is experts:
            seen.append(self.num_experts)
        return own(self, *a, **k)
    monkeypatch.setattr(type(experts), "forward", counted)
    layer = sum(p.numel() * 4 for p in experts.parameters())
    h = tier.wrap_module(m, budget=layer)
    groups = _experts_groups(h)
    assert groups and all(g.split and len(g.pieces) > 1 for g in groups), h.plan
    assert all(p.hi > p.lo and p.nbytes <= h._stream.slot_bytes for g in groups for p in g.pieces)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids).logits
        seen.clear()
        for _ in range(2):
            got = m(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert h._fwd_mode == "stream"
    parts = [p.hi - p.lo for p in h._groups["model.layers.0.mlp.experts"].pieces]
    assert seen == parts * 2                  # the module ran once per part, renumbered to its experts
    seen.clear()
    with torch.no_grad():
        m(ids[:, :2])                         # a decode step: the routed experts, in place
    assert seen == [16] and h._fwd_mode == "decode"
    tokens = ref.generate(ids[:, :10], max_new_tokens=5, do_sample=False)
    assert torch.equal(m.generate(ids[:, :10], max_new_tokens=5, do_sample=False), tokens)
    h.unwrap()
    assert "forward" not in vars(experts) and experts.num_experts == 16
    assert all(p.shape[0] == 16 for p in experts.parameters())


def test_stacked_experts_on_disk_are_staged_a_part_at_a_time(tier, fake, cheap_parts, tmp_path):
    """issue 57: a disk tier staged a whole layer's stacked experts per buffer. Read from disk in
    parts, a staging buffer is no bigger than a slot and the pinned bytes stay within the host
    budget."""
    ref = _moe("qwen2_moe", experts=16, layers=4)
    ref.config._experts_implementation = "eager"
    ref.save_pretrained(tmp_path, max_shard_size="200KB")
    layer = sum(p.numel() * 4 for p in ref.model.layers[0].mlp.experts.parameters())
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref(ids).logits
    home = None
    for host_budget in (None, "half"):
        fake.peak_live["pinned"] = 0
        model, h = load_pretrained(tmp_path, budget=layer, host_budget=home // 2 if host_budget else None, tier=tier)
        model.config._experts_implementation = "eager"
        groups = _experts_groups(h)
        assert groups and all(g.split for g in groups)
        if host_budget is None:
            home = h.stats()["pinned_bytes.home"]
        else:
            on_disk = [g for g in groups if g.on_disk]
            assert on_disk and h.plan.stage_bytes <= h.plan.slot
            assert h._stream.disk.stage_bytes <= h._stream.slot_bytes < layer
            assert fake.peak_live["pinned"] <= home // 2
        with torch.no_grad():
            for _ in range(2):
                torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
        h.unwrap()


def test_a_head_on_disk_streams_in_parts(tier, fake, cheap_parts, tmp_path):
    """An untied head bigger than a slot, on disk: its parts are read into staging buffers and
    copied into slots; between forwards it has no home."""
    import transformers as tf
    from safetensors.torch import save_file
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=8192, tie_word_embeddings=False)
    ref = tf.AutoModelForCausalLM.from_config(cfg).eval()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, tmp_path / "model.safetensors")
    with empty_weights():
        m = tf.AutoModelForCausalLM.from_config(cfg).eval()
    head = ref.lm_head.weight.numel() * 4
    table = ref.model.embed_tokens.weight.numel() * 4       # read in place: it stays in the home
    h = tier.wrap_module(m, budget=head // 2, weights=Checkpoint(tmp_path), host_budget=table + head // 2)
    g = h._groups["lm_head"]
    assert g.split and g.on_disk and len(g.pieces) > 1 and h._stream.disk.stage_bytes <= h._stream.slot_bytes
    ids = torch.randint(0, 8192, (1, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ref(ids).logits
        for _ in range(2):
            got = m(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    h.unwrap()
    assert torch.equal(m.lm_head.weight, ref.lm_head.weight)
