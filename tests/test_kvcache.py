"""The KV cache in tiers (NOTE [kv cache in tiers] in tiermem/inference/kvcache.py) on the CPU over the
fake backend: tokens equal to transformers' DynamicCache for a tiny Llama (greedy with left padding,
chunked prefill, beam search), the token-major layout of the home and the device, what a decode step
copies, the budget it holds, its refusals, fp8 in transit, and the one budget wrap_module splits
between the weights and the cache."""
from __future__ import annotations

import ctypes
import gc
import re
import warnings

import pytest
import torch

import tiermem
from tiermem.planning import kv_shape, plan_kv

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

VERSION = tuple(int(x) for x in transformers.__version__.split(".")[:2])
KW = "cache" if VERSION >= (5, 24) else "past_key_values"     # generate's and forward's name for it
MAX = 64                                                      # max_tokens of the caches here
GEN = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)


def llama(layers: int = 6, init: float = 0.5, seed: int = 0) -> LlamaForCausalLM:
    # initializer_range=0.5: with the default init a tiny model repeats one token, and equal
    # tokens would say nothing
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=init)
    return LlamaForCausalLM(cfg).eval()


def prompt(batch: int = 2, n: int = 11, pad: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, n), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :pad] = 0            # left padding
    return ids, mask


def layer_bytes(model, batch: int = 2, tokens: int = MAX) -> int:
    return kv_shape(model.config, model.dtype, batch).layer_bytes(tokens)


def budget(model, resident: int, batch: int = 2, slots: int = 2) -> int:
    """The kv_budget that keeps ``resident`` layers and a ring of ``slots``."""
    return layer_bytes(model, batch) * (resident + slots)


@pytest.fixture(scope="module")
def model():
    return llama()


@pytest.fixture(scope="module")
def want(model):
    ids, mask = prompt()
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **GEN)


def generate(model, cache, **kw):
    ids, mask = prompt()
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **{KW: cache}, **GEN, **kw)


@pytest.mark.parametrize("resident", [0, 1, 3, 6], ids=["all-streamed", "one-resident", "three-resident", "all-resident"])
def test_greedy_tokens_equal_dynamic_cache_with_left_padding(model, want, tier, fake, resident):
    c = tiermem.kv_cache(model, MAX, budget(model, resident, slots=0 if resident == 6 else 2), batch_size=2, tier=tier)
    assert len(c.plan.resident) == resident and c.plan.slots == (0 if resident == 6 else 2)
    assert not c.is_compileable
    assert torch.equal(generate(model, c), want)
    assert c.get_seq_length() == want.shape[1] - 1      # the last token is generated, not yet cached
    st = c.stats()
    assert st["fills_late"] == 0 and (st["fills"] > 0) == (resident < 6)
    c.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0} and not tier.leases


def test_the_old_keyword_and_a_forward_of_many_chunks_give_the_same_tokens(model, want, tier):
    ids, mask = prompt()
    with tiermem.kv_cache(model, MAX, budget(model, 1), batch_size=2, tier=tier) as c, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)    # 5.24 names it cache= and says so
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=c, **GEN)
    assert torch.equal(out, want)
    # prefill in chunks of 4 tokens: each chunk's forward reads the layers' past back from home
    with tiermem.kv_cache(model, MAX, budget(model, 1), batch_size=2, tier=tier) as c:
        assert torch.equal(generate(model, c, prefill_chunk_size=4), want)
        assert c.stats()["fills_late"] == 0


def test_beam_search_reorders_the_homes_and_the_resident_layers(model, tier):
    ids, mask = prompt()
    beams = dict(num_beams=3, num_return_sequences=2)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, **GEN, **beams)
        with tiermem.kv_cache(model, MAX, budget(model, 1, batch=6), batch_size=6, tier=tier) as c:
            out = model.generate(input_ids=ids, attention_mask=mask, **{KW: c}, **GEN, **beams)
            assert len(c.plan.resident) == 1
    assert torch.equal(out, ref)


def _raw(ptr: int, shape: tuple[int, ...], dtype) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    n *= torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_uint8 * n).from_address(ptr), dtype=torch.uint8).view(dtype).view(shape).clone()


