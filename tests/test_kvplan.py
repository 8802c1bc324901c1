"""The KV cache's plan (NOTE [kv plan] in tiermem/inference/kvplan.py), pure, on the CPU: its sizes,
which layers stay resident within a budget, its refusals with their numbers, and the split of one
budget between a module's weights and its cache."""
from __future__ import annotations

import pytest
import torch

import tiermem
from tiermem.inference.kvplan import pinned_map_bytes
from tiermem.planning import KVShape, kv_shape, plan_kv, plan_residency, split_budget

transformers = pytest.importorskip("transformers")

GB = 10**9
# Llama-3-8B's cache: 32 layers of 8 KV heads of 128, fp16: 128 KiB a token (issue 58)
LLAMA3 = KVShape(layers=32, kv_heads=8, head_dim=128, v_head_dim=128, itemsize=2)


def test_a_llama3_8b_shape_holds_128_kib_a_token_and_half_a_gib_a_layer_at_128k():
    cfg = transformers.LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                                   num_key_value_heads=8, intermediate_size=14336, vocab_size=128256)
    s = kv_shape(cfg, torch.float16)
    assert s == LLAMA3
    assert s.token_bytes == 128 << 10
    assert s.layer_bytes(131072) == 512 << 20
    assert kv_shape(cfg, torch.float32).itemsize == 4 and kv_shape(cfg, torch.bfloat16, batch=3).batch == 3


def test_the_plan_keeps_what_fits_beside_a_ring_of_two_slots_spread_over_the_model():
    # 8 layers' worth: 2 slots, 6 resident, and the driver's mapping of the 26 streamed layers'
    # 13 GiB pinned home, 2 MiB a GiB (NOTE [pinned mapping])
    p = plan_kv(LLAMA3, 131072, (4 << 30) + (26 << 20))
    assert p.slots == 2 and len(p.resident) == 6 and p.device_bytes == 8 * (512 << 20) + (26 << 20) <= p.budget
    assert plan_kv(LLAMA3, 131072, 4 << 30).device_bytes <= 4 << 30       # a layer fewer, not over
    gaps = sorted(p.resident)
    assert gaps == [2, 8, 13, 18, 24, 29]          # spread evenly, not bunched at one end
    assert p.moved_bytes() == 26 * (128 << 10) // 32 * 131072
    assert p.moved_bytes(1000) == 26 * 1000 * 4096
    assert p.predicted_seconds(link_GBps=50.0) == pytest.approx(p.moved_bytes() / 50e9)
    assert p.home_bytes == 26 * (512 << 20)       # only streamed layers have a home
    # a byte short of the next layer plans the same; the whole cache plans no ring at all
    seven = (9 << 29) + (24 << 20)                 # 9 layers, and the 12.5 GiB home's 12 whole GiB mapped
    assert plan_kv(LLAMA3, 131072, seven - 1).resident == p.resident
    assert len(plan_kv(LLAMA3, 131072, seven).resident) == 7
    full = plan_kv(LLAMA3, 131072, 16 << 30)
    assert len(full.resident) == 32 and full.slots == 0 and full.home_bytes == 0 and full.moved_bytes() == 0
    assert "32 of 32" not in full.table() and "all of it resident" in full.table()
    assert "6 of 32 layers resident, 26 streamed through 2 slots" in p.table()


def _needs(shape, tokens, slots=2):
    """Device bytes of the ring and r resident layers, r = 0 .. all, with the home's mapping."""
    n = shape.layer_bytes(tokens)
    return [(r + min(slots, shape.layers - r)) * n + pinned_map_bytes((shape.layers - r) * n)
            for r in range(shape.layers + 1)]


def test_three_slots_take_a_layer_from_the_resident_ones():
    assert len(plan_kv(LLAMA3, 131072, (4 << 30) + (26 << 20), slots=3).resident) == 5
    with pytest.raises(tiermem.ConfigError, match="slots must be at least 2"):
        plan_kv(LLAMA3, 131072, 4 << 30, slots=1)


def test_a_budget_below_the_ring_is_refused_with_what_would_fit():
    with pytest.raises(tiermem.OutOfBudgetError) as e:
        plan_kv(LLAMA3, 131072, GB)
    msg = str(e.value)
    # two 512 MiB slots, and 32 MiB of the device to map the 16 GiB home (NOTE [pinned mapping])
    assert "raise kv_budget to 1,107,296,256 bytes" in msg and "lower max_tokens to 118,486" in msg
    assert "2 device slots of 536,870,912 bytes each" in msg and "takes 33,554,432 bytes of the device" in msg
    assert e.value.asked == (1 << 30) + (32 << 20) and e.value.limit == GB
    # the number it names does fit, and one token more does not
    assert plan_kv(LLAMA3, 118486, GB).device_bytes <= GB
    with pytest.raises(tiermem.OutOfBudgetError):
        plan_kv(LLAMA3, 118487, GB)
    with pytest.raises(tiermem.ConfigError, match="max_tokens"):
        plan_kv(LLAMA3, 0, GB)


