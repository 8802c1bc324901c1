"""GPU tests of whole-step graphs (NOTE [whole-step graphs] in tiermem/training/stepgraph.py): a
wrap_training step captured once and replayed gives the resident run's losses bitwise, within
the budget; what changes the step (a learning rate, a load, a plan) drops the graph and nothing
is lost; what cannot be captured leaves the steps eager."""
from __future__ import annotations

import pytest
from test_gpu_train import (
    CFG,
    _batches,
    _cleanup,
    _gpt,
    _hf_on_host,
    _labels_losses,
    _loss,
    _pool_report,
    _private_pool_segments,
    _resident_losses,
    _setup,
)

pytestmark = pytest.mark.gpu

MiB = 1 << 20
# bench/train_budget.py part 4's GPT: 0.88 GB of parameters, 3.5 GB of training state with AdamW,
# at 1/2.5 of it (bench/probes/probe_step_graph.py: captured, 1.22 GB reserved against 1.40).
BIG = dict(vocab=8192, seq=512, d=1024, layers=16, heads=16)
# The GPT of CFG (251 MB of state) at 352 MiB: its eager steps fit with little room to spare.
TIGHT = 352 * MiB


def _captured_by():
    """The steps by which a capture has come at the latest: the trace, the probe, the check and
    the late check of NOTE [measured choice], a step more if the late check gives the plan up,
    the settled eager step, and the capture's own. The plan's choices rest on measured times, so
    which of these a run takes differs from run to run (on the H100 at d477e04, some runs
    captured after 6 steps and some after 17)."""
    from tiermem.training.choice import LATE_STEPS, PROBE_STEPS, VERIFY_STEPS
    from tiermem.training.stepgraph import SETTLED_STEPS
    return 1 + PROBE_STEPS + VERIFY_STEPS + LATE_STEPS + 1 + SETTLED_STEPS + 1


CAPTURED_BY = _captured_by()


def _choice_steps():
    """Steps the replays' choice of plan may add (NOTE [graph choice]): the first plan's timed
    replays, the plan tried settling eagerly and captured, its timed replays, and the first
    plan's coming back the same way."""
    from tiermem.training.graphchoice import REPLAYS_TIMED
    from tiermem.training.stepgraph import SETTLED_STEPS
    return 2 * (REPLAYS_TIMED + 2 + SETTLED_STEPS + 1)


CHOICE_STEPS = _choice_steps()


def _only_plan_changes(step):
    """The graph was captured once, and again only where its replays changed the plan."""
    from tiermem.training.stepgraph import PLAN_CHANGED
    return all(d == PLAN_CHANGED for d in step.drops) and step.captures == 1 + len(step.drops)


_HELD: list = []


@pytest.fixture(autouse=True)
def _unwrap_what_a_test_left():
    """A failed test's frames keep its training alive: unwrap it here, so the next test's
    budget does not count what this one held."""
    yield
    while _HELD:
        tier, train, step = _HELD.pop()
        try:
            step.close()
            if train.active:
                train.unwrap("cpu")     # the failed test's frames keep the model: keep it off the device
                tier.close()
        except Exception:  # noqa: BLE001 - best effort after a failure
            pass
    _cleanup()


def _big():
    import torch

    from tiermem.testing import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(**BIG)).cuda()


def _fused(model, lr=1e-3):
    import torch
    return torch.optim.AdamW(model.parameters(), lr=lr, fused=True)


def _state(model):
    return 16 * sum(p.numel() for p in model.parameters())


def _data(n, big=True):
    from tiermem.testing import GPTConfig
    return _batches(GPTConfig(**(BIG if big else CFG)), n, batch=4 if big else 8)


def _plain(batches, loss=_loss, schedule=None, lr=1e-3, big=True):
    """The plain loop's losses and parameters (on the host), fused AdamW as the graphed runs use."""
    def build():
        model = _big() if big else _gpt()[0]
        return model, _fused(model, lr)
    losses, params = _resident_losses(batches, build, loss_fn=loss, schedule=schedule)
    return losses, [p.cpu() for p in params]


