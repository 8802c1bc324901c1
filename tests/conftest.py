"""Shared test set-up: the gpu marker's skip, the fake-backend Tier, and a reset of global state.

The gpu check runs when a gpu test is about to run, never at collection, so collecting the suite
starts no CUDA context.
"""
from __future__ import annotations

import functools
import gc
import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# bench/um_budget.py, the advice study's enforcer, is bench code with CPU tests of its own.
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
# Deterministic cuBLAS, for the bitwise checks in the GPU tests; must be set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


# NOTE [test threads]
#     The CPU tests train tiny models (tests/test_train.py's GPT is 0.94 MB): each op is microseconds
#     of work, and torch's intra-op threads only add hand-offs. Under ``-n auto`` every xdist worker
#     would start a thread per core, so two workers on CI's two cores ran four busy threads and the
#     training sweeps slowed down (6 cases of tests/test_train_faults.py on a loaded 2-core machine:
#     50 s with two threads, 20.5 s with one). Each worker gets its share of the cores;
#     subprocesses (tests/test_bad_input.py) inherit it through OMP_NUM_THREADS. A plain run keeps
#     every core, as do the GPU tests (.ci/gpu_tests.py runs a process per file). The bitwise checks
#     compare two runs of one process, which share the setting.
def _threads() -> int:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    return max(1, (os.cpu_count() or 1) // workers)


os.environ.setdefault("OMP_NUM_THREADS", str(_threads()))


@functools.cache
def gpu_reason() -> str | None:
    """None when a GPU test can run here, else why not."""
    try:
        from tiermem.cuda import runtime as _cuda
        ok, why = _cuda.available()
    except Exception as e:  # cuda-bindings missing or broken
        return f"no CUDA: {e}"
    if not ok:
        return f"no GPU: {why}"
    for mod in ("cupy", "torch"):
        try:
            __import__(mod)
        except ImportError:
            return f"{mod} is not installed"
    import torch
    if not torch.cuda.is_available():
        return "torch has no CUDA"
    return None


def pytest_configure(config: pytest.Config) -> None:
    import torch
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))    # NOTE [test threads], if torch was in first


def pytest_collection_finish(session: pytest.Session) -> None:
    # NOTE [frozen collection]
    #     Every test ends with a full gc.collect (_reset_global_state, the leak checks, a failed
    #     training step's NOTE [kept exceptions]), and each one walked all that collection left
    #     alive: torch, transformers, the test modules and their parameter lists, ~300k objects
    #     and a third of a second a time on CI's cores, a fifth of a training sweep's time.
    #     Freezing them moves them out of gc's generations, so a collection walks only what tests
    #     made since. Frozen objects are never collected (they are the modules' own, alive to the
    #     end anyway) and gc.get_objects leaves them out, which no test asks of them.
    gc.collect()
    gc.freeze()


def slow_cases(items: list[pytest.Item]) -> set[str]:
    """NOTE [slow cases] in helpers.py: the node ids of CPU cases recorded slower than SLOW_S,
    less each file's fastest recorded case."""
    import durations
    from helpers import SLOW_S
    times = durations.load()
    fastest: dict[str, tuple[float, str]] = {}
    for it in items:
        t = times.get(it.nodeid)
        if t is None or it.get_closest_marker("gpu") is not None:
            continue
        f = it.nodeid.split("::")[0]
        fastest[f] = min(fastest.get(f, (t, it.nodeid)), (t, it.nodeid))
    kept = {n for _, n in fastest.values()}
    return {it.nodeid for it in items if it.nodeid not in kept and it.get_closest_marker("gpu") is None
            and times.get(it.nodeid, 0.0) > SLOW_S}


