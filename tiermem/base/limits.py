"""The two limits: the cap on managed memory and the device budget.

NOTE [managed cap]
    Managed memory can be allocated beyond what the GPU holds; the driver then pages it in and
    out. On shared, virtualised GPU machines a process that oversubscribes managed memory can hang
    the GPU for everyone (docs/facts.md). So tiermem refuses any managed allocation that would
    take its total past a cap. By default the cap is the device memory that was free when tiermem
    started on that device, so all managed memory can be resident at once. A larger cap is an
    explicit opt-in: ``allow_oversubscribe=True`` (or TIERMEM_ALLOW_OVERSUBSCRIBE=1) together
    with ``cap=`` (or TIERMEM_MANAGED_CAP). The cap counts raw managed bytes from the driver,
    including blocks that a pool caches for reuse; a pool releases its cache before giving up.

NOTE [device budget]
    The budget is how many bytes of tiered tensors tiermem keeps resident on the device. It
    emulates a smaller GPU, and it is what tiermem's prefetch and eviction work within. It is
    tiermem's own accounting of where it placed each tensor, cross-checked in the tests with CUDA
    range attributes and transfer counters; cudaMemGetInfo cannot serve, since it does not rise
    when managed pages leave the device.

NOTE [sizes]
    Every size tiermem takes (a cap, a budget, a handle's budget, a host budget, a CLI flag) is
    read here, by one rule: an int is bytes; a string is a number and a unit, decimal ("8GB" is
    8e9 bytes) or binary ("8GiB" is 2**33), case ignored; a percentage ("25%") is a share of the
    total memory of the device the tier runs on, at most 100%. It is never a share of a model:
    ``wrap_module(model, budget="25%")`` lets the module keep up to a quarter of the GPU, and
    ``budget=tiermem.planning.weight_bytes(model) // 4`` keeps a quarter of its weights. A host
    budget has no percentage (host memory is not the device's), and where no device is known (the
    ``plan`` command on a CPU) a percentage needs the device's size given.
"""
from __future__ import annotations

import math
import numbers
import os
import re
import threading

from ..errors import CapExceededError, ConfigError, ConfigTypeError

__all__ = ["parse_bytes", "check_bytes", "CapGuard", "resolve_cap", "resolve_budget", "budget_setting", "cap_setting", "ENV_CAP", "ENV_OVERSUBSCRIBE", "ENV_BUDGET"]

ENV_CAP = "TIERMEM_MANAGED_CAP"
ENV_OVERSUBSCRIBE = "TIERMEM_ALLOW_OVERSUBSCRIBE"
ENV_BUDGET = "TIERMEM_BUDGET"

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _parse(value: int | float | str, what: str, max_percent: float | None) -> tuple[int | float, bool]:
    """(number, is_percent) of a size, checked: everything but resolving a percentage."""
    if isinstance(value, bool):
        raise ConfigTypeError(f"{what} must be a byte count, got {value!r}")
    if isinstance(value, numbers.Real):   # NumPy's scalars too
        if not math.isfinite(value):
            raise ConfigError(f"{what} must be a finite byte count, got {value!r}")
        # An int stays exact: a float has 53 bits.
        num, percent = (int(value) if isinstance(value, numbers.Integral) else float(value)), False
    elif not isinstance(value, str):
        raise ConfigTypeError(f"{what} must be a byte count or a string like '4GiB', got {type(value).__name__}")
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(%|[a-zA-Z]*)\s*", str(value))
        if not m or (m.group(2).lower() not in _UNITS and m.group(2) != "%"):
            why = "sizes are not negative" if re.fullmatch(r"\s*-\s*[0-9.]+\s*%?[a-zA-Z]*\s*", str(value)) else \
                "use bytes, '4GiB', '1.5GB' or '25%'"
            raise ConfigError(f"{what}={value!r} is not a size: {why}")
        unit = m.group(2).lower()
        percent = unit == "%"
        num = float(m.group(1)) * (1 if percent else _UNITS[unit])
        if percent and max_percent is not None and num > max_percent:
            raise ConfigError(f"{what}={value!r} is more than {max_percent:g}%: a budget is a share of "
                              f"what it limits, at most all of it")
    if num < 0:
        raise ConfigError(f"{what} must not be negative, got {value!r}")
    return num, percent


