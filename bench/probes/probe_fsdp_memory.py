"""Where a wrap_fsdp rank's device memory goes, on two GPUs: the 0.85B Llama of bench/multi_gpu.py
under FSDP2 plain, with CPUOffloadPolicy, and under tiermem.wrap_fsdp at lookahead 0 and 2, each
step's peak allocated and reserved bytes and its time (NOTE [groups in flight] in
tiermem/training/fsdp.py).

    python bench/probes/probe_fsdp_memory.py [steps]

Prints a table per variant (rank 0) and writes probe_fsdp_memory-<device>-<date>.json.
"""
import datetime
import os
import statistics
import sys
import tempfile

import _path  # noqa: F401  (bench/ and the repository root on sys.path)
from _common import progress, write_results

VARIANTS = ("plain", "offload", "lookahead0", "lookahead2")


def run(torch, tier, rank: int, how: str, steps: int) -> dict:
    import multi_gpu as mg
    model, opt = mg.fsdp_model(torch, how == "offload")
    handle = tier.wrap_fsdp(model, opt, lookahead=int(how[-1])) if how.startswith("lookahead") else None
    mg._free(torch)
    torch.cuda.reset_peak_memory_stats()
    rows = []
    for step in range(steps):
        ids = mg.batch(torch, step, rank)

        def one():
            model(input_ids=ids, labels=ids).loss.backward()
            if handle is None:
                opt.step()
                opt.zero_grad(set_to_none=True)
        t = mg._timed(torch, one)
        st = torch.cuda.memory_stats()
        rows.append({"step_s": t, "allocated_peak": st["allocated_bytes.all.peak"],
                     "reserved_peak": st["reserved_bytes.all.peak"]})
    if handle is not None:
        handle.unwrap()
    handle = model = opt = None        # their memory goes before the next variant
    mg._free(torch)
    return {"rows": rows, "step_s": statistics.median(r["step_s"] for r in rows[1:])}


def rank_main(rank: int, world: int, init: str, out: str, steps: int) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch
    import torch.distributed as dist

    import tiermem
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=180), device_id=torch.device("cuda", rank))
    tier = tiermem.Tier(rank)
    res = {}
    try:
        for how in VARIANTS:
            res[how] = run(torch, tier, rank, how, steps)
            if rank == 0:
                r = res[how]
                progress(f"{how:11s} step {r['step_s'] * 1e3:7.1f} ms; GB allocated / reserved at each step's peak: "
                         + ", ".join(f"{x['allocated_peak'] / 1e9:.2f}/{x['reserved_peak'] / 1e9:.2f}"
                                     for x in r["rows"]))
            dist.barrier()
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    finally:
        tier.close()
        dist.destroy_process_group()


def main() -> None:
    import torch
    import torch.multiprocessing as mp
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two GPUs")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(rank_main, args=(2, f"file://{d}/rendezvous", d, steps), nprocs=2, join=True)
        ranks = [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(2)]
    metrics = {}
    for how in VARIANTS:
        metrics[f"{how}_step_ms"] = round(max(r[how]["step_s"] for r in ranks) * 1e3, 1)
        metrics[f"{how}_reserved_GB"] = round(max(x["reserved_peak"] for r in ranks for x in r[how]["rows"]) / 1e9, 2)
        metrics[f"{how}_allocated_GB"] = round(max(x["allocated_peak"] for r in ranks for x in r[how]["rows"]) / 1e9, 2)
    last = [r["lookahead2"]["rows"] for r in ranks]
    checks = {"reserve_stops_growing": all(rows[-1]["reserved_peak"] == rows[-2]["reserved_peak"] for rows in last)}
    write_results("probe_fsdp_memory", metrics, checks, {"ranks": ranks, "steps": steps})


if __name__ == "__main__":
    main()
