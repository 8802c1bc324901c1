"""A recomputed block's backward replayed as a CUDA graph (NOTE [replayed recompute]).

:class:`Replays` runs a module's forward without saving anything but its tensor inputs, and its
backward as one graph: the forward again, then its backward, the parameters' gradients added
into their ``.grad`` in place. The graph is keyed by everything it bakes in: the inputs' shapes,
dtypes and strides, which outputs get a gradient, autocast's state, and the addresses of the
block's parameters and gradients (a streamed block's slot). A key's first backward runs eagerly
(a block's first one measured, its working set for the pool's room) and asks for the graph;
:meth:`Replays.capture_pending`, called between steps, makes the static buffers and captures
what was asked for (after one forward without autograd on the capture stream, the first time:
it warms that stream's cuBLAS handle and workspace), and later backwards replay. A block whose
forward draws random numbers, whose capture fails (out of memory under the cap, an op that
syncs), or that needs more than MAX_GRAPHS_PER_BLOCK keys runs eagerly from then on.
"""
from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from ..pytorch.savedhooks import as_saved
from ..pytorch.unwind import ended, give_pool_back, unroute
from ..pytorch.workspaces import own_workspaces

__all__ = ["Replays", "MAX_GRAPHS_PER_BLOCK"]

MAX_GRAPHS_PER_BLOCK = 6     # a streamed block passes through lookahead + 1 slots (3 by default)
# torch's caching allocator carves a private pool from its own segments: 2 MiB ones for
# requests up to 1 MiB, 20 MiB ones up to 10 MiB (c10/cuda/CUDACachingAllocator.cpp), none shared
# with the cache the step's other tensors use; a pool's estimate leaves room for one of each
SEGMENTS = 22 << 20
# Before any capture the pool's size is an estimate: the largest measured eager backward, this
# share of it more, and SEGMENTS. It is not a bound: pools came to 1.4-1.6x the eager backward
# they replay (docs/history.md, "Measurements behind the code's notes"). A pool that outgrows its room after a capture is given up cleanly, so too low an estimate costs
# captures that are thrown away; too high a one holds room from kept activations where it fits.
RESERVE_MARGIN = 0.25

log = logging.getLogger("tiermem")

# NOTE [replayed recompute]
#     A recomputed block costs its forward twice on the GPU, and on the host its Python forward
#     and checkpoint's hooks twice plus backward's launches. The host's part is what holds a
#     step back where a layer's forward takes more host time than kernel time, and in backward
#     the GPU waits for it (docs/history.md, "Measurements behind the code's notes"). A CUDA graph of
#     the block's recompute and backward launches the same kernels in one call, so the same
#     bits come out (the GPU tests compare losses with the resident run's, bitwise).
#
#     What the graph bakes in decides when it may be replayed:
#     - addresses: the inputs are copied into static buffers (shared by every graph with the same
#       input at the same position: replays run one after another), the output gradients too;
#       the parameters and their .grad are read and added into where they were at capture, so the
#       key holds their addresses, and a streamed block gets a graph per slot it passes through;
#     - the RNG: a replay draws from the generator's offset at replay time, not the forward's, so
#       a block whose forward moved the CUDA generator keeps torch's eager path;
#     - memory: the graphs share one private pool, as large as the largest block's recompute
#       and backward, which torch's allocator cannot lend to other tensors between replays; the
#       cap counts it. So a block's first backward runs eagerly and measured (:meth:`_measure`),
#       the trainer's plan holds room for the estimate (:attr:`reserve`) as it does for kept
#       activations, no capture starts where the estimate does not fit the room the trainer
#       gives (its cap less the last step's peak outside the pool, less 1/32 of the budget),
#       and a pool past that room after a capture, a capture that fails, or a step that runs out
#       of memory beside the pool stops all capturing: the pool goes back and every block
#       recomputes eagerly. The static buffers (inputs, output gradients, input gradients: one
#       per shape and place, shared by the blocks) live outside the pool; an ask names them and
#       the reserve counts them from then on, but they are made between steps, with the capture.
#       Made by the ask, inside backward, they took memory no plan had left: a GPT split into
#       its Linears (100 blocks) asked for buffers of every Linear's shapes, its head's 64 MiB
#       output gradient among them, and every step after the first ran out of memory
#       (docs/training.md, "The graphs' static buffers, made between steps").
#     - when: between steps (:meth:`capture_pending`), never inside one. Captured inside the
#       step that measured, the pool's new segments and the eager backwards' cached ones were
#       held at once, and a room that counted the working set once lost steps that way (a
#       capture, then the optimizer, ran out of memory with 114-301 MiB cached but unallocated;
#       docs/training.md). Between steps the cache is emptied first, and the pool takes what
#       the step's tensors left. A graph bakes in its block's slot, so a recipe holds where the
#       block's parameters and gradients were and the capture puts them there and back; a
#       new plan (new slots) drops what was asked for, and later backwards ask again. The room
#       still counts the eager working set twice (in the step's peak and in the pool): counted
#       once, a GPT step replaying its graphs ran out of memory in forward (2026-11-27,
#       docs/training.md), so capturing between steps makes the capture safe, not the room larger.
#     At 1/2.5 of the bench models' state the plan's floor and the pool together pass the budget
#     less its margin, so there the graphs are given up before any capture, and graphs stay off
#     by default (docs/training.md).
#     The gradient of each input comes out in a shared static buffer and is cloned before it is
#     returned: autograd may hold it past the next block's replay.


