"""Two GPUs of one host: data parallel, FSDP2 with tiermem holding the shards, and inference across
GPUs. One command, about 4 minutes on two H200s:

    python bench/multi_gpu.py            (TIERMEM_COMMIT=<sha> names the commit of a copied tree)

Writes bench/results/multi_gpu-<device>-<date>.json:
  metrics
    gpus                          GPUs used (2)
    dp_scaling_2gpu               tokens/s of wrap_training(process_group=True) on two GPUs over one
                                  GPU (a ~0.85B Llama-style transformers model, bf16 autocast over
                                  fp32 masters, fused AdamW, 4x1024 tokens per rank, --dp-budget per rank)
    dp_scaling_2gpu_sharded       the same with shard_steps=True (NOTE [sharded steps]: each streamed
                                  block stepped on one rank, its parameters broadcast), over the
                                  same one-GPU run
    dp_host_mem_sharded_over_plain   the two ranks' pinned bytes with shard_steps over without (a
                                  rank keeps the states of the blocks it steps only)
    dp_scaling_2gpu_host_step     the same with host_step=True (NOTE [host stepping]: the gradients
                                  averaged, then stepped on the host), and dp_host_step_speedup_2gpu
                                  the two-GPU step time without it over with it
    dp_scaling_link_bound         the most a step that keeps both directions of its link busy can
                                  scale: two GPUs' pinned copies both ways at once over one GPU's
                                  alone (the host's memory is shared by the two links)
    fsdp2_offload_over_tiermem    FSDP2 CPUOffloadPolicy step time over FSDP2 under tiermem.wrap_fsdp
                                  (same model, MixedPrecisionPolicy bf16/fp32, 4x1024 tokens per rank)
    fsdp2_tiermem_peak_over_offload_peak   that wrap_fsdp run's device reserve over CPU offload's
    host_mem_over_state           pinned bytes of both ranks' homes over one copy of the training
                                  state (fp32 parameters and AdamW's two moments)
    infer_scaling_2gpu            the lower of prefill and decode tokens/s of the layers over two GPUs
                                  (wrap_module(devices=[0, 1]), each GPU's layers over both links:
                                  NOTE [two links into one GPU]) over one GPU, each at --infer-share of
                                  the bf16 weights per GPU, for the last of --infer-sizes (2.4B, whose
                                  forward is link-bound); infer_scaling_2gpu_<size> for each size, and
                                  raw's two_own_link the same without the relay
    host_mem_ratio_shared_home    pinned bytes of two replicas on two GPUs sharing one home over
                                  one copy of the streamed weights
  checks
    losses_match                  wrap_fsdp's losses equal plain FSDP2's (bitwise where plain FSDP2
                                  repeats itself bitwise, else within 1e-3 relative: raw says which)
    tokens_equal                  greedy tokens across two GPUs equal the resident model's on one
    resident_within_budget_all_ranks   every rank's (and device's) tiermem peak within its budget
    dp_replicas_equal             the two ranks' parameters after data parallel, with and without
                                  shard_steps, sum to the same value on both
    all_runs_finished             no rank failed (what ran before a failure is kept in raw)
"""
from __future__ import annotations

import argparse
import copy
import datetime
import gc
import os
import statistics
import tempfile
import time

from _common import duplex_copy, progress, write_results

GiB = 1 << 30
TOKENS = (4, 1024)


# The training model (~0.85B), and for inference also a wider one (~2.4B, 4.8 GB in bf16) whose
# forward at a third of its weights resident is bound by the link, not by compute or the host.
SIZES = {"0.85B": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                       num_key_value_heads=4),
         "2.4B": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=12, num_attention_heads=32,
                      num_key_value_heads=8)}


def llama_config(size: str = "0.85B"):
    import transformers
    return transformers.LlamaConfig(vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False,
                                    use_cache=False, **SIZES[size])


def build(torch, device: str = "cuda", dtype=None, size: str = "0.85B"):
    import transformers
    torch.manual_seed(0)
    with torch.device(device):
        m = transformers.LlamaForCausalLM(llama_config(size))
    return m if dtype is None else m.to(dtype)


def batch(torch, step: int, rank: int):
    g = torch.Generator(device="cuda").manual_seed(1000 * (rank + 1) + step)
    return torch.randint(0, 32000, TOKENS, device="cuda", generator=g)


