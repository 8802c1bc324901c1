"""NOTE [fewer slots] on the CPU: where the traced step's measured peak, with the slots grown to
hold the optimizer states, and tiermem's resident bytes pass the budget, the ring gives up slots
(and lookahead) down to two, and where even two do not fit the step is refused with what it
needs. torch's CPU allocator reports no peak, so the tests give the trainer one
(fakes.PeakedHostMemory), as CUDA's caching allocator would on a GPU."""
from __future__ import annotations

import logging

import pytest
import torch
from fakes import PeakedHostMemory
from test_train import batches, plain_run, tiered, tiered_losses

import tiermem


def peak_for(train, tier, slots: float):
    """A peak that, with the slots grown and the resident bytes, leaves the budget short by
    ``slots`` grown slots (negative: room for that many)."""
    def peak() -> int:
        slot = train.stream.needed_slot_bytes()
        grown = -(-slot // 4096) * 4096     # the upper bound of the slot's alignment on the fake
        growth = train.stream.nslots * max(grown - train.stream.slot_bytes, 0)
        return max(int(train.budget - tier.resident_bytes - growth + slots * grown), 0)
    return peak


def test_a_peak_the_slots_do_not_fit_lowers_the_lookahead_and_trains_as_plain(caplog):
    bs = batches(6)
    want, want_params = plain_run(bs)
    fake, tier, model, opt, train = tiered(lookahead=3)
    before = train.stream.nslots
    train.mem = PeakedHostMemory(train.mem, peak_for(train, tier, 1.5))
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        got = tiered_losses(train, model, bs)
    assert got == want
    assert train.stream.nslots == before - 2 and train.stream.lookahead == 1
    assert [r for r in caplog.records if "NOTE [fewer slots]" in r.getMessage()]
    train.unwrap()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), want_params))


def test_a_peak_that_fits_keeps_every_slot(caplog):
    bs = batches(3)
    want, _ = plain_run(bs)
    fake, tier, model, opt, train = tiered(lookahead=3, recompute="never")     # no slot for recompute either
    before = (train.stream.nslots, train.stream.lookahead)
    train.mem = PeakedHostMemory(train.mem, peak_for(train, tier, -0.5))
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        assert tiered_losses(train, model, bs) == want
    assert (train.stream.nslots, train.stream.lookahead) == before
    assert not [r for r in caplog.records if "fewer slots" in r.getMessage()]


def test_a_peak_two_slots_do_not_fit_is_refused_with_what_it_needs_and_training_goes_on_when_it_fits():
    bs = batches(4)
    want, want_params = plain_run(bs)
    fake, tier, model, opt, train = tiered(lookahead=1)
    mem = PeakedHostMemory(train.mem, lambda: 10 * train.budget)
    train.mem = mem
    with pytest.raises(tiermem.OutOfBudgetError, match=r"NOTE \[fewer slots\]") as e:
        tiered_losses(train, model, bs[:1])
    assert "raise the budget to at least" in str(e.value)
    assert train.stream.nslots == 2
    mem.peak = 0                                        # in budget now: the next step traces again
    # The refused step had stepped every block (the refusal comes at its end, from its peak), so
    # the run goes on from the plain run's second step, bitwise.
    assert tiered_losses(train, model, bs[1:]) == want[1:]
    assert train.plan is not None
    train.unwrap()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), want_params))


def test_a_slot_goes_where_it_lets_recomputing_everywhere_recompute_every_block(caplog):
    """NOTE [a slot for recompute]: half a slot of room holds no recomputed segment; one slot
    fewer holds one, so every block is recomputed, and the losses stay the plain run's."""
    bs = batches(4)
    want, want_params = plain_run(bs)
    fake, tier, model, opt, train = tiered(lookahead=3, recompute="always")
    before = train.stream.nslots
    train.mem = PeakedHostMemory(train.mem, peak_for(train, tier, -0.5))
    with caplog.at_level(logging.INFO, logger="tiermem"):
        assert tiered_losses(train, model, bs) == want
    assert train.stream.nslots == before - 1 and train.stream.lookahead == 2
    assert train.plan.recompute == train.trace.recomputable and train.trace.recomputable
    assert [r for r in caplog.records if "NOTE [a slot for recompute]" in r.getMessage()]
    assert not [r for r in caplog.records if "NOTE [fewer slots]" in r.getMessage()]
    train.unwrap()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), want_params))


def test_no_slot_goes_for_recompute_where_the_room_already_holds_every_segment():
    fake, tier, model, opt, train = tiered(lookahead=3, recompute="always")
    before = train.stream.nslots
    train.mem = PeakedHostMemory(train.mem, peak_for(train, tier, -1.0))
    tiered_losses(train, model, batches(2))
    assert train.stream.nslots == before
    assert train.plan.recompute == train.trace.recomputable
