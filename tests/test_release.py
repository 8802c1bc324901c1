"""A handle dropped without unwrap is freed with everything it holds (NOTE [hooks gc cannot see]
in tiermem/training/hooks.py): its tier goes, and the process's resident memory does not grow
with each training or module dropped that way."""
from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
import torch.nn as nn
from fakes import FakeBackend
from helpers import share
from test_train import batches, loss_of, tiered

import tiermem

MiB = 1 << 20


def _trained_and_dropped() -> weakref.ref:
    """A training that streams blocks and swaps activations, two steps, dropped without unwrap."""
    _, tier, model, _, train = tiered()
    for ids in batches(2):
        with train.step():
            loss_of(model, ids).backward()
    return weakref.ref(tier)


def _module_trained_and_dropped() -> weakref.ref:
    """A module whose streamed weights got gradients (their hooks offload them), dropped without unwrap."""
    tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
    m = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    tier.wrap_module(m, budget=share(m, 40), max_group_bytes=1 * MiB, lookahead=2)
    x = torch.randn(32, 256)
    with torch.no_grad():
        m(x), m(x)
    m(x).square().mean().backward()
    return weakref.ref(tier)


@pytest.mark.parametrize("drop", [_trained_and_dropped, _module_trained_and_dropped])
def test_a_handle_dropped_without_unwrap_frees_its_tier(drop):
    ref = drop()
    _collect()
    assert ref() is None


def _collect() -> None:
    # A tiered buffer's finalizer gives its bytes back to its tier in the first collection; the
    # tier itself goes in the next.
    gc.collect()
    gc.collect()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set from /proc")
def test_resident_memory_does_not_grow_with_handles_dropped_without_unwrap():
    # A tier kept per cycle grew the suite's pytest process to 18 GB. Two cycles first, so
    # allocator caches settle; a collection after each, since dropped handles wait for one.
    def cycle() -> None:
        _trained_and_dropped(), _module_trained_and_dropped()
        _collect()
    for _ in range(2):
        cycle()
    before = _rss()
    for _ in range(6):
        cycle()
    assert _rss() - before < 150 * MiB, f"grew {(_rss() - before) / MiB:.0f} MiB over 6 dropped trainings and modules"
