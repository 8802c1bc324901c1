"""Reference models for tests, benches and examples, written out in plain torch.nn so that a run
is the same on any machine: a GPT-2-style decoder and ResNet-50; a router skewed on purpose
(:func:`skew_router`) and the agreement of two models' logits (:func:`logits_agreement`)."""
from .models import GPT, GPTConfig, gpt_param_count, resnet50
from .moe import SkewedRouting, routers, skew_router
from .quality import logits_agreement

__all__ = ["GPT", "GPTConfig", "resnet50", "gpt_param_count", "skew_router", "SkewedRouting", "routers",
           "logits_agreement"]
