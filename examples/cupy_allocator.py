"""tiermem as CuPy's allocator: every array in managed memory, counted under a role, evictable.

    PYTHONPATH=. python examples/cupy_allocator.py     (needs a GPU)
"""
import cupy

import tiermem as tier

tier.configure(cap="2GiB", budget="256MiB")
cupy.cuda.set_allocator(tier.allocator())         # without a role: the innermost using_role, else workspace

with tier.using_role("activation"):
    acts = [cupy.random.random((1 << 22,), dtype=cupy.float32) for _ in range(8)]   # 8 x 16 MiB
with tier.using_role("input"):
    batch = cupy.arange(1 << 20, dtype=cupy.int32)

print(sum(float(a.sum()) for a in acts), int(batch[-1]))
print(tier.memory_summary())
cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
