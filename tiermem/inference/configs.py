"""transformers configs, read and checked before a model is built from one.

load_pretrained and ``python -m tiermem plan`` take a checkpoint folder's config.json (plan also a
config.json alone, or a model type with field overrides). :func:`read_config` reads it and refuses,
in one line that names the file or the name, what transformers would answer with a traceback or a
list of every model it knows: a folder with no config.json, broken JSON, no ``model_type``, a model
type transformers does not know (with the close names), an override of a field the config does not
have or of the wrong type. :func:`check_causal` refuses a model that is not a causal language model
(ViT, T5): both build a model with ``AutoModelForCausalLM`` and plan its decoder layers' streaming,
which an encoder or an encoder-decoder model does not follow (NOTE [causal models only]).
:func:`defaulted` names the size fields a config file leaves to transformers' defaults. Needs
transformers, not torch.

NOTE [causal models only]
    The streaming plan (NOTE [streaming plan] in inference/plan.py) brings groups in in the order
    of the first forward and predicts a prefill and a decode step of one model that runs whole on
    every token. An encoder-decoder model runs its encoder once and its decoder per token, so the
    order of the first forward (encoder then decoder) is not the order of the next, and its
    decode would be predicted with the encoder's bytes in it; an encoder alone (ViT, BERT) has no
    decode step at all. Such models can still be adopted with ``wrap_module``, which plans any
    module; the command and load_pretrained say they build causal LMs only, rather than print a
    plan that does not hold.
"""
from __future__ import annotations

import difflib
import json
import os
from typing import Any

from ..errors import CheckpointError, ConfigError, ConfigTypeError, TierMemError

__all__ = ["read_config", "check_causal", "causal_types", "model_types", "defaulted", "reason", "SIZE_FIELDS",
           "LIST_HINT"]

CONFIG = "config.json"
# The fields that set a model's size: a config file without them is planned with transformers'
# defaults (a Llama of 4096 x 32 layers), which is rarely what a file that omits them describes.
SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size")
LIST_HINT = "python -m tiermem plan --list-models lists them"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise TierMemError("reading a model's config needs transformers; pip install transformers") from e
    return transformers


def model_types() -> list[str]:
    """Every model type this transformers knows (its configs)."""
    _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    return list(CONFIG_MAPPING_NAMES)


def causal_types() -> list[str]:
    """The model types ``AutoModelForCausalLM`` builds: the ones load_pretrained and the plan
    command take (NOTE [causal models only])."""
    _transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _unknown(name: Any, where: str) -> str:
    close = difflib.get_close_matches(str(name), causal_types(), n=3) if isinstance(name, str) else []
    hint = f" (close: {', '.join(close)})" if close else ""
    return (f"{where}{name!r} is not a model type transformers {_transformers().__version__} knows{hint}; "
            f"{len(causal_types())} can be planned and loaded: {LIST_HINT}")


def check_causal(config: Any, source: str = "") -> None:
    """Raise :class:`ConfigError` unless ``config`` (read from ``source``, a file or folder named in
    the message) is one of a causal LM (NOTE [causal models only])."""
    mt = getattr(config, "model_type", None)
    if mt in causal_types():
        return
    kind = "an encoder-decoder model" if getattr(config, "is_encoder_decoder", False) else "not a causal language model"
    raise ConfigError(f"{source + ': ' if source else ''}{mt} ({type(config).__name__}) is {kind}: plan and load_pretrained build causal LMs only, "
                      f"the {len(causal_types())} model types of AutoModelForCausalLM ({LIST_HINT}); wrap_module "
                      "adopts any other module")


def _config_class(model_type: str) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    return CONFIG_MAPPING[model_type]


def _read_json(file: str) -> dict[str, Any]:
    try:
        with open(file, "rb") as f:
            d = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON ({e})", file) from None
    except OSError as e:
        raise CheckpointError(f"{file} cannot be read ({e.strerror or e})", file) from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{file} holds a JSON {type(d).__name__}, not a config object", file)
    return d


