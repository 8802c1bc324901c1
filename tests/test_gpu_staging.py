"""GPU tests of the staging ring (NOTE [staging ring] in tiermem/cuda/staging.py): data goes through it
bit for bit both ways, the caller's stream is ordered after all of it, and trim() gives its memory
back to the driver. Managed use stays under 1 GiB."""
from __future__ import annotations

import gc

import pytest

pytestmark = pytest.mark.gpu

MiB = 1 << 20
SIZES = [96 * MiB, 5 * MiB + 77, 300_000, 40 * MiB, 4096, 2 * MiB]


def _group(t, role="gradient"):
    import torch
    g = t.empty_group([((n,), "uint8") for n in SIZES], role=role)
    refs = []
    for x in g:
        r = torch.randint(0, 256, (x.nbytes,), dtype=torch.uint8, device="cuda")
        x.torch().copy_(r)
        refs.append(r)
    gc.collect()          # no views left: the shadow paths are allowed
    return g, refs


@pytest.mark.parametrize("budgeted", [False, True], ids=["no-budget", "budget"])
@pytest.mark.parametrize("non_blocking", [False, True])
def test_a_group_goes_through_the_ring_both_ways_bit_for_bit(budgeted, non_blocking):
    import torch

    import tiermem
    t = tiermem.Tier(0, cap="1GiB", staging="64MiB")
    g1, r1 = _group(t)
    g2, r2 = _group(t)
    total = sum(SIZES)
    if budgeted:      # one group and both rings: each prefetch parks the other group, dirty
        t.evict(g2, release=True).synchronize()
        t.set_budget(t.resident_bytes + 128 * MiB)
    cur = torch.cuda.current_stream()
    for cycle in range(4):
        for g, refs in ((g2, r2), (g1, r1)):
            tr = t.prefetch(g, non_blocking=non_blocking)
            if non_blocking:
                tr.wait(cur)
            for x, r in zip(g, refs):
                v = x.torch()
                assert torch.equal(v, r), f"cycle {cycle}"
                r.add_(1)                # dirty: the next eviction must copy it out again
                v.add_(1)
                del v
            gc.collect()
            if not budgeted:
                t.evict(g, non_blocking=non_blocking)
    torch.cuda.synchronize()
    s = t.stats()
    assert t.staging_bytes == 128 * MiB and s["staging.refused_count"] == 0
    # six refills at least (the groups start on the device) and six dirty evictions (the first
    # one under the budget comes before the rings), every byte of them staged
    assert s["staged_bytes.gradient.h2d"] >= 6 * total and s["staged_bytes.gradient.d2h"] >= 6 * total
    if budgeted:
        assert t.resident_bytes + t.staging_bytes <= t.budget
    t.close()


def test_trim_gives_the_ring_back_to_the_driver():
    import torch

    import tiermem
    t = tiermem.Tier(0, cap="1GiB", staging="128MiB")
    x = t.empty(64 * MiB, "uint8", role="gradient")
    ref = torch.randint(0, 256, (64 * MiB,), dtype=torch.uint8, device="cuda")
    x.torch().copy_(ref)
    gc.collect()
    t.evict(x)
    t.prefetch(x)
    torch.cuda.synchronize()
    assert t.staging_bytes == 256 * MiB          # 128 MiB each way
    free_before, _ = torch.cuda.mem_get_info()
    assert t.trim() == 256 * MiB and t.staging_bytes == 0
    free_after, _ = torch.cuda.mem_get_info()
    # cudaMalloc memory, unlike managed pages, shows in the free figure (docs/facts.md)
    assert free_after - free_before >= 250 * MiB
    assert torch.equal(x.torch(), ref)
    t.close()


def test_an_eviction_and_a_refill_share_the_link_both_ways():
    """Each direction on its own stream and ring (NOTE [staging ring]); bench/bandwidth.py
    measures how much they overlap. This checks the streams and the bytes."""
    import torch

    import tiermem
    t = tiermem.Tier(0, cap="1GiB", budget="1GiB", staging="64MiB")
    a, ra = _group(t)
    b, rb = _group(t, role="activation")
    t.evict(b).synchronize()          # parked: it comes back into its own pages
    for x, r in zip(a, ra):
        v = x.torch()
        v.add_(3)
        r.add_(3)
        del v
    gc.collect()
    torch.cuda.synchronize()
    out = t.evict(a, non_blocking=True)
    inn = t.prefetch(b, non_blocking=True)
    assert out.stream != inn.stream
    inn.synchronize()
    out.synchronize()
    s = t.stats()
    assert s["staged_bytes.gradient.d2h"] >= sum(SIZES) and s["staged_bytes.activation.h2d"] >= sum(SIZES)
    assert all(torch.equal(x.torch(), r) for x, r in zip(b, rb))
    t.prefetch(a)
    assert all(torch.equal(x.torch(), r) for x, r in zip(a, ra))
    t.close()