@pytest.hookimpl(tryfirst=True)       # the sweep marks below before ``-m`` selects by them
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Cases marked ``sweep`` (NOTE [sampled sweeps] in helpers.py) run only when the marker
    expression names them (``pytest -m sweep``); the default run leaves them out, with the cases
    recorded as slow (NOTE [slow cases] in helpers.py). A long
    parametrised set (marked ``long``) keeps its first ``keep`` cases (default 1) in the default
    run; the rest are ``sweep`` cases (NOTE [long sets] in helpers.py)."""
    # Under pytest-xdist (README's test command), every GPU test runs on one worker, one after
    # another: they share the one GPU, and some take most of its memory on purpose.
    taken: dict[tuple[str, str], int] = {}
    slow = slow_cases(items)
    for it in items:
        if it.get_closest_marker("gpu") is not None:
            it.add_marker(pytest.mark.xdist_group("gpu"))
        if it.nodeid in slow:
            it.add_marker(pytest.mark.sweep)
        long = it.get_closest_marker("long")
        if long is not None:
            key = (str(it.path), getattr(it, "originalname", it.name))
            taken[key] = taken.get(key, 0) + 1
            if taken[key] > long.kwargs.get("keep", 1):
                it.add_marker(pytest.mark.sweep)
    if "sweep" in (config.getoption("markexpr") or ""):
        return
    keep = [it for it in items if it.get_closest_marker("sweep") is None]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[it for it in items if it.get_closest_marker("sweep") is not None])
        items[:] = keep


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None:
        why = gpu_reason()
        if why is not None:
            pytest.skip(why)


@pytest.fixture(autouse=True)
def _reset_global_state():
    """Each test starts with no default Tier and no role scope, and leaves none behind."""
    import tiermem.base.default as default
    import tiermem.cupy.allocator as cp
    default.replace(None)
    cp._scope.role = None
    yield
    default.replace(None)
    cp._scope.role = None
    gc.collect()


@pytest.fixture(autouse=True)
def _gpu_memory_after(request):
    """After each gpu test: drop the frames pytest keeps of a failure (``sys.last_traceback``
    holds the failed test's locals, its tiers and models with them, until the next failure),
    give torch's cache back, and, where ``TIERMEM_GPU_MEMLOG`` names a file, write the driver's
    free memory there, so that a test that leaves memory taken is named by the first line whose
    free memory drops and stays down."""
    yield
    if request.node.get_closest_marker("gpu") is None or gpu_reason() is not None:
        return
    import torch
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()
    torch.cuda.synchronize()
    # A training test that failed before its unwrap leaves torch's per-process cap set (its
    # handle is gone with the frames, but the cap is torch's): every later test then ran out of
    # memory under it (H100, 37467bb: 570 MiB allowed, 13 tests failed in a row).
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()
    log = os.environ.get("TIERMEM_GPU_MEMLOG")
    if log:
        free, total = torch.cuda.mem_get_info()
        with open(log, "a") as f:
            f.write(f"{free / 2**30:8.3f} GiB free  torch {torch.cuda.memory_allocated() / 2**20:8.1f} MiB allocated "
                    f"{torch.cuda.memory_reserved() / 2**20:8.1f} MiB reserved  {request.node.nodeid}\n")
            for line in _private_pool_report(torch):
                f.write(f"    {line}\n")


def _private_pool_report(torch) -> list[str]:
    """What is left in torch's private pools (a graph's): each segment's live blocks, and the
    tensors gc can reach that sit in them, with who holds them; blocks no tensor accounts for
    are the allocator's own (a library's workspace, say)."""
    segs = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
    out = []
    for s in segs:
        live = [b for b in s["blocks"] if b["state"] == "active_allocated"]
        out.append(f"private segment pool={tuple(s['segment_pool_id'])} {s['total_size']} B, "
                   f"live blocks {[int(b['size']) for b in live]}")
        lo, hi = int(s["address"]), int(s["address"]) + int(s["total_size"])
        for obj in gc.get_objects():
            try:
                with warnings.catch_warnings():      # a deprecated torch object warns when asked its type
                    warnings.simplefilter("ignore")
                    if not (torch.is_tensor(obj) and obj.is_cuda and lo <= obj.data_ptr() < hi):
                        continue
            except Exception:  # noqa: BLE001 - a half-built object
                continue
            # gc.get_objects()'s list and this frame refer to every tensor; an empty set means only
            # what gc cannot see holds it (autograd's saved tensors, say)
            held = sorted({_holder(r, obj) for r in gc.get_referrers(obj)} - {"list", "frame"})
            out.append(f"  tensor {tuple(obj.shape)} {obj.dtype} at +{obj.data_ptr() - lo}, held by {held}")
    return out


def _holder(ref, obj) -> str:
    if isinstance(ref, dict):
        keys = [k for k, v in list(ref.items())[:10000] if v is obj][:2]
        return f"dict{keys}"
    return type(ref).__name__


@pytest.fixture
def fake():
    from fakes import FakeBackend
    return FakeBackend(total=1 << 30)


@pytest.fixture
def tier(fake):
    import tiermem
    return tiermem.Tier(backend=fake)
