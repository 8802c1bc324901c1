"""The GPU suite on a machine with one or more GPUs: the files of tests/test_gpu_*.py are shared
out over the GPUs, one pytest process per GPU at a time (CUDA_VISIBLE_DEVICES), longest first; then
the tests marked ``multigpu`` run once over all the GPUs. CI has no GPU and never runs this.

    python .ci/gpu_tests.py [--logs DIR] [-k EXPR] [FILE ...]

Each file's log is DIR/gpu-<file>.log; the closing line of every pytest run is printed at the end,
and the exit status is non-zero if any run failed.
"""
from __future__ import annotations

import argparse
import glob
import os
import queue
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Minutes each file took on one H100/H200 alone; a file not named here is taken as 2. Only the
# order of the queue depends on it.
MINUTES = {"test_gpu_stepgraph.py": 4.0, "test_gpu_train.py": 2.7, "test_gpu_recompute.py": 0.8,
           "test_gpu_torch_alloc.py": 1.5, "test_gpu_module.py": 0.6, "test_gpu_load.py": 0.4,
           "test_gpu_faults.py": 0.3, "test_gpu_core.py": 0.3}


def gpus() -> int:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return max(1, sum(1 for line in out.stdout.splitlines() if line.startswith("GPU ")))


def closing(log: str) -> str:
    with open(log, encoding="utf-8", errors="replace") as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    ends = [ln for ln in lines if ln.startswith("=") and (" in " in ln) and ("passed" in ln or "failed" in ln
                                                                            or "error" in ln or "skipped" in ln)]
    return ends[-1] if ends else (lines[-1] if lines else "(no output)")


def run(files: list[str], env: dict[str, str], log: str, marker: str, k: str | None) -> int:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-m", marker, *files]
    if k:
        cmd += ["-k", k]
    with open(log, "w") as f:
        return subprocess.run(cmd, cwd=HERE, env=env, stdout=f, stderr=subprocess.STDOUT).returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="test files (default: tests/test_gpu_*.py)")
    ap.add_argument("--logs", default=os.environ.get("OUT", "."), help="folder for the logs")
    ap.add_argument("-k", default=None, help="pytest -k expression")
    a = ap.parse_args()
    files = a.files or sorted(glob.glob(os.path.join(HERE, "tests", "test_gpu_*.py")))
    files = sorted(files, key=lambda p: -MINUTES.get(os.path.basename(p), 2.0))
    os.makedirs(a.logs, exist_ok=True)
    n = gpus()
    todo: queue.Queue[str] = queue.Queue()
    for f in files:
        todo.put(f)
    results: list[tuple[str, int, str, float]] = []
    lock = threading.Lock()

    def worker(gpu: int) -> None:
        while True:
            try:
                f = todo.get_nowait()
            except queue.Empty:
                return
            name = os.path.basename(f)[:-3]
            log = os.path.join(a.logs, f"gpu-{name}.log")
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), "PYTHONUNBUFFERED": "1"}
            t = time.time()
            rc = run([f], env, log, "gpu and not multigpu", a.k)
            with lock:
                results.append((name, rc, closing(log), time.time() - t))
                print(f"[gpu {gpu}] {name}: {closing(log)} ({time.time() - t:.0f} s)", flush=True)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if n >= 2:
        log = os.path.join(a.logs, "gpu-multigpu.log")
        t = time.time()
        rc = run(files, {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0"}, log, "multigpu", a.k)
        results.append(("multigpu", rc, closing(log), time.time() - t))
        print(f"[all {n}] multigpu: {closing(log)} ({time.time() - t:.0f} s)", flush=True)
    bad = [r for r in results if r[1] not in (0, 5)]   # 5: nothing collected for that marker
    print(f"\n{len(results)} runs on {n} GPU(s); {len(bad)} failed")
    for name, rc, line, s in sorted(results):
        print(f"  {name:28s} rc={rc}  {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
