"""``python -m tiermem plan``: what wrap_module / load_pretrained would do with a model, on any machine.

    python -m tiermem plan path/to/checkpoint --budget 8GB --host-budget 16GB --disk-gbps 6
    python -m tiermem plan llama hidden_size=4096 num_hidden_layers=32 --budget 25% --device-memory 80GB

The model is built from its config with meta parameters (no weights, no GPU), grouped by
module_groups, and planned by plan_residency and plan_host: the same functions, with the same
arguments, that adoption uses, so the plan printed is the plan a GPU run makes (less any budget
the device cannot hold, which adoption shrinks and says so). The times are transfer bounds: the
bytes a forward moves over the link and reads from disk at the rates given, the prefill streaming
every group not resident and a decode step reading in place what it may (NOTE [streaming plan]).
Compute is not counted: offloaded forwards are transfer-bound by a wide margin.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from ..base.limits import parse_bytes
from ..inference.groups import (MAX_GROUP, enclosing_groups, fit_groups, gathered_groups, home_layout, is_stacked,
                                module_groups, span_of)
from ..inference.plan import LINK_GBPS, LOOKAHEAD, Plan, plan_host, plan_residency, stay_home
from ..inference.split import find_cuts

__all__ = ["ModelPlan", "plan_model", "load_config"]

DISK_GBPS = 3.0         # assumed when a plan reads from disk and no rate is given: a typical NVMe drive, cold
ZERO_COPY_MAX_TOKENS = 16   # TieredModule's default: forwards of at most this many tokens are decode steps


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

    def text(self, limit: int = 8) -> str:
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
        return "\n".join(lines + (["groups (module order):"] + body if limit else []))

    def __str__(self) -> str:
        return self.text()


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def load_config(model: str | os.PathLike, overrides: dict[str, Any] | None = None) -> tuple[Any, str]:
    """(transformers config, where it came from) for a checkpoint folder, a config.json, or a
    model type ("llama") with ``overrides`` (field -> value)."""
    import transformers
    model = os.fspath(model)
    overrides = dict(overrides or {})
    if os.path.isdir(model):
        cfg = transformers.AutoConfig.from_pretrained(model, local_files_only=True, **overrides)
    elif os.path.isfile(model):
        with open(model) as f:
            d = json.load(f)
        d.update(overrides)
        cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    else:
        try:
            cfg = transformers.AutoConfig.for_model(model, **overrides)
        except ValueError as e:
            from ..errors import TierMemError
            raise TierMemError(f"{model!r} is neither a checkpoint folder, a config.json nor a model type "
                               f"transformers knows ({e})") from None
    return cfg, model


def plan_model(model: str | os.PathLike | Any, budget: int | str, host_budget: int | str | None = None, *,
               link_GBps: float = LINK_GBPS, disk_GBps: float | None = None, tokens: int = 128,
               overrides: dict[str, Any] | None = None, dtype: Any = None, lookahead: int = LOOKAHEAD,
               max_group_bytes: int | None = None, device_memory: int | str | None = None) -> ModelPlan:
    """The plan adoption makes for ``model`` (a checkpoint folder, a config.json, a model type with
    ``overrides``, or a transformers config) within ``budget`` device bytes and ``host_budget``
    pinned bytes, and its predicted prefill of ``tokens`` tokens and decode per token (seconds) at
    ``link_GBps`` and ``disk_GBps``. A percentage budget is a share of ``device_memory`` (the
    GPU's total memory; NOTE [sizes] in base/limits.py). Builds nothing real; needs no GPU."""
    import torch
    import transformers

    from ..inference.load import Checkpoint, config_dtype, empty_weights, model_weights, to_torch_dtype
    if isinstance(model, transformers.PretrainedConfig):
        cfg, source = model, "a config"
    else:
        cfg, source = load_config(model, overrides)
    ckpt = None
    if isinstance(model, (str, os.PathLike)) and os.path.isdir(model):
        from ..errors import CheckpointError
        try:
            ckpt = Checkpoint(model)
        except CheckpointError:
            ckpt = None             # a folder with a config only: plan as if save_pretrained had written it
    floating = {k: v for k, v in (ckpt.dtypes() if ckpt else {}).items() if k.startswith(("float", "bfloat"))}
    want = (to_torch_dtype(dtype) or to_torch_dtype(config_dtype(cfg))
            or (getattr(torch, max(floating, key=floating.get)) if floating else torch.float16))
    with empty_weights():
        m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=want)
    found = module_groups(m, MAX_GROUP if max_group_bytes is None else max_group_bytes)
    device = None if device_memory is None else parse_bytes(device_memory, what="device memory")
    b = parse_bytes(budget, total=device, what="module budget", max_percent=100)
    if max_group_bytes is None:
        found = fit_groups(m, found, b, lookahead)
    sizes = [(name, sum(span_of(t) for _, t in own)) for name, _, own in found]
    cuts = find_cuts(m, found)
    plan = plan_residency(sizes, b, lookahead, in_place=gathered_groups(m, found) | enclosing_groups(found),
                          split={g: c.unit for g, c in cuts.items()})
    if host_budget is not None:
        # Every parameter is in the files byte for byte (as save_pretrained writes them), unless the
        # checkpoint at hand says otherwise: the rule adoption applies (NOTE [disk tier]).
        names: dict[int, list[str]] = {}
        for n, t in m.named_parameters(remove_duplicate=False):
            names.setdefault(id(t), []).append(n)

        files = model_weights(ckpt, m) if ckpt is not None else {}

        def in_files(t: Any) -> bool:
            if ckpt is None:
                return True
            got = next((files[n] for n in names.get(id(t), []) if n in files), None)
            return got is not None and got.dtype == str(t.dtype).replace("torch.", "")
        groups = [(name, [t for _, t in own]) for name, _, own in found]
        plan = plan_host(plan, [(name, home_layout(ts)[1]) for name, ts in groups],
                         parse_bytes(host_budget, what="host_budget"),
                         keep=stay_home(groups, in_files) | {g for g, c in cuts.items() if c.gathers})
    if plan.on_disk and not disk_GBps:
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
                     decode_disk, share)


