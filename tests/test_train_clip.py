"""Global-norm gradient clipping under wrap_training (NOTE [clipping] in tiermem/training/clipping.py,
NOTE [clip arithmetic] in tiermem/training/gradnorm.py), on the CPU over the fake backend: ``max_grad_norm``
gives a plain loop's ``clip_grad_norm_`` then ``optimizer.step()``, bitwise, the norm included,
with blocks streamed, with accumulation, and whether the clip bites or not. A caller's own
``optimizer.step()`` inside the step is refused, as it would update the parameters twice."""
from __future__ import annotations

import gc

import pytest
import torch
from fakes import FakeBackend
from test_train import _deterministic, batches, gpt, loss_of, state_bytes, tiered  # noqa: F401  (fixture)

import tiermem
from tiermem.training.gradnorm import stack_order


def _plain(bs, max_norm, norm_type=2.0, n=1):
    model, opt = gpt()
    losses, norms = [], []
    for i, ids in enumerate(bs):
        loss = loss_of(model, ids)
        (loss / n).backward()
        losses.append(float(loss.detach()))
        if (i + 1) % n == 0:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type))
            opt.step()
            opt.zero_grad(set_to_none=True)
    return model, losses, norms


def _tiered(bs, max_norm, norm_type=2.0, n=1, **kw):
    fake, tier, model, opt, train = tiered(max_grad_norm=max_norm, norm_type=norm_type, accumulate=n, **kw)
    losses, norms = [], []
    for i, ids in enumerate(bs):
        with train.step():
            loss = loss_of(model, ids)
            (loss / n).backward()
        losses.append(float(loss.detach()))
        if (i + 1) % n == 0:
            norms.append(train.grad_norm)
    return fake, tier, model, train, losses, norms


@pytest.mark.parametrize("max_norm, norm_type, n", [(0.05, 2.0, 1), (1e6, 2.0, 1), (0.05, 2.0, 2),
                                                    (0.01, float("inf"), 1)])
@pytest.mark.long
def test_clipping_gives_clip_grad_norm_then_step_bitwise(max_norm, norm_type, n):
    bs = batches(6)
    want, want_losses, want_norms = _plain(bs, max_norm, norm_type, n)
    fake, tier, model, train, got, norms = _tiered(bs, max_norm, norm_type, n)
    assert train.plan.streamed_blocks and train.plan.swapped_bytes > 0
    assert got == want_losses
    assert len(norms) == len(want_norms) and all(torch.equal(a, b) for a, b in zip(norms, want_norms))
    if max_norm < 1:
        assert all(float(x) > max_norm for x in want_norms), "the clip must bite"
    else:
        assert all(float(x) < max_norm for x in want_norms)
    for p, q in zip(model.parameters(), want.parameters()):
        assert torch.equal(p.detach(), q.detach())
    train.unwrap()
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


def test_clipping_with_every_block_resident_after_the_trace():
    bs = batches(4)
    want, want_losses, want_norms = _plain(bs, 0.05)
    fake, tier, model, train, got, norms = _tiered(bs, 0.05, budget=1 << 29)
    assert not train.plan.streamed_blocks
    assert got == want_losses and all(torch.equal(a, b) for a, b in zip(norms, want_norms))


def test_torchs_stack_order_is_its_grouping_not_first_appearance():
    """NOTE [clip arithmetic]: the order torch stacks the per-gradient norms in, for mixed dtypes."""
    dts = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float16, torch.float32]
    ts = [torch.zeros(3, dtype=d) for d in dts]
    order = stack_order(torch, ts)
    assert sorted(order) == list(range(len(ts)))
    groups = [dts[i] for i in order]
    assert all(groups[k] == groups[k + 1] or groups[k + 1] not in groups[:k + 1] for k in range(len(groups) - 1))
    # against torch's own total norm over those tensors, filled
    g = torch.Generator().manual_seed(0)
    for t in ts:
        t.copy_(torch.randn(3, generator=g))
    from tiermem.training.gradnorm import NormParts
    parts = NormParts(torch, 2.0)
    ps = [torch.nn.Parameter(t.clone()) for t in ts]
    for p, t in zip(ps, ts):
        p.grad = t.clone()
    parts.add(ps[:2])
    parts.add(ps[2:])
    assert torch.equal(parts.total(ps), torch.nn.utils.get_total_norm(ts, 2.0))


