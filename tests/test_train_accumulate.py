"""Gradient accumulation under wrap_training (NOTE [accumulation] in tiermem/training/handle.py), on the
CPU over the fake backend: ``accumulate=N`` makes each ``train.step()`` one micro-batch and the
optimizer steps in every N-th, as a plain loop that calls ``backward()`` N times and then
``optimizer.step()`` does. Streamed blocks carry the window's gradients home between
micro-batches; the losses, parameters and gradients must be the plain loop's, bitwise."""
from __future__ import annotations

import gc

import pytest
import torch
from fakes import FakeBackend
from test_train import _deterministic, batches, gpt, loss_of, state_bytes, tiered  # noqa: F401  (fixture)

import tiermem

N = 3


def _plain(bs, n=N, update_at=None):
    """A plain loop: ``n`` backwards of loss/n, then the optimizer's step; ``update_at`` (indices)
    replaces the every-n-th rule."""
    model, opt = gpt()
    losses = []
    for i, ids in enumerate(bs):
        loss = loss_of(model, ids)
        (loss / n).backward()
        losses.append(float(loss.detach()))
        if (update_at is None and (i + 1) % n == 0) or (update_at is not None and i in update_at):
            opt.step()
            opt.zero_grad(set_to_none=True)
    return model, opt, losses


def _tiered(train, model, bs, n=N, update=lambda i: None):
    losses = []
    for i, ids in enumerate(bs):
        with train.step(update=update(i)):
            loss = loss_of(model, ids)
            (loss / n).backward()
        losses.append(float(loss.detach()))
    return losses


def _same(model, want) -> bool:
    return all(torch.equal(p.detach(), q.detach()) for p, q in zip(model.parameters(), want.parameters()))


def test_accumulated_micro_batches_give_the_plain_loops_losses_and_parameters_bitwise():
    bs = batches(3 * N + 1)
    want, _, want_losses = _plain(bs)
    fake, tier, model, opt, train = tiered(accumulate=N)
    moved = []
    got = []
    for i, ids in enumerate(bs):
        got += _tiered(train, model, [ids])
        moved.append(dict(tier.stats()))
    assert got == want_losses
    assert train.plan is not None and train.plan.streamed_blocks, "some blocks must stream"
    assert train.updates == 3 and train.accumulated == 1 and train.steps == 3 * N + 1
    # Steps that do not update move gradients and no optimizer state (NOTE [accumulation]); the
    # window's first brings no gradient in, and its update brings the states.
    def delta(i, key):
        return moved[i][f"moved_bytes.{key}"] - moved[i - 1][f"moved_bytes.{key}"]
    for i in (N, N + 1):                       # the second window's micro-batches before its update
        assert delta(i, "optimizer_state.h2d") == 0 and delta(i, "gradient.d2h") > 0, i
    assert delta(N, "gradient.h2d") == 0 and delta(N + 1, "gradient.h2d") > 0
    assert delta(2 * N - 1, "optimizer_state.h2d") > 0 and delta(2 * N - 1, "gradient.d2h") == 0
    # The short last window stays open: unwrap gives its gradients back, as a plain loop holds them.
    train.unwrap()
    assert _same(model, want)
    for p, q in zip(model.parameters(), want.parameters()):
        assert (p.grad is None) == (q.grad is None)
        assert q.grad is None or torch.equal(p.grad, q.grad)
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


def test_update_true_closes_a_short_window_and_update_false_holds_one_open():
    bs = batches(7)
    # windows: [0, 1] closed early by update=True, [2, 3, 4, 5] held open by update=False at 4, [6]
    plan = {1: True, 4: False, 6: True}
    want, _, want_losses = _plain(bs, update_at={1, 5, 6})
    fake, tier, model, opt, train = tiered(accumulate=N)
    got = _tiered(train, model, bs, update=plan.get)
    assert got == want_losses and _same(model, want)
    assert train.updates == 3 and train.accumulated == 0
    with pytest.raises(tiermem.ConfigError):
        with train.step(update="yes"):
            pass