def test_the_home_and_the_device_are_token_major_and_hold_dynamic_caches_keys(model, tier):
    ids, mask = prompt()
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{KW: ref})
    c = tiermem.kv_cache(model, MAX, budget(model, 2), batch_size=2, tier=tier)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{KW: c})
    c.synchronize()
    n, (b, h, d) = ids.shape[1], (2, 2, 16)
    assert sorted(c.plan.resident) == [1, 4]
    for i, lay in enumerate(c.layers):
        k_ref, v_ref = ref.layers[i].keys, ref.layers[i].values            # [batch, heads, tokens, dim]
        if lay.resident:
            k, v = (t[:n] for t in lay.dev)
            assert lay.home == ()                                          # no home: it never leaves
        else:
            # keys then values, each [max_tokens, batch, heads, dim] from the home's address
            k = _raw(lay.home[0], (n, b, h, d), torch.float32)
            v = _raw(lay.home[1], (n, b, h, d), torch.float32)
            assert lay.home[1] - lay.home[0] == MAX * b * h * d * 4
        torch.testing.assert_close(k.permute(1, 2, 0, 3), k_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v.permute(1, 2, 0, 3), v_ref, rtol=1e-5, atol=1e-6)
        got = c.read_layer(i)
        torch.testing.assert_close(got[0], k_ref, rtol=1e-5, atol=1e-6)
    c.close()


def test_a_decode_step_appends_only_its_token_and_fills_each_streamed_layer_once(model, tier, fake):
    ids, mask = prompt()
    c = tiermem.kv_cache(model, MAX, budget(model, 1), batch_size=2, tier=tier)
    streamed = [i for i in range(6) if i not in c.plan.resident]
    row = 2 * 2 * 16 * 4                      # one token of keys (or values), both sequences, fp32
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **{KW: c})
        nxt = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        allocs = [x for x in fake.calls if x[0] in ("device_alloc", "host_alloc")]
        for _ in range(3):
            before, n = dict(c.stats()), c.get_seq_length()
            out = model(input_ids=nxt, attention_mask=mask, **{KW: c})
            nxt = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            st = c.stats()
            # no round trip: home gets the new token of keys and values, nothing more
            assert st["d2h_bytes"] - before["d2h_bytes"] == len(streamed) * 2 * row
            # each streamed layer comes in once, filled ahead of its use: its n tokens so far, but
            # the first one of the next step, filled while this step's last streamed layer ran,
            # already with this step's token
            m = len(streamed)
            assert st["h2d_bytes"] - before["h2d_bytes"] == 2 * row * ((m - 1) * n + n + 1)
            assert st["fills"] - before["fills"] == len(streamed) and st["fills_late"] == 0
            assert st["appends"] - before["appends"] == len(streamed)
    assert [x for x in fake.calls if x[0] in ("device_alloc", "host_alloc")] == allocs   # nothing allocated per step
    assert tier.stats()["moved_bytes.activation.h2d"] == c.stats()["h2d_bytes"]
    c.close()


def test_the_cache_holds_its_budget_and_its_lease_and_gives_both_back(model, tier, fake):
    kvb = budget(model, 1) + 1000
    c = tiermem.kv_cache(model, MAX, kvb, batch_size=2, tier=tier)
    assert [x.nbytes for x in tier.leases] == [kvb] and tier.budget == kvb
    assert c.device_bytes == 0 and fake.live()["device"] == 0        # taken at the first forward
    fake.peak_live["device"] = 0
    generate(model, c)
    assert c.device_bytes == c.plan.device_bytes == 3 * layer_bytes(model) <= kvb
    assert fake.peak_live["device"] == c.device_bytes
    assert c.home_bytes == c.plan.home_bytes == 5 * layer_bytes(model)      # the five streamed layers
    assert tier.stats()["resident_bytes.activation.current"] == c.device_bytes
    c.close()
    c.close()                                                         # idempotent
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}
    assert not tier.leases and tier.stats()["resident_bytes.activation.current"] == 0
    with pytest.raises(tiermem.TierMemError, match="closed"):
        generate(model, c)


def test_a_cache_dropped_without_close_is_given_back(model, tier, fake):
    c = tiermem.kv_cache(model, MAX, budget(model, 1), batch_size=2, tier=tier)
    generate(model, c)
    assert fake.live()["device"] > 0
    del c
    gc.collect()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0} and not tier.leases


def test_a_configured_budget_bounds_the_caches_lease(model, fake, caplog):
    t = tiermem.Tier(backend=fake, budget=budget(model, 1))
    with caplog.at_level("WARNING", logger="tiermem"):
        c = tiermem.kv_cache(model, MAX, budget(model, 3), batch_size=2, tier=t)
    assert "does not fit the tier's configured budget" in caplog.text
    assert len(c.plan.resident) == 1
    c.close()


