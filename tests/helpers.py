"""Small helpers shared by the tests: stats slices, call filters, random fills and HF Trainer's loop."""
from __future__ import annotations

from typing import Any

import torch

MiB = 1 << 20

# The per-role keys documented in tiermem/core/stats.py, with the role part taken out.
ROLE_KEYS = (
    "allocated_bytes.current", "allocated_bytes.peak", "allocated_bytes.total", "allocated_bytes.freed",
    "allocation_count.current", "allocation_count.peak", "allocation_count.total", "allocation_count.freed",
    "resident_bytes.current", "resident_bytes.peak",
    "moved_bytes.h2d", "moved_bytes.d2h", "moved_seconds.h2d", "moved_seconds.d2h",
    "ops.prefetch", "ops.evict", "ops.evict_clean", "ops.evict_um", "ops.evict_budget",
    "ops.evict_park", "ops.refill_reuse", "ops.park_release", "staged_bytes.h2d", "staged_bytes.d2h",
    "advice.applied", "advice.skipped", "prefetch.skipped",
)


def role_stats(stats: dict[str, Any], role: str) -> dict[str, Any]:
    """The slice of a flat stats dict for one role (or "all"), keyed without the role part."""
    return {k.replace(f".{role}.", ".", 1): v for k, v in stats.items() if k.split(".")[1:2] == [role]}


def expected_stats(**nonzero: Any) -> dict[str, Any]:
    """A whole role slice: every documented key 0 except ``nonzero`` (``ops__evict=1`` names
    ``ops.evict``: a double underscore stands for the dot)."""
    out = dict.fromkeys(ROLE_KEYS, 0)
    for k, v in nonzero.items():
        key = k.replace("__", ".")
        if key not in out:
            raise KeyError(f"not a documented stats key: {key}")
        out[key] = v
    return out


def calls(fake: Any, kind: str) -> list[tuple]:
    return [c for c in fake.calls if c[0] == kind]


def fill_random(tt: Any) -> torch.Tensor:
    """Write random data into ``tt`` through a short-lived view; returns a copy of what was written."""
    view = tt.torch()
    if view.dtype.is_floating_point:
        data = torch.randn(view.shape, dtype=view.dtype)
    else:
        nbytes = view.numel() * view.element_size()
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).view(view.dtype).view(view.shape)
    view.copy_(data)
    return data


def read(tt: Any) -> torch.Tensor:
    """A copy of ``tt``'s current contents (the view is dropped before returning)."""
    return tt.torch().clone()


ALLOCATING = ("allocate", "host_alloc", "device_alloc")


# NOTE [sampled sweeps]
#     The fault sweeps fail every faultable call of an operation in turn: thousands of cases, most
#     of the suite's time. The default run takes a sample of each scene's positions (its first and
#     last call, the first use of each call name, then evenly spaced ones, up to SAMPLED), every
#     failure kind at each; the other cases carry the ``sweep`` marker and run with
#     ``pytest -m sweep``, which .ci/run runs after the default command. Together the two runs are
#     the whole sweep, each case once.
SAMPLED = 5

# NOTE [long sets]
#     A parametrised test whose cases each train a model for several steps (data parallel ranks,
#     precisions, optimizers, clipping modes) is marked ``long``: the default run keeps its first
#     case (or ``keep`` of them), which exercises the path end to end, and the others carry the
#     ``sweep`` marker (tests/conftest.py), so ``pytest -m sweep`` in .ci/run runs every case.

# NOTE [slow cases]
#     README's test command is the quick check a newcomer runs (at most 5 minutes on two cores);
#     .ci/run then runs ``-m sweep``, so every case still runs in CI, once. A CPU case recorded
#     slower than SLOW_S in tests/durations.json (its setup, call and teardown, measured by a
#     default run on two cores: tests/durations.py rewrites the record) carries the ``sweep``
#     marker, except the fastest recorded case of its file, which keeps each file's path in the
#     default run. A case with no record (a new one) runs by default until the record is
#     rewritten.
SLOW_S = 3.0


