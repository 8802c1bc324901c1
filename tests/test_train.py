"""wrap_training on the CPU, over the fake backend (NOTE [device memory] in tiermem/pytorch/devmem.py):
the blocks' homes, slots and copies, the traced step and its plan, activation swap, steps that
fail, and unwrap are the real ones; the model trains on the CPU, and torch's CPU allocator has
no cap or peaks to read, so the plan's floor is zero here. The GPU tests (test_gpu_train.py)
check what needs a device: the cap, the peaks, the link."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from fakes import FakeBackend

import tiermem
from tiermem.testing import GPT, GPTConfig

CFG = dict(vocab=256, seq=32, d=64, layers=4, heads=4)       # 0.94 MB of parameters


def gpt(seed: int = 0) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = GPT(GPTConfig(**CFG))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


def batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG["vocab"], (4, CFG["seq"] + 1), generator=g) for _ in range(n)]


def loss_of(model, ids):
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def plain_losses(model, opt, bs, loss_fn=None) -> list[float]:
    """The plain loop's losses over ``bs`` (``loss_fn``: loss_of): backward, step, zero_grad."""
    out = []
    for ids in bs:
        loss = (loss_fn or loss_of)(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(float(loss.detach()))
    return out


def plain_run(bs):
    model, opt = gpt()
    out = plain_losses(model, opt, bs)
    return out, [p.detach().clone() for p in model.parameters()]


def tiered_losses(train, model, bs, loss_fn=None) -> list[float]:
    """The losses of steps under ``train`` over the batches ``bs`` (``loss_fn``: loss_of)."""
    out = []
    for ids in bs:
        with train.step():
            loss = (loss_fn or loss_of)(model, ids)
            loss.backward()
        out.append(float(loss.detach()))
    return out


def state_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def tiered(**kw):
    """A GPT under a budget of its parameters' bytes alone (with AdamW it needs 4x that): some
    blocks stream, and saved activations of 4 KiB and up swap."""
    model, opt = gpt()
    fake = FakeBackend(total=1 << 30, foreign_host=True)
    tier = tiermem.Tier(backend=fake)
    kw.setdefault("block_bytes", 16 << 10)
    kw.setdefault("min_swap", 4096)
    train = tier.wrap_training(model, opt, kw.pop("budget", state_bytes(model)), **kw)
    return fake, tier, model, opt, train


@pytest.fixture(autouse=True)
def _deterministic():
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(old)


def test_training_under_a_budget_gives_the_plain_runs_losses_and_parameters_bitwise():
    bs = batches(6)
    want, want_params = plain_run(bs)
    fake, tier, model, opt, train = tiered()
    got = tiered_losses(train, model, bs)
    plan = train.plan
    assert plan.streamed_blocks and plan.swapped_bytes > 0 and train.moved["h2d"] > 0
    assert got == want
    for p, q in zip(model.parameters(), want_params):
        assert torch.equal(p.detach(), q)
    train.unwrap()
    assert all(p.grad is None for p in model.parameters())
    for p, q in zip(model.parameters(), want_params):
        assert torch.equal(p.detach(), q)
    assert not tier.leases
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


def test_unwrapped_model_and_optimizer_train_on_like_plain_ones():
    """After unwrap the parameters and AdamW's states are plain again: training goes on as the
    plain run would have, step for step."""
    bs = batches(5)
    want, want_params = plain_run(bs)
    fake, tier, model, opt, train = tiered()
    got = []
    for i, ids in enumerate(bs):
        if i == 3:
            train.unwrap()
        if i < 3:
            with train.step():
                loss = loss_of(model, ids)
                loss.backward()
        else:
            loss = loss_of(model, ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        got.append(float(loss.detach()))
    assert got == want
    for p, q in zip(model.parameters(), want_params):
        assert torch.equal(p.detach(), q)


def test_unwrap_to_another_device_is_refused_with_nothing_changed():
    bs = batches(2)
    want, _ = plain_run(bs)
    fake, tier, model, opt, train = tiered()
    with train.step():
        loss = loss_of(model, bs[0])
        loss.backward()
    got = [float(loss.detach())]
    with pytest.raises(tiermem.ConfigError, match="plain copies go to"):
        train.unwrap(device="meta")
    with train.step():                       # still trained by tiermem, as before
        loss = loss_of(model, bs[1])
        loss.backward()
    got.append(float(loss.detach()))
    assert got == want
    train.unwrap(device="cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())


def _raising(model, ids, where: str):
    def fail(_):
        raise RuntimeError("injected failure in backward")
    handles = []
    if where == "middle":
        def hook(m, i, out):      # returns None: a forward hook's return value replaces the output
            out.register_hook(fail)
        handles.append(model.blocks[len(model.blocks) // 2].register_forward_hook(hook))
    try:
        loss = loss_of(model, ids)
    finally:
        for h in handles:
            h.remove()
    if where == "start":
        loss.register_hook(fail)
    return loss


@pytest.mark.parametrize("where", ["start", "middle", "forward"])
@pytest.mark.long
def test_a_step_that_raises_leaves_no_gradient_and_training_goes_on(where):
    """Backward raising before any block's gradients ("start") leaves the run bitwise as if the
    step had never been; raising half-way ("middle": the blocks after it stepped already, as
    tiermem steps each block as its gradients complete) or in forward leaves no gradient for the
    next step to add to, and training goes on."""
    bs = batches(6)
    want, _ = plain_run([b for i, b in enumerate(bs) if i != 2])
    fake, tier, model, opt, train = tiered()
    got = []
    for i, ids in enumerate(bs):
        if i == 2:
            with pytest.raises(RuntimeError, match="injected failure"):
                with train.step():
                    if where == "forward":
                        loss_of(model, ids)
                        raise RuntimeError("injected failure in forward")
                    _raising(model, ids, where).backward()
            assert all(p.grad is None for p in model.parameters())
            continue
        with train.step():
            loss = loss_of(model, ids)
            loss.backward()
        got.append(float(loss.detach()))
    if where in ("start", "forward"):
        assert got == want
    else:
        assert got[:2] == want[:2] and all(torch.isfinite(torch.tensor(got)))
    train.unwrap()
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


def test_the_cap_is_set_while_training_and_given_back_at_unwrap_whatever_failed_between():
    """The cap on torch's allocator (here the fake's remembered fraction) is set at adoption,
    follows the plan, and is given back at unwrap, whatever steps failed between."""
    fake, tier, model, opt, train = tiered()
    assert train.mem.fraction() < 1.0
    for where in ("start", None, "middle", None):
        if where is None:
            with train.step():
                loss_of(model, batches(1)[0]).backward()
        else:
            with pytest.raises(RuntimeError):
                with train.step():
                    _raising(model, batches(1)[0], where).backward()
        assert 0.0 < train.mem.fraction() < 1.0
    train.unwrap()
    assert train.mem.fraction() == 1.0


@pytest.mark.skipif(not hasattr(BaseException, "add_note"), reason="exception notes are Python 3.11+")
def test_torch_running_out_inside_a_step_says_what_the_budget_held():
    """torch's out-of-memory error inside a step stays torch's (code that catches it, as batch
    size finders do, keeps working), with a note of the budget, the slots and what to change;
    the step fails as any failed step does and training goes on."""
    bs = batches(3)
    _, _, model, opt, train = tiered()
    tiered_losses(train, model, bs[:1])
    with pytest.raises(torch.OutOfMemoryError) as e:
        with train.step():
            loss_of(model, bs[1]).backward()
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
    (note,) = e.value.__notes__
    assert f"budget of {train.budget / 1e9:.3f} GB" in note and "slots take" in note and "block_bytes" in note
    assert all(p.grad is None for p in model.parameters())
    tiered_losses(train, model, bs[2:])
