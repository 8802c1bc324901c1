"""GPU tests of training within a budget: each role's tiering and losses equal to the resident run.
Managed use stays far below 1 GiB; the budgets are tens of MiB."""
from __future__ import annotations

import contextlib
import copy
import gc

import pytest

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def _setup():
    import torch
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch


CFG = dict(vocab=2048, seq=128, d=384, layers=8, heads=4)   # 15.7M parameters: 251 MB with grads and AdamW
BUDGET = 288 * MiB     # within the 0.25 GB state and its 0.23 GB of activations; the traced step holds 0.15-0.26 GB, 51 MiB of it cuBLAS workspaces (bench/probes/probe_step_memory.py)


def _gpt(seed=0):
    import torch

    from tiermem.testing import GPT, GPTConfig
    c = GPTConfig(**CFG)
    torch.manual_seed(seed)
    return GPT(c).cuda(), c


def _batches(c, n, batch=8, seq=None, seed=1):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    seq = seq or c.seq
    return [torch.randint(0, c.vocab, (batch, seq + 1), device="cuda", generator=g) for _ in range(n)]


def _loss(model, ids):
    import torch.nn.functional as F
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _resident_losses(batches, build=None, loss_fn=_loss, schedule=None):
    """The plain loop's losses and final parameters; ``build()`` gives (model, optimizer), by
    default the GPT of CFG with AdamW; ``schedule(optimizer)``, a learning-rate scheduler
    stepped after each optimizer step."""
    import torch
    if build is None:
        model, _ = _gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        model, opt = build()
    sched = schedule(opt) if schedule is not None else None
    out = []
    for ids in batches:
        loss = loss_fn(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
        out.append(loss.detach())
    return [float(x) for x in torch.stack(out).cpu()], [p.detach().clone() for p in model.parameters()]


def _tiered(budget, **kw):
    import torch

    import tiermem
    model, c = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tier = tiermem.Tier(0, cap="1GiB")
    kw.setdefault("block_bytes", 1 * MiB)     # blocks of a Linear or two: deep nesting, many slots' worth
    kw.setdefault("min_swap", 256 << 10)
    train = tier.wrap_training(model, opt, budget, **kw)
    return tier, model, opt, train, c


def _train_losses(train, model, batches):
    import torch
    out, peaks = [], []
    for ids in batches:
        with train.step():
            loss = _loss(model, ids)
            loss.backward()
        out.append(loss.detach())
        peaks.append(train.resident_peak())
    return [float(x) for x in torch.stack(out).cpu()], peaks


def _cleanup(tier=None, train=None):
    import torch
    if train is not None:
        train.unwrap()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if tier is not None:
        tier.close()


def _private_pool_segments(torch):
    """Segments of torch's private pools (a graph's), with their live blocks' sizes: none once
    every graph is gone."""
    return [(int(seg["total_size"]), [int(b["size"]) for b in seg["blocks"] if b["state"] == "active_allocated"])
            for seg in torch.cuda.memory_snapshot() if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)]


def _pool_report(torch) -> str:
    """What holds a private pool's blocks, for an assertion's message (tests/conftest.py)."""
    import gc

    from conftest import _private_pool_report
    gc.collect()
    return "\n".join(_private_pool_report(torch))


def test_thirty_steps_under_a_tight_budget_give_the_resident_losses_bitwise():
    torch = _setup()
    from tiermem.testing import GPTConfig
    batches = _batches(GPTConfig(**CFG), 30)
    want, want_params = _resident_losses(batches)
    _cleanup()
    budget = BUDGET
    tier, model, opt, train, c = _tiered(budget)
    print("outside", train.outside)
    got, peaks = _train_losses(train, model, batches)
    plan = train.plan
    print(plan.table())
    assert got == want                                   # bitwise: same floats, same order
    for p, q in zip(model.parameters(), want_params):
        assert torch.equal(p.detach(), q)
    assert max(peaks) <= budget, (max(peaks), budget)
    assert plan.swapped_bytes > 0 and len(plan.streamed_blocks) > 0      # the budget really bit
    s = tier.stats()
    for role in ("weight", "optimizer_state", "activation"):
        assert s[f"moved_bytes.{role}.h2d"] > 0 and s[f"moved_bytes.{role}.d2h"] > 0, role
    _cleanup(tier, train)


def test_the_steps_peak_counts_all_the_step_holds_and_stays_within_the_budget():
    """NOTE [outside memory]: a model built on the device, then wrapped. Its parameters' old
    memory is not outside the budget: the step's peak as tiermem counts it is at least torch's
    absolute peak reserved bytes plus tiermem's managed bytes, less what torch held before the
    model was built, and it stays within the budget."""
    torch = _setup()
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    budget = BUDGET
    tier, model, opt, train, c = _tiered(budget)
    assert train.outside <= base + 2 * MiB, (train.outside, base)     # not the model's 63 MB
    for ids in _batches(c, 8):
        plan = train.plan
        with train.step():
            _loss(model, ids).backward()
        absolute = torch.cuda.max_memory_reserved() + tier.resident_bytes - base
        # tiermem counts no less than torch's own figure (the free space of segments held
        # before wrapping may count as the step's, never the other way); a step whose end made
        # a new plan also made its slots after its peak was read
        if train.plan is plan:
            assert train.resident_peak() >= absolute - 2 * MiB, (train.resident_peak(), absolute)
        assert train.resident_peak() <= budget, (train.resident_peak(), budget)
    assert train.plan.streamed_blocks
    _cleanup(tier, train)


