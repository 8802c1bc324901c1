"""Budget leases (NOTE [budget leases] in tiermem/core/leases.py): handles take a share of the tier's
budget and give it back; nothing a user configured is overwritten. On the fake backend."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
from helpers import share

import tiermem
from tiermem import OutOfBudgetError, TierMemError

MiB = 1 << 20


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)) for _ in range(6)])


def _weights(m: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def test_without_a_configured_budget_the_leases_make_the_budget(tier):
    assert (tier.budget, tier.configured_budget, tier.lease_room()) == (None, None, None)
    a = tier.lease(3 * MiB, "a")
    b = tier.lease(5 * MiB, "b")
    assert tier.budget == 8 * MiB and tier.leases == (a, b)
    a.release()
    assert tier.budget == 5 * MiB and not a.active and b.active
    a.release()                                   # twice is a no-op
    assert tier.budget == 5 * MiB
    with b:
        pass
    assert tier.budget is None and tier.leases == ()


def test_a_configured_budget_holds_and_leases_fit_inside_it(fake):
    t = tiermem.Tier(backend=fake, budget="16MiB")
    a = t.lease(10 * MiB, "a")
    assert t.budget == 16 * MiB and t.lease_room() == 6 * MiB
    with pytest.raises(OutOfBudgetError, match="6,291,456 B left for leases"):
        t.lease(7 * MiB, "b")
    assert t.leases == (a,)                       # a refused lease takes nothing
    with pytest.raises(OutOfBudgetError, match=r"a: 10,485,760 B"):
        t.set_budget("8MiB")                      # below what the leases hold
    assert t.configured_budget == t.budget == 16 * MiB
    assert t.set_budget("32MiB") == 16 * MiB      # a configure while the handle lives ...
    a.release()
    assert t.budget == 32 * MiB                   # ... is not undone when it lets go


def test_a_lease_given_back_evicts_what_no_longer_fits(tier):
    a, b = tier.lease(4 * MiB, "a"), tier.lease(4 * MiB, "b")
    xs = [tier.empty(2 * MiB, "uint8", role="activation") for _ in range(4)]
    assert tier.resident_bytes == 8 * MiB
    b.release()
    assert tier.budget == 4 * MiB and tier.resident_bytes <= 4 * MiB
    assert sum(x.is_resident for x in xs) == 2
    a.release()
    assert tier.budget is None


def test_a_lease_takes_any_whole_number(tier):
    import numpy as np
    with tier.lease(np.int64(3 * MiB), "numpy") as a:
        assert type(a.nbytes) is int and tier.budget == 3 * MiB


@pytest.mark.parametrize("configured", [None, "8MiB"])
def test_bad_lease_sizes_are_value_errors(fake, configured):
    t = tiermem.Tier(backend=fake, budget=configured)
    for bad in (-1, 1.5, "1MiB", True):
        with pytest.raises(ValueError):
            t.lease(bad, "x")
    assert t.leases == ()


def test_two_modules_on_one_tier_each_keep_their_budget(tier):
    m1, m2 = _model(0), _model(1)
    r1, r2 = copy.deepcopy(m1), copy.deepcopy(m2)
    h1 = tier.wrap_module(m1, budget=share(m1, 40), max_group_bytes=1 * MiB)
    h2 = tier.wrap_module(m2, budget=share(m2, 30), max_group_bytes=1 * MiB)
    assert [x.nbytes for x in tier.leases] == [h1.budget, h2.budget]
    assert tier.budget == h1.budget + h2.budget       # before leases: h2's budget replaced h1's
    x = torch.randn(8, 256)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(m1(x), r1(x)) and torch.equal(m2(x), r2(x))
    h1.unwrap()
    assert tier.budget == h2.budget and [x.nbytes for x in tier.leases] == [h2.budget]
    with torch.no_grad():
        assert torch.equal(m2(x), r2(x)) and torch.equal(m1(x), r1(x))
    h2.unwrap()
    assert tier.budget is None and tier.leases == ()


def test_a_module_under_a_configured_budget_leaves_it_alone(fake):
    t = tiermem.Tier(backend=fake, budget="64MiB")
    m = _model()
    h = t.wrap_module(m, budget=share(m, 50), max_group_bytes=1 * MiB)
    # the share is of the weights as tiermem lays them out (whole pages per group)
    assert t.budget == 64 * MiB and t.leases[0].nbytes == h.budget >= _weights(m) // 2
    h.unwrap()
    assert t.budget == 64 * MiB and t.leases == ()


def test_a_module_budget_past_the_configured_room_is_cut_to_it_with_a_warning(fake, caplog):
    t = tiermem.Tier(backend=fake, budget="4MiB")
    other = t.lease(1 * MiB, "someone else")
    m, ref = _model(), _model()
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        h = t.wrap_module(m, budget=share(m, 50), max_group_bytes=1 * MiB)
    assert h.budget == 3 * MiB and "configured budget" in caplog.text
    x = torch.randn(8, 256)
    with torch.no_grad():
        assert torch.equal(m(x), ref(x))
    h.unwrap()
    other.release()
    assert t.budget == 4 * MiB and t.leases == ()


def test_a_failed_adoption_gives_its_lease_back(tier, fake):
    m = _model()
    fake_calls = {"n": 0}
    real = fake.host_alloc

    def boom(*a, **k):
        fake_calls["n"] += 1
        raise tiermem.CUDAError("cudaHostAlloc", 2, "cudaErrorMemoryAllocation")
    fake.host_alloc = boom
    try:
        with pytest.raises(TierMemError, match="cudaErrorMemoryAllocation"):
            tier.wrap_module(m, budget=share(m, 40), max_group_bytes=1 * MiB)
    finally:
        fake.host_alloc = real
    assert fake_calls["n"] >= 1 and tier.leases == () and tier.budget is None
