"""Graphed offloaded forwards on the fake backend (NOTE [graphed forwards] in
tiermem/inference/graphed.py): the forwards' graph mode, when a capture is tried, and what
keeps a forward eager. The captures themselves are CUDA's: tests/test_gpu_graphed_forward.py."""
from __future__ import annotations

import pytest
import torch
from helpers import share, tiny_llama

from tiermem.errors import ConfigError, TierMemError
from tiermem.inference.graphed import SETTLED_FORWARDS, GraphedForward

GROUP = 512 << 10        # max_group_bytes: the tiny Llama's sublayers are groups of their own


def _wrap(tier, fmt=None, lookahead=3):
    model, cfg = tiny_llama()
    h = tier.wrap_module(model, budget=share(model, 40), stream_dtype=fmt, mode="stream", max_group_bytes=GROUP,
                         lookahead=lookahead)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    return model, h, ids


@pytest.mark.parametrize("fmt", [None, "int8", "int4"])
def test_forwards_in_graph_mode_use_the_same_slots_each_time_and_give_the_same_logits(tier, fake, fmt):
    """Graph mode (NOTE [graphed forwards]): each forward starts at slot 0 and its tail brings the
    next one's first pieces into slots 0, 1, ...: every forward in a row makes the same copies
    into the same slots, ends as it began, and moves what a plain forward moves. Its logits are
    the plain forwards' bit for bit. Where a plain forward ran between, ``before_replay`` brings
    those first pieces back to their slots, and the forward after it is the same again."""
    model, h, ids = _wrap(tier, fmt, lookahead=4)
    st = h._stream
    n = sum(len(g.pieces) for g in h._groups.values() if not g.pinned and g.slot_in("stream"))
    ahead = min(h.lookahead, st.nslots - 1)
    assert st.nslots and n % st.nslots, "a forward that ends where it began proves nothing"
    fills: list[list[int]] = []
    real = st._load

    def load(p, slot, wait=True):
        fills[-1].append(slot)
        return real(p, slot, wait)
    st._load = load

    def forward(graph: bool):
        h.drain()
        before = tier.stats()["moved_bytes.all.h2d"]
        fills.append([])
        if graph:
            with h.graph_mode():
                out = model(ids).logits
        else:
            out = model(ids).logits
        h.drain()
        return out, tier.stats()["moved_bytes.all.h2d"] - before
    with torch.no_grad():
        want, _ = forward(False)                 # learns the order
        plain = [forward(False)[0] for _ in range(2)]
        assert fills[1] != fills[2]               # plain forwards go on around the ring
        runs = [forward(True) for _ in range(3)]
        steady = fills[4]
        assert fills[5] == steady and len(steady) == n
        assert steady[0] == ahead % st.nslots          # the first piece it brings in: the one after those
        assert steady[-ahead:] == list(range(ahead))       # the tail: the next forward's first pieces
        assert runs[1][1] == runs[2][1] == h.moved_bytes
        between = forward(False)[0]                 # a plain forward: the first pieces elsewhere now
        fills.append([])
        h.before_replay(fake.current_stream(), h.forward_mode)
        assert sorted(fills[-1]) == list(range(ahead))
        again = forward(True)
        assert fills[-1] == steady
    for x in (*plain, *(r[0] for r in runs), between, again[0]):
        assert torch.equal(x, want)
    h.unwrap()


def test_graphed_on_a_backend_without_graphs_runs_eagerly_and_says_why(tier):
    model, h, ids = _wrap(tier)
    fwd = h.graphed(lambda x: model(x, use_cache=False).logits)
    assert "does not capture" in fwd.off
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    for _ in range(4):
        got = fwd(ids)
        assert torch.equal(got, want) and not got.requires_grad
    assert fwd.captures == 0 and fwd.graph is None and "eager" in repr(fwd)
    with pytest.raises(ConfigError, match="tensors only"):
        fwd(ids, 3)
    h.unwrap()
    with pytest.raises(TierMemError, match="unwrapped"):
        fwd(ids)


def _capturing(monkeypatch, h):
    """A GraphedForward whose capture is recorded instead of made: the policy of when to try."""
    monkeypatch.setattr(h, "graph_blockers", lambda: "")
    tried: list[tuple] = []

    def capture(self, inputs):
        tried.append(tuple(inputs[0].shape))
        return None                                # as a failed capture would: the forward runs eagerly
    monkeypatch.setattr(GraphedForward, "_capture", capture)
    return tried


