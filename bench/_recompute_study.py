"""Part 4 of bench/train_budget.py: keep, swap or recompute (NOTE [recompute plan] in tiermem/training/plan.py).

For the GPT-style model and a transformers Qwen2-style model (its default flags, but eager
attention: see DETERMINISM), side by side in one process:
  - resident PyTorch (no cap), eagerly, and captured whole as one CUDA graph (ResidentGraph)
    where tiermem's step is graphed too;
  - torch FSDP2 with CPUOffloadPolicy on one GPU (world size 1);
  - torch's save_on_cpu for the activations;
  - torch's activation checkpointing on every block (non-reentrant), all else resident;
  - tiermem's swap-only plan (recompute="never") and its new plan (recompute="auto") at budgets of
    1/1.5, 1/2.5 and 1/4 of the training state (fp32 parameters, gradients, AdamW's two moments).

Every contender runs the same step code: the same loss function over the same batches. The
Qwen2 model's loss passes the 4-D causal mask built once (causal_mask), for all of them: the
whole-step graph needs it (transformers builds its own mask with a host copy no graph can
capture), and a contender that built the mask each step would be timed on different work.
"""
from __future__ import annotations

from _common import progress

from tiermem.training.choice import PROBE_STEPS, VERIFY_STEPS
from tiermem.training.graphchoice import REPLAYS_TIMED
from tiermem.training.stepgraph import SETTLED_STEPS

GiB, MiB = 1 << 30, 1 << 20
RATIOS = (1.5, 2.5, 4.0)
# steps before the plan settles (NOTE [measured choice]): the trace, the probe's, the check's,
# and a changed plan's first; a kept plan checked again later times from its last change
# (Result.settled in train_budget.py)
SETTLE = 1 + PROBE_STEPS + VERIFY_STEPS + 1
# steps the whole-step graph's run takes beyond the others' (the batches again): a plan its
# replays change (NOTE [graph choice]) settles, is captured again and replays in them, twice
# where the plan tried gives way to the first, and the last capture replays a few more
GRAPH_EXTRA = 2 * (REPLAYS_TIMED + 2 + SETTLED_STEPS + 1) + 4

# NOTE: DETERMINISM
# Losses are compared bitwise with the resident run, which needs the same kernels to give the
# same bits twice. The GPT's attention is matmuls and a softmax (deterministic with
# CUBLAS_WORKSPACE_CONFIG set). transformers' default attention is SDPA, whose flash and
# memory-efficient backward kernels add into dQ with atomics unless determinism is enforced
# without warn_only (which other ops here refuse); the study runs the Qwen2 model with
# attn_implementation="eager" so both runs are comparable bit for bit.


def qwen2(torch, a):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=a.hf_vocab, hidden_size=a.hf_d, intermediate_size=a.hf_ff,
                      num_hidden_layers=a.hf_layers, num_attention_heads=a.hf_heads, num_key_value_heads=a.hf_kv,
                      max_position_embeddings=a.seq, tie_word_embeddings=False, attn_implementation="eager",
                      use_cache=False)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).cuda()          # requires_grad=True everywhere: the default


