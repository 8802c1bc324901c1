"""The exception hierarchy (tiermem/errors.py), and arguments checked before tiermem looks for a GPU.

Every bad argument raises a TierMemError that is also a ValueError (or a TypeError for a wrong
type), so code that does not know tiermem can catch it. The public functions check their
arguments before they make the default Tier, which needs a GPU: on a machine without one, each
mistake still raises its own error.
"""
from __future__ import annotations

import pytest
from um_budget import UMBudget

import tiermem
from tiermem import ConfigError, Policy, TierMemError
from tiermem.base.limits import ENV_BUDGET, ENV_CAP, check_bytes, resolve_budget, resolve_cap
from tiermem.cuda import runtime as _cuda
from tiermem.cuda.staging import Staging, StagingRing, ring_slot
from tiermem.errors import ConfigTypeError, CUDAUnavailableError, RoleError, WrapError
from tiermem.planning import StepTrace, parse_bytes, plan_training
from tiermem.pytorch import allocator as _torch_alloc
from tiermem.roles import PolicyTable
from tiermem.training.options import check_options

GiB = 1 << 30


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (ENV_BUDGET, ENV_CAP):
        monkeypatch.delenv(name, raising=False)


def test_the_hierarchy():
    for cls in (ConfigError, RoleError, WrapError):
        assert issubclass(cls, TierMemError) and issubclass(cls, ValueError)
    assert issubclass(RoleError, ConfigError) and issubclass(WrapError, ConfigError)
    assert issubclass(ConfigTypeError, ConfigError) and issubclass(ConfigTypeError, TypeError)
    assert not issubclass(ConfigError, TypeError)
    assert set(tiermem.errors.__all__) >= {"ConfigError", "ConfigTypeError"} and "ConfigError" in tiermem.__all__
    # every error class of the package has its public home
    assert {c.__name__ for c in vars(tiermem.errors).values()
            if isinstance(c, type) and issubclass(c, TierMemError)} <= set(tiermem.errors.__all__)


def test_the_top_level_is_short_and_the_old_names_still_work_with_a_warning():
    assert len(tiermem.__all__) <= 30
    for name in tiermem.__all__:
        assert hasattr(tiermem, name)
    with pytest.warns(DeprecationWarning, match=r"tiermem.WrapError is now tiermem.errors.WrapError"):
        assert tiermem.WrapError is tiermem.errors.WrapError
    with pytest.warns(DeprecationWarning, match=r"tiermem.plan_training is now tiermem.planning.plan_training"):
        from tiermem import plan_training
    assert plan_training is tiermem.planning.plan_training
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tiermem.nope


def _other_tiers_tensor(fake):
    from fakes import FakeBackend
    return tiermem.Tier(backend=FakeBackend(total=GiB)).empty(4, role="weight")


