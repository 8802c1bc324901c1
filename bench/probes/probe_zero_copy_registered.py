"""Does the GPU read registered host memory in place (zero-copy) as fast as cudaHostAlloc's?
After large homes moved to registration (NOTE [pinned by registration]), Mixtral's decode in
bench/offload_infer.py went from 0.42-0.45x to 0.85x of the dense bound. For 1 GiB from
cudaHostAlloc, from anonymous memory registered with and without huge pages: a kernel reading
all of it in place, and one reading a quarter in 4 runs (as routed experts are), CUDA events,
median of 7 after a warm-up; and the copy engine's H2D rate from each.

    python bench/probes/probe_zero_copy_registered.py
"""
import json
import os
import statistics

import _path  # noqa: F401
import torch
from _common import cuda_times, provenance
from cuda.bindings import runtime as rt

from tiermem.base import hostpages as _hostpages
from tiermem.cuda.backend import CudaBackend

N = 1 << 30
R = {}


def ok(r):
    e = r[0] if isinstance(r, tuple) else r
    assert int(e) == 0, e
    return r[1] if isinstance(r, tuple) and len(r) > 1 else None


def timed(fn, reps=7):
    return statistics.median(cuda_times(fn, reps, warmup=1))


def measure(ptr, be, name):
    v = be.torch_view(ptr, N, None)           # a CUDA tensor over the host pages
    v.copy_(torch.randint(0, 100, (N,), dtype=torch.uint8, device="cuda"))
    f = v.view(torch.float16)
    full = timed(lambda: f.sum(dtype=torch.float32))
    q = N // 2 // 8                            # 4 runs of 1/16 each, a quarter in all
    runs = [f[i * (N // 2 // 4): i * (N // 2 // 4) + q] for i in range(4)]
    quarter = timed(lambda: [r.sum(dtype=torch.float32) for r in runs])
    d = torch.empty(N, dtype=torch.uint8, device="cuda")
    s = torch.cuda.current_stream().cuda_stream
    h2d = timed(lambda: be.copy(d.data_ptr(), ptr, N, s))
    R[name] = {"zero_copy_full_GBps": round(N / full / 1e9, 2), "zero_copy_quarter_GBps": round(N / 4 / quarter / 1e9, 2),
               "h2d_copy_GBps": round(N / h2d / 1e9, 2)}
    print(name, R[name], flush=True)


def main():
    torch.empty(1, device="cuda")
    be = CudaBackend(0)
    p = ok(rt.cudaHostAlloc(N, rt.cudaHostAllocPortable | rt.cudaHostAllocMapped))
    measure(p, be, "cudaHostAlloc")
    ok(rt.cudaFreeHost(p))
    for huge in (True, False):
        old = _hostpages.MADV_HUGEPAGE
        if not huge:
            _hostpages.MADV_HUGEPAGE = 15      # MADV_NOHUGEPAGE
        ptr = _hostpages.map_pages(N, 8)
        _hostpages.MADV_HUGEPAGE = old
        ok(rt.cudaHostRegister(ptr, N, rt.cudaHostRegisterPortable | rt.cudaHostRegisterMapped))
        measure(ptr, be, f"registered_{'thp' if huge else '4k'}")
        ok(rt.cudaHostUnregister(ptr))
        _hostpages.unmap_pages(ptr, N)
    with open(os.path.join(os.environ.get("OUT") or _path.RESULTS, "probe_zero_copy_registered.json"), "w") as fh:
        json.dump({**provenance(), **R}, fh, indent=1)


if __name__ == "__main__":
    main()
