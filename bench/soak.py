"""Soak on a really small GPU: random operations on tensors of every role, a wrap_training loop and
a wrap_module inference loop between them, and failures injected at random through the CUDA
backend's hook (NOTE [failure injection] in tiermem/cuda/backend.py), recovering from each.

First it takes all but ``--keep-gb`` of the card with one plain allocation, so the driver really
has little free (docs/facts.md, "A really small GPU"); tiermem's default managed cap is the free
memory at its start, so managed memory stays below what the driver has. tiermem's own use stays
well under 1 GiB.

Checks: a checksum on every read of a tiered tensor and a bitwise compare of every inference
forward against the plain model's output (``mismatches``); after each injected failure, the
error is tiermem's (or the interrupt), the books agree with the tensors and the tensor the
operation touched still reads right (``faults_recovered``); at the end of each seed, with
everything freed, tiermem holds nothing and the driver has its memory back (``leaked_bytes``).

    PYTHONPATH=. python3 bench/soak.py --seeds 3 --minutes 2
"""
from __future__ import annotations

import argparse
import collections
import gc
import math
import os
import random
import sys
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 2 * MiB, 3 * MiB + 8, 8 * MiB]
ROLES = ["weight", "frozen_weight", "activation", "gradient", "optimizer_state", "input", "workspace"]
BUDGET = 48 * MiB             # as tests/test_gpu_stress.py: every eviction path is taken
MAX_LIVE = 40                 # tensors at once: at most ~0.4 GiB of managed memory
OPS = ["alloc", "group", "wrap", "unwrap", "free", "write", "evict", "prefetch", "read", "hold", "drop", "bounce",
       "release", "trim"]
WEIGHTS = [10, 2, 3, 2, 8, 16, 14, 14, 24, 3, 3, 6, 3, 1]
TRAIN_EVERY, INFER_EVERY = 400, 150     # a training step, an inference forward, every so many ops
MAX_MINUTES = 10
WARM_OPS = 3000               # the unmeasured first pass (NOTE [soak warm-up])

# NOTE [soak warm-up]
#     CUDA loads a kernel's module when the kernel first runs (lazy loading, the default since
#     CUDA 12.2), and torch and CuPy keep what they load: device memory taken on a first use and
#     never given back. A seed that is the first to reach some path (a fault's recovery, a dtype,
#     the staging ring on) then showed 2 MiB less free memory at its end than at its start (H100,
#     1ec2eef), though nothing of tiermem's was left. So a short pass with the same operations
#     and faults runs first, unmeasured; each measured seed must then give the driver back every
#     byte (no slack).


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=20261123, help="the first seed (default %(default)s)")
    ap.add_argument("--seeds", type=int, default=1, help="how many seeds, one after another in one process")
    ap.add_argument("--ops", type=int, default=50_000, help="random operations per seed (default %(default)s)")
    ap.add_argument("--minutes", type=float, default=3.0,
                    help=f"time limit per seed, minutes (default %(default)s; all seeds together at most {MAX_MINUTES})")
    ap.add_argument("--keep-gb", type=float, default=4.0, help="GB of the card left free for the soak (default %(default)s)")
    ap.add_argument("--fault-rate", type=float, default=0.02, help="share of operations with a failure injected")
    ap.add_argument("--no-write", action="store_true", help="do not write the results file")
    args = ap.parse_args(argv)
    if args.seeds < 1 or args.ops < 1 or args.minutes <= 0:
        ap.error("--seeds, --ops and --minutes must be positive")
    if args.minutes * args.seeds > MAX_MINUTES:
        ap.error(f"--minutes x --seeds is {args.minutes * args.seeds:g} minutes; the soak runs {MAX_MINUTES} at most")
    if args.keep_gb < 2:
        ap.error("--keep-gb must leave at least 2 GB: the soak's own memory has to fit in it")
    if not 0 <= args.fault_rate < 1:
        ap.error("--fault-rate is a share, 0 <= rate < 1")
    return args


