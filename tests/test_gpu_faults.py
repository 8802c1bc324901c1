"""Interrupted work on the GPU: Ctrl-C at every backend call of an eviction, and training steps
whose backward raises. Failures come through the CUDA backend's hook (NOTE [failure injection]
in tiermem/cuda/backend.py). Managed use stays far below 1 GiB.

The CPU sweep (tests/test_faults.py) fails every call of every operation on the fake backend;
these check the same promises against the real driver: nothing lost, nothing leaked, and the next
step gives bitwise what a run that was never interrupted gives.
"""
from __future__ import annotations

import gc
import traceback

import pytest

pytestmark = pytest.mark.gpu

MiB = 1 << 20
BOOKS = ("allocated_bytes.all.current", "allocation_count.all.current", "resident_bytes.all.current",
         "parked_bytes.current", "shadow_bytes.current", "staging_bytes.current", "managed.reserved_bytes.current")


def books(tier) -> dict:
    s = tier.stats()
    return {k: s[k] for k in BOOKS}


@pytest.fixture
def injector():
    from tiermem.cuda.backend import FaultInjector, inject_faults
    inj = FaultInjector()
    inject_faults(inj)
    try:
        yield inj
    finally:
        inject_faults(None)


@pytest.mark.parametrize("budget", [None, 96 * MiB], ids=["no_budget", "budget"])
def test_ctrl_c_at_every_call_of_an_eviction_loses_nothing_and_leaks_nothing(budget, injector):
    """One eviction takes every path at once: a staged copy to the shadow (8 MiB), a clean
    discard (read-only, shadow valid), Unified Memory (a small tensor), a wrapped weight
    re-pointed at its shadow, a frozen weight's read-mostly collapse. Ctrl-C lands at its 1st
    call, then its 2nd, ... until one runs to the end."""
    import torch

    import tiermem
    torch.manual_seed(0)
    tier = tiermem.Tier(0, cap="1GiB", budget=budget, staging="8MiB")
    tts = [tier.empty(8 * MiB, "uint8", role="activation"), tier.empty(5000, "uint8", role="gradient"),
           tier.empty(4 * MiB, "uint8", role="activation", read_only=True)]
    refs = []
    for tt in tts:
        v = tt.torch()
        v.random_(0, 256)
        refs.append(v.clone())
        del v
    lin = torch.nn.Linear(1024, 1024, device="cuda")                          # a 4 MiB trained weight
    frozen = torch.nn.Linear(1024, 1024, device="cuda").requires_grad_(False)  # read-mostly
    x = torch.randn(16, 1024, device="cuda")
    with torch.no_grad():
        want = (lin(x), frozen(x))
    moved = tts + [tier.wrap(lin.weight), tier.wrap(frozen.weight)]
    # Once through, so that every shadow and both rings exist: the books then compare whole.
    tier.evict(moved)
    tier.prefetch(moved)
    torch.cuda.synchronize()
    base = books(tier)
    # The driver's free memory from here: it keeps the device pages of freed managed memory for
    # the process (NOTE [retained pages] in tiermem/cupy/scoped.py; 112 MiB of them after the first
    # round here on the H100), so only what the interrupted rounds take on top is ours to find.
    # CuPy's default pool, like torch's cache, keeps what is freed into it (the staging rings'
    # device memory comes from there): both caches are emptied before each reading.
    cupy = pytest.importorskip("cupy")
    torch.cuda.empty_cache()
    cupy.get_default_memory_pool().free_all_blocks()
    free0, torch0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
    frees = []          # (round, the call interrupted, driver free - free0), for the message below
    rounds = 0
    while True:
        rounds += 1
        injector.fail_at(rounds, "interrupt")
        try:
            tier.evict(moved)
        except KeyboardInterrupt:
            pass
        fired = injector.fired
        injector.disarm()
        for tt, r in zip(tts, refs):
            v = tt.torch(writable=False)     # brings back what is in its shadow
            assert torch.equal(v, r), (rounds, fired, tt)
            del v
        with torch.no_grad():
            assert torch.equal(lin(x), want[0]) and torch.equal(frozen(x), want[1]), (rounds, fired)
        tier.prefetch(moved)
        torch.cuda.synchronize()
        assert books(tier) == base, (rounds, fired)
        frees.append((rounds, fired and fired[1], torch.cuda.mem_get_info()[0] - free0))
        if fired is None:       # the eviction made fewer calls than ``rounds``: all were tried
            break
    assert rounds > 10, rounds
    # No round takes more than the first: an interrupted eviction leaves nothing behind. The
    # first round's own drop is the driver keeping the pages that bringing everything back
    # touched (NOTE [retained pages]): run alone, this test saw 90 MiB less free from round 1 on,
    # the same in every round, and 32 MiB of it still kept after close (H100, 140fe40); after
    # other GPU tests the driver already keeps them and the drop is 0.
    first = frees[0][2]
    assert all(d >= first - 8 * MiB for _, _, d in frees), [(r, c, round(d / MiB, 1)) for r, c, d in frees]
    print(f"{rounds - 1} calls interrupted in turn")
    tiermem.unwrap(lin.weight)
    tiermem.unwrap(frozen.weight)
    # The read loop's names go too: ``tt`` held the last tensor, the 4 MiB that this test
    # found "in tiermem's books after close()" on the H100 at 6e3159b.
    del tts, moved, tt, r
    gc.collect()
    tier.close()
    torch.cuda.synchronize()
    s = tier.stats()
    assert (s["allocated_bytes.all.current"], s["resident_bytes.all.current"], s["shadow_bytes.current"],
            s["staging_bytes.current"], s["managed.reserved_bytes.current"]) == (0, 0, 0, 0, 0)
    assert tier.backend.pool_bytes() == {"used": 0, "cached": 0, "reserved": 0}
    # The driver has not lost what the interrupted rounds took (streams and events take a
    # little of their own); the tier's own memory is checked in its books above.
    del refs, lin, frozen, x, want
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    cupy.get_default_memory_pool().free_all_blocks()
    free, kept = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved() - torch0   # cuBLAS's workspaces stay
    assert free >= free0 + min(first, 0) - max(kept, 0) - 8 * MiB, (
        f"{(free0 - free) / MiB:.1f} MiB of the driver's memory lost in the rounds; torch has "
        f"{torch.cuda.memory_allocated() / MiB:.1f} MiB allocated, {torch.cuda.memory_reserved() / MiB:.1f} MiB reserved; "
        f"by round: {[(r, c, round(d / MiB, 1)) for r, c, d in frees if d]}")


