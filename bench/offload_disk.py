"""bench/offload_disk.py: a checkpoint bigger than the host budget, loaded and run from disk.

A Qwen2-style model of >= 12 GB fp16 (GQA, qkv bias, a large vocabulary) is built on the GPU from
random weights, its reference tokens taken there (the resident run), and saved with
save_pretrained to local disk. Then, side by side in one process, with a device budget of 2 GB
and a host budget of 4 GB (the machine has far more RAM; the host is emulated by the budget and
by dropping the files from the page cache before each timed run):
  read         the raw read rate of those files: cold (page cache dropped per file, then
               os.preadv on 8 threads, each chunk dropped as read, as the disk tier reads) and warm
               (8 and 16 threads; the load is held to the faster); where KvikIO is installed, cold
               through kvikio too, into pinned memory and straight into device memory
  tiermem      tiermem.load_pretrained(dir, budget, host_budget): the model built on the meta
               device, resident groups and the pinned home filled from the files, the rest read
               from the files ahead of use through pinned staging (NOTE [disk tier])
  accelerate   transformers' from_pretrained with device_map="auto", max_memory {GPU: budget,
               cpu: host budget} and offload_folder: accelerate's disk offload path
  readers      where KvikIO is installed, tiermem's prefill with disk_reader="kvikio" and "posix",
               each after its own load (NOTE [kvikio reader]); the default must not be the slower
Both loads are timed in the same page-cache state, each state in turn (--cache): "cold", the
checkpoint (and accelerate's offload folder) dropped from the page cache with
posix_fadvise(DONTNEED) before every load, as after a reboot; and "warm", every file read once
just before every load, as when the same checkpoint was just read. For each: loading (wall time,
the median of --load-reps; peak host memory: RSS sampled every 5 ms, pinned memory included
when the driver's pinned pages count in RSS, which a probe checks; the goal is 1.10x the host
budget plus LOAD_MARGIN, 256 MiB), a 1x128 prefill, and decode per token. tiermem's forwards run
back to back in the steady state of _common.STEADY (its reads ahead across forwards are part of
it; it drops what it reads from the page cache, so every forward reads the drive); accelerate's
are timed one at a time, its files dropped from the page cache before each (its reads would
otherwise stay cached), so both read the drive in every forward. accelerate's from_pretrained
path offers no faster mode for this (no pinned host copies, and offload_buffers offloads more,
not faster), so it runs as users call it.

The bound of a forward comes from the model and the two budgets (bench/bounds.py disk_forward):
every weight but the embeddings (read in place) is read once a forward; all but the device
budget's share crosses the link, and all but the device's and the host's shares comes from the
drive; the drive and the link work at once, so the bound is the slower of the two at the rates
measured. ``forward_vs_serial_bound`` takes them one after the other; ``forward_vs_plan_bytes``
sets the time against the bytes tiermem's plan reads and moves (the plan's own figure). The cold
disk rate is the mean of cold reads before the load and after tiermem's forwards: the drive's
rate drifts within a run (1.13 GB/s before the forwards and 1.26 in them at 41eec95). plan_error
compares `python -m tiermem plan`'s prediction (same budgets, that rate) with the measured
prefill; plan_error_rate_before gives it the first read's rate.

    python bench/offload_disk.py [--weights-gb 12.5] [--budget 2GB] [--host-budget 4GB] [--dir PATH]
                                 [--decode-tokens 16] [--no-accelerate] [--keep] [--cache both|cold|warm]
Writes bench/results/offload_disk-<device>-<date>.json and a plot; deletes the checkpoint unless --keep.
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import threading
import time

import bounds
from _common import (STEADY, cuda_times, embedding_bytes, gbps, median, plot_path, progress, steady_times, table,
                     write_results)

GiB = 1 << 30
# The fixed host margin the load's peak may take beyond 1.10x the host budget: the resident fill's
# two 64 MiB buffers, and the pages of libraries and CUDA modules a first load touches (a 3 MB
# checkpoint's load added 3.6 MB on the H100: bench/probes/probe_load.py).
LOAD_MARGIN = 256 << 20


def qwen2_config(weights_gb: float):
    """A Qwen2-style config (hidden 2048, GQA 8:1, qkv bias, vocab 151936) of about ``weights_gb`` GB fp16."""
    import transformers as tf
    h, i, heads, kv, vocab = 2048, 11008, 16, 2, 151936
    per = 2 * (2 * h * h + 2 * h * (h * kv // heads) + 3 * h * i)
    fixed = 2 * 2 * vocab * h
    layers = max(2, round((weights_gb * 1e9 - fixed) / per))
    return tf.Qwen2Config(hidden_size=h, intermediate_size=i, num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=False, dtype="float16")


def rss_parts() -> dict:
    """The resident set by kind (anonymous, file-backed, shared: the driver's cudaHostAlloc
    memory shows as shared), bytes, from /proc/self/status."""
    return {k: status_kb(k) for k in ("RssAnon", "RssFile", "RssShmem")}


class HostWatch:
    """Peak resident set size (bytes) sampled every 5 ms on a thread, from /proc/self/statm; with
    the resident set's parts at the peak (``at_peak``)."""

    def __init__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = self.rss()
        self.at_peak = rss_parts()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self):
        while not self._stop.wait(0.005):
            r = self.rss()
            if r > self.peak:
                self.peak, self.at_peak = r, rss_parts()

    def reset(self) -> int:
        self.peak = now = self.rss()
        self.at_peak = rss_parts()
        return now

    def stop(self):
        self._stop.set()
        self._t.join()


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def files_of(path: str) -> list[str]:
    return sorted(os.path.join(dp, f) for dp, _, fs in os.walk(path) for f in fs)


