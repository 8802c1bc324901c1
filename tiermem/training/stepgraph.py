"""A whole training step under wrap_training, captured once as a CUDA graph and replayed.

    train = tiermem.wrap_training(model, opt, budget)
    step = train.graphed(lambda ids: loss_fn(model, ids))
    for ids in batches:
        loss = step(ids)          # forward, backward and every block's optimizer step

NOTE [whole-step graphs]
    Under a budget the steps are host-bound: the GPU waits for Python. tiermem's own per-block
    work (binding a block to its slot, queueing its copies, stepping its optimizer share,
    swapping a recomputed block's input) costs about 40 ms of host time a step on the GPT of
    bench/train_budget.py, spread over about a thousand calls (docs/training.md, "Where the
    step's time goes, without a profiler"), and recomputing a block repeats its forward's host
    time too. A CUDA graph of the whole step takes the host out: one launch replays every
    kernel, copy and cross-stream wait the eager step queued, in the same order, so the step
    costs its GPU time and the link's.

    What makes a step capturable here:
    * Every address is fixed once the plan has settled: the slots are one allocation, the
      homes are pinned host memory made once, the swap's host buffers come from an arena that
      hands out the same bytes each step, and what torch allocates inside the step comes from
      the graph's own pool, laid out at capture and reused by every replay. A step starts and
      ends with every streamed parameter bound to its home and no slot holding anything
      (NOTE [training transport] in training/handle.py), so each replay starts from the state the
      capture started from.
    * The host's decisions inside a step (which slot, which copy, when to wait) depend only on
      the plan and the step's own progress, not on timing: where the eager step asks whether a
      copy has finished, the capture makes the GPU wait instead (NOTE [events across a capture]
      in cuda/capture.py).
    * The optimizer steps inside the graph with the hyperparameters it had at capture. A change
      to any of them (a learning-rate schedule) drops the graph, and the steps run eagerly until
      the plan has run two steps unchanged again; the same after a plan change, a load of the
      model's or the optimizer's state, or a step of other shapes.

    A step is captured after the plan has settled (the measured choice is done) and one eager
    step has run under it; the capture is a step for the batch given, and its first replay runs
    it. What the capture cannot do (an optimizer that refuses capture, memory beyond the cap,
    an operation CUDA refuses in a capture) gives the graphs up for the run, with the reason in
    ``off``, and the step runs eagerly: no step is lost. Gradient clipping, accumulation and
    data parallelism keep the steps eager (``blockers``).

    Losses are those of the eager steps, bit for bit, on the models the tests and benches
    capture (tests/test_gpu_stepgraph.py): the graph replays the kernels the eager step launched,
    with the same inputs at the same addresses; dropout draws from torch's generator, which a
    graph advances per replay as an eager step does. That holds where torch's capture of the
    model's own ops launches what its eager run does: a resident transformers Llama of hidden
    size 4096, captured by torch alone, differed from its eager forward at rounding level
    (bench/probes/probe_graphed_gemm.py; NOTE [graphed forwards] in inference/graphed.py).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from ..core.stats import count_delta
from ..errors import ConfigError, TierMemError
from ..pytorch.unwind import clear_frames, first_cause, free_cache, release_graph, unroute
from ..pytorch.workspaces import own_workspaces
from .graphchoice import REPLAYS_TIMED

__all__ = ["GraphedStep", "PLAN_CHANGED", "RELEASED", "capture_now", "why_invalid"]

log = logging.getLogger("tiermem")

SETTLED_STEPS = 1        # eager steps under the settled plan before the capture
PLAN_CHANGED = "the plan changed for the graph's replays (NOTE [graph choice])"
RELEASED = "released for work between steps (GraphedStep.release)"


class GraphedStep:
    """``fn(*inputs) -> loss`` run as training steps of ``train``: eagerly until the plan has
    settled, then as one captured CUDA graph (NOTE [whole-step graphs]). Call it with tensors of
    the same shapes each step; it returns the loss (a new tensor each step)."""

    def __init__(self, train: Any, fn: Callable[..., Any]):
        if not callable(fn):
            raise ConfigError(f"graphed() takes the step's loss function, got {fn!r}")
        self.train, self.fn = train, fn
        self.torch = train.torch
        self.graph: Any = None
        self.off = train.graph_blockers()       # why the steps stay eager ("" while graphs may come)
        self.captures = 0
        self.replays = 0
        self.drops: list[str] = []              # why captured graphs were dropped, in order
        self.last_replays = 0                   # replays of the graph captured last
        self._timed: list[tuple[Any, Any]] = []   # NOTE [graph choice]: timed replays' events
        self._judged = False
        self._static: list[Any] = []
        self._loss: Any = None
        self._layout: Any = None
        self._hyper: Any = None
        self._moved: dict[str, int] = {}
        self._counts: dict[Any, int] = {}
        self._settled = 0
        self._stale = False
        self._hooks = [train.model.register_load_state_dict_pre_hook(self._loading),
                       train.opt.register_load_state_dict_pre_hook(self._loading)]

    def __repr__(self) -> str:
        state = "captured" if self.graph is not None else f"eager ({self.off})" if self.off else "eager"
        return f"GraphedStep({state}, captures={self.captures}, replays={self.replays})"

    def release(self) -> None:
        """Drop the graph and give its pool back to the budget: work between steps (an
        evaluation of a whole batch, say) then has what the pool held. Between replays the
        pool stays reserved, and an evaluation beside it has the budget less the pool (a whole
        batch of the bench's GPT beside the pool ran out of memory: docs/history.md,
        "Measurements behind the code's notes"). The steps after run eagerly until the plan has settled, then are captured
        again: a release costs SETTLED_STEPS + 1 eager steps and a capture."""
        self._drop(RELEASED)

    def close(self) -> None:
        """Drop the graph and the hooks; the handle trains eagerly as before."""
        if self.graph is not None:
            g, self.graph, self._loss, self._static = self.graph, None, None, []
            release_graph(self.torch, g)
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __call__(self, *inputs: Any) -> Any:
        torch = self.torch
        if not all(torch.is_tensor(x) for x in inputs):
            raise ConfigError("a graphed step takes tensors only (close over everything else in the function)")
        if not self.train.active:
            self._drop("the training was unwrapped")
            raise TierMemError("this graphed step's training was unwrapped: train the model plainly, or wrap it again")
        if self.graph is not None:
            self._judge()
        if self.graph is not None:
            why = self._invalid(inputs)
            if why:
                self._drop(why)
        if self.graph is not None:
            return self._replay(inputs)
        t = self.train
        layout = t.layout
        self._settled = self._settled + 1 if t.settled and layout == self._layout else 0
        self._layout = layout
        if capture_now(self.off, t.settled, self._settled):
            loss = self._capture(inputs)
            if loss is not None:
                return loss
        return self._eager(inputs)

    # -- eager -------------------------------------------------------------------------------------
    def _eager(self, inputs: tuple[Any, ...]) -> Any:
        with self.train.step():
            loss = self.fn(*inputs)
            loss.backward()
        return loss.detach()

    # -- capture -----------------------------------------------------------------------------------
    def _capture(self, inputs: tuple[Any, ...]) -> Any:
        torch, t = self.torch, self.train
        self._static = [x.detach().clone() for x in inputs]
        # The graph's pool takes the place of the eager steps' cache under the same cap: give
        # that back first, or the pool finds only what the cache left (a capture ran out of
        # memory at 352 MiB beside 134 MiB of cached blocks, tests/test_gpu_stepgraph.py).
        free_cache(torch)
        g = torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()      # NOTE [failed capture's pool]
        before = t.tier.accounting.snapshot()
        why = ""
        try:
            self._loss, self._moved = self._record(g, pool)
        except Exception as e:    # noqa: BLE001 - any refusal: the step runs eagerly, graphs off
            why = first_cause(e)
            clear_frames(e)
        if why:
            # Outside the handler, so the failed step's frames (and the tensors they held in the
            # graph's pool) are gone before the pool is given back.
            self._static, self._loss = [], None
            release_graph(torch, g, pool)
            self.off = f"the capture failed: {why}"
            log.warning("tiermem: the training step could not be captured as a CUDA graph; the steps stay "
                        "eager: %s", self.off)
            return None
        self.captures += 1
        self.last_replays = 0
        self._timed, self._judged = [], False
        self.graph = g
        self._counts = count_delta(before, t.tier.accounting.snapshot())
        t.tier.accounting.count_many({k: -n for k, n in self._counts.items()})   # nothing ran yet
        self._hyper = _hyperparameters(t.opt)
        self._stale = False
        return self._replay(inputs, first=True)

    def _record(self, g: Any, pool: Any) -> tuple[Any, dict[str, int]]:
        """One step of ``fn`` on the static inputs, captured into ``g`` with its memory from
        ``pool``: (its loss, what it moved)."""
        torch, t = self.torch, self.train
        prev = torch.cuda.current_stream()
        try:
            with own_workspaces(torch), t.capturing(), _capturable(t.opt), torch.cuda.graph(g, pool=pool):
                try:
                    with t.step():
                        loss = self.fn(*self._static)
                        loss.backward()
                finally:
                    # Also when the step refused itself (NOTE [another path under capture]): the
                    # capture then ends cleanly and leaves torch nothing to undo.
                    t.join_streams()
        except BaseException:
            unroute(torch, g, pool, prev)
            raise
        return loss.detach(), dict(t.moved)

    # -- replay ------------------------------------------------------------------------------------
    def _invalid(self, inputs: tuple[Any, ...]) -> str:
        t = self.train
        return why_invalid(stale=self._stale, settled=t.settled, layout=t.layout, captured_layout=self._layout,
                           inputs=inputs, static=self._static, hyper=_hyperparameters(t.opt),
                           captured_hyper=self._hyper)

    def _replay(self, inputs: tuple[Any, ...], first: bool = False) -> Any:
        t = self.train
        if not first:
            for s, x in zip(self._static, inputs):
                s.copy_(x)
        t.before_replay()
        be = t.tier.backend
        stream = be.current_stream()
        # NOTE [graph choice]: the replays after the first are timed until they judge the plan
        timed = not first and not self._judged and len(self._timed) < REPLAYS_TIMED and t.choice.graph_choice_open
        if timed:
            ev = (be.new_event(timing=True), be.new_event(timing=True))
            be.record(ev[0], stream)
        self.graph.replay()
        if timed:
            be.record(ev[1], stream)
            self._timed.append(ev)
        be.replayed(stream)
        t.replayed(self._moved)
        t.tier.accounting.count_many(self._counts)
        self.replays += 1
        self.last_replays += 1
        return self._loss.clone()

    def _judge(self) -> None:
        """NOTE [graph choice]: once the timed replays are queued, their median judges the plan.
        The host waits for the last of them, once a plan: read without a wait, the judgement
        came as many replays late as the host ran ahead of the GPU (docs/history.md,
        "Measurements behind the code's notes"), and every replay under a plan about to change is a step of the slower one."""
        if self._judged or len(self._timed) < REPLAYS_TIMED:
            return
        be = self.train.tier.backend
        be.synchronize(self._timed[-1][1])
        ms = sorted(be.elapsed_ms(a, b) for a, b in self._timed)
        self._timed, self._judged = [], True
        plan = self.train.choice.graph_timed(ms[len(ms) // 2])
        if plan is not None:
            self._drop(PLAN_CHANGED)        # first: its pool and the plan's slots may not both fit
            self.train.follow(plan)

    def _drop(self, why: str) -> None:
        if self.graph is None:
            return
        self.drops.append(why)
        log.info("tiermem: the captured training step is dropped (%s); the steps run eagerly until the "
                 "plan has settled again", why)
        g, self.graph, self._loss, self._static = self.graph, None, None, []
        release_graph(self.torch, g)
        self._settled = 0

    def _loading(self, *_: Any) -> None:
        self._stale = True






def capture_now(off: str, settled: bool, settled_steps: int) -> bool:
    """Whether this step is captured: graphs not given up, and the plan settled for more than
    SETTLED_STEPS eager steps in a row under one layout (its first step under the plan makes
    the allocations the later ones reuse)."""
    return not off and settled and settled_steps > SETTLED_STEPS


def why_invalid(*, stale: bool, settled: bool, layout: Any, captured_layout: Any, inputs: Any, static: Any,
                hyper: Any, captured_hyper: Any) -> str:
    """Why a captured step may not replay now ("" when it may): what the graph baked in changed."""
    if stale:
        return "the model's or the optimizer's state was loaded"
    if not settled or layout != captured_layout:
        return "the plan changed"
    if len(inputs) != len(static) or any(
            x.shape != s.shape or x.dtype != s.dtype or x.device != s.device for x, s in zip(inputs, static)):
        return "the inputs' shapes changed"
    if hyper != captured_hyper:
        return "the optimizer's hyperparameters changed"
    return ""








def _hyperparameters(opt: Any) -> list[dict[str, Any]]:
    """Each group's settings, as the capture baked them in: a float by value, a tensor (a
    learning rate a schedule updates in place) by identity, as the graph reads its memory."""
    import torch
    return [{k: ("tensor", id(v), v.data_ptr()) if torch.is_tensor(v) else v for k, v in g.items() if k != "params"}
            for g in opt.param_groups]



@contextlib.contextmanager
def _capturable(opt: Any) -> Iterator[None]:
    """torch's optimizers refuse a capture unless their groups say ``capturable``. A fused
    optimizer's step is the same kernels either way (its step counts are device tensors already),
    so its groups say so for the capture; any other keeps what the caller chose, and a
    non-capturable one makes the capture fail (it reads its step counts on the host)."""
    flipped = [g for g in opt.param_groups if g.get("fused") and g.get("capturable") is False]
    for g in flipped:
        g["capturable"] = True
    try:
        yield
    finally:
        for g in flipped:
            g["capturable"] = False
