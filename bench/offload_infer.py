"""bench/offload_infer.py: transformers models bigger than a really small GPU, as users load them.

For each architecture (Llama; Qwen2 with GQA and qkv bias; GPT-NeoX with fused QKV and parallel
residual; Mixtral, a mixture of experts; Phi; Gemma, whose tied 256k-vocabulary embedding is
larger than the budget; Qwen2-MoE, many small experts and a shared expert; OLMoE, 64 experts and
top-8: bench/infer_moe.py), a model of >= 5 GB fp16 is built from its config with random weights
and transformers' default flags (requires_grad=True, eval mode), and run side by side in one
process:
  resident     the model fully on the GPU (the ceiling, and the reference tokens)
  tiermem      tier.wrap_module(model, budget=<25% of its weights, in bytes>) on a GPU made really small: before tiermem
               starts, one cudaMalloc reservation takes all but budget + margin of the card, so
               the driver really has only that much free (docs/facts.md)
  accelerate   accelerate.cpu_offload(model), under the same reservation, twice: as users call it
               (its weights in pageable host memory) and with a state_dict of pinned host copies,
               its faster mode (page-locked copies run at the link's rate); the figures take the faster
Prefill is one forward of 1x128 tokens, timed for every contender in a steady state of forwards
back to back (_common.STEADY: no synchronization inside the timed spans, so the copies tiermem
starts at the end of a forward for the next one are timed too). Decode is 32 new tokens through
generate() with the KV cache (greedy), timed as generate(33 tokens) - generate(1 token), per
token: generate() waits on the host every token, and the two calls' untimed tails cancel.

The bound of a forward comes from the model and the budget, never from tiermem's plan
(bench/bounds.py): every weight is read once a forward, the budget holds at most its bytes,
and an embedding table is read in place, so (weights - budget - embeddings) must cross the link,
at the pinned H2D rate measured in the same run. The time of the bytes tiermem's plan moves is
kept beside it as ``..._vs_plan_bytes``. For the mixture of experts, decode is also set against
the routed bound: the weights a decode step reads (all but the experts its router did not pick,
counted in the run) less the budget. A ratio below 0.98 of a bound prints why it cannot stand.

Checks of the plan and of checkpoints: ``no_plan_collapse``, no architecture read wholly in place
while its budget could hold a slot (NOTE [no plan collapse] in tiermem/inference/plan.py); and
for each architecture with a tied embedding (``tied_checkpoint_loads``) and each mixture of experts
(``moe_checkpoint_loads``), the model saved with save_pretrained (which leaves out the tied copy)
and read back by tiermem.load_pretrained within the same budget and a host budget of half its
weights (the rest from disk), its prefill logits equal to the resident model's, or, where the
plan cuts a group into parts (NOTE [split groups]: a head by rows, stacked experts by expert), equal
to rounding, a cosine of at least 0.9999 for every token (--no-checkpoints skips them).

    python bench/offload_infer.py [--archs llama,qwen2,...] [--quick] [--weights-gb 5.2]
                                  [--budget 25%] [--margin-gb 2] [--no-small-gpu] [--no-accelerate]
                                  [--reps 5] [--forwards 4] [--stream-dtypes int8,int4] [--moe-cache]
                                  [--moe-experts eager] [--lookahead N]
                                  [--no-checkpoints] [--ckpt-dir DIR] [--tag NAME]
--archs picks a subset of ARCHS; --quick runs QUICK_ARCHS (unless --archs names others) with
fewer repetitions. --stream-dtypes adds quantized streaming (bench/infer_quant.py), --moe-cache
the expert cache on each mixture of experts (bench/infer_moe.py); --moe-experts sets the mixtures'
experts implementation (default: the one transformers picks); --lookahead sets tiermem's slots
(wrap_module's lookahead). Writes
bench/results/offload_infer-<device>-<date>[-<tag>].json and a plot of time against the bound.
"""
from __future__ import annotations

import argparse
import gc
import threading

import bounds
import infer_moe
import infer_quant
from _common import (STEADY, cuda_times, embedding_bytes, gbps, median, nvml_handle, plot_path, progress, slots, steady_times,
                     table, write_results)

GiB = 1 << 30
ARCHS = ("llama", "qwen2", "gpt_neox", "mixtral", "phi", "gemma", "qwen2_moe", "olmoe")
QUICK_ARCHS = ("llama", "gemma", "qwen2_moe")    # --quick: a dense model, the tied embedding, the small experts


