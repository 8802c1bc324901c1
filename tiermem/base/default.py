"""The slot that holds the process-wide default tier.

tiermem._api fills it; modules below the API that only need to know whether a default tier
exists (the torch allocator reads its role policies) read it here, so that no layer imports one
above it (tests/test_layers.py).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["peek", "get", "replace"]

_lock = threading.Lock()
_tier: Any = None


def peek() -> Any:
    """The default tier, or None if none was made yet."""
    return _tier


def get(make: Callable[[], Any]) -> Any:
    """The default tier, made by ``make`` on first use."""
    global _tier
    with _lock:
        if _tier is None:
            _tier = make()
        return _tier


def replace(tier: Any) -> None:
    """Make ``tier`` the default (None: the next ``get`` makes a new one)."""
    global _tier
    with _lock:
        _tier = tier
