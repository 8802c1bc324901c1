"""Streamed blocks' optimizer steps taken on the host, in their pinned homes, while backward goes
on (NOTE [host stepping]); ``wrap_training(host_step=True)``.

NOTE [host stepping]
    A streamed block stepped on the device brings its fp32 masters and both AdamW moments into
    its slot and sends them home again every step: 16 bytes a parameter in (the masters twice)
    and 12 out. At 1/2.5 of a 1.1B model's training state that is 19 GB in, 1.8x the resident
    step before any compute (docs/training.md). Stepped on the host, a streamed block's states
    never move: backward sends its gradients home (4 bytes a parameter out), a host thread steps
    the home's masters and moments there with torch's fused CPU AdamW, and the next forward
    brings the stepped masters in: 8 bytes a parameter in, 4 out. The states' bytes leave the
    slots too, so a slot holds a block's parameters and gradients only, and the budget keeps
    more blocks resident. What bounds the step instead is the host's AdamW, which runs beside
    backward (one thread queues the blocks in the order their gradients are complete; torch's
    intra-op threads share each block's step) and must end before the next forward needs the
    first block (the step's end waits for it).

    What it keeps of the optimizer: the caller's optimizer (Adam or AdamW) stays the one the
    caller sees. Its hyperparameters are read from its param_groups at each step's begin (a
    learning-rate scheduler writes there), a block's moments are its home's memory, seen by
    the caller's ``opt.state`` (a device view) and by a fused CPU twin of the same class (a
    CPU view), and each parameter's ``step`` is the caller's, advanced at the step's end for
    every parameter the host stepped. The first (traced) step steps on the device, which makes
    the states; a block the plan makes resident steps on the device from then on.

    Which blocks: the host's AdamW is bounded by host memory (it reads and writes 28 bytes a
    parameter), about 0.3 ns a parameter on the H200's host, so a 1.1B model's full step takes
    longer than its backward. Past that the next step's forward waits for the host. So after
    the traced step the host takes blocks while their steps, at a rate measured on this host
    (:func:`host_seconds_per_param`), fit in the traced backward: first the blocks larger than
    the median (an embedding, a head, whose states in a slot would size every slot), then the
    others in backward's order (the first whose gradients are complete first). The rest step
    on the device as without the option, their states in their slots. The plan then sees each
    block's bytes as it moves them.

    What it costs: the CPU's fused AdamW rounds as the CUDA one does not always (fused kernels
    of two devices), so the losses are close to a device-stepped run's, not bitwise; against a
    plain loop with a fused CPU AdamW they are bitwise (tests/test_train_hoststep.py). Not with
    ``state_dtype`` (moments that never cross the link need no narrowing) or ``speculate``;
    with clipping, the host steps wait for the total norm at the step's end.

    With a process group (NOTE [data parallel] in training/handle.py) a block's gradients are
    averaged on the reduce stream as without the option, and go home after the average. The
    ranks agree on which blocks the host steps (:meth:`HostSteps.agree`: a block steps there
    only where every rank chose it), since the two devices' AdamW may round apart and the
    replicas must not. A block one rank's plan keeps resident steps on that rank's device
    whatever the others do, and each rank plans from its own budget and measured times: where
    two ranks' plans keep different blocks resident, such a block's replicas may part by that
    rounding (bench/multi_gpu.py's two ranks, at equal budgets, kept the same blocks).
    Whole-step graphs are off (the host's steps are not CUDA work). Off by default: on the
    H200's host it was within a run's spread of device stepping at 1/2.5 of a 1.1B model's
    state and slower at 1/4 (docs/training.md, "Host stepping"); a slower link or a faster host
    moves the balance its way.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

from ..errors import ConfigError
from .options import on_every_rank
from .slots import Block, BlockSlots

__all__ = ["HostSteps", "host_step_refusal", "host_seconds_per_param", "HOST_STATE_KEYS"]

HOST_STATE_KEYS = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
_NOT_COPIED = frozenset({"params", "fused", "foreach", "capturable", "differentiable"})


def host_step_refusal(optimizer: Any) -> str:
    """Why ``optimizer``'s streamed blocks cannot step on the host ("" when they can)."""
    import torch
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"host_step=True steps Adam or AdamW on the host, got {type(optimizer).__name__}"
    for g in optimizer.param_groups:
        if g.get("differentiable"):
            return "host_step=True does not step a differentiable optimizer"
    return ""


