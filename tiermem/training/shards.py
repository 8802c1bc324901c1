"""Streamed blocks' optimizer steps shared out over a data-parallel group (NOTE [sharded steps]);
``wrap_training(process_group=..., shard_steps=True)``.

NOTE [sharded steps]
    Under data parallel (NOTE [data parallel] in training/handle.py) every rank steps every
    block. A streamed block's fp32 masters and both AdamW moments then cross each rank's link in
    and out every step: 16 bytes a parameter in, 12 out. The ranks of one host share its memory,
    and two H200s copying both ways at once got 64-76 GB/s each against 86-101 for one alone
    (docs/facts.md), so two ranks scaled about as far as their links (1.3-1.6x).

    With ``shard_steps=True`` each shared block steps on one rank, its owner. After the average,
    the owner steps the block in its slot as before and broadcasts the stepped parameters over
    the group (NVLink between the GPUs of one host). Every other rank takes them into its slot in
    place of a step and writes them home. So a rank moves a block's states only where it owns
    the block, about 1/world of them; the parameters still come in twice and go home once on
    every rank. As ZeRO stage 1 does, this shares out the optimizer's work, its traffic and its
    states' host memory: a rank gives back the state homes of the blocks it does not own
    (:meth:`ShardedSteps.drop`), so a host of N ranks holds N copies of the parameters and one of
    the states, not N of both.

    Which blocks: those every rank streams, agreed once, at the first plan, with one all-reduce of
    a flag per block (MIN), as host stepping agrees (NOTE [host stepping]). Host-stepped blocks
    are not shared. Owners are dealt by gradient bytes, largest first, each to the rank with the
    fewest so far (ties to the lower rank), so every rank computes the same deal with no more
    collectives. From then on the plans keep the shared blocks streamed: a later trace is one
    rank's own, and must not change which blocks broadcast (``can_reside`` in training/plan.py).
    The plans count a rank's state bytes for its own blocks only.

    What it keeps:
    - The owner's step is the step every rank took before, so the replicas stay bitwise equal,
      and the losses are bitwise those of data parallel without the option
      (tests/test_train_dp.py).
    - With clipping, the pass after backward (NOTE [clipping]) broadcasts in its own order, and a
      speculative step (NOTE [speculative clipping]) writes the broadcast to the second home.
    - The caller's ``opt.state`` lacks the states of the blocks another rank steps. So
      ``opt.state_dict()`` refuses until ``train.gather_states()`` has brought every block's
      states from its owner into a home again, until the next step gives them back. The gather
      is collective: every rank calls it. ``unwrap()`` gathers first, so it is collective too.
      A load (``opt.load_state_dict``) takes the dict as it is; the next step gives back what it
      placed for the blocks this rank does not own.
    - A load that starts a block's states afresh leaves the block without states on every rank.
      Its next step then runs on every rank, which makes them, and the broadcast follows as before.

    Not with ``state_dtype``: the stochastic rounding's generator would advance on the owners
    only, so the replicas' later rounding would differ from data parallel without the option.
"""
from __future__ import annotations

from typing import Any

from ..errors import TierMemError
from .options import on_every_rank
from .slots import Block, BlockSlots

__all__ = ["ShardedSteps", "GATHER_CHUNK"]

GATHER_CHUNK = 64 << 20      # bytes of states a gather broadcasts at once, at most


