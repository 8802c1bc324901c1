"""What every bench shares: CUDA-event timing, progress lines, the table, and the results file.

Results go to bench/results/<bench>-<device>-<yyyymmdd>[-<tag>].json with the keys bench, device,
commit (with commit_note where the code measured is not one commit: see provenance), date,
metrics (name -> number), checks (name -> bool) and raw (anything else). With $OUT set, the same
files are also written there, for runs whose results are collected from one folder.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
_T0 = time.perf_counter()

sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing


def progress(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


_HASH = re.compile(r"[0-9a-f]{7,40}")


def _git(*args: str) -> str | None:
    """git's output in this checkout, or None where there is no git or no repository (a copied
    tree: the device machine gets the files without .git)."""
    try:
        out = subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def provenance() -> dict[str, Any]:
    """Which code a result measured: ``{"commit": hash}`` where that is one commit, else
    ``{"commit": None, "commit_note": why}``; never a made-up name ("wip9", "abc1234-dirty").

    $TIERMEM_COMMIT names the commit of a copied tree (it must be a hash; where the copy's .git
    cannot look it up, the result says so); without it, git's HEAD, provided nothing under tiermem/
    or bench/ (results aside) differs from it."""
    env = os.environ.get("TIERMEM_COMMIT")
    inside = _git("rev-parse", "--is-inside-work-tree") == "true"
    if env is not None:
        c = env.strip().lower()
        if not _HASH.fullmatch(c):
            return {"commit": None, "commit_note": f"TIERMEM_COMMIT={env!r} is not a commit hash"}
        if inside and _git("cat-file", "-e", f"{c}^{{commit}}") is None:
            # a copied tree's .git may be older than the commit it holds (the device machine's is)
            return {"commit": c, "commit_note": "set from TIERMEM_COMMIT; this copy's .git could not look it up"}
        return {"commit": c}
    if not inside:
        return {"commit": None, "commit_note": "no git repository and no TIERMEM_COMMIT: the code measured is unknown"}
    head = _git("rev-parse", "--short", "HEAD")
    if not head:
        return {"commit": None, "commit_note": "git gave no HEAD: the code measured is unknown"}
    dirty = _git("status", "--porcelain", "--", ":(top)tiermem", ":(top)bench", ":(top,exclude)bench/results")
    if dirty:
        files = sorted({line.split(None, 1)[-1] for line in dirty.splitlines()})
        shown = ", ".join(files[:8]) + (f" and {len(files) - 8} more" if len(files) > 8 else "")
        return {"commit": None, "commit_note": f"the tree at {head} with uncommitted changes: {shown}"}
    return {"commit": head}


def commit() -> str | None:
    """The commit being measured, or None where it is not one commit (provenance says why)."""
    return provenance()["commit"]


def device_name() -> str:
    import torch
    return torch.cuda.get_device_name(0)


def nvml_handle() -> Any:
    """NVML's handle of the GPU this process's torch uses: NVML numbers the machine's GPUs and
    ignores CUDA_VISIBLE_DEVICES, so a bench on one GPU of several finds its own by UUID."""
    import pynvml
    import torch
    pynvml.nvmlInit()
    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    return pynvml.nvmlDeviceGetHandleByUUID(("GPU-" + uuid).encode())


def device_slug(name: str) -> str:
    m = re.search(r"(H100|H200|A100|L40S|B200|GH200|[A-Z]\d{2,4})", name)
    return (m.group(1) if m else re.sub(r"\W+", "-", name)).lower()


def cuda_times(fn: Callable[[], Any], reps: int = 5, warmup: int = 1, setup: Callable[[], Any] | None = None) -> list[float]:
    """Seconds of fn() on the current stream, one per rep, from CUDA events; setup() runs untimed
    before each call, after a device sync."""
    import torch
    out = []
    for i in range(warmup + reps):
        if setup is not None:
            setup()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        if i >= warmup:
            out.append(a.elapsed_time(b) / 1e3)
    return out


# What steady_times says it measured; benches copy it into their JSON beside the figures.
STEADY = ("steady state: after {warmup} untimed forwards (no synchronization after them), {spans} spans of "
          "{forwards} forwards back to back, CUDA events around each span and no synchronization inside the "
          "timed run, so every copy a forward queues (its own, and those it starts for the next forward) is "
          "inside a span; per-forward time = span / {forwards}, median over the spans")


def steady_times(fn: Callable[[], Any], forwards: int = 4, spans: int = 5, warmup: int = 2) -> list[float]:
    """Seconds per call of ``fn`` in a steady state of back-to-back calls, one figure per span
    (STEADY says how). The spans follow one another with no gap: each starts where the last
    ended, in the same phase of the work a call leaves running for the next, so what a call
    starts for the next one is timed exactly once. ``fn`` should drop its outputs."""
    import torch
    events = [torch.cuda.Event(enable_timing=True) for _ in range(spans + 1)]
    for _ in range(warmup):      # no synchronization after: the first span starts in the same phase as the rest
        fn()
    events[0].record()
    for s in range(spans):
        for _ in range(forwards):
            fn()
        events[s + 1].record()
    events[-1].synchronize()
    return [events[s].elapsed_time(events[s + 1]) / 1e3 / forwards for s in range(spans)]


def embedding_bytes(model: Any) -> int:
    """Bytes of ``model``'s embedding tables that only lookups read: each ``nn.Embedding`` weight
    that no other module holds (a table tied to the output head is read whole by the head, so it
    does not count). A lookup reads only its tokens' rows, so these need not cross the link
    (bench/bounds.py's forward bound)."""
    import torch
    holders: dict[int, set[bool]] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(isinstance(m, torch.nn.Embedding))
    seen: set[int] = set()
    total = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            if holders[id(m.weight)] == {True}:
                total += m.weight.numel() * m.weight.element_size()
    return total


def tier_staging_everything(tiermem: Any, **kw: Any) -> Any:
    """A ``tiermem.Tier(**kw)`` whose staging rings take every shadow copy, however small
    (tiermem.cuda.staging.MIN_STAGED, read when a Tier is made, set to 1 for the call): the
    stress tests' way to run the rings on every move."""
    from tiermem.cuda import staging
    old, staging.MIN_STAGED = staging.MIN_STAGED, 1
    try:
        return tiermem.Tier(**kw)
    finally:
        staging.MIN_STAGED = old


class _DeviceBytes:
    # No "stream" key: the consumer must not synchronize on the bench's behalf (CUDA array interface v3).
    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


def device_view(ptr: int, nbytes: int) -> Any:
    """A torch uint8 tensor over ``nbytes`` of device, managed or (UVA) pinned memory at ``ptr``,
    zero-copy: what the probes copy into and out of."""
    import torch
    return torch.as_tensor(_DeviceBytes(ptr, nbytes), device="cuda")


def host_us_per_call(fn: Callable[[], Any], n: int = 2000, warmup: int = 50) -> float:
    """Microseconds of host time per call of ``fn`` (the GPU's work it queues waited for once,
    after the loop): what a call costs the host, not the device."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t) / n * 1e6, 2)


def duplex_copy(torch: Any, to_dev: Any, from_host: Any, to_host: Any, from_dev: Any, s_in: Any, s_out: Any,
                reps: int = 1) -> None:
    """``reps`` copies host to device on ``s_in`` and device to host on ``s_out`` at once, after
    the current stream's work and before what it queues next: both directions of the link busy."""
    cur = torch.cuda.current_stream()
    s_in.wait_stream(cur)
    s_out.wait_stream(cur)
    for _ in range(reps):
        with torch.cuda.stream(s_in):
            to_dev.copy_(from_host, non_blocking=True)
        with torch.cuda.stream(s_out):
            to_host.copy_(from_dev, non_blocking=True)
    cur.wait_stream(s_in)
    cur.wait_stream(s_out)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def gbps(nbytes: float, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else float("inf")


def table(rows: list[list[Any]], headers: list[str]) -> str:
    cells = [headers] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r))  # noqa: E731
    return "\n".join([line(cells[0]), "  ".join("-" * x for x in w)] + [line(r) for r in cells[1:]])