def arch_config(arch: str, weights_gb: float):
    """A transformers config of ``arch`` whose fp16 weights come to about ``weights_gb`` GB: the
    layer count is solved from the per-layer and fixed bytes of a shape typical of the family."""
    import transformers as tf
    if arch == "llama":
        h, i, heads, kv, vocab = 4096, 11008, 32, 32, 32000
        per = 2 * h * h + 2 * h * (h * kv // heads) + 3 * h * i
        fixed = 2 * vocab * h
        make = lambda n: tf.LlamaConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=n, num_attention_heads=heads,  # noqa: E731
                                        num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=False)
    elif arch == "qwen2":     # GQA 8:1 and bias on q, k, v; a large vocabulary
        h, i, heads, kv, vocab = 2048, 11008, 16, 2, 151936
        per = 2 * h * h + 2 * h * (h * kv // heads) + 3 * h * i
        fixed = 2 * vocab * h
        make = lambda n: tf.Qwen2Config(hidden_size=h, intermediate_size=i, num_hidden_layers=n, num_attention_heads=heads,  # noqa: E731
                                        num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=False)
    elif arch == "gpt_neox":  # fused QKV, parallel residual (Pythia-2.8B's shape)
        h, i, heads, vocab = 2560, 10240, 32, 50304
        per = 4 * h * h + 2 * h * i
        fixed = 2 * vocab * h
        make = lambda n: tf.GPTNeoXConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=n,  # noqa: E731
                                          num_attention_heads=heads, vocab_size=vocab, use_parallel_residual=True)
    elif arch == "mixtral":   # 8 experts, 2 routed per token
        h, i, heads, kv, vocab, e = 2048, 2816, 16, 4, 32000, 8
        per = 2 * h * h + 2 * h * (h * kv // heads) + e * 3 * h * i + h * e
        fixed = 2 * vocab * h
        make = lambda n: tf.MixtralConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=n,  # noqa: E731
                                          num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                          num_local_experts=e, num_experts_per_tok=2, tie_word_embeddings=False)
    elif arch == "phi":       # Phi-2's shape: partial rotary, a biased head
        h, i, heads, vocab = 2560, 10240, 32, 51200
        per = 4 * h * h + 2 * h * i
        fixed = 2 * vocab * h
        make = lambda n: tf.PhiConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=n,  # noqa: E731
                                      num_attention_heads=heads, vocab_size=vocab)
    elif arch == "gemma":     # Gemma-7B's shape: a 256k vocabulary, its embedding tied to the head
        h, i, heads, hd, vocab = 3072, 24576, 16, 256, 256000
        per = 4 * h * heads * hd + 3 * h * i
        fixed = vocab * h
        make = lambda n: tf.GemmaConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=n,  # noqa: E731
                                        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hd,
                                        vocab_size=vocab, tie_word_embeddings=True)
    elif arch in infer_moe.MOE_ARCHS:
        return infer_moe.MOE_ARCHS[arch](weights_gb)
    else:
        raise SystemExit(f"unknown architecture {arch!r}; choose from {', '.join(ARCHS)}")
    layers = max(2, round((weights_gb * 1e9 / 2 - fixed) / per))
    return make(layers)


def build(cfg):
    """The model for ``cfg``, fp16 random weights built on the GPU, with transformers' defaults."""
    import torch
    import transformers as tf
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device("cuda"):
            torch.manual_seed(0)
            model = tf.AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(old)
    model.eval()                              # as from_pretrained returns it; requires_grad stays True
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None   # random weights: always decode every token asked for
    return model


class FreeWatch:
    """The smallest free device memory the driver reports, sampled every 2 ms on a thread (NVML,
    so the samples need no CUDA context work on the timed stream)."""

    def __init__(self):
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nvml, self.h = pynvml, nvml_handle()
        except Exception:   # no NVML: the CUDA runtime's figure, read from the thread
            self.nvml = None
        self.min_free = self.free()
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
            self.min_free = min(self.min_free, self.free())

    def reset(self) -> None:
        self.min_free = self.free()

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


class Routing:
    """Counts the experts a mixture-of-experts model's router picks in decode steps: the routed
    bound's bytes. A module is an expert set when all its direct parameters are stacked along a
    first dimension the size of its expert count and its forward gets the picked indices."""

    def __init__(self, model):
        import torch
        self.sets = []
        for m in model.modules():
            ps = list(m.parameters(recurse=False))
            e = getattr(m, "num_experts", None)
            if ps and isinstance(e, int) and all(p.dim() == 3 and p.shape[0] == e for p in ps):
                per = sum(p.numel() * p.element_size() for p in ps) // e
                self.sets.append((m, e, per))
        self.routed = 0
        self.steps = 0
        self.hooks = [m.register_forward_pre_hook(self._hook(e, per)) for m, e, per in self.sets]
        self.torch = torch

    def _hook(self, e: int, per: int):
        def pre(mod, args):
            hidden, index = args[0], args[1]
            if hidden.shape[0] == 1:           # a decode step of one token
                self.routed += int(self.torch.unique(index).numel()) * per
        return pre

    @property
    def expert_bytes(self) -> int:
        return sum(e * per for _, e, per in self.sets)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def timed_generate(model, ids, new: int, reps: int):
    out = None

    def run():
        nonlocal out
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return median(cuda_times(run, reps, warmup=1)), out


def measure(model, ids, forwards: int, spans: int, decode_tokens: int, dec_reps: int):
    """(prefill s, decode s per token, generated tokens); prefill in the steady state (STEADY)."""
    import torch
    with torch.no_grad():
        pre = median(steady_times(lambda: model(ids, use_cache=False), forwards, spans, warmup=2))
        t1, _ = timed_generate(model, ids, 1, dec_reps)
        tn, out = timed_generate(model, ids, 1 + decode_tokens, dec_reps)
    return pre, (tn - t1) / decode_tokens, out


def measure_loop(model, ids, forwards: int, spans: int, decode_tokens: int):
    """(prefill s, decode s per token) with a hand-written greedy loop over the KV cache, for a
    peer whose hooks leave generate() no device to read (accelerate puts parameters on meta);
    prefill in the same steady state as the others."""
    import torch
    with torch.no_grad():
        pre = median(steady_times(lambda: model(ids, use_cache=False), forwards, spans, warmup=1))
        out = model(ids, use_cache=True)
        pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        model(nxt, past_key_values=pkv, use_cache=True)

        def steps():
            nonlocal pkv, nxt
            for _ in range(decode_tokens):
                o = model(nxt, past_key_values=pkv, use_cache=True)
                pkv, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
        t = cuda_times(steps, 1, warmup=0)[0]
    return pre, t / decode_tokens


