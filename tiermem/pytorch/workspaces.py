"""cuBLAS's per-stream workspaces around a CUDA graph capture (NOTE [capture's cuBLAS workspace]).

NOTE [capture's cuBLAS workspace]
    torch keeps one cuBLAS workspace (32 MiB under ``CUBLAS_WORKSPACE_CONFIG=:4096:8``) and one
    cuBLASLt workspace (1 MiB) per stream, made at a stream's first matmul and kept for the life
    of the process. A capture's first matmul makes them for the capture's stream, inside the
    graph's private pool. Resetting the graph does not let them go, so the pool keeps those
    segments (100 MiB reserved, 66 MiB of it live) after the graph is gone, and they count in
    torch's reserved bytes under the next training's budget, which then finds no room to
    recompute (docs/history.md, "Measurements behind the code's notes"). And a
    later capture on the same stream reuses the workspace that sits in an earlier graph's pool.
    So, as torch's inductor does around its own captures, the workspaces are let go before a
    capture (the capture makes its own, in its own pool) and after it (the block is then a
    temporary of the capture, free in its pool: the graph's replays still use those bytes as
    scratch, a later capture into a shared pool may place its own temporaries there as it may
    over any freed block (graphs that share a pool run one after another, as torch requires),
    and the pool goes back whole with its graphs). The eager streams make theirs again at their
    next matmul.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["let_go", "own_workspaces"]


def let_go(torch: Any) -> None:
    """Drop torch's cuBLAS and cuBLASLt workspaces (their blocks go back to their pools)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


@contextlib.contextmanager
def own_workspaces(torch: Any) -> Iterator[None]:
    """Around a capture: it makes its cuBLAS workspaces in its own pool and keeps none past it."""
    let_go(torch)
    try:
        yield
    finally:
        let_go(torch)
