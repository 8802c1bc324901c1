"""bench/infer_quant.py: offload_infer's contenders past the fp16 link bound, run from it under flags.

    python bench/offload_infer.py --stream-dtypes int8,int4 --moe-cache [the usual flags]

--stream-dtypes  each architecture again with wrap_module(stream_dtype=...) on the same really
                 small GPU and budget (NOTE [quantized streaming] in tiermem/inference/quant.py):
                 prefill and decode timed as offload_infer times tiermem's fp16 run, both set
                 against the fp16 bound of that run (weights - budget - embeddings at the pinned
                 H2D rate: the quantized run must beat the link's bound for fp16 by moving fewer
                 bytes); the logits of a prefill against the fp16 resident logits
                 (tiermem.testing.logits_agreement: cosine per position, its minimum and mean,
                 top-1 agreement), and the bytes a forward moved. The model is adopted from its own
                 fp16 host tensors each time and given them back after (unwrap would give the
                 dequantized weights).
--moe-cache      each mixture of experts again with an expert cache of MOE_CACHE_SHARE of the
                 budget (NOTE [expert cache] in tiermem/inference/experts.py), twice: routed as
                 its random weights route (almost uniformly), and skewed on purpose by
                 tiermem.testing.skew_router (+SKEW_BIAS on the logits of the first 2 x top-k
                 experts of every router), with the share of the picks that went to those
                 experts; decode per token set against the fp16 dense bound, the cache's hit rate,
                 and its tokens against the skewed model's without a cache (the batched_mm
                 experts: equal to the bit).

Each Linear's output is also compared with its own fp16 weight's on the same input
(tiermem.testing.linear_agreement): the error the packing adds, which the logits of random
weights compound through the layers (docs/inference.md, "What it costs in accuracy"); stacked
experts are not Linears and are not in it. A prefill is also set against its floor, the slower of
the model's resident prefill and the plan's bytes at the link rate: where the resident prefill
alone takes more of the fp16 bound than a format's goal, a note says so.

Metrics it adds (offload_infer's JSON keeps its own keys beside them):
  prefill_vs_bound_worst_<fmt>, decode_vs_bound_worst_<fmt>, logits_cosine_min_<fmt>,
  logits_top1_min_<fmt>, linear_cosine_min_<fmt>, prefill_vs_floor_worst_<fmt>,
  prefill_vs_bound.<arch>.<fmt>, decode_vs_bound.<arch>.<fmt>, linear_cosine_min.<arch>.<fmt>,
  prefill_vs_floor.<arch>.<fmt>;
  moe_decode_vs_dense_bound_uniform / _skewed, moe_cache_hit_rate_uniform / _skewed,
  moe_skew_hot_share; checks quant_goal_<fmt>, logits_goal_<fmt>, linear_goal_<fmt>, moe_skewed_goal,
  moe_cache_tokens_equal.
"""
from __future__ import annotations

import gc

import bounds
from _common import progress

# The goals (figure / fp16 bound, worst architecture; logits cosine against fp16).
GOALS = {"int8": (0.55, 0.60, 0.999), "fp8": (0.55, 0.60, 0.999), "int4": (0.32, 0.35, 0.99)}
MOE_CACHE_SHARE = 0.5     # of the budget: the expert cache's bytes
SKEW_BIAS = 2.0           # added to the hot experts' router logits
MOE_GOAL_SKEWED = 0.3     # decode / dense bound with the skewed router


def moe_config(weights_gb: float):
    """A mixture of many small experts with a shared expert (Qwen1.5-MoE-A2.7B's shape: 60
    experts of 1408, top-4, a shared expert of 5632), its layers solved for ``weights_gb`` GB of
    fp16, run by the batched_mm experts (each token's picks summed in their order)."""
    import transformers as tf
    h, heads, kv, vocab, e, inter, shared = 2048, 16, 16, 151936, 60, 1408, 5632
    per = 4 * h * h + e * 3 * h * inter + 3 * h * shared + h * e + h
    fixed = 2 * vocab * h
    layers = max(2, round((weights_gb * 1e9 / 2 - fixed) / per))
    cfg = tf.Qwen2MoeConfig(hidden_size=h, intermediate_size=shared, moe_intermediate_size=inter,
                            shared_expert_intermediate_size=shared, num_hidden_layers=layers, num_attention_heads=heads,
                            num_key_value_heads=kv, vocab_size=vocab, num_experts=e, num_experts_per_tok=4,
                            decoder_sparse_step=1, tie_word_embeddings=False)
    cfg._experts_implementation = "batched_mm"
    return cfg


