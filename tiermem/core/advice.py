"""Advice: each buffer's policy (its role's, or its own) and the CUDA advice that carries it out
(NOTE [default policies] in roles.py), given over the range each buffer may advise."""
from __future__ import annotations

import functools
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ..cuda.backend import PAGE
from ..errors import RoleError
from ..roles import Policy, PolicyTable, Role, advice_plan
from .tensor import Buffer

__all__ = ["Advisor", "cached_plan"]


@functools.lru_cache(maxsize=256)
def cached_plan(policy: Policy) -> tuple:
    """``advice_plan`` as a tuple, cached: trading pages compares plans per buffer, on the host
    time before a refill's first copy."""
    return tuple(advice_plan(policy))


class Advisor:
    """Policies and their advice for one device's buffers: resolves a buffer's policy from the
    ``policies`` table, gives its advice (or counts it skipped where the device cannot take it),
    and changes it."""

    def __init__(self, backend: Any, accounting: Any, policies: PolicyTable, lock: threading.RLock):
        self.backend = backend
        self.accounting = accounting
        self.policies = policies
        self._lock = lock

    def resolve_policy(self, role: Role, policy: Policy | None, changes: Mapping[str, Any]) -> Policy:
        base = policy if policy is not None else self.policies[role]
        if not isinstance(base, Policy):
            raise RoleError(f"policy must be a tiermem.Policy, got {type(base).__name__}")
        return base.replace(**changes) if changes else base

    @staticmethod
    def page_range(buf: Buffer) -> tuple[int, int]:
        """The range to advise and prefetch: whole pages when the buffer has them to itself (a
        group member, a large buffer), else just its bytes (its pages are shared)."""
        whole = buf.ptr % PAGE == 0 and buf.span % PAGE == 0 and (buf.owns_pages or buf.block.alloc != buf.ptr
                                                                   or buf.block.pool_key.endswith("/large"))
        return (buf.ptr, buf.span if whole else buf.nbytes)

    def apply(self, buf: Buffer, policy: Policy | None = None) -> None:
        """Give ``buf``'s range the advice of ``policy`` (default: its own)."""
        plan = advice_plan(policy or buf.policy)
        if not self.backend.capabilities().supports("advise"):
            self.accounting.count(buf.role, "advice_skipped", len(plan))
            return
        ptr, n = self.page_range(buf)
        for advice in plan:
            self.backend.advise(ptr, n, advice)
        self.accounting.count(buf.role, "advice_applied", len(plan))

    def change_policies(self, bufs: Sequence[Buffer], policy: Policy) -> None:
        """Give every buffer of ``bufs`` ``policy`` and apply its advice, one call per advice for
        each run of adjacent buffers of one allocation (a group's members): advised one tensor at
        a time, a module's resident groups were a tenth of a checkpoint's load
        (docs/inference.md, "Loading a checkpoint")."""
        plan = advice_plan(policy)
        with self._lock:
            runs: list[list[Any]] = []          # [allocation, start, end, role]
            for b in sorted(bufs, key=lambda b: b.ptr):
                b.policy = policy
                if not policy.read_only:
                    b.shadow_valid = False
                ptr, n = self.page_range(b)
                if runs and runs[-1][0] == b.block.alloc and ptr <= runs[-1][2]:
                    runs[-1][2] = max(runs[-1][2], ptr + n)
                else:
                    runs.append([b.block.alloc, ptr, ptr + n, b.role])
            if not self.backend.capabilities().supports("advise"):
                for b in bufs:
                    self.accounting.count(b.role, "advice_skipped", len(plan))
                return
            for _, start, end, role in runs:
                for advice in plan:
                    self.backend.advise(start, end - start, advice)
                self.accounting.count(role, "advice_applied", len(plan))

    def change_policy(self, buf: Buffer, policy: Policy | None, changes: Mapping[str, Any]) -> Policy:
        with self._lock:
            buf.policy = (policy if policy is not None else buf.policy).replace(**changes)
            if not buf.policy.read_only:
                buf.shadow_valid = False   # the device may write it from now on
            self.apply(buf)
            return buf.policy
