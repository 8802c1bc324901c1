"""Data-parallel tiered training on the CPU: two ranks under gloo, each with its own replica on the
fake backend, against one process training on the whole batch (NOTE [data parallel] in
tiermem/training/handle.py). The NCCL run on two GPUs is for the multi-GPU machine."""
from __future__ import annotations

import os

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

STEPS = 4
# Against the whole batch in one process the gradients differ by float rounding, which AdamW's
# normalised update turns into up to 2e-5 here after four steps (lr 1e-3).
TOL = dict(rtol=0, atol=1e-4)


def _rank(rank: int, world: int, init: str, out: str, accumulate: int, clip: float | None,
          wider: int = 0, capacity: bool = False, host: bool = False, drop: bool = False,
          shorter: bool = False, shard: bool = False, speculate: bool = False) -> None:
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from fakes import FakeBackend
    from test_train import batches, gpt, loss_of, state_bytes

    import tiermem
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    reduces, blocking, agreed = [], [], []
    all_reduce = dist.all_reduce

    def counted(t, *a, **kw):
        if not t.is_floating_point():
            agreed.append(t.numel())        # NOTE [host stepping]: the ranks' agreement, not a gradient
            return all_reduce(t, *a, **kw)
        reduces.append(t.numel())
        if not kw.get("async_op", False):
            blocking.append(t.numel())
        return all_reduce(t, *a, **kw)
    dist.all_reduce = counted
    dropped: list[int] = []
    from tiermem.training.hoststep import HostSteps
    agree, agreements = HostSteps.agree, []

    def counting(self, *a):
        agreements.append(1)
        return agree(self, *a)
    HostSteps.agree = counting
    if drop and rank:          # this rank's host cannot step the first block it chose: no rank may
        from tiermem.training.hoststep import HostSteps
        choose = HostSteps.choose

        def fewer(self, blocks, *a):
            choose(self, blocks, *a)
            first = next(b for b in blocks if b.host)
            first.host = False
            dropped.append(first.index)
        HostSteps.choose = fewer
    try:
        model, opt = gpt()
        if host:                            # the host's twin is fused: so is the reference's
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
        # ``wider``: this rank's budget is that many more times the state, so its plan differs;
        # ``capacity``: the second rank's budget holds everything, and it plans no recompute
        budget = state_bytes(model) * (100 if capacity and rank else 1 + wider * rank)
        train = tier.wrap_training(model, opt, budget, block_bytes=16 << 10, min_swap=4096,
                                   recompute="never" if capacity and rank else "auto",
                                   process_group=True, accumulate=accumulate, max_grad_norm=clip,
                                   host_step=host, shard_steps=shard, speculate=speculate)
        broadcast, broadcasts = dist.broadcast, []

        def counted_broadcast(t, *a, **kw):
            broadcasts.append(t.numel())
            return broadcast(t, *a, **kw)
        dist.broadcast = counted_broadcast
        losses = []
        for step, ids in enumerate(batches(STEPS)):
            for micro in ids.chunk(world)[rank].chunk(accumulate):     # NOTE [accumulation]
                if shorter and rank and step == 1:
                    micro = micro[:, :-8]    # another shape on this rank alone: it traces again alone
                with train.step():
                    loss = loss_of(model, micro)
                    (loss / accumulate).backward()
                losses.append(float(loss.detach()))
        plan = str(train.plan)
        streamed = len(train.plan.streamed_blocks)
        hosted = train.host.blocks_stepped if train.host is not None else 0
        on_host = [b.index for b in train.blocks if b.host]
        in_capacity = not streamed and not train.plan.swapped_bytes and not train.plan.recompute
        report = train.report()
        speculation = dict(train.clipping.speculation) if clip is not None else {}
        refused = ""
        released = []
        if shard and shorter:
            import tiermem.training.shards as shards
            shards.GATHER_CHUNK = 4096          # the gathers' states cross in many pieces
        if shard:                   # NOTE [sharded steps]: what another rank steps is not saved from here
            try:
                opt.state_dict()
            except tiermem.TierMemError as e:
                refused = str(e)
            peers = [b for b in train.blocks if b.peer]
            released.append(all(b.home_s is None for b in peers))
            train.gather_states()
            released.append(any(b.home_s is None for b in peers))
            opt.load_state_dict(opt.state_dict())     # whole now; loaded back, then one more step
            for micro in batches(STEPS + 1)[STEPS].chunk(world)[rank].chunk(accumulate):
                with train.step():
                    loss = loss_of(model, micro)
                    (loss / accumulate).backward()
                losses.append(float(loss.detach()))
            released.append(all(b.home_s is None for b in peers))
            report = train.report()
            speculation = dict(train.clipping.speculation) if clip is not None else {}
        shared = {b.index: b.peer for b in train.blocks if b.index in train.shards.owner} if shard else {}
        state_bytes_of = {b.index: b.s_bytes for b in train.blocks if b.index in shared}
        train.unwrap()          # with shard_steps, gathers first
        dist.broadcast = broadcast
        states = {k: {n: v.clone() for n, v in st.items() if torch.is_tensor(v)}
                  for k, st in opt.state_dict()["state"].items()}
        torch.save({"params": [p.detach().clone() for p in model.parameters()], "losses": losses, "plan": plan,
                    "streamed": streamed, "in_capacity": in_capacity,
                    "reduced": sum(reduces), "blocking": len(blocking), "agreed": agreed, "hosted": hosted,
                    "on_host": on_host, "blocks": len(train.blocks), "dropped": dropped,
                    "agreements": len(agreements), "states": states, "refused": refused, "shared": shared,
                    "broadcasts": broadcasts, "report": report, "speculation": speculation, "released": released,
                    "state_bytes": state_bytes_of},
                   os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.all_reduce = all_reduce
        dist.destroy_process_group()


def _averaged_step(model, opt, ids, world: int, accumulate: int, clip: float | None, shorter: bool = False):
    """One process doing what the ranks do in one step: each rank's half of ``ids`` in
    ``accumulate`` micro-batches (the second rank's shortened by 8 tokens with ``shorter``), the
    halves' gradients summed and halved as the all-reduce of two ranks does, clipped, stepped.
    Returns the micro-batches' losses in rank order."""
    from test_train import loss_of
    grads, losses = [], []
    for r, part in enumerate(ids.chunk(world)):
        for micro in part.chunk(accumulate):
            if shorter and r:
                micro = micro[:, :-8]
            loss = loss_of(model, micro)
            (loss / accumulate).backward()
            losses.append(float(loss.detach()))
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.zero_grad(set_to_none=True)
    for p, *gs in zip(model.parameters(), *grads):
        p.grad = (gs[0] + gs[1]).div_(world)
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return losses


@pytest.mark.parametrize("accumulate, clip, wider, capacity", [(1, None, 0, False), (2, None, 0, False),
                                                               (2, 0.05, 0, False), (1, None, 3, False),
                                                               (2, 0.05, 3, False), (2, None, 0, True)])
@pytest.mark.long
def test_two_ranks_train_as_one_process_averaging_their_gradients(tmp_path, accumulate, clip, wider, capacity):
    """With ``accumulate`` each rank's half of a batch is that many micro-batches, and the
    gradients are averaged once per optimizer step, in its last micro-batch (as DDP's no_sync);
    with ``clip`` the averaged gradients are clipped to that global norm (NOTE [clipping]). With
    ``wider`` the second rank's budget is that many times larger, so its plan keeps other blocks
    resident, and with ``capacity`` it holds everything (its plan moves nothing and needs no
    hooks alone): the all-reduces still pair up (NOTE [data parallel])."""
    import torch.multiprocessing as mp
    from test_train import batches, gpt, loss_of
    world = 2
    mp.spawn(_rank, args=(world, f"file://{tmp_path / 'rendezvous'}", str(tmp_path), accumulate, clip, wider,
                          capacity),
             nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    # Every rank stepped the same averaged gradients: the replicas are bitwise the same.
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)
    assert ranks[0]["streamed"] > 0
    if capacity:
        assert ranks[1]["in_capacity"] and not ranks[0]["in_capacity"], ranks[1]["plan"]
    elif wider:
        assert ranks[1]["streamed"] < ranks[0]["streamed"], (ranks[0]["plan"], ranks[1]["plan"])
    else:
        assert ranks[0]["plan"] == ranks[1]["plan"]
    # Each parameter's gradient is reduced once per optimizer step, whatever the micro-batches.
    n = sum(p.numel() for p in gpt()[0].parameters())
    assert ranks[0]["reduced"] == ranks[1]["reduced"] == STEPS * n
    # issued with async_op, so on a GPU NCCL runs on tiermem's reduce stream beside the backward
    assert ranks[0]["blocking"] == ranks[1]["blocking"] == 0
    # One process computing each half's gradients, summing them and halving, as the all-reduce
    # does, then stepping: bitwise the ranks' run. (Float addition of two is commutative, so the
    # order gloo sums in does not matter.)
    torch.use_deterministic_algorithms(True)
    model, opt = gpt()
    whole, _ = gpt()
    whole_opt = torch.optim.AdamW(whole.parameters(), lr=1e-3)
    for step, ids in enumerate(batches(STEPS)):
        losses = _averaged_step(model, opt, ids, world, accumulate, clip)
        k = accumulate
        assert [x for r in range(world) for x in ranks[r]["losses"][step * k:(step + 1) * k]] == losses
        loss_of(whole, ids).backward()       # the whole batch at once: the same, to rounding
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(whole.parameters(), clip)
        whole_opt.step()
        whole_opt.zero_grad(set_to_none=True)
    for a, p, q in zip(ranks[0]["params"], model.parameters(), whole.parameters()):
        assert torch.equal(a, p.detach())
        assert torch.allclose(a, q.detach(), **TOL)


@pytest.mark.parametrize("accumulate, clip, wider, drop, shorter", [
    (1, None, 0, False, False), (2, 0.05, 0, False, False), (1, None, 3, False, False), (1, None, 0, True, False),
    (1, None, 0, False, True)])
@pytest.mark.long
def test_two_ranks_step_on_the_host_after_averaging(tmp_path, accumulate, clip, wider, drop, shorter):
    """NOTE [host stepping] with a process group: each block's gradients are averaged, then go
    home, and the host steps them there; the ranks agree once on the blocks the host steps (one
    all-reduce of a flag per block: with ``drop`` rank 1 chose one block fewer, and rank 0 steps
    it on its device too), and the replicas are bitwise one process's run with a fused AdamW (the
    host's twin is fused too), with clipping and accumulation as without the host. With
    ``shorter`` rank 1's second batch is shorter, so it traces and plans again alone: that plan
    keeps the blocks agreed at the first, with no collective the other rank would not join."""
    import torch.multiprocessing as mp
    from test_train import batches, gpt
    world = 2
    mp.spawn(_rank, args=(world, f"file://{tmp_path / 'rendezvous'}", str(tmp_path), accumulate, clip, wider,
                          False, True, drop, shorter),
             nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)
    for r in ranks:
        assert r["agreed"] == [r["blocks"]]          # one all-reduce, of a flag per block
    assert ranks[0]["hosted"] > 0 and ranks[0]["on_host"], ranks[0]["plan"]
    if wider:        # rank 1's budget holds more: what its plan keeps resident steps on its device
        assert set(ranks[1]["on_host"]) < set(ranks[0]["on_host"])
    else:
        assert ranks[0]["on_host"] == ranks[1]["on_host"] and ranks[1]["hosted"] > 0
    if drop:
        assert ranks[1]["dropped"] and ranks[1]["dropped"][0] not in ranks[0]["on_host"]
    assert [r["agreements"] for r in ranks] == ([1, 2] if shorter else [1, 1])
    n = sum(p.numel() for p in gpt()[0].parameters())
    assert ranks[0]["reduced"] == ranks[1]["reduced"] == STEPS * n
    assert ranks[0]["blocking"] == ranks[1]["blocking"] == 0
    torch.use_deterministic_algorithms(True)
    model, _ = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for step, ids in enumerate(batches(STEPS)):
        losses = _averaged_step(model, opt, ids, world, accumulate, clip, shorter=shorter and step == 1)
        k = accumulate
        assert [x for r in range(world) for x in ranks[r]["losses"][step * k:(step + 1) * k]] == losses
    for a, p in zip(ranks[0]["params"], model.parameters()):
        assert torch.equal(a, p.detach())


@pytest.mark.parametrize("accumulate, clip, wider, shorter, speculate", [
    (1, None, 0, False, False), (2, 0.05, 0, False, False), (1, 10.0, 0, False, True), (1, 0.87, 0, False, True),
    (1, None, 0.5, False, False), (1, None, 0, True, False)])
@pytest.mark.long
def test_two_ranks_share_the_streamed_blocks_steps(tmp_path, accumulate, clip, wider, shorter, speculate):
    """NOTE [sharded steps]: each streamed block steps on one rank, which broadcasts its stepped
    parameters; the replicas are bitwise one process's run, as without the option, with
    accumulation, clipping (speculations that stand with ``clip`` 10; with 0.87 the second step's
    clip bites, undoing its speculation, and the fourth's stands),
    unequal budgets (``wider``: only the blocks both ranks stream are shared) and a rank that
    traces again alone (``shorter``). A rank gives back the state homes of the blocks the other
    steps, so ``opt.state_dict()`` refuses until ``gather_states()``; the whole dict loads back,
    the step after it gives those homes back again, and after unwrap's gather every rank's
    optimizer states are the one process's, bitwise."""
    import torch.multiprocessing as mp
    from test_train import batches, gpt
    world = 2
    mp.spawn(_rank, args=(world, f"file://{tmp_path / 'rendezvous'}", str(tmp_path), accumulate, clip, wider,
                          False, False, False, shorter, True, speculate),
             nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)
    shared = ranks[0]["shared"]
    assert shared and set(shared) == set(ranks[1]["shared"]), ranks[0]["plan"]
    # each shared block steps on exactly one rank, and both ranks own some
    assert all(shared[i] != ranks[1]["shared"][i] for i in shared)
    assert any(shared.values()) and not all(shared.values())
    for r in ranks:
        assert "gather_states" in r["refused"]
        assert r["report"]["shared_blocks"] == len(shared)
        assert r["report"]["blocks_stepped_elsewhere"] == sum(r["shared"].values())
    if wider:       # the blocks rank 1 keeps resident are not shared
        assert len(shared) < ranks[0]["streamed"], (ranks[0]["plan"], ranks[1]["plan"])
    for r in ranks:
        assert r["released"] == [True, False, True]
    # one broadcast a shared block an update after the traced first (STEPS + 1 updates), then two
    # gathers': the states' pieces and the steps each (``shorter``: pieces of 4 KiB). A speculation
    # the clip undoes broadcasts again in the pass after it, and the step after it does not
    # speculate while the clip bites.
    undone = clip is not None and speculate and clip < 1
    if speculate:
        assert ranks[0]["speculation"] == ranks[1]["speculation"] == (
            {"committed": 2, "redone": 1} if undone else {"committed": STEPS, "redone": 0})
    pieces = sum(-(-n // 4096) if shorter else 1 for n in ranks[0]["state_bytes"].values())
    assert not shorter or pieces > 2 * len(shared)
    assert len(ranks[0]["broadcasts"]) == (STEPS + undone + 2) * len(shared) + 2 * pieces
    assert ranks[0]["broadcasts"] == ranks[1]["broadcasts"]
    n = sum(p.numel() for p in gpt()[0].parameters())
    assert ranks[0]["reduced"] == ranks[1]["reduced"] == (STEPS + 1) * n
    assert ranks[0]["blocking"] == ranks[1]["blocking"] == 0
    torch.use_deterministic_algorithms(True)
    model, opt = gpt()
    for step, ids in enumerate(batches(STEPS + 1)):
        losses = _averaged_step(model, opt, ids, world, accumulate, clip, shorter=shorter and step == 1)
        k = accumulate
        assert [x for r in range(world) for x in ranks[r]["losses"][step * k:(step + 1) * k]] == losses
    for a, p in zip(ranks[0]["params"], model.parameters()):
        assert torch.equal(a, p.detach())
    want = opt.state_dict()["state"]
    for r in ranks:
        assert set(r["states"]) == set(want)
        for k, st in want.items():
            for name, v in st.items():
                if torch.is_tensor(v):
                    assert torch.equal(r["states"][k][name].cpu(), v), (k, name)


def test_process_group_needs_torch_distributed_initialised():
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from fakes import FakeBackend
    from test_train import gpt, state_bytes

    import tiermem
    assert not dist.is_initialized()
    model, opt = gpt()
    tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
    with pytest.raises(tiermem.ConfigError, match="init_process_group"):
        tier.wrap_training(model, opt, state_bytes(model), process_group=True)
    assert getattr(model, "_tiermem_handle", None) is None
