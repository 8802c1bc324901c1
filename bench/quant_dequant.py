"""bench/quant_dequant.py: is the dequantization of quantized streaming the bound? (issue 57)

    python bench/quant_dequant.py [--archs llama,qwen2,phi] [--layers 8] [--compile]

One decoder layer's Linear weights of each architecture of bench/offload_infer.py (its shapes;
random fp16), packed as tiermem packs a streamed weight (NOTE [quantized streaming] in
tiermem/inference/quant.py), for each of int8, fp8 and int4, timed with CUDA events:

- link_ms: the packed layer's bytes from pinned host memory to the device (one copy per member);
  fp16_link_ms the same layer in fp16 (what the fp16 bound moves).
- dequant_ms: quant.dequantize of every member from device memory into a device fp16 buffer, as
  the dequantization lane runs it (the fused Triton kernel where it runs, NOTE [one
  dequantization kernel] in tiermem/inference/dequant_kernel.py; variants_ms has torch's ops
  too); dequant_over_link = dequant_ms / link_ms (it must stay well under 1 for the
  dequantization to hide behind the link), dequant_GBps = fp16 bytes written / time.
- dequant_host_us: host time to queue that layer's dequantization (the forward's thread pays it).
- variants_ms: other ways to write the same slot (scales in the model's dtype, two-pass, and with
  --compile a torch.compile'd fused kernel), device time, so a faster kernel can be picked.
- pipelined_ms: --layers layers back to back through two staging buffers of QSTAGE_BYTES, the copy
  on one stream and the dequantization on another, as the transport orders them, against
  --layers x link_ms: pipelined_over_link near 1 means the link is the bound.
- e2e: wrap_module(stream_dtype=..., mode="stream") at 40% of the weights of a model of --layers
  such layers whose forward is one token (compute is next to nothing): per-forward time (steady
  state) against the bytes the forward moved at the measured link rate (forward_vs_plan_bytes, as offload_infer's
  prefill_vs_plan_bytes), so anything tiermem's path adds beside the link shows; host_ms is the
  host's time to queue one forward (near forward_ms: the host, not the device, is the bound),
  host_vs_plan_bytes the same against the link's time for the bytes moved (it must stay well
  under 1 for the link to be the bound) and host_us_per_streamed_group per group that streams.

Takes about a minute on an H200 (three architectures; --compile adds the compile time).
Results: bench/results/quant_dequant-<device>-<date>.json.
"""
from __future__ import annotations

import argparse
import statistics
import time

from _common import cuda_times, progress, steady_times, write_results

FORMATS = ("int8", "fp8", "int4")

# (rows, cols) of one decoder layer's Linear weights, bench/offload_infer.py's configurations.
LAYERS = {
    "llama": [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)],
    "qwen2": [(2048, 2048), (256, 2048), (256, 2048), (2048, 2048), (11008, 2048), (11008, 2048), (2048, 11008)],
    "phi": [(2560, 2560)] * 4 + [(10240, 2560), (2560, 10240)],
}


def _median_ms(fn, reps: int = 7) -> float:
    return statistics.median(cuda_times(fn, reps, warmup=2)) * 1e3


class Packed:
    """One layer's weights packed in ``fmt``: pinned host bytes per member, device copies of
    them, and a device fp16 output per member."""

    def __init__(self, shapes, fmt: str):
        import torch

        from tiermem.inference import quant
        self.fmt, self.members = fmt, []
        for rows, cols in shapes:
            w = torch.randn(rows, cols, device="cuda", dtype=torch.float16) * 0.02
            p = quant.packing(w, fmt)
            host = torch.empty(p.nbytes, dtype=torch.uint8, pin_memory=True)
            dev = torch.empty(p.nbytes, dtype=torch.uint8, device="cuda")
            q, s = quant.views(p, dev)
            quant.pack_into(w, p, q, s, torch.device("cuda"))
            host.copy_(dev)
            self.members.append((p, host, dev, torch.empty_like(w), w))
        self.nbytes = sum(p.nbytes for p, *_ in self.members)
        self.fp16_bytes = sum(w.numel() * 2 for *_, w in self.members)
        q4 = max((p.q_bytes for p, *_ in self.members), default=0)
        self.scratch = torch.empty(q4, dtype=torch.uint8, device="cuda")

    def copy(self) -> None:
        for _, host, dev, _, _ in self.members:
            dev.copy_(host, non_blocking=True)

    def dequant(self) -> None:
        from tiermem.inference import quant
        for p, _, dev, out, _ in self.members:
            q, s = quant.views(p, dev)
            quant.dequantize(q, s, p, out, self.scratch)

    def check(self) -> bool:
        """The device's dequantization equals the plain formula's to the bit."""
        import torch

        from tiermem.inference import quant
        self.dequant()
        return all(torch.equal(out, quant.reference(*quant.views(p, dev), p, out.dtype))
                   for p, _, dev, out, _ in self.members)