def test_each_role_lives_where_the_plan_puts_it():
    _setup()
    import tiermem
    tier, model, opt, train, c = _tiered(BUDGET)
    batches = _batches(c, 3)
    _train_losses(train, model, batches)
    be = tier.backend
    plan = train.plan
    streamed = [b for b in train.blocks if not b.resident]
    resident = [b for b in train.blocks if b.resident]
    assert streamed and plan.keep is not None
    for b in streamed:
        for p in b.params:
            # between steps a streamed parameter is in its device slot or its pinned home
            kind = be.pointer_kind(p.data_ptr())
            in_slot = b.slot is not None
            assert kind == ("device" if in_slot else "host"), (b.name, kind, in_slot)
            assert p.grad is None                        # gradients were consumed inside backward
        for p, key, _ in b.states:
            st = opt.state[p][key]
            assert be.pointer_kind(st.data_ptr()) in ("host", "device")
            assert st.shape == p.shape
    for b in resident:
        for p in b.params:
            assert be.pointer_kind(p.data_ptr()) == "managed"
            assert tiermem.tiered_of(p) is not None
        for p, key, _ in b.states:
            assert be.pointer_kind(opt.state[p][key].data_ptr()) == "managed"
    # Gradients: when a streamed block steps, its gradients are views of its device slot.
    seen = []
    step_block = train._step_block

    def spy(b):
        seen.extend((p.grad.data_ptr(), b.slot.ptr) for p in b.trainable if p.grad is not None)
        step_block(b)
    train._step_block = spy
    with train.step():
        _loss(model, batches[0]).backward()
    train._step_block = step_block
    assert seen and all(slot <= g < slot + train.slot_bytes for g, slot in seen)
    assert "blocks streamed" in str(plan) and "activations" in str(plan)
    _cleanup(tier, train)


def test_a_new_batch_shape_is_traced_and_planned_again():
    _setup()
    tier, model, opt, train, c = _tiered(BUDGET)
    _train_losses(train, model, _batches(c, 2, seq=128))
    first = train.trace.key
    _train_losses(train, model, _batches(c, 3, seq=64, seed=5))
    assert train.trace.key != first and not train._tracing
    assert train.resident_peak() <= BUDGET
    _cleanup(tier, train)


def test_in_capacity_everything_stays_resident_and_nothing_moves():
    _setup()
    from tiermem.testing import GPTConfig
    batches = _batches(GPTConfig(**CFG), 6)
    want, _ = _resident_losses(batches)
    _cleanup()
    tier, model, opt, train, c = _tiered(1 << 30, block_bytes=64 * MiB)
    got, _ = _train_losses(train, model, batches)
    assert got == want
    assert train.plan.swapped_bytes == 0 and not train.plan.streamed_blocks
    assert train.moved == {"h2d": 0, "d2h": 0}
    _cleanup(tier, train)


def test_unwrap_gives_plain_parameters_and_states_back():
    torch = _setup()
    tier, model, opt, train, c = _tiered(BUDGET)
    _train_losses(train, model, _batches(c, 2))
    before = [p.detach().clone() for p in model.parameters()]
    train.unwrap()
    be = tier.backend
    for p, q in zip(model.parameters(), before):
        assert be.pointer_kind(p.data_ptr()) == "device" and torch.equal(p, q)
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.is_cuda:
                assert be.pointer_kind(v.data_ptr()) == "device"
    # and training goes on plainly
    loss = _loss(model, _batches(c, 1)[0])
    loss.backward()
    opt.step()
    _cleanup(tier)


