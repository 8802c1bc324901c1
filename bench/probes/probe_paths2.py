"""Exploration of the data paths tiermem can build on (not a benchmark of tiermem itself).

Answers, on the device, the questions the transfer design depends on: how fast each way of moving
managed memory runs (UM prefetch, batched prefetch, explicit copies to pinned memory, discard,
read-mostly collapse, zero-copy reads and writes), whether device memory comes back after
eviction, and how the CUDA range/pointer queries answer. Managed memory stays at 3 GiB at most.

    python bench/probes/probe_paths2.py  ->  $OUT/probe_paths2.json (or bench/results/)
"""
from _path import RESULTS  # bench/ and the repository on sys.path
from _common import provenance  # noqa: E402
from _probe import *  # noqa: F401,F403  (shared helpers and R)
from _probe import R, section


def pinned(n):
    return cupy.cuda.alloc_pinned_memory(n)


def events_time(fn):
    """Wall time of work fn() spreads over several streams, bracketed by device-wide syncs."""
    cupy.cuda.Device().synchronize()
    t = time.perf_counter()
    fn()
    cupy.cuda.Device().synchronize()
    return time.perf_counter() - t


@section("discard_variants")
def _():
    out = {}
    m, a = managed(N)
    fill_random(a)
    p = a.data.ptr
    h = pinned(N)
    setup = lambda: (prefetch(p, N, DEV), S1.synchronize())
    copy = lambda s=S1: cupy.cuda.runtime.memcpyAsync(h.ptr, p, N, 4, s.ptr)
    disc = lambda s=S1, ptr=p, n=N: chk(rt.cudaMemDiscardBatchAsync([ptr], [n], 1, 0, s.ptr))
    out["copy_only"] = gbps(N, timed(copy, setup=setup))
    out["discard_only_resident_s"] = timed(disc, setup=setup)
    def copy_sync_discard():
        copy(); S1.synchronize(); disc(); S1.synchronize()
    ts = []
    for _ in range(3):
        setup(); ts.append(events_time(copy_sync_discard))
    out["copy_sync_then_discard"] = gbps(N, float(np.median(ts)))
    # discard in chunks interleaved with the copy
    for piece in [64 << 20, 256 << 20]:
        k = N // piece
        def chunked():
            for i in range(k):
                cupy.cuda.runtime.memcpyAsync(h.ptr + i * piece, p + i * piece, piece, 4, S1.ptr)
                disc(S1, p + i * piece, piece)
        out[f"copy_discard_chunks_{piece >> 20}MiB"] = gbps(N, timed(chunked, setup=setup))
        def chunked_batch_discard_end():
            for i in range(k):
                cupy.cuda.runtime.memcpyAsync(h.ptr + i * piece, p + i * piece, piece, 4, S1.ptr)
            chk(rt.cudaMemDiscardBatchAsync([p + i * piece for i in range(k)], [piece] * k, k, 0, S1.ptr))
        out[f"copy_chunks_batch_discard_{piece >> 20}MiB"] = gbps(N, timed(chunked_batch_discard_end, setup=setup))
    # discard on a second stream after an event
    def two_stream():
        copy(S1); e = cupy.cuda.Event(); e.record(S1); S2.wait_event(e); disc(S2)
    ts = []
    for _ in range(3):
        setup(); ts.append(events_time(two_stream))
    out["copy_then_discard_other_stream"] = gbps(N, float(np.median(ts)))
    # kernel copy (torch) managed -> pinned via a device view of pinned memory, then discard
    class CAI:
        def __init__(self, ptr, n):
            self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None, "stream": None}
    th = torch.as_tensor(CAI(h.ptr, N), device="cuda")
    tm = torch.as_tensor(CAI(p, N), device="cuda")
    ts_ = torch.cuda.ExternalStream(S1.ptr)
    with torch.cuda.stream(ts_):
        out["kernel_copy_to_pinned"] = gbps(N, timed(lambda: th.copy_(tm), setup=setup))
        out["kernel_copy_to_pinned_then_discard"] = gbps(N, timed(lambda: (th.copy_(tm), disc()), setup=setup))
    # populate host pages of a discarded range (no data to move)
    setup(); disc(); S1.synchronize()
    t = time.perf_counter(); prefetch(p, N, -1); S1.synchronize()
    out["prefetch_host_after_discard_GBps"] = gbps(N, time.perf_counter() - t)
    # refill variants: discard+prefetch then copy; copy straight into a discarded range
    def refill_dp():
        chk(rt.cudaMemDiscardAndPrefetchBatchAsync([p], [N], 1, [loc(DEV)], [0], 1, 0, S1.ptr))
        cupy.cuda.runtime.memcpyAsync(p, h.ptr, N, 4, S1.ptr)
    out["refill_discard_prefetch_copy"] = gbps(N, timed(refill_dp, setup=lambda: (setup(), disc(), S1.synchronize())))
    for piece in [64 << 20, 256 << 20]:
        k = N // piece
        def refill_pipe():
            for i in range(k):
                chk(rt.cudaMemDiscardAndPrefetchBatchAsync([p + i * piece], [piece], 1, [loc(DEV)], [0], 1, 0, S2.ptr))
                e = cupy.cuda.Event(); e.record(S2); S1.wait_event(e)
                cupy.cuda.runtime.memcpyAsync(p + i * piece, h.ptr + i * piece, piece, 4, S1.ptr)
        out[f"refill_pipelined_{piece >> 20}MiB"] = gbps(N, timed(refill_pipe, setup=lambda: (setup(), disc(), S1.synchronize())))
    with torch.cuda.stream(ts_):
        def refill_kernel():
            chk(rt.cudaMemDiscardAndPrefetchBatchAsync([p], [N], 1, [loc(DEV)], [0], 1, 0, S1.ptr))
            tm.copy_(th)
        out["refill_discard_prefetch_kernel"] = gbps(N, timed(refill_kernel, setup=lambda: (setup(), disc(), S1.synchronize())))
    out["intact"] = True
    return out


