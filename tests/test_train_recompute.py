"""Recompute in wrap_training on the CPU, over the fake backend (NOTE [recompute plan] in
tiermem/training/plan.py, tiermem/training/recompute.py): recomputed blocks give the plain run's losses and
parameters bitwise, dropout included; they move fewer bytes than swapping them; unwrap gives every
module its own forward back. What the plan chooses from measured times is tested on synthetic
traces (tests/test_trainplan.py); the fake backend's clock is not a GPU's."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fakes import FakeBackend
from test_train import _deterministic, batches, gpt, plain_losses, plain_run, state_bytes, tiered_losses  # noqa: F401 - the fixture, autouse here too

import tiermem

BLOCK = 1 << 20            # each of the GPT's transformer blocks (200 KB of parameters, 64 KiB a tensor as spans count) is one block


def tiered_gpt(recompute: str, budget_times: int = 4):
    model, opt = gpt()
    fake = FakeBackend(total=1 << 30, foreign_host=True)
    tier = tiermem.Tier(backend=fake)
    # 4x the parameters: the slots (three blocks' parameters, gradients and AdamW states) take
    # most of it, and what is left holds one block's saves at a time, not every block's.
    train = tier.wrap_training(model, opt, budget_times * state_bytes(model), block_bytes=BLOCK, min_swap=4096,
                               recompute=recompute)
    return fake, tier, model, opt, train


@pytest.mark.parametrize("recompute", ["always", "auto", "never"])
@pytest.mark.long
def test_recomputed_blocks_give_the_plain_runs_losses_and_parameters_bitwise(recompute):
    bs = batches(6)
    want, want_params = plain_run(bs)
    fake, tier, model, opt, train = tiered_gpt(recompute)
    got = tiered_losses(train, model, bs)
    assert got == want
    for p, q in zip(model.parameters(), want_params):
        assert torch.equal(p.detach(), q)
    names = {train.plan.block_names[i] for i in train.plan.recompute}
    if recompute == "always":
        assert {f"blocks.{i}" for i in range(4)} <= names     # the transformer blocks: no block inside them
        assert train.report()["recomputed_blocks"] == len(names)
    if recompute == "never":
        assert not names
    assert all(train.plan.segment_modes[i] == "recompute" for i in train.plan.recompute)
    train.unwrap()
    assert all("forward" not in m.__dict__ for m in model.modules())
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


def test_recomputing_moves_fewer_activation_bytes_than_swapping():
    bs = batches(4)
    moved = {}
    for mode in ("always", "never"):
        fake, tier, model, opt, train = tiered_gpt(mode)
        tiered_losses(train, model, bs)
        moved[mode] = train.swap.moved["d2h"]
        assert train.plan.swapped_bytes == pytest.approx(moved[mode], rel=0.01)
        train.unwrap()
    assert moved["always"] < moved["never"] / 2


class DropNet(nn.Module):
    """Residual MLP blocks with dropout inside: a recomputed block must draw the same masks."""

    def __init__(self, d: int = 64, layers: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.3),
                                                  nn.Linear(4 * d, d), nn.Dropout(0.1)) for _ in range(layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x).squeeze(-1)


def drop_run(tiered: bool, steps: int = 5):
    torch.manual_seed(0)
    model = DropNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(16, 64, generator=g), torch.randn(16, generator=g)) for _ in range(steps)]
    train = None
    if tiered:
        tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        train = tier.wrap_training(model, opt, 8 * nbytes, block_bytes=1 << 20, min_swap=1024, recompute="always")
    torch.manual_seed(42)              # dropout's draws start here in both runs
    out = []
    for x, y in data:
        if train is not None:
            with train.step():
                loss = F.mse_loss(model(x), y)
                loss.backward()
        else:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        out.append(float(loss.detach()))
    return out, [p.detach().clone() for p in model.parameters()], train, torch.rand(1)


def test_dropout_in_a_recomputed_block_draws_the_same_masks():
    want, want_params, _, want_next = drop_run(False)
    got, got_params, train, got_next = drop_run(True)
    assert {0, 1, 2, 3} <= train.plan.recompute          # every block with dropout
    assert got == want
    for p, q in zip(got_params, want_params):
        assert torch.equal(p, q)
    assert torch.equal(got_next, want_next)       # the global RNG is where the plain run left it


def test_a_bad_recompute_option_is_a_value_error_before_anything_is_taken():
    model, opt = gpt()
    tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
    with pytest.raises(ValueError, match="recompute"):
        tier.wrap_training(model, opt, "50%", recompute="sometimes")
    with pytest.raises(ValueError, match="link_GBps"):
        tier.wrap_training(model, opt, "50%", link_GBps=-1)
    assert not tier.leases


def test_a_module_that_has_its_own_forward_attribute_gets_it_back():
    """accelerate and others set an instance ``forward``: recompute wraps it and unwrap restores it."""
    model, opt = gpt()
    blk = model.blocks[1]
    seen = []
    own = blk.forward

    def patched(x):
        seen.append(1)
        return own(x)
    blk.forward = patched
    fake = FakeBackend(total=1 << 30, foreign_host=True)
    tier = tiermem.Tier(backend=fake)
    train = tier.wrap_training(model, opt, 4 * state_bytes(model), block_bytes=BLOCK, min_swap=4096,
                               recompute="always")
    tiered_losses(train, model, batches(3))
    assert train.plan.recompute and len(seen) >= 3 + 2      # forward in every step, again in recompute
    train.unwrap()
    assert blk.__dict__["forward"] is patched


def _losses_and_kinds(train, model, bs):
    """Each step's loss, and the kind of plan the steps after it follow."""
    got, kinds = [], []
    for ids in bs:
        got += tiered_losses(train, model, [ids])
        kinds.append(train.plan.kind)
    return got, kinds