def sampled_positions(seen: list[str], positions: list[int] | None = None, k: int = SAMPLED) -> set[int]:
    """The 1-based positions of ``seen`` (among ``positions``) the default run keeps."""
    pos = list(positions or range(1, len(seen) + 1))
    if len(pos) <= k:
        return set(pos)
    out = [pos[0], pos[-1]]
    firsts: dict[str, int] = {}
    for n in pos:
        firsts.setdefault(seen[n - 1], n)
    for n in firsts.values():
        if len(out) >= k:
            break
        if n not in out:
            out.append(n)
    step = len(pos) / k
    i = 0.0
    while len(out) < k and i < len(pos):
        n = pos[int(i)]
        if n not in out:
            out.append(n)
        i += step
    return set(out)


def fault_params(name: str, seen: list[str], positions: list[int] | None = None) -> list[Any]:
    """The fault sweeps' cases for one operation: a pytest.param (name, n, call, kind) for each
    1-based position ``n`` of the faultable calls ``seen`` (all, or ``positions``) and each
    failure kind; out-of-memory only for allocations. Ids start with "fault", for ``-k fault``.
    Cases outside the default run's sample carry the ``sweep`` marker (NOTE [sampled sweeps])."""
    import pytest

    from tiermem.cuda.backend import FaultInjector
    keep = sampled_positions(seen, positions)
    out = []
    for n in positions or range(1, len(seen) + 1):
        call = seen[n - 1]
        marks = () if n in keep else (pytest.mark.sweep,)
        for kind in FaultInjector.KINDS:
            if kind == "oom" and call not in ALLOCATING:
                continue
            out.append(pytest.param(name, n, call, kind, id=f"fault-{name}-{n:03d}-{call}-{kind}", marks=marks))
    return out


def share(module: Any, percent: int) -> int:
    """``percent`` of ``module``'s weights, in bytes: a percentage budget is a share of the device
    (NOTE [sizes] in tiermem/base/limits.py), so a share of a model is spelled in bytes."""
    from tiermem.planning import weight_bytes
    return weight_bytes(module) * percent // 100


def checkpoint_share(path: Any, percent: int) -> int:
    """``percent`` of the weights load_pretrained would read from ``path``, in bytes."""
    from tiermem.cli.plan import plan_model
    return plan_model(path, 1 << 50).plan.total * percent // 100


def trainer_optimizer(model: Any, make_opt: Any) -> tuple[Any, Any]:
    """HF Trainer's optimizer set-up over ``model``: two parameter groups (no weight decay for
    biases and norms), built by ``make_opt(groups)``, and a linear warm-up over four steps."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = make_opt([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))


def trainer_loop(model: Any, opt: Any, sched: Any, batches: Any, loss_fn: Any) -> list[torch.Tensor]:
    """HF Trainer's plain step over ``batches``: backward, clip to 1.0, step, schedule, zero the
    gradients through the model, as Trainer does. Returns the detached losses."""
    out = []
    model.zero_grad()
    for ids in batches:
        loss = loss_fn(model, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        model.zero_grad()
        out.append(loss.detach())
    return out


def tiny_qwen2_moe(transformers: Any, impl: str | None = None) -> Any:
    """bench/offload_infer.py's mixture of experts shrunk, in fp16 on the host: 12 small experts,
    top-4, a shared expert, 4 layers; ``impl`` sets the experts implementation (None: the one
    transformers picks). Greedy generation runs to its length (no end token)."""
    cfg = transformers.Qwen2MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
                                      shared_expert_intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=4, vocab_size=256, num_experts=12, num_experts_per_tok=4,
                                      decoder_sparse_step=1, tie_word_embeddings=False)
    if impl is not None:
        cfg._experts_implementation = impl
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    m.generation_config.pad_token_id, m.generation_config.eos_token_id = 0, None
    return m


def tiny_llama(dtype: Any = torch.float32) -> tuple[Any, Any]:
    """A 4-layer transformers Llama of hidden size 256 (untied, GQA 2:1), seeded, in eval mode on
    the host, and its config: the quantized and graphed streaming tests' model."""
    import pytest
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval(), cfg