def test_a_failed_micro_batch_drops_its_window_and_the_next_one_trains_as_a_plain_loop():
    """The plain loop zeroes its gradients after the failure; tiermem drops the window's."""
    bs = batches(2 * N + 2)
    fail_at = N + 1                    # the second window's second micro-batch

    model_p, opt_p = gpt()
    want_losses = []
    for i, ids in enumerate(bs):
        if i == fail_at:
            opt_p.zero_grad(set_to_none=True)
            continue
        loss = loss_of(model_p, ids)
        (loss / N).backward()
        want_losses.append(float(loss.detach()))
        if i in (N - 1, 2 * N + 1):    # after the failure the window restarts at fail_at + 1
            opt_p.step()
            opt_p.zero_grad(set_to_none=True)

    fake, tier, model, opt, train = tiered(accumulate=N)
    got = []
    for i, ids in enumerate(bs):
        if i == fail_at:
            with pytest.raises(RuntimeError, match="injected"):
                with train.step():
                    loss = loss_of(model, ids)
                    loss.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("injected")))
                    loss.backward()
            assert train.accumulated == 0
            continue
        got += _tiered(train, model, [ids])
    assert got == want_losses and _same(model, model_p)


class Skippy(torch.nn.Module):
    """Four layers; ``skip`` names one the next forward leaves out (its block gets no gradient)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
        self.skip = -1

    def forward(self, x):
        for i, m in enumerate(self.layers):
            if i != self.skip:
                x = torch.tanh(m(x))
        return x.square().mean()


@pytest.mark.parametrize("skip_last", [False, True])
def test_a_block_without_a_gradient_in_the_last_micro_batch_still_takes_its_step(skip_last):
    """Layer 1 gets gradients in the window's first micro-batches only (or, with ``skip_last``
    off, never in the middle one): its update uses what it accumulated, as in a plain loop."""
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(8, 64, generator=g) for _ in range(2 * N)]
    skips = [1 if (i % N == N - 1 if skip_last else i % N == 1) else -1 for i in range(2 * N)]

    def run(tiered_run: bool):
        model = Skippy()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        fake = tier = train = None
        if tiered_run:
            fake = FakeBackend(total=1 << 30, foreign_host=True)
            tier = tiermem.Tier(backend=fake)
            train = tier.wrap_training(model, opt, state_bytes(model), block_bytes=16 << 10, min_swap=4096,
                                       accumulate=N)
        losses = []
        for i, x in enumerate(xs):
            model.skip = skips[i]
            if train is not None:
                with train.step():
                    loss = model(x)
                    (loss / N).backward()
            else:
                loss = model(x)
                (loss / N).backward()
                if (i + 1) % N == 0:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        if train is not None:
            assert train.plan.streamed_blocks
            train.unwrap()
            del train
            gc.collect()
            tier.close()
            assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}
        return losses, [p.detach().clone() for p in model.parameters()]

    want, want_params = run(False)
    got, got_params = run(True)
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(got_params, want_params))


def test_accumulate_is_checked_and_the_twice_error_points_at_it():
    model, opt = gpt()
    fake = FakeBackend(total=1 << 30, foreign_host=True)
    tier = tiermem.Tier(backend=fake)
    for bad, err in ((0, tiermem.ConfigError), (True, TypeError), ("2", TypeError), (1.5, TypeError)):
        with pytest.raises(err, match="accumulate"):
            tier.wrap_training(model, opt, state_bytes(model), accumulate=bad)
        with pytest.raises(err, match="accumulate"):
            tiermem.wrap_training(model, opt, state_bytes(model), accumulate=bad, tier=tier)
    assert not tier.leases
    _, _, model, _, train = tiered()
    bs = batches(2)
    with pytest.raises(tiermem.TierMemError, match="accumulate=N"):
        with train.step():
            for ids in bs:
                loss_of(model, ids).backward()


def test_an_evaluation_and_a_resident_plan_inside_a_window_keep_it():
    """An evaluation between micro-batches reads the parameters of the last update, and a budget
    that keeps every block resident accumulates in p.grad as plain torch does."""
    bs = batches(2 * N)
    probe = batches(1, seed=9)[0]
    want, _, want_losses = _plain(bs)
    fake, tier, model, opt, train = tiered(accumulate=N)
    got = _tiered(train, model, bs[:N + 1])
    with torch.no_grad():
        ev = float(loss_of(model, probe))
    got += _tiered(train, model, bs[N + 1:])
    assert got == want_losses and _same(model, want)
    model_p, opt_p, _ = _plain(bs[:N])
    with torch.no_grad():
        assert ev == float(loss_of(model_p, probe))

    fake2, tier2, model2, opt2, train2 = tiered(accumulate=N, budget=1 << 29)
    got2 = _tiered(train2, model2, bs[:N])         # the traced window streams every block
    traced = tier2.stats()["moved_bytes.gradient.d2h"]
    got2 += _tiered(train2, model2, bs[N:])
    assert not train2.plan.streamed_blocks
    assert got2 == want_losses and _same(model2, want)
    assert tier2.stats()["moved_bytes.gradient.d2h"] == traced


def test_step_times_wait_for_their_events_and_come_from_updating_steps_only():
    """The plan's measured step time: a step's events are read once complete, at a later step's
    start if not at the next one's, and micro-batches that do not update are not timed."""
    bs = batches(25)
    fake, tier, model, opt, train = tiered(accumulate=2)
    _tiered(train, model, bs[:20])               # ends on an update; the plan is settled by then
    assert not train.choice.refine and not train.choice.verify and not train._tracing
    n0 = len(train.step_ms)
    fake.events_pending = True                   # a GPU behind the host
    _tiered(train, model, bs[20:24])             # two windows: two updating steps
    assert len(train.step_ms) == n0
    fake.events_pending = False
    _tiered(train, model, bs[24:])               # its start reads the three updating steps waiting
    assert len(train.step_ms) == n0 + 3
    assert train.plan.measured["step_ms"] == 1.0


