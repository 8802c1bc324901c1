"""What a CUDA graph capture that failed leaves in torch, undone: the allocator's routing to the
capture's pool and the pool itself, the current stream, and the CUDA generator (NOTE
[failed capture's generator] in pytorch/generators.py); and a dropped graph's memory given back.
Every capture uses it: a whole training step's (training/stepgraph.py), a recomputed block's
backward (training/replay.py) and an offloaded forward's (inference/graphed.py).

NOTE [invalidated capture]
    A capture that an operation invalidated (a host sync inside the step, a call CUDA forbids
    while capturing) fails in ``cudaStreamEndCapture``, and torch's ``capture_end`` raises
    there, before it stops routing allocations to the graph's pool and before
    ``torch.cuda.graph``'s exit gives the caller's stream back; every later allocation on that
    stream would land in the dead pool (the eager step after such a failure ran out of memory
    with 356 MiB held there, docs/training.md). Both are undone here: the stream with torch's
    public call, the routing with the private one torch's own ``use_mem_pool`` ends with,
    where this torch has it. A capture that ended cleanly ended its routing itself.

NOTE [failed capture's pool]
    torch gives a graph's private pool back when the graph is reset or destroyed, but only a
    graph whose capture ended: a capture that failed in cudaStreamEndCapture leaves its pool
    referenced for the life of the process, with every segment it took. Those segments count
    in torch's reserved bytes, so the next wrap_training on the device traced a step that
    "held" them: a GPT of 251 MB of state was refused at 352 MiB, its traced step 3.6 GB, after
    a failed capture of the 3.5 GB GPT (tests/test_gpu_stepgraph.py). So each capture that did
    not end gives its reference to its pool back with the private call torch's
    ``use_mem_pool`` gives its pools back with: a whole step's capture takes a pool of its own,
    and the recomputed blocks' graphs share one, whose other graphs give theirs back when they
    are dropped. cuBLAS keeps a workspace per stream, and the capture's stream took its
    workspace from the pool: those are let go too (NOTE [capture's cuBLAS workspace] in
    pytorch/workspaces.py).
"""
from __future__ import annotations

from typing import Any

from .generators import end_generator_capture
from .workspaces import let_go

__all__ = ["clear_frames", "ended", "first_cause", "free_cache", "give_pool_back", "release_graph", "unroute"]


def ended(g: Any) -> bool:
    """Whether ``g``'s capture ended: torch's ``pool()`` refuses a graph whose capture did not."""
    try:
        g.pool()
        return True
    except Exception:  # noqa: BLE001 - RuntimeError from torch's check
        return False


def _device(torch: Any, stream: Any) -> int:
    index = getattr(getattr(stream, "device", None), "index", None)
    return index if index is not None else torch.cuda.current_device()


def unroute(torch: Any, g: Any, pool: Any, prev: Any) -> None:
    """NOTE [invalidated capture]: after a capture into ``g`` (allocating from ``pool``) raised,
    make ``prev`` the current stream again, and where the capture did not end, stop routing
    allocations to its pool and take the CUDA generator out of capture mode (NOTE [failed
    capture's generator])."""
    torch.cuda.set_stream(prev)
    if ended(g):
        return
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        end(_device(torch, prev), pool)
    end_generator_capture(torch)


def give_pool_back(torch: Any, pool: Any) -> None:
    """NOTE [failed capture's pool]: a capture into ``pool`` that did not end gives its reference
    to the pool back (its graph's reset will not; ask :func:`ended` before that reset), and the
    cuBLAS workspaces the capture's stream took from it are let go. Once per failed capture."""
    release = getattr(torch._C, "_cuda_releasePool", None)
    if release is not None:
        release(torch.cuda.current_device(), pool)
    let_go(torch)


def first_cause(e: BaseException) -> str:
    """The error that began a failure: when a step raises inside a capture, ending the capture
    raises too (its streams were left unjoined), and that second error hides the first."""
    while e.__context__ is not None and e.__context__ is not e:
        e = e.__context__
    msg = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {msg}"


def clear_frames(e: BaseException) -> None:
    """NOTE [kept exceptions] in training/stepping.py: a failure's traceback frames hold the failed
    capture's tensors (its activations, in the graph's pool) for as long as the exception lives.
    A failed capture's exception is tiermem's own, handled and never raised, so tiermem lets go
    of its frames itself, or a failed capture's activations stay in its pool through the eager
    work that follows (docs/history.md, "Measurements behind the code's notes")."""
    import traceback
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)   # frames still running (this one) are skipped
        e = e.__context__ or e.__cause__


def free_cache(torch: Any) -> None:
    """torch's cached blocks back to the device, after the work queued so far."""
    import gc
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def release_graph(torch: Any, g: Any, failed_pool: Any = None) -> None:
    """A dropped or failed capture's graph gives its pool back to torch's allocator, and the
    allocator its cached memory to the device (eager work's cache takes its place).
    ``failed_pool``: the pool handle of a capture that failed (NOTE [failed capture's pool])."""
    give_back = failed_pool is not None and not ended(g)    # asked before the reset, which forgets it
    try:
        g.reset()
    except Exception:  # noqa: BLE001 - a capture that never began has nothing to reset
        pass
    del g
    if give_back:
        give_pool_back(torch, failed_pool)
    elif failed_pool is not None:
        let_go(torch)
    free_cache(torch)
