"""Out-of-core CuPy: Y = X @ W for an X three times the device budget, one row block at a time.

Every CuPy array comes from tiermem's allocator. X's blocks live wherever the budget puts them;
``tier.use`` brings the next block in while the current one multiplies, and keeps W (read by
every block) on the device. Blocks the loop does not name would still work: they are read in
place from the host, never faulted back behind the budget's back.

Speed: allocator arrays move by Unified Memory's own prefetches. On the H100 a read-only array
moved this way cost 22-26x the link bound (bench/cupy_budget.py, "reuse"): the example shows
the API, not a fast path. Data read many times is faster as TieredTensors (``tier.empty``).

    PYTHONPATH=. python examples/cupy_out_of_core.py [--budget-mib 256] [--blocks 12]   (needs a GPU)
"""
import argparse
import time

import cupy
import numpy as np

import tiermem as tier

ap = argparse.ArgumentParser()
ap.add_argument("--budget-mib", type=int, default=256)
ap.add_argument("--blocks", type=int, default=12)
ap.add_argument("--k", type=int, default=4096)
ap.add_argument("--m", type=int, default=256)
args = ap.parse_args()

budget = args.budget_mib << 20
t = tier.configure(budget=budget, cap="2GiB")          # a few GiB of managed memory at most
cupy.cuda.set_allocator(tier.allocator())
rows = 3 * budget // args.blocks // (args.k * 4)        # X is 3x the budget, in float32

# Arrays under "activation" may be evicted; the allocator's default role (workspace) never is.
with tier.using_role("activation"):
    X = [cupy.random.standard_normal((rows, args.k), dtype=cupy.float32) for _ in range(args.blocks)]
    W = cupy.random.standard_normal((args.k, args.m), dtype=cupy.float32) / np.sqrt(args.k)
print(f"X: {args.blocks} blocks of {rows}x{args.k} float32 ({sum(x.nbytes for x in X) >> 20} MiB), "
      f"budget {args.budget_mib} MiB")

start = time.perf_counter()
keep_w = tier.use(W, read_only=True)                     # an open handle pins its arrays
keep_w.wait()                                            # the stream waits for W's move (an event)
Y = []
nxt = tier.use(X[0], read_only=True)
for i in range(args.blocks):
    with nxt:                                            # the stream waits for block i's moves
        if i + 1 < args.blocks:
            nxt = tier.use(X[i + 1], read_only=True)     # block i+1 comes in meanwhile
        Y.append(X[i] @ W)
keep_w.close()                                           # W may be evicted again
cupy.cuda.Device().synchronize()
seconds = time.perf_counter() - start

# Check sampled rows of every block against NumPy in float64.
rng = np.random.default_rng(0)
w64 = W.get().astype(np.float64)
worst = 0.0
for x, y in zip(X, Y):
    pick = cupy.asarray(np.sort(rng.choice(rows, 8, replace=False)))
    want = x[pick].get().astype(np.float64) @ w64
    worst = max(worst, float(np.max(np.abs(y[pick].get() - want))))
assert worst < 1e-3, f"Y differs from NumPy by {worst}"

s = t.stats()
print(f"{seconds * 1e3:.1f} ms for {args.blocks} blocks; max |error| {worst:.2e}")
print(f"moved in {s['moved_bytes.all.h2d'] >> 20} MiB, out {s['moved_bytes.all.d2h'] >> 20} MiB; "
      f"resident {s['resident_bytes.all.current'] >> 20} MiB (peak {s['resident_bytes.all.peak'] >> 20}) "
      f"of a {args.budget_mib} MiB budget; in place {s['residency.in_place_bytes.current'] >> 20} MiB; "
      f"device pages the driver keeps for evicted blocks {s['residency.retained_bytes.current'] >> 20} MiB; "
      f"budget overruns {s['residency.budget_overruns']}")
# The budget held for live data, and nothing came back to the device behind tiermem's books.
assert s["resident_bytes.all.peak"] <= budget, "the budget did not hold"
assert s["residency.budget_overruns"] == 0 and s["residency.faulted_back_count"] == 0
print(tier.memory_summary())
