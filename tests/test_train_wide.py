"""Wide blocks (NOTE [wide blocks] in tiermem/training/floor.py), on the CPU over the fake backend:
a Llama whose embedding and head are its largest blocks steps those two at the step's end across
the whole ring, so the slots are sized by its decoder layers. The losses and parameters are the
plain loop's bitwise, with accumulation too; the floor names the wide blocks and is lower than
without them; the option is checked."""
from __future__ import annotations

import gc

import pytest
import torch
from fakes import FakeBackend
from test_train import _deterministic, tiered_losses  # noqa: F401 - the fixture, autouse here too
from test_train_finetune import _llama, _loss

import tiermem
from tiermem.errors import ConfigError, ConfigTypeError
from tiermem.training.options import TrainingOptions

VOCAB = 4096        # an embedding and a head of 0.5M parameters each, a decoder layer 0.18M


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, 32), generator=g) for _ in range(n)]


def _plain(model, opt, bs, accumulate):
    """The plain loop's losses, the optimizer stepping every ``accumulate``-th micro-batch."""
    out = []
    for i, ids in enumerate(bs):
        loss = _loss(model, ids)
        loss.backward()
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
        out.append(float(loss.detach()))
    return out


def _wrap(budget_share=2, **kw):
    model, opt = _llama(vocab=VOCAB)
    state = 16 * sum(p.numel() for p in model.parameters())
    fake = FakeBackend(total=1 << 30, foreign_host=True)
    fake.enforces_budget = True
    tier = tiermem.Tier(backend=fake)
    train = tier.wrap_training(model, opt, int(state / budget_share), block_bytes=1 << 20, min_swap=16384, **kw)
    return model, opt, fake, tier, train


def _close(train, tier, fake):
    train.unwrap()
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_wide_blocks_step_at_the_end_and_give_the_plain_loops_losses_bitwise(accumulate):
    bs = _batches(6)
    model, opt = _llama(vocab=VOCAB)
    want = _plain(model, opt, bs, accumulate)
    want_params = [p.detach().clone() for p in model.parameters()]
    model, opt, fake, tier, train = _wrap(wide_blocks=True, accumulate=accumulate)
    f = train.budget_floor
    assert f.wide == ("model.embed_tokens", "lm_head") and f.block.startswith("model.layers.")
    embed = next(b for b in train.blocks if b.name == "model.embed_tokens")
    assert embed.wide and train.stream.slot_bytes < 16 * embed.params[0].numel()
    assert tiered_losses(train, model, bs, _loss) == want
    assert "step across them at the step's end" in str(train.budget_floor)
    model_params = [p.detach().clone() for p in model.parameters()]
    _close(train, tier, fake)
    assert all(torch.equal(a, b) for a, b in zip(model_params, want_params))


def test_the_floor_with_wide_blocks_is_lower_and_none_chooses_them_where_slots_would_crowd_the_budget():
    model, opt, fake, tier, train = _wrap(budget_share=1, wide_blocks=False)
    plain = train.budget_floor
    assert not plain.wide and plain.block in ("model.embed_tokens", "lm_head")
    _close(train, tier, fake)
    model, opt, fake, tier, train = _wrap(budget_share=1, wide_blocks=True)
    wide = train.budget_floor
    assert wide.bytes < plain.bytes and wide.slot_bytes < plain.slot_bytes
    _close(train, tier, fake)
    # None: wide where the slots at the largest block's size take more than a third of the budget;
    # its floor is the wide one at every budget, since at that floor the same rule steps them wide
    for share, expect in ((0.5, False), (2, True)):
        model, opt, fake, tier, train = _wrap(budget_share=share)
        assert any(b.wide for b in train.blocks) == expect, share
        assert train.budget_floor == wide, (share, str(train.budget_floor))
        _close(train, tier, fake)


def test_wide_blocks_are_checked():
    with pytest.raises(ConfigTypeError, match="wide_blocks"):
        TrainingOptions(wide_blocks="yes")
    with pytest.raises(ConfigError, match="wide_blocks"):
        TrainingOptions(wide_blocks=True, max_grad_norm=1.0)
    model, opt, fake, tier, train = _wrap(budget_share=1, max_grad_norm=1.0)   # None with clipping: never wide
    assert not train.budget_floor.wide and not any(b.wide for b in train.blocks)
    _close(train, tier, fake)
