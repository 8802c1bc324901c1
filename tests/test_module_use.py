"""wrap_module as users run it, on a CPU over the fake backend: parameters that keep transformers'
default requires_grad=True, the path chosen by the grad mode (NOTE [trainable weights in the
pinned home]), writes to weights between and during forwards, all-or-nothing adoption and unwrap
(NOTE [all or nothing])."""
from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn as nn
from helpers import share

import tiermem
from tiermem.pytorch.wrap import TIERED_ATTR

MiB = 1 << 20


def _model(requires_grad: bool = True) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)) for _ in range(6)],
                      nn.LayerNorm(256))
    return m.requires_grad_(requires_grad)


def _live(fake) -> int:
    return len(fake._arrays)    # every managed, pinned and device allocation the fake holds


def test_no_grad_forwards_stream_whatever_requires_grad_says(tier, fake):
    m = _model()                                  # every parameter requires grad, as transformers leaves them
    ref = copy.deepcopy(m)
    h = tier.wrap_module(m, budget=share(m, 40), max_group_bytes=1 * MiB)
    assert h.transport == "pinned" and 0 < len(h.plan.pinned) < len(h.plan.sizes)
    streamed = [t for g in h._groups.values() if not g.pinned for t in g.tensors]
    assert all(fake.pointer_kind(t.data_ptr()) == "host" for t in streamed)   # a pinned home, not managed memory
    x = torch.randn(32, 256)
    with torch.no_grad():
        for _ in range(3):
            before = tier.stats()["moved_bytes.weight.h2d"]
            assert torch.equal(m(x), ref(x)) and h._fwd_mode == "stream"
            assert tier.stats()["moved_bytes.weight.h2d"] > before
    with torch.inference_mode():
        assert torch.equal(m(x), ref(x)) and h._fwd_mode == "stream"
    assert tier.stats()["resident_bytes.all.peak"] <= h.budget
    h.unwrap()


def test_a_forward_that_records_gradients_reads_in_place_and_gives_the_right_gradients(tier, fake):
    m = _model()
    ref = copy.deepcopy(m)
    h = tier.wrap_module(m, budget=share(m, 40), max_group_bytes=1 * MiB, lookahead=2)
    x = torch.randn(32, 256)
    with torch.no_grad():
        m(x), m(x)                                # learn the order; slots are loaded ahead for the next forward
    moved = tier.stats()["moved_bytes.weight.h2d"]
    loss, want = m(x).square().mean(), ref(x).square().mean()
    assert h._fwd_mode == "zero_copy" and torch.equal(loss, want)
    assert tier.stats()["moved_bytes.weight.h2d"] == moved     # read in place: nothing moved
    loss.backward()
    want.backward()
    streamed = {id(t) for g in h._groups.values() if not g.pinned for t in g.tensors}
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
        if id(p) in streamed:   # the gradient lives beside its weight in pinned host memory
            assert fake.pointer_kind(p.grad.data_ptr()) == "host", name
    # An optimizer step writes the weights at home; the slots loaded ahead before it are stale.
    opt, ropt = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    opt.step()
    ropt.step()
    with torch.no_grad():
        assert torch.equal(m(x), ref(x)) and h._fwd_mode == "stream"
    # A second backward accumulates into the gradients' home in place.
    m(x).sum().backward()
    ref(x).sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    h.unwrap()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)
        assert fake.pointer_kind(p.grad.data_ptr()) == "unregistered"   # plain memory again
    assert _live(fake) == 0


def test_a_write_made_in_a_slot_during_a_forward_is_kept(tier, fake):
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.BatchNorm1d(128)) for _ in range(6)])
    ref = copy.deepcopy(m)
    m.train(), ref.train()                        # BatchNorm updates its running stats in its forward
    h = tier.wrap_module(m, budget=share(m, 30), max_group_bytes=256 << 10, mode="stream")
    assert len(h.plan.pinned) < len(h.plan.sizes)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(32, 128)
            assert torch.equal(m(x), ref(x))
    m.eval(), ref.eval()
    with torch.no_grad():
        x = torch.randn(32, 128)
        assert torch.equal(m(x), ref(x))          # eval reads the running stats the train forwards wrote
    for (name, b), rb in zip(m.named_buffers(), ref.buffers()):
        assert torch.equal(b, rb), name
    h.unwrap()


