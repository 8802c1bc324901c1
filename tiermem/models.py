"""Moved to :mod:`tiermem.testing`; importing from here still works, with a DeprecationWarning
(NOTE [public names] in tiermem/__init__.py)."""
import warnings

from .testing import GPT, GPTConfig, gpt_param_count, resnet50

__all__ = ["GPT", "GPTConfig", "resnet50", "gpt_param_count"]
warnings.warn("tiermem.models is now tiermem.testing", DeprecationWarning, stacklevel=2)