# (what is called, the error class, a part of its message). Every site that raises for a bad
# value or type, outside module adoption (tiermem/_module*.py).
BAD_VALUES = [
    (lambda f: parse_bytes("lots"), ConfigError, "is not a size"),
    (lambda f: parse_bytes(-1), ConfigError, "must not be negative"),
    (lambda f: parse_bytes(float("nan")), ConfigError, "finite"),
    (lambda f: parse_bytes("25%"), ConfigError, "percentage"),
    (lambda f: parse_bytes("101%", total=GiB, max_percent=100), ConfigError, "more than 100%"),
    (lambda f: check_bytes(0, what="budget", positive=True), ConfigError, "more than 0 bytes"),
    (lambda f: check_bytes("0%", what="budget", positive=True), ConfigError, "more than 0 bytes"),
    (lambda f: resolve_cap("4GiB", False, free=GiB, total=2 * GiB), ConfigError, "opt in"),
    (lambda f: resolve_budget("150%", total=GiB), ConfigError, "more than 100%"),
    (lambda f: StagingRing(f, slot=0), ConfigError, "two slots"),
    (lambda f: ring_slot("1KiB"), ConfigError, "at least 2 MiB"),
    (lambda f: Staging(f, "1KiB"), ConfigError, "at least 2 MiB"),
    (lambda f: plan_training(StepTrace((), (1,), (1,), 0), 0), ConfigError, "positive"),
    (lambda f: plan_training(StepTrace((), (1, 2), (1,), 0), 10), ConfigError, "differ in length"),
    (lambda f: UMBudget(-1, segments=list, evict=lambda p, n: None), ConfigError, ">= 0"),
    (lambda f: f.capabilities().supports("teleport"), ConfigError, "unknown feature"),
    (lambda f: check_options("150%"), ConfigError, "more than 100%"),
    (lambda f: check_options(0), ConfigError, "more than 0 bytes"),
    (lambda f: check_options("1GiB", lookahead=0), ConfigError, "at least 1"),
    (lambda f: tiermem.Tier(backend=f, cap="1GiB"), ConfigError, "belong to the backend"),
    (lambda f: tiermem.Tier(backend=f, budget="150%"), ConfigError, "more than 100%"),
    (lambda f: tiermem.Tier(backend=f, staging="1MiB"), ConfigError, "at least 2 MiB"),
    (lambda f: tiermem.Tier(-1, backend=f), ConfigError, "device index"),
    (lambda f: tiermem.Tier(backend=f).set_budget("200%"), ConfigError, "more than 100%"),
    (lambda f: tiermem.Tier(backend=f).empty((2, -1), role="weight"), ConfigError, "negative"),
    (lambda f: tiermem.Tier(backend=f).empty_group([(4, "float32")], role="weight", names=["a", "b"]),
     ConfigError, "2 names for 1 tensors"),
    (lambda f: tiermem.Tier(backend=f).empty(4, role="weight", policy="host"), RoleError, "tiermem.Policy"),
    (lambda f: (t := tiermem.Tier(backend=f)).prefetch([t.empty(4, role="weight")], to="gpu"),
     ConfigError, "location must be"),
    (lambda f: tiermem.Tier(backend=f).prefetch([_other_tiers_tensor(f)]), ConfigError, "another Tier"),
    (lambda f: PolicyTable({"weight": "host"}), RoleError, "must be a Policy"),
    (lambda f: _torch_alloc.torch_allocations(device=-1).__enter__(), ConfigError, "device index"),
]

BAD_TYPES = [
    (lambda f: parse_bytes(True), "byte count"),
    (lambda f: parse_bytes([4]), "byte count"),
    (lambda f: UMBudget(True, segments=list, evict=lambda p, n: None), "an int"),
    (lambda f: UMBudget(1.5, segments=list, evict=lambda p, n: None), "an int"),
    (lambda f: check_options("1GiB", lookahead=1.5), "lookahead must be an int"),
    (lambda f: tiermem.Tier("cuda:0", backend=f), "device index"),
    (lambda f: tiermem.Tier(backend=f, budget=True), "byte count"),
    (lambda f: (t := tiermem.Tier(backend=f)).evict([t.empty(4, role="weight")], stream=object()),
     "not a stream"),
    (lambda f: _torch_alloc.torch_allocations(prefetch=1).__enter__(), "prefetch must be"),
    (lambda f: _torch_alloc.torch_allocations(device="cuda:0").__enter__(), "device must be"),
]


@pytest.mark.parametrize("call, error, message", BAD_VALUES)
def test_bad_values_raise_value_errors(call, error, message, fake, monkeypatch):
    # The torch allocator's arguments must be refused before CUDA is asked for anything.
    monkeypatch.setattr(_torch_alloc, "_torch_cuda", lambda: pytest.fail("CUDA touched before the check"))
    with pytest.raises(error, match=message) as exc:
        call(fake)
    assert isinstance(exc.value, ValueError) and isinstance(exc.value, TierMemError)


@pytest.mark.parametrize("call, message", BAD_TYPES)
def test_bad_types_raise_type_errors(call, message, fake, monkeypatch):
    monkeypatch.setattr(_torch_alloc, "_torch_cuda", lambda: pytest.fail("CUDA touched before the check"))
    with pytest.raises(ConfigTypeError, match=message) as exc:
        call(fake)
    assert isinstance(exc.value, TypeError) and isinstance(exc.value, TierMemError)


def test_parse_bytes_keeps_large_ints_exact():
    assert parse_bytes(2**60 + 1) == 2**60 + 1
    np = pytest.importorskip("numpy")
    assert parse_bytes(np.int64(4096)) == 4096


