"""What the benches read off a model for their bounds, on the CPU: the embedding bytes a lookup
reads in place (bench/_common.py embedding_bytes) and the experts a decode step's router picks
(bench/offload_infer.py Routing); and the stress benches' Tier that stages every move. No GPU."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

import offload_infer  # noqa: E402
from _common import embedding_bytes  # noqa: E402

from tiermem.testing import GPT, GPTConfig  # noqa: E402


def _llama(tie: bool):
    cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=300, tie_word_embeddings=tie)
    return tf.LlamaForCausalLM(cfg)


def test_an_untied_embedding_is_read_in_place():
    m = _llama(tie=False)
    assert embedding_bytes(m) == 300 * 64 * 4
    assert embedding_bytes(m.half()) == 300 * 64 * 2


def test_a_table_tied_to_the_head_is_read_whole():
    m = _llama(tie=True)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert embedding_bytes(m) == 0


def test_every_lookup_table_counts():
    c = GPTConfig(vocab=200, seq=32, d=48, layers=1, heads=4)
    assert embedding_bytes(GPT(c)) == (200 + 32) * 48 * 4     # tokens and positions; the head is its own


def test_routing_counts_the_experts_a_decode_step_picks():
    cfg = tf.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=100, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    m = tf.MixtralForCausalLM(cfg).eval()
    r = offload_infer.Routing(m)
    per = (192 * 64 + 64 * 96) * 4                   # one expert's gate_up and down projections, fp32
    assert [(e, p) for _, e, p in r.sets] == [(4, per), (4, per)]
    assert r.expert_bytes == 2 * 4 * per
    picked = []
    hooks = [s[0].register_forward_pre_hook(lambda mod, args: picked.append(int(torch.unique(args[1]).numel())))
             for s in r.sets]
    with torch.no_grad():
        m(torch.randint(0, 100, (1, 8)))             # a prefill: not a decode step, not counted
        assert r.routed == 0
        picked.clear()
        m(torch.randint(0, 100, (1, 1)))             # one token
    assert r.routed == sum(picked) * per and 2 * per <= r.routed <= 4 * per
    for h in hooks:
        h.remove()
    r.remove()


def test_a_tier_that_stages_everything_sends_even_a_small_move_through_the_ring():
    """bench/soak.py and the stress probe run the staging rings on every move through
    _common.tier_staging_everything, with no reach into the Tier's private members."""
    from _common import tier_staging_everything
    from fakes import FakeBackend
    from helpers import fill_random, read

    import tiermem
    from tiermem.cuda import staging
    before = staging.MIN_STAGED
    small_bytes = staging.MIN_STAGED - 1
    moved = {}
    for name, make in (("plain", lambda fake: tiermem.Tier(backend=fake, staging="8MiB")),
                       ("everything", lambda fake: tier_staging_everything(tiermem, backend=fake, staging="8MiB"))):
        fake = FakeBackend(total=1 << 30)
        t = make(fake)
        assert staging.MIN_STAGED == before           # set only while the Tier was made
        small = t.empty(small_bytes, "uint8", role="gradient")
        data = fill_random(small)
        t.evict(small)
        t.prefetch(small)
        assert torch.equal(read(small), data)
        s = t.stats()
        moved[name] = (s["staged_bytes.gradient.d2h"], s["staged_bytes.gradient.h2d"])
        t.close()
    assert moved == {"plain": (0, 0), "everything": (small_bytes, small_bytes)}
