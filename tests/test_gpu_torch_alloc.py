"""GPU tests of torch's allocations in managed memory (tiermem.pytorch.allocator): pointer types,
advice per role, a training step whose backward allocates managed gradients, tensors that
outlive the block, the cap, nesting and threads, and one CUDA runtime per process.

Safety (docs/facts.md): the allocator's cap is 1 GiB for this module, and each test asks for
a few MiB."""
from __future__ import annotations

import copy
import gc
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def small_cap():
    from tiermem.pytorch import allocator as ta
    ta.set_torch_managed_cap("1GiB")
    yield
    ta.set_torch_managed_cap("1GiB")


def _kind(t):
    from tiermem.cuda import runtime as _cuda
    return _cuda.pointer_kind(t.data_ptr())


def _segment_of(t):
    from tiermem.pytorch import allocator as ta
    p = t.data_ptr()
    hits = [s for s in ta.torch_managed_allocations() if s.ptr <= p < s.ptr + s.nbytes]
    assert len(hits) == 1, hits
    return hits[0]


def test_inside_is_managed_and_outside_is_not():
    import torch

    from tiermem import Role
    from tiermem.pytorch.allocator import is_managed, torch_allocations
    before = torch.ones(MiB, device="cuda")
    with torch_allocations("activation") as block:
        x = torch.ones(MiB, device="cuda")
        small = torch.ones(16, device="cuda")
    after = torch.ones(MiB, device="cuda")
    assert (block.role, block.device) == (Role.ACTIVATION, torch.cuda.current_device())
    assert [_kind(t) for t in (before, x, small, after)] == ["device", "managed", "managed", "device"]
    assert [is_managed(t) for t in (before, x, small, after)] == [False, True, True, False]
    assert _segment_of(x).role is Role.ACTIVATION


@pytest.mark.parametrize("role", ["weight", "frozen_weight", "activation", "gradient", "optimizer_state", "input", "workspace"])
def test_each_role_advice_reads_back(role):
    import torch

    from tiermem import Location, Role
    from tiermem.cuda import runtime as _cuda
    from tiermem.pytorch.allocator import torch_allocations
    from tiermem.roles import DEFAULT_POLICIES
    pol = DEFAULT_POLICIES[Role(role)]
    with torch_allocations(role) as block:
        t = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    info = _cuda.range_info(t.data_ptr(), t.numel())
    assert info.read_mostly == pol.read_mostly
    assert info.preferred_location == pol.preferred_location
    assert (Location.DEVICE in info.accessed_by) == pol.accessed_by_device
    assert (Location.HOST in info.accessed_by) == pol.accessed_by_host
    assert block.prefetch == (pol.preferred_location is not Location.HOST)
    assert info.last_prefetch == (Location.DEVICE if block.prefetch else None)
    assert _segment_of(t).role is Role(role)


def test_a_custom_policy_and_no_prefetch():
    import torch

    from tiermem import Location, Policy
    from tiermem.cuda import runtime as _cuda
    from tiermem.pytorch.allocator import torch_allocations
    pol = Policy("host", read_mostly=True, accessed_by_device=True, accessed_by_host=True)
    with torch_allocations("input", policy=pol, prefetch=False):
        t = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    info = _cuda.range_info(t.data_ptr(), t.numel())
    assert (info.preferred_location, info.read_mostly, info.last_prefetch) == (Location.HOST, True, None)
    assert set(info.accessed_by) == {Location.DEVICE, Location.HOST}


