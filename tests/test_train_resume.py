"""Resuming training under wrap_training from a checkpoint (NOTE [loaded states] in
tiermem/training/states.py), on the CPU over the fake backend: ``model.load_state_dict`` and
``opt.load_state_dict`` into a handle that has trained, into one that has not stepped yet, and
into a model and optimizer before they are wrapped. Each resumed run must give the losses and
parameters of the uninterrupted one bitwise. tests/test_gpu_train.py repeats the host-side cases
where a streamed parameter's home is host memory and the step runs on the GPU."""
from __future__ import annotations

import io

import pytest
import torch
from fakes import FakeBackend
from test_train import _deterministic, batches, gpt, loss_of, state_bytes, tiered, tiered_losses  # noqa: F401

import tiermem

STEPS, AT = 7, 3        # the checkpoint is taken after AT of STEPS steps
BUDGETS = {"streamed": 1, "in-capacity": 8}     # x the parameters' bytes


def checkpoint(model, opt) -> bytes:
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    return buf.getvalue()


def restore(model, opt, data: bytes) -> None:
    ck = torch.load(io.BytesIO(data))       # fresh tensors each time: torch's load keeps "step" as given
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])


def wrapped(budget_x: int, **kw):
    model, _ = gpt()
    return tiered(budget=budget_x * state_bytes(model), **kw)


def uninterrupted(budget_x: int, **kw):
    _, _, model, _, train = wrapped(budget_x, **kw)
    losses = tiered_losses(train, model, batches(STEPS))
    return losses, [p.detach().clone() for p in model.parameters()], train


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32-states", "bf16-states"])
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.long
def test_a_checkpoint_loaded_into_the_handle_that_trained_on_resumes_bitwise(budget, bf16):
    """Saved after 3 steps, 2 more taken, the checkpoint loaded back into the same model,
    optimizer and handle: the 4 steps after it are the uninterrupted run's, bits and all.
    Before NOTE [loaded states] the blocks' homes kept the later states and the slots the later
    parameters, and the second resumed loss was off."""
    kw = {"state_dtype": torch.bfloat16} if bf16 else {}
    want, want_params, ref = uninterrupted(BUDGETS[budget], **kw)
    bs = batches(STEPS)
    _, _, model, opt, train = wrapped(BUDGETS[budget], **kw)
    tiered_losses(train, model, bs[:AT])
    data = checkpoint(model, opt)
    tiered_losses(train, model, bs[AT:AT + 2])
    restore(model, opt, data)
    got = tiered_losses(train, model, bs[AT:])
    assert got == want[AT:]
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), want_params))
    assert (train.plan.streamed_blocks != ()) == (budget == "streamed")
    assert train.plan.streamed_blocks == ref.plan.streamed_blocks


@pytest.mark.parametrize("when", ["before-wrapping", "before-the-first-step"])
@pytest.mark.long
def test_a_fresh_model_and_optimizer_resume_bitwise(when):
    want, want_params, _ = uninterrupted(BUDGETS["streamed"])
    bs = batches(STEPS)
    _, _, model, opt, train = wrapped(BUDGETS["streamed"])
    tiered_losses(train, model, bs[:AT])
    data = checkpoint(model, opt)
    train.unwrap()

    model2, opt2 = gpt(seed=5)                 # other weights: the load must replace them all
    if when == "before-wrapping":
        restore(model2, opt2, data)
    tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
    train2 = tier.wrap_training(model2, opt2, state_bytes(model2), block_bytes=16 << 10, min_swap=4096)
    if when == "before-the-first-step":
        restore(model2, opt2, data)
    assert tiered_losses(train2, model2, bs[AT:]) == want[AT:]
    assert all(torch.equal(a, b) for a, b in zip(params_of(model2), want_params))


def test_states_missing_from_the_loaded_dict_start_afresh_as_a_plain_optimizers_do():
    """A checkpoint without some parameters' states (they got no gradient before it was taken):
    those start from zero again, as torch's optimizer does, and the rest resume."""
    bs = batches(STEPS)
    _, _, model, opt, train = wrapped(BUDGETS["streamed"])
    tiered_losses(train, model, bs[:AT])
    data = checkpoint(model, opt)
    ck = torch.load(io.BytesIO(data))
    dropped = sorted(ck["opt"]["state"])[::3]
    for i in dropped:
        del ck["opt"]["state"][i]
    buf = io.BytesIO()
    torch.save(ck, buf)
    data = buf.getvalue()

    plain, plain_opt = gpt()
    restore(plain, plain_opt, data)
    want = []
    for ids in bs[AT:]:
        loss = loss_of(plain, ids)
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
        want.append(float(loss.detach()))

    tiered_losses(train, model, bs[AT:AT + 2])
    restore(model, opt, data)
    assert tiered_losses(train, model, bs[AT:]) == want
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), params_of(plain)))


def test_loading_inside_a_step_is_refused_with_nothing_changed():
    bs = batches(3)
    _, _, model, opt, train = wrapped(BUDGETS["streamed"])
    tiered_losses(train, model, bs[:2])
    data = checkpoint(model, opt)
    before = params_of(model)
    ck = torch.load(io.BytesIO(data))
    with pytest.raises(tiermem.TierMemError, match="between steps"):
        with train.step():
            opt.load_state_dict(ck["opt"])
    with pytest.raises(tiermem.TierMemError, match="between steps"):
        with train.step():
            model.load_state_dict(ck["model"])
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), before))
    tiered_losses(train, model, bs[2:])         # and training goes on


def test_a_state_of_the_wrong_shape_is_a_clear_value_error():
    bs = batches(2)
    _, _, model, opt, train = wrapped(BUDGETS["streamed"])
    tiered_losses(train, model, bs)
    ck = torch.load(io.BytesIO(checkpoint(model, opt)))
    st = ck["opt"]["state"][max(ck["opt"]["state"])]
    st["exp_avg"] = st["exp_avg"].reshape(-1)[:-1].clone()
    with pytest.raises(ValueError, match="exp_avg.*another model"):
        opt.load_state_dict(ck["opt"])
