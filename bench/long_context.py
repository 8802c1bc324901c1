"""bench/long_context.py: decode at 128k and 512k tokens of context with the KV cache in tiers (issue 58).

A Llama-3-8B-shaped transformers model (32 layers, hidden 4096, 32 heads, 8 KV heads of 128,
intermediate 14336, vocab 128256; 16 GB of random fp16 weights built on the GPU) decodes greedily
at growing contexts, each contender in turn, in one process:
  resident      transformers' DynamicCache on the device (the reference tokens and logits; where
                the device holds the cache: 16.8 GB at 128k, 67 GB at 512k on an H200)
  tiermem       tiermem.kv_cache(model, max_tokens, kv_budget="2GB"): the layers that do not fit
                the budget stream from pinned host memory one layer ahead (NOTE [kv cache in tiers])
  hf_offloaded  transformers' DynamicCache(offloading=True), what cache_implementation="offloaded" makes
  tiermem_fp8   the same as tiermem with fp8=True (NOTE [fp8 in transit]): its logits against the
                resident cache's (cosine, top-1 agreement) and its time
  tiermem_512k  a cache for 512k tokens, whose budget is the least that holds its ring: attention
                needs a whole layer on the device, and a layer at 512k is 2 GiB
After the resident run, one cudaMalloc reservation takes all of the card but the cache's budget and
--slack-gb for activations (docs/facts.md, "a really small GPU"); the weights stay resident (16 GB)
unless --stream-weights, which adopts them with wrap_module in the same budget as the cache.

The contexts are not prefilled through attention (a real 128k prefill would take most of the run):
a real prompt of --prompt tokens is prefilled, then each stage fills the cache up to its context
with random keys and values of the right shape, written straight into the cache through
Cache.update, the same bytes for every contender (seeded per stage and layer); then --tokens
decode steps are timed (after --warmup), fed the resident run's tokens (teacher forcing), so that
every contender's argmax and logits compare step for step; the timed steps run back to back between
two CUDA events. The bound of a step (bench/bounds.py) is the cache bytes the budget cannot hold at
that context, plus with --stream-weights the weights the weights' budget cannot hold, over the
pinned H2D rate measured in the same run; the bytes tiermem's plan moves (every streamed layer
whole: its ring holds no data between steps) are beside it as ..._vs_plan_bytes. 512k runs where
the host's available memory holds its home (64 GiB), else it is skipped with the reason.

    python bench/long_context.py [--contexts 16384,32768,65536,131072] [--big 524288] [--kv-budget 2GB]
                                 [--tokens 4] [--warmup 1] [--prompt 512] [--slack-gb 3] [--stream-weights]
                                 [--layers 32] [--no-hf] [--no-fp8]
Writes bench/results/long_context-<device>-<date>.json and a plot of per-token time against context.
"""
from __future__ import annotations

import argparse
import gc
import threading
import time

import bounds
from _common import cuda_times, embedding_bytes, nvml_handle, gbps, median, plot_path, progress, table, write_results

GiB, MiB = 1 << 30, 1 << 20


def build(layers: int):
    """The Llama-3-8B-shaped model, fp16 random weights made on the GPU (a CPU init of 8B
    parameters takes minutes: docs/facts.md)."""
    import torch
    import transformers as tf
    cfg = tf.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=1 << 20,
                         rope_theta=500000.0, tie_word_embeddings=False)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device("cuda"):
            torch.manual_seed(0)
            model = tf.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval(), cfg


def cache_kw() -> str:
    import transformers
    return "cache" if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 24) else "past_key_values"