@pytest.fixture
def torch_cap_restored():
    """A training test that fails before its unwrap would leave torch's per-process memory cap
    set, and every later test in the process would run out of memory under it."""
    yield
    import torch
    gc.collect()
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    torch.cuda.empty_cache()


def _train_setup():
    from test_gpu_train import _setup
    return _setup()


def _failing_loss(model, ids, where):
    """The GPT loss, with backward raising at ``where``: "start" (the logits' gradient, before
    any parameter's) or "middle" (the output of the middle block)."""
    import torch.nn.functional as F

    def fail(_):
        raise RuntimeError("injected failure in backward")
    handles = []
    if where == "middle":
        mid = model.blocks[len(model.blocks) // 2]
        def hook(m, i, out):      # returns None: a forward hook's return value replaces the output
            out.register_hook(fail)
        handles.append(mid.register_forward_hook(hook))
    try:
        logits = model(ids[:, :-1])
    finally:
        for h in handles:
            h.remove()
    if where == "start":
        logits.register_hook(fail)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def test_a_step_whose_backward_raises_leaves_the_run_bitwise_as_if_it_never_happened():
    """Backward raises before any block has its gradients: the next steps give the losses and
    the parameters of the uninterrupted run, bitwise, and nothing leaks."""
    torch = _train_setup()
    from test_gpu_train import BUDGET, CFG, _batches, _cleanup, _loss, _resident_losses, _tiered

    from tiermem.testing import GPTConfig
    batches = _batches(GPTConfig(**CFG), 8)
    want, want_params = _resident_losses(batches)
    _cleanup()
    tier, model, opt, train, c = _tiered(BUDGET)
    got = []
    for i, ids in enumerate(batches):
        if i in (0, 4):          # in the first (traced) step, and in a planned one
            before = {k: v for k, v in books(tier).items() if k.startswith(("allocat", "managed"))}
            with pytest.raises(RuntimeError, match="injected failure"):
                with train.step():
                    _failing_loss(model, ids, "start").backward()
            torch.cuda.synchronize()
            assert all(p.grad is None for p in model.parameters())
            assert {k: v for k, v in books(tier).items() if k.startswith(("allocat", "managed"))} == before
        with train.step():
            loss = _loss(model, ids)
            loss.backward()
        got.append(loss.detach())
    assert [float(x) for x in torch.stack(got).cpu()] == want
    for p, q in zip(model.parameters(), want_params):
        assert torch.equal(p.detach(), q)
    train.unwrap()
    gc.collect()
    torch.cuda.synchronize()
    s = tier.stats()
    assert (s["allocated_bytes.all.current"], s["resident_bytes.all.current"]) == (0, 0)
    _cleanup(tier)


def test_a_step_whose_backward_raises_half_way_leaves_no_gradient_behind(torch_cap_restored):
    """Backward raises in the middle of the model. The blocks after that point have taken their
    optimizer step already (tiermem steps each streamed block as its gradients complete), so
    the run is not the uninterrupted one; but the step leaves no gradient behind for the next
    one to add to, training goes on, and unwrap gives every byte back."""
    torch = _train_setup()
    from test_gpu_train import BUDGET, _batches, _cleanup, _loss, _tiered
    tier, model, opt, train, c = _tiered(BUDGET)
    batches = _batches(c, 6)
    for ids in batches[:2]:
        with train.step():
            _loss(model, ids).backward()
    with pytest.raises(RuntimeError, match="injected failure") as ei:
        with train.step():
            _failing_loss(model, batches[2], "middle").backward()
    # pytest keeps the exception, and its frames keep the failed step's graph: drop them as the
    # contract asks of a caller who keeps one (NOTE [kept exceptions] in training/stepping.py).
    traceback.clear_frames(ei.tb)
    del ei
    assert all(p.grad is None for p in model.parameters())
    # On the host: a device copy (63 MB) would be taken from the step's budget, and the next
    # step ran out of memory under its cap (H100, 1ec2eef and 2ed0d69: 202-256 MiB allocated).
    before = [p.detach().cpu() for p in model.parameters()]
    got = []
    for ids in batches[3:]:
        with train.step():
            loss = _loss(model, ids)
            loss.backward()
        got.append(float(loss))
    assert all(torch.isfinite(torch.tensor(got)))
    assert not all(torch.equal(a, b.detach().cpu()) for a, b in zip(before, model.parameters()))   # it trains on
    train.unwrap()
    gc.collect()
    s = tier.stats()
    assert (s["allocated_bytes.all.current"], s["resident_bytes.all.current"]) == (0, 0)
    _cleanup(tier)


def test_ctrl_c_at_a_backend_call_inside_a_training_step_leaves_no_leak_and_training_goes_on(injector, torch_cap_restored):
    """Ctrl-C lands at one of the backend calls a planned step makes (a prefetch, a copy of a
    streamed block, an activation's swap): the next steps run, and unwrap gives everything back."""
    torch = _train_setup()
    from test_gpu_train import BUDGET, _batches, _cleanup, _loss, _tiered
    tier, model, opt, train, c = _tiered(BUDGET)
    from tiermem.training.choice import PROBE_STEPS, VERIFY_STEPS
    # The plan settles after the trace, the probe and its check (NOTE [measured choice]); the
    # step after that may still set things up (slots, events) when the check changed the plan.
    warm = 1 + PROBE_STEPS + VERIFY_STEPS + 1
    batches = _batches(c, warm + 2 + 3)
    for ids in batches[:warm]:
        with train.step():
            _loss(model, ids).backward()
    counts = []
    for ids in batches[warm:warm + 2]:
        calls0 = injector.calls
        with train.step():
            _loss(model, ids).backward()
        counts.append(injector.calls - calls0)
    per_step = min(counts)
    assert per_step > 20, counts
    # A step's call count varies with the link's timing (a copy found done or not: seen on the
    # H100 at 1ec2eef, 2233 and 2371 calls, then 2226): the last interrupt aims at 95% of the fewest.
    for k, n in enumerate((per_step // 7, per_step // 2, per_step * 19 // 20)):
        injector.fail_at(n, "interrupt")
        injector.seen, calls0, err = [], injector.calls, None
        try:
            with train.step():
                _loss(model, batches[warm + 2 + k]).backward()
        except BaseException as e:      # noqa: B036 - Ctrl-C is what is being tested
            err = e
        seen, injector.seen = injector.seen, None
        assert err is not None, (f"interrupt {k} at call {n} of {counts} per step: nothing raised; the step made "
                                 f"{injector.calls - calls0} calls, fired={injector.fired}, first calls {seen[:n + 1]}")
        # Raised in a backward hook, the interrupt crosses autograd's engine, which may hand it
        # on as a RuntimeError that carries its message.
        assert isinstance(err, KeyboardInterrupt) or "injected at" in str(err), repr(err)
        assert injector.fired is not None
        # A caught exception's frames hold the failed step's activations; a caller that keeps
        # it keeps them, inside the step's memory cap (NOTE [kept exceptions] in training/stepping.py).
        traceback.clear_frames(err.__traceback__)
        del err
        assert all(p.grad is None for p in model.parameters())
        with train.step():
            loss = _loss(model, batches[warm + 2 + k])
            loss.backward()
        assert torch.isfinite(loss)
    train.unwrap()
    gc.collect()
    torch.cuda.synchronize()
    s = tier.stats()
    assert (s["allocated_bytes.all.current"], s["resident_bytes.all.current"]) == (0, 0)
    _cleanup(tier)