# -- refusals ------------------------------------------------------------------------------------

def test_a_context_past_the_host_budget_is_refused_before_anything_is_taken(model, tier, fake):
    home = 5 * layer_bytes(model, batch=2, tokens=MAX)       # the five streamed layers' homes at MAX tokens
    with pytest.raises(tiermem.errors.HostBudgetError) as e:
        tiermem.kv_cache(model, MAX, budget(model, 1), batch_size=2, host_budget=home - 1, tier=tier)
    msg = str(e.value)
    assert f"a context of {MAX:,} tokens x 2 needs {home:,} bytes of pinned host memory" in msg
    assert e.value.limit == home - 1 and e.value.asked == home
    fit = int(re.search(r"at most ([\d,]+) tokens fit", msg).group(1).replace(",", ""))
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0} and not tier.leases
    # the number it names is the most that fits (the home's parts are 512-byte aligned)
    tiermem.kv_cache(model, fit, budget(model, 1), batch_size=2, host_budget=home - 1, tier=tier).close()
    with pytest.raises(tiermem.errors.HostBudgetError):
        tiermem.kv_cache(model, fit + 1, budget(model, 1), batch_size=2, host_budget=home - 1, tier=tier)
    # by default the host's available memory is the limit: a context past it is refused too
    from tiermem.base.hostpages import available_bytes
    t = available_bytes() // (4 * 256)         # six homes of 256 bytes a token: 1.5x what is available
    with pytest.raises(tiermem.errors.HostBudgetError, match="available memory"):
        tiermem.kv_cache(model, t, 3 * layer_bytes(model, batch=1, tokens=t), tier=tier)   # the ring, and the home's mapping
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0} and not tier.leases


def test_a_budget_below_the_ring_and_bad_arguments_are_refused(model, tier):
    with pytest.raises(tiermem.OutOfBudgetError, match="raise kv_budget to"):
        tiermem.kv_cache(model, MAX, budget(model, 0) - 1, batch_size=2, tier=tier)
    with pytest.raises(tiermem.ConfigError, match="kv_budget is required"):
        tiermem.kv_cache(model, MAX, tier=tier)
    with pytest.raises(tiermem.ConfigError, match="max_tokens"):
        tiermem.kv_cache(model, 0, "1MB", tier=tier)
    with pytest.raises(tiermem.ConfigError):
        tiermem.kv_cache(model, MAX, "lots", tier=tier)
    assert not tier.leases


def test_a_prompt_or_a_decode_past_max_tokens_is_refused_and_the_cache_keeps_its_tokens(model, tier):
    ids, mask = prompt()
    c = tiermem.kv_cache(model, 12, budget(model, 1), batch_size=2, tier=tier)
    with torch.no_grad(), pytest.raises(tiermem.ConfigError, match="max_tokens=12"):
        model(input_ids=torch.cat([ids, ids], 1), **{KW: c})       # 22 tokens: refused at layer 0
    assert c.get_seq_length() == 0
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        got = model(input_ids=ids, attention_mask=mask, **{KW: c}).logits
        assert torch.equal(got, want) and c.get_seq_length() == 11
        model(input_ids=ids[:, :1], **{KW: c})                     # the 12th token fits
        with pytest.raises(tiermem.ConfigError, match="a context of 13 tokens"):
            model(input_ids=ids[:, :1], **{KW: c})
    assert c.get_seq_length() == 12
    c.close()


def test_keys_of_another_batch_or_device_are_refused(model, tier):
    ids, _ = prompt(batch=3)
    c = tiermem.kv_cache(model, MAX, budget(model, 1), batch_size=2, tier=tier)
    with torch.no_grad():
        model(input_ids=ids[:2], **{KW: c})                         # the cache takes the batch of 2
        with pytest.raises(tiermem.ConfigError, match="batch 2"):
            model(input_ids=ids[:, :1], **{KW: c})
    c.close()
    c = tiermem.kv_cache(model, MAX, budget(model, 1), batch_size=2, tier=tier)
    with pytest.raises(tiermem.ConfigError, match="on meta"):
        c.update(torch.empty(2, 2, 1, 16, device="meta"), torch.empty(2, 2, 1, 16, device="meta"), 0)
    c.close()


# -- fp8 in transit ------------------------------------------------------------------------------