# -- NOTE [zero_grad] ----------------------------------------------------------------------------------

@pytest.mark.parametrize("owner", ["optimizer", "model"])
@pytest.mark.parametrize("budget", ["streamed", "in capacity"])
@pytest.mark.long
def test_zero_grad_before_backward_is_a_plain_loops_and_after_backward_is_refused(budget, owner):
    """A ported loop that keeps ``optimizer.zero_grad()`` (or transformers' Trainer's
    ``model.zero_grad()``) at the top of each iteration trains as the plain loop; one inside a
    window drops the window's gradients, streamed blocks' too, as a plain loop's would; one after
    backward inside the step is refused, the step failing cleanly."""
    bs = batches(2 * N + 3)
    drop_at = N + 1                      # zero_grad before the second window's second micro-batch
    model_p, opt_p = gpt()
    want = []
    for i, ids in enumerate(bs[:2 * N + 1]):
        if i == drop_at:
            opt_p.zero_grad(set_to_none=True)
        loss = loss_of(model_p, ids)
        (loss / N).backward()
        want.append(float(loss.detach()))
        if i in (N - 1, 2 * N):         # after the drop the window restarts at drop_at
            opt_p.step()
            opt_p.zero_grad(set_to_none=True)
    kw = {} if budget == "streamed" else {"budget": 1 << 29}
    fake, tier, model, opt, train = tiered(accumulate=N, **kw)
    zero = {"optimizer": opt, "model": model}[owner]
    got = []
    for i, ids in enumerate(bs[:2 * N + 1]):
        with train.step():
            if i == drop_at or train.accumulated == 0:
                zero.zero_grad()         # at a window's top: harmless; inside one: drops it
            loss = loss_of(model, ids)
            (loss / N).backward()
        got.append(float(loss.detach()))
    assert got == want and _same(model, model_p)
    assert (not train.plan.streamed_blocks) == (budget == "in capacity")
    for ids in batches(3 * N, seed=4):          # past the probe and the check: in capacity no hook is left
        with train.step():
            loss_of(model, ids).backward()
    p = train.plan
    assert (not (p.streamed_blocks or p.recompute or p.swapped_bytes)) == (budget == "in capacity")
    with pytest.raises(tiermem.TierMemError, match=f"{owner}.zero_grad"):
        with train.step():
            loss_of(model, bs[-2]).backward()
            zero.zero_grad()
    with train.step():
        loss_of(model, bs[-1]).backward()
    assert "zero_grad" in vars(opt) and "zero_grad" in vars(model)
    train.unwrap()
    assert "zero_grad" not in vars(opt) and "zero_grad" not in vars(model)   # the classes' own again
    zero.zero_grad()