def drop_cache(paths: list[str]) -> None:
    """Drop the files from the page cache: per file posix_fadvise DONTNEED (after a sync, so no
    dirty page stays), and the whole cache as well where this runs as root."""
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


def read_files(reader, paths: list[str], buf) -> tuple[float, int]:
    """(GB/s, bytes) of reading every file whole through ``reader`` into ``buf`` (a CPU uint8
    tensor), reused."""
    from tiermem.inference.load import FileTensor, host_bytes
    total, t0 = 0, time.perf_counter()
    for p in paths:
        size = os.path.getsize(p)
        for s in range(0, size, buf.numel()):
            n = min(buf.numel(), size - s)
            reader.read([(FileTensor(p, p, s, n, "uint8", (n,)), host_bytes(buf.data_ptr(), n))])
            total += n
    return gbps(total, time.perf_counter() - t0), total


def read_rate(paths: list[str], threads: int, drop: bool) -> tuple[float, int]:
    """(GB/s, bytes) of reading every file whole through tiermem's Reader into one reused buffer."""
    import torch

    from tiermem.inference.load import Reader
    r = Reader(threads=threads, drop_cache=drop)
    try:
        return read_files(r, paths, torch.empty(256 << 20, dtype=torch.uint8))
    finally:
        r.close()


def kvikio_read_rate(paths: list[str], threads: int, device: bool) -> dict:
    """Cold read rates through KvikIO (NOTE [kvikio reader]): tiermem's KvikioReader into one
    reused pinned buffer, as the disk tier reads; and, with ``device``, kvikio's own CuFile.pread
    straight into device memory (GPUDirect Storage where the system has it, else kvikio's POSIX
    path and a copy). The page cache is dropped before each."""
    import torch

    from tiermem.inference.kvikio import KvikioReader
    r = KvikioReader(threads=threads, drop_cache=True)
    out = {"compat_mode": r.compat_mode, "direct_io_read": r.direct}
    drop_cache(paths)
    out["pinned_GBps"], _ = read_files(r, paths, torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True))
    r.close()
    if device:
        import kvikio
        dev = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        drop_cache(paths)
        total, t0 = 0, time.perf_counter()
        for p in paths:
            size = os.path.getsize(p)
            with kvikio.CuFile(p, "r") as f:
                for s in range(0, size, dev.numel()):
                    n = min(dev.numel(), size - s)
                    total += f.pread(dev[:n], n, s).get()
        torch.cuda.synchronize()
        out["device_GBps"] = gbps(total, time.perf_counter() - t0)
        drop_cache(paths)
    return out