def test_a_training_step_is_managed_backward_included():
    import torch
    import torch.nn.functional as F

    from tiermem.pytorch.allocator import is_managed, torch_allocations
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
    ref = copy.deepcopy(model)
    x = torch.randn(64, 256, device="cuda")
    y = torch.randint(0, 10, (64,), device="cuda")

    def step(m):
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        loss = F.cross_entropy(m(x), y)
        loss.backward()                   # runs on autograd's device thread
        opt.step()
        return loss, opt

    with torch_allocations("activation"):
        loss, opt = step(model)
    ref_loss, _ = step(ref)

    assert is_managed(loss)
    assert not any(is_managed(p) for p in model.parameters())       # made before the block
    assert all(is_managed(p.grad) for p in model.parameters())      # made by the backward
    assert all(is_managed(s[k]) for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    torch.testing.assert_close(loss, ref_loss)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(p.grad, q.grad)


def test_tensors_outlive_the_block_and_their_segments_are_reused():
    import torch

    from tiermem.pytorch.allocator import is_managed, torch_allocations, torch_allocator_stats
    with torch_allocations("workspace"):
        a = torch.arange(MiB, device="cuda", dtype=torch.float32)
    filler = torch.full((4 * MiB,), 7.0, device="cuda")       # outside: must not reuse a's memory
    gc.collect()
    torch.cuda.empty_cache()
    assert is_managed(a) and not is_managed(filler)
    assert torch.equal(a * 2, torch.arange(MiB, device="cuda", dtype=torch.float32) * 2)
    del a
    before = torch_allocator_stats()
    with torch_allocations("workspace"):
        b = torch.empty(MiB, device="cuda", dtype=torch.float32)
    after = torch_allocator_stats()
    assert is_managed(b)
    assert after.allocations == before.allocations               # a cached block of the pool again


def test_the_cap_refuses_and_torch_raises_out_of_memory():
    import torch

    from tiermem.pytorch.allocator import is_managed, set_torch_managed_cap, torch_allocations, torch_allocator_stats
    before = torch_allocator_stats()
    set_torch_managed_cap(before.live_bytes + 32 * MiB)
    try:
        with torch_allocations("gradient", prefetch=False):
            with pytest.raises(torch.OutOfMemoryError):
                torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
            ok = torch.ones(3 * MiB, dtype=torch.uint8, device="cuda")      # a 20 MiB segment fits
        mid = torch_allocator_stats()
        assert mid.refused > before.refused
        assert mid.live_bytes <= mid.cap_bytes == before.live_bytes + 32 * MiB
        assert is_managed(ok) and int(ok.sum()) == 3 * MiB
        assert torch.ones(8, device="cuda").sum().item() == 8      # CUDA is fine after the refusal
    finally:
        set_torch_managed_cap("1GiB")
    assert torch_allocator_stats().cap_bytes == 1 << 30


def test_nesting_restores_the_outer_role_then_nothing():
    import torch

    from tiermem import Location, Role
    from tiermem.cuda import runtime as _cuda
    from tiermem.pytorch.allocator import is_managed, torch_allocations
    with torch_allocations("activation"):
        with torch_allocations("optimizer_state"):
            inner = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
            with torch_allocations("optimizer_state"):      # the same pool again: shared, no error
                same = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        outer = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    plain = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    # optimizer_state's advice is accessed-by device (NOTE [default policies]); activation has none
    assert Location.DEVICE in _cuda.range_info(inner.data_ptr(), inner.numel()).accessed_by
    assert Location.DEVICE in _cuda.range_info(same.data_ptr(), same.numel()).accessed_by
    assert Location.DEVICE not in _cuda.range_info(outer.data_ptr(), outer.numel()).accessed_by
    assert [_segment_of(t).role for t in (inner, same, outer)] == [Role.OPTIMIZER_STATE] * 2 + [Role.ACTIVATION]
    assert not is_managed(plain)


def test_routing_is_process_wide_and_blocks_may_close_out_of_order():
    import torch

    from tiermem.pytorch.allocator import is_managed, torch_allocations
    got = {}
    entered, release = threading.Event(), threading.Event()

    def other():
        got["other"] = torch.empty(MiB, device="cuda")      # no block in this thread
        with torch_allocations("input"):
            entered.set()
            release.wait(30)

    with torch_allocations("activation"):
        th = threading.Thread(target=other)
        th.start()
        assert entered.wait(30)
    # The main thread's block closed first; the other thread's block still routes.
    mid = torch.empty(MiB, device="cuda")
    release.set()
    th.join(30)
    end = torch.empty(MiB, device="cuda")
    assert is_managed(got["other"]) and is_managed(mid) and not is_managed(end)


_MAPS = textwrap.dedent("""
    import json, os, torch
    torch.cuda.init()
    from tiermem.pytorch.allocator import is_managed, torch_allocations
    with torch_allocations("activation"):
        t = torch.ones(16, device="cuda")
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            if "libcudart" in line:
                paths.add(os.path.realpath(line.split()[-1]))
    print(json.dumps({"managed": is_managed(t), "cudart": sorted(paths)}))
""")


def test_one_cuda_runtime_in_the_process():
    env = dict(os.environ, TIERMEM_MANAGED_CAP="64MiB")
    proc = subprocess.run([sys.executable, "-c", _MAPS], capture_output=True, text=True, timeout=120, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print("libcudart mapped:", out["cudart"])
    assert out["managed"] is True
    assert len(out["cudart"]) == 1, out["cudart"]


def test_stats_and_registry_agree():
    import torch

    from tiermem.pytorch.allocator import torch_allocations, torch_allocator_stats, torch_managed_allocations
    with torch_allocations("weight"):
        keep = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
    s = torch_allocator_stats()
    segs = torch_managed_allocations()
    assert s.live_allocations == len(segs) > 0
    assert s.live_bytes == sum(x.nbytes for x in segs)
    assert s.peak_bytes >= s.live_bytes and s.allocations - s.frees == s.live_allocations
    assert s.failed == 0 and s.hints_failed == 0
    assert any(x.ptr <= keep.data_ptr() < x.ptr + x.nbytes for x in segs)