def _plain_evaluated(batches, at, probe):
    """The plain loop's losses (fused AdamW, as the graphed runs use), and the model's logits on
    ``probe`` after step ``at``, on the host."""
    import torch
    model = _big()
    opt = _fused(model)
    want, evaluated = [], None
    for i, ids in enumerate(batches):
        v = _loss(model, ids)
        v.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(float(v.detach()))
        if i == at:
            with torch.no_grad():
                evaluated = model(probe[:, :-1]).float().cpu()
    return want, evaluated


def _graphed(batches, loss=_loss, schedule=None, lr=1e-3, big=True, between=None):
    import torch

    import tiermem
    model = _big() if big else _gpt()[0]
    opt = _fused(model, lr)
    sched = schedule(opt) if schedule else None
    budget = int(_state(model) / 2.5) if big else TIGHT
    tier = tiermem.Tier(0, cap="4GiB")
    train = tier.wrap_training(model, opt, budget) if big else \
        tier.wrap_training(model, opt, budget, block_bytes=16 * MiB, min_swap=256 << 10)
    step = train.graphed(lambda ids: loss(model, ids))
    _HELD.append((tier, train, step))
    out, reserved = [], []
    for i, ids in enumerate(batches):
        out.append(step(ids))
        if sched is not None:
            sched.step()
        if between is not None:
            between(i, model, opt, step)
        if step.graph is not None:
            reserved.append(torch.cuda.memory_reserved())
    losses = [float(x) for x in torch.stack(out).cpu()]
    params = [p.detach().cpu() for p in model.parameters()]   # the host: the cap is the budget's
    return losses, params, step, reserved, (tier, train, budget)


def test_a_graphed_step_replays_and_gives_the_resident_losses_bitwise_within_the_budget():
    torch = _setup()
    batches = _data(CAPTURED_BY + CHOICE_STEPS + 8)
    want, want_params = _plain(batches)
    _cleanup()
    got, params, step, reserved, (tier, train, budget) = _graphed(batches)
    print(step, train.plan.table())
    assert _only_plan_changes(step) and step.last_replays >= 8 and not step.off, (step, step.drops)
    assert "replay_ms" in train.plan.measured or "tried_replay_ms" in train.plan.measured, train.plan.measured
    assert train.plan.streamed_blocks and train.plan.recompute       # the step streams and recomputes
    assert got == want
    for p, q in zip(params, want_params):
        assert torch.equal(p, q)
    # the graph's pool holds the step's temporaries: torch's reservation stays within the budget
    assert max(reserved) <= budget, (max(reserved), budget)
    assert train.steps == len(batches) and train.moved["h2d"] > 0
    step.close()
    _cleanup(tier, train)
    # NOTE [capture's cuBLAS workspace]: the graph's pool goes back whole, workspaces included
    assert _private_pool_segments(torch) == [], _pool_report(torch)


def test_dropout_in_recomputed_blocks_draws_the_same_masks_in_replays():
    """Dropout inside recomputed blocks: the graph advances torch's generator per replay as the
    eager step does, and the recompute restores it as torch's checkpoint does."""
    torch = _setup()
    import torch.nn as nn
    import torch.nn.functional as F

    import tiermem

    def build():
        torch.manual_seed(0)
        d = 512
        blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.2),
                                             nn.Linear(4 * d, d), nn.Dropout(0.1)) for _ in range(6)).cuda()
        return blocks, torch.optim.AdamW(blocks.parameters(), lr=1e-3, fused=True)

    g = torch.Generator(device="cuda").manual_seed(5)
    data = [(torch.randn(8, 128, 512, device="cuda", generator=g), torch.randn(8, 128, 512, device="cuda", generator=g))
            for _ in range(CAPTURED_BY + 4)]

    def loss(blocks, x, y):
        for b in blocks:
            x = x + b(x)
        return F.mse_loss(x, y)

    def build_then_seed():
        built = build()
        torch.manual_seed(7)            # the dropout masks' generator, as the graphed run seeds it
        return built

    want, _ = _resident_losses(data, build_then_seed, loss_fn=lambda blocks, xy: loss(blocks, *xy))
    _cleanup()
    blocks, opt = build()
    tier = tiermem.Tier(0, cap="1GiB")
    train = tier.wrap_training(blocks, opt, 320 * MiB, block_bytes=16 * MiB, min_swap=256 << 10, recompute="always")
    step = train.graphed(lambda x, y: loss(blocks, x, y))
    _HELD.append((tier, train, step))
    torch.manual_seed(7)
    got = [float(step(x, y)) for x, y in data]
    print(step, train.plan.table())
    assert len(train.plan.recompute) == 6 and step.replays >= 4, step
    assert got == want
    step.close()
    _cleanup(tier, train)