@pytest.mark.parametrize("when", ["into-the-handle-that-trained", "before-the-first-step", "host-before-wrapping"])
def test_a_resumed_run_gives_the_uninterrupted_losses_bitwise(when):
    """NOTE [loaded states] in tiermem/training/states.py: a checkpoint (torch.save of the model's and the
    optimizer's state dicts) taken after 4 steps and loaded back: into the handle that went on
    training, into a fresh model and optimizer wrapped but not stepped yet (a streamed block's
    states then load onto the host, where its parameters live between steps), or into a model
    and optimizer on the host before wrapping them. The 6 steps after it give the uninterrupted
    run's losses and parameters bitwise, and loading the optimizer allocates nothing on the device."""
    import io
    torch = _setup()
    import tiermem
    from tiermem.testing import GPTConfig
    at, batches = 4, _batches(GPTConfig(**CFG), 10)
    tier, model, opt, train, c = _tiered(BUDGET)
    want, _ = _train_losses(train, model, batches)
    want_params = [p.detach().clone() for p in model.parameters()]
    _cleanup(tier, train)

    tier, model, opt, train, c = _tiered(BUDGET)
    _train_losses(train, model, batches[:at])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)

    def restore(m, o):
        ck = torch.load(io.BytesIO(buf.getvalue()), map_location="cpu")   # the allocator is capped
        m.load_state_dict(ck["model"])
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        o.load_state_dict(ck["opt"])
        # the moments go straight into tiermem's memory, or stay on the host until their first
        # step: torch's allocator holds no copy of the optimizer's state on the way
        assert torch.cuda.max_memory_allocated() - before < MiB
    if when == "into-the-handle-that-trained":
        _train_losses(train, model, batches[at:at + 2])
        restore(model, opt)
    else:
        _cleanup(tier, train)
        model, c = _gpt(seed=5)                 # other weights: the load must replace them all
        if when == "host-before-wrapping":
            model.cpu()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if when == "host-before-wrapping":
            restore(model, opt)
        tier = tiermem.Tier(0, cap="1GiB")
        train = tier.wrap_training(model, opt, BUDGET, block_bytes=1 * MiB, min_swap=256 << 10)
        if when == "before-the-first-step":
            restore(model, opt)
    got, peaks = _train_losses(train, model, batches[at:])
    print(train.plan.table())
    assert got == want[at:]
    assert all(torch.equal(p.detach().cuda(), q) for p, q in zip(model.parameters(), want_params))
    assert max(peaks) <= BUDGET and train.plan.streamed_blocks
    _cleanup(tier, train)


def test_writes_between_steps_reach_the_next_steps_as_in_a_resident_run():
    """NOTE [training transport] in tiermem/training/handle.py: between steps every streamed parameter is
    its home's. After 3 steps the first block is re-initialised in place, the second's weights
    are written through ``p.data`` from device tensors (kernels on the compute stream writing the
    pinned home, which the next step's fills must wait for), and the third loads a state dict;
    the 5 steps after give the resident run's losses and parameters bitwise, as in
    tests/test_train_writes.py on the CPU."""
    torch = _setup()
    from tiermem.testing import GPTConfig
    at, batches = 3, _batches(GPTConfig(**CFG), 8)

    def write(model):
        with torch.no_grad():
            for p in model.blocks[0].parameters():
                p.mul_(0.5)
            for p in model.blocks[1].parameters():
                p.data.copy_(torch.full_like(p, 0.01, device="cuda"))
            sd = model.blocks[2].state_dict()
            model.blocks[2].load_state_dict({k: torch.full_like(v, 0.02) for k, v in sd.items()})

    model, _ = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    want = []
    for i, ids in enumerate(batches):
        if i == at:
            write(model)
        loss = _loss(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(float(loss))
    want_params = [p.detach().clone() for p in model.parameters()]
    del model, opt
    _cleanup()

    tier, model, opt, train, c = _tiered(BUDGET)
    got, _ = _train_losses(train, model, batches[:at])
    write(model)
    more, peaks = _train_losses(train, model, batches[at:])
    print(train.plan.table())
    streamed = [train.blocks[i].name for i in train.plan.streamed_blocks]
    assert any(n.startswith(("blocks.0", "blocks.1", "blocks.2")) for n in streamed), streamed
    assert got + more == want
    assert all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), want_params))
    assert max(peaks) <= BUDGET
    _cleanup(tier, train)


def test_an_evaluation_between_steps_streams_and_gives_the_resident_logits():
    """NOTE [evaluation between steps] in tiermem/training/hooks.py: after 4 steps under the tight budget,
    a forward under torch.no_grad() gives the resident run's logits bitwise, brings each streamed
    block's parameters in once over the link (it read them in place before), stays within the
    budget, and training goes on with the resident losses."""
    torch = _setup()
    from tiermem.testing import GPTConfig
    batches = _batches(GPTConfig(**CFG), 6)
    probe = _batches(GPTConfig(**CFG), 1, seed=9)[0][:, :-1]
    model, _ = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    want = []
    for i, ids in enumerate(batches):
        if i == 4:
            with torch.no_grad():
                want_logits = model(probe)
        loss = _loss(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(float(loss))
    del model, opt
    _cleanup()

    tier, model, opt, train, c = _tiered(BUDGET)
    got, _ = _train_losses(train, model, batches[:4])
    streamed = sum(train.blocks[i].p_bytes for i in train.plan.streamed_blocks)
    before = tier.stats()["moved_bytes.weight.h2d"]
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        logits = model(probe)
    torch.cuda.synchronize()
    assert torch.equal(logits, want_logits)
    assert tier.stats()["moved_bytes.weight.h2d"] - before == streamed > 0
    assert tier.resident_bytes + torch.cuda.max_memory_reserved() - train.outside <= BUDGET
    del logits
    more, _ = _train_losses(train, model, batches[4:])
    assert got + more == want
    _cleanup(tier, train)


@pytest.mark.parametrize("recompute", ["auto", "always"])
def test_bf16_autocast_training_gives_the_resident_losses_bitwise(recompute):
    """Mixed precision as most users train: the forward under torch.autocast(bfloat16), the
    parameters and AdamW in fp32. Under a tight budget (blocks streamed, activations swapped, or
    recomputed in backward, where torch's checkpoint enters autocast again) the losses and
    parameters are the resident run's, bit for bit."""
    torch = _setup()
    from tiermem.testing import GPTConfig
    batches = _batches(GPTConfig(**CFG), 12)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    model, _ = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    want = []
    for ids in batches:
        with autocast():
            loss = _loss(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(float(loss.detach()))
    want_params = [p.detach().clone() for p in model.parameters()]
    del model, opt
    _cleanup()
    tier, model, opt, train, c = _tiered(BUDGET, recompute=recompute)
    got, peaks = [], []
    for ids in batches:
        with train.step():
            with autocast():
                loss = _loss(model, ids)
            loss.backward()
        got.append(float(loss.detach()))
        peaks.append(train.resident_peak())
    print(train.plan.table())
    assert got == want
    assert all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), want_params))
    assert max(peaks) <= BUDGET and train.plan.streamed_blocks
    assert recompute != "always" or train.plan.recompute
    _cleanup(tier, train)


