"""Whole-step graphs on the CPU (NOTE [whole-step graphs] in tiermem/training/stepgraph.py): what keeps
a step eager, and the books behind a capture: how events resolve across it (NOTE [events across
a capture] in tiermem/cuda/capture.py), which settings it bakes in, and what it counted. Capturing
and replaying need a GPU: tests/test_gpu_stepgraph.py."""
from __future__ import annotations

import pytest
import torch
from test_train import batches, loss_of, plain_run, tiered

import tiermem
from tiermem.cuda.capture import CaptureEpochs
from tiermem.roles import Role
from tiermem.core.stats import count_delta
from tiermem.pytorch.unwind import first_cause, release_graph, unroute
from tiermem.training.stepgraph import (
    SETTLED_STEPS,
    _capturable,
    _hyperparameters,
    capture_now,
    why_invalid,
)


class _Ev:
    capture = 0


def test_events_resolve_for_the_capture_they_were_recorded_in():
    ep = CaptureEpochs()
    before, during, after = _Ev(), _Ev(), _Ev()
    ep.stamp(before)
    assert ep.resolve(before) == ("use", before)           # no capture: events are themselves
    ep.begin()
    ep.stamp(during)
    assert during.capture == 1
    assert ep.resolve(during) == ("use", during)           # the same capture's event
    assert ep.resolve(before) == ("present", None)         # from before it: the capturing stream's present
    ep.end()
    assert ep.resolve(during) == ("done", None)            # never replayed: its work never ran
    replay_end = _Ev()
    ep.after_replay = replay_end
    assert ep.resolve(during) == ("use", replay_end)       # it stands for the last replay's end
    assert ep.resolve(before) == ("use", before)
    ep.begin()
    assert ep.resolve(during) == ("present", None)         # another capture's: not this one's
    ep.stamp(after)
    assert after.capture == 2
    with pytest.raises(RuntimeError, match="nest"):
        ep.begin()
    ep.end()


def test_an_event_type_without_room_for_the_stamp_counts_as_never_captured():
    ep = CaptureEpochs()
    ep.begin()
    ev = object()
    ep.stamp(ev)                     # no error
    assert ep.resolve(ev) == ("present", None)
    ep.end()
    assert ep.resolve(ev) == ("use", ev)


def _tiered(**kw):
    _, _, model, opt, train = tiered(**kw)
    return model, opt, train


@pytest.mark.parametrize("kw,why", [
    ({}, "no GPU"),
    ({"accumulate": 2}, "accumulate"),
    ({"max_grad_norm": 1.0}, "clipping"),
])
@pytest.mark.long
def test_what_keeps_the_steps_eager_is_said_and_they_train_as_plain_ones(kw, why):
    bs = batches(5)
    want, want_params = plain_run(bs)
    model, _, train = _tiered(**kw)
    step = train.graphed(lambda ids: loss_of(model, ids))
    assert why in step.off and step.graph is None
    assert why in repr(step)
    if not kw:
        got = [float(step(ids)) for ids in bs]
        assert got == want
        for p, q in zip(model.parameters(), want_params):
            assert torch.equal(p.detach(), q)
        assert train.steps == len(bs) and step.captures == step.replays == 0
    step.close()
    train.unwrap()


def test_a_graphed_step_refuses_what_it_cannot_take():
    model, _, train = _tiered()
    with pytest.raises(tiermem.ConfigError, match="loss function"):
        train.graphed(3)
    step = train.graphed(lambda ids: loss_of(model, ids))
    with pytest.raises(tiermem.ConfigError, match="tensors only"):
        step([1, 2])
    with pytest.raises(ValueError):            # a bad value is a ValueError too
        step("ids")
    train.unwrap()
    with pytest.raises(tiermem.TierMemError, match="unwrapped"):
        step(batches(1)[0])


