"""wrap_module's options as one record (tiermem.handles.ModuleOptions, inference/options.py):
documented once, checked once when made, before any GPU is looked for; keywords and ``options=``
give the same handle."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from helpers import share

import tiermem
from tiermem.errors import ConfigError, ConfigTypeError
from tiermem.handles import ModuleOptions

MiB = 1 << 20


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)) for _ in range(6)],
                         nn.LayerNorm(256)).requires_grad_(False)


def test_every_field_is_documented_in_the_docstring_with_its_default_and_checked():
    doc = ModuleOptions.__doc__
    for f in dataclasses.fields(ModuleOptions):
        assert f"``{f.name}`` = " in doc, f"{f.name} is not in ModuleOptions' docstring"
        assert callable(f.metadata["check"]) and f.metadata["doc"], f"{f.name} has no check or no description"
    assert "``max_group_bytes`` = None" in doc and "``mode`` = 'auto'" in doc and "``lookahead`` = 3" in doc
    assert "``stream_dtype`` = None" in doc and "``expert_cache`` = None" in doc


def test_quantized_streaming_and_the_expert_cache_are_fields_too(tier, fake):
    """stream_dtype and expert_cache travel in the record like the other options: the handle runs
    by them, whether given as keywords or in ``options``."""
    o = ModuleOptions(stream_dtype="int8", expert_cache="1%")
    assert ModuleOptions.of(o, "wrap_module", (), mode="stream") == dataclasses.replace(o, mode="stream")
    with pytest.raises(ConfigError, match="zero_copy"):
        dataclasses.replace(o, mode="zero_copy")
    m1, m2 = _model(), _model()
    h1 = tier.wrap_module(m1, budget=share(m1, 40), stream_dtype="int8", max_group_bytes=1 * MiB)
    h2 = tier.wrap_module(m2, budget=share(m2, 40), options=ModuleOptions(stream_dtype="int8", max_group_bytes=1 * MiB))
    assert h1.options == h2.options and h1.stream_dtype == h2.stream_dtype == "int8"
    assert any(g.packed for g in h1._groups.values()) and h1.plan.link_sizes == h2.plan.link_sizes
    for h in (h1, h2):
        h.unwrap()


def test_the_record_is_frozen_and_replace_checks_again():
    o = ModuleOptions(lookahead=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.lookahead = 3
    assert dataclasses.replace(o, mode="stream") == ModuleOptions(mode="stream", lookahead=2)
    with pytest.raises(ConfigError, match="at least 1"):
        dataclasses.replace(o, lookahead=0)
    assert "weights" not in repr(ModuleOptions(weights={"w": torch.zeros(1 << 20)}))   # a state dict is not printed


BAD = [
    (dict(mode="fast"), ConfigError, r"mode must be one of 'auto', 'stream', 'zero_copy', got 'fast'"),
    (dict(lookahead=0), ConfigError, "lookahead must be at least 1"),
    (dict(lookahead=1.5), ConfigTypeError, "lookahead must be an int"),
    (dict(lookahead=True), ConfigTypeError, "lookahead must be an int"),
    (dict(zero_copy_max_tokens=-1), ConfigError, "zero_copy_max_tokens must be at least 0"),
    (dict(zero_copy_max_tokens="16"), ConfigTypeError, "zero_copy_max_tokens must be an int"),
    (dict(max_group_bytes=0), ConfigError, "max_group_bytes must be at least 1"),
    (dict(max_group_bytes="1GiB"), ConfigTypeError, "max_group_bytes must be an int"),
    (dict(weights=[torch.zeros(1)]), ConfigTypeError, "weights must be a Mapping"),
    (dict(host_budget="lots"), ConfigError, "host_budget='lots' is not a size"),
    (dict(host_budget="25%"), ConfigError, "percentage"),
    (dict(host_budget=True), ConfigTypeError, "host_budget"),
    (dict(disk_reader="io_uring"), ConfigError, "disk_reader must be one of 'posix', 'kvikio'"),
    (dict(kv_tokens=0), ConfigError, "kv_tokens must be a number of tokens >= 1"),
    (dict(kv_budget="auto"), ConfigError, "give kv_tokens"),
    (dict(kv_budget="150%"), ConfigError, "kv_budget='150%' is more than 100%"),
    (dict(stream_dtype="int3"), ConfigError, "stream_dtype must be None or one of 'int8', 'fp8', 'int4', got 'int3'"),
    (dict(stream_dtype="int8", mode="zero_copy"), ConfigError, "mode='zero_copy' reads every streamed weight in place"),
    (dict(expert_cache="lots"), ConfigError, "expert_cache='lots' is not a size"),
    (dict(expert_cache="150%"), ConfigError, "expert_cache='150%' is more than 100%"),
    (dict(devices=[0]), ConfigError, "devices must name at least two distinct GPUs"),
    (dict(devices=[1, 1]), ConfigError, "devices must name at least two distinct GPUs"),
    (dict(devices=[0, -1]), ConfigError, "devices must be CUDA device indices >= 0"),
    (dict(devices="01"), ConfigTypeError, "devices must be a list of CUDA device indices"),
    (dict(devices=[0, 1], kv_budget="1GiB"), ConfigError, "leave kv_budget out"),
    (dict(share_home=nn.Linear(1, 1)), ConfigTypeError, "share_home takes the handle wrap_module returned"),
    (dict(colour="red"), ConfigTypeError, r"wrap_module\(\) got an unknown keyword argument 'colour'; it takes mode, "
                                          "lookahead"),
    (dict(lookahed=2), ConfigTypeError, "did you mean 'lookahead'"),
    (dict(options="stream"), ConfigTypeError, "options must be a tiermem.handles.ModuleOptions"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD, ids=[next(iter(k)) + "=" + repr(v)[:12]
                                                            for k, _, _ in BAD for v in [next(iter(k.values()))]])
def test_a_bad_option_is_refused_before_the_gpu(kwargs, error, message):
    """tiermem.wrap_module checks its options before it makes the default Tier, which needs a GPU;
    an error of each kind is a ValueError (or a TypeError), as everywhere in tiermem."""
    with pytest.raises(error, match=message) as e:
        tiermem.wrap_module(None, "1GiB", **kwargs)
    assert isinstance(e.value, TypeError if error is ConfigTypeError else ValueError)
    assert tiermem.base.default.peek() is None, "the default Tier was made before the options were checked"
    if "options" not in kwargs:
        with pytest.raises(error, match=message):
            ModuleOptions.of(**kwargs)


def test_load_pretrained_checks_its_options_before_the_files_and_the_gpu(tmp_path):
    with pytest.raises(ConfigError, match="mode must be"):
        tiermem.load_pretrained(tmp_path / "nowhere", "1GiB", mode="fast")
    with pytest.raises(ConfigError, match="host_budget='lots'"):
        tiermem.load_pretrained(tmp_path / "nowhere", "1GiB", host_budget="lots")
    with pytest.raises(ConfigTypeError, match=r"load_pretrained\(\) got an unknown keyword argument 'weights'"):
        tiermem.load_pretrained(tmp_path / "nowhere", "1GiB", weights={})
    with pytest.raises(ConfigTypeError, match="takes no weights option"):
        tiermem.load_pretrained(tmp_path / "nowhere", "1GiB", options=ModuleOptions(weights={}))
    assert tiermem.base.default.peek() is None


def test_devices_are_a_tuple_and_a_tier_and_load_pretrained_refuse_them(tier, fake, tmp_path):
    """``devices`` is the module-level wrap_module's (a list given is kept as a tuple): a Tier's
    wrap_module and load_pretrained adopt on one device and refuse it, before anything changes;
    a module spread over devices shares no replica's home."""
    assert ModuleOptions(devices=[1, 0]).devices == (1, 0)
    other = _model()
    h = tier.wrap_module(other, budget=share(other, 40))
    with pytest.raises(ConfigError, match="leave share_home out"):
        ModuleOptions(devices=[0, 1], share_home=h)
    h.unwrap()
    m = _model()
    before = [p.data_ptr() for p in m.parameters()]
    with pytest.raises(ConfigError, match="spreads a module over several GPUs"):
        tier.wrap_module(m, budget=share(m, 40), devices=[0, 1])
    assert [p.data_ptr() for p in m.parameters()] == before and not tier.leases
    with pytest.raises(ConfigError, match="load_pretrained adopts the model on one GPU"):
        tiermem.load_pretrained(tmp_path / "nowhere", "1GiB", devices=[0, 1])
    assert tiermem.base.default.peek() is None


