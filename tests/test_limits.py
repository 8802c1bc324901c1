"""The two limits: parse_bytes, the managed cap (resolve_cap, CapGuard) and the device budget."""
from __future__ import annotations

import random
import threading

import pytest

from tiermem import OutOfBudgetError, TierMemError
from tiermem.base.limits import ENV_BUDGET, ENV_CAP, ENV_OVERSUBSCRIBE, CapGuard, resolve_budget, resolve_cap
from tiermem.errors import CapExceededError
from tiermem.planning import parse_bytes

GiB = 1 << 30


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    # The machine running the tests may have these set; every test here starts without them.
    for name in (ENV_CAP, ENV_OVERSUBSCRIBE, ENV_BUDGET):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("value, total, expected", [
    ("4GiB", None, 4 * GiB),
    ("1.5GB", None, 1_500_000_000),
    ("512", None, 512),
    (1024, None, 1024),
    ("25%", 1000, 250),
    ("25%", 8 * GiB, 2 * GiB),
    (" 2 MiB ", None, 2 << 20),
    ("3kib", None, 3072),
    ("10 kb", None, 10_000),
])
def test_parse_bytes(value, total, expected):
    assert parse_bytes(value, total=total) == expected


@pytest.mark.parametrize("value, pattern", [
    ("lots", r"size='lots' is not a size"),
    ("-1", r"size='-1' is not a size"),
    (-1, r"size must not be negative, got -1"),
    (True, r"size must be a byte count, got True"),
    ("25%", r"size='25%' is a percentage, a share of the device's memory, and here no device size is known"),
    ("4 parsecs", r"size='4 parsecs' is not a size"),
])
def test_parse_bytes_errors_name_the_bad_value(value, pattern):
    with pytest.raises(TierMemError, match=pattern):
        parse_bytes(value)


def test_parse_bytes_error_names_what():
    with pytest.raises(TierMemError, match=r"^device budget='lots' is not a size"):
        parse_bytes("lots", what="device budget")


def test_parse_bytes_rejects_nan_with_tiermem_error():
    with pytest.raises(TierMemError, match="nan"):
        parse_bytes(float("nan"))


def test_resolve_cap_defaults_to_free_memory():
    assert resolve_cap(None, None, free=6 * GiB, total=8 * GiB) == (6 * GiB, False)


def test_resolve_cap_below_free_needs_no_opt_in():
    assert resolve_cap("4GiB", None, free=6 * GiB, total=8 * GiB) == (4 * GiB, False)
    assert resolve_cap("50%", None, free=6 * GiB, total=8 * GiB) == (4 * GiB, False)


def test_resolve_cap_above_free_without_opt_in_is_refused():
    with pytest.raises(TierMemError) as exc:
        resolve_cap("7GiB", None, free=6 * GiB, total=8 * GiB)
    msg = str(exc.value)
    assert "7,516,192,768 bytes" in msg and "6,442,450,944 bytes" in msg
    assert "allow_oversubscribe=True" in msg and f"{ENV_OVERSUBSCRIBE}=1" in msg


def test_resolve_cap_above_free_with_opt_in():
    assert resolve_cap("7GiB", True, free=6 * GiB, total=8 * GiB) == (7 * GiB, True)


def test_resolve_cap_from_environment(monkeypatch):
    monkeypatch.setenv(ENV_CAP, "7GiB")
    with pytest.raises(TierMemError, match=ENV_OVERSUBSCRIBE):
        resolve_cap(None, None, free=6 * GiB, total=8 * GiB)
    monkeypatch.setenv(ENV_OVERSUBSCRIBE, "1")
    assert resolve_cap(None, None, free=6 * GiB, total=8 * GiB) == (7 * GiB, True)
    # Arguments win over the environment.
    assert resolve_cap("1GiB", None, free=6 * GiB, total=8 * GiB) == (GiB, True)
    with pytest.raises(TierMemError):
        resolve_cap(None, False, free=6 * GiB, total=8 * GiB)


def test_resolve_budget(monkeypatch):
    assert resolve_budget(None, total=8 * GiB) is None
    assert resolve_budget("25%", total=8 * GiB) == 2 * GiB
    assert resolve_budget(123, total=8 * GiB) == 123
    monkeypatch.setenv(ENV_BUDGET, "1GiB")
    assert resolve_budget(None, total=8 * GiB) == GiB
    assert resolve_budget("2GiB", total=8 * GiB) == 2 * GiB
    monkeypatch.setenv(ENV_BUDGET, "much")
    with pytest.raises(TierMemError, match=r"device budget='much' is not a size"):
        resolve_budget(None, total=8 * GiB)


def test_cap_guard_reserve_release_peak_refused():
    g = CapGuard(1000)
    g.reserve(300)
    g.reserve(700)
    assert (g.reserved, g.peak, g.refused) == (1000, 1000, 0)
    g.release(600)
    with pytest.raises(CapExceededError):
        g.reserve(601)
    assert (g.reserved, g.peak, g.refused) == (400, 1000, 1)
    assert g.fits(600) and not g.fits(601)
    g.reserve(600)
    assert (g.reserved, g.peak, g.refused) == (1000, 1000, 1)


def test_cap_exceeded_error_says_what_and_how_to_opt_in():
    g = CapGuard(3_000_000)
    g.reserve(2_500_000)
    with pytest.raises(MemoryError) as exc:
        g.reserve(1_000_000)
    e = exc.value
    assert isinstance(e, CapExceededError) and isinstance(e, OutOfBudgetError) and isinstance(e, TierMemError)
    assert (e.asked, e.used, e.limit) == (1_000_000, 2_500_000, 3_000_000)
    msg = str(e)
    assert msg.startswith("managed-memory cap: asked for 1,000,000 bytes")
    assert "2,500,000 bytes" in msg and "3,000,000 bytes" in msg
    assert "allow_oversubscribe=True" in msg and f"{ENV_OVERSUBSCRIBE}=1" in msg and ENV_CAP in msg


def test_cap_exceeded_error_once_opted_in_says_how_to_raise_the_cap():
    g = CapGuard(10, allow_oversubscribe=True)
    with pytest.raises(CapExceededError, match=f"Raise the cap with cap= or {ENV_CAP}"):
        g.reserve(11)


def test_cap_guard_is_thread_safe():
    limit = 1_000_000
    g = CapGuard(limit)
    refused = [0] * 16

    def work(i: int) -> None:
        rng = random.Random(i)
        for _ in range(1000):
            n = rng.randint(1, 200_000)
            try:
                g.reserve(n)
            except CapExceededError:
                refused[i] += 1
                continue
            g.release(n)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert g.reserved == 0
    assert 0 < g.peak <= limit
    assert g.refused == sum(refused)