def resident_graphed(model, ids, forwards: int, spans: int) -> dict:
    """The resident model's prefill captured by torch alone (no tiermem), timed as the others:
    the floor a graphed streamed prefill is set against. {"prefill_ms"}, or {"error"} where the
    model's code refuses a capture (torch is then put back as it was: tiermem/pytorch/unwind.py)."""
    import torch

    from tiermem.pytorch.unwind import clear_frames, first_cause, release_graph, unroute
    static = ids.clone()
    g, pool, prev = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle(), torch.cuda.current_stream()
    why = ""
    try:
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(prev)
            with torch.cuda.stream(side):            # warm-up off the capture, as torch asks
                model(static, use_cache=False)
            prev.wait_stream(side)
            with torch.cuda.graph(g, pool=pool):
                model(static, use_cache=False)
    except Exception as e:   # noqa: BLE001 - reported; the bench goes on
        why = first_cause(e)
        clear_frames(e)
    if why:
        unroute(torch, g, pool, prev)
        release_graph(torch, g, pool)
        return {"error": why}
    try:
        return {"prefill_ms": median(steady_times(g.replay, forwards, spans, warmup=2)) * 1e3}
    finally:
        release_graph(torch, g)


def measure_graphed(model, hd, ids, forwards: int, spans: int, eager_logits, decode_tokens: int = 0) -> dict:
    """The prefill as a graphed forward (NOTE [graphed forwards] in tiermem/inference/graphed.py),
    timed in the same steady state after its capture: its ms, whether its logits are the eager
    forward's bit for bit, and why it stayed eager if it did."""
    import torch

    from tiermem.testing import logits_agreement
    fwd = hd.graphed(lambda x: model(x, use_cache=False).logits)
    try:
        pre = median(steady_times(lambda: fwd(ids), forwards, spans, warmup=3))
        got = fwd(ids)
        agree = logits_agreement(eager_logits, got)
        return {"prefill_ms": pre * 1e3, "logits_equal_eager": bool(torch.equal(got, eager_logits)),
                "logits_max_abs_diff_eager": float((got.float() - eager_logits.float()).abs().max()),
                "logits_cosine_min_eager": agree["cosine_min"], "top1_eager": agree["top1"],
                "captures": fwd.captures, "replays": fwd.replays, "off": fwd.off,
                "decode": measure_graphed_decode(model, hd, ids, decode_tokens) if decode_tokens > 3 else None}
    finally:
        fwd.close()


