"""GPU tests of the core: real advice, views, modules, round trips, the CuPy allocator, the cap,
threads. Every Tier here caps managed memory at a few GiB (docs/facts.md safety rule)."""
from __future__ import annotations

import copy
import gc
import io
import random
import threading

import pytest

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture(scope="module")
def gtier():
    import tiermem
    t = tiermem.Tier(0, cap="3GiB")
    yield t
    t.close()


def _rand_bytes(n):
    import torch
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")


@pytest.mark.parametrize("role", ["weight", "frozen_weight", "activation", "gradient", "optimizer_state", "input", "workspace"])
def test_advice_is_applied_and_reads_back(gtier, role):
    from tiermem import Location, Role
    from tiermem.roles import DEFAULT_POLICIES
    t = gtier.empty(4 * MiB, "uint8", role=role)
    pol = DEFAULT_POLICIES[Role(role)]
    info = t.range_info()
    assert info.read_mostly == pol.read_mostly
    assert info.preferred_location == pol.preferred_location
    assert (Location.DEVICE in info.accessed_by) == pol.accessed_by_device
    assert (Location.HOST in info.accessed_by) == pol.accessed_by_host
    t.advise(read_mostly=not pol.read_mostly, preferred_location="host", accessed_by_host=True)
    info = t.range_info()
    assert info.read_mostly == (not pol.read_mostly)
    assert info.preferred_location is Location.HOST
    assert Location.HOST in info.accessed_by


def test_last_prefetch_location_follows_moves(gtier):
    from tiermem import Location
    t = gtier.empty(4 * MiB, "uint8", role="activation")
    t.prefetch()
    assert t.range_info().last_prefetch is Location.DEVICE
    view = t.torch()          # a live foreign view: eviction must go through Unified Memory
    t.evict().synchronize()
    assert t.range_info().last_prefetch is Location.HOST
    assert gtier.stats()["ops.activation.evict_um"] >= 1
    del view


def test_views_are_zero_copy_both_ways(gtier):
    import cupy
    import torch

    from tiermem.cuda import runtime as _cuda
    t = gtier.empty((512, 256), "float32", role="activation")
    tv, cv = t.torch(), t.cupy()
    assert tv.data_ptr() == cv.data.ptr == t.data_ptr
    assert tv.device == torch.device("cuda", 0) and tv.shape == (512, 256) and tv.dtype == torch.float32
    assert _cuda.pointer_kind(t.data_ptr) == "managed"
    tv.copy_(torch.randn(512, 256, device="cuda"))
    torch.cuda.synchronize()
    assert cupy.array_equal(cv, cupy.asarray(tv))
    cv *= 2
    cupy.cuda.get_current_stream().synchronize()
    assert torch.equal(tv, torch.as_tensor(cv, device="cuda"))
    dt, dc = torch.from_dlpack(t), cupy.from_dlpack(t)
    assert dt.data_ptr() == dc.data.ptr == t.data_ptr
    dt.add_(1)
    torch.cuda.synchronize()
    assert cupy.array_equal(dc, cupy.asarray(tv))


def test_dlpack_keeps_memory_until_consumer_releases(gtier):
    import torch
    t = gtier.empty((256, 1024), "float32", role="workspace")
    t.torch().copy_(torch.randn(256, 1024, device="cuda"))
    before = gtier.stats()["allocated_bytes.workspace.current"]
    consumer = torch.from_dlpack(t)
    ref = consumer.clone()
    t.free()
    del t
    gc.collect()
    assert gtier.stats()["allocated_bytes.workspace.current"] == before  # still held by the consumer
    assert torch.equal(consumer, ref)
    del consumer
    gc.collect()
    assert gtier.stats()["allocated_bytes.workspace.current"] == before - 256 * 1024 * 4


def _mlp():
    import torch.nn as nn
    return nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.LayerNorm(1024), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 256)).cuda()


