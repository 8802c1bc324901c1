"""Roles and their memory policies: data, not code.

A role names how a buffer is used in a training or inference step. Each role maps to a frozen
:class:`Policy` that says which CUDA memory advice the buffer gets and when tiermem moves it. The
engine never looks at module or type names: it looks a role up in a :class:`PolicyTable`.

NOTE [default policies]
    The defaults follow each role's access pattern, the link figures (docs/facts.md) and, for the
    four roles a training step has, bench/advice_study.py (docs/advice-study.md, with its runs:
    ResNet-50 and a GPT-2-style model, one advice on one role at a time, under a budget of half
    the footprint, where data comes back by page faults):

    - prefetching a large range in runs at ~50 GB/s, page faults at ~7 GB/s, so whatever the next
      step needs is prefetched, never faulted in;
    - a GPU kernel reads host-resident managed pages mapped with accessed-by at ~51 GB/s, as fast
      as a copy, so data read once per step is better read in place than moved; data read many
      times is not (accessed-by on weights or activations: 0.43-0.61x of no advice for the GPT);
    - with read-mostly, a prefetch makes a device duplicate and the host copy stays valid, so
      dropping the duplicate moves nothing (~1 ms/GiB); but a device write collapses the
      duplicates (0.16 s for 2 GiB; read-mostly weights or optimizer state: 5-75x slower in the
      study), so only data the device never writes gets read-mostly.

    weight           read by every forward and backward, written once per step by the optimizer:
                     hot all step. Preferred on the device, accessed-by device. The study was
                     split here (preferred-location device: +8% for ResNet-50, -21% for the GPT;
                     accessed-by: +1% and -42%), so the table was left as it was: dropping both
                     changed how wrap_training places its resident blocks, and that change was
                     not measured. tiermem's own prefetch plan brings weights in ahead of use.
    frozen_weight    never written (inference, frozen layers). Preferred on the host and
                     read-mostly: a prefetch duplicates it, eviction is free. Accessed-by device so
                     a weight left on the host is read in place at link rate.
    activation       written once in forward, read once in backward, cold in between: the first
                     to evict. No preferred location (it stays where it was produced);
                     accessed-by made both models ~1.7-2.3x slower.
    gradient         accumulated in backward, read once by the optimizer. Preferred on the device.
    optimizer_state  read and written once per step by the optimizer, cold the rest of the step.
                     Accessed-by device, no preferred location: +3% and +28% in the study (an
                     evicted state is read in place by the one kernel that needs it, not faulted
                     back); preferred on the device was -13% and -18%. Until the study it was
                     preferred on the host, which made a GPT step 4x slower in capacity (AdamW
                     read and wrote every state byte over the link each step).
    input            written once (by the loader or on the device), then only read: read-mostly,
                     the study's best single advice (+19% and +31%), so reads hit a device
                     duplicate. Preferred on the host with accessed-by device, as frozen weights:
                     left on the host it is read in place, and eviction collapses the duplicate
                     onto the host copy, moving nothing.
    workspace        scratch, written and read on the device within one operation. Preferred on
                     the device and never evicted (evicting scratch only moves garbage).
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

from .errors import ConfigError, RoleError

__all__ = ["Role", "Location", "Prefetch", "Evict", "Policy", "DEFAULT_POLICIES", "PolicyTable", "as_role", "as_location",
           "check_policy", "advice_plan"]


class Role(str, enum.Enum):
    WEIGHT = "weight"
    FROZEN_WEIGHT = "frozen_weight"
    ACTIVATION = "activation"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    INPUT = "input"
    WORKSPACE = "workspace"

    def __str__(self) -> str:
        return self.value


class Location(str, enum.Enum):
    DEVICE = "device"
    HOST = "host"

    def __str__(self) -> str:
        return self.value


class Prefetch(str, enum.Enum):
    """When tiermem brings a buffer to the device."""

    AHEAD = "ahead"      # before its use, on a side stream, when a plan or caller asks
    ON_USE = "on_use"    # only when asked for it directly
    NEVER = "never"      # read in place from the host (zero-copy): planners never bring it in (an
                         # explicit prefetch() call still does, and counts it against the budget)


class Evict(str, enum.Enum):
    """When tiermem takes a resident buffer off the device."""

    LRU = "lru"                # when the budget needs room, coldest first
    AFTER_USE = "after_use"    # as soon as its use is over
    NEVER = "never"            # stays resident; the budget must hold it


@dataclasses.dataclass(frozen=True)
class Policy:
    """How one buffer is advised and moved.

    preferred_location  cudaMemAdviseSetPreferredLocation target, or None for no preference.
    read_mostly         cudaMemAdviseSetReadMostly: device reads make duplicates.
    accessed_by_device  cudaMemAdviseSetAccessedBy the GPU: host pages stay mapped for the GPU.
    accessed_by_host    cudaMemAdviseSetAccessedBy the CPU: device pages stay mapped for the CPU.
    prefetch, evict     when tiermem moves it (see :class:`Prefetch`, :class:`Evict`).
    read_only           the device never writes it after it is filled, so a valid host copy
                        stays valid and eviction moves nothing.
    evict_priority      budget eviction order: lower goes first; ties go least recently used.
    """

    preferred_location: Location | None = None
    read_mostly: bool = False
    accessed_by_device: bool = False
    accessed_by_host: bool = False
    prefetch: Prefetch = Prefetch.ON_USE
    evict: Evict = Evict.LRU
    read_only: bool = False
    evict_priority: int = 1

    def __post_init__(self) -> None:
        # Normalise strings so Policy(preferred_location="host") works and compares equal.
        if self.preferred_location is not None:
            object.__setattr__(self, "preferred_location", _enum(Location, self.preferred_location, "preferred_location"))
        object.__setattr__(self, "prefetch", _enum(Prefetch, self.prefetch, "prefetch"))
        object.__setattr__(self, "evict", _enum(Evict, self.evict, "evict"))
        for name in ("read_mostly", "accessed_by_device", "accessed_by_host", "read_only"):
            if not isinstance(getattr(self, name), bool):
                raise RoleError(f"Policy.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.evict_priority, int) or isinstance(self.evict_priority, bool):
            raise RoleError(f"Policy.evict_priority must be an int, got {self.evict_priority!r}")

    def replace(self, **changes: Any) -> Policy:
        """A copy with ``changes`` applied; an unknown field raises :class:`RoleError`."""
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - fields)
        if unknown:
            raise RoleError(f"unknown policy field(s) {unknown}; fields are {sorted(fields)}")
        return dataclasses.replace(self, **changes)


def _enum(kind: type[enum.Enum], value: Any, field: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        raise RoleError(f"{field}={value!r} is not one of {[m.value for m in kind]}") from None


# See NOTE [default policies] above for the reasoning behind each row.
DEFAULT_POLICIES: Mapping[Role, Policy] = MappingProxyType({
    Role.WEIGHT: Policy(Location.DEVICE, read_mostly=False, accessed_by_device=True,
                        prefetch=Prefetch.AHEAD, evict=Evict.LRU, read_only=False, evict_priority=2),
    Role.FROZEN_WEIGHT: Policy(Location.HOST, read_mostly=True, accessed_by_device=True,
                               prefetch=Prefetch.AHEAD, evict=Evict.LRU, read_only=True, evict_priority=1),
    Role.ACTIVATION: Policy(None, prefetch=Prefetch.AHEAD, evict=Evict.LRU, evict_priority=0),
    Role.GRADIENT: Policy(Location.DEVICE, prefetch=Prefetch.ON_USE, evict=Evict.LRU, evict_priority=1),
    Role.OPTIMIZER_STATE: Policy(None, accessed_by_device=True, prefetch=Prefetch.ON_USE, evict=Evict.LRU,
                                 evict_priority=0),
    Role.INPUT: Policy(Location.HOST, read_mostly=True, accessed_by_device=True, prefetch=Prefetch.AHEAD,
                       evict=Evict.AFTER_USE, read_only=True, evict_priority=0),
    Role.WORKSPACE: Policy(Location.DEVICE, prefetch=Prefetch.ON_USE, evict=Evict.NEVER, evict_priority=3),
})


def as_role(role: Role | str) -> Role:
    """The :class:`Role` named by ``role``; anything else raises :class:`RoleError`."""
    if isinstance(role, Role):
        return role
    try:
        return Role(role)
    except ValueError:
        raise RoleError(f"unknown role {role!r}; roles are {[r.value for r in Role]}") from None


def as_location(to: Location | str) -> Location:
    """The :class:`Location` named by ``to``; anything else raises :class:`ConfigError`."""
    try:
        return Location(to)
    except ValueError:
        raise ConfigError(f"location must be 'device' or 'host', got {to!r}") from None


def check_policy(role: Role | str, policy: Policy | None = None, changes: Mapping[str, Any] | None = None) -> Role:
    """The :class:`Role` named by ``role``, once ``policy`` (a replacement) and ``changes`` (fields
    to change) are known to be usable; raises :class:`RoleError`. Needs no Tier, so the public
    functions call it before they look for a GPU: changes are tried on the role's default policy,
    whose fields every policy shares."""
    r = as_role(role)
    if policy is not None and not isinstance(policy, Policy):
        raise RoleError(f"policy must be a tiermem.Policy, got {type(policy).__name__}")
    if changes:
        (policy or DEFAULT_POLICIES[r]).replace(**changes)
    return r


class PolicyTable(Mapping[Role, Policy]):
    """The policy per role, with per-role overrides.

    Reads are lock-free (the mapping is swapped whole on every change); changes apply to buffers
    allocated afterwards and to buffers whose policy is applied again (:meth:`TieredTensor.advise`).
    """

    def __init__(self, base: Mapping[Role, Policy] = DEFAULT_POLICIES):
        table = {as_role(r): p for r, p in base.items()}
        for r, p in table.items():
            if not isinstance(p, Policy):
                raise RoleError(f"policy for {r} must be a Policy, got {type(p).__name__}")
        self._base: Mapping[Role, Policy] = MappingProxyType(table)
        self._table: Mapping[Role, Policy] = self._base

    def __getitem__(self, role: Role | str) -> Policy:
        return self._table[as_role(role)]

    def __iter__(self) -> Iterator[Role]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def set(self, role: Role | str, policy: Policy | None = None, **changes: Any) -> Policy:
        """Replace a role's policy, or change some of its fields. Returns the previous policy."""
        r = as_role(role)
        old = self._table[r]
        new = (policy if policy is not None else old).replace(**changes) if changes else (policy or old)
        if not isinstance(new, Policy):
            raise RoleError(f"policy for {r} must be a Policy, got {type(new).__name__}")
        table = dict(self._table)
        table[r] = new
        self._table = MappingProxyType(table)
        return old

    def reset(self) -> None:
        """Back to the policies the table was made with."""
        self._table = self._base


@dataclasses.dataclass(frozen=True)
class Advice:
    """One cudaMemAdvise call: ``set`` or unset ``kind`` for ``location``."""

    kind: str          # "preferred_location" | "read_mostly" | "accessed_by"
    set: bool
    location: Location  # for read_mostly and unset preferred_location the location is ignored by CUDA


def advice_plan(policy: Policy) -> list[Advice]:
    """The cudaMemAdvise calls that give a range exactly ``policy``'s advice.

    Unsets are included so that a pooled block reused under another policy loses its old advice.
    """
    plan = []
    if policy.preferred_location is None:
        plan.append(Advice("preferred_location", False, Location.DEVICE))
    else:
        plan.append(Advice("preferred_location", True, policy.preferred_location))
    plan.append(Advice("read_mostly", policy.read_mostly, Location.DEVICE))
    plan.append(Advice("accessed_by", policy.accessed_by_device, Location.DEVICE))
    plan.append(Advice("accessed_by", policy.accessed_by_host, Location.HOST))
    return plan
