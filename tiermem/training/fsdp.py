"""FSDP2 with each rank's shards in tiers: :func:`wrap_fsdp` after ``fully_shard``.

    for block in model.layers:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)                  # no CPUOffloadPolicy
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    fsdp = tiermem.wrap_fsdp(model, opt)
    for batch in batches:
        loss = model(batch).loss
        loss.backward()                               # each parameter steps inside backward

NOTE [FSDP2 composition]
    FSDP2 shards each parameter across the ranks; a rank keeps its shard (the padded 1-D tensor
    FSDP all-gathers from) on the device for the whole run, and the optimizer's states beside
    it. Here each shard and its optimizer states live in a pinned host home, one copy on the
    host for all ranks together, and are on the device only while FSDP needs them:

      - restore: the shard's storage is given its bytes again (``untyped_storage().resize_``,
        allocated on tiermem's H2D stream) and filled from its home on that stream; FSDP's
        copy-in stream (world size > 1) and the compute stream (world size 1, where FSDP
        copies on it) wait for the copy's end event before FSDP reads the shard. This runs
        from each group's ``unshard``, which every all-gather passes through (forward,
        backward and its prefetch, explicit prefetch lists, a recompute, the user's own), and
        ``lookahead`` groups ahead in the order the first step recorded. In backward the
        optimizer's states come with the shard.
      - evict: ``resize_(0)`` once the readers are done, the H2D stream having waited for them
        (NOTE [freed after the readers]). After forward there is nothing to write back:
        the home is the master copy.
      - step: FSDP2 runs each sharded parameter's post-accumulate-grad hooks itself right after
        its reduce-scatter (torch's ``foreach_reduce``), on its reduce-scatter stream. There
        the wrapped optimizer steps that one parameter (its own ``step()``, restricted to it,
        so the arithmetic is the optimizer's: AdamW's update of an element depends on that
        element alone), the gradient is dropped, and the shard and its states are copied home
        on tiermem's D2H stream and evicted.

    The shard stays a device tensor whose storage comes and goes, so the DTensor the optimizer
    holds keeps its device and its local tensor, and FSDP finds the restored bytes where it
    reads them. Swapping pointers instead (a host tensor in ``_local_tensor``, a new
    ``_sharded_param_data``) leaves FSDP's two cached tensors apart, or the DTensor wrapper on
    the wrong device (the study, /docs/training.md "FSDP2"). A shard whose storage is gone must
    never be read: FSDP's lazy init pads from it, so it is forced before anything is evicted;
    ``model.load_state_dict``, ``state_dict()``, clipping or any read of the parameters
    between steps goes inside :meth:`TieredFSDP.materialized` (a load outside it is refused).

    No ``CPUOffloadPolicy``: it makes the shards host tensors, which a device step cannot
    update in place, and steps the optimizer on the CPU. Every private member of FSDP this
    relies on is named in training/fsdp_internals.py, which refuses a torch that lacks one.
    Not handled: gradient clipping (a global norm is not known inside backward), gradient
    accumulation other than FSDP's own ``set_requires_gradient_sync(False)`` for the
    micro-batches that do not step (the hooks fire on every synced backward), and the
    activations, which FSDP keeps as a plain run does (torch's checkpoint composes with it).

NOTE [freed after the readers]
    torch's caching allocator hands a freed block out again to the next allocation on the
    stream it was allocated on, with no wait for other streams. So before a shard's or state's
    storage is freed, the streams that read it are recorded on it (``record_stream``): the
    allocator reuses the block only once the work queued on them so far is done, and no stream
    waits. The readers are the stream current at the free (the compute stream after forward,
    FSDP's reduce-scatter stream in a gradient's hook), tiermem's D2H stream after a step (the
    write-back home), and FSDP's own copy-in and all-gather streams, always: the compute
    stream's wait for the all-gather does not cover the copy-in's read of the shard. Recording
    the compute stream alone let a block be handed out again while the copy-in still read it,
    and the losses parted from plain FSDP2's from the first step on two H200s (bitwise equal
    again with the copy-in and all-gather streams recorded, or with CUDA_LAUNCH_BLOCKING=1). Restored
    storage is allocated on tiermem's H2D stream, whose copy is the first to touch it. Making
    the H2D stream wait for the readers instead would hold every restore behind the last
    write-back, and the link's two directions would take turns instead of overlapping.

NOTE [groups in flight]
    The allocator hands a block freed that way out again only once the streams recorded on it
    have passed the free, so while the host runs ahead of the device, every restore it queues
    finds the blocks of the groups before still pending and takes new memory: on two H200s the
    0.85B Llama's rank reserved 12.4, 13.2 and then 13.5 GB over three steps, with 9.4 GB
    allocated at the peak. So the host runs at most IN_FLIGHT groups (or ``lookahead`` + 1,
    if more) ahead: before a group's restore in forward it waits for the compute stream to
    reach the unshard of the group that many back, and in backward for that group's
    write-backs home. The same waits patched into the build before this one held the reserve
    at 12.2 GB from the first step on, at the same step time (331 against 332 ms); two groups
    ahead cost 7% of the step (bench/probes/probe_fsdp_memory.py measures it). A group's
    prefetch and its own unshard count once. The waits are the host's: the GPU's streams do
    not wait for each other more than before.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..base.limits import parse_bytes
from ..core.stream import Lane, now
from ..errors import ConfigError, TierMemError, WrapError
from ..pytorch.devmem import device_memory
from ..roles import Role
from . import fsdp_internals as fi
from .options import FSDPOptions, check_fsdp_options

if TYPE_CHECKING:
    from ..core.engine import Engine as Tier

__all__ = ["TieredFSDP", "refuse_budget_across_ranks", "wrap_fsdp"]

log = logging.getLogger("tiermem")

ALIGN = 512        # a shard's place in its group's home starts on this boundary
IN_FLIGHT = 3      # groups the host runs ahead of the device, at the least (NOTE [groups in flight])


def _aligned(n: int) -> int:
    return -(-int(n) // ALIGN) * ALIGN


@dataclasses.dataclass(eq=False)
class Shard:
    """One parameter's shard on this rank: its pinned home, and its optimizer states' home."""

    name: str
    param: Any                 # the sharded parameter, the one the optimizer holds
    fp: Any                    # its FSDPParam
    group: ShardGroup
    nbytes: int                # the padded shard's bytes, what FSDP all-gathers from
    offset: int                # in its group's home
    trainable: bool
    states: list[tuple[str, int]] = dataclasses.field(default_factory=list)   # (key, bytes) tiered
    state_home: Any = None     # a pinned block holding them back to back (ALIGN apart)
    resident: bool = True      # the shard's storage holds its bytes
    states_resident: bool = True
    home_ready: Any = None     # event: its last write-back home is done


@dataclasses.dataclass(eq=False)
class ShardGroup:
    index: int
    view: fi.Group
    shards: list[Shard]
    home: Any = None           # pinned block of the shards, back to back (ALIGN apart)
    ready: Any = None          # event: its last restore is done

    @property
    def trainable(self) -> bool:
        return any(s.trainable for s in self.shards)


class TieredFSDP:
    """Handle of a ``fully_shard`` model whose shards and optimizer states tiermem holds in
    pinned host memory (NOTE [FSDP2 composition]); made by :func:`wrap_fsdp`.

    ``budget``: bytes (or "40GiB", "50%" of the device) torch's caching allocator may hold on
    this rank's device (None: no cap): the unsharded parameters FSDP gathers, the activations,
    and the shards and states in flight; one rank only (:func:`refuse_budget_across_ranks`). ``options``: an :class:`FSDPOptions` (training/options.py,
    which documents each: ``lookahead``), or its fields as keywords.
    The handle steps the optimizer itself, each parameter inside backward: drop
    ``optimizer.step()`` from the loop (it is refused) and keep ``zero_grad()`` or not."""

    def __init__(self, tier: Tier, model: Any, optimizer: Any, budget: int | str | None = None, *,
                 options: FSDPOptions | None = None, **kwargs: Any):
        import torch
        self.torch = torch
        self.options = check_fsdp_options(budget, options, **kwargs)
        lookahead = self.options.lookahead
        if getattr(model, "_tiermem_handle", None) is not None:
            raise WrapError("this model is already adopted by tiermem; unwrap it first")
        fi.check(torch, model)
        self.tier, self.model, self.opt, self.lookahead = tier, model, optimizer, lookahead
        be = tier.backend
        self.mem = device_memory(torch, be, tier.device)
        total = be.capabilities().total_memory
        self.budget = None if budget is None else parse_bytes(budget, total=total, what="FSDP budget",
                                                               max_percent=100)
        dist = torch.distributed
        refuse_budget_across_ranks(self.budget, dist.get_world_size() if dist.is_available()
                                   and dist.is_initialized() else 1)
        views = fi.groups_of(model)         # forces FSDP's lazy init: it pads from the shards
        in_opt = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.groups: list[ShardGroup] = []
        self._shard_of: dict[int, Shard] = {}
        for v in views:
            sg = ShardGroup(len(self.groups), v, [])
            off = 0
            for name, p, fp in v.params():
                if v.offloads(fp):
                    raise ConfigError(f"{name} is sharded with CPUOffloadPolicy: tiermem holds the shards in host "
                                      "memory itself and steps them on the device; fully_shard without "
                                      "offload_policy (NOTE [FSDP2 composition])")
                data = v.shard(fp)
                if data.device.type != self.mem.device.type or (
                        data.device.type == "cuda" and data.device.index != tier.device):
                    raise ConfigError(f"{name}'s shard is on {data.device}, this tier's device is {self.mem.device}: "
                                      f"make the tier on the rank's device (tiermem.Tier(rank))")
                n = data.numel() * data.element_size()
                s = Shard(name, p, fp, sg, n, off, trainable=p.requires_grad and id(p) in in_opt)
                off += _aligned(n)
                sg.shards.append(s)
                self._shard_of[id(p)] = s
            if sg.shards:
                self.groups.append(sg)
        if not self.groups:
            raise ConfigError("this FSDP model has no sharded parameters to tier")
        missing = set(in_opt) - set(self._shard_of)
        if missing:
            raise ConfigError(f"{len(missing)} optimizer parameters are not sharded parameters of the model: "
                              "make the optimizer after fully_shard, over model.parameters()")
        self._group_of_param = in_opt
        self.h2d = Lane(be, lambda: tier.side_stream("h2d"))
        self.d2h = Lane(be, lambda: tier.side_stream("d2h"))
        self._hooks: list[Any] = []
        self._order: dict[str, list[int]] = {"fwd": [], "bwd": []}   # groups in use order, first step's
        self._recording = {"fwd": True, "bwd": True}
        self._in_backward = False
        self._behind: dict[str, list[Any]] = {"fwd": [], "bwd": []}    # NOTE [groups in flight]
        self._stepping = False
        self._materialized = False
        self.steps = 0                 # backwards that ended
        self.moved = {"h2d": 0, "d2h": 0}
        self._lease = tier.lease(self.budget, owner=f"wrap_fsdp({type(model).__name__})") if self.budget else None
        self._old_fraction: float | None = None
        try:
            self._adopt()
        except BaseException:
            self._rollback()
            raise

    # -- adoption ------------------------------------------------------------------------------------
    def _adopt(self) -> None:
        torch, be = self.torch, self.tier.backend
        self.mem.synchronize()
        parts = []
        for sg in self.groups:
            size = sum(_aligned(s.nbytes) for s in sg.shards)
            sg.home = be.host_alloc(max(size, 1), pooled=False)
            for s in sg.shards:
                if s.nbytes:
                    parts.append((sg.home.ptr + s.offset, sg.view.shard(s.fp).data_ptr(), s.nbytes))
        with torch.no_grad():
            for s in self._shards():
                if self.opt.state.get(s.param):       # states from before (a resumed optimizer)
                    self._adopt_states(s)
                    parts += self._state_parts(s, to_home=True)
        self._run(self.d2h, parts, "d2h", after=[now()])
        self.mem.synchronize()
        self._patches = [sg.view.patch_unshard(lambda sg=sg: self._before_unshard(sg)) for sg in self.groups]
        ref = weakref.ref(self)
        for sg in self.groups:
            for m in sg.view.modules:
                self._hooks.append(m.register_forward_hook(lambda *_, sg=sg: _call(ref, "_after_forward", sg)))
        self._hooks.append(self.model.register_forward_hook(lambda *_: _call(ref, "_forward_done")))
        for s in self._shards():
            if s.trainable:
                self._hooks.append(s.param.register_post_accumulate_grad_hook(
                    lambda p, s=s: _call(ref, "_grad_ready", s)))
        self._hooks.append(self.opt.register_step_pre_hook(lambda *_: _call(ref, "_user_step")))
        self._hooks.append(self.model.register_load_state_dict_pre_hook(lambda *_: _call(ref, "_loading")))
        if self.budget is not None:
            self._old_fraction = self.mem.fraction()
            self.mem.set_fraction(min(self.budget / self.tier.backend.capabilities().total_memory, 1.0))
        self.model._tiermem_handle = weakref.ref(self)
        for sg in self.groups:        # the last step: the device was synchronised above
            self._free(sg, states=True, readers=[])

    def _rollback(self) -> None:
        """Undo a failed adoption: hooks and patches off, homes given back; the shards were not
        evicted yet (that is the adoption's last step). Must not raise over the adoption's error."""
        for p in getattr(self, "_patches", []):
            p.remove()
        for h in self._hooks:
            h.remove()
        self._hooks, self._patches = [], []
        if self._old_fraction is not None:
            self.mem.set_fraction(self._old_fraction)
        self.mem.synchronize()
        self._release_homes()
        if self._lease is not None:
            self._lease.release()

    def _release_homes(self) -> None:
        for sg in self.groups:
            if sg.home is not None:
                sg.home.release()
                sg.home = None
            for s in sg.shards:
                if s.state_home is not None:
                    s.state_home.release()
                    s.state_home = None

    def _shards(self) -> Iterator[Shard]:
        for sg in self.groups:
            yield from sg.shards

    # -- states --------------------------------------------------------------------------------------
    def _local(self, t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    def _state_tensors(self, s: Shard) -> list[tuple[str, Any]]:
        """The optimizer's states of ``s`` that tiermem holds: the tensors of its local shard's
        size on the device (not "step", a scalar)."""
        st = self.opt.state.get(s.param, {})
        n = self._local(s.param.detach()).numel()
        out = []
        for k, v in st.items():
            if self.torch.is_tensor(v):
                loc = self._local(v)
                if loc.numel() == n and n and loc.device.type == self.mem.device.type:
                    out.append((k, loc))
        return out

    def _adopt_states(self, s: Shard) -> None:
        """Give the optimizer's states of ``s`` a pinned home (their bytes are copied by the caller)."""
        found = self._state_tensors(s)
        s.states = [(k, t.numel() * t.element_size()) for k, t in found]
        size = sum(_aligned(n) for _, n in s.states)
        if size:
            s.state_home = self.tier.backend.host_alloc(size, pooled=False)
        s.states_resident = True

    def _state_parts(self, s: Shard, to_home: bool) -> list[tuple[int, int, int]]:
        """Copies of ``s``'s tiered states between the device and home ((dst, src, bytes) each)."""
        if s.state_home is None:
            return []
        cur = dict(self._state_tensors(s))
        out, off = [], 0
        for k, n in s.states:
            t = cur.get(k)
            if t is None or t.numel() * t.element_size() != n:
                raise TierMemError(f"the optimizer's state {k!r} of {s.name} changed shape or went away while "
                                   "tiermem held it; load optimizer states inside fsdp.materialized()")
            home, dev = s.state_home.ptr + off, t.data_ptr()
            out.append((home, dev, n) if to_home else (dev, home, n))
            off += _aligned(n)
        return out

    def _tensors(self, s: Shard, states: bool) -> list[tuple[Any, int]]:
        """(tensor, bytes) of ``s``'s shard, and with ``states`` of its tiered states."""
        out = [(s.group.view.shard(s.fp), s.nbytes)]
        if states and s.state_home is not None:
            by = dict(self._state_tensors(s))
            out += [(by[k], n) for k, n in s.states if k in by]
        return out

    # -- moves ---------------------------------------------------------------------------------------
    def _run(self, lane: Lane, parts: list[tuple[int, int, int]], direction: str, after: list[Any]) -> Any:
        if not parts:
            return None
        _, end = lane.run(parts, after=after)
        n = sum(p[2] for p in parts)
        self.moved[direction] += n
        self.tier.accounting.on_move(Role.WEIGHT, direction, n)
        return end

    def _restore(self, sg: ShardGroup, states: bool, only: Shard | None = None) -> None:
        """Queue ``sg``'s shards (or ``only``), and with ``states`` their optimizer states, back
        from home on the H2D stream, into storage allocated on that stream (NOTE [freed after the
        readers])."""
        parts, after = [], []
        with self.mem.stream(self.h2d.stream), self.torch.no_grad():
            for s in [only] if only is not None else sg.shards:
                if not s.resident and s.nbytes:
                    st = sg.view.shard(s.fp).untyped_storage()
                    st.resize_(s.nbytes)
                    parts.append((sg.view.shard(s.fp).data_ptr(), sg.home.ptr + s.offset, s.nbytes))
                    after.append(s.home_ready)
                s.resident = True
                if states and s.trainable and not s.states_resident and s.state_home is not None:
                    for t, n in self._tensors(s, states=True)[1:]:
                        t.untyped_storage().resize_(n)
                    parts += self._state_parts(s, to_home=False)
                    after.append(s.home_ready)
                    s.states_resident = True
        end = self._run(self.h2d, parts, "h2d", after=after)
        if end is not None:
            sg.ready = end

    def _wait_ready(self, sg: ShardGroup, stream: int | None = None) -> None:
        if sg.ready is not None:
            be = self.tier.backend
            be.wait(be.current_stream() if stream is None else stream, sg.ready)

    def _free(self, sg: ShardGroup, states: bool, only: Shard | None = None, readers: list[int] | None = None) -> None:
        """Give back the storage of ``sg``'s resident shards (or of ``only``), and with ``states``
        their states', once the work queued so far on ``readers`` (default: the current stream;
        [] after a synchronisation) is done (NOTE [freed after the readers])."""
        be = self.tier.backend
        readers = [be.current_stream()] if readers is None else list(readers)
        readers += [h for h in (self.mem.handle_of(x) for x in sg.view.comm_streams()) if h is not None]
        todo = [only] if only is not None else sg.shards
        for s in todo:
            for i, (t, _) in enumerate(self._tensors(s, states)):
                if (s.resident if i == 0 else s.states_resident) and t.untyped_storage().nbytes():
                    self.mem.free_after(t, readers)
                    t.untyped_storage().resize_(0)
            s.resident = False
            if states and s.state_home is not None:
                s.states_resident = False

    # -- FSDP's calls --------------------------------------------------------------------------------
    def _before_unshard(self, sg: ShardGroup) -> None:
        """Every all-gather of ``sg`` passes here first (NOTE [FSDP2 composition])."""
        torch = self.torch
        bw = fi.in_backward(torch) or sg.view.in_backward_state()
        phase = "bwd" if bw else "fwd"
        if bw and not self._in_backward:
            self._in_backward = True
            fi.at_backward_end(torch, _bound(self, "_backward_done"))
        with_states = bw and sg.trainable and sg.view.syncs_grads()
        self._hold_back(sg, bw)
        if bw or sg.view.will_gather():
            self._restore(sg, states=with_states)
        be = self.tier.backend
        self._wait_ready(sg)
        cs = self.mem.handle_of(sg.view.copy_in_stream())
        if cs is not None:
            self._wait_ready(sg, cs)
        order = self._order[phase]
        if self._recording[phase]:
            if sg.index not in order:
                order.append(sg.index)
        elif self.lookahead and sg.index in order:
            at = order.index(sg.index)
            for i in order[at + 1: at + 1 + self.lookahead]:
                nxt = self.groups[i]
                if bw or nxt.view.will_gather():
                    self._restore(nxt, states=bw and nxt.trainable and nxt.view.syncs_grads())
        del be

    def _hold_back(self, sg: ShardGroup, bw: bool) -> None:
        """NOTE [groups in flight]: before ``sg``'s restore the host waits until the device has
        reached the group ``max(IN_FLIGHT, lookahead + 1)`` back: in forward, that group's
        unshard on the compute stream; in backward, its write-backs home."""
        be = self.tier.backend
        back = max(IN_FLIGHT, self.lookahead + 1)
        # a group's prefetch and its own unshard both pass here: it counts once, at its last
        if bw:
            self._behind["fwd"].clear()
            seen = self._behind["bwd"]
            if sg in seen:
                seen.remove(sg)
            seen.append(sg)
            while len(seen) > back:
                for s in seen.pop(0).shards:
                    if s.home_ready is not None:
                        be.synchronize(s.home_ready)
        else:
            ev = be.new_event()
            be.record(ev, be.current_stream())
            marks = self._behind["fwd"]
            marks[:] = [(g, e) for g, e in marks if g is not sg] + [(sg, ev)]
            while len(marks) > back:
                be.synchronize(marks.pop(0)[1])

    def _after_forward(self, sg: ShardGroup) -> None:
        """A module of ``sg`` ran forward: FSDP's all-gather has read the shards (the compute
        stream waited for it), and the home is the master copy, so they go at once. Not in a
        recompute inside backward: the step needs them there."""
        if fi.in_backward(self.torch) or self._materialized:
            return
        self._free(sg, states=False)

    def _forward_done(self) -> None:
        if not fi.in_backward(self.torch):
            self._recording["fwd"] = False

    def _grad_ready(self, s: Shard) -> None:
        """FSDP reduce-scattered ``s``'s gradient (its hook, on FSDP's reduce-scatter stream):
        step it, copy it and its states home, and evict them (NOTE [FSDP2 composition])."""
        if self._materialized:
            raise TierMemError("a backward inside fsdp.materialized(): run training steps outside it")
        sg = s.group
        if not s.resident or (s.state_home is not None and not s.states_resident):
            self._restore(sg, states=True, only=s)
        self._wait_ready(sg)
        self._step(s.param)
        s.param.grad = None
        if s.state_home is None:
            self._adopt_states(s)          # the optimizer made them in this step
        parts = [(sg.home.ptr + s.offset, sg.view.shard(s.fp).data_ptr(), s.nbytes)] if s.nbytes else []
        parts += self._state_parts(s, to_home=True)
        s.home_ready = self._run(self.d2h, parts, "d2h", after=[now()])
        self._free(sg, states=True, only=s, readers=[self.d2h.stream])

    def _step(self, p: Any) -> None:
        """The optimizer's own step restricted to ``p`` (NOTE [FSDP2 composition])."""
        groups = self.opt.param_groups
        gi = self._group_of_param.get(id(p))
        if gi is None or gi >= len(groups) or not any(q is p for q in groups[gi]["params"]):
            self._group_of_param = {id(q): i for i, g in enumerate(groups) for q in g["params"]}
            gi = self._group_of_param.get(id(p))
            if gi is None:
                return               # taken out of the optimizer: it steps no more
        saved = [g["params"] for g in groups]
        try:
            for i, g in enumerate(groups):
                g["params"] = [p] if i == gi else []
            self._stepping = True
            self.opt.step()
        finally:
            self._stepping = False
            for g, ps in zip(groups, saved):
                g["params"] = ps

    def _backward_done(self) -> None:
        """The backward ended (after FSDP's final callback, which fired the last groups'
        hooks): whatever is still resident (frozen parameters, ones with no gradient, a
        micro-batch with gradient sync off) goes, unchanged, with no write-back."""
        self._in_backward = False
        self._behind["bwd"].clear()
        self._recording["bwd"] = False
        self.steps += 1
        for sg in self.groups:
            self._free(sg, states=True)

    def _user_step(self) -> None:
        if not self._stepping:
            raise TierMemError("optimizer.step() was called by the caller, but wrap_fsdp steps the optimizer "
                               "itself, each parameter inside backward: drop optimizer.step() from the loop")

    def _loading(self) -> None:
        if not self._materialized:
            raise TierMemError("load the model's state inside fsdp.materialized(): outside it the shards are "
                               "in tiermem's pinned homes and FSDP's own tensors have no bytes")

    # -- between steps ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def materialized(self) -> Iterator[TieredFSDP]:
        """Every shard and optimizer state on the device inside, as FSDP keeps them alone:
        for ``state_dict()``, a load, an evaluation that reads parameters directly, or EMA. What
        is written inside (a load, say) goes home at the end, and they are evicted again."""
        if self._materialized:
            raise TierMemError("fsdp.materialized() does not nest")
        if self._in_backward:
            raise TierMemError("fsdp.materialized() is entered between steps, not inside backward")
        self.mem.synchronize()
        for sg in self.groups:
            self._restore(sg, states=True)
        self.mem.synchronize()
        self._materialized = True
        try:
            yield self
        finally:
            self._materialized = False
            self.mem.synchronize()
            parts = []
            for s in self._shards():
                if s.nbytes:
                    parts.append((s.group.home.ptr + s.offset, s.group.view.shard(s.fp).data_ptr(), s.nbytes))
                if s.state_home is None and self._state_tensors(s):
                    self._adopt_states(s)              # loaded or made inside
                parts += self._state_parts(s, to_home=True)
            self._run(self.d2h, parts, "d2h", after=[now()])
            self.mem.synchronize()
            for sg in self.groups:
                self._free(sg, states=True, readers=[])

    @property
    def pinned_bytes(self) -> int:
        """Pinned host bytes of this rank's homes: shards and optimizer states."""
        return sum(sg.home.nbytes for sg in self.groups if sg.home is not None) + sum(
            s.state_home.nbytes for s in self._shards() if s.state_home is not None)

    def resident_bytes(self) -> int:
        """Bytes of shards and states on the device now (0 between steps)."""
        n = 0
        for s in self._shards():
            n += s.nbytes if s.resident else 0
            n += sum(b for _, b in s.states) if s.states_resident else 0
        return n

    def home_of(self, p: Any) -> Any:
        """The pinned master of sharded parameter ``p``: its local shard's elements, a host tensor."""
        s = self._shard_of[id(p)]
        loc = self._local(p.detach())
        view = self.tier.backend.torch_view(s.group.home.ptr + s.offset, s.nbytes, s.group.home)
        return view.view(loc.dtype)[: loc.numel()].view(loc.shape)

    def report(self) -> dict[str, Any]:
        return {"groups": len(self.groups), "shards": sum(len(sg.shards) for sg in self.groups),
                "pinned_bytes": self.pinned_bytes, "resident_bytes": self.resident_bytes(),
                "moved_h2d_bytes": self.moved["h2d"], "moved_d2h_bytes": self.moved["d2h"],
                "steps": self.steps, "budget_bytes": self.budget}

    def unwrap(self) -> Any:
        """Every shard and state back on the device for good, hooks and wrappers off, homes
        given back; returns the model, a plain FSDP2 model again."""
        if self._in_backward:
            raise TierMemError("unwrap() between steps, not inside backward")
        self.mem.synchronize()
        for sg in self.groups:
            self._restore(sg, states=True)
        self.mem.synchronize()
        for p in self._patches:
            p.remove()
        for h in self._hooks:
            h.remove()
        self._hooks, self._patches = [], []
        if self._old_fraction is not None:
            self.mem.set_fraction(self._old_fraction)
        self._release_homes()
        if self._lease is not None:
            self._lease.release()
        self.model._tiermem_handle = None
        return self.model

    def __repr__(self) -> str:
        return (f"<TieredFSDP {type(self.model).__name__}: {len(self.groups)} groups, "
                f"{self.pinned_bytes / 1e9:.3f} GB pinned>")


def _call(ref: Any, name: str, *args: Any) -> Any:
    """Call method ``name`` of the handle ``ref`` holds weakly, if it is alive."""
    h = ref()
    return None if h is None else getattr(h, name)(*args)


def _bound(handle: TieredFSDP, name: str) -> Any:
    ref = weakref.ref(handle)
    return lambda: _call(ref, name)


def refuse_budget_across_ranks(budget: int | None, world: int) -> None:
    """ConfigError for a ``budget`` with more than one rank: on two H200s under NCCL, FSDP2 under
    wrap_fsdp with torch's allocator capped at CPU offload's reserve hung at its second step (a
    rank waited in an all-gather until the timeout; bench/multi_gpu.py --fsdp-capped), and the
    cause is not known. A hang is worse than a refusal; one rank is not affected."""
    if budget is not None and world > 1:
        raise ConfigError(f"wrap_fsdp's budget with {world} ranks is not supported: capping torch's allocator "
                          "hung FSDP2's collectives under NCCL on two GPUs (docs/training.md, FSDP2); "
                          "leave budget out (each rank's memory is then what FSDP2 needs, less the shards "
                          "and states, which tiermem keeps in pinned memory)")


def wrap_fsdp(tier: Tier, model: Any, optimizer: Any, budget: int | str | None = None, *,
              options: FSDPOptions | None = None, **kwargs: Any) -> TieredFSDP:
    """Hold the shards of a ``fully_shard`` model and its optimizer's states in pinned host
    memory, and step inside backward (see :class:`TieredFSDP`, NOTE [FSDP2 composition])."""
    return TieredFSDP(tier, model, optimizer, budget, options=options, **kwargs)
