"""What a saved-tensor pack hook hands autograd for a tensor it leaves on the device
(NOTE [saved tensor cycle]).

NOTE [saved tensor cycle]
    A ``saved_tensors_hooks`` pack hook's result is held by the autograd node that saved it, in
    C++, where Python's garbage collector cannot see it. An op that saves its own output
    (softmax, exp, tanh) then holds, through the hook's result, the output tensor, whose
    ``grad_fn`` is that node: a cycle that only backward breaks (it frees the saved tensors).
    A forward whose backward never runs (a step that raised after its forward, a CUDA graph
    capture that ran out of memory) leaves the cycle, the node's inputs and every upstream
    node's saved tensors alive until the process ends: a failed capture left one block's
    activations in its graph's private pool for the rest of the session, and the tests after it
    found too little room under their budgets (docs/training.md, "Whole-step graphs", has the run
    and its memory log). Handing autograd a detached alias
    of the tensor instead (the same storage and version counter, no ``grad_fn``) breaks the
    cycle, and a forward that is dropped is freed like one without hooks
    (tests/test_savedhooks.py shows both on the CPU).
"""
from __future__ import annotations

from typing import Any

__all__ = ["as_saved"]


def as_saved(t: Any) -> Any:
    """``t`` as a pack hook keeps it on the device: an alias without autograd history."""
    return t.detach()
