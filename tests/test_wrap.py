"""wrap / unwrap of torch tensors and parameters, DLPack export and the role scope, on the CPU
through the fake backend (its "device" memory is host memory, so torch sees CPU tensors)."""
from __future__ import annotations

import copy
import gc
import threading

import pytest
import torch
from helpers import MiB, fill_random
from torch import nn

import tiermem
from tiermem import Location, Role
from tiermem.errors import RoleError, WrapError


@pytest.fixture
def default(fake):
    """The fake-backed Tier as tiermem's default, so the module-level functions use it."""
    return tiermem.configure(backend=fake)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.LayerNorm(256), nn.Linear(256, 2048), nn.ReLU(),
                         nn.Linear(2048, 10))   # the 256x2048 weight is 2 MiB: it owns its pages


def test_wrapped_mlp_is_bitwise_the_same_model(default, fake):
    model = mlp()
    ref = copy.deepcopy(model)
    params = list(model.parameters())
    tts = [tiermem.wrap(p, role="weight") for p in params]
    assert list(model.parameters()) == params and all(a is b for a, b in zip(model.parameters(), params))
    assert [p.requires_grad for p in model.parameters()] == [True] * len(params)
    assert [tiermem.tiered_of(p) for p in params] == tts
    assert [p.data_ptr() for p in params] == [tt.data_ptr for tt in tts]
    assert [fake.pointer_kind(p.data_ptr()) for p in params] == ["managed"] * len(params)
    assert {tt.role for tt in tts} == {Role.WEIGHT}

    x = torch.randn(32, 64)
    out, expected = model(x), ref(x)
    assert torch.equal(out, expected)
    out.square().mean().backward()
    expected.square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert default.stats()["allocated_bytes.weight.current"] == sum(p.numel() * 4 for p in params)


def test_wrapped_mlp_trains_like_the_original(default):
    model = mlp()
    ref = copy.deepcopy(model)
    for p in model.parameters():
        tiermem.wrap(p)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    x = torch.randn(16, 64)
    for _ in range(3):
        for m, opt in zip((model, ref), opts):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(tiermem.tiered_of(p).torch(writable=False), q.detach())


@pytest.mark.parametrize("role", ["activation", "input"])
def test_wrapped_buffer_keeps_being_updated_in_place(tier, role):
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(16).train()
    ref = copy.deepcopy(bn)
    tt = tier.wrap(bn.running_mean, role=role)
    for _ in range(3):
        x = torch.randn(8, 16) * 3 + 1
        bn(x)
        ref(x)
    assert not torch.equal(ref.running_mean, torch.zeros(16))
    assert torch.equal(bn.running_mean, ref.running_mean)
    assert bn.running_mean.data_ptr() == tt.data_ptr
    assert torch.equal(tt.torch(writable=False), ref.running_mean)


def test_frozen_parameter_becomes_frozen_weight(tier, fake):
    lin = nn.Linear(1024, 512).requires_grad_(False)
    expected = lin.weight.clone()
    tt = tier.wrap(lin.weight)                  # default role "weight"
    assert (tt.role, tt.policy) == (Role.FROZEN_WEIGHT, tiermem.roles.DEFAULT_POLICIES[Role.FROZEN_WEIGHT])
    assert lin.weight.requires_grad is False
    # Host-preferred and read-mostly: it leaves the device once filled, and stays readable in place.
    info = tt.range_info()
    assert (tt.location, info.read_mostly, info.preferred_location) == (Location.HOST, True, Location.HOST)
    assert torch.equal(lin.weight, expected)
    trained = tier.wrap(nn.Linear(4, 4).weight)
    assert trained.role is Role.WEIGHT


def test_wrapping_twice_is_refused_and_changes_nothing(tier, fake):
    p = nn.Parameter(torch.randn(100, 100))
    tt = tier.wrap(p)
    ptr, n_calls, before = p.data_ptr(), len(fake.calls), tier.stats()
    with pytest.raises(WrapError, match="already wrapped"):
        tier.wrap(p, role="activation")
    assert (p.data_ptr(), tiermem.tiered_of(p), tt.role) == (ptr, tt, Role.WEIGHT)
    assert fake.calls[n_calls:] == []
    assert tier.stats() == before


def test_unknown_role_is_refused_and_changes_nothing(tier, fake):
    p = nn.Parameter(torch.randn(10))
    ptr = p.data_ptr()
    with pytest.raises(RoleError, match="unknown role 'weights'"):
        tier.wrap(p, role="weights")
    assert (p.data_ptr(), tiermem.tiered_of(p), fake.calls) == (ptr, None, [])