def test_a_learning_rate_as_a_device_tensor_follows_its_schedule_through_the_replays():
    """A schedule over a tensor learning rate updates it in place, which the graph reads; a float
    one changes what the capture baked in, so the graph is dropped and captured again (the same
    losses either way)."""
    torch = _setup()
    batches = _data(CAPTURED_BY + CHOICE_STEPS + 8)
    cut = CAPTURED_BY + CHOICE_STEPS + 2       # the schedule decays after the last capture

    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 if i < cut else 0.5 ** (i - cut + 1))

    lr = torch.tensor(1e-3, device="cuda")
    want, _ = _plain(batches, schedule=schedule, lr=lr.clone())
    _cleanup()
    got, _, step, _, (tier, train, *_) = _graphed(batches, schedule=schedule, lr=lr.clone())
    print(step, step.drops)
    assert _only_plan_changes(step) and step.last_replays >= 8, (step, step.drops)
    assert got == want
    step.close()               # its graphs' pool, else held while the next training traces its first step
    _cleanup(tier, train)
    want, _ = _plain(batches, schedule=schedule)
    _cleanup()
    got, _, step, _, (tier, train, *_) = _graphed(batches, schedule=schedule)
    print(step, step.drops)
    assert "the optimizer's hyperparameters changed" in step.drops, step.drops
    assert got == want
    _cleanup(tier, train)


def test_evaluation_and_a_reload_between_replays():
    """An evaluation between replays reads the updated parameters; loading the optimizer's
    state drops the graph (its tensors may be new ones), and training goes on as the plain loop
    with the same load does."""
    torch = _setup()
    batches = _data(CAPTURED_BY + 6)
    probe = batches[0]
    evals, saved = {}, {}

    def between(i, model, opt, step):
        if step.graph is not None and "at" not in saved:    # the first step after the capture
            saved["at"] = i
            with torch.no_grad():
                # one row: the graph's pool stays reserved between replays, so an evaluation
                # has the budget less the pool (docs/training.md); 4x512 tokens beside a 486 MiB
                # pool ran out of memory on the H200 at ee27da0
                evals["tiered"] = model(probe[:1, :-1]).float().cpu()
            saved["opt"] = {k: v for k, v in opt.state_dict().items()}
            opt.load_state_dict(saved["opt"])

    got, _, step, _, (tier, train, _) = _graphed(batches, between=between)
    print(step, step.drops, saved.get("at"))
    assert "at" in saved and saved["at"] < len(batches) - 2, saved.get("at")
    assert step.captures >= 1 and step.drops[:1] == ["the model's or the optimizer's state was loaded"], step
    _cleanup(tier, train)
    want, evaluated = _plain_evaluated(batches, saved["at"], probe[:1])
    assert torch.equal(evaluated, evals["tiered"])
    assert got == want