def host_seconds_per_param(torch: Any, n: int = 1 << 24, parts: int = 4) -> float:
    """Seconds torch's fused CPU AdamW takes a parameter on this host, with all its threads: the
    median of three steps (after one) over ``n`` fp32 parameters in ``parts`` tensors. The step
    reads and writes each parameter's bytes once, so its time goes with their number."""
    import time
    ps = [torch.zeros(n // parts, dtype=torch.float32) for _ in range(parts)]
    for p in ps:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(ps, lr=1e-4, fused=True)
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[1] / n


@dataclasses.dataclass(eq=False)
class _Twin:
    """A block's CPU views: its trainable parameters' masters and gradients in its homes, the
    group each is in, and the homes they were made for."""
    key: tuple[Any, ...]
    params: list[Any]
    grads: list[Any]
    group: list[int]


class HostSteps:
    """The host's steps of streamed blocks (NOTE [host stepping]): :meth:`submit` queues one,
    :meth:`finish` waits for the step's and advances the caller's ``step`` counts."""

    def __init__(self, torch: Any, optimizer: Any, stream: BlockSlots, loads: Any):
        refused = host_step_refusal(optimizer)
        if refused:
            raise ConfigError(refused)
        self.torch, self.opt, self.stream = torch, optimizer, stream
        self.be = stream.tier.backend
        self.loads = loads                      # the optimizer's loads so far (a load makes new states)
        self.cpu_opt: Any = None
        self._twins: dict[int, _Twin] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        # this step's host steps, each with the caller's parameters it steps
        self._futures: list[tuple[concurrent.futures.Future[None], list[Any]]] = []
        self.blocks_stepped = 0
        self.seconds_per_param: float | None = None   # the host's AdamW; None: measured when first needed
        self.agreed: frozenset[int] | None = None       # with a process group, the blocks every rank chose
        self.chosen: frozenset[int] = frozenset()       # the blocks the host steps, as last chosen

    # -- which blocks ------------------------------------------------------------------------------
    def eligible(self, b: Block) -> bool:
        """``b``'s states, now adopted, can step on the host: all Adam's moments, held as made."""
        return (not b.resident and bool(b.states) and b.home_s is not None
                and all(key in HOST_STATE_KEYS for _, key, _ in b.states)
                and all(dt == held for dt, held in b.s_dtypes))

    def choose(self, blocks: list[Block], order: list[int], backward_ms: float) -> None:
        """After a traced step: which eligible blocks step on the host, while their steps fit in
        ``backward_ms``; the rest step on the device. First the blocks larger than the median
        (an embedding, a head: their states would size every slot), then the others in
        backward's order, one run of them from backward's first."""
        if self.seconds_per_param is None:
            self.seconds_per_param = host_seconds_per_param(self.torch) if self.be.kind == "cuda" else 0.0
        left = backward_ms / 1e3
        seen = [i for i in reversed(order)] + [b.index for b in blocks if b.index not in order]
        need = {i: blocks[i].p_bytes + blocks[i].g_bytes + blocks[i].s_bytes for i in seen}
        typical = sorted(need.values())[len(need) // 2] if need else 0
        big = sorted((i for i in seen if need[i] > typical), key=lambda i: -need[i])
        run = True
        for i in big + [i for i in seen if need[i] <= typical]:
            b = blocks[i]
            cost = sum(p.numel() for p in b.trainable) * self.seconds_per_param
            b.host = self.eligible(b) and cost <= left and (run or i in big)
            if b.host:
                left -= cost
            else:
                run = run and i in big
                self._forget(b)
        self.chosen = frozenset(b.index for b in blocks if b.host)

    def takes(self, b: Block) -> bool:
        """Whether the host steps ``b`` once its states are adopted again (after a load started
        them afresh): where it was chosen, and can."""
        return b.index in self.chosen and self.eligible(b)

    def agree(self, blocks: list[Block], group: Any, device: Any) -> None:
        """With a process group, after :meth:`choose`: a block steps on the host only where every
        rank chose it (NOTE [host stepping]). At the first plan, which every rank makes after
        its first step, one all-reduce of a flag per block, on ``device`` (the group's
        backend's: NCCL's a GPU, gloo's the CPU). A later trace is one rank's own (its batch
        changed shape) and must not wait for ranks that do not trace: the blocks agreed then
        stay the host's, where they still can."""
        if self.agreed is None:
            ok = on_every_rank(self.torch, [bool(b.host) for b in blocks], group, device)
            self.agreed = frozenset(b.index for b, yes in zip(blocks, ok) if yes)
        for b in blocks:
            was, b.host = b.host, b.index in self.agreed and self.eligible(b)
            if was and not b.host:
                self._forget(b)
        self.chosen = frozenset(b.index for b in blocks if b.host)

    def _forget(self, b: Block) -> None:
        tw = self._twins.pop(b.index, None)
        if tw is not None and self.cpu_opt is not None:
            for cp in tw.params:
                self.cpu_opt.state.pop(cp, None)

    # -- a step ------------------------------------------------------------------------------------
    def begin(self) -> None:
        """A step begins (the host is idle): the twin takes the caller's hyperparameters now."""
        if self.cpu_opt is None:
            return
        for g, t in zip(self.opt.param_groups, self.cpu_opt.param_groups):
            for k, v in g.items():
                if k not in _NOT_COPIED:
                    t[k] = float(v) if self.torch.is_tensor(v) else v

    def submit(self, b: Block, got: list[Any], clip: tuple[float, Any] | None = None) -> None:
        """Step ``b`` on the host once its gradients' copy home (``b.home_ready``) is done:
        ``got`` are the parameters that have gradients; ``clip`` = (max_norm, the total norm on
        the host) clips them first as clip_grads_with_norm_ does."""
        tw = self._twin(b)
        ids = {id(p) for p in got}
        work = [(cp, cg, k) for p, cp, cg, k in zip(b.trainable, tw.params, tw.grads, tw.group) if id(p) in ids]
        after = b.home_ready
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tiermem-host-step",
                                                               initializer=self._thread_init)
        self._futures.append((self._pool.submit(self._run, after, work, clip),
                              [p for p in b.trainable if id(p) in ids]))
        self.blocks_stepped += 1

    def finish(self) -> None:
        """Wait for this step's host steps (the first raised comes out), and advance the caller's
        ``step`` of each parameter they stepped."""
        err = self._join()
        if err is not None:
            raise err

    def abandon(self) -> None:
        """A failed step: wait for what the host is doing. The blocks it stepped keep their step,
        as blocks stepped on the device inside a failed backward do (NOTE [training transport]),
        so their ``step`` advances too; its error, if any, is the failed step's to report."""
        self._join()

    def _join(self) -> BaseException | None:
        futures, self._futures = self._futures, []
        err, steps = None, []
        for f, params in futures:
            try:
                f.result()
            except BaseException as e:      # noqa: PERF203 - every one is waited for
                err = err or e
                continue
            for p in params:
                st = self.opt.state[p]
                s = st.get("step")
                if self.torch.is_tensor(s):
                    steps.append(s)
                elif s is not None:
                    st["step"] = s + 1
        if steps:
            self.torch._foreach_add_(steps, 1)     # one launch, not one a parameter
        return err

    def close(self) -> None:
        self.abandon()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._twins.clear()
        self.cpu_opt = None

    # -- the host's side -----------------------------------------------------------------------------
    def _thread_init(self) -> None:
        if self.be.kind == "cuda":
            self.torch.cuda.set_device(self.be.device)     # the event waits are this device's

    def _run(self, after: Any, work: list[tuple[Any, Any, int]], clip: tuple[float, Any] | None) -> None:
        torch = self.torch
        if after is not None:
            self.be.synchronize(after)          # the gradients are home
        params = [cp for cp, _, _ in work]
        for cp, cg, _ in work:
            cp.grad = cg
        try:
            if clip is not None:
                torch.nn.utils.clip_grads_with_norm_(params, clip[0], clip[1])
            groups = self.cpu_opt.param_groups
            saved = [g["params"] for g in groups]
            try:
                for k, g in enumerate(groups):
                    g["params"] = [cp for cp, _, j in work if j == k]
                self.cpu_opt.step()
            finally:
                for g, ps in zip(groups, saved):
                    g["params"] = ps
        finally:
            for cp in params:
                cp.grad = None

    # -- the CPU views -----------------------------------------------------------------------------
    def _twin(self, b: Block) -> _Twin:
        """``b``'s CPU views and the twin's states over them, made again when its homes changed
        or the optimizer loaded a state dict (the states then start from the caller's)."""
        key = (b.home_p.ptr, b.home_g.ptr, b.home_s.ptr, b.s_bytes, self.loads())
        tw = self._twins.get(b.index)
        if tw is not None and tw.key == key:
            return tw
        torch = self.torch
        if self.cpu_opt is None:
            self._make_optimizer()
        if tw is not None:
            self._forget(b)
        s = self.stream
        pv = dict(zip(map(id, b.params), s.views(b.home_p.ptr, b, b.home_p, "p", host=True)))
        params = [pv[id(p)] for p in b.trainable]
        grads = s.views(b.home_g.ptr, b, b.home_g, "g", host=True)
        where = {id(p): k for k, g in enumerate(self.opt.param_groups) for p in g["params"]}
        group = [where[id(p)] for p in b.trainable]
        states = s.views(b.home_s.ptr, b, b.home_s, "s", host=True)
        by = {id(p): cp for p, cp in zip(b.trainable, params)}
        for (p, k, _), v in zip(b.states, states):
            st = self.cpu_opt.state[by[id(p)]]
            st[k] = v
            if "step" not in st:
                step = self.opt.state[p].get("step", 0)
                st["step"] = torch.tensor(float(step), dtype=torch.float32)
        tw = self._twins[b.index] = _Twin(key, params, grads, group)
        return tw

    def _make_optimizer(self) -> None:
        """The CPU twin: the caller's optimizer class, fused, a group and a placeholder for each
        of the caller's groups (a group's parameters are set to a block's for each step; its
        hyperparameters are the caller's from :meth:`begin`)."""
        torch = self.torch
        self.cpu_opt = type(self.opt)([{"params": [torch.zeros(1)]} for _ in self.opt.param_groups], fused=True)
        self.begin()
