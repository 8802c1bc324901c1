"""Where load_pretrained's time and host memory go (issue: load at 0.072 of the warm read rate,
peak host 1.28x the host budget, bench/offload_disk.py on the H200 at b8b73ed).

Sections, each timed on its own:
  pin          ways to get N bytes of pinned host memory ready to hold data: cudaHostAlloc; an
               anonymous mapping written by 8 threads then cudaHostRegister'ed, with and
               without transparent huge pages; cudaHostRegister on untouched memory; the
               checkpoint file's own mapping registered read-only
  read         N bytes of the (warm) checkpoint read on 8 threads into fresh memory and into
               memory already written
  load_small   load_pretrained of a tiny checkpoint: host memory it adds beyond its pinned bytes
               (what is fixed: library pages, CUDA modules)
  load_big     load_pretrained of the bench's checkpoint (cache warm) under cProfile: the main
               thread's top calls; host memory by kind (anon, file, shmem) at its peak

    python bench/probes/probe_load.py [--weights-gb 12.5] [--budget 2GB] [--host-budget 4GB] [--load-only]
Writes $OUT/probe_load.json (or bench/results/probe_load-<date>.json).
"""
import argparse
import cProfile
import ctypes
import gc
import io
import json
import mmap
import os
import pstats
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import _path  # noqa: F401
from _common import provenance  # noqa: E402
import torch
from _probe import R, section
from cuda.bindings import runtime as rt

sys.path.insert(0, os.path.join(_path.BENCH))
from offload_disk import HostWatch, drop_cache, files_of, pinned_counts_in_rss, qwen2_config, read_rate  # noqa: E402

libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_HUGEPAGE = 14


def status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k = line.split(":")[0]
            if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmLck", "VmPin"):
                out[k] = int(line.split()[1]) * 1024
    return out


def anon_huge() -> int:
    """Bytes of this process's anonymous memory in transparent huge pages."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


class KindWatch(HostWatch):
    """HostWatch that also keeps /proc/self/status's RSS parts at the peak."""

    def __init__(self):
        self.at_peak = status()
        super().__init__()

    def _run(self):
        while not self._stop.wait(0.005):
            r = self.rss()
            if r > self.peak:
                self.peak = r
                self.at_peak = status()

    def reset(self):
        self.at_peak = status()
        return super().reset()


def ok(err):
    e = err[0] if isinstance(err, tuple) else err
    if e != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(str(e))
    return err[1] if isinstance(err, tuple) and len(err) > 1 else None


def anon(n, huge):
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    if huge:
        libc.madvise(ptr, n, MADV_HUGEPAGE)
    return m, ptr


def touch(ptr, n, threads=8):
    step = -(-n // threads)
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda i: libc.memset(ptr + i * step, 1, max(0, min(step, n - i * step))), range(threads)))


