"""GPU tests of the expert cache (NOTE [expert cache], NOTE [cached experts sum alike] in
tiermem/inference/experts.py): a long greedy decode of a small Qwen2-MoE in fp16, its router
skewed as bench/infer_moe.py skews it, through a cache that must evict, against the same model
without a cache: the tokens and every step's logits equal to the bit, with each experts
implementation (the one transformers picks on the device, the eager loop, batched_mm), while the
cache's copies run on the copy lane for real: from the pinned home, and for the eager loop from
slot to slot on the device, which keep each call one round. A model of about 100 MB."""
from __future__ import annotations

import copy

import pytest
from helpers import share

pytestmark = pytest.mark.gpu


def _qwen2_moe(impl):
    import torch
    tf = pytest.importorskip("transformers")
    cfg = tf.Qwen2MoeConfig(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                            shared_expert_intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=4, vocab_size=8192, num_experts=16, num_experts_per_tok=4,
                            decoder_sparse_step=1, max_position_embeddings=512, tie_word_embeddings=False)
    if impl is not None:
        cfg._experts_implementation = impl
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(cfg).half().eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model.cpu(), cfg


@pytest.mark.parametrize("impl", [None, "eager", "batched_mm"])
def test_a_skewed_greedy_decode_through_the_cache_computes_the_same_logits(impl):
    import torch

    import tiermem
    from tiermem.inference.experts import ORDERED_IMPLEMENTATIONS
    from tiermem.testing import skew_router
    model, cfg = _qwen2_moe(impl)
    ids = torch.randint(0, cfg.vocab_size, (1, 16), device="cuda")
    one = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 2           # an expert, fp16
    cache = 21 * one                                                     # 20 slots of 64 experts, and the zero slot

    def decode(m, **kw):
        sk = skew_router(m, hot=2 * cfg.num_experts_per_tok, bias=2.0)
        t = tiermem.Tier(0, cap="1GiB")
        h = t.wrap_module(m, **kw)
        try:
            with torch.no_grad():
                out = m.generate(ids, max_new_tokens=48, min_new_tokens=48, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            h.drain()
            return out, h.stats(), h
        finally:
            h.unwrap()
            t.close()
            sk.remove()

    want, _, h0 = decode(copy.deepcopy(model), budget=share(model, 40))
    got, s, h = decode(copy.deepcopy(model), budget=share(model, 40) + cache, expert_cache=cache)
    assert h._cache is None and h.plan.pinned == h0.plan.pinned     # unwrapped; the same plan beside the cache
    assert s["expert_cache.slots"] == 20 and s["expert_cache.calls"] > 100
    assert s["expert_cache.evictions"] > 0 and s["expert_cache.hits"] > 0
    # One round a call: the eager loop's by its experts kept in slots in number order, moved there
    # by copies from slot to slot on the device (NOTE [experts in number order]).
    assert s["expert_cache.rounds"] == s["expert_cache.calls"]
    if model.config._experts_implementation in ORDERED_IMPLEMENTATIONS:
        assert s["expert_cache.slot_moves"] == 0       # no order to keep (grouped_mm, batched_mm)
    else:
        assert s["expert_cache.slot_moves"] > 0
    assert torch.equal(got.sequences, want.sequences)
    differ = [i for i, (a, b) in enumerate(zip(got.logits, want.logits)) if not torch.equal(a, b)]
    assert differ == []
