"""Writes to a model's parameters between steps under wrap_training (NOTE [training transport] in
tiermem/training/handle.py), on the CPU over the fake backend. Users write between steps: a re-initialised
layer, a submodule's ``load_state_dict``, EMA weights copied in for an evaluation and copied back
(diffusers' EMAModel writes through ``p.data``). Each write must reach the next step, whichever
block's parameters it touches and however it writes, as it does in a plain run: the losses and
parameters are the plain run's, bitwise. Before the fix, a write to a block still held in a slot
from the last backward went into the slot alone: the next forward read it, then the slot was
reused and the block's backward and optimizer step read its home's old values."""
from __future__ import annotations

import pytest
import torch
from test_train import _deterministic, batches, gpt, loss_of, tiered, tiered_losses  # noqa: F401

STEPS, AT = 5, 2        # the write comes after AT of STEPS steps


def _write(model, how: str) -> None:
    """One write between steps, the same in the plain and the tiered run."""
    first = model.blocks[0]
    with torch.no_grad():
        if how == "in-place":
            for p in first.parameters():
                p.mul_(0.5)
        elif how == "through-data":
            for p in first.parameters():
                p.data.copy_(torch.full_like(p, 0.01))
        elif how == "submodule-load":
            sd = {k: torch.full_like(v, 0.02) for k, v in first.state_dict().items()}
            first.load_state_dict(sd)
        elif how == "init":
            torch.nn.init.normal_(first.fc.weight, std=0.02, generator=torch.Generator().manual_seed(3))
            torch.nn.init.zeros_(model.blocks[1].qkv.bias)
        else:
            raise AssertionError(how)


def _ema_eval(model, ema: list[torch.Tensor], ids) -> float:
    """EMA weights in through ``p.data`` for an evaluation, the training weights back after it."""
    stored = [p.detach().clone() for p in model.parameters()]
    for p, e in zip(model.parameters(), ema):
        p.data.copy_(e)
    with torch.no_grad():
        out = float(loss_of(model, ids))
    for p, s in zip(model.parameters(), stored):
        p.data.copy_(s)
    return out


def _plain(bs, between):
    model, opt = gpt()
    losses = []
    for i, ids in enumerate(bs):
        if i == AT:
            losses.append(between(model))
        loss = loss_of(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, [p.detach().clone() for p in model.parameters()]


def _tiered(bs, between):
    _, _, model, _, train = tiered()
    assert train is not None
    losses = tiered_losses(train, model, bs[:AT])
    losses.append(between(model))
    losses += tiered_losses(train, model, bs[AT:])
    assert train.plan.streamed_blocks, "the budget must leave some blocks streamed"
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("how", ["in-place", "through-data", "submodule-load", "init"])
@pytest.mark.long
def test_a_write_between_steps_reaches_the_next_steps_as_in_a_plain_run(how):
    bs = batches(STEPS)

    def between(model):
        _write(model, how)
        return 0.0
    want, want_params = _plain(bs, between)
    got, got_params = _tiered(bs, between)
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(got_params, want_params))


def test_ema_weights_swapped_in_for_an_evaluation_and_out_again_change_nothing():
    bs = batches(STEPS)
    ema = [t.detach().clone().mul_(0.9) for t in gpt()[0].parameters()]
    probe = batches(1, seed=9)[0]
    want, want_params = _plain(bs, lambda m: _ema_eval(m, ema, probe))
    got, got_params = _tiered(bs, lambda m: _ema_eval(m, ema, probe))
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(got_params, want_params))