def test_a_held_model_refuses_copies_and_its_optimizer_copies_plain():
    """copy.deepcopy or pickling of a model tiermem trains would carry tiermem's hooks, still
    calling the original's handle: refused with WrapError (NOTE [held modules]). A copy of its
    optimizer has the plain zero_grad, which neither reaches the handle nor the original's
    gradients. After unwrap() the model copies as any module does."""
    import copy
    import pickle
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
    train = tier.wrap_training(model, opt, state_bytes(model), block_bytes=16 << 10, min_swap=1 << 30)
    x = torch.randn(8, 64)
    for copier in (copy.deepcopy, copy.copy, pickle.dumps, lambda m: copy.deepcopy({"ema": m})):
        with pytest.raises(tiermem.errors.WrapError, match="unwrap"):
            copier(model)
    for i in range(2):
        with train.step():
            model(x).square().mean().backward()
            if i == 1:
                for twin in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
                    assert "zero_grad" not in vars(twin)
                    twin.zero_grad()   # where the original's would be refused
    assert train.plan.streamed_blocks and train.steps == 2
    with pytest.raises(tiermem.TierMemError, match="model.zero_grad"):
        with train.step():
            model(x).square().mean().backward()
            model.zero_grad()
    train.unwrap()
    assert not {"__deepcopy__", "__reduce_ex__", "zero_grad"} & set(vars(model))
    twin = pickle.loads(pickle.dumps(copy.deepcopy(model)))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_a_submodules_zero_grad_in_a_window_runs_as_a_plain_loops_where_resident_and_is_refused_where_streamed():
    """NOTE [zero_grad]: a submodule's own zero_grad inside an accumulation window drops that
    submodule's gradients, as in a plain loop, where all its parameters are resident; where one
    streams it is refused with nothing changed (its block keeps them at home with the rest of
    its block's); after backward inside a step it is refused as the model's is."""
    bs = batches(2 * N + 1)
    drop_at = N + 1
    fake, tier, model, opt, train = tiered(accumulate=N)
    got, resident_name = [], None
    for i, ids in enumerate(bs):
        if i == drop_at:
            streamed = next(b.name for b in train.blocks if not b.resident and b.trainable)
            before = {n: p.grad for n, p in model.named_parameters()}
            with pytest.raises(tiermem.TierMemError, match=f"model.{streamed}.zero_grad.*accumulation window"):
                model.get_submodule(streamed).zero_grad()
            assert {n: p.grad for n, p in model.named_parameters()} == before      # nothing changed
            resident_name = next(b.name for b in train.blocks if b.resident and b.trainable)
            model.get_submodule(resident_name).zero_grad()
        with train.step():
            loss = loss_of(model, ids)
            (loss / N).backward()
        got.append(float(loss.detach()))
    model_p, opt_p = gpt()
    want = []
    for i, ids in enumerate(bs):
        if i == drop_at:
            model_p.get_submodule(resident_name).zero_grad()
        loss = loss_of(model_p, ids)
        (loss / N).backward()
        want.append(float(loss.detach()))
        if (i + 1) % N == 0:
            opt_p.step()
            opt_p.zero_grad(set_to_none=True)
    assert got == want and _same(model, model_p)
    model.get_submodule(resident_name).zero_grad()            # between windows: nothing to drop
    with pytest.raises(tiermem.TierMemError, match=f"model.{resident_name}.zero_grad.. after backward"):
        with train.step():
            loss_of(model, bs[0]).backward()
            model.get_submodule(resident_name).zero_grad()
    subs = [m for n, m in model.named_modules() if n and any(True for _ in m.parameters())]
    assert all("zero_grad" in vars(m) for m in subs)
    train.unwrap()
    assert not any("zero_grad" in vars(m) for m in subs)      # the class's own again