def test_the_plan_is_settled_once_the_measured_choice_is_done():
    model, _, train = _tiered(recompute="auto")
    seen = []
    for ids in batches(20):
        with train.step():
            loss_of(model, ids).backward()
        seen.append(train.settled)
    # the traced step plans; the probe's steps, the check's and a kept plan's later steps follow
    # (NOTE [measured choice] in tiermem/training/choice.py); then nothing changes the plan by itself
    assert not any(seen[:8])
    assert seen[-1] and train.plan is not None
    layout = train.layout
    with train.step():
        loss_of(model, batches(1)[0]).backward()
    assert train.layout == layout             # a settled plan keeps its slots and resident blocks


def test_settings_are_compared_by_value_and_a_tensor_learning_rate_by_identity():
    p = torch.nn.Parameter(torch.ones(3))
    lr = torch.tensor(0.1)
    opt = torch.optim.AdamW([p], lr=lr)
    h = _hyperparameters(opt)
    lr.fill_(0.05)                            # a schedule's in-place update: the graph reads it
    assert _hyperparameters(opt) == h
    opt.param_groups[0]["lr"] = torch.tensor(0.05)     # a new tensor: the graph holds the old one
    assert _hyperparameters(opt) != h
    opt2 = torch.optim.AdamW([p], lr=0.1)
    h2 = _hyperparameters(opt2)
    opt2.param_groups[0]["weight_decay"] = 0.5
    assert _hyperparameters(opt2) != h2


def test_only_fused_groups_say_capturable_for_the_capture_and_get_their_setting_back():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([{"params": [a]}, {"params": [b]}], lr=0.1)
    opt.param_groups[0]["fused"] = True      # a CPU AdamW may not be fused: the flag is what is read
    with pytest.raises(RuntimeError, match="inside"):
        with _capturable(opt):
            assert opt.param_groups[0]["capturable"] is True
            assert opt.param_groups[1]["capturable"] is False     # foreach/for-loop: its own choice
            raise RuntimeError("inside")
    assert opt.param_groups[0]["capturable"] is False


def test_the_capture_counts_moves_once_per_replay():
    from tiermem.core.stats import Accounting
    acc = Accounting()
    before = acc.snapshot()
    acc.on_move(Role.WEIGHT, "h2d", 100)
    acc.on_move(Role.ACTIVATION, "d2h", 7)
    acc.count(Role.ACTIVATION, "evict_ops")
    delta = count_delta(before, acc.snapshot())
    assert delta == {(Role.WEIGHT, "moved_h2d_bytes"): 100, (Role.ACTIVATION, "moved_d2h_bytes"): 7,
                     (Role.ACTIVATION, "evict_ops"): 1}


def test_the_first_error_of_a_failed_capture_is_the_one_reported():
    try:
        try:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        finally:
            raise OSError("capturing stream has unjoined work")
    except OSError as e:
        assert first_cause(e) == "RuntimeError: operation not permitted when stream is capturing"


class _Graph:
    """torch.cuda.CUDAGraph's calls release_graph and unroute make: ``pool()`` refuses a graph whose
    capture did not end, as torch's does."""
    def __init__(self, ended):
        self.ended, self.resets = ended, 0

    def pool(self):
        if not self.ended:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return (1, 0)

    def reset(self):
        self.resets += 1


class _Torch:
    """The torch calls of _release and _unroute, recorded instead of made."""
    def __init__(self):
        import types
        self.calls = []
        rec = self.calls.append
        self._C = types.SimpleNamespace(_cuda_endAllocateToPool=lambda d, p: rec(("end", d, p)),
                                        _cuda_releasePool=lambda d, p: rec(("release", d, p)),
                                        _cuda_clearCublasWorkspaces=lambda: rec(("cublas",)))
        self.cuda = types.SimpleNamespace(set_stream=lambda s: rec(("stream", s)), current_device=lambda: 0,
                                          synchronize=lambda: None, empty_cache=lambda: rec(("empty",)))