@pytest.mark.parametrize("plan_slower", [True, False])
@pytest.mark.long
def test_a_plan_slower_than_the_probe_gives_way_to_recomputing_everywhere(plan_slower):
    # NOTE [measured choice]: the fake's clock says the probe's (recompute everywhere) timed
    # steps take 3 ms and then 1 ms, and, with plan_slower, 5 ms while a plan other than
    # recompute-everywhere runs; the model (which sees 1 ms per block of recompute and a
    # near-free link) proposes such a plan after the probe.
    bs = batches(10)
    want, want_params = plain_run(bs)
    fake, tier, model, opt, train = tiered_gpt("auto")
    calls = []

    def last_step_ms():
        # the fastest of each phase's timed steps counts: the probe's 3 then 1 ms; the model's
        # plan's 5 ms each when it is slower, else 9 ms (a host's hiccup) then 1 ms
        kind = train.plan.kind
        calls.append(kind)
        if kind == "recompute":
            return 3.0 if calls.count(kind) == 1 else 1.0
        return 5.0 if plan_slower else (9.0 if calls.count(kind) == 1 else 1.0)
    train.choice.last_step_ms = last_step_ms
    got, kinds = _losses_and_kinds(train, model, bs)
    assert got == want
    for p, q in zip(model.parameters(), want_params):
        assert torch.equal(p.detach(), q)
    # the plan after each step: step 1 traced, steps 2-5 the probe (recompute everywhere; step 3
    # metered, 4 and 5 timed), steps 6-8 the model's plan, the fastest of 7 and 8 checked after 8
    assert kinds[:4] == ["recompute"] * 4 and kinds[4] != "recompute" and kinds[5] == kinds[6] == kinds[4], kinds
    assert calls.count("recompute") == 2 and calls.count(kinds[4]) == 2, calls
    m = train.plan.measured
    if plan_slower:
        assert kinds[7:] == ["recompute"] * 3, kinds
        assert (m["checked_ms"], m["probe_ms"], m["chosen_by"]) == (5.0, 1.0, "measured")
    else:
        assert kinds[7:] == [kinds[4]] * 3, kinds
        assert (m["checked_ms"], m["probe_ms"]) == (1.0, 1.0) and "chosen_by" not in m
    train.unwrap()
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