def test_wrapped_mlp_is_bitwise_equal_with_equal_grads(gtier):
    import torch
    torch.manual_seed(0)
    model = _mlp()
    ref = copy.deepcopy(model)
    params = list(model.parameters())
    tts = [gtier.wrap(p, role="weight") for p in params]
    assert [p is q for p, q in zip(params, model.parameters())] == [True] * len(params)
    assert all(p.requires_grad for p in model.parameters())
    x = torch.randn(64, 512, device="cuda")
    out, out_ref = model(x), ref(x)
    assert torch.equal(out, out_ref)
    out.square().mean().backward()
    out_ref.square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    # Evict everything (the 4 MiB weight goes through the pinned shadow), run, bring back, run.
    gtier.evict(tts).synchronize()
    assert torch.equal(model(x), out_ref)
    gtier.prefetch(tts).synchronize()
    assert torch.equal(model(x), out_ref)
    assert gtier.stats()["ops.weight.evict"] >= len(tts)


def test_wrapped_transformers_model_is_bitwise_equal(gtier):
    import torch
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=2048, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).cuda()
    ref = copy.deepcopy(model)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        for _, p in model.named_parameters():
            gtier.wrap(p, role="weight")
        for _, b in model.named_buffers():
            gtier.wrap(b, role="weight")   # a buffer needs no grad: tiered as frozen_weight
        ids = torch.randint(0, cfg.vocab_size, (2, 64), device="cuda")
        out, out_ref = model(ids, labels=ids), ref(ids, labels=ids)
        assert torch.equal(out.logits, out_ref.logits)
        out.loss.backward()
        out_ref.loss.backward()
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert torch.equal(p.grad, q.grad), n
        assert gtier.stats()["allocation_count.weight.current"] >= len(list(model.parameters()))
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("nbytes", [4096, 3 * MiB, 64 * MiB + 1234])
@pytest.mark.parametrize("keep_view", [False, True], ids=["fast-path", "um-path"])
def test_random_data_survives_round_trips(gtier, nbytes, keep_view):
    import torch
    t = gtier.empty(nbytes, "uint8", role="activation")
    before = gtier.stats()
    for cycle in range(3):
        ref = _rand_bytes(nbytes)
        view = t.torch()
        view.copy_(ref)
        if not keep_view:
            del view          # no foreign view: the shadow path is allowed for buffers >= 2 MiB
        t.evict().synchronize()
        assert not t.is_resident
        t.prefetch().synchronize()
        assert torch.equal(t.torch(), ref), f"cycle {cycle}"
        if keep_view:
            assert torch.equal(view, ref)
            del view
    s = gtier.stats()
    assert s["moved_bytes.activation.d2h"] - before["moved_bytes.activation.d2h"] == 3 * nbytes
    um = s["ops.activation.evict_um"] - before["ops.activation.evict_um"]
    assert um == (3 if keep_view or nbytes < 2 * MiB else 0)


def test_read_mostly_clean_eviction_moves_nothing(gtier):
    import torch
    t = gtier.empty(64 * MiB, "uint8", role="activation", read_only=True, read_mostly=True,
                    preferred_location="host", accessed_by_device=True)
    ref = _rand_bytes(64 * MiB)
    t.prefetch()
    t.torch().copy_(ref)
    gc.collect()
    gtier.evict([t], _path="um").synchronize()    # its host pages now hold the data
    for cycle in range(3):
        t.prefetch().synchronize()
        assert torch.equal(t.torch(writable=False), ref)
        gc.collect()
        before = gtier.stats()
        tr = t.evict()
        tr.synchronize()
        s = gtier.stats()
        assert tr.nbytes == 0
        assert s["moved_bytes.activation.d2h"] == before["moved_bytes.activation.d2h"]
        assert s["ops.activation.evict_clean"] == before["ops.activation.evict_clean"] + 1
        assert torch.equal(t.torch(writable=False), ref), f"cycle {cycle}"   # read in place from the host


def test_shadow_clean_eviction_moves_nothing(gtier):
    import torch
    # input is read-only: its shadow stays valid (not read-mostly here: that evicts by collapse)
    t = gtier.empty(32 * MiB, "uint8", role="input", read_mostly=False)
    ref = _rand_bytes(32 * MiB)
    t.prefetch()
    t.torch().copy_(ref)
    gc.collect()
    first = t.evict()
    first.synchronize()
    assert first.nbytes == 32 * MiB and t.in_shadow
    for _ in range(2):
        t.prefetch().synchronize()
        assert torch.equal(t.torch(writable=False), ref)
        gc.collect()
        tr = t.evict()
        tr.synchronize()
        assert tr.nbytes == 0 and t.in_shadow