def reader_prefill(tiermem, ckpt_dir, files, budget, host_budget, ids, ref_logits, reps, reader) -> dict:
    """load_pretrained with ``disk_reader=reader``, then ``reps`` prefills back to back after one
    that learns the order, in the main run's steady state: ms per prefill, the reader's rate,
    logits equal."""
    import torch
    tier = tiermem.Tier(0)
    model, hd = tiermem.load_pretrained(ckpt_dir, budget=budget, host_budget=host_budget, tier=tier,
                                        disk_reader=reader)
    drop_cache(files)
    with torch.no_grad():
        pre = median(steady_times(lambda: model(ids, use_cache=False), forwards=1, spans=reps, warmup=1))
        eq = bool(torch.equal(model(ids, use_cache=False).logits[:, -1].float().cpu(), ref_logits))
    s = hd.stats()
    r = {"prefill_ms": round(pre * 1e3, 1), "last_logits_equal_resident": eq,
         "disk_reader_GBps": gbps(s["disk.read_bytes"], s["disk.read_seconds"]),
         "max_pinned_GB": round(s["pinned_bytes.current"] / 1e9, 3)}
    hd.unwrap(device="cpu")
    del model, hd
    gc.collect()
    tier.close()
    torch.cuda.empty_cache()
    return r


def pinned_counts_in_rss(tier) -> bool:
    """Whether the driver's pinned pages show in this process's RSS (then RSS is the whole host
    figure; otherwise pinned bytes are added to it)."""
    watch_page = os.sysconf("SC_PAGE_SIZE")
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * watch_page  # noqa: E731
    import ctypes
    before = rss()
    b = tier.backend.host_alloc(256 << 20)
    ctypes.memset(b.ptr, 1, b.nbytes)
    grew = rss() - before
    b.release()
    tier.backend.release_cached()
    return grew >= 0.9 * (256 << 20)


def generate_times(model, ids, new: int):
    import torch
    out = None

    def run():
        nonlocal out
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    with torch.no_grad():
        t = cuda_times(run, 1, warmup=0)[0]
    return t, out