def test_a_released_graph_gives_its_pool_back_for_a_whole_batch_evaluation_and_is_captured_again():
    """GraphedStep.release: once the replays have judged the plan, the graph is dropped and its
    pool given back; an evaluation of a whole batch (which ran out of memory beside the pool on
    the H200 at ee27da0) then runs, the steps after are captured again, and losses and the
    evaluation are the plain run's, bitwise."""
    from tiermem.training.stepgraph import RELEASED
    torch = _setup()
    batches = _data(CAPTURED_BY + CHOICE_STEPS + 10)
    probe = batches[0]
    seen = {}

    def between(i, model, opt, step):
        if step.graph is not None and "at" not in seen and not step.train.choice.graph_choice_open:
            before = torch.cuda.memory_reserved()
            step.release()
            seen.update(at=i, freed=before - torch.cuda.memory_reserved())
            with torch.no_grad():
                seen["eval"] = model(probe[:, :-1]).float().cpu()

    got, _, step, _, (tier, train, _) = _graphed(batches, between=between)
    print(step, step.drops, seen.get("at"), seen.get("freed"))
    assert "at" in seen and seen["freed"] > 0, seen.get("at")
    assert RELEASED in step.drops and step.graph is not None and step.last_replays >= 2, (step, step.drops)
    _cleanup(tier, train)
    want, evaluated = _plain_evaluated(batches, seen["at"], probe)
    assert torch.equal(evaluated, seen["eval"])
    assert got == want


def test_replays_try_recomputing_everywhere_after_a_swapping_plan_and_keep_it_where_faster():
    """NOTE [graph choice]: the eager steps price recomputing at what it costs an eager step, so
    after a plan that swaps (here followed by hand once the eager choice is done, as the Qwen2
    at 1/1.5 kept on its eager steps at d16ed8c), the replays try recomputing everywhere
    whatever the model predicts, and keep it where it replays faster. The losses stay the
    plain run's, bitwise, through both plans' captures."""
    import dataclasses

    from tiermem.planning import plan_training
    from tiermem.training.stepgraph import PLAN_CHANGED
    torch = _setup()
    batches = _data(CAPTURED_BY + CHOICE_STEPS + 12)
    want, _ = _plain(batches)
    _cleanup()
    forced = {}

    def between(i, model, opt, step):
        train = step.train
        if "at" not in forced and train.settled and step.graph is None:
            p = train.plan
            t = dataclasses.replace(train.trace, resident_blocks=p.resident_blocks)
            # no block made resident beyond the plan's: a resident block stays so (as in that run,
            # where both plans kept the same 8 blocks resident)
            same = [i in p.resident_blocks for i in range(len(p.block_param_bytes))]
            swapping = plan_training(t, p.budget, margin=p.margin, recompute="never", link_GBps=p.link_GBps,
                                     can_reside=same)
            forced.update(at=i, plan=swapping)
            train.follow(swapping)

    got, _, step, _, (tier, train, budget) = _graphed(batches, between=between)
    print(step, step.drops, train.plan.table())
    swapping = forced["plan"]
    assert swapping.swapped_bytes > 0 and not swapping.recompute
    p = train.plan
    assert p.recompute and p.swapped_bytes < swapping.swapped_bytes, p.table()
    assert p.measured.get("chosen_by") == "graph", p.measured
    assert p.measured["replay_ms"] < p.measured["first_replay_ms"], p.measured   # faster, measured
    assert step.drops == [PLAN_CHANGED] and step.last_replays >= 4, (step, step.drops)
    assert got == want
    _cleanup(tier, train)