def state_bytes(model) -> int:
    return sum(p.numel() * 12 for p in model.parameters())      # fp32 + AdamW's two moments


def _free(torch):
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _timed(torch, fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


# -- data parallel -------------------------------------------------------------------------------------
def dp(torch, tiermem, tier, rank: int, world: int, budget: str, warm: int, timed: int,
       host_step: bool = False, shard: bool = False) -> dict:
    model = build(torch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    train = tier.wrap_training(model, opt, budget, process_group=True if world > 1 else None, host_step=host_step,
                               shard_steps=shard and world > 1)
    how = " host-stepped" if host_step else " sharded steps" if shard else ""
    times, peaks = [], []
    for step in range(warm + timed):
        ids = batch(torch, step, rank)

        def one():
            with train.step(), torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
        t = _timed(torch, one)
        peaks.append(train.resident_peak())
        if step >= warm:
            times.append(t)
        if rank == 0:
            progress(f"  dp world={world}{how} step {step}: {t * 1e3:.0f} ms")
    out = {"step_s": statistics.median(times), "peak": max(peaks), "budget": train.budget,
           "plan": str(train.plan), "pinned": train.pinned_bytes, "report": train.report()}
    train.unwrap()
    # the replica's parameters, summed: equal on every rank where the replicas are bitwise equal
    out["checksum"] = float(sum(p.detach().double().sum() for p in model.parameters()))
    del train, model, opt
    _free(torch)
    return out


# -- FSDP2 ---------------------------------------------------------------------------------------------
def fsdp_model(torch, offload: bool):
    """The bench's model under FSDP2 (each layer, then the whole; bf16 all-gathers, fp32
    reductions; ``offload``: CPUOffloadPolicy) and its AdamW (fused on the device, not with
    CPU offload, whose step runs on the CPU)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    model = build(torch)
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=not offload)


def fsdp_run(torch, tiermem, tier, rank: int, world: int, how: str, steps: int, warm: int) -> dict:
    """``how``: "plain" (FSDP2 on the device, AdamW after backward), "offload" (CPUOffloadPolicy,
    AdamW on the CPU), "tiermem" (wrap_fsdp)."""
    model, opt = fsdp_model(torch, how == "offload")
    sb = state_bytes(model) // world
    handle = tier.wrap_fsdp(model, opt) if how == "tiermem" else None
    _free(torch)
    torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for step in range(steps):
        ids = batch(torch, step, rank)
        box = []

        def one():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if handle is None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            box.append(loss)
        t = _timed(torch, one)
        losses.append(float(box[0].detach()))
        if step >= warm:
            times.append(t)
        if rank == 0:
            progress(f"  fsdp {how} step {step}: {t * 1e3:.0f} ms, loss {losses[-1]:.6f}")
    out = {"step_s": statistics.median(times) if times else None, "losses": losses,
           "peak_reserved": torch.cuda.max_memory_reserved(), "state_share": sb,
           "pinned": handle.pinned_bytes if handle is not None else 0}
    if handle is not None:
        handle.unwrap()
    del handle, model, opt
    _free(torch)
    return out


def rank_main(rank: int, world: int, init: str, outdir: str, a: argparse.Namespace) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    import torch.distributed as dist

    import tiermem
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))     # CPUOffloadPolicy's AdamW runs here
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.cuda.set_device(rank)
    # A rank that fails mid-collective must not leave the other waiting for ever.
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=180), device_id=torch.device("cuda", rank))
    tier = tiermem.Tier(rank)
    res: dict = {}
    keep = os.path.join(outdir, f"rank{rank}.pt")
    try:
        # one GPU (the other waits), then two; sharded steps (NOTE [sharded steps]): a rank's link
        # carries its own blocks' states only; steps on the host (NOTE [host stepping]): fewer bytes
        for key, what, ranks, kw in (("dp1", "one GPU (the other waits)", 1, {}), ("dp2", "two GPUs", world, {}),
                                     ("dp2_shard", "two GPUs, sharded steps", world, {"shard": True}),
                                     ("dp1_host", "one GPU, host-stepped", 1, {"host_step": True}),
                                     ("dp2_host", "two GPUs, host-stepped", world, {"host_step": True})):
            if rank == 0:
                progress(f"data parallel, {what}")
            if rank < ranks:
                res[key] = dp(torch, tiermem, tier, rank, ranks, a.dp_budget, a.dp_warm, a.dp_steps, **kw)
            torch.save(res, keep)
            dist.barrier()
        for how, steps, warm in (("plain", a.fsdp_steps, 1), ("plain_again", a.fsdp_steps, 1),
                                 ("offload", a.offload_steps, 1), ("tiermem", a.fsdp_steps, 1)):
            if rank == 0:
                progress(f"FSDP2 {how}")
            res[how] = fsdp_run(torch, tiermem, tier, rank, world, how.split("_")[0], steps, warm)
            torch.save(res, keep)          # what ran is kept if a later run fails
            dist.barrier()
    finally:
        torch.save(res, keep)
        tier.close()
        dist.destroy_process_group()


# -- the links ------------------------------------------------------------------------------------
def link_rates(torch, devices: list[int], reps: int = 4) -> dict:
    """Pinned copies of 1 GiB both ways at once on each of ``devices`` together (threads, one per
    GPU, two streams each), after a warm-up; GB/s per GPU, medians of three."""
    import threading
    bufs = {}
    for d in devices:
        with torch.cuda.device(d):
            bufs[d] = (torch.empty(GiB, dtype=torch.uint8, device=d), torch.empty(GiB, dtype=torch.uint8, device=d),
                       torch.empty(GiB, dtype=torch.uint8, pin_memory=True),
                       torch.empty(GiB, dtype=torch.uint8, pin_memory=True), torch.cuda.Stream(d), torch.cuda.Stream(d))

    def run(d, out):
        dev, dev2, h, h2, s1, s2 = bufs[d]
        torch.cuda.set_device(d)
        cur = torch.cuda.current_stream(d)
        cur.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(cur)
        duplex_copy(torch, dev, h, h2, dev2, s1, s2, reps)
        e1.record(cur)
        e1.synchronize()
        out.setdefault(d, []).append(2 * reps * GiB / (e0.elapsed_time(e1) / 1e3) / 1e9)

    out: dict = {}
    for _ in range(4):
        th = [threading.Thread(target=run, args=(d, out)) for d in devices]
        for t in th:
            t.start()
        for t in th:
            t.join()
    rates = {d: statistics.median(v[1:]) for d, v in out.items()}
    del bufs
    _free(torch)
    return rates


# -- inference -------------------------------------------------------------------------------------
def weight_bytes(m) -> int:
    return sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))


def infer_times(torch, model, prompt, decode_ids, new: int) -> dict:
    with torch.no_grad():
        model(prompt)                                # learns the order
        prefill = [_timed(torch, lambda: model(prompt)) for _ in range(5)]
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, use_cache=True)
        for _ in range(2):                           # a decode's first forwards learn its order
            model.generate(decode_ids, **kw)
        gen = [_timed(torch, lambda: model.generate(decode_ids, **kw)) for _ in range(5)]
        tokens = model.generate(decode_ids, **kw)
    return {"prefill_tok_s": prompt.numel() / statistics.median(prefill),
            "decode_tok_s": new / statistics.median(gen), "tokens": tokens.cpu()}


def inference(torch, tiermem, a, size: str, replicas: bool) -> dict:
    ref = build(torch, "cuda:0", torch.bfloat16, size).eval()
    w = weight_bytes(ref)
    budget = int(w * a.infer_share)
    g = torch.Generator(device="cuda").manual_seed(7)
    prompt = torch.randint(0, 32000, (1, a.prefill), device="cuda:0", generator=g)
    decode_ids = prompt[:, :64]
    kw = dict(max_new_tokens=a.decode, min_new_tokens=a.decode, do_sample=False, pad_token_id=0, use_cache=True)
    with torch.no_grad():
        want = ref.generate(decode_ids, **kw).cpu()
    cpu = ref.to("cpu")                               # the weights' source for every handle below
    del ref
    _free(torch)
    tiers = [tiermem.Tier(0), tiermem.Tier(1)]
    out: dict = {"weight_bytes": w, "budget_per_gpu": budget}

    progress(f"inference, {size}, one GPU, {budget / 1e9:.2f} of {w / 1e9:.2f} GB resident")
    one = copy.deepcopy(cpu)
    h = tiers[0].wrap_module(one, budget)
    out["one"] = infer_times(torch, one, prompt, decode_ids, a.decode)
    out["one"]["peak_ok"] = tiers[0].stats()["resident_bytes.all.peak"] <= h.budget
    h.unwrap("cpu")
    del h, one
    _free(torch)

    # "two": each GPU's layers over both links (the relay, NOTE [two links into one GPU]);
    # "two_own_link": each over its own link alone.
    for key, relay in (("two", True), ("two_own_link", False)):
        progress(f"inference, {size}, layers over two GPUs, relay={relay}")
        moved0 = sum(t.stats()["moved_bytes.all.h2d"] for t in tiers)
        two = copy.deepcopy(cpu)
        h = tiermem.wrap_module(two, budget, devices=[0, 1], tiers=tiers, relay=relay)
        out[key] = infer_times(torch, two, prompt, decode_ids, a.decode)
        out[key]["peak_ok"] = all(t.stats()["resident_bytes.all.peak"] <= budget for t in tiers)
        st = h.stats()
        out[key]["pinned"] = st["pinned_bytes.home"]
        out[key]["relayed_share"] = st["relayed_bytes"] / max(1, sum(t.stats()["moved_bytes.all.h2d"]
                                                                      for t in tiers) - moved0)
        out[key]["plans"] = [p.plan.table(limit=0) for p in h.parts]
        h.unwrap("cpu")
        del h, two
        _free(torch)

    out["want"] = want
    if not replicas:
        for t in tiers:
            t.close()
        return out
    progress(f"inference, {size}, two replicas sharing one home")
    ra, rb = copy.deepcopy(cpu), copy.deepcopy(cpu)
    ha = tiers[0].wrap_module(ra, budget)
    hb = tiers[1].wrap_module(rb, budget, share_home=ha)
    with torch.no_grad():
        ta = ra.generate(decode_ids, **kw).cpu()
        tb = rb.generate(decode_ids.to("cuda:1"), **kw).cpu()
    sa, sb = ha.stats(), hb.stats()
    out["replicas"] = {"pinned": sa["pinned_bytes.current"] + sb["pinned_bytes.current"],
                       "one_home": sa["pinned_bytes.home"], "tokens_equal": bool(torch.equal(ta, want)
                                                                                 and torch.equal(tb, want))}
    hb.unwrap("cpu")
    ha.unwrap("cpu")
    for t in tiers:
        t.close()
    return out


def summary(torch, ranks: list[dict], infs: dict, alone: dict, together: dict, a: argparse.Namespace,
            failed: str | None, parts: set, world: int) -> tuple[dict, dict, dict]:
    """(metrics, checks, raw) from the ranks' training results (empty dicts where training did
    not run), the inference results by model size, and the link rates."""
    sizes = list(infs)
    inf = infs[sizes[0]] if sizes else {"replicas": {"one_home": 0, "pinned": 0, "tokens_equal": True}}
    r0 = ranks[0]

    def have(key):
        return all(key in r and r[key].get("step_s") for r in ranks)

    def worst(key, field="step_s"):
        return max(r[key][field] for r in ranks)
    def scaling(two, one):
        return r0[one]["step_s"] * world / worst(two) if have(two) and one in r0 else None
    dp_scaling = scaling("dp2", "dp1")
    plain_repeats = have("plain_again") and all(r["plain"]["losses"] == r["plain_again"]["losses"] for r in ranks)
    tiered = [k for k in ("tiermem",) if have(k)]

    def matches(k):
        if plain_repeats:
            return all(r[k]["losses"] == r["plain"]["losses"] for r in ranks)
        return all(abs(x - y) <= 1e-3 * abs(y) for r in ranks for x, y in zip(r[k]["losses"], r["plain"]["losses"]))
    losses_match = bool(tiered) and all(matches(k) for k in tiered)
    # wrap_fsdp takes no budget with more than one rank (training/fsdp.py): its reserve is
    # reported beside CPU offload's (fsdp2_tiermem_peak_over_offload_peak).
    fair = tiered[0] if tiered else None
    offload_over = worst("offload") / worst(fair) if fair and have("offload") else None
    host_over_state = sum(r[tiered[0]]["pinned"] for r in ranks) / sum(r[tiered[0]]["state_share"] for r in ranks) \
        if tiered else None
    scal = {}
    for size, x in infs.items():
        scal[size] = {"prefill": x["two"]["prefill_tok_s"] / x["one"]["prefill_tok_s"],
                      "decode": x["two"]["decode_tok_s"] / x["one"]["decode_tok_s"]}
    streamed_one = inf["replicas"]["one_home"]

    def r3(v):
        return None if v is None else round(v, 3)
    metrics = {
        "gpus": world,
        "dp_scaling_2gpu": r3(dp_scaling),
        "dp_scaling_2gpu_sharded": r3(scaling("dp2_shard", "dp1")),
        "dp_host_mem_sharded_over_plain": r3(sum(r["dp2_shard"]["pinned"] for r in ranks)
                                             / sum(r["dp2"]["pinned"] for r in ranks))
        if have("dp2") and have("dp2_shard") else None,
        "dp_scaling_2gpu_host_step": r3(scaling("dp2_host", "dp1_host")),
        "dp_host_step_speedup_2gpu": r3(worst("dp2") / worst("dp2_host")) if have("dp2") and have("dp2_host") else None,
        "dp_scaling_link_bound": r3(sum(together.values()) / alone[0]),
        "fsdp2_offload_over_tiermem": r3(offload_over),
        "fsdp2_tiermem_peak_over_offload_peak": r3(worst(fair, "peak_reserved") / worst(
            "offload", "peak_reserved")) if fair and have("offload") else None,
        "host_mem_over_state": r3(host_over_state),
        "infer_scaling_2gpu": r3(min(scal[sizes[-1]].values())) if sizes else None,
        **{f"infer_scaling_2gpu_{size}": r3(min(v.values())) for size, v in scal.items()},
        "host_mem_ratio_shared_home": r3(inf["replicas"]["pinned"] / streamed_one) if streamed_one else None,
    }
    tokens_equal = all(torch.equal(x[k]["tokens"], x["want"]) for x in infs.values()
                       for k in ("one", "two", "two_own_link")) and inf["replicas"]["tokens_equal"]
    within = ("train" not in parts or have("dp2") and all(r[k]["peak"] <= r[k]["budget"] for r in ranks
                                                          for k in ("dp2", "dp2_shard", "dp2_host") if k in r)
              and all(r0[k]["peak"] <= r0[k]["budget"] for k in ("dp1", "dp1_host") if k in r0)) \
        and all(x[k]["peak_ok"] for x in infs.values() for k in ("one", "two", "two_own_link"))
    checks = {"resident_within_budget_all_ranks": bool(within), "all_runs_finished": failed is None}
    if "train" in parts:
        checks["losses_match"] = bool(losses_match)
        ran = [k for k in ("dp2", "dp2_shard") if have(k)]
        checks["dp_replicas_equal"] = bool(ran) and all(
            all("checksum" in r[k] for r in ranks) and len({r[k]["checksum"] for r in ranks}) == 1 for k in ran)
    if "infer" in parts:
        checks["tokens_equal"] = bool(tokens_equal)
    hows = ("plain", "plain_again", "offload", "tiermem")
    raw = {
        "model": "LlamaForCausalLM hidden 2048, 16 layers, ffn 5632, 16 heads / 4 kv, vocab 32000 (~0.85B)",
        "infer_models": {size: SIZES[size] for size in sizes},
        "tokens_per_rank": list(TOKENS), "args": vars(a), "failed": failed,
        "link_duplex_GBps": {"one_gpu_alone": alone[0], "each_of_two_at_once": together},
        "dp": {"one_gpu_step_s": r0["dp1"]["step_s"], "two_gpu_step_s": [r["dp2"]["step_s"] for r in ranks],
               "peaks": [r["dp2"]["peak"] for r in ranks], "budget": r0["dp2"]["budget"],
               "plans": [r["dp2"]["plan"] for r in ranks], "one_gpu_plan": r0["dp1"]["plan"]} if have("dp2") else None,
        "dp_host_step": {"one_gpu_step_s": r0["dp1_host"]["step_s"], "two_gpu_step_s": [r["dp2_host"]["step_s"]
                                                                                       for r in ranks],
                         "peaks": [r["dp2_host"]["peak"] for r in ranks],
                         "plans": [r["dp2_host"]["plan"] for r in ranks], "one_gpu_plan": r0["dp1_host"]["plan"]}
        if have("dp2_host") and "dp1_host" in r0 else None,
        "dp_sharded": {"two_gpu_step_s": [r["dp2_shard"]["step_s"] for r in ranks],
                       "peaks": [r["dp2_shard"]["peak"] for r in ranks],
                       "moved_h2d_d2h": [(r["dp2_shard"]["report"]["moved_h2d_bytes"],
                                          r["dp2_shard"]["report"]["moved_d2h_bytes"]) for r in ranks],
                       "unsharded_moved_h2d_d2h": [(r["dp2"]["report"]["moved_h2d_bytes"],
                                                    r["dp2"]["report"]["moved_d2h_bytes"]) for r in ranks],
                       "plans": [r["dp2_shard"]["plan"] for r in ranks]} if have("dp2_shard") else None,
        "fsdp": {how: {"step_s": [r[how]["step_s"] for r in ranks], "losses": [r[how]["losses"] for r in ranks],
                       "peak_reserved": [r[how]["peak_reserved"] for r in ranks],
                       "pinned": [r[how]["pinned"] for r in ranks]}
                 for how in hows if all(how in r for r in ranks)},
        "fsdp_plain_repeats_bitwise": plain_repeats,
        "infer": {size: {"weight_bytes": x["weight_bytes"], "budget_per_gpu": x["budget_per_gpu"],
                         "one": {k: v for k, v in x["one"].items() if k != "tokens"},
                         "two": {k: v for k, v in x["two"].items() if k != "tokens"},
                         "two_own_link": {k: v for k, v in x["two_own_link"].items() if k != "tokens"},
                         "scaling_own_link": {
                             "prefill": x["two_own_link"]["prefill_tok_s"] / x["one"]["prefill_tok_s"],
                             "decode": x["two_own_link"]["decode_tok_s"] / x["one"]["decode_tok_s"]},
                         "prefill_scaling": scal[size]["prefill"], "decode_scaling": scal[size]["decode"],
                         "split_pinned_over_weights": x["two"]["pinned"] / x["weight_bytes"],
                         "replicas": x.get("replicas")} for size, x in infs.items()},
        # link-bound, one forward runs the GPUs in turn: (W - B) / (W - 2B), slots not counted
        "infer_ideal_link_bound_scaling": (1 - a.infer_share) / max(1 - 2 * a.infer_share, 1e-9),
    }
    return metrics, checks, raw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp-budget", default="6GiB", help="wrap_training's budget per rank")
    ap.add_argument("--dp-warm", type=int, default=10, help="steps before timing (the plan's trace, probe, check)")
    ap.add_argument("--dp-steps", type=int, default=4)
    ap.add_argument("--fsdp-steps", type=int, default=4)
    ap.add_argument("--offload-steps", type=int, default=3)
    ap.add_argument("--infer-share", type=float, default=1 / 3, help="weights resident per GPU, a share")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--parts", default="train,infer", help="train (data parallel, FSDP2), infer, or both; a run "
                    "of one part writes multi_gpu-<device>-<date>-<part>.json")
    ap.add_argument("--infer-sizes", default="0.85B,2.4B", help=f"models for inference, of {sorted(SIZES)}; "
                    "the first also runs the shared home; the last gives infer_scaling_2gpu")
    a = ap.parse_args()
    import torch
    import torch.multiprocessing as mp
    world = 2
    if torch.cuda.device_count() < world:
        raise SystemExit(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    parts = set(a.parts.split(","))
    if not parts or parts - {"train", "infer"}:
        raise SystemExit(f"--parts takes train, infer or both, got {a.parts!r}")
    failed = None
    ranks: list[dict] = [{} for _ in range(world)]
    if "train" in parts:
        with tempfile.TemporaryDirectory() as d:
            progress("training on two ranks (spawned)")
            try:
                mp.spawn(rank_main, args=(world, f"file://{d}/rendezvous", d, a), nprocs=world, join=True)
            except Exception as e:           # what ran before the failure is kept and reported
                failed = repr(e)[-2000:]
                progress(f"a rank failed: {failed}")
            ranks = [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(world)]
    import tiermem
    progress("the links: both ways on one GPU, then on both at once")
    alone = link_rates(torch, [0])
    together = link_rates(torch, [0, 1])
    sizes = a.infer_sizes.split(",") if "infer" in parts else []
    infs = {size: inference(torch, tiermem, a, size, replicas=k == 0) for k, size in enumerate(sizes)}

    metrics, checks, raw = summary(torch, ranks, infs, alone, together, a, failed, parts, world)
    progress(f"metrics {metrics}")
    progress(f"checks {checks}")
    write_results("multi_gpu", metrics, checks, raw, tag="" if parts == {"train", "infer"} else a.parts)


if __name__ == "__main__":
    main()
