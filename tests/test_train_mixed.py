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
@pytest.mark.long(keep=2)
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


def test_autocast_casts_of_the_weights_are_cast_again_in_backward_not_swapped():
    """NOTE [saved casts]: a linear layer under autocast saves its weight's bf16 copy; the swap
    keeps which parameter it was and backward casts it again, so the trace's saves are the
    activations alone (here tiny beside the weights), and the losses are the plain loop's."""
    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, 256, generator=g, requires_grad=True) for _ in range(4)]

    def loss(m, x):
        with torch.autocast("cpu", dtype=BF16):
            return m(x).float().square().mean()
    m, opt = build()
    want = []
    for x in xs:
        v = loss(m, x)
        v.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(float(v.detach()))
    m, opt = build()
    tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
    train = tier.wrap_training(m, opt, 1 << 20, block_bytes=256 << 10, min_swap=256, recompute="never")
    got = []
    for x in xs:
        with train.step():
            v = loss(m, x)
            v.backward()
        got.append(float(v.detach()))
    assert got == want
    weight_cast = 256 * 256 * 2
    assert train.trace.saved and train.trace.saved_bytes < weight_cast, train.trace.saved_bytes
    assert train.plan.streamed_blocks
    train.unwrap()


def test_bf16_moments_under_autocast_stay_close_to_the_plain_loop():
    """fp32 masters under autocast with their AdamW moments held as bf16 at home
    (``state_dtype``, NOTE [bf16 moments]): rounded, so close to the plain loop, not bitwise."""
    bs = batches(6)
    _, want, _ = _plain("autocast", bs, 1, None)
    _, train, got, _ = _tiered("autocast", bs, 1, None, state_dtype=BF16)
    assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(got, want)), (got, want)
    train.unwrap()
