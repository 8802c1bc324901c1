"""Forwards outside train.step() under wrap_training (NOTE [evaluation between steps] in
tiermem/training/hooks.py), on the CPU over the fake backend: once a step has been traced, an evaluation
streams the blocks through the slots instead of reading their pinned homes in place. Its logits
are the plain model's, bitwise; it moves each streamed block's parameters in once; nothing stays
bound to a slot after it; a forward stopped part-way, a block called alone and a write between
evaluations change nothing of that; and training goes on with the plain run's losses."""
from __future__ import annotations

import pytest
import torch
from test_train import _deterministic, batches, gpt, loss_of, tiered, tiered_losses  # noqa: F401

STEPS = 4


def _plain_trained(bs):
    model, opt = gpt()
    for ids in bs:
        loss_of(model, ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def _logits(model, ids):
    with torch.no_grad():
        return model(ids[:, :-1])


def _home_bound(train) -> bool:
    """No parameter is bound to a slot, and no slot keeps a copy."""
    slots = list(train.stream.slots)
    return all(s.occupant is None and not s.has_params for s in slots) and all(b.slot is None for b in train.blocks)


def test_an_evaluation_streams_the_blocks_and_gives_the_plain_logits():
    bs, probe = batches(STEPS), batches(1, seed=7)[0]
    plain, _ = _plain_trained(bs)
    fake, tier, model, opt, train = tiered()
    tiered_losses(train, model, bs)
    streamed = sum(train.blocks[i].p_bytes for i in train.plan.streamed_blocks)
    assert streamed and _home_bound(train)
    before = tier.stats()["moved_bytes.weight.h2d"]
    for _ in range(2):
        assert torch.equal(_logits(model, probe), _logits(plain, probe))
        assert _home_bound(train)
    assert tier.stats()["moved_bytes.weight.h2d"] - before == 2 * streamed    # each block in, once a forward


@pytest.mark.parametrize("how", ["stopped-part-way", "a-block-alone"])
@pytest.mark.long
def test_forwards_off_the_traced_order_change_nothing(how):
    bs, probe = batches(STEPS + 2), batches(1, seed=7)[0]
    plain, plain_opt = _plain_trained(bs[:STEPS])
    fake, tier, model, opt, train = tiered()
    tiered_losses(train, model, bs[:STEPS])
    x = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(2))
    if how == "stopped-part-way":
        stop = model.blocks[2]
        h = stop.register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(RuntimeError("stop")))
        with pytest.raises(RuntimeError, match="stop"):
            _logits(model, probe)
        h.remove()
    else:
        with torch.no_grad():
            assert torch.equal(model.blocks[3](x), plain.blocks[3](x))
    with torch.no_grad():                  # a write between: the next forward reads it
        for m in (model, plain):
            m.blocks[1].fc.weight.mul_(0.5)
    assert torch.equal(_logits(model, probe), _logits(plain, probe))
    assert _home_bound(train)
    want = []
    for ids in bs[STEPS:]:
        loss = loss_of(plain, ids)
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
        want.append(float(loss.detach()))
    assert tiered_losses(train, model, bs[STEPS:]) == want
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))


def test_before_the_first_step_a_forward_reads_in_place():
    probe = batches(1, seed=7)[0]
    plain, _ = gpt()
    fake, tier, model, opt, train = tiered()
    before = tier.stats()["moved_bytes.weight.h2d"]
    assert torch.equal(_logits(model, probe), _logits(plain, probe))
    assert tier.stats()["moved_bytes.weight.h2d"] == before and _home_bound(train)
