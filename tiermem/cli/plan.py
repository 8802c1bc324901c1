"""``python -m tiermem plan``: what wrap_module / load_pretrained would do with a model, on any machine.

    python -m tiermem plan path/to/checkpoint --budget 8GB --host-budget 16GB --disk-gbps 6
    python -m tiermem plan llama hidden_size=4096 num_hidden_layers=32 --budget 25% --device-memory 80GB

It plans causal language models, the model types transformers builds with AutoModelForCausalLM
(``--list-models``; NOTE [causal models only] in inference/configs.py). The model is built from its config with meta parameters (no weights, no GPU), grouped by
module_groups, and planned by plan_residency and plan_host: the same functions, with the same
arguments, that adoption uses, so the plan printed is the plan a GPU run makes (less any budget
the device cannot hold, which adoption shrinks and says so). The times are transfer bounds: the
bytes a forward moves over the link and reads from disk at the rates given, the prefill streaming
every group not resident and a decode step reading in place what it may (NOTE [streaming plan]).
Compute is not counted: offloaded forwards are transfer-bound by a wide margin.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import numbers
import os
from typing import Any

from ..base.limits import check_bytes, parse_bytes
from ..errors import ConfigError, ConfigTypeError, TierMemError
from ..inference.configs import causal_types, check_causal, read_config
from ..inference.groups import (MAX_GROUP, enclosing_groups, fit_groups, gathered_groups, home_layout, is_stacked,
                                module_groups, span_of)
from ..inference.load import INDEX, SINGLE, Checkpoint, FileTensor, check_dtype
from ..inference.plan import LINK_GBPS, LOOKAHEAD, Plan, plan_host, plan_residency, stay_home
from ..inference.split import find_cuts

__all__ = ["ModelPlan", "plan_model", "load_config"]

DISK_GBPS = 3.0         # assumed when a plan reads from disk and no rate is given: a typical NVMe drive, cold
ZERO_COPY_MAX_TOKENS = 16   # TieredModule's default: forwards of at most this many tokens are decode steps
OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".gguf")   # weights in a form load_pretrained does not read


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """A model's plan and its predicted transfer time per forward (seconds)."""

    name: str
    source: str
    dtype: str
    plan: Plan
    link_GBps: float
    disk_GBps: float | None
    tokens: int
    prefill_seconds: float
    decode_seconds: float
    decode_moved: int           # bytes a decode step moves over the link (streamed and read in place)
    decode_disk: int            # bytes a decode step reads from disk
    routed_share: float         # the share of stacked experts a decode step reads (top-k over experts)
    warnings: tuple[str, ...] = ()  # what the plan assumed that its input did not say

    def text(self, limit: int = 8, warnings: bool = True) -> str:
        p = self.plan
        gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
        host_moved = p.moved_bytes - p.disk_bytes
        lines = [f"{self.name} from {self.source}: {gb(p.total)} of {self.dtype} weights in {len(p.sizes)} groups",
                 f"on the device ({gb(p.budget)} budget): {gb(p.pinned_bytes)} resident in {len(p.pinned)} groups"
                 + (f", a {gb(p.window)} window of {p.lookahead} slots for streamed groups" if p.window else "")]
        if p.zero_copy_only:
            lines.append("  the budget has no room for a window: every streamed group is read in place (zero-copy)")
        lines.append(f"from host (pinned): {gb(host_moved)} streamed per forward"
                     + (f", {gb(sum(n for g, n in p.sizes if g in p.in_place))} read in place (embeddings)"
                        if p.in_place else ""))
        if p.on_disk:
            lines.append(f"from disk: {gb(p.disk_bytes)} in {len(p.on_disk)} groups, read through {p.stages} staging "
                         f"buffers of {gb(p.stage_bytes)}; pinned {gb(p.pinned_host_bytes)} of the "
                         f"{gb(p.host_budget or 0)} host budget")
        elif p.host_budget is not None:
            lines.append(f"from disk: nothing (pinned {gb(p.pinned_host_bytes)} of the {gb(p.host_budget)} host budget)")
        disk = lambda n: f" ({gb(n)} of them from disk)" if p.on_disk else ""  # noqa: E731
        lines.append(f"bytes per forward: prefill {gb(p.moved_bytes)}{disk(p.disk_bytes)}, "
                     f"decode {gb(self.decode_moved)}{disk(self.decode_disk)}"
                     + (f"; a decode step reads {self.routed_share:.0%} of the experts" if self.routed_share < 1 else ""))
        rates = f"link {self.link_GBps:g} GB/s" + (f", disk {self.disk_GBps:g} GB/s" if p.on_disk else "")
        lines.append(f"predicted at {rates}: prefill 1x{self.tokens} {self.prefill_seconds * 1e3:.1f} ms, "
                     f"decode {self.decode_seconds * 1e3:.1f} ms per token (transfer bounds; compute not counted)")
        body = p.table(self.link_GBps, limit=limit).splitlines()[2:]
        return "\n".join([f"warning: {w}" for w in self.warnings if warnings] + lines
                         + (["groups (module order):"] + body if limit else []))

    def __str__(self) -> str:
        return self.text()


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def load_config(model: str | os.PathLike, overrides: dict[str, Any] | None = None) -> tuple[Any, str]:
    """(transformers config, where it came from) for a checkpoint folder, a config.json, or a
    model type ("llama") with ``overrides`` (field -> value); see inference/configs.py."""
    cfg, source, _ = read_config(model, overrides)
    return cfg, source


