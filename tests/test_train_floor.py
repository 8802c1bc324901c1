"""NOTE [the floor] on the CPU: the smallest budget at which every step of a training runs, its
slots' part refused at wrap, its activations' part at the end of the traced first step, and the
traced step at the floor. The fake backend says it enforces its budgets as a GPU's would
(``enforces_budget``); torch's CPU allocator has no peak, so the tests give the trainer the
traced step's activations (fakes.PeakedHostMemory), as CUDA's caching allocator would report them."""
from __future__ import annotations

import logging

import pytest
import torch
from fakes import FakeBackend, PeakedHostMemory
from test_train import batches, gpt, loss_of, plain_run, tiered_losses

import tiermem
from tiermem.training.floor import FLOOR_SLACK, asked_bytes, trace_slots
from tiermem.training.slots import aligned

KW = dict(block_bytes=16 << 10, min_swap=4096)


def _tier():
    fake = FakeBackend(total=1 << 30, foreign_host=True)
    fake.enforces_budget = True
    return tiermem.Tier(backend=fake)


def _wrap(budget, **kw):
    model, opt = gpt()
    tier = _tier()
    return model, opt, tier, tier.wrap_training(model, opt, budget, **{**KW, **kw})


def _slots_floor():
    """The floor before the first step, read from a training wrapped with room to spare."""
    model, opt, tier, train = _wrap(64 << 20)
    f = train.budget_floor
    big = max(train.blocks, key=lambda b: b.p_bytes)
    train.unwrap()
    return f, big


def _activations(train, act):
    """The traced step's activations, as torch's caching allocator would report them."""
    train.mem = PeakedHostMemory(train.mem, lambda: train.stream.nslots * train.stream.slot_bytes + act)


def test_the_floor_at_wrap_counts_the_fewest_slots_of_the_largest_block_with_its_states():
    f, big = _slots_floor()
    assert f.activations is None and f.workspace == 0           # no cuBLAS on the host
    # AdamW keeps two moments of each parameter: a slot holds parameters, gradients and both
    assert f.slot_bytes == aligned(4 * big.p_bytes) and f.slots == 2 and f.bytes == 2 * f.slot_bytes
    assert big.name in f.what and "known after the first step" in f.what


def test_a_budget_below_the_floor_is_refused_at_wrap_with_the_floor_and_nothing_taken():
    f, big = _slots_floor()
    model, opt = gpt()
    tier = _tier()
    with pytest.raises(tiermem.OutOfBudgetError, match=r"NOTE \[the floor\]") as e:
        tier.wrap_training(model, opt, f.bytes - 1, **KW)
    assert f"{f.bytes:,}" in str(e.value) and big.name in str(e.value)
    assert not tier.leases and all(p.device.type == "cpu" and not hasattr(p, "_tiermem") for p in model.parameters())
    train = tier.wrap_training(model, opt, f.bytes, **KW)         # at it: taken
    assert train.budget_floor.bytes == f.bytes
    train.unwrap()


def test_a_budget_below_the_traced_steps_floor_ends_that_step_with_the_floor_and_what_sets_it():
    f, _ = _slots_floor()
    act = 4 * f.slot_bytes
    model, opt, tier, train = _wrap(f.bytes + act // 2)
    _activations(train, act)
    assert train.stream.nslots == 2          # three slots would take more than half the budget
    with pytest.raises(tiermem.OutOfBudgetError, match=r"NOTE \[the floor\]") as e:
        tiered_losses(train, model, batches(1))
    g = train.budget_floor
    assert g.activations == act + -(-int(act * FLOOR_SLACK) // 1)
    assert g.bytes == 2 * aligned(train.stream.needed_slot_bytes()) + g.activations
    assert f"{g.bytes:,}" in str(e.value) and "activations" in str(e.value)
    assert g.largest > 0 and "saved" in g.what
    train.unwrap()


def test_the_traced_step_at_the_floor_runs_and_so_does_every_step_after(caplog):
    bs = batches(5)
    want, want_params = plain_run(bs)
    f, _ = _slots_floor()
    act = 2 * f.slot_bytes            # three slots would take more than half of the floor
    floor = 2 * f.slot_bytes + act + -(-int(act * FLOOR_SLACK) // 1)    # AdamW's states: the estimate is exact
    with caplog.at_level(logging.INFO, logger="tiermem"):
        model, opt, tier, train = _wrap(floor)
        _activations(train, act)
        got = tiered_losses(train, model, bs)
    assert got == want
    assert train.budget_floor.bytes == floor == train.budget
    assert train.stream.nslots == 2 and train.plan.budget_floor == floor
    assert "budget floor" in str(train.plan) and "the least budget every step runs at" in train.plan.table()
    assert train.plan.predicted_peak <= train.budget and not train.plan.keep and not train.plan.resident_blocks
    assert any("traced through 2 slots" in r.getMessage() for r in caplog.records)
    train.unwrap()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), want_params))


def test_with_room_the_trace_keeps_the_configured_slots_and_the_plan_gets_them():
    f, _ = _slots_floor()
    model, opt, tier, train = _wrap(64 << 20, recompute="never")
    _activations(train, f.slot_bytes)
    assert train.stream.nslots == 3
    tiered_losses(train, model, batches(2))
    assert train.stream.nslots == 3 and train.budget_floor.activations is not None
    train.unwrap()


@pytest.mark.skipif(not hasattr(BaseException, "add_note"), reason="exception notes are Python 3.11+")
def test_torch_running_out_in_the_traced_step_says_the_floor_is_at_least_what_it_held_and_asked():
    f, _ = _slots_floor()
    model, opt, tier, train = _wrap(64 << 20)
    held = 3 << 20
    train.mem = PeakedHostMemory(train.mem, held)
    with pytest.raises(torch.OutOfMemoryError) as e:
        with train.step():
            loss_of(model, batches(1)[0]).backward()
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has ...")
    notes = "\n".join(e.value.__notes__)
    assert f"floor is at least {held + (2 << 20) + tier.resident_bytes:,} bytes" in notes
    assert "NOTE [the floor]" in notes
    least = held + (2 << 20) + tier.resident_bytes
    if least > f.bytes:                                 # the handle says it too, as a lower bound
        assert train.budget_floor.at_least and train.budget_floor.bytes == least
        assert str(train.budget_floor).startswith(f"at least {least:,} bytes")
    del e
    train.mem = train.mem.inner
    tiered_losses(train, model, batches(2))            # the next step traces again and runs
    assert train.plan is not None and not train.budget_floor.at_least
    train.unwrap()


def test_the_pieces():
    assert asked_bytes("Tried to allocate 500.00 MiB. GPU 0") == 500 << 20
    assert asked_bytes("Tried to allocate 1.50 GiB") == int(1.5 * (1 << 30))
    assert asked_bytes("out of memory") == 0
    assert trace_slots(3, 2, 100, 600) == 3 and trace_slots(3, 2, 100, 599) == 2 and trace_slots(2, 3, 1, 10) == 2
