"""The engine: one device's tiered memory, composed of small parts around its one backend.

An :class:`Engine` owns one device's tiered memory; :class:`tiermem.Tier` (in _tier.py) is the
engine with the adapters' entry points (wrap, wrap_module, wrap_training, the CuPy allocator)
on top, so that this layer imports none of them (tests/test_layers.py). It talks to CUDA only
through its backend (``cuda.backend.CudaBackend`` on a GPU, a fake one in the CPU tests), so all
of its policy, budget and accounting logic runs without a GPU.

Each part owns one concern, and the parts talk through their public methods, the way RMM's
resource adaptors wrap one allocator:
  - core/books.py, ``Books``: the lock, the live buffers, the counters the budget checks;
  - core/budget.py, ``Budget``: the configured budget and the handles' leases on it;
  - core/sidestreams.py, ``SideStreams``: tiermem's side streams and the moves in flight;
  - core/advice.py, ``Advisor``: policies and their CUDA advice;
  - core/parking.py, ``Parking``: parked pages (NOTE [parked pages]);
  - core/moves.py, ``Moves``: refills and evictions (NOTE [eviction paths], NOTE [failed moves]);
  - core/eviction.py, ``Eviction``: room within the budget;
  - core/placement.py, ``Placement``: new buffers, their first place, and their end.
The engine composes them and is the face the tensors and the adapters call.
"""
from __future__ import annotations

import math
import numbers
import operator
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..base import dtypes as _dtypes
from ..base.limits import budget_setting, cap_setting, resolve_budget
from ..cuda.backend import Backend
from ..cuda.staging import Staging, ring_slot
from ..errors import ConfigError, ConfigTypeError, OutOfBudgetError
from ..roles import DEFAULT_POLICIES, Location, Policy, PolicyTable, Role, as_location, check_policy
from .advice import Advisor
from .bindings import rebind
from .books import Books
from .budget import Budget
from .eviction import Eviction
from .leases import BudgetLease
from .moves import Moves
from .parking import Parking
from .placement import Placement
from .ranges import GROUP_ALIGN, coalesce, member_span  # noqa: F401 - importable from here, as before the split
from .report import summary
from .sidestreams import UM_STREAMS, SideStreams  # noqa: F401 - importable from here, as before the split
from .stats import Accounting
from .stream import Lane
from .tensor import Buffer, TieredTensor, tiered_list
from .transfer import Transfer

