"""The KV cache in tiers on the GPU (NOTE [kv cache in tiers] in tiermem/inference/kvcache.py).

A Llama-shaped fp16 model (1.0 GB of weights, 128 KiB of cache a token) decodes after a prompt of
8k tokens whose cache (1.08 GB at the most it may reach) is bigger than what the GPU has left: one
plain reservation takes all of the card but the weights, the cache's budget and 768 MiB for the
forward's activations (docs/facts.md, "a really small GPU"). The tokens equal a resident-cache run
made before the card was taken, and the driver's free memory, sampled while it decodes, never drops
by more than the cache's budget and what torch's own allocator took. Ctrl-C at backend calls in the
middle of a decode (NOTE [failure injection] in tiermem/cuda/backend.py), with copies in flight,
leaves a cache that goes on to the same tokens, and once closed the device has its memory back.
"""
from __future__ import annotations

import gc
import threading
import time

import pytest

pytestmark = pytest.mark.gpu

MiB = 1 << 20
PROMPT = 8192
NEW = 32


def _model():
    import torch
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=2048, intermediate_size=2048, num_hidden_layers=16,
                                   num_attention_heads=16, num_key_value_heads=16, vocab_size=8192,
                                   max_position_embeddings=PROMPT + 256)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).half().eval()
    model.generation_config.pad_token_id = 0
    return model, cfg


def _kw():
    import transformers
    return "cache" if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 24) else "past_key_values"


def _take_device(keep: int):
    """All but ``keep`` bytes of the card in plain cudaMalloc reservations (docs/facts.md)."""
    import torch
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    blobs = []
    for _ in range(4):
        free, _ = torch.cuda.mem_get_info()
        if free <= keep + 64 * MiB:
            break
        blobs.append(torch.empty(free - keep, dtype=torch.uint8, device="cuda"))
    return blobs


