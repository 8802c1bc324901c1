"""GPU tests of recompute in wrap_training (NOTE [recompute plan] in tiermem/training/plan.py):
recomputed and swapped activations in one step give the resident run's losses bitwise, dropout
inside a recomputed block draws the same masks, and the plan's measured times are real ones."""
from __future__ import annotations

import pytest
from test_gpu_train import (
    CFG,
    _batches,
    _cleanup,
    _loss,
    _pool_report,
    _private_pool_segments,
    _resident_losses,
    _setup,
    _train_losses,
)

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def _tiered(budget, **kw):
    import torch
    from test_gpu_train import _gpt

    import tiermem
    model, c = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tier = tiermem.Tier(0, cap="1GiB")
    # 16 MiB: each transformer block (7 MB of parameters) is one block, with no block inside it
    train = tier.wrap_training(model, opt, budget, block_bytes=16 * MiB, min_swap=256 << 10, **kw)
    return tier, model, opt, train, c


@pytest.mark.parametrize("recompute,graphs", [("always", True), ("auto", True), ("always", False), ("auto", False)])
def test_thirty_steps_recomputing_and_swapping_give_the_resident_losses_bitwise(recompute, graphs):
    """With ``graphs`` the recomputed blocks' backwards are replayed (NOTE [replayed recompute]);
    their shared pool fits the budget beside the step's own allocations, the plan made after the
    first captures leaving room for it."""
    torch = _setup()
    from tiermem.testing import GPTConfig
    batches = _batches(GPTConfig(**CFG), 30)
    want, want_params = _resident_losses(batches)
    _cleanup()
    # the state is 251 MB; with graphs, room beside the plan's peak for their pool (NOTE [replayed recompute])
    budget = (352 if graphs and recompute == "always" else 288) * MiB
    tier, model, opt, train, c = _tiered(budget, recompute=recompute, graphs=graphs)
    got, peaks = _train_losses(train, model, batches)
    plan = train.plan
    rep = train.report()
    print(plan.table(), rep)
    assert got == want                                   # bitwise: same floats, same order
    for p, q in zip(model.parameters(), want_params):
        assert torch.equal(p.detach(), q)
    assert max(peaks) <= budget, (max(peaks), budget)
    assert plan.streamed_blocks                          # the budget bit
    if recompute == "always":
        assert len(plan.recompute) >= CFG["layers"] and plan.swapped_bytes > 0   # both in one step
    assert plan.fwd_ms > 0 and plan.bwd_ms > 0           # measured on the GPU, waits taken out
    assert plan.measured.get("step_ms", 0) > 0
    if graphs and rep["replayed_backwards"] and not rep["graphs_off"]:
        # NOTE [replayed recompute]: the recomputed blocks' backwards ran as graphs, a few per block
        assert rep["eager_recomputed_blocks"] == 0 and 0 < rep["graphs"] <= 6 * len(plan.recompute), rep
    if graphs:
        # either they ran as graphs or the pool did not fit and they were given up cleanly: never
        # a failed capture or a step out of memory (the losses above are resident's either way)
        assert rep["replayed_backwards"] or "does not fit" in rep["graphs_off"] or "no room" in rep["graphs_off"], rep
    elif not graphs:
        assert rep["replayed_backwards"] == 0
    _cleanup(tier, train)
    # NOTE [capture's cuBLAS workspace]: the graphs' pool goes back whole, workspaces included
    assert _private_pool_segments(torch) == [], _pool_report(torch)


