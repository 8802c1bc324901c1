"""torch's CUDA generators after a capture that failed (NOTE [failed capture's generator]).

NOTE [failed capture's generator]
    A capture registers the device's default CUDA generator with the graph and puts it in capture
    mode (its offset then counts inside the graph); ``capture_end`` takes it out again, but only
    after ``cudaStreamEndCapture`` succeeded. A capture that an operation invalidated (a host sync
    inside the step, a call CUDA forbids while capturing) raises there, and the generator stays in
    capture mode for the life of the process: the next random op outside any capture, a model's
    ``normal_`` init, raises "Offset increment outside graph capture encountered unexpectedly"
    (docs/facts.md). A refusal must leave torch as it was, so after a failed capture one tiny
    capture is made and ended on the same device: its end takes every generator it registered
    (the default one, the one a failed capture leaves behind) out of capture mode. Its graph and
    pool are given back at once.
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("tiermem")

__all__ = ["end_generator_capture"]


def end_generator_capture(torch: Any) -> None:
    """Take the current device's CUDA generators out of capture mode after a failed capture.
    Never raises: a failure is logged (the caller is already handling an error)."""
    try:
        cur = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(cur)
        x = torch.zeros(1, device=cur.device)        # made before the capture, outside its pool
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            g.capture_begin(capture_error_mode="thread_local")
            try:
                x.add_(1)
            finally:
                g.capture_end()
        cur.wait_stream(side)
        g.reset()
        del g, x
    except Exception as e:  # noqa: BLE001 - logged; the capture's own error is what the caller reports
        log.warning("tiermem: could not take torch's CUDA generator out of capture mode after a failed "
                    "capture; random ops outside a capture may now fail: %s", e)
