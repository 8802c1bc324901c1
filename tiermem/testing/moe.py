"""A router made skewed on purpose, for benches and tests of the expert cache (NOTE [expert cache]
in tiermem/inference/experts.py): random weights route almost uniformly, where a trained model's
routers choose a few experts far more often than the rest."""
from __future__ import annotations

from typing import Any

__all__ = ["SkewedRouting", "skew_router", "routers"]


def routers(model: Any) -> list[Any]:
    """The routers of ``model``: modules with int ``top_k`` and ``num_experts`` and a 2-D ``weight``
    of one row per expert, as transformers' mixture-of-experts routers are (Mixtral, Qwen2-MoE,
    Qwen3-MoE, OLMoE: ``router_logits = F.linear(hidden_states, self.weight)``)."""
    out = []
    for m in model.modules():
        w = getattr(m, "weight", None)
        e = getattr(m, "num_experts", None)
        if (isinstance(getattr(m, "top_k", None), int) and isinstance(e, int) and getattr(w, "dim", None) is not None
                and w.dim() == 2 and w.shape[0] == e):
            out.append(m)
    return out


class SkewedRouting:
    """Adds ``bias`` to the logits of experts 0 .. ``hot`` - 1 of every router of a model, in
    every forward, until :meth:`remove`. Each router's forward runs under a torch function mode
    that adds the bias to the result of ``F.linear(hidden_states, router.weight)``, so the
    router's own softmax, top-k and normalization see the skewed logits (and return them).
    The mode is entered and left around that forward only, on the calling thread."""

    def __init__(self, model: Any, hot: int, bias: float):
        self.hot, self.bias = int(hot), float(bias)
        self.routers = routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no router (a module with top_k, num_experts and a "
                             "[num_experts, hidden] weight)")
        self._patched = []
        for r in self.routers:
            own = r.forward
            r.forward = self._forward(r, own)
            self._patched.append(r)

    def _forward(self, router: Any, own: Any) -> Any:
        import torch
        skew = self

        class AddBias(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func is torch.nn.functional.linear and len(args) >= 2 and args[1] is router.weight:
                    b = torch.zeros(out.shape[-1], dtype=out.dtype, device=out.device)
                    b[: skew.hot] = skew.bias
                    out = out + b
                return out

        def forward(*args: Any, **kwargs: Any) -> Any:
            with AddBias():
                return own(*args, **kwargs)
        return forward

    def remove(self) -> None:
        for r in self._patched:
            vars(r).pop("forward", None)
        self._patched = []


def skew_router(model: Any, hot: int = 8, bias: float = 2.0) -> SkewedRouting:
    """Make every router of ``model`` prefer its first ``hot`` experts: ``bias`` is added to their
    logits before the softmax (a logit of +2 makes an expert e^2 = 7.4x as likely as before).
    Returns the :class:`SkewedRouting`; ``.remove()`` undoes it."""
    return SkewedRouting(model, hot, bias)