def test_save_pretrained_of_a_model_in_training_loads_back_in_transformers(tmp_path):
    """A transformers Qwen2 (default flags) trained under a tight budget, saved mid-run with
    ``save_pretrained`` (safetensors) while its parameters live in tiermem's homes, slots and
    managed memory: ``from_pretrained`` gives back exactly the parameters the run holds, and
    training goes on after the save. Before it, budgets too small for the model's largest block
    are refused at wrapping, or fail the first step with torch's out-of-memory error and
    tiermem's note of what the budget held."""
    torch = _setup()
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                                   num_attention_heads=8, num_key_value_heads=2, vocab_size=4096,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    import tiermem
    tier = tiermem.Tier(0, cap="1GiB")
    state = sum(p.numel() * p.element_size() for p in model.parameters()) * 4
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (2, 128), device="cuda", generator=g) for _ in range(4)]

    def step(ids):
        with train.step():
            model(input_ids=ids, labels=ids).loss.backward()
    # A budget smaller than the slots for the largest block (the 8 MB embedding and its
    # gradients, three times) is refused at wrapping, nothing changed; one that holds the slots
    # and no more fails the first step with torch's OOM, and a note of what the budget held.
    before = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(tiermem.errors.OutOfBudgetError, match="embed_tokens") as e:
        tier.wrap_training(model, opt, 32 * MiB, block_bytes=1 * MiB)
    assert [p.data_ptr() for p in model.parameters()] == before
    slots = e.value.asked
    del e
    gc.collect()
    torch.cuda.empty_cache()
    train = tier.wrap_training(model, opt, slots + MiB, block_bytes=1 * MiB)
    # 67 MB of logits alone: past the budget whatever free space the caller's partly used
    # segments lend the step (memory torch held before wrapping is left out of the budget)
    big = torch.randint(0, cfg.vocab_size, (16, 256), device="cuda", generator=g)
    with pytest.raises(torch.OutOfMemoryError) as e:
        step(big)
    assert any("tiermem: this step runs within a budget" in n and "embed_tokens" in n
               for n in getattr(e.value, "__notes__", [])), getattr(e.value, "__notes__", None)
    del e
    train.unwrap()
    train = tier.wrap_training(model, opt, state * 3 // 4, block_bytes=1 * MiB)
    for ids in batches[:3]:
        step(ids)
    assert train.plan.streamed_blocks
    model.save_pretrained(tmp_path)
    held = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    back = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32)
    got = back.state_dict()
    assert set(got) == set(held)
    assert all(torch.equal(got[k], held[k]) for k in held)
    step(batches[3])                           # and the run goes on
    assert not all(torch.equal(p.detach().cpu(), held[k]) for k, p in model.named_parameters())
    _cleanup(tier, train)


def test_a_second_backward_in_one_step_is_refused_clearly():
    _setup()
    import tiermem
    tier, model, opt, train, c = _tiered(BUDGET)
    ids = _batches(c, 1)[0]
    with pytest.raises(tiermem.TierMemError, match="one backward per train.step.*accumulate=N"):
        with train.step():
            _loss(model, ids).backward()
            _loss(model, ids).backward()
    _cleanup(tier, train)


