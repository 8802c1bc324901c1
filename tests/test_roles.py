"""Roles are data: the default policy table, Policy validation, PolicyTable and advice_plan."""
from __future__ import annotations

import pytest

from tiermem import Location, Policy, Role
from tiermem.errors import RoleError
from tiermem.roles import DEFAULT_POLICIES, Advice, Evict, PolicyTable, Prefetch, advice_plan, as_role


def test_every_role_has_a_default_policy():
    assert set(DEFAULT_POLICIES) == set(Role)
    assert len(DEFAULT_POLICIES) == len(Role) == 7


def test_default_policies_are_read_only():
    with pytest.raises(TypeError):
        DEFAULT_POLICIES[Role.WEIGHT] = Policy()  # type: ignore[index]
    with pytest.raises(TypeError):
        del DEFAULT_POLICIES[Role.WEIGHT]  # type: ignore[attr-defined]
    assert DEFAULT_POLICIES[Role.WORKSPACE].preferred_location is Location.DEVICE


def test_as_role_accepts_enum_and_str():
    assert as_role(Role.ACTIVATION) is Role.ACTIVATION
    assert as_role("optimizer_state") is Role.OPTIMIZER_STATE
    assert [as_role(r.value) for r in Role] == list(Role)


@pytest.mark.parametrize("bad", ["weights", "WEIGHT", "", 3, None])
def test_unknown_role_is_a_role_error_and_a_value_error(bad):
    with pytest.raises(RoleError) as exc:
        as_role(bad)
    assert isinstance(exc.value, ValueError)
    msg = str(exc.value)
    assert repr(bad) in msg
    # The message lists every valid role, so the user can fix a typo from it alone.
    for r in Role:
        assert repr(r.value) in msg


def test_policy_normalises_strings_to_enums():
    p = Policy(preferred_location="host", prefetch="never", evict="after_use")
    assert p.preferred_location is Location.HOST
    assert p.prefetch is Prefetch.NEVER
    assert p.evict is Evict.AFTER_USE
    assert p == Policy(Location.HOST, prefetch=Prefetch.NEVER, evict=Evict.AFTER_USE)


def test_policy_replace_changes_fields_and_rejects_unknown_ones():
    base = DEFAULT_POLICIES[Role.GRADIENT]
    changed = base.replace(read_mostly=True, prefetch="ahead")
    assert changed == Policy(Location.DEVICE, read_mostly=True, prefetch=Prefetch.AHEAD, evict=Evict.LRU,
                             evict_priority=1)
    assert base.read_mostly is False  # frozen: replace made a copy
    with pytest.raises(RoleError, match=r"unknown policy field\(s\) \['readmostly'\]"):
        base.replace(readmostly=True)


@pytest.mark.parametrize("field, value, pattern", [
    ("read_mostly", 1, r"read_mostly must be a bool, got 1"),
    ("accessed_by_device", "yes", r"accessed_by_device must be a bool, got 'yes'"),
    ("read_only", None, r"read_only must be a bool, got None"),
    ("prefetch", "sometimes", r"prefetch='sometimes' is not one of \['ahead', 'on_use', 'never'\]"),
    ("evict", "later", r"evict='later' is not one of"),
    ("preferred_location", "gpu", r"preferred_location='gpu' is not one of \['device', 'host'\]"),
    ("evict_priority", True, r"evict_priority must be an int, got True"),
    ("evict_priority", 1.5, r"evict_priority must be an int, got 1.5"),
])
def test_policy_rejects_bad_values(field, value, pattern):
    with pytest.raises(RoleError, match=pattern):
        Policy(**{field: value})


def test_advice_plan_frozen_weight():
    assert advice_plan(DEFAULT_POLICIES[Role.FROZEN_WEIGHT]) == [
        Advice("preferred_location", True, Location.HOST),
        Advice("read_mostly", True, Location.DEVICE),
        Advice("accessed_by", True, Location.DEVICE),
        Advice("accessed_by", False, Location.HOST),
    ]


def test_advice_plan_optimizer_state():
    assert advice_plan(DEFAULT_POLICIES[Role.OPTIMIZER_STATE]) == [
        Advice("preferred_location", False, Location.DEVICE),
        Advice("read_mostly", False, Location.DEVICE),
        Advice("accessed_by", True, Location.DEVICE),
        Advice("accessed_by", False, Location.HOST),
    ]


def test_advice_plan_unsets_everything_for_a_policy_without_preferences():
    # A pooled block reused as an activation must lose whatever advice it had before.
    assert advice_plan(DEFAULT_POLICIES[Role.ACTIVATION]) == [
        Advice("preferred_location", False, Location.DEVICE),
        Advice("read_mostly", False, Location.DEVICE),
        Advice("accessed_by", False, Location.DEVICE),
        Advice("accessed_by", False, Location.HOST),
    ]


def test_policy_table_set_returns_previous_and_reset_restores_defaults():
    table = PolicyTable()
    assert dict(table) == dict(DEFAULT_POLICIES)
    old = table.set("activation", read_mostly=True, evict_priority=5)
    assert old == DEFAULT_POLICIES[Role.ACTIVATION]
    assert table[Role.ACTIVATION] == DEFAULT_POLICIES[Role.ACTIVATION].replace(read_mostly=True, evict_priority=5)
    whole = Policy(Location.HOST, prefetch=Prefetch.NEVER)
    assert table.set(Role.INPUT, whole) == DEFAULT_POLICIES[Role.INPUT]
    assert table["input"] == whole
    # The defaults themselves are untouched by a table's changes.
    assert DEFAULT_POLICIES[Role.ACTIVATION].read_mostly is False
    table.reset()
    assert dict(table) == dict(DEFAULT_POLICIES)


def test_policy_table_set_rejects_unknown_role_and_field():
    table = PolicyTable()
    with pytest.raises(RoleError):
        table.set("scratch", read_mostly=True)
    with pytest.raises(RoleError):
        table.set("weight", colour="blue")
    assert dict(table) == dict(DEFAULT_POLICIES)


def test_default_policy_invariants():
    for role, p in DEFAULT_POLICIES.items():
        # Read-mostly pays off only if the device never writes: a write collapses the duplicates.
        if p.read_mostly:
            assert p.read_only, role
    assert [r for r, p in DEFAULT_POLICIES.items() if p.read_mostly] == [Role.FROZEN_WEIGHT, Role.INPUT]
    opt = DEFAULT_POLICIES[Role.OPTIMIZER_STATE]
    # bench/advice_study.py: streaming AdamW state over the link each step was 4x slower
    assert (opt.prefetch, opt.preferred_location, opt.accessed_by_device) == (Prefetch.ON_USE, None, True)
    assert [r for r, p in DEFAULT_POLICIES.items() if p.evict is Evict.NEVER] == [Role.WORKSPACE]
    # Activations are the first to go when the budget needs room.
    assert DEFAULT_POLICIES[Role.ACTIVATION].evict_priority == min(p.evict_priority for p in DEFAULT_POLICIES.values())
    assert DEFAULT_POLICIES[Role.ACTIVATION].evict_priority < DEFAULT_POLICIES[Role.WEIGHT].evict_priority