@pytest.mark.parametrize("gain", ["too_small", "enough"])
@pytest.mark.long
def test_a_plan_predicted_barely_faster_than_the_probe_is_not_tried(monkeypatch, gain):
    """NOTE [measured choice]: the model's plan is tried (and checked) only when it predicts a step
    at least MIN_GAIN faster than the probe's plan, from the same fitted times; else the steps stay
    on recomputing everywhere, unchecked, and the table says what was not tried. The fake's model
    sees a near-free link, so its plan predicts a large gain; MIN_GAIN is raised past it here."""
    import tiermem.training.choice as trainmod
    if gain == "too_small":
        monkeypatch.setattr(trainmod, "MIN_GAIN", 0.99)
    bs = batches(9)
    want, want_params = plain_run(bs)
    fake, tier, model, opt, train = tiered_gpt("auto")
    train.choice.last_step_ms = lambda: 1.0
    got, kinds = _losses_and_kinds(train, model, bs)
    assert got == want
    for p, q in zip(model.parameters(), want_params):
        assert torch.equal(p.detach(), q)
    m = train.plan.measured
    if gain == "too_small":
        assert kinds == ["recompute"] * len(bs), kinds
        assert m["model_ms"] > 0 and "checked_ms" not in m, m
        assert "not enough faster to try" in train.plan.table()
    else:
        assert kinds[4] != "recompute" and "model_ms" not in m, (kinds, m)
        assert m["checked_ms"] == m["probe_ms"] == 1.0, m
    train.unwrap()
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


def test_the_plan_after_the_probe_is_predicted_from_times_fitted_to_the_probes_steps(monkeypatch):
    """NOTE [calibrated compute]: after the probe, the compute times are fitted to the mean of
    its two unmetered steps (30 and 50 ms here) through the probe's own plan, and every plan
    after carries the factor. The fitting's arithmetic is tests/test_trainplan.py's; the fake's
    clock gives no compute to fit, so the factor is stood in for here."""
    import tiermem.training.choice as trainmod
    seen = []

    def fit(plan, ms):
        seen.append((plan.kind, sorted(plan.recompute), ms))
        return 2.0
    monkeypatch.setattr(trainmod, "fit_compute", fit)
    bs = batches(8)
    want, _ = plain_run(bs)
    fake, tier, model, opt, train = tiered_gpt("auto")
    times = iter([30.0, 50.0])
    train.choice.last_step_ms = lambda: next(times, 1.0)
    got, kinds = _losses_and_kinds(train, model, bs)
    assert got == want
    assert len(seen) == 1, seen
    kind, rec, ms = seen[0]
    assert kind == "recompute" and rec and ms == 40.0
    assert train.trace.compute_scale == 2.0 and train.plan.compute_scale == 2.0
    assert "x2.00, fitted to the probe's own steps" in train.plan.table()
    train.unwrap()
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


@pytest.mark.parametrize("recompute", ["never", "always"])
@pytest.mark.long
def test_a_plan_with_no_choice_to_check_is_still_predicted_from_its_own_steps(monkeypatch, recompute):
    """NOTE [calibrated compute]: "never" and "always" have no probe to choose by, but their plan
    is metered and timed the same way, and its prediction fitted to its own steps; its choices
    stay, and nothing after it is checked or switched."""
    import tiermem.training.choice as trainmod
    seen = []

    def fit(plan, ms):
        seen.append((plan.kind, ms))
        return 0.5
    monkeypatch.setattr(trainmod, "fit_compute", fit)
    bs = batches(8)
    want, _ = plain_run(bs)
    fake, tier, model, opt, train = tiered_gpt(recompute)
    times = iter([30.0, 50.0])
    train.choice.last_step_ms = lambda: next(times, 1.0)
    got = tiered_losses(train, model, bs[:1])
    first = train.plan
    for ids in bs[1:]:
        got += tiered_losses(train, model, [ids])
        assert (train.plan.resident_blocks, train.plan.recompute, train.plan.keep, train.plan.kind) == \
            (first.resident_blocks, first.recompute, first.keep, first.kind)
    assert got == want
    assert seen == [("swap" if recompute == "never" else "recompute", 40.0)], seen
    assert train.plan.compute_scale == 0.5 and "x0.50, fitted" in train.plan.table()
    assert "checked_ms" not in train.plan.measured
    train.unwrap()
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


