"""How close a model's logits are to a reference's on the same inputs, and each Linear's output to
what its reference weight gives on the same input: what quantized streaming costs in accuracy
(NOTE [quantized streaming] in tiermem/inference/quant.py; docs/inference.md, "What it costs in
accuracy", says why random weights need the second)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["CHECK_BYTES", "linear_agreement", "logits_agreement"]

CHECK_BYTES = 64 << 20   # linear_agreement: bytes of a reference weight on the device at a time


def logits_agreement(reference: Any, logits: Any) -> dict[str, float]:
    """Per position (every dimension but the last, the vocabulary), the cosine similarity of
    ``logits`` to ``reference`` in fp32, and whether their largest entries agree: ``cosine_min``,
    ``cosine_mean``, ``top1`` (the share of positions whose argmax agrees) and ``positions``."""
    import torch
    if tuple(reference.shape) != tuple(logits.shape):
        raise ValueError(f"the logits' shapes differ: {tuple(reference.shape)} and {tuple(logits.shape)}")
    a = reference.detach().float().reshape(-1, reference.shape[-1])
    b = logits.detach().float().reshape(-1, logits.shape[-1]).to(a.device)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    top1 = (a.argmax(-1) == b.argmax(-1)).float()
    return {"cosine_min": float(cos.min()), "cosine_mean": float(cos.mean()), "top1": float(top1.mean()),
            "positions": int(a.shape[0])}


@contextlib.contextmanager
def linear_agreement(model: Any, reference: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """While open, every ``nn.Linear`` of ``model`` named in ``reference`` (module name -> its
    reference weight, on any device) has each forward's output compared, per position, with
    ``F.linear(input, reference weight, the module's bias)`` on the same input, in fp32: the
    error the weight alone adds, whatever the layers before did to the input. The dict yielded
    gets ``cosine_min`` (over every position of every Linear), ``worst`` (its module),
    ``linears`` (how many were compared) and ``per_linear`` (name -> its smallest cosine).
    A Linear's weight read where it is used (a part of a head, a slot) is what it compares."""
    import torch
    F = torch.nn.functional
    out: dict[str, Any] = {"cosine_min": 1.0, "worst": None, "linears": 0, "per_linear": {}}
    hooks = []

    def hook(name: str) -> Any:
        def after(mod: Any, args: tuple, y: Any) -> None:
            x = args[0]
            ref = reference[name]
            rows = ref.shape[0]
            # The reference weight crosses to the input's device a range of rows at a time (at most
            # CHECK_BYTES), so checking a head bigger than the budget does not hold it whole there.
            step = max(1, CHECK_BYTES // max(1, ref[:1].numel() * ref.element_size()))
            dot = n_want = n_got = 0
            with torch.no_grad():
                got_all = y.detach().reshape(-1, rows)
                for lo in range(0, rows, step):
                    hi = min(rows, lo + step)
                    w = ref[lo:hi].to(x.device, x.dtype)
                    bias = mod.bias[lo:hi].to(x.dtype) if mod.bias is not None else None
                    want = F.linear(x, w, bias).float().reshape(-1, hi - lo)
                    got = got_all[:, lo:hi].float()
                    dot = dot + (want * got).sum(-1)
                    n_want = n_want + want.square().sum(-1)
                    n_got = n_got + got.square().sum(-1)
                    del w, want, got
                cos = float((dot / (n_want.sqrt() * n_got.sqrt()).clamp_min(1e-8)).min())
            if name not in out["per_linear"]:
                out["linears"] += 1
            out["per_linear"][name] = min(cos, out["per_linear"].get(name, 1.0))
            if out["worst"] is None or cos < out["cosine_min"]:
                out["cosine_min"], out["worst"] = cos, name
        return after

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name in reference:
            hooks.append(m.register_forward_hook(hook(name)))
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()
