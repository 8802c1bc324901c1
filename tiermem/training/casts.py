"""Autocast inside a training step (NOTE [autocast in a step]).

NOTE [autocast in a step]
    ``torch.autocast`` keeps the low-precision copy it casts of every fp32 leaf tensor that
    requires grad (every trainable parameter) in a cache until the outermost autocast region
    exits. Inside ``train.step()`` those copies would stay on the device for the whole forward,
    every streamed block's among them, however the plan streams the blocks: half the parameters'
    bytes in bf16, for a 1B-parameter model 2.2 GB, more than the slots the budget streams them
    through, and none of it in the plan's trace as anything but activations it cannot free. And
    a copy cached while a CUDA graph captures the step lives in the graph's pool, where eager
    code after the capture would read bytes no replay wrote (torch's ``make_graphed_callables``
    refuses the cache for that reason). So the cache is off for the step's length
    (``torch.set_autocast_cache_enabled``, put back after): each weight is cast where it is
    used. A cast is exact and deterministic, so the step computes the same bits; a weight used
    twice in a forward (a tied one) is cast twice. An autocast region opened inside the step
    reads the setting when it is made, so it caches nothing either, unless it is made with
    ``cache_enabled=True``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["autocast_cache_off"]


@contextlib.contextmanager
def autocast_cache_off(torch: Any) -> Iterator[None]:
    """NOTE [autocast in a step]: torch's autocast cache off inside, as it was after. Thread-local,
    as torch's setting is."""
    get = getattr(torch, "is_autocast_cache_enabled", None)
    put = getattr(torch, "set_autocast_cache_enabled", None)
    if get is None or put is None:
        yield
        return
    was = get()
    put(False)
    try:
        yield
    finally:
        put(was)