def test_dropout_in_recomputed_blocks_gives_the_resident_losses_bitwise():
    torch = _setup()
    import torch.nn as nn
    import torch.nn.functional as F

    import tiermem

    def build():
        torch.manual_seed(0)
        d = 512
        blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.2),
                                             nn.Linear(4 * d, d), nn.Dropout(0.1)) for _ in range(6))
        return blocks.cuda()

    g = torch.Generator(device="cuda").manual_seed(5)
    data = [(torch.randn(8, 128, 512, device="cuda", generator=g), torch.randn(8, 128, 512, device="cuda", generator=g))
            for _ in range(8)]

    def forward(blocks, x):
        for b in blocks:
            x = x + b(x)
        return x

    def run(tiered):
        blocks = build()
        opt = torch.optim.AdamW(blocks.parameters(), lr=1e-3)
        tier = train = None
        if tiered:
            tier = tiermem.Tier(0, cap="1GiB")
            train = tier.wrap_training(blocks, opt, 320 * MiB, block_bytes=16 * MiB, min_swap=256 << 10,
                                       recompute="always", graphs=True)
        torch.manual_seed(7)
        out = []
        for x, y in data:
            if train is not None:
                with train.step():
                    loss = F.mse_loss(forward(blocks, x), y)
                    loss.backward()
            else:
                loss = F.mse_loss(forward(blocks, x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            out.append(loss.detach())
        losses = [float(v) for v in torch.stack(out).cpu()]
        params = [p.detach().clone() for p in blocks.parameters()]
        plan = (train.plan, train.report()) if train is not None else None
        if train is not None:
            _cleanup(tier, train)
        return losses, params, plan

    want, want_params, _ = run(False)
    _cleanup()
    got, got_params, (plan, rep) = run(True)
    print(plan.table(), rep)
    assert len(plan.recompute) == 6
    # NOTE [replayed recompute]: a block that draws random numbers keeps torch's checkpoint
    # (the first block's input needs no gradient: torch's checkpoint runs it from the start)
    assert rep["eager_recomputed_blocks"] >= 5 and rep["graphs"] == 0 and rep["replayed_backwards"] == 0
    assert got == want
    for p, q in zip(got_params, want_params):
        assert torch.equal(p, q)



def test_a_transformers_model_replays_its_recomputed_layers_and_gives_the_resident_losses_bitwise():
    """A Qwen2 with transformers' defaults (SDPA, rotary tables and the mask passed as keywords;
    use_cache=True, off inside the steps: NOTE [no KV cache in a step]) recomputing every layer,
    its layers' backwards replayed as graphs (NOTE [replayed recompute]) or, where the budget
    leaves the pool no room, given up before a step runs out of memory."""
    torch = _setup()
    import torch.nn.functional as F
    import transformers

    import tiermem
    cfg = transformers.Qwen2Config(hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                                   num_attention_heads=8, num_key_value_heads=2, vocab_size=4096,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    assert cfg.use_cache
    g = torch.Generator(device="cuda").manual_seed(3)
    batches = [torch.randint(0, 4096, (4, 129), device="cuda", generator=g) for _ in range(12)]

    def loss_of(model, ids):
        logits = model(input_ids=ids[:, :-1]).logits
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    def run(budget):
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(cfg).cuda().train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tier = train = None
        if budget:
            tier = tiermem.Tier(0, cap="1GiB")
            train = tier.wrap_training(model, opt, budget, block_bytes=16 * MiB, min_swap=256 << 10,
                                       recompute="always", graphs=True)
        out, peaks = [], []
        for ids in batches:
            if train is not None:
                with train.step():
                    loss = loss_of(model, ids)
                    loss.backward()
                peaks.append(train.resident_peak())
            else:
                loss = loss_of(model, ids)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            out.append(loss.detach())
        losses = [float(v) for v in torch.stack(out).cpu()]
        rep = train.report() if train is not None else None
        if train is not None:
            print(train.plan.table(), rep)
            _cleanup(tier, train)
        return losses, rep, peaks

    want, _, _ = run(0)
    _cleanup()
    for budget in (416 * MiB, 288 * MiB):
        got, rep, peaks = run(budget)
        assert got == want, budget
        assert max(peaks) <= budget, (max(peaks), budget)
        assert rep["recomputed_blocks"] >= 6, rep
        if rep["replayed_backwards"] and not rep["graphs_off"]:
            assert rep["replayed_backwards"] >= 6 * 6 and rep["eager_recomputed_blocks"] == 0, rep
        else:
            assert "does not fit" in rep["graphs_off"] or "no room" in rep["graphs_off"], rep
        _cleanup()


def test_a_kept_plan_that_runs_slower_later_gives_way_on_the_steps_own_cuda_events():
    """NOTE [measured choice] on the GPU: the second check reads the kept plan's step times from
    the steps' own CUDA events, and a plan whose later steps run more than LATE_SLACK slower than
    the probe goes back to recomputing everywhere, once, the losses still resident's bitwise. The
    GPU's sleep kernel, queued at the start of chosen steps' forwards, sets the times: the probe's
    two timed steps run slower (so the first check keeps the model's plan), and the model's plan
    runs much slower after its check (so the second check must give it up)."""
    torch = _setup()
    from tiermem.testing import GPTConfig
    from tiermem.training.choice import LATE_SLACK, LATE_STEPS, PROBE_STEPS, VERIFY_STEPS
    checked = 1 + PROBE_STEPS + VERIFY_STEPS              # the trace, the probe, the model's plan
    n = checked + LATE_STEPS + 12                          # room for the host to run ahead of the GPU
    batches = _batches(GPTConfig(**CFG), n)
    want, want_params = _resident_losses(batches)
    _cleanup()

    # cycles of the sleep kernel per millisecond on this GPU, timed with events
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1 << 20)
    a.record(); torch.cuda._sleep(50_000_000); b.record(); b.synchronize()
    per_ms = 50_000_000 / a.elapsed_time(b)

    tier, model, opt, train, c = _tiered(288 * MiB, recompute="auto")
    step = [0]

    def sleep(mod, args):
        p = train.plan
        if not torch.is_grad_enabled() or p is None:
            return
        if step[0] in (PROBE_STEPS - 1, PROBE_STEPS) and p.kind == "recompute":
            torch.cuda._sleep(int(100 * per_ms))           # the probe's two timed steps: +100 ms
        elif step[0] >= checked and p.kind != "recompute":
            torch.cuda._sleep(int(400 * per_ms))           # the kept plan, after its check: +400 ms

    hook = model.register_forward_pre_hook(sleep)
    out, peaks, kinds = [], [], []
    for ids in batches:
        with train.step():
            loss = _loss(model, ids)
            loss.backward()
        out.append(loss.detach())
        peaks.append(train.resident_peak())
        kinds.append(train.plan.kind)
        step[0] += 1
    hook.remove()
    got = [float(x) for x in torch.stack(out).cpu()]
    m = dict(train.plan.measured)
    print(kinds, m)
    assert got == want
    for p, q in zip(model.parameters(), want_params):
        assert torch.equal(p.detach(), q)
    assert max(peaks) <= 288 * MiB
    # the first check kept the model's plan; it ran on until LATE_STEPS of its steps were read
    kept = kinds[checked - 1]
    assert kept != "recompute", kinds
    assert kinds[checked - 1:checked + LATE_STEPS] == [kept] * (LATE_STEPS + 1), kinds
    # then gave way once, on times that saw the sleeps: no switch back
    switch = kinds.index("recompute", checked)
    assert kinds[switch:] == ["recompute"] * (n - switch), kinds
    assert m["chosen_by"] == "late" and m["late_ms"] > m["probe_ms"] * (1 + LATE_SLACK) and m["late_ms"] > 400, m
    _cleanup(tier, train)


def test_an_expanded_keyword_tensor_replays_with_checkpoints_gradients_bitwise():
    """NOTE [replayed recompute]: a held keyword tensor that overlaps itself (an attention mask
    made with ``expand``, stride 0) is copied into a dense static buffer; the block's first
    backward runs eagerly and asks for its graph, captured between the steps; the second and
    third replay it, each giving the gradients of torch's checkpoint bitwise."""
    torch = _setup()
    from tiermem.training.replay import Replays

    class Layer(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.a, self.b = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

        def forward(self, x, mask=None):
            return x + self.b(torch.nn.functional.gelu(self.a(x))) * mask

    def grads(wrap, between=lambda: None):
        torch.manual_seed(0)
        layers = torch.nn.ModuleList(Layer(256) for _ in range(2)).cuda()
        for p in layers.parameters():
            p.grad = torch.zeros_like(p)          # a graph adds into .grad where it was captured
        mask = torch.rand(1, 128, 1, device="cuda").expand(8, 128, 256)
        assert 0 in mask.stride()
        out = []
        for s in range(3):
            torch.manual_seed(10 + s)
            x = torch.randn(8, 128, 256, device="cuda", requires_grad=True)
            h = x
            for m in layers:
                h = wrap(m, h, mask)
            h.square().mean().backward()
            out.append([p.grad.clone() for p in layers.parameters()] + [x.grad.clone()])
            between()
        return out

    want = grads(lambda m, h, mask: torch.utils.checkpoint.checkpoint(m, h, mask=mask, use_reentrant=False))
    r = Replays(torch, capture=True, params_of=lambda m: list(m.parameters()))
    got = grads(lambda m, h, mask: r.run(m, m.forward, (h,), {"mask": mask}), between=r.capture_pending)
    assert r.captured == 2 and r.replayed == 4 and not r.off and not r.pending, (r.captured, r.replayed, r.off)
    for a, b in zip(got, want):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    r.close()
    _cleanup()


@pytest.mark.parametrize("budget_mib", [352, 480])
def test_a_gpt_split_into_its_linears_loses_no_step_with_graphs(budget_mib):
    """NOTE [replayed recompute], memory: a model split into its Linears asks for a graph per
    block, and those graphs' static buffers come in every Linear's shapes (here the head's 32 MiB
    output gradient among them). Made inside backward, as they were, they took memory no plan had
    left: on the H200 the bench's GPT split this way ran out of memory in every step after the
    first; at 352 MiB this test did the same (a 32 MiB allocation in the loss). Made between steps
    and counted in the reserve, no step is lost, the losses are the resident run's bitwise, and
    the peaks stay within the budget, whether the graphs fit or not."""
    torch = _setup()
    import tiermem
    from tiermem.testing import GPT, GPTConfig
    c = GPTConfig(vocab=8192, seq=128, d=384, layers=4, heads=4)       # 13.4M parameters: 214 MB of state
    batches = _batches(c, 12)

    def build():
        torch.manual_seed(0)
        m = GPT(c).cuda()
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3)

    want, _ = _resident_losses(batches, build)
    _cleanup()
    model, opt = build()
    tier = tiermem.Tier(0, cap="1GiB")
    budget = budget_mib * MiB
    train = tier.wrap_training(model, opt, budget, block_bytes=1 * MiB, min_swap=256 << 10, recompute="auto",
                               graphs=True)
    got, peaks = _train_losses(train, model, batches)
    rep = train.report()
    print(train.plan.table(), rep)
    assert got == want
    assert max(peaks) <= budget, (max(peaks), budget)
    # the graphs replayed, or were given up cleanly, or the plan kept nothing to recompute
    assert (rep["replayed_backwards"] or "does not fit" in rep["graphs_off"] or "no room" in rep["graphs_off"]
            or (rep["recomputed_blocks"] == 0 and not rep["graphs_off"])), rep
    _cleanup(tier, train)
