"""The engine: allocation, advice, the device budget, prefetch and eviction.

An :class:`Engine` owns one device's tiered memory; :class:`tiermem.Tier` (in _tier.py) is the
engine with the adapters' entry points (wrap, wrap_module, wrap_training, the CuPy allocator)
on top, so that this layer imports none of them (tests/test_layers.py). It talks to CUDA only
through its backend (``_backend.CudaBackend`` on a GPU, a fake one in the CPU tests), so all of
its policy, budget and accounting logic runs without a GPU.

NOTE [eviction paths]
    Measured on the H100 machine (bench/results/probe_paths*.json), for 1 GiB:
      - Unified Memory's own write-back (prefetch to the host): ~10 GB/s.
      - copy to a pinned shadow + discard of the managed range: the copy runs at ~52 GB/s (out of
        managed memory, however its pages were populated or advised; cudaMalloc memory gives 55),
        and the discard then costs ~3.7 ms/GiB of the host's time in the driver: ~44 GB/s in all,
        0.79-0.80 of the link (bench/results/probe_managed_read-*.json, probe_release-*.json).
        Discarding each 64 MiB chunk right after its copy ran at ~52 GB/s but lost data now and
        then (NOTE [discard fence] in cuda/backend.py). Discarding a piece on another stream while
        later pieces are still being copied gains nothing: the discard call waits for all work
        on the device, on every stream, before it does its own (probe_discard_overlap-*.json,
        probe_discard_cost-*.json). So all of a call's copies go first, then one discard; and
        under a budget there is no discard at all (NOTE [parked pages]): ~52 GB/s.
      - a clean buffer whose shadow is still valid: discard only, nothing over the link.
      - a read-mostly duplicate with the host as preferred location: unset read-mostly collapses
        the copies onto the host, ~1 ms/GiB and nothing over the link.
    Which path a buffer takes is decided per buffer in :meth:`Tier._evict_path`; the shadow paths
    need NOTE [views and the fast paths] (in core/tensor.py) to hold, a buffer that owns whole 2 MiB
    pages, and no read-mostly advice.

NOTE [parked pages]
    The discard is a quarter of a dirty eviction's time (3.7 of ~24 ms per GiB), and giving pages
    back makes the next refill pay again for fresh ones (discard-and-prefetch, ~2 ms/GiB). Under
    a budget those pages are tiermem's to hold anyway: the budget counts device memory tiermem
    keeps, not bytes of live data. So a shadow eviction under a budget *parks* the buffer: its data
    is in the shadow as before, but its managed range keeps its device pages, still counted in
    ``resident_bytes`` (and in ``parked_bytes``). A dirty eviction is then the copy alone, a clean
    one is nothing at all, and a refill reuses parked pages, copying the shadow in without a
    discard: its own pages if it still has them, else another parked buffer's of the same span.
    Then the two buffers trade ranges (``Block`` objects, with their ownership): the incoming one
    takes the pages and the parked one takes the incoming one's empty range. Its bound tensors
    follow the move (``_rebind``). That is only safe for buffers that nothing else refers to, and
    the shadow paths already require that (NOTE [views and the fast paths]); a buffer with a live
    foreign view never moves, so ``data_ptr`` is stable while anyone holds a view.
    Parked pages go back to the driver (a fenced discard) when the budget needs room for anything
    else, on :meth:`Tier.trim`, on ``evict(..., release=True)``, and at ``close()``. Without a
    budget nothing parks: an eviction gives its pages back at once, as before.
    Small buffers (under 2 MiB, sharing pages with others) park too, since parking discards
    nothing: a group's small members then move by copy like the large ones. Before they parked they
    went through Unified Memory's write-back and came back by migration, ~0.4% of a layer's bytes
    that cost ~4% of its time each way (bench/results/bandwidth-*.json, 0.90 against 0.94 for one
    1 GiB tensor). Their pages cannot be discarded, so giving them back moves them to the host,
    stale contents and all, and a refill without pages migrates them in before the copy.

NOTE [failed moves]
    Any CUDA call can fail, and Ctrl-C can arrive during any of them (tests/test_faults.py fails
    each call of each operation in turn). A move that fails leaves every buffer as it found it,
    with the budget's books matching, until the one call that destroys data: the discard of
    managed pages whose data has been copied to the shadows. ``_move_in`` and ``_move_out``
    snapshot the state of the buffers they move (``_MOVE_STATE``) and put it back when anything
    before that discard fails, counters included (``_roll_back``); tensors tiermem bound follow
    the data back. That is safe because until the discard the managed range still holds the
    data (a refill never writes a shadow, an eviction's copies only write shadows), and because
    between two backend calls every counter agrees with every buffer's state. Shadows a failed
    eviction allocated stay with their buffers (counted, and marked stale): the next eviction
    uses them. A failure of the discard itself, or after it, leaves the eviction done: the
    discard may have dropped the pages (a Ctrl-C can land just as it returns), and the data is
    in the shadows, whose copies the stream runs before the discard. The error is raised as it
    came: tiermem's CUDAError with the call and the CUDA error's name, or the KeyboardInterrupt.
"""
from __future__ import annotations

import collections
import functools
import itertools
import logging
import math
import numbers
import operator
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..base import dtypes as _dtypes
from ..base.limits import budget_setting, cap_setting, parse_bytes, resolve_budget
from ..cuda.backend import PAGE, Backend, Block, round_request
from ..cuda.staging import Staging, ring_slot
from ..errors import ConfigError, ConfigTypeError, OutOfBudgetError, RoleError
from ..roles import (
    DEFAULT_POLICIES,
    Advice,
    Evict,
    Location,
    Policy,
    PolicyTable,
    Prefetch,
    Role,
    advice_plan,
    as_location,
    as_role,
    check_policy,
)
from .leases import BudgetLease, Leases
from .report import summary
from .stats import Accounting
from .stream import Lane, now
from .tensor import Buffer, TieredTensor, tiered_list
from .transfer import Transfer

__all__ = ["Engine", "check_empty"]

log = logging.getLogger("tiermem")

# Moves of managed ranges go on one stream per direction: refills (prefetch, fresh pages, copies
# in from a shadow) on UM_STREAMS["h2d"], evictions (write-back, copies out, giving parked pages
# back) on UM_STREAMS["d2h"]. Direct moves that touch managed memory never overlapped across
# directions on the H100 (bench/results/probe_paths2-*.json: 47-53 GB/s for both together), but
# through the staging rings the link copies touch only pinned memory and cudaMalloc slots, and
# the two directions together ran at 92 GB/s (NOTE [staging ring] in cuda/staging.py). A move waits
# for the other direction where it must: a buffer's earlier move (``_begin``), and the eviction
# of a parked buffer whose pages a refill takes (``_move_in``). Every discard drains both
# streams first (``_quiesce``; NOTE [discard fence] in cuda/backend.py). Pinned copies (wrap_module's
# and wrap_training's slots) have streams of their own, "h2d" and "d2h".
UM_STREAMS = {"h2d": "um_h2d", "d2h": "um_d2h"}

# What a move changes in a buffer, put back when it fails (NOTE [failed moves]).
_MOVE_STATE = ("block", "ptr", "where", "shadow_valid", "in_shadow", "parked", "host_valid")


@functools.lru_cache(maxsize=256)
def _plan(policy: Policy) -> tuple:
    """``advice_plan`` as a tuple, cached: trading pages compares plans per buffer, on the host
    time before a refill's first copy."""
    return tuple(advice_plan(policy))


def _dim(n: Any) -> int:
    # An int, or a NumPy or torch integer (operator.index); not a float or a string, which int() takes.
    if isinstance(n, bool):
        raise TypeError(n)
    return operator.index(n)


