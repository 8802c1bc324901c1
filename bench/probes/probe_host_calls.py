"""What tiermem's own CUDA calls cost the host in a training step.

Sections:
  calls   microseconds per call of the backend's primitives (a new event, a record, a stream
          wait, a query, the current stream, a 4 KiB copy, an event's destruction) and of a
          parameter's rebinding (``p.data = v``), each over a few thousand calls
  count   how many of each one training step makes: the Qwen2-style (or GPT) model of
          bench/train_budget.py part 4 at 1/2.5 of its state, recomputing everywhere, the
          backend's methods counted on the step's instance; times the prices above, the host
          milliseconds a step spends in those calls

    python bench/probes/probe_host_calls.py [--model hf|gpt]
Writes $OUT/probe_host_calls-<model>.json (or bench/results/probe_host_calls-<model>-<date>.json).
"""
import argparse
import collections
import datetime
import gc
import json
import os
import time

import _path  # noqa: F401 - bench/ and the repository root on sys.path
import torch
import torch.nn.functional as F
from _common import host_us_per_call, provenance

import tiermem
from tiermem.cuda import runtime as _cuda

COUNTED = ("new_event", "record", "wait", "query", "synchronize", "copy", "current_stream", "torch_view")


def prices(be):
    """Microseconds per call on the host (the GPU's work is tiny and waited for once)."""
    s = be.current_stream()
    ev = be.new_event()
    be.record(ev, s)
    src = torch.empty(4096, dtype=torch.uint8, device="cuda")
    dst = torch.empty(4096, dtype=torch.uint8, device="cuda")
    p = torch.nn.Parameter(torch.randn(1024, device="cuda"))
    views = [torch.randn(1024, device="cuda") for _ in range(2)]
    flip = [0]

    def rebind():
        flip[0] ^= 1
        p.data = views[flip[0]]
    keep = []

    def create_destroy():
        keep.append(be.new_event())
        if len(keep) > 64:
            keep.clear()                 # 65 destructions
    return {"new_event": host_us_per_call(lambda: be.new_event()),
            "new_event + destroy": host_us_per_call(create_destroy),
            "record": host_us_per_call(lambda: be.record(ev, s)),
            "wait": host_us_per_call(lambda: be.wait(s, ev)),
            "query": host_us_per_call(lambda: be.query(ev)),
            "current_stream": host_us_per_call(be.current_stream),
            "copy (4 KiB, device to device)": host_us_per_call(lambda: be.copy(dst.data_ptr(), src.data_ptr(), 4096, s)),
            "cudaEventRecord (cuda-bindings, no checks)": host_us_per_call(
                lambda: _cuda._runtime().cudaEventRecord(ev.handle, s)),
            "torch.cuda.current_stream()": host_us_per_call(torch.cuda.current_stream),
            "p.data = v": host_us_per_call(rebind)}


def count_step(model_name):
    from _recompute_study import hf_loss, qwen2
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    args = argparse.Namespace(hf_vocab=8192, hf_d=1024, hf_ff=2816, hf_layers=20, hf_heads=16, hf_kv=4, seq=512)
    if model_name == "hf":
        model, loss_fn = qwen2(torch, args), hf_loss
    else:
        from tiermem.testing import GPT, GPTConfig
        model = GPT(GPTConfig(vocab=8192, seq=512, d=1024, layers=16, heads=16)).cuda()

        def loss_fn(m, ids):
            logits = m(ids[:, :-1])
            return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tier = tiermem.Tier(0, cap="12GiB")
    train = tier.wrap_training(model, opt, int(16 * n / 2.5), block_bytes=64 << 20, recompute="always")
    ids = torch.randint(0, 8192, (4, 513), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))

    def run():
        with train.step():
            loss_fn(model, ids).backward()
    for _ in range(8):                       # the trace, the probe, the plan
        run()
    torch.cuda.synchronize()
    be = train.tier.backend
    counts = collections.Counter()
    for name in COUNTED:
        fn = getattr(be, name)

        def counted(*a, _fn=fn, _name=name, **k):
            counts[_name] += 1
            return _fn(*a, **k)
        setattr(be, name, counted)
    binds = [0]
    slots = train.stream
    bind = slots.bind

    def counted_bind(p, v):
        binds[0] += 1
        return bind(p, v)
    slots.bind = counted_bind
    steps = 4
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e3
    for name in COUNTED:
        delattr(be, name)
    del slots.bind
    plan = train.plan
    out = {"per_step": {k: v / steps for k, v in counts.most_common()}, "binds_per_step": binds[0] / steps,
           "step_ms_counted": round(wall, 1), "blocks": len(train.stream.blocks),
           "recomputed": len(plan.recompute), "streamed": len(plan.streamed_blocks)}
    train.unwrap()
    del train, model, opt
    gc.collect()
    torch.cuda.empty_cache()
    tier.close()
    return out, be


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="hf", choices=["hf", "gpt"])
    a = ap.parse_args()
    torch.cuda.init()
    R = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": a.model}
    counted, be = count_step(a.model)
    R["count"] = counted
    R["calls_us"] = prices(be)
    cost = {"new_event": "new_event + destroy", "record": "record", "wait": "wait", "query": "query",
            "current_stream": "current_stream", "copy": "copy (4 KiB, device to device)"}
    ms = {k: round(counted["per_step"].get(k, 0) * R["calls_us"][v] / 1e3, 2) for k, v in cost.items()}
    ms["p.data = v"] = round(counted["binds_per_step"] * R["calls_us"]["p.data = v"] / 1e3, 2)
    R["host_ms_per_step"] = ms
    R["host_ms_per_step_total"] = round(sum(ms.values()), 2)
    print(json.dumps(R, indent=1), flush=True)
    out = os.environ.get("OUT")
    path = (os.path.join(out, f"probe_host_calls-{a.model}.json") if out else
            os.path.join(_path.RESULTS, f"probe_host_calls-{a.model}-{datetime.date.today():%Y%m%d}.json"))
    with open(path, "w") as fh:
        json.dump({**provenance(), **R}, fh, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