@pytest.mark.parametrize("make, pattern", [
    (lambda: torch.randn(4, 4).to_sparse(), "sparse"),
    (lambda: torch.empty(4, device="meta"), "meta tensor"),
    (lambda: torch.randn(4, 6).t(), r"non-contiguous tensor \(strides \(1, 6\)\)"),
    (lambda: [1.0, 2.0], "takes a torch.Tensor"),
])
def test_tensors_that_cannot_be_wrapped(tier, fake, make, pattern):
    with pytest.raises(WrapError, match=pattern):
        tier.wrap(make())
    assert fake.calls == []
    assert tier.stats()["allocation_count.all.total"] == 0


def test_a_view_of_tiered_memory_cannot_be_wrapped(tier, fake):
    tt = tier.empty(1000, role="activation")
    n_calls = len(fake.calls)
    with pytest.raises(WrapError, match="view of tiered memory"):
        tier.wrap(tt.torch())
    with pytest.raises(WrapError, match="view of tiered memory"):
        tier.wrap(tt.torch()[10:20])             # an interior address is tiered memory too
    assert fake.calls[n_calls:] == []


def test_unwrap_restores_plain_memory(default, fake):
    p = nn.Parameter(torch.randn(512, 1024))   # 2 MiB
    expected = p.detach().clone()
    tt = tiermem.wrap(p)
    with torch.no_grad():
        p.mul_(2)                                # a change made while tiered survives the unwrap
    out = tiermem.unwrap(p)
    assert out is p
    assert (p.device, p.requires_grad, tiermem.tiered_of(p), tt.freed) == (torch.device("cpu"), True, None, True)
    assert fake.pointer_kind(p.data_ptr()) == "unregistered"
    assert torch.equal(p, expected * 2)
    gc.collect()
    s = default.stats()
    assert (s["allocated_bytes.all.current"], s["allocation_count.all.freed"], fake.live_blocks) == (0, 1, 0)
    with pytest.raises(WrapError, match="not wrapped"):
        default.unwrap(p)
    tiermem.wrap(p)                              # and it can be wrapped again
    assert tiermem.tiered_of(p) is not None


def test_tensor_bigger_than_the_budget_fills_host_pages(fake):
    t = tiermem.Tier(backend=fake, budget=2 * MiB)
    x = torch.randn(1024, 1024)                  # 4 MiB
    expected = x.clone()
    tt = t.wrap(x, role="activation")
    assert (tt.location, t.resident_bytes) == (Location.HOST, 0)
    assert torch.equal(x, expected) and torch.equal(tt.torch(writable=False), expected)
    assert x.data_ptr() == tt.data_ptr


def test_tensor_bigger_than_the_budget_is_read_in_place(fake):
    # As Tier.empty does for a tensor that cannot fit: host-preferred and mapped for the device,
    # or the first device touch migrates pages that the budget never counted.
    t = tiermem.Tier(backend=fake, budget=2 * MiB)
    p = nn.Parameter(torch.randn(1024, 1024))
    tt = t.wrap(p)
    assert tt.location is Location.HOST
    info = tt.range_info()
    assert (info.preferred_location, info.accessed_by) == (Location.HOST, (Location.DEVICE,))
    assert (tt.policy.preferred_location, tt.policy.accessed_by_device) == (Location.HOST, True)


def test_from_dlpack_is_zero_copy_and_keeps_the_memory_alive(tier):
    tt = tier.empty((64, 64), "float32", role="activation")
    data = fill_random(tt)
    consumer = torch.from_dlpack(tt)
    assert consumer.data_ptr() == tt.data_ptr
    assert torch.equal(consumer, data)
    consumer[3, 5] = 42.0
    assert tt.torch(writable=False)[3, 5].item() == 42.0
    tt.free()
    del tt
    gc.collect()
    assert tier.stats()["allocated_bytes.activation.current"] == 64 * 64 * 4
    assert consumer[3, 5].item() == 42.0
    del consumer
    gc.collect()
    assert tier.stats()["allocated_bytes.activation.current"] == 0


def test_using_role_nests_restores_and_is_thread_local():
    assert tiermem.arrays.current_role() is None
    seen = []
    with tiermem.arrays.using_role("activation") as r:
        assert r is Role.ACTIVATION
        with tiermem.arrays.using_role(Role.INPUT):
            assert tiermem.arrays.current_role() is Role.INPUT
            th = threading.Thread(target=lambda: seen.append(tiermem.arrays.current_role()))
            th.start()
            th.join()
        assert tiermem.arrays.current_role() is Role.ACTIVATION
        with pytest.raises(ZeroDivisionError):
            with tiermem.arrays.using_role("gradient"):
                1 / 0
        assert tiermem.arrays.current_role() is Role.ACTIVATION
    assert tiermem.arrays.current_role() is None
    assert seen == [None]
    with pytest.raises(RoleError):
        with tiermem.arrays.using_role("nope"):
            pass
