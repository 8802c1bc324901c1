"""Exploration of the data paths tiermem can build on (not a benchmark of tiermem itself).

Answers, on the device, the questions the transfer design depends on: how fast each way of moving
managed memory runs (UM prefetch, batched prefetch, explicit copies to pinned memory, discard,
read-mostly collapse, zero-copy reads and writes), whether device memory comes back after
eviction, and how the CUDA range/pointer queries answer. Managed memory stays at 3 GiB at most.

    python bench/probes/probe_paths.py  ->  $OUT/probe_paths.json (or bench/results/)
"""
from _path import RESULTS  # bench/ and the repository on sys.path
from _common import provenance  # noqa: E402
from _probe import *  # noqa: F401,F403  (shared helpers and R)
from _probe import R, section


@section("env")
def _():
    p = chk(rt.cudaGetDeviceProperties(DEV))
    return {"name": p.name.decode() if isinstance(p.name, bytes) else str(p.name), "torch": torch.__version__,
            "cupy": cupy.__version__, "driver": chk(rt.cudaDriverGetVersion()), "runtime": chk(rt.cudaRuntimeGetVersion()),
            "free_GiB": free_gib()}


@section("alignment")
def _():
    out = {}
    keep = []
    for size in [512, 4096, 65536, 1 << 20, 3 << 20, 5 << 20]:
        m = cupy.cuda.malloc_managed(size)
        keep.append(m)
        out[size] = {"mod_4K": m.ptr % 4096, "mod_64K": m.ptr % 65536, "mod_2M": m.ptr % (2 << 20)}
    return out


@section("queries")
def _():
    m, a = managed(8 << 20)
    attrs = chk(rt.cudaPointerGetAttributes(a.data.ptr))
    p, n = a.data.ptr, a.nbytes
    out = {"ptr_type": str(attrs.type), "ptr_device": attrs.device}
    advise(p, n, A.cudaMemAdviseSetPreferredLocation, -1)
    advise(p, n, A.cudaMemAdviseSetAccessedBy, DEV)
    advise(p, n, A.cudaMemAdviseSetReadMostly, DEV)
    prefetch(p, n, -1)
    S1.synchronize()
    RA = rt.cudaMemRangeAttribute
    for name, size in [("cudaMemRangeAttributeReadMostly", 4), ("cudaMemRangeAttributePreferredLocation", 4),
                       ("cudaMemRangeAttributePreferredLocationType", 4), ("cudaMemRangeAttributePreferredLocationId", 4),
                       ("cudaMemRangeAttributeAccessedBy", 12), ("cudaMemRangeAttributeLastPrefetchLocation", 4),
                       ("cudaMemRangeAttributeLastPrefetchLocationType", 4), ("cudaMemRangeAttributeLastPrefetchLocationId", 4)]:
        try:
            r = rt.cudaMemRangeGetAttribute(size, getattr(RA, name), p, n)
            out[name] = [repr(r[0]), repr(r[1]), type(r[1]).__name__]
        except Exception as e:
            out[name] = "ERR " + repr(e)[:200]
    # host pointer, device pointer, pinned pointer types
    h = cupy.cuda.alloc_pinned_memory(4096)
    d = cupy.cuda.alloc(4096)
    out["pinned_type"] = str(chk(rt.cudaPointerGetAttributes(h.ptr)).type)
    out["device_type"] = str(chk(rt.cudaPointerGetAttributes(d.ptr)).type)
    out["bad_advise"] = repr(rt.cudaMemAdvise(d.ptr, 4096, A.cudaMemAdviseSetReadMostly, loc(DEV)))
    out["err_name"] = repr(rt.cudaGetErrorName(rt.cudaError_t.cudaErrorInvalidValue))
    return out


