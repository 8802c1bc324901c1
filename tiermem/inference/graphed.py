"""An offloaded forward captured once as a CUDA graph and replayed (NOTE [graphed forwards]).

    handle = tiermem.wrap_module(model, budget)
    forward = handle.graphed(lambda ids: model(ids, use_cache=False).logits)
    logits = forward(ids)      # eager until the order is known, then one launch a forward

NOTE [graphed forwards]
    A streamed forward of a few hundred tokens is bound by the host, not by the link: each layer
    costs the model's own Python (transformers' modules, their checks and masks) and tiermem's
    hooks (a slot to pick, copies and events to queue, a chunk's dequantization to launch), and
    the GPU waits for it. With weights packed to a quarter of their bytes (NOTE [quantized
    streaming] in inference/quant.py) the link's share of a forward falls below the host's: an
    int4 prefill took up to 2.7x its floor, the slower of the resident prefill and the plan's bytes
    (bench/results/offload_infer-h200-20261130-quant.json). A CUDA graph of the whole forward
    takes the host out: one launch replays every copy, dequantization, kernel and cross-stream
    wait the forward queued, so a forward costs the link's time or the GPU's, whichever is more.

    What makes a forward replayable: the addresses are fixed (the slots and staging buffers are
    one allocation, the home pinned memory made once, torch's allocations inside come from the
    graph's own pool) and so are the host's choices, once the order is learned. One thing is not:
    the slots a forward uses. The eager forwards run on around the ring, use after use, and each
    starts where the last one's tail prefetch left its first pieces, so two forwards in a row use
    different slots. In graph mode every forward starts its count at slot 0 (and the first
    staging buffer), and its tail brings the next forward's first pieces into slots 0, 1, ...:
    each forward starts in the state the last one ended in, the capture's and every replay's
    alike. Where an eager forward ran since, ``before_replay`` brings those first pieces back
    into their slots before the launch, and the launch stream waits for tiermem's lanes. What
    that costs against the eager rotation: at a forward's end its tail waits for the last users
    of slots 0, 1, ..., which are (pieces mod slots) pieces from the end rather than a whole
    window. A piece brought into a slot other than the one it last held is found in the new one
    (``PinnedTransport._vacate``).

    One eager forward in graph mode runs before the capture, with the same shapes: it makes what
    the capture must find made (the chunks' copies and prepared launches of each piece in its
    slot and staging buffer, NOTE [packed chunks made once] in inference/transport.py; the first
    launch's tables, copied to the device then) and leaves the first pieces where the capture
    reads them. The capture runs the forward's Python with tiermem's events resolved for it
    (NOTE [events across a capture] in cuda/capture.py), untimed and untracked, and its moves are
    counted once a replay (core/stats.py's ``count_delta``). A forward of other shapes, an order
    learned again, or an unwrap drops the graph; the next forwards run eagerly until the capture
    can be made again.

    What stays eager, with the reason in ``off``: a backend without graphs (the fake one), a
    disk tier (host threads read the files), the expert cache (its choices are the host's, token
    by token), tiermem's KV cache (it grows by each forward's tokens), a relay or layers across
    GPUs. A capture that fails (an operation the model's code makes that a capture forbids: a
    host sync, say) gives graphs up for this forward, logs the reason and runs the forward
    eagerly; torch is left as it was (pytorch/unwind.py), and so is the transport: the failed
    capture ran the forward's Python, whose books say pieces were copied into slots where no
    copy ever ran, so the slots are forgotten and its moves uncounted (``handle.capturing``).

    The outputs are the graph's, copied: each call returns new tensors. They are what torch's
    capture of the model's forward computes: the eager forward's bits on the models of
    tests/test_gpu_graphed_forward.py, and within rounding of them where torch's own capture of
    the model differs from its eager run (a two-layer Llama of hidden size 4096, resident, with
    no tiermem in it, differed by up to 0.0078 in its logits: bench/probes/probe_graphed_gemm.py).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..core.stats import count_delta
from ..errors import ConfigError, TierMemError
from ..pytorch.unwind import clear_frames, first_cause, free_cache, release_graph, unroute
from ..pytorch.workspaces import own_workspaces

__all__ = ["GraphedForward", "SETTLED_FORWARDS", "signature"]

log = logging.getLogger("tiermem")

SETTLED_FORWARDS = 1      # eager forwards in graph mode, of the same shapes, before the capture


def signature(inputs: tuple[Any, ...]) -> tuple:
    """What a graph bakes in of its inputs: each one's shape, dtype and device."""
    return tuple((tuple(x.shape), x.dtype, x.device) for x in inputs)


def _tensors(out: Any) -> list[Any]:
    """The tensors of a forward's result (a tensor, or a tuple, list or dict of them)."""
    if isinstance(out, (tuple, list)):
        return [t for x in out for t in _tensors(x)]
    if isinstance(out, dict):
        return [t for x in out.values() for t in _tensors(x)]
    return [out]


def _copied(out: Any) -> Any:
    """``out`` with each tensor cloned (the graph's own are rewritten by its next replay)."""
    if isinstance(out, (tuple, list)) and not hasattr(out, "_fields"):
        return type(out)(_copied(x) for x in out)
    if isinstance(out, dict):
        return type(out)((k, _copied(v)) for k, v in out.items())
    return out.clone()