def test_cupy_allocator_arrays_are_managed_and_counted(gtier):
    import cupy

    import tiermem
    from tiermem.cuda import runtime as _cuda
    before = gtier.stats()
    with cupy.cuda.using_allocator(tiermem.allocator(tier=gtier)):
        with tiermem.arrays.using_role("input"):
            a = cupy.random.random(1 << 20)           # 8 MiB: the large pool
            b = cupy.arange(1000, dtype=cupy.int32)    # 4 KB: the small pool
    assert _cuda.pointer_kind(a.data.ptr) == "managed" and _cuda.pointer_kind(b.data.ptr) == "managed"
    s = gtier.stats()
    assert s["allocated_bytes.input.current"] - before["allocated_bytes.input.current"] == a.nbytes + b.nbytes
    assert s["allocation_count.input.current"] - before["allocation_count.input.current"] == 2
    assert float(a.sum()) > 0 and int(b[-1]) == 999
    del a, b
    gc.collect()
    assert gtier.stats()["allocated_bytes.input.current"] == before["allocated_bytes.input.current"]
    prev = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(tiermem.allocator("gradient", tier=gtier))
    try:
        c = cupy.ones(300_000, dtype=cupy.float32)
        assert _cuda.pointer_kind(c.data.ptr) == "managed"
        assert gtier.stats()["allocation_count.gradient.current"] >= 1
    finally:
        cupy.cuda.set_allocator(prev)
    del c


def test_cap_is_enforced_and_pool_caches_give_way():
    import tiermem
    t = tiermem.Tier(0, cap="64MiB")
    a = t.empty(48 * MiB, "uint8", role="activation")
    with pytest.raises(tiermem.errors.CapExceededError) as e:
        t.empty(32 * MiB, "uint8", role="weight")
    assert isinstance(e.value, MemoryError) and e.value.limit == 64 * MiB
    assert "allow_oversubscribe" in str(e.value)
    assert t.stats()["managed.refused_count"] >= 1
    a.free()
    del a
    gc.collect()
    b = t.empty(32 * MiB, "uint8", role="weight")   # the activation pool's cached 48 MiB is released
    assert t.stats()["managed.reserved_bytes.current"] <= 64 * MiB
    del b
    with pytest.raises(tiermem.TierMemError, match="ALLOW_OVERSUBSCRIBE"):
        tiermem.Tier(0, cap="100TiB")


def test_threads_lose_no_bytes():
    import torch

    import tiermem
    t = tiermem.Tier(0, cap="2GiB")
    roles = ["activation", "gradient", "workspace", "input", "weight"]
    errors = []

    def work(seed):
        rng = random.Random(seed)
        held = []
        try:
            for _ in range(150):
                if held and rng.random() < 0.45:
                    held.pop(rng.randrange(len(held))).free()
                else:
                    n = rng.choice([1000, 4096, 100_000, 2 * MiB, 3 * MiB + 5])
                    x = t.empty(n, "uint8", role=rng.choice(roles))
                    x.torch().fill_(rng.randrange(1, 255))
                    held.append(x)
            for x in held:
                x.free()
        except Exception as e:  # reported below: a thread's exception would otherwise vanish
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    torch.cuda.synchronize()
    gc.collect()
    assert errors == []
    s = t.stats()
    assert s["allocated_bytes.all.current"] == 0 and s["allocation_count.all.current"] == 0
    assert s["allocated_bytes.all.total"] == s["allocated_bytes.all.freed"]
    assert s["allocation_count.all.total"] == s["allocation_count.all.freed"] > 500
    assert s["resident_bytes.all.current"] == 0
    assert s["managed.reserved_bytes.peak"] <= 2 << 30


