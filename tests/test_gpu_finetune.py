"""GPU tests of issue 55's fine-tune as users run it: a transformers Llama with its defaults, fp32
masters under ``torch.autocast(dtype=torch.bfloat16)``, fused AdamW, ``labels=`` loss, on a GPU made
really small with one plain cudaMalloc reservation (docs/facts.md), at the floor tiermem states
(NOTE [the floor] in tiermem/training/floor.py). The failed-capture test is in test_gpu_stepgraph.py
(``test_an_autocast_mistral_step_is_captured_or_refused_with_torch_left_as_it_was``)."""
from __future__ import annotations

import pytest
from test_gpu_train import _cleanup, _setup

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
    model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    want = []
    for ids in batches:
        v = _loss(torch, model, ids)
        v.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(float(v.detach()))
    model.cpu()
    model.load_state_dict(init)
    del opt
    _cleanup()
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
