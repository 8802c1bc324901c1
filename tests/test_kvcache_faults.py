"""The KV cache's copy order and its faults, on the CPU over the fake backend.

Order (NOTE [kv copy order] in tiermem/inference/kvcache.py): a fake backend that keeps a vector
clock per stream records every copy, and the compute stream's reads and writes of the slots
(attention, the new tokens, fp8's dequantization); any two that touch the same bytes, one of them
writing, on different streams, must be ordered by the events the cache recorded and waited for.
So a slot is never overwritten before the attention and the append that read it are done, a fill
waits for the append that wrote its home, and attention waits for its fill.

Faults (NOTE [kv forward as a transaction]): each backend call of a decode step fails in turn (a
CUDA error, Ctrl-C); the cache then holds the tokens of the last whole forward, the step run again
gives the same logits as a run that never failed, and once closed nothing is left allocated. An
interrupt from the model itself (a hook) in the middle of ``generate`` leaves a cache that
``generate`` continues from to the same tokens as DynamicCache's.
"""
from __future__ import annotations

import gc
import itertools

import pytest
import torch
from fakes import FakeBackend
from helpers import fault_params

import tiermem

transformers = pytest.importorskip("transformers")
from test_kvcache import GEN, KW, MAX, budget, llama, prompt  # noqa: E402

COMPUTE = 0          # the fake's current stream


class ClockedFake(FakeBackend):
    """A fake whose streams keep vector clocks, and which logs every op with the bytes it reads
    and writes; ``races()`` lists conflicting ops on two streams that nothing orders."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.clock: dict[int, dict[int, int]] = {}
        self.stamps: dict[int, tuple[object, dict[int, int]]] = {}
        self.ops: list[dict] = []

    def _tick(self, stream: int) -> dict[int, int]:
        c = self.clock.setdefault(stream, {})
        c[stream] = c.get(stream, 0) + 1
        return dict(c)

    def record(self, event, stream):
        super().record(event, stream)
        self.stamps[id(event)] = (event, self._tick(stream))

    def wait(self, stream, event):
        super().wait(stream, event)
        got = self.stamps.get(id(event), (None, {}))[1]
        c = self.clock.setdefault(stream, {})
        for s, n in got.items():
            c[s] = max(c.get(s, 0), n)

    def copy(self, dst, src, nbytes, stream):
        super().copy(dst, src, nbytes, stream)
        self.op("copy", stream, reads=[(src, src + nbytes)], writes=[(dst, dst + nbytes)])

    def op(self, what: str, stream: int, reads=(), writes=()) -> None:
        vc = self._tick(stream)
        self.ops.append({"what": what, "stream": stream, "at": vc[stream], "vc": vc,
                         "reads": list(reads), "writes": list(writes)})

    def races(self) -> list[tuple[dict, dict]]:
        def touch(a, b):
            return any(x0 < y1 and y0 < x1 for x0, x1 in a for y0, y1 in b)
        out = []
        for j, y in enumerate(self.ops):
            for x in self.ops[:j]:
                if x["stream"] == y["stream"]:
                    continue
                if (touch(x["writes"], y["reads"] + y["writes"]) or touch(x["reads"], y["writes"])) \
                        and y["vc"].get(x["stream"], 0) < x["at"]:
                    out.append((x, y))
        return out


def _slot_range(s, cache):
    return [(s.ptr, s.ptr + cache.plan.slot_bytes)]


def clocked(cache, fake: ClockedFake):
    """Log the compute stream's slot work of ``cache`` into ``fake``: attention reads the slot
    ``update`` returns once it returns; the new tokens and fp8's dequantization write theirs."""
    update, put, deq = cache.update, cache._put, cache._dequantize

    def slot_of(t):
        p = t.data_ptr()
        return next((s for s in cache.ring or () if s.ptr <= p < s.ptr + cache.plan.slot_bytes), None)

    def traced_update(k, v, layer_idx, *a, **kw):
        out = update(k, v, layer_idx, *a, **kw)
        s = slot_of(out[0])
        if s is not None:
            fake.op("attention", COMPUTE, reads=_slot_range(s, cache))
        return out

    def traced_put(s, *a):
        put(s, *a)
        fake.op("new tokens", COMPUTE, reads=_slot_range(s, cache), writes=_slot_range(s, cache))

    def traced_deq(s, *a):
        deq(s, *a)
        fake.op("dequantize", COMPUTE, reads=_slot_range(s, cache), writes=_slot_range(s, cache))

    cache.update, cache._put, cache._dequantize = traced_update, traced_put, traced_deq