def test_a_plan_in_capacity_is_kept_however_slow_its_steps_were_timed():
    """NOTE [measured choice]: a plan that moves and recomputes nothing does less than the probe
    (recompute everywhere); a slow host's clock does not send it back there."""
    bs = batches(8)
    want, _ = plain_run(bs)
    fake, tier, model, opt, train = tiered_gpt("auto", budget_times=64)
    train.choice.last_step_ms = lambda: 5.0 if train.plan.kind != "recompute" else 1.0
    got = []
    for ids in bs:
        got += tiered_losses(train, model, [ids])
    p = train.plan
    assert got == want
    assert not p.streamed_blocks and not p.recompute and p.swapped_bytes == 0
    assert p.measured.get("checked_ms") == 5.0 and "chosen_by" not in p.measured
    train.unwrap()
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


@pytest.mark.parametrize("later", ["slower", "as_fast"])
@pytest.mark.long
def test_a_kept_plan_whose_later_steps_run_slower_than_the_probe_gives_way_once(later):
    """NOTE [measured choice]: the check keeps the model's plan on two timed steps a side; the
    median of its next LATE_STEPS steps, read from the steps' own events, is checked against the
    probe once more, and a plan more than LATE_SLACK slower goes back to recomputing everywhere,
    once. Losses stay the plain run's bitwise through both switches."""
    from tiermem.training.choice import LATE_SLACK, LATE_STEPS, PROBE_STEPS, VERIFY_STEPS
    checked = 1 + PROBE_STEPS + VERIFY_STEPS           # the trace, the probe, the model's plan
    n = checked + LATE_STEPS + 4
    bs = batches(n)
    want, want_params = plain_run(bs)
    fake, tier, model, opt, train = tiered_gpt("auto")
    # The check sees the model's plan as fast as the probe (1 ms each); the steps' own events say
    # the model's plan then takes 1.5 ms a step (or 1.05, within the slack), recomputing 1 ms.
    train.choice.last_step_ms = lambda: 1.0
    slow = 1.5 if later == "slower" else 1 + LATE_SLACK / 2
    fake.elapsed_ms = lambda a, b: 1.0 if train.plan is None or train.plan.kind == "recompute" else slow
    got, kinds = _losses_and_kinds(train, model, bs)
    assert got == want
    for p, q in zip(model.parameters(), want_params):
        assert torch.equal(p.detach(), q)
    # the plan after each step: the check after step `checked` keeps the model's plan; a step's
    # time is read when the next one begins, so its LATE_STEPS steps are all read one step later
    model_plan = kinds[checked - 1]
    assert model_plan != "recompute", kinds
    assert kinds[checked - 1:checked + LATE_STEPS] == [model_plan] * (LATE_STEPS + 1), " ".join(kinds)
    m = train.plan.measured
    if later == "slower":
        assert kinds[checked + LATE_STEPS:] == ["recompute"] * (n - checked - LATE_STEPS), " ".join(kinds)
        assert (m["late_ms"], m["probe_ms"], m["chosen_by"]) == (1.5, 1.0, "late"), m
        assert "checked again" in train.plan.table() and "recomputing everywhere" in train.plan.table()
    else:
        assert kinds[checked - 1:] == [model_plan] * (n - checked + 1), kinds
        assert m["late_ms"] == slow and "chosen_by" not in m, m
    train.unwrap()
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