def measure_graphed_decode(model, hd, ids, decode_tokens: int) -> dict:
    """Greedy decode steps over a transformers StaticCache (fixed addresses, so a step can be
    captured), eagerly and as a graphed forward (NOTE [graphed forwards]): ms per token of each
    (CUDA events around each step, the median of the steps after the first three, which learn,
    settle and capture), whether their tokens agree, and why the graphed steps stayed eager if
    they did. The positions are passed in as tensors: reading the cache's length would wait for
    the device."""
    import inspect

    import torch
    from transformers import StaticCache
    takes_cache_position = "cache_position" in inspect.signature(model.base_model.forward).parameters
    n = ids.shape[1]

    def run(graphed: bool):
        cache = StaticCache(config=model.config, max_cache_len=n + decode_tokens + 1)

        def step(tok, pos):
            extra = {"cache_position": pos} if takes_cache_position else {}
            return model(tok, position_ids=pos[None], past_key_values=cache, use_cache=True, **extra).logits
        fn = hd.graphed(step) if graphed else step
        with torch.no_grad():
            logits = step(ids, torch.arange(n, device=ids.device))
            tok = logits[:, -1:].argmax(-1)
            pos = torch.tensor([n], device=ids.device)
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(decode_tokens + 1)]
            toks = []
            marks[0].record()
            for i in range(decode_tokens):
                tok = fn(tok, pos)[:, -1:].argmax(-1)
                pos = pos + 1
                toks.append(tok)
                marks[i + 1].record()
            marks[-1].synchronize()
        ms = sorted(marks[i].elapsed_time(marks[i + 1]) for i in range(3, decode_tokens))
        out = {"decode_ms_per_token": ms[len(ms) // 2], "tokens": torch.cat(toks, 1)[0].tolist()}
        if graphed:
            out.update(captures=fn.captures, replays=fn.replays, off=fn.off)
            fn.close()
        return out
    try:
        eager, graphed = run(False), run(True)
    except Exception as e:   # reported: a model whose static cache does not run here
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    same = sum(a == b for a, b in zip(eager["tokens"], graphed["tokens"]))
    return {"eager_static_ms": eager["decode_ms_per_token"], "graphed_ms": graphed["decode_ms_per_token"],
            "tokens_equal": eager["tokens"] == graphed["tokens"], "tokens_agree": same / len(eager["tokens"]),
            "captures": graphed["captures"], "replays": graphed["replays"], "off": graphed["off"]}


def adoption_atomic(model, tier_cls, budget: int) -> bool:
    """A wrap_module made to fail midway (after its resident groups took managed memory) leaves
    the model's tensors, the tier's stats and the driver's free memory as they were."""
    import torch

    import tiermem
    t = tier_cls(0)
    before = [(p, p.data_ptr()) for p in model.parameters()]
    sums = [float(p.float().sum()) for p in list(model.parameters())[:8]]
    torch.cuda.synchronize()
    stats, free = t.stats(), torch.cuda.mem_get_info()[0]
    real = t.backend.host_alloc

    def boom(*a, **k):
        raise tiermem.CUDAError("cudaHostAlloc", 2, "cudaErrorMemoryAllocation")
    t.backend.host_alloc = boom
    try:
        t.wrap_module(model, budget=budget)
        ok = False
    except tiermem.CUDAError:
        ok = True
    finally:
        t.backend.host_alloc = real
    gc.collect()
    torch.cuda.synchronize()
    ok &= all(p.data_ptr() == ptr and tiermem.tiered_of(p) is None for p, ptr in before)
    ok &= sums == [float(p.float().sum()) for p in list(model.parameters())[:8]]
    now = t.stats()
    ok &= all(now[k] == v for k, v in stats.items() if k.endswith(".current"))
    drift = abs(torch.cuda.mem_get_info()[0] - free)
    ok &= drift <= 32 << 20
    progress(f"  failed adoption: nothing left behind = {ok} (driver free memory drift {drift / 2**20:.1f} MiB)")
    t.close()
    return ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--weights-gb", type=float, default=5.2)
    ap.add_argument("--budget", default="25%", help="bytes, or a share of each model's weights like 25%%")
    ap.add_argument("--margin-gb", type=float, default=2.0, help="free memory left beside the budget (activations, KV cache, CUDA's own)")
    ap.add_argument("--floor-gb", type=float, default=1.0, help="the free memory the run must never go below")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5, help="prefill: spans of --forwards back-to-back forwards timed")
    ap.add_argument("--forwards", type=int, default=4, help="prefill: forwards in each timed span")
    ap.add_argument("--no-small-gpu", action="store_true", help="skip the cudaMalloc reservation (an emulated budget only)")
    ap.add_argument("--no-accelerate", action="store_true")
    ap.add_argument("--accelerate-decode-tokens", type=int, default=3)
    ap.add_argument("--accelerate-forwards", type=int, default=2, help="accelerate's prefill: forwards a span")
    ap.add_argument("--stream-dtypes", default="", help="also run tiermem with these stream_dtypes (int8,fp8,int4): "
                    "bench/infer_quant.py")
    ap.add_argument("--quant-profile", default=None, metavar="PREFIX",
                    help="with --stream-dtypes: one prefill of each format under torch's profiler, to "
                    "PREFIX-<model type>-<fmt>.txt")
    ap.add_argument("--moe-cache", action="store_true", help="also run each mixture of experts with an expert cache, "
                    "routed uniformly and skewed: bench/infer_moe.py")
    ap.add_argument("--moe-profile", default=None, metavar="PREFIX",
                    help="with --moe-cache: a short cached decode under torch's profiler, its tables to PREFIX-<routing>.txt")
    ap.add_argument("--moe-cache-size", default="half", choices=("half", "auto"),
                    help="with --moe-cache: half the budget, or what expert_cache='auto' gives (bench/infer_moe.py)")
    ap.add_argument("--moe-experts", default=None, help="the mixtures of experts' experts implementation (eager, "
                    "batched_mm, grouped_mm; default: transformers' pick): bench/infer_moe.py")
    ap.add_argument("--quick", action="store_true", help=f"{','.join(QUICK_ARCHS)} (unless --archs is given), "
                    "--reps 2 --forwards 2 --decode-tokens 16")
    ap.add_argument("--no-checkpoints", action="store_true", help="skip save_pretrained / load_pretrained of the tied "
                    "and mixture-of-experts architectures")
    ap.add_argument("--ckpt-dir", default=None, help="where those checkpoints are written (default: a temporary folder)")
    ap.add_argument("--lookahead", type=int, default=None, help="tiermem's streamed groups in flight (wrap_module's "
                    "lookahead; default: its own): fewer slots leave more of the budget to resident groups")
    ap.add_argument("--max-group-bytes", default=None, help="the largest streamed group (wrap_module's "
                    "max_group_bytes: bytes or '64MiB'; default: its own): smaller slots leave more of the budget "
                    "to resident groups, for more pieces a forward")
    ap.add_argument("--no-graphed", action="store_true", help="skip the prefills as graphed forwards "
                    "(handle.graphed: NOTE [graphed forwards])")
    ap.add_argument("--tag", default="", help="appended to the JSON's name: runs of parts of the matrix on one day")
    args = ap.parse_args()
    if args.quick:
        if args.archs == ",".join(ARCHS):
            args.archs = ",".join(QUICK_ARCHS)
        args.reps, args.forwards, args.decode_tokens = min(args.reps, 2), min(args.forwards, 2), min(args.decode_tokens, 16)

    import torch

    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    metrics: dict = {}
    checks: dict = {}
    raw: dict = {"lookahead": args.lookahead, "max_group_bytes": args.max_group_bytes, "tokens": args.tokens, "decode_tokens": args.decode_tokens, "reps": args.reps,
                 "budget": args.budget, "margin_GB": args.margin_gb, "small_gpu": not args.no_small_gpu, "archs": {},
                 "prefill_timing": STEADY.format(warmup=2, spans=args.reps, forwards=args.forwards),
                 "bound": "(weights - budget - embeddings read in place) / pinned H2D measured in this run "
                          "(bench/bounds.py forward_seconds); plan_bytes_ms: the bytes tiermem's plan moves / the same"}

    d = torch.randint(0, 256, (GiB,), dtype=torch.uint8, device="cuda")
    h = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    h.copy_(d)
    link = gbps(GiB, median(cuda_times(lambda: d.copy_(h, non_blocking=True), 9)))
    metrics["pinned_h2d_GBps"] = link
    del d, h
    watch = FreeWatch()
    if not args.no_accelerate:
        import accelerate
        raw["accelerate_version"] = accelerate.__version__
    import transformers
    raw["transformers_version"] = transformers.__version__

    equal_all, small_all, within_all = True, True, True
    min_free = None
    atomic = None
    for arch in archs:
        try:
            atomic = run_arch(arch, args, link, watch, raw, atomic)
        except Exception:   # one architecture's failure is reported; the others still run
            import traceback
            traceback.print_exc()
            raw.setdefault("failed", []).append(arch)
            gc.collect()
            torch.cuda.empty_cache()
        equal_all &= raw["archs"].get(arch, {}).get("tiermem", {}).get("tokens_equal_resident", False)
        small_all &= raw["archs"].get(arch, {}).get("small", False) or args.no_small_gpu
        within_all &= raw["archs"].get(arch, {}).get("within", False)
        mf = raw["archs"].get(arch, {}).get("min_free", None)
        if mf is not None:
            min_free = mf if min_free is None else min(min_free, mf)
    finish(args, metrics, checks, raw, equal_all, small_all, within_all, min_free, atomic, watch)


def run_arch(arch, args, link, watch, raw, atomic):
    import torch

    import tiermem
    r: dict = {}
    progress(f"{arch}: building ~{args.weights_gb} GB fp16 on the GPU")
    cfg = arch_config(arch, args.weights_gb)
    if arch in infer_moe.MOE_ARCHS and args.moe_experts:
        cfg._experts_implementation = args.moe_experts
    model = build(cfg)
    W = sum(p.numel() * p.element_size() for p in model.parameters())
    E = embedding_bytes(model)
    r["weights_GB"] = round(W / 1e9, 3)
    r["embeddings_GB"] = round(E / 1e9, 3)
    r["layers"] = cfg.num_hidden_layers
    r["requires_grad_default"] = all(p.requires_grad for p in model.parameters())
    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens), device="cuda")

    progress(f"{arch}: resident")
    pre, dec, ref_tokens = measure(model, ids, args.forwards, args.reps, args.decode_tokens, 3)
    r["resident"] = {"prefill_ms": pre * 1e3, "decode_ms_per_token": dec * 1e3}
    if not args.no_graphed:
        r["resident"]["graphed"] = resident_graphed(model, ids, args.forwards, args.reps)
    with torch.no_grad():
        ref_logits = model(ids, use_cache=False).logits

    model.cpu()                               # a model bigger than the GPU starts on the host
    gc.collect()
    torch.cuda.empty_cache()
    # The bench's --budget is a share of each model's weights; tiermem's own percentages are
    # shares of the GPU (NOTE [sizes]), so the bench hands it bytes.
    budget = tiermem.planning.parse_bytes(args.budget, total=tiermem.planning.weight_bytes(model))
    blob = None
    if not args.no_small_gpu:
        free, _ = torch.cuda.mem_get_info()
        keep = budget + int(args.margin_gb * 1e9)
        blob = torch.empty(max(0, free - keep), dtype=torch.uint8, device="cuda")
        r["free_after_reservation_GB"] = round(torch.cuda.mem_get_info()[0] / 1e9, 3)
        progress(f"{arch}: reservation in place; the driver has {r['free_after_reservation_GB']} GB free "
                 f"for a {W / 1e9:.2f} GB model")
        r["small"] = torch.cuda.mem_get_info()[0] < W
    if atomic is None:
        atomic = adoption_atomic(model, tiermem.Tier, budget)

    progress(f"{arch}: tiermem at {args.budget}")
    watch.reset()
    tier = tiermem.Tier(0)                    # the default cap: the memory free now
    hd = tier.wrap_module(model, budget=budget, **slots(args))
    routing = Routing(model)
    pre, dec, tokens = measure(model, ids, args.forwards, args.reps, args.decode_tokens, 3)
    with torch.no_grad():
        eager_logits = model(ids, use_cache=False).logits
    logits_eq = bool(torch.equal(eager_logits, ref_logits))
    graphed = None if args.no_graphed else measure_graphed(model, hd, ids, args.forwards, args.reps, eager_logits,
                                                           args.decode_tokens)
    del eager_logits
    hd.drain()
    s = tier.stats()
    bound = bounds.forward_seconds(W, budget, E, link)
    plan_s = hd.moved_bytes / (link * 1e9)
    eq = bool(torch.equal(tokens, ref_tokens))
    r["tiermem"] = {"prefill_ms": pre * 1e3, "decode_ms_per_token": dec * 1e3, "bound_ms": bound * 1e3,
                    "bound_GB_per_forward": bounds.forward_bytes(W, budget, E) / 1e9, "plan_bytes_ms": plan_s * 1e3,
                    "budget_GB": budget / 1e9, "handle_budget_GB": hd.budget / 1e9,
                    "streamed_GB": hd.plan.streamed_bytes / 1e9,
                    "moved_GB_per_forward": hd.moved_bytes / 1e9, "in_place_groups": sorted(hd.plan.in_place),
                    "groups": len(hd.plan.sizes), "pinned_groups": len(hd.plan.pinned),
                    "window_GB": hd.plan.window / 1e9, "lookahead": hd.plan.lookahead,
                    "resident_peak_GB": s["resident_bytes.all.peak"] / 1e9,
                    "managed_reserved_GB": tier.backend.guard.reserved / 1e9, "cap_GB": tier.backend.guard.limit / 1e9,
                    "tokens_equal_resident": eq, "prefill_logits_equal_resident": logits_eq,
                    "min_free_GB": watch.min_free / 1e9, "graphed": graphed}
    r["within"] = s["resident_bytes.all.peak"] <= hd.budget and tier.backend.guard.reserved <= tier.backend.guard.limit
    r["tiermem"]["plan"] = plan_shape(hd.plan, budget)
    if routing.sets:
        steps = 4 * args.decode_tokens       # decode steps hooked: the warm-up and 3 timed generate() calls
        routed_per_token = routing.routed / steps
        experts = routing.expert_bytes
        routed = bounds.routed_decode_bytes(W, budget, E, experts, routed_per_token)
        r["tiermem"]["moe"] = {"expert_sets": len(routing.sets), "expert_GB": experts / 1e9,
                               "routed_expert_GB_per_token": routed_per_token / 1e9,
                               "routed_bound_ms": routed / (link * 1e9) * 1e3}
    routing.remove()
    progress(f"{arch}: tiermem prefill {pre * 1e3:.1f} ms (bound {bound * 1e3:.1f}, the plan's bytes "
             f"{plan_s * 1e3:.1f}), decode {dec * 1e3:.1f} ms/token, tokens equal {eq}, "
             f"min free {watch.min_free / 1e9:.2f} GB")
    if graphed is not None:
        progress(f"{arch}: graphed prefill {graphed['prefill_ms']:.1f} ms, logits equal eager "
                 f"{graphed['logits_equal_eager']}{', eager: ' + graphed['off'] if graphed['off'] else ''}; "
                 f"decode over a static cache {graphed['decode']}")
    hd.unwrap()
    tier.close()
    del hd, tier
    gc.collect()
    if args.stream_dtypes:
        r["quant"] = infer_quant.run_quantized(model, ids, args, budget, ref_logits, bound, link, measure, watch,
                                               None if args.no_graphed else measure_graphed)
    if args.moe_cache and "moe" in r["tiermem"]:
        r["moe_cache"] = infer_moe.run_moe_cache(model, ids, args, budget, bound, timed_generate)
    tied = model.get_output_embeddings() is not None and (model.get_output_embeddings().weight
                                                           is model.get_input_embeddings().weight)
    r["tied"] = tied
    if not args.no_checkpoints and (tied or "moe" in r["tiermem"]):
        r["checkpoint"] = checkpoint_round_trip(model, ids, budget, ref_logits, args, arch)

    if not args.no_accelerate:
        r["accelerate"] = run_accelerate(model, ids, args, arch)
    r["min_free"] = watch.min_free
    del model, blob
    gc.collect()
    torch.cuda.empty_cache()
    raw["archs"][arch] = r
    return atomic


