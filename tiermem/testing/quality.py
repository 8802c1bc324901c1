"""How close a model's logits are to a reference's on the same inputs: what quantized streaming
costs in accuracy (NOTE [quantized streaming] in tiermem/inference/quant.py)."""
from __future__ import annotations

from typing import Any

__all__ = ["logits_agreement"]


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
