"""GPU tests of issue 55's fine-tune as users run it: a transformers Llama with its defaults, fp32
masters under ``torch.autocast(dtype=torch.bfloat16)``, fused AdamW, ``labels=`` loss, on a GPU made
really small with one plain cudaMalloc reservation (docs/facts.md), at the floor tiermem states
(NOTE [the floor] in tiermem/training/floor.py). The failed-capture test is in test_gpu_stepgraph.py
(``test_an_autocast_mistral_step_is_captured_or_refused_with_torch_left_as_it_was``)."""
from __future__ import annotations

import pytest
from test_gpu_train import _cleanup, _setup
from test_train import plain_losses

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def _llama(torch):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                                   num_key_value_heads=2, vocab_size=8192, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()          # on the host
    init = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (2, 256), device="cuda", generator=g) for _ in range(10)]
    return model, init, batches


def _loss(torch, model, ids):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return model(input_ids=ids, labels=ids).loss


def _plain_losses(torch, model, init, batches, loss):
    """The plain loop's losses on the device (fused AdamW); the model goes back to the host with
    its ``init`` weights."""
    model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    want = plain_losses(model, opt, batches, lambda _, ids: loss(ids))
    model.cpu()
    model.load_state_dict(init)
    del opt
    _cleanup()
    return want