def test_budget_holds_and_data_survives():
    import torch

    import tiermem
    t = tiermem.Tier(0, cap="1GiB", budget="64MiB")
    ts = [t.empty(16 * MiB, "uint8", role="activation") for _ in range(8)]
    refs = []
    for x in ts:
        r = _rand_bytes(16 * MiB)
        x.prefetch()
        x.torch().copy_(r)
        refs.append(r)
        assert t.resident_bytes <= 64 * MiB
    rng = random.Random(1)
    for _ in range(40):
        i = rng.randrange(len(ts))
        ts[i].prefetch()
        assert t.resident_bytes <= 64 * MiB
        assert torch.equal(ts[i].torch(), refs[i])
    s = t.stats()
    assert s["resident_bytes.all.peak"] <= 64 * MiB
    assert s["ops.activation.evict_budget"] > 0


def test_unwrap_restores_plain_device_memory(gtier):
    import torch

    import tiermem
    from tiermem.cuda import runtime as _cuda
    lin = torch.nn.Linear(1024, 1024).cuda()
    ref = lin.weight.detach().clone()
    gtier.wrap(lin.weight)
    assert _cuda.pointer_kind(lin.weight.data_ptr()) == "managed"
    gtier.unwrap(lin.weight)
    assert _cuda.pointer_kind(lin.weight.data_ptr()) == "device"
    assert torch.equal(lin.weight, ref) and tiermem.tiered_of(lin.weight) is None


def test_info_reports_the_device():
    from tiermem.cli.main import info
    out = io.StringIO()
    assert info(out) == 0
    text = out.getvalue()
    assert "concurrent_managed_access" in text and "device 0:" in text and "managed cap" in text


def test_a_large_unpooled_host_block_is_registered_pinned_memory_the_gpu_reads_in_place(gtier):
    """NOTE [pinned by registration]: pinned, mapped at its host address, read and written by the
    GPU in place and by copies at its address, and unpinned when released."""
    import ctypes

    import torch

    from tiermem.cuda import runtime as _cuda
    be = gtier.backend
    n = 80 * MiB
    b = be.host_alloc(n, pooled=False)
    assert _cuda.pointer_kind(b.ptr) == "host"
    src = _rand_bytes(n)
    view = be.torch_view(b.ptr, n, b)          # the GPU's view of the host pages, zero-copy
    view.copy_(src)
    torch.cuda.synchronize()
    host = (ctypes.c_ubyte * n).from_address(b.ptr)
    assert bytes(host[n - 4096:]) == bytes(src[n - 4096:].cpu().numpy())
    back = torch.empty(n, dtype=torch.uint8, device="cuda")
    be.copy(back.data_ptr(), b.ptr, n, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    small = be.host_alloc(MiB, pooled=False)   # small blocks keep the pool
    assert _cuda.pointer_kind(small.ptr) == "host"
    small.release()
    ptr = b.ptr
    del view, host
    b.release()
    gc.collect()
    assert _cuda.pointer_kind(ptr) == "unregistered"


def test_a_pooled_events_new_record_leaves_earlier_waits_alone():
    """NOTE [pooled events]: a stream that waits on an event keeps waiting for that record after
    the event is dropped and its handle, taken again from the pool, is recorded elsewhere."""
    import torch

    from tiermem.cuda import runtime as rt
    a, b, c = (rt.stream_create(0) for _ in range(3))
    try:
        with torch.cuda.stream(torch.cuda.ExternalStream(a)):
            torch.cuda._sleep(400_000_000)          # a fifth of a second or so on stream a
        e = rt.event_create(False, 0)
        h = e.handle
        rt.event_record(e, a)
        rt.stream_wait_event(b, e)
        del e
        f = rt.event_create(False, 0)
        assert f.handle == h                         # the pooled handle
        rt.event_record(f, c)                        # c is idle: this record is done at once
        g = rt.event_create(False, 0)
        rt.event_record(g, b)                        # behind b's wait for a's sleep
        rt.event_synchronize(f)
        assert rt.event_query(f) and not rt.event_query(g)
        rt.event_synchronize(g)
        assert rt.event_query(g)
    finally:
        rt.device_synchronize()
        for s in (a, b, c):
            rt.stream_destroy(s)
