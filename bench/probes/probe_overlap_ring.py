"""Probe: with the staging ring, do an eviction and a refill overlap across the two directions?

tiermem runs every move on one stream (UM_STREAMS in tiermem/core/sidestreams.py), because moves that touch
managed memory never overlapped across directions (probe_paths2). Through the ring (NOTE [staging
ring] in tiermem/cuda/staging.py) the link copies touch only pinned memory and cudaMalloc slots; only
the device-side copies touch managed pages. This times 1 GiB out of managed pages and 1 GiB into
other managed pages, with tiermem's real StagingRing and CudaBackend:

  pinned_both          cudaMalloc <-> pinned, one stream per direction (the ceiling)
  direct_both          managed -> pinned and pinned -> managed, one stream per direction
  ring_in, ring_out    one direction alone, through a ring
  ring_both_one        both through one ring on one stream, out then in (tiermem today)
  ring_both_two        each direction through its own ring on its own stream

Rounds interleaved; CUDA-event medians after a warm-up; bytes checked after the last round.

    python bench/probes/probe_overlap_ring.py [reps]
"""
from __future__ import annotations

import sys

import _path  # noqa: F401  (bench/ and the repository on sys.path)
from _common import device_view, gbps, median, progress, table, write_results

GiB = 1 << 30


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    import torch

    from tiermem import Location
    from tiermem.cuda import runtime as _cuda
    from tiermem.cuda.backend import CudaBackend
    from tiermem.cuda.staging import StagingRing

    N = GiB
    be = CudaBackend(0, cap="3GiB")
    view = lambda p: device_view(p, N)  # noqa: E731
    m_in, m_out = _cuda.managed_alloc(N, 0), _cuda.managed_alloc(N, 0)
    p_in, p_out = _cuda.host_alloc(N), _cuda.host_alloc(N)
    dev_a, dev_b = torch.empty(N, dtype=torch.uint8, device="cuda"), torch.empty(N, dtype=torch.uint8, device="cuda")
    ref_in = torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda")
    ref_out = torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda")
    view(p_in).copy_(ref_in)
    main_s = torch.cuda.current_stream().cuda_stream
    for m in (m_in, m_out):
        _cuda.prefetch(m.ptr, N, Location.DEVICE, 0, main_s)
    view(m_out.ptr).copy_(ref_out)
    dev_b.copy_(ref_out)
    s_in, s_out = be.new_stream(), be.new_stream()
    ring_a, ring_b = StagingRing(be), StagingRing(be)
    ring_a.allocate()
    ring_b.allocate()
    torch.cuda.synchronize()

    def fork(*streams):
        ev = be.new_event()
        be.record(ev, main_s)
        for s in streams:
            be.wait(s, ev)

    def join(*streams):
        for s in streams:
            ev = be.new_event()
            be.record(ev, s)
            be.wait(main_s, ev)

    def session(ring, side, direction, dst, src):
        sess = ring.session(side, direction)
        sess.add(dst, src, N)
        sess.close()

    def pinned_both():
        fork(s_in, s_out)
        be.copy(dev_a.data_ptr(), p_in, N, s_in)
        be.copy(p_out, dev_b.data_ptr(), N, s_out)
        join(s_in, s_out)

    def direct_both():
        fork(s_in, s_out)
        be.copy(m_in.ptr, p_in, N, s_in)
        be.copy(p_out, m_out.ptr, N, s_out)
        join(s_in, s_out)

    def ring_in():
        fork(s_in)
        session(ring_a, s_in, "h2d", m_in.ptr, p_in)
        join(s_in)

    def ring_out():
        fork(s_out)
        session(ring_b, s_out, "d2h", p_out, m_out.ptr)
        join(s_out)

    def ring_both_one():
        fork(s_in)
        session(ring_a, s_in, "d2h", p_out, m_out.ptr)
        session(ring_a, s_in, "h2d", m_in.ptr, p_in)
        join(s_in)

    def ring_both_two():
        fork(s_in, s_out)
        session(ring_b, s_out, "d2h", p_out, m_out.ptr)
        session(ring_a, s_in, "h2d", m_in.ptr, p_in)
        join(s_in, s_out)

    variants = {"pinned_both": pinned_both, "direct_both": direct_both, "ring_in": ring_in, "ring_out": ring_out,
                "ring_both_one": ring_both_one, "ring_both_two": ring_both_two}
    moved = {"ring_in": N, "ring_out": N}
    times: dict[str, list[float]] = {k: [] for k in variants}
    checks: dict[str, bool] = {}

    def scramble():
        view(m_in.ptr).fill_(0x5A)
        view(p_out).fill_(0xA5)
        torch.cuda.synchronize()

    for rnd in range(reps + 1):
        progress(f"round {rnd + 1}/{reps + 1}")
        for name, body in variants.items():
            scramble()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            body()
            b.record()
            b.synchronize()
            if rnd:
                times[name].append(a.elapsed_time(b) / 1e3)
            if rnd == reps and name != "pinned_both":
                ok_in = name == "ring_out" or bool(torch.equal(view(m_in.ptr), ref_in))
                ok_out = name == "ring_in" or bool(torch.equal(view(p_out), ref_out))
                checks[f"{name}_intact"] = ok_in and ok_out
    metrics = {k: gbps(moved.get(k, 2 * N), median(v)) for k, v in times.items()}
    for k in list(times):
        metrics[k + "_vs_pinned_both"] = round(metrics[k] / metrics["pinned_both"], 3)
    print(table([[k, metrics[k], metrics[k + "_vs_pinned_both"]] for k in times], ["variant", "GB/s (total)", "vs pinned_both"]))
    print(checks)
    write_results("probe_overlap_ring", metrics, checks, {"reps": reps, "times_s": times})
    _cuda.host_free(p_in)
    _cuda.host_free(p_out)


if __name__ == "__main__":
    main()
