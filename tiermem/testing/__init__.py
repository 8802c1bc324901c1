"""Reference models for tests, benches and examples, written out in plain torch.nn so that a run
is the same on any machine: a GPT-2-style decoder and ResNet-50."""
from .models import GPT, GPTConfig, gpt_param_count, resnet50

__all__ = ["GPT", "GPTConfig", "resnet50", "gpt_param_count"]