__all__ = ["Engine", "check_empty"]


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
        configured = resolve_budget(budget, total=backend.capabilities().total_memory)
        self.accounting = Accounting()
        # The parts (module docstring), each around the one backend. Not for users: they change
        # the books as the engine's methods do.
        self.staging = Staging(backend, staging)
        self.books = Books(self.accounting, self.staging, configured)
        self.streams = SideStreams(backend, self.accounting, self.books.lock)
        self.advisor = Advisor(backend, self.accounting, table, self.books.lock)
        self.parking = Parking(backend, self.books, self.streams, self.advisor)
        self.moves = Moves(backend, self.books, self.streams, self.advisor, self.parking)
        self.eviction = Eviction(self.books, self.streams, self.parking, self.moves)
        self.budgeting = Budget(backend, self.books, configured, self.eviction.hold_to)
        self.placement = Placement(backend, self.books, self.advisor, self.eviction, self.moves)

    # -- settings -------------------------------------------------------------------------------
    @property
    def budget(self) -> int | None:
        """Bytes tiermem may keep resident on the device (NOTE [device budget]); None: no limit.
        The configured budget where there is one, else the sum of the handles' leases (NOTE
        [budget leases] in core/leases.py)."""
        return self.books.budget

    @property
    def configured_budget(self) -> int | None:
        """The budget the user set (``Tier(budget=)``, ``configure``, ``set_budget``); None: none."""
        return self.budgeting.configured

    def set_budget(self, budget: int | str | None) -> int | None:
        """Change the configured budget, evicting at once what no longer fits. Returns the old
        configured budget. A budget smaller than the live leases is refused
        (:class:`OutOfBudgetError`), changing nothing."""
        return self.budgeting.set(budget)

    def lease_room(self) -> int | None:
        """Bytes a new lease may take (NOTE [budget leases]): the configured budget less the live
        leases; None where no budget is configured, so that any lease fits."""
        return self.budgeting.room()

    def lease(self, nbytes: int, owner: str) -> BudgetLease:
        """Take ``nbytes`` of the budget for ``owner`` (a handle), until the returned lease is
        released (NOTE [budget leases]). Without a configured budget, the enforced budget grows
        by ``nbytes``; with one, the lease must fit its room (:meth:`lease_room`), else
        :class:`OutOfBudgetError`."""
        return self.budgeting.lease(nbytes, owner)

    @property
    def leases(self) -> tuple[BudgetLease, ...]:
        """The live budget leases, in the order taken."""
        return self.budgeting.leases

    @property
    def resident_bytes(self) -> int:
        """Device bytes tiermem holds (whole pages), what the budget limits: live data placed on
        the device, and the parked pages of evicted tensors (``parked_bytes``)."""
        return self.books.resident

    @property
    def staging_bytes(self) -> int:
        """Device bytes of the staging rings (NOTE [staging ring]), 0 until they are first used.
        Under a budget they count against it, beside ``resident_bytes``."""
        return self.staging.nbytes

    def held_bytes(self) -> int:
        """What the budget limits: tensors' pages and the staging rings."""
        return self.books.held()

    @property
    def parked_bytes(self) -> int:
        """Device pages kept from shadow evictions for the next refill (NOTE [parked pages])."""
        return self.books.parked

    def trim(self) -> int:
        """Give every parked page (NOTE [parked pages]) and the staging rings (NOTE [staging
        ring]) back to the driver, so other allocators can use them. Blocks until that is done;
        returns the bytes given back."""
        with self.lock:
            self.reap()
            return self.parking.drop(self.books.parked_bufs()) + self.staging.release(self.um_stream)

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
        sizes = [math.prod(sh) * _dtypes.itemsize(dt) for sh, dt in specs]
        bufs = self.placement.new_group(self, sizes, role, names_l, policy, policy_changes)
        return [TieredTensor(b, sh, dt) for b, (sh, dt) in zip(bufs, specs)]

    def resolve_policy(self, role: Role, policy: Policy | None, changes: Mapping[str, Any]) -> Policy:
        return self.advisor.resolve_policy(role, policy, changes)

    def new_buffer(self, nbytes: int, role: Role | str, policy: Policy | None,
                   changes: Mapping[str, Any], name: str | None) -> Buffer:
        return self.placement.new_buffer(self, nbytes, role, policy, changes, name)

    def page_range(self, buf: Buffer) -> tuple[int, int]:
        """The range to advise and prefetch: whole pages when the buffer has them to itself (a
        group member, a large buffer), else just its bytes (its pages are shared)."""
        return self.advisor.page_range(buf)

    def apply_advice(self, buf: Buffer, policy: Policy | None = None) -> None:
        self.advisor.apply(buf, policy)

    def change_policies(self, bufs: Sequence[Buffer], policy: Policy) -> None:
        """Give every buffer of ``bufs`` ``policy`` and apply its advice, a group's members in
        one call per advice (:meth:`Advisor.change_policies`)."""
        self.advisor.change_policies(bufs, policy)

    def change_policy(self, buf: Buffer, policy: Policy | None, changes: Mapping[str, Any]) -> Policy:
        return self.advisor.change_policy(buf, policy, changes)

    def place_new(self, buf: Buffer) -> None:
        """Give a new buffer its first place, within the budget (:meth:`Placement.place`)."""
        self.placement.place([buf])

    def reserve(self, nbytes: int, role: Role) -> None:
        """Count device memory tiermem uses outside managed buffers (a streaming window) against
        the budget, making room first; raises OutOfBudgetError if it cannot fit."""
        self.placement.reserve(nbytes, role)

    def unreserve(self, nbytes: int, role: Role) -> None:
        self.placement.unreserve(nbytes, role)

    def release_buffer(self, buf: Buffer) -> None:
        """A TieredTensor let go of its buffer; the buffer lives on while views hold it."""
        buf.freed = True

    def buffer_gone(self, buf: Buffer) -> None:
        """The last owner of ``buf`` went: give its memory back (NOTE [finalizer race] in
        core/placement.py). Called from __del__."""
        self.placement.gone(buf)

    # -- streams --------------------------------------------------------------------------------
    def stream_handle(self, stream: Any) -> int:
        """A stream handle from None (the current stream), an int, a torch or a CuPy stream."""
        return self.streams.stream_handle(stream)

    def side_stream(self, direction: str) -> int:
        return self.streams.side(direction)

    def um_stream(self, direction: str) -> int:
        return self.streams.um(direction)

    def reap(self) -> None:
        self.streams.reap()

    # -- the engine's interface to tiermem's adapters (pytorch/, inference/, training/, cupy/) ----
    # Not for users: these change the books and must be called as the adapters do (NOTE
    # [budget leases], [parked pages], [failed moves]). They are named, not private, so that the
    # interface between modules is visible; tests/test_layers.py checks that no module reaches
    # into another's private members.
    @property
    def lock(self) -> threading.RLock:
        """The lock that guards the books; hold it around a read-then-change of them."""
        return self.books.lock

    def inflight(self) -> list[Transfer]:
        """The moves enqueued and not yet reaped."""
        return self.streams.inflight()

    def track(self, tr: Transfer) -> None:
        """Count a move an adapter enqueued itself (``synchronize`` then waits for it too)."""
        self.streams.track(tr)

    def tick(self) -> int:
        """The next value of the use clock (``last_use``: the coldest is evicted first)."""
        return self.books.tick()

    def count_resident(self, b: Buffer, delta: int) -> None:
        """``b``'s pages came to (``delta`` > 0) or left the device outside tiermem's moves."""
        with self.lock:
            self.books.on_resident(b.role, delta)

    def synchronize(self) -> None:
        """Block until every move tiermem has enqueued is done."""
        self.streams.synchronize()

    def make_room(self, need: int, exclude: set[Buffer]) -> None:
        """Make ``need`` more bytes fit the budget (:meth:`Eviction.make_room`)."""
        self.eviction.make_room(need, exclude)

    def move_in(self, todo: list[Buffer], stream: Any, non_blocking: bool,
                pairs: Mapping[Buffer, Buffer] | None = None) -> Transfer:
        """Enqueue the moves of ``todo`` to the device (:meth:`Moves.move_in`)."""
        return self.moves.move_in(todo, stream, non_blocking, pairs)

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
        with self.lock:
            self.reap()
            todo = [b for b in bufs if b.where is not Location.DEVICE or b.in_shadow]
            pairs = self.eviction.room_for(todo, exclude=set(bufs)) if todo else {}
            for b in bufs:
                b.last_use = self.books.tick()
            if not todo:
                return Transfer.done_now("h2d")
            return self.moves.move_in(todo, stream, non_blocking, pairs)

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
        return self.moves.evict(self._bufs(tensors, "evict"), stream=stream, non_blocking=non_blocking, release=release,
                                path=_path, for_room=_for_room)

    # -- views ----------------------------------------------------------------------------------
    def materialize(self, b: Buffer, writable: bool = True) -> None:
        """Get ``b`` ready for a foreign view: bring data that lives only in the shadow back into
        the managed range (onto the device if the budget allows, else into host pages), and, for a
        view that may write, stop trusting the host copies that make eviction free."""
        with self.lock:
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
            b.last_use = self.books.tick()
            return
        with self.lock:
            try:
                self.prefetch([b]).synchronize()
                return
            except OutOfBudgetError:
                pass
            if b.parked:   # its pages go too: the host pages below replace them
                self.books.unpark(b, pages_gone=True)
            side = self.um_stream("h2d")
            self.moves.fresh_pages([b], Location.HOST, side)
            _, ev = Lane(self.backend, side).run([(b.ptr, b.shadow.ptr, b.nbytes)], after=())
            self.backend.synchronize(ev)
            rebind(self.backend, b, shadow=False)   # first: if it fails, the data is still where they point
            b.in_shadow = False

    def owner_of(self, ptr: int) -> Any:
        """The live internal buffer whose managed range (or shadow) holds address ``ptr``, or None.
        For integrations that get raw pointers back (the CuPy allocator's arrays)."""
        return self.placement.owner_of(int(ptr))

    # -- telemetry ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The flat stats dict; keys are documented in tiermem/core/stats.py."""
        with self.lock:
            self.reap()
        out = self.accounting.flat()
        g = self.backend.guard
        pools = self.backend.pool_bytes()
        budget = self.books.budget
        out.update({
            "managed.reserved_bytes.current": g.reserved, "managed.reserved_bytes.peak": g.peak,
            "managed.cap_bytes": g.limit, "managed.refused_count": g.refused,
            "managed.pool_cached_bytes": pools["cached"],
            "budget_bytes": -1 if budget is None else budget,
            "shadow_bytes.current": self.books.shadow_bytes,
            "parked_bytes.current": self.books.parked,
            "staging_bytes.current": self.staging_bytes,
            "staging.refused_count": self.staging.refused,
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
        with self.lock:
            # Every stream's work is done (synchronize); events recorded on them stay valid.
            streams = self.streams.drop() + self.staging.drop_streams()
            for s in streams:
                self.backend.destroy_stream(s)
