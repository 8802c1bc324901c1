"""Mixed precision as fine-tuners run it, under wrap_training on the CPU over the fake backend (torch's
CPU autocast supports bfloat16 and float16): fp32 master weights under
``torch.autocast(dtype=torch.bfloat16)`` (HF Trainer's ``bf16=True``) or float16, and a model loaded in bf16 with its AdamW states in bf16; each with
gradient accumulation and clipping, against the plain loop that does the same, bitwise. Inside a step
autocast caches no cast (NOTE [autocast in a step]): a cast is exact, so the bits are the same."""
from __future__ import annotations

import pytest
import torch
from fakes import FakeBackend
from test_train import _deterministic, batches, gpt, loss_of, state_bytes  # noqa: F401  (fixture)

import tiermem

BF16 = torch.bfloat16
CASES = [dict(n=1, clip=None), dict(n=2, clip=None), dict(n=1, clip=0.05), dict(n=2, clip=0.05)]


def _model(kind):
    model, opt = gpt()
    if kind == "bf16":
        model.to(BF16)                                   # loaded in bf16: AdamW keeps bf16 moments
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def _forward(model, ids, kind):
    if kind in ("autocast", "autocast16"):
        with torch.autocast("cpu", dtype=BF16 if kind == "autocast" else torch.float16):
            return loss_of(model, ids)
    return loss_of(model, ids)


def _plain(kind, bs, n, clip):
    model, opt = _model(kind)
    losses, norms = [], []
    for i, ids in enumerate(bs):
        loss = _forward(model, ids, kind)
        (loss / n).backward()
        losses.append(float(loss.detach()))
        if (i + 1) % n == 0:
            if clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            opt.zero_grad(set_to_none=True)
    return model, losses, norms


def _tiered(kind, bs, n, clip, **kw):
    model, opt = _model(kind)
    tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
    train = tier.wrap_training(model, opt, state_bytes(model), block_bytes=16 << 10, min_swap=4096, accumulate=n,
                               max_grad_norm=clip, **kw)
    losses, norms = [], []
    for i, ids in enumerate(bs):
        with train.step():
            loss = _forward(model, ids, kind)
            (loss / n).backward()
        losses.append(float(loss.detach()))
        if clip is not None and (i + 1) % n == 0:
            norms.append(float(train.grad_norm))
    return model, train, losses, norms


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"accumulate{c['n']}-clip{c['clip']}")
@pytest.mark.parametrize("kind", ["autocast", "autocast16", "bf16"])
def test_mixed_precision_trains_as_the_plain_loop_bitwise(kind, case):
    """fp16 autocast runs without a GradScaler here (a tiny model's gradients do not underflow):
    the scaler's step calls optimizer.step(), which the handle refuses (docs/training.md)."""
    n, clip = case["n"], case["clip"]
    bs = batches(4 * n)
    want, want_losses, want_norms = _plain(kind, bs, n, clip)
    model, train, got, norms = _tiered(kind, bs, n, clip)
    assert got == want_losses
    assert norms == want_norms
    for p, q in zip(model.parameters(), want.parameters()):
        assert p.dtype == q.dtype and torch.equal(p.detach(), q.detach())
    plan = train.plan
    assert plan.streamed_blocks and (plan.swapped_bytes > 0 or plan.recompute)
    if kind == "bf16":
        # the bf16 model's moments are bf16, held and moved as they are
        assert {dt for b in train.blocks for dt, _ in b.s_dtypes} == {BF16}
        assert {held for b in train.blocks for _, held in b.s_dtypes} == {BF16}
    train.unwrap()
    for p, q in zip(model.parameters(), want.parameters()):
        assert torch.equal(p.detach(), q.detach())


def test_autocast_plans_see_the_bf16_casts_autocast_saves():
    """Under autocast the step saves the bf16 casts of the weights (a linear's backward reads its
    weight): the trace records them among the activations, so the plan counts them."""
    bs = batches(3)
    _, fp32, _, _ = _tiered("fp32", bs, 1, None)
    _, auto, _, _ = _tiered("autocast", bs, 1, None)
    assert auto.trace.saved_bytes != fp32.trace.saved_bytes
    for t in (fp32, auto):
        t.unwrap()


def test_bf16_moments_under_autocast_stay_close_to_the_plain_loop():
    """fp32 masters under autocast with their AdamW moments held as bf16 at home
    (``state_dtype``, NOTE [bf16 moments]): rounded, so close to the plain loop, not bitwise."""
    bs = batches(6)
    _, want, _ = _plain("autocast", bs, 1, None)
    _, train, got, _ = _tiered("autocast", bs, 1, None, state_dtype=BF16)
    assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(got, want)), (got, want)
    train.unwrap()