def _hf_case(torch, layers, vocab, batch, seq, n=10):
    """A transformers Llama on the host (hidden 512, GQA 8/2) with its initial weights, ``n``
    batches of ``batch`` x ``seq`` tokens on the device, the plain loop's losses (HF's
    ``labels=`` loss under bf16 autocast), and its training state's bytes."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=layers,
                                   num_attention_heads=8, num_key_value_heads=2, vocab_size=vocab,
                                   max_position_embeddings=seq)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()          # on the host
    init = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, vocab, (batch, seq), device="cuda", generator=g) for _ in range(n)]
    want = _plain_losses(torch, model, init, batches, lambda ids: _loss(torch, model, ids))
    return model, init, batches, want, 16 * sum(p.numel() for p in model.parameters())


def _chunked_llama(torch):
    """A Llama of 150M parameters on the host (its embedding and head 6% each, as TinyLlama's),
    its initial weights, 12 batches of 4 x 512 tokens on the device, and its loss under bf16
    autocast through chunked_lm_loss (NOTE [chunked loss])."""
    from tiermem.training.lmloss import chunked_lm_loss
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                                   num_attention_heads=8, num_key_value_heads=2, vocab_size=8192,
                                   max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()          # on the host
    init = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (4, 512), device="cuda", generator=g) for _ in range(12)]

    def loss(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = model.model(input_ids=ids).last_hidden_state
            return chunked_lm_loss(model.lm_head, h, ids, chunk_tokens=512)
    return model, init, batches, loss


def test_an_autocast_fine_tune_runs_every_step_at_its_floor_on_a_really_small_gpu():
    """The floor is read from a first training (its slots at wrap, its activations after the
    traced step); a second training at exactly that budget runs every step, the traced one
    included, within the budget, with losses close to the plain run's (SDPA's backward is not
    bitwise repeatable: within 1e-2). A budget a slot's worth below it is refused: at wrap, at the
    end of its traced step, or by torch inside it with a note that states the floor."""
    from test_gpu_module import _take_device
    torch = _setup()
    import tiermem
    model, init, batches = _llama(torch)
    want = _plain_losses(torch, model, init, batches, lambda ids: _loss(torch, model, ids))
    state = 16 * sum(p.numel() for p in model.parameters())
    blob = _take_device(2 << 30)
    try:
        def wrapped(budget):
            model.load_state_dict(init)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            tier = tiermem.Tier(0)                  # the default cap: the memory free now
            return tier, tier.wrap_training(model, opt, budget, block_bytes=8 * MiB)

        tier, train = wrapped(state)                # room to spare: read the floor
        with train.step():
            _loss(torch, model, batches[0]).backward()
        floor = train.budget_floor
        print("floor", floor, "state", state)
        assert floor.activations is not None and floor.bytes < state
        train.unwrap("cpu")
        _cleanup(tier)

        tier, train = wrapped(floor.bytes)
        base = torch.cuda.memory_reserved()
        got, peaks = [], []
        for ids in batches:
            with train.step():
                v = _loss(torch, model, ids)
                v.backward()
            got.append(float(v.detach()))
            peaks.append(max(train.resident_peak(), torch.cuda.memory_reserved() - base))
        print(train.plan.table())
        assert all(abs(a - b) <= 1e-2 * abs(b) for a, b in zip(got, want)), (got, want)
        assert max(peaks) <= floor.bytes, (max(peaks), floor.bytes)
        assert train.plan.budget_floor <= floor.bytes and "budget floor" in str(train.plan)
        train.unwrap("cpu")
        _cleanup(tier)

        below = floor.bytes - floor.slot_bytes
        try:
            tier, train = wrapped(below)
        except tiermem.OutOfBudgetError as e:
            assert "NOTE [the floor]" in str(e)
        else:
            with pytest.raises((tiermem.OutOfBudgetError, torch.OutOfMemoryError)) as e:
                with train.step():
                    _loss(torch, model, batches[0]).backward()
            said = str(e.value) + "\n".join(getattr(e.value, "__notes__", []))
            assert "NOTE [the floor]" in said, said
            del e
            train.unwrap("cpu")
            _cleanup(tier)
    finally:
        del blob
        torch.cuda.empty_cache()


def test_a_chunked_loss_fine_tune_at_a_quarter_of_its_state_runs_every_step():
    """NOTE [chunked loss], NOTE [the floor]: a Llama of 150M parameters (its embedding and head 6%
    each, as TinyLlama's) under bf16 autocast, its loss through chunked_lm_loss, on a GPU made
    really small: at 1/4 of its training state every step runs, the traced one included, within
    the budget, with losses close to the plain loop's with the same loss (SDPA's backward is not
    bitwise repeatable: within 1e-2); the traced floor is below the budget, and each step moves
    no more than twice its plan's bytes bound (NOTE [bytes bound])."""
    from test_gpu_module import _take_device
    torch = _setup()
    import tiermem
    model, init, batches, loss = _chunked_llama(torch)

    want = _plain_losses(torch, model, init, batches, loss)
    state = 16 * sum(p.numel() for p in model.parameters())
    budget = state // 4
    blob = _take_device(budget + (2 << 30))
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        tier = tiermem.Tier(0)                      # the default cap: the memory free now
        train = tier.wrap_training(model, opt, budget, block_bytes=8 * MiB)   # the embedding is the largest block
        assert train.stream.slot_bytes == train.budget_floor.slot_bytes    # the trace's slots hold the states
        base = torch.cuda.memory_reserved()
        got, peaks = [], []
        for ids in batches:
            with train.step():
                v = loss(ids)
                v.backward()
            got.append(float(v.detach()))
            peaks.append(max(train.resident_peak(), torch.cuda.memory_reserved() - base))
            if train.plan is not None:
                moved = train.moved["h2d"] + train.moved["d2h"]
                assert moved <= 2 * train.plan.bytes_bound, (moved, train.plan.table())
        print(train.plan.table())
        print("floor", train.budget_floor, "state", state)
        assert all(abs(a - b) <= 1e-2 * abs(b) for a, b in zip(got, want)), (got, want)
        assert max(peaks) <= budget, (max(peaks), budget)
        assert train.budget_floor.bytes <= budget
        train.unwrap("cpu")
        _cleanup(tier)
    finally:
        del blob
        torch.cuda.empty_cache()