@pytest.mark.parametrize("ended", [False, True])
def test_a_capture_that_did_not_end_gives_its_own_pool_back(ended):
    """NOTE [failed capture's pool]: torch gives back the pool of a graph whose capture ended
    (its reset does); one whose capture did not end is ended and given back by tiermem, once."""
    import types
    t, g, pool = _Torch(), _Graph(ended), (0, 7)
    prev = types.SimpleNamespace(device=types.SimpleNamespace(index=0))
    unroute(t, g, pool, prev)
    release_graph(t, g, pool)
    assert g.resets == 1
    mine = [c for c in t.calls if c[0] in ("end", "release", "cublas")]
    assert t.calls[0] == ("stream", prev) and t.calls[-1] == ("empty",)
    # the capture stream's cuBLAS workspace came from the pool: let go after any failed capture
    assert mine == ([("cublas",)] if ended else [("end", 0, pool), ("release", 0, pool), ("cublas",)])
    t.calls.clear()
    release_graph(t, _Graph(False))          # a dropped graph (no pool of its own to give): reset only
    assert [c for c in t.calls if c[0] != "empty"] == []


def test_a_step_is_captured_after_the_settled_plan_ran_eagerly_and_never_once_graphs_are_off():
    assert not capture_now("", True, SETTLED_STEPS)           # the first step under the plan allocates
    assert capture_now("", True, SETTLED_STEPS + 1)
    assert not capture_now("", False, 5)                      # the plan may still change
    assert not capture_now("the capture failed: ...", True, 5)


def test_what_a_capture_baked_in_is_checked_before_each_replay():
    x = torch.zeros(4, 8, dtype=torch.long)
    ok = dict(stale=False, settled=True, layout=(1, 2), captured_layout=(1, 2), inputs=(x,), static=[x.clone()],
              hyper=[{"lr": 0.1}], captured_hyper=[{"lr": 0.1}])
    assert why_invalid(**ok) == ""
    assert "loaded" in why_invalid(**{**ok, "stale": True})
    assert "plan" in why_invalid(**{**ok, "settled": False})
    assert "plan" in why_invalid(**{**ok, "layout": (1, 3)})          # new slots, other resident blocks
    assert "shapes" in why_invalid(**{**ok, "inputs": (torch.zeros(2, 8, dtype=torch.long),)})
    assert "shapes" in why_invalid(**{**ok, "inputs": (x.float(),)})
    assert "shapes" in why_invalid(**{**ok, "inputs": (x, x)})
    assert "hyperparameters" in why_invalid(**{**ok, "hyper": [{"lr": 0.05}]})


class _Calls:
    """The raw CUDA calls the backend makes, recorded instead of made (no GPU here)."""

    def __init__(self, monkeypatch, capturing=()):
        from tiermem.cuda import runtime as _cuda
        self.log: list[tuple] = []
        self.capturing = set(capturing)
        for name in ("event_record", "stream_wait_event", "event_query", "event_synchronize", "memcpy_async",
                     "event_elapsed_ms"):
            monkeypatch.setattr(_cuda, name, lambda *a, name=name: self.log.append((name, *a)) or (
                True if name == "event_query" else 1.0 if name == "event_elapsed_ms" else None))
        monkeypatch.setattr(_cuda, "event_create", lambda timing=False, device=None: _Ev())
        monkeypatch.setattr(_cuda, "stream_is_capturing", lambda s: s in self.capturing)


def _backend():
    from tiermem.cuda.backend import CudaBackend
    be = object.__new__(CudaBackend)        # its event calls only: no device is opened
    be.epochs = CaptureEpochs()
    be.device = 0
    be.current_stream = lambda: 7           # the capturing (compute) stream in these tests
    return be


def test_outside_a_capture_the_backend_uses_events_as_they_are(monkeypatch):
    calls, be = _Calls(monkeypatch), _backend()
    ev = _Ev()
    be.record(ev, 3)
    be.wait(5, ev)
    assert be.query(ev) is True
    be.synchronize(ev)
    assert [c[0] for c in calls.log] == ["event_record", "stream_wait_event", "event_query", "event_synchronize"]
    assert calls.log[1] == ("stream_wait_event", 5, ev)


