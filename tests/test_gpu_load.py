"""GPU tests of load_pretrained and the disk tier: a small checkpoint saved by transformers, loaded
by tiermem (model on the meta device, tensors read from the files into their homes) and by
transformers itself; logits and tokens compared bit for bit, the disk tier's included."""
from __future__ import annotations

import pytest
from helpers import checkpoint_share

pytestmark = pytest.mark.gpu
MiB = 1 << 20


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A Qwen2-style fp16 checkpoint (GQA, qkv bias) in shards, and the model transformers loads."""
    import torch
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
                                   num_key_value_heads=2, vocab_size=8192, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float16)
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path, max_shard_size="20MB")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16).cuda().eval()
    ref.generation_config.pad_token_id = 0
    return path, ref, cfg


def _ids(cfg, n=48):
    import torch
    return torch.randint(0, cfg.vocab_size, (1, n), device="cuda", generator=torch.Generator("cuda").manual_seed(1))


@pytest.mark.parametrize("host_budget,reader", [(None, "posix"), (16 * MiB, "posix"), (16 * MiB, "kvikio")],
                         ids=["pinned_home", "disk_tier", "disk_tier_kvikio"])
def test_loaded_logits_and_tokens_equal_transformers(saved, host_budget, reader):
    import torch

    import tiermem
    if reader == "kvikio":
        pytest.importorskip("kvikio")
    path, ref, cfg = saved
    t = tiermem.Tier(0, cap="1GiB")
    model, h = tiermem.load_pretrained(path, budget=checkpoint_share(path, 30), host_budget=host_budget, tier=t,
                                       max_group_bytes=2 * MiB, disk_reader=reader)
    assert 0 < len(h.plan.pinned) < len(h.plan.sizes)
    assert bool(h.plan.on_disk) == (host_budget is not None)
    ids = _ids(cfg)
    with torch.no_grad():
        want = ref(ids).logits
        for _ in range(3):                     # learns the order, then reads ahead
            assert torch.equal(model(ids).logits, want)
    model.generation_config.pad_token_id = 0
    got = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, ref.generate(ids, max_new_tokens=12, do_sample=False))
    s = h.stats()
    if host_budget is not None:
        assert s["pinned_bytes.current"] <= host_budget and s["disk.read_bytes"] >= 3 * s["disk_bytes.per_forward"]
    h.drain()
    assert t.stats()["resident_bytes.all.peak"] <= h.budget
    h.unwrap()
    assert all(p.device.type == "cpu" for p in model.parameters())   # built on meta: restored onto the host
    t.close()


def test_a_bad_checkpoint_leaves_the_device_as_it_was(saved, tmp_path):
    import os
    import shutil

    import torch

    import tiermem
    path, _, _ = saved
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    f = sorted(bad.glob("*.safetensors"))[-1]
    os.truncate(f, os.path.getsize(f) - 4096)
    t = tiermem.Tier(0, cap="1GiB")
    torch.cuda.synchronize()
    free, stats = torch.cuda.mem_get_info()[0], t.stats()
    with pytest.raises(tiermem.errors.CheckpointError, match="truncated"):
        tiermem.load_pretrained(bad, budget=checkpoint_share(bad, 30), host_budget=16 * MiB, tier=t)
    torch.cuda.synchronize()
    assert t.stats() == stats and abs(torch.cuda.mem_get_info()[0] - free) <= 32 * MiB
    t.close()


def test_the_kvikio_reader_reads_what_the_posix_reader_reads(tmp_path):
    """Unaligned ranges, several at once, merged tensors' pieces; a short file is a clear error.
    kvikio's process-wide settings are raised while the reader lives and put back at close."""
    kvikio = pytest.importorskip("kvikio")
    import os

    import kvikio.defaults
    import torch

    from tiermem.errors import CheckpointError
    from tiermem.inference.kvikio import KvikioReader
    from tiermem.inference.load import FileTensor, Reader, host_bytes
    data = os.urandom(9 * MiB + 12345)
    f = tmp_path / "blob"
    f.write_bytes(data)
    ranges = [(1, 4 * MiB + 7), (4096, 3 * MiB), (5 * MiB + 3, 4 * MiB), (0, 1)]
    settings = ("num_threads", "auto_direct_io_read")
    before = {k: kvikio.defaults.get(k) for k in settings}
    threads = before["num_threads"] + 3
    kv = KvikioReader(threads=threads, chunk=1 * MiB, drop_cache=True)
    assert kvikio.defaults.get("num_threads") == threads and kvikio.defaults.get("auto_direct_io_read")
    for reader in (kv, Reader(threads=4, chunk=1 * MiB)):
        bufs = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for _, n in ranges]
        jobs = [(FileTensor("r", str(f), o, n, "uint8", (n,)), host_bytes(b.data_ptr(), n)) for (o, n), b in zip(ranges, bufs)]
        assert reader.read(jobs) == sum(n for _, n in ranges) == reader.bytes_read
        for (o, n), b in zip(ranges, bufs):
            assert bytes(b.numpy()) == data[o:o + n]
        short = FileTensor("r", str(f), len(data) - 100, 4096, "uint8", (4096,))
        b = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
        with pytest.raises(CheckpointError, match="truncated"):
            reader.read([(short, host_bytes(b.data_ptr(), 4096))])
        gone = FileTensor("r", str(tmp_path / "missing"), 0, 4096, "uint8", (4096,))
        with pytest.raises(CheckpointError, match="does not exist"):   # after a good range: waited for, then raised
            reader.read([jobs[0], (gone, host_bytes(b.data_ptr(), 4096))])
        reader.close()
    assert {k: kvikio.defaults.get(k) for k in settings} == before