class GraphedForward:
    """``fn(*inputs)`` run as forwards of the module ``handle`` holds, under ``torch.no_grad()``:
    eagerly until the order is learned and SETTLED_FORWARDS forwards of the same shapes ran in
    graph mode, then as one captured CUDA graph (NOTE [graphed forwards])."""

    def __init__(self, handle: Any, fn: Callable[..., Any]):
        if not callable(fn):
            raise ConfigError(f"graphed() takes the forward to capture, got {fn!r}")
        import torch
        self.handle, self.fn, self.torch = handle, fn, torch
        self.off = handle.graph_blockers()      # why the forwards stay eager ("" while graphs may come)
        self.graph: Any = None
        self.captures = 0
        self.replays = 0
        self.drops: list[str] = []              # why captured graphs were dropped, in order
        self._static: list[Any] = []
        self._out: Any = None
        self._sig: Any = None
        self._epoch = -1
        self._settled = 0
        self._counts: dict[Any, int] = {}
        self._mode = "stream"                   # how the captured forward moved its pieces

    def __repr__(self) -> str:
        state = "captured" if self.graph is not None else f"eager ({self.off})" if self.off else "eager"
        return f"GraphedForward({state}, captures={self.captures}, replays={self.replays})"

    def __call__(self, *inputs: Any) -> Any:
        torch, hd = self.torch, self.handle
        if not all(torch.is_tensor(x) for x in inputs):
            raise ConfigError("a graphed forward takes tensors only (close over everything else in the function)")
        if hd.graph_blockers() == "the module was unwrapped":
            raise TierMemError("this graphed forward's module was unwrapped: run the model plainly, or wrap it again")
        sig = signature(inputs)
        if self.graph is not None:
            if sig != self._sig:
                self.close("the inputs' shapes changed")
            elif hd.order_epoch != self._epoch:
                self.close("the module's order was learned again")
        if self.graph is not None:
            return self._replay(inputs)
        if self.off:
            with torch.no_grad():
                return self.fn(*inputs)
        known = hd.order_learned
        epoch = hd.order_epoch
        if known and sig == self._sig and epoch == self._epoch and self._settled >= SETTLED_FORWARDS:
            out = self._capture(inputs)
            if out is not None:
                return out
        with torch.no_grad(), hd.graph_mode():
            out = self.fn(*inputs)
        # Settled: the order was known before this forward and is the same after it.
        if known and hd.order_learned and hd.order_epoch == epoch:
            self._settled = self._settled + 1 if sig == self._sig else 1
        else:
            self._settled = 0
        self._sig, self._epoch = sig, hd.order_epoch
        return out

    # -- capture -----------------------------------------------------------------------------------
    def _capture(self, inputs: tuple[Any, ...]) -> Any:
        torch, hd = self.torch, self.handle
        acc = hd.tier.accounting
        self._static = [x.detach().clone() for x in inputs]
        free_cache(torch)              # the graph's pool takes the place of the eager forwards' cache
        g = torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()      # NOTE [failed capture's pool] in pytorch/unwind.py
        before = acc.snapshot()
        why = ""
        try:
            self._out = self._record(g, pool)
        except Exception as e:    # noqa: BLE001 - any refusal: the forward runs eagerly, graphs off
            why = first_cause(e)
            clear_frames(e)
        if why:
            self._static, self._out = [], None
            release_graph(torch, g, pool)
            self.off = f"the capture failed: {why}"
            log.warning("tiermem: the forward could not be captured as a CUDA graph; it stays eager: %s", self.off)
            return None
        if not all(torch.is_tensor(t) for t in _tensors(self._out)):
            self._static, self._out = [], None
            release_graph(torch, g)
            self.off = "the forward returns something other than tensors (a tuple, list or dict of them)"
            return None
        self.captures += 1
        self.graph = g
        self._mode = hd.forward_mode
        self._counts = count_delta(before, acc.snapshot())
        acc.count_many({k: -n for k, n in self._counts.items()})    # nothing ran yet: the replay counts them
        return self._replay(inputs, first=True)

    def _record(self, g: Any, pool: Any) -> Any:
        torch, hd = self.torch, self.handle
        be = hd.tier.backend
        prev = torch.cuda.current_stream()
        try:
            with own_workspaces(torch), hd.capturing(), torch.cuda.graph(g, pool=pool):
                try:
                    with torch.no_grad():
                        out = self.fn(*self._static)
                finally:
                    be.join_capture(be.current_stream())   # a copy queued ahead and never waited on
        except BaseException:
            unroute(torch, g, pool, prev)
            raise
        return out

    # -- replay ------------------------------------------------------------------------------------
    def _replay(self, inputs: tuple[Any, ...], first: bool = False) -> Any:
        hd = self.handle
        if not first:
            for s, x in zip(self._static, inputs):
                s.copy_(x)
        be = hd.tier.backend
        stream = be.current_stream()
        hd.before_replay(stream, self._mode)
        self.graph.replay()
        be.replayed(stream)
        hd.tier.accounting.count_many(self._counts)
        self.replays += 1
        return _copied(self._out)

    def close(self, why: str = "closed") -> None:
        """Drop the graph and give its pool back; later calls run eagerly until it is captured
        again."""
        if self.graph is None:
            return
        self.drops.append(why)
        log.info("tiermem: the captured forward is dropped (%s)", why)
        g, self.graph, self._out, self._static = self.graph, None, None, []
        release_graph(self.torch, g)
        self._settled = 0