def test_unwrap_onto_the_host_and_only_once(tier, fake):
    m = _model()
    ref = copy.deepcopy(m)
    h = tier.wrap_module(m, budget=share(m, 40), max_group_bytes=1 * MiB)
    h.unwrap(device="cpu")
    assert all(fake.pointer_kind(p.data_ptr()) == "unregistered" and p.device.type == "cpu" for p in m.parameters())
    assert all(not hasattr(p, TIERED_ATTR) for p in m.parameters())
    x = torch.randn(4, 256)
    assert torch.equal(m(x), ref(x))
    with pytest.raises(tiermem.TierMemError, match="unwrapped already"):
        h.unwrap()
    assert _live(fake) == 0 and tier.budget is None


class _FailAt:
    """Makes the fake backend's ``method`` raise ``exc()`` at its ``n``-th call (0-based)."""

    def __init__(self, fake, method: str, n: int, exc: BaseException):
        self.orig, self.n, self.exc, self.calls = getattr(fake, method), n, exc, 0
        self.fake, self.method = fake, method
        setattr(fake, method, self)

    def __call__(self, *a, **k):
        i, self.calls = self.calls, self.calls + 1
        if i == self.n:
            # A fresh instance: a raised exception keeps its traceback, and with it every frame's
            # locals, alive for as long as the instance lives (the parameter outlives the test).
            raise self.exc()
        return self.orig(*a, **k)

    def undo(self) -> None:
        setattr(self.fake, self.method, self.orig)


def _calls(fake, method: str, build) -> int:
    probe = _FailAt(fake, method, -1, RuntimeError)
    try:
        h = build()
    finally:
        probe.undo()
    h.unwrap()
    return probe.calls


@pytest.mark.parametrize("method", ["allocate", "host_alloc", "device_alloc", "advise", "prefetch", "copy", "torch_view",
                                    "new_event", "record", "wait"])
@pytest.mark.parametrize("exc", [lambda: tiermem.CUDAError("cudaMemPrefetchAsync", 2, "cudaErrorMemoryAllocation"),
                                 KeyboardInterrupt], ids=["cuda", "interrupt"])
def test_fault_in_wrap_module_leaves_the_module_as_it_was(tier, fake, method, exc):
    m = _model()
    x = torch.randn(4, 256)
    with torch.no_grad():
        want = m(x)
    live = _live(fake)
    build = lambda: tier.wrap_module(m, budget=share(m, 40), max_group_bytes=1 * MiB)  # noqa: E731
    n_calls = _calls(fake, method, build)         # a clean adoption and unwrap, counting the calls
    assert _live(fake) == live and tier.budget is None
    params = [(p, p.data_ptr(), p.detach().clone(), p.requires_grad) for p in m.parameters()]
    stats = tier.stats()
    for n in sorted({0, n_calls // 2, n_calls - 1}) if n_calls else []:
        inj = _FailAt(fake, method, n, exc)
        try:
            with pytest.raises((tiermem.CUDAError, KeyboardInterrupt)):
                build()
        finally:
            inj.undo()
        gc.collect()
        for p, ptr, data, rg in params:           # the same memory, the same bytes, the same flag
            assert p.data_ptr() == ptr and torch.equal(p.data, data) and p.requires_grad == rg
            assert not hasattr(p, TIERED_ATTR)
        assert getattr(m, "_tiermem_handle", None) is None
        assert not m._forward_pre_hooks and not m[0][0]._forward_pre_hooks
        assert _live(fake) == live, f"{method}#{n} leaked"
        assert tier.budget is None and tier.resident_bytes == 0
        now = tier.stats()
        for k in ("resident_bytes.all.current", "allocated_bytes.all.current"):
            assert now.get(k) == stats.get(k), k
        with torch.no_grad():
            assert torch.equal(m(x), want)        # it still runs, with the same output
    h = build()                                   # and the next adoption succeeds
    with torch.no_grad():
        assert torch.equal(m(x), want)
    h.unwrap()
    assert _live(fake) == live