def set_cache(state: str, paths: list[str]) -> None:
    """Puts ``paths`` in the page-cache state a timed load starts from: "cold", dropped
    (posix_fadvise DONTNEED, drop_cache); "warm", read once whole, so they sit in the cache."""
    if state == "cold":
        drop_cache(paths)
    else:
        buf = bytearray(64 << 20)
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights-gb", type=float, default=12.5)
    ap.add_argument("--budget", default="2GB")
    ap.add_argument("--host-budget", default="4GB")
    ap.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tiermem-offload-disk"))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3, help="prefills timed back to back (steady state)")
    ap.add_argument("--load-reps", type=int, default=3, help="loads timed in each cache state (the median is reported)")
    ap.add_argument("--cache", choices=("both", "cold", "warm"), default="both",
                    help="the page-cache state of the files before every timed load, for tiermem and accelerate alike")
    ap.add_argument("--accelerate-decode-tokens", type=int, default=2)
    ap.add_argument("--no-accelerate", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the saved checkpoint")
    args = ap.parse_args()
    states = ("warm", "cold") if args.cache == "both" else (args.cache,)

    import torch
    import transformers as tf

    import tiermem
    from tiermem.cli.plan import plan_model

    metrics: dict = {}
    checks: dict = {}
    raw: dict = {"tokens": args.tokens, "decode_tokens": args.decode_tokens, "budget": args.budget,
                 "host_budget": args.host_budget, "transformers_version": tf.__version__, "dir": args.dir,
                 "load_cache": {"cold": "the files dropped from the page cache (posix_fadvise DONTNEED) before each load",
                                "warm": "every file read once whole just before each load"},
                 "load_cache_states": list(states),
                 "prefill_timing": "tiermem: " + STEADY.format(warmup=1, spans=args.reps, forwards=1)
                                   + "; accelerate: one forward at a time, its files dropped from the page cache before each",
                 "bound": "max(link bytes / pinned H2D, disk bytes / cold disk rate) from the model and the two budgets "
                          "(bench/bounds.py disk_forward); plan_bytes: tiermem's plan's disk bytes / disk rate + "
                          "its host-streamed bytes / link"}
    budget, host_budget = tiermem.planning.parse_bytes(args.budget), tiermem.planning.parse_bytes(args.host_budget)
    ckpt_dir = os.path.join(args.dir, "model")
    offload_dir = os.path.join(args.dir, "accelerate-offload")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)

    d = torch.randint(0, 256, (GiB,), dtype=torch.uint8, device="cuda")
    h = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    link = gbps(GiB, median(cuda_times(lambda: d.copy_(h, non_blocking=True), 9)))
    metrics["pinned_h2d_GBps"] = link
    del d, h

    # -- the model, its resident reference, the checkpoint ------------------------------------------
    cfg = qwen2_config(args.weights_gb)
    progress(f"building a {args.weights_gb} GB fp16 Qwen2-style model ({cfg.num_hidden_layers} layers) on the GPU")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float16).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None       # random weights: decode every token asked for
    W = sum(p.numel() * p.element_size() for p in model.parameters())
    E = embedding_bytes(model)
    raw["weights_GB"] = round(W / 1e9, 3)
    raw["embeddings_GB"] = round(E / 1e9, 3)
    raw["layers"] = cfg.num_hidden_layers
    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        ref_logits = model(ids, use_cache=False).logits[:, -1].float().cpu()
        ref_tokens = model.generate(ids, max_new_tokens=args.decode_tokens, min_new_tokens=args.decode_tokens,
                                    do_sample=False).cpu()
        res_pre = median(steady_times(lambda: model(ids, use_cache=False), forwards=4, spans=args.reps, warmup=2))
    raw["resident"] = {"prefill_ms": res_pre * 1e3}
    progress(f"resident prefill {res_pre * 1e3:.1f} ms; saving to {ckpt_dir}")
    t0 = time.perf_counter()
    model.save_pretrained(ckpt_dir)
    os.sync()
    raw["save_s"] = round(time.perf_counter() - t0, 1)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    files = [p for p in files_of(ckpt_dir) if p.endswith(".safetensors")]
    raw["checkpoint_GB"] = round(sum(os.path.getsize(p) for p in files) / 1e9, 3)
    raw["shards"] = len(files)

    # -- raw read rates -----------------------------------------------------------------------------
    drop_cache(files)
    cold, n = read_rate(files, 8, drop=True)
    drop_cache(files)
    cold1, _ = read_rate(files, 1, drop=True)
    from tiermem.inference.kvikio import available as kvikio_available
    kv = kvikio_read_rate(files, 8, device=True) if kvikio_available() else "not installed"
    read_rate(files, 8, drop=False)                   # fills the page cache for the warm rates
    warm8, _ = read_rate(files, 8, drop=False)
    warm16, _ = read_rate(files, 16, drop=False)
    warm = max(warm8, warm16)                         # the warm load is held to the faster
    metrics["disk_read_GBps"] = cold
    raw["read"] = {"cold_8_threads_GBps": cold, "cold_1_thread_GBps": cold1, "warm_8_threads_GBps": warm8,
                   "warm_16_threads_GBps": warm16, "bytes": n, "kvikio": kv}
    if isinstance(kv, dict):
        metrics["kvikio_disk_read_GBps"] = kv["pinned_GBps"]
        progress(f"kvikio read rate, cold: {kv}")
    progress(f"read rate: cold {cold} GB/s (1 thread {cold1}), warm {warm} GB/s")

    # -- tiermem --------------------------------------------------------------------------------------
    watch = HostWatch()
    tier = tiermem.Tier(0)
    counts = pinned_counts_in_rss(tier)
    raw["pinned_counts_in_rss"] = counts
    from tiermem.inference.load import Reader
    r: dict = {"load": {}}
    model = hd = None
    for state in states:
        loads, peaks = [], []
        for i in range(args.load_reps):   # the median of a few loads: one varied from 0.58 to 0.87 s
            if model is not None:
                del model, hd
                gc.collect()
                tier.backend.release_cached()
            set_cache(state, files)
            read0 = Reader.shared().bytes_read
            rss0 = watch.reset()
            parts0 = dict(watch.at_peak)
            lck0, pin0 = status_kb("VmLck"), status_kb("VmPin")
            progress(f"tiermem: load_pretrained, {state} page cache ({i + 1}/{args.load_reps})")
            t0 = time.perf_counter()
            model, hd = tiermem.load_pretrained(ckpt_dir, budget=budget, host_budget=host_budget, tier=tier)
            torch.cuda.synchronize()
            loads.append(time.perf_counter() - t0)
            s = hd.stats()
            pinned = s["pinned_bytes.current"]
            peaks.append(watch.peak - rss0 + (0 if counts else pinned))
            loaded = Reader.shared().bytes_read - read0
        load_s = median(loads)
        r["load"][state] = {"load_s": round(load_s, 2), "load_s_each": [round(x, 3) for x in loads],
                            "load_read_GB": round(loaded / 1e9, 3), "load_GBps": gbps(loaded, load_s),
                            "peak_host_GB": round(max(peaks) / 1e9, 3),
                            "VmLck_delta_GB": round((status_kb("VmLck") - lck0) / 1e9, 3),
                            "VmPin_delta_GB": round((status_kb("VmPin") - pin0) / 1e9, 3),
                            "peak_parts_GB": {k: round((v - parts0[k]) / 1e9, 3) for k, v in watch.at_peak.items()},
                            "after_load_rss_GB": round((watch.rss() - rss0) / 1e9, 3)}
        progress(f"tiermem: loaded from a {state} page cache in {load_s:.2f} s ({r['load'][state]['load_GBps']} GB/s "
                 f"read), peak host {max(peaks) / 1e9:.2f} GB, pinned {pinned / 1e9:.2f} GB")
    first = r["load"][states[0]]
    r.update({"load_s": first["load_s"], "load_GBps": first["load_GBps"], "load_read_GB": first["load_read_GB"],
              "peak_host_GB": max(x["peak_host_GB"] for x in r["load"].values()),
              "pinned_GB": round(pinned / 1e9, 3), "home_GB": round(s["pinned_bytes.home"] / 1e9, 3),
              "staging_GB": round(s["pinned_bytes.staging"] / 1e9, 3), "plan": hd.plan.table(link, limit=0)})
    p = hd.plan
    disk_bytes = p.disk_bytes
    host_bytes_moved = p.moved_bytes - p.disk_bytes
    r.update({"resident_GB": round(p.pinned_bytes / 1e9, 3), "disk_GB_per_forward": round(disk_bytes / 1e9, 3),
              "host_streamed_GB_per_forward": round(host_bytes_moved / 1e9, 3), "groups_on_disk": len(p.on_disk),
              "stages": p.stages, "stage_GB": round(p.stage_bytes / 1e9, 3)})
    progress(f"tiermem: {disk_bytes / 1e9:.2f} GB from disk and {host_bytes_moved / 1e9:.2f} GB from the pinned home "
             "per forward")

    drop_cache(files)
    max_pinned = pinned
    rss_fwd0 = watch.reset()
    with torch.no_grad():
        # back to back, the first forward learning the order: reads ahead across forwards
        pre = median(steady_times(lambda: model(ids, use_cache=False), forwards=1, spans=args.reps, warmup=1))
        logits_eq = bool(torch.equal(model(ids, use_cache=False).logits[:, -1].float().cpu(), ref_logits))
    max_pinned = max(max_pinned, hd.stats()["pinned_bytes.current"])
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    t1, _ = generate_times(model, ids, 1)
    tn, tokens = generate_times(model, ids, 1 + args.decode_tokens)
    dec = (tn - t1) / args.decode_tokens
    tokens = tokens[:, :ref_tokens.shape[1]]          # greedy: the first tokens are those of a shorter run
    max_pinned = max(max_pinned, hd.stats()["pinned_bytes.current"])
    fwd_host = watch.peak - rss_fwd0
    s = hd.stats()
    # The drive's rate drifts between runs (1.13 GB/s before the forwards and 1.26 in them at
    # 41eec95): the bound and the plan take the mean of cold reads before and after the forwards
    drop_cache(files)
    cold_after, _ = read_rate(files, 8, drop=True)
    disk_rate = (cold + cold_after) / 2
    bound = bounds.disk_forward(W, budget, host_budget, E, link, disk_rate)
    plan_s = disk_bytes / (disk_rate * 1e9) + host_bytes_moved / (link * 1e9)
    eq = bool(torch.equal(tokens.cpu(), ref_tokens))
    r.update({"prefill_ms": round(pre * 1e3, 1), "decode_ms_per_token": round(dec * 1e3, 1),
              "bound_ms": round(bound.seconds * 1e3, 1), "serial_bound_ms": round(bound.serial_seconds * 1e3, 1),
              "bound_link_GB": round(bound.link_bytes / 1e9, 3), "bound_disk_GB": round(bound.disk_bytes / 1e9, 3),
              "plan_bytes_ms": round(plan_s * 1e3, 1),
              "tokens_equal_resident": eq, "last_logits_equal_resident": logits_eq,
              "max_pinned_GB": round(max_pinned / 1e9, 3), "forward_host_growth_GB": round(fwd_host / 1e9, 3),
              "disk_reader": {k: v for k, v in s.items() if k.startswith("disk.")},
              "disk_reader_GBps": gbps(s["disk.read_bytes"], s["disk.read_seconds"]),
              "cold_before_GBps": cold, "cold_after_GBps": cold_after, "disk_rate_GBps": round(disk_rate, 3)})
    progress(f"tiermem: prefill {pre * 1e3:.0f} ms (bound {bound.seconds * 1e3:.0f}, one after the other "
             f"{bound.serial_seconds * 1e3:.0f}, the plan's bytes {plan_s * 1e3:.0f}), decode {dec * 1e3:.0f} ms/token, "
             f"tokens equal {eq}")
    mp = plan_model(ckpt_dir, budget, host_budget, link_GBps=link, disk_GBps=disk_rate, tokens=args.tokens)
    r["plan_predicted_prefill_ms"] = round(mp.prefill_seconds * 1e3, 1)
    before = plan_model(ckpt_dir, budget, host_budget, link_GBps=link, disk_GBps=cold, tokens=args.tokens)
    r["plan_predicted_prefill_ms_rate_before"] = round(before.prefill_seconds * 1e3, 1)
    r["plan_same_as_adoption"] = mp.plan == hd.plan
    raw["tiermem"] = r
    hd.unwrap(device="cpu")
    del model, hd
    gc.collect()
    tier.close()
    torch.cuda.empty_cache()

    # -- the disk tier's two readers, side by side (NOTE [kvikio reader]) ---------------------------
    if kvikio_available():
        raw["readers"] = {}
        for reader in ("kvikio", "posix"):
            progress(f"tiermem: prefill with disk_reader={reader!r}")
            raw["readers"][reader] = reader_prefill(tiermem, ckpt_dir, files, budget, host_budget, ids, ref_logits,
                                                    args.reps, reader)
        progress(f"readers: {raw['readers']}")

    # -- accelerate -----------------------------------------------------------------------------------
    if not args.no_accelerate:
        try:
            raw["accelerate"] = run_accelerate(args, ckpt_dir, offload_dir, files, ids, budget, host_budget, watch,
                                               states)
        except Exception as e:      # the peer's failure is reported; tiermem's results still stand
            import traceback
            traceback.print_exc()
            raw["accelerate_error"] = repr(e)
    watch.stop()

    t = raw["tiermem"]
    notes = [n for n in (bounds.below_bound_note("forward_vs_bound", t["prefill_ms"] / t["bound_ms"]),
                         bounds.below_bound_note("decode_vs_bound", t["decode_ms_per_token"] / t["bound_ms"])) if n]
    metrics.update({"load_s": t["load_s"],
                    "load_peak_host_over_budget": round(t["peak_host_GB"] * 1e9 / host_budget, 3),
                    "forward_vs_bound": bounds.ratio(t["prefill_ms"], t["bound_ms"]),
                    "forward_vs_serial_bound": bounds.ratio(t["prefill_ms"], t["serial_bound_ms"]),
                    "forward_vs_plan_bytes": bounds.ratio(t["prefill_ms"], t["plan_bytes_ms"]),
                    "decode_vs_bound": bounds.ratio(t["decode_ms_per_token"], t["bound_ms"]),
                    "plan_error": round(abs(t["plan_predicted_prefill_ms"] - t["prefill_ms"]) / t["prefill_ms"], 3),
                    "plan_error_rate_before": round(abs(t["plan_predicted_prefill_ms_rate_before"] - t["prefill_ms"])
                                                   / t["prefill_ms"], 3),
                    "disk_read_after_GBps": t["cold_after_GBps"],
                    "prefill_ms": t["prefill_ms"], "decode_ms_per_token": t["decode_ms_per_token"],
                    "bound_ms": t["bound_ms"], "weights_GB": raw["weights_GB"]})
    for state, x in t["load"].items():
        metrics[f"load_{state}_s"] = x["load_s"]
        metrics[f"load_{state}_GBps"] = x["load_GBps"]
    if "warm" in t["load"]:
        metrics["load_vs_read_rate"] = round(t["load"]["warm"]["load_GBps"] / warm, 3)   # the page cache's rate
    if "cold" in t["load"]:
        metrics["load_cold_vs_read_rate"] = round(t["load"]["cold"]["load_GBps"] / cold, 3)
    if "accelerate" in raw:
        a = raw["accelerate"]
        metrics["accelerate_disk_over_tiermem"] = round(a["prefill_ms"] / t["prefill_ms"], 2)
        metrics["accelerate_disk_over_tiermem_decode"] = round(a["decode_ms_per_token"] / t["decode_ms_per_token"], 2)
        metrics["accelerate_load_s"] = a["load_s"]
        for state, x in a["load"].items():
            metrics[f"accelerate_load_{state}_s"] = x["load_s"]
            metrics[f"accelerate_load_over_tiermem_{state}"] = round(x["load_s"] / t["load"][state]["load_s"], 2)
    if "readers" in raw:
        rd = raw["readers"]
        metrics["kvikio_over_posix_prefill"] = round(rd["kvikio"]["prefill_ms"] / rd["posix"]["prefill_ms"], 3)
        metrics["kvikio_disk_reader_GBps"] = rd["kvikio"]["disk_reader_GBps"]
        metrics["posix_disk_reader_GBps"] = rd["posix"]["disk_reader_GBps"]
        checks["kvikio_logits_equal_resident"] = rd["kvikio"]["last_logits_equal_resident"]
        # the default reader (the first of READERS) must be the one that ran faster here, within 3%
        from tiermem.inference.disk import READERS
        other = "kvikio" if READERS[0] == "posix" else "posix"
        checks["default_disk_reader_not_slower"] = rd[READERS[0]]["prefill_ms"] <= 1.03 * rd[other]["prefill_ms"]
    checks["tokens_equal_resident"] = t["tokens_equal_resident"]
    checks["pinned_within_host_budget"] = t["max_pinned_GB"] * 1e9 <= host_budget
    checks["plan_same_as_adoption"] = t["plan_same_as_adoption"]
    checks["forward_vs_bound_goal"] = metrics["forward_vs_bound"] <= 1.15
    checks["no_figure_below_its_bound"] = not notes
    if "load_vs_read_rate" in metrics:
        checks["load_vs_read_rate_goal"] = metrics["load_vs_read_rate"] >= 0.8
    checks["load_peak_host_goal"] = t["peak_host_GB"] * 1e9 <= 1.10 * host_budget + LOAD_MARGIN
    checks["plan_error_goal"] = metrics["plan_error"] <= 0.15
    if "accelerate_disk_over_tiermem" in metrics:
        checks["accelerate_disk_over_tiermem_goal"] = metrics["accelerate_disk_over_tiermem"] >= 5

    rows = [["resident", "-", "-", raw["resident"]["prefill_ms"], "-", "-"]]
    for name, x in (("tiermem", t), ("accelerate", raw.get("accelerate"))):
        if x is not None:
            for state, ld in x["load"].items():
                rows.append([f"{name}, {state} cache", ld["load_s"], ld["peak_host_GB"], x["prefill_ms"],
                             x["decode_ms_per_token"], t["bound_ms"] if name == "tiermem" else "-"])
    print()
    print(table(rows, ["", "load s", "peak host GB", "prefill ms", "decode ms/token", "bound ms"]))
    print(f"\nprefill timing: {raw['prefill_timing']}\nbound: {raw['bound']}\n")
    for n in notes:
        print("BELOW THE BOUND: " + n)
    print(table([[k, v] for k, v in metrics.items()], ["metric", "value"]))
    print(table([[k, v] for k, v in checks.items()], ["check", "ok"]))
    png = plot(raw)
    write_results("offload_disk", metrics, checks, raw, extra_files=[png] if png else [], notes=notes)
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


