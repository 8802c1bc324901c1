"""Reference models for tests, benches and examples, written out in plain torch.nn so that a run
is the same on any machine: a GPT-2-style decoder and ResNet-50; a router skewed on purpose
(:func:`skew_router`), the agreement of two models' logits (:func:`logits_agreement`) and of
each Linear's output with its reference weight's (:func:`linear_agreement`)."""
from .models import GPT, GPTConfig, gpt_param_count, resnet50
from .moe import SkewedRouting, routers, skew_router
from .quality import linear_agreement, logits_agreement

__all__ = ["GPT", "GPTConfig", "resnet50", "gpt_param_count", "skew_router", "SkewedRouting", "routers",
           "logits_agreement", "linear_agreement"]
