"""The command line: ``python -m tiermem info``, ``python -m tiermem demo`` and ``python -m tiermem plan``."""
from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys

from . import __version__
from ._limits import ENV_BUDGET, ENV_CAP, ENV_OVERSUBSCRIBE


def _version(mod: str) -> str:
    try:
        m = importlib.import_module(mod)
    except Exception as e:  # not installed, or broken: say so rather than fail
        return f"not installed ({type(e).__name__})"
    return str(getattr(m, "__version__", "installed"))


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n:,} bytes)"


def info(out=sys.stdout) -> int:
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"tiermem {__version__}")
    p(f"  python {platform.python_version()} on {platform.machine()}")
    for mod, label in [("numpy", "numpy"), ("torch", "torch"), ("cupy", "cupy"), ("cuda.bindings", "cuda-bindings")]:
        p(f"  {label:<14}{_version(mod)}")
    p("")
    p("settings")
    p(f"  managed cap     {os.environ.get(ENV_CAP) or 'default: the device memory free when tiermem starts'}  ({ENV_CAP})")
    p(f"  oversubscribe   {'allowed' if os.environ.get(ENV_OVERSUBSCRIBE, '').lower() in {'1', 'true', 'yes', 'on'} else 'refused (default)'}  ({ENV_OVERSUBSCRIBE})")
    p(f"  device budget   {os.environ.get(ENV_BUDGET) or 'none (default)'}  ({ENV_BUDGET})")
    p("")
    from . import _cuda
    ok, why = _cuda.available()
    if not ok:
        p(f"CUDA: no usable GPU here: {why}.")
        p("  tiermem needs a CUDA GPU with managed memory to allocate. Without one, the tests that")
        p("  need no GPU still run, and `python -m tiermem demo` prints a dry-run plan instead.")
        return 0
    from ._limits import resolve_cap, resolve_budget
    for dev in range(_cuda.device_count()):
        c = _cuda.capabilities(dev)
        free, total = _cuda.mem_get_info(dev)
        p(f"device {dev}: {c.name}, compute capability {c.compute_capability[0]}.{c.compute_capability[1]}")
        p(f"  memory            {_gib(free)} free of {_gib(total)}")
        p(f"  driver / runtime  {c.driver_version} / {c.runtime_version}")
        for field in ("managed_memory", "concurrent_managed_access", "pageable_memory_access",
                      "direct_managed_mem_access_from_host", "host_native_atomic_supported", "batch_memory_ops"):
            p(f"  {field:<36}{'yes' if getattr(c, field) else 'no'}")
        p(f"  tiermem can       " + ", ".join(f"{f}={'yes' if c.supports(f) else 'no'}"
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tiermem", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="versions, device capabilities, cap and budget settings")
    d = sub.add_parser("demo", help="run a model bigger than its budget (a dry-run plan without a GPU)")
    d.add_argument("--weights-gb", type=float, default=None, help="model weight size (default: 2 GB on a GPU)")
    d.add_argument("--budget", default="25%", help="device budget: bytes, '1GiB', or a share of the weights like '25%%'")
    d.add_argument("--dry-run", action="store_true", help="print the plan only, even on a GPU")
    from . import _plan
    _plan.add_parser(sub)
    args = ap.parse_args(argv)
    if args.cmd == "info":
        return info()
    if args.cmd == "plan":
        return _plan.run(args)
    from ._demo import demo
    return demo(weights_gb=args.weights_gb, budget=args.budget, dry_run=args.dry_run)