def test_layers_recomputed_in_parts_run_where_a_whole_layer_does_not_fit():
    """NOTE [recompute in parts] in tiermem/training/plan.py: a Llama whose decoder layers are one
    block each, under bf16 autocast at 4x1024 tokens. A first training reads the trace; the
    second gets the least budget at which the plan recomputes every layer in parts (a whole
    layer's saves do not fit beside its floor), on a GPU made really small. Every step runs within
    the budget with losses close to the plain loop's (SDPA's backward is not bitwise
    repeatable: within 1e-2), and the plan recomputes the layers in parts."""
    from test_gpu_module import _take_device
    torch = _setup()
    import tiermem
    from tiermem.planning import plan_training
    model, init, batches, want, state = _hf_case(torch, layers=8, vocab=8192, batch=4, seq=1024)
    layers = {f"model.layers.{i}" for i in range(8)}

    def wrapped(budget):
        model.load_state_dict(init)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        tier = tiermem.Tier(0)                      # the default cap: the memory free now
        return tier, tier.wrap_training(model, opt, budget, recompute="always")

    tier, train = wrapped(4 * state)                # room to spare: read the trace
    with train.step():
        _loss(torch, model, batches[0]).backward()
    trace, floor = train.choice.trace, train.budget_floor.bytes
    assert {train.blocks[i].name for i in set(trace.part_block)} >= layers
    train.unwrap("cpu")
    _cleanup(tier)
    step = state // 200
    budget = next((b for b in range(floor, 2 * state, step)
                   if {trace.block_names[i] for i in plan_training(trace, b, recompute="always").parts} >= layers),
                  None)
    assert budget is not None, "no budget recomputes every layer in parts"
    blob = _take_device(budget + (2 << 30))
    try:
        tier, train = wrapped(budget)
        base = torch.cuda.memory_reserved()
        got, peaks = [], []
        for ids in batches:
            with train.step():
                v = _loss(torch, model, ids)
                v.backward()
            got.append(float(v.detach()))
            peaks.append(max(train.resident_peak(), torch.cuda.memory_reserved() - base))
        p = train.plan
        print(p.table())
        assert all(abs(a - b) <= 1e-2 * abs(b) for a, b in zip(got, want)), (got, want)
        assert max(peaks) <= budget, (max(peaks), budget)
        assert {p.block_names[i] for i in p.parts} & layers, p.table()
        train.unwrap("cpu")
        _cleanup(tier)
    finally:
        del blob
        torch.cuda.empty_cache()


def test_wide_blocks_lower_the_floor_and_run_every_step_on_a_really_small_gpu():
    """NOTE [wide blocks] in tiermem/training/floor.py: a Llama whose embedding and head (a 32k
    vocabulary) are its largest blocks, under bf16 autocast. With wide blocks the slots are sized
    by its decoder layers and the floor is lower than without; at that lower floor's budget (plus
    a tenth), on a GPU made really small, every step runs within the budget with losses close to
    the plain loop's (SDPA's backward is not bitwise repeatable: within 1e-2), and the plan marks
    the two blocks wide."""
    from test_gpu_module import _take_device
    torch = _setup()
    import tiermem
    model, init, batches, want, state = _hf_case(torch, layers=6, vocab=32000, batch=2, seq=512)

    def wrapped(budget, wide):
        model.load_state_dict(init)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        tier = tiermem.Tier(0)                      # the default cap: the memory free now
        return tier, tier.wrap_training(model, opt, budget, wide_blocks=wide)

    floors = {}
    for wide in (False, True):                      # room to spare: read each floor
        tier, train = wrapped(4 * state, wide)
        with train.step():
            _loss(torch, model, batches[0]).backward()
        floors[wide] = train.budget_floor
        train.unwrap("cpu")
        _cleanup(tier)
    print(floors)
    assert floors[True].wide == ("model.embed_tokens", "lm_head")
    assert floors[True].bytes < floors[False].bytes and floors[True].slot_bytes < floors[False].slot_bytes
    budget = floors[True].bytes * 11 // 10
    blob = _take_device(budget + (2 << 30))
    try:
        tier, train = wrapped(budget, None)         # None: the slots would crowd this budget
        base = torch.cuda.memory_reserved()
        got, peaks = [], []
        for ids in batches:
            with train.step():
                v = _loss(torch, model, ids)
                v.backward()
            got.append(float(v.detach()))
            peaks.append(max(train.resident_peak(), torch.cuda.memory_reserved() - base))
        p = train.plan
        print(p.table())
        assert all(abs(a - b) <= 1e-2 * abs(b) for a, b in zip(got, want)), (got, want)
        assert max(peaks) <= budget, (max(peaks), budget)
        assert train.budget_floor.wide and "wide" in p.table()
        train.unwrap("cpu")
        _cleanup(tier)
    finally:
        del blob
        torch.cuda.empty_cache()


