"""Streamed blocks stepped on the host (NOTE [host stepping] in tiermem/training/hoststep.py), on
the CPU over the fake backend: with a fused AdamW (the host's twin is fused) the losses,
parameters and optimizer states are a plain loop's bitwise, with accumulation, with clipping
that bites, and resumed from a checkpoint; the states stop crossing the link; what it does
not take is refused before anything is adopted."""
from __future__ import annotations

import gc
import io
from typing import Any

import pytest
import torch
from fakes import FakeBackend
from test_train import CFG, _deterministic, batches, loss_of, state_bytes, tiered_losses  # noqa: F401  (fixture)
from test_train_resume import checkpoint

import tiermem
from tiermem.testing.models import GPT, GPTConfig


def gpt(fused: bool = True, opt=torch.optim.AdamW, seed: int = 0, **kw):
    torch.manual_seed(seed)
    m = GPT(GPTConfig(**CFG))
    decay = [p for n, p in m.named_parameters() if p.dim() > 1]
    rest = [p for n, p in m.named_parameters() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return m, opt(groups, lr=1e-3, fused=fused, **kw)


def plain(bs, n=1, max_norm=None, **kw):
    model, opt = gpt(**kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    losses = []
    for i, ids in enumerate(bs):
        loss = loss_of(model, ids)
        (loss / n).backward()
        losses.append(float(loss.detach()))
        if (i + 1) % n == 0:
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
    return model, opt, losses


def hosted(budget_x=1, fused=True, opt=torch.optim.AdamW, opt_kw=None, **kw):
    model, o = gpt(fused, opt, **(opt_kw or {}))
    fake = FakeBackend(total=1 << 30, foreign_host=True)
    tier = tiermem.Tier(backend=fake)
    kw.setdefault("block_bytes", 16 << 10)
    kw.setdefault("min_swap", 4096)
    train = tier.wrap_training(model, o, budget_x * state_bytes(model), host_step=True, **kw)
    return fake, tier, model, o, train


def run(train, model, opt, bs, n=1):
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    losses = []
    for i, ids in enumerate(bs):
        with train.step():
            loss = loss_of(model, ids)
            (loss / n).backward()
        losses.append(float(loss.detach()))
        if (i + 1) % n == 0:
            sched.step()
    return losses


def same_states(opt, want):
    for p, q in zip([p for g in opt.param_groups for p in g["params"]],
                    [q for g in want.param_groups for q in g["params"]]):
        a, b = opt.state[p], want.state[q]
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(torch.as_tensor(a[k]).cpu(), torch.as_tensor(b[k])), k


@pytest.mark.parametrize("n, max_norm", [(1, None), (2, None), (1, 0.05), (2, 0.05), (1, 1e6)],
                         ids=["step", "accumulate", "clip-bites", "accumulate-clip", "clip-not"])
@pytest.mark.long(keep=2)
def test_host_steps_give_a_plain_fused_loop_bitwise(n, max_norm):
    bs = batches(6)
    want, want_opt, want_losses = plain(bs, n, max_norm)
    fake, tier, model, opt, train = hosted(accumulate=n, max_grad_norm=max_norm)
    got = run(train, model, opt, bs, n)
    streamed = [b for b in train.blocks if not b.resident]
    assert streamed and all(b.host for b in streamed)
    assert got == want_losses
    for p, q in zip(model.parameters(), want.parameters()):
        assert torch.equal(p.detach(), q.detach())
    same_states(opt, want_opt)
    assert train.host.blocks_stepped > 0
    train.unwrap()
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


def test_host_steps_move_no_states_and_free_the_slots_of_them():
    bs = batches(4)
    _, tier, model, opt, train = hosted()
    run(train, model, opt, bs)
    streamed = [b for b in train.blocks if not b.resident]
    assert streamed
    p = sum(b.p_bytes for b in streamed)
    moved = dict(train.moved)
    swapped = train.plan.swapped_bytes
    # parameters in twice (forward, backward), gradients out once, activations as planned
    assert moved["h2d"] <= 2 * p + swapped and moved["d2h"] <= p + swapped
    assert train.stream.slot_bytes < max(b.p_bytes + b.g_bytes + b.s_bytes for b in streamed)
    assert all(b.slot_need == b.p_bytes + b.g_bytes for b in streamed)
    assert "host_step=True" in train.graph_blockers()
    train.unwrap()


def test_a_device_stepped_run_moves_more_and_keeps_fewer_blocks():
    bs = batches(4)
    model, o = gpt()
    fake = FakeBackend(total=1 << 30, foreign_host=True)
    dev = tiermem.Tier(backend=fake).wrap_training(model, o, state_bytes(model), block_bytes=16 << 10,
                                                   min_swap=4096)
    run(dev, model, o, bs)
    _, _, model2, o2, host = hosted()
    run(host, model2, o2, bs)
    assert host.moved["h2d"] < dev.moved["h2d"]
    assert len(host.plan.streamed_blocks) <= len(dev.plan.streamed_blocks)
    dev.unwrap()
    host.unwrap()


def test_a_checkpoint_resumes_host_stepped_training_bitwise():
    bs = batches(7)
    _, _, model, opt, train = hosted()
    want = run(train, model, opt, bs)
    want_params = [p.detach().clone() for p in model.parameters()]
    train.unwrap()
    _, _, model, opt, train = hosted()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    got = []
    for ids in bs[:3]:
        with train.step():
            loss = loss_of(model, ids)
            loss.backward()
        got.append(float(loss.detach()))
        sched.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    for ids in bs[3:5]:                     # steps the checkpoint will undo
        with train.step():
            loss_of(model, ids).backward()
    ck = torch.load(io.BytesIO(buf.getvalue()), map_location="cpu")
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    sched.load_state_dict(ck["sched"])
    for ids in bs[3:]:
        with train.step():
            loss = loss_of(model, ids)
            loss.backward()
        got.append(float(loss.detach()))
        sched.step()
    assert got == want
    for p, q in zip(model.parameters(), want_params):
        assert torch.equal(p.detach(), q)
    assert all(float(opt.state[p]["step"]) == 7 for p in model.parameters())
    train.unwrap()


def test_an_unfused_optimizer_steps_close_to_its_own_loop():
    """The host's twin is fused whatever the caller's is: not bitwise then, close."""
    bs = batches(5)
    _, _, want = plain(bs, fused=None)
    _, _, model, opt, train = hosted(fused=None)
    got = run(train, model, opt, bs)
    assert got == pytest.approx(want, rel=1e-4)
    train.unwrap()


def test_adam_with_amsgrad_steps_on_the_host_bitwise():
    bs = batches(4)
    want, want_opt, want_losses = plain(bs, opt=torch.optim.Adam, amsgrad=True)
    _, _, model, opt, train = hosted(opt=torch.optim.Adam, opt_kw={"amsgrad": True})
    assert run(train, model, opt, bs) == want_losses
    same_states(opt, want_opt)
    train.unwrap()


@pytest.mark.parametrize("kw, words", [
    ({"state_dtype": torch.bfloat16}, "state_dtype"),
    ({"max_grad_norm": 1.0, "speculate": True}, "speculate"),
])
def test_host_step_refuses_what_it_does_not_take(kw, words):
    model, o = gpt()
    tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
    with pytest.raises(tiermem.ConfigError, match=words):
        tier.wrap_training(model, o, state_bytes(model), host_step=True, **kw)
    assert all(not hasattr(p, "_tiermem") for p in model.parameters())
    assert getattr(model, "_tiermem_handle", None) is None


def test_host_step_refuses_an_optimizer_it_cannot_step_before_adopting():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    before = [p.data_ptr() for p in model.parameters()]
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
    with pytest.raises(tiermem.ConfigError, match="Adam or AdamW"):
        tier.wrap_training(model, o, state_bytes(model), host_step=True)
    assert [p.data_ptr() for p in model.parameters()] == before
    assert getattr(model, "_tiermem_handle", None) is None


@pytest.mark.parametrize("n, max_norm", [(1, None), (2, 0.05)], ids=["step", "accumulate-clip"])
@pytest.mark.long
def test_blocks_the_host_cannot_step_within_backward_step_on_the_device_bitwise(n, max_norm):
    """NOTE [host stepping]: the host takes blocks in backward's order while their steps fit in
    the traced backward; the rest step on the device, their states in their slots. Split so
    about half the streamed parameters fit, the run is still the plain fused loop's bitwise."""
    bs = batches(6)
    want, want_opt, want_losses = plain(bs, n, max_norm)
    fake, tier, model, opt, train = hosted(accumulate=n, max_grad_norm=max_norm)
    total = sum(p.numel() for p in model.parameters())
    train.host.seconds_per_param = 1.0 / (total // 2)       # one second holds half the model's steps
    choose = train.host.choose
    train.host.choose = lambda blocks, order, ms: choose(blocks, order, 1000.0)
    got = run(train, model, opt, bs, n)
    streamed = [b for b in train.blocks if not b.resident]
    on_host = [b for b in streamed if b.host]
    assert on_host and len(on_host) < len(streamed), [(b.name, b.host) for b in streamed]
    order = train.state.order
    need = sorted(b.p_bytes + b.g_bytes + b.s_bytes for b in train.blocks)
    typical = need[len(need) // 2]
    layers = [b for b in on_host if b.p_bytes + b.g_bytes + b.s_bytes <= typical and b.index in order]
    first = min((order.index(b.index) for b in layers), default=len(order))
    assert all(order.index(b.index) < first for b in streamed
               if not b.host and b.index in order and b.p_bytes + b.g_bytes + b.s_bytes <= typical), \
        "the host's blocks of the median's size or less are backward's first"
    assert train.stream.slot_bytes >= max(b.slot_need for b in streamed if not b.host)
    assert got == want_losses
    for p, q in zip(model.parameters(), want.parameters()):
        assert torch.equal(p.detach(), q.detach())
    same_states(opt, want_opt)
    train.unwrap()
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


def test_the_hosts_adamw_rate_is_measured():
    from tiermem.training.hoststep import host_seconds_per_param
    rate = host_seconds_per_param(torch, n=1 << 16)
    assert 0 < rate < 1e-6


@pytest.mark.parametrize("where", ["middle", "start"])
@pytest.mark.long
def test_a_step_that_raises_half_way_leaves_host_and_device_stepping_alike(where):
    """A backward that raises half-way leaves the blocks whose gradients were complete stepped
    (NOTE [training transport]); on the host as on the device: the same losses, parameters and
    optimizer states bitwise afterwards, the caller's ``step`` counts the host's."""
    from test_train import _raising
    bs = batches(6)
    runs = []
    for host in (False, True):
        model, o = gpt()
        fake = FakeBackend(total=1 << 30, foreign_host=True)
        tier = tiermem.Tier(backend=fake)
        train = tier.wrap_training(model, o, state_bytes(model), block_bytes=16 << 10, min_swap=4096, host_step=host)
        got = []
        for i, ids in enumerate(bs):
            if i == 2:
                with pytest.raises(RuntimeError, match="injected failure"):
                    with train.step():
                        _raising(model, ids, where).backward()
                continue
            with train.step():
                loss = loss_of(model, ids)
                loss.backward()
            got.append(float(loss.detach()))
        if host:
            assert any(b.host for b in train.blocks)
            for b in train.blocks:
                tw = train.host._twins.get(b.index)
                for p, cp in zip(b.trainable, tw.params if tw else []):
                    assert float(train.host.cpu_opt.state[cp]["step"]) == float(o.state[p]["step"])
        runs.append((got, [p.detach().clone() for p in model.parameters()], o))
        train.unwrap()
    (a, pa, oa), (b, pb, ob) = runs
    assert a == b and all(torch.isfinite(torch.tensor(b)))
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    same_states(ob, oa)


def _restore(model, opt, data: bytes, drop_every: int = 0) -> None:
    ck = torch.load(io.BytesIO(data))
    if drop_every:                  # states of some parameters missing: they start afresh
        for i in sorted(ck["opt"]["state"])[::drop_every]:
            del ck["opt"]["state"][i]
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])


def _plain_from(data: bytes, bs, drop_every: int = 0) -> tuple[list[float], Any]:
    model, opt = gpt(seed=5)
    _restore(model, opt, data, drop_every)
    out = []
    for ids in bs:
        loss = loss_of(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(float(loss.detach()))
    return out, model


@pytest.mark.parametrize("when, drop_every", [("before-wrapping", 0), ("before-the-first-step", 0),
                                              ("after-steps", 0), ("after-steps", 3)],
                         ids=["before-wrapping", "before-the-first-step", "after-steps", "states-missing"])
@pytest.mark.long(keep=2)
def test_a_checkpoint_loads_into_host_stepped_training_as_into_a_plain_loop(when, drop_every):
    """NOTE [loaded states], NOTE [host stepping]: a checkpoint of a host-stepped run loaded into
    a fresh model and optimizer (before wrapping, or before the first step), or into one that
    trained on, gives the plain fused loop's losses and parameters from it bitwise; states the
    checkpoint lacks start afresh, as torch's optimizer starts them."""
    bs = batches(7)
    _, _, model, opt, train = hosted()
    tiered_losses(train, model, bs[:3])
    data = checkpoint(model, opt)
    train.unwrap()
    want, plain_model = _plain_from(data, bs[3:], drop_every)

    model, opt = gpt(seed=5)                    # other weights: the load must replace them all
    if when == "before-wrapping":
        _restore(model, opt, data)
    tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
    train = tier.wrap_training(model, opt, state_bytes(model), block_bytes=16 << 10, min_swap=4096, host_step=True)
    if when == "after-steps":
        tiered_losses(train, model, bs[:2])            # steps the load will undo
    if when != "before-wrapping":
        _restore(model, opt, data, drop_every)
    assert tiered_losses(train, model, bs[3:]) == want
    assert all(torch.equal(p.detach(), q.detach()) for p, q in zip(model.parameters(), plain_model.parameters()))
    assert train.host.blocks_stepped > 0
    train.unwrap()


def test_an_evaluation_between_host_steps_gives_the_plain_logits():
    """NOTE [evaluation between steps]: the host's steps are done when train.step() returns, so a
    forward between steps reads the stepped masters: the plain fused loop's logits, bitwise."""
    bs, probe = batches(4), batches(1, seed=7)[0]
    want_model, _, _ = plain(bs)
    _, _, model, opt, train = hosted()
    run(train, model, opt, bs)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(probe[:, :-1]), want_model(probe[:, :-1]))
    train.unwrap()