@pytest.fixture(scope="module")
def model():
    return llama()


@pytest.mark.parametrize(("resident", "fp8", "how"), [
    (0, False, "greedy"), (1, False, "greedy"), (1, True, "greedy"), (1, False, "chunked"), (1, False, "beams")])
def test_no_two_streams_touch_the_same_bytes_unordered(model, resident, fp8, how):
    fake = ClockedFake(total=1 << 30)
    tier = tiermem.Tier(backend=fake)
    batch = 6 if how == "beams" else 2
    from tiermem.planning import kv_shape, plan_kv
    ring = 2 * plan_kv(kv_shape(model.config, model.dtype, batch), MAX, 1 << 30, fp8=fp8).slot_bytes
    c = tiermem.kv_cache(model, MAX, ring + resident * budget(model, 1, batch=batch, slots=0), batch_size=batch,
                         fp8=fp8, tier=tier)
    assert len(c.plan.resident) == resident
    clocked(c, fake)
    extra = {"greedy": {}, "chunked": {"prefill_chunk_size": 4}, "beams": {"num_beams": 3, "num_return_sequences": 2}}
    ids, mask = prompt()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, **{KW: c}, **GEN, **extra[how])
    kinds = {o["what"] for o in fake.ops}
    assert {"copy", "attention", "new tokens"} <= kinds and ("dequantize" in kinds) == fp8
    assert len([o for o in fake.ops if o["what"] == "copy"]) > 100
    bad = fake.races()
    assert not bad, [(x["what"], x["stream"], y["what"], y["stream"]) for x, y in bad[:5]]
    c.close()


def test_the_race_detector_sees_a_fill_that_does_not_wait_for_attention(model):
    # the check above is only as good as its detector: make a slot's free event (what a fill
    # waits for before it overwrites a slot attention read) say nothing, and it must complain
    fake = ClockedFake(total=1 << 30)
    tier = tiermem.Tier(backend=fake)
    c = tiermem.kv_cache(model, MAX, budget(model, 0), batch_size=2, tier=tier)
    clocked(c, fake)
    from tiermem.core.stream import SlotRing
    release, idle = SlotRing.release, fake.new_stream()

    def released_on_an_idle_stream(self, slot, backend, stream=None):
        release(self, slot, backend, idle)
    SlotRing.release = released_on_an_idle_stream
    try:
        ids, mask = prompt()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, **{KW: c}, **dict(GEN, max_new_tokens=3))
    finally:
        SlotRing.release = release
    assert any(x["what"] == "attention" and y["what"] == "copy" for x, y in fake.races())
    c.close()


# -- faults ------------------------------------------------------------------------------------

STEPS = 4           # decode steps after the prefill; the fault lands in the third


class Scene:
    def __init__(self, model):
        self.model = model
        self.fake = FakeBackend(total=1 << 30)
        self.tier = tiermem.Tier(backend=self.fake)
        self.cache = tiermem.kv_cache(model, MAX, budget(model, 1), batch_size=2, tier=self.tier)
        self.ids, self.mask = prompt()
        self.logits: list[torch.Tensor] = []
        self.next = None
        self.forward(self.ids)                      # prefill
        for _ in range(2):
            self.step()

    def forward(self, ids: torch.Tensor) -> None:
        with torch.no_grad():
            out = self.model(input_ids=ids, attention_mask=self.mask, **{KW: self.cache}).logits[:, -1:]
        self.logits.append(out)
        self.next = out.argmax(-1)

    def step(self) -> None:
        self.mask = torch.cat([self.mask, torch.ones_like(self.next)], 1)
        try:
            self.forward(self.next)
        except BaseException:
            self.mask = self.mask[:, :-1]
            raise


