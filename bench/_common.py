"""What every bench shares: CUDA-event timing, progress lines, the table, and the results file.

Results go to bench/results/<bench>-<device>-<yyyymmdd>.json with the keys bench, device, commit,
date, metrics (name -> number), checks (name -> bool) and raw (anything else). With $OUT set, the
same files are also written there, for runs whose results are collected from one folder.
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


def commit() -> str:
    """The commit being measured: $TIERMEM_COMMIT (a copied tree has no .git), else git."""
    c = os.environ.get("TIERMEM_COMMIT")
    if c:
        return c
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "tiermem", "bench"], cwd=HERE,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def device_name() -> str:
    import torch
    return torch.cuda.get_device_name(0)


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
                  extra_files: list[str] = ()) -> str:
    name = device_name()
    date = datetime.date.today().strftime("%Y%m%d")
    obj = {"bench": bench, "device": name, "commit": commit(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "metrics": metrics, "checks": checks, "raw": raw or {}}
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{bench}-{device_slug(name)}-{date}.json")
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