def test_accumulated_micro_batches_give_the_resident_losses_parameters_and_gradients_bitwise():
    """NOTE [accumulation] in tiermem/training/handle.py: with accumulate=4 under the tight budget, 14
    micro-batches (3 optimizer steps and an open window) give the resident loop's losses and
    parameters bitwise, within the budget; the micro-batches that do not update move the
    gradients and no optimizer state, and unwrap() gives the open window's gradients back."""
    torch = _setup()
    from tiermem.testing import GPTConfig
    n, batches = 4, _batches(GPTConfig(**CFG), 14)
    model, _ = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    want = []
    for i, ids in enumerate(batches):
        loss = _loss(model, ids)
        (loss / n).backward()
        want.append(loss.detach())
        if (i + 1) % n == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
    want = [float(x) for x in torch.stack(want).cpu()]
    want_params = [p.detach().clone() for p in model.parameters()]
    want_grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    del model, opt
    _cleanup()

    tier, model, opt, train, c = _tiered(BUDGET, accumulate=n)
    got, peaks, moved = [], [], []
    for i, ids in enumerate(batches):
        before = tier.stats()
        with train.step():
            loss = _loss(model, ids)
            (loss / n).backward()
        got.append(loss.detach())
        peaks.append(train.resident_peak())
        after = tier.stats()
        moved.append({k: after[f"moved_bytes.{k}"] - before[f"moved_bytes.{k}"]
                      for k in ("optimizer_state.h2d", "gradient.h2d", "gradient.d2h")})
    print(train.plan.table())
    print(moved[-6:])
    assert [float(x) for x in torch.stack(got).cpu()] == want
    assert train.plan.streamed_blocks and train.updates == 3 and train.accumulated == 2
    assert max(peaks) <= BUDGET
    for i in (9, 10):                          # inside the third window (micro-batches 8 to 11)
        assert moved[i]["optimizer_state.h2d"] == 0 and moved[i]["gradient.h2d"] > 0 and moved[i]["gradient.d2h"] > 0
    assert moved[11]["optimizer_state.h2d"] > 0 and moved[11]["gradient.d2h"] == 0
    train.unwrap()
    assert all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), want_params))
    for p, g in zip(model.parameters(), want_grads):
        assert (p.grad is None) == (g is None) and (g is None or torch.equal(p.grad, g))
    _cleanup(tier)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_clipping_gives_clip_grad_norm_then_step_bitwise(accumulate):
    """NOTE [clipping] in tiermem/training/clipping.py: max_grad_norm=0.5 under the tight budget gives the
    resident loop's clip_grad_norm_ (foreach norms on the GPU, NOTE [clip arithmetic]) and step,
    bitwise: losses, total norms and parameters, within the budget; the clip bites."""
    torch = _setup()
    from tiermem.testing import GPTConfig
    batches, clip = _batches(GPTConfig(**CFG), 8), 0.5
    model, _ = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    want, want_norms = [], []
    for i, ids in enumerate(batches):
        loss = _loss(model, ids)
        (loss / accumulate).backward()
        want.append(loss.detach())
        if (i + 1) % accumulate == 0:
            want_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
            opt.step()
            opt.zero_grad(set_to_none=True)
    want_params = [p.detach().clone() for p in model.parameters()]
    del model, opt
    _cleanup()

    tier, model, opt, train, c = _tiered(BUDGET, max_grad_norm=clip, accumulate=accumulate)
    got, norms, peaks = [], [], []
    for i, ids in enumerate(batches):
        with train.step():
            loss = _loss(model, ids)
            (loss / accumulate).backward()
        got.append(loss.detach())
        peaks.append(train.resident_peak())
        if (i + 1) % accumulate == 0:
            norms.append(train.grad_norm)
    print(train.plan.table(), [float(x) for x in want_norms])
    assert train.plan.streamed_blocks
    assert torch.equal(torch.stack(got), torch.stack(want))
    assert torch.equal(torch.stack(norms), torch.stack(want_norms))
    assert any(float(x) > clip for x in want_norms)
    assert all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), want_params))
    assert max(peaks) <= BUDGET
    with pytest.raises(Exception, match="steps the optimizer itself"):
        opt.step()
    _cleanup(tier, train)


def test_speculative_clipping_gives_clip_grad_norm_bitwise_and_keeps_or_redoes_each_step():
    """NOTE [speculative clipping]: with max_grad_norm at the median of an unclipped run's norms
    the clip bites on some steps and not on others; speculate=True keeps the steps inside
    backward where it did not and redoes them where it did, and the losses, norms and
    parameters are the resident loop's with clip_grad_norm_, bitwise."""
    torch = _setup()
    from tiermem.testing import GPTConfig
    batches = _batches(GPTConfig(**CFG), 10)

    def resident(clip):
        model, _ = _gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, norms = [], []
        for ids in batches:
            loss = _loss(model, ids)
            loss.backward()
            losses.append(loss.detach())
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return torch.stack(losses), torch.stack(norms), [p.detach().clone() for p in model.parameters()]
    _, free_norms, _ = resident(1e9)
    clip = float(free_norms.median())
    want, want_norms, want_params = resident(clip)
    _cleanup()
    tier, model, opt, train, c = _tiered(BUDGET, max_grad_norm=clip, speculate=True)
    got, norms, peaks = [], [], []
    for ids in batches:
        with train.step():
            loss = _loss(model, ids)
            loss.backward()
        got.append(loss.detach())
        norms.append(train.grad_norm)
        peaks.append(train.resident_peak())
    print(train.plan.table(), train.speculation, [float(x) for x in want_norms], clip)
    assert train.plan.streamed_blocks and max(peaks) <= BUDGET
    assert torch.equal(torch.stack(got), want) and torch.equal(torch.stack(norms), want_norms)
    assert all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), want_params))
    from test_train_clip import _speculation_expected
    assert train.speculation == _speculation_expected(torch, want_norms, clip)
    assert train.speculation["committed"] >= 1
    _cleanup(tier, train)