def check_rate(value: Any, what: str) -> float:
    """A transfer rate in GB/s: a finite number above 0, else :class:`ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigTypeError(f"{what} must be a number of GB/s, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{what} must be a positive, finite number of GB/s, got {value!r}")
    return float(value)


def check_count(value: Any, what: str, least: int) -> int:
    """An int of at least ``least``, else :class:`ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigTypeError(f"{what} must be an int, got {value!r}")
    if value < least:
        raise ConfigError(f"{what} must be at least {least}, got {value}")
    return int(value)


def _checkpoint(model: Any) -> Checkpoint | None:
    """The checkpoint in a folder that holds safetensors weights; None for a config alone (planned as
    if save_pretrained had written its weights). Weights that are there but bad are refused as
    load_pretrained refuses them (:class:`CheckpointError`)."""
    if not isinstance(model, (str, os.PathLike)) or not os.path.isdir(model):
        return None
    if not any(os.path.exists(os.path.join(model, f)) for f in (SINGLE, INDEX)):
        return None
    return Checkpoint(model)


def plan_model(model: str | os.PathLike | Any, budget: int | str, host_budget: int | str | None = None, *,
               link_GBps: float = LINK_GBPS, disk_GBps: float | None = None, tokens: int = 128,
               overrides: dict[str, Any] | None = None, dtype: Any = None, lookahead: int = LOOKAHEAD,
               max_group_bytes: int | None = None, device_memory: int | str | None = None) -> ModelPlan:
    """The plan adoption makes for ``model`` (a checkpoint folder, a config.json, a model type with
    ``overrides``, or a transformers config) within ``budget`` device bytes and ``host_budget``
    pinned bytes, and its predicted prefill of ``tokens`` tokens and decode per token (seconds) at
    ``link_GBps`` and ``disk_GBps``. A percentage budget is a share of ``device_memory`` (the
    GPU's total memory; NOTE [sizes] in base/limits.py). Builds nothing real; needs no GPU.

    Every argument, the config and the checkpoint's headers are checked before the model is built:
    a bad one raises :class:`ConfigError`, a checkpoint load_pretrained would refuse
    :class:`CheckpointError`, both ValueErrors. Building the model needs torch."""
    link_GBps = check_rate(link_GBps, "link_GBps")
    disk_GBps = None if disk_GBps is None else check_rate(disk_GBps, "disk_GBps")
    check_count(tokens, "tokens", 1)
    check_count(lookahead, "lookahead", 1)
    if max_group_bytes is not None:
        check_count(max_group_bytes, "max_group_bytes", 1)
    check_bytes(budget, what="module budget", max_percent=100)
    if device_memory is not None:
        check_bytes(device_memory, what="device memory", positive=True)
    device = None if device_memory is None else parse_bytes(device_memory, what="device memory")
    budget_bytes = parse_bytes(budget, total=device, what="module budget", max_percent=100)
    host = None if host_budget is None else parse_bytes(host_budget, what="host budget")
    check_dtype(dtype)
    if not isinstance(model, (str, os.PathLike)):
        if not isinstance(getattr(model, "model_type", None), str):
            raise ConfigTypeError(f"plan_model takes a checkpoint folder, a config.json, a model type or a "
                                  f"transformers config, got {type(model).__name__}")
        cfg, source, unset = model, "a config", []
    else:
        cfg, source, unset = read_config(model, overrides)
    if isinstance(model, (str, os.PathLike)) and os.path.exists(model):
        check_causal(cfg, os.path.join(model, "config.json") if os.path.isdir(model) else os.fspath(model))
    else:
        check_causal(cfg)
    ckpt = _checkpoint(model)
    try:
        import torch  # noqa: F401
    except ImportError:
        checked = f" (its checkpoint's {len(ckpt)} tensors, {ckpt.nbytes / 1e9:.2f} GB, are well formed)" if ckpt else ""
        raise TierMemError(f"planning {cfg.model_type} builds it from its config on the meta device, which needs "
                           f"torch: pip install torch{checked}") from None
    from ..inference.load import build_model, checkpoint_weights, weights_dtype, weights_source

    want = weights_dtype(dtype, cfg, ckpt, fallback="float16")
    tensors = weights_source(ckpt, cfg, want) if ckpt is not None else None
    m = build_model(cfg, want)
    found = module_groups(m, MAX_GROUP if max_group_bytes is None else max_group_bytes)
    if max_group_bytes is None:        # as adoption groups it (groups.fit_groups)
        found = fit_groups(m, found, budget_bytes, lookahead)
    weights = checkpoint_weights(tensors, m, str(want).replace("torch.", "") if dtype is not None else None, unset) \
        if tensors is not None else None
    warnings = []
    if ckpt is None and unset:        # with a checkpoint, a wrong default is refused above
        warnings.append(f"{source} does not set {', '.join(unset)}: planned with transformers' defaults for "
                        f"{cfg.model_type} ({', '.join(f'{f}={getattr(cfg, f)}' for f in unset)})")
    if ckpt is None and isinstance(model, (str, os.PathLike)) and os.path.isdir(model):
        other = sorted(f for f in os.listdir(model) if f.endswith(OTHER_WEIGHTS))
        if other:
            warnings.append(f"{model} holds {', '.join(other[:2])}{' ...' if len(other) > 2 else ''} but no safetensors "
                            "weights, which are all load_pretrained reads: planned from its config")
    sizes = [(name, sum(span_of(t) for _, t in own)) for name, _, own in found]
    cuts = find_cuts(m, found)          # NOTE [split groups] in inference/split.py
    plan = plan_residency(sizes, budget_bytes, lookahead, in_place=gathered_groups(m, found) | enclosing_groups(found),
                          split={g: c.unit for g, c in cuts.items()})
    if host is not None:
        # Every parameter is in the files byte for byte (as save_pretrained writes them), unless the
        # checkpoint at hand says otherwise: the rule adoption applies (NOTE [disk tier]).
        names: dict[int, list[str]] = {}
        for n, t in m.named_parameters(remove_duplicate=False):
            names.setdefault(id(t), []).append(n)

        def in_files(t: Any) -> bool:
            if weights is None:
                return True
            return isinstance(next((weights[n] for n in names.get(id(t), []) if n in weights), None), FileTensor)
        groups = [(name, [t for _, t in own]) for name, _, own in found]
        plan = plan_host(plan, [(name, home_layout(ts)[1]) for name, ts in groups], host,
                         keep=stay_home(groups, in_files) | {g for g, c in cuts.items() if c.gathers})
    if plan.on_disk and disk_GBps is None:
        disk_GBps = DISK_GBPS
    # A decode step (NOTE [streaming plan]): dense groups stream, stacked experts in the home are
    # read in place (the routed share of them), groups on disk are read whole.
    stacked = {name for name, _, own in found if is_stacked([t for _, t in own])}
    k = getattr(cfg, "num_experts_per_tok", None)
    e = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    share = min(1.0, k / e) if isinstance(k, int) and isinstance(e, int) and e else 1.0
    moving = [(g, n) for g, n in plan.sizes if g not in plan.pinned and g not in plan.in_place]
    decode_disk = sum(n for g, n in moving if g in plan.on_disk)
    decode_moved = sum(n * (share if g in stacked and g not in plan.on_disk else 1.0) for g, n in moving)
    decode = (decode_moved - decode_disk) / (link_GBps * 1e9) + (decode_disk / (disk_GBps * 1e9) if decode_disk else 0.0)
    decode_only = tokens <= ZERO_COPY_MAX_TOKENS
    prefill = decode if decode_only else plan.predicted_seconds(link_GBps, disk_GBps)
    return ModelPlan(type(m).__name__ + f" ({cfg.model_type})", str(source), str(want).replace("torch.", ""), plan,
                     link_GBps, disk_GBps if plan.on_disk else None, tokens, prefill, decode, int(decode_moved),
                     decode_disk, share, tuple(warnings))


def _arg(check: Any, *args: Any) -> Any:
    """An argparse type from a check: its ConfigError becomes argparse's one-line error."""
    def parse(text: str) -> Any:
        try:
            return check(text, *args)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"expected a positive, finite number of GB/s, got {text!r}")
    return value


def _count(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise ConfigError(f"expected a whole number of at least {least}, got {text!r}")
    return value


def _size(text: str, what: str, max_percent: float | None, positive: bool = False) -> str:
    check_bytes(text, what=what, max_percent=max_percent, positive=positive)
    if max_percent is None:
        parse_bytes(text, what=what)       # no percentage: a share of nothing known
    return text


def _quiet_transformers() -> None:
    # transformers speaks on import (with no torch: "PyTorch was not found") and while it builds a
    # model; the command says itself what matters, and an error must stay one line.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


class _ListModels(argparse.Action):
    """``--list-models``: the model types the command plans, then exit (as ``--version`` does)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        _quiet_transformers()
        names = causal_types()
        print(f"{len(names)} model types, the causal LMs transformers builds with AutoModelForCausalLM:")
        print("\n".join(names))
        parser.exit(0)


def add_parser(sub: Any) -> None:
    """The ``plan`` subcommand, for tiermem's command line."""
    p = sub.add_parser("plan", help="what stays on the device, streams from host and from disk, and the predicted "
                                     "time per token, for a causal language model transformers builds (no GPU needed)",
                       description="Plan a causal language model (a model type AutoModelForCausalLM builds: "
                                   "--list-models lists them) as wrap_module and load_pretrained would. Encoder and "
                                   "encoder-decoder models (ViT, T5) are not planned.")
    p.add_argument("model", nargs="+", help="a checkpoint folder, a config.json, or a model type followed by "
                                            "overrides like hidden_size=4096 num_hidden_layers=32")
    p.add_argument("--list-models", action=_ListModels, help="list the model types it plans, and exit")
    p.add_argument("--budget", required=True, type=_arg(_size, "budget", 100),
                   help="device budget: bytes, '8GB', or a share of the GPU like '25%%' (with --device-memory)")
    p.add_argument("--device-memory", default=None, metavar="SIZE", type=_arg(_size, "device memory", None, True),
                   help="the GPU's total memory, which a percentage budget is a share of, e.g. 80GB")
    p.add_argument("--host-budget", default=None, type=_arg(_size, "host budget", None),
                   help="pinned host memory allowed; the rest is read from disk")
    p.add_argument("--link-gbps", type=_arg(_rate), default=LINK_GBPS, metavar="GBPS",
                   help=f"pinned host-to-device rate, GB/s, above 0 (default {LINK_GBPS:g})")
    p.add_argument("--disk-gbps", type=_arg(_rate), default=None, metavar="GBPS",
                   help=f"disk read rate, GB/s, above 0 (default {DISK_GBPS:g})")
    p.add_argument("--tokens", type=_arg(_count, 1), default=128, metavar="N", help="prefill length, tokens, at least 1")
    p.add_argument("--dtype", default=None, type=_arg(check_dtype),
                   help="weight dtype (default: the config's, else the checkpoint's, else float16)")
    p.add_argument("--groups", type=_arg(_count, 0), default=8, metavar="N", help="group rows to print (0: none)")


def run(args: Any) -> int:
    """Print the plan for parsed ``plan`` arguments; returns the exit status. Warnings (what the
    plan assumed) go to stderr, the plan to stdout."""
    import sys
    _quiet_transformers()
    overrides = {}
    for kv in args.model[1:]:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise ConfigError(f"override {kv!r} is not field=value")
        overrides[k] = _value(v)
    if str(args.budget).strip().endswith("%") and args.device_memory is None:
        raise ConfigError(f"--budget {args.budget} is a share of the device's memory: give --device-memory too "
                          "(e.g. 80GB), or a size like 8GB")
    mp = plan_model(args.model[0], args.budget, args.host_budget, link_GBps=args.link_gbps, disk_GBps=args.disk_gbps,
                    tokens=args.tokens, overrides=overrides, dtype=args.dtype, device_memory=args.device_memory)
    for w in mp.warnings:
        print(f"python -m tiermem plan: warning: {w}", file=sys.stderr)
    print(mp.text(limit=args.groups, warnings=False))
    return 0