def empty_host_cache() -> None:
    """Give torch's cached pinned blocks back to the host (transformers' offloaded cache leaves
    tens of GB there)."""
    import torch
    for name in ("_accelerator_emptyHostCache", "_host_emptyCache", "_cuda_emptyHostCache"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            fn()
            return


def host_available() -> int:
    from tiermem.base.hostpages import available_bytes
    return available_bytes() or 0


class FreeWatch:
    """The smallest free device memory the driver reports, sampled every 2 ms on a thread while
    armed (NVML where present, so the samples put no work on the CUDA context)."""

    def __init__(self):
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nvml, self.h = pynvml, nvml_handle()
        except Exception:   # no NVML: the CUDA runtime's figure
            self.nvml = None
        self.low = None
        self._armed = threading.Event()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def free(self) -> int:
        if self.nvml is None:
            import torch
            return int(torch.cuda.mem_get_info()[0])
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.h).free)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            if self._armed.is_set():
                f = self.free()
                self.low = f if self.low is None else min(self.low, f)

    def arm(self) -> int:
        self.low = self.free()
        self._armed.set()
        return self.low

    def disarm(self) -> int:
        self._armed.clear()
        return self.low

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def take_device(keep: int) -> list:
    """All but ``keep`` bytes of the card in plain cudaMalloc reservations (docs/facts.md)."""
    import torch
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    blobs = []
    for _ in range(4):
        free, _ = torch.cuda.mem_get_info()
        if free <= keep + 64 * MiB:
            break
        blobs.append(torch.empty(free - keep, dtype=torch.uint8, device="cuda"))
    return blobs


def filler(stage: int, layer: int, n: int, cfg):
    """The random keys and values that fill ``n`` tokens of ``layer`` at ``stage``: the same bytes
    for every contender."""
    import torch
    g = torch.Generator("cuda").manual_seed(1000 * stage + layer + 1)
    shape = (1, cfg.num_key_value_heads, n, cfg.head_dim)
    return (torch.randn(shape, generator=g, device="cuda", dtype=torch.float16),
            torch.randn(shape, generator=g, device="cuda", dtype=torch.float16))


