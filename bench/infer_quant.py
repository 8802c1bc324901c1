"""bench/infer_quant.py: offload_infer's quantized contenders, past the fp16 link bound, run from it under a flag.

    python bench/offload_infer.py --stream-dtypes int8,int4 [the usual flags]

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
The expert cache (--moe-cache) is bench/infer_moe.py's.

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
  prefill_vs_floor.<arch>.<fmt>; checks quant_goal_<fmt>, logits_goal_<fmt>, linear_goal_<fmt>.
With graphed prefills (offload_infer's default; --no-graphed skips them):
  prefill_vs_bound_graphed.<arch>.<fmt>, prefill_vs_bound_worst_graphed_<fmt>, and the decode's
  over a StaticCache, decode_vs_bound_graphed.<arch>.<fmt>, decode_vs_bound_worst_graphed_<fmt>; checks
  quant_goal_graphed_<fmt> (the graphed prefill and the eager decode against the goals),
  prefill_vs_floor_graphed.<arch>.<fmt>, prefill_vs_floor_worst_graphed_<fmt> (against the slower
  of the resident prefill captured by torch alone and the plan's bytes),
  prefill_vs_bound_worst_captured_<fmt>, decode_vs_bound_worst_captured_<fmt> (over the
  architectures whose prefill and decode were both captured; a note names the others and why),
  graphed_logits_agree_eager (GRAPHED_COSINE), graphed_logits_equal_eager (bitwise, reported),
  graphed_captured_all, graphed_decode_captured_all.
"""
from __future__ import annotations

import gc

import bounds
from _common import profile_to, progress, slots

# The goals (figure / fp16 bound, worst architecture; logits cosine against fp16).
GOALS = {"int8": (0.55, 0.60, 0.999), "fp8": (0.55, 0.60, 0.999), "int4": (0.32, 0.35, 0.99)}


def _own_tensors(model) -> list:
    """Every parameter and buffer with its data now: wrap_module rebinds them, and unwrap of a
    quantized module gives back its dequantized weights, so the bench puts these back after."""
    return [(t, t.data) for t in list(model.parameters()) + list(model.buffers())]


def _restore(saved) -> None:
    for t, d in saved:
        t.data = d


def run_quantized(model, ids, args, budget: int, ref_logits, bound_s: float, link: float, measure, watch,
                  measure_graphed=None) -> dict:
    """Each of ``args.stream_dtypes`` on ``model`` (on the host, under offload_infer's
    reservation), timed by offload_infer's ``measure`` (and its prefill as a graphed forward by
    ``measure_graphed``, where given): {fmt: figures}."""
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
            hd = tier.wrap_module(model, budget=budget, stream_dtype=fmt, **slots(args))
        except Exception as e:        # reported, and the other formats still run
            progress(f"  {fmt}: refused: {e}")
            out[fmt] = {"error": f"{type(e).__name__}: {e}"}
            tier.close()
            _restore(saved)
            continue
        try:
            pre, dec, tokens = measure(model, ids, args.forwards, args.reps, args.decode_tokens, 2)
            if getattr(args, "quant_profile", None):
                with torch.no_grad():
                    profile_to(f"{args.quant_profile}-{model.config.model_type}-{fmt}.txt",
                               lambda: model(ids, use_cache=False), "a prefill")
            with torch.no_grad(), linear_agreement(model, weights) as lin:
                logits = model(ids, use_cache=False).logits
            graphed = None if measure_graphed is None else measure_graphed(model, hd, ids, args.forwards, args.reps,
                                                                           logits, args.decode_tokens)
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
                        "tokens": tokens[0].tolist()[-args.decode_tokens:], "graphed": graphed}
            progress(f"  {fmt}: prefill {pre * 1e3:.1f} ms ({pre / bound_s:.2f} of the fp16 bound), decode "
                     f"{dec * 1e3:.1f} ms/token ({dec / bound_s:.2f}), logits cosine min {agree['cosine_min']:.5f}, "
                     f"top-1 {agree['top1']:.3f}, each Linear's cosine min {lin['cosine_min']:.5f} ({lin['worst']}), "
                     f"{hd.moved_bytes / 1e9:.2f} GB a forward")
            if graphed is not None:
                progress(f"  {fmt}: graphed prefill {graphed['prefill_ms']:.1f} ms "
                         f"({graphed['prefill_ms'] / 1e3 / bound_s:.2f} of the fp16 bound), logits equal eager "
                         f"{graphed['logits_equal_eager']}{', eager: ' + graphed['off'] if graphed['off'] else ''}; "
                         f"decode over a static cache {graphed['decode']}")
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


