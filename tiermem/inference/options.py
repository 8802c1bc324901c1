"""wrap_module's options: one frozen record, documented and checked here once.

Each field is declared with its default, its check and its one-line description together
(``_option``); the class docstring's table of fields is made from those declarations, so adding
an option is one declaration. The record checks itself when it is made (``__post_init__``),
which needs no GPU: ``tiermem.wrap_module`` builds it before it makes the default Tier.
"""
from __future__ import annotations

import dataclasses
import numbers
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..base.keywords import check_names
from ..base.limits import check_bytes, parse_bytes
from ..errors import ConfigError, ConfigTypeError
from .disk import READERS
from .groups import MAX_GROUP
from .plan import LOOKAHEAD
from .quant import FORMATS, check_format

__all__ = ["ModuleOptions", "MODES", "check_devices"]

MODES = ("auto", "stream", "zero_copy")


# -- checks: each takes the field's name and value and raises ConfigError / ConfigTypeError ------

def _one_of(*choices: str) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if value not in choices:
            raise ConfigError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return check


def _count(least: int, what: str) -> Callable[[str, Any], None]:
    """An int (not a bool) of at least ``least``; ``what`` says what it counts."""
    def check(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ConfigTypeError(f"{name} must be an int ({what}), got {value!r}")
        if value < least:
            raise ConfigError(f"{name} must be at least {least} ({what}), got {value}")
    return check


def _or_none(check: Callable[[str, Any], None]) -> Callable[[str, Any], None]:
    """None, or what ``check`` takes."""
    def inner(name: str, value: Any) -> None:
        if value is not None:
            check(name, value)
    return inner


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigTypeError(f"{name} must be True or False, got {value!r}")


def _host_bytes(name: str, value: Any) -> None:
    """None, or a number of bytes ("64GiB"); not a share: the host's memory is not the device's."""
    if value is not None:
        parse_bytes(value, what=name)


def _kv_budget(name: str, value: Any) -> None:
    """None, "auto" (split the budget for kv_tokens, NOTE [kv plan]), or bytes or a share of the device."""
    if value is not None and value != "auto":
        check_bytes(value, what=name, max_percent=100)


def _stream_dtype(name: str, value: Any) -> None:
    """None, or one of quant.FORMATS (NOTE [quantized streaming] in inference/quant.py)."""
    check_format(value)


def _device_bytes_or_none(name: str, value: Any) -> None:
    """None, or bytes or a share of the device ("5%")."""
    if value is not None:
        check_bytes(value, what=name, max_percent=100)


def _cache_bytes_or_none(name: str, value: Any) -> None:
    """None, "auto", or bytes or a share of the device ("5%")."""
    if value != "auto":
        _device_bytes_or_none(name, value)


def _tokens_or_none(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
        raise ConfigError(f"{name} must be a number of tokens >= 1, got {value!r}")


def _mapping_or_none(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, Mapping):
        raise ConfigTypeError(f"{name} must be a Mapping from state-dict names to tensors (a state_dict, or a "
                              f"tiermem.handles.Checkpoint), or None; got {type(value).__name__}")


def check_devices(devices: Any, name: str = "devices") -> tuple[int, ...]:
    """``devices`` as a tuple of distinct CUDA device indices, at least two; ConfigError (or
    ConfigTypeError for what is no list of ints) otherwise."""
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
        raise ConfigTypeError(f"{name} must be a list of CUDA device indices, got {devices!r}")
    out = []
    for d in devices:
        if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0:
            raise ConfigError(f"{name} must be CUDA device indices >= 0, got {devices!r}")
        out.append(int(d))
    if len(out) < 2 or len(set(out)) != len(out):
        raise ConfigError(f"{name} must name at least two distinct GPUs, got {devices!r}; for one, leave {name} out")
    return tuple(out)


def _devices(name: str, value: Any) -> None:
    if value is not None:
        check_devices(value, name)


def _handle_or_none(name: str, value: Any) -> None:
    """None, or a handle wrap_module returned for one device (its plan and its home; the
    handle's own type is checked where the home is taken, in inference/module.py)."""
    if value is not None and not (hasattr(value, "plan") and callable(getattr(value, "unwrap", None))):
        raise ConfigTypeError(f"{name} takes the handle wrap_module returned for another replica of the same "
                              f"weights on one GPU, got {type(value).__name__}")


def _option(default: Any, check: Callable[[str, Any], None], doc: str, **field: Any) -> Any:
    return dataclasses.field(default=default, metadata={"check": check, "doc": doc}, **field)


@dataclasses.dataclass(frozen=True)
class ModuleOptions:
    """How :func:`tiermem.wrap_module` adopts a module and runs it, beside the module and its
    device budget. Every field has a default; a bad value raises :class:`ConfigError` (a
    ValueError), or :class:`ConfigTypeError` (a TypeError) for a wrong type, when the record is
    made, before any GPU is looked for. ``wrap_module(model, budget, **options)`` builds one
    from its keyword arguments (an unknown one is refused, naming the valid ones), or takes
    ``options=ModuleOptions(...)``. Frozen: :func:`dataclasses.replace` makes a changed copy.
    """

    mode: str = _option("auto", _one_of(*MODES),
                        "how streamed groups reach the kernels: 'auto' (copied into device slots ahead of use, "
                        "but in a decode step, see zero_copy_max_tokens, stacked expert weights are read in "
                        "place), 'stream' (always copied) or 'zero_copy' (always read in place) "
                        "(NOTE [streaming plan] in inference/plan.py)")
    lookahead: int = _option(LOOKAHEAD, _count(1, "streamed groups in flight"),
                             "streamed groups in flight at once, the window's slots (the plan may use fewer)")
    zero_copy_max_tokens: int = _option(16, _count(0, "tokens"),
                                        "tokens: in mode 'auto', a forward of at most this many is a decode "
                                        "step, which reads stacked expert weights in place")
    max_group_bytes: int | None = _option(None, _or_none(_count(1, "bytes")),
                                          "bytes: a submodule of at most this many is one group, moved in one "
                                          f"call. None: {MAX_GROUP:,}, or less for a budget too small to stream "
                                          "groups that big (groups.fit_groups, NOTE [no plan collapse] in "
                                          "inference/plan.py)")
    weights: Mapping[str, Any] | None = _option(
        None, _mapping_or_none,
        "where the bytes come from, by state-dict name, for a module built on the meta device "
        "(NOTE [weight source] in inference/sources.py); None: the module's own tensors",
        repr=False)
    host_budget: int | str | None = _option(
        None, _host_bytes,
        "bytes of pinned host memory allowed (int, or \"64GiB\"); beyond it streamed groups are read "
        "from their checkpoint files ahead of use (NOTE [disk tier] in inference/disk.py; needs weights "
        "from a Checkpoint). None: no limit")
    disk_reader: str = _option(READERS[0], _one_of(*READERS),
                               "what reads the disk tier: 'posix' (threads of os.preadv) or 'kvikio' "
                               "(NOTE [kvikio reader] in inference/kvikio.py)")
    kv_budget: int | str | None = _option(
        None, _kv_budget,
        "the budget's share for a KV cache that handle.kv_cache() makes: bytes, a share of the device, "
        "or 'auto' (the split that moves the fewest bytes per decode step, for kv_tokens; NOTE [kv plan] "
        "in inference/kvplan.py). None: no KV share")
    kv_tokens: int | None = _option(None, _tokens_or_none,
                                    "tokens: the most a sequence of the KV cache may reach (needed by "
                                    "kv_budget='auto')")
    stream_dtype: str | None = _option(
        None, _stream_dtype,
        f"None, or one of {', '.join(map(repr, FORMATS))}: the streamed groups' Linear and stacked-expert weights "
        "are kept packed at that size in the pinned home and dequantized into their slots (NOTE [quantized "
        "streaming] in inference/quant.py); lossy, so no forward may record gradients")
    expert_cache: int | str | None = _option(
        None, _cache_bytes_or_none,
        "bytes, or a share of the device like '5%', taken from the budget: the experts a decode routes to are "
        "kept on the device (NOTE [expert cache] in inference/experts.py). 'auto': the most the budget holds "
        "beyond the groups every decode step reads (NOTE [expert cache budget] in inference/module.py). "
        "None: no cache")
    share_home: Any = _option(
        None, _handle_or_none,
        "the handle of a replica of the same weights on another GPU of this process, whose pinned home "
        "this one reads instead of pinning its own, when its plan streams the same groups laid out alike "
        "(refused otherwise; NOTE [one home for replicas] in inference/transport.py). None: a home of its own",
        repr=False, compare=False)
    devices: tuple[int, ...] | None = _option(
        None, _devices,
        "CUDA devices (at least two) to spread the module's layers over, in contiguous runs of about equal "
        "bytes, each within the budget on its own GPU and streaming over its own link (tiermem.wrap_module "
        "then returns a SplitModule; NOTE [layers across GPUs] in inference/multidevice.py). None: one device")
    relay: bool = _option(
        True, _flag,
        "with devices: each GPU's streamed layers also cross the next GPU's link, half of each copy, and go on "
        "over the GPUs' peer link (NOTE [two links into one GPU] in inference/multidevice.py); 64 MiB of each GPU's "
        "budget; only where the GPUs reach each other's memory directly")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            f.metadata["check"](f.name, getattr(self, f.name))
        if self.kv_budget == "auto" and self.kv_tokens is None:
            raise ConfigError("kv_budget='auto' splits the budget for a context of kv_tokens tokens: give kv_tokens")
        if self.stream_dtype is not None and self.mode == "zero_copy":
            raise ConfigError(f"mode='zero_copy' reads every streamed weight in place, and stream_dtype="
                              f"{self.stream_dtype!r} keeps them packed, with no copy in the model's dtype to read; "
                              "use mode='auto' or 'stream' (NOTE [quantized streaming])")
        if self.devices is not None:
            object.__setattr__(self, "devices", check_devices(self.devices))   # a list given: kept as a tuple
            if self.share_home is not None:
                raise ConfigError("share_home is for replicas on one GPU each; a module spread over devices has one "
                                  "home already (its layers are split, not copied): leave share_home out")
            if self.kv_budget is not None:
                raise ConfigError("a KV share of the budget (kv_budget) is for a module on one GPU; spread over "
                                  "devices, transformers' own cache keeps each layer's keys and values on that "
                                  "layer's GPU: leave kv_budget out")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def of(cls, options: ModuleOptions | None = None, call: str = "wrap_module", taken: tuple[str, ...] = (), /,
           **kwargs: Any) -> ModuleOptions:
        """``options`` (default: every default) with the fields ``kwargs`` name changed. Raises
        :class:`ConfigTypeError` for a keyword that is no field of ``call`` (``taken``: fields it
        sets itself), naming the closest and the valid ones."""
        check_names(call, [n for n in cls.names() if n not in taken], kwargs)
        if options is None:
            return cls(**kwargs)
        if not isinstance(options, cls):
            raise ConfigTypeError(f"options must be a tiermem.handles.ModuleOptions, got {type(options).__name__}")
        return dataclasses.replace(options, **kwargs) if kwargs else options


def _fields_doc(cls: type) -> str:
    """The docstring's table of fields, from their declarations."""
    def shown(v: Any) -> str:
        return f"{v >> 20} MiB" if isinstance(v, int) and not isinstance(v, bool) and v >= 1 << 20 else repr(v)
    lines = ["", "    Fields (name = default: what it is):"]
    for f in dataclasses.fields(cls):
        lines += textwrap.wrap(f"- ``{f.name}`` = {shown(f.default)}: {f.metadata['doc']}.", 96,
                               initial_indent=" " * 6, subsequent_indent=" " * 8)
    return "\n".join(lines) + "\n"


ModuleOptions.__doc__ = (ModuleOptions.__doc__ or "").rstrip() + "\n" + _fields_doc(ModuleOptions)
