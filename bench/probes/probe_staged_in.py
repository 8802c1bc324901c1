"""Probe: can a refill beat the ~50 GB/s that copies into managed pages top out at?

bandwidth.py's stream-in copies from pinned shadows into device-resident managed pages at 0.88-0.93
of the pinned -> cudaMalloc rate; nothing tried so far (splitting over streams, a pull kernel)
raised that. This tries staging: the link copy lands in a ring of plain cudaMalloc slots at the full
link rate, and a second stream copies each slot on into the managed pages at HBM speed, so the link
never waits on a managed-page write. 1 GiB of random bytes, into device-resident managed pages.

  cudaMalloc          pinned -> cudaMalloc (the ceiling)
  managed             pinned -> managed, one copy (tiermem today)
  d2d_managed         cudaMalloc -> managed, one copy (what the second stream pays)
  ring_<s>x<k>        pinned -> slot on stream X, slot -> managed on stream Y; k slots of s MiB
  ring_<s>x<k>_kernel the same with torch's copy_ (a kernel) for slot -> managed
  out_*               the other way: managed (or cudaMalloc) -> pinned, direct and through the ring

Rounds are interleaved; medians of CUDA events after a warm-up; every staged variant's bytes are
checked against the source.

    python bench/probes/probe_staged_in.py [reps]
"""
from __future__ import annotations

import sys

import _path  # noqa: F401  (bench/ and the repository on sys.path)
from _common import device_view, gbps, median, progress, table, write_results

GiB, MiB = 1 << 30, 1 << 20


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    import torch

    from tiermem import Location
    from tiermem.cuda import runtime as _cuda

    N = GiB
    dev = torch.empty(N, dtype=torch.uint8, device="cuda")
    man = _cuda.managed_alloc(N, 0)
    mv = device_view(man.ptr, N)
    pin = _cuda.host_alloc(N)
    pv = device_view(pin, N)   # UVA view of pinned
    ref = torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda")
    pv.copy_(ref)
    pin_out = _cuda.host_alloc(N)
    pov = device_view(pin_out, N)
    dev.copy_(ref)
    main_s = torch.cuda.current_stream()
    X, Y = torch.cuda.Stream(), torch.cuda.Stream()
    _cuda.prefetch(man.ptr, N, Location.DEVICE, 0, main_s.cuda_stream)
    slots_mem = torch.empty(4 * 64 * MiB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()

    def timed(body) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(main_s)
        body()
        b.record(main_s)
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    def one(dst, src, n=N):
        return lambda: _cuda.memcpy_async(dst, src, n, main_s.cuda_stream)

    def ring_out(s_mib: int, k: int):
        """managed -> slot on Y, slot -> pinned on X: an eviction staged the other way."""
        s = s_mib * MiB
        base = slots_mem.data_ptr()

        def body():
            start = torch.cuda.Event()
            start.record(main_s)
            X.wait_event(start)
            Y.wait_event(start)
            freed = [None] * k
            for i, off in enumerate(range(0, N, s)):
                slot = i % k
                n = min(s, N - off)
                if freed[slot] is not None:
                    Y.wait_event(freed[slot])
                _cuda.memcpy_async(base + slot * s, man.ptr + off, n, Y.cuda_stream)
                landed = torch.cuda.Event()
                landed.record(Y)
                X.wait_event(landed)
                _cuda.memcpy_async(pin_out + off, base + slot * s, n, X.cuda_stream)
                freed[slot] = torch.cuda.Event()
                freed[slot].record(X)
            main_s.wait_stream(X)
            main_s.wait_stream(Y)
        return body

    def ring(s_mib: int, k: int, kernel: bool):
        s = s_mib * MiB
        base = slots_mem.data_ptr()

        def body():
            start = torch.cuda.Event()
            start.record(main_s)
            X.wait_event(start)
            Y.wait_event(start)
            landed = [torch.cuda.Event() for _ in range(k)]
            freed = [None] * k
            for i, off in enumerate(range(0, N, s)):
                slot = i % k
                n = min(s, N - off)
                if freed[slot] is not None:
                    X.wait_event(freed[slot])
                _cuda.memcpy_async(base + slot * s, pin + off, n, X.cuda_stream)
                landed[slot] = torch.cuda.Event()
                landed[slot].record(X)
                Y.wait_event(landed[slot])
                if kernel:
                    with torch.cuda.stream(Y):
                        mv[off:off + n].copy_(slots_mem[slot * s:slot * s + n])
                else:
                    _cuda.memcpy_async(man.ptr + off, base + slot * s, n, Y.cuda_stream)
                freed[slot] = torch.cuda.Event()
                freed[slot].record(Y)
            main_s.wait_stream(X)
            main_s.wait_stream(Y)
        return body

    def scramble():
        mv.fill_(0xA5)

    variants = {
        "cudaMalloc": (None, one(dev.data_ptr(), pin)),
        "managed": (None, one(man.ptr, pin)),
        "d2d_managed": (None, one(man.ptr, dev.data_ptr())),
    }
    for s in (16, 32, 64):
        for k in (2, 4):
            variants[f"ring_{s}x{k}"] = (scramble, ring(s, k, False))
    variants["out_cudaMalloc"] = (None, one(pin_out, dev.data_ptr()))
    variants["out_managed"] = (None, one(pin_out, man.ptr))
    for s in (32, 64):
        variants[f"out_ring_{s}x2"] = (lambda: pov.fill_(0x5A), ring_out(s, 2))
    variants["ring_32x2_kernel"] = (scramble, ring(32, 2, True))
    variants["ring_64x2_kernel"] = (scramble, ring(64, 2, True))

    times: dict[str, list[float]] = {k: [] for k in variants}
    checks: dict[str, bool] = {}
    for rnd in range(reps + 1):
        progress(f"round {rnd + 1}/{reps + 1}")
        for name, (setup, body) in variants.items():
            if setup is not None:
                setup()
            torch.cuda.synchronize()
            t = timed(body)
            if rnd > 0:
                times[name].append(t)
            if setup is not None and rnd == reps:
                checks[f"{name}_intact"] = bool(torch.equal(pov if name.startswith("out_") else mv, ref))
    metrics = {k: gbps(N, median(v)) for k, v in times.items()}
    for k in list(times):
        base = metrics["out_cudaMalloc" if k.startswith("out_") else "cudaMalloc"]
        metrics[k + "_vs_pinned"] = round(metrics[k] / base, 3)
    print(table([[k, metrics[k], metrics[k + "_vs_pinned"]] for k in times], ["variant", "GB/s", "vs pinned"]))
    write_results("probe_staged_in", metrics, checks, {"reps": reps, "times_s": times})
    _cuda.host_free(pin)
    _cuda.host_free(pin_out)


if __name__ == "__main__":
    main()
