"""The replayed recompute's eager path on the CPU (NOTE [replayed recompute] in tiermem/training/replay.py):
what a replayed block computes when it cannot be captured, the gradients of torch's checkpoint
bitwise; random ops get the forward's draws; a keyword tensor that needs its gradient goes
through torch's checkpoint. The graphs themselves are GPU tests (tests/test_gpu_recompute.py)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tiermem.training.replay import Replays  # noqa: E402


class _Layer(torch.nn.Module):
    def __init__(self, d, p=0.0):
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x, scale=None, tag="x"):
        h = self.drop(torch.nn.functional.gelu(self.a(x)))
        y = x + self.b(h)
        if scale is not None:
            y = y * scale
        return y, None, tag          # a non-tensor output and a None, as transformers' layers give


def _model(p=0.0, seed=0):
    torch.manual_seed(seed)
    return torch.nn.ModuleList(_Layer(16, p) for _ in range(3))


def _run(layers, wrap, scale, seed=3):
    torch.manual_seed(seed)
    x = torch.randn(4, 8, 16, requires_grad=True)
    h = x
    for m in layers:
        h, none, tag = wrap(m, h, scale)
        assert none is None and tag == "t"
    h.square().mean().backward()
    return [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]


def _plain(m, h, scale):
    return m(h, scale=scale, tag="t")


def _checkpoint(m, h, scale):
    return torch.utils.checkpoint.checkpoint(lambda a: m(a, scale=scale, tag="t"), h, use_reentrant=False)


def _replays():
    return Replays(torch, capture=False, params_of=lambda m: [p for p in m.parameters()])


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_the_eager_path_gives_checkpoints_gradients_bitwise(dropout):
    scale = torch.full((16,), 0.5)
    want = _run(_model(dropout), _plain, scale)
    assert all(torch.equal(a, b) for a, b in zip(_run(_model(dropout), _checkpoint, scale), want))
    r = _replays()
    got = _run(_model(dropout), lambda m, h, s: r.run(m, m.forward, (h,), {"scale": s, "tag": "t"}), scale)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # a block that drew random numbers goes to torch's checkpoint from its next forward on
    assert len(r.eager) == (3 if dropout else 0)


def test_a_keyword_tensor_that_needs_its_gradient_gets_it():
    scale = torch.full((16,), 0.5, requires_grad=True)
    _run(_model(), _plain, scale)
    want = scale.grad.clone()
    scale.grad = None
    r = _replays()
    _run(_model(), lambda m, h, s: r.run(m, m.forward, (h,), {"scale": s, "tag": "t"}), scale)
    assert torch.equal(scale.grad, want)


def test_the_forwards_inputs_are_not_held_past_the_saved_tensor_hooks():
    # the positional inputs reach backward through the saved-tensor hooks alone (tiermem's swap
    # moves them to the host), not through a reference the replay keeps
    packed = []
    r = _replays()
    m = _model()[0]
    x = torch.randn(4, 8, 16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or len(packed) - 1,
                                                  lambda i: packed[i]):
        y, _, _ = r.run(m, m.forward, (x * 1.0,), {"tag": "t"})
    assert len(packed) == 1 and packed[0].shape == x.shape
    y.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in m.parameters())


def test_the_pools_reserve_is_the_estimate_until_the_pool_is_larger_or_capturing_is_off(monkeypatch):
    """What the plan must leave the graphs' pool (NOTE [replayed recompute]): nothing before a
    backward was measured; then the measured working set with RESERVE_MARGIN of it more and the
    allocator's segments; what the captures really took once that is more; and once capturing
    is off, only what is still held."""
    import tiermem.training.replay as replay
    r = Replays(torch, capture=True, params_of=lambda m: [])
    assert r.reserve == 0
    r.need = 300 << 20
    assert r.reserve == (300 << 20) + (75 << 20) + replay.SEGMENTS
    monkeypatch.setattr(replay, "RESERVE_MARGIN", 0.6)
    assert r.reserve == (300 << 20) + (180 << 20) + replay.SEGMENTS
    r.pool_bytes = 528 << 20
    assert r.reserve == 528 << 20
    r.capture = False
    r.pool_bytes = 0
    assert r.reserve == 0


def test_an_ask_makes_no_buffer_in_the_step_and_the_reserve_counts_the_buffers_it_names():
    """NOTE [replayed recompute], memory: an eager backward that asks for its graph makes none of
    the graph's static buffers (made in backward they took memory no plan had left); the reserve
    counts them from the ask on, once per shape and place however many blocks share them, and
    nothing once the graphs are given up."""
    r = Replays(torch, capture=True, params_of=lambda m: list(m.parameters()))
    layers = _model()
    for m in layers:
        r.measured.add(id(m))            # their first backward was measured (a GPU's counters)
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
    x = torch.randn(4, 8, 16, requires_grad=True)
    h = x
    for m in layers:
        h, _, _ = r.run(m, m.forward, (h,), {"tag": "t"})
    h.square().sum().backward()          # a dense output gradient (sum's alone is an expanded one)
    assert len(r.pending) == 3 and not r.statics and r.statics_bytes == 0 and r.held_bytes == 0
    one = 4 * 8 * 16 * 4
    assert r.reserve == 3 * one          # input, output gradient, input gradient: shared by the three
    r.need = 100 << 20
    assert r.reserve > (100 << 20) + 3 * one
    r.give_up("a test")
    assert r.reserve == 0 and not r.pending


def test_graphs_asked_for_are_captured_between_steps_only_where_the_room_holds_their_pool():
    """NOTE [replayed recompute]: capture_pending takes what a step asked for, once; with nothing
    asked it does nothing; where the pool's estimate passes the room it captures nothing and
    gives the graphs up, saying why; a capture that fails (here: no CUDA) gives them up too. In
    every case the asks are gone afterwards."""
    import types

    r = Replays(torch, capture=True, params_of=lambda m: [])
    assert r.capture_pending() == 0 and not r.off and r.capture
    r.need = 100 << 20
    r.room = lambda: 50_000_000
    r.pending[("k",)] = types.SimpleNamespace(module=torch.nn.Linear(1, 1))
    assert r.capture_pending() == 0
    assert not r.pending and not r.capture and not r.graphs
    assert "does not fit" in r.off and "(50 MB left" in r.off, r.off

    r = Replays(torch, capture=True, params_of=lambda m: [])
    r.room = lambda: None
    r.pending[("k",)] = types.SimpleNamespace(module=torch.nn.Linear(1, 1))
    if torch.cuda.is_available():
        pytest.skip("the failing capture needs a machine without CUDA")
    assert r.capture_pending() == 0
    assert not r.pending and not r.capture and "Linear's capture failed" in r.off, r.off

    r = Replays(torch, capture=True, params_of=lambda m: [])
    r.pending[("k",)] = types.SimpleNamespace(module=torch.nn.Linear(1, 1))
    r.drop_pending()
    assert not r.pending and r.capture and not r.off