def _half_the_weights(path) -> tuple[int, int]:
    """(device budget, host budget): a quarter and a half of the weights load_pretrained reads."""
    return checkpoint_share(path, 25), checkpoint_share(path, 50)


def test_a_tied_checkpoint_loads_within_half_its_weights_of_host_memory(tmp_path):
    """issue 57: load_pretrained refused every checkpoint with tied embeddings. A tied 67 MB table
    bigger than the device budget (61 MB), a host budget of half the weights: the table is one
    parameter, kept in the pinned home (the lookup reads it in place), layers on disk, and the
    tokens are those of transformers' own load."""
    import torch

    import tiermem
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(hidden_size=1024, intermediate_size=4096, num_hidden_layers=6, num_attention_heads=16,
                                   num_key_value_heads=2, vocab_size=32768, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float16).save_pretrained(tmp_path, max_shard_size="100MB")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float16).cuda().eval()
    ref.generation_config.pad_token_id = 0
    budget, host_budget = _half_the_weights(tmp_path)
    t = tiermem.Tier(0, cap="1GiB")
    model, h = tiermem.load_pretrained(tmp_path, budget=budget, host_budget=host_budget, tier=t)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert h.plan.on_disk and "model.embed_tokens" not in h.plan.on_disk and not h.plan.zero_copy_only
    ids = _ids(cfg)
    with torch.no_grad():
        want = ref(ids).logits
        for _ in range(3):
            got = model(ids).logits
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        if not h.plan.split:
            assert torch.equal(got, want)
    model.generation_config.pad_token_id = 0
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False),
                       ref.generate(ids, max_new_tokens=12, do_sample=False))
    s = h.stats()
    assert s["pinned_bytes.current"] <= host_budget and s["disk.read_bytes"] > 0
    h.drain()
    assert t.stats()["resident_bytes.all.peak"] <= h.budget
    h.unwrap()
    t.close()


def test_a_stacked_expert_moe_loads_from_disk_within_half_its_weights(tmp_path):
    """issue 57: a disk tier staged a whole layer's stacked experts per buffer ("3 staging buffers
    3,114,270,720"). A Qwen2-MoE checkpoint of 32 experts (100 MB of them per layer), saved one
    tensor per expert, loaded within a quarter of its weights on the device and half on the host:
    the experts stream from disk in parts, each staging buffer no bigger than a slot, and the
    tokens are those of transformers' own load."""
    import torch

    import tiermem
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2MoeConfig(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
                                      shared_expert_intermediate_size=2048, num_experts=32, num_experts_per_tok=4,
                                      num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                                      vocab_size=16384, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float16).save_pretrained(tmp_path, max_shard_size="200MB")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float16).cuda().eval()
    ref.generation_config.pad_token_id = 0
    budget, host_budget = _half_the_weights(tmp_path)
    layer = sum(p.numel() * 2 for p in ref.model.layers[0].mlp.experts.parameters())
    t = tiermem.Tier(0, cap="1GiB")
    model, h = tiermem.load_pretrained(tmp_path, budget=budget, host_budget=host_budget, tier=t)
    experts = [g for g in h._groups.values() if g.cut is not None and g.cut.kind == "experts"]
    assert experts and all(g.split for g in experts) and any(g.on_disk for g in experts), h.plan.table()
    assert h.plan.stage_bytes <= h.plan.slot < layer and h._stream.disk.stage_bytes < layer
    ids = _ids(cfg)
    with torch.no_grad():
        want = ref(ids).logits
        for _ in range(3):                     # learns the order, then reads ahead
            got = model(ids).logits
        # the experts' parts are summed part by part: equal to rounding, the same tokens
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    model.generation_config.pad_token_id = 0
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False),
                       ref.generate(ids, max_new_tokens=12, do_sample=False))
    s = h.stats()
    assert s["pinned_bytes.current"] <= host_budget and s["pinned_bytes.staging"] < 3 * layer
    h.drain()
    assert t.stats()["resident_bytes.all.peak"] <= h.budget
    h.unwrap()
    t.close()
