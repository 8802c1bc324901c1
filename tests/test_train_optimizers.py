"""The optimizers and loops users port to wrap_training, on the CPU over the fake backend: each
gives the plain loop's losses and parameters bitwise with blocks streamed. The loop is HF
Trainer's: two parameter groups (no weight decay for biases and norms), a linear warm-up
scheduler stepped after each step, clipping to 1.0. Trainer's default optimizer is fused AdamW
(``adamw_torch_fused``); nanoGPT picks it too where CUDA has it. Adafactor's factored moments
have other shapes than their parameters: they are not given a pinned home and stay where the
optimizer made them, which the budget must hold."""
from __future__ import annotations

import gc

import pytest
import torch
from fakes import FakeBackend
from helpers import trainer_loop, trainer_optimizer
from test_train import _deterministic, batches, gpt, loss_of, state_bytes  # noqa: F401  (fixture)

import tiermem

OPTIMIZERS = {
    "adamw-fused": lambda g: torch.optim.AdamW(g, lr=1e-3, fused=True),
    "adamw-foreach": lambda g: torch.optim.AdamW(g, lr=1e-3, foreach=True),
    "adamw-single-tensor": lambda g: torch.optim.AdamW(g, lr=1e-3, foreach=False),
    "adam-amsgrad": lambda g: torch.optim.Adam(g, lr=1e-3, amsgrad=True),
    "sgd-nesterov": lambda g: torch.optim.SGD(g, lr=1e-2, momentum=0.9, nesterov=True),
    "rmsprop": lambda g: torch.optim.RMSprop(g, lr=1e-3, momentum=0.9),
    "adafactor": lambda g: torch.optim.Adafactor(g, lr=1e-2),
}


def _hf_style(name: str):
    """The GPT with HF Trainer's two groups, its warm-up schedule, and optimizer ``name``."""
    model, _ = gpt()
    return (model, *trainer_optimizer(model, OPTIMIZERS[name]))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.long
def test_a_ported_trainer_loop_gives_the_plain_loops_losses_and_parameters_bitwise(name):
    bs = batches(6)
    model, opt, sched = _hf_style(name)
    want = [float(x) for x in trainer_loop(model, opt, sched, bs, loss_of)]
    want_params = [p.detach().clone() for p in model.parameters()]
    want_lr = [g["lr"] for g in opt.param_groups]

    model, opt, sched = _hf_style(name)
    fake = FakeBackend(total=1 << 30, foreign_host=True)
    tier = tiermem.Tier(backend=fake)
    # the parameters' bytes alone: blocks must stream, whatever their states take
    train = tier.wrap_training(model, opt, state_bytes(model), block_bytes=16 << 10, min_swap=4096,
                               max_grad_norm=1.0)
    got = []
    model.zero_grad()                # Trainer's loop, ported: its zero_grad calls are harmless
    for ids in bs:
        with train.step():
            loss = loss_of(model, ids)
            loss.backward()
        sched.step()
        model.zero_grad()
        got.append(float(loss.detach()))
    assert train.plan.streamed_blocks
    assert got == want
    assert [g["lr"] for g in opt.param_groups] == want_lr
    for p, q in zip(model.parameters(), want_params):
        assert torch.equal(p.detach(), q)
    homed = {key for b in train.blocks for _, key, _ in b.states}
    if name == "adafactor":
        assert homed <= {"variance"}    # the 1-D parameters' moment; the factored ones have other shapes
    else:
        assert homed                    # the streamed blocks' states went home
    train.unwrap()
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


def test_a_parameter_moved_between_groups_mid_run_is_stepped_with_its_new_groups_settings():
    """Each block steps the groups' share of its parameters. That share is kept from step to step
    (filtering every group per block cost the host a pass over the model), so a caller who moves
    a parameter to another group in place, keeping the lists' lengths, must still have it stepped
    with the new group's weight decay, as a plain loop does."""
    def swap(model, opt):
        named = dict(model.named_parameters())
        w, b = named["blocks.1.fc.weight"], named["blocks.1.ln2.bias"]
        decay, rest = opt.param_groups[0]["params"], opt.param_groups[1]["params"]
        i = next(k for k, p in enumerate(decay) if p is w)
        j = next(k for k, p in enumerate(rest) if p is b)
        decay[i], rest[j] = b, w

    def make():
        model, _ = gpt()
        opt, _ = trainer_optimizer(model, lambda g: torch.optim.AdamW(g, lr=1e-2, foreach=True))
        return model, opt

    bs = batches(5)
    model, opt = make()
    want = []
    for i, ids in enumerate(bs):
        if i == 2:
            swap(model, opt)
        loss = loss_of(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(float(loss.detach()))
    want_params = [p.detach().clone() for p in model.parameters()]

    model, opt = make()
    fake = FakeBackend(total=1 << 30, foreign_host=True)
    tier = tiermem.Tier(backend=fake)
    train = tier.wrap_training(model, opt, state_bytes(model), block_bytes=16 << 10, min_swap=4096)
    got = []
    for i, ids in enumerate(bs):
        if i == 2:
            swap(model, opt)
        with train.step():
            loss = loss_of(model, ids)
            loss.backward()
        got.append(float(loss.detach()))
    moved = dict(model.named_parameters())["blocks.1.fc.weight"]
    assert [b.index for b in train.blocks if any(p is moved for p in b.params)][0] in train.plan.streamed_blocks
    assert got == want
    for p, q in zip(model.parameters(), want_params):
        assert torch.equal(p.detach(), q)
    train.unwrap()
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}