@section("paths")
def _():
    out = {}
    ma, a = managed(N)
    fill_random(a)
    ref = checksum(a)
    h = cupy.cuda.alloc_pinned_memory(N)
    hp = h.ptr
    p = a.data.ptr
    dev_buf = cupy.empty(N // 4, cupy.float32)
    dev_buf[...] = a
    cupy.cuda.Device().synchronize()

    # raw pinned ceilings
    out["pinned_h2d"] = gbps(N, timed(lambda: cupy.cuda.runtime.memcpyAsync(dev_buf.data.ptr, hp, N, 1, S1.ptr)))
    out["pinned_d2h"] = gbps(N, timed(lambda: cupy.cuda.runtime.memcpyAsync(hp, dev_buf.data.ptr, N, 2, S1.ptr)))

    # UM baselines
    out["um_prefetch_d2h"] = gbps(N, timed(lambda: prefetch(p, N, -1), setup=lambda: (prefetch(p, N, DEV), S1.synchronize())))
    out["um_prefetch_h2d_1call"] = gbps(N, timed(lambda: prefetch(p, N, DEV), setup=lambda: (prefetch(p, N, -1), S1.synchronize())))
    for piece in [2 << 20, 16 << 20, 64 << 20]:
        k = N // piece

        def loop():
            for i in range(k):
                prefetch(p + i * piece, piece, DEV)

        def batch():
            chk(rt.cudaMemPrefetchBatchAsync([p + i * piece for i in range(k)], [piece] * k, k, [loc(DEV)], [0], 1, 0, S1.ptr))

        setup = lambda: (prefetch(p, N, -1), S1.synchronize())
        out[f"um_prefetch_h2d_loop_{piece >> 20}MiB"] = gbps(N, timed(loop, setup=setup))
        try:
            out[f"um_prefetch_h2d_batch_{piece >> 20}MiB"] = gbps(N, timed(batch, setup=setup))
        except Exception as e:
            out[f"um_prefetch_h2d_batch_{piece >> 20}MiB"] = "ERR " + repr(e)[:200]
    prefetch(p, N, DEV)
    S1.synchronize()
    out["intact_after_um_moves"] = checksum(a) == ref

    # dirty evict: explicit copy of device-resident managed -> pinned, then discard the managed range
    cupy.cuda.Device().synchronize()
    out["copy_managed_to_pinned"] = gbps(N, timed(lambda: cupy.cuda.runtime.memcpyAsync(hp, p, N, 4, S1.ptr),
                                                  setup=lambda: (prefetch(p, N, DEV), S1.synchronize())))
    f_before = free_gib()

    def discard():
        chk(rt.cudaMemDiscardBatchAsync([p], [N], 1, 0, S1.ptr))

    try:
        out["discard_s"] = timed(discard, setup=lambda: (prefetch(p, N, DEV), S1.synchronize()))
        out["copy_then_discard"] = gbps(N, timed(lambda: (cupy.cuda.runtime.memcpyAsync(hp, p, N, 4, S1.ptr), discard()),
                                                 setup=lambda: (prefetch(p, N, DEV), S1.synchronize())))
        out["free_after_discard_delta_GiB"] = round(free_gib() - f_before, 3)
        # refill: discard+prefetch (allocate device pages, move nothing) then copy pinned -> managed
        def refill():
            chk(rt.cudaMemDiscardAndPrefetchBatchAsync([p], [N], 1, [loc(DEV)], [0], 1, 0, S1.ptr))
            cupy.cuda.runtime.memcpyAsync(p, hp, N, 4, S1.ptr)
        out["discard_prefetch_then_copy_in"] = gbps(N, timed(refill, setup=lambda: (discard(), S1.synchronize())))
        out["discard_prefetch_alone_s"] = timed(
            lambda: chk(rt.cudaMemDiscardAndPrefetchBatchAsync([p], [N], 1, [loc(DEV)], [0], 1, 0, S1.ptr)),
            setup=lambda: (discard(), S1.synchronize()))
        refill()
        S1.synchronize()
        out["intact_after_pinned_roundtrip"] = checksum(a) == ref
        # what a reader sees after a discard (documented as indeterminate)
        discard()
        S1.synchronize()
        out["read_after_discard_equal"] = checksum(a) == ref
        refill()
        S1.synchronize()
    except Exception as e:
        out["discard_error"] = repr(e)[:300]
        traceback.print_exc()

    # clean evict through read-mostly duplication with preferred location host
    prefetch(p, N, -1)
    S1.synchronize()
    advise(p, N, A.cudaMemAdviseSetPreferredLocation, -1)
    advise(p, N, A.cudaMemAdviseSetReadMostly, DEV)
    out["readmostly_prefetch_h2d"] = gbps(N, timed(lambda: prefetch(p, N, DEV), reps=1))
    out["readmostly_gpu_sum_s"] = timed(lambda: a.sum(), reps=3)
    t = time.perf_counter()
    advise(p, N, A.cudaMemAdviseUnsetReadMostly, DEV)
    out["unset_readmostly_s"] = round(time.perf_counter() - t, 4)
    advise(p, N, A.cudaMemAdviseSetAccessedBy, DEV)  # reads go over the link instead of faulting
    out["after_collapse_gpu_sum_s"] = timed(lambda: a.sum(), reps=1)
    out["after_collapse_intact"] = checksum(a) == ref
    # the read-mostly cycle again with timing of re-set + prefetch
    advise(p, N, A.cudaMemAdviseSetReadMostly, DEV)
    t = time.perf_counter()
    prefetch(p, N, DEV)
    S1.synchronize()
    out["readmostly_prefetch_again_s"] = round(time.perf_counter() - t, 4)
    t = time.perf_counter()
    prefetch(p, N, -1)
    S1.synchronize()
    out["readmostly_prefetch_to_host_s"] = round(time.perf_counter() - t, 4)
    out["after_rm_prefetch_host_gpu_sum_s"] = timed(lambda: a.sum(), reps=1)
    advise(p, N, A.cudaMemAdviseUnsetReadMostly, DEV)

    # zero-copy read: preferred host + accessed-by GPU, data on host
    prefetch(p, N, -1)
    S1.synchronize()
    ta = torch.as_tensor(a, device="cuda")
    out["torch_view_same_ptr"] = ta.data_ptr() == p
    ts = torch.cuda.ExternalStream(S1.ptr)
    with torch.cuda.stream(ts):
        out["zero_copy_sum_torch"] = gbps(N, timed(lambda: ta.sum(), reps=3))
        out["zero_copy_sum_cupy"] = gbps(N, timed(lambda: a.sum(), reps=3))
        # zero-copy write into host-resident pages from a device buffer
        out["zero_copy_write_memcpy"] = gbps(N, timed(lambda: cupy.cuda.runtime.memcpyAsync(p, dev_buf.data.ptr, N, 4, S1.ptr), reps=3))
        tdev = torch.as_tensor(dev_buf, device="cuda")
        out["zero_copy_write_kernel"] = gbps(N, timed(lambda: ta.copy_(tdev), reps=3))
    out["zero_copy_last_prefetch"] = repr(rt.cudaMemRangeGetAttribute(4, rt.cudaMemRangeAttribute.cudaMemRangeAttributeLastPrefetchLocation, p, N))
    # pinned memory as a device tensor through the array interface
    class CAI:
        def __init__(self, ptr, n):
            self.__cuda_array_interface__ = {"shape": (n // 4,), "typestr": "<f4", "data": (ptr, False), "version": 3, "strides": None, "stream": None}
    try:
        tp = torch.as_tensor(CAI(hp, N), device="cuda")
        with torch.cuda.stream(ts):
            out["pinned_cai_device"] = str(tp.device)
            out["pinned_cai_sum"] = gbps(N, timed(lambda: tp.sum(), reps=3))
    except Exception as e:
        out["pinned_cai"] = repr(e)[:300]
    advise(p, N, A.cudaMemAdviseUnsetAccessedBy, DEV)
    advise(p, N, A.cudaMemAdviseUnsetPreferredLocation, DEV)

    # overlap: UM prefetch-in of b while a's device copy goes out to pinned
    mb, b = managed(N)
    fill_random(b)
    prefetch(b.data.ptr, N, -1)
    prefetch(p, N, DEV)
    cupy.cuda.Device().synchronize()
    t0 = cupy.cuda.Event(); t0.record(S1)
    S2.wait_event(t0)
    prefetch(b.data.ptr, N, DEV, S1)
    cupy.cuda.runtime.memcpyAsync(hp, p, N, 4, S2.ptr)
    e2 = cupy.cuda.Event(); e2.record(S2); S1.wait_event(e2)
    t1 = cupy.cuda.Event(); t1.record(S1); t1.synchronize()
    out["overlap_prefetch_in_plus_copy_out_total"] = gbps(2 * N, cupy.cuda.get_elapsed_time(t0, t1) / 1e3)
    # overlap with explicit copies both ways
    h2 = cupy.cuda.alloc_pinned_memory(N)
    cupy.cuda.Device().synchronize()
    t0 = cupy.cuda.Event(); t0.record(S1); S2.wait_event(t0)
    cupy.cuda.runtime.memcpyAsync(b.data.ptr, h2.ptr, N, 4, S1.ptr)
    cupy.cuda.runtime.memcpyAsync(hp, p, N, 4, S2.ptr)
    e2 = cupy.cuda.Event(); e2.record(S2); S1.wait_event(e2)
    t1 = cupy.cuda.Event(); t1.record(S1); t1.synchronize()
    out["overlap_copy_both_total"] = gbps(2 * N, cupy.cuda.get_elapsed_time(t0, t1) / 1e3)
    del b, mb
    del ta, a, ma
    return out


@section("reclaim")
def _():
    """Does device memory come back after eviction? Ask cudaMalloc for nearly all of it and time it."""
    out = {}
    torch.cuda.empty_cache()
    cupy.get_default_memory_pool().free_all_blocks()
    f0 = chk(rt.cudaMemGetInfo())[0]
    out["free0_GiB"] = round(f0 / GiB, 3)
    m, a = managed(2 * GiB)
    fill_random(a)
    out["free_after_prefetch_GiB"] = free_gib()
    prefetch(a.data.ptr, a.nbytes, -1)
    S1.synchronize()
    out["free_after_um_evict_GiB"] = free_gib()
    ask = f0 - (1 * GiB)  # more than is free while 2 GiB sits resident, less than all
    t = time.perf_counter()
    try:
        big = torch.empty(ask, dtype=torch.uint8, device="cuda")
        big[::1 << 20].fill_(1)
        torch.cuda.synchronize()
        out["cudaMalloc_after_evict_ok"] = True
        out["cudaMalloc_after_evict_s"] = round(time.perf_counter() - t, 4)
        out["free_with_big_GiB"] = free_gib()
        del big
    except Exception as e:
        out["cudaMalloc_after_evict_ok"] = repr(e)[:200]
    torch.cuda.empty_cache()
    # the same ask while the 2 GiB is resident on the GPU: does the driver evict managed pages for it?
    prefetch(a.data.ptr, a.nbytes, DEV)
    S1.synchronize()
    ref = checksum(a)
    t = time.perf_counter()
    try:
        big = torch.empty(ask, dtype=torch.uint8, device="cuda")
        big[::1 << 20].fill_(1)
        torch.cuda.synchronize()
        out["cudaMalloc_while_resident_ok"] = True
        out["cudaMalloc_while_resident_s"] = round(time.perf_counter() - t, 4)
        del big
    except Exception as e:
        out["cudaMalloc_while_resident_ok"] = repr(e)[:200]
    torch.cuda.empty_cache()
    out["intact"] = checksum(a) == ref
    return out


dest = os.environ.get("OUT") or RESULTS
os.makedirs(dest, exist_ok=True)
with open(os.path.join(dest, "probe_paths.json"), "w") as f:
    json.dump({**provenance(), **R}, f, indent=1, default=str)
