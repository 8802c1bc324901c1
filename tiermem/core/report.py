"""The readable report behind tiermem.memory_summary()."""
from __future__ import annotations

from typing import Any

from ..roles import Role


def _b(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return ""


def _rate(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.1f} GB/s" if seconds > 0 else "-"


def summary(s: dict[str, Any], device: int, caps: Any) -> str:
    """The report of a Tier's ``stats()`` on ``device``, whose ``capabilities()`` are ``caps``."""
    budget = "none" if s["budget_bytes"] < 0 else _b(s["budget_bytes"])
    lines = [
        f"tiermem on device {device} ({caps.name}, {_b(caps.total_memory)})",
        f"  managed: {_b(s['managed.reserved_bytes.current'])} reserved (peak {_b(s['managed.reserved_bytes.peak'])}, "
        f"{_b(s['managed.pool_cached_bytes'])} cached) of a {_b(s['managed.cap_bytes'])} cap; "
        f"{s['managed.refused_count']} refused",
        f"  device budget: {budget}; resident {_b(s['resident_bytes.all.current'])} (peak {_b(s['resident_bytes.all.peak'])}, "
        f"{_b(s['parked_bytes.current'])} parked); "
        f"pinned shadows {_b(s['shadow_bytes.current'])}",
        "",
        f"  {'role':<16}{'allocated':>12}{'peak':>12}{'count':>7}{'resident':>12}"
        f"{'moved in':>12}{'in rate':>12}{'moved out':>12}{'out rate':>12}{'advice':>8}{'skipped':>8}",
    ]
    for name in [r.value for r in Role] + ["all"]:
        if s[f"allocation_count.{name}.total"] == 0 and name != "all":
            continue
        g = lambda k: s[f"{k}".replace("ROLE", name)]  # noqa: E731
        lines.append(
            f"  {name:<16}{_b(g('allocated_bytes.ROLE.current')):>12}{_b(g('allocated_bytes.ROLE.peak')):>12}"
            f"{g('allocation_count.ROLE.current'):>7}{_b(g('resident_bytes.ROLE.current')):>12}"
            f"{_b(g('moved_bytes.ROLE.h2d')):>12}{_rate(g('moved_bytes.ROLE.h2d'), g('moved_seconds.ROLE.h2d')):>12}"
            f"{_b(g('moved_bytes.ROLE.d2h')):>12}{_rate(g('moved_bytes.ROLE.d2h'), g('moved_seconds.ROLE.d2h')):>12}"
            f"{g('advice.ROLE.applied'):>8}{g('advice.ROLE.skipped'):>8}")
    return "\n".join(lines)