# ---------------------------------------------------------------------------------------------
# The public functions check their arguments before they make the default Tier (which needs a
# GPU). Each test also checks that no default Tier was made, so it means the same with a GPU.

try:
    import torch
except ImportError:   # the cases that wrap a tensor skip; the others need no torch
    torch = None


def _sparse():
    return torch.ones(4).to_sparse()


NEED_TORCH = [
    (lambda: tiermem.wrap(torch.ones(4), role="bogus"), RoleError, "unknown role 'bogus'"),
    (lambda: tiermem.wrap(_sparse()), WrapError, "sparse"),
    (lambda: tiermem.wrap(torch.ones(4, 2).t()), WrapError, "non-contiguous"),
    (lambda: tiermem.wrap(torch.empty(4, device="meta")), WrapError, "meta tensor"),
    (lambda: tiermem.wrap([1.0, 2.0]), WrapError, "torch.Tensor"),
    (lambda: tiermem.wrap(torch.ones(4), colour="red"), RoleError, "unknown policy field"),
    (lambda: tiermem.wrap(torch.ones(4), read_mostly="yes"), RoleError, "must be a bool"),
    (lambda: tiermem.wrap(torch.ones(4), policy="host"), RoleError, "tiermem.Policy"),
]
NO_GPU_NEEDED = [
    (lambda: tiermem.configure(budget="150%"), ConfigError, "more than 100%"),
    (lambda: tiermem.configure(budget="lots"), ConfigError, "is not a size"),
    (lambda: tiermem.configure(budget=-5), ConfigError, "negative"),
    (lambda: tiermem.configure(cap="much"), ConfigError, "is not a size"),
    (lambda: tiermem.configure(staging="1KiB"), ConfigError, "at least 2 MiB"),
    (lambda: tiermem.configure(device=-1), ConfigError, "device index"),
    (lambda: tiermem.configure(policies={"nope": Policy()}), RoleError, "unknown role"),
    (lambda: tiermem.empty(4, role="bogus"), RoleError, "unknown role"),
    (lambda: tiermem.empty((2, -1), role="weight"), ConfigError, "negative"),
    (lambda: tiermem.wrap_training(None, None, "150%"), ConfigError, "more than 100%"),
    (lambda: tiermem.wrap_training(None, None, "1GiB", lookahead=0), ConfigError, "at least 1"),
    (lambda: tiermem.wrap_module(None, "lots"), ConfigError, "is not a size"),
    (lambda: tiermem.wrap_module(None, "1GiB", mode="fast"), ConfigError, "mode must be"),
    (lambda: tiermem.wrap_module(None, "1GiB", lookahed=2), ConfigTypeError, "unknown keyword argument"),
    (lambda: tiermem.allocator("bogus"), RoleError, "unknown role"),
    (lambda: tiermem.policy_override("weight", colour="red").__enter__(), RoleError, "unknown policy field"),
]


@pytest.mark.parametrize("call, error, message", NEED_TORCH + NO_GPU_NEEDED)
def test_arguments_are_checked_before_the_gpu(call, error, message):
    if torch is None and (call, error, message) in NEED_TORCH:
        pytest.skip("torch is not installed")
    with pytest.raises(error, match=message):
        call()
    assert tiermem.base.default.peek() is None, "the default Tier was made before the arguments were checked"


def test_the_environment_budget_is_checked_before_the_gpu(monkeypatch):
    monkeypatch.setenv(ENV_BUDGET, "120%")
    with pytest.raises(ConfigError, match="device budget='120%' is more than 100%"):
        tiermem.configure()
    monkeypatch.setenv(ENV_BUDGET, "1GiB")
    monkeypatch.setenv(ENV_CAP, "lots")
    with pytest.raises(ConfigError, match="managed cap='lots' is not a size"):
        tiermem.configure()


def test_without_a_gpu_good_arguments_meet_the_gpu_check():
    if torch is None:
        pytest.skip("torch is not installed")
    ok, why = _cuda.available()
    if ok:
        pytest.skip("a GPU is here: this checks the error of a machine without one")
    with pytest.raises(CUDAUnavailableError):
        tiermem.wrap(torch.ones(4), role="weight")
    with pytest.raises(CUDAUnavailableError):
        tiermem.configure(budget="50%", staging="off")
