"""wrap_training's adoption, steps (the traced one and a planned one, activation swap out and back
included) and unwrap, with a backend call failed in turn, on the CPU over the fake backend (the
sweep of tests/test_faults.py, for training; NOTE [device memory] in tiermem/pytorch/devmem.py).

Adoption fails at every call; unwrap makes none (nothing is bound to a slot between steps). A step makes ~800 calls, so its cases are every call
name at its first, middle and last use, and every 64th call besides. After each failure:

  - the error is tiermem's and keeps the CUDA error's name, or is the interrupt (raised inside a
    backward hook, it may cross autograd's engine as a RuntimeError carrying its message);
  - a failed adoption leaves the model as it was: the same parameter objects, their
    bytes, no hooks or handle left, nothing allocated, no lease, the cap given back;
  - a failed step leaves no gradient, and the next steps train;
  - once unwrapped and closed, nothing is left allocated.
"""
from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from fakes import FakeBackend
from helpers import fault_params
from test_train import batches, gpt, loss_of, state_bytes

import tiermem

SMALL = dict(layers=2, d=32, seq=16)
KW = dict(block_bytes=4 << 10, min_swap=1024)
EVERY = 64


def _small():
    import test_train
    old = dict(test_train.CFG)
    test_train.CFG.update(SMALL)
    try:
        return gpt()
    finally:
        test_train.CFG.clear()
        test_train.CFG.update(old)


def _batches(n: int) -> list[torch.Tensor]:
    return [b[:, :SMALL["seq"] + 1] for b in batches(n)]


class Scene:
    def __init__(self, name: str):
        self.fake = FakeBackend(total=1 << 30, foreign_host=True)
        self.tier = tiermem.Tier(backend=self.fake)
        self.model, self.opt = _small()
        self.bs = _batches(6)
        self.train: Any = None
        self.name = name
        if name != "train_adopt":
            self.adopt()
        if name in ("train_step", "train_unwrap"):
            for ids in self.bs[:2]:
                self.step(ids)

    def adopt(self) -> None:
        self.train = self.tier.wrap_training(self.model, self.opt, state_bytes(self.model), **KW)

    def step(self, ids: torch.Tensor) -> float:
        with self.train.step():
            loss = loss_of(self.model, ids)
            loss.backward()
        return float(loss.detach())

    def op(self) -> None:
        if self.name == "train_adopt":
            self.adopt()
        elif self.name == "train_unwrap":
            self.train.unwrap()
        else:
            self.step(self.bs[2])


def _calls(name: str) -> list[str]:
    sc = Scene(name)
    with sc.fake.counting() as seen:
        sc.op()
    return seen


def _picked(seen: list[str]) -> list[int]:
    """1-based positions: all of them for short operations; for a step, every call name at its
    first, middle and last use, and every EVERY-th call."""
    if len(seen) <= EVERY:
        return list(range(1, len(seen) + 1))
    at: dict[str, list[int]] = {}
    for i, call in enumerate(seen, 1):
        at.setdefault(call, []).append(i)
    picked = {p for ps in at.values() for p in (ps[0], ps[len(ps) // 2], ps[-1])}
    picked |= set(range(EVERY, len(seen) + 1, EVERY))
    return sorted(picked)


def _cases() -> list[Any]:
    out = []
    for name in ("train_adopt", "train_traced_step", "train_step"):
        seen = _calls(name)
        out += fault_params(name, seen, _picked(seen))
    return out


CASES = _cases()


def _check_error(err: BaseException | None, kind: str) -> None:
    assert err is not None, "the failure was swallowed"
    if kind == "interrupt":
        assert isinstance(err, KeyboardInterrupt) or "injected at" in str(err), repr(err)
        return
    name = "cudaErrorMemoryAllocation" if kind == "oom" else "cudaErrorLaunchFailure"
    assert isinstance(err, tiermem.TierMemError) or name in str(err), f"not tiermem's error: {err!r}"
    assert getattr(err, "name", None) == name or name in str(err), f"the CUDA error's name was lost: {err!r}"


def _snapshot(model) -> list[tuple[Any, int, torch.Tensor]]:
    return [(p, p.data_ptr(), p.detach().clone()) for p in model.parameters()]


def _as_before(sc: Scene, snap) -> None:
    assert getattr(sc.model, "_tiermem_handle", None) is None
    for (p, ptr, data), q in zip(snap, sc.model.parameters()):
        assert p is q and p.data_ptr() == ptr and torch.equal(p.detach(), data)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in sc.model.modules())
    assert not sc.tier.leases


def _nothing_left(sc: Scene) -> None:
    sc.train = None
    gc.collect()
    sc.tier.close()
    assert sc.fake.live() == {"managed": 0, "pinned": 0, "device": 0}, "bytes leaked"


@pytest.mark.parametrize(("name", "n", "call", "kind"), CASES)
def test_fault(name: str, n: int, call: str, kind: str) -> None:
    sc = Scene(name)
    snap = _snapshot(sc.model) if name == "train_adopt" else None
    sc.fake.fail_at(n, kind)
    err = None
    try:
        sc.op()
    except BaseException as e:      # noqa: B036 - the interrupt is what is under test
        err = e
        err.__traceback__ = None     # its frames would keep the step's tensors alive
    sc.fake.disarm()
    assert sc.fake.fired is not None and sc.fake.fired[1] == call, f"call {n} is {sc.fake.fired}, not {call}"
    _check_error(err, kind)
    del err
    if name == "train_adopt":
        sc.train = None
        _as_before(sc, snap)
        gc.collect()
        assert sc.fake.live() == {"managed": 0, "pinned": 0, "device": 0}, "a failed adoption left bytes behind"
        sc.adopt()                  # and it works now
    else:
        assert all(p.grad is None for p in sc.model.parameters()), "a failed step left gradients"
    losses = [sc.step(ids) for ids in sc.bs[3:5]]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    mem = sc.train.mem
    sc.train.unwrap()
    assert mem.fraction() == 1.0 and not sc.tier.leases
    assert all(torch.isfinite(p).all() for p in sc.model.parameters())
    _nothing_left(sc)


def test_fault_training_sweep_covers_every_operation_and_call_name():
    names = {c.values[0] for c in CASES}
    assert names == {"train_adopt", "train_traced_step", "train_step"}
    # Between steps no parameter is bound to a slot (NOTE [training transport]), so unwrap's
    # copies are torch's alone and it makes no backend call to fail; its failures are the room
    # check's and torch's (tests/test_train.py, tests/test_gpu_train.py).
    assert _calls("train_unwrap") == []
    calls = {name: {c.values[2] for c in CASES if c.values[0] == name} for name in names}
    assert {"copy", "record", "wait", "new_event", "query"} <= calls["train_step"], calls["train_step"]
    assert {"torch_view", "host_alloc"} <= calls["train_traced_step"] and "host_alloc" in calls["train_adopt"], calls
    assert len(CASES) >= 100, len(CASES)