def test_inside_a_capture_host_checks_become_gpu_waits_and_old_events_the_present(monkeypatch):
    from tiermem import TierMemError
    calls, be = _Calls(monkeypatch, capturing={7, 5}), _backend()
    old = _Ev()
    be.record(old, 3)                        # before the capture
    with be.capturing():
        calls.log.clear()
        be.wait(5, old)                      # the side stream joins the capture at the present
        (_, ev_present, on), (_, s, waited) = calls.log
        assert ev_present is not old and on == 7 and s == 5 and waited is ev_present
        assert ev_present.capture == 1
        calls.log.clear()
        assert be.query(old) is True and calls.log == []        # complete: the capture began after a sync
        mine = _Ev()
        be.record(mine, 5)
        calls.log.clear()
        assert be.query(mine) is True                            # the GPU waits instead of the host
        be.synchronize(mine)
        assert calls.log == [("stream_wait_event", 7, mine)] * 2
        with pytest.raises(TierMemError, match="outside the running capture"):
            be.copy(1, 2, 3, 9)             # a stream not in the capture: it would run once, now
        be.copy(1, 2, 3, 5)
        calls.log.clear()
        be.join_capture(7)                   # every capturing stream it used joins the compute stream
        assert [c[0] for c in calls.log] == ["event_record", "stream_wait_event"]
        assert calls.log[0][2] == 5 and calls.log[1][1] == 7
    with pytest.raises(TierMemError, match="no times"):
        be.elapsed_ms(mine, mine)
    calls.log.clear()
    be.wait(4, mine)                         # never replayed: nothing to wait for
    assert be.query(mine) is True and calls.log == []
    be.replayed(7)
    end = calls.log[-1][1]
    calls.log.clear()
    be.wait(4, mine)                         # it stands for the last replay's end
    assert calls.log == [("stream_wait_event", 4, end)]


def test_a_capture_lets_cublas_workspaces_go_before_and_after_it_even_when_it_fails():
    """NOTE [capture's cuBLAS workspace]: the capture makes its workspaces in its own pool and
    none outlives it there, or the pool keeps its segments after the graph is gone."""
    import types

    from tiermem.pytorch.workspaces import own_workspaces
    calls = []
    t = types.SimpleNamespace(_C=types.SimpleNamespace(_cuda_clearCublasWorkspaces=lambda: calls.append("clear")))
    with own_workspaces(t):
        calls.append("capture")
    assert calls == ["clear", "capture", "clear"]
    calls.clear()
    with pytest.raises(RuntimeError), own_workspaces(t):
        calls.append("capture")
        raise RuntimeError("invalidated")
    assert calls == ["clear", "capture", "clear"]
    with own_workspaces(types.SimpleNamespace(_C=types.SimpleNamespace())):   # a torch without the call
        pass


def test_a_failed_captures_exception_lets_go_of_its_frames_and_their_tensors():
    """NOTE [kept exceptions]: the failed capture's exception is tiermem's own; its frames (the
    failed forward's activations) are cleared, down the chain of exceptions it came with."""
    import weakref

    from tiermem.pytorch.unwind import clear_frames

    class Big:
        pass

    def forward():
        act = Big()
        refs.append(weakref.ref(act))
        raise MemoryError("out of memory in the capture")

    refs = []
    try:
        try:
            forward()
        except MemoryError:
            raise RuntimeError("the capture's end failed too")
    except RuntimeError as e:
        kept = e                                   # as a caller that keeps the exception would
    assert refs[0]() is not None
    clear_frames(kept)
    assert refs[0]() is None                       # gone without a collection
    assert kept.__context__ is not None            # the exceptions themselves stay readable


def test_releasing_a_step_that_holds_no_graph_changes_nothing():
    bs = batches(3)
    want, _ = plain_run(bs)
    model, _, train = _tiered()
    step = train.graphed(lambda ids: loss_of(model, ids))
    got = []
    for ids in bs:
        step.release()
        got.append(float(step(ids)))
    assert step.drops == [] and step.graph is None and got == want


