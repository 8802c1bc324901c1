"""Every backend call of every public operation, failed in turn (the SQLite way: fail the Nth call,
for every N), on the fake backend.

Each scene builds a Tier holding tensors of known bytes, and names one operation. The sweep first
counts the faultable backend calls the operation makes (``FakeBackend.counting``), then makes
one test case per (scene, call, failure kind): the Nth call fails with a CUDA error, an
out-of-memory error (allocations only) or a KeyboardInterrupt. After the failure:

  - the error is tiermem's (a TierMemError that keeps the CUDA error's name), or the interrupt
    itself; an operation may also absorb a failure it has a fallback for;
  - the Tier's books match the fake's live allocations (managed, pinned, device), and each
    buffer's state is coherent (bound tensors point where the data lives);
  - every tensor the test holds has its bytes (the fake poisons discarded memory);
  - the same operation then succeeds, the bytes are still there, and once everything is let go,
    nothing is left allocated.

``wrap_training`` (adoption, the traced and a planned step with activation swap, unwrap) has its
sweep in tests/test_train_faults.py; ``wrap_module``'s failures are in tests/test_module_use.py.
"""
from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from fakes import FakeBackend, _FakeBlock
from helpers import MiB, fault_params
from torch import nn

import tiermem
from tiermem import Location, TierMemError
from tiermem.core.placement import _SharedBlock
from tiermem.cuda.staging import StagingRing
from tiermem.pytorch.wrap import tiered_of

RNG = np.random.default_rng(18)
DATA = np.random.default_rng(0).integers(0, 256, 12 << 20, dtype=np.uint8)   # never written


# -- what a scene holds, and reading it behind tiermem's back --------------------------------------

def raw(fake: FakeBackend, ptr: int, n: int) -> np.ndarray:
    base, arr = fake._find(ptr)
    return arr[ptr - base:ptr - base + n]


def tt_bytes(fake: FakeBackend, tt: Any) -> torch.Tensor:
    """Where a TieredTensor's data lives now: its shadow while it is in it, else its range."""
    b = tt._b
    return raw(fake, b.shadow.ptr if b.in_shadow else b.ptr, b.nbytes)


def t_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def rand_bytes(n: int) -> np.ndarray:
    """``n`` random bytes, not to be written (a slice of one block drawn once: drawing fresh ones
    for every tensor of ~2,000 cases was a third of the sweep's time)."""
    off = int(RNG.integers(0, DATA.size - n))
    return DATA[off:off + n]


def filled(tier: tiermem.Tier, n: int, role: str = "activation", **kw: Any) -> tuple[Any, torch.Tensor]:
    tt = tier.empty(n, "uint8", role=role, **kw)
    data = rand_bytes(n)
    tt.torch().copy_(torch.from_numpy(data))
    return tt, data


def param(nbytes: int, grad: bool = True) -> nn.Parameter:
    return nn.Parameter(torch.from_numpy(rand_bytes(nbytes).copy()).view(torch.float32), requires_grad=grad)


@dataclasses.dataclass
class Scene:
    tier: tiermem.Tier
    op: Callable[[], Any]
    tts: list[tuple[Any, torch.Tensor]] = dataclasses.field(default_factory=list)      # TieredTensors
    tensors: list[tuple[Any, torch.Tensor]] = dataclasses.field(default_factory=list)  # torch tensors (wrapped or not)
    keep: list[Any] = dataclasses.field(default_factory=list)                          # views the user keeps
    again: Callable[[], Any] | None = None       # the next operation, if not the same one
    adopting: list[Any] = dataclasses.field(default_factory=list)  # tensors a failed wrap must leave as they were


def held_tt(sc: Scene, tt: Any, data: torch.Tensor) -> Any:
    sc.tts.append((tt, data))
    return tt


# -- the scenes ---------------------------------------------------------------------------------------
SCENES: dict[str, Callable[[FakeBackend], Scene]] = {}


def scene(fn: Callable[[FakeBackend], Scene]) -> Callable[[FakeBackend], Scene]:
    SCENES[fn.__name__] = fn
    return fn


def with_resident(fake: FakeBackend, op: Callable[[tiermem.Tier], Any], n: int = 2, **tier_kw: Any) -> Scene:
    t = tiermem.Tier(backend=fake, **tier_kw)
    sc = Scene(t, lambda: op(t))
    for _ in range(n):
        held_tt(sc, *filled(t, 2 * MiB))
    return sc


@scene
def empty(fake):
    return with_resident(fake, lambda t: t.empty(2 * MiB, "uint8", role="activation"))


@scene
def empty_small(fake):
    return with_resident(fake, lambda t: t.empty(5000, "uint8", role="gradient"), n=1)


@scene
def empty_budget(fake):
    """Two resident tensors fill the budget: the new one evicts (and releases) the colder one."""
    return with_resident(fake, lambda t: t.empty(2 * MiB, "uint8", role="workspace"), budget=4 * MiB)


