"""bench/train_budget.py's ``finetune`` part (issue 55): a transformers Llama of 1.1B parameters as
fine-tuners train it (transformers' defaults, SDPA attention, ``labels=`` loss, fp32 masters under
``torch.autocast(dtype=torch.bfloat16)``, fused AdamW, 4x2048 tokens), resident, FSDP2's
``CPUOffloadPolicy`` (world size 1), tiermem eager and tiermem graphed, side by side in one process,
at 1/2.5, 1/4 and 1/6 of the training state (tiermem's runs compute the loss with
``chunked_lm_loss``, NOTE [chunked loss]: the same loss, its logits never whole), each tiermem run on a GPU made really small with one plain
cudaMalloc reservation (docs/facts.md).

    python bench/train_budget.py --only finetune            (about 5 minutes on an H200)
    python bench/train_budget.py --only finetune --quick    (a small model: a smoke run)

Adds to the JSON's ``metrics``: finetune_eager_over_resident_2.5, finetune_graphed_over_resident_2.5,
finetune_eager_over_resident_4, finetune_eager_over_resident_6, finetune_fsdp2_over_tiermem_2.5,
finetune_vs_bytes_bound_2.5, finetune_moved_over_bytes_bound_2.5 (NOTE [bytes bound]), finetune_floor_over_state
(the floor traced at the tightest budget that ran); to ``checks``: finetune_all_steps_ran, finetune_losses_ok,
finetune_within_budget, capture_failure_leaves_torch_usable. The bytes bound of a step is the larger
of the resident step plus what the plan recomputes, and the bytes the step moved (in and out) over
the duplex link rate measured in the same run.

The runs ``host_2.5`` and ``host_4`` step streamed blocks on the host (``host_step=True``, NOTE [host
stepping]) and add finetune_host_over_resident_2.5 / _4 and finetune_host_vs_bytes_bound_2.5 / _4. The
run also measures what bounds that design on this machine: ``finetune_host_adamw_ms``, torch's fused
AdamW on the host over every parameter (fp32 masters, gradients and moments in pinned memory, all
the host's threads; timed on a slice and scaled, as the step reads and writes each parameter's bytes
once), and ``finetune_host_stepping_bound``, the least a step with every block stepped on the host
could take over the resident one: the slower of the resident step, the host's AdamW, and the bf16
weights in and bf16 gradients out over the link (each way at its own rate).
"""
from __future__ import annotations

import copy
import gc
import time
import traceback

from _common import median, progress

GiB = 1 << 30


def _sizes(quick: bool) -> dict:
    if quick:
        return dict(hidden=512, ff=1408, layers=4, heads=8, kv=2, vocab=8192, seq=256, batch=4, steps=22, res_steps=6,
                    fsdp_steps=4, graph_steps=34)
    # TinyLlama-1.1B's shape: 1.10B parameters, 17.6 GB of fp32 parameters, gradients and AdamW moments
    return dict(hidden=2048, ff=5632, layers=22, heads=32, kv=4, vocab=32000, seq=2048, batch=4, steps=22,
                res_steps=8, fsdp_steps=6, graph_steps=34)