def timed(f):
    t = time.perf_counter()
    out = f()
    return time.perf_counter() - t, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights-gb", type=float, default=12.5)
    ap.add_argument("--budget", default="2GB")
    ap.add_argument("--host-budget", default="4GB")
    ap.add_argument("--n-gb", type=float, default=3.4)
    ap.add_argument("--dir", default="/tmp/tiermem-probe-load")
    ap.add_argument("--load-only", action="store_true", help="skip the pin and read_into sections")
    args = ap.parse_args()
    import transformers as tf

    import tiermem
    N = int(args.n_gb * 1e9) // (2 << 20) * (2 << 20)
    R["N"] = N
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        R["thp"] = f.read().strip()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    flags = rt.cudaHostRegisterPortable | rt.cudaHostRegisterMapped

    # -- the checkpoints ------------------------------------------------------------------------
    shutil.rmtree(args.dir, ignore_errors=True)
    big, small = os.path.join(args.dir, "big"), os.path.join(args.dir, "small")
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.device("cuda"):
        m = tf.AutoModelForCausalLM.from_config(qwen2_config(args.weights_gb), dtype=torch.float16)
    m.save_pretrained(big)
    del m
    cfg = tf.Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1024, dtype="float16")
    with torch.device("cuda"):
        m = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float16)
    m.save_pretrained(small)
    del m
    gc.collect()
    torch.cuda.empty_cache()
    os.sync()
    R["save_s"] = round(time.perf_counter() - t, 1)
    files = [p for p in files_of(big) if p.endswith(".safetensors")]

    @section("read_rates")
    def _():
        drop_cache(files)
        read_rate(files, 8, drop=False)
        return {"warm_8": read_rate(files, 8, drop=False)[0], "warm_16": read_rate(files, 16, drop=False)[0],
                "warm_4": read_rate(files, 4, drop=False)[0]}

    @section("pin", skip=args.load_only)
    def _():
        out = {}
        dt, p = timed(lambda: ok(rt.cudaHostAlloc(N, rt.cudaHostAllocPortable | rt.cudaHostAllocMapped)))
        out["cudaHostAlloc_s"] = dt
        dt, _ = timed(lambda: touch(p, N))
        out["cudaHostAlloc_then_write_s"] = dt
        dt, _ = timed(lambda: ok(rt.cudaFreeHost(p)))
        out["cudaFreeHost_s"] = dt
        for huge in (True, False):
            m, ptr = anon(N, huge)
            t1, _ = timed(lambda: touch(ptr, N))
            t2, _ = timed(lambda: ok(rt.cudaHostRegister(ptr, N, flags)))
            t3, _ = timed(lambda: ok(rt.cudaHostUnregister(ptr)))
            out[f"anon{'_thp' if huge else ''}"] = {"write_8_threads_s": t1, "register_s": t2, "unregister_s": t3}
            del ptr
            m.close()
        m, ptr = anon(N, True)
        t2, _ = timed(lambda: ok(rt.cudaHostRegister(ptr, N, flags)))
        t1, _ = timed(lambda: touch(ptr, N))
        ok(rt.cudaHostUnregister(ptr))
        out["anon_thp_register_untouched"] = {"register_s": t2, "write_after_s": t1}
        m.close()
        # The file's own pages (page cache), registered read-only.
        f = files[0]
        fd = os.open(f, os.O_RDONLY)
        size = os.path.getsize(f)
        n = min(N, size // 4096 * 4096)
        fm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        import numpy as np
        a = np.frombuffer(fm, dtype=np.uint8)
        addr = a.ctypes.data
        try:
            t2, _ = timed(lambda: ok(rt.cudaHostRegister(addr, n, flags | rt.cudaHostRegisterReadOnly)))
            ok(rt.cudaHostUnregister(addr))
            out["file_mmap_register_readonly_s"] = t2
        except Exception as e:
            out["file_mmap_register_readonly_s"] = repr(e)[:200]
        del a
        fm.close()
        os.close(fd)
        out["GBps"] = {k: (round(N / v / 1e9, 2) if isinstance(v, float) else
                           {kk: round(N / vv / 1e9, 2) for kk, vv in v.items()} if isinstance(v, dict) else v)
                       for k, v in out.items()}
        return out

    @section("read_into", skip=args.load_only)
    def _():
        from tiermem.inference.load import FileTensor, Reader, host_bytes
        out = {}
        f = files[0]
        n = min(N, os.path.getsize(f)) // 4096 * 4096
        ft = FileTensor(f, f, 0, n, "uint8", (n,))
        for threads in (8, 16):
            r = Reader(threads=threads)
            m, ptr = anon(n, True)
            t1, _ = timed(lambda: r.read([(ft, host_bytes(ptr, n))]))
            t2, _ = timed(lambda: r.read([(ft, host_bytes(ptr, n))]))
            t3, _ = timed(lambda: ok(rt.cudaHostRegister(ptr, n, flags)))
            ok(rt.cudaHostUnregister(ptr))
            m.close()
            r.close()
            out[f"{threads}_threads"] = {"fresh_thp_GBps": round(n / t1 / 1e9, 2), "written_GBps": round(n / t2 / 1e9, 2),
                                         "register_after_GBps": round(n / t3 / 1e9, 2)}
        return out

    watch = KindWatch()
    tier = tiermem.Tier(0)
    R["pinned_counts_in_rss"] = pinned_counts_in_rss(tier)
    budget, host_budget = tiermem.planning.parse_bytes(args.budget), tiermem.planning.parse_bytes(args.host_budget)

    phases: dict = {}
    spans: list = []          # (key, thread, start, end) from the load's start: what overlaps what
    origin = [0.0]

    def timer(owner, name, key):
        fn = getattr(owner, name)

        def wrapped(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                e = time.perf_counter()
                phases[key] = phases.get(key, 0.0) + e - t
                spans.append((key, threading.current_thread().name, round(t - origin[0], 4), round(e - origin[0], 4)))
        setattr(owner, name, wrapped)

    from tiermem import (
        _backend,
        _disk,
        _engine,
        _hostpages,
        _load,
        _module,
        _modulesources,
        _moduletransport,
        _tensor,
        _torch,
    )
    timer(tf.AutoModelForCausalLM, "from_config", "from_config")
    timer(_backend.CudaBackend, "host_alloc", "host_alloc")
    timer(_backend.CudaBackend, "device_alloc", "device_alloc")
    timer(_load.Reader, "read", "reader.read")
    timer(_module, "wrap_from", "resident_groups")
    timer(_module, "plan_residency", "plan")
    timer(_disk.DiskTier, "__init__", "disk_tier_init")
    timer(_load, "model_weights", "model_weights")
    timer(_load.Checkpoint, "__init__", "checkpoint_headers")
    # inside the two big phases
    timer(_load.Reader, "read_ranges", "reader.read_ranges (all reads)")
    timer(_hostpages, "map_pages", "host_alloc: map_pages")
    timer(rt, "cudaHostRegister", "host_alloc: cudaHostRegister")
    timer(_engine.Engine, "empty_group", "resident: empty_group")
    timer(_modulesources._Filler, "_flush", "resident: filler reads and queued copies")
    timer(_modulesources._Filler, "discard", "resident: filler waits for copies")
    timer(_torch, "fill_and_bind", "resident: fill_and_bind")
    timer(_tensor.TieredTensor, "advise", "resident: advise")
    timer(_module.TieredModule, "_adopt", "adopt (resident groups, home, hooks, prefetch)")
    timer(_moduletransport.PinnedTransport, "_run_host_side", "home thread (fill, register, disk staging)")
    timer(_moduletransport.PinnedTransport, "finish", "home: finish (wait, window, copies)")
    timer(tf.AutoConfig, "from_pretrained", "AutoConfig.from_pretrained")
    timer(tf.GenerationConfig, "from_pretrained", "GenerationConfig.from_pretrained")
    timer(_module, "_wrap_group", "resident: _wrap_group")
    timer(_module.TieredModule, "_setup", "wrap_module setup (plan, sources, adopt)")

    def load(path, prof=False):
        gc.collect()
        phases.clear()
        spans.clear()
        huge0 = anon_huge()
        s0 = status()
        rss0 = watch.reset()
        pr = cProfile.Profile() if prof else None
        t = origin[0] = time.perf_counter()
        if pr:
            pr.enable()
        model, hd = tiermem.load_pretrained(path, budget=budget, host_budget=host_budget, tier=tier)
        torch.cuda.synchronize()
        if pr:
            pr.disable()
        dt = time.perf_counter() - t
        s = hd.stats()
        merged: dict = {}
        for key, th, a, b in spans:      # many short calls (reader.read) become one span per thread
            m = merged.setdefault((key, th), [a, b, 0])
            m[0], m[1], m[2] = min(m[0], a), max(m[1], b), m[2] + 1
        out = {"load_s": round(dt, 3), "anon_huge_pages_GB": round((anon_huge() - huge0) / 1e9, 3),
               "phases_s": {k: round(v, 3) for k, v in phases.items()},
               "timeline": sorted([[k, th, a, b, n] for (k, th), (a, b, n) in merged.items()], key=lambda x: x[2]), "pinned": s["pinned_bytes.current"], "peak_over_rss0": watch.peak - rss0,
               "extra_over_pinned": watch.peak - rss0 - s["pinned_bytes.current"],
               "at_peak_minus_start": {k: watch.at_peak.get(k, 0) - s0.get(k, 0) for k in s0}}
        if pr:
            sio = io.StringIO()
            pstats.Stats(pr, stream=sio).sort_stats("cumulative").print_stats(35)
            out["profile_cum"] = sio.getvalue()[-6000:]
            sio = io.StringIO()
            pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(20)
            out["profile_tot"] = sio.getvalue()[-4000:]
            print(out["profile_cum"])
            print(out["profile_tot"])
        hd.unwrap("cpu") if path == small else None
        del model, hd
        gc.collect()
        tier.backend.release_cached()
        return out

    @section("load_small")
    def _():
        return load(small)

    @section("load_big")
    def _():
        read_rate(files, 8, drop=False)
        return load(big)

    @section("load_big_again")
    def _():
        return load(big)

    @section("load_small_again")
    def _():
        return load(small)

    shutil.rmtree(args.dir, ignore_errors=True)
    out = os.environ.get("OUT") or _path.RESULTS
    with open(os.path.join(out, "probe_load.json"), "w") as f:
        json.dump({**provenance(), **R}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