def _check_overrides(config_class: Any, overrides: dict[str, Any]) -> None:
    """Each override names a field of ``config_class`` and has its default's type."""
    if not overrides:
        return
    fields = config_class().to_dict()
    amap = getattr(config_class, "attribute_map", {})
    known = set(fields) | set(amap)
    sizes = set(SIZE_FIELDS) | {amap[f] for f in SIZE_FIELDS if f in amap}
    for k, v in overrides.items():
        if k not in known:
            close = difflib.get_close_matches(k, sorted(known), n=1)
            raise ConfigError(f"{config_class.model_type} has no field {k!r}"
                              + (f"; did you mean {close[0]!r}?" if close else ""))
        default = fields.get(k, fields.get(amap.get(k, k)))
        if isinstance(default, bool):
            ok, kind = isinstance(v, bool), "true or false"
        elif isinstance(default, int):
            ok, kind = isinstance(v, int) and not isinstance(v, bool), "an int"
        elif isinstance(default, float):
            ok, kind = isinstance(v, (int, float)) and not isinstance(v, bool), "a number"
        else:
            continue
        if not ok:
            raise ConfigTypeError(f"{k}={v!r}: {config_class.model_type}'s {k} is {kind} (default {default!r})")
        if k in sizes and v < 1:
            raise ConfigError(f"{k}={v!r}: a model's {k} is at least 1")


def read_config(model: str | os.PathLike, overrides: dict[str, Any] | None = None) -> tuple[Any, str, list[str]]:
    """(transformers config, where it came from, the size fields left to defaults) for a checkpoint
    folder, a config.json, or a model type with ``overrides`` (field -> value). A bad file raises
    :class:`CheckpointError`; a bad name or override :class:`ConfigError`."""
    tf = _transformers()
    model = os.fspath(model)
    overrides = dict(overrides or {})
    if os.path.isdir(model):
        file = os.path.join(model, CONFIG)
        if not os.path.isfile(file):
            raise CheckpointError(f"{model} has no {CONFIG}: it is not a checkpoint folder as save_pretrained writes "
                                  "it", model)
    elif os.path.isfile(model):
        if model.endswith(".safetensors"):
            raise CheckpointError(f"{model} is a weights file: give the folder that holds it and its {CONFIG}", model)
        file = model
    elif os.sep in model or model.endswith(".json") or (os.altsep and os.altsep in model):
        raise ConfigError(f"{model} does not exist")
    else:
        if model not in model_types():
            raise ConfigError(_unknown(model, ""))
        cls = _config_class(model)
        _check_overrides(cls, overrides)
        return _built(lambda: tf.AutoConfig.for_model(model, **overrides), "", model), model, []
    d = _read_json(file)
    mt = d.get("model_type")
    if mt is None:
        raise CheckpointError(f"{file} has no model_type: it does not say which model it configures", file)
    if mt not in model_types():
        raise CheckpointError(_unknown(mt, f"{file}: model_type "), file)
    cls = _config_class(mt)
    _check_overrides(cls, overrides)
    cfg = _built(lambda: tf.AutoConfig.from_pretrained(model, local_files_only=True, **overrides), f"{file}: ", mt)
    return cfg, model, defaulted(d, cls, overrides)


def reason(e: BaseException) -> str:
    """One line for an error from transformers: the first line of its root cause (huggingface_hub's
    validation errors wrap the ValueError that says what is wrong), with the cause's type."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0].strip()}" if lines else type(e).__name__


def _built(make: Any, where: str, mt: str) -> Any:
    """The config ``make`` builds; transformers' refusal of its values as one line naming ``where``."""
    try:
        return make()
    except Exception as e:
        # The values are the user's, checked by the config class in whatever way it checks them
        # (ValueError, TypeError, huggingface_hub's validation errors): each is a refusal of them.
        raise ConfigError(f"{where}transformers refuses this {mt} config: {reason(e)}") from e


def defaulted(fields: dict[str, Any], config_class: Any, overrides: dict[str, Any] | None = None) -> list[str]:
    """The size fields (:data:`SIZE_FIELDS`) that a config file's ``fields`` and ``overrides`` leave
    to transformers' defaults, under the config's own names (GPT-2's n_embd is its hidden_size)."""
    given = set(fields) | set(overrides or {})
    amap = getattr(config_class, "attribute_map", {})
    default = config_class()
    return [f for f in SIZE_FIELDS if hasattr(default, f) and f not in given and amap.get(f) not in given]