def add_metrics(archs: dict, metrics: dict, checks: dict, notes: list) -> list[list]:
    """The metrics and checks of the runs above, from offload_infer's raw["archs"]; rows for a table."""
    rows = []
    fmts = sorted({f for r in archs.values() for f in r.get("quant", {})})
    for fmt in fmts:
        pv, dv, cos, top, lin, floor, gv, gd, caught = {}, {}, {}, {}, {}, {}, {}, {}, set()
        gfloor: dict = {}
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
                rg = (r.get("resident", {}).get("graphed") or {}).get("prefill_ms")
                if g is not None and resident > g[0] * q["fp16_bound_ms"]:
                    graphed_too = rg is not None and rg > g[0] * q["fp16_bound_ms"]
                    notes.append(f"{arch}: resident, its prefill takes {resident / q['fp16_bound_ms']:.2f} of the "
                                 f"fp16 bound, above the {fmt} goal of {g[0]}: no eager {fmt} stream can meet that "
                                 "goal here" + (f"; graphed, {rg / q['fp16_bound_ms']:.2f}: no graphed one either"
                                                if graphed_too else ""))
            gr = q.get("graphed")
            if gr:                    # NOTE [graphed forwards]: the prefill as one launch
                gv[arch] = metrics[f"prefill_vs_bound_graphed.{arch}.{fmt}"] = bounds.ratio(gr["prefill_ms"],
                                                                                          q["fp16_bound_ms"])
                rg = r.get("resident", {}).get("graphed") or {}
                if "prefill_ms" in rg:    # its floor: the resident prefill graphed, or the plan's bytes
                    gfloor[arch] = metrics[f"prefill_vs_floor_graphed.{arch}.{fmt}"] = bounds.ratio(
                        gr["prefill_ms"], max(rg["prefill_ms"], q["plan_bytes_ms"]))
                graphed_checks(checks, gr)
                d = graphed_decode_ms(gr)
                if d is not None:
                    gd[arch] = metrics[f"decode_vs_bound_graphed.{arch}.{fmt}"] = bounds.ratio(d, q["fp16_bound_ms"])
                if captured(gr, notes, f"{arch}, {fmt}"):
                    caught.add(arch)
            note = bounds.below_bound_note(f"prefill_vs_plan_bytes.{arch}.{fmt}",
                                           metrics[f"prefill_vs_plan_bytes.{arch}.{fmt}"])
            if note:
                notes.append(note)
            rows.append([arch, fmt, round(q["prefill_ms"], 1), round(q["fp16_bound_ms"], 1), pv[arch],
                         round(q["decode_ms_per_token"], 2), dv[arch], round(cos[arch], 5), round(top[arch], 3),
                         round(q["moved_GB_per_forward"], 3), round(gr["prefill_ms"], 1) if gr else "-",
                         gv.get(arch, "-"), gd.get(arch, "-")])
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
        if gv:
            metrics[f"prefill_vs_bound_worst_graphed_{fmt}"] = max(gv.values())
        if gd:
            metrics[f"decode_vs_bound_worst_graphed_{fmt}"] = max(gd.values())
        if gfloor:
            metrics[f"prefill_vs_floor_worst_graphed_{fmt}"] = max(gfloor.values())
        if caught:            # over the architectures whose forwards were captured, prefill and decode
            metrics[f"prefill_vs_bound_worst_captured_{fmt}"] = max(gv[a] for a in caught)
            metrics[f"decode_vs_bound_worst_captured_{fmt}"] = max(gd.get(a, 0.0) for a in caught)
        g = GOALS.get(fmt)
        if g is not None:
            checks[f"quant_goal_{fmt}"] = (metrics[f"prefill_vs_bound_worst_{fmt}"] <= g[0]
                                           and metrics[f"decode_vs_bound_worst_{fmt}"] <= g[1])
            checks[f"logits_goal_{fmt}"] = metrics[f"logits_cosine_min_{fmt}"] >= g[2]
            if lin:
                checks[f"linear_goal_{fmt}"] = metrics[f"linear_cosine_min_{fmt}"] >= g[2]
            if gv:            # the prefill graphed; the decode graphed where it ran, else as generate() runs it
                dec = metrics.get(f"decode_vs_bound_worst_graphed_{fmt}", metrics[f"decode_vs_bound_worst_{fmt}"])
                checks[f"quant_goal_graphed_{fmt}"] = (metrics[f"prefill_vs_bound_worst_graphed_{fmt}"] <= g[0]
                                                       and dec <= g[1])
    return rows


# A graphed prefill's logits against the eager forward's: torch's own capture of a resident
# Llama of this size differs from its eager forward at rounding level, with no tiermem in it
# (bench/probes/probe_graphed_gemm.py), so bitwise is reported, and agreement is checked.
GRAPHED_COSINE = 0.9999


def graphed_checks(checks: dict, gr: dict) -> None:
    """A graphed prefill's checks, over every run that had one: its logits agree with the eager
    forward's (cosine >= GRAPHED_COSINE at every position; top-1 is reported, not checked: random
    weights' logits have near ties that rounding flips), and a graph was captured (the forward
    did not stay eager)."""
    agree = gr["logits_equal_eager"] or gr.get("logits_cosine_min_eager", 0.0) >= GRAPHED_COSINE
    checks["graphed_logits_agree_eager"] = checks.get("graphed_logits_agree_eager", True) and agree
    checks["graphed_logits_equal_eager"] = checks.get("graphed_logits_equal_eager", True) and gr["logits_equal_eager"]
    checks["graphed_captured_all"] = checks.get("graphed_captured_all", True) and gr["captures"] > 0 and not gr["off"]
    d = gr.get("decode")
    if d is not None:
        ok = "error" not in d and d["captures"] > 0 and not d["off"]
        checks["graphed_decode_captured_all"] = checks.get("graphed_decode_captured_all", True) and ok


def captured(gr: dict, notes: list, what: str) -> bool:
    """Whether both the prefill and the decode of ``gr`` ran as graphs; where one stayed eager,
    a note says why."""
    ok = True
    for part, g in (("prefill", gr), ("decode", gr.get("decode") or {})):
        why = g.get("error") or g.get("off")
        if why or not g.get("captures"):
            notes.append(f"{what}: the graphed {part} stayed eager: {why or 'not run'}")
            ok = False
    return ok


def graphed_decode_ms(gr: dict) -> float | None:
    """The graphed decode's ms per token (a StaticCache loop: bench/offload_infer.py's
    measure_graphed_decode), None where it did not run."""
    d = gr.get("decode")
    return None if d is None or "error" in d else d["graphed_ms"]