def check_empty(shape: int | Iterable[int], dtype: Any, role: Role | str, policy: Policy | None = None,
                policy_changes: Mapping[str, Any] | None = None) -> tuple[tuple[int, ...], str]:
    """(shape, dtype name) of :meth:`Tier.empty`'s arguments, once they are all known to be usable.
    Needs no Tier, so tiermem.empty calls it before it looks for a GPU."""
    check_policy(role, policy, policy_changes)
    try:
        shape_t = (_dim(shape),) if not isinstance(shape, Iterable) else tuple(_dim(s) for s in shape)
    except TypeError:
        raise ConfigTypeError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    if any(s < 0 for s in shape_t):
        raise ConfigError(f"shape must not be negative, got {shape_t}")
    return shape_t, _dtypes.canonical(dtype)


GROUP_ALIGN = 64 << 10   # members of a group start on 64 KiB boundaries: no page is shared


def member_span(nbytes: int) -> tuple[int, int]:
    """(span, alignment) of a group member: members of 2 MiB or more take whole 2 MiB pages, so
    each can be discarded on its own (``Buffer.owns_pages``); smaller ones take 64 KiB."""
    from ..cuda.backend import LARGE
    step = LARGE if nbytes >= LARGE else GROUP_ALIGN
    return -(-max(int(nbytes), 1) // step) * step, step


def coalesce(ranges: Iterable[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """(alloc, ptr, nbytes) ranges, sorted, with ranges that touch inside one allocation merged.
    A group's members are adjacent slices of one allocation, so a whole group moves in one call
    (large calls run at link rate); a range spanning two allocations is refused by CUDA."""
    out: list[list[int]] = []
    for a, p, n in sorted(ranges, key=lambda r: (r[1], r[0])):
        if out and out[-1][0] == a and p == out[-1][1] + out[-1][2]:
            out[-1][2] += n
        else:
            out.append([a, p, n])
    return [(p, n) for _, p, n in out]


class _SharedBlock:
    """Owns the one allocation a group's buffers are slices of; gives it back when the last goes."""

    __slots__ = ("block",)

    def __init__(self, block: Any):
        self.block = block

    def __del__(self) -> None:
        try:
            self.block.release()
        except Exception:  # pragma: no cover - destructors log, never raise
            log.exception("tiermem: error while freeing a group")


class Engine:
    """Tiered memory on one device: managed buffers, their roles' policies, and a device budget.

    ``budget`` caps the bytes tiermem keeps resident on the device (bytes, "8GiB" or "25%" of the
    device; None: no budget; default from TIERMEM_BUDGET). ``cap`` and ``allow_oversubscribe`` set
    the cap on managed memory (NOTE [managed cap] in base/limits.py). ``staging`` sizes the rings of
    device memory that shadow copies go through at the link's full rate, one per direction (NOTE
    [staging ring] in cuda/staging.py): "auto" (64 MiB each, kept out of budgets under 1 GiB), a size
    per ring (always on), or "off". Under a budget the rings count against it. ``backend``
    replaces the CUDA backend (tests). All methods are thread-safe.
    """

    def __init__(self, device: int | None = None, *, budget: int | str | None = None,
                 cap: int | str | None = None, allow_oversubscribe: bool | None = None,
                 policies: Mapping[Role, Policy] | None = None, backend: Backend | None = None,
                 staging: int | str | None = "auto"):
        # Every setting is checked before the backend looks for a GPU: on a machine without one,
        # a bad setting says what is wrong with it, not that there is no GPU.
        if backend is not None and (cap is not None or allow_oversubscribe is not None):
            raise ConfigError("cap and allow_oversubscribe belong to the backend; pass them when you build it")
        if device is not None and (isinstance(device, bool) or not isinstance(device, numbers.Integral)):
            raise ConfigTypeError(f"device must be a CUDA device index (an int) or None, got {device!r}")
        if device is not None and device < 0:
            raise ConfigError(f"device must be a CUDA device index >= 0, got {device}")
        budget = budget_setting(budget)
        ring_slot(staging)
        table = PolicyTable(policies if policies is not None else DEFAULT_POLICIES)
        if backend is None:
            from ..cuda.backend import CudaBackend
            backend = CudaBackend(device, cap=cap_setting(cap), allow_oversubscribe=allow_oversubscribe)
        self.backend = backend
        self.device = backend.device
        self.policies = table
        self._configured = resolve_budget(budget, total=backend.capabilities().total_memory)
        self._leases = Leases()          # NOTE [budget leases] in core/leases.py
        self._budget = self._configured  # what is enforced: the configured budget, or the leases'
        self.accounting = Accounting()
        self._lock = threading.RLock()
        self._bufset: weakref.WeakSet[Buffer] = weakref.WeakSet()
        self._resident = 0
        self._parked = 0             # of _resident: pages kept for refills (NOTE [parked pages])
        self._shadow_bytes = 0
        self._tick = itertools.count(1)
        self._inflight: list[Transfer] = []
        self._streams: dict[str, int] = {}
        self._staging = Staging(backend, staging)

    # -- settings -------------------------------------------------------------------------------
    @property
    def budget(self) -> int | None:
        """Bytes tiermem may keep resident on the device (NOTE [device budget]); None: no limit.
        The configured budget where there is one, else the sum of the handles' leases (NOTE
        [budget leases] in core/leases.py)."""
        return self._budget

    @property
    def configured_budget(self) -> int | None:
        """The budget the user set (``Tier(budget=)``, ``configure``, ``set_budget``); None: none."""
        return self._configured

    def set_budget(self, budget: int | str | None) -> int | None:
        """Change the configured budget, evicting at once what no longer fits. Returns the old
        configured budget. A budget smaller than the live leases is refused
        (:class:`OutOfBudgetError`), changing nothing."""
        total = self.backend.capabilities().total_memory
        new = None if budget is None else parse_bytes(budget, total=total, what="device budget", max_percent=100)
        with self._lock:
            if new is not None and self._leases.nbytes > new:
                raise OutOfBudgetError(self._leases.nbytes, self._resident, new,
                                       "handles hold leases on more than that ("
                                       + ", ".join(f"{x.owner}: {x.nbytes:,} B" for x in self._leases)
                                       + "); unwrap them first")
            old, self._configured = self._configured, new
            try:
                self._enforce(self._leases.enforced(new))
            except BaseException:
                self._configured = old
                raise
        return old

    def lease_room(self) -> int | None:
        """Bytes a new lease may take (NOTE [budget leases]): the configured budget less the live
        leases; None where no budget is configured, so that any lease fits."""
        with self._lock:
            return self._leases.room(self._configured)

    def lease(self, nbytes: int, owner: str) -> BudgetLease:
        """Take ``nbytes`` of the budget for ``owner`` (a handle), until the returned lease is
        released (NOTE [budget leases]). Without a configured budget, the enforced budget grows
        by ``nbytes``; with one, the lease must fit its room (:meth:`lease_room`), else
        :class:`OutOfBudgetError`."""
        nbytes = self._leases.check(nbytes)
        with self._lock:
            room = self._leases.room(self._configured)
            if room is not None and nbytes > room:
                raise OutOfBudgetError(nbytes, self._configured - room, self._configured,
                                       f"the configured budget has {room:,} B left for leases")
            lease = self._leases.add(nbytes, owner, self._end_lease)
            try:
                self._enforce(self._leases.enforced(self._configured))
            except BaseException:
                lease.release()
                raise
        return lease

    @property
    def leases(self) -> tuple[BudgetLease, ...]:
        """The live budget leases, in the order taken."""
        with self._lock:
            return tuple(self._leases)

    def _end_lease(self, lease: BudgetLease) -> None:
        with self._lock:
            self._leases.remove(lease)
            try:
                self._enforce(self._leases.enforced(self._configured))
            except OutOfBudgetError as e:
                # What is left cannot all leave the device now (never-evicted tensors, or tensors
                # in use): the smaller budget holds from the next placement on. Giving a lease back
                # runs on unwrap and on a failed adoption, which must not fail over it.
                self._budget = self._leases.enforced(self._configured)
                log.warning("tiermem: a lease given back leaves more on the device than the budget: %s", e)

    def _enforce(self, new: int | None) -> None:
        """Hold to budget ``new`` from now on, evicting at once what no longer fits; a budget
        that cannot be met changes nothing (raises OutOfBudgetError)."""
        with self._lock:
            self.reap()             # finished moves let go of buffers freed meanwhile
            old, self._budget = self._budget, new
            self._staging.yielded = False
            self._staging.release(self.um_stream, new, unwanted_only=True)
            if new is None:   # nothing parks without a budget (NOTE [parked pages])
                self._drop(self._parked_bufs())
            elif self.held_bytes() > new:
                try:
                    self.make_room(0, exclude=set())
                except OutOfBudgetError:
                    self._budget = old
                    raise

    @property
    def resident_bytes(self) -> int:
        """Device bytes tiermem holds (whole pages), what the budget limits: live data placed on
        the device, and the parked pages of evicted tensors (``parked_bytes``)."""
        return self._resident

    @property
    def staging_bytes(self) -> int:
        """Device bytes of the staging rings (NOTE [staging ring]), 0 until they are first used.
        Under a budget they count against it, beside ``resident_bytes``."""
        return self._staging.nbytes

    def held_bytes(self) -> int:
        """What the budget limits: tensors' pages and the staging rings."""
        return self._resident + self.staging_bytes

    @property
    def parked_bytes(self) -> int:
        """Device pages kept from shadow evictions for the next refill (NOTE [parked pages])."""
        return self._parked

    def trim(self) -> int:
        """Give every parked page (NOTE [parked pages]) and the staging rings (NOTE [staging
        ring]) back to the driver, so other allocators can use them. Blocks until that is done;
        returns the bytes given back."""
        with self._lock:
            self.reap()
            return self._drop(self._parked_bufs()) + self._staging.release(self.um_stream)

    # -- the staging rings ------------------------------------------------------------------------
    def um_stream(self, direction: str) -> int:
        return self.side_stream(UM_STREAMS[direction])

    def _yield_ring(self) -> int:
        """Give the rings' room to tensors that need it: tensors come first, the rings only make
        copies faster. They stay off until the budget changes, so that they never take the room
        back by evicting a tensor the next move needs (NOTE [staging ring])."""
        self._staging.yielded = True
        log.info("tiermem: the staging rings give their %d bytes of the budget to tensors; shadow copies "
                 "go direct until the budget changes", self.staging_bytes)
        return self._staging.release(self.um_stream)

    def _stage(self, nbytes: int, direction: str, grow: bool = True) -> Any:
        """A ring session for ``nbytes`` of shadow copies in ``direction``, or None to copy
        direct. Without a budget a ring is allocated here. Under one, a prefetch has made room
        for the refills' ring already (``_room_for``); an eviction the caller asked for
        (``grow``) takes its ring where the budget has room to spare, since parked pages keep
        counting. One that makes room for something else never does: the room is spoken for."""
        if not self._staging.wanted(direction, nbytes, self._budget):
            return None
        ring = self._staging.ring(direction)
        if not ring.allocated:
            if self._budget is not None and (direction == "h2d" or not grow
                                             or self.held_bytes() + ring.nbytes > self._budget):
                return None
            if not self._staging.allocate(direction):
                return None
        return ring.session(self.um_stream(direction), direction)

    def _quiesce(self) -> None:
        """NOTE [discard fence] with two streams: before a discard the host drains both of
        tiermem's managed-memory streams (the backend then drains the discard's own stream
        before and after it), so no tiermem move of managed memory runs anywhere around it."""
        be = self.backend
        for name in UM_STREAMS.values():
            s = self._streams.get(name)
            if s is not None:
                ev = be.new_event()
                be.record(ev, s)
                be.synchronize(ev)
    # -- allocation -----------------------------------------------------------------------------
    def empty(self, shape: int | Iterable[int], dtype: Any = "float32", *, role: Role | str,
              policy: Policy | None = None, name: str | None = None, **policy_changes: Any) -> TieredTensor:
        """A new tiered tensor, uninitialised, placed by its role's policy.

        ``policy`` replaces the role's policy for this tensor; ``policy_changes`` change fields of
        it (e.g. ``read_mostly=True``). Raises :class:`CapExceededError` past the managed cap.
        """
        shape_t, dt = check_empty(shape, dtype, role, policy, policy_changes)
        buf = self.new_buffer(math.prod(shape_t) * _dtypes.itemsize(dt), role, policy, policy_changes, name)
        self.apply_advice(buf)
        self.place_new(buf)
        return TieredTensor(buf, shape_t, dt)

    def empty_group(self, specs: Iterable[tuple[Any, Any]], *, role: Role | str, names: Iterable[str] | None = None,
                    policy: Policy | None = None, **policy_changes: Any) -> list[TieredTensor]:
        """Tensors of one role as adjacent slices of a single allocation, each given by
        ``(shape, dtype)``. A group of 2 MiB or more moves in one CUDA call, at link rate, where
        separate tensors need one call each, and its members share no page (members of 2 MiB or
        more take whole 2 MiB pages, smaller ones 64 KiB), so each can still be prefetched,
        evicted or advised on its own. A smaller group shares pages like any small buffer
        (NOTE [size classes] in cuda/backend.py)."""
        specs = [((int(sh),) if isinstance(sh, int) else tuple(int(x) for x in sh), _dtypes.canonical(dt))
                 for sh, dt in specs]
        names_l = list(names) if names is not None else [None] * len(specs)
        if len(names_l) != len(specs):
            raise ConfigError(f"{len(names_l)} names for {len(specs)} tensors")
        r = as_role(role)
        pol = self.resolve_policy(r, policy, policy_changes)
        sizes = [math.prod(sh) * _dtypes.itemsize(dt) for sh, dt in specs]
        offsets, spans, off = [], [], 0
        for n in sizes:
            span, align = member_span(n)
            off = -(-off // align) * align
            offsets.append(off)
            spans.append(span)
            off += span
        request, size_class = round_request(off)
        block = self.backend.allocate(request, f"{r.value}/{size_class}")
        group = _SharedBlock(block)
        bufs = []
        for n, span, name, off in zip(sizes, spans, names_l, offsets):
            sub = Block(block.ptr + off, span, block.pool_key, group, alloc=block.alloc)
            buf = Buffer(self, sub, n, r, pol, name)
            buf.last_use = next(self._tick)
            self.accounting.on_alloc(r, n)
            bufs.append(buf)
        with self._lock:
            for b in bufs:
                self._bufset.add(b)
        for b in bufs:
            self.apply_advice(b)
        self._place_new_group(bufs)
        return [TieredTensor(b, sh, dt) for b, (sh, dt) in zip(bufs, specs)]

    def resolve_policy(self, role: Role, policy: Policy | None, changes: Mapping[str, Any]) -> Policy:
        base = policy if policy is not None else self.policies[role]
        if not isinstance(base, Policy):
            raise RoleError(f"policy must be a tiermem.Policy, got {type(base).__name__}")
        return base.replace(**changes) if changes else base

    def new_buffer(self, nbytes: int, role: Role | str, policy: Policy | None,
                    changes: Mapping[str, Any], name: str | None) -> Buffer:
        r = as_role(role)
        pol = self.resolve_policy(r, policy, changes)
        request, size_class = round_request(nbytes)
        block = self.backend.allocate(request, f"{r.value}/{size_class}")
        buf = Buffer(self, block, nbytes, r, pol, name)
        buf.last_use = next(self._tick)
        self.accounting.on_alloc(r, nbytes)
        with self._lock:
            self._bufset.add(buf)
        return buf

    def page_range(self, buf: Buffer) -> tuple[int, int]:
        """The range to advise and prefetch: whole pages when the buffer has them to itself (a
        group member, a large buffer), else just its bytes (its pages are shared)."""
        whole = buf.ptr % PAGE == 0 and buf.span % PAGE == 0 and (buf.owns_pages or buf.block.alloc != buf.ptr
                                                                   or buf.block.pool_key.endswith("/large"))
        return (buf.ptr, buf.span if whole else buf.nbytes)

    def apply_advice(self, buf: Buffer, policy: Policy | None = None) -> None:
        plan = advice_plan(policy or buf.policy)
        if not self.backend.capabilities().supports("advise"):
            self.accounting.count(buf.role, "advice_skipped", len(plan))
            return
        ptr, n = self.page_range(buf)
        for advice in plan:
            self.backend.advise(ptr, n, advice)
        self.accounting.count(buf.role, "advice_applied", len(plan))

    def change_policies(self, bufs: Sequence[Buffer], policy: Policy) -> None:
        """Give every buffer of ``bufs`` ``policy`` and apply its advice, one call per advice for
        each run of adjacent buffers of one allocation (a group's members): one tensor at a time,
        a module's resident groups took 70 ms of a 0.74 s checkpoint load on the H100
        (bench/probes/probe_load.py)."""
        plan = advice_plan(policy)
        with self._lock:
            runs: list[list[Any]] = []          # [allocation, start, end, role]
            for b in sorted(bufs, key=lambda b: b.ptr):
                b.policy = policy
                if not policy.read_only:
                    b.shadow_valid = False
                ptr, n = self.page_range(b)
                if runs and runs[-1][0] == b.block.alloc and ptr <= runs[-1][2]:
                    runs[-1][2] = max(runs[-1][2], ptr + n)
                else:
                    runs.append([b.block.alloc, ptr, ptr + n, b.role])
            if not self.backend.capabilities().supports("advise"):
                for b in bufs:
                    self.accounting.count(b.role, "advice_skipped", len(plan))
                return
            for _, start, end, role in runs:
                for advice in plan:
                    self.backend.advise(start, end - start, advice)
                self.accounting.count(role, "advice_applied", len(plan))

    def change_policy(self, buf: Buffer, policy: Policy | None, changes: Mapping[str, Any]) -> Policy:
        with self._lock:
            buf.policy = (policy if policy is not None else buf.policy).replace(**changes)
            if not buf.policy.read_only:
                buf.shadow_valid = False   # the device may write it from now on
            self.apply_advice(buf)
            return buf.policy

    def place_new(self, buf: Buffer) -> None:
        self._place_new_group([buf])

    def _place_new_group(self, bufs: list[Buffer]) -> None:
        """Give new buffers their first place, so the budget counts them before anything writes them.

        Host-preferred buffers stay unplaced: the preferred-location rule puts their pages on the
        host at first touch, so nothing is moved and nothing is resident. Others get device pages
        now, within the budget; buffers that cannot fit are made host-preferred and read in place
        (zero-copy), since a device write would otherwise take pages the budget never counted.
        """
        pol = bufs[0].policy
        if pol.preferred_location is Location.HOST or pol.prefetch is Prefetch.NEVER:
            return
        try:
            with self._lock:
                self.make_room(sum(b.span for b in bufs), exclude=set(bufs))
                big = [b for b in bufs if b.owns_pages]
                if big:
                    self.move_in(big, None, non_blocking=False)
                for b in bufs:
                    if not b.owns_pages:
                        # Shared pages (NOTE [size classes]): the first device touch places them
                        # by the preferred-location rule; a prefetch per small array costs more.
                        b.where = Location.DEVICE
                        self._resident += b.span
                        self.accounting.on_resident(b.role, b.span)
        except OutOfBudgetError:
            log.debug("tiermem: %s bytes do not fit the budget; reading them in place", sum(b.nbytes for b in bufs))
            for b in bufs:
                self.change_policy(b, None, {"preferred_location": Location.HOST, "accessed_by_device": True,
                                           "read_mostly": False})

    def reserve(self, nbytes: int, role: Role) -> None:
        """Count device memory tiermem uses outside managed buffers (a streaming window) against
        the budget, making room first; raises OutOfBudgetError if it cannot fit."""
        with self._lock:
            self.make_room(nbytes, exclude=set())
            self._resident += nbytes
            self.accounting.on_resident(role, nbytes)

    def unreserve(self, nbytes: int, role: Role) -> None:
        with self._lock:
            self._resident -= nbytes
            self.accounting.on_resident(role, -nbytes)

    def _owner_of(self, ptr: int) -> Buffer | None:
        """The live buffer whose managed range or shadow holds address ``ptr``, if any."""
        with self._lock:
            for b in self._live_buffers():
                if b.ptr <= ptr < b.ptr + max(b.nbytes, 1):
                    return b
                if b.shadow is not None and b.shadow.ptr <= ptr < b.shadow.ptr + max(b.nbytes, 1):
                    return b
        return None

    def release_buffer(self, buf: Buffer) -> None:
        """A TieredTensor let go of its buffer; the buffer lives on while views hold it."""
        buf.freed = True

    # NOTE [finalizer race]
    # CPython runs a finalizer (``Buffer.__del__``) *before* it clears the object's weak
    # references, and the finalizer waits here for the lock. Meanwhile another thread that holds
    # the lock can still find the buffer in ``self._bufset`` (a WeakSet) and evict it, or find it
    # after this method ran: the buffer was then counted off twice (the concurrency test in
    # tests/test_engine.py saw resident_bytes at -64 KiB in CI). So a gone buffer leaves the set
    # here, under the lock, is marked ``gone``, and every walk of the set skips gone buffers.
    def buffer_gone(self, buf: Buffer) -> None:
        """The last owner of ``buf`` went: give its memory back. Called from __del__."""
        with self._lock:
            if buf.gone:
                return
            buf.gone = True
            self._bufset.discard(buf)
            if buf.parked:
                self._unpark(buf, pages_gone=True)
            elif buf.where is Location.DEVICE:
                self._resident -= buf.span
                self.accounting.on_resident(buf.role, -buf.span)
            buf.where = None
            if buf.shadow is not None:
                self._shadow_bytes -= buf.shadow.nbytes
                buf.shadow.release()
        self.accounting.on_free(buf.role, buf.nbytes)
        buf.block.release()

    def _live_buffers(self) -> list[Buffer]:
        """The buffers not yet gone (NOTE [finalizer race]); call with the lock held."""
        return [b for b in list(self._bufset) if not b.gone]

    # -- streams --------------------------------------------------------------------------------
    def stream_handle(self, stream: Any) -> int:
        """A stream handle from None (the current stream), an int, a torch or a CuPy stream."""
        if stream is None:
            return self.backend.current_stream()
        if isinstance(stream, int):
            return stream
        for attr in ("cuda_stream", "ptr"):
            if hasattr(stream, attr):
                return int(getattr(stream, attr))
        raise ConfigTypeError(f"not a stream: {stream!r}")

    def side_stream(self, direction: str) -> int:
        s = self._streams.get(direction)
        if s is None:
            s = self._streams[direction] = self.backend.new_stream()
        return s

    def _begin(self, bufs: list[Buffer], cur: int, side: int) -> Any:
        """Order ``side`` after the caller's stream and after earlier moves of ``bufs``; returns the
        timing event that starts the transfer."""
        lane = Lane(self.backend, side)        # NOTE [ordered copies] in core/stream.py
        lane.after([now(cur)] + [b.pending.event for b in bufs
                                 if b.pending is not None and not b.pending.done() and b.pending.stream != side])
        return lane.mark(timing=True)

    def _finish(self, direction: str, bufs: list[Buffer], cur: int, side: int, start: Any,
                moved: dict[Role, int], non_blocking: bool) -> Transfer:
        be = self.backend
        end = Lane(be, side).mark(timing=True)
        tr = Transfer(self, direction, side, start, end, list(bufs), sum(moved.values()), moved)
        for b in bufs:
            b.pending = tr
        self._inflight.append(tr)
        if not non_blocking:
            be.wait(cur, end)
        return tr

    def reap(self) -> None:
        self._inflight = [t for t in self._inflight if not t.done()]

    # -- the engine's interface to tiermem's adapters (_torch, _module, _train, _swap, _scoped) --
    # Not for users: these change the books and must be called as the adapters do (NOTE
    # [budget leases], [parked pages], [failed moves]). They are named, not private, so that the
    # interface between modules is visible; tests/test_layers.py checks that no module reaches
    # into another's private members.
    @property
    def lock(self) -> threading.RLock:
        """The lock that guards the books; hold it around a read-then-change of them."""
        return self._lock

    def inflight(self) -> list[Transfer]:
        """The moves enqueued and not yet reaped."""
        with self._lock:
            return list(self._inflight)

    def track(self, tr: Transfer) -> None:
        """Count a move an adapter enqueued itself (``synchronize`` then waits for it too)."""
        with self._lock:
            self._inflight.append(tr)

    def tick(self) -> int:
        """The next value of the use clock (``last_use``: the coldest is evicted first)."""
        return next(self._tick)

    def count_resident(self, b: Buffer, delta: int) -> None:
        """``b``'s pages came to (``delta`` > 0) or left the device outside tiermem's moves."""
        with self._lock:
            self._resident += delta
            self.accounting.on_resident(b.role, delta)

    def synchronize(self) -> None:
        """Block until every move tiermem has enqueued is done."""
        with self._lock:
            for t in self._inflight:
                t.synchronize()
            self._inflight = []

    # -- placement ------------------------------------------------------------------------------
    def _bufs(self, tensors: Any, call: str) -> list[Buffer]:
        out, seen = [], set()
        for t in tiered_list(tensors, call, also=(Buffer,)):     # the adapters pass Buffers
            b = t if isinstance(t, Buffer) else t.buffer
            if b.tier is not self:
                raise ConfigError(f"{t!r} belongs to another Tier")
            if id(b) not in seen:
                seen.add(id(b))
                out.append(b)
        return out

    def prefetch(self, tensors: TieredTensor | Iterable[TieredTensor], to: Location | str = Location.DEVICE, *,
                 stream: Any = None, non_blocking: bool = False) -> Transfer:
        """Bring ``tensors`` to ``to`` ("device" or "host") in one transfer on a tiermem stream.

        Moves to the device first make room in the budget, evicting the coldest evictable tensors
        (raises :class:`OutOfBudgetError` if they cannot all fit). The moves wait for work already
        queued on ``stream`` (default: the current stream). Unless ``non_blocking``, ``stream``
        then waits for the moves on the device; with ``non_blocking`` the caller waits on the
        returned :class:`Transfer` before using the data. The host blocks only where a move
        discards managed pages (a shadow refill, a shadow eviction): NOTE [discard fence] in
        cuda/backend.py drains the stream around each discard, so it waits for ``stream``'s queued
        work too.
        """
        loc = as_location(to)
        if loc is Location.HOST:
            return self.evict(tensors, stream=stream, non_blocking=non_blocking)
        bufs = self._bufs(tensors, "prefetch")
        with self._lock:
            self.reap()
            todo = [b for b in bufs if b.where is not Location.DEVICE or b.in_shadow]
            pairs = self._room_for(todo, exclude=set(bufs)) if todo else {}
            for b in bufs:
                b.last_use = next(self._tick)
            if not todo:
                return Transfer.done_now("h2d")
            return self.move_in(todo, stream, non_blocking, pairs)

    @staticmethod
    def _snapshot(bufs: Iterable[Buffer]) -> list[tuple[Buffer, tuple]]:
        return [(b, tuple(getattr(b, f) for f in _MOVE_STATE)) for b in bufs]

    def _roll_back(self, snap: list[tuple[Buffer, tuple]]) -> None:
        """Put the buffers of ``snap`` back as they were, with the counters (NOTE [failed
        moves]): each buffer's held pages and parked pages go back to what they were."""
        for b, vals in snap:
            held = b.span if (b.where is Location.DEVICE or b.parked) else 0
            parked = b.span if b.parked else 0
            for f, v in zip(_MOVE_STATE, vals):
                setattr(b, f, v)
            d = (b.span if (b.where is Location.DEVICE or b.parked) else 0) - held
            if d:
                self._resident += d
                self.accounting.on_resident(b.role, d)
            self._parked += (b.span if b.parked else 0) - parked
            if b.bindings:    # tensors tiermem bound follow the data back
                self._rebind(b, shadow=b.in_shadow)

    def move_in(self, todo: list[Buffer], stream: Any, non_blocking: bool,
                 pairs: Mapping[Buffer, Buffer] | None = None) -> Transfer:
        """Enqueue the moves of ``todo`` to the device; ``pairs`` maps shadowed buffers to the
        parked buffers whose pages they take (NOTE [parked pages]). On failure, nothing moved
        (NOTE [failed moves])."""
        snap = self._snapshot([*todo, *(pairs.values() if pairs else ())])
        try:
            return self._move_in_(todo, stream, non_blocking, pairs)
        except BaseException:
            self._roll_back(snap)
            raise

    def _move_in_(self, todo: list[Buffer], stream: Any, non_blocking: bool,
                  pairs: Mapping[Buffer, Buffer] | None) -> Transfer:
        be = self.backend
        caps = be.capabilities()
        cur, side = self.stream_handle(stream), self.um_stream("h2d")
        start = self._begin(todo, cur, side)
        for d in pairs.values() if pairs else ():
            # its eviction, on the other stream, must have copied out of the pages first
            if d.pending is not None and d.pending.stream != side and not d.pending.done():
                be.wait(side, d.pending.event)
        moved: dict[Role, int] = {}
        um = [b for b in todo if not b.in_shadow]
        shadowed = [b for b in todo if b.in_shadow]
        intact = {b for b in shadowed if self._intact(b)}
        pairs = pairs or {}
        fresh = [b for b in shadowed if not b.parked and b not in pairs]
        if um:
            if caps.supports("prefetch"):
                be.prefetch(coalesce((b.block.alloc, *self.page_range(b)) for b in um), Location.DEVICE, side)
            else:
                for b in um:
                    self.accounting.count(b.role, "prefetch_skipped")
            for b in um:
                if b.where is Location.HOST:  # unplaced buffers only get pages: nothing crosses the link
                    moved[b.role] = moved.get(b.role, 0) + b.nbytes
        if fresh:   # device pages first, then the shadow's bytes
            self._fresh_pages(fresh, Location.DEVICE, side)
        stage = self._stage(self._copy_in_bytes(shadowed), "h2d")
        # Largest first, each taking its pages just before its copy: the link is busy while the
        # host does the rest (the host's work before the first copy is time the link stands idle).
        for b in sorted(shadowed, key=lambda b: -b.nbytes):
            if b in pairs:
                self._take_pages(b, pairs[b])
            if b not in intact:
                if stage is not None:
                    stage.add(b.ptr, b.shadow.ptr, b.nbytes)
                else:
                    be.copy(b.ptr, b.shadow.ptr, b.nbytes, side)
                moved[b.role] = moved.get(b.role, 0) + b.nbytes
        if stage is not None:
            stage.close()
            self.accounting.count_many(collections.Counter(
                {(r, "staged_h2d_bytes"): n for r, n in moved.items() if n}))
        for b in todo:
            if b.in_shadow:    # first, so that a failure finds the buffer untouched (NOTE [failed moves])
                self._rebind(b, shadow=False)
            was_host = b.where is Location.HOST and not b.in_shadow and b.host_valid
            if b.parked:   # its pages were counted all along
                self._unpark(b, pages_gone=False)
                b.where = Location.DEVICE
                self.accounting.count(b.role, "refill_reuse_ops")
            b.in_shadow = False
            # A device write would invalidate host copies; only read-only buffers keep theirs.
            b.shadow_valid = b.shadow_valid and b.policy.read_only
            b.host_valid = b.policy.read_only and b.policy.read_mostly and (was_host or b.host_valid)
            if b.where is not Location.DEVICE:
                self._resident += b.span
                self.accounting.on_resident(b.role, b.span)
            b.where = Location.DEVICE
            self.accounting.count(b.role, "prefetch_ops")
        for r, n in moved.items():
            self.accounting.on_move(r, "h2d", n)
        return self._finish("h2d", todo, cur, side, start, moved, non_blocking)

    @staticmethod
    def _intact(b: Buffer) -> bool:
        # A parked buffer's own pages still hold its data if it is read-only (nothing may write its
        # shadow) and its shadow is valid: the refill then moves nothing.
        return b.in_shadow and b.parked and b.policy.read_only and b.shadow_valid

    @classmethod
    def _copy_in_bytes(cls, todo: list[Buffer]) -> int:
        """Bytes a refill of ``todo`` copies from shadows."""
        return sum(b.nbytes for b in todo if b.in_shadow and not cls._intact(b))

    def evict(self, tensors: TieredTensor | Iterable[TieredTensor], *, stream: Any = None,
              non_blocking: bool = False, release: bool | None = None, _path: str | None = None,
              _for_room: bool = False) -> Transfer:
        """Take ``tensors`` off the device, each by the fastest safe path (NOTE [eviction paths]).

        Ordering is as for :meth:`prefetch`. With ``non_blocking`` the caller must not touch the
        tensors until the returned transfer is done (or they are prefetched again). Under a
        budget, a shadow eviction keeps the device pages for the next refill (NOTE [parked
        pages]); ``release=True`` gives them back to the driver now, these tensors' parked pages
        included (blocking until the copies are done). Without a budget they always go back.
        """
        bufs = self._bufs(tensors, "evict")
        park = self._budget is not None and not release
        with self._lock:
            self.reap()
            for b in bufs:
                if b.where is None:  # never placed: no pages anywhere, nothing to move
                    b.where = Location.HOST
            todo = [b for b in bufs if b.where is Location.DEVICE]
            if release:
                self._drop([b for b in bufs if b.parked])
            if not todo:
                return Transfer.done_now("d2h")
            tr, collapse = self._move_out(todo, stream, non_blocking, _path, park, grow_ring=not _for_room)
        # Collapsing read-mostly copies is a host-side driver call that takes ~25 ms per GiB
        # (bench/results/probe_refill-*.json); it runs outside the lock so that other threads can
        # keep enqueuing moves meanwhile. It moves no data. It is not stream-ordered, so it first
        # waits for the kernels a buffer's fence covers (NOTE [collapse fence] in cupy/scoped.py).
        fences = {id(f): f for *_, f in collapse if f is not None}
        for f in fences.values():
            if not self.backend.query(f):
                self.backend.synchronize(f)
        for ptr, n, again, _ in collapse:
            self.backend.advise(ptr, n, Advice("read_mostly", False, Location.DEVICE))
            if again:
                self.backend.advise(ptr, n, Advice("read_mostly", True, Location.DEVICE))
        return tr

    def _evict_path(self, b: Buffer, park: bool = False) -> str:
        caps = self.backend.capabilities()
        if not caps.supports("prefetch"):
            return "skip"
        pol = b.policy
        if pol.read_mostly and b.host_valid and pol.preferred_location is Location.HOST:
            return "collapse"
        # A buffer that shares 2 MiB pages may take the shadow path only when it parks: then
        # nothing is discarded (NOTE [parked pages], "Small buffers").
        if caps.supports("discard") and (b.owns_pages or park) and not pol.read_mostly:
            # Never on a read-mostly range: after a device write, a copy out, a discard and a
            # refill of one lost data on the H100 (tests/test_gpu_stress.py found it; the driver's
            # read duplicates do not follow the discard). Read-mostly data collapses or goes by UM.
            return "discard" if b.shadow_valid else "copy"
        return "um"

    def _move_out(self, todo: list[Buffer], stream: Any, non_blocking: bool,
                  force: str | None = None, park: bool = False,
                  grow_ring: bool = True) -> tuple[Transfer, list[tuple[int, int, bool, Any]]]:
        """Enqueue the evictions of ``todo``; returns the transfer and the ranges whose read-mostly
        copies the caller must collapse (after releasing the lock), each with whether read-mostly
        is set again and the fence to wait for first. With ``park``, shadow
        evictions keep their pages (NOTE [parked pages]) instead of discarding them."""
        snap = self._snapshot(todo)
        discarded: list[bool] = []    # once the discard is asked for, the eviction stands (NOTE [failed moves])
        try:
            return self._move_out_(todo, stream, non_blocking, force, park, grow_ring, discarded)
        except BaseException:
            if not discarded:
                self._roll_back(snap)
            raise

    def _move_out_(self, todo: list[Buffer], stream: Any, non_blocking: bool, force: str | None,
                   park: bool, grow_ring: bool, discarded: list[bool]) -> tuple[Transfer, list[tuple[int, int]]]:
        be = self.backend
        cur, side = self.stream_handle(stream), self.um_stream("d2h")
        start = self._begin(todo, cur, side)
        moved: dict[Role, int] = {}
        discards: list[Buffer] = []
        collapse: list[Buffer] = []
        # Counted once at the end: each count takes the stats lock, and under budget pressure
        # this loop runs on the host before the refill's first copy (link idle meanwhile).
        ops: collections.Counter[tuple[Role, str]] = collections.Counter()
        stage: Any = None    # the ring session, opened at the first copy (False: copies go direct)
        for b in todo:
            path = force or self._evict_path(b, park)
            if path in ("discard", "copy"):
                if b.foreign_views() or not (b.owns_pages or park):
                    path = "um"
                else:
                    if path == "copy" and b.shadow is None:
                        b.shadow = be.host_alloc(b.nbytes)
                        self._shadow_bytes += b.shadow.nbytes
                    if not self._detach_for_discard(b):
                        path = "um"
            if path == "skip":
                ops[b.role, "prefetch_skipped"] += 1
            elif path == "collapse":
                # Unset read-mostly: the copies collapse onto the preferred location, the host,
                # whose copy is current, so nothing moves; then read-mostly is set again, unless
                # a read-only scope only lent it (NOTE [read-only scopes] in cupy/scoped.py). (A
                # device write to a read-only buffer breaks that promise; see Policy.read_only.)
                collapse.append(b)
                ops[b.role, "advice_applied"] += 1 if b.read_mostly_while_resident else 2
                ops[b.role, "evict_clean_ops"] += 1
            elif path == "discard":
                if park:
                    self._park(b, ops)
                else:
                    discards.append(b)   # one batched discard for all of them, below
                b.in_shadow = True
                ops[b.role, "evict_clean_ops"] += 1
            elif path == "copy":
                # One call per buffer: copies out of managed memory run at ~52 GB/s in any size
                # of piece (bench/results/probe_managed_read-*.json); through the ring, ~54.5
                # (NOTE [staging ring]).
                if stage is None:
                    stage = self._stage(sum(x.nbytes for x in todo), "d2h", grow_ring) or False
                if stage:
                    stage.add(b.shadow.ptr, b.ptr, b.nbytes)
                    ops[b.role, "staged_d2h_bytes"] += b.nbytes
                else:
                    be.copy(b.shadow.ptr, b.ptr, b.nbytes, side)
                if park:
                    self._park(b, ops)
                else:
                    discards.append(b)   # after every copy, in one fenced call (NOTE [discard fence])
                b.in_shadow = True
                b.shadow_valid = True
                moved[b.role] = moved.get(b.role, 0) + b.nbytes
            else:  # "um": Unified Memory's own write-back; every pointer stays valid
                be.prefetch([self.page_range(b)], Location.HOST, side)
                b.host_valid = True
                moved[b.role] = moved.get(b.role, 0) + b.nbytes
                ops[b.role, "evict_um_ops"] += 1
            if not b.parked:
                self._resident -= b.span
                self.accounting.on_resident(b.role, -b.span)
            b.where = Location.HOST
            ops[b.role, "evict_ops"] += 1
        self.accounting.count_many(ops)
        if stage:
            stage.close()     # before the discards: their fence drains tiermem's stream
        if discards:
            self._quiesce()
            # Before the call: one that fails, or a Ctrl-C that lands as it returns, may have
            # dropped the pages already, and the shadows hold the data (NOTE [failed moves]).
            discarded.append(True)
            be.discard(coalesce((b.block.alloc, b.ptr, b.span) for b in discards), side)
        for r, n in moved.items():
            self.accounting.on_move(r, "d2h", n)
        tr = self._finish("d2h", todo, cur, side, start, moved, non_blocking)
        # (range, set read-mostly again, fence): a buffer lent read-mostly for a read-only scope
        # keeps it only while resident (NOTE [read-only scopes] in cupy/scoped.py). A group's members
        # still collapse in one call where they share both.
        same: dict[tuple[bool, int], tuple[bool, Any, list[Buffer]]] = {}
        for b in collapse:
            again = not b.read_mostly_while_resident
            same.setdefault((again, id(b.fence)), (again, b.fence, []))[2].append(b)
        return tr, [(p, n, again, fence) for again, fence, bs in same.values()
                    for p, n in coalesce((b.block.alloc, *self.page_range(b)) for b in bs)]

    def make_room(self, need: int, exclude: set[Buffer]) -> None:
        """Make ``need`` more bytes fit the budget: give parked pages back first (NOTE [parked
        pages]), then evict the coldest evictable resident buffers, releasing their pages."""
        if self._budget is None:
            return
        over = self.held_bytes() + need - self._budget
        if over <= 0:
            return
        over -= self._drop(self._parked_bufs(exclude), over)
        if over > 0:
            try:
                victims = self._victims(over, need, exclude)
            except OutOfBudgetError:
                if not self.staging_bytes:
                    raise
                over -= self._yield_ring()
                if over <= 0:
                    return
                victims = self._victims(over, need, exclude)
            self.evict(victims, non_blocking=True, release=True, _for_room=True)

    def _victims(self, over: int, need: int, exclude: set[Buffer]) -> list[Buffer]:
        """The coldest evictable resident buffers whose pages add up to ``over`` bytes."""
        cands = [b for b in self._live_buffers()
                 if b.where is Location.DEVICE and b not in exclude and b.policy.evict is not Evict.NEVER]
        cands.sort(key=lambda b: (b.policy.evict_priority, b.last_use))
        chosen, freed = [], 0
        for b in cands:
            if freed >= over:
                break
            chosen.append(b)
            freed += b.span
        if freed < over:
            raise OutOfBudgetError(
                need, self._resident, self._budget,
                "Everything else resident is in use or never evicted (Evict.NEVER); raise the "
                "budget or free tensors")
        self.accounting.count_many(collections.Counter((b.role, "evict_budget_ops") for b in chosen))
        return chosen

    def _room_for(self, todo: list[Buffer], exclude: set[Buffer]) -> dict[Buffer, Buffer]:
        """Make room for a prefetch of ``todo`` within the budget. Shadowed buffers take parked
        pages where they can (NOTE [parked pages]), the victims' included: the victims' copies
        out and the refills' copies in then meet in the same pages with no discard between.
        Returns {incoming buffer: parked buffer whose pages it takes}. Makes room for the staging
        ring too where the refill will use it and it is not allocated yet (NOTE [staging ring]);
        if the budget has room for the tensors but not the ring as well, they copy direct."""
        if self._budget is None:
            return self._pair(todo, exclude, {})
        # The refills' ring, and the evictions' one for the victims to come (sized by the refill's
        # bytes, the victims' being unknown yet): both if they fit, else the refills' alone.
        n = self._copy_in_bytes(todo)
        want = [d for d in ("h2d", "d2h") if self._staging.wanted(d, n, self._budget) and not self._staging.ring(d).allocated]
        if "h2d" in want:
            for rings in ([want, ["h2d"]] if len(want) > 1 else [want]):
                try:
                    pairs = self._room_within(todo, exclude, sum(self._staging.ring(d).nbytes for d in rings))
                except OutOfBudgetError:
                    continue
                for d in rings:
                    self._staging.allocate(d)
                return pairs
        try:
            return self._room_within(todo, exclude, 0)
        except OutOfBudgetError:
            if not self.staging_bytes:
                raise
            self._yield_ring()
            return self._room_within(todo, exclude, 0)

    def _room_within(self, todo: list[Buffer], exclude: set[Buffer], extra: int) -> dict[Buffer, Buffer]:
        """``_room_for`` with ``extra`` more bytes to fit (the ring's). Raises OutOfBudgetError
        before it evicts anything if they cannot fit."""
        pairs = self._pair(todo, exclude, {})

        def over() -> int:
            need = sum(b.span for b in todo if b.where is not Location.DEVICE and not b.parked and b not in pairs)
            return self.held_bytes() + extra + need - self._budget

        if over() > 0:   # parked pages no incoming buffer can take go back first
            self._drop(self._parked_bufs([*exclude, *pairs.values()]), over())
        if over() > 0:
            need = sum(b.span for b in todo if b.where is not Location.DEVICE and not b.parked) + extra
            victims = self._victims(over(), need, exclude)
            self.evict(victims, non_blocking=True, _for_room=True)   # parks the ones that take a shadow path
            pairs = self._pair(todo, exclude, pairs)
            if over() > 0:
                self._drop([v for v in victims if v.parked and v not in pairs.values()], over())
        return pairs

    def _pair(self, todo: list[Buffer], exclude: set[Buffer],
              pairs: dict[Buffer, Buffer]) -> dict[Buffer, Buffer]:
        """Match shadowed buffers of ``todo`` that have no pages with parked buffers of the same
        span outside ``exclude``, preferring one whose range has the same advice."""
        want = [b for b in todo if b.in_shadow and not b.parked and b not in pairs]
        if not want:
            return pairs
        donors: dict[int, list[Buffer]] = {}
        for d in self._parked_bufs([*exclude, *pairs.values()]):
            donors.setdefault(d.span, []).append(d)
        for c in want:
            ds = donors.get(c.span)
            if ds:
                plan = _plan(c.policy)
                same = [d for d in ds if d.policy == c.policy or _plan(d.policy) == plan]
                d = (same or ds)[0]
                ds.remove(d)
                pairs[c] = d
        return pairs

    def _park(self, b: Buffer, ops: collections.Counter[tuple[Role, str]]) -> None:
        b.parked = True
        self._parked += b.span
        ops[b.role, "evict_park_ops"] += 1

    def _unpark(self, b: Buffer, pages_gone: bool) -> None:
        """``b`` is parked no more: its pages hold its live data again, or (``pages_gone``) they
        leave tiermem's hands and the budget's count."""
        b.parked = False
        self._parked -= b.span
        if pages_gone:
            self._resident -= b.span
            self.accounting.on_resident(b.role, -b.span)

    def _parked_bufs(self, exclude: Iterable[Buffer] = ()) -> list[Buffer]:
        skip = set(exclude)
        return [b for b in self._live_buffers() if b.parked and b not in skip]

    def _fresh_pages(self, bufs: list[Buffer], location: Location, side: int) -> None:
        """Give shadowed buffers without pages new pages at ``location``; their old contents are
        stale (the data is in the shadow). Whole pages get them by discard-and-prefetch, with
        nothing migrated; shared pages cannot be discarded, so they migrate, stale contents and
        all (NOTE [parked pages], "Small buffers")."""
        whole = [b for b in bufs if b.owns_pages]
        shared = [b for b in bufs if not b.owns_pages]
        if whole:
            self._quiesce()
            self.backend.discard_and_prefetch(coalesce((b.block.alloc, b.ptr, b.span) for b in whole), location, side)
        if shared:
            self.backend.prefetch(coalesce((b.block.alloc, *self.page_range(b)) for b in shared), location, side)

    def _take_pages(self, c: Buffer, d: Buffer) -> None:
        """``c`` (in the shadow, without pages) takes parked ``d``'s range and its device pages;
        ``d`` keeps its shadow and takes ``c``'s range, which holds no pages (NOTE [parked
        pages]). Ranges keep the advice they were given, so it is given again if it differs."""
        c.block, d.block = d.block, c.block
        c.ptr, d.ptr = c.block.ptr, d.block.ptr
        c.parked, d.parked = True, False      # c's refill then unparks it like its own pages
        self.accounting.on_resident(d.role, -d.span)
        self.accounting.on_resident(c.role, c.span)
        if c.policy != d.policy and _plan(c.policy) != _plan(d.policy):
            self.apply_advice(c)
            self.apply_advice(d)

    def _drop(self, cands: list[Buffer], amount: int | None = None) -> int:
        """Give back the pages of the coldest parked buffers in ``cands`` until ``amount`` bytes
        (all of them if None), in one fenced discard; returns the bytes given back."""
        chosen, freed = [], 0
        for b in sorted(cands, key=lambda b: b.last_use):
            if amount is not None and freed >= amount:
                break
            chosen.append(b)
            freed += b.span
        if not chosen:
            return 0
        side = self.um_stream("d2h")
        whole = [b for b in chosen if b.owns_pages]
        if whole:
            self._quiesce()
            # Before the call, as an eviction counts its discard (NOTE [failed moves]): a parked
            # buffer whose pages may be gone must not stay parked, or a read-only one would be
            # refilled from those pages (``_intact``). Its data is in its shadow.
            self._gave_back(whole)
            self.backend.discard(coalesce((b.block.alloc, b.ptr, b.span) for b in whole), side)
        shared = [b for b in chosen if not b.owns_pages]
        if shared:
            # Pages shared with other buffers cannot be discarded; Unified Memory moves them to
            # the host instead, as it evicts any small buffer (their contents are stale: the
            # data is in the shadow).
            self._gave_back(shared)
            self.backend.prefetch(coalesce((b.block.alloc, *self.page_range(b)) for b in shared), Location.HOST, side)
            for b in shared:
                self.accounting.on_move(b.role, "d2h", b.nbytes)
        return freed

    def _gave_back(self, bufs: list[Buffer]) -> None:
        for b in bufs:
            self._unpark(b, pages_gone=True)
            self.accounting.count(b.role, "park_release_ops")

    # -- views and bindings -----------------------------------------------------------------------
    def _rebind(self, b: Buffer, shadow: bool) -> None:
        """Point every tensor tiermem bound to ``b`` at the managed range or at the shadow."""
        live = [t for t in (r() for r in b.bindings) if t is not None]
        b.bindings = [weakref.ref(t) for t in live]
        if not live:
            return
        ptr = b.shadow.ptr if shadow else b.ptr
        raw = self.backend.torch_view(ptr, b.nbytes, b.token(internal=True, shadow=shadow))
        base = raw.view(live[0].dtype).view(live[0].shape)
        for t in live:
            t.data = base

    def _detach_for_discard(self, b: Buffer) -> bool:
        """Re-point ``b``'s bindings at its shadow; True if nothing else still refers to the
        managed range, so it may be discarded (NOTE [views and the fast paths])."""
        if not b.tokens:      # no view of any kind: nothing else can point at the range
            self._rebind(b, shadow=True)
            return True
        if b.foreign_views():
            return False
        old = [weakref.ref(t) for t in list(b.tokens) if not t.shadow]
        self._rebind(b, shadow=True)
        if any(r() is not None for r in old):
            self._rebind(b, shadow=False)
            return False
        return True

    def materialize(self, b: Buffer, writable: bool = True) -> None:
        """Get ``b`` ready for a foreign view: bring data that lives only in the shadow back into
        the managed range (onto the device if the budget allows, else into host pages), and, for a
        view that may write, stop trusting the host copies that make eviction free."""
        with self._lock:
            self._bring_back(b)
            if b.where is None:
                b.where = Location.HOST   # a view may fill it: its pages appear on the host
            if writable:
                b.shadow_valid = False
                b.host_valid = False

    def _bring_back(self, b: Buffer) -> None:
        if b.pending is not None and not b.pending.done():
            b.pending.wait()   # a view must not see a move still in flight (the device waits, not the host)
        if not b.in_shadow:
            b.last_use = next(self._tick)
            return
        with self._lock:
            try:
                self.prefetch([b]).synchronize()
                return
            except OutOfBudgetError:
                pass
            if b.parked:   # its pages go too: the host pages below replace them
                self._unpark(b, pages_gone=True)
            side = self.um_stream("h2d")
            self._fresh_pages([b], Location.HOST, side)
            _, ev = Lane(self.backend, side).run([(b.ptr, b.shadow.ptr, b.nbytes)], after=())
            self.backend.synchronize(ev)
            self._rebind(b, shadow=False)   # first: if it fails, the data is still where they point
            b.in_shadow = False

    def owner_of(self, ptr: int) -> Any:
        """The live internal buffer whose managed range (or shadow) holds address ``ptr``, or None.
        For integrations that get raw pointers back (the CuPy allocator's arrays)."""
        return self._owner_of(int(ptr))

    # -- telemetry ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The flat stats dict; keys are documented in tiermem/core/stats.py."""
        with self._lock:
            self.reap()
        out = self.accounting.flat()
        g = self.backend.guard
        pools = self.backend.pool_bytes()
        out.update({
            "managed.reserved_bytes.current": g.reserved, "managed.reserved_bytes.peak": g.peak,
            "managed.cap_bytes": g.limit, "managed.refused_count": g.refused,
            "managed.pool_cached_bytes": pools["cached"],
            "budget_bytes": -1 if self._budget is None else self._budget,
            "shadow_bytes.current": self._shadow_bytes,
            "parked_bytes.current": self._parked,
            "staging_bytes.current": self.staging_bytes,
            "staging.refused_count": self._staging.refused,
        })
        return out

    def memory_summary(self) -> str:
        """A readable report of the stats, one row per role that has been used."""
        return summary(self.stats(), self.device, self.backend.capabilities())

    def close(self) -> None:
        """Wait for outstanding moves, give parked pages back, release cached pool blocks, and
        destroy tiermem's streams (a later move makes new ones)."""
        self.synchronize()
        self.trim()
        self.backend.release_cached()
        with self._lock:
            # Every stream's work is done (synchronize); events recorded on them stay valid.
            streams = list(self._streams.values()) + self._staging.drop_streams()
            self._streams.clear()
            for s in streams:
                self.backend.destroy_stream(s)