class FreeSampler:
    """The driver's free memory, sampled every millisecond on a thread while the block runs."""

    def __init__(self):
        self.low = None
        self._stop = threading.Event()

    def __enter__(self):
        import torch
        self.low = torch.cuda.mem_get_info()[0]

        def run():
            while not self._stop.is_set():
                self.low = min(self.low, torch.cuda.mem_get_info()[0])
                time.sleep(0.001)
        self._t = threading.Thread(target=run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


@pytest.mark.parametrize("chunk", [None, 2048], ids=["whole_prompt", "chunked_prefill"])
def test_a_long_decode_on_a_really_small_gpu_gives_the_resident_caches_tokens_within_budget(chunk):
    import torch

    import tiermem
    from tiermem.inference.kvplan import pinned_map_bytes
    from tiermem.planning import kv_shape
    model, cfg = _model()
    ids = torch.randint(0, cfg.vocab_size, (1, PROMPT), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    gen = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    if chunk:
        gen["prefill_chunk_size"] = chunk
    with torch.no_grad():
        want = model.generate(ids, **gen)                    # transformers' resident DynamicCache
    max_tokens = PROMPT + NEW
    layer = kv_shape(cfg, torch.float16).layer_bytes(max_tokens)
    whole = cfg.num_hidden_layers * layer
    # one layer resident, two slots, and the driver's mapping of the home (NOTE [pinned mapping])
    kv_budget = 3 * layer + pinned_map_bytes(whole)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    blob = _take_device(kv_budget + 768 * MiB)
    try:
        free0, _ = torch.cuda.mem_get_info()
        assert free0 < whole, "the cache must not fit the device"
        t = tiermem.Tier(0)
        cache = t.kv_cache(model, max_tokens, kv_budget)
        assert len(cache.plan.resident) == 1 and cache.plan.slots == 2
        torch.cuda.reset_peak_memory_stats()
        torch0 = torch.cuda.memory_reserved()
        with torch.no_grad(), FreeSampler() as s:
            got = model.generate(ids, **{_kw(): cache}, **gen)
            torch.cuda.synchronize()
        torch_grew = torch.cuda.max_memory_reserved() - torch0
        print(f"free {free0 / 2**30:.2f} GiB, lowest {s.low / 2**30:.2f} GiB, cache {cache.device_bytes / 2**30:.2f} GiB "
              f"of {kv_budget / 2**30:.2f}, torch grew {torch_grew / 2**30:.2f} GiB, weights {weights / 2**30:.2f}, "
              f"{cache.stats()}")
        assert torch.equal(got, want)
        assert cache.device_bytes <= kv_budget
        assert free0 - s.low <= kv_budget + torch_grew + 64 * MiB
        st = cache.stats()
        per_token = kv_shape(cfg, torch.float16).token_bytes // cfg.num_hidden_layers
        streamed = cfg.num_hidden_layers - 1
        assert st["fills_late"] == 0                         # every layer was filled ahead of its use
        assert st["h2d_bytes"] >= (NEW - 1) * streamed * PROMPT * per_token
        cache.close()
        torch.cuda.synchronize()
        assert cache.home_bytes == 0 and t.stats()["resident_bytes.all.current"] == 0 and not t.leases
        t.close()
    finally:
        del blob
        torch.cuda.empty_cache()


def test_weights_and_cache_in_one_budget_on_a_really_small_gpu():
    import torch

    import tiermem
    model, cfg = _model()
    ids = torch.randint(0, cfg.vocab_size, (1, 2048), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    gen = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)
    with torch.no_grad():
        want = model.generate(ids, **gen)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    model.cpu()
    gc.collect()
    budget = weights // 2 + 256 * MiB
    blob = _take_device(budget + 1024 * MiB)
    try:
        t = tiermem.Tier(0)
        h = t.wrap_module(model, budget=budget, kv_budget="auto", kv_tokens=2048 + 16)
        print(h.plan.table())
        assert h.plan.kv is not None and h.plan.budget + h.plan.kv_budget <= budget and h.plan.streamed_bytes > 0
        cache = h.kv_cache()
        with torch.no_grad():
            got = model.generate(ids, **{_kw(): cache}, **gen)
        assert torch.equal(got, want)
        assert t.stats()["resident_bytes.all.peak"] <= budget
        h.unwrap()                                           # closes the cache too
        assert cache.device_bytes == 0 and not t.leases
        t.close()
    finally:
        del blob
        torch.cuda.empty_cache()


def test_ctrl_c_in_the_middle_of_a_decode_leaves_a_cache_that_goes_on_to_the_same_tokens():
    import torch

    import tiermem
    from tiermem.cuda.backend import FaultInjector, inject_faults
    model, cfg = _model()
    ids = torch.randint(0, cfg.vocab_size, (1, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    gen = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    with torch.no_grad():
        want = model.generate(ids, **gen)
    from tiermem.planning import kv_shape
    layer = kv_shape(cfg, torch.float16).layer_bytes(1024 + 12)
    t = tiermem.Tier(0)
    gc.collect()
    torch.cuda.synchronize()
    free0, torch0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
    for n in (3, 17, 40, 150, 700):          # calls of a fill, an append, a wait..., the last in the third step
        cache = t.kv_cache(model, 1024 + 12, 3 * layer)
        with torch.no_grad():
            model(ids, **{_kw(): cache})                     # prefill
            nxt = want[:, 1024:1025]
            model(nxt, **{_kw(): cache})                     # one decode step: the ring turns
        inj = FaultInjector()
        inject_faults(inj)
        try:
            inj.fail_at(n, "interrupt")
            with torch.no_grad(), pytest.raises(KeyboardInterrupt):
                for i in range(1025, 1024 + 12):
                    model(want[:, i:i + 1], **{_kw(): cache})
        finally:
            inject_faults(None)
        have = cache.get_seq_length()
        assert 1025 <= have < 1024 + 12
        with torch.no_grad():                                # go on from what the cache holds
            got = model.generate(want[:, :have + 1], **{_kw(): cache}, **dict(gen, max_new_tokens=1024 + 12 - have - 1))
        assert torch.equal(got, want), n
        cache.close()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert not t.leases and t.stats()["resident_bytes.all.current"] == 0
    t.close()                                                # once closed, the device has its memory back
    torch.cuda.synchronize()
    # What the device lacks now is torch's own (the interrupted forwards' tracebacks keep tensors
    # of transformers' alive: 1 GB on an H200), not tiermem's
    torch_grew = torch.cuda.memory_reserved() - torch0
    assert abs(free0 - torch.cuda.mem_get_info()[0] - torch_grew) <= 8 * MiB, torch_grew
