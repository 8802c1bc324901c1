"""Exploration: why a group's refill from pinned shadows ran at 19 GB/s (the probe's single buffer
ran at 46), what read-mostly costs, and how zero-copy reads depend on the element size.
Managed memory stays at 2 GiB. Writes $OUT/probe_refill.json (or bench/results/)."""
from __future__ import annotations

import gc
import json
import os

import torch
from _path import RESULTS  # first: puts bench/ and the repository on sys.path
from _common import cuda_times, gbps, median, progress, provenance  # noqa: E402

import tiermem
from tiermem import Location
from tiermem.core.ranges import coalesce
from tiermem.cuda import runtime as _cuda

GiB, MiB = 1 << 30, 1 << 20
N = GiB
R: dict = {}
mib = [256, 128, 128, 96, 96, 64, 64, 48, 40, 32, 24, 16, 12, 8, 4, 4, 2, 1, 0.5, 0.25, 0.125, 0.125]
sizes = [max(4096, int(m * MiB * N / (sum(mib) * MiB)) // 4096 * 4096) for m in mib]
sizes[0] += N - sum(sizes)
specs = [((n // 2,), "float16") for n in sizes]
cur = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
sync = torch.cuda.synchronize

# The discard calls refuse the legacy default stream: run everything on a stream of our own.
_stream = torch.cuda.Stream()
torch.cuda.set_stream(_stream)
tier = tiermem.Tier(0, cap="3GiB")
be = tier.backend


def med(fn, setup, reps=5):
    return gbps(N, median(cuda_times(fn, reps, setup=setup)))


# ---- pinned ceilings, two ways -----------------------------------------------------------------
d = torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda")
h = torch.empty(N, dtype=torch.uint8, pin_memory=True)
R["torch_d2h"] = gbps(N, median(cuda_times(lambda: h.copy_(d, non_blocking=True), 9)))
R["raw_d2h"] = gbps(N, median(cuda_times(lambda: _cuda.memcpy_async(h.data_ptr(), d.data_ptr(), N, cur()), 9)))
R["torch_h2d"] = gbps(N, median(cuda_times(lambda: d.copy_(h, non_blocking=True), 9)))
R["raw_h2d"] = gbps(N, median(cuda_times(lambda: _cuda.memcpy_async(d.data_ptr(), h.data_ptr(), N, cur()), 9)))
cp_h = be.host_alloc(N)
R["cupy_pinned_h2d"] = gbps(N, median(cuda_times(lambda: _cuda.memcpy_async(d.data_ptr(), cp_h.ptr, N, cur()), 9)))
progress(f"ceilings {R}")

# ---- a group evicted through the shadow: refill variants ----------------------------------------
A = tier.empty_group(specs, role="activation")
for t in A:
    t.torch().copy_(torch.randn(t.shape, device="cuda", dtype=torch.float16))
refs = [t.torch(writable=False).clone() for t in A]
gc.collect()
bufs = [t.buffer for t in A]


def shadow_evict():
    tier.prefetch(A)
    for b in bufs:
        b.shadow_valid = False
    tier.evict(A)
    sync()


R["refill_tiermem"] = med(lambda: tier.prefetch(A), shadow_evict)


def refill_manual(mode):
    def fn():
        s = cur()
        if mode == "dp_each":
            for b in bufs:
                be.discard_and_prefetch([(b.ptr, b.span)], Location.DEVICE, s)
                be.copy(b.ptr, b.shadow.ptr, b.nbytes, s)
        elif mode == "no_dp":
            for b in bufs:
                be.copy(b.ptr, b.shadow.ptr, b.nbytes, s)
        elif mode == "prefetch_then_copy":
            be.prefetch(coalesce((b.block.alloc, b.ptr, b.span) for b in bufs), Location.DEVICE, s)
            for b in bufs:
                be.copy(b.ptr, b.shadow.ptr, b.nbytes, s)
        elif mode == "dp_whole_then_copy":
            be.discard_and_prefetch(coalesce((b.block.alloc, b.ptr, b.span) for b in bufs), Location.DEVICE, s)
            for b in bufs:
                be.copy(b.ptr, b.shadow.ptr, b.nbytes, s)
    return fn


for mode in ["dp_whole_then_copy", "dp_each", "no_dp", "prefetch_then_copy"]:
    R[f"refill_{mode}"] = med(refill_manual(mode), shadow_evict)
    # the manual refill leaves tiermem's state at "shadow": put it right
    for b in bufs:
        b.in_shadow = True
    tier.prefetch(A)
    sync()
    R[f"refill_{mode}_intact"] = all(torch.equal(t.torch(writable=False), r) for t, r in zip(A, refs))
    gc.collect()
progress(f"refill {R}")

# one contiguous pinned shadow for the whole group
big = be.host_alloc(N)
group_ptr, group_n = coalesce((b.block.alloc, b.ptr, b.span) for b in bufs)[0]


def evict_group_to_big():
    tier.prefetch(A)
    sync()
    _cuda.memcpy_async(big.ptr, group_ptr, min(group_n, N), cur())
    be.discard([(group_ptr, group_n)], cur())
    sync()


R["refill_one_pinned_dp_copy"] = med(lambda: (be.discard_and_prefetch([(group_ptr, group_n)], Location.DEVICE, cur()),
                                              _cuda.memcpy_async(group_ptr, big.ptr, min(group_n, N), cur())), evict_group_to_big)
R["refill_one_pinned_copy_only"] = med(lambda: _cuda.memcpy_async(group_ptr, big.ptr, min(group_n, N), cur()), evict_group_to_big)
for b in bufs:
    b.in_shadow = False
tier.prefetch(A)
progress(f"one pinned {R}")
del A, refs, bufs
gc.collect()

# ---- read-mostly and UM group paths --------------------------------------------------------------
W = tier.empty_group(specs, role="activation")   # no read-mostly: plain UM group
tier.prefetch(W)
for t in W:
    t.torch().copy_(torch.randn(t.shape, device="cuda", dtype=torch.float16))
gc.collect()
tier.evict(W, _path="um")
sync()
R["um_group_prefetch_in"] = med(lambda: tier.prefetch(W), lambda: (tier.evict(W, _path="um"), sync()))
R["um_group_evict_um"] = med(lambda: tier.evict(W, _path="um"), lambda: (tier.prefetch(W), sync()))
wb = [t.buffer for t in W]
ptr, n = coalesce((b.block.alloc, b.ptr, b.span) for b in wb)[0]
for t in W:
    t.advise(read_mostly=True, preferred_location="host", accessed_by_device=True, read_only=True)
tier.evict(W, _path="um")
sync()


def rm_collapse_only():
    be.advise(ptr, n, tiermem.roles.Advice("read_mostly", False, Location.DEVICE))
    be.advise(ptr, n, tiermem.roles.Advice("read_mostly", True, Location.DEVICE))


R["rm_prefetch_in_first"] = gbps(N, median(cuda_times(lambda: tier.prefetch(W), 1, warmup=0)))
R["rm_collapse_only_s"] = median(cuda_times(rm_collapse_only, 5, setup=lambda: (_cuda.prefetch(ptr, n, Location.DEVICE, 0, cur()), sync())))
R["rm_prefetch_in_after_collapse_only"] = med(lambda: _cuda.prefetch(ptr, n, Location.DEVICE, 0, cur()), lambda: (rm_collapse_only(), sync()))
R["rm_tiermem_evict_s"] = median(cuda_times(lambda: tier.evict(W), 5, setup=lambda: (tier.prefetch(W), sync())))
R["rm_prefetch_in_after_tiermem_evict"] = med(lambda: tier.prefetch(W), lambda: (tier.evict(W), sync()))
progress(f"read-mostly {R}")
del W, wb
gc.collect()

# ---- zero-copy reads by element size ----------------------------------------------------------------
(Z,) = tier.empty_group([((N // 4,), "float32")], role="optimizer_state")
tier.prefetch(Z)
Z.torch().copy_(torch.randn(N // 4, device="cuda"))
gc.collect()
tier.evict(Z, _path="um")
sync()
zv = Z.torch()
R["zero_copy_f32_sum"] = gbps(N, median(cuda_times(lambda: zv.sum(), 5)))
R["zero_copy_u8_sum_int64"] = gbps(N, median(cuda_times(lambda: zv.view(torch.uint8).sum(dtype=torch.int64), 5)))
R["zero_copy_f16_sum"] = gbps(N, median(cuda_times(lambda: zv.view(torch.float16).sum(), 5)))
R["zero_copy_f32_copy_to_device"] = gbps(N, median(cuda_times(lambda: d.view(torch.float32).copy_(zv), 5)))
R["zero_copy_f32_sum_again"] = gbps(N, median(cuda_times(lambda: zv.sum(), 5)))
progress(f"zero-copy {R}")

dest = os.environ.get("OUT") or RESULTS
with open(os.path.join(dest, "probe_refill.json"), "w") as f:
    json.dump({**provenance(), **R}, f, indent=1)
print(json.dumps(R, indent=1))