def plan_shape(plan, budget: int) -> dict:
    """What the plan does with the groups it streams: read wholly in place (``collapsed``) or
    not, and whether the budget could hold a slot of the smallest streamed group or part
    (NOTE [no plan collapse] in tiermem/inference/plan.py)."""
    streamed = [(g, n) for g, n in plan.sizes if g not in plan.pinned and g not in plan.in_place]
    parts = dict(plan.units)
    smallest = min((min(n, parts.get(g, n)) for g, n in streamed), default=0)
    collapsed = bool(streamed) and (plan.zero_copy_only or all(g in plan.oversized for g, _ in streamed))
    return {"streamed_groups": len(streamed), "oversized": len(plan.oversized), "split": len(plan.split),
            "slot_GB": plan.slot / 1e9, "zero_copy_only": plan.zero_copy_only, "collapsed": collapsed,
            "smallest_streamed_GB": smallest / 1e9, "budget_holds_a_slot": 0 < smallest <= budget}


def checkpoint_round_trip(model, ids, budget: int, ref_logits, args, arch) -> dict:
    """``model`` (on the host) saved with save_pretrained and read back by load_pretrained within
    ``budget`` and a host budget of half its weights; its prefill logits against ``ref_logits``."""
    import os
    import shutil
    import tempfile
    import time

    import torch

    import tiermem
    W = tiermem.planning.weight_bytes(model)
    base = args.ckpt_dir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    path = tempfile.mkdtemp(prefix=f"offload_infer-{arch}-", dir=base)
    out: dict = {"host_budget_GB": W / 2 / 1e9}
    try:
        progress(f"{arch}: save_pretrained, then load_pretrained with host_budget={W / 2 / 1e9:.2f} GB")
        t0 = time.perf_counter()
        model.save_pretrained(path)
        out["save_s"] = round(time.perf_counter() - t0, 1)
        tier = tiermem.Tier(0)
        try:
            t0 = time.perf_counter()
            loaded, hd = tiermem.load_pretrained(path, budget=budget, host_budget=W // 2, tier=tier)
            out["load_s"] = round(time.perf_counter() - t0, 1)
            with torch.no_grad():
                logits = loaded(ids, use_cache=False).logits
            cos = torch.nn.functional.cosine_similarity(logits.float().flatten(0, -2), ref_logits.float().flatten(0, -2), dim=-1)
            out.update(loads=True, logits_equal_resident=bool(torch.equal(logits, ref_logits)),
                       logits_cosine_min=float(cos.min()), cut_groups=len(hd.plan.split),
                       on_disk_groups=len(hd.plan.on_disk), pinned_host_GB=hd.plan.pinned_host_bytes / 1e9)
            hd.unwrap()
            del loaded, hd
        finally:
            tier.close()
    except Exception as e:        # reported; the rest of the run goes on
        out.update(loads=False, error=f"{type(e).__name__}: {e}")
    finally:
        shutil.rmtree(path, ignore_errors=True)
        gc.collect()
    progress(f"{arch}: checkpoint round trip: {out}")
    return out


def run_accelerate(model, ids, args, arch) -> dict:
    """accelerate's cpu_offload in its two modes, one after the other on the same host model:
    "pageable" as users call it (the host weights as they are), then "pinned" with a state_dict
    of page-locked copies; ``fastest`` names the faster prefill. The hooks of the first are
    removed before the second (its parameters stay on meta; the second reads its state_dict)."""
    import accelerate
    import torch
    from accelerate.hooks import remove_hook_from_submodules
    pinned = {n: t.detach().to("cpu").pin_memory() for n, t in model.state_dict().items()}
    k = args.accelerate_decode_tokens
    out: dict = {"decode_tokens": k}
    for mode, sd in (("pageable", None), ("pinned", pinned)):
        progress(f"{arch}: accelerate cpu_offload, {mode}")
        accelerate.cpu_offload(model, execution_device=torch.device("cuda", 0), state_dict=sd)
        pre_a, dec_a = measure_loop(model, ids, args.accelerate_forwards, 2, k)
        remove_hook_from_submodules(model)
        out[mode] = {"prefill_ms": pre_a * 1e3, "decode_ms_per_token": dec_a * 1e3}
        progress(f"{arch}: accelerate ({mode}) prefill {pre_a * 1e3:.0f} ms, decode {dec_a * 1e3:.0f} ms/token")
    del pinned
    best = min(("pageable", "pinned"), key=lambda m: out[m]["prefill_ms"])
    out.update(fastest=best, prefill_ms=out[best]["prefill_ms"], decode_ms_per_token=out[best]["decode_ms_per_token"])
    return out


def finish(args, metrics, checks, raw, equal_all, small_all, within_all, min_free, atomic, watch):
    watch.stop()
    rows = []
    pv, dv, ao, gv, gd, caught = {}, {}, {}, {}, {}, set()
    notes: list[str] = []
    eager_notes: list[str] = []      # graphed forwards that stayed eager, and why
    for arch, r in raw["archs"].items():
        t = r["tiermem"]
        pv[arch] = bounds.ratio(t["prefill_ms"], t["bound_ms"])
        gr = t.get("graphed")
        if gr:                   # NOTE [graphed forwards] in tiermem/inference/graphed.py
            gv[arch] = metrics[f"prefill_vs_bound_graphed.{arch}"] = bounds.ratio(gr["prefill_ms"], t["bound_ms"])
            infer_quant.graphed_checks(checks, gr)
            d = infer_quant.graphed_decode_ms(gr)
            if d is not None:      # against the eager decode's bound (the routed one for experts)
                gd[arch] = metrics[f"decode_vs_bound_graphed.{arch}"] = bounds.ratio(
                    d, t["moe"]["routed_bound_ms"] if "moe" in t else t["bound_ms"])
            if infer_quant.captured(gr, eager_notes, arch):
                caught.add(arch)
        # A mixture of experts' decode step reads only the experts its router picked: the dense
        # bound is no lower bound there, the routed one is.
        dv[arch] = bounds.ratio(t["decode_ms_per_token"], t["moe"]["routed_bound_ms"] if "moe" in t else t["bound_ms"])
        metrics[f"prefill_vs_bound.{arch}"] = pv[arch]
        metrics[f"decode_vs_bound.{arch}"] = dv[arch]
        metrics[f"prefill_vs_plan_bytes.{arch}"] = bounds.ratio(t["prefill_ms"], t["plan_bytes_ms"])
        metrics[f"decode_vs_plan_bytes.{arch}"] = bounds.ratio(t["decode_ms_per_token"], t["plan_bytes_ms"])
        for what, v in ((f"prefill_vs_bound.{arch}", pv[arch]), (f"decode_vs_bound.{arch}", dv[arch])):
            note = bounds.below_bound_note(what, v)
            if note:
                notes.append(note)
        if "accelerate" in r:
            a = r["accelerate"]
            ao[arch] = round(a["prefill_ms"] / t["prefill_ms"], 2)
            metrics[f"accelerate_over_tiermem.{arch}"] = ao[arch]
            metrics[f"accelerate_over_tiermem_decode.{arch}"] = round(a["decode_ms_per_token"] / t["decode_ms_per_token"], 2)
            for mode in ("pageable", "pinned"):
                metrics[f"accelerate_{mode}_over_tiermem.{arch}"] = round(a[mode]["prefill_ms"] / t["prefill_ms"], 2)
        if "moe" in t:            # over the mixtures of experts: the worst
            metrics[f"moe_decode_vs_dense_bound.{arch}"] = bounds.ratio(t["decode_ms_per_token"], t["bound_ms"])
            metrics["moe_decode_vs_dense_bound"] = max(metrics.get("moe_decode_vs_dense_bound", 0),
                                                       metrics[f"moe_decode_vs_dense_bound.{arch}"])
            metrics["moe_decode_vs_routed_bound"] = max(metrics.get("moe_decode_vs_routed_bound", 0), dv[arch])
        rows.append([arch, r["weights_GB"], round(r["resident"]["prefill_ms"], 1), round(t["prefill_ms"], 1),
                     round(t["bound_ms"], 1), pv[arch], round(t["plan_bytes_ms"], 1),
                     round(r["resident"]["decode_ms_per_token"], 2), round(t["decode_ms_per_token"], 2), dv[arch],
                     round(r["accelerate"]["prefill_ms"]) if "accelerate" in r else "-", ao.get(arch, "-"),
                     t["tokens_equal_resident"], round(gr["prefill_ms"], 1) if gr else "-", gv.get(arch, "-"),
                     gd.get(arch, "-")])
    metrics["architectures"] = len(raw["archs"])
    metrics["prefill_vs_bound_worst"] = max(pv.values())
    metrics["prefill_vs_bound_best"] = min(pv.values())
    if gv:
        metrics["prefill_vs_bound_worst_graphed"] = max(gv.values())
    if gd:
        metrics["decode_vs_bound_worst_graphed"] = max(gd.values())
    if caught:
        metrics["prefill_vs_bound_worst_captured"] = max(gv[a] for a in caught)
        metrics["decode_vs_bound_worst_captured"] = max(gd.get(a, 0.0) for a in caught)
    metrics["decode_vs_bound_worst"] = max(dv.values())
    metrics["prefill_vs_plan_bytes_worst"] = max(v for k, v in metrics.items() if k.startswith("prefill_vs_plan_bytes."))
    if ao:
        metrics["accelerate_over_tiermem_min"] = min(ao.values())
    metrics["min_free_GB"] = round(min_free / 1e9, 3)
    metrics["margin_GB"] = args.margin_gb
    if "llama" in raw["archs"]:          # the keys of the single-model bench before it, from Llama
        r = raw["archs"]["llama"]
        t = r["tiermem"]
        metrics.update({"weights_GB": r["weights_GB"], "budget_GB": round(t["budget_GB"], 3),
                        "prefill_ms": round(t["prefill_ms"], 2), "bound_ms": round(t["bound_ms"], 2),
                        "prefill_vs_bound": pv["llama"], "decode_ms": round(t["decode_ms_per_token"], 2),
                        "decode_vs_bound": dv["llama"], "resident_ms": round(r["resident"]["prefill_ms"], 2),
                        "resident_decode_ms": round(r["resident"]["decode_ms_per_token"], 2),
                        "streamed_GB": round(t["streamed_GB"], 3)})
        if "accelerate" in r:
            metrics["accelerate_ms"] = round(r["accelerate"]["prefill_ms"], 1)
            metrics["accelerate_over_tiermem"] = ao["llama"]
    checks["tokens_equal_resident_all"] = equal_all
    checks["real_small_gpu"] = (not args.no_small_gpu) and small_all
    checks["adoption_atomic"] = bool(atomic)
    checks["resident_within_budget"] = within_all
    checks["min_free_above_floor"] = min_free >= args.floor_gb * 1e9
    metrics["floor_GB"] = args.floor_gb
    checks["prefill_vs_bound_goal"] = metrics["prefill_vs_bound_worst"] <= 1.10
    checks["decode_vs_bound_goal"] = metrics["decode_vs_bound_worst"] <= 1.15
    checks["no_figure_below_its_bound"] = not notes
    notes += eager_notes
    if ao:
        checks["accelerate_over_tiermem_goal"] = metrics["accelerate_over_tiermem_min"] >= 7
    if "moe_decode_vs_dense_bound" in metrics:
        checks["moe_decode_goal"] = metrics["moe_decode_vs_dense_bound"] <= 0.6
    qrows = infer_quant.add_metrics(raw["archs"], metrics, checks, notes)
    mrows = infer_moe.add_metrics(raw["archs"], metrics, checks)
    collapsed = [a for a, r in raw["archs"].items()
                 if r["tiermem"]["plan"]["collapsed"] and r["tiermem"]["plan"]["budget_holds_a_slot"]]
    checks["no_plan_collapse"] = not collapsed
    if collapsed:
        notes.append(f"read wholly in place though the budget could hold a slot: {', '.join(collapsed)}")
    for key, which in (("tied_checkpoint_loads", lambda r: r.get("tied")),
                       ("moe_checkpoint_loads", lambda r: "moe" in r["tiermem"])):
        trips = {a: r["checkpoint"] for a, r in raw["archs"].items() if which(r) and "checkpoint" in r}
        if trips:
            # NOTE [split groups]: a group cut into parts sums to rounding, not to the bit
            checks[key] = all(c.get("loads") and (c.get("logits_equal_resident") or (
                c.get("cut_groups", 0) > 0 and c.get("logits_cosine_min", 0.0) >= 0.9999)) for c in trips.values())
            for a, c in trips.items():
                if not c.get("loads"):
                    notes.append(f"{a}: load_pretrained of its checkpoint failed: {c.get('error')}")

    print()
    print(table(rows, ["arch", "GB", "res pre ms", "tm pre ms", "bound ms", "pre/bound", "plan ms", "res dec ms",
                       "tm dec ms", "dec/bound", "acc pre ms", "acc/tm", "tokens eq", "graphed ms", "graphed/bound", "g dec/bound"]))
    if qrows:
        print(table(qrows, ["arch", "stream", "pre ms", "fp16 bound", "pre/bound", "dec ms", "dec/bound", "cos min",
                            "top-1", "GB/fwd", "graphed ms", "graphed/bound", "g dec/bound"]))
    if mrows:
        print(table(mrows, ["arch", "routing", "dec ms", "dense bound", "dec/bound", "hit rate", "moved/token", "slots",
                            "equal"]))
    print(f"\nprefill timing: {raw['prefill_timing']}\nbound: {raw['bound']}\n")
    for n in notes:
        print("NOTE: " + n)
    print(table([[k, v] for k, v in metrics.items()], ["metric", "value"]))
    print(table([[k, v] for k, v in checks.items()], ["check", "ok"]))
    png = plot(raw["archs"])
    write_results("offload_infer", metrics, checks, raw, extra_files=[png] if png else [], notes=notes, tag=args.tag)


def plot(archs: dict) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(archs)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, what in ((axes[0], "prefill_ms", "prefill 1x128"), (axes[1], "decode_ms_per_token", "decode, per token")):
        x = range(len(names))
        w = 0.2
        series = [("resident", "#2a2"), ("tiermem", "#369"), ("accelerate", "#c33")]
        for k, (sysname, color) in enumerate(series):
            ys = [archs[a][sysname][key] if sysname in archs[a] else 0 for a in names]
            ax.bar([i + (k - 1) * w for i in x], ys, w, color=color, label=sysname)
        ax.scatter([i for i in x], [archs[a]["tiermem"]["bound_ms"] for a in names], marker="_", s=400, color="k",
                   label="bound: (weights - budget - embeddings) / pinned H2D", zorder=3)
        ax.set_xticks(list(x), names)
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(f"{what}: 25% of the weights on a really small GPU")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = plot_path("offload_infer")
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    main()
