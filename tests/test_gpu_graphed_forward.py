"""GPU tests of graphed offloaded forwards (NOTE [graphed forwards] in tiermem/inference/graphed.py):
a transformers model streamed on a really small GPU, in fp16 and packed, captured once and
replayed, its logits those of its eager forwards bit for bit; shapes that change, eager forwards
between replays, a forward a capture refuses, and unwrap."""
from __future__ import annotations

import pytest
from helpers import share

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def _model(arch: str):
    import torch
    tf = pytest.importorskip("transformers")
    common = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=6, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=16384, max_position_embeddings=512)
    cfg = (tf.Qwen2Config(**common, tie_word_embeddings=False) if arch == "qwen2"
           else tf.LlamaConfig(**common, tie_word_embeddings=False))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(cfg).half().eval()    # requires_grad=True, as users get it
    return model, cfg


@pytest.mark.parametrize("fmt", [None, "int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_streamed_forward_is_captured_once_and_replays_its_eager_logits_on_a_really_small_gpu(arch, fmt):
    import gc

    import torch
    from test_gpu_module import _take_device

    import tiermem
    model, cfg = _model(arch)
    ids = torch.randint(0, cfg.vocab_size, (1, 128), device="cuda")
    with torch.no_grad():
        resident = model(ids, use_cache=False).logits
    model.cpu()
    gc.collect()
    torch.cuda.empty_cache()
    budget = share(model, 25)
    blob = _take_device(budget + 256 * MiB)
    try:
        t = tiermem.Tier(0)                               # the default cap: the memory free now
        free = torch.cuda.mem_get_info()[0]
        h = t.wrap_module(model, budget=budget, stream_dtype=fmt, max_group_bytes=8 * MiB)
        with torch.no_grad():
            model(ids, use_cache=False)
            eager = model(ids, use_cache=False).logits
        fwd = h.graphed(lambda x: model(x, use_cache=False).logits)
        assert fwd.off == "", fwd.off
        outs = [fwd(ids) for _ in range(5)]
        assert fwd.captures == 1 and fwd.replays == 4, fwd
        for o in outs:
            assert torch.equal(o, eager)
        if fmt is None:
            assert torch.equal(eager, resident)
        # The replays move what the eager forwards move, counted once a replay.
        h.drain()
        before = t.stats()["moved_bytes.all.h2d"]
        fwd(ids)
        h.drain()
        assert t.stats()["moved_bytes.all.h2d"] - before == h.moved_bytes
        # An eager forward between replays, and a replay after it: the slots are what each expects.
        with torch.no_grad():
            assert torch.equal(model(ids, use_cache=False).logits, eager)
        other = torch.randint(0, cfg.vocab_size, (1, 128), device="cuda")
        with torch.no_grad():
            want_other = model(other, use_cache=False).logits
        assert torch.equal(fwd(other), want_other) and fwd.replays == 6
        # Other shapes drop the graph; they are captured in turn once they have settled.
        short = ids[:, :32]
        with torch.no_grad():
            want_short = model(short, use_cache=False).logits
        for _ in range(3):
            assert torch.equal(fwd(short), want_short)
        assert fwd.drops == ["the inputs' shapes changed"] and fwd.captures == 2
        assert t.stats()["resident_bytes.all.peak"] <= h.budget
        assert t.backend.guard.reserved <= free
        h.unwrap()
        assert fwd.graph is None and fwd.drops[-1] == "the module was unwrapped"
        with pytest.raises(tiermem.TierMemError, match="unwrapped"):
            fwd(ids)
        t.close()
    finally:
        del blob
        torch.cuda.empty_cache()
    if fmt is None:
        with torch.no_grad():
            assert torch.equal(model.cuda()(ids, use_cache=False).logits, resident)


def test_a_forward_a_capture_refuses_stays_eager_and_leaves_torch_usable():
    import torch

    import tiermem
    model, cfg = _model("llama")
    t = tiermem.Tier(0, cap="2GiB")
    h = t.wrap_module(model, budget=share(model, 25), max_group_bytes=8 * MiB)
    ids = torch.randint(0, cfg.vocab_size, (1, 64), device="cuda")

    def synced(x):
        logits = model(x, use_cache=False).logits
        if logits.isnan().any():          # a host sync: CUDA refuses it in a capture
            raise AssertionError("nan")
        return logits
    fwd = h.graphed(synced)
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    outs = [fwd(ids) for _ in range(4)]
    assert fwd.captures == 0 and fwd.off.startswith("the capture failed"), fwd.off
    assert all(torch.equal(o, want) for o in outs)
    # torch as it was: a new model is built and seeded on the device (its generator is usable).
    torch.manual_seed(1)
    x = torch.randn(4, 4, device="cuda")
    torch.manual_seed(1)
    assert torch.equal(torch.randn(4, 4, device="cuda"), x)
    torch.nn.Linear(64, 64, device="cuda")          # a new model's init: normal_ and uniform_ on the device
    h.unwrap()
    t.close()


@pytest.mark.parametrize("fmt", [None, "int4"])
def test_decode_steps_over_a_static_cache_are_captured_and_give_the_eager_steps_tokens(fmt):
    """A decode step of one token reads the streamed weights as a decode does (NOTE [experts by
    expert]'s modes), and its cache is transformers' StaticCache, whose tensors keep their
    addresses: the steps are captured once and replayed, their tokens the eager steps'."""
    import inspect

    import torch
    from transformers import StaticCache

    import tiermem
    model, cfg = _model("llama")
    t = tiermem.Tier(0, cap="2GiB")
    h = t.wrap_module(model, budget=share(model, 25), stream_dtype=fmt, max_group_bytes=8 * MiB)
    ids = torch.randint(0, cfg.vocab_size, (1, 32), device="cuda")
    takes_cache_position = "cache_position" in inspect.signature(model.base_model.forward).parameters

    def decode(graphed: bool, steps: int = 12):
        cache = StaticCache(config=model.config, max_cache_len=64)

        def step(tok, pos):
            extra = {"cache_position": pos} if takes_cache_position else {}
            return model(tok, position_ids=pos[None], past_key_values=cache, use_cache=True, **extra).logits
        fn = h.graphed(step) if graphed else step
        with torch.no_grad():
            tok = step(ids, torch.arange(32, device="cuda"))[:, -1:].argmax(-1)
            pos = torch.tensor([32], device="cuda")
            out = []
            for _ in range(steps):
                tok = fn(tok, pos)[:, -1:].argmax(-1)
                pos = pos + 1
                out.append(tok)
        return torch.cat(out, 1), fn
    want, _ = decode(False)
    got, fn = decode(True)
    assert fn.off == "" and fn.captures == 1 and fn.replays == 12 - 1, fn
    assert torch.equal(got, want)
    fn.close()
    h.unwrap()
    t.close()
