"""bench/um_budget.py (the advice study's UM budget enforcer): its estimate and LRU eviction, on the CPU with fake
segments; and on the GPU, that a training step under it stays within the budget's estimate."""
from __future__ import annotations

import dataclasses

import pytest
from um_budget import UMBudget, UMBudgetStats

from tiermem.errors import TierMemError

MiB = 1 << 20


@dataclasses.dataclass
class Seg:
    ptr: int
    nbytes: int
    device: int = 0


class FakeSegments:
    def __init__(self):
        self.live: list[Seg] = []
        self.evicted: list[tuple[int, int]] = []

    def add(self, ptr, n, device=0):
        self.live.append(Seg(ptr, n, device))

    def __call__(self):
        return list(self.live)

    def evict(self, ptr, n):
        self.evicted.append((ptr, n))


def make(budget):
    f = FakeSegments()
    return f, UMBudget(budget, segments=f, evict=f.evict)


def test_new_segments_count_and_lru_goes_first():
    f, b = make(3 * MiB)
    for i in range(3):
        f.add(0x1000_0000 * (i + 1), MiB)
        b.refresh()
    assert b.resident_bytes == 3 * MiB
    b.touch_ptrs([0x1000_0000 + 5])            # segment 1 is now the most recent
    f.add(0x4000_0000, MiB)
    b.refresh()
    assert b.enforce() == MiB
    assert f.evicted == [(0x2000_0000, MiB)]    # segment 2 was the coldest
    assert b.stats == UMBudgetStats(budget_bytes=3 * MiB, resident_bytes=3 * MiB, peak_resident_bytes=3 * MiB,
                                    peak_seen_bytes=4 * MiB, evictions=1, evicted_bytes=MiB)


def test_protected_segments_stay_even_over_budget():
    f, b = make(MiB)
    f.add(0x1000, 2 * MiB)
    f.add(0x1000 + 4 * MiB, 2 * MiB)
    b.refresh()
    hit = b.touch_ptrs([0x1000 + 10, 0x1000 + 4 * MiB])
    assert hit == {0x1000, 0x1000 + 4 * MiB}
    assert b.enforce(protect=hit) == 0
    assert b.resident_bytes == 4 * MiB
    assert b.enforce(protect={0x1000}) == 2 * MiB
    assert f.evicted == [(0x1000 + 4 * MiB, 2 * MiB)]


def test_touch_brings_an_evicted_segment_back_into_the_estimate():
    f, b = make(0)
    f.add(0x1000, MiB)
    b.refresh()
    b.enforce()
    assert b.resident_bytes == 0
    b.touch_ptrs([0x1000 + MiB - 1])
    assert b.resident_bytes == MiB
    b.touch_ptrs([0x1000 + MiB])                # one past the end: no segment
    assert b.segment_of(0x1000 + MiB) is None and b.segment_of(0x10) is None


def test_freed_segments_leave_and_other_devices_are_ignored():
    f, b = make(10 * MiB)
    f.add(0x1000, MiB)
    f.add(0x9000_0000, 5 * MiB, device=1)
    b.refresh()
    assert b.resident_bytes == MiB
    f.live = []
    b.refresh()
    assert b.resident_bytes == 0 and b.segment_of(0x1000) is None


def test_bad_budget():
    with pytest.raises(TierMemError, match="budget"):
        UMBudget(-1, segments=list, evict=lambda p, n: None)
    with pytest.raises(TierMemError, match="budget"):
        UMBudget(True, segments=list, evict=lambda p, n: None)


@pytest.mark.gpu
def test_gpu_training_step_stays_within_the_estimate():
    """Safety (docs/facts.md): a few MiB of managed memory, the allocator's cap at 1 GiB."""
    import torch

    import tiermem
    from tiermem.pytorch import allocator as ta
    ta.set_torch_managed_cap("1GiB")
    budget = 8 * MiB
    off = tiermem.Policy()
    with tiermem.torch_memory.torch_allocations("weight", policy=off, prefetch=False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)]).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with tiermem.torch_memory.torch_allocations("input", policy=off, prefetch=False):
        x = torch.randn(1024, 512, device="cuda")
    ub = UMBudget(budget)
    hs = ub.attach(model, opt)
    seen = []
    orig = ub.enforce

    def checked(protect=()):
        n = orig(protect)
        seen.append(ub.resident_bytes)
        return n
    ub.enforce = checked
    for _ in range(2):
        with tiermem.torch_memory.torch_allocations("activation", policy=off, prefetch=False), ub.saving():
            model(x).square().mean().backward()
            with tiermem.torch_memory.torch_allocations("weight", policy=off, prefetch=False):
                opt.step()
            opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    ub.detach(hs)
    assert ub.stats.evictions > 0
    # Within the budget after every enforcement, but for the segments one module needs at once.
    biggest = max(s.nbytes for s in tiermem.torch_memory.torch_managed_allocations())
    assert max(seen) <= budget + 4 * biggest
    assert ub.stats.resident_bytes <= budget