@pytest.mark.parametrize("speculate", [False, True])
def test_a_ported_trainer_loop_with_fused_adamw_gives_the_resident_losses_bitwise(speculate):
    """HF Trainer's loop as users run it: fused AdamW (its default optimizer, adamw_torch_fused),
    two parameter groups, a warm-up scheduler stepped after each step, clipping to 1.0. Under
    the tight budget the losses, parameters and learning rates are the resident loop's, bitwise
    (tests/test_train_optimizers.py covers more optimizers on the CPU)."""
    torch = _setup()
    from tiermem.testing import GPTConfig
    batches = _batches(GPTConfig(**CFG), 8)

    from helpers import trainer_loop, trainer_optimizer

    def build():
        model, _ = _gpt()
        return (model, *trainer_optimizer(model, lambda g: torch.optim.AdamW(g, lr=1e-3, fused=True)))

    model, opt, sched = build()
    want = trainer_loop(model, opt, sched, batches, _loss)
    want_params = [p.detach().clone() for p in model.parameters()]
    want_lr = [g["lr"] for g in opt.param_groups]
    del model, opt, sched
    _cleanup()
    import tiermem
    model, opt, sched = build()
    tier = tiermem.Tier(0, cap="1GiB")
    train = tier.wrap_training(model, opt, BUDGET, block_bytes=1 * MiB, min_swap=256 << 10, max_grad_norm=1.0,
                               speculate=speculate)
    got, peaks = [], []
    model.zero_grad()                # Trainer's loop, ported: its zero_grad calls are harmless
    for ids in batches:
        with train.step():
            loss = _loss(model, ids)
            loss.backward()
        sched.step()
        model.zero_grad()
        got.append(loss.detach())
        peaks.append(train.resident_peak())
    print(train.plan.table(), train.speculation)
    assert train.plan.streamed_blocks and max(peaks) <= BUDGET
    assert torch.equal(torch.stack(got), torch.stack(want))
    assert all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), want_params))
    assert [g["lr"] for g in opt.param_groups] == want_lr
    _cleanup(tier, train)


def test_bf16_moments_stay_close_to_the_resident_losses_and_move_half_the_state_bytes():
    """NOTE [bf16 moments]: streamed blocks' AdamW moments held and moved as bf16 (rounded
    stochastically, stepped in fp32). A CPU emulation of this run (fp32 AdamW, its moments rounded
    to bf16 after every step) stayed within 2e-6 of the fp32 losses over the 30 steps."""
    torch = _setup()
    from tiermem.roles import Role
    from tiermem.testing import GPTConfig
    batches = _batches(GPTConfig(**CFG), 30)
    want, _ = _resident_losses(batches)
    _cleanup()
    tier, model, opt, train, c = _tiered(BUDGET, state_dtype=torch.bfloat16)
    counted = []                      # optimizer-state bytes of each crossing of the link
    count = train.stream.count

    def spy(direction, role, n):
        if role is Role.OPTIMIZER_STATE:
            counted.append(n)
        count(direction, role, n)
    train.stream.count = spy
    rng = torch.cuda.get_rng_state()
    got, peaks = _train_losses(train, model, batches)
    assert torch.equal(torch.cuda.get_rng_state(), rng)        # the rounding draws from its own generator
    plan = train.plan
    print(plan.table())
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) < 2e-4, (got, want)
    assert max(peaks) <= BUDGET, (max(peaks), BUDGET)
    streamed = [b for b in train.blocks if not b.resident and b.states]
    assert streamed and plan.swapped_bytes > 0
    for b in train.blocks:
        # every state of this model is a whole number of 128 elements: bf16 is exactly half
        assert 2 * b.s_bytes == b.s_full
        want_dtype = torch.float32 if b.resident else torch.bfloat16
        assert all(opt.state[p][key].dtype == want_dtype for p, key, _ in b.states), b.name
    assert plan.block_state_moved_bytes == tuple(n // 2 for n in plan.block_state_bytes)
    assert counted and set(counted) <= {b.s_full // 2 for b in train.blocks if b.states}
    s = tier.stats()
    assert s["moved_bytes.optimizer_state.h2d"] > 0 and s["moved_bytes.optimizer_state.d2h"] > 0
    train.unwrap()
    for st in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            assert st[key].dtype == torch.float32 and st[key].is_cuda
    _cleanup(tier)


def _labels_losses(model, opt, batches, **kw):
    """The plain loop's losses, transformers computing each from ``labels=`` (``kw``: more of the
    model's arguments)."""
    out = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids, **kw).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(float(loss.detach()))
    return out


def _hf_on_host(torch, steps, arch="neox"):
    """A transformers model of an architecture no bench is tuned on, with its default flags (SDPA
    attention, requires_grad=True), built on the host: "neox" (GPT-NeoX) or "llama" (Llama:
    RoPE, grouped-query attention, SwiGLU). The model, its initial state, its parameters' bytes,
    and ``steps`` batches of token ids on the device."""
    transformers = pytest.importorskip("transformers")
    if arch == "llama":
        cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                                       num_attention_heads=16, num_key_value_heads=4, vocab_size=4096,
                                       max_position_embeddings=256)
        build = transformers.LlamaForCausalLM
    else:
        cfg = transformers.GPTNeoXConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12,
                                         num_attention_heads=16, vocab_size=4096, max_position_embeddings=256)
        build = transformers.GPTNeoXForCausalLM
    torch.manual_seed(0)
    model = build(cfg).train()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (2, 128), device="cuda", generator=g) for _ in range(steps)]
    return model, init, params, batches