class _Graph:
    __slots__ = ("graph", "static_in", "static_gout", "static_gin", "hit")

    def __init__(self, graph: Any, static_in: list[Any], static_gout: list[Any], static_gin: list[Any],
                 hit: list[Any]):
        self.graph, self.static_in, self.static_gout, self.static_gin = graph, static_in, static_gout, static_gin
        self.hit = hit           # the parameters whose accumulation the capture saw, in its order


class _Recipe:
    """What a graph is captured from between steps (NOTE [replayed recompute]): the block's call,
    the static buffers its replays copy into and out of (their keys: :meth:`Replays._spec`; the
    buffers are made when it is captured, not in the step that asks), and where its parameters
    and gradients were (``binding``: parameter, its data, its .grad) when an eager backward asked
    for it."""
    __slots__ = ("module", "call", "autocast", "static_in", "grad_in", "static_gout", "static_gin", "binding")

    def __init__(self, module: Any, call: Callable, autocast: Any, static_in: list[tuple], grad_in: list[bool],
                 static_gout: list[tuple | None], static_gin: list[tuple | None],
                 binding: list[tuple[Any, Any, Any]]):
        self.module, self.call, self.autocast = module, call, autocast
        self.static_in, self.grad_in, self.static_gout, self.static_gin = static_in, grad_in, static_gout, static_gin
        self.binding = binding