@pytest.fixture(scope="module")
def reference(model):
    sc = Scene(model)
    for _ in range(STEPS - 2):
        sc.step()
    sc.cache.close()
    return sc.logits


def _calls(model) -> list[str]:
    sc = Scene(model)
    with sc.fake.counting() as seen:
        sc.step()
    sc.cache.close()
    return seen


# Every call of a decode step; the default run takes a sample of them (NOTE [sampled sweeps] in
# tests/helpers.py), ``pytest -m sweep`` the rest.
CASES = fault_params("kv_decode", _calls(llama()))


def test_the_sweep_covers_a_decode_steps_fills_appends_and_waits():
    calls = {c.values[2] for c in CASES}
    assert {"copy", "wait", "record", "new_event"} <= calls and len(CASES) >= 150


@pytest.mark.parametrize(("name", "n", "call", "kind"), CASES)
def test_fault(model, reference, name, n, call, kind):
    sc = Scene(model)
    tokens = sc.cache.get_seq_length()
    sc.fake.fail_at(n, kind)
    err = None
    try:
        sc.step()
    except BaseException as e:     # noqa: B036 - the interrupt is what is under test
        err = e
    sc.fake.disarm()
    assert sc.fake.fired is not None and sc.fake.fired[1] == call
    assert err is not None, "a failed backend call inside the step must surface"
    if kind == "interrupt":
        assert isinstance(err, KeyboardInterrupt)
    else:
        assert isinstance(err, tiermem.TierMemError) and "cudaError" in str(err)
    del err
    # the cache holds the last whole forward's tokens, and the step run again gives what a run
    # that never failed gave
    assert sc.cache.get_seq_length() == tokens
    for _ in range(STEPS - 2):
        sc.step()
    assert len(sc.logits) == len(reference)
    for got, want in zip(sc.logits, reference):
        assert torch.equal(got, want)
    sc.cache.close()
    gc.collect()
    assert sc.fake.live() == {"managed": 0, "pinned": 0, "device": 0}, "bytes leaked"
    assert not sc.tier.leases and sc.tier.stats()["resident_bytes.all.current"] == 0
    sc.tier.close()


def test_an_interrupt_mid_generate_leaves_a_cache_generate_continues_from(model):
    ids, mask = prompt()
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, **GEN)
    fake = FakeBackend(total=1 << 30)
    tier = tiermem.Tier(backend=fake)
    c = tiermem.kv_cache(model, MAX, budget(model, 1), batch_size=2, tier=tier)
    calls = itertools.count()

    def hook(mod, args, out):
        if next(calls) == 9:               # the layer's tenth forward: the ninth decode step
            raise KeyboardInterrupt("stop")
    h = model.model.layers[3].register_forward_hook(hook)
    try:
        with torch.no_grad(), pytest.raises(KeyboardInterrupt):
            model.generate(input_ids=ids, attention_mask=mask, **{KW: c}, **GEN)
    finally:
        h.remove()
    have = c.get_seq_length()
    assert have == ids.shape[1] + 8          # the prompt and eight whole decode steps
    # generate again over the tokens so far: the cache gives the first ``have``, one is new
    so_far = want[:, :have + 1]
    m2 = torch.cat([mask, torch.ones(2, so_far.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    with torch.no_grad():
        out = model.generate(input_ids=so_far, attention_mask=m2, **{KW: c},
                             **dict(GEN, max_new_tokens=want.shape[1] - so_far.shape[1]))
    assert torch.equal(out, want)
    c.close()
    assert fake.live() == {"managed": 0, "pinned": 0, "device": 0} and not tier.leases
