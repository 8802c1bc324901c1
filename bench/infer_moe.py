"""bench/infer_moe.py: offload_infer's mixtures of experts: their shapes, and the expert cache run
from it under a flag.

    python bench/offload_infer.py --moe-cache [--moe-experts eager] [the usual flags]

Architectures it adds to offload_infer's list (each solved for --weights-gb of fp16):
  qwen2_moe   Qwen1.5-MoE-A2.7B's layer: 60 experts of 1408, top-4, a shared expert of 5632
  olmoe       OLMoE-1B-7B's layer: 64 experts of 1024, top-8, no shared expert
Both run the experts implementation transformers picks on the device (grouped_mm on an H200),
or the one --moe-experts names (eager: the loop whose sums keep the experts' order, NOTE [cached
experts sum alike]); each result names the one that ran (``experts_implementation``).

--moe-cache  each mixture of experts again with an expert cache of MOE_CACHE_SHARE of the budget
             (--moe-cache-size half), or of what expert_cache='auto' gives it (--moe-cache-size auto)
             (NOTE [expert cache] in tiermem/inference/experts.py), twice: routed as its random
             weights route (almost uniformly), and skewed on purpose by tiermem.testing.skew_router
             (+SKEW_BIAS on the logits of the first 2 x top-k experts of every router), with the
             share of the picks that went to those experts. Decode per token is timed as
             offload_infer times it (generate(1 + n) - generate(1), over n) and set against the
             fp16 dense bound; the cache's hit rate, how often what it brought ahead was used,
             the experts it moved per token, the experts module's calls per cached call
             (``rounds_per_call``: 1 unless a call had to keep its experts' order in rounds) and
             the copies from slot to slot per token (``slot_moves_per_token``: NOTE [experts in
             number order]) are reported. With the skewed router the tokens
             and every step's logits of a greedy generate of 1 + n tokens are set against the
             same model's without a cache (same plan: the cache's bytes come out of the budget
             there too), the first step that differs named where one does.

Metrics it adds (offload_infer's JSON keeps its own keys beside them): per mixture of experts
moe_decode_vs_dense_bound_<routing>.<arch>, moe_cache_hit_rate_<routing>.<arch>,
moe_moved_experts_per_token_<routing>.<arch>; over them (the worst, the lowest hit rate)
moe_decode_vs_dense_bound_uniform / _skewed, moe_cache_hit_rate_uniform / _skewed,
moe_skew_hot_share; checks moe_uniform_goal, moe_skewed_goal, moe_cache_tokens_equal (every
mixture of experts: tokens and every step's logits equal).
"""
from __future__ import annotations

import gc

import bounds
from _common import profile_to, progress

MOE_CACHE_SHARE = 0.5     # of the budget: the expert cache's bytes
SKEW_BIAS = 2.0           # added to the hot experts' router logits
MOE_GOAL_UNIFORM = 0.6    # decode / dense bound, routed as the weights route
MOE_GOAL_SKEWED = 0.3     # decode / dense bound with the skewed router


def _layers(weights_gb: float, per: int, fixed: int) -> int:
    return max(2, round((weights_gb * 1e9 / 2 - fixed) / per))


def qwen2_moe_config(weights_gb: float):
    """A mixture of many small experts with a shared expert (Qwen1.5-MoE-A2.7B's shape: 60
    experts of 1408, top-4, a shared expert of 5632), its layers solved for ``weights_gb`` GB of
    fp16."""
    import transformers as tf
    h, heads, kv, vocab, e, inter, shared = 2048, 16, 16, 151936, 60, 1408, 5632
    per = 4 * h * h + e * 3 * h * inter + 3 * h * shared + h * e + h
    fixed = 2 * vocab * h
    return tf.Qwen2MoeConfig(hidden_size=h, intermediate_size=shared, moe_intermediate_size=inter,
                             shared_expert_intermediate_size=shared, num_hidden_layers=_layers(weights_gb, per, fixed),
                             num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab, num_experts=e,
                             num_experts_per_tok=4, decoder_sparse_step=1, tie_word_embeddings=False)


def olmoe_config(weights_gb: float):
    """OLMoE-1B-7B's layer (64 experts of 1024, top-8, no shared expert, q/k norms), its layers
    solved for ``weights_gb`` GB of fp16."""
    import transformers as tf
    h, heads, vocab, e, inter = 2048, 16, 50304, 64, 1024
    per = 4 * h * h + e * 3 * h * inter + h * e + 4 * h
    fixed = 2 * vocab * h
    return tf.OlmoeConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=_layers(weights_gb, per, fixed),
                          num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab, num_experts=e,
                          num_experts_per_tok=8, tie_word_embeddings=False)


MOE_ARCHS = {"qwen2_moe": qwen2_moe_config, "olmoe": olmoe_config}


