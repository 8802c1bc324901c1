"""wrap_training(..., state_dtype=torch.bfloat16) on the CPU, over the fake backend (NOTE [bf16
moments] in tiermem/training/states.py): streamed blocks' fp32 optimizer states held and moved as bf16,
stepped in fp32, narrowed by stochastic rounding from the handle's own generator."""
from __future__ import annotations

import gc
import io

import pytest
import torch
from fakes import FakeBackend
from test_train import batches, gpt, loss_of, state_bytes, tiered, tiered_losses

import tiermem
from tiermem.planning import StepTrace, plan_training
from tiermem.training.options import check_options
from tiermem.training.states import ROUNDING_KEY, round_stochastic

BF16 = torch.bfloat16


def _streamed(train):
    return [b for b in train.blocks if not b.resident]


# -- the option ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [torch.float16, torch.float32, "float16", "bf16", "torch.bfloat16", 16, True])
def test_a_bad_state_dtype_is_a_config_error_before_anything_is_taken(bad):
    with pytest.raises(tiermem.ConfigError, match="state_dtype"):
        check_options("50%", state_dtype=bad)
    model, opt = gpt()
    tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
    with pytest.raises(ValueError, match="state_dtype"):
        tier.wrap_training(model, opt, "50%", state_dtype=bad)
    assert not tier.leases
    # tiermem.wrap_training checks it before it looks for a GPU (there is none here)
    with pytest.raises(tiermem.ConfigError, match="state_dtype"):
        tiermem.wrap_training(model, opt, "50%", state_dtype=bad)


@pytest.mark.parametrize("good", [None, BF16, "bfloat16"])
def test_the_state_dtypes_taken(good):
    check_options("50%", state_dtype=good)


# -- what is held and moved ------------------------------------------------------------------------
def _mlp(seed: int = 0):
    """Layers of 128: every state's bf16 bytes are a whole number of the homes' 256-byte
    alignment, so bf16 states take exactly half the bytes."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(128, 128), torch.nn.Tanh()]
    m = torch.nn.Sequential(*layers)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


def _mlp_wrapped(budget_x: int = 1, **kw):
    """The MLP under ``budget_x`` times its parameters' bytes: at 1 every block streams."""
    model, opt = _mlp()
    tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
    train = tier.wrap_training(model, opt, budget_x * state_bytes(model), block_bytes=64 << 10, min_swap=4096,
                               recompute="never", **kw)
    return tier, model, opt, train


def _mlp_run(steps: int, **kw):
    tier, model, opt, train = _mlp_wrapped(**kw)
    g = torch.Generator().manual_seed(3)
    per_step = []
    for _ in range(steps):
        x = torch.randn(16, 128, generator=g)
        before = tier.stats()
        with train.step():
            model(x).square().mean().backward()
        after = tier.stats()
        per_step.append(tuple(after[f"moved_bytes.optimizer_state.{d}"] - before[f"moved_bytes.optimizer_state.{d}"]
                              for d in ("h2d", "d2h")))
    return tier, model, opt, train, per_step


