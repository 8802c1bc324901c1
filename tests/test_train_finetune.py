"""Training as fine-tuners run it (issue 55), on the CPU over the fake backend: a Llama-shaped
transformers model under bf16 autocast over fp32 masters, its loss through the chunked head and
cross-entropy (NOTE [chunked loss] in tiermem/training/lmloss.py), at 1/2.5 and 1/4 of its
training state on a budget the fake enforces. Every step runs, the losses and parameters are the
plain loop's bitwise, the traced step streams through slots that already hold the optimizer's
states (NOTE [the floor]), and each step moves no more than a stated factor of the bytes bound its
plan computes (NOTE [bytes bound] in tiermem/training/plan.py). The fake's clock reads 1 ms for
every span, so the plan's choice is the same on every run."""
from __future__ import annotations

import gc

import pytest
import torch
from fakes import FakeBackend
from test_train import _deterministic, plain_losses, tiered_losses  # noqa: F401 - the fixture, autouse here too

import tiermem
from tiermem.errors import ConfigError, ConfigTypeError
from tiermem.training.lmloss import chunk_tokens_for, chunked_lm_loss
from tiermem.training.plan import bytes_bound

transformers = pytest.importorskip("transformers")

VOCAB = 512
MOVED_OVER_BOUND = 1.5      # a step's bytes against its plan's bytes bound (NOTE [bytes bound])


def _llama(seed: int = 0, vocab: int = VOCAB, layers: int = 4):
    # TinyLlama's proportions, small: the embedding and the head are the largest blocks (7% of the
    # parameters each), a decoder layer splits into its projections and norms at 32 KiB a block
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                   max_position_embeddings=64, use_cache=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _loss(model, ids):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model.model(input_ids=ids).last_hidden_state
        return chunked_lm_loss(model.lm_head, h, ids, chunk_tokens=16)


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, 32), generator=g) for _ in range(n)]


def test_the_chunked_loss_is_transformers_loss_and_gradients():
    model, _ = _llama(layers=1, vocab=300)
    ids = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, 5] = labels[1, -3] = -100                     # ignored labels count for nothing
    for autocast, tol in ((False, 1e-6), (True, 5e-3)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            want = model(input_ids=ids, labels=labels).loss
        want.backward()
        gw, ge = model.lm_head.weight.grad.clone(), model.model.embed_tokens.weight.grad.clone()
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            h = model.model(input_ids=ids).last_hidden_state
            got = chunked_lm_loss(model.lm_head, h, labels, chunk_tokens=7)    # the last chunk is short
        got.backward()
        assert abs(float(got.detach()) - float(want.detach())) <= tol * abs(float(want.detach()))
        assert torch.allclose(model.lm_head.weight.grad, gw, atol=tol * float(gw.abs().max()))
        assert torch.allclose(model.model.embed_tokens.weight.grad, ge, atol=tol * float(ge.abs().max()))
        model.zero_grad(set_to_none=True)


def test_the_chunked_loss_under_autocast_sums_each_chunks_grad_as_autocasts_cast_gives_it():
    """Its head's weight is cast once and each chunk's grad added into the fp32 sum at the compute
    dtype (NOTE [chunked loss]): bitwise the grads of chunks taken through autocast's own cast."""
    model, _ = _llama(layers=1, vocab=300)
    head = model.lm_head
    h = torch.randn(2, 33, head.in_features, generator=torch.Generator().manual_seed(4))
    ids = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunked_lm_loss(head, h, ids, chunk_tokens=7, shift=False)
    got.backward()
    gw = head.weight.grad.clone()
    head.weight.grad = None
    flat, y = h.reshape(-1, h.shape[-1]), ids.reshape(-1)
    want = torch.zeros_like(head.weight)
    scale = torch.ones(()) / y.numel()
    for a in range(0, flat.shape[0], 7):    # each chunk's grad through autocast's cast of the fp32 leaf
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(head(flat[a:a + 7]).float(), y[a:a + 7], reduction="sum")
        want += torch.autograd.grad(loss, head.weight, scale)[0]
    assert gw.dtype == torch.float32 and torch.equal(want, gw)


def test_the_chunked_loss_refuses_what_it_cannot_take():
    model, _ = _llama(layers=1)
    h = torch.zeros(2, 8, 128)
    y = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ConfigTypeError, match="Linear"):
        chunked_lm_loss(model.model.norm, h, y)
    with pytest.raises(ConfigError, match="do not match"):
        chunked_lm_loss(model.lm_head, h, y[:, :4])
    with pytest.raises(ConfigError, match="chunk_tokens"):
        chunked_lm_loss(model.lm_head, h, y, chunk_tokens=0)
    assert chunk_tokens_for(32000) == (64 << 20) // (4 * 32000) and chunk_tokens_for(1 << 30) == 1


