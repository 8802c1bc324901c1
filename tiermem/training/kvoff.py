"""A transformers model's KV cache, off for a training step's length (NOTE [no KV cache in a step]).

NOTE [no KV cache in a step]
    transformers' configs default to use_cache=True, and a model forward then builds a KV
    cache (a DynamicCache) and hands it to every layer, training or not. Inside a step the
    cache does harm: it references every layer's keys and values until the step ends, so the
    swap moves them to the host and the device keeps them all the same, and a recomputed
    layer's second forward appends its keys and values to the cache again. transformers
    itself turns the cache off in a layer that gradient checkpointing runs
    (GradientCheckpointingLayer in transformers/modeling_layers.py); tiermem turns off the
    config's default for the step's length, so a call that passes use_cache=True itself still
    gets its cache, and between steps (evaluation, generate()) the config is the user's.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["kv_cache_configs", "kv_cache_off"]


def kv_cache_configs(model: Any) -> list[Any]:
    """The model's configs (its own and its text model's) whose use_cache default is True."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return []
    found = [cfg]
    text = getattr(cfg, "get_text_config", None)
    if callable(text):
        try:
            t = text()
        except Exception:      # noqa: BLE001 - a config without a text part
            t = None
        if t is not None and t is not cfg:
            found.append(t)
    return [c for c in found if getattr(c, "use_cache", None) is True]


@contextlib.contextmanager
def kv_cache_off(model: Any) -> Iterator[None]:
    """NOTE [no KV cache in a step]: ``use_cache`` False inside in the model's configs where it is
    True at entry, True again after (a config the user turned off between steps stays off)."""
    configs = kv_cache_configs(model)
    for c in configs:
        c.use_cache = False
    try:
        yield
    finally:
        for c in configs:
            c.use_cache = True