def _own_tensors(model) -> list:
    """Every parameter and buffer with its data now: wrap_module rebinds them; put back after."""
    return [(t, t.data) for t in list(model.parameters()) + list(model.buffers())]


def _restore(saved) -> None:
    for t, d in saved:
        t.data = d


def _hot_share(model, hot: int):
    """A counter of the picks the experts modules get in decode steps, and of those among the
    first ``hot`` experts; remove() its hooks."""
    counts = {"picks": 0, "hot": 0}      # "hot" a device tensor once counted: read it after the timing
    hooks = []
    for m in model.modules():
        if isinstance(getattr(m, "num_experts", None), int) and hasattr(m, "gate_up_proj"):
            def pre(mod, a):
                if a[0].shape[0] == 1:
                    idx = a[1]
                    counts["picks"] += idx.numel()
                    counts["hot"] = counts["hot"] + (idx < hot).sum()   # no host sync inside the timed decode
            hooks.append(m.register_forward_pre_hook(pre))
    return counts, hooks


def _greedy(model, ids, new: int):
    """(tokens, per-step logits) of a greedy generate of ``new`` tokens."""
    import torch
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences, [x.detach().clone() for x in out.logits]


def same_decode(got, want) -> dict:
    """Tokens and per-step logits of two greedy decodes ((tokens, logits) each), compared to the
    bit: {"tokens_equal", "logits_equal", "first_step_differing" (None where none), "steps"}."""
    import torch
    (gt, gl), (wt, wl) = got, want
    tokens = gt.shape == wt.shape and bool(torch.equal(gt, wt))
    differ = [i for i, (a, b) in enumerate(zip(gl, wl)) if a.shape != b.shape or not torch.equal(a, b)]
    if len(gl) != len(wl):
        differ.append(min(len(gl), len(wl)))
    return {"tokens_equal": tokens, "logits_equal": not differ, "first_step_differing": differ[0] if differ else None,
            "steps": max(len(gl), len(wl))}


def run_moe_cache(model, ids, args, budget: int, bound_s: float, timed_generate) -> dict:
    """The expert cache on ``model`` (a mixture of experts, on the host under the reservation),
    routed as it is and skewed on purpose, timed by offload_infer's ``timed_generate``."""
    import tiermem
    from tiermem.testing import skew_router
    top_k = next(m.top_k for m in tiermem.testing.routers(model))
    hot = 2 * top_k
    size = getattr(args, "moe_cache_size", "half")
    if size == "auto":     # what the library gives it (NOTE [expert cache budget])
        saved = _own_tensors(model)
        tier = tiermem.Tier(0)
        try:
            hd = tier.wrap_module(model, budget=budget, expert_cache="auto")
            cache = int(hd.stats()["expert_cache.bytes"])
            hd.unwrap()
        finally:
            tier.close()
            _restore(saved)
    else:
        cache = int(budget * MOE_CACHE_SHARE)
    out: dict = {"cache_GB": cache / 1e9, "cache_size": size, "hot_experts": hot, "skew_bias": SKEW_BIAS,
                 "experts_implementation": getattr(model.config, "_experts_implementation", None)}
    if not cache:
        progress(f"  expert_cache='auto' is 0 at a budget of {budget / 1e9:.2f} GB: no cache run")
        return out
    new = args.decode_tokens
    for routing in ("uniform", "skewed"):
        sk = skew_router(model, hot=hot, bias=SKEW_BIAS) if routing == "skewed" else None
        try:
            want = None
            if routing == "skewed":      # the same decode without a cache, same plan, to compare
                saved = _own_tensors(model)
                tier = tiermem.Tier(0)
                hd = tier.wrap_module(model, budget=budget - cache)
                try:
                    want = _greedy(model, ids, 1 + new)
                finally:
                    hd.unwrap()
                    tier.close()
                    _restore(saved)
            progress(f"  expert cache of {cache / 1e9:.2f} GB, {routing} routing")
            saved = _own_tensors(model)
            tier = tiermem.Tier(0)
            hd = tier.wrap_module(model, budget=budget, expert_cache=cache)
            counts, hooks = _hot_share(model, hot)
            try:
                t1, _ = timed_generate(model, ids, 1, 2)
                before = hd.stats()
                tn, _ = timed_generate(model, ids, 1 + new, 2)
                st = hd.stats()
                dec = (tn - t1) / new
                d = {k: st[f"expert_cache.{k}"] - before[f"expert_cache.{k}"] for k in
                     ("hits", "misses", "prefetched", "prefetch_hits", "moved_bytes", "calls", "rounds", "slot_moves")}
                tokens = 3 * new      # decode steps of the timed generate(1 + new): its warm-up and 2 runs
                r = {"decode_ms_per_token": dec * 1e3, "dense_bound_ms": bound_s * 1e3,
                     "hit_rate": st["expert_cache.hit_rate"], "slots": st["expert_cache.slots"],
                     "hits": st["expert_cache.hits"], "misses": st["expert_cache.misses"],
                     "prefetched": st["expert_cache.prefetched"], "prefetch_hits": st["expert_cache.prefetch_hits"],
                     "predicted": st["expert_cache.predicted"], "evictions": st["expert_cache.evictions"],
                     "calls": st["expert_cache.calls"], "rounds": st["expert_cache.rounds"],
                     "prefetch_used": d["prefetch_hits"] / max(1, d["prefetched"]),
                     "misses_per_token": d["misses"] / tokens,
                     "moved_experts_per_token": (d["misses"] + d["prefetched"]) / tokens,
                     "moved_GB_per_token": d["moved_bytes"] / tokens / 1e9,
                     "rounds_per_call": d["rounds"] / max(1, d["calls"]),
                     "slot_moves_per_token": d["slot_moves"] / tokens,
                     "hot_share": int(counts["hot"]) / max(1, counts["picks"])}
                if getattr(args, "moe_profile", None):
                    profile_to(f"{args.moe_profile}-{routing}.txt", lambda: _greedy(model, ids, 8), "8 tokens")
                if want is not None:
                    r.update(same_decode(_greedy(model, ids, 1 + new), want))
                    r["tokens_equal_uncached"] = r["tokens_equal"] and r["logits_equal"]
                out[routing] = r
                progress(f"  {routing}: decode {dec * 1e3:.1f} ms/token ({dec / bound_s:.3f} of the dense bound), "
                         f"hit rate {r['hit_rate']:.3f}, {r['slots']} slots, {r['moved_experts_per_token']:.1f} experts "
                         f"moved a token, {r['rounds_per_call']:.2f} rounds a call, {r['slot_moves_per_token']:.1f} "
                         f"slot moves a token, hot share {r['hot_share']:.2f}"
                         + (f", tokens equal {r['tokens_equal']}, logits equal {r['logits_equal']}"
                            if want is not None else ""))
            finally:
                for h in hooks:
                    h.remove()
                hd.unwrap()
                tier.close()
                _restore(saved)
                gc.collect()
        finally:
            if sk is not None:
                sk.remove()
    return out