@pytest.mark.parametrize("why", ["sync", "memory"])
def test_a_step_that_cannot_be_captured_stays_eager_and_loses_nothing(why):
    """A host sync inside the step (``.item()``), or a capture that needs more memory than the
    budget leaves, fails the capture: the graphs go off with the reason, the failed capture's
    pool is given back, and that step and the later ones run eagerly with the resident run's
    losses."""
    torch = _setup()
    big = why == "sync"
    batches = _data(CAPTURED_BY + 3, big=big)
    seen = []

    def loss(model, ids):
        v = _loss(model, ids)
        if why == "sync":
            seen.append(v.item())           # not capturable
        elif torch.cuda.is_current_stream_capturing():
            # More than the budget, asked for in the capture only: how big the graph's pool is
            # beside the step depends on the plan the measured times chose (at TIGHT it ran out
            # on the H100 and H200, then fit once the cuBLAS workspaces went back, ee27da0).
            torch.empty(TIGHT, dtype=torch.uint8, device="cuda")
        return v

    want, _ = _plain(batches, big=big)
    _cleanup()
    got, _, step, _, (tier, train, budget) = _graphed(batches, loss=loss, big=big)
    print(step)
    assert step.graph is None and step.off.startswith("the capture failed"), step
    if why == "memory":
        assert "OutOfMemoryError" in step.off
    # NOTE [failed capture's pool]: torch keeps the pool of a capture that did not end; tiermem
    # gives it back (at d35d421 the sync case left 3.6 GB there, and the next test was refused).
    # A capture that ran out of memory did end and its pool goes back with the graph; the
    # activations its forward made there go with the exception's frames, which tiermem clears
    # (at 2bbf434 on the H200, 23 MiB of them were still there after the eager steps).
    assert _private_pool_segments(torch) == [], _pool_report(torch)
    assert got == want

    # NOTE [failed capture's generator]: torch is as it was after the refusal: a new model is
    # built and seeded on the device, and the same seed gives the same values again.
    def seeded():
        torch.manual_seed(1234)
        lin = torch.nn.Linear(64, 64, device="cuda")
        torch.nn.init.normal_(lin.weight)
        return lin.weight.detach().clone(), torch.rand(8, device="cuda")
    (w1, r1), (w2, r2) = seeded(), seeded()
    assert torch.equal(w1, w2) and torch.equal(r1, r2)
    # the steps after the failed capture ran within the budget: its pool was given back
    assert train.resident_peak() <= budget, (train.resident_peak(), budget)
    train.unwrap()
    with pytest.raises(Exception, match="unwrapped"):
        step(batches[0])
    _cleanup(tier)


def test_a_transformers_model_with_its_mask_built_once_is_captured():
    """A Qwen2 (transformers' defaults but eager attention, for bitwise losses): transformers
    builds its attention mask each forward with a pageable copy, which a graph cannot hold, so
    the step passes the same 4-D mask built once; the losses are the resident run's with the
    model's own mask."""
    torch = _setup()
    import torch.nn.functional as F
    import transformers

    import tiermem
    # bench/train_budget.py part 4's Qwen2 (0.97 GB of parameters) at 1/2.5 of its training state
    cfg = transformers.Qwen2Config(hidden_size=1024, intermediate_size=2816, num_hidden_layers=20,
                                   num_attention_heads=16, num_key_value_heads=4, vocab_size=8192,
                                   max_position_embeddings=512, tie_word_embeddings=False,
                                   attn_implementation="eager")
    g = torch.Generator(device="cuda").manual_seed(3)
    batches = [torch.randint(0, 8192, (4, 513), device="cuda", generator=g)
               for _ in range(CAPTURED_BY + CHOICE_STEPS + 6)]
    n = 512
    allowed = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
    mask = torch.full((n, n), torch.finfo(torch.float32).min, device="cuda").masked_fill(allowed, 0.0)
    mask = mask.expand(4, 1, n, n)

    def build():
        torch.manual_seed(0)
        m = transformers.Qwen2ForCausalLM(cfg).cuda()
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)

    def loss(model, ids, with_mask):
        kw = {"attention_mask": mask} if with_mask else {}
        logits = model(input_ids=ids[:, :-1], **kw).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    model, opt = build()
    want = []
    for ids in batches:
        v = loss(model, ids, False)
        v.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(float(v.detach()))
    del model, opt
    _cleanup()
    model, opt = build()
    state = 16 * sum(p.numel() for p in model.parameters())
    tier = tiermem.Tier(0, cap="4GiB")
    train = tier.wrap_training(model, opt, int(state / 2.5))
    step = train.graphed(lambda ids: loss(model, ids, True))
    _HELD.append((tier, train, step))
    got = [float(step(ids)) for ids in batches]
    print(step, train.plan.table())
    assert _only_plan_changes(step) and step.last_replays >= 6, (step, step.drops)
    assert got == want
    step.close()
    _cleanup(tier, train)