@pytest.mark.parametrize("accumulate, max_norm", [(1, None), (2, 1.0)], ids=["step", "accumulate-clip"])
def test_host_stepped_fine_tune_at_a_quarter_of_its_state_on_a_really_small_gpu(accumulate, max_norm):
    """NOTE [host stepping]: a Llama of 150M parameters under bf16 autocast, fused AdamW with
    weight decay on two groups and a learning-rate schedule, stepped on the host, on a GPU made
    really small at 1/4 of its training state: every step runs within the budget; the losses
    stay close to the plain loop's with the same clipping and accumulation (the host's fused
    AdamW rounds as the device's does not always, and SDPA's backward is not bitwise repeatable:
    within 1e-2); the streamed blocks' states never cross the link (a step moves the streamed
    parameters in twice and their gradients out, with the activations the plan swaps); the
    caller's optimizer counts its steps, and its state dict loads back."""
    import io

    from test_gpu_module import _take_device
    torch = _setup()
    import tiermem
    model, init, batches, loss = _chunked_llama(torch)

    def optimizer():
        decay = [p for p in model.parameters() if p.dim() > 1]
        rest = [p for p in model.parameters() if p.dim() <= 1]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                lr=1e-4, fused=True)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

    model.cuda()
    opt, sched = optimizer()
    want = []
    for i, ids in enumerate(batches):
        v = loss(ids)
        (v / accumulate).backward()
        want.append(float(v.detach()))
        if (i + 1) % accumulate == 0:
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
    model.cpu()
    model.load_state_dict(init)
    del opt, sched
    _cleanup()

    state = 16 * sum(p.numel() for p in model.parameters())
    budget = state // 4
    blob = _take_device(budget + (2 << 30))
    try:
        opt, sched = optimizer()
        tier = tiermem.Tier(0)                      # the default cap: the memory free now
        train = tier.wrap_training(model, opt, budget, block_bytes=8 * MiB, host_step=True,
                                   accumulate=accumulate, max_grad_norm=max_norm)
        base = torch.cuda.memory_reserved()
        got, peaks = [], []
        for i, ids in enumerate(batches):
            with train.step():
                v = loss(ids)
                (v / accumulate).backward()
            got.append(float(v.detach()))
            peaks.append(max(train.resident_peak(), torch.cuda.memory_reserved() - base))
            if (i + 1) % accumulate == 0:
                sched.step()
            if train.plan is not None and i >= 2:
                streamed = [b for b in train.blocks if not b.resident]
                # NOTE [host stepping]: the host takes the blocks whose steps fit in the traced
                # backward at this host's measured rate (on a host shared with another GPU's
                # tests, not the embedding); the others step on the device, their states crossing
                assert streamed and any(b.host for b in streamed)
                p_bytes = sum(b.p_bytes for b in streamed)
                s_bytes = sum(b.s_bytes for b in streamed if not b.host)
                sw = train.plan.swapped_bytes
                # NOTE [accumulation]: a window's gradients go home and come back once more
                extra = p_bytes if accumulate > 1 else 0
                # NOTE [clipping]: a device-stepped block's gradients go home and come back with its
                # parameters for the pass after backward
                dev = sum(b.p_bytes for b in streamed if not b.host) if max_norm is not None else 0
                assert train.moved["h2d"] <= 2 * p_bytes + sw + extra + s_bytes + 2 * dev, (train.moved, p_bytes, sw,
                                                                                           s_bytes, dev)
                assert train.moved["d2h"] <= p_bytes + sw + s_bytes + dev, (train.moved, p_bytes, sw, s_bytes, dev)
        print(train.plan.table())
        assert all(abs(a - b) <= 1e-2 * abs(b) for a, b in zip(got, want)), (got, want)
        assert max(peaks) <= budget, (max(peaks), budget)
        assert train.host.blocks_stepped > 0
        updates = len(batches) // accumulate
        assert all(float(opt.state[p]["step"]) == updates for p in model.parameters())
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        sd = torch.load(io.BytesIO(buf.getvalue()), map_location="cpu")
        moments = {k: v["exp_avg"].clone() for k, v in sd["state"].items()}
        opt.load_state_dict(sd)
        with train.step():                          # a step after the load: the host steps the loaded states
            (loss(batches[0]) / accumulate).backward()
        assert all(torch.isfinite(p.detach()).all() for p in model.parameters())
        assert len(moments) == len(list(model.parameters()))
        train.unwrap("cpu")
        _cleanup(tier)
    finally:
        del blob
        torch.cuda.empty_cache()
