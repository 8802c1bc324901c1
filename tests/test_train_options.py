"""wrap_training's options as one frozen dataclass (tiermem.handles.TrainingOptions): checked once,
when made, before anything is adopted or a GPU is looked for; keywords or ``options=``."""
from __future__ import annotations

import dataclasses

import pytest
from fakes import FakeBackend
from test_train import batches, gpt, plain_run, state_bytes, tiered_losses

import tiermem
from tiermem.errors import ConfigError, ConfigTypeError
from tiermem.handles import TrainingOptions


def _tier():
    return tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))


def test_the_defaults_and_one_frozen_record():
    o = TrainingOptions()
    assert (o.lookahead, o.recompute, o.accumulate, o.swap, o.graphs, o.max_grad_norm) == (2, "auto", 1, True, False,
                                                                                            None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.lookahead = 3
    assert TrainingOptions.of(o) is o
    assert TrainingOptions.of(o, lookahead=3) == TrainingOptions(lookahead=3)
    assert TrainingOptions.of(None, accumulate=4).accumulate == 4


def test_an_unknown_keyword_is_a_type_error_that_lists_the_options_before_any_gpu_is_looked_for():
    model, opt = gpt()
    # no GPU here: tiermem.wrap_training would fail looking for one if it got that far
    with pytest.raises(ConfigTypeError, match="lookahed") as e:
        tiermem.wrap_training(model, opt, "50%", lookahed=3)
    assert isinstance(e.value, TypeError)
    for name in (f.name for f in dataclasses.fields(TrainingOptions)):
        assert name in str(e.value)
    tier = _tier()
    with pytest.raises(ConfigTypeError, match="the options are"):
        tier.wrap_training(model, opt, "50%", budgett=1)
    assert not tier.leases and all(p.device.type == "cpu" for p in model.parameters())
    with pytest.raises(ConfigTypeError, match="TrainingOptions"):
        tiermem.wrap_training(model, opt, "50%", options={"lookahead": 3})


@pytest.mark.parametrize("kw, error, match", [
    (dict(lookahead=0), ConfigError, "lookahead must be at least 1"),
    (dict(lookahead=1.5), ConfigTypeError, "lookahead must be an int"),
    (dict(min_swap=-1), ConfigError, "min_swap"),
    (dict(window=0), ConfigError, "window"),
    (dict(block_bytes="64MB"), ConfigTypeError, "block_bytes"),
    (dict(margin=-5), ConfigError, "margin"),
    (dict(swap=1), ConfigTypeError, "swap must be True or False"),
    (dict(recompute="sometimes"), ConfigError, "recompute must be one of"),
    (dict(link_GBps=0), ConfigError, "link_GBps"),
    (dict(state_dtype="float16"), ConfigError, "state_dtype"),
    (dict(accumulate=0), ConfigError, "accumulate"),
    (dict(max_grad_norm=-1.0), ConfigError, "max_grad_norm must be positive"),
    (dict(norm_type="inf"), ConfigTypeError, "norm_type must be a number"),
    (dict(speculate=True), ConfigError, "needs max_grad_norm"),
    (dict(graphs="yes"), ConfigTypeError, "graphs must be True or False"),
    (dict(shard_steps=True), ConfigError, "give process_group"),
    (dict(shard_steps=True, process_group=True, state_dtype="bfloat16"), ConfigError, "does not take state_dtype"),
    (dict(shard_steps="yes", process_group=True), ConfigTypeError, "shard_steps must be True or False"),
])
def test_each_bad_option_is_refused_when_the_options_are_made_and_by_wrap_training(kw, error, match):
    with pytest.raises(error, match=match):
        TrainingOptions(**kw)
    model, opt = gpt()
    with pytest.raises(error, match=match):
        tiermem.wrap_training(model, opt, "50%", **kw)      # before any GPU is looked for
    tier = _tier()
    with pytest.raises(error, match=match):
        tier.wrap_training(model, opt, "50%", **kw)
    assert not tier.leases


def test_options_as_a_record_or_as_keywords_train_alike():
    bs = batches(4)
    want, _ = plain_run(bs)
    opts = TrainingOptions(block_bytes=16 << 10, min_swap=4096)
    got = []
    for how in ("options", "keywords", "both"):
        model, opt = gpt()
        tier = _tier()
        if how == "options":
            train = tier.wrap_training(model, opt, state_bytes(model), options=opts)
        elif how == "keywords":
            train = tier.wrap_training(model, opt, state_bytes(model), block_bytes=16 << 10, min_swap=4096)
        else:       # keywords replace the record's fields
            train = tier.wrap_training(model, opt, state_bytes(model), options=TrainingOptions(min_swap=1),
                                       block_bytes=16 << 10, min_swap=4096)
        assert train.options == opts
        got.append(tiered_losses(train, model, bs))
        assert train.plan.streamed_blocks
        train.unwrap()
    assert got == [want] * 3