def write_results(bench: str, metrics: dict[str, float], checks: dict[str, bool], raw: dict[str, Any] | None = None,
                  extra_files: list[str] = (), tag: str = "", notes: list[str] = ()) -> str:
    """Writes the result JSON (the module docstring says where) and returns its path. ``tag``
    tells apart runs of one bench on one day (a part run alone); ``notes`` are the run's own
    explanations of a figure (printed where they arose), kept beside the figures."""
    name = device_name()
    date = datetime.date.today().strftime("%Y%m%d")
    obj = {"bench": bench, "device": name, **provenance(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "metrics": metrics, "checks": checks}
    if notes:
        obj["notes"] = list(notes)
    obj["raw"] = raw or {}
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{bench}-{device_slug(name)}-{date}{'-' + tag if tag else ''}.json")
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    out = os.environ.get("OUT")
    if out:
        for p in [path, *extra_files]:
            if os.path.exists(p):
                shutil.copy(p, out)
    progress(f"wrote {path}")
    return path


def plot_path(bench: str) -> str:
    date = datetime.date.today().strftime("%Y%m%d")
    return os.path.join(RESULTS, f"{bench}-{device_slug(device_name())}-{date}.png")


def profile_to(path: str, fn: Callable[[], Any], what: str) -> None:
    """``fn()`` under torch's profiler, then its operators by host time and by device time written
    to ``path`` (``what``: the work, for the progress line)."""
    import torch
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    with open(path, "w") as f:
        f.write(ka.table(sort_by="self_cpu_time_total", row_limit=40) + "\n\n")
        f.write(ka.table(sort_by="self_cuda_time_total", row_limit=30) + "\n")
    progress(f"  profile of {what} written to {path}")


def slots(args) -> dict:
    """wrap_module's ``lookahead`` and ``max_group_bytes`` where --lookahead and --max-group-bytes
    give them, else nothing (its defaults)."""
    out = {}
    if getattr(args, "lookahead", None) is not None:
        out["lookahead"] = args.lookahead
    if getattr(args, "max_group_bytes", None) is not None:
        from tiermem.planning import parse_bytes
        out["max_group_bytes"] = parse_bytes(args.max_group_bytes)
    return out