def assemble(seeds: list[dict[str, Any]], min_free: float) -> tuple[dict[str, float], dict[str, bool]]:
    """The results file's metrics and checks from the per-seed results."""
    total = collections.Counter()
    for s in seeds:
        total.update({k: v for k, v in s.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    leaked = sum(max(0, s["tiermem_leaked_bytes"]) + max(0, s["driver_leaked_bytes"]) for s in seeds)
    metrics = {
        "ops": int(total["ops"]), "reads_checked": int(total["reads_checked"]), "mismatches": int(total["mismatches"]),
        "faults_injected": int(total["faults_injected"]), "faults_recovered": int(total["faults_recovered"]),
        "leaked_bytes": int(leaked), "min_free_GB": round(min_free / 1e9, 3),
        "tiermem_leaked_bytes": int(total["tiermem_leaked_bytes"]),
        "driver_leaked_bytes": int(sum(s["driver_leaked_bytes"] for s in seeds)),
        "train_steps": int(total["train_steps"]), "infer_forwards": int(total["infer_forwards"]),
        "unexpected_errors": int(total["unexpected_errors"]), "seeds": len(seeds),
        "seconds": round(float(total["seconds"]), 1),
    }
    checks = {
        "no_mismatch": metrics["mismatches"] == 0,
        # tiermem holds nothing, and the driver has every byte back (NOTE [soak warm-up])
        "no_leak": metrics["tiermem_leaked_bytes"] == 0 and metrics["driver_leaked_bytes"] == 0,
        "all_recovered": metrics["faults_recovered"] == metrics["faults_injected"] and metrics["unexpected_errors"] == 0,
    }
    return metrics, checks


def drop_frames(err: BaseException | None) -> None:
    """Let go of the frames an exception's tracebacks hold (its cause and context included): a
    caller that keeps the exception would otherwise keep the failed call's tensors alive."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if err.__traceback__ is not None:
            traceback.clear_frames(err.__traceback__)
            err.__traceback__ = None
        err = err.__cause__ or err.__context__


def injected(err: BaseException) -> bool:
    """Whether ``err`` is an injected failure as it should reach the caller: tiermem's error with
    the CUDA error's name, the interrupt itself, or (raised inside a backward hook, carried across
    autograd's engine) a RuntimeError with the injector's message."""
    import tiermem
    if isinstance(err, KeyboardInterrupt):
        return True
    if isinstance(err, tiermem.TierMemError):
        return getattr(err, "name", "") in ("cudaErrorLaunchFailure", "cudaErrorMemoryAllocation")
    return isinstance(err, RuntimeError) and ("injected at" in str(err) or "cudaError" in str(err))


class Soak:
    """One seed's run. Every counter it reports is an attribute; ``run`` fills them."""

    def __init__(self, seed: int, ops: int, seconds: float, fault_rate: float, injector: Any, log: Any):
        import torch
        self.torch, self.rng = torch, random.Random(seed)
        self.seed, self.max_ops, self.seconds, self.fault_rate = seed, ops, seconds, fault_rate
        self.inj, self.log = injector, log
        self.last_fired: Any = None
        self.c = collections.Counter()
        self.min_free = math.inf
        self.errors: list[str] = []
        self.weights = torch.randint(-(2**62), 2**62, (SIZES[-1] // 8,), dtype=torch.int64, device="cuda",
                                     generator=torch.Generator(device="cuda").manual_seed(seed))

    # -- helpers ----------------------------------------------------------------------------------
    def checksum(self, x: Any) -> int:
        w = x.reshape(-1).view(self.torch.uint8)
        pad = (-w.numel()) % 8
        if pad:
            w = self.torch.cat([w, w.new_zeros(pad)])
        w = w.view(self.torch.int64)
        return int((w * self.weights[: w.numel()]).sum())

    def sample_free(self) -> None:
        self.min_free = min(self.min_free, self.torch.cuda.mem_get_info()[0])

    def unexpected(self, where: str, err: BaseException) -> None:
        self.c["unexpected_errors"] += 1
        if len(self.errors) < 10:
            self.errors.append(f"{where}: {''.join(traceback.format_exception(err))}")
            self.log(f"UNEXPECTED at {where}: {err!r}")

    def arm(self, calls: int) -> bool:
        if self.rng.random() >= self.fault_rate:
            return False
        self.inj.fail_at(self.rng.randint(1, max(calls, 1)), self.rng.choice(["cuda", "interrupt", "oom"]))
        return True

    def settle(self, err: BaseException | None, where: str) -> bool:
        """After an operation: True if an injected failure fired (its error checked)."""
        fired = self.last_fired = self.inj.fired
        self.inj.disarm()
        self.inj.fired = None
        if fired is None:
            if err is not None:
                self.unexpected(where, err)
            return False
        self.c["faults_injected"] += 1
        if err is not None and not injected(err):
            self.unexpected(f"{where} (after {fired})", err)
            return True
        return True

    # -- the tensors ----------------------------------------------------------------------------------
    def tensor_op(self, t: Any, live: list[list]) -> None:
        """One random operation. ``live`` rows: [TieredTensor, checksum or None, held view or
        None, the wrapped torch tensor or None]."""
        import tiermem
        rng = self.rng
        op = rng.choices(OPS, weights=WEIGHTS)[0]
        e = rng.choice(live) if live else None
        if e is None or (op in ("alloc", "group", "wrap") and len(live) < MAX_LIVE):
            op = op if op in ("alloc", "group", "wrap") else "alloc"
        elif op in ("alloc", "group", "wrap"):
            op = "read"
        armed = self.arm(12)
        err: BaseException | None = None
        try:
            self.do(op, t, live, e)
        except BaseException as x:     # noqa: B036 - injected interrupts are part of the soak
            err = x
        if isinstance(err, tiermem.OutOfBudgetError) and self.inj.fired is None:
            self.c[f"{op}_refused"] += 1     # the budget's own answer, not a failure
            err = None
        self.c["ops"] += 1
        self.c[f"op_{op}"] += 1
        fired = self.settle(err, op)
        drop_frames(err)   # before the books: its frames would keep the failed operation's buffers alive
        if fired:
            if err is None or injected(err):
                self.c["faults_recovered"] += self.recovered(t, live, e, op)
        elif armed:
            self.c["armed_not_fired"] += 1

    def do(self, op: str, t: Any, live: list[list], e: list | None) -> None:
        import tiermem
        torch, rng = self.torch, self.rng
        if op == "alloc":
            live.append([t.empty(rng.choice(SIZES), "uint8", role=rng.choice(ROLES)), None, None, None])
        elif op == "group":
            members = [((rng.choice(SIZES[:4]),), "uint8") for _ in range(rng.randint(2, 4))]
            live.extend([x, None, None, None] for x in t.empty_group(members, role=rng.choice(ROLES)))
        elif op == "wrap":
            n = rng.choice(SIZES[:-1]) // 4
            p = torch.nn.Parameter(torch.randn(n, device="cuda"), requires_grad=rng.random() < 0.5)
            want = self.checksum(p.detach())
            tt = t.wrap(p, role="weight")
            live.append([tt, want, None, p])
        elif op == "trim":
            t.trim()
        else:
            x, _, _, p = e
            if op == "free":
                live.remove(e)
                if p is not None and tiermem.tiered_of(p) is not None:
                    tiermem.unwrap(p)
                e[2] = None
                x.free()
            elif op == "unwrap":
                if p is None or tiermem.tiered_of(p) is None:
                    return
                tiermem.unwrap(p)
                live.remove(e)
                self.read_plain(p, e[1])
            elif op == "write":
                if p is not None:
                    if not p.requires_grad:
                        return           # wrapped as a frozen weight: the soak promised not to write it
                    with torch.no_grad():
                        p.data.normal_()
                    e[1] = self.checksum(p.detach())
                    return
                v = x.torch()
                v.random_(0, 256)
                e[1] = self.checksum(v)
                del v
            elif op == "evict":
                x.evict(non_blocking=self.non_blocking(p))
            elif op == "release":
                t.evict(x, release=True)
            elif op == "prefetch":
                x.prefetch(non_blocking=self.non_blocking(p))
            elif op == "bounce":
                # Out without waiting and straight back in (the pattern behind NOTE [discard
                # fence] in cuda/backend.py).
                x.evict(non_blocking=p is None)
                self.read(e)
            elif op == "read":
                self.read(e)
            elif op == "hold":
                e[2] = x.torch()        # a foreign view: the Unified Memory path
            elif op == "drop":
                e[2] = None

    def non_blocking(self, p: Any) -> bool:
        # Not for a wrapped tensor: the soak touches it directly, and a non-blocking move's
        # tensors must not be touched until it is done (Tier.evict).
        return p is None and self.rng.random() < 0.3

    def read(self, e: list) -> None:
        x, want, _, p = e
        if want is None:
            return
        v = x.torch(writable=False)      # waits for its moves, brings it back from its shadow
        got = self.checksum(v if p is None else p.detach())   # a wrapped one reads through itself
        del v
        self.c["reads_checked"] += 1
        if got != want:
            self.c["mismatches"] += 1
            self.log(f"MISMATCH seed {self.seed} op {self.c['ops']}: {x!r}")

    def read_plain(self, p: Any, want: int | None) -> None:
        if want is not None:
            self.c["reads_checked"] += 1
            if self.checksum(p.detach()) != want:
                self.c["mismatches"] += 1
                self.log(f"MISMATCH seed {self.seed} op {self.c['ops']}: unwrapped tensor")

    def books(self, t: Any, live: list[list], collect: bool = False) -> bool:
        """tiermem's accounting against the tensors the soak holds. Without a full collection
        first (it takes a good part of a second here), and if they disagree, again after one."""
        t.synchronize()
        if collect:
            gc.collect()
        parked = sum(e[0].buffer.span for e in live if not e[0].freed and e[0].parked)
        resident = sum(e[0].buffer.span for e in live if not e[0].freed and e[0].is_resident) + parked
        s = t.stats()
        ok = (t.resident_bytes == resident and t.parked_bytes == parked and resident + t.staging_bytes <= BUDGET
              and s["allocated_bytes.all.current"] == sum(e[0].nbytes for e in live if not e[0].freed))
        return ok or (not collect and self.books(t, live, collect=True))

    def recovered(self, t: Any, live: list[list], e: list | None, op: str = "") -> int:
        """After an injected failure: the books agree and the touched tensor reads right."""
        try:
            ok = self.books(t, live)
            if not ok:
                held = [x for x in live if not x[0].freed]
                s = t.stats()
                self.log(f"books disagree after a fault in {op!r} (fault at {self.last_fired}), seed {self.seed} op "
                         f"{self.c['ops']}: resident {t.resident_bytes} vs tensors "
                         f"{sum(x[0].buffer.span for x in held if x[0].is_resident or x[0].parked)}, parked "
                         f"{t.parked_bytes} vs {sum(x[0].buffer.span for x in held if x[0].parked)}, allocated "
                         f"{s['allocated_bytes.all.current']} vs {sum(x[0].nbytes for x in held)}, staging "
                         f"{t.staging_bytes}")
            if e is not None and e in live:
                before = self.c["mismatches"]
                self.read(e)
                ok = ok and self.c["mismatches"] == before
            return int(ok)
        except BaseException as x:   # noqa: B036
            self.unexpected("recovery check", x)
            return 0

    # -- training and inference -------------------------------------------------------------------
    def gpt(self, cfg: dict, seed: int) -> tuple[Any, Any]:
        from tiermem.testing import GPT, GPTConfig
        c = GPTConfig(**cfg)
        self.torch.manual_seed(seed)
        return GPT(c).cuda(), c

    def warm_up(self) -> None:
        """Load, once, what the process keeps for good after its first use: the kernels the two
        models run (CUDA loads modules lazily, into device memory) and cuBLAS's handle. Without
        this the first seed's leak check would count them (310 MB on the H100)."""
        import torch.nn.functional as F

        import tiermem
        torch = self.torch
        for cfg in (dict(vocab=2048, seq=64, d=256, layers=4, heads=4), dict(vocab=2048, seq=128, d=384, layers=8, heads=4)):
            model, c = self.gpt(cfg, 0)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            ids = self.batch(c)
            logits = model(ids[:, :-1])
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
            opt.step()
            with torch.no_grad():
                model.eval()(ids[:2, :-1])
            del model, opt, logits
        t = tiermem.Tier(0, budget=BUDGET, staging="8MiB")
        x = t.empty(4 * MiB, "uint8", role="activation")
        x.evict()
        x.prefetch()
        x.free()
        t.close()
        torch.cuda.synchronize()

    def batch(self, c: Any, n: int = 8) -> Any:
        return self.torch.randint(0, c.vocab, (n, c.seq + 1), device="cuda",
                                  generator=self.gen)

    def train_step(self, train: Any, model: Any, c: Any, per_step: int) -> None:
        import torch.nn.functional as F
        ids = self.batch(c)
        self.arm(per_step)
        err = None
        loss = None
        try:
            with train.step():
                logits = model(ids[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
                loss.backward()
        except BaseException as x:    # noqa: B036
            err = x
        self.c["ops"] += 1
        self.c["train_steps"] += 1
        fired = self.settle(err, "train step")
        drop_frames(err)   # the failed step's activations, held by its frames
        if fired:
            if err is None or injected(err):
                # recovered when the step after it runs and leaves no gradient behind
                try:
                    self.train_step_plain(train, model, c)
                    self.c["faults_recovered"] += 1
                except BaseException as x:   # noqa: B036
                    self.unexpected("train step after a fault", x)
        elif loss is not None and not bool(self.torch.isfinite(loss)):
            self.unexpected("train step", FloatingPointError(f"loss {float(loss)}"))

    def train_step_plain(self, train: Any, model: Any, c: Any) -> None:
        import torch.nn.functional as F
        ids = self.batch(c)
        with train.step():
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            loss.backward()
        if any(p.grad is not None for p in model.parameters()) or not bool(self.torch.isfinite(loss)):
            raise AssertionError("a step left gradients behind or gave a non-finite loss")

    def infer(self, model: Any, ids: Any, want: Any, per_fwd: int) -> None:
        torch = self.torch
        self.arm(per_fwd)
        err = None
        try:
            with torch.no_grad():
                got = model(ids)
            self.c["reads_checked"] += 1
            if not torch.equal(got, want):
                self.c["mismatches"] += 1
                self.log(f"MISMATCH seed {self.seed}: an inference forward differs from the plain model's")
        except BaseException as x:    # noqa: B036
            err = x
        self.c["ops"] += 1
        self.c["infer_forwards"] += 1
        fired = self.settle(err, "inference forward")
        drop_frames(err)
        if fired and (err is None or injected(err)):
            try:            # recovered when the next forward gives the plain model's output again
                with torch.no_grad():
                    ok = torch.equal(model(ids), want)
                self.c["reads_checked"] += 1
                self.c["mismatches"] += not ok
                self.c["faults_recovered"] += ok
            except BaseException as x:    # noqa: B036
                self.unexpected("inference forward after a fault", x)

    # -- one seed -----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        import tiermem
        torch = self.torch
        self.gen = torch.Generator(device="cuda").manual_seed(self.seed)
        t0 = time.perf_counter()
        self.warm_up()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free0 = torch.cuda.mem_get_info()[0]
        self.sample_free()
        from _common import tier_staging_everything      # every shadow copy goes through the ring when it is on
        t = tier_staging_everything(tiermem, device=0, budget=BUDGET, staging=self.rng.choice(["off", "8MiB"]))
        # inference: a frozen tiny GPT within 40% of its weights
        in_tier = tiermem.Tier(0)
        imodel, ic = self.gpt(dict(vocab=2048, seq=64, d=256, layers=4, heads=4), self.seed + 1)
        imodel = imodel.eval().requires_grad_(False)
        ids = self.batch(ic, 2)[:, :-1]
        with torch.no_grad():
            want = imodel(ids)
        wbytes = sum(p.numel() * p.element_size() for p in imodel.parameters())
        handle = in_tier.wrap_module(imodel, budget=int(0.4 * wbytes))
        # training, last: its cap on torch's allocator leaves out what torch holds before it.
        # The GPT and budget of tests/test_gpu_train.py: blocks stream, activations swap.
        tr_tier = tiermem.Tier(0)
        model, c = self.gpt(dict(vocab=2048, seq=128, d=384, layers=8, heads=4), self.seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        train = tr_tier.wrap_training(model, opt, 128 * MiB, block_bytes=1 * MiB, min_swap=256 << 10)
        # calls a clean (planned) step and a clean forward make: where an injected failure may land
        self.train_step_plain(train, model, c)      # traced
        n0 = self.inj.calls
        self.train_step_plain(train, model, c)
        per_step = self.inj.calls - n0
        n0 = self.inj.calls
        with torch.no_grad():
            imodel(ids)
        per_fwd = self.inj.calls - n0
        live: list[list] = []
        last = time.perf_counter()
        i = 0
        while self.c["ops"] < self.max_ops and time.perf_counter() - t0 < self.seconds:
            i += 1
            self.tensor_op(t, live)
            if i % TRAIN_EVERY == 0:
                self.train_step(train, model, c, per_step)
            if i % INFER_EVERY == 0:
                self.infer(imodel, ids, want, per_fwd)
            if i % 200 == 0:
                self.sample_free()
                if not self.books(t, live, collect=i % 5000 == 0):
                    self.unexpected("books", AssertionError("tiermem's accounting disagrees with the tensors"))
            if time.perf_counter() - last > 10:
                last = time.perf_counter()
                self.log(f"seed {self.seed}: {self.c['ops']:,} ops, {self.c['reads_checked']:,} reads, "
                         f"{self.c['mismatches']} mismatches, {self.c['faults_injected']} faults "
                         f"({self.c['faults_recovered']} recovered), {self.c['unexpected_errors']} unexpected, "
                         f"free {self.min_free / 1e9:.2f} GB min")
        # final reads, then everything goes
        for e in list(live):
            try:
                self.read(e)
            except BaseException as x:   # noqa: B036
                self.unexpected("final read", x)
        for e in live:
            if e[3] is not None and tiermem.tiered_of(e[3]) is not None:
                tiermem.unwrap(e[3])
        live.clear()
        e = None
        train.unwrap()
        handle.unwrap()
        del train, handle, model, opt, imodel
        gc.collect()
        torch.cuda.synchronize()
        held = 0
        for tier in (t, tr_tier, in_tier):
            tier.close()
            s = tier.stats()
            held += s["allocated_bytes.all.current"] + s["managed.reserved_bytes.current"] + s["shadow_bytes.current"]
            held += s["staging_bytes.current"]
        del t, tr_tier, in_tier
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        free1 = torch.cuda.mem_get_info()[0]
        self.sample_free()
        out = {k: v for k, v in self.c.items()}
        out.update(seed=self.seed, seconds=time.perf_counter() - t0, tiermem_leaked_bytes=held,
                   driver_leaked_bytes=max(0, free0 - free1), free_before=free0, free_after=free1,
                   min_free=self.min_free, errors=self.errors)
        for k in ("ops", "reads_checked", "mismatches", "faults_injected", "faults_recovered", "train_steps",
                  "infer_forwards", "unexpected_errors"):
            out.setdefault(k, 0)
        return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from _common import progress, write_results

    from tiermem.cuda.backend import FaultInjector, inject_faults
    if not torch.cuda.is_available():
        print("bench/soak.py needs a CUDA GPU", file=sys.stderr)
        return 2
    free, total = torch.cuda.mem_get_info()
    keep = int(args.keep_gb * 1e9)
    progress(f"{torch.cuda.get_device_name(0)}: {free / 1e9:.1f} of {total / 1e9:.1f} GB free; taking all but "
             f"{args.keep_gb:g} GB in one allocation")
    blob = torch.empty(max(free - keep, 0), dtype=torch.uint8, device="cuda")   # noqa: F841 - held to the end
    progress(f"the driver has {torch.cuda.mem_get_info()[0] / 1e9:.2f} GB free")
    inj = FaultInjector()
    inject_faults(inj)
    results = []
    try:
        progress(f"warm-up pass: {WARM_OPS:,} ops, not counted (NOTE [soak warm-up])")
        w = Soak(args.seed - 1, min(WARM_OPS, args.ops), 60, args.fault_rate, inj, progress).run()
        progress(f"warm-up: driver free {w['free_before'] / 1e9:.3f} -> {w['free_after'] / 1e9:.3f} GB, "
                 f"{w['unexpected_errors']} unexpected errors")
        for k in range(args.seeds):
            seed = args.seed + k
            progress(f"seed {seed}: up to {args.ops:,} ops or {args.minutes:g} min")
            r = Soak(seed, args.ops, args.minutes * 60, args.fault_rate, inj, progress).run()
            results.append(r)
            progress(f"seed {seed}: {r['ops']:,} ops, {r['reads_checked']:,} reads checked, {r['mismatches']} mismatches, "
                     f"{r['faults_injected']} faults injected, {r['faults_recovered']} recovered, "
                     f"{r['unexpected_errors']} unexpected errors, tiermem holds {r['tiermem_leaked_bytes']} B, "
                     f"driver free {r['free_before'] / 1e9:.3f} -> {r['free_after'] / 1e9:.3f} GB")
            for msg in r["errors"]:
                print(msg, flush=True)
    finally:
        inject_faults(None)
        del blob
    min_free = min(r["min_free"] for r in results)
    metrics, checks = assemble(results, min_free)
    progress(f"metrics {metrics}")
    progress(f"checks {checks}")
    if not args.no_write:
        write_results("soak", metrics, checks, raw={"args": vars(args), "seeds": results})
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