def _qwen2(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _hf_loss(model, ids):
    logits = model(input_ids=ids[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def _plain_hf_losses(model, opt, bs):
    return plain_losses(model, opt, bs, _hf_loss)


def test_a_transformers_model_with_its_default_kv_cache_recomputes_its_layers():
    """transformers' configs default to ``use_cache=True``, so a training forward builds a KV cache
    that holds every layer's keys and values and makes the layers look unrecomputable (NOTE [no
    KV cache in a step] in tiermem/training/kvoff.py). Inside a step the cache is off, as transformers
    turns it off under gradient checkpointing; between steps the config is the user's again."""
    bs = batches(6)
    model, opt = _qwen2()
    assert model.config.use_cache is True
    want = _plain_hf_losses(model, opt, bs)
    model, opt = _qwen2()
    fake = FakeBackend(total=1 << 30, foreign_host=True)
    tier = tiermem.Tier(backend=fake)
    train = tier.wrap_training(model, opt, 4 * state_bytes(model), block_bytes=BLOCK, min_swap=4096,
                               recompute="always")
    seen = []
    h = model.model.layers[0].register_forward_pre_hook(lambda m, a: seen.append(model.config.use_cache))
    got = []
    for ids in bs:
        with train.step():
            loss = _hf_loss(model, ids)
            loss.backward()
        got.append(float(loss.detach()))
        assert model.config.use_cache is True
    h.remove()
    assert got == want
    assert seen and not any(seen)
    names = {train.plan.block_names[i] for i in train.plan.recompute}
    assert {f"model.layers.{i}" for i in range(4)} <= names, train.plan
    with torch.no_grad():                  # outside a step the cache is built as the user asked
        assert model(input_ids=bs[0][:, :8]).past_key_values is not None
    model.config.use_cache = False         # the user's own change between steps stays
    with train.step():
        _hf_loss(model, bs[0]).backward()
    assert model.config.use_cache is False
    train.unwrap()
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


@pytest.mark.parametrize("recompute", ["always", "auto"])
@pytest.mark.long
def test_a_mixture_of_experts_recomputes_and_gives_the_plain_losses_bitwise(recompute):
    """A transformers Mixtral: each expert sees a different, data-dependent share of the tokens
    at every step, and one that gets none has no gradient (the optimizer skips it, as it does in
    the plain loop). Its layers are recomputed (the routing runs again on the same input, so it
    picks the same experts) and the losses and parameters are the plain run's bitwise."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
                                     tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2)

    def build():
        torch.manual_seed(0)
        m = transformers.MixtralForCausalLM(cfg).train()
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3)
    bs = batches(8)
    model, opt = build()
    want = _plain_hf_losses(model, opt, bs)
    want_params = [p.detach().clone() for p in model.parameters()]
    model, opt = build()
    fake = FakeBackend(total=1 << 30, foreign_host=True)
    tier = tiermem.Tier(backend=fake)
    # as the Qwen2 test above: 4x the parameters, the slots taking most of it
    train = tier.wrap_training(model, opt, 4 * state_bytes(model), block_bytes=BLOCK, min_swap=4096,
                               recompute=recompute)
    got = tiered_losses(train, model, bs, _hf_loss)
    assert got == want
    for p, q in zip(model.parameters(), want_params):
        assert torch.equal(p.detach(), q)
    plan = train.plan
    assert plan.streamed_blocks
    if recompute == "always":
        names = {plan.block_names[i] for i in plan.recompute}
        assert {f"model.layers.{i}" for i in range(4)} <= names, plan
    train.unwrap()
    del train
    gc.collect()
    tier.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}


def test_graphs_are_captured_between_steps_only_where_the_plan_holds_their_pool(monkeypatch):
    """NOTE [replayed recompute]: after a step, the graphs its eager backwards asked for are
    captured only if the plan's peak with the pool stays within the budget less its margin;
    else the asks are dropped (the plan makes room first, or gives the graphs up). A new plan
    drops them too: they were asked at the old plan's slots. (The fake has no CUDA graphs: the
    capture itself is tests/test_gpu_recompute.py's.)"""
    import types

    import tiermem.training.replay as replay
    monkeypatch.setattr(replay, "SEGMENTS", 0)
    monkeypatch.setattr(replay, "RESERVE_MARGIN", 0.0)
    fake, tier, model, opt, train = tiered_gpt("always")
    tiered_losses(train, model, batches(4))
    r = train.replays
    calls = []
    monkeypatch.setattr(r, "capture_pending", lambda: calls.append(dict(r.pending)) or 0)
    r.capture = True

    def ask():
        r.pending[("k",)] = types.SimpleNamespace(module=model)

    r.need = 1                       # a pool of a byte fits wherever the plan did
    ask()
    train._capture_graphs()
    assert len(calls) == 1 and ("k",) in calls[0]
    r.pending.clear()
    r.need = train.budget            # a pool of the whole budget does not
    ask()
    train._capture_graphs()
    assert len(calls) == 1 and not r.pending and r.capture
    ask()
    train.choice.take(train.plan)
    assert not r.pending
    r.capture, r.need = False, 0
    tiered_losses(train, model, batches(2))
    train.unwrap()
    del train, model, opt
    gc.collect()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}
