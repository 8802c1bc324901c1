"""One module's layers across several GPUs, each streaming its own over its own link:
``tiermem.wrap_module(model, budget, devices=[0, 1])`` (:class:`SplitModule`).

NOTE [layers across GPUs]
    A forward streams every weight that is not resident over one GPU's link. On a host whose
    GPUs each have a link of their own, the module's groups (``module_groups``, in the order the
    module registers them) are cut into as many contiguous runs of about equal bytes as there
    are devices, and each run is adopted by a :class:`TieredModule` of its own (a
    :class:`Part`) on that device's Tier, within ``budget`` there (the budget is per GPU): its
    resident groups in that device's managed memory, its streamed ones in a pinned home of their
    own, copied over that device's link into that device's slots, or read in place by it. The
    runs partition the weights, so the host holds one copy of them in all.

    The computation moves with the weights: each group's module gets a forward pre-hook that
    brings the tensors it is given (positional and keyword, through tuples, lists and dicts;
    other objects, such as transformers' KV cache, pass as they are) to its device. A tensor is
    moved once per forward per device (the moved copy is kept until the forward ends), so the
    hidden state crosses once at each boundary, and tensors the model computes once for every
    layer (an attention mask, rotary cos/sin) once per device. The outputs go back to the device
    of the model's first input tensor, as accelerate's ``io_same_device`` does: transformers'
    ``generate`` then finds the logits where its ``input_ids`` are, and a KV cache keeps each
    layer's keys and values on that layer's device (its layers are made lazily from the first
    keys they are given). The devices' streams, events and slots are their Tiers' own; a Tier
    on a GPU other than the caller's leaves the caller's current device alone
    (``runtime.on_device``).

    A single forward runs the devices one after the other, so with ``budget`` per GPU the
    time a link-bound forward takes is about (W - n*budget) / link for n devices against
    (W - budget) / link for one (W: the weight bytes), plus what the next device's lookahead
    brings in while the one before computes.

    Tied weights: a module that owns no group and uses another's tensor (a head tied to the
    embedding, as small Llamas and Qwens ship) computes on the device of the run that holds
    the tensor, so the last hidden state crosses back to the first device for the head. A
    module that owns a group of its own and uses a tensor another run holds is refused: it
    would be read by a device that does not hold it.

NOTE [two links into one GPU]
    The devices compute in turn, so while one GPU streams its layers the others' links are idle.
    With ``relay`` (the default) each part's copies into its slots also use the next GPU's link:
    the last half of each streamed piece crosses into a staging ring of two slots on that GPU (its
    side stream "relay-in") and goes on into the slot over the GPUs' peer link (its side stream
    "relay-out"), beside the first half on the part's own link; the slot is ready once both are in
    (core/stream.py's :class:`Relay` and ``SlotRing.fill``). Two H200s of one host (NV18) landed 1
    GiB on one GPU at 101 GB/s this way against 55 over its own link, both links one way at once at
    51.5 GB/s each and the peer copy at 390 (bench/probes/probe_stripe.py, docs/facts.md). Each
    ring takes two slots of 32 MiB, or of a 32nd of the budget where that is less, from the part's
    own budget; a budget whose 32nd is under 16 KiB gets no relay. The groups are cut for the whole
    budget all the same (groups.fit_groups): a ring that cut them finer multiplied a small model's
    groups (the 0.85B Llama's 9 a part became 33 at a third of its weights, and each group costs
    the host its hooks and copies), for 6% of the budget. Where the GPUs cannot reach each other's
    memory directly (no peer access) no relay is made: the driver would stage the peer copy through
    the host. Pieces read from disk or packed (quantized streaming) cross one link as before.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING, Any

from ..base.limits import parse_bytes
from ..core.stream import Lane, Relay, SlotRing
from ..errors import ConfigError, WrapError
from ..pytorch.devmem import device_memory
from ..pytorch.held import CopyGuard
from ..roles import Role
from .groups import MAX_GROUP, fit_cap, module_groups, span_of
from .module import Part, TieredModule, check_module, check_module_options
from .options import ModuleOptions
from .sources import stand_ins

if TYPE_CHECKING:
    from ..core.engine import Engine as Tier

__all__ = ["SplitModule", "split_runs", "split_units", "unit_of"]

RELAY_SLOT = 32 << 20      # NOTE [two links into one GPU]: two of them on each GPU, at most
MIN_RELAY_SLOT = 16 << 10  # no relay for a budget whose sixteenth is less than two of these
RELAY_SHARE = 0.5          # of a piece through the relay: the links are alike


def unit_of(module: Any, name: str) -> str:
    """The part of ``module`` that group ``name`` must not be cut from: the first enclosing
    module that is an element of a ModuleList or Sequential (a layer, whose own forward adds
    its residual on the device it began on), else the group itself."""
    import torch
    parts = name.split(".") if name else []
    m = module
    for k, p in enumerate(parts):
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
            return ".".join(parts[:k + 1])
        m = getattr(m, p, None)
        if m is None:
            break
    return name


def split_units(sizes: list[tuple[str, int]], units: dict[str, str], n: int) -> list[list[str]]:
    """:func:`split_runs` over the groups' units (consecutive groups of one unit go together, so
    no run boundary falls inside a layer), the runs then given back as groups."""
    merged: list[tuple[str, int]] = []
    members: dict[str, list[str]] = {}
    for name, b in sizes:
        u = units.get(name, name)
        if merged and merged[-1][0] == u:
            merged[-1] = (u, merged[-1][1] + b)
            members[u].append(name)
        else:
            key = u if u not in members else f"{u}#{len(merged)}"     # a unit met again later
            merged.append((key, b))
            members[key] = [name]
    return [[g for key in run for g in members[key]] for run in split_runs(merged, n)]


def split_runs(sizes: list[tuple[str, int]], n: int) -> list[list[str]]:
    """``sizes`` ((group, bytes), in order) cut into ``n`` contiguous runs of about equal bytes:
    a group goes to the run its middle byte falls in. Every run gets at least one group when
    there are as many groups as runs."""
    if len(sizes) < n:
        raise ConfigError(f"{len(sizes)} groups cannot be spread over {n} devices: give fewer devices")
    total = sum(b for _, b in sizes) or 1
    at, runs = 0, [[] for _ in range(n)]
    for name, b in sizes:
        runs[min(n - 1, int((at + b / 2) * n // total))].append(name)
        at += b
    if any(not r for r in runs):            # a group larger than a device's share: cut by count
        names, at = [g for g, _ in sizes], 0
        runs = []
        for i in range(n):
            k = (len(names) - at) // (n - i)
            runs.append(names[at:at + k])
            at += k
    flat = [g for r in runs for g in r]
    if flat != [g for g, _ in sizes]:        # only ever a contiguous cut
        raise AssertionError("split_runs broke the order")
    return runs


class SplitModule:
    """Handle of a module adopted across several GPUs (NOTE [layers across GPUs]): ``parts`` (a
    :class:`TieredModule` per device, in the module's order), ``devices``, ``plans``, stats(),
    drain() and unwrap(). ``budget`` is per GPU; ``options`` (or its fields as keywords) are
    wrap_module's (:class:`ModuleOptions`) and apply to every part, ``devices`` aside (the
    tiers' devices)."""

    def __init__(self, tiers: list[Tier], module: Any, budget: int | str | None, *,
                 options: ModuleOptions | None = None, **kwargs: Any):
        import torch
        self.torch = torch
        check_module(module)
        opts = check_module_options(budget, kwargs, given=options)
        self.options = opts
        part_opts = dataclasses.replace(opts, devices=None)
        if len(tiers) < 2:
            raise ConfigError("a SplitModule spreads a module over at least two tiers (devices)")
        self.tiers = list(tiers)
        self.devices = [t.device for t in tiers]
        self.module = module
        cap = opts.max_group_bytes or MAX_GROUP
        found = module_groups(module, cap)
        if not found:
            raise WrapError("this module has no parameters or buffers to tier")
        per_gpu = None if budget is None else parse_bytes(
            budget, total=min(t.backend.capabilities().total_memory for t in tiers), what="module budget",
            max_percent=100)
        # NOTE [two links into one GPU]: a relay's ring takes at most a sixteenth of the budget
        slot = RELAY_SLOT if per_gpu is None else min(RELAY_SLOT, per_gpu // 32 // 4096 * 4096)
        n = len(tiers)
        self._relay_slot = slot if opts.relay and slot >= MIN_RELAY_SLOT and all(
            tiers[(i + 1) % n].backend.enable_peer(tiers[i].device) for i in range(n)) else 0
        relay_bytes = 2 * self._relay_slot
        part_budget = budget if per_gpu is None else per_gpu - relay_bytes   # NOTE [two links into one GPU]
        if opts.max_group_bytes is None and per_gpu is not None:
            # the groups cut for the GPU's budget as one device's are (groups.fit_groups), before
            # they are spread: a part makes its groups at the same size and finds its run's. The
            # relay's ring is left out of that fit (NOTE [two links into one GPU]).
            cap = fit_cap(found, per_gpu, opts.lookahead) or cap
            found = module_groups(module, cap)
        sizes = [(name, sum(span_of(t) for _, t in own)) for name, _, own in found]
        units = {name: unit_of(module, name) for name, _ in sizes}
        runs = split_units(sizes, units, len(tiers))
        self.run_of = {g: i for i, r in enumerate(runs) for g in r}
        users = _tied_users(module, found, self.run_of)
        swaps = stand_ins(module) if opts.weights is not None else []
        made = frozenset(id(new) for *_, new in swaps)
        self.parts: list[TieredModule] = []
        self._hooks: list[Any] = []
        self._moved: dict[tuple[int, Any], tuple[Any, Any]] = {}
        self._home_device: Any = None
        self._relays: list[tuple[Any, Any, Relay, Any]] = []    # (helper tier, its ring's block, relay, lease)
        try:
            for tier, run in zip(tiers, runs):
                self.parts.append(TieredModule(tier, module, part_budget, options=part_opts,
                                               part=Part(frozenset(run), cap, made, fit_budget=per_gpu)))
            if relay_bytes:
                self._make_relays()
            self.targets = [device_memory(torch, t.backend, t.device).device for t in tiers]
            ref = weakref.ref(self)
            # A layer cut into groups also gets the hook: its own forward keeps its input (the
            # residual) and must find it on the layer's device, not where the layer before ran.
            layers = {u: self.run_of[name] for name, u in units.items() if u != name}
            for m, run in ([(m, self.run_of[name]) for name, m, _ in found] + users
                           + [(module.get_submodule(u), run) for u, run in layers.items()]):
                dev = self.targets[run]
                self._hooks.append(m.register_forward_pre_hook(
                    lambda mod, args, kw, dev=dev: _call(ref, "_inputs", dev, args, kw), with_kwargs=True))
            self._hooks.append(module.register_forward_pre_hook(
                lambda mod, args, kw: _call(ref, "_begin", args, kw), with_kwargs=True, prepend=True))
            self._hooks.append(module.register_forward_hook(lambda mod, args, out: _call(ref, "_end", out)))
            self._hooks.append(CopyGuard(module))      # NOTE [held modules]
        except BaseException:
            for h in self._hooks:
                h.remove()
            self._drop_relays()
            for p in reversed(self.parts):
                p.unwrap()
            for owner, name, old, _ in reversed(swaps):
                owner[name] = old
            raise
        module._tiermem_handle = weakref.ref(self)

    # -- relays (NOTE [two links into one GPU]) -------------------------------------------------------
    def _make_relays(self) -> None:
        n = len(self.tiers)
        for i, part in enumerate(self.parts):
            helper = self.tiers[(i + 1) % n]
            hbe = helper.backend
            size = 2 * self._relay_slot
            # Its own lease beside the part's (NOTE [budget leases]): the part's budget was cut by it.
            lease = helper.lease(size, owner=f"relay for {type(self.module).__name__} on device {self.devices[i]}")
            try:
                helper.reserve(size, Role.FROZEN_WEIGHT)
            except BaseException:
                lease.release()
                raise
            try:
                block = hbe.device_alloc(size, pooled=False)
            except BaseException:
                helper.unreserve(size, Role.FROZEN_WEIGHT)
                lease.release()
                raise
            relay = Relay(Lane(hbe, lambda h=helper: h.side_stream("relay-in")),
                          Lane(hbe, lambda h=helper: h.side_stream("relay-out")),
                          SlotRing(block.ptr, self._relay_slot, 2))
            self._relays.append((helper, block, relay, lease))
            if not part.attach_relay(relay, RELAY_SHARE):   # nothing it streams can use it
                self._drop_relays(self._relays.pop())

    def _drop_relays(self, only: tuple[Any, Any, Relay, Any] | None = None) -> None:
        """Detach and free the relays (or ``only`` that one), once their copies are done."""
        if only is None:
            for part in self.parts:
                part.attach_relay(None, 0.0)
        for helper, block, relay, lease in [only] if only is not None else self._relays:
            hbe = helper.backend
            hbe.synchronize(relay.onward.mark())
            block.release()
            helper.unreserve(relay.ring.slot_bytes * len(relay.ring), Role.FROZEN_WEIGHT)
            lease.release()
        if only is None:
            self._relays = []

    @property
    def relayed_bytes(self) -> int:
        """Bytes the relays have carried so far (NOTE [two links into one GPU])."""
        return sum(r.moved for _, _, r, _ in self._relays)

    # -- forward hooks -------------------------------------------------------------------------------
    def _begin(self, args: tuple, kwargs: dict) -> None:
        self._moved = {}
        self._home_device = _first_device(self.torch, (args, kwargs))

    def _inputs(self, dev: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self._to(args, dev), self._to(kwargs, dev)

    def _end(self, out: Any) -> Any:
        self._moved = {}                     # the crossed copies go with the forward
        home = self._home_device
        return out if home is None else self._to(out, home, keep=False)

    def _to(self, x: Any, dev: Any, keep: bool = True) -> Any:
        torch = self.torch
        if torch.is_tensor(x):
            if x.device == dev:
                return x
            key = (id(x), dev)
            hit = self._moved.get(key)
            if hit is not None and hit[0] is x:
                return hit[1]
            y = x.to(dev, non_blocking=True)
            if keep:
                self._moved[key] = (x, y)    # x kept too: its id is not reused while the entry lives
            return y
        if isinstance(x, tuple):
            vals = [self._to(v, dev, keep) for v in x]
            return type(x)(*vals) if hasattr(x, "_fields") else tuple(vals)
        if isinstance(x, list):
            return [self._to(v, dev, keep) for v in x]
        if isinstance(x, dict):
            if type(x) is dict:
                return {k: self._to(v, dev, keep) for k, v in x.items()}
            for k in list(x.keys()):         # a ModelOutput (an OrderedDict): its own type, in place
                x[k] = self._to(x[k], dev, keep)
            return x
        return x

    # -- the parts -------------------------------------------------------------------------------------
    @property
    def plans(self) -> list[Any]:
        return [p.plan for p in self.parts]

    @property
    def budget(self) -> int:
        """The per-GPU budget each part plans for (the smallest, where a device had less room)."""
        return min(p.budget for p in self.parts)

    def stats(self) -> dict[str, Any]:
        """The parts' stats() summed (their flat keys), and ``devices``."""
        out: dict[str, Any] = {}
        for p in self.parts:
            for k, v in p.stats().items():
                if isinstance(v, (int, float)) and k != "host_budget":
                    out[k] = out.get(k, 0) + v
                else:
                    out.setdefault(k, v)
        out["devices"] = list(self.devices)
        out["relayed_bytes"] = self.relayed_bytes
        return out

    def drain(self) -> None:
        for p in self.parts:
            p.drain()

    @property
    def moved_bytes(self) -> int:
        return sum(p.moved_bytes for p in self.parts)

    def unwrap(self, device: Any = None) -> Any:
        """Every part's tensors in plain memory again (``device``: all there; default, where each
        came from), hooks off; returns the module."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._drop_relays()
        for p in reversed(self.parts):
            p.unwrap(device)
        self.parts = []
        self.module._tiermem_handle = None
        return self.module

    def __repr__(self) -> str:
        return (f"<SplitModule {type(self.module).__name__} over devices {self.devices}: "
                + "; ".join(p.plan.table(limit=0) for p in self.parts) + ">")


def _tied_users(module: Any, found: list, run_of: dict[str, int]) -> list[tuple[Any, int]]:
    """The modules outside every group that use a group's tensors (a head tied to the
    embedding, with nothing of its own), with the run they then compute in: the run of the
    tensors they use. Refused: such a module using tensors of two runs, and a module inside a
    group using a tensor another run holds (it would be read by a device that does not hold
    it)."""
    owner: dict[int, str] = {}
    for name, _, own in found:
        for _, t in own:
            owner.setdefault(id(t), name)
    inside: dict[int, str] = {}
    for name, m, _ in found:
        for sub in m.modules():
            inside.setdefault(id(sub), name)
    out = []
    for mname, m in module.named_modules():
        here = inside.get(id(m))
        runs = {run_of[g] for t in list(m._parameters.values()) + list(m._buffers.values())
                if t is not None and (g := owner.get(id(t))) is not None}
        label = mname or type(module).__name__
        if here is not None and runs - {run_of[here]}:
            raise ConfigError(f"{label} uses a tensor that goes to another device than its own (tied weights "
                              "across the cut): untie them (tie_word_embeddings=False), or run the module on one "
                              "device")
        if here is None and len(runs) > 1:
            raise ConfigError(f"{label} uses tensors that go to different devices (tied weights across the cut): "
                              "untie them, or run the module on one device")
        if here is None and runs:
            out.append((m, runs.pop()))
    return out


def _first_device(torch: Any, x: Any) -> Any:
    if torch.is_tensor(x):
        return x.device
    if isinstance(x, (tuple, list)):
        for v in x:
            d = _first_device(torch, v)
            if d is not None:
                return d
    if isinstance(x, dict):
        for v in x.values():
            d = _first_device(torch, v)
            if d is not None:
                return d
    return None


def _call(ref: Any, name: str, *args: Any) -> Any:
    h = ref()
    return None if h is None else getattr(h, name)(*args)