def hf_loss(model, ids):
    import torch.nn.functional as F
    logits = model(input_ids=ids[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def causal_mask(torch, ids, dtype):
    """The 4-D additive causal mask transformers' eager attention builds for ``ids[:, :-1]`` (0
    where a position may attend, the dtype's lowest value elsewhere), built once. Passed as the
    attention mask, it is used as it is: transformers builds its own each forward with a
    pageable host-to-device copy of a scalar, which no CUDA graph can capture."""
    n = ids.shape[1] - 1
    allowed = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
    mask = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype, device=ids.device).masked_fill(allowed, 0.0)
    return mask.expand(ids.shape[0], 1, n, n)


def hf_graph_loss(mask):
    """hf_loss with the attention mask built once (causal_mask): a step CUDA graphs can capture."""
    def loss(model, ids):
        import torch.nn.functional as F
        logits = model(input_ids=ids[:, :-1], attention_mask=mask).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return loss


class ResidentGraph:
    """The resident step captured whole as one CUDA graph, as torch.cuda.graphs' whole-network
    recipe has it: ``warm`` eager steps on a side stream, then forward, backward and the
    optimizer's step captured once and replayed for each later batch (copied into the captured
    input). It is resident's answer to tiermem's ``train.graphed``: the host's work taken out of
    both. Each step is timed with CUDA events as Stepper times its steps; its fields are those
    train_budget's Result reads."""

    def __init__(self, torch, model, opt, loss_fn, warm: int = 3):
        self.torch, self.model, self.opt, self.loss_fn, self.warm = torch, model, opt, loss_fn, warm
        self.graph = self.static = self.static_loss = None
        self.side = torch.cuda.Stream()
        self.losses, self.times, self.moved, self.gc_ms = [], [], [], []

    def _capture(self, batch) -> None:
        torch = self.torch
        self.static = batch.clone()
        self.opt.zero_grad(set_to_none=True)     # the capture's backward assigns the gradients: replays do not add
        # torch's optimizers refuse a capture unless their groups say capturable; a fused
        # AdamW's step is the same kernels either way (its step counts are device tensors)
        flipped = [g for g in self.opt.param_groups if g.get("fused") and g.get("capturable") is False]
        for g in flipped:
            g["capturable"] = True
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.static_loss = self.loss_fn(self.model, self.static)
                self.static_loss.backward()
                self.opt.step()
        finally:
            for g in flipped:
                g["capturable"] = False
        self.graph = graph

    def step(self, batch):
        torch = self.torch
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        if len(self.times) < self.warm:
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                loss = self.loss_fn(self.model, batch)
                loss.backward()
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
            torch.cuda.current_stream().wait_stream(self.side)
        else:
            if self.graph is None:
                self._capture(batch)
            self.static.copy_(batch)
            self.graph.replay()
            loss = self.static_loss.clone()
        b.record()
        b.synchronize()
        self.times.append(a.elapsed_time(b) / 1e3)
        self.gc_ms.append(0.0)
        self.moved.append({"h2d": 0, "d2h": 0})
        self.losses.append(loss.detach())

    def run(self, batches, label):
        for i, bt in enumerate(batches):
            self.step(bt)
            if i in (0, self.warm, len(batches) - 1) or (i + 1) % 10 == 0:
                progress(f"  {label}: step {i + 1}/{len(batches)} {self.times[-1] * 1e3:.1f} ms")
        return self

    def loss_values(self):
        return [float(x) for x in self.torch.stack(self.losses).cpu()]


def probe_model(torch, name):
    """The probes' model of part 4, "gpt" or "hf" (Qwen2-style), at part 4's shapes: its builder,
    loss, layers, and one fixed batch of 4 x 513 token ids on the GPU."""
    import argparse
    if name == "hf":
        a = argparse.Namespace(hf_vocab=8192, hf_d=1024, hf_ff=2816, hf_layers=20, hf_heads=16, hf_kv=4, seq=512)
        build, loss_fn, layers, vocab = (lambda: qwen2(torch, a)), hf_loss, (lambda m: list(m.model.layers)), a.hf_vocab
    else:
        from tiermem.testing import GPT, GPTConfig
        cfg = GPTConfig(vocab=8192, seq=512, d=1024, layers=16, heads=16)

        def build():
            torch.manual_seed(0)
            return GPT(cfg).cuda()

        def loss_fn(model, ids):
            logits = model(ids[:, :-1])
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        layers, vocab = (lambda m: list(m.blocks)), cfg.vocab
    g = torch.Generator(device="cuda").manual_seed(1)
    return build, loss_fn, layers, torch.randint(0, vocab, (4, 513), device="cuda", generator=g)


def _checkpointed(torch, model, blocks):
    """torch's activation checkpointing on every block, the way users add it."""
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    for b in blocks:
        f = b.forward
        b.forward = lambda *x, f=f, **k: torch.utils.checkpoint.checkpoint(f, *x, use_reentrant=False, **k)
    return model


def _fsdp(torch, model, blocks):
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    for b in blocks:
        fully_shard(b, offload_policy=CPUOffloadPolicy())
    fully_shard(model, offload_policy=CPUOffloadPolicy())
    return model


def study(kit, torch, tiermem, name, build, blocks_of, loss_fn, batches, a, rates, out):
    """One model: the peers, then tiermem's two plans at each budget. ``kit``: train_budget's
    module (its Stepper, Result, tiermem_run and free), passed in as it runs as __main__."""
    Result, Stepper, free, tiermem_run = kit.Result, kit.Stepper, kit.free, kit.tiermem_run
    m, raw = out["metrics"], out["raw"].setdefault("recompute_study", {})
    model = build()
    n = sum(p.numel() for p in model.parameters())
    footprint = 16 * n
    progress(f"part 4: {name}, {n / 1e6:.0f}M parameters, training state {footprint / 1e9:.2f} GB, "
             f"batch {tuple(batches[0].shape)}")
    opt = kit.adamw(torch, model.parameters())
    torch.cuda.reset_peak_memory_stats()
    res = Result(Stepper(torch, model, opt, loss_fn).run(batches, f"{name} resident"))
    resident_ms, resident_peak, want = res.median_ms(), torch.cuda.max_memory_reserved(), res.loss_values()
    raw[f"{name}_resident_gc"] = {"gc_ms_per_step": round(res.gc_ms_per_step(), 2), "mean_ms": round(res.mean_ms(), 2)}
    del model, opt
    free()
    peers = {"resident": resident_ms}
    if 2.5 in a.ratios:
        # where tiermem's step is graphed (below), resident's is too: the same step code, captured
        model = build()
        opt = kit.adamw(torch, model.parameters())
        try:
            rg = ResidentGraph(torch, model, opt, loss_fn)
            r = Result(rg.run(batches, f"{name} resident, whole-step graph"))
            peers["resident_graphed"] = r.median_ms(skip=rg.warm + 1)
            raw[f"{name}_resident_graphed"] = {"step_ms": round(peers["resident_graphed"], 2),
                                               "losses_equal_eager": r.loss_values() == want,
                                               "timed_from_step": rg.warm + 2}
        except Exception as e:       # the contender's own limit is reported; the rest still runs
            progress(f"  {name} resident, whole-step graph: {type(e).__name__}: {str(e)[:240]}")
            raw[f"{name}_resident_graphed"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        del model, opt
        free()
    for label in ("checkpoint", "save_on_cpu", "fsdp_offload"):
        def peer(make_opt):
            model = build()
            if label == "checkpoint":
                model = _checkpointed(torch, model, blocks_of(model))
            if label == "fsdp_offload":
                model = _fsdp(torch, model, blocks_of(model))
            opt = make_opt(model.parameters())
            torch.cuda.reset_peak_memory_stats()
            st = Stepper(torch, model, opt, loss_fn, save_on_cpu=label == "save_on_cpu")
            return Result(st.run(batches[: a.peer_steps], f"{name} {label}"))
        try:
            r = peer(lambda ps: kit.adamw(torch, ps))
        except (RuntimeError, TypeError) as e:
            if label != "fsdp_offload" or kit.ADAMW.get("foreach"):
                raise
            # the peer's own limit: its CPU-held DTensor parameters may not take the fused kernel
            progress(f"  {name} {label}: fused AdamW failed ({str(e)[:160]}); foreach instead")
            raw[f"{name}_{label}_adamw"] = "foreach (fused failed)"
            free()
            r = peer(lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True))
        peers[label] = r.median_ms(skip=2)
        raw[f"{name}_{label}_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        del r
        free()
    rate = min(rates["h2d"], rates["d2h"])
    runs = {}
    for ratio in a.ratios:
        budget = int(footprint / ratio)
        for mode in ("never", "auto"):
            full = ratio == 2.5 and mode == "auto"
            steps = batches if full else batches[: a.plan_steps]
            try:
                r, info = tiermem_run(torch, tiermem, build, loss_fn, steps, budget, f"{name} 1/{ratio:g} {mode}",
                                      block_bytes=a.block4_mib * MiB, recompute=mode, link_GBps=rate)
            except (torch.OutOfMemoryError, tiermem.OutOfBudgetError) as e:
                # torch's allocator ran out under the cap, or tiermem refused a budget that does
                # not hold the traced step (NOTE [fewer slots])
                progress(f"  {name} 1/{ratio:g} {mode}: out of memory ({str(e)[:240]})")
                free()
                runs[(ratio, mode)] = {"step_ms": float("nan"), "predicted_ms": float("nan"), "moved": 0, "peak": 0,
                                       "budget": budget, "recomputed": 0, "kind": "oom", "losses_equal": False}
                raw[f"{name}_{ratio:g}_{mode}"] = runs[(ratio, mode)]
                continue
            pred = info["predicted_ms"]
            # the plan settles after the trace, the probe and the check (NOTE [measured choice]):
            # steps 1-5, and a step more if the check changed the plan
            skip = r.settled(SETTLE)
            meas = r.median_ms(skip=skip)
            mv = r.moved[-1]
            runs[(ratio, mode)] = {"step_ms": meas, "predicted_ms": pred, "moved": mv["h2d"] + mv["d2h"],
                                   "mean_ms": round(r.mean_ms(skip=skip), 2), "timed_from_step": skip + 1,
                                   "gc_ms_per_step": round(r.gc_ms_per_step(skip=skip), 2),
                                   "peak": info["resident_peak_bytes"], "budget": budget,
                                   "recomputed": info["recomputed"], "kind": info["kind"],
                                   "losses_equal": r.loss_values() == want[: len(steps)]}
            raw[f"{name}_{ratio:g}_{mode}"] = dict(runs[(ratio, mode)], plan=info["plan"], checked=info["measured"],
                                                   report=info["report"])
            progress(f"  {name} 1/{ratio:g} {mode}: {meas:.1f} ms (predicted {pred:.1f}; mean "
                     f"{r.mean_ms(skip=skip):.1f}, garbage collection {r.gc_ms_per_step(skip=skip):.2f} ms a step), "
                     f"{info['recomputed']} blocks recomputed, plan {info['kind']}")
    if 2.5 in a.ratios:
        # NOTE [replayed recompute]: the same budget with the recomputed blocks' backwards replayed
        budget = int(footprint / 2.5)
        try:
            r, info = tiermem_run(torch, tiermem, build, loss_fn, batches[: a.plan_steps], budget,
                                  f"{name} 1/2.5 auto, graphs", block_bytes=a.block4_mib * MiB, recompute="auto",
                                  link_GBps=rate, graphs=True)
        except torch.OutOfMemoryError as e:
            # a step lost beside the graphs' pool: what graphs=True must not do; recorded, not hidden
            progress(f"  {name} 1/2.5 auto, graphs: out of memory ({str(e)[:240]})")
            free()
            raw[f"{name}_2.5_auto_graphs"] = {"kind": "oom", "error": str(e)[:400]}
            out["checks"][f"{name}_graphs_no_step_lost"] = False
            r = None
        if r is not None:
            out["checks"][f"{name}_graphs_no_step_lost"] = True
            _graph_row(a, name, r, info, budget, want, resident_ms, runs, raw, m)
        # NOTE [whole-step graphs]: the same budget, the whole step captured once and replayed;
        # NOTE [graph choice]: a plan the replays change is captured again; its replays need steps too
        r, info = tiermem_run(torch, tiermem, build, loss_fn, batches + batches[:GRAPH_EXTRA], budget,
                              f"{name} 1/2.5 auto, whole-step graph", block_bytes=a.block4_mib * MiB,
                              recompute="auto", link_GBps=rate, graphed=loss_fn)
        _step_graph_row(name, r, info, budget, want, resident_ms, peers, runs, raw, m, out["checks"])
    main = runs[(2.5, "auto")]
    m.update({
        f"{name}_state_bytes": footprint,
        f"{name}_resident_ms": round(resident_ms, 2),
        f"{name}_resident_peak_reserved_bytes": resident_peak,
        **{f"{name}_{k}_ms": round(v, 2) for k, v in peers.items() if k != "resident"},
        **{f"{name}_{mode}_{ratio:g}_ms": round(runs[(ratio, mode)]["step_ms"], 2) for ratio in a.ratios
           for mode in ("never", "auto")},
        f"{name}_step_over_resident": round(main["step_ms"] / resident_ms, 3),
        f"{name}_swap_only_over_resident": round(runs[(2.5, "never")]["step_ms"] / resident_ms, 3),
        f"{name}_fsdp_offload_over_tiermem": round(peers["fsdp_offload"] / main["step_ms"], 3),
        f"{name}_checkpoint_over_resident": round(peers["checkpoint"] / resident_ms, 3),
        f"{name}_plan_error_max": round(max(abs(v["predicted_ms"] - v["step_ms"]) / v["step_ms"] for v in runs.values()
                                            if "moved" in v), 3),
        f"{name}_plan_error_2_5": round(abs(main["predicted_ms"] - main["step_ms"]) / main["step_ms"], 3),
        f"{name}_bytes_moved_per_state_byte": round(main["moved"] / footprint, 3),
        f"{name}_swap_only_bytes_moved_per_state_byte": round(runs[(2.5, "never")]["moved"] / footprint, 3),
    })
    if a.bf16_states:
        # NOTE [bf16 moments]: the same plan with the moments held and moved as bf16; its losses
        # are close to resident's, not equal, so they are compared by their largest relative gap
        budget = int(footprint / 2.5)
        r, info = tiermem_run(torch, tiermem, build, loss_fn, batches, budget, f"{name} 1/2.5 auto bf16 states",
                              block_bytes=a.block4_mib * MiB, recompute="auto", link_GBps=rate,
                              state_dtype=torch.bfloat16)
        meas, mv = r.median_ms(skip=r.settled(SETTLE)), r.moved[-1]
        gap = max(abs(x - y) / abs(y) for x, y in zip(r.loss_values(), want))
        runs[(2.5, "auto_bf16")] = {"step_ms": meas, "predicted_ms": info["predicted_ms"],
                                    "moved": mv["h2d"] + mv["d2h"], "peak": info["resident_peak_bytes"],
                                    "budget": budget, "recomputed": info["recomputed"], "kind": info["kind"],
                                    "losses_equal": r.loss_values() == want, "loss_max_rel_gap": gap}
        raw[f"{name}_2.5_auto_bf16"] = dict(runs[(2.5, "auto_bf16")], plan=info["plan"], checked=info["measured"])
        progress(f"  {name} 1/2.5 auto, bf16 states: {meas:.1f} ms (predicted {info['predicted_ms']:.1f}), "
                 f"largest loss gap {gap:.2e}")
        m.update({f"{name}_bf16_states_2_5_ms": round(meas, 2),
                  f"{name}_bf16_states_over_resident": round(meas / resident_ms, 3),
                  f"{name}_bf16_states_bytes_moved_per_state_byte": round((mv["h2d"] + mv["d2h"]) / footprint, 3),
                  f"{name}_bf16_states_loss_max_rel_gap": gap,
                  f"{name}_fsdp_offload_over_bf16_states": round(peers["fsdp_offload"] / meas, 3)})
    out["checks"][f"{name}_losses_equal_resident"] = main["losses_equal"]
    out["checks"][f"{name}_resident_within_budget"] = all(v["peak"] <= v["budget"] for v in runs.values())
    return runs, peers


def _graph_row(a, name, r, info, budget, want, resident_ms, runs, raw, m):
    """The 1/2.5 run with graphs=True (NOTE [replayed recompute]): its row and metrics."""
    meas = r.median_ms(skip=r.settled(SETTLE))
    runs[(2.5, "auto_graphs")] = {"step_ms": meas, "predicted_ms": info["predicted_ms"],
                                 "peak": info["resident_peak_bytes"], "budget": budget,
                                 "recomputed": info["recomputed"], "kind": info["kind"],
                                 "losses_equal": r.loss_values() == want[: a.plan_steps]}
    raw[f"{name}_2.5_auto_graphs"] = dict(runs[(2.5, "auto_graphs")], plan=info["plan"], checked=info["measured"],
                                          report=info["report"])
    progress(f"  {name} 1/2.5 auto, graphs: {meas:.1f} ms, {info['recomputed']} blocks recomputed, "
             f"{info['report']['replayed_backwards']} backwards replayed"
             + (f", graphs off: {info['report']['graphs_off'][:160]}" if info['report']['graphs_off'] else ""))
    m[f"{name}_auto_graphs_2.5_ms"] = round(meas, 2)
    m[f"{name}_graphs_over_resident"] = round(meas / resident_ms, 3)


def _step_graph_row(name, r, info, budget, want, resident_ms, peers, runs, raw, m, checks):
    """The 1/2.5 run with the whole step replayed as one graph (NOTE [whole-step graphs]): timed
    over its replays (the steps before the capture are the eager plan's), its row and metrics."""
    from tiermem.training.stepgraph import PLAN_CHANGED
    g = info["graphed"]
    first = len(r.times) - g["last_replays"]            # the last capture's replays (NOTE [graph choice])
    meas = r.median_ms(skip=first + 1) if g["last_replays"] > 1 else float("nan")
    mv = r.moved[-1]
    got = info["measured"]
    runs[(2.5, "graphed")] = {"step_ms": meas, "moved_bytes": mv["h2d"] + mv["d2h"],
                              "peak": info["resident_peak_bytes"], "budget": budget,
                              "recomputed": info["recomputed"], "kind": info["kind"],
                              "losses_equal": r.loss_values()[: len(want)] == want, "timed_from_step": first + 2,
                              "graph_choice": got.get("chosen_by") == "graph" and "tried, kept"
                              or "tried_replay_ms" in got and "tried, back"
                              or "graph_refuted_ms" in got and "kept, the eager steps refuting the other"
                              or "kept"}
    # the graphed step's plan error: the fitted model's prediction of the plan the replays tried
    tried = (got.get("graph_predicted_ms"), got.get("replay_ms")) if got.get("chosen_by") == "graph" else \
        (got.get("tried_predicted_ms"), got.get("tried_replay_ms"))
    if tried[0] and tried[1]:
        m[f"{name}_graphed_plan_error"] = round(abs(tried[0] - tried[1]) / tried[1], 3)
    raw[f"{name}_2.5_graphed"] = dict(runs[(2.5, "graphed")], plan=info["plan"], graphed=g)
    progress(f"  {name} 1/2.5 auto, whole-step graph: {meas:.1f} ms over {g['last_replays']} replays "
             f"({meas / resident_ms:.2f}x resident), captures {g['captures']}, plan by replays: "
             f"{runs[(2.5, 'graphed')]['graph_choice']} "
             f"({ {k: v for k, v in got.items() if any(w in k for w in ('replay', 'tried', 'refuted'))} })"
             + (f", off: {g['off'][:160]}" if g["off"] else ""))
    m[f"{name}_graphed_2.5_ms"] = round(meas, 2)
    m[f"{name}_graphed_over_resident"] = round(meas / resident_ms, 3)
    m[f"{name}_fsdp_offload_over_graphed"] = round(peers["fsdp_offload"] / meas, 3)
    if "resident_graphed" in peers:
        m[f"{name}_resident_graphed_ms"] = round(peers["resident_graphed"], 2)
        m[f"{name}_graphed_over_resident_graphed"] = round(meas / peers["resident_graphed"], 3)
    checks[f"{name}_graphed_losses_equal_resident"] = runs[(2.5, "graphed")]["losses_equal"]
    checks[f"{name}_graphed_within_budget"] = runs[(2.5, "graphed")]["peak"] <= budget
    checks[f"{name}_graphed_replayed"] = g["captures"] >= 1 and g["last_replays"] > 1 and \
        all(d == PLAN_CHANGED for d in g["drops"])


def arena_study(kit, torch, name, build, loss_fn, batches, out):
    """NOTE [lifetime arena]: one resident step (after two that make the optimizer's states and
    warm torch's cache) under torch's allocator history; its temporaries laid out by plan_arena.
    The figure is (bytes alive all step + the arena's peak) over torch's peak reserved bytes in
    that step: what the planned layout would need against what torch's caching allocator held."""
    from tiermem.planning import plan_arena, temps_from_trace
    model = build()
    opt = kit.adamw(torch, model.parameters())

    for i, bt in enumerate(batches[:3]):
        if i == 2:                      # the third step is recorded
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                     max_entries=1 << 22)
        loss_fn(model, bt).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    reserved, allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
    temps, before = temps_from_trace(snap["device_traces"][torch.cuda.current_device()])
    plan = plan_arena(temps)
    static = start - before
    m = out["metrics"]
    m[f"{name}_arena_peak_over_torch_reserved"] = round((static + plan.peak) / reserved, 3)
    m[f"{name}_arena_peak_over_torch_allocated_peak"] = round((static + plan.peak) / allocated, 3)
    out["raw"].setdefault("arena", {})[name] = {
        "temporaries": len(temps), "static_bytes": static, "arena_peak_bytes": plan.peak,
        "live_peak_bytes": plan.live_peak, "torch_peak_reserved_bytes": reserved,
        "torch_peak_allocated_bytes": allocated}
    progress(f"part 4: {name} arena: {len(temps)} temporaries, arena {plan.peak / 1e9:.3f} GB (live peak "
             f"{plan.live_peak / 1e9:.3f}) + {static / 1e9:.3f} GB alive all step, against torch's peak reserved "
             f"{reserved / 1e9:.3f} GB (allocated {allocated / 1e9:.3f})")
    del model, opt, snap
    torch.cuda.empty_cache()


def part4(kit, torch, tiermem, a, rates, out):
    from tiermem.testing import GPTConfig
    build_gpt, gpt_batches, gpt_loss = kit.build_gpt, kit.gpt_batches, kit.gpt_loss
    cfg = GPTConfig(vocab=a.vocab, seq=a.seq, d=a.d, layers=a.layers, heads=a.heads)
    gb = gpt_batches(torch, cfg, a.steps, a.batch)
    hcfg = GPTConfig(vocab=a.hf_vocab, seq=a.seq, d=a.hf_d, layers=a.hf_layers, heads=a.hf_heads)
    if a.arena:
        arena_study(kit, torch, "gpt", lambda: build_gpt(torch, cfg), gpt_loss, gb, out)
        arena_study(kit, torch, "hf", lambda: qwen2(torch, a), hf_loss, gpt_batches(torch, hcfg, 3, a.batch, seed=2), out)
        m = out["metrics"]
        m["arena_peak_over_torch_reserved"] = max(m["gpt_arena_peak_over_torch_reserved"],
                                                  m["hf_arena_peak_over_torch_reserved"])
        if a.arena_only:
            return
    g_runs = study(kit, torch, tiermem, "gpt", lambda: build_gpt(torch, cfg), lambda m: list(m.blocks), gpt_loss,
                   gb, a, rates, out)
    del gb
    hb = gpt_batches(torch, hcfg, a.steps, a.batch, seed=2)
    hf_step = hf_graph_loss(causal_mask(torch, hb[0], torch.float32))   # every contender's loss: the mask built once
    h_runs = study(kit, torch, tiermem, "hf", lambda: qwen2(torch, a), lambda m: list(m.model.layers), hf_step,
                   hb, a, rates, out)
    m = out["metrics"]
    m["fsdp_offload_over_tiermem"] = min(m["gpt_fsdp_offload_over_tiermem"], m["hf_fsdp_offload_over_tiermem"])
    m["plan_error"] = max(m["gpt_plan_error_2_5"], m["hf_plan_error_2_5"])
    if "gpt_graphed_over_resident" in m and "hf_graphed_over_resident" in m:
        m["graphed_over_resident"] = max(m["gpt_graphed_over_resident"], m["hf_graphed_over_resident"])
        if "gpt_graphed_over_resident_graphed" in m and "hf_graphed_over_resident_graphed" in m:
            m["graphed_over_resident_graphed"] = max(m["gpt_graphed_over_resident_graphed"],
                                                     m["hf_graphed_over_resident_graphed"])
        m["fsdp_offload_over_graphed"] = min(m["gpt_fsdp_offload_over_graphed"], m["hf_fsdp_offload_over_graphed"])
    m["bytes_moved_per_state_byte"] = m["gpt_bytes_moved_per_state_byte"]
    c = out["checks"]
    c["losses_equal_resident"] = c.get("losses_equal_resident", True) and c["gpt_losses_equal_resident"] and \
        c["hf_losses_equal_resident"]
    c["resident_within_budget"] = c.get("resident_within_budget", True) and c["gpt_resident_within_budget"] and \
        c["hf_resident_within_budget"]
    out["raw"]["recompute_runs"] = {n: {f"{k[0]:g}_{k[1]}": v for k, v in r[0].items()} | {"peers": r[1]}
                                    for n, r in (("gpt", g_runs), ("hf", h_runs))}


def plot4(out, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib missing: no plot")
        return None
    runs = out["raw"].get("recompute_runs", {})
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    for ax, (name, r) in zip(axes[0], runs.items()):
        peers = r["peers"]
        ratios = [x for x in RATIOS if f"{x:g}_never" in r]
        for mode, style in (("never", "s--"), ("auto", "o-")):
            xs = [1 / ratio for ratio in ratios]
            ys = [r[f"{ratio:g}_{mode}"]["step_ms"] for ratio in ratios]
            ax.plot(xs, ys, style, label=f"tiermem {'swap only' if mode == 'never' else 'keep/swap/recompute'}")
        if "2.5_graphed" in r:
            ax.plot([1 / 2.5], [r["2.5_graphed"]["step_ms"]], "*", ms=12, color="tab:orange",
                    label="tiermem, whole-step graph")
        if "2.5_auto_bf16" in r:
            ax.plot([1 / 2.5], [r["2.5_auto_bf16"]["step_ms"]], "D", color="k", label="tiermem, bf16 moments")
        for label, color in (("resident", "g"), ("resident_graphed", "y"), ("checkpoint", "c"), ("save_on_cpu", "r"),
                             ("fsdp_offload", "m")):
            if label in peers:
                ax.axhline(peers[label], color=color, ls=":", label=f"{label} (no budget)")
        ax.set_xlabel("budget / training state")
        ax.set_ylabel("step time (ms)")
        ax.set_yscale("log")
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
