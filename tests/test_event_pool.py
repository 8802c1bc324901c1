"""NOTE [pooled events] in tiermem/cuda/runtime.py: a plain event's handle goes back to its
device's pool when its Event is dropped and is taken again by the next event of that device;
timing events, captured events and events of no named device are destroyed as before. On the CPU,
over a stand-in for cuda-bindings' runtime that counts the calls (tests/test_gpu_core.py makes
real events)."""
from __future__ import annotations

import types

import pytest

from tiermem.cuda import runtime


@pytest.fixture
def rt(monkeypatch):
    calls: list[tuple] = []
    state = {"next": 100, "device": 0}

    def create(flags):
        state["next"] += 1
        calls.append(("create", flags, state["device"]))
        return (0, state["next"])

    def destroy(h):
        calls.append(("destroy", h))
        return (0,)

    def set_device(d):
        state["device"] = d
        return (0,)

    fake = types.SimpleNamespace(cudaEventDefault=0, cudaEventDisableTiming=2, cudaEventCreateWithFlags=create,
                                 cudaEventDestroy=destroy, cudaGetDevice=lambda: (0, state["device"]),
                                 cudaSetDevice=set_device)
    monkeypatch.setattr(runtime, "_rt", fake)
    monkeypatch.setattr(runtime, "_event_pools", {})
    return calls


def test_plain_events_are_reused_per_device(rt):
    a = runtime.event_create(False, 1)
    h = a.handle
    assert rt == [("create", 2, 1)]                 # made with device 1 current
    del a
    assert ("destroy", h) not in rt                 # kept in device 1's pool
    b = runtime.event_create(False, 1)
    assert b.handle == h and len(rt) == 1           # taken again: no call at all
    c = runtime.event_create(False, 0)
    assert c.handle != h and rt[-1] == ("create", 2, 0)     # device 0's pool is its own
    del b, c
    assert not any(x[0] == "destroy" for x in rt)


def test_timing_captured_and_unnamed_device_events_are_destroyed(rt):
    t = runtime.event_create(True, 0)
    th = t.handle
    del t
    assert ("destroy", th) in rt                    # a timing event is never pooled
    e = runtime.event_create(False, 0)
    e.capture = 3                                   # recorded in a capture (NOTE [events across a capture])
    eh = e.handle
    del e
    assert ("destroy", eh) in rt
    n = runtime.event_create(False, None)
    nh = n.handle
    del n
    assert ("destroy", nh) in rt
    again = runtime.event_create(False, 0)
    assert again.handle not in (th, eh, nh)          # none of them came back


def test_a_pool_keeps_at_most_EVENT_POOL_handles(rt, monkeypatch):
    monkeypatch.setattr(runtime, "EVENT_POOL", 3)
    evs = [runtime.event_create(False, 0) for _ in range(5)]
    handles = [e.handle for e in evs]
    del evs
    pool = runtime._event_pools[0]
    assert len(pool) == 3 and set(pool) <= set(handles)
    assert sum(1 for x in rt if x[0] == "destroy") == 2
    made = sum(1 for x in rt if x[0] == "create")
    again = [runtime.event_create(False, 0) for _ in range(4)]
    assert sum(1 for x in rt if x[0] == "create") == made + 1      # three from the pool, one made
    assert len({e.handle for e in again}) == 4