def test_keywords_and_options_give_the_same_handle(tier, fake):
    m1, m2, m3 = _model(), _model(), _model()
    ref = copy.deepcopy(m1)
    h1 = tier.wrap_module(m1, budget=share(m1, 40), max_group_bytes=1 * MiB, mode="stream", lookahead=2)
    opts = ModuleOptions(max_group_bytes=1 * MiB, mode="stream", lookahead=2)
    h2 = tier.wrap_module(m2, budget=share(m2, 40), options=opts)
    # keywords change the fields of ``options``
    h3 = tier.wrap_module(m3, budget=share(m3, 40), options=ModuleOptions(max_group_bytes=1 * MiB, lookahead=2),
                          mode="stream")
    assert h1.options == h2.options == h3.options == opts and h2.options is opts
    assert (h1.mode, h1.lookahead, h1.plan.pinned, h1.plan.window) == (h2.mode, h2.lookahead, h2.plan.pinned, h2.plan.window)
    assert (h3.mode, h3.plan.pinned, h3.plan.window) == (h1.mode, h1.plan.pinned, h1.plan.window)
    x = torch.randn(8, 256)
    with torch.no_grad():
        want = ref(x)
        assert all(torch.equal(m(x), want) for m in (m1, m2, m3))
    for h in (h1, h2, h3):
        h.unwrap()


def test_a_bad_option_on_a_tier_changes_nothing(tier, fake):
    m = _model()
    before = [p.data_ptr() for p in m.parameters()]
    with pytest.raises(ConfigTypeError, match="unknown keyword argument 'lookahed'"):
        tier.wrap_module(m, budget=share(m, 40), lookahed=2)
    assert [p.data_ptr() for p in m.parameters()] == before and tier.budget is None and not tier.leases
