"""wrap_module's forward and unwrap with a backend call failed in turn, on the CPU over the fake
backend (the sweep of tests/test_faults.py, for inference; adoption is swept in
tests/test_module_use.py). Scenes: a streamed forward from the pinned home, a forward whose
groups come from disk (the disk tier), and unwrap to the host and to the model's device. The disk scene is swept twice: over the calls the
forward makes on its own thread, and over the first calls of the disk tier's reader thread (which
reads ahead, across forwards; NOTE [disk read errors] in inference/disk.py).

After each failure: the error is tiermem's and keeps the CUDA error's name, or is the interrupt;
the next forward gives the same output as the model before adoption; a failed unwrap leaves the
model adopted and running; once unwrapped and closed, nothing is left allocated and every
parameter holds its bytes.
"""
from __future__ import annotations

import gc
import time
from typing import Any

import pytest
import torch
import torch.nn as nn
from fakes import FakeBackend
from helpers import fault_params, share

import tiermem

save_file = pytest.importorskip("safetensors.torch").save_file

MiB = 1 << 20
SCENES = ("module_forward", "module_forward_disk", "module_unwrap", "module_unwrap_device")
READER = "tiermem-disk"         # the disk tier's reader thread
READER_CALLS = 6                # its first calls swept (fence waits: a forward makes about four)


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)) for _ in range(6)],
                         nn.LayerNorm(128)).requires_grad_(False)


class Scene:
    def __init__(self, name: str, tmp: Any):
        self.name = name
        self.fake = FakeBackend(total=1 << 30)
        self.tier = tiermem.Tier(backend=self.fake)
        self.ref = _mlp()
        self.x = torch.randn(4, 128, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            self.want = self.ref(self.x)
        self.bytes = [p.detach().clone() for p in self.ref.parameters()]
        if name.startswith("module_forward_disk"):
            save_file(self.ref.state_dict(), tmp / "model.safetensors")
            from tiermem.inference.load import Checkpoint, empty_weights
            with empty_weights():
                self.model = _mlp()
            self.handle = self.tier.wrap_module(self.model, budget=share(self.model, 25), max_group_bytes=MiB // 4,
                                                weights=Checkpoint(tmp), host_budget=700_000)
            assert self.handle.plan.on_disk
        else:
            self.model = self.ref
            self.handle = self.tier.wrap_module(self.model, budget=share(self.model, 25), max_group_bytes=MiB // 4)
        if name == "module_forward_disk":
            # The forward's look-ahead takes a group from disk only if its read is done, so its
            # calls would depend on the reader's pace (155 or 143 in CI runs): here every read is
            # waited for, which makes them the same on every run. The reader's own scene keeps
            # the real pace.
            disk = self.handle._stream.disk
            take = disk.take
            disk.take = lambda g, wait=True: take(g, True)
        self.forward()                          # the first forward learns the order
        if name.startswith("module_forward_disk"):
            self.settle()

    def settle(self) -> None:
        """Wait until the disk tier's reader has read as far ahead as it may (its reads count stops
        moving), so that the forward's own calls come in the same order on every run."""
        last, still = -1, 0
        for _ in range(400):
            n = self.handle.stats()["disk.reads"]
            still = still + 1 if n == last else 0
            if still == 3:
                return
            last = n
            time.sleep(0.005)

    def forward(self) -> torch.Tensor:
        with torch.no_grad():
            return self.model(self.x)

    def op(self) -> None:
        if self.name == "module_unwrap":
            self.handle.unwrap()
        elif self.name == "module_unwrap_device":
            self.handle.unwrap(device="cpu")    # the fake's device memory is host memory
        else:
            assert torch.equal(self.forward(), self.want)


def _calls(name: str, tmp: Any) -> list[str]:
    sc = Scene(name, tmp)
    with sc.fake.counting(thread="MainThread") as seen:     # the reader's calls are swept apart
        sc.op()
    return seen


def _cases() -> list[Any]:
    import tempfile
    from pathlib import Path
    out = []
    for name in SCENES:
        with tempfile.TemporaryDirectory() as d:
            out += fault_params(name, _calls(name, Path(d)))
    out += [pytest.param("module_forward_disk_reader", n, "synchronize", kind,
                         id=f"fault-module_forward_disk_reader-{n:03d}-synchronize-{kind}")
            for n in range(1, READER_CALLS + 1) for kind in ("cuda", "interrupt")]
    return out


CASES = _cases()


@pytest.mark.parametrize(("name", "n", "call", "kind"), CASES)
def test_fault(name: str, n: int, call: str, kind: str, tmp_path) -> None:
    sc = Scene(name, tmp_path)
    reader = name == "module_forward_disk_reader"
    sc.fake.fail_at(n, kind, thread=READER if reader else "MainThread")
    err = None
    try:
        sc.op()
    except BaseException as e:      # noqa: B036 - the interrupt is what is under test
        err = e
        err.__traceback__ = None
    if reader:
        # A read ahead that failed is read again when a forward needs it: no forward fails.
        assert err is None, repr(err)
        for _ in range(2):
            assert torch.equal(sc.forward(), sc.want)
        assert sc.handle.stats()["disk.retries"] == 1, sc.handle.stats()
    sc.fake.disarm()
    assert sc.fake.fired is not None and sc.fake.fired[1] == call, f"call {n} is {sc.fake.fired}, not {call}"
    if err is not None:
        if kind == "interrupt":
            assert isinstance(err, KeyboardInterrupt), repr(err)
        else:
            cuda = "cudaErrorMemoryAllocation" if kind == "oom" else "cudaErrorLaunchFailure"
            assert isinstance(err, tiermem.TierMemError) and cuda in str(err), repr(err)
    del err
    if name.startswith("module_unwrap") and getattr(sc.model, "_tiermem_handle", None) is None:
        pass                                  # the failure came after the model was given back
    else:
        assert getattr(sc.model, "_tiermem_handle", None) is not None
        for _ in range(2):                    # the next forwards give the same output
            assert torch.equal(sc.forward(), sc.want)
        sc.handle.unwrap()
    assert getattr(sc.model, "_tiermem_handle", None) is None
    for p, data in zip(sc.model.parameters(), sc.bytes):
        assert torch.equal(p.detach(), data)
    with torch.no_grad():
        assert torch.equal(sc.model(sc.x), sc.want)
    sc.handle = None
    gc.collect()
    sc.tier.close()
    assert sc.fake.live() == {"managed": 0, "pinned": 0, "device": 0}, "bytes leaked"


def test_fault_module_sweep_covers_every_scene():
    assert {c.values[0] for c in CASES} == {*SCENES, "module_forward_disk_reader"}
    assert len(CASES) >= 50, len(CASES)