def test_a_capture_is_tried_once_the_order_is_known_and_a_forward_of_the_same_shapes_ran(tier, monkeypatch):
    model, h, ids = _wrap(tier)
    tried = _capturing(monkeypatch, h)
    fwd = h.graphed(lambda x: model(x, use_cache=False).logits)
    assert fwd.off == ""
    fwd(ids)                                       # learns the order
    assert tried == [] and h.order_learned
    for _ in range(SETTLED_FORWARDS):
        fwd(ids)
    assert tried == []
    fwd(ids)                                       # settled: tried
    assert tried == [tuple(ids.shape)]
    short = ids[:, :8]
    fwd(short)                                     # other shapes: they settle first
    assert len(tried) == 1
    for _ in range(SETTLED_FORWARDS):
        fwd(short)
    assert tried[-1] == tuple(short.shape)
    h.unwrap()


def test_an_order_learned_again_settles_again_before_a_capture(tier, monkeypatch):
    model, h, ids = _wrap(tier)
    tried = _capturing(monkeypatch, h)
    fwd = h.graphed(lambda x: model(x, use_cache=False).logits)
    for _ in range(1 + SETTLED_FORWARDS):
        fwd(ids)
    epoch = h.order_epoch
    # A forward that runs the modules in another order (a layer skipped) starts learning again.
    layers = model.model.layers
    model.model.layers = layers[:-1]
    model.config.num_hidden_layers -= 1
    with torch.no_grad():
        model(ids, use_cache=False)
    model.model.layers = layers
    model.config.num_hidden_layers += 1
    assert h.order_epoch == epoch + 1
    n = len(tried)
    fwd(ids)                                       # learns again (the epoch moved): not tried
    assert len(tried) == n
    h.unwrap()


@pytest.mark.parametrize("why", ["expert_cache", "disk"])
def test_forwards_whose_host_chooses_their_moves_stay_eager(tier, monkeypatch, why):
    model, h, ids = _wrap(tier)
    monkeypatch.setattr(type(tier.backend), "kind", "cuda", raising=False)
    if why == "expert_cache":
        monkeypatch.setattr(h, "_cache", object())
        assert "expert cache" in h.graph_blockers()
    else:
        monkeypatch.setattr(h._stream, "disk", object())
        assert "disk" in h.graph_blockers()
    monkeypatch.undo()
    h.unwrap()


def test_a_capture_that_fails_leaves_the_transport_as_if_it_never_ran(tier, fake, monkeypatch):
    """A failed capture ran the forward's Python, none of its copies: the books would name pieces
    in slots that were never filled, and a later forward would read those slots. So the slots
    are forgotten and the capture's moves uncounted: the next forward brings in every piece it
    uses, and its logits are right."""
    import contextlib
    model, h, ids = _wrap(tier, "int8", lookahead=4)
    st = h._stream
    monkeypatch.setattr(fake, "capturing", contextlib.nullcontext, raising=False)
    with torch.no_grad():
        want = model(ids).logits
        with h.graph_mode():
            model(ids)
        h.drain()
        moved = tier.stats()["moved_bytes.all.h2d"]
        fills = []
        real = st._load
        st._load = lambda p, slot, wait=True: (fills.append(slot), real(p, slot, wait))[1]
        # A forward stopped halfway (a host sync the capture refuses, in layer 2, say).
        layer = model.model.layers[2].mlp
        boom = layer.register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("sync in a capture")))
        with pytest.raises(RuntimeError, match="sync"), h.capturing():
            model(ids)
        boom.remove()
        assert fills and not st.slot_of and all(s.occupant is None for s in st.ring)
        assert tier.stats()["moved_bytes.all.h2d"] == moved
        fills.clear()
        got = model(ids).logits
    n = sum(len(g.pieces) for g in h._groups.values() if not g.pinned and g.slot_in("stream"))
    assert len(fills) >= n                          # every piece brought in again
    assert torch.equal(got, want)
    h.unwrap()


def test_a_live_kv_cache_keeps_forwards_eager(tier, monkeypatch):
    model, h, ids = _wrap(tier)
    monkeypatch.setattr(type(tier.backend), "kind", "cuda", raising=False)
    assert h.graph_blockers() == ""
    monkeypatch.setattr(h, "_kv_live", object())
    assert "KV cache" in h.graph_blockers()
    monkeypatch.undo()
    h.unwrap()
