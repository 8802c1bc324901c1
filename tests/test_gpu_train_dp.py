"""Data-parallel tiered training on two GPUs under NCCL (NOTE [data parallel] in
tiermem/training/handle.py): each rank streams its own replica under a budget and averages each block's
gradients just before the block's step; the replicas stay bitwise equal, and their losses and
parameters are bitwise those of one process on one GPU that averages the two halves' gradients
(two fp32 values summed once, as NCCL's all-reduce of two ranks does, then halved)."""
from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

STEPS = 6
WORLD = 2
WATCHDOG_S = 180


def _rank(rank: int, world: int, init: str, out: str, host: bool = False, shard: bool = False) -> None:
    import faulthandler
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    # a rank stuck in a collective prints every thread's stack and exits, and the test fails
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    import torch
    import torch.distributed as dist
    from test_gpu_train import BUDGET, _batches, _gpt, _loss, _setup

    import tiermem
    _setup()
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    try:
        model, c = _gpt()                                  # on this rank's GPU
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=host or None)
        tier = tiermem.Tier(rank, cap="1GiB")
        train = tier.wrap_training(model, opt, BUDGET, block_bytes=1 << 20, min_swap=256 << 10,
                                   process_group=True, host_step=host, shard_steps=shard)
        losses, peaks = [], []
        for ids in _batches(c, STEPS):                     # the same batches on every rank (same seed)
            with train.step():
                loss = _loss(model, ids.chunk(world)[rank])
                loss.backward()
            losses.append(float(loss.detach()))
            peaks.append(train.resident_peak())
        plan, streamed = str(train.plan), len(train.plan.streamed_blocks)
        on_host = [b.index for b in train.blocks if b.host]
        resident = [b.index for b in train.blocks if b.resident]
        hosted = train.host.blocks_stepped if train.host is not None else 0
        shared = {i: train.blocks[i].peer for i in train.shards.owner} if shard else {}
        released = all(b.home_s is None for b in train.blocks if b.peer)
        train.unwrap()                  # with shard_steps, every rank's states gathered first
        states = {k: {n: v.cpu() for n, v in st.items() if torch.is_tensor(v)}
                  for k, st in opt.state_dict()["state"].items()}
        torch.save({"params": [p.detach().cpu() for p in model.parameters()], "losses": losses,
                    "peaks": peaks, "plan": plan, "streamed": streamed, "device": torch.cuda.current_device(),
                    "on_host": on_host, "resident": resident, "hosted": hosted, "shared": shared,
                    "states": states, "released": released},
                   os.path.join(out, f"rank{rank}.pt"))
        del train
        tier.close()
    finally:
        dist.destroy_process_group()


def _one_process(fused):
    """One process on one GPU doing what the ranks do: each half's gradients, summed once and
    halved as NCCL's all-reduce of two ranks does, then AdamW (``fused`` as given). Returns the
    model and each step's two losses."""
    import torch
    from test_gpu_train import _batches, _gpt, _loss, _setup
    _setup()
    model, c = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    steps = []
    for ids in _batches(c, STEPS):
        grads, losses = [], []
        for part in ids.chunk(WORLD):
            loss = _loss(model, part)
            loss.backward()
            losses.append(float(loss.detach()))
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.zero_grad(set_to_none=True)
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = (g0 + g1).div_(WORLD)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append(losses)
    return model, steps, opt


def test_two_gpus_train_as_one_process_averaging_their_gradients(tmp_path):
    import torch
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs, this host has {torch.cuda.device_count()}")
    import torch.multiprocessing as mp
    from test_gpu_train import BUDGET
    mp.spawn(_rank, args=(WORLD, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert [r["device"] for r in ranks] == list(range(WORLD))
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)                          # the replicas stepped the same averages
    # each rank plans from its own measured times, so the plans may differ (on two H200s they
    # did): the all-reduces pair up all the same (NOTE [data parallel])
    assert all(r["streamed"] > 0 for r in ranks), [r["plan"] for r in ranks]
    assert max(max(r["peaks"]) for r in ranks) <= BUDGET
    model, steps, _ = _one_process(fused=None)
    for step, losses in enumerate(steps):
        assert [r["losses"][step] for r in ranks] == losses, step
    for a, p in zip(ranks[0]["params"], model.parameters()):
        assert torch.equal(a, p.detach().cpu())


def test_two_gpus_step_on_their_hosts_after_averaging(tmp_path):
    """host_step=True with a process group (NOTE [host stepping]): each block's gradients are
    averaged over NCCL, then go home and the host's fused AdamW steps them there; the ranks step
    the same blocks on their hosts. Where their plans keep the same blocks resident the replicas
    are bitwise equal; the losses stay within 1e-2 of one process stepping on its GPU (the CPU's
    and the GPU's fused AdamW round apart)."""
    import torch
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs, this host has {torch.cuda.device_count()}")
    import torch.multiprocessing as mp
    from test_gpu_train import BUDGET
    mp.spawn(_rank, args=(WORLD, f"file://{tmp_path / 'rendezvous'}", str(tmp_path), True), nprocs=WORLD,
             join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert all(r["hosted"] > 0 and r["on_host"] for r in ranks), [r["plan"] for r in ranks]
    assert max(max(r["peaks"]) for r in ranks) <= BUDGET
    if ranks[0]["resident"] == ranks[1]["resident"]:
        assert ranks[0]["on_host"] == ranks[1]["on_host"]
        for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
            assert torch.equal(a, b)
    _, steps, _ = _one_process(fused=True)
    for step, losses in enumerate(steps):
        got = [r["losses"][step] for r in ranks]
        assert all(abs(a - b) <= 1e-2 * abs(b) for a, b in zip(got, losses)), (step, got, losses)


def test_two_gpus_share_the_streamed_blocks_steps(tmp_path):
    """shard_steps=True (NOTE [sharded steps]): each streamed block steps on one GPU, which
    broadcasts its parameters over NCCL, and each GPU's host memory keeps the states of its own
    blocks only; the replicas, the losses and, after unwrap's gather, every rank's optimizer
    states are bitwise one process's."""
    import torch
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs, this host has {torch.cuda.device_count()}")
    import torch.multiprocessing as mp
    from test_gpu_train import BUDGET
    mp.spawn(_rank, args=(WORLD, f"file://{tmp_path / 'rendezvous'}", str(tmp_path), False, True), nprocs=WORLD,
             join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    shared = ranks[0]["shared"]
    assert shared and set(shared) == set(ranks[1]["shared"]), [r["plan"] for r in ranks]
    assert all(shared[i] != ranks[1]["shared"][i] for i in shared)       # one owner each
    assert any(shared.values()) and not all(shared.values())
    assert all(r["released"] for r in ranks)        # the other's blocks' state homes given back
    assert max(max(r["peaks"]) for r in ranks) <= BUDGET
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)
    model, steps, opt = _one_process(fused=None)
    for step, losses in enumerate(steps):
        assert [r["losses"][step] for r in ranks] == losses, step
    for a, p in zip(ranks[0]["params"], model.parameters()):
        assert torch.equal(a, p.detach().cpu())
    want = opt.state_dict()["state"]
    for r in ranks:
        for k, st in want.items():
            for name, v in st.items():
                if torch.is_tensor(v):
                    assert torch.equal(r["states"][k][name], v.cpu()), (k, name)
