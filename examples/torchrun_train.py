"""Train on every GPU of a host with tiermem, launched by torchrun (needs GPUs and transformers):

    torchrun --nproc-per-node 2 examples/torchrun_train.py              # FSDP2, shards in pinned memory
    torchrun --nproc-per-node 2 examples/torchrun_train.py --mode dp    # a replica per GPU, in a budget
    torchrun --nproc-per-node 2 examples/torchrun_train.py --mode dp --host-step   # AdamW on the host
    torchrun --nproc-per-node 2 examples/torchrun_train.py --mode dp --shard-steps # each block steps on one rank

``--mode fsdp`` shards the model with FSDP2's fully_shard and lets tiermem hold each rank's shards
and AdamW states in pinned host memory (one copy of the training state per host, across the
ranks), bringing them in ahead of FSDP's all-gathers and stepping each parameter inside backward
(tiermem.wrap_fsdp). ``--mode dp`` gives each rank a whole replica trained within ``--budget`` of
its GPU, each block's gradients averaged over the ranks just before its step (wrap_training with
process_group=True); with ``--host-step`` the streamed blocks' AdamW steps run on the host after the
average, so their moments never cross the link (NOTE [host stepping]); with ``--shard-steps`` each
streamed block steps on one rank, which broadcasts its parameters, so a rank's link carries its own
blocks' moments only (NOTE [sharded steps]). Both print rank 0's loss and what the host holds.
"""
import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

try:
    import tiermem
except ImportError:              # run from a checkout: the package is beside this folder
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import tiermem

ap = argparse.ArgumentParser()
ap.add_argument("--mode", choices=("fsdp", "dp"), default="fsdp")
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--budget", default="4GiB", help="--mode dp: device memory per rank")
ap.add_argument("--host-step", action="store_true", help="--mode dp: step streamed blocks' AdamW on the host")
ap.add_argument("--shard-steps", action="store_true", help="--mode dp: step each streamed block on one rank")
args = ap.parse_args()

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")      # NVLink multicast off (docs/facts.md)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
local = int(os.environ.get("LOCAL_RANK", rank))
torch.cuda.set_device(local)
dist.init_process_group("nccl")

cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                               num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                               tie_word_embeddings=False)
torch.manual_seed(0)                                 # the same initial weights on every rank
with torch.device("cuda"):
    model = transformers.LlamaForCausalLM(cfg)
tier = tiermem.Tier(local)

if args.mode == "fsdp":
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)                 # no CPUOffloadPolicy: tiermem holds the shards
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    handle = tiermem.wrap_fsdp(model, opt, tier=tier)
else:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    handle = tiermem.wrap_training(model, opt, args.budget, process_group=True, tier=tier, host_step=args.host_step,
                                   shard_steps=args.shard_steps)

g = torch.Generator(device="cuda").manual_seed(1000 + rank)      # each rank its own batches
for step in range(args.steps):
    ids = torch.randint(0, cfg.vocab_size, (4, 1024), device="cuda", generator=g)
    if args.mode == "fsdp":
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()                              # each parameter steps right after its reduce-scatter
    else:
        with handle.step(), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()                          # each block steps inside backward
    if rank == 0:
        print(f"step {step}: loss {loss.item():.4f}", flush=True)

pinned = torch.tensor([handle.pinned_bytes], device="cuda")
dist.all_reduce(pinned)
if rank == 0:
    print(f"{args.mode}: {world} ranks, {pinned.item() / 1e9:.2f} GB pinned on this host in all")
if args.mode == "dp":
    handle.gather_states()        # every rank calls it: with --shard-steps, opt.state_dict() is whole after it
    if rank == 0:
        print(f"optimizer states of {len(opt.state_dict()['state'])} parameters", flush=True)
handle.unwrap()
dist.destroy_process_group()