EXTRA_ARCHS = {"qwen2_moe": moe_config}


def _own_tensors(model) -> list:
    """Every parameter and buffer with its data now: wrap_module rebinds them, and unwrap of a
    quantized module gives back its dequantized weights, so the bench puts these back after."""
    return [(t, t.data) for t in list(model.parameters()) + list(model.buffers())]


def _restore(saved) -> None:
    for t, d in saved:
        t.data = d


def run_quantized(model, ids, args, budget: int, ref_logits, bound_s: float, link: float, measure, watch) -> dict:
    """Each of ``args.stream_dtypes`` on ``model`` (on the host, under offload_infer's
    reservation), timed by offload_infer's ``measure``: {fmt: figures}."""
    import torch

    import tiermem
    from tiermem.testing import linear_agreement, logits_agreement
    out: dict = {}
    # Each Linear's own fp16 weight (host), for linear_agreement (docs/inference.md, "What it costs in accuracy").
    weights = {n: m.weight.data for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for fmt in [f.strip() for f in args.stream_dtypes.split(",") if f.strip()]:
        progress(f"  tiermem, stream_dtype={fmt}")
        saved = _own_tensors(model)
        watch.reset()
        tier = tiermem.Tier(0)
        try:
            hd = tier.wrap_module(model, budget=budget, stream_dtype=fmt)
        except Exception as e:        # reported, and the other formats still run
            progress(f"  {fmt}: refused: {e}")
            out[fmt] = {"error": f"{type(e).__name__}: {e}"}
            tier.close()
            _restore(saved)
            continue
        try:
            pre, dec, tokens = measure(model, ids, args.forwards, args.reps, args.decode_tokens, 2)
            with torch.no_grad(), linear_agreement(model, weights) as lin:
                logits = model(ids, use_cache=False).logits
            hd.drain()
            s = tier.stats()
            agree = logits_agreement(ref_logits, logits)
            out[fmt] = {"prefill_ms": pre * 1e3, "decode_ms_per_token": dec * 1e3, "fp16_bound_ms": bound_s * 1e3,
                        "plan_bytes_ms": hd.moved_bytes / (link * 1e9) * 1e3,
                        "moved_GB_per_forward": hd.moved_bytes / 1e9, "window_GB": hd.plan.window / 1e9,
                        "pinned_groups": len(hd.plan.pinned), "groups": len(hd.plan.sizes),
                        "packed_groups": sum(1 for g in hd._groups.values() if g.packed),
                        "logits": agree, "linear": {k: lin[k] for k in ("cosine_min", "worst", "linears")},
                        "dequant_kernel": _kernel_ran(fmt),
                        "resident_peak_GB": s["resident_bytes.all.peak"] / 1e9,
                        "within": s["resident_bytes.all.peak"] <= hd.budget, "min_free_GB": watch.min_free / 1e9,
                        "tokens": tokens[0].tolist()[-args.decode_tokens:]}
            progress(f"  {fmt}: prefill {pre * 1e3:.1f} ms ({pre / bound_s:.2f} of the fp16 bound), decode "
                     f"{dec * 1e3:.1f} ms/token ({dec / bound_s:.2f}), logits cosine min {agree['cosine_min']:.5f}, "
                     f"top-1 {agree['top1']:.3f}, each Linear's cosine min {lin['cosine_min']:.5f} ({lin['worst']}), "
                     f"{hd.moved_bytes / 1e9:.2f} GB a forward")
        finally:
            hd.unwrap()
            tier.close()
            _restore(saved)
            del hd, tier
            gc.collect()
    return out


def _kernel_ran(fmt: str) -> str:
    """Which dequantization ran (NOTE [one dequantization kernel] in
    tiermem/inference/dequant_kernel.py): "fused", or "torch" where Triton is missing or the
    kernel did not compile for ``fmt``."""
    import torch

    from tiermem.inference import dequant_kernel
    ok = dequant_kernel.available(torch.empty(0, device="cuda"))
    return "fused" if ok and not any(f == fmt for f, _, _ in dequant_kernel.failed()) else "torch"


def _hot_share(model, hot: int):
    """A counter of the picks the experts modules get in decode steps, and of those among the
    first ``hot`` experts; remove() its hooks."""
    counts = {"picks": 0, "hot": 0}
    hooks = []
    for m in model.modules():
        if isinstance(getattr(m, "num_experts", None), int) and hasattr(m, "gate_up_proj"):
            def pre(mod, a):
                if a[0].shape[0] == 1:
                    idx = a[1]
                    counts["picks"] += int(idx.numel())
                    counts["hot"] += int((idx < hot).sum())
            hooks.append(m.register_forward_pre_hook(pre))
    return counts, hooks


def run_moe_cache(model, ids, args, budget: int, bound_s: float, timed_generate) -> dict:
    """The expert cache on ``model`` (a mixture of experts, on the host under the reservation),
    routed as it is and skewed on purpose, timed by offload_infer's ``timed_generate``."""
    import torch

    import tiermem
    from tiermem.testing import skew_router
    top_k = next(m.top_k for m in tiermem.testing.routers(model))
    hot = 2 * top_k
    cache = int(budget * MOE_CACHE_SHARE)
    out: dict = {"cache_GB": cache / 1e9, "hot_experts": hot, "skew_bias": SKEW_BIAS}
    new = args.decode_tokens
    for routing in ("uniform", "skewed"):
        sk = skew_router(model, hot=hot, bias=SKEW_BIAS) if routing == "skewed" else None
        try:
            want = None
            if routing == "skewed":             # the tokens without a cache, same plan, to compare
                saved = _own_tensors(model)
                tier = tiermem.Tier(0)
                hd = tier.wrap_module(model, budget=budget - cache)
                with torch.no_grad():
                    want = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
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
                tn, tokens = timed_generate(model, ids, 1 + new, 2)
                dec = (tn - t1) / new
                st = hd.stats()
                r = {"decode_ms_per_token": dec * 1e3, "dense_bound_ms": bound_s * 1e3,
                     "hit_rate": st["expert_cache.hit_rate"], "slots": st["expert_cache.slots"],
                     "hits": st["expert_cache.hits"], "misses": st["expert_cache.misses"],
                     "prefetched": st["expert_cache.prefetched"], "prefetch_hits": st["expert_cache.prefetch_hits"],
                     "evictions": st["expert_cache.evictions"], "calls": st["expert_cache.calls"],
                     "hot_share": counts["hot"] / max(1, counts["picks"])}
                if want is not None:
                    r["tokens_equal_uncached"] = bool(torch.equal(tokens, want))
                out[routing] = r
                progress(f"  {routing}: decode {dec * 1e3:.1f} ms/token ({dec / bound_s:.3f} of the dense bound), "
                         f"hit rate {r['hit_rate']:.3f}, {r['slots']} slots, hot share {r['hot_share']:.2f}")
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


def add_metrics(archs: dict, metrics: dict, checks: dict, notes: list) -> list[list]:
    """The metrics and checks of the runs above, from offload_infer's raw["archs"]; rows for a table."""
    rows = []
    fmts = sorted({f for r in archs.values() for f in r.get("quant", {})})
    for fmt in fmts:
        pv, dv, cos, top, lin, floor = {}, {}, {}, {}, {}, {}
        for arch, r in archs.items():
            q = r.get("quant", {}).get(fmt)
            if q is None or "error" in q:
                if q is not None:
                    notes.append(f"{arch} with stream_dtype={fmt} did not run: {q['error']}")
                continue
            pv[arch] = bounds.ratio(q["prefill_ms"], q["fp16_bound_ms"])
            dv[arch] = bounds.ratio(q["decode_ms_per_token"], q["fp16_bound_ms"])
            cos[arch], top[arch] = q["logits"]["cosine_min"], q["logits"]["top1"]
            metrics[f"prefill_vs_bound.{arch}.{fmt}"] = pv[arch]
            metrics[f"decode_vs_bound.{arch}.{fmt}"] = dv[arch]
            metrics[f"prefill_vs_plan_bytes.{arch}.{fmt}"] = bounds.ratio(q["prefill_ms"], q["plan_bytes_ms"])
            if "linear" in q:
                lin[arch] = metrics[f"linear_cosine_min.{arch}.{fmt}"] = round(q["linear"]["cosine_min"], 6)
            resident = r.get("resident", {}).get("prefill_ms")
            if resident is not None:
                # No streaming beats the model resident: the floor is the slower of its resident
                # prefill and the plan's bytes at the link rate.
                floor[arch] = metrics[f"prefill_vs_floor.{arch}.{fmt}"] = bounds.ratio(
                    q["prefill_ms"], max(resident, q["plan_bytes_ms"]))
                g = GOALS.get(fmt)
                if g is not None and resident > g[0] * q["fp16_bound_ms"]:
                    notes.append(f"{arch}: resident, its prefill takes {resident / q['fp16_bound_ms']:.2f} of the "
                                 f"fp16 bound, above the {fmt} goal of {g[0]}: no {fmt} stream can meet that goal here")
            note = bounds.below_bound_note(f"prefill_vs_plan_bytes.{arch}.{fmt}",
                                           metrics[f"prefill_vs_plan_bytes.{arch}.{fmt}"])
            if note:
                notes.append(note)
            rows.append([arch, fmt, round(q["prefill_ms"], 1), round(q["fp16_bound_ms"], 1), pv[arch],
                         round(q["decode_ms_per_token"], 2), dv[arch], round(cos[arch], 5), round(top[arch], 3),
                         round(q["moved_GB_per_forward"], 3)])
        if not pv:
            continue
        metrics[f"prefill_vs_bound_worst_{fmt}"] = max(pv.values())
        metrics[f"decode_vs_bound_worst_{fmt}"] = max(dv.values())
        metrics[f"logits_cosine_min_{fmt}"] = round(min(cos.values()), 6)
        metrics[f"logits_top1_min_{fmt}"] = round(min(top.values()), 4)
        if lin:
            metrics[f"linear_cosine_min_{fmt}"] = min(lin.values())
        if floor:
            metrics[f"prefill_vs_floor_worst_{fmt}"] = max(floor.values())
        g = GOALS.get(fmt)
        if g is not None:
            checks[f"quant_goal_{fmt}"] = (metrics[f"prefill_vs_bound_worst_{fmt}"] <= g[0]
                                           and metrics[f"decode_vs_bound_worst_{fmt}"] <= g[1])
            checks[f"logits_goal_{fmt}"] = metrics[f"logits_cosine_min_{fmt}"] >= g[2]
            if lin:
                checks[f"linear_goal_{fmt}"] = metrics[f"linear_cosine_min_{fmt}"] >= g[2]
    for arch, r in archs.items():
        c = r.get("moe_cache")
        if not c:
            continue
        for routing in ("uniform", "skewed"):
            x = c.get(routing)
            if x is None:
                continue
            metrics[f"moe_decode_vs_dense_bound_{routing}"] = bounds.ratio(x["decode_ms_per_token"], x["dense_bound_ms"])
            metrics[f"moe_cache_hit_rate_{routing}"] = round(x["hit_rate"], 4)
        if "skewed" in c:
            metrics["moe_skew_hot_share"] = round(c["skewed"]["hot_share"], 4)
            checks["moe_skewed_goal"] = metrics["moe_decode_vs_dense_bound_skewed"] <= MOE_GOAL_SKEWED
            checks["moe_cache_tokens_equal"] = bool(c["skewed"].get("tokens_equal_uncached", False))
    return rows

