"""Can page-locking a large host block be made faster than one cudaHostRegister call (issue 19: the
load ran at 0.167 of the warm read rate; registering its 3.86 GB pinned home took 0.26 s of 0.78 s,
bench/results/probe_load-h100-20261124-68986dc.json)?

Sections, each on fresh huge-page memory written by 16 threads (tiermem.base.hostpages.map_pages):
  first_small    the process's first registration, of 2 MiB (the first of a process paid more)
  one            one cudaHostRegister of the whole block
  serial_K       K registrations of adjacent chunks, one after another
  threads_K      the same K registrations from K threads at once
  across         with the block registered in chunks: H2D copy rate of 256 MiB inside one chunk and
                 across a chunk boundary; a CuPy kernel summing, through the mapped host address,
                 a range across the boundary (equal to the host's sum?)
  pipeline       read a warm file into the block chunk by chunk on 16 threads, registering each
                 chunk on another thread as soon as it is read, against reading all then
                 registering once
  beside_copies  one registration while the main thread copies 1.4 GB host-to-device through a
                 pinned buffer (a load's resident groups): each alone and both at once

    python bench/probes/probe_register.py [--n-gb 3.86] [--quick]
Writes $OUT/probe_register.json (or bench/results/probe_register-<date>.json).
"""
import argparse
import ctypes
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import _path  # noqa: F401
from _common import provenance  # noqa: E402
import numpy as np
import torch
from _probe import R, section
from _probe import chk as ok
from cuda.bindings import runtime as rt

from tiermem.base import hostpages as _hostpages

FLAGS = rt.cudaHostRegisterPortable | rt.cudaHostRegisterMapped