GROUP = [((2 * MiB) // 4, "float32"), (1000, "float32"), (2 * MiB, "uint8")]


@scene
def empty_group(fake):
    return with_resident(fake, lambda t: t.empty_group(GROUP, role="gradient"), n=1)


@scene
def empty_group_budget(fake):
    return with_resident(fake, lambda t: t.empty_group(GROUP, role="gradient"), budget=6 * MiB)


def wrap_scene(fake: FakeBackend, op: Callable[[tiermem.Tier, Any], Any], grad: bool = True, **tier_kw: Any) -> Scene:
    t = tiermem.Tier(backend=fake, **tier_kw)
    other = param(2 * MiB)
    t.wrap(other)
    p = param(2 * MiB, grad)
    sc = Scene(t, lambda: None if tiered_of(p) is not None else op(t, p), adopting=[p])
    sc.tensors += [(other, t_bytes(other).copy()), (p, t_bytes(p).copy())]
    held_tt(sc, *filled(t, 2 * MiB))
    return sc


@scene
def wrap(fake):
    return wrap_scene(fake, lambda t, p: t.wrap(p))


@scene
def wrap_frozen(fake):
    return wrap_scene(fake, lambda t, p: t.wrap(p), grad=False)


@scene
def wrap_budget(fake):
    return wrap_scene(fake, lambda t, p: t.wrap(p), budget=4 * MiB)


@scene
def wrap_over_budget(fake):
    """The tensor is larger than the budget: it is filled in host pages."""
    return wrap_scene(fake, lambda t, p: t.wrap(p), budget=MiB)


def group_scene(fake: FakeBackend, on_host: bool) -> Scene:
    t = tiermem.Tier(backend=fake)
    ps = [param(2 * MiB), param(4096), param(2 * MiB + 4096)]
    sc = Scene(t, lambda: None if tiered_of(ps[0]) is not None else
               tiermem.pytorch.wrap.wrap_group(t, ps, "weight", on_host=on_host), adopting=ps)
    sc.tensors += [(p, t_bytes(p).copy()) for p in ps]
    held_tt(sc, *filled(t, 2 * MiB))
    return sc


@scene
def wrap_group(fake):
    return group_scene(fake, on_host=False)


@scene
def wrap_group_on_host(fake):
    return group_scene(fake, on_host=True)


def unwrap_scene(fake: FakeBackend, evicted: bool, **tier_kw: Any) -> Scene:
    t = tiermem.Tier(backend=fake, **tier_kw)
    p, q = param(2 * MiB), param(4096)
    tp, tq = t.wrap(p), t.wrap(q)
    if evicted:
        t.evict([tp, tq])
    sc = Scene(t, lambda: [t.unwrap(x) for x in (p, q) if tiered_of(x) is not None])
    sc.tensors += [(p, t_bytes(p).copy()), (q, t_bytes(q).copy())]
    return sc


@scene
def unwrap(fake):
    return unwrap_scene(fake, evicted=False)


@scene
def unwrap_evicted(fake):
    return unwrap_scene(fake, evicted=True)


@scene
def unwrap_parked(fake):
    return unwrap_scene(fake, evicted=True, budget=8 * MiB)


def prefetch_scene(fake: FakeBackend, prep: Callable[[tiermem.Tier, Scene], list], **tier_kw: Any) -> Scene:
    t = tiermem.Tier(backend=fake, **tier_kw)
    sc = Scene(t, lambda: None)
    todo = prep(t, sc)
    sc.op = lambda: t.prefetch(todo)
    return sc


def evicted(t: tiermem.Tier, sc: Scene, sizes=(2 * MiB,), **kw: Any) -> list:
    out = [held_tt(sc, *filled(t, n, **kw)) for n in sizes]
    t.evict(out)
    return out


@scene
def prefetch_shadow(fake):
    """No budget: the evicted tensor has no pages; it gets fresh ones and its shadow copied in."""
    return prefetch_scene(fake, lambda t, sc: evicted(t, sc, (2 * MiB, 4 * MiB)))


@scene
def prefetch_parked(fake):
    return prefetch_scene(fake, lambda t, sc: evicted(t, sc, (2 * MiB, 5000)), budget=16 * MiB)


@scene
def prefetch_read_only_parked(fake):
    """A read-only parked tensor whose pages still hold its data: its refill moves nothing."""
    def prep(t, sc):
        x = evicted(t, sc, read_only=True)
        t.prefetch(x)
        t.evict(x)
        return x
    return prefetch_scene(fake, prep, budget=16 * MiB)


@scene
def prefetch_trade(fake):
    """The budget holds one of two: the refill evicts the other and takes its pages."""
    def prep(t, sc):
        a = held_tt(sc, *filled(t, 2 * MiB))
        held_tt(sc, *filled(t, 2 * MiB))        # evicts a, releasing its pages
        return [a]
    return prefetch_scene(fake, prep, budget=2 * MiB)


@scene
def prefetch_trade_roles(fake):
    """As prefetch_trade, across roles: the traded pages get the incoming role's advice."""
    def prep(t, sc):
        a = held_tt(sc, *filled(t, 2 * MiB, role="gradient"))
        held_tt(sc, *filled(t, 2 * MiB, role="optimizer_state"))
        return [a]
    return prefetch_scene(fake, prep, budget=2 * MiB)


@scene
def prefetch_um(fake):
    """Evicted through Unified Memory (a view was alive then): a plain prefetch brings it in."""
    def prep(t, sc):
        tt = held_tt(sc, *filled(t, 2 * MiB))
        view = tt.torch()
        t.evict(tt)
        del view
        return [tt]
    return prefetch_scene(fake, prep)


@scene
def prefetch_group(fake):
    def prep(t, sc):
        tts = t.empty_group(GROUP, role="gradient")
        for tt in tts:
            data = rand_bytes(tt.nbytes)
            tt.torch().view(-1).view(torch.uint8).copy_(torch.from_numpy(data))
            held_tt(sc, tt, data)
        t.evict(tts)
        return tts
    return prefetch_scene(fake, prep, budget=16 * MiB)


@scene
def prefetch_staged(fake):
    """4 MiB through a ring of two 1 MiB slots (NOTE [staging ring]), into fresh pages."""
    return prefetch_scene(fake, lambda t, sc: evicted(t, sc, (4 * MiB,)), staging="2MiB")


@scene
def prefetch_wrapped(fake):
    """A wrapped parameter in its shadow: the refill re-points it at the managed range."""
    def prep(t, sc):
        p = param(2 * MiB)
        tt = t.wrap(p)
        sc.tensors.append((p, t_bytes(p).copy()))
        t.evict(tt)
        return [tt]
    return prefetch_scene(fake, prep, budget=2 * MiB)


def evict_scene(fake: FakeBackend, prep: Callable[[tiermem.Tier, Scene], list], release: bool | None = None,
                **tier_kw: Any) -> Scene:
    t = tiermem.Tier(backend=fake, **tier_kw)
    sc = Scene(t, lambda: None)
    todo = prep(t, sc)
    sc.op = lambda: t.evict(todo, release=release)
    return sc


def resident(t: tiermem.Tier, sc: Scene, sizes=(2 * MiB,), **kw: Any) -> list:
    return [held_tt(sc, *filled(t, n, **kw)) for n in sizes]


@scene
def evict_copy(fake):
    return evict_scene(fake, lambda t, sc: resident(t, sc, (2 * MiB, 4 * MiB)))


@scene
def evict_clean(fake):
    """Read-only with a valid shadow: the eviction is a discard alone."""
    def prep(t, sc):
        x = resident(t, sc, read_only=True)
        t.evict(x)
        t.prefetch(x)
        return x
    return evict_scene(fake, prep)


@scene
def evict_park(fake):
    return evict_scene(fake, lambda t, sc: resident(t, sc, (2 * MiB, 5000)), budget=16 * MiB)


@scene
def evict_release(fake):
    """release=True: a parked tensor's pages and the evicted ones' go back to the driver."""
    def prep(t, sc):
        a = resident(t, sc)
        t.evict(a)                      # parked
        return a + resident(t, sc)
    return evict_scene(fake, prep, release=True, budget=16 * MiB)


@scene
def evict_um(fake):
    """A live view forces Unified Memory's write-back; a small tensor goes that way too."""
    def prep(t, sc):
        x = resident(t, sc, (2 * MiB, 5000))
        sc.keep.append((x[0].torch(), sc.tts[0][1]))
        return x
    return evict_scene(fake, prep)


@scene
def evict_collapse(fake):
    """A frozen weight's read-mostly duplicate collapses onto its host copy."""
    def prep(t, sc):
        p = param(2 * MiB, grad=False)
        tt = t.wrap(p)
        sc.tensors.append((p, t_bytes(p).copy()))
        t.prefetch(tt)
        return [tt]
    return evict_scene(fake, prep)


@scene
def evict_wrapped(fake):
    """Wrapped parameters are re-pointed at their shadows."""
    def prep(t, sc):
        ps = [param(2 * MiB), param(2 * MiB)]
        sc.tensors += [(p, t_bytes(p).copy()) for p in ps]
        return [t.wrap(p) for p in ps]
    return evict_scene(fake, prep)


@scene
def evict_staged(fake):
    return evict_scene(fake, lambda t, sc: resident(t, sc, (4 * MiB, 2 * MiB)), staging="2MiB")


@scene
def evict_mixed(fake):
    """One call, every path: a copy, a clean discard, Unified Memory, a wrapped parameter."""
    def prep(t, sc):
        clean = resident(t, sc, read_only=True)
        t.evict(clean)
        t.prefetch(clean)
        p = param(2 * MiB)
        sc.tensors.append((p, t_bytes(p).copy()))
        return clean + resident(t, sc, (2 * MiB, 5000)) + [t.wrap(p)]
    return evict_scene(fake, prep)


@scene
def make_room(fake):
    """A prefetch under a full budget evicts the coldest tensors (copies, then a discard)."""
    def prep(t, sc):
        new = evicted(t, sc, (4 * MiB,))
        resident(t, sc, (2 * MiB, 2 * MiB))
        return new
    return prefetch_scene(fake, prep, budget=5 * MiB, staging="off")


@scene
def view_bring_back(fake):
    """A view of a tensor in its shadow brings it back first."""
    t = tiermem.Tier(backend=fake)
    sc = Scene(t, lambda: None)
    (tt,) = evicted(t, sc)
    sc.op = lambda: tt.torch(writable=False)
    return sc


@scene
def view_bring_back_to_host(fake):
    """No room in the budget: the shadow comes back into host pages."""
    t = tiermem.Tier(backend=fake, budget=2 * MiB)
    sc = Scene(t, lambda: None)
    (tt,) = evicted(t, sc)
    other = held_tt(sc, *filled(t, 2 * MiB, role="workspace"))   # never evicted: the budget is full
    assert other.is_resident
    sc.op = lambda: tt.torch(writable=False)
    return sc


def parked_with_rings(fake: FakeBackend) -> tuple[tiermem.Tier, Scene]:
    t = tiermem.Tier(backend=fake, budget=64 * MiB, staging="2MiB")
    sc = Scene(t, lambda: None)
    evicted(t, sc, (4 * MiB, 2 * MiB, 5000))       # parked; the eviction's ring allocated
    resident(t, sc)
    return t, sc


@scene
def empty_over_budget(fake):
    """Larger than the budget: the new tensor is made host-preferred and read in place."""
    return with_resident(fake, lambda t: t.empty(4 * MiB, "uint8", role="activation"), n=1, budget=3 * MiB)


@scene
def prefetch_in_flight(fake):
    """The eviction it follows is still in flight (events not done): the refill waits for it
    on the device, across streams."""
    def prep(t, sc):
        x = resident(t, sc, (2 * MiB, 5000))
        fake.events_pending = True
        t.evict(x, non_blocking=True)
        return x
    return prefetch_scene(fake, prep, budget=16 * MiB)


@scene
def trim(fake):
    t, sc = parked_with_rings(fake)
    sc.op = t.trim
    return sc


@scene
def trim_read_only(fake):
    """A read-only parked tensor's pages hold its data: its refill copies nothing. Given back
    with a small tensor's pages (discard, then migration), then refilled."""
    t = tiermem.Tier(backend=fake, budget=64 * MiB, staging="off")
    sc = Scene(t, lambda: None)
    x = resident(t, sc, (2 * MiB,), read_only=True) + resident(t, sc, (5000,))
    t.evict(x)
    t.prefetch(x)
    t.evict(x)                  # parked, and intact
    sc.op = t.trim
    sc.again = lambda: t.prefetch(x)
    return sc


@scene
def view_bring_back_wrapped(fake):
    """A wrapped parameter in its shadow, no room in the budget: a view brings it back into host
    pages, and the parameter follows."""
    t = tiermem.Tier(backend=fake, budget=2 * MiB)
    sc = Scene(t, lambda: None)
    p = param(2 * MiB)
    sc.tensors.append((p, t_bytes(p).copy()))
    tt = t.wrap(p)
    t.evict(tt)
    held_tt(sc, *filled(t, 2 * MiB, role="workspace"))   # takes the parked pages; never evicted
    sc.op = lambda: tt.torch(writable=False)
    return sc


@scene
def close(fake):
    t, sc = parked_with_rings(fake)
    t.evict([sc.tts[-1][0]], non_blocking=True)
    sc.op = t.close
    return sc


@scene
def set_budget(fake):
    """A smaller budget evicts what no longer fits."""
    t, sc = parked_with_rings(fake)
    resident(t, sc, (2 * MiB, 2 * MiB))
    sc.op = lambda: t.set_budget(2 * MiB)
    return sc


def cupy_scene(fake: FakeBackend, free: bool, **tier_kw: Any) -> Scene:
    """The CuPy allocator's malloc and free as make_allocator routes them, without CuPy: malloc is
    ``residency(tier).new_array`` (a placed buffer, and the token the array's memory owns); free
    is the array's memory letting its token go. Two resident tensors share the tier."""
    from tiermem.cupy.scoped import residency
    sc = with_resident(fake, lambda t: None, **tier_kw)
    t, arrays = sc.tier, []
    state = residency(t)
    if free:
        arrays.append(state.new_array(3 * MiB, "workspace")[1])
        sc.op = lambda: arrays.clear()
        sc.again = lambda: arrays.append(state.new_array(3 * MiB, "workspace")[1]) or arrays.clear()
    else:
        sc.op = lambda: arrays.append(state.new_array(3 * MiB, "workspace")[1])
    return sc


@scene
def cupy_malloc(fake):
    return cupy_scene(fake, free=False)


@scene
def cupy_malloc_budget(fake):
    """No room under the budget: the allocation evicts a resident tensor first."""
    return cupy_scene(fake, free=False, budget=6 * MiB)


@scene
def cupy_free(fake):
    return cupy_scene(fake, free=True)


# -- the checks -----------------------------------------------------------------------------------------

def check_books(tier: tiermem.Tier, fake: FakeBackend) -> None:
    """The Tier's accounting equals the fake's live allocations, and every buffer is coherent.
    (No gc.collect: tiermem's buffers form no reference cycles, so what nothing refers to is gone
    already; a full collection costs a third of a second in this process.)"""
    tier.reap()
    bufs = tier.books.live()
    allocs = {}
    for b in bufs:
        h = b.block._handle
        own = h.block if isinstance(h, _SharedBlock) else b.block
        assert isinstance(own, _FakeBlock)
        allocs[own.ptr] = own.nbytes
    live = fake.live()
    managed = {p: a.nbytes for p, a in fake._arrays.items() if fake._kind[p] == "managed"}
    assert set(managed) == set(allocs), "managed allocations the Tier does not own (or lost)"
    assert live["managed"] == sum(allocs.values()) == fake.guard.reserved
    shadows = sum(b.shadow.nbytes for b in bufs if b.shadow is not None)
    assert live["pinned"] == shadows == tier.books.shadow_bytes
    assert live["device"] == tier.staging_bytes
    for ring in tier.staging.rings.values():
        assert ring is None or not ring.allocated or ring._stream is not None, "a ring without its stream"
    assert tier.books.parked == sum(b.span for b in bufs if b.parked)
    assert tier.books.resident == sum(b.span for b in bufs if b.where is Location.DEVICE or b.parked)
    s = tier.stats()
    assert (s["allocated_bytes.all.current"], s["allocation_count.all.current"]) == (
        sum(b.nbytes for b in bufs), len(bufs))
    assert s["resident_bytes.all.current"] == tier.books.resident
    assert s["parked_bytes.current"] == tier.books.parked
    for b in bufs:
        if b.parked:
            assert b.in_shadow
        if b.in_shadow:
            assert b.shadow is not None and b.where is Location.HOST
        at = b.shadow.ptr if b.in_shadow else b.ptr
        for t in (r() for r in b.bindings):
            if t is not None:
                assert t.data_ptr() == at, "a bound tensor points where the data is not"


def check_bytes(fake: FakeBackend, sc: Scene) -> None:
    for tt, data in sc.tts:
        if not tt.freed:     # an unwrap that succeeded frees it
            assert np.array_equal(tt_bytes(fake, tt), data), f"{tt!r} lost its bytes"
    for t, data in sc.tensors:
        assert np.array_equal(t_bytes(t), data), "a tensor lost its bytes"
        tt = tiered_of(t)
        if tt is not None:
            assert np.array_equal(tt_bytes(fake, tt), data), "a wrapped tensor's buffer lost its bytes"
    for view, data in sc.keep:
        assert np.array_equal(t_bytes(view), data), "a view lost its bytes"


def check_untouched(fake: FakeBackend, sc: Scene) -> None:
    """A failed wrap leaves its tensors exactly as they were: not wrapped, in their own memory."""
    for t in sc.adopting:
        assert tiered_of(t) is None, "a failed wrap left the tensor wrapped"
        assert fake.pointer_kind(t.data_ptr()) == "unregistered", "a failed wrap left the tensor in tiered memory"
        assert sc.tier.owner_of(t.data_ptr()) is None


def check_error(err: BaseException | None, kind: str, call: str, scene_name: str) -> None:
    if err is None:
        # Absorbed: only where the operation has a fallback (a staging ring the device has no
        # room for: its copies go direct).
        assert call == "device_alloc", f"{call} failed and the operation said nothing"
        return
    if kind == "interrupt":
        assert type(err) is KeyboardInterrupt, f"the interrupt became {err!r}"
        return
    assert isinstance(err, TierMemError), f"not tiermem's error: {err!r}"
    name = "cudaErrorMemoryAllocation" if kind == "oom" else "cudaErrorLaunchFailure"
    assert getattr(err, "name", None) == name or name in str(err), f"the CUDA error's name was lost: {err!r}"


def _calls(name: str) -> list[str]:
    fake = FakeBackend(total=1 << 30)
    sc = SCENES[name](fake)
    with fake.counting() as seen:
        sc.op()
    del sc
    return seen


def _cases() -> list[Any]:
    return [c for name in SCENES for c in fault_params(name, _calls(name))]


CASES = _cases()
PAIRS = {(c.values[0], c.values[1]) for c in CASES}


def run_case(name: str, n: int, call: str, kind: str) -> None:
    fake = FakeBackend(total=1 << 30)
    sc = SCENES[name](fake)
    tier = sc.tier
    fake.fail_at(n, kind)
    err = None
    try:
        sc.op()
    except BaseException as e:   # noqa: B036 - the interrupt is what is under test
        err = e
        err.__traceback__ = None  # its frames would keep the operation's buffers alive
    fake.disarm()
    assert fake.fired is not None and fake.fired[1] == call, f"call {n} is {fake.fired}, not {call}"
    check_error(err, kind, call, name)
    if err is not None:
        check_untouched(fake, sc)
    del err
    check_books(tier, fake)
    check_bytes(fake, sc)
    (sc.again or sc.op)()
    check_books(tier, fake)
    check_bytes(fake, sc)
    for tt, data in sc.tts:     # and through tiermem's own views
        if not tt.freed:
            assert np.array_equal(t_bytes(tt.torch(writable=False)), data)
    tt = data = None
    sc.tts = sc.tensors = sc.keep = []
    sc.op = sc.again = None
    del sc
    tier.close()
    gc.collect(0)
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0}, "bytes leaked"
    assert tier.resident_bytes == tier.parked_bytes == 0


@pytest.fixture(autouse=True)
def _reset_global_state():
    """conftest's reset without its gc.collect (a third of a second in this process, for each of
    ~2,000 cases): every case checks that it leaves nothing allocated, and no default Tier or role
    scope is set here."""
    import tiermem.base.default as default
    import tiermem.cupy.allocator as cp
    default.replace(None)
    cp._scope.role = None
    yield


@pytest.mark.parametrize(("name", "n", "call", "kind"), CASES)
def test_fault(name, n, call, kind):
    run_case(name, n, call, kind)


# unwrap of a bound tensor copies with torch alone, and the CuPy allocator's free gives the block
# back to the pool (trim is what returns pool memory to CUDA): they make no backend call that
# could fail.
NO_CALLS = {"unwrap", "unwrap_evicted", "unwrap_parked", "cupy_free"}


def test_fault_sweep_covers_every_scene_with_500_pairs():
    assert {c.values[0] for c in CASES} == set(SCENES) - NO_CALLS
    assert all(_calls(name) == [] for name in NO_CALLS)
    assert len(PAIRS) >= 500, len(PAIRS)


def test_fault_injection_fires_once_at_the_nth_call_and_counting_fails_nothing():
    fake = FakeBackend(total=1 << 30)
    t = tiermem.Tier(backend=fake)
    with fake.counting() as seen:
        t.empty(2 * MiB, "uint8", role="activation")
    assert seen[0] == "allocate" and len(seen) > 3
    fake.fail_at(2, "cuda")
    with pytest.raises(tiermem.CUDAError, match="cudaErrorLaunchFailure") as ei:
        t.empty(2 * MiB, "uint8", role="activation")
    assert ei.value.call == seen[1] and fake.fired == (2, seen[1], "cuda")
    t.empty(2 * MiB, "uint8", role="activation")     # once only
    with pytest.raises(ValueError):
        fake.fail_at(0)


# -- the bugs the sweep found, one test each ------------------------------------------------------

def nth(fake: FakeBackend, op: Callable[[], Any], call: str, occurrence: int = 1) -> int:
    """The index (1-based) of the ``occurrence``-th ``call`` that ``op`` makes, counted on ``fake``."""
    with fake.counting() as seen:
        op()
    return [i for i, c in enumerate(seen, 1) if c == call][occurrence - 1]


def twin(build: Callable[[FakeBackend], tuple]) -> tuple:
    """Build the same set-up twice: one to count calls on (its operation is run), one to fail."""
    return build(FakeBackend(total=1 << 30)), build(FakeBackend(total=1 << 30))


def test_fault_a_failed_eviction_leaves_every_tensor_on_the_device_with_its_bytes():
    """The first tensor's copies went into the staging ring, not all of them on to its shadow yet,
    when the second one's shadow could not be allocated: it used to be marked as in its shadow."""
    def build(fake):
        t = tiermem.Tier(backend=fake)
        (a, da), (b, db) = filled(t, 4 * MiB), filled(t, 2 * MiB)
        return fake, t, [a, b], [da, db]
    (f0, t0, tts0, _), (fake, t, tts, data) = twin(build)
    fake.fail_at(nth(f0, lambda: t0.evict(tts0), "host_alloc", 2), "oom")   # the second shadow
    with pytest.raises(tiermem.errors.CUDAOutOfMemoryError):
        t.evict(tts)
    assert fake.fired[1] == "host_alloc"
    for tt, d in zip(tts, data):
        assert (tt.location, tt.in_shadow) == (Location.DEVICE, False)
        assert np.array_equal(tt_bytes(fake, tt), d)
    assert t.resident_bytes == 6 * MiB
    t.evict(tts)
    for tt, d in zip(tts, data):
        assert tt.in_shadow and np.array_equal(t_bytes(tt.torch()), d)


def test_fault_a_wrapped_parameter_stays_with_its_data_when_an_eviction_or_refill_fails():
    def build(fake):
        t = tiermem.Tier(backend=fake, staging="off")
        p = param(2 * MiB)
        return fake, t, p, t.wrap(p), t_bytes(p).copy()
    (f0, t0, p0, tt0, _), (fake, t, p, tt, data) = twin(build)
    fake.fail_at(nth(f0, lambda: t0.evict(tt0), "copy"), "interrupt")
    with pytest.raises(KeyboardInterrupt):
        t.evict(tt)
    assert p.data_ptr() == tt.data_ptr and not tt.in_shadow and np.array_equal(t_bytes(p), data)
    t.evict(tt)
    assert p.data_ptr() == tt._b.shadow.ptr
    fake.fail_at(nth(f0, lambda: t0.prefetch(tt0), "torch_view"))
    with pytest.raises(tiermem.CUDAError):
        t.prefetch(tt)
    assert p.data_ptr() == tt._b.shadow.ptr and tt.in_shadow and np.array_equal(t_bytes(p), data)
    t.prefetch(tt)
    assert p.data_ptr() == tt.data_ptr and np.array_equal(t_bytes(p), data)


@pytest.mark.parametrize("kind", ["cuda", "interrupt"])
def test_fault_a_failed_wrap_leaves_the_model_as_it_was(kind):
    """The wrap of a frozen weight fails at its last step (the write-back to its host pages):
    the weight used to stay bound to tiered memory, wrapped, while the wrap raised."""
    def build(fake):
        torch.manual_seed(0)
        lin = nn.Linear(1024, 512).requires_grad_(False)
        return fake, tiermem.Tier(backend=fake), lin
    (f0, t0, lin0), (fake, t, lin) = twin(build)
    fake.fail_at(nth(f0, lambda: t0.wrap(lin0.weight), "prefetch", 2), kind)
    x = torch.randn(3, 1024)
    want, ptr = lin(x), lin.weight.data_ptr()
    with pytest.raises(KeyboardInterrupt if kind == "interrupt" else tiermem.CUDAError):
        t.wrap(lin.weight)
    assert tiered_of(lin.weight) is None and lin.weight.data_ptr() == ptr
    assert torch.equal(lin(x), want)
    gc.collect()
    assert fake.live()["managed"] == 0 and t.resident_bytes == 0
    t.wrap(lin.weight)
    assert tiered_of(lin.weight) is not None and torch.equal(lin(x), want)


def test_fault_a_ring_whose_stream_cannot_be_made_is_not_allocated():
    ring = StagingRing(FakeBackend())
    ring.backend.fail_at(1)
    with pytest.raises(tiermem.CUDAError):
        ring.allocate()
    assert ring.backend.fired[1] == "new_stream"
    assert not ring.allocated and ring.backend.live()["device"] == 0
    ring.allocate()
    assert ring.allocated and ring._stream is not None


def test_fault_a_read_only_tensor_whose_pages_went_back_is_refilled_from_its_shadow():
    """Parked pages of a read-only tensor (whole pages) and of a small one went back in one
    trim; the small one's migration failed after the discard. The read-only tensor used to stay
    parked, its refill then copied nothing into discarded pages."""
    def build(fake):
        t = tiermem.Tier(backend=fake, budget=64 * MiB, staging="off")
        (a, da), (b, _) = filled(t, 2 * MiB, read_only=True), filled(t, 5000)
        t.evict([a, b])
        t.prefetch([a, b])
        t.evict([a, b])
        return fake, t, a, da, b
    (f0, t0, *keep0), (fake, t, a, data, _) = twin(build)
    fake.fail_at(nth(f0, t0.trim, "prefetch"))
    with pytest.raises(tiermem.CUDAError):
        t.trim()
    assert not a.parked and a.in_shadow
    t.prefetch(a)
    assert np.array_equal(tt_bytes(fake, a), data)


def test_fault_a_wrapped_parameter_brought_back_into_host_pages_follows_only_once_it_is_there():
    def build(fake):
        t = tiermem.Tier(backend=fake, budget=2 * MiB)
        p = param(2 * MiB)
        data = t_bytes(p).copy()
        tt = t.wrap(p)
        t.evict(tt)
        w = t.empty(2 * MiB, "uint8", role="workspace")    # takes the parked pages; never evicted
        return fake, t, p, tt, data, w
    (f0, t0, p0, tt0, _, w0), (fake, t, p, tt, data, w) = twin(build)
    fake.fail_at(nth(f0, lambda: tt0.torch(), "torch_view"))
    with pytest.raises(tiermem.CUDAError):
        tt.torch()
    assert p.data_ptr() == (tt._b.shadow.ptr if tt.in_shadow else tt.data_ptr)
    assert np.array_equal(t_bytes(p), data)
    assert np.array_equal(t_bytes(tt.torch()), data) and p.data_ptr() == tt.data_ptr


class _LateInterrupt(FakeBackend):
    """Ctrl-C lands just as the discard returns, its work done (Python runs signal handlers
    between bytecodes, so it can)."""

    def discard(self, ranges, stream):
        super().discard(ranges, stream)
        raise KeyboardInterrupt("landed as the discard returned")


def test_fault_an_interrupt_landing_as_the_discard_returns_keeps_the_eviction():
    fake = _LateInterrupt(total=1 << 30)
    t = tiermem.Tier(backend=fake, staging="off")
    tt, data = filled(t, 2 * MiB)
    with pytest.raises(KeyboardInterrupt):
        t.evict(tt)
    assert tt.in_shadow and t.resident_bytes == 0       # the pages are gone: the data is in the shadow
    assert np.array_equal(tt_bytes(fake, tt), data)
    check_books(t, fake)
    assert np.array_equal(t_bytes(tt.torch()), data)


def test_fault_injection_in_the_real_backend_is_there_only_while_set():
    """The CUDA backend's hook (NOTE [failure injection]) needs no GPU to check: the injector
    raises before the method's body runs."""
    from tiermem.cuda.backend import FAULTABLE, CudaBackend, FaultInjector, inject_faults
    plain = {n: CudaBackend.__dict__[n] for n in FAULTABLE}
    inj = FaultInjector()
    inject_faults(inj)
    try:
        assert all(CudaBackend.__dict__[n] is not plain[n] for n in FAULTABLE)
        inj.fail_at(1, "interrupt")
        with pytest.raises(KeyboardInterrupt):
            object.__new__(CudaBackend).copy(0, 0, 0, 0)
        assert (inj.fired, inj.calls, inj.injected) == ((1, "copy", "interrupt"), 1, 1)
        inj.fail_at(1, "oom")
        with pytest.raises(tiermem.errors.CUDAOutOfMemoryError, match="cudaErrorMemoryAllocation"):
            object.__new__(CudaBackend).allocate(1, "x")
    finally:
        inject_faults(None)
    assert all(CudaBackend.__dict__[n] is plain[n] for n in FAULTABLE)


# -- bench/soak.py's logic that needs no GPU -----------------------------------------------------------

def _soak():
    import importlib
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    return importlib.import_module("soak")


def test_soak_arguments_and_their_limits():
    soak = _soak()
    a = soak.parse_args([])
    assert (a.seeds, a.ops, a.minutes, a.keep_gb) == (1, 50_000, 3.0, 4.0)
    a = soak.parse_args(["--seeds", "3", "--minutes", "2", "--seed", "7"])
    assert (a.seed, a.seeds, a.minutes) == (7, 3, 2.0)
    for bad in (["--seeds", "3", "--minutes", "4"], ["--minutes", "11"], ["--keep-gb", "1"], ["--ops", "0"],
                ["--fault-rate", "1"]):
        with pytest.raises(SystemExit):
            soak.parse_args(bad)


def test_soak_results_sum_the_seeds_and_check_every_promise():
    soak = _soak()
    seed = dict(ops=50_000, reads_checked=20_000, mismatches=0, faults_injected=900, faults_recovered=900,
                train_steps=125, infer_forwards=333, unexpected_errors=0, seconds=100.0,
                tiermem_leaked_bytes=0, driver_leaked_bytes=0, errors=[])
    metrics, checks = soak.assemble([seed, dict(seed, reads_checked=20_001)], 3.5e9)
    assert (metrics["ops"], metrics["reads_checked"], metrics["faults_injected"], metrics["leaked_bytes"],
            metrics["min_free_GB"], metrics["seeds"]) == (100_000, 40_001, 1800, 0, 3.5, 2)
    assert checks == {"no_mismatch": True, "no_leak": True, "all_recovered": True}
    metrics, _ = soak.assemble([seed, dict(seed, driver_leaked_bytes=2 << 20)], 3.5e9)
    assert metrics["leaked_bytes"] == metrics["driver_leaked_bytes"] == 2 << 20
    for change, failed in ((dict(mismatches=1), "no_mismatch"), (dict(tiermem_leaked_bytes=4096), "no_leak"),
                           (dict(driver_leaked_bytes=2 << 20), "no_leak"), (dict(faults_recovered=899), "all_recovered"),
                           (dict(unexpected_errors=1), "all_recovered")):
        _, checks = soak.assemble([dict(seed, **change)], 3.5e9)
        assert [k for k, ok in checks.items() if not ok] == [failed], change


def test_fault_an_interrupt_landing_as_a_trims_discard_returns_leaves_nothing_parked():
    """As above, for parked pages given back: a read-only tensor left parked on pages that were
    discarded would be refilled from them, with nothing copied."""
    fake = _LateInterrupt(total=1 << 30)
    t = tiermem.Tier(backend=fake, budget=64 * MiB, staging="off")
    a, data = filled(t, 2 * MiB, read_only=True)
    t.evict(a)                  # under a budget: parked, no discard
    t.prefetch(a)
    t.evict(a)                  # parked, and intact: its refill would copy nothing
    assert a.parked
    with pytest.raises(KeyboardInterrupt):
        t.trim()
    assert not a.parked and a.in_shadow
    check_books(t, fake)
    t.prefetch(a)
    assert np.array_equal(tt_bytes(fake, a), data)