def run_schedule(model, cfg, cache, prompt, stages, args, teacher=None, keep_logits=False, on_stage=None):
    """Prefill ``prompt``, then for each stage fill the cache to ``stage - 1`` tokens and decode
    ``warmup`` steps, then ``tokens`` steps back to back between two CUDA events with no
    synchronization inside (the copies a step starts for the next are in the span), each fed
    ``teacher``'s token (else its own argmax, left on the device). Returns every step's argmax,
    their logits when asked (fp32, on the host), the tokens fed, and per stage the seconds a step."""
    import torch
    kw = {cache_kw(): cache}
    argmax, logits, fed, times = [], [], [], {}
    step = 0

    def one(nxt):
        nonlocal step
        tok = teacher[step] if teacher is not None else nxt
        out = model(input_ids=tok, **kw).logits[:, -1]
        nxt = out.argmax(-1, keepdim=True)
        fed.append(tok)
        argmax.append(nxt)
        if keep_logits:
            logits.append(out.float())
        step += 1
        return nxt

    with torch.no_grad():
        nxt = model(input_ids=prompt, **kw).logits[:, -1].argmax(-1, keepdim=True)
        for si, stage in enumerate(stages):
            n = stage - 1 - cache.get_seq_length()
            if n > 0:
                for layer in range(cfg.num_hidden_layers):
                    k, v = filler(si, layer, n, cfg)
                    cache.update(k, v, layer)
                    del k, v
            torch.cuda.synchronize()
            if on_stage is not None:
                on_stage(stage, True)
            for _ in range(args.warmup):
                nxt = one(nxt)
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(args.tokens):
                nxt = one(nxt)
            b.record()
            b.synchronize()
            times[stage] = a.elapsed_time(b) / 1e3 / args.tokens
            if on_stage is not None:
                on_stage(stage, False)
            logits[:] = [x.cpu() if x.is_cuda else x for x in logits]
            progress(f"    context {stage:>7,}: {times[stage] * 1e3:8.1f} ms/token")
    return [int(x) for x in argmax], logits, fed, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="16384,32768,65536,131072")
    ap.add_argument("--big", type=int, default=524288, help="the long stage (0: skip it)")
    ap.add_argument("--kv-budget", default="2GB")
    ap.add_argument("--tokens", type=int, default=4, help="timed decode steps a stage")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512, help="real tokens prefilled through the model")
    ap.add_argument("--slack-gb", type=float, default=3.0, help="free device memory left beside the budget")
    ap.add_argument("--host-margin-gb", type=float, default=8.0, help="host memory left free beside a home")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--stream-weights", action="store_true", help="adopt the weights with wrap_module, half of them streamed")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-fp8", action="store_true")
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import DynamicCache

    import tiermem
    from tiermem.base.limits import parse_bytes
    from tiermem.inference.kvplan import pinned_map_bytes
    from tiermem.planning import kv_shape, plan_kv

    stages = [int(x) for x in args.contexts.split(",") if x.strip()]
    big = args.big
    top = stages[-1]
    raw: dict = {"transformers_version": transformers.__version__, "torch_version": torch.__version__,
                 "stages": stages, "big": big, "tokens": args.tokens, "warmup": args.warmup, "prompt": args.prompt,
                 "kv_budget": args.kv_budget, "layers": args.layers,
                 "weights": "streamed (wrap_module, half resident)" if args.stream_weights else "resident",
                 "fill": (f"a real prompt of {args.prompt} tokens is prefilled through the model; each stage's context "
                          "is filled with random fp16 keys and values (seeded per stage and layer, the same for every "
                          "contender) written straight into the cache through Cache.update, not by a prefill through "
                          "attention; decode steps are fed the resident run's tokens (teacher forcing)"),
                 "contenders": {}, "skipped": {}}
    metrics: dict = {}
    checks: dict = {}

    d = torch.randint(0, 256, (GiB,), dtype=torch.uint8, device="cuda")
    h = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    h.copy_(d)
    link = gbps(GiB, median(cuda_times(lambda: d.copy_(h, non_blocking=True), 7)))
    metrics["pinned_h2d_GBps"] = link
    del d, h
    progress(f"pinned H2D {link} GB/s; building the model")
    model, cfg = build(args.layers)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    raw["weight_bytes"] = weights
    shape = kv_shape(cfg, torch.float16)
    raw["kv_bytes_per_token"] = shape.token_bytes
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(7))
    watch = FreeWatch()
    total = torch.cuda.get_device_properties(0).total_memory
    kv_budget = parse_bytes(args.kv_budget, total=total, what="kv_budget")
    all_stages = stages + ([big] if big else [])

    # -- resident: the reference ----------------------------------------------------------------
    free = torch.cuda.mem_get_info()[0]
    fits_big = bool(big) and shape.token_bytes * (big + 64) < free - 8 * GiB
    ref_stages = all_stages if fits_big else stages
    if big and not fits_big:
        raw["skipped"]["resident_big"] = (f"the device has {free / 1e9:.1f} GB free; the resident cache at {big:,} tokens "
                                          f"needs {shape.token_bytes * big / 1e9:.1f} GB: tokens at {big:,} compare to "
                                          "nothing")
    progress(f"resident DynamicCache over {ref_stages}")
    dc = DynamicCache(config=cfg)
    ref_argmax, ref_logits, teacher, ref_times = run_schedule(model, cfg, dc, prompt, ref_stages, args, keep_logits=True)
    raw["contenders"]["resident"] = {"ms_per_token": {s: t * 1e3 for s, t in ref_times.items()}}
    del dc
    gc.collect()
    torch.cuda.empty_cache()

    handle = None
    t = tiermem.Tier(0)
    if args.stream_weights:
        handle = t.wrap_module(model, budget=weights // 2 + kv_budget, kv_budget=kv_budget)
        progress(handle.plan.table(limit=4))
    streamed_weights = handle.plan.moved_bytes if handle is not None else 0
    weights_bound = (bounds.forward_bytes(weights, handle.plan.budget, embedding_bytes(model))
                     if handle is not None else 0)
    raw["weight_bytes_streamed"] = streamed_weights
    raw["weight_bytes_bound"] = weights_bound

    def make_cache(max_tokens: int, budget: int, fp8: bool = False):
        if handle is not None:
            return handle.kv_cache(max_tokens, fp8=fp8)
        return t.kv_cache(model, max_tokens, budget, fp8=fp8)

    def tiermem_run(name: str, max_tokens: int, budget: int, run_stages: list, fp8: bool = False) -> dict:
        blob = take_device(budget + int(args.slack_gb * GiB))
        try:
            torch.cuda.synchronize()
            free0, torch0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
            cache = make_cache(max_tokens, budget, fp8)
            progress(f"{name}: {cache.plan.table()}")
            lows: dict = {}
            over: dict = {}

            def on_stage(stage, start):
                # The driver's free memory while it decodes: it may drop by the cache's budget and
                # what torch's own allocator holds (activations, the fill's buffers it keeps), no more
                if start:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    watch.arm()
                else:
                    lows[stage] = low = watch.disarm()
                    torch_grew = max(0, torch.cuda.max_memory_reserved() - torch0)
                    over[stage] = (free0 - low) - (budget + torch_grew + 64 * MiB)
            argmax, logits, _, times = run_schedule(model, cfg, cache, prompt, run_stages, args, teacher=teacher,
                                                    keep_logits=fp8, on_stage=on_stage)
            # the bound: what the budget cannot hold, whatever a design keeps (bench/bounds.py);
            # beside it, the bytes this plan moves (its ring holds no data between steps)
            bound = {s: bounds.kv_decode_seconds(shape.token_bytes * s, budget, weights_bound, link) for s in run_stages}
            plan_s = {s: (cache.plan.moved_bytes(s) + streamed_weights) / (link * 1e9) for s in run_stages}
            n = min(len(argmax), len(ref_argmax))
            out = {"ms_per_token": {s: x * 1e3 for s, x in times.items()},
                   "bound_ms": {s: b * 1e3 for s, b in bound.items()},
                   "plan_bytes_ms": {s: b * 1e3 for s, b in plan_s.items()},
                   "vs_bound": {s: bounds.ratio(times[s], bound[s]) for s in run_stages},
                   "vs_plan_bytes": {s: bounds.ratio(times[s], plan_s[s]) for s in run_stages},
                   "plan": cache.plan.table(), "kv_budget": budget, "device_bytes": cache.device_bytes,
                   "home_bytes": cache.home_bytes, "stats": cache.stats(),
                   "free_before_GB": free0 / 1e9, "min_free_GB": min(lows.values()) / 1e9,
                   "over_budget_bytes": over,
                   "within_budget": bool(cache.device_bytes <= budget and max(over.values()) <= 0),
                   "tokens_equal": argmax[:n] == ref_argmax[:n], "steps_compared": n, "steps": len(argmax),
                   "argmax": argmax}
            if fp8:
                cos = [float(torch.nn.functional.cosine_similarity(logits[i], ref_logits[i], dim=-1)) for i in range(n)]
                out["logits_cosine_min"] = min(cos)
                out["logits_cosine_mean"] = sum(cos) / n
                out["top1_agree"] = sum(a == b for a, b in zip(argmax[:n], ref_argmax[:n])) / n
            cache.close()
            return out
        finally:
            del blob
            gc.collect()
            torch.cuda.empty_cache()

    # -- tiermem at 128k --------------------------------------------------------------------------
    progress(f"tiermem, kv_budget {kv_budget:,} bytes, over {stages}")
    tm = tiermem_run("tiermem", top + 64, kv_budget, stages)
    raw["contenders"]["tiermem"] = tm

    # -- fp8 in transit -------------------------------------------------------------------------
    if not args.no_fp8:
        progress(f"tiermem with fp8 in transit over {stages}")
        raw["contenders"]["tiermem_fp8"] = fp8 = tiermem_run("tiermem_fp8", top + 64, kv_budget, stages, fp8=True)
        metrics["fp8_logits_cosine_min"] = round(fp8["logits_cosine_min"], 5)
        metrics["fp8_top1_agree"] = round(fp8["top1_agree"], 4)
        metrics["fp8_decode_vs_bound_128k"] = fp8["vs_bound"][top]
        metrics["fp8_speedup_128k"] = round(tm["ms_per_token"][top] / fp8["ms_per_token"][top], 3)

    # -- 512k -----------------------------------------------------------------------------------
    big_run = None
    if big and handle is not None:
        raw["skipped"]["tiermem_big"] = "--stream-weights plans one cache budget (the 128k one) with the weights"
    elif big:
        # the ring of two layers, and the device memory the driver takes to map the home of all 32
        # (NOTE [pinned mapping]): the least budget a cache of this length runs in
        ring = 2 * shape.layer_bytes(big + 64) + pinned_map_bytes(shape.layers * shape.layer_bytes(big + 64))
        big_budget = max(kv_budget, ring)
        home = plan_kv(shape, big + 64, big_budget).home_bytes
        avail = host_available()
        if home + int(args.host_margin_gb * GiB) > avail:
            raw["skipped"]["tiermem_big"] = (f"its home needs {home / 1e9:.1f} GB of pinned host memory and the host has "
                                             f"{avail / 1e9:.1f} GB available (less a {args.host_margin_gb} GB margin)")
        else:
            progress(f"tiermem at {big:,}: kv_budget {big_budget:,} bytes (the ring of two {big:,}-token layers), "
                     f"home {home / 1e9:.1f} GB of {avail / 1e9:.1f} GB available")
            big_run = tiermem_run("tiermem_big", big + 64, big_budget, all_stages)
            raw["contenders"]["tiermem_big"] = big_run
    # -- transformers' offloaded cache ----------------------------------------------------------
    hf = None
    if not args.no_hf:
        progress(f"transformers' DynamicCache(offloading=True) over {stages}")
        blob = take_device(kv_budget + int(args.slack_gb * GiB))
        try:
            dc = DynamicCache(config=cfg, offloading=True)
            argmax, _, _, times = run_schedule(model, cfg, dc, prompt, stages, args, teacher=teacher)
            hf = {"ms_per_token": {s: x * 1e3 for s, x in times.items()},
                  "tokens_equal": argmax == ref_argmax[:len(argmax)]}   # 5.17's race (docs/inference.md) may break it
            del dc
        finally:
            del blob
            gc.collect()
            torch.cuda.empty_cache()
            empty_host_cache()
        raw["contenders"]["hf_offloaded"] = hf

    for name, why in raw["skipped"].items():
        progress(f"skipped {name}: {why}")

    watch.stop()
    if handle is not None:
        handle.unwrap()

    # -- results ---------------------------------------------------------------------------------
    metrics["decode_vs_bound_128k"] = tm["vs_bound"][top]
    metrics["decode_vs_plan_bytes_128k"] = tm["vs_plan_bytes"][top]
    metrics["tiermem_ms_per_token_128k"] = round(tm["ms_per_token"][top], 1)
    metrics["bound_ms_128k"] = round(tm["bound_ms"][top], 1)
    metrics["resident_ms_per_token_128k"] = round(raw["contenders"]["resident"]["ms_per_token"][top], 2)
    if hf is not None:
        metrics["hf_offloaded_ms_per_token_128k"] = round(hf["ms_per_token"][top], 1)
        metrics["hf_offloaded_over_tiermem_128k"] = round(hf["ms_per_token"][top] / tm["ms_per_token"][top], 3)
    metrics["decode_vs_bound_512k"] = big_run["vs_bound"][big] if big_run else None
    if big_run:
        metrics["decode_vs_plan_bytes_512k"] = big_run["vs_plan_bytes"][big]
        metrics["kv_budget_512k_GB"] = round(big_run["kv_budget"] / 1e9, 3)
    metrics["max_context_tokens"] = max(big_run["ms_per_token"]) if big_run else max(tm["ms_per_token"])
    runs = [r for r in (tm, raw["contenders"].get("tiermem_fp8"), big_run) if r]
    metrics["min_free_GB"] = round(min(r["min_free_GB"] for r in runs), 3)
    checks["tokens_equal"] = all(r["tokens_equal"] for r in (tm, big_run) if r)
    checks["within_budget"] = all(r["within_budget"] for r in runs)
    if hf is not None:
        raw["hf_offloaded_tokens_equal"] = hf["tokens_equal"]

    rows = []
    for s in all_stages:
        row = [f"{s:,}", raw["contenders"]["resident"]["ms_per_token"].get(s, float("nan"))]
        for r in (tm, hf, raw["contenders"].get("tiermem_fp8"), big_run):
            row.append(r["ms_per_token"].get(s, float("nan")) if r else float("nan"))
        row.append(tm["bound_ms"].get(s, (big_run or {}).get("bound_ms", {}).get(s, float("nan"))))
        rows.append(row)
    print()
    print(table(rows, ["context", "resident ms", "tiermem ms", "hf offl ms", "fp8 ms", "512k-cache ms",
                       "bound ms (2 GB)"]))
    print()
    print(table([[k, v] for k, v in metrics.items()], ["metric", "value"]))
    print(table([[k, v] for k, v in checks.items()], ["check", "ok"]))
    notes = [n for n in (bounds.below_bound_note("decode_vs_bound_128k", metrics["decode_vs_bound_128k"]),
                         metrics["decode_vs_bound_512k"] is not None
                         and bounds.below_bound_note("decode_vs_bound_512k", metrics["decode_vs_bound_512k"])) if n]
    notes.append(raw["fill"])
    notes += [f"skipped {k}: {v}" for k, v in raw["skipped"].items()]
    if big_run:
        notes.append(f"at {big:,} tokens the cache's budget is the least that holds its ring, "
                     f"{big_run['kv_budget']:,} bytes: attention needs a whole layer on the device, and a layer is "
                     f"{shape.layer_bytes(big + 64):,} bytes there")
    for n in notes:
        progress(n)
    png = plot(raw, all_stages)
    write_results("long_context", metrics, checks, raw, extra_files=[png] if png else [], notes=notes)
    t.close()


def plot(raw: dict, all_stages: list) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    c = raw["contenders"]
    fig, ax = plt.subplots(figsize=(8, 5))
    series = [("resident", "resident DynamicCache", "#2a2", "-"), ("tiermem", "tiermem (2 GB cache budget)", "#369", "-"),
              ("hf_offloaded", "transformers offloaded", "#c33", "-"),
              ("tiermem_fp8", "tiermem, fp8 in transit", "#96c", "-"),
              ("tiermem_big", "tiermem, 512k cache (ring budget)", "#39c", "--")]
    for key, label, color, ls in series:
        if key in c:
            xs = sorted(c[key]["ms_per_token"])
            ax.plot(xs, [c[key]["ms_per_token"][x] for x in xs], ls, marker="o", color=color, label=label)
    for key, label in (("tiermem", "bound: (cache - budget) / pinned H2D"),
                       ("tiermem_big", "bound, 512k cache's budget")):
        if key in c:
            xs = sorted(c[key]["bound_ms"])
            ax.plot(xs, [c[key]["bound_ms"][x] for x in xs], ":", color="k" if key == "tiermem" else "#777", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("ms per decoded token")
    ax.set_title(f"Llama-3-8B shape, decode per token against context ({raw['weights']} weights)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = plot_path("long_context")
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    progress(f"done in {time.perf_counter() - t0:.0f} s")