@section("overlap_variants")
def _():
    out = {}
    d1 = cupy.empty(N, cupy.uint8); d2 = cupy.empty(N, cupy.uint8)
    h1 = pinned(N); h2 = pinned(N)
    m, a = managed(N); fill_random(a); p = a.data.ptr
    mb, b = managed(N); fill_random(b); q = b.data.ptr
    def both(f1, f2):
        def run():
            f1(S1); f2(S2)
        ts = [events_time(run) for _ in range(3)]
        return gbps(2 * N, float(np.median(ts)))
    cp = lambda dst, src: (lambda s: cupy.cuda.runtime.memcpyAsync(dst, src, N, 4, s.ptr))
    out["dev_pinned_both"] = both(cp(d1.data.ptr, h1.ptr), cp(h2.ptr, d2.data.ptr))
    prefetch(p, N, DEV); prefetch(q, N, DEV); cupy.cuda.Device().synchronize()
    out["managed_out_dev_in"] = both(cp(d1.data.ptr, h1.ptr), cp(h2.ptr, p))
    out["managed_out_managed_in"] = both(cp(q, h1.ptr), cp(h2.ptr, p))
    # UM prefetch in + explicit copy out
    def um_in(s):
        prefetch(q, N, DEV, s)
    ts = []
    for _ in range(3):
        prefetch(q, N, -1); cupy.cuda.Device().synchronize()
        ts.append(events_time(lambda: (um_in(S1), cp(h2.ptr, p)(S2))))
    out["um_prefetch_in_copy_out"] = gbps(2 * N, float(np.median(ts)))
    # kernel-based copy out (device view of pinned) + copy in
    class CAI:
        def __init__(self, ptr, n):
            self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None, "stream": None}
    th2 = torch.as_tensor(CAI(h2.ptr, N), device="cuda"); tm = torch.as_tensor(CAI(p, N), device="cuda")
    def kout(s):
        with torch.cuda.stream(torch.cuda.ExternalStream(s.ptr)):
            th2.copy_(tm)
    out["kernel_out_copy_in"] = both(cp(q, h1.ptr), kout)
    out["kernel_out_dev_in"] = both(cp(d1.data.ptr, h1.ptr), kout)
    return out


def reclaim_case(evict, name):
    """Evict 2 GiB of device-resident managed memory with evict(ptr, n), then ask cudaMalloc for more
    than was free while it was resident. Success without data movement means the pages came back."""
    out = {}
    torch.cuda.empty_cache(); cupy.get_default_memory_pool().free_all_blocks()
    n = 2 * GiB
    m, a = managed(n); fill_random(a)
    f_res = cupy.cuda.runtime.memGetInfo()[0]
    evict(a.data.ptr, n)
    cupy.cuda.Device().synchronize()
    out["free_after_evict_GiB"] = free_gib()
    ask = f_res + GiB  # only possible if at least 1 GiB of the evicted 2 GiB is handed back
    t = time.perf_counter()
    try:
        big = torch.empty(ask, dtype=torch.uint8, device="cuda"); big[:: 1 << 20].fill_(1); torch.cuda.synchronize()
        out["malloc_ok"] = True; out["malloc_s"] = round(time.perf_counter() - t, 4)
        del big
    except Exception as e:
        out["malloc_ok"] = repr(e)[:120]
    torch.cuda.empty_cache()
    del a, m
    return out


@section("reclaim")
def _():
    out = {"free0_GiB": free_gib()}
    S = S1
    out["um_prefetch_host"] = reclaim_case(lambda p, n: prefetch(p, n, -1), "um")
    out["discard"] = reclaim_case(lambda p, n: chk(rt.cudaMemDiscardBatchAsync([p], [n], 1, 0, S.ptr)), "discard")
    def rm(p, n):
        prefetch(p, n, -1); S.synchronize()
        advise(p, n, A.cudaMemAdviseSetPreferredLocation, -1); advise(p, n, A.cudaMemAdviseSetReadMostly, DEV)
        prefetch(p, n, DEV); S.synchronize()
        advise(p, n, A.cudaMemAdviseUnsetReadMostly, DEV)
    out["readmostly_collapse"] = reclaim_case(rm, "rm")
    out["none_resident"] = reclaim_case(lambda p, n: None, "none")
    return out


dest = os.environ.get("OUT") or RESULTS
os.makedirs(dest, exist_ok=True)
with open(os.path.join(dest, "probe_paths2.json"), "w") as f:
    json.dump({**provenance(), **R}, f, indent=1, default=str)