def test_fp8_halves_the_home_and_the_bytes_a_step_moves_and_widens_the_slots():
    p16 = plan_kv(LLAMA3, 131072, 4 << 30)
    p8 = plan_kv(LLAMA3, 131072, 4 << 30, fp8=True)
    per_token = 8 * 256 + 2 * 8 * 4               # fp8 keys and values, an fp32 scale per head of each
    assert p8.moved_bytes(1) == len(p8.streamed) * per_token
    assert p8.home_layer_bytes == 131072 * per_token
    assert p8.slot_bytes == p16.layer_bytes + p8.home_layer_bytes
    assert p8.home_layer_bytes / p16.home_layer_bytes == pytest.approx(0.5 + 1 / 64)    # scales: 8 bytes a head against 512


def test_configs_the_cache_cannot_hold_are_refused():
    cfg = transformers.Qwen2Config(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   layer_types=["full_attention", "sliding_attention"] * 2, use_sliding_window=True)
    with pytest.raises(tiermem.ConfigError, match="sliding_attention"):
        kv_shape(cfg)
    with pytest.raises(tiermem.ConfigError, match="floating-point"):
        kv_shape(transformers.LlamaConfig(num_hidden_layers=2), torch.int8)


def _weights() -> list[tuple[str, int]]:
    # a Llama-3-8B's groups: the embedding and head, and each layer's seven matrices
    out = [("embed", 1_050_673_152)]
    for i in range(32):
        out += [(f"{i}.q", 33_554_432), (f"{i}.k", 8_388_608), (f"{i}.v", 8_388_608), (f"{i}.o", 33_554_432),
                (f"{i}.gate", 117_440_512), (f"{i}.up", 117_440_512), (f"{i}.down", 117_440_512)]
    return out + [("head", 1_050_673_152)]


def _moved(w, kv) -> int:
    return w.moved_bytes + kv.moved_bytes()


def test_the_split_moves_the_fewest_bytes_of_every_split_the_budget_allows():
    sizes = _weights()
    total = sum(n for _, n in sizes)
    budget = total + (1 << 30)
    w, kv = split_budget(sizes, budget, LLAMA3, 131072, in_place=["embed"])
    assert w.budget + kv.budget == budget and kv.budget == kv.device_bytes and kv.slots == 2
    every = [plan_residency(sizes, budget - need, 2, in_place=["embed"]).moved_bytes
             + plan_kv(LLAMA3, 131072, need).moved_bytes()
             for need in _needs(LLAMA3, 131072) if need <= budget]    # the ring and r more layers
    assert _moved(w, kv) == min(every)
    # the weights all resident beside a ring is one of them, and not the best: streaming 72 MiB of
    # small groups (room for two cache layers and the 15 GiB home's 30 MiB mapping) frees room for
    # two cache layers (1 GiB fewer bytes a step)
    assert every[0] == 32 * (512 << 20) and _moved(w, kv) < every[0]
    assert len(kv.resident) == 2 and w.moved_bytes < 96 << 20


def test_one_budget_with_room_for_everything_keeps_everything_and_a_small_one_still_plans_the_ring():
    sizes = _weights()
    total = sum(n for _, n in sizes)
    w, kv = split_budget(sizes, total + (16 << 30), LLAMA3, 131072)
    assert w.moved_bytes == 0 and len(kv.resident) == 32 and kv.moved_bytes() == 0
    w, kv = split_budget(sizes, 3 << 30, LLAMA3, 131072, in_place=["embed"])
    assert kv.device_bytes + w.budget <= 3 << 30 and kv.slots == 2
    with pytest.raises(tiermem.OutOfBudgetError, match="raise kv_budget"):
        split_budget(sizes, 1 << 29, LLAMA3, 131072)


def test_the_split_goes_where_a_byte_saves_most():
    # weights that stream through a wide window (one 4 GB group) against a cache whose ring is
    # small: the budget goes to the cache first, since a weight byte on the device saves one
    # byte a step only once its group is whole
    sizes = [("big", 4 * GB), ("small", GB // 10)]
    shape = KVShape(layers=8, kv_heads=8, head_dim=128, v_head_dim=128, itemsize=2)
    w, kv = split_budget(sizes, 3 * GB, shape, 65536)
    best = min(plan_residency(sizes, 3 * GB - d, 2).moved_bytes + plan_kv(shape, 65536, d).moved_bytes()
               for d in _needs(shape, 65536) if d < 3 * GB)
    assert _moved(w, kv) == best