def test_a_captured_step_that_saves_other_tensors_than_its_trace_fails_as_a_refused_capture(monkeypatch):
    """NOTE [another path under capture] in tiermem/training/handle.py: a step whose saves, while
    captured, differ from the trace (a transformers Llama's attention under a capture) raises
    with the reason, as a capture CUDA refuses does; the training goes on eagerly from a new
    trace. The CPU cannot capture: here the step runs inside the training's capture books, with
    the backend's capture a no-op, and is given other shapes."""
    import contextlib

    from test_train import CFG
    model, _, train = _tiered(recompute="never")
    monkeypatch.setattr(train.tier.backend, "capturing", contextlib.nullcontext, raising=False)
    for ids in batches(10):
        with train.step():
            loss_of(model, ids).backward()
    assert train.settled
    shorter = batches(1)[0][:, : CFG["seq"] // 2 + 1]
    with pytest.raises(tiermem.TierMemError, match="another path under a CUDA graph capture"):
        with train.capturing():
            with train.step():
                loss_of(model, shorter).backward()
    assert not train.settled                  # the next step traces again
    for ids in batches(6, seed=2):
        with train.step():
            loss_of(model, ids).backward()
    assert train.plan is not None and train.settled


def test_a_captured_step_is_refused_in_its_forward_before_it_queues_more_than_its_eager_steps(monkeypatch):
    """NOTE [another path under capture]: the first save that differs from the trace while the
    step is captured refuses the step there, in forward, before the swap takes anything the eager
    steps never took (a new piece of the pinned arena is a cudaHostAlloc, which CUDA refuses while
    a stream captures: the capture failed with cudaErrorStreamCaptureUnsupported on a transformers
    Mistral under autocast). The plan stays, and the next eager steps train under it."""
    import contextlib

    fake, _, model, _, train = tiered(recompute="never")
    monkeypatch.setattr(train.tier.backend, "capturing", contextlib.nullcontext, raising=False)
    for ids in batches(10):
        with train.step():
            loss_of(model, ids).backward()
    assert train.settled
    plan = train.plan
    longer = torch.cat([batches(1)[0]] * 2)          # a larger batch: more to save than any step before
    seen_backward = []
    with fake.counting() as calls:
        with pytest.raises(tiermem.TierMemError, match="another path under a CUDA graph capture"):
            with train.capturing():
                with train.step():
                    loss = loss_of(model, longer)
                    seen_backward.append(True)
                    loss.backward()
    assert not seen_backward                     # refused in forward
    assert "host_alloc" not in calls, calls      # the arena did not grow
    for ids in batches(3, seed=2):
        with train.step():
            loss_of(model, ids).backward()
    assert train.plan is plan and train.settled  # no new trace: the eager steps never diverged


def test_the_swap_never_grows_its_pinned_arena_while_a_step_is_captured(monkeypatch):
    """A captured step that would swap more than the arena holds is refused before it asks for
    pinned memory (NOTE [another path under capture]); eagerly the arena grows as before."""
    import contextlib
    fake, _, model, _, train = tiered(recompute="never")
    monkeypatch.setattr(train.tier.backend, "capturing", contextlib.nullcontext, raising=False)
    for ids in batches(10):
        with train.step():
            loss_of(model, ids).backward()
    assert train.settled and train.plan.swapped_bytes > 0
    train.swap.arena.release()                   # as if the eager steps had swapped less than this one
    with fake.counting() as calls:
        with pytest.raises(tiermem.TierMemError, match="another path"):
            with train.capturing():
                with train.step():
                    loss_of(model, batches(1)[0]).backward()
    assert "host_alloc" not in calls, calls
    with fake.counting() as calls:
        with train.step():
            loss_of(model, batches(1)[0]).backward()
    assert "host_alloc" in calls                 # eagerly it grows again


def test_autocast_caches_no_cast_inside_a_step_and_its_setting_comes_back_after():
    """NOTE [autocast in a step] in tiermem/training/casts.py."""
    model, _, train = _tiered()
    assert torch.is_autocast_cache_enabled()
    with train.step():
        assert not torch.is_autocast_cache_enabled()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not torch.is_autocast_cache_enabled()   # a region made inside reads the step's setting
            loss = loss_of(model, batches(1)[0])
        loss.backward()
    assert torch.is_autocast_cache_enabled()
    with pytest.raises(RuntimeError, match="inside"):
        with train.step():
            raise RuntimeError("inside")
    assert torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        with train.step():
            loss_of(model, batches(1)[0]).backward()
        assert not torch.is_autocast_cache_enabled()       # the caller's own setting, kept
    finally:
        torch.set_autocast_cache_enabled(True)