def test_a_transformers_model_bigger_than_the_really_small_gpu_trains_from_the_host():
    """NOTE [host models] in tiermem/training/memory.py: a transformers GPT-NeoX (an architecture no bench
    is tuned on) with its default flags (SDPA attention, requires_grad=True), whose parameters
    alone are bigger than the free memory of a GPU made really small, trains from the host within
    its budget. Its losses follow the resident run's (SDPA's backward is not bitwise repeatable,
    so within 2e-3); unwrap to the device is refused clearly with nothing changed, and unwrap()
    gives parameters, states and buffers back to the host."""
    from test_gpu_module import _take_device
    torch = _setup()
    import tiermem
    model, init, params, batches = _hf_on_host(torch, 6)

    def run(step):
        out = []
        for ids in batches:
            with step():
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            out.append(float(loss.detach()))
        return out

    model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    @contextlib.contextmanager
    def plain():
        yield
        opt.step()
        opt.zero_grad(set_to_none=True)
    want = run(plain)
    model.cpu()
    model.load_state_dict(init)
    del opt
    gc.collect()
    torch.cuda.empty_cache()
    blob = _take_device(params * 7 // 8)          # less free device memory than the parameters alone
    try:
        free, _ = torch.cuda.mem_get_info()
        assert free < params
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tier = tiermem.Tier(0)                      # the default cap: the memory free now
        budget = free * 2 // 3
        train = tier.wrap_training(model, opt, budget, block_bytes=8 * MiB)
        assert tier.backend.guard.reserved <= free
        got = run(train.step)
        print(train.plan.table())
        assert all(abs(a - b) <= 2e-3 * abs(b) for a, b in zip(got, want)), (got, want)
        assert train.resident_peak() <= budget
        assert len(train.plan.streamed_blocks) > 0
        with pytest.raises(tiermem.errors.DeviceFullError, match="device='cpu'"):
            train.unwrap(device="cuda")             # the plain model would not fit: refused, nothing changed
        with train.step():
            model(input_ids=batches[0], labels=batches[0]).loss.backward()
        train.unwrap()                              # back where it came from: the host
        assert all(p.device.type == "cpu" for p in model.parameters())
        assert all(b.device.type == "cpu" for b in model.buffers())
        assert all(v.device.type == "cpu" for s in opt.state.values() for k, v in s.items()
                   if torch.is_tensor(v) and k != "step")
        del train
        _cleanup(tier)
    finally:
        del blob
        torch.cuda.empty_cache()


def test_a_transformers_model_accumulates_clips_and_generates_between_steps_on_a_really_small_gpu():
    """A transformers Qwen2 with its default flags (SDPA, requires_grad=True), on a GPU made really
    small (less free memory than its training state), trained with accumulate=2 and
    max_grad_norm=1.0 (NOTE [accumulation], NOTE [clipping]): the losses and norms follow the
    resident loop's with clip_grad_norm_ (SDPA's backward is not bitwise repeatable, so within
    2e-3), within the budget; generate() between steps (NOTE [evaluation between steps]) gives
    the tokens the same weights give once unwrapped. The loop calls model.zero_grad() where
    transformers' Trainer does (NOTE [zero_grad]), and an EMA-style copy.deepcopy of the held
    model is refused (NOTE [held modules])."""
    from test_gpu_module import _take_device
    torch = _setup()
    import tiermem
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                   num_attention_heads=8, num_key_value_heads=2, vocab_size=4096,
                                   max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).cuda().train()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    state = sum(p.numel() * p.element_size() for p in model.parameters()) * 4
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (4, 256), device="cuda", generator=g) for _ in range(8)]
    prompt = batches[0][:1, :16]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    want, want_norms = [], []
    for i, ids in enumerate(batches):
        loss = model(input_ids=ids, labels=ids).loss
        (loss / 2).backward()
        want.append(float(loss.detach()))
        if i % 2:
            want_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            opt.zero_grad(set_to_none=True)
    model.load_state_dict(init)
    del opt
    gc.collect()
    torch.cuda.empty_cache()
    blob = _take_device(state // 2)            # less free device memory than the training state
    try:
        free, _ = torch.cuda.mem_get_info()
        assert free < state
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tier = tiermem.Tier(0)                   # the default cap: the memory free now
        budget = free * 9 // 10
        train = tier.wrap_training(model, opt, budget, block_bytes=8 * MiB, accumulate=2, max_grad_norm=1.0)
        got, norms, peaks = [], [], []
        model.zero_grad()
        for i, ids in enumerate(batches):
            with train.step():
                loss = model(input_ids=ids, labels=ids).loss
                (loss / 2).backward()
            got.append(float(loss.detach()))
            peaks.append(train.resident_peak())
            if i % 2:
                norms.append(float(train.grad_norm))
                model.zero_grad()                # Trainer's, after each update: harmless
            if i == 2:
                with pytest.raises(tiermem.errors.WrapError, match="unwrap"):
                    copy.deepcopy(model)
            if i == 5:                           # generate between an update and the next window
                model.eval()
                with torch.no_grad():
                    tokens = model.generate(prompt, max_new_tokens=8, do_sample=False)
                model.train()
                mid = [p.detach().to("cpu", copy=True) for p in model.parameters()]   # outside the budget
        print(train.plan.table(), got, want, norms, want_norms)
        assert len(train.plan.streamed_blocks) > 0 and max(peaks) <= budget
        assert all(abs(a - b) <= 2e-3 * abs(b) for a, b in zip(got, want)), (got, want)
        assert all(abs(a - b) <= 1e-3 * b for a, b in zip(norms, want_norms)), (norms, want_norms)
        assert any(n > 1.0 for n in want_norms)
        train.unwrap(device="cpu")
        del train
        _cleanup(tier)
    finally:
        del blob
        torch.cuda.empty_cache()
    with torch.no_grad():
        for p, m in zip(model.parameters(), mid):       # the weights generate() saw, plain
            p.copy_(m)
    model.cuda().eval()
    with torch.no_grad():
        again = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(tokens, again)


@pytest.mark.parametrize("arch", ["Llama", "Mixtral"])
def test_llama_and_a_mixture_of_experts_train_on_a_really_small_gpu_with_the_resident_losses(arch):
    """Two architectures no bench is tuned on, with transformers' default flags but eager
    attention (SDPA's backward is not bitwise repeatable): a Llama, and a Mixtral whose experts
    each see a different, data-dependent share of the tokens at every step (an expert that gets
    none has no gradient, and the optimizer skips it, as it does resident). On a GPU made really
    small (less free memory than the training state), at a budget of 1/2.5 of the state, with the
    default plan (keep, swap or recompute, NOTE [recompute plan]): the losses and the parameters
    are the resident run's bitwise when the resident run is itself repeatable (checked by running
    it twice), else within 1e-5; the step's peak stays within the budget."""
    from test_gpu_module import _take_device
    torch = _setup()
    import tiermem
    transformers = pytest.importorskip("transformers")
    # 20 layers, as the benches' models have: three slots of one layer's parameters, gradients and
    # AdamW states (45 and 61 MB) then fit 1/2.5 of the state beside the step's floor
    common = dict(hidden_size=512, intermediate_size=1408 if arch == "Llama" else 512, num_hidden_layers=20,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=2048, max_position_embeddings=256,
                  attn_implementation="eager")
    if arch == "Mixtral":
        cfg = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
    else:
        cfg = transformers.LlamaConfig(**common)
    cls = getattr(transformers, f"{arch}ForCausalLM")
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (4, 128), device="cuda", generator=g) for _ in range(12)]

    def build():
        torch.manual_seed(0)
        m = cls(cfg).cuda().train()
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3)

    def resident():
        m, opt = build()
        return _labels_losses(m, opt, batches), [p.detach().cpu() for p in m.parameters()]

    want, want_params = resident()
    again, _ = resident()
    repeatable = want == again
    _cleanup()
    model, opt = build()
    state = sum(p.numel() * p.element_size() for p in model.parameters()) * 4    # parameters, gradients, AdamW
    blob = _take_device(state // 2)            # less free device memory than the training state
    try:
        free, _ = torch.cuda.mem_get_info()
        assert free < state
        tier = tiermem.Tier(0)                 # the default cap: the memory free now
        budget = int(state / 2.5)
        train = tier.wrap_training(model, opt, budget, block_bytes=16 * MiB)   # a layer a block
        got, peaks = [], []
        for ids in batches:
            with train.step():
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            got.append(float(loss.detach()))
            peaks.append(train.resident_peak())
        plan = train.plan
        print(arch, plan.table(), got, want, repeatable)
        assert plan.streamed_blocks and max(peaks) <= budget, (max(peaks), budget)
        params = [p.detach().cpu() for p in model.parameters()]
        if repeatable:
            assert got == want
            assert all(torch.equal(p, q) for p, q in zip(params, want_params))
        else:
            assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want)), (got, want)
        train.unwrap(device="cpu")             # the plain model would not fit this GPU
        del train
        _cleanup(tier)
    finally:
        del blob
        torch.cuda.empty_cache()
