"""NOTE [saved tensor cycle] in tiermem/pytorch/savedhooks.py, on the CPU: a forward run under pack
hooks and dropped before its backward is freed when the hooks keep tensors through
``as_saved``, and not when they hand autograd the tensor itself (the cycle the NOTE names; the
test fails if torch ever frees it, and the NOTE's reason is then gone)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tiermem.pytorch.savedhooks import as_saved


def _dropped_forward_lives(pack) -> bool:
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = torch.softmax(x, -1)           # saves its own output
        z = (y.exp() * 2).sum()
    w = weakref.ref(y)
    del y, z
    gc.collect()
    return w() is not None


@pytest.mark.parametrize("pack,lives", [(lambda t: t, True), (as_saved, False)])
def test_a_forward_dropped_before_its_backward_is_freed_only_without_the_cycle(pack, lives):
    assert _dropped_forward_lives(pack) is lives


def test_gradients_through_as_saved_are_the_plain_ones():
    x = torch.randn(4, 8, requires_grad=True, dtype=torch.float64)

    def f():
        return (torch.softmax(x, -1).exp() * x.tanh()).sum()
    f().backward()
    want, x.grad = x.grad.clone(), None
    with torch.autograd.graph.saved_tensors_hooks(as_saved, lambda t: t):
        y = f()
    y.backward()
    assert torch.equal(x.grad, want)



@pytest.mark.parametrize("min_swap", [4096, 100_000])   # under 100 kB (softmax's output) kept as is
def test_a_training_step_that_raises_after_its_forward_leaves_none_of_its_tensors(min_swap):
    """Through tiermem's own hooks (the fake backend's step, its plan made): the failed step's
    activations go with the exception, not with the process."""
    from test_train import batches, loss_of, tiered
    _, _, model, _, train = tiered(min_swap=min_swap)
    bs = batches(6)
    for ids in bs[:4]:
        with train.step():
            loss_of(model, ids).backward()
    outs = []
    hooks = [m.register_forward_hook(lambda m, i, o: outs.append(weakref.ref(o)) if torch.is_tensor(o) else None)
             for m in model.modules()]
    try:
        with train.step():
            loss_of(model, bs[4])
            raise KeyboardInterrupt           # after the forward, before its backward
    except KeyboardInterrupt:
        pass
    for h in hooks:
        h.remove()
    gc.collect()
    assert outs and [w for w in outs if w() is not None] == []
    with train.step():                        # and the next step trains
        loss_of(model, bs[5]).backward()