class Replays:
    """Graphs of the blocks' recompute and backward, with their shared pool and buffers.

    ``capture``: False runs every backward eagerly (a reentrant checkpoint's way; CPU tests).
    ``params_of(module)``: the tensors whose gradients the block's backward adds into (its
    trainable parameters). While :attr:`capturing`, the caller's gradient-accumulation hooks
    must do nothing but append their parameter to :attr:`hit`; ``after_replay(module, hit)`` is
    called after each replay with the parameters the capture saw, where those hooks would have
    run (a graph runs no Python).
    """

    def __init__(self, torch: Any, *, capture: bool, params_of: Callable[[Any], list[Any]],
                 after_replay: Callable[[Any, list[Any]], None] | None = None):
        self.torch = torch
        self.capture = capture
        self.warmed = False
        self.params_of = params_of
        self.after_replay = after_replay
        self.capturing = False
        self.hit: list[Any] = []
        self.off = ""                            # why capturing stopped, if it did
        self.pool_bytes = 0                      # what the captures reserved for the pool
        self.pool_peak = 0                       # the most it held, given up or not
        self.need = 0                            # the largest working set an eager backward measured
        self.measured: set[int] = set()          # modules whose eager backward was measured
        self.peak_carry = 0                      # the step's reserved peak before a measurement reset it
        self.room: Callable[[], int | None] | None = None   # bytes the pool may take (None: no limit)
        self.graphs: dict[tuple, _Graph] = {}
        self.pending: dict[tuple, _Recipe] = {}  # graphs the step's eager backwards asked for
        self.per_module: dict[int, int] = {}     # graphs captured per module
        self.eager: set[int] = set()             # modules left to run eagerly (random ops, failed capture)
        self.statics: dict[tuple, Any] = {}      # (kind, position, shape, dtype, strides, device) -> buffer
        self.static_sizes: dict[tuple, int] = {} # every buffer's key an ask named -> its bytes, made or not
        self.stream: Any = None
        self.pool: Any = None
        self.replayed = 0
        self.captured = 0
        self.changes = 0                         # captures, measured backwards and give-ups: steps not to time

    def close(self) -> None:
        """Drop every graph and buffer (their pool goes back to torch's allocator)."""
        self.graphs.clear()
        self.pending.clear()
        self.statics.clear()
        self.static_sizes.clear()
        self.per_module.clear()
        self.pool = None
        self.pool_bytes = 0

    # -- forward -----------------------------------------------------------------------------------
    def run(self, module: Any, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``fn(*args, **kwargs)`` for a recomputed block, its backward replayed when it can be.

        As torch's non-reentrant checkpoint does, the positional tensors are saved for backward
        (through whatever saved-tensor hooks the step has: tiermem's swap), the keyword ones are
        held as they are."""
        torch = self.torch
        from torch.utils._pytree import tree_flatten, tree_unflatten
        leaves, spec = tree_flatten((args, kwargs))
        where = [i for i, x in enumerate(leaves) if torch.is_tensor(x)]
        npos = len(tree_flatten(args)[0])
        others = tuple((i, x) for i, x in enumerate(leaves) if not torch.is_tensor(x))
        try:
            hash(others)
        except TypeError:
            others = None
        pos = [leaves[i] for i in where if i < npos]
        held = [leaves[i] for i in where if i >= npos]
        if (others is None or id(module) in self.eager or not torch.is_grad_enabled()
                or not any(t.requires_grad for t in pos) or any(t.requires_grad for t in held)):
            # a keyword tensor that needs its gradient reaches it through checkpoint's closure only
            return torch.utils.checkpoint.checkpoint(lambda *a: fn(*a, **kwargs), *args, use_reentrant=False)

        template = [None if torch.is_tensor(x) else x for x in leaves]   # the inputs' memory is not held here

        def call(ts: list[Any]) -> Any:
            lv = list(template)
            for i, t in zip(where, ts):
                lv[i] = t
            a, k = tree_unflatten(lv, spec)
            return fn(*a, **k)

        box: dict[str, Any] = {"held": held}
        outs = iter(_Block.apply(self, module, call, others, box, *pos))
        return tree_unflatten([next(outs) if torch.is_tensor(x) else x for x in box["leaves"]], box["spec"])

    # -- backward ----------------------------------------------------------------------------------
    def backward(self, module: Any, call: Callable, key0: tuple, tensors: list[Any], gouts: list[Any],
                 rng: Any, autocast: Any) -> list[Any]:
        """The gradients of ``tensors`` (positional inputs, then held keyword tensors). ``rng``:
        the RNG states before the forward when it drew random numbers, else None."""
        if rng is not None:
            self.eager.add(id(module))       # from the next step on, torch's checkpoint runs it
            return _with_rng(self.torch, rng, lambda: _recompute_backward(self.torch, call, tensors, gouts, autocast))
        params = self.params_of(module)
        if not self.capture or id(module) in self.eager or any(p.grad is None for p in params):
            return _recompute_backward(self.torch, call, tensors, gouts, autocast)
        key = key0 + (tuple(g is not None for g in gouts),
                      tuple(tuple(g.shape) for g in gouts if g is not None),
                      tuple(p.data_ptr() for p in params),
                      tuple(p.grad.data_ptr() for p in params))
        g = self.graphs.get(key)
        if g is None:
            # NOTE [replayed recompute]: eager now; the graph is captured between steps
            self._ask(module, call, key, tensors, gouts, autocast, params)
            if id(module) not in self.measured:
                # its first backward is measured, so the plan and the room know the pool's size
                self.measured.add(id(module))
                return self._measure(lambda: _recompute_backward(self.torch, call, tensors, gouts, autocast))
            return _recompute_backward(self.torch, call, tensors, gouts, autocast)
        for s, t in zip(g.static_in, tensors):
            s.copy_(t)
        for s, t in zip(g.static_gout, gouts):
            if s is not None:
                s.copy_(t)
        g.graph.replay()
        self.replayed += 1
        gin = [s.clone() if s is not None else None for s in g.static_gin]
        if self.after_replay is not None:
            self.after_replay(module, g.hit)
        return gin

    @property
    def reserve(self) -> int:
        """Bytes a plan must leave the graphs: what the pool holds, or while capturing is on, what
        the largest measured backward says it will hold, with a quarter more and the allocator's
        segments (SEGMENTS) for what the pool cannot share with the rest of the step; and the
        static buffers that every ask so far named, made or not."""
        if not self.capture:
            return self.pool_bytes + self.statics_bytes
        pool = max(self.pool_bytes, self.need + int(self.need * RESERVE_MARGIN) + SEGMENTS if self.need else 0)
        return pool + sum(self.static_sizes.values())

    @property
    def statics_bytes(self) -> int:
        """Bytes of the static buffers made so far (outside the pool, in torch's cache)."""
        return sum(self.static_sizes[k] for k in self.statics)

    @property
    def held_bytes(self) -> int:
        """What the graphs hold now: the pool and the static buffers."""
        return self.pool_bytes + self.statics_bytes

    def _measure(self, run: Callable[[], Any]) -> Any:
        """``run()``, its peak of allocated bytes above where it began kept in :attr:`need`.
        Measuring resets the device's peak counters; the peak before is kept in :attr:`peak_carry`
        for the caller, whose step's peak it is part of."""
        cuda = self.torch.cuda
        self.changes += 1
        self.peak_carry = max(self.peak_carry, cuda.max_memory_reserved())
        cuda.reset_peak_memory_stats()
        begin = cuda.memory_allocated()
        try:
            return run()
        finally:
            self.need = max(self.need, cuda.max_memory_allocated() - begin)

    def _ask(self, module: Any, call: Callable, key: tuple, tensors: list[Any], gouts: list[Any],
             autocast: Any, params: list[Any]) -> None:
        """Ask for ``key``'s graph, to be captured between steps (:meth:`capture_pending`)."""
        if key in self.pending:
            return
        n = self.per_module.get(id(module), 0) + sum(r.module is module for r in self.pending.values())
        if n >= MAX_GRAPHS_PER_BLOCK:
            # its parameters or inputs keep moving: a graph per step would never be replayed
            log.info("tiermem: block %s stays eager: %d graphs and still another key", type(module).__name__, n)
            self.eager.add(id(module))
            return
        # the buffers' keys only: they are made between steps (NOTE [replayed recompute], memory)
        self.pending[key] = _Recipe(
            module, call, autocast,
            static_in=[self._spec("in", i, t) for i, t in enumerate(tensors)],
            grad_in=[t.requires_grad for t in tensors],
            static_gout=[self._spec("gout", i, g) if g is not None else None for i, g in enumerate(gouts)],
            static_gin=[self._spec("gin", i, t) if t.requires_grad else None for i, t in enumerate(tensors)],
            binding=[(p, p.data, p.grad) for p in params])

    def drop_pending(self) -> None:
        """Forget the graphs asked for: the memory they were asked at is no longer the blocks'."""
        self.pending.clear()

    def capture_pending(self) -> int:
        """Capture the graphs the last step asked for; returns how many. Call it between steps,
        when the step's own tensors are gone (NOTE [replayed recompute]): the pool then takes its
        memory from an emptied cache, not beside the step's."""
        pending, self.pending = self.pending, {}
        if not pending or not self.capture:
            return 0
        room = self.room() if self.room is not None else None
        if room is not None and self.reserve > room:
            self.give_up(f"the graphs' pool (about {self.reserve / 1e6:.0f} MB) does not fit "
                         f"beside the step's own peak ({room / 1e6:.0f} MB left in the budget)")
            return 0
        torch = self.torch
        # The pool cannot take memory torch's allocator keeps cached for other tensors, and the
        # cap counts both: what is cached and unused goes back first (a device sync).
        torch.cuda.empty_cache()
        done = 0
        for key, rec in pending.items():
            if key in self.graphs or id(rec.module) in self.eager:
                continue
            why = ""
            try:
                g = self._capture(rec)
            except Exception as e:        # noqa: BLE001 - any failure: no graphs from now on
                g, why = None, f"{type(rec.module).__name__}'s capture failed: {e}"
            if not why and room is not None and self.held_bytes > room:
                why = (f"the graphs' pool and buffers ({self.held_bytes / 1e6:.0f} MB) do not fit beside the "
                       f"step's own peak ({room / 1e6:.0f} MB left in the budget)")
            if why:
                g = None                  # no frame may hold a graph while its pool goes back
                self.give_up(why)
                return done
            self.graphs[key] = g
            self.per_module[id(rec.module)] = self.per_module.get(id(rec.module), 0) + 1
            self.captured += 1
            self.changes += 1
            done += 1
        return done

    def give_up(self, why: str) -> None:
        """Stop capturing and replaying, and give the pool's memory back to the device: a capture
        that failed for want of memory under the cap would leave the step's own allocations none."""
        log.warning("tiermem: recomputed blocks run eagerly from now on: %s", why.splitlines()[0][:300])
        self.off = why
        self.capture = False
        self.changes += 1
        self.pending.clear()
        if self.pool is None and not self.graphs and not self.statics:
            self.static_sizes.clear()
            return             # nothing was captured: no memory to give back (and no sync mid-step)
        self.close()
        gc.collect()           # a failed capture's frames can hold its tensors in the pool in a cycle
        self.torch.cuda.empty_cache()

    def _side(self) -> Any:
        if self.stream is None:
            self.stream = self.torch.cuda.Stream()
        return self.stream

    def _warm(self, call: Callable, tensors: list[Any], autocast: Any) -> None:
        """Run the block's forward once, without autograd, on the capture stream: cuBLAS makes its
        handle and workspace for a stream at its first use there, which must not be inside a
        capture. Between steps, on the static buffers (zeros: an index read from them is in
        range). The forward draws no random numbers (else the block would be eager) and writes
        nothing the step keeps."""
        if self.warmed:
            return
        torch = self.torch
        side, cur = self._side(), torch.cuda.current_stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side), torch.no_grad(), _autocast(torch, autocast):
            call(list(tensors))
        cur.wait_stream(side)
        torch.cuda.empty_cache()      # what the forward left cached is the capture stream's alone
        self.warmed = True

    def _spec(self, kind: str, i: int, t: Any) -> tuple:
        """The key of the static buffer for tensor ``t`` at position ``i`` of ``kind``; its bytes
        are counted in :attr:`reserve` from now on, the buffer is made by :meth:`_static`."""
        k = (kind, i, tuple(t.shape), t.dtype, tuple(t.stride()), t.device)
        if k not in self.static_sizes:
            self.static_sizes[k] = t.numel() * t.element_size()
        return k

    def _static(self, k: tuple) -> Any:
        s = self.statics.get(k)
        if s is None:
            _, _, shape, dtype, stride, dev = k
            # dense where the tensor was (its strides kept); contiguous where it overlapped itself
            # (an expanded mask: a copy into a buffer with its stride-0 layout is refused)
            like = self.torch.empty_strided(shape, stride, dtype=dtype, device="meta")   # no memory
            s = self.statics[k] = self.torch.zeros_like(like, device=dev, memory_format=self.torch.preserve_format)
            self.static_sizes[k] = s.untyped_storage().nbytes()
        return s

    def _capture(self, rec: _Recipe) -> _Graph:
        """A graph of ``rec``'s recompute and backward, captured with the block's parameters and
        gradients where they were when it was asked for (its slot's memory), put back after."""
        torch = self.torch
        static_in = [self._static(k) for k in rec.static_in]
        static_gout = [self._static(k) if k is not None else None for k in rec.static_gout]
        static_gin = [self._static(k) if k is not None else None for k in rec.static_gin]
        self._warm(rec.call, static_in, rec.autocast)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        before = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        side, cur = self._side(), torch.cuda.current_stream()
        side.wait_stream(cur)
        was = [(p, p.data, p.grad) for p, _, _ in rec.binding]
        self.capturing, self.hit = True, []
        try:
            for p, data, grad in rec.binding:
                p.data = data
                p.grad = grad
            with torch.cuda.stream(side), own_workspaces(torch):   # NOTE [capture's cuBLAS workspace]
                try:
                    graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                    try:
                        xs = [s.detach().requires_grad_(r) for s, r in zip(static_in, rec.grad_in)]
                        gin = _recompute_backward(torch, rec.call, xs, static_gout, rec.autocast)
                        for s, g in zip(static_gin, gin):
                            if s is not None:
                                if g is None:
                                    s.zero_()
                                else:
                                    s.copy_(g)
                        del xs, gin
                    finally:
                        graph.capture_end()
                except BaseException:
                    # a capture that did not end: its routing, the generator (NOTE [invalidated
                    # capture]) and its hold on the shared pool (NOTE [failed capture's pool]),
                    # undone; the other graphs give theirs back when give_up drops them
                    if not ended(graph):
                        unroute(torch, graph, self.pool, side)
                        give_pool_back(torch, self.pool)
                    raise
            hit = self.hit
        finally:
            self.capturing, self.hit = False, []
            for p, data, grad in was:
                p.data = data
                p.grad = grad
        cur.wait_stream(side)
        self.pool_bytes += max(0, torch.cuda.memory_reserved() - before)   # only the pool allocates in a capture
        self.pool_peak = max(self.pool_peak, self.pool_bytes)
        return _Graph(graph, static_in, static_gout, static_gin, hit)


def _autocast(torch: Any, state: Any) -> Any:
    enabled, dtype = state
    return torch.autocast("cuda", dtype=dtype, enabled=enabled) if enabled else nullcontext()



def _recompute_backward(torch: Any, call: Callable, tensors: list[Any], gouts: list[Any], autocast: Any) -> list[Any]:
    """Run ``call`` on detached copies of ``tensors`` with autograd on, under the forward's
    autocast state, and backward from ``gouts``: the parameters' gradients accumulate as
    autograd's do, the inputs' are returned (a reentrant checkpoint's way)."""
    from torch.utils._pytree import tree_flatten
    xs = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
    # Saved tensors stay on the device here, whatever hooks the step has installed: the innermost
    # hooks are the ones autograd uses.
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(as_saved, _same), _autocast(torch, autocast):
        out = call(xs)
    outs = [o for o in tree_flatten(out)[0] if torch.is_tensor(o)]
    pairs = [(o, g) for o, g in zip(outs, gouts) if g is not None and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return [x.grad if x.requires_grad else None for x in xs]


def _same(t: Any) -> Any:
    return t


def _with_rng(torch: Any, rng: Any, run: Callable[[], Any]) -> Any:
    """``run()`` with the CPU and CUDA generators where the forward found them, as torch's
    checkpoint recomputes; the generators are where they were afterwards."""
    cpu, cuda, dev = rng
    with torch.random.fork_rng(devices=[dev] if cuda is not None else [], device_type="cuda"):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, dev)
        return run()


def _offset(gen: Any) -> Any:
    """Where the CUDA generator ``gen`` is in its stream of random numbers (None without one)."""
    if gen is None:
        return None
    try:
        return gen.get_offset()
    except (AttributeError, RuntimeError):
        return bytes(gen.get_state().numpy())


def _block_function(torch: Any) -> Any:
    class Block(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, replays: Replays, module: Any, call: Callable, others: tuple, box: dict,
                    *pos: Any) -> Any:
            from torch.utils._pytree import tree_flatten
            held = box.pop("held")
            tensors = list(pos) + held
            dev = (pos[0].device.index or 0) if pos and pos[0].is_cuda else None
            gen = torch.cuda.default_generators[dev] if dev is not None else None
            cpu = torch.get_rng_state()
            cuda = torch.cuda.get_rng_state(dev) if dev is not None else None
            before = _offset(gen)
            with torch.no_grad():
                out = call(tensors)
            leaves, box["spec"] = tree_flatten(out)
            box["leaves"] = leaves
            leaves = [x for x in leaves if torch.is_tensor(x)]
            ctx.replays, ctx.module, ctx.call, ctx.held = replays, module, call, held
            moved = (gen is not None and _offset(gen) != before) or not torch.equal(torch.get_rng_state(), cpu)
            ctx.rng = (cpu, cuda, dev) if moved else None
            ctx.autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
            ctx.key = (id(module), others, ctx.autocast,
                       tuple((tuple(t.shape), t.dtype, tuple(t.stride()), t.requires_grad) for t in tensors))
            ctx.save_for_backward(*pos)
            return tuple(leaves)

        @staticmethod
        def backward(ctx: Any, *gouts: Any) -> Any:
            tensors = list(ctx.saved_tensors) + ctx.held
            gin = ctx.replays.backward(ctx.module, ctx.call, ctx.key, tensors, list(gouts), ctx.rng, ctx.autocast)
            return (None, None, None, None, None, *gin[:len(tensors) - len(ctx.held)])

    return Block


class _Lazy:
    fn: Any = None

    def apply(self, *args: Any) -> Any:
        if self.fn is None:
            import torch
            self.fn = _block_function(torch)
        return self.fn.apply(*args)


_Block = _Lazy()
