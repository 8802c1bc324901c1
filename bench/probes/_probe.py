"""Helpers the path probes share (probe_paths*.py): sections that keep going after an
error, CUDA-event timing on a side stream, managed buffers filled on the GPU, checksums."""
import json
import os
import time
import traceback

import cupy
import numpy as np
import torch
from cuda.bindings import runtime as rt

R: dict = {}
GiB = 1 << 30
N = 1 * GiB
DEV = 0


def section(name, skip=False):
    def deco(f):
        if skip:
            return
        t = time.perf_counter()
        try:
            R[name] = f()
        except Exception as e:  # a probe keeps going: the other sections still answer
            R[name] = "ERROR " + repr(e)[:500]
            traceback.print_exc()
        print(f"{name} ({time.perf_counter() - t:.1f}s) =>", json.dumps(R[name], default=str)[:1500], flush=True)
    return deco


def chk(r):
    err = r[0] if isinstance(r, tuple) else r
    if int(err) != 0:
        raise RuntimeError(f"{err!r} {rt.cudaGetErrorName(err)[1]}")
    return r[1] if isinstance(r, tuple) and len(r) == 2 else r


def loc(dev):
    l = rt.cudaMemLocation()
    if dev < 0:
        l.type = rt.cudaMemLocationType.cudaMemLocationTypeHost
        l.id = 0
    else:
        l.type = rt.cudaMemLocationType.cudaMemLocationTypeDevice
        l.id = dev
    return l


A = rt.cudaMemoryAdvise
S1 = cupy.cuda.Stream(non_blocking=True)
S2 = cupy.cuda.Stream(non_blocking=True)


def prefetch(p, n, dev, s=S1):
    chk(rt.cudaMemPrefetchAsync(p, n, loc(dev), 0, s.ptr))


def advise(p, n, adv, dev):
    chk(rt.cudaMemAdvise(p, n, adv, loc(dev)))


def timed(fn, s=S1, reps=3, setup=None):
    """Median seconds of fn() enqueued on stream s, timed with CUDA events; setup() runs untimed."""
    ts = []
    for _ in range(reps):
        if setup:
            setup()
        cupy.cuda.Device().synchronize()
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record(s)
        with s:
            fn()
        e1.record(s)
        e1.synchronize()
        ts.append(cupy.cuda.get_elapsed_time(e0, e1) / 1e3)
    return float(np.median(ts))


def gbps(n, s):
    return round(n / s / 1e9, 2)


def managed(n):
    m = cupy.cuda.malloc_managed(n)
    return m, cupy.ndarray((n // 4,), cupy.float32, memptr=m)


def fill_random(arr):
    """GPU-side fill: random data, never zeros, and no host first touch."""
    prefetch(arr.data.ptr, arr.nbytes, DEV)
    S1.synchronize()
    arr[...] = cupy.random.random(arr.shape, dtype=cupy.float32) + 0.5
    cupy.cuda.Device().synchronize()


def checksum(arr):
    return int(arr.view(cupy.uint32).astype(cupy.uint64).sum())


def free_gib():
    return round(cupy.cuda.runtime.memGetInfo()[0] / GiB, 3)