def _causal_mask(torch, ids):
    """A 4-D additive causal mask for ``ids``, built once: transformers uses a 4-D mask as it is,
    eagerly and while a graph captures."""
    n = ids.shape[1]
    allowed = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
    m = torch.full((n, n), torch.finfo(torch.float32).min, device=ids.device).masked_fill(allowed, 0.0)
    return m.expand(ids.shape[0], 1, n, n)


@pytest.mark.parametrize("arch,mask", [("neox", False), ("llama", False), ("llama", True)])
def test_a_transformers_model_with_its_defaults_is_graphed_on_a_really_small_gpu(arch, mask):
    """A transformers GPT-NeoX or Llama as users run it (SDPA attention, the masks and rotary
    tables transformers makes itself, requires_grad=True, the loss from ``labels=``), its
    parameters alone bigger than the free memory of a GPU made really small, trained from the
    host as one graph. Its losses follow the plain run's (SDPA's backward is not bitwise
    repeatable: within 2e-3) and torch stays within the budget. The Llama with no mask takes
    another attention path while captured (NOTE [another path under capture] in
    tiermem/training/handle.py): its graphs go off with that reason, and its steps train eagerly, nothing
    lost; with a 4-D mask built once it is graphed."""
    from test_gpu_module import _take_device
    torch = _setup()
    import tiermem
    model, init, params, batches = _hf_on_host(torch, CAPTURED_BY + CHOICE_STEPS + 6, arch)
    kw = {"attention_mask": _causal_mask(torch, batches[0])} if mask else {}
    model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    want = _labels_losses(model, opt, batches, **kw)
    model.cpu()
    model.load_state_dict(init)
    del opt
    _cleanup()
    blob = _take_device(params * 7 // 8)          # less free device memory than the parameters alone
    try:
        free, _ = torch.cuda.mem_get_info()
        assert free < params
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        tier = tiermem.Tier(0)                      # the default cap: the memory free now
        budget = free * 2 // 3
        train = tier.wrap_training(model, opt, budget, block_bytes=8 * MiB)
        step = train.graphed(lambda ids: model(input_ids=ids, labels=ids, **kw).loss)
        _HELD.append((tier, train, step))
        base = torch.cuda.memory_reserved()         # the reservation that makes the GPU small
        got, peaks, reserved = [], [], [0]
        for ids in batches:
            got.append(float(step(ids)))
            peaks.append(train.resident_peak())
            if step.graph is not None:
                reserved.append(torch.cuda.memory_reserved() - base)
        print(step, step.drops, step.off, train.plan.table(), train.plan.measured)
        assert all(abs(a - b) <= 2e-3 * abs(b) for a, b in zip(got, want)), (got, want)
        assert max(peaks) <= budget and max(reserved) <= budget, (max(peaks), max(reserved), budget)
        assert train.plan.streamed_blocks
        if arch == "llama" and not mask:
            assert "another path under a CUDA graph capture" in step.off, (step, step.off)
            assert step.graph is None and step.replays == 0 and train.steps == len(batches), (step, train.steps)
            assert _private_pool_segments(torch) == [], _pool_report(torch)     # the refused capture's pool went back
        else:
            assert step.captures >= 1 and _only_plan_changes(step) and step.last_replays >= 4, (step, step.off)
        step.close()
        train.unwrap()
        _HELD.clear()
        _cleanup(tier)
    finally:
        del blob
        torch.cuda.empty_cache()


def _mistral(torch, n_batches, seq=256):
    """A transformers Mistral with its defaults (SDPA attention, sliding window, grouped-query
    attention, ``labels=`` loss), small, built on the GPU, and ``n_batches`` batches of ids."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MistralConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=16,
                                     num_attention_heads=8, num_key_value_heads=2, vocab_size=4096,
                                     max_position_embeddings=seq)
    g = torch.Generator(device="cuda").manual_seed(5)
    batches = [torch.randint(0, cfg.vocab_size, (4, seq), device="cuda", generator=g) for _ in range(n_batches)]

    def build():
        torch.manual_seed(0)
        m = transformers.MistralForCausalLM(cfg).cuda().train()
        return m, torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    return build, batches


def _seeded_draws_repeat(torch):
    """NOTE [failed capture's generator]: a new model built and seeded on the device, twice, gives
    the same values."""
    def seeded():
        torch.manual_seed(1234)
        lin = torch.nn.Linear(64, 64, device="cuda")
        torch.nn.init.normal_(lin.weight)
        return lin.weight.detach().clone(), torch.rand(8, device="cuda")
    (w1, r1), (w2, r2) = seeded(), seeded()
    return torch.equal(w1, w2) and torch.equal(r1, r2)


@pytest.mark.parametrize("mask", [False, True])
def test_an_autocast_mistral_step_is_captured_or_refused_with_torch_left_as_it_was(mask):
    """Issue 55's Mistral as users train it: fp32 masters and fused AdamW under
    ``torch.autocast(bfloat16)``, transformers' defaults. With no mask, a transformers that builds
    one only while a graph captures makes the captured step save other tensors than its eager ones:
    the capture refuses itself in forward with the reason (NOTE [another path under capture]),
    before the swap asks CUDA for anything a capture forbids (at 4babce1 a new piece of the
    pinned arena failed it with cudaErrorStreamCaptureUnsupported, and left torch's generator in
    capture mode). Torch is as it was: no private pool, tiermem's streams not capturing, a seeded
    model repeats itself. With a 4-D mask built once, or a transformers that builds the same mask
    eagerly and under capture (5.17), the step is captured and replayed. Losses
    follow the plain autocast run (SDPA's backward is not bitwise repeatable: within 1e-2)."""
    torch = _setup()
    from tiermem.cuda import runtime as _cuda
    build, batches = _mistral(torch, CAPTURED_BY + CHOICE_STEPS + 4)
    n = batches[0].shape[1]
    kw = {"attention_mask": torch.ones(n, n, dtype=torch.bool, device="cuda").tril().expand(4, 1, n, n)} if mask else {}

    def loss(model, ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(input_ids=ids, labels=ids, **kw).loss

    model, opt = build()
    want = []
    for ids in batches:
        v = loss(model, ids)
        v.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(float(v.detach()))
    state = 16 * sum(p.numel() for p in model.parameters())
    del model, opt
    _cleanup()
    import tiermem
    model, opt = build()
    tier = tiermem.Tier(0, cap="4GiB")
    train = tier.wrap_training(model, opt, int(state / 2.5), block_bytes=16 * MiB)   # a layer a block
    step = train.graphed(lambda ids: loss(model, ids))
    _HELD.append((tier, train, step))
    got = [float(step(ids)) for ids in batches]
    print(step, step.off, step.drops, train.plan.table())
    assert all(abs(a - b) <= 1e-2 * abs(b) for a, b in zip(got, want)), (got, want)
    assert train.steps == len(batches)
    if mask or step.graph is not None:
        # transformers 5.17 builds the same mask eagerly and under capture: captured, and replayed
        assert step.captures >= 1 and step.last_replays >= 2 and not step.off, (step, step.off)
    else:
        assert step.off.startswith("the capture failed"), step.off
        # the reason: tiermem's own refusal where the saves diverge first; CUDA's where transformers'
        # mask building asks for what a capture forbids before any save differs
        assert "another path under a CUDA graph capture" in step.off or "capturing" in step.off, step.off
        assert _private_pool_segments(torch) == [], _pool_report(torch)
        assert not any(_cuda.stream_is_capturing(tier.side_stream(d)) for d in ("h2d", "d2h"))
        assert not torch.cuda.is_current_stream_capturing()
        assert _seeded_draws_repeat(torch)
    step.close()
    _cleanup(tier, train)
    _HELD.clear()