def add_metrics(archs: dict, metrics: dict, checks: dict) -> list[list]:
    """The metrics and checks of the runs above, from offload_infer's raw["archs"]; rows for a table."""
    rows = []
    worst: dict = {}
    equal = []
    for arch, r in archs.items():
        c = r.get("moe_cache")
        if not c:
            continue
        for routing in ("uniform", "skewed"):
            x = c.get(routing)
            if x is None:
                continue
            v = bounds.ratio(x["decode_ms_per_token"], x["dense_bound_ms"])
            metrics[f"moe_decode_vs_dense_bound_{routing}.{arch}"] = v
            metrics[f"moe_cache_hit_rate_{routing}.{arch}"] = round(x["hit_rate"], 4)
            if "moved_experts_per_token" in x:
                metrics[f"moe_moved_experts_per_token_{routing}.{arch}"] = round(x["moved_experts_per_token"], 2)
            w = worst.setdefault(routing, [v, x["hit_rate"], arch])
            if v >= w[0]:
                worst[routing] = [v, min(w[1], x["hit_rate"]), arch]
            else:
                w[1] = min(w[1], x["hit_rate"])
            rows.append([arch, routing, round(x["decode_ms_per_token"], 2), round(x["dense_bound_ms"], 1), v,
                         round(x["hit_rate"], 3), round(x.get("moved_experts_per_token", 0), 1), x["slots"],
                         x.get("tokens_equal_uncached", "-")])
        if "skewed" in c:
            equal.append(bool(c["skewed"].get("tokens_equal_uncached", False)))
            metrics["moe_skew_hot_share"] = min(metrics.get("moe_skew_hot_share", 1.0), round(c["skewed"]["hot_share"], 4))
    for routing, (v, hit, arch) in worst.items():
        metrics[f"moe_decode_vs_dense_bound_{routing}"] = v
        metrics[f"moe_cache_hit_rate_{routing}"] = round(hit, 4)
        metrics[f"moe_decode_worst_arch_{routing}"] = arch
    if "uniform" in worst:
        checks["moe_uniform_goal"] = metrics["moe_decode_vs_dense_bound_uniform"] <= MOE_GOAL_UNIFORM
    if "skewed" in worst:
        checks["moe_skewed_goal"] = metrics["moe_decode_vs_dense_bound_skewed"] <= MOE_GOAL_SKEWED
    if equal:
        checks["moe_cache_tokens_equal"] = all(equal)
    return rows