def test_streamed_states_are_held_and_moved_as_half_the_bytes():
    _, _, opt32, t32, moved32 = _mlp_run(4)
    _, _, opt16, t16, moved16 = _mlp_run(4, state_dtype=BF16)
    assert t16.plan.streamed_blocks == t32.plan.streamed_blocks and t16.plan.streamed_blocks
    for b32, b16 in zip(t32.blocks, t16.blocks):
        assert b16.s_full == b32.s_bytes == b32.s_full        # what a resident block would keep: fp32
        if b16.resident:
            continue
        assert b16.s_bytes * 2 == b32.s_bytes > 0 and b16.home_s.nbytes == b16.s_bytes
        assert all(v.dtype == BF16 for v in b16.home_state_views)
        for p, key, _ in b16.states:                          # between steps: the bf16 home or slot
            assert opt16.state[p][key].dtype == BF16
    for b in t16.blocks:
        if b.resident:                                        # resident blocks do not move: fp32
            assert all(opt16.state[p][key].dtype == torch.float32 for p, key, _ in b.states)
    # every step, each direction: half the optimizer-state bytes over the link
    assert all(h > 0 and d > 0 for h, d in moved32[1:])
    assert moved16 == [(h // 2, d // 2) for h, d in moved32]
    # and the plan counts them so: the resident footprint is the same, the bytes moved half
    p32, p16 = t32.plan, t16.plan
    assert p16.block_state_bytes == p32.block_state_bytes
    assert p16.block_state_moved_bytes == tuple(n // 2 for n in p32.block_state_moved_bytes)
    halved = sum(p32.block_state_bytes[i] // 2 for i in p32.streamed_blocks)
    for d in ("h2d_bytes", "d2h_bytes"):          # the blocks' part (activations aside)
        assert (getattr(p32, d) - p32.swapped_bytes) - (getattr(p16, d) - p16.swapped_bytes) == halved
    assert p16.floor_peak < p32.floor_peak         # smaller slots leave more room (here: kept activations)


def test_the_planner_counts_the_moved_state_bytes_and_keeps_the_resident_ones():
    MiB = 1 << 20
    params, states = (10 * MiB,) * 4, (20 * MiB,) * 4
    full = plan_training(StepTrace((), params, states, 100 * MiB), 100 * MiB, margin=0)
    half = plan_training(StepTrace((), params, states, 100 * MiB, block_state_moved_bytes=(10 * MiB,) * 4),
                         100 * MiB, margin=0)
    assert full.h2d_bytes == 4 * 40 * MiB and half.h2d_bytes == 4 * 30 * MiB
    assert full.d2h_bytes == 4 * 30 * MiB and half.d2h_bytes == 4 * 20 * MiB
    assert half.predicted_seconds() < full.predicted_seconds()
    roomy = plan_training(StepTrace((), params, states, 0, block_state_moved_bytes=(10 * MiB,) * 4),
                          60 * MiB, margin=0)
    assert len(roomy.resident_blocks) == 2 and roomy.resident_block_bytes == 60 * MiB   # fp32 when resident
    with pytest.raises(tiermem.ConfigError, match="differ in length"):
        plan_training(StepTrace((), params, states, 0, block_state_moved_bytes=(1,)), MiB)


# -- training ----------------------------------------------------------------------------------------
def test_losses_stay_close_to_the_default_runs_and_the_callers_rng_is_untouched():
    bs = batches(12)
    _, tier32, model32, opt32, t32 = tiered()
    torch.manual_seed(7)
    want = tiered_losses(t32, model32, bs)
    rng_want = torch.get_rng_state()
    _, tier16, model16, opt16, t16 = tiered(state_dtype="bfloat16")
    first = t16.rounding.get_state()
    torch.manual_seed(7)
    got = tiered_losses(t16, model16, bs)
    assert torch.equal(torch.get_rng_state(), rng_want)        # the rounding's bits are its own
    assert not torch.equal(t16.rounding.get_state(), first)
    assert got[0] == want[0]                    # the first step's states start at zero: no rounding yet
    assert got != want
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) < 1e-4, (got, want)   # 6e-6 seen over 30 steps
    assert t16.moved["h2d"] < t32.moved["h2d"] and t16.moved["d2h"] < t32.moved["d2h"]


def test_unwrap_gives_fp32_states_close_to_the_default_runs_and_training_goes_on():
    bs = batches(6)
    fake, tier, model, opt, train = tiered(state_dtype=BF16)
    _, _, model32, opt32, t32 = tiered()
    tiered_losses(train, model, bs[:5])
    tiered_losses(t32, model32, bs[:5])
    saved = opt.state_dict()                    # between steps: bf16 moments, loadable into a plain AdamW
    plain = torch.optim.AdamW(gpt()[0].parameters(), lr=1e-3)
    plain.load_state_dict(saved)
    assert all(v.dtype == torch.float32 for st in plain.state.values() for k, v in st.items() if k != "step")
    del saved, plain                            # they hold views of the tier's memory
    t32.unwrap()
    train.unwrap()
    n = 0
    for p, q in zip(model.parameters(), model32.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = opt.state[p][key], opt32.state[q][key]
            assert a.dtype == torch.float32 and a.shape == p.shape
            assert float((a - b).norm()) <= 2e-2 * float(b.norm()) + 1e-12, (key, p.shape)
            n += 1
        assert opt.state[p]["step"] == opt32.state[q]["step"]
    assert n == 2 * len(list(model.parameters()))
    loss = loss_of(model, bs[5])                # plain again: the optimizer steps fp32 states
    loss.backward()
    opt.step()
    assert all(v.dtype == torch.float32 for st in opt.state.values() for k, v in st.items() if k != "step")
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


# -- checkpoints -------------------------------------------------------------------------------------
def _mlp_steps(train, model, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        with train.step():
            model(torch.randn(16, 128, generator=g)).square().mean().backward()


def _moments(opt, model) -> list[torch.Tensor]:
    return [opt.state[p][key] for p in model.parameters() for key in ("exp_avg", "exp_avg_sq")]


def _checkpoint(model, opt) -> dict:
    """Saved and read back as a file would be: copies, not views of the tier's memory."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_the_state_dict_carries_the_rounding_generator_only_when_narrowing():
    _, model, opt, train = _mlp_wrapped(state_dtype=BF16)
    _mlp_steps(train, model, 1, seed=1)
    early = _checkpoint(model, opt)["opt"]
    _mlp_steps(train, model, 1, seed=2)
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups", ROUNDING_KEY}
    key = sd[ROUNDING_KEY]
    assert key.dtype == torch.uint8 and key.device.type == "cpu" and torch.equal(key, train.rounding.get_state())
    assert not torch.equal(early[ROUNDING_KEY], key)
    train.unwrap()                              # the hooks go with the handle
    assert set(opt.state_dict()) == {"state", "param_groups"}
    opt.load_state_dict(early)                  # a plain optimizer again: the key is not read
    assert torch.equal(train.rounding.get_state(), key)
    # in capacity the module hooks are removed (NOTE [training transport]); the optimizer's stay
    _, model, opt, train = _mlp_wrapped(budget_x=8, state_dtype=BF16)
    _mlp_steps(train, model, 2, seed=1)
    assert not train.plan.streamed_blocks and not train._hooks
    assert torch.equal(opt.state_dict()[ROUNDING_KEY], train.rounding.get_state())
    _, model, opt, train = _mlp_wrapped()
    _mlp_steps(train, model, 2, seed=1)
    assert train.rounding is None and set(opt.state_dict()) == {"state", "param_groups"}


@pytest.mark.parametrize("restore", [True, False])
def test_a_resumed_run_rounds_as_the_uninterrupted_one(restore):
    """Saved after 4 steps, 5 more; the same 5 in a new model, optimizer and handle loaded from
    the checkpoint: bitwise the same moments only when the generator's state comes back too."""
    _, model, opt, train = _mlp_wrapped(state_dtype=BF16)
    _mlp_steps(train, model, 4, seed=1)
    # Every block streams: a resident block's fp32 states would be narrowed once by the resumed
    # run's traced step, which the uninterrupted run never does (NOTE [bf16 moments]).
    assert not train.plan.resident_blocks
    ckpt = _checkpoint(model, opt)
    _mlp_steps(train, model, 5, seed=2)
    want = _moments(opt, model)

    _, model2, opt2, train2 = _mlp_wrapped(state_dtype=BF16)
    model2.load_state_dict(ckpt["model"])
    if not restore:
        del ckpt["opt"][ROUNDING_KEY]
    opt2.load_state_dict(ckpt["opt"])
    assert (ROUNDING_KEY in ckpt["opt"]) == restore        # torch's copy lost it, the caller's dict did not
    _mlp_steps(train2, model2, 5, seed=2)
    got = _moments(opt2, model2)
    assert all(a.dtype == BF16 for a in got)
    same = [torch.equal(a, b) for a, b in zip(want, got)]
    if restore:
        assert all(same)
        assert torch.equal(train2.rounding.get_state(), train.rounding.get_state())
    else:                                       # the fresh generator's bits: the test can fail
        assert not any(same)


def test_a_state_dict_without_the_key_loads_as_before():
    model, opt = _mlp()                         # a plain run's checkpoint
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        model(torch.randn(16, 128, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    plain = opt.state_dict()
    assert ROUNDING_KEY not in plain
    _, model2, opt2, train = _mlp_wrapped(state_dtype=BF16)
    model2.load_state_dict(model.state_dict())
    fresh = train.rounding.get_state()
    opt2.load_state_dict(plain)
    assert torch.equal(train.rounding.get_state(), fresh)   # left as it was
    for a, b in zip(_moments(opt2, model2), _moments(opt, model)):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    _mlp_steps(train, model2, 3, seed=2)
    assert not torch.equal(train.rounding.get_state(), fresh)
    assert all(a.dtype == BF16 and a.isfinite().all() for a in _moments(opt2, model2))
    # and a tiermem checkpoint, key and all, loads into a plain optimizer
    back = torch.optim.AdamW(_mlp()[0].parameters(), lr=1e-3)
    back.load_state_dict(_checkpoint(model2, opt2)["opt"])
    assert all(v.dtype == torch.float32 for st in back.state.values() for k, v in st.items() if k != "step")


# -- stochastic rounding ---------------------------------------------------------------------------
def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("v", [1.0 + 0.3 * 2 ** -7, -3.0 - 0.71 * 2 ** -6, 1.2345e-8, 0.1])
def test_stochastic_rounding_is_unbiased(v):
    lo = torch.tensor(v).to(BF16).float()
    x = torch.full((200_000,), v)
    out = torch.empty_like(x, dtype=BF16)
    rng = torch.get_rng_state()
    round_stochastic(x, out, _gen())
    assert torch.equal(torch.get_rng_state(), rng)
    got = out.float()
    assert len(set(got.tolist())) == 2 and abs(v) - float(got.abs().min()) > 0     # the two neighbours
    step = float(got.abs().max() - got.abs().min())
    assert abs(float(got.double().mean()) - v) < 0.01 * step, (float(got.double().mean()), v, float(lo))
    assert torch.equal(x, torch.full((200_000,), v))      # the input is left as it was


def test_stochastic_rounding_is_exact_where_bf16_is_and_keeps_nan_and_inf():
    x = (torch.randn(10_000) * 1e3).to(BF16).float()
    x = torch.cat([x, torch.tensor([0.0, -0.0, float("inf"), float("-inf"), torch.finfo(BF16).max])])
    out = torch.empty_like(x, dtype=BF16)
    round_stochastic(x, out, _gen())
    assert torch.equal(out.float(), x) and torch.equal(out.float().signbit(), x.signbit())
    nan = torch.tensor([float("nan"), 0.0]).view(torch.int32)
    nan[0] = 0x7F800001                          # a NaN whose mantissa is all in the low 16 bits
    nan[1] = 0x7FFFFFFF                          # and one that carries past the exponent
    out = torch.empty(2, dtype=BF16)
    round_stochastic(nan.view(torch.float32), out, _gen())
    assert out.isnan().all()


def test_stochastic_rounding_follows_a_slow_moment_where_round_to_nearest_stalls():
    """exp_avg_sq's update with beta2 = 0.999 and a constant gradient: in bf16 with round-to-nearest
    it stops well short; rounded stochastically it follows the fp32 one."""
    beta2, steps = 0.999, 3000
    ref = 1.0 - beta2 ** steps
    nearest = torch.zeros(1000, dtype=BF16)
    sr = torch.zeros(1000, dtype=BF16)
    g = _gen()
    for _ in range(steps):
        nearest = (nearest.float() * beta2 + (1 - beta2)).to(BF16)
        round_stochastic(sr.float() * beta2 + (1 - beta2), sr, g)
    assert float(nearest.float().mean()) < 0.7 * ref
    assert abs(float(sr.float().mean()) - ref) < 0.01 * ref