def test_the_bytes_bound_spends_the_room_where_it_saves_the_most():
    # two blocks: 10 B of parameters with 20 B of states (moves 70 B, 70/30 a byte), 10 B alone (30 B, 3 a byte)
    assert bytes_bound([10, 10], [20, 0], [20, 0], room=0) == 100
    assert bytes_bound([10, 10], [20, 0], [20, 0], room=10) == 70          # the second, whole: 3 a byte
    assert bytes_bound([10, 10], [20, 0], [20, 0], room=25) == 35          # then half the first
    assert bytes_bound([10, 10], [20, 0], [20, 0], room=1000) == 0
    # bf16 moments: the states moved are half those kept
    assert bytes_bound([10], [20], [10], room=0) == 50


@pytest.mark.parametrize("ratio", [2.5, 4])
def test_an_autocast_llama_at_a_share_of_its_state_runs_every_step_as_the_plain_loop(ratio):
    bs = _batches(8)
    model, opt = _llama()
    want = plain_losses(model, opt, bs, _loss)
    want_params = [p.detach().clone() for p in model.parameters()]

    model, opt = _llama()
    state = 16 * sum(p.numel() for p in model.parameters())     # fp32 parameters, gradients, two moments
    fake = FakeBackend(total=1 << 30, foreign_host=True)
    fake.enforces_budget = True
    tier = tiermem.Tier(backend=fake)
    train = tier.wrap_training(model, opt, int(state / ratio), block_bytes=32 << 10, min_swap=4096)
    f = train.budget_floor
    # the embedding sets the slots, or steps across them (NOTE [wide blocks]: where they crowd the budget)
    assert (f.block == "model.embed_tokens" or "model.embed_tokens" in f.wide) and f.bytes <= state / 6
    # NOTE [the floor]: the traced step's slots already hold the largest block's states
    assert train.stream.slot_bytes == f.slot_bytes
    got = []
    for i, ids in enumerate(bs):
        with train.step():
            loss = _loss(model, ids)
            loss.backward()
        got.append(float(loss.detach()))
        assert train.stream.slot_bytes <= f.slot_bytes
        if i and train.plan is not None:        # the traced first step moves everything it can
            moved = train.moved["h2d"] + train.moved["d2h"]
            assert moved <= MOVED_OVER_BOUND * train.plan.bytes_bound, train.plan
    assert got == want
    p = train.plan
    assert not p.in_capacity and p.streamed_blocks and p.predicted_peak <= train.budget
    assert "bytes bound" in p.table()
    train.unwrap()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), want_params))
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


def test_blocks_are_as_large_as_the_largest_parameter_by_default():
    # NOTE [block size]: TinyLlama's shape on the meta device: its embedding (262 MB fp32) sets the
    # slots, so a decoder layer (176 MB) is one block; a model whose parameters are all small keeps
    # BLOCK_BYTES
    from tiermem.inference.groups import module_groups, span_of
    from tiermem.training.handle import block_size
    from tiermem.training.options import BLOCK_BYTES
    cfg = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=3,
                                   num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
    with torch.device("meta"):
        big = transformers.LlamaForCausalLM(cfg)
    size = block_size(big, None)
    assert size == span_of(big.model.embed_tokens.weight) > BLOCK_BYTES
    names = [name for name, _, own in module_groups(big, size)
             if any(isinstance(t, torch.nn.Parameter) for _, t in own)]
    assert names == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.norm",
                     "lm_head"]
    assert len(module_groups(big, BLOCK_BYTES)) > 3 * 5        # 64 MiB blocks: each layer in pieces
    assert block_size(big, 1 << 20) == 1 << 20                  # an explicit size is kept
    small, _ = _llama()
    assert block_size(small, None) == BLOCK_BYTES


def test_the_chunked_loss_recomputes_its_chunks_without_the_swap():
    # NOTE [chunked loss]: in backward each chunk's bf16 head weight and log-probabilities are
    # saved and read at once; a tiered step's swap must not see them (it copied them out and back)
    model, opt = _llama()
    state = 16 * sum(p.numel() for p in model.parameters())
    fake = FakeBackend(total=1 << 30, foreign_host=True)
    fake.enforces_budget = True
    tier = tiermem.Tier(backend=fake)
    train = tier.wrap_training(model, opt, int(state / 2.5), block_bytes=32 << 10, min_swap=4096)
    for ids in _batches(2):
        with train.step():
            _loss(model, ids).backward()
    outside = [r.nbytes for r in train.choice.trace.saved if r.segment == -1]
    head_bf16 = model.lm_head.weight.numel() * 2
    assert outside and head_bf16 not in outside
    assert outside[-1] == 2 * 32 * model.config.hidden_size * 4      # the loss's own: the fp32 hidden states
    train.unwrap()
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