def test_options_are_checked_and_a_callers_optimizer_step_is_refused():
    model, opt = gpt()
    tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
    for kw, err in (({"max_grad_norm": 0}, tiermem.ConfigError), ({"max_grad_norm": "1"}, TypeError),
                    ({"norm_type": -1}, tiermem.ConfigError), ({"max_grad_norm": True}, TypeError)):
        with pytest.raises(err, match=next(iter(kw))):
            tier.wrap_training(model, opt, state_bytes(model), **kw)
    assert not tier.leases
    bs = batches(4)
    fake, tier, model, opt, train = tiered()
    with pytest.raises(tiermem.TierMemError, match="steps the optimizer itself"):
        with train.step():
            loss_of(model, bs[0]).backward()
            opt.step()
    with train.step():                   # the failed step left nothing behind
        loss_of(model, bs[1]).backward()
    with pytest.raises(tiermem.TierMemError, match="max_grad_norm"):
        opt.step()                       # between steps too
    train.unwrap()
    loss_of(model, bs[2]).backward()
    opt.step()                           # a plain optimizer again


# -- NOTE [speculative clipping] ----------------------------------------------------------------------

def _norms_of_plain(bs):
    return [float(x) for x in _plain(bs, 1e9)[2]]


def _speculation_expected(torch, norms, clip):
    """What speculate=True does with these norms: after the traced first step, it speculates on a
    step when the clip did not bite on the step before, and keeps the step when it does not bite
    on it either (NOTE [speculative clipping])."""
    out, ok = {"committed": 0, "redone": 0}, True
    for i, n in enumerate(norms):
        bites = float(torch.clamp(clip / (n + 1e-6), max=1.0)) != 1.0
        if ok and i > 0:
            out["redone" if bites else "committed"] += 1
        ok = not bites
    return out


@pytest.mark.parametrize("regime", ["never bites", "always bites", "sometimes bites"])
@pytest.mark.long
def test_speculative_clipping_gives_the_same_bits_and_keeps_only_steps_that_did_not_clip(regime):
    bs = batches(10)
    if regime == "never bites":
        max_norm = 1e6
    elif regime == "always bites":
        max_norm = 1e-3
    else:         # the norms of an unclipped run fall as it trains: the clip bites early on only
        norms = _norms_of_plain(bs)
        max_norm = sorted(norms)[len(norms) // 2]
    want, want_losses, want_norms = _plain(bs, max_norm)
    fake, tier, model, train, got, norms = _tiered(bs, max_norm, speculate=True)
    assert got == want_losses and all(torch.equal(a, b) for a, b in zip(norms, want_norms))
    for p, q in zip(model.parameters(), want.parameters()):
        assert torch.equal(p.detach(), q.detach())
    bites = [float(x) * (1 + 1e-6) > max_norm for x in want_norms]
    sp = train.speculation
    print(regime, bites, sp)
    if regime == "never bites":
        assert sp["committed"] >= 6 and sp["redone"] == 0
    elif regime == "always bites":
        assert sp == {"committed": 0, "redone": 0}      # it speculates only after a step that did not clip
    else:
        assert sp["committed"] >= 1 and sp["redone"] >= 1
    assert sp == _speculation_expected(torch, want_norms, max_norm)
    train.unwrap()
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


@pytest.mark.parametrize("speculate", [False, True])
@pytest.mark.long
def test_a_step_failing_half_way_through_backward_steps_no_block_when_clipping(speculate):
    """With clipping no block may step before the total norm is known: a backward that raises
    half-way leaves the run bitwise as if the step had never been, speculating or not."""
    from test_train import _raising
    bs = batches(6)
    want, want_losses, _ = _plain([b for i, b in enumerate(bs) if i != 3], 1e6)
    fake, tier, model, opt, train = tiered(max_grad_norm=1e6, speculate=speculate)
    got = []
    for i, ids in enumerate(bs):
        if i == 3:
            with pytest.raises(RuntimeError, match="injected"):
                with train.step():
                    _raising(model, ids, "middle").backward()
            continue
        with train.step():
            loss = loss_of(model, ids)
            loss.backward()
        got.append(float(loss.detach()))
    assert got == want_losses
    for p, q in zip(model.parameters(), want.parameters()):
        assert torch.equal(p.detach(), q.detach())
    if speculate:
        assert train.speculation["committed"] >= 3


def test_speculate_is_checked():
    model, _ = gpt()
    tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(tiermem.ConfigError, match="max_grad_norm"):
        tier.wrap_training(model, adamw, state_bytes(model), speculate=True)
    with pytest.raises(TypeError, match="speculate"):
        tier.wrap_training(model, adamw, state_bytes(model), max_grad_norm=1.0, speculate="yes")
    with pytest.raises(tiermem.ConfigError, match="RMSprop"):
        tier.wrap_training(model, torch.optim.RMSprop(model.parameters()), state_bytes(model), max_grad_norm=1.0,
                           speculate=True)
    assert not tier.leases and getattr(model, "_tiermem_handle", None) is None