def parse_bytes(value: int | float | str, *, total: int | None = None, what: str = "size",
                max_percent: float | None = None) -> int:
    """Bytes from an int, ``"4GiB"``, ``"1.5 GB"``, or ``"25%"`` of ``total``.

    ``max_percent`` refuses larger percentages (budgets pass 100: they cannot exceed what they
    are a share of). Raises :class:`ConfigError` (a ValueError) naming ``what`` and the bad value,
    :class:`ConfigTypeError` for a bool.
    """
    num, percent = _parse(value, what, max_percent)
    if not percent:
        return int(num)
    if total is None:
        raise ConfigError(f"{what}={value!r} is a percentage, a share of the device's memory, and here no device "
                          f"size is known: give a size like '8GB'")
    return int(total * num / 100)


def check_bytes(value: int | float | str, *, what: str = "size", max_percent: float | None = None,
                positive: bool = False) -> None:
    """Raise what :func:`parse_bytes` would for ``value``, without the total a percentage needs,
    so that sizes are checked before the device is known (or where there is none). ``positive``
    refuses zero too."""
    num, percent = _parse(value, what, max_percent)
    if positive and (num == 0 if percent else int(num) == 0):
        raise ConfigError(f"{what} must be more than 0 bytes, got {value!r}")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def resolve_cap(cap: int | str | None, allow_oversubscribe: bool | None, *, free: int, total: int) -> tuple[int, bool]:
    """The managed cap in bytes, and whether oversubscription is allowed (NOTE [managed cap]).

    Arguments win over the environment. Raises :class:`ConfigError` for a cap above ``free``
    without the opt-in.
    """
    allow = _env_flag(ENV_OVERSUBSCRIBE) if allow_oversubscribe is None else bool(allow_oversubscribe)
    if cap is None:
        cap = os.environ.get(ENV_CAP) or None
    limit = free if cap is None else parse_bytes(cap, total=total, what="managed cap")
    if limit > free and not allow:
        raise ConfigError(
            f"managed cap {limit:,} bytes is more than the {free:,} bytes free on the device. "
            f"Oversubscribed managed memory can hang a shared GPU, so it is off by default; to opt in, "
            f"pass allow_oversubscribe=True or set {ENV_OVERSUBSCRIBE}=1")
    return limit, allow


def cap_setting(cap: int | str | None) -> int | str | None:
    """The managed cap asked for: the argument, else TIERMEM_MANAGED_CAP, else None (the free
    memory); checked before a device is looked for."""
    if cap is None:
        cap = os.environ.get(ENV_CAP) or None
    if cap is not None:
        check_bytes(cap, what="managed cap")
    return cap


def budget_setting(budget: int | str | None) -> int | str | None:
    """The device budget asked for: the argument, else TIERMEM_BUDGET, else None; checked, so
    that a bad one is refused before a device is looked for."""
    if budget is None:
        budget = os.environ.get(ENV_BUDGET) or None
    if budget is not None:
        check_bytes(budget, what="device budget", max_percent=100)
    return budget


def resolve_budget(budget: int | str | None, *, total: int) -> int | None:
    """The device budget in bytes, or None for none (NOTE [device budget]); a share is of the
    device's ``total`` memory, at most 100%."""
    budget = budget_setting(budget)
    return None if budget is None else parse_bytes(budget, total=total, what="device budget", max_percent=100)


class CapGuard:
    """Counts raw managed bytes and refuses any that would pass the cap. Thread-safe."""

    def __init__(self, limit: int, allow_oversubscribe: bool = False):
        self.limit = int(limit)
        self.allow_oversubscribe = allow_oversubscribe
        self._lock = threading.RLock()   # released from destructors too (see Accounting)
        self.reserved = 0
        self.peak = 0
        self.refused = 0

    def reserve(self, nbytes: int) -> None:
        """Count ``nbytes`` more, or raise :class:`CapExceededError` and count nothing."""
        with self._lock:
            if self.reserved + nbytes <= self.limit:
                self.reserved += nbytes
                self.peak = max(self.peak, self.reserved)
                return
            self.refused += 1
        raise self.error(nbytes)

    def error(self, nbytes: int) -> CapExceededError:
        """The error that refuses ``nbytes`` more, saying how to opt in and why it is off."""
        hint = (f"Raise the cap with cap= or {ENV_CAP}" if self.allow_oversubscribe else
                f"The cap keeps managed memory within the device's free memory, because oversubscribed "
                f"managed memory can hang a shared GPU. Free tiered tensors, or opt in with "
                f"allow_oversubscribe=True and a larger cap= (or {ENV_OVERSUBSCRIBE}=1 and {ENV_CAP})")
        return CapExceededError(nbytes, self.reserved, self.limit, hint)

    def fits(self, nbytes: int) -> bool:
        return self.reserved + nbytes <= self.limit

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.reserved -= nbytes