def _room_for_parts(monkeypatch) -> None:
    """Plans made with room for 4/5 of a layer's saves above the floor: its parts' inputs and
    largest part fit, not its whole segment. The fake's device does not hold the activations, so
    the traced floor cannot make room tight (planner tests in test_trainplan.py choose from real
    sizes)."""
    import dataclasses

    import tiermem.training.choice as choice
    real = choice.plan_training

    def tight(trace, budget, **kw):
        seg = max(sum(r.nbytes for r in trace.saved if r.segment == i) for i in set(trace.part_block))
        margin = kw.get("margin") or budget // 16
        return real(dataclasses.replace(trace, floor_peak=max(budget - margin - seg * 4 // 5, 0)), budget, **kw)

    monkeypatch.setattr(choice, "plan_training", tight)


@pytest.mark.parametrize("recompute", ["always", "auto"])
def test_layers_recomputed_in_parts_give_the_plain_loops_losses_bitwise(recompute, monkeypatch):
    # NOTE [recompute in parts]: each layer is one block (1 MiB blocks)
    _room_for_parts(monkeypatch)
    g = torch.Generator().manual_seed(1)
    bs = [torch.randint(0, VOCAB, (8, 64), generator=g) for _ in range(5)]
    model, opt = _llama()
    want = plain_losses(model, opt, bs, _loss)
    want_params = [p.detach().clone() for p in model.parameters()]
    model, opt = _llama()
    state = 16 * sum(p.numel() for p in model.parameters())
    fake = FakeBackend(total=1 << 30, foreign_host=True)
    tier = tiermem.Tier(backend=fake)
    # min_swap above the rotary tables, which every layer saves (a shared save is not recomputed)
    train = tier.wrap_training(model, opt, state // 2, block_bytes=1 << 20, min_swap=16384, recompute=recompute)
    assert tiered_losses(train, model, bs, _loss) == want
    p = train.plan
    assert {train.blocks[i].name for i in train.choice.trace.part_block} == {f"model.layers.{i}" for i in range(4)}
    assert p.parts <= p.recompute and all(p.segment_modes[i] == "recompute in parts" for i in p.parts)
    if recompute == "always":
        assert {train.blocks[i].name for i in p.parts} == {f"model.layers.{i}" for i in range(4)}, p.table()
        assert "4 of them in parts" in p.table()
        layer = model.model.layers[0]
        assert "forward" in layer.self_attn.__dict__ and "forward" in layer.mlp.__dict__   # checkpointed inside
    train.unwrap()
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), want_params))
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


def test_a_layer_in_parts_holds_none_of_its_parts_inputs_through_the_forward(monkeypatch):
    """NOTE [recompute in parts]: in forward a layer in parts keeps its own inputs only. A Llama
    layer's attention takes its hidden states as a keyword (``hidden_states=``); checkpoint's
    recompute function held it through the forward, out of the swap's sight, till the keyword's
    tensors went to checkpoint as inputs (tiermem/training/recompute.py)."""
    import weakref

    _room_for_parts(monkeypatch)
    g = torch.Generator().manual_seed(1)
    bs = [torch.randint(0, VOCAB, (8, 64), generator=g) for _ in range(3)]
    model, opt = _llama()
    state = 16 * sum(p.numel() for p in model.parameters())
    tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
    train = tier.wrap_training(model, opt, state // 2, block_bytes=1 << 20, min_swap=16384, recompute="always")
    refs = []
    hooks = [layer.input_layernorm.register_forward_hook(lambda m, a, out: refs.append(weakref.ref(out)))
             for layer in model.model.layers]
    try:
        for ids in bs:
            refs.clear()
            with train.step():
                loss = _loss(model, ids)
                gc.collect()
                alive = sum(r() is not None for r in refs)
                loss.backward()
            if train.plan is not None and train.plan.parts:
                assert alive == 0, f"{alive} of {len(refs)} attention inputs held through the forward"
        assert train.plan.parts
    finally:
        for h in hooks:
            h.remove()
        train.unwrap()