def test_fp8_in_transit_halves_the_bytes_and_keeps_the_logits(tier):
    m = llama(init=0.02)        # a model whose logits do not amplify every rounding
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(5))
    logits = {}
    for fp8 in (False, True):
        b = 2 * plan_kv(kv_shape(m.config, m.dtype), MAX, 1 << 30, fp8=fp8).slot_bytes     # the ring alone
        c = tiermem.kv_cache(m, MAX, b, batch_size=1, fp8=fp8, tier=tier)
        assert not c.plan.resident
        with torch.no_grad():
            m(input_ids=ids[:, :32], **{KW: c})
            logits[fp8] = torch.cat([m(input_ids=ids[:, i:i + 1], **{KW: c}).logits for i in range(32, 48)], 1)
        if fp8:
            st = c.stats()
            assert c.home_bytes < 0.6 * c.plan.layer_bytes * 6
            k, _ = c.read_layer(0)                      # what the home holds, dequantized
            ref_cache = DynamicCache(config=m.config)
            with torch.no_grad():
                m(input_ids=ids, **{KW: ref_cache})
            err = (k - ref_cache.layers[0].keys[:, :, :48]).norm() / ref_cache.layers[0].keys.norm()
            assert 0 < err < 0.05                       # e4m3's 3 mantissa bits, one scale per token and head
            assert st["h2d_bytes"] > 0
        c.close()
    cos = torch.nn.functional.cosine_similarity(logits[True].flatten(), logits[False].flatten(), dim=0)
    top1 = (logits[True].argmax(-1) == logits[False].argmax(-1)).float().mean()
    assert cos > 0.999 and top1 >= 0.9, (cos, top1)


# -- one budget for weights and cache ------------------------------------------------------------

def test_wrap_module_splits_one_budget_between_weights_and_cache(tier, fake):
    m = llama()
    ref = llama()
    ids, mask = prompt()
    with torch.no_grad():
        want = ref.generate(input_ids=ids, attention_mask=mask, **GEN)
    w = sum(p.numel() * p.element_size() for p in m.parameters())
    kvb = budget(m, 1)
    h = tier.wrap_module(m, budget=w // 2 + kvb, kv_budget=kvb, max_group_bytes=16 << 10)
    assert h.plan.kv_budget == kvb and h.plan.budget == w // 2 and h.budget == w // 2 + kvb
    assert h.plan.streamed_bytes > 0
    assert "for the weights" in h.plan.table() and "for the KV cache" in h.plan.table()
    c = h.kv_cache(MAX, batch_size=2)
    assert h.plan.kv is c.plan and len(c.plan.resident) == 1 and "KV cache budget" in h.plan.table()
    assert [x.nbytes for x in tier.leases] == [w // 2 + kvb]          # one lease for both
    with pytest.raises(tiermem.TierMemError, match="still open"):
        h.kv_cache(MAX)
    with torch.no_grad():
        out = m.generate(input_ids=ids, attention_mask=mask, **{KW: c}, **GEN)
    assert torch.equal(out, want)
    assert tier.stats()["resident_bytes.all.peak"] <= h.budget
    h.unwrap()                                          # closes the cache, whose bytes are in its lease
    assert c._closed and fake.live() == {"managed": 0, "pinned": 0, "device": 0} and not tier.leases


def test_kv_budget_auto_plans_the_split_for_kv_tokens(tier):
    m = llama()
    w = sum(p.numel() * p.element_size() for p in m.parameters())
    h = tier.wrap_module(m, budget=w + budget(m, 2, batch=1), kv_budget="auto", kv_tokens=MAX, max_group_bytes=16 << 10)
    kv = h.plan.kv
    assert kv is not None and kv.max_tokens == MAX and h.plan.budget + h.plan.kv_budget <= h.budget
    assert h.plan.kv_budget == kv.device_bytes
    c = h.kv_cache()                                   # max_tokens from kv_tokens
    assert c.max_tokens == MAX and c.plan.budget == h.plan.kv_budget
    c.close()
    h.kv_cache().close()                               # closed, so another may be made
    h.unwrap()
    with pytest.raises(tiermem.ConfigError, match="kv_tokens"):
        tier.wrap_module(llama(), budget=w, kv_budget="auto")
    with pytest.raises(tiermem.ConfigError, match="more than the whole budget"):
        tier.wrap_module(llama(), budget=w, kv_budget=2 * w)
    h = tier.wrap_module(llama(), budget=w)
    with pytest.raises(tiermem.ConfigError, match="no KV share"):
        h.kv_cache(MAX)
    h.unwrap()
