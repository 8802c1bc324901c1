"""The command line: ``python -m tiermem info``, ``python -m tiermem demo`` and ``python -m tiermem plan``.

A user error (a bad option, a missing command, a setting tiermem refuses) is one line on stderr
and exit status 2, never a traceback; ``--help`` says the rest.
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import platform
import sys
from typing import NoReturn

from .. import __version__
from ..base.limits import ENV_BUDGET, ENV_CAP, ENV_OVERSUBSCRIBE, check_bytes
from ..errors import CheckpointError, ConfigError, TierMemError

# The dry run lists every decoder layer, and a real run builds the model: past this the command
# would only run out of memory or time.
MAX_WEIGHTS_GB = 1000.0


def _version(mod: str) -> str:
    try:
        m = importlib.import_module(mod)
    except Exception as e:  # not installed, or broken: say so rather than fail
        return f"not installed ({type(e).__name__})"
    return str(getattr(m, "__version__", "installed"))


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n:,} bytes)"


def _invalid(value: str | None, **check) -> str:
    """"" or "  invalid: <why>" for a size setting from the environment, checked without a GPU."""
    if not value:
        return ""
    try:
        check_bytes(value, **check)
    except ConfigError as e:
        return f"  invalid: {e}"
    return ""


def info(out=sys.stdout) -> int:
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"tiermem {__version__}")
    p(f"  python {platform.python_version()} on {platform.machine()}")
    for mod, label in [("numpy", "numpy"), ("torch", "torch"), ("cupy", "cupy"), ("cuda.bindings", "cuda-bindings")]:
        p(f"  {label:<14}{_version(mod)}")
    p("")
    p("settings")
    cap, budget = os.environ.get(ENV_CAP), os.environ.get(ENV_BUDGET)
    p(f"  managed cap     {cap or 'default: the device memory free when tiermem starts'}  ({ENV_CAP})"
      + _invalid(cap, what="managed cap"))
    p(f"  oversubscribe   {'allowed' if os.environ.get(ENV_OVERSUBSCRIBE, '').lower() in {'1', 'true', 'yes', 'on'} else 'refused (default)'}  ({ENV_OVERSUBSCRIBE})")
    p(f"  device budget   {budget or 'none (default)'}  ({ENV_BUDGET})"
      + _invalid(budget, what="device budget", max_percent=100))
    p("")
    from ..cuda import runtime as _cuda
    ok, why = _cuda.available()
    if not ok:
        p(f"CUDA: no usable GPU here: {why}.")
        p("  tiermem needs a CUDA GPU with managed memory to allocate. Without one, the tests that")
        p("  need no GPU still run, and `python -m tiermem demo` prints a dry-run plan instead.")
        return 0
    from ..base.limits import resolve_budget, resolve_cap
    for dev in range(_cuda.device_count()):
        c = _cuda.capabilities(dev)
        free, total = _cuda.mem_get_info(dev)
        p(f"device {dev}: {c.name}, compute capability {c.compute_capability[0]}.{c.compute_capability[1]}")
        p(f"  memory            {_gib(free)} free of {_gib(total)}")
        p(f"  driver / runtime  {c.driver_version} / {c.runtime_version}")
        for field in ("managed_memory", "concurrent_managed_access", "pageable_memory_access",
                      "direct_managed_mem_access_from_host", "host_native_atomic_supported", "batch_memory_ops"):
            p(f"  {field:<36}{'yes' if getattr(c, field) else 'no'}")
        p("  tiermem can       " + ", ".join(f"{f}={'yes' if c.supports(f) else 'no'}"
                                             for f in ("advise", "prefetch", "batch_prefetch", "discard")))
        try:
            cap, allow = resolve_cap(None, None, free=free, total=total)
            p(f"  managed cap       {_gib(cap)}{' (oversubscription allowed)' if allow else ''}")
        except Exception as e:
            p(f"  managed cap       invalid: {e}")
        try:
            b = resolve_budget(None, total=total)
            p(f"  device budget     {'none' if b is None else _gib(b)}")
        except Exception as e:
            p(f"  device budget     invalid: {e}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, with an error on one line: argparse's own prints the usage over several lines
    first, which buries the reason. The usage still follows the reason, on the same line."""

    def error(self, message: str) -> NoReturn:
        usage = " ".join(self.format_usage().split())
        self.exit(2, f"{self.prog}: error: {message} ({usage})\n")


def _weights_gb(text: str) -> float:
    try:
        gb = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GB") from None
    if not math.isfinite(gb) or gb <= 0:
        raise argparse.ArgumentTypeError(f"the model needs a positive size in GB, got {text}")
    if gb > MAX_WEIGHTS_GB:
        raise argparse.ArgumentTypeError(f"{text} GB is more than the demo's {MAX_WEIGHTS_GB:g} GB")
    return gb


def _budget(text: str) -> str:
    # A share above 100% would be more than the GPU has, and 0 bytes would keep nothing.
    try:
        check_bytes(text, what="budget", max_percent=100, positive=True)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m tiermem",
                 description="tiermem: tiered GPU/host tensors on CUDA Unified Memory. `info` says what this "
                             "machine has; `demo` runs a model bigger than its device budget.")
    ap.add_argument("--version", action="version", version=f"tiermem {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{info,demo,plan}")
    sub.add_parser("info", help="versions, device capabilities, cap and budget settings")
    d = sub.add_parser("demo", help="run a model bigger than its budget (a dry-run plan without a GPU)")
    d.add_argument("--weights-gb", type=_weights_gb, default=None, metavar="GB",
                   help=f"model weight size in GB, more than 0 and at most {MAX_WEIGHTS_GB:g} (default: 2)")
    d.add_argument("--budget", type=_budget, default=None, metavar="SIZE",
                   help="device budget: bytes, '1GiB', or a share of the GPU up to 100%% like '25%%' "
                        "(default: a quarter of the weights)")
    d.add_argument("--dry-run", action="store_true", help="print the plan only, even on a GPU")
    from . import plan as _plan
    _plan.add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    try:
        if args.cmd == "info":
            return info()
        if args.cmd == "plan":
            from . import plan as _plan
            return _plan.run(args)
        from .demo import demo
        return demo(weights_gb=args.weights_gb, budget=args.budget, dry_run=args.dry_run)
    except TierMemError as e:
        # tiermem's errors say what to do in their message; a traceback would only hide it. A bad
        # setting (TIERMEM_BUDGET, say) or input (a checkpoint load_pretrained would refuse) is
        # the user's, so it exits 2 like a bad option; anything else (no memory left, a CUDA
        # failure, a package missing) exits 1. Other exceptions are bugs: they keep their traceback.
        text = " ".join(str(e).split("\n"))      # one line, whatever a message quoted
        print(f"{ap.prog}: error: {text}", file=sys.stderr)
        return 2 if isinstance(e, (ConfigError, CheckpointError)) else 1
    except KeyboardInterrupt:
        print(f"{ap.prog}: interrupted", file=sys.stderr)
        return 130
