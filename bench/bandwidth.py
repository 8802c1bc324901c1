"""bench/bandwidth.py: tiermem's data paths against the link's ceilings and plain Unified Memory.

In one run, side by side, on 1 GiB (default) of data:
  ceilings     pinned H2D, pinned D2H, both at once (cudaMalloc <-> pinned host, torch copies)
  plain UM     prefetch to the host (UM's write-back), fault-in (a kernel touches host pages),
               one-call prefetch in
  tiermem      prefetch-in of a group of evicted tensors of various sizes: streamed in where the
               group before it was (the headline), into fresh pages, read-mostly, and as separate
               tensors; dirty eviction, clean eviction (read-mostly and shadow), prefetch-in
               from the pinned shadow, zero-copy reads, prefetch-in and eviction at once, and
               an exchange under a tight budget (one group in, another out)
  direct       the shadow copies without the staging ring (NOTE [staging ring] in
               tiermem/cuda/staging.py), straight between pinned and managed memory: the stream-in,
               the dirty eviction and the shadow refill, in rounds alternating with the ring's
and whether evicted device memory really goes back to other allocators.

The tier runs under a budget (3 GiB, the size of its managed cap), so shadow evictions park their
device pages for the next refill (NOTE [parked pages] in tiermem/core/parking.py). Each eviction and
refill through the shadow is also timed with ``release=True``, the path that gives the pages back
to the driver at once, which is what every eviction did before parking.

Times are CUDA-event medians after a warm-up, on random data. Total managed memory stays at
3 GiB or less (docs/facts.md). Writes bench/results/bandwidth-<device>-<date>.json and .png.

    python bench/bandwidth.py [--size-gib 1] [--reps 5] [--no-reclaim]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import time

from _common import cuda_times, device_view, duplex_copy, gbps, median, nvml_handle, plot_path, progress, table, write_results

GiB = 1 << 30
MiB = 1 << 20


def piece_sizes(total: int) -> list[int]:
    """A layer's worth of tensors of various sizes (MiB), scaled to ``total`` bytes."""
    mib = [256, 128, 128, 96, 96, 64, 64, 48, 40, 32, 24, 16, 12, 8, 4, 4, 2, 1, 0.5, 0.25, 0.125, 0.125]
    scale = total / (sum(mib) * MiB)
    sizes = [max(4096, int(m * MiB * scale) // 4096 * 4096) for m in mib]
    sizes[0] += total - sum(sizes)
    return sizes


def advise_all(group, **changes) -> None:
    # a function, not a loop in main(): a loop variable left over would keep the last member, and
    # with it the group's whole allocation, alive under the managed cap
    for t in group:
        t.advise(**changes)


@contextlib.contextmanager
def direct_copies(tier):
    """tiermem's shadow copies without the staging ring: the baseline it is measured against."""
    old, tier.staging.min_bytes = tier.staging.min_bytes, 1 << 62
    try:
        yield
    finally:
        tier.staging.min_bytes = old


def alternating(variants: dict, reps: int) -> dict[str, list[float]]:
    """{name: seconds per rep} for {name: (fn, setup)}, one rep of each in turn per round (after
    a warm-up round), so that drift over the run touches every variant alike."""
    out: dict[str, list[float]] = {k: [] for k in variants}
    for rnd in range(reps + 1):
        for name, (fn, setup) in variants.items():
            t = cuda_times(fn, 1, warmup=0, setup=setup)
            if rnd:
                out[name] += t
    return out


def pcie_bytes():
    """(tx, rx) byte counters of the PCIe link from NVML, or None where the driver has none."""
    try:
        import pynvml
        h = nvml_handle()
        ids = [pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES]
        vals = pynvml.nvmlDeviceGetFieldValues(h, ids)
        if any(v.nvmlReturn != 0 for v in vals):
            return None
        return tuple(int(v.value.ullVal) for v in vals)
    except Exception:
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--no-reclaim", action="store_true")
    args = ap.parse_args()

    import torch

    import tiermem
    from tiermem import Location
    from tiermem.cuda import runtime as _cuda

    N = int(args.size_gib * GiB)
    reps = args.reps
    metrics: dict[str, float] = {}
    checks: dict[str, bool] = {}
    raw: dict = {"size_bytes": N, "reps": reps}
    cur = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731

    # ---- 1. ceilings ----------------------------------------------------------------------
    progress("pinned ceilings")
    d = torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda")
    d2 = torch.empty_like(d)
    h = torch.empty(N, dtype=torch.uint8, pin_memory=True)
    h2 = torch.empty(N, dtype=torch.uint8, pin_memory=True)
    h.copy_(d)
    h2.copy_(d)
    def ceilings() -> tuple[float, float]:
        # torch's copy and a raw cudaMemcpyAsync, 9 reps each: the larger is the ceiling
        c = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
        h2d = max(gbps(N, median(cuda_times(lambda: d2.copy_(h, non_blocking=True), 9))),
                  gbps(N, median(cuda_times(lambda: _cuda.memcpy_async(d2.data_ptr(), h.data_ptr(), N, c()), 9))))
        d2h = max(gbps(N, median(cuda_times(lambda: h.copy_(d, non_blocking=True), 9))),
                  gbps(N, median(cuda_times(lambda: _cuda.memcpy_async(h.data_ptr(), d.data_ptr(), N, c()), 9))))
        return h2d, d2h

    metrics["pinned_h2d_GBps"], metrics["pinned_d2h_GBps"] = ceilings()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        duplex_copy(torch, d2, h, h2, d, s1, s2)

    metrics["pinned_bidir_total_GBps"] = gbps(2 * N, median(cuda_times(both, reps)))
    del h2

    # ---- 2. plain Unified Memory ---------------------------------------------------------------
    progress("plain Unified Memory baselines")
    m = _cuda.managed_alloc(N, 0)
    mv = device_view(m.ptr, N)
    _cuda.prefetch(m.ptr, N, Location.DEVICE, 0, cur())
    mv.copy_(d)
    to_dev = lambda: (_cuda.prefetch(m.ptr, N, Location.DEVICE, 0, cur()), torch.cuda.synchronize())  # noqa: E731
    to_host = lambda: (_cuda.prefetch(m.ptr, N, Location.HOST, 0, cur()), torch.cuda.synchronize())  # noqa: E731
    metrics["um_prefetch_d2h_GBps"] = gbps(N, median(cuda_times(lambda: _cuda.prefetch(m.ptr, N, Location.HOST, 0, cur()), reps, setup=to_dev)))
    metrics["um_prefetch_h2d_GBps"] = gbps(N, median(cuda_times(lambda: _cuda.prefetch(m.ptr, N, Location.DEVICE, 0, cur()), reps, setup=to_host)))
    mf = mv.view(torch.float32)   # float32 reads: byte-wide reads over the link run slower (probe_refill)
    metrics["um_fault_in_GBps"] = gbps(N, median(cuda_times(lambda: mf.sum(), reps, setup=to_host)))
    checks["um_baseline_intact"] = bool(torch.equal(mv, d))
    # The ceiling for anything that lands in managed pages: one copy from pinned memory into
    # device-resident managed pages (docs/facts.md: ~50 GB/s, where cudaMalloc memory takes 55).
    to_dev()
    metrics["pinned_h2d_managed_GBps"] = gbps(N, median(cuda_times(lambda: _cuda.memcpy_async(m.ptr, h.data_ptr(), N, cur()), reps)))
    checks["managed_ceiling_intact"] = bool(torch.equal(mv, d))
    del mf, mv, m
    gc.collect()

    tier = tiermem.Tier(0, cap="3GiB", budget="3GiB")
    sizes = piece_sizes(N)
    raw["piece_sizes"] = sizes
    specs = [((n // 2,), "float16") for n in sizes]

    def fill(group):
        refs = []
        for t in group:
            v = t.torch()
            v.copy_(torch.randn(v.shape, device="cuda", dtype=torch.float16))
            refs.append(v.clone())
        return refs

    def intact(group, refs) -> bool:
        return all(torch.equal(t.torch(writable=False), r) for t, r in zip(group, refs))

    # ---- 3. separate tensors: one range each --------------------------------------------------
    progress("prefetch-in of separate tensors (one range each)")
    sep = [tier.empty(sh, dt, role="activation") for sh, dt in specs]
    sep_refs = fill(sep)
    gc.collect()
    evict_um = lambda g: (tier.evict(g, _path="um"), torch.cuda.synchronize())  # noqa: E731
    metrics["prefetch_in_separate_GBps"] = gbps(N, median(cuda_times(lambda: tier.prefetch(sep), reps, setup=lambda: evict_um(sep))))
    checks["separate_intact"] = intact(sep, sep_refs)
    del sep, sep_refs
    gc.collect()

    # ---- 4. a group of frozen weights: prefetch-in and clean (read-mostly) eviction -----------
    progress("group prefetch-in and clean eviction (frozen_weight: read-mostly, host-preferred)")
    W = tier.empty_group(specs, role="frozen_weight", read_mostly=True)
    tier.prefetch(W)
    w_refs = fill(W)
    gc.collect()
    evict_um(W)                                    # its host pages hold the data from now on
    clean = lambda: (tier.evict(W), torch.cuda.synchronize())  # noqa: E731
    metrics["prefetch_in_read_mostly_GBps"] = gbps(N, median(cuda_times(lambda: tier.prefetch(W), reps, setup=clean)))
    moved_before = tier.stats()["moved_bytes.frozen_weight.d2h"]
    pcie0 = pcie_bytes()
    t_clean = cuda_times(lambda: tier.evict(W), reps, setup=lambda: (tier.prefetch(W), torch.cuda.synchronize()))
    pcie1 = pcie_bytes()
    moved = tier.stats()["moved_bytes.frozen_weight.d2h"] - moved_before
    metrics["evict_clean_bytes_moved_fraction"] = moved / ((reps + 1) * N)
    metrics["evict_clean_ms"] = round(median(t_clean) * 1e3, 3)
    if pcie0 and pcie1:
        raw["evict_clean_pcie_tx_rx_bytes_per_rep"] = [(b - a) / (reps + 1) for a, b in zip(pcie0, pcie1)]
    tier.prefetch(W)
    checks["group_intact"] = intact(W, w_refs)
    gc.collect()
    tier.evict(W)
    checks["read_in_place_after_clean_evict"] = intact(W, w_refs)
    gc.collect()
    big = W[0].torch(writable=False)   # the largest member, read in place from host pages
    raw["read_mostly_evicted_read_in_place_GBps"] = gbps(big.nbytes, median(cuda_times(lambda: big.sum(), reps)))
    del big
    gc.collect()

    # ---- 5. a group of activations: dirty eviction and prefetch-in from the shadow ------------
    progress("dirty eviction through the pinned shadow (activation group)")
    A = tier.empty_group(specs, role="activation")
    a_refs = fill(A)
    gc.collect()
    state = {"refs": a_refs}

    def dirty_setup():
        tier.prefetch(A)
        views = [t.torch() for t in A]
        for v in views:
            v.mul_(-1)                             # new data every rep, never zeros, never inf
        state["refs"] = [v.clone() for v in views]
        del views
        gc.collect()
        torch.cuda.synchronize()

    transfers = []

    def evict_direct():
        with direct_copies(tier):
            tier.evict(A)

    pcie0 = pcie_bytes()
    t_dirty = alternating({"ring": (lambda: transfers.append(tier.evict(A)), dirty_setup),
                           "direct": (evict_direct, dirty_setup)}, reps)
    pcie1 = pcie_bytes()
    metrics["evict_dirty_GBps"] = gbps(N, median(t_dirty["ring"]))
    metrics["evict_dirty_direct_GBps"] = gbps(N, median(t_dirty["direct"]))
    checks["dirty_evict_parked"] = all(t.parked for t in A if t.nbytes >= 2 * MiB)
    metrics["evict_dirty_release_GBps"] = gbps(N, median(cuda_times(lambda: tier.evict(A, release=True), reps,
                                                                    setup=dirty_setup)))
    # The same path on one 1 GiB tensor: the group's members under 2 MiB cannot be discarded on
    # their own (they share 2 MiB pages) and go through Unified Memory's write-back instead.
    (S,) = tier.empty_group([((N,), "uint8")], role="activation")
    sv = S.torch()
    sv.copy_(d)
    del sv
    gc.collect()

    def single_setup():
        tier.prefetch(S)
        v = S.torch()
        v.add_(1)
        del v
        gc.collect()
        torch.cuda.synchronize()

    metrics["evict_dirty_single_GBps"] = gbps(N, median(cuda_times(lambda: tier.evict(S), reps, setup=single_setup)))
    metrics["evict_dirty_single_release_GBps"] = gbps(N, median(cuda_times(lambda: tier.evict(S, release=True), reps,
                                                                           setup=single_setup)))
    tier.prefetch(S)
    # one add per timed rep and per warm-up, of both timings
    checks["single_dirty_round_trip_intact"] = bool(torch.equal(S.torch(writable=False), d + 2 * (reps + 1)))
    del S
    gc.collect()
    raw["evict_dirty_transfer_GBps"] = [gbps(N, t.seconds) for t in transfers]
    raw["evict_dirty_path_counts"] = {k: tier.stats()[f"ops.activation.{k}"]
                                      for k in ("evict", "evict_um", "evict_clean", "evict_park", "refill_reuse", "park_release")}
    if pcie0 and pcie1:   # both variants: two evictions per round
        raw["evict_dirty_pcie_tx_rx_bytes_per_rep"] = [(b - a) / (2 * (reps + 1)) for a, b in zip(pcie0, pcie1)]
    checks["dirty_evict_took_shadow_path"] = all(t.in_shadow for t in A if t.nbytes >= 2 * MiB)

    def shadowed(release=False):
        dirty_setup()
        tier.evict(A, release=release)
        torch.cuda.synchronize()

    def prefetch_direct():
        with direct_copies(tier):
            tier.prefetch(A)

    t_shadow = alternating({"ring": (lambda: tier.prefetch(A), shadowed), "direct": (prefetch_direct, shadowed)}, reps)
    metrics["prefetch_in_shadow_GBps"] = gbps(N, median(t_shadow["ring"]))
    metrics["prefetch_in_shadow_direct_GBps"] = gbps(N, median(t_shadow["direct"]))
    ring = tier.staging_bytes          # allocated by the refills above; the budgets below make room for it
    raw["staging_ring_bytes"] = ring
    checks["staging_ring_used"] = ring > 0 and tier.stats()["staged_bytes.activation.h2d"] > 0
    metrics["prefetch_in_shadow_fresh_pages_GBps"] = gbps(N, median(cuda_times(
        lambda: tier.prefetch(A), reps, setup=lambda: shadowed(release=True))))
    with torch.cuda.stream(torch.cuda.Stream()):   # the same with a non-default current stream
        raw["prefetch_in_shadow_side_stream_GBps"] = gbps(N, median(cuda_times(lambda: tier.prefetch(A), reps, setup=shadowed)))
    checks["dirty_round_trip_intact"] = intact(A, state["refs"])
    gc.collect()
    # The same group marked read-only: its shadow stays valid, so eviction is a discard only.
    advise_all(A, read_only=True)
    tier.evict(A)
    torch.cuda.synchronize()
    moved_before = tier.stats()["moved_bytes.activation.d2h"]
    t_sclean = cuda_times(lambda: tier.evict(A), reps, setup=lambda: (tier.prefetch(A), torch.cuda.synchronize()))
    metrics["evict_clean_shadow_ms"] = round(median(t_sclean) * 1e3, 3)
    metrics["evict_clean_shadow_bytes_moved_fraction"] = (tier.stats()["moved_bytes.activation.d2h"] - moved_before) / ((reps + 1) * N)
    tier.prefetch(A)
    checks["shadow_clean_round_trip_intact"] = intact(A, state["refs"])
    advise_all(A, read_only=False)
    gc.collect()

    # ---- 6. overlap: A goes out while B (or W) comes in -----------------------------------------
    # Each direction has its own stream and staging ring (NOTE [staging ring]), so a dirty
    # eviction and a refill from the shadow share the link both ways. B comes back into its own
    # parked pages; the budget (3 GiB) has room for both groups, so neither waits for the other.
    progress("prefetch-in and eviction at once")
    B = tier.empty_group(specs, role="activation")
    b_refs = fill(B)
    gc.collect()
    tier.evict(B)
    torch.cuda.synchronize()

    def overlap_setup(incoming):
        dirty_setup()
        tier.evict(incoming)
        torch.cuda.synchronize()

    def overlap(incoming):
        out = tier.evict(A, non_blocking=True)
        inn = tier.prefetch(incoming, non_blocking=True)
        out.wait()
        inn.wait()

    metrics["overlap_total_GBps"] = gbps(2 * N, median(cuda_times(lambda: overlap(B), reps, setup=lambda: overlap_setup(B))))
    tier.prefetch(A)
    checks["overlap_intact"] = intact(A, state["refs"]) and intact(B, b_refs)
    # the same with W, the read-mostly group, coming in by Unified Memory's migration
    metrics["overlap_read_mostly_total_GBps"] = gbps(2 * N, median(cuda_times(lambda: overlap(W), reps,
                                                                          setup=lambda: overlap_setup(W))))
    tier.prefetch(A)
    checks["overlap_read_mostly_intact"] = intact(A, state["refs"]) and intact(W, w_refs)
    del W, w_refs
    gc.collect()

    # ---- 6b. an exchange under a tight budget: B comes in, A (dirty) goes out ------------------
    progress("exchange under a budget that holds one group: B in, A out")
    tier.evict(B)
    torch.cuda.synchronize()
    old_budget = tier.set_budget(sum(t.buffer.span for t in A) + ring)   # one group's pages and the ring
    raw["exchange_budget_bytes"] = tier.budget

    def exchange_setup():
        tier.evict(B)           # parks: B's pages (A's before) stay for A's refill
        dirty_setup()           # A in, and written
        assert tier.resident_bytes <= tier.budget

    def exchange_release():
        tier.evict(A, release=True)   # what eviction did before parking: pages back at once
        tier.prefetch(B)              # then fresh pages for B

    moved0 = tier.stats()["ops.activation.refill_reuse"]
    metrics["exchange_GBps"] = gbps(2 * N, median(cuda_times(lambda: tier.prefetch(B), reps, setup=exchange_setup)))
    raw["exchange_refills_into_reused_pages"] = tier.stats()["ops.activation.refill_reuse"] - moved0
    checks["exchange_intact"] = intact(B, b_refs) and intact(A, state["refs"])   # A comes back in, B goes out
    metrics["exchange_release_GBps"] = gbps(2 * N, median(cuda_times(exchange_release, reps, setup=exchange_setup)))
    checks["exchange_release_intact"] = intact(B, b_refs) and intact(A, state["refs"])
    tier.set_budget(old_budget)
    del B, b_refs, A
    gc.collect()

    # ---- 6c. streaming weights in: a group comes in where the group before it was --------------
    # What a model bigger than its budget does every layer: frozen weights without read-mostly,
    # so they evict through the shadow (read-only: once copied, it stays valid), and without the
    # host as preferred location, since the shadow is their host copy (with it, copies into the
    # range ran at 7.5 GB/s, and at 1.9 into fresh pages, on the H100 at d8400a6).
    # Under a budget that holds one group, bringing one group in parks the other (nothing moves:
    # it is clean) and copies the incoming group's shadow into its pages. The timed call is the
    # whole prefetch, room-making included.
    progress("streaming frozen weights in, one group where the other was (shadow path)")
    shadowed_frozen = {"read_mostly": False, "preferred_location": None}
    F1 = tier.empty_group(specs, role="frozen_weight", **shadowed_frozen)
    F2 = tier.empty_group(specs, role="frozen_weight", **shadowed_frozen)
    f_refs = [fill(F1), fill(F2)]
    gc.collect()
    old_budget = tier.set_budget(sum(t.buffer.span for t in F1) + ring)   # one group and the ring
    for group in (F1, F2, F1, F2):      # the first eviction of each copies out; then the shadow is valid
        tier.prefetch(group)
    del group                           # a loop variable would keep F2's allocation alive
    torch.cuda.synchronize()
    turn = {"next": 0}                  # F2 is in (the loop above ended with it): F1 comes next

    transfers_in: list = []

    def stream_in():                    # each call brings in the group that is out
        tr = tier.prefetch((F1, F2)[turn["next"] % 2])
        transfers_in.append((tier.staging.min_bytes < 1 << 62, tr))
        turn["next"] += 1

    moved0 = tier.stats()["moved_bytes.frozen_weight.d2h"], tier.stats()["moved_bytes.frozen_weight.h2d"]
    reuse0 = tier.stats()["ops.frozen_weight.refill_reuse"]
    # host time of the call, and before its first copy: while the host plans, the link is idle
    marks: dict[str, list[float]] = {"call": [], "first_copy": [], "t0": [0.0]}
    real_copy = tier.backend.copy

    def copy_marked(*a):
        if len(marks["first_copy"]) < len(marks["call"]) + 1:
            marks["first_copy"].append(time.perf_counter() - marks["t0"][0])
        real_copy(*a)

    def stream_in_marked():
        marks["t0"][0] = time.perf_counter()
        stream_in()
        marks["call"].append(time.perf_counter() - marks["t0"][0])
        tier.backend.copy = real_copy      # the direct variant is not marked

    def stream_in_direct():
        with direct_copies(tier):
            stream_in()

    def mark_next():
        torch.cuda.synchronize()
        tier.backend.copy = copy_marked

    t_both = alternating({"ring": (stream_in_marked, mark_next), "direct": (stream_in_direct, torch.cuda.synchronize)}, reps)
    del tier.backend.copy
    t_stream = t_both["ring"]
    marks["call"], marks["first_copy"] = marks["call"][1:], marks["first_copy"][1:]   # the warm-up round
    metrics["prefetch_in_direct_GBps"] = gbps(N, median(t_both["direct"]))
    raw["stream_in_host_ms"] = round(median(marks["call"]) * 1e3, 3)
    raw["stream_in_host_ms_before_first_copy"] = round(median(marks["first_copy"]) * 1e3, 3)
    metrics["prefetch_in_GBps"] = gbps(N, median(t_stream))
    # The transfer's own events (on tiermem's stream, from just before the first copy to after
    # the last): the link-side rate, without the host's planning before it (room, victims).
    # (the ring's calls, after the warm-up round)
    metrics["prefetch_in_transfer_GBps"] = gbps(N, median([tr.seconds for staged, tr in transfers_in[2:] if staged]))
    del transfers_in[:]
    moved1 = tier.stats()["moved_bytes.frozen_weight.d2h"], tier.stats()["moved_bytes.frozen_weight.h2d"]
    calls = 2 * (reps + 1)              # both variants
    raw["stream_in_moved_bytes_per_call"] = {"d2h": (moved1[0] - moved0[0]) / calls,
                                             "h2d": (moved1[1] - moved0[1]) / calls}
    raw["stream_in_refills_into_reused_pages"] = tier.stats()["ops.frozen_weight.refill_reuse"] - reuse0
    metrics["stream_in_evict_bytes_moved_fraction"] = raw["stream_in_moved_bytes_per_call"]["d2h"] / N
    checks["stream_in_intact"] = intact(F1, f_refs[0]) and intact(F2, f_refs[1])
    # the same with the pages given back at every eviction: each refill then gets fresh pages
    # (release=True gives back the groups' parked pages; trim() would give back the ring too)
    metrics["prefetch_in_fresh_pages_GBps"] = gbps(N, median(cuda_times(
        stream_in, reps, setup=lambda: (tier.evict(F1 + F2, release=True), torch.cuda.synchronize()))))
    checks["stream_in_fresh_intact"] = intact(F1, f_refs[0]) and intact(F2, f_refs[1])
    tier.set_budget(old_budget)
    del F1, F2, f_refs
    gc.collect()

    # ---- 7. zero-copy reads ---------------------------------------------------------------------
    progress("zero-copy reads of host-resident data (optimizer_state: host-preferred, accessed-by GPU)")
    (Z,) = tier.empty_group([((N // 4,), "float32")], role="optimizer_state")
    tier.prefetch(Z)
    zref = torch.randn(N // 4, device="cuda")
    Z.torch().copy_(zref)
    gc.collect()
    tier.evict(Z, _path="um")
    zv = Z.torch(writable=False)
    metrics["zero_copy_read_GBps"] = gbps(N, median(cuda_times(lambda: zv.sum(), reps)))
    checks["zero_copy_read_correct"] = bool(torch.equal(zv, zref))
    # Still on the host after the reads: a second timing matches the first (no migration).
    metrics["zero_copy_read_again_GBps"] = gbps(N, median(cuda_times(lambda: zv.sum(), reps)))
    raw["zero_copy_read_uint8_GBps"] = gbps(N, median(cuda_times(lambda: zv.view(torch.uint8).sum(dtype=torch.int64), reps)))
    del zref
    raw["stats"] = tier.stats()
    del zv, Z
    gc.collect()

    # ---- ratios and checks ----------------------------------------------------------------------
    again = ceilings()   # measured again at the end; the ratios use the larger of the two runs
    raw["ceilings_first_and_last"] = [[metrics["pinned_h2d_GBps"], metrics["pinned_d2h_GBps"]], list(again)]
    metrics["pinned_h2d_GBps"] = max(metrics["pinned_h2d_GBps"], again[0])
    metrics["pinned_d2h_GBps"] = max(metrics["pinned_d2h_GBps"], again[1])
    del d2, h
    h2d, d2h = metrics["pinned_h2d_GBps"], metrics["pinned_d2h_GBps"]
    metrics["prefetch_in_vs_pinned_h2d"] = round(metrics["prefetch_in_GBps"] / h2d, 3)
    metrics["prefetch_in_direct_vs_pinned_h2d"] = round(metrics["prefetch_in_direct_GBps"] / h2d, 3)
    metrics["prefetch_in_staging_speedup"] = round(metrics["prefetch_in_GBps"] / metrics["prefetch_in_direct_GBps"], 3)
    metrics["prefetch_in_shadow_direct_vs_pinned_h2d"] = round(metrics["prefetch_in_shadow_direct_GBps"] / h2d, 3)
    metrics["evict_dirty_direct_vs_pinned_d2h"] = round(metrics["evict_dirty_direct_GBps"] / d2h, 3)
    metrics["prefetch_in_vs_pinned_h2d_managed"] = round(metrics["prefetch_in_GBps"] / metrics["pinned_h2d_managed_GBps"], 3)
    metrics["prefetch_in_shadow_vs_pinned_h2d_managed"] = round(metrics["prefetch_in_shadow_GBps"] / metrics["pinned_h2d_managed_GBps"], 3)
    metrics["pinned_h2d_managed_vs_pinned_h2d"] = round(metrics["pinned_h2d_managed_GBps"] / h2d, 3)
    metrics["prefetch_in_read_mostly_vs_pinned_h2d"] = round(metrics["prefetch_in_read_mostly_GBps"] / h2d, 3)
    metrics["prefetch_in_fresh_pages_vs_pinned_h2d"] = round(metrics["prefetch_in_fresh_pages_GBps"] / h2d, 3)
    metrics["prefetch_in_separate_vs_pinned_h2d"] = round(metrics["prefetch_in_separate_GBps"] / h2d, 3)
    metrics["prefetch_in_shadow_vs_pinned_h2d"] = round(metrics["prefetch_in_shadow_GBps"] / h2d, 3)
    metrics["evict_dirty_vs_pinned_d2h"] = round(metrics["evict_dirty_GBps"] / d2h, 3)
    metrics["evict_dirty_single_vs_pinned_d2h"] = round(metrics["evict_dirty_single_GBps"] / d2h, 3)
    metrics["evict_dirty_release_vs_pinned_d2h"] = round(metrics["evict_dirty_release_GBps"] / d2h, 3)
    metrics["evict_dirty_single_release_vs_pinned_d2h"] = round(metrics["evict_dirty_single_release_GBps"] / d2h, 3)
    serial = 2 / (1 / h2d + 1 / d2h)     # one GiB out, then one in, over pinned copies
    metrics["exchange_vs_pinned_serial"] = round(metrics["exchange_GBps"] / serial, 3)
    metrics["exchange_release_vs_pinned_serial"] = round(metrics["exchange_release_GBps"] / serial, 3)
    metrics["exchange_speedup_over_release"] = round(metrics["exchange_GBps"] / metrics["exchange_release_GBps"], 3)
    metrics["um_prefetch_d2h_vs_pinned_d2h"] = round(metrics["um_prefetch_d2h_GBps"] / d2h, 3)
    metrics["zero_copy_read_vs_pinned_h2d"] = round(metrics["zero_copy_read_GBps"] / h2d, 3)
    metrics["overlap_vs_pinned_bidir"] = round(metrics["overlap_total_GBps"] / metrics["pinned_bidir_total_GBps"], 3)
    checks["data_intact"] = all(v for k, v in checks.items() if "intact" in k or "correct" in k)
    checks["prefetch_in_goal"] = metrics["prefetch_in_vs_pinned_h2d"] >= 0.90
    checks["evict_dirty_goal"] = metrics["evict_dirty_vs_pinned_d2h"] >= 0.80
    checks["evict_clean_goal"] = metrics["evict_clean_bytes_moved_fraction"] <= 0.01
    checks["zero_copy_goal"] = metrics["zero_copy_read_vs_pinned_h2d"] >= 0.90

    # ---- 8. does evicted device memory go back to other allocators? -------------------------------
    if not args.no_reclaim:
        raw["reclaim"] = reclaim(tier, torch)
        checks["evicted_memory_reusable_by_cudaMalloc"] = all(
            r["cudaMalloc_ok"] for k, r in raw["reclaim"].items() if k != "parked")
        raw["parked_pages_reusable_by_cudaMalloc_without_trim"] = raw["reclaim"]["parked"]["cudaMalloc_ok"]
        checks["reclaim_intact"] = all(r["intact"] for r in raw["reclaim"].values())
    tier.close()

    rows = [[k, v] for k, v in metrics.items()]
    print()
    print(table(rows, ["metric", "value"]))
    print()
    print(table([[k, v] for k, v in checks.items()], ["check", "ok"]))
    png = plot(metrics)
    write_results("bandwidth", metrics, checks, raw, extra_files=[png] if png else [])


def reclaim(tier, torch) -> dict:
    """Fill the GPU with cudaMalloc until 3 GiB are free, make 2 GiB of managed memory resident,
    evict it, then ask cudaMalloc for 1 GiB more than is free: it succeeds only if evicted pages
    come back to other allocators.
    cudaMemGetInfo cannot tell (free memory does not rise after eviction, docs/facts.md), but a
    cudaMalloc that succeeds, quickly and with the evicted data intact, can.
    Paths: "copy" (shadow eviction with release=True), "um" (Unified Memory's write-back),
    "parked" (a shadow eviction under the budget, pages kept: expected to fail unless the driver
    takes managed pages back for cudaMalloc) and "parked_trim" (the same, then Tier.trim())."""
    out = {}
    for path in ("copy", "um", "parked", "parked_trim"):
        gc.collect()
        torch.cuda.empty_cache()
        ref = torch.randint(0, 256, (2 * GiB,), dtype=torch.uint8, device="cuda")
        free, _ = torch.cuda.mem_get_info()
        filler = torch.empty(free - 3 * GiB, dtype=torch.uint8, device="cuda")
        (R,) = tier.empty_group([((2 * GiB,), "uint8")], role="activation")
        R.torch().copy_(ref)
        gc.collect()
        free_resident = torch.cuda.mem_get_info()[0]
        if path in ("copy", "um"):
            tier.evict(R, _path=path, release=True).synchronize()
        else:
            tier.evict(R).synchronize()
            if path == "parked_trim":
                tier.trim()
        free_evicted = torch.cuda.mem_get_info()[0]
        ask = free_evicted + GiB   # only possible if at least 1 GiB of the evicted pages comes back
        t0 = time.perf_counter()
        try:
            probe = torch.empty(ask, dtype=torch.uint8, device="cuda")
            probe.fill_(7)
            torch.cuda.synchronize()
            ok, secs = True, time.perf_counter() - t0
            del probe
        except RuntimeError as e:
            ok, secs = False, repr(e)[:200]
        del filler
        torch.cuda.empty_cache()
        tier.prefetch(R).synchronize()
        out[path] = {"free_GiB_resident": round(free_resident / GiB, 3), "free_GiB_after_evict": round(free_evicted / GiB, 3),
                     "asked_GiB": round(ask / GiB, 3),
                     "cudaMalloc_ok": ok, "cudaMalloc_s": secs, "intact": bool(torch.equal(R.torch(), ref))}
        progress(f"reclaim after {path} eviction: {out[path]}")
        del R, ref
    return out


def plot(metrics: dict) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [("pinned_h2d_GBps", "ceiling: pinned H2D"), ("pinned_d2h_GBps", "ceiling: pinned D2H"),
             ("pinned_h2d_managed_GBps", "ceiling: pinned H2D into managed pages"),
             ("um_prefetch_h2d_GBps", "UM: prefetch in (1 call)"), ("um_fault_in_GBps", "UM: fault in"),
             ("um_prefetch_d2h_GBps", "UM: write back (prefetch to host)"),
             ("prefetch_in_GBps", "tiermem: group streamed in (pages of the group out)"),
             ("prefetch_in_direct_GBps", "direct: group streamed in, no staging ring"),
             ("prefetch_in_fresh_pages_GBps", "tiermem: group streamed in (fresh pages)"),
             ("prefetch_in_read_mostly_GBps", "tiermem: read-mostly group in"),
             ("prefetch_in_separate_GBps", "tiermem: separate tensors in"),
             ("prefetch_in_shadow_GBps", "tiermem: in from pinned shadow (parked pages)"),
             ("prefetch_in_shadow_fresh_pages_GBps", "tiermem: in from pinned shadow (fresh pages)"),
             ("evict_dirty_GBps", "tiermem: dirty eviction (pages parked)"),
             ("evict_dirty_direct_GBps", "direct: dirty eviction, no staging ring"),
             ("evict_dirty_release_GBps", "tiermem: dirty eviction (pages released)"),
             ("exchange_GBps", "tiermem: exchange under budget (total)"),
             ("exchange_release_GBps", "tiermem: exchange, pages released (total)"),
             ("zero_copy_read_GBps", "tiermem: zero-copy read"), ("overlap_total_GBps", "tiermem: in + out at once (total)"),
             ("overlap_read_mostly_total_GBps", "tiermem: in (read-mostly, by UM) + out at once (total)"),
             ("pinned_bidir_total_GBps", "ceiling: both ways at once (total)")]
    labels = [n for k, n in names if k in metrics]
    vals = [metrics[k] for k, _ in names if k in metrics]
    colors = ["#888" if lab.startswith("ceiling") else "#c66" if lab.startswith("UM") else
              "#9ab" if lab.startswith("direct") else "#369" for lab in labels]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    ax.barh(labels[::-1], vals[::-1], color=colors[::-1])
    for i, v in enumerate(vals[::-1]):
        ax.text(v + 0.5, i, f"{v:.1f}", va="center", fontsize=8)
    ax.set_xlabel("GB/s (1 GiB, CUDA-event medians)")
    ax.set_title("tiermem data paths vs pinned copies and plain Unified Memory")
    fig.tight_layout()
    path = plot_path("bandwidth")
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    main()
