"""FSDP2 with tiermem holding the shards (NOTE [FSDP2 composition] in tiermem/training/fsdp.py), on the
CPU: ``fully_shard`` runs there under gloo, so the composition is checked against plain FSDP2
stepping after backward, world size 1 in this process and world size 2 in two spawned ones, on
the fake backend (its pinned homes are host memory; the shards' storages really go and come
back, so a shard read while evicted would crash or give other losses). The NCCL run on two GPUs
is tests/test_gpu_multigpu.py."""
from __future__ import annotations

import copy
import os

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)
fsdp_mod = pytest.importorskip("torch.distributed.fsdp")
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard  # noqa: E402

STEPS = 4
CFG = dict(vocab=257, seq=32, d=64, layers=4, heads=4)     # 257 rows: the embedding and head shard unevenly


def build(mp: bool = False, frozen: bool = False, offload: bool = False):
    from tiermem.testing import GPT, GPTConfig
    torch.manual_seed(0)
    m = GPT(GPTConfig(**CFG))
    if frozen:
        m.blocks[1].requires_grad_(False)
    kw = {}
    if mp:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for b in m.blocks:
        fully_shard(b, **kw)
    fully_shard(m, **kw)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    return m, opt


def batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG["vocab"], (4, CFG["seq"] + 1), generator=g) for _ in range(n)]


def loss_of(model, ids):
    import torch.nn.functional as F
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def evicted(model) -> bool:
    """Every sharded parameter's storage has no bytes (FSDP's own tensors are empty)."""
    return all(p.to_local().untyped_storage().nbytes() == 0 for p in model.parameters())


def run_pair(rank: int, world: int, mp: bool = False, frozen: bool = False, lookahead: int = 2,
             accumulate: int = 1) -> dict:
    """Plain FSDP2 (stepping after backward) and FSDP2 under wrap_fsdp on the same batches;
    returns both runs' losses and parameters and what the tiered run held between steps."""
    from fakes import FakeBackend

    import tiermem
    a, opt_a = build(mp, frozen)
    b, opt_b = build(mp, frozen)
    tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
    fsdp = tier.wrap_fsdp(a, opt_a, lookahead=lookahead)
    out = {"tiered": [], "plain": [], "evicted": [], "resident": []}
    for ids in batches(STEPS):
        micro = ids.chunk(world)[rank].chunk(accumulate)
        for model, opt, key in ((a, None, "tiered"), (b, opt_b, "plain")):
            for i, x in enumerate(micro):
                model.set_requires_gradient_sync(i == len(micro) - 1)      # FSDP's own accumulation
                loss = loss_of(model, x)
                (loss / accumulate).backward()
                out[key].append(float(loss.detach()))
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
        out["evicted"].append(evicted(a))
        out["resident"].append(fsdp.resident_bytes())
    out["pinned"] = fsdp.pinned_bytes
    out["homes"] = [fsdp.home_of(p).clone() for p in a.parameters()]
    fsdp.unwrap()
    out["params_tiered"] = [p.to_local().detach().clone() for p in a.parameters()]
    out["params_plain"] = [p.to_local().detach().clone() for p in b.parameters()]
    out["state_bytes"] = sum(p.to_local().numel() * p.to_local().element_size() * (3 if p.requires_grad else 1)
                             for p in a.parameters())
    return out


def check_pair(out: dict) -> None:
    assert out["tiered"] == out["plain"]                  # bitwise, every micro-batch
    for x, y, h in zip(out["params_tiered"], out["params_plain"], out["homes"]):
        assert torch.equal(x, y)
        assert torch.equal(h, y)                          # the pinned home is the master copy
    assert all(out["evicted"]) and not any(out["resident"])


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mp, lookahead", [(False, 2), (True, 0)])
@pytest.mark.long
def test_one_rank_trains_as_plain_fsdp2(one_rank, mp, lookahead):
    """At world size 1 FSDP copies each shard into its unsharded parameter on the compute
    stream; the pinned homes hold the parameters and AdamW's two moments, nothing more."""
    out = run_pair(0, 1, mp=mp, lookahead=lookahead)
    check_pair(out)
    assert out["pinned"] <= 1.02 * out["state_bytes"] + 512 * 200