def run_accelerate(args, ckpt_dir, offload_dir, files, ids, budget, host_budget, watch, states) -> dict:
    """transformers + accelerate with the same budgets: device_map="auto", max_memory and an
    offload folder for what fits neither; loaded --load-reps times in each page-cache state, the
    same as tiermem's loads (set_cache), the last load's model then run."""
    import accelerate
    import torch
    import transformers as tf
    out: dict = {"load": {}}
    model = None
    for state in states:
        loads, peaks = [], []
        for i in range(args.load_reps):
            if model is not None:
                del model
                gc.collect()
                torch.cuda.empty_cache()
            offloaded = files + (files_of(offload_dir) if os.path.isdir(offload_dir) else [])
            set_cache(state, offloaded)
            progress(f"accelerate: from_pretrained(device_map='auto', max_memory, offload_folder), {state} page "
                     f"cache ({i + 1}/{args.load_reps})")
            rss0 = watch.reset()
            t0 = time.perf_counter()
            model = tf.AutoModelForCausalLM.from_pretrained(
                ckpt_dir, dtype=torch.float16, device_map="auto", offload_folder=offload_dir,
                max_memory={0: budget, "cpu": host_budget}).eval()
            torch.cuda.synchronize()
            loads.append(time.perf_counter() - t0)
            peaks.append(watch.peak - rss0)
        out["load"][state] = {"load_s": round(median(loads), 2), "load_s_each": [round(x, 3) for x in loads],
                              "peak_host_GB": round(max(peaks) / 1e9, 3)}
        progress(f"accelerate: loaded from a {state} page cache in {median(loads):.2f} s, peak host "
                 f"{max(peaks) / 1e9:.2f} GB")
    where: dict = {}
    for dev in getattr(model, "hf_device_map", {}).values():
        where[str(dev)] = where.get(str(dev), 0) + 1
    offloaded = files + (files_of(offload_dir) if os.path.isdir(offload_dir) else [])
    progress(f"accelerate: device map {where}")

    def one(fn):
        drop_cache(offloaded)                 # untimed: its reads would stay in the page cache
        return cuda_times(fn, 1, warmup=0)[0]
    with torch.no_grad():
        pre = median([one(lambda: model(ids, use_cache=False)) for _ in range(2)])
        o = model(ids, use_cache=True)
        pkv, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
        steps = []
        for _ in range(args.accelerate_decode_tokens):
            def step():
                nonlocal pkv, nxt
                o = model(nxt, past_key_values=pkv, use_cache=True)
                pkv, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
            steps.append(one(step))
    dec = median(steps)
    progress(f"accelerate: prefill {pre * 1e3:.0f} ms, decode {dec * 1e3:.0f} ms/token")
    first = out["load"][states[0]]
    out.update({"load_s": first["load_s"], "peak_host_GB": max(x["peak_host_GB"] for x in out["load"].values()),
                "prefill_ms": round(pre * 1e3, 1), "decode_ms_per_token": round(dec * 1e3, 1),
                "decode_tokens": args.accelerate_decode_tokens, "device_map": where,
                "accelerate_version": accelerate.__version__,
                "offload_folder_GB": round(sum(os.path.getsize(p) for p in files_of(offload_dir)) / 1e9, 3)
                if os.path.isdir(offload_dir) else 0.0})
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def plot(raw: dict) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    t = raw["tiermem"]
    a = raw.get("accelerate")
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    systems = [("tiermem", t, "#369")] + ([("accelerate", a, "#c33")] if a else [])
    for ax, key, title in ((axes[0], "load_s", "load, s"), (axes[1], "prefill_ms", "prefill 1x128, ms"),
                           (axes[2], "decode_ms_per_token", "decode, ms per token")):
        ax.bar([n for n, _, _ in systems], [r[key] for _, r, _ in systems], color=[c for _, _, c in systems])
        if key != "load_s":
            ax.axhline(t["bound_ms"], color="k", ls="--", label="bound: max(disk bytes / disk rate, link bytes / link)")
            ax.legend(fontsize=7)
        ax.set_yscale("log")
        ax.set_title(title)
    fig.suptitle(f"{raw['weights_GB']} GB fp16 from disk: device budget {raw['budget']}, host budget {raw['host_budget']}")
    fig.tight_layout()
    path = plot_path("offload_disk")
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    main()