def _reserve(torch, keep: int) -> list:
    """All but ``keep`` bytes of the card in one plain allocation (docs/facts.md, a really small GPU)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    return [torch.empty(free - keep, dtype=torch.uint8, device="cuda")] if free > keep else []


def part_finetune(kit, torch, tiermem, a, rates, out):
    """``kit``: train_budget's module (its Stepper, Result, adamw and free), passed in as it runs as
    __main__."""
    import transformers
    from _recompute_study import _fsdp

    from tiermem.training.lmloss import chunked_lm_loss
    m, checks, raw = out["metrics"], out["checks"], out["raw"].setdefault("finetune", {})
    z = _sizes(a.quick)
    if a.ft_seq:
        z["seq"] = a.ft_seq
    cfg = transformers.LlamaConfig(hidden_size=z["hidden"], intermediate_size=z["ff"], num_hidden_layers=z["layers"],
                                   num_attention_heads=z["heads"], num_key_value_heads=z["kv"], vocab_size=z["vocab"],
                                   max_position_embeddings=z["seq"])
    t0 = time.perf_counter()
    with torch.device("cuda"):                     # init on the GPU: a 1B model's normal_ on the host is slow
        torch.manual_seed(0)
        template = transformers.LlamaForCausalLM(cfg)
    template = template.cpu().train()              # each run copies it: every run starts from the same weights
    n = sum(p.numel() for p in template.parameters())
    state = 16 * n
    g = torch.Generator(device="cuda").manual_seed(1)
    steps = max(z["steps"], z["graph_steps"], z["res_steps"])
    batches = [torch.randint(0, cfg.vocab_size, (z["batch"], z["seq"]), device="cuda", generator=g)
               for _ in range(steps)]
    s = z["seq"]
    mask = torch.ones(s, s, dtype=torch.bool, device="cuda").tril().expand(z["batch"], 1, s, s)   # built once
    progress(f"finetune: Llama {n / 1e9:.2f}B parameters, training state {state / 1e9:.1f} GB, "
             f"batch {z['batch']}x{z['seq']}, bf16 autocast over fp32 masters, fused AdamW "
             f"({time.perf_counter() - t0:.0f} s to build)")
    raw.update(params=n, state_bytes=state, batch=[z["batch"], z["seq"]])

    def loss_fn(model, ids, with_mask=False):
        kw = {"attention_mask": mask} if with_mask else {}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(input_ids=ids, labels=ids, **kw).loss

    def chunked_loss_fn(model, ids, with_mask=False):
        # NOTE [chunked loss]: the same loss, its logits never whole; what sets the floor otherwise
        kw = {"attention_mask": mask} if with_mask else {}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = model.model(input_ids=ids, **kw).last_hidden_state
            return chunked_lm_loss(model.lm_head, h, ids)

    ok = {"all": True}

    def guarded(label, fn):
        if a.ft_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100000, stacks="python")
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - recorded, the bench goes on
            ok["all"] = False
            progress(f"  {label} failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            raw[f"{label}_error"] = f"{type(e).__name__}: {e}"[:2000]
            raw[f"{label}_traceback"] = traceback.format_exc()[-6000:]
            progress("    " + "\n    ".join(traceback.format_exc().splitlines()[-24:]))
            if a.ft_snapshot:     # torch's allocator history up to the failure, for memory_viz
                torch.cuda.memory._dump_snapshot(f"{a.ft_snapshot}-{label}.pickle")
            return None
        finally:
            if a.ft_snapshot:
                torch.cuda.memory._record_memory_history(enabled=None)

    # -- resident, twice: its own run-to-run spread is what tiermem's losses are held to --------------
    def resident(k):
        model = copy.deepcopy(template).cuda()
        opt = kit.adamw(torch, model.parameters())
        torch.cuda.reset_peak_memory_stats()
        r = kit.Result(kit.Stepper(torch, model, opt, loss_fn).run(batches[: z["res_steps"]], f"resident {k}"))
        peak = torch.cuda.max_memory_reserved()
        del model, opt
        kit.free()
        return r, peak
    res = [guarded(f"resident_{k}", lambda k=k: resident(k)) for k in (1, 2)]
    if res[0] is None:
        return
    resident_ms = min(r.median_ms() for r, _ in res if r is not None)
    want = res[0][0].loss_values()
    spread = max((abs(x - y) for x, y in zip(want, res[1][0].loss_values())), default=0.0) if res[1] else 0.0
    raw.update(resident_ms=round(resident_ms, 2), resident_peak_bytes=res[0][1], resident_spread=spread)
    progress(f"  resident {resident_ms:.1f} ms a step, peak {res[0][1] / 1e9:.1f} GB, run-to-run spread {spread:.2e}")

    # -- FSDP2 with CPUOffloadPolicy, one rank -------------------------------------------------------
    def fsdp_run():
        model = copy.deepcopy(template).cuda()
        model = _fsdp(torch, model, model.model.layers)
        opt = kit.adamw(torch, model.parameters())
        torch.cuda.reset_peak_memory_stats()
        r = kit.Result(kit.Stepper(torch, model, opt, loss_fn).run(batches[: z["fsdp_steps"]], "fsdp2 offload"))
        peak = torch.cuda.max_memory_reserved()
        del model, opt
        kit.free()
        return r, peak
    f = guarded("fsdp2", fsdp_run)
    fsdp_ms = f[0].median_ms(skip=2) if f else None
    if f:
        raw.update(fsdp2_ms=round(fsdp_ms, 2), fsdp2_peak_bytes=f[1])
        progress(f"  FSDP2 CPUOffloadPolicy {fsdp_ms:.1f} ms a step, peak {f[1] / 1e9:.1f} GB")

    # -- tiermem on a really small GPU ----------------------------------------------------------------
    duplex = rates["duplex"] * 1e9
    within, losses_ok = [True], [True]

    def tiered(ratio, graphed, host=False):
        budget = int(state / ratio)
        blob = _reserve(torch, budget + 2 * GiB)         # the card keeps the budget and 2 GiB for CUDA's own
        base = torch.cuda.memory_reserved()
        try:
            tier = tiermem.Tier(0)                       # the default cap: the memory free now
            model = copy.deepcopy(template)              # on the host: the GPU could not hold it
            opt = kit.adamw(torch, model.parameters())
            kw = {"block_bytes": a.ft_block_mib << 20} if a.ft_block_mib else {}
            train = tier.wrap_training(model, opt, budget, host_step=host, **kw)
            label = f"tiermem {'graphed' if graphed else 'host-stepped' if host else 'eager'} 1/{ratio:g}"
            progress(f"  {label}: budget {budget / 1e9:.2f} GB, floor at wrap {train.budget_floor}")
            step = train.graphed(lambda ids: chunked_loss_fn(model, ids, True)) if graphed else None
            times, losses, peaks, moved = [], [], [], []
            for i, ids in enumerate(batches[: z["graph_steps"] if graphed else z["steps"]]):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                try:
                    if graphed:
                        v = step(ids)
                    else:
                        with train.step():
                            v = chunked_loss_fn(model, ids)
                            v.backward()
                except torch.OutOfMemoryError:
                    # NOTE [the floor]: a traced step that runs out says what the floor is at least;
                    # a budget below it is refused, not a step lost above the floor
                    floor = train.budget_floor.bytes if train.budget_floor.at_least else 0
                    if i == 0 and floor > budget:
                        progress(f"  {label}: refused, the floor is at least {floor / 1e9:.2f} GB")
                        try:
                            train.unwrap("cpu")
                        finally:
                            tier.close()
                        return {"below_floor": True, "floor_bytes": floor, "budget_bytes": budget}
                    if i > 0:                            # what the plan expected of the step that ran out
                        progress("    " + "\n    ".join(str(train.plan.table()).splitlines()[:14]))
                    raise
                e1.record()
                e1.synchronize()
                times.append(e0.elapsed_time(e1))
                losses.append(float(v.detach()))
                peaks.append(max(train.resident_peak(), torch.cuda.memory_reserved() - base))
                moved.append(dict(train.moved))
                if i in (0, 4) or (i + 1) % 8 == 0:
                    progress(f"    step {i + 1}: {times[-1]:.1f} ms, loss {losses[-1]:.4f}, "
                             f"moved {moved[-1]['h2d'] / 1e9:.2f} GB in / {moved[-1]['d2h'] / 1e9:.2f} GB out")
            ms = median(times[-8:])
            plan = train.plan
            info = {"ms": round(ms, 2), "losses": losses, "peak_bytes": max(peaks), "budget_bytes": budget,
                    "moved_h2d": moved[-1]["h2d"], "moved_d2h": moved[-1]["d2h"], "floor": str(train.budget_floor),
                    "floor_bytes": train.budget_floor.bytes, "plan": plan.table() if plan is not None else None,
                    "recompute_ms": plan.recompute_ms if plan is not None else 0.0,
                    "bytes_bound": plan.bytes_bound if plan is not None else None,
                    "streamed_blocks": len(plan.streamed_blocks) if plan is not None else None}
            if graphed:
                info.update(captures=step.captures, replays=step.replays, off=step.off)
                step.close()
            progress(f"  {label}: {ms:.1f} ms a step ({ms / resident_ms:.2f}x resident), device peak "
                     f"{max(peaks) / 1e9:.2f} GB of {budget / 1e9:.2f}" + (f", {step.replays} replays" if graphed else ""))
            within[0] &= max(peaks) <= budget
            # within the resident run's own spread, or 2e-3 of the loss where it repeated itself
            # closer than that (SDPA's backward and autocast's casts under another plan)
            tol = max(2 * spread, 2e-3 * max(abs(x) for x in want))
            diff = max(abs(x - y) for x, y in zip(losses, want))
            info.update(losses_max_diff=diff, losses_tolerance=tol)
            losses_ok[0] &= diff <= tol
            train.unwrap("cpu")
            tier.close()
            model = opt = train = step = None        # their memory goes before the next run
            return info
        finally:
            del blob
            kit.free()

    runs = {}
    for key in a.ft_runs.split(","):
        kind, ratio = key.split("_")
        ratio, graphed = float(ratio), kind == "graphed"
        runs[key] = guarded(key, lambda ratio=ratio, graphed=graphed, host=kind == "host": tiered(ratio, graphed, host))
    raw["tiermem"] = runs
    below = {k: r["floor_bytes"] for k, r in runs.items() if r and r.get("below_floor")}
    raw["below_floor"] = below
    e25, g25, e4, e6, h25, h4 = (None if k in below else runs.get(k)
                                 for k in ("eager_2.5", "graphed_2.5", "eager_4", "eager_6", "host_2.5", "host_4"))
    if e25:
        m["finetune_eager_over_resident_2.5"] = round(e25["ms"] / resident_ms, 3)
        bound = max(resident_ms + e25["recompute_ms"], (e25["moved_h2d"] + e25["moved_d2h"]) / duplex * 1e3)
        raw["bytes_bound_2.5_ms"] = round(bound, 2)
        m["finetune_vs_bytes_bound_2.5"] = round(e25["ms"] / bound, 3)
        if e25["bytes_bound"]:
            # NOTE [bytes bound]: what the plan moved against the least any plan of that budget moves
            m["finetune_moved_over_bytes_bound_2.5"] = round((e25["moved_h2d"] + e25["moved_d2h"])
                                                             / e25["bytes_bound"], 3)
    # the floor is the traced step's at the tightest budget that ran (a looser cap lets torch's cache hold more)
    tight = next((r for r in (e6, e4, e25, h4, h25) if r), None)
    if tight:
        m["finetune_floor_over_state"] = round(tight["floor_bytes"] / state, 4)
    if g25 and g25.get("replays"):
        m["finetune_graphed_over_resident_2.5"] = round(g25["ms"] / resident_ms, 3)
    if e4:
        m["finetune_eager_over_resident_4"] = round(e4["ms"] / resident_ms, 3)
    if e6:
        m["finetune_eager_over_resident_6"] = round(e6["ms"] / resident_ms, 3)
    for key, r in (("2.5", h25), ("4", h4)):    # NOTE [host stepping]
        if r:
            m[f"finetune_host_over_resident_{key}"] = round(r["ms"] / resident_ms, 3)
            bound = max(resident_ms + r["recompute_ms"], (r["moved_h2d"] + r["moved_d2h"]) / duplex * 1e3)
            m[f"finetune_host_vs_bytes_bound_{key}"] = round(r["ms"] / bound, 3)
    best = min((r["ms"] for r in (e25, g25, h25) if r and (r is not g25 or r.get("replays"))), default=None)
    if fsdp_ms and best:
        m["finetune_fsdp2_over_tiermem_2.5"] = round(fsdp_ms / best, 3)
    try:                 # a measurement beside the runs: its failure is reported, not a run's
        host_ms = host_adamw_ms(torch, n)
    except Exception as e:  # noqa: BLE001
        host_ms = None
        raw["host_adamw_error"] = f"{type(e).__name__}: {e}"[:2000]
        progress(f"  host AdamW failed: {type(e).__name__}: {e}")
    if host_ms:
        link_ms = 2 * n / min(rates["h2d"], rates["d2h"]) / 1e6
        m["finetune_host_adamw_ms"] = round(host_ms, 1)
        m["finetune_host_stepping_bound"] = round(max(resident_ms, host_ms, link_ms) / resident_ms, 3)
        progress(f"  host AdamW over {n / 1e9:.2f}B parameters: {host_ms:.0f} ms ({torch.get_num_threads()} threads); "
                 f"a step on the host is at least {m['finetune_host_stepping_bound']:.2f}x resident")
    checks["capture_failure_leaves_torch_usable"] = bool(guarded("capture_failure", lambda: _capture_failure(
        torch, tiermem, transformers)))
    checks["finetune_all_steps_ran"] = ok["all"]
    checks["finetune_losses_ok"] = ok["all"] and losses_ok[0]
    checks["finetune_within_budget"] = ok["all"] and within[0]


def host_adamw_ms(torch, params: int, slice_params: int = 1 << 27, parts: int = 4) -> float:
    """torch's fused AdamW on the host over ``params`` fp32 parameters, ms a step: timed over
    ``slice_params`` of them (``parts`` tensors, pinned, with gradients) as the median of three
    steps after one, and scaled to ``params`` (each step reads and writes every parameter's
    bytes once, so its time goes with their number)."""
    n = max(1, min(params, slice_params) // parts)
    pin = torch.cuda.is_available()
    ps = [torch.zeros(n, pin_memory=pin).requires_grad_() for _ in range(parts)]
    for p in ps:
        p.grad = torch.full((n,), 1e-3).pin_memory() if pin else torch.full((n,), 1e-3)
    opt = torch.optim.AdamW(ps, lr=1e-4, fused=True)
    opt.step()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    return median(times) * 1e3 * params / (n * parts)


def _capture_failure(torch, tiermem, transformers) -> bool:
    """A capture that fails (a small Llama with its defaults under autocast, its loss read on the
    host inside the step), then torch as it was: no private pool
    left, a seeded model built twice draws the same values. The budget is half the model's
    training state, or a quarter above its floor where that is more: the floor is asked of a
    training wrapped first with room and traced once (NOTE [the floor]); a budget guessed below it
    is refused at wrap, and the capture never tried."""
    cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, vocab_size=8192,
                                   max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    state = 16 * sum(p.numel() for p in model.parameters())
    g = torch.Generator(device="cuda").manual_seed(2)

    def ids():
        return torch.randint(0, cfg.vocab_size, (2, 128), device="cuda", generator=g)

    def loss(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            v = model(input_ids=x, labels=x).loss
        # a host read inside the step, as a loop that skips non-finite losses makes: a capture
        # cannot hold it (cudaErrorStreamCaptureUnsupported), so the capture fails every time
        if not bool(torch.isfinite(v)):
            raise FloatingPointError("loss is not finite")
        return v
    tier = tiermem.Tier(0, cap="4GiB")
    probe = tier.wrap_training(model, opt, 2 * state, block_bytes=1 << 20)
    with probe.step():
        loss(ids()).backward()
    floor = probe.budget_floor.bytes
    probe.unwrap()
    probe = None
    budget = max(state // 2, floor + floor // 4)
    progress(f"  capture failure: state {state / 1e6:.0f} MB, floor {floor / 1e6:.0f} MB, budget {budget / 1e6:.0f} MB")
    train = tier.wrap_training(model, opt, budget, block_bytes=1 << 20)
    step = train.graphed(loss)
    for _ in range(40):
        step(ids())
        if step.off:
            break
    refused = step.graph is None and step.off.startswith("the capture failed")
    progress(f"  capture refused: {refused} ({step.off[:160]})")
    step.close()
    train.unwrap()
    tier.close()
    model = opt = train = step = None            # their memory goes before the pools are read
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    pools = [seg for seg in torch.cuda.memory_snapshot() if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)]

    def seeded():
        torch.manual_seed(1234)
        lin = torch.nn.Linear(64, 64, device="cuda")
        torch.nn.init.normal_(lin.weight)
        return lin.weight.detach().clone(), torch.rand(8, device="cuda")
    (w1, r1), (w2, r2) = seeded(), seeded()
    usable = torch.equal(w1, w2) and torch.equal(r1, r2) and not pools
    progress(f"  after it: private pools left {len(pools)}, seeded draws repeat {usable}")
    return refused and usable