def add_parser(sub: Any) -> None:
    """The ``plan`` subcommand, for tiermem's command line."""
    p = sub.add_parser("plan", help="what stays on the device, streams from host and from disk, and the predicted "
                                     "time per token, for any transformers model (no GPU needed)")
    p.add_argument("model", nargs="+", help="a checkpoint folder, a config.json, or a model type followed by "
                                            "overrides like hidden_size=4096 num_hidden_layers=32")
    p.add_argument("--budget", required=True, help="device budget: bytes, '8GB', or a share of the GPU like '25%%' "
                                                   "(with --device-memory)")
    p.add_argument("--device-memory", default=None, metavar="SIZE", help="the GPU's total memory, which a percentage "
                                                                        "budget is a share of, e.g. 80GB")
    p.add_argument("--host-budget", default=None, help="pinned host memory allowed; the rest is read from disk")
    p.add_argument("--link-gbps", type=float, default=LINK_GBPS, help="pinned host-to-device rate, GB/s")
    p.add_argument("--disk-gbps", type=float, default=None, help=f"disk read rate, GB/s (default {DISK_GBPS:g})")
    p.add_argument("--tokens", type=int, default=128, help="prefill length, tokens")
    p.add_argument("--dtype", default=None, help="weight dtype (default: the config's, else the checkpoint's, else float16)")
    p.add_argument("--groups", type=int, default=8, help="group rows to print (0: none)")


def run(args: Any) -> int:
    """Print the plan for parsed ``plan`` arguments; returns the exit status."""
    overrides = {}
    for kv in args.model[1:]:
        k, sep, v = kv.partition("=")
        if not sep:
            from ..errors import TierMemError
            raise TierMemError(f"override {kv!r} is not field=value")
        overrides[k] = _value(v)
    mp = plan_model(args.model[0], args.budget, args.host_budget, link_GBps=args.link_gbps, disk_GBps=args.disk_gbps,
                    tokens=args.tokens, overrides=overrides, dtype=args.dtype, device_memory=args.device_memory)
    print(mp.text(limit=args.groups))
    return 0