def _rank(rank: int, world: int, init: str, path: str, mp: bool, frozen: bool, accumulate: int) -> None:
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.save(run_pair(rank, world, mp=mp, frozen=frozen, accumulate=accumulate),
                   os.path.join(path, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mp, frozen, accumulate", [(False, False, 1), (True, True, 2)])
@pytest.mark.long
def test_two_ranks_train_as_plain_fsdp2(tmp_path, mp, frozen, accumulate):
    """Two gloo ranks, each holding half of every parameter (rank 1's embedding and head shards
    padded): bitwise the losses and parameters of plain FSDP2 on both ranks, with bf16
    all-gathers, a frozen block (gathered, never stepped), and FSDP's own accumulation
    (gradient sync off in the first micro-batch: the hooks fire in the second only). The two
    ranks' homes together are one copy of the training state."""
    import torch.multiprocessing as tmp
    world = 2
    tmp.spawn(_rank, args=(world, f"file://{tmp_path / 'rendezvous'}", str(tmp_path), mp, frozen, accumulate),
              nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for out in ranks:
        check_pair(out)
    one_copy = sum(r["state_bytes"] for r in ranks)
    assert sum(r["pinned"] for r in ranks) <= 1.05 * one_copy + 512 * 400


def test_refusals(one_rank):
    """What the composition cannot take is refused before anything changes, with the reason."""
    from fakes import FakeBackend

    import tiermem
    from tiermem.testing import GPT, GPTConfig
    tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
    m, opt = build(offload=True)
    with pytest.raises(tiermem.ConfigError, match="CPUOffloadPolicy"):
        tier.wrap_fsdp(m, opt)
    assert getattr(m, "_tiermem_handle", None) is None
    plain = GPT(GPTConfig(**CFG))
    with pytest.raises(tiermem.ConfigError, match="fully_shard"):
        tier.wrap_fsdp(plain, torch.optim.AdamW(plain.parameters()))
    m, opt = build()
    with pytest.raises(tiermem.ConfigError, match="optimizer parameters"):
        tier.wrap_fsdp(m, torch.optim.AdamW(list(m.parameters()) + [torch.nn.Parameter(torch.zeros(2))]))
    with pytest.raises(tiermem.ConfigError, match="lookahead"):
        tier.wrap_fsdp(m, opt, lookahead=-1)
    assert not evicted(m)                    # nothing was taken
    loss_of(m, batches(1)[0]).backward()     # and it trains as plain FSDP2
    opt.step()


def test_options_are_checked_before_the_gpu():
    """wrap_fsdp's options (tiermem.handles.FSDPOptions) and budget are checked before the
    default Tier, which needs a GPU, is made; keywords change the fields of ``options``."""
    import tiermem
    from tiermem.handles import FSDPOptions
    for kwargs, error, message in [
            (dict(lookahead=-1), tiermem.ConfigError, "lookahead must be at least 0"),
            (dict(lookahead=1.5), tiermem.errors.ConfigTypeError, "lookahead must be an int"),
            (dict(lookahed=1), tiermem.errors.ConfigTypeError, "did you mean 'lookahead'"),
            (dict(budget="lots"), tiermem.ConfigError, "FSDP budget='lots' is not a size"),
            (dict(budget=0), tiermem.ConfigError, "FSDP budget must be more than 0"),
            (dict(options=3), tiermem.errors.ConfigTypeError, "options must be a tiermem.handles.FSDPOptions")]:
        with pytest.raises(error, match=message):
            tiermem.wrap_fsdp(None, None, **kwargs)
    assert tiermem.base.default.peek() is None
    assert FSDPOptions.of(FSDPOptions(lookahead=0)) == FSDPOptions(lookahead=0)
    assert FSDPOptions.of(FSDPOptions(lookahead=0), lookahead=3).lookahead == 3


def test_a_budget_with_more_than_one_rank_is_refused(one_rank):
    """A budget caps torch's allocator, which hung FSDP2's collectives under NCCL on two H200s:
    refused with more than one rank, before anything is adopted; one rank keeps it."""
    from fakes import FakeBackend

    import tiermem
    from tiermem.training.fsdp import refuse_budget_across_ranks
    refuse_budget_across_ranks(None, 2)
    refuse_budget_across_ranks(1 << 30, 1)
    with pytest.raises(tiermem.ConfigError, match="budget with 2 ranks is not supported"):
        refuse_budget_across_ranks(1 << 30, 2)
    tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
    m, opt = build()
    fsdp = tier.wrap_fsdp(m, opt, "512MiB")           # world size 1: the budget is taken
    assert fsdp.budget == 512 << 20
    fsdp.unwrap()


def test_a_torch_without_what_it_builds_on_is_refused(one_rank, monkeypatch):
    from fakes import FakeBackend
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    import tiermem
    tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
    m, opt = build()
    monkeypatch.delattr(FSDPParamGroup, "is_unsharded")
    with pytest.raises(tiermem.ConfigError, match="FSDPParamGroup.is_unsharded"):
        tier.wrap_fsdp(m, opt)
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    with pytest.raises(tiermem.ConfigError, match="torch >= 2.11"):
        tier.wrap_fsdp(m, opt)


def test_steps_loads_and_unwrap(one_rank):
    """The handle steps the optimizer itself (a caller's step is refused); a model load goes
    inside materialized(), whose writes go home; unwrap gives a plain FSDP2 model that trains on
    as the tiered one would have."""
    from fakes import FakeBackend

    import tiermem
    tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
    a, opt_a = build()
    b, opt_b = build()
    fsdp = tier.wrap_fsdp(a, opt_a)
    bs = batches(3)
    loss_of(a, bs[0]).backward()
    with pytest.raises(tiermem.TierMemError, match="optimizer.step"):
        opt_a.step()
    with pytest.raises(tiermem.TierMemError, match="materialized"):
        a.load_state_dict(b.state_dict())
    assert evicted(a)
    with fsdp.materialized():
        assert not evicted(a)
        a.load_state_dict(b.state_dict())      # b never stepped: a's first step is undone
        sd = copy.deepcopy(opt_a.state_dict())   # its own tensors: a's go when they are evicted
    assert evicted(a)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(fsdp.home_of(p), q.to_local())
    # the moments a's first step made stay: b gets them too, then both train alike
    opt_b.load_state_dict(sd)
    for ids in bs[1:]:
        la = loss_of(a, ids)
        la.backward()
        lb = loss_of(b, ids)
        lb.backward()
        opt_b.step()
        opt_b.zero_grad()
        assert float(la.detach()) == float(lb.detach())
    fsdp.unwrap()
    assert getattr(a, "_tiermem_handle", None) is None
    loss_of(a, bs[0]).backward()
    opt_a.step()                                # a plain FSDP2 model again
    loss_of(b, bs[0]).backward()
    opt_b.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p.to_local(), q.to_local())


@pytest.mark.parametrize("lookahead", [0, 2, 4])
def test_the_host_runs_a_bounded_number_of_groups_ahead(one_rank, lookahead):
    """NOTE [groups in flight]: before a group's restore the host waits for the device to reach
    the group max(IN_FLIGHT, lookahead + 1) back: in forward the compute stream's mark at that
    group's unshard, in backward that group's write-backs home on the D2H stream. The losses stay
    plain FSDP2's (the other tests of this file run with the waits in place)."""
    from fakes import FakeBackend

    import tiermem
    from tiermem.training.fsdp import IN_FLIGHT

    class Spy(FakeBackend):
        def synchronize(self, event):
            waited.append(event.stream)
            super().synchronize(event)
    waited: list = []
    tier = tiermem.Tier(backend=Spy(total=1 << 30, foreign_host=True))
    a, opt_a = build()
    b, opt_b = build()
    fsdp = tier.wrap_fsdp(a, opt_a, lookahead=lookahead)
    groups = len(fsdp.groups)
    back = max(IN_FLIGHT, lookahead + 1)
    d2h = tier.side_stream("d2h")
    for i, ids in enumerate(batches(2)):
        waited.clear()
        loss = loss_of(a, ids)
        fwd = list(waited)
        loss.backward()
        bwd = waited[len(fwd):]
        want = loss_of(b, ids)
        want.backward()
        opt_b.step()
        opt_b.zero_grad(set_to_none=True)
        assert float(loss.detach()) == float(want.detach())
        assert fwd == [tier.backend.current_stream()] * max(0, groups - back)
        if i:        # the write-backs of the groups that many back (a first backward has none yet)
            assert set(bwd) <= {d2h} and (len(bwd) > 0) == (groups > back), (bwd, groups, back)
    fsdp.unwrap()
