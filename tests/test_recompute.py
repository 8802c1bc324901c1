"""Recomputing segments in backward (NOTE [recompute]) on the CPU: the real hooks of a training
handle (ActivationSwap with its Recompute), on CPU tensors, which the swap itself never moves.
torch's CPU kernels are deterministic, so gradients must match a run that kept everything, bitwise."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from tiermem import TierMemError  # noqa: E402
from tiermem._recompute import Recompute, repeated_layers  # noqa: E402
from tiermem._swap import ActivationSwap  # noqa: E402


class Layer(nn.Module):
    """A pre-norm residual layer with dropout in two places and keyword inputs, as a
    transformers decoder layer takes its position embeddings."""

    def __init__(self, d: int, p: float = 0.3):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x, *, pos=None):
        h = self.ln(x)
        if pos is not None:
            cos, sin = pos
            h = h * cos + h.roll(1, -1) * sin
        h = self.drop(torch.nn.functional.gelu(self.fc(h)))
        return x + self.drop(self.out(h))


class Net(nn.Module):
    def __init__(self, d=32, n=4, vocab=50):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        T = ids.shape[1]
        ang = torch.arange(T, dtype=torch.float32)[:, None] / 7.0
        pos = (ang.cos().expand(T, x.shape[-1]), ang.sin().expand(T, x.shape[-1]))
        for layer in self.layers:
            x = layer(x, pos=pos)
        return self.head(x)


def _grads(model, ids, seed, hooks=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if hooks is None:
        loss = model(ids).logsumexp(-1).mean()
        loss.backward()
    else:
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            loss = model(ids).logsumexp(-1).mean()
            loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _hooks(model, active):
    swap = ActivationSwap(None, {}, min_swap=1, window=1)
    rc = Recompute(repeated_layers(model))
    swap.recompute = rc
    rc.param_ref = swap._param_ref
    rc.begin(frozenset(active))
    swap.begin(None, frozenset(), [])
    return swap, rc


@pytest.mark.parametrize("active", [{0, 1, 2, 3}, {1, 3}, set()])
def test_gradients_with_recompute_equal_those_without_bitwise_dropout_included(active):
    torch.manual_seed(0)
    model = Net()
    ids = torch.randint(0, 50, (3, 16))
    want_loss, want = _grads(model, ids, seed=7)
    swap, rc = _hooks(model, active)
    calls = []
    orig = rc._recompute
    rc._recompute = lambda run: (calls.append(run.seg), orig(run))[1]
    got_loss, got = _grads(model, ids, seed=7, hooks=swap)
    assert torch.equal(got_loss, want_loss)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # each recomputed segment ran its forward again exactly once, in backward (last first)
    assert calls == sorted(active, reverse=True)


def test_dropout_really_draws_and_a_lost_rng_state_would_show():
    # The check above can fail: recomputing with the RNG state not restored gives other masks.
    torch.manual_seed(0)
    model = Net()
    ids = torch.randint(0, 50, (3, 16))
    _, want = _grads(model, ids, seed=7)
    swap, rc = _hooks(model, {0, 1, 2, 3})
    real = torch.set_rng_state
    try:
        torch.set_rng_state = lambda s: None       # what forgetting the state would do
        _, got = _grads(model, ids, seed=7, hooks=swap)
    finally:
        torch.set_rng_state = real
    assert not all(torch.equal(g, w) for g, w in zip(got, want))


def test_recomputed_segments_keep_only_their_inputs():
    torch.manual_seed(0)
    model = Net()
    ids = torch.randint(0, 50, (3, 16))
    kept = []

    class Count(ActivationSwap):
        def pack(self, t):
            r = super().pack(t)
            kept.append(torch.is_tensor(r))
            return r
    swap = Count(None, {}, min_swap=1, window=1)
    rc = Recompute(repeated_layers(model))
    swap.recompute, rc.param_ref = rc, swap._param_ref
    rc.begin(frozenset(range(4)))
    swap.begin(None, frozenset(), [])
    with torch.autograd.graph.saved_tensors_hooks(swap.pack, swap.unpack):
        loss = model(ids).sum()
        inside = [k for k in kept]
        loss.backward()
    # the embedding and head still keep theirs; every save inside the four layers is a reference
    assert inside.count(False) >= 4 * 8 and inside.count(True) <= 4
    assert rc.input_bytes[0] > 0 and set(rc.input_bytes) == {0, 1, 2, 3}


def test_a_second_read_after_the_recompute_let_go_raises_clearly():
    torch.manual_seed(0)
    model = Net()
    ids = torch.randint(0, 50, (2, 8))
    swap, rc = _hooks(model, {0})
    with torch.autograd.graph.saved_tensors_hooks(swap.pack, swap.unpack):
        loss = model(ids).sum()
        loss.backward(retain_graph=True)
        with pytest.raises(TierMemError, match="one backward"):
            loss.backward()


def test_a_segment_saving_other_tensors_when_recomputed_is_refused():
    class Moody(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            y = self.fc(x)
            return y * y if self.calls == 1 else y + 1      # saves y once, nothing the second time

    model = nn.Sequential(nn.Linear(8, 8), nn.ModuleList([Moody(), Moody()]))
    rc = Recompute(list(model[1]))
    swap = ActivationSwap(None, {}, min_swap=1, window=1)
    swap.recompute, rc.param_ref = rc, swap._param_ref
    rc.begin(frozenset({0}))
    x = torch.randn(2, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(swap.pack, swap.unpack):
        y = model[1][0](model[0](x))
        with pytest.raises(TierMemError, match="same tensors"):
            y.sum().backward()


def test_repeated_layers_finds_the_largest_module_list_and_begin_checks_indices():
    model = Net(n=3)
    assert repeated_layers(model) == list(model.layers)
    assert repeated_layers(nn.Linear(2, 2)) == []
    rc = Recompute(repeated_layers(model))
    with pytest.raises(ValueError, match="no segments"):
        rc.begin(frozenset({3}))
    rc.remove()
    assert not model.layers[0]._forward_pre_hooks


def test_a_transformers_decoder_recomputes_bitwise_with_attention_dropout():
    # Decoder layers take keyword inputs (the mask, position embeddings) and draw attention
    # dropout: the recompute must hold the former and replay the latter.
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                   attention_dropout=0.2, use_cache=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).train()
    ids = torch.randint(0, 256, (2, 24))

    def run(hooks):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        ctx = (torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack) if hooks is not None
               else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
        with ctx:
            loss = model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()
            loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]
    want_loss, want = run(None)
    swap, rc = _hooks(model, {0, 2})
    assert rc.segments == list(model.model.layers)
    got_loss, got = run(swap)
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