class ShardedSteps:
    """Which rank steps each shared streamed block, and the broadcasts that carry its stepped
    parameters (and, when gathered, its states) to the others (NOTE [sharded steps])."""

    def __init__(self, torch: Any, group: Any, stream: BlockSlots, device: Any):
        import torch.distributed as dist
        self.torch, self.group, self.stream, self.device = torch, group, stream, device
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.owner: dict[int, int] = {}     # shared block's index -> the group rank that steps it
        self.agreed = False
        self.stale = False                  # this rank lacks states another steps, or holds them stale

    def agree(self, blocks: list[Block]) -> frozenset[int]:
        """Once, at the first plan: the blocks every rank streams (not on the host) are shared,
        and dealt out. Returns their indices."""
        if self.agreed:
            return frozenset(self.owner)
        ok = on_every_rank(self.torch, [not b.resident and not b.host and bool(b.trainable) for b in blocks],
                           self.group, self.device)
        shared = [b for b, yes in zip(blocks, ok) if yes]
        load = [0] * self.world
        for b in sorted(shared, key=lambda b: (-b.g_bytes, b.index)):
            r = min(range(self.world), key=lambda r: (load[r], r))
            self.owner[b.index] = r
            load[r] += b.g_bytes
        for b in blocks:
            b.peer = self.owner.get(b.index, self.rank) != self.rank
        self.agreed = True
        return frozenset(self.owner)

    def shares(self, b: Block) -> bool:
        return b.index in self.owner

    def broadcast(self, b: Block) -> None:
        """``b``'s parameters in its slot, from its owner to every rank, on the current stream:
        the owner's just stepped, the others' overwritten with them."""
        import torch.distributed as dist
        region = self.stream.param_region(b.slot, b)
        src = dist.get_global_rank(self.group, self.owner[b.index])
        dist.broadcast(region, src=src, group=self.group, async_op=True).wait()

    def drop(self, blocks: list[Block], opt: Any) -> None:
        """Give back the state homes of the blocks another rank steps (NOTE [sharded steps]): the
        optimizer's tensors of them go too ("step" stays), the layout stays for a gather."""
        be = self.stream.tier.backend
        for b in blocks:
            if not b.peer:
                continue
            had = b.home_s is not None
            for p, key, _ in b.states:          # bound to the home, or placed by a load
                had = opt.state[p].pop(key, None) is not None or had
            if b.home_s is not None:
                if b.home_ready is not None:
                    be.synchronize(b.home_ready)      # no copy home is still writing there
                self.stream.forget_views(b)
                b.home_s.release()
                b.home_s, b.home_state_views = None, []
            self.stale = self.stale or had

    def check_state_dict(self) -> None:
        if self.stale:
            raise TierMemError(
                "the optimizer's states of the streamed blocks are stepped on one rank each (shard_steps=True, "
                "NOTE [sharded steps]), and this rank lacks those the others step. Call train.gather_states() "
                "on every rank first, then opt.state_dict()")

    def gather(self, blocks: list[Block], opt: Any) -> None:
        """Every shared block's states, and the optimizer's ``step`` of its parameters, from its
        owner into every rank's home (collective: every rank calls it, between steps)."""
        import torch.distributed as dist
        torch = self.torch
        shared = [blocks[i] for i in sorted(self.owner)]
        if not shared:
            return
        # The states pass through the slots' memory, idle between steps: no allocation under the
        # budget's cap. Every rank cuts them alike, at the smallest ring's size.
        ring = self.stream.slot_mem
        sizes = torch.tensor([b.s_bytes for b in shared] + [0 if ring is None else ring.numel()],
                             dtype=torch.int64, device=self.device)
        lo, hi = sizes.clone(), sizes.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.group)
        if not torch.equal(lo[:-1], hi[:-1]):
            bad = [b.name for b, a, z in zip(shared, lo.tolist(), hi.tolist()) if a != z]
            raise TierMemError(f"the ranks hold optimizer states of different sizes for {', '.join(bad[:3])}: "
                               "did they load different state dicts? (NOTE [sharded steps])")
        chunk = min(GATHER_CHUNK, int(lo[-1]))
        if chunk <= 0:
            raise TierMemError("a rank has no slots to gather through, though it streams the shared blocks: a "
                               "tiermem bug, please report it")
        be = self.stream.tier.backend
        buf = ring[:chunk]
        for b in shared:
            src = dist.get_global_rank(self.group, self.owner[b.index])
            mine = not b.peer
            if not mine and b.home_s is None:       # given back by drop(): a home again until the next step
                b.home_s = be.host_alloc(b.s_bytes, pooled=False)
                b.home_state_views = self.stream.views(b.home_s.ptr, b, b.home_s, "s")
            for off in range(0, b.s_bytes, buf.numel()):
                n = min(buf.numel(), b.s_bytes - off)
                home = be.host_view(b.home_s.ptr + off, n, b.home_s)
                if mine:
                    buf[:n].copy_(home)
                dist.broadcast(buf[:n], src=src, group=self.group)
                if not mine:
                    home.copy_(buf[:n])
            steps = torch.tensor([_step_of(opt, p) for p in b.trainable], dtype=torch.float64, device=self.device)
            dist.broadcast(steps, src=src, group=self.group)
            if not mine:
                for p, v in zip(b.trainable, steps.tolist()):
                    _set_step(torch, opt, p, v)
                self.stream.bind_states(b, b.home_state_views)
        self.stale = False


def _step_of(opt: Any, p: Any) -> float:
    s = opt.state.get(p, {}).get("step")
    return -1.0 if s is None else float(s)


def _set_step(torch: Any, opt: Any, p: Any, v: float) -> None:
    if v < 0:
        return
    st = opt.state[p]
    s = st.get("step")
    if torch.is_tensor(s):
        s.fill_(v)
    else:
        st["step"] = v if s is None or isinstance(s, float) else type(s)(v)