def variants(pk: Packed, compile_: bool) -> dict[str, float]:
    """Device ms of other ways to write the same outputs (not bit-checked: for picking a kernel)."""
    import torch

    from tiermem.inference import quant
    views = [(p, *quant.views(p, dev), out) for p, _, dev, out, _ in pk.members]
    half = [(p, q, s.half(), out) for p, q, s, out in views]
    out: dict[str, float] = {}
    # NOTE [one dequantization kernel]: dequant_ms is what the transport runs (the fused kernel
    # where Triton is); these are each path alone.
    for kernel in ("torch", "fused"):
        try:
            out[f"dequantize_{kernel}"] = _median_ms(
                lambda k=kernel: [quant.dequantize(q, s, p, o, pk.scratch, kernel=k) for p, q, s, o in views])
        except Exception as e:      # the fused kernel needs Triton: reported
            out[f"dequantize_{kernel}_error"] = f"{type(e).__name__}: {e}"[:300]
    if pk.fmt == "int8":
        out["mul_scales_fp16"] = _median_ms(lambda: [torch.mul(q, s, out=o) for _, q, s, o in half])
        out["copy_then_mul_fp16"] = _median_ms(lambda: [(o.copy_(q), o.mul_(s)) for _, q, s, o in half])
    elif pk.fmt == "fp8":
        out["copy_then_mul_fp16"] = _median_ms(lambda: [(o.copy_(q), o.mul_(s)) for _, q, s, o in half])
        out["copy_only"] = _median_ms(lambda: [o.copy_(q) for _, q, s, o in half])
    if compile_:
        def fused(q, s, o, fmt: str, group: int):
            n = q.shape[0]
            if fmt == "int4":
                b = q.view(torch.int8)
                hi = torch.bitwise_right_shift(b, 4)
                lo = torch.bitwise_right_shift(torch.bitwise_left_shift(b, 4), 4)
                v = torch.stack([lo, hi], dim=-1).view(n, -1, group).float()
            else:
                v = q.float().view(n, -1, group)
            o.view(n, -1, group).copy_(v * s.view(n, -1, 1))
        try:
            f = torch.compile(fused, dynamic=True)
            t0 = time.perf_counter()
            for p, q, s, o in views:
                f(q, s, o, p.fmt, p.group)
            torch.cuda.synchronize()
            out["compile_s"] = time.perf_counter() - t0
            out["compiled"] = _median_ms(lambda: [f(q, s, o, p.fmt, p.group) for p, q, s, o in views])
        except Exception as e:      # reported: the device may lack a working compiler
            out["compile_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


def pipelined(pk: Packed, layers: int) -> float:
    """Device ms of ``layers`` layers through two staging buffers, copy and dequantization on
    streams of their own, ordered as the transport orders them (NOTE [quantized streaming])."""
    import torch

    from tiermem.inference import quant
    cap = max(quant.QSTAGE_BYTES, max(p.nbytes for p, *_ in pk.members))
    stages = [torch.empty(cap, dtype=torch.uint8, device="cuda") for _ in range(quant.QSTAGES)]
    freed = [None] * quant.QSTAGES
    cs, ds = torch.cuda.Stream(), torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    turn = 0

    def run():
        nonlocal turn
        for _ in range(layers):
            for p, host, _, out, _ in pk.members:       # one member a chunk: at most a stage
                k, turn = turn, (turn + 1) % len(stages)
                st = stages[k][:p.nbytes]
                with torch.cuda.stream(cs):
                    if freed[k] is not None:
                        cs.wait_event(freed[k])
                    st.copy_(host, non_blocking=True)
                    copied = torch.cuda.Event()
                    copied.record(cs)
                with torch.cuda.stream(ds):
                    ds.wait_event(copied)
                    q, s = quant.views(p, st)
                    quant.dequantize(q, s, p, out, pk.scratch)
                    freed[k] = torch.cuda.Event()
                    freed[k].record(ds)
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start.record()
        cs.wait_stream(torch.cuda.current_stream())
        run()
        torch.cuda.current_stream().wait_stream(ds)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class _Layer:
    """A decoder layer's Linears, each read by a forward of one token (compute next to nothing)."""

    @staticmethod
    def make(shapes):
        import torch

        class Layer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.ModuleList(torch.nn.Linear(c, r, bias=False, device="meta") for r, c in shapes)

            def forward(self, x):
                # Every weight is read; the hidden size (the first Linear's columns) goes on.
                return x + sum(m(x if m.in_features == x.shape[-1] else x.new_ones(x.shape[0], m.in_features)).mean()
                               for m in self.lin)
        return Layer()


def e2e_model(shapes, layers: int):
    """``layers`` layers of ``shapes``, fp16 on the host, random N(0, 0.02) weights."""
    import torch
    model = torch.nn.Sequential(*[_Layer.make(shapes) for _ in range(layers)])
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            w = torch.randn(m.weight.shape, device="cuda", dtype=torch.float16) * 0.02
            m.weight = torch.nn.Parameter(w.cpu(), requires_grad=False)
    return model.eval()


def e2e(model, fmt: str | None, layers: int) -> dict:
    """wrap_module(stream_dtype=fmt, mode="stream") on ``model`` at 40% of its weights, one token
    a forward; its own tensors are given back after (unwrap gives the dequantized ones)."""
    import torch

    import tiermem
    saved = [(t, t.data) for t in model.parameters()]
    total = sum(t.numel() * t.element_size() for t in model.parameters())
    x = torch.randn(1, model[0].lin[0].in_features, device="cuda", dtype=torch.float16)
    tier = tiermem.Tier(0)
    try:
        h = tier.wrap_module(model, budget=int(total * 0.4), stream_dtype=fmt, mode="stream")
        try:
            with torch.no_grad():
                model(x)
                h.drain()
                before = tier.stats()["moved_bytes.all.h2d"]
                model(x)
                h.drain()
                moved = tier.stats()["moved_bytes.all.h2d"] - before
                t = statistics.median(steady_times(lambda: model(x), forwards=3, spans=3, warmup=1))
                h.drain()
                host = []
                for _ in range(3):      # the host's time to queue a forward, the GPU idle at its start
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    model(x)
                    host.append(time.perf_counter() - t0)
                h.drain()
            return {"forward_ms": t * 1e3, "host_ms": statistics.median(host) * 1e3, "moved_GB": moved / 1e9,
                    "groups": len(h.plan.sizes), "resident_groups": len(h.plan.pinned)}
        finally:
            h.unwrap()
    finally:
        tier.close()
        for t, d in saved:
            t.data = d


def _link_GBps() -> float:
    """Pinned host-to-device GB/s, 1 GiB copies, median of 7 (as offload_infer measures it)."""
    import torch
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    return n / (statistics.median(cuda_times(lambda: dev.copy_(host, non_blocking=True), 7)) * 1e9)


def main() -> None:
    import torch

    from tiermem.inference import dequant_kernel
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default="llama,qwen2,phi")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--compile", action="store_true", help="also time a torch.compile'd fused dequantization")
    ap.add_argument("--no-e2e", action="store_true", help="skip the wrap_module runs")
    args = ap.parse_args()
    metrics: dict = {}
    checks: dict = {}
    raw: dict = {"layers": args.layers, "archs": {}}
    link = _link_GBps()
    metrics["pinned_h2d_GBps"] = round(link, 2)
    checks["fused_kernel_available"] = dequant_kernel.available(torch.empty(0, device="cuda"))
    progress(f"pinned H2D {link:.1f} GB/s")
    for arch in [a.strip() for a in args.archs.split(",") if a.strip()]:
        shapes = LAYERS[arch]
        r: dict = {}
        raw["archs"][arch] = r
        fp16 = sum(rr * c * 2 for rr, c in shapes)
        r["fp16_layer_MB"] = fp16 / 1e6
        r["fp16_link_ms"] = fp16 / (link * 1e9) * 1e3
        for fmt in FORMATS:
            pk = Packed(shapes, fmt)
            x: dict = {"packed_MB": pk.nbytes / 1e6}
            x["link_ms"] = _median_ms(pk.copy)
            x["dequant_ms"] = _median_ms(pk.dequant)
            x["dequant_over_link"] = round(x["dequant_ms"] / x["link_ms"], 3)
            x["dequant_GBps"] = round(pk.fp16_bytes / (x["dequant_ms"] / 1e3) / 1e9, 1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                pk.dequant()
            x["dequant_host_us"] = (time.perf_counter() - t0) / 20 * 1e6
            torch.cuda.synchronize()
            checks[f"dequant_exact.{arch}.{fmt}"] = pk.check()
            x["variants_ms"] = variants(pk, args.compile)
            x["pipelined_ms"] = pipelined(pk, args.layers)
            x["pipelined_over_link"] = round(x["pipelined_ms"] / (args.layers * x["link_ms"]), 3)
            metrics[f"dequant_over_link.{arch}.{fmt}"] = x["dequant_over_link"]
            metrics[f"pipelined_over_link.{arch}.{fmt}"] = x["pipelined_over_link"]
            progress(f"{arch} {fmt}: link {x['link_ms']:.3f} ms, dequant {x['dequant_ms']:.3f} ms "
                     f"({x['dequant_GBps']} GB/s written, host {x['dequant_host_us']:.0f} us), pipelined "
                     f"{x['pipelined_over_link']}x the link, variants {x['variants_ms']}")
            x["failed_to_compile"] = [f"{f} {d}" for f, d, _ in dequant_kernel.failed() if f == fmt]
            r[fmt] = x
            del pk
        if not args.no_e2e:
            model = e2e_model(shapes, args.layers)
            for fmt in (None, *FORMATS):
                try:
                    e = e2e(model, fmt, args.layers)
                except Exception as err:     # reported, the others still run
                    r[f"e2e_{fmt or 'fp16'}"] = {"error": f"{type(err).__name__}: {err}"[:300]}
                    progress(f"{arch} e2e {fmt or 'fp16'}: {err}")
                    continue
                e["forward_vs_plan_bytes"] = round(e["forward_ms"] / (e["moved_GB"] / link * 1e3), 3)
                metrics[f"e2e_forward_vs_plan_bytes.{arch}.{fmt or 'fp16'}"] = e["forward_vs_plan_bytes"]
                e["host_vs_plan_bytes"] = round(e["host_ms"] / (e["moved_GB"] / link * 1e3), 3)
                metrics[f"e2e_host_vs_plan_bytes.{arch}.{fmt or 'fp16'}"] = e["host_vs_plan_bytes"]
                e["host_us_per_streamed_group"] = round(e["host_ms"] * 1e3 / max(1, e["groups"] - e["resident_groups"]), 1)
                r[f"e2e_{fmt or 'fp16'}"] = e
                progress(f"{arch} e2e {fmt or 'fp16'}: {e['forward_ms']:.2f} ms a forward ({e['host_ms']:.2f} ms of "
                         f"host time to queue it), {e['moved_GB']:.3f} GB moved: {e['forward_vs_plan_bytes']}x the "
                         "link's time for them")
            del model
        torch.cuda.empty_cache()
    path = write_results("quant_dequant", metrics, checks, raw)
    progress(f"wrote {path}")


if __name__ == "__main__":
    main()