def chunks(ptr, n, k):
    step = -(-n // k)
    step = -(-step // (2 << 20)) * (2 << 20)
    return [(ptr + s, min(step, n - s)) for s in range(0, n, step)]


def timed(f):
    t = time.perf_counter()
    out = f()
    return round(time.perf_counter() - t, 4), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-gb", type=float, default=3.86)
    ap.add_argument("--file", default="/tmp/tiermem-probe-register.bin")
    ap.add_argument("--quick", action="store_true", help="first_small and one only")
    args = ap.parse_args()
    N = int(args.n_gb * 1e9) // (2 << 20) * (2 << 20)
    R["N"] = N
    torch.empty(1, device="cuda")
    R["device"] = torch.cuda.get_device_name()
    R["cores"] = os.cpu_count()

    def fresh():
        return _hostpages.map_pages(N, threads=16, touch=True)

    def unregister(parts):
        for p, _ in parts:
            ok(rt.cudaHostUnregister(p))

    @section("first_small")
    def _():
        # The first registration of a process paid 0.28 s more than later ones: is that fixed,
        # whatever the size (so a small one made early, off the critical path, takes it)?
        small = 2 << 20
        ptr = _hostpages.map_pages(small, threads=1, touch=True)
        t, _r = timed(lambda: ok(rt.cudaHostRegister(ptr, small, FLAGS)))
        t2, _r = timed(lambda: ok(rt.cudaHostUnregister(ptr)))
        _hostpages.unmap_pages(ptr, small)
        return {"register_s": t, "unregister_s": t2}

    @section("one")
    def _():
        out = []
        for _ in range(2):
            ptr = fresh()
            t, _r = timed(lambda: ok(rt.cudaHostRegister(ptr, N, FLAGS)))
            out.append(t)
            ok(rt.cudaHostUnregister(ptr))
            _hostpages.unmap_pages(ptr, N)
        return {"s": out, "GBps": round(N / min(out) / 1e9, 2)}

    for k in (4, 8, 16):
        @section(f"serial_{k}", skip=args.quick)
        def _(k=k):
            ptr = fresh()
            parts = chunks(ptr, N, k)
            t, _r = timed(lambda: [ok(rt.cudaHostRegister(p, n, FLAGS)) for p, n in parts])
            unregister(parts)
            _hostpages.unmap_pages(ptr, N)
            return {"s": t, "GBps": round(N / t / 1e9, 2)}

        @section(f"threads_{k}", skip=args.quick)
        def _(k=k):
            out = []
            for _ in range(2):
                ptr = fresh()
                parts = chunks(ptr, N, k)
                with ThreadPoolExecutor(k) as ex:
                    t, _r = timed(lambda: list(ex.map(lambda pn: ok(rt.cudaHostRegister(pn[0], pn[1], FLAGS)), parts)))
                out.append(t)
                unregister(parts)
                _hostpages.unmap_pages(ptr, N)
            return {"s": out, "GBps": round(N / min(out) / 1e9, 2)}

    @section("across", skip=args.quick)
    def _():
        import cupy
        ptr = fresh()
        parts = chunks(ptr, N, 8)
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda pn: ok(rt.cudaHostRegister(pn[0], pn[1], FLAGS)), parts))
        host = np.ctypeslib.as_array((ctypes.c_uint8 * N).from_address(ptr))
        rng = np.random.default_rng(1)
        host[: 256 << 20] = rng.integers(0, 255, 256 << 20, dtype=np.uint8)
        boundary = parts[1][0] - ptr
        host[boundary - (1 << 28): boundary + (1 << 28)] = rng.integers(0, 255, 1 << 29, dtype=np.uint8)
        dev = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        s = torch.cuda.Stream()

        def rate(off):
            ts = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(s):
                    a.record()
                    ok(rt.cudaMemcpyAsync(dev.data_ptr(), ptr + off, 256 << 20, rt.cudaMemcpyKind.cudaMemcpyHostToDevice, s.cuda_stream))
                    b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b))
            return round((256 << 20) / (sorted(ts)[2] / 1e3) / 1e9, 2)

        inside = rate(0)
        spanning = rate(boundary - (128 << 20))
        attr = ok(rt.cudaPointerGetAttributes(ptr + boundary - 4096))
        attr2 = ok(rt.cudaPointerGetAttributes(ptr + boundary))
        mem = cupy.cuda.UnownedMemory(ptr + boundary - (128 << 20), 256 << 20, None, 0)
        arr = cupy.ndarray(256 << 20, dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        got = int(arr.astype(cupy.uint64).sum())
        want = int(host[boundary - (128 << 20): boundary + (128 << 20)].astype(np.uint64).sum())
        unregister(parts)
        _hostpages.unmap_pages(ptr, N)
        return {"inside_GBps": inside, "spanning_GBps": spanning, "kernel_sum_equal": got == want,
                "attr_types": [str(attr.type), str(attr2.type)],
                "devptr_is_hostptr": [int(attr.devicePointer) == ptr + boundary - 4096, int(attr2.devicePointer) == ptr + boundary]}

    @section("pipeline", skip=args.quick)
    def _():
        blk = np.random.default_rng(2).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
        with open(args.file, "wb") as f:
            for _ in range(-(-N // len(blk))):
                f.write(blk)
        fd = os.open(args.file, os.O_RDONLY)
        try:
            def read_into(p, n, pool, piece=16 << 20):
                def one(o):
                    m = min(piece, n - o)
                    buf = (ctypes.c_char * m).from_address(p + o)
                    got = os.preadv(fd, [memoryview(buf).cast("B")], (p - base[0]) + o)
                    assert got == m
                list(pool.map(one, range(0, n, piece)))

            base = [0]
            out = {}
            with ThreadPoolExecutor(16) as pool:
                for _ in range(2):                                  # warm the cache, then time
                    ptr = _hostpages.map_pages(N, touch=False)
                    base[0] = ptr
                    t0 = time.perf_counter()
                    read_into(ptr, N, pool)
                    t1 = time.perf_counter()
                    ok(rt.cudaHostRegister(ptr, N, FLAGS))
                    t2 = time.perf_counter()
                    ok(rt.cudaHostUnregister(ptr))
                    _hostpages.unmap_pages(ptr, N)
                    out["sequential"] = {"read_s": round(t1 - t0, 4), "register_s": round(t2 - t1, 4), "total_s": round(t2 - t0, 4)}
                for k in (4, 8, 16):
                    ptr = _hostpages.map_pages(N, touch=False)
                    base[0] = ptr
                    parts = chunks(ptr, N, k)
                    t0 = time.perf_counter()
                    with ThreadPoolExecutor(1) as reg:
                        futs = []
                        for p, n in parts:
                            read_into(p, n, pool)
                            futs.append(reg.submit(lambda p=p, n=n: ok(rt.cudaHostRegister(p, n, FLAGS))))
                        for f in futs:
                            f.result()
                    out[f"pipelined_{k}"] = round(time.perf_counter() - t0, 4)
                    unregister(parts)
                    _hostpages.unmap_pages(ptr, N)
            return out
        finally:
            os.close(fd)
            os.unlink(args.file)

    @section("beside_copies", skip=args.quick)
    def _():
        src = torch.empty(128 << 20, dtype=torch.uint8).pin_memory()
        src.random_(0, 255)
        dst = torch.empty(int(1.4e9) // (128 << 20) * (128 << 20), dtype=torch.uint8, device="cuda")

        def copies():
            for o in range(0, dst.numel(), src.numel()):
                dst[o:o + src.numel()].copy_(src, non_blocking=True)
            torch.cuda.synchronize()

        copies()
        alone_copies, _r = timed(copies)
        ptr = fresh()
        alone_reg, _r = timed(lambda: ok(rt.cudaHostRegister(ptr, N, FLAGS)))
        ok(rt.cudaHostUnregister(ptr))
        _hostpages.unmap_pages(ptr, N)
        ptr = fresh()
        with ThreadPoolExecutor(1) as ex:
            t0 = time.perf_counter()
            f = ex.submit(lambda: timed(lambda: ok(rt.cudaHostRegister(ptr, N, FLAGS)))[0])
            c, _r = timed(copies)
            r = f.result()
            both = time.perf_counter() - t0
        ok(rt.cudaHostUnregister(ptr))
        _hostpages.unmap_pages(ptr, N)
        return {"copies_alone_s": alone_copies, "register_alone_s": alone_reg, "together_s": round(both, 4),
                "copies_beside_s": c, "register_beside_s": r}

    out = os.environ.get("OUT") or os.path.join(_path.BENCH, "results")
    name = "probe_register.json" if os.environ.get("OUT") else f"probe_register-{time.strftime('%Y%m%d')}.json"
    with open(os.path.join(out, name), "w") as f:
        json.dump({**provenance(), **R}, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
