import os, sys, time
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, "bench")
import torch
torch.use_deterministic_algorithms(True, warn_only=True)
import tiermem
from tiermem.models import GPT, GPTConfig, gpt_param_count
import torch.nn.functional as F
cfg = GPTConfig(vocab=8192, seq=512, d=1024, layers=16, heads=16)
g = torch.Generator(device="cuda").manual_seed(1)
bs = [torch.randint(0, 8192, (4, 513), device="cuda", generator=g) for _ in range(6)]
def loss_of(m, ids):
    lo = m(ids[:, :-1]); return F.cross_entropy(lo.reshape(-1, lo.shape[-1]), ids[:, 1:].reshape(-1))
def build():
    torch.manual_seed(0); return GPT(cfg).cuda()
# resident per-block forward
m = build(); opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
evs = []
for b in m.blocks:
    b.register_forward_pre_hook(lambda mod, a: evs.append(("s", torch.cuda.Event(enable_timing=True))) or evs[-1][1].record())
    b.register_forward_hook(lambda mod, a, o: evs.append(("e", torch.cuda.Event(enable_timing=True))) or evs[-1][1].record())
for ids in bs[:3]:
    evs.clear()
    a0 = torch.cuda.Event(enable_timing=True); a1 = torch.cuda.Event(enable_timing=True); a2 = torch.cuda.Event(enable_timing=True)
    a0.record(); l = loss_of(m, ids); a1.record(); l.backward(); opt.step(); opt.zero_grad(); a2.record(); torch.cuda.synchronize()
    per = [evs[i][1].elapsed_time(evs[i+1][1]) for i in range(0, len(evs), 2)]
    print("resident fwd %.1f total %.1f per-block %s" % (a0.elapsed_time(a1), a0.elapsed_time(a2), [round(x, 2) for x in per[:4]]), flush=True)
del m, opt, l; torch.cuda.empty_cache()
n = gpt_param_count(cfg); budget = int(16 * n / 2.5)
tier = tiermem.Tier(0, cap="12GiB")
keys = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")
for mode in ("never", "always"):
    m = build(); opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    train = tier.wrap_training(m, opt, budget, recompute=mode, link_GBps=47)
    for i, ids in enumerate(bs):
        s0 = torch.cuda.memory_stats()
        a0 = torch.cuda.Event(enable_timing=True); a1 = torch.cuda.Event(enable_timing=True)
        a0.record()
        with train.step():
            l = loss_of(m, ids); l.backward()
        a1.record(); torch.cuda.synchronize()
        s1 = torch.cuda.memory_stats()
        print(mode, i, "%.1f ms" % a0.elapsed_time(a1), {k: s1.get(k, 0) - s0.get(k, 0) for k in keys}, flush=True)
        if i == 0:
            t = train.trace
            print("  trace fwd %.1f bwd %.1f blocks %s" % (t.fwd_ms, t.bwd_ms, [round(x, 2) for x in t.block_fwd_ms]), flush=True)
    print(train.plan.table()[:900], flush=True)
    train.unwrap(); del train, m, opt, l; torch.cuda.empty_cache()
