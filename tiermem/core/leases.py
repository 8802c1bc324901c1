"""Budget leases: a handle's share of a tier's device budget (NOTE [budget leases]).

NOTE [budget leases]
    A tier's budget has one owner, the user: ``Tier(budget=)``, ``configure(budget=)``,
    ``set_budget``, ``TIERMEM_BUDGET``. A handle that needs device memory of its own
    (``wrap_module``'s resident groups and window, ``wrap_training``'s blocks and slots) takes a
    lease on it instead of setting it, and gives the lease back on unwrap or when its adoption
    fails. So two handles on one tier never overwrite each other's budget, and an unwrap never
    undoes a ``configure`` made while the handle lived.

    The budget the tier enforces:
      - the configured budget, where there is one; leases must fit inside it together (a handle
        asks for at most ``Tier.lease_room()``, and says so when it gets less than it wanted);
      - else the sum of the live leases, so that an adopted module still holds to its budget,
        the tier's other tensors included (as before leases, when it set the budget);
      - else none.
    A lease given back lowers the enforced budget, and tiermem evicts what no longer fits.
"""
from __future__ import annotations

import numbers
from collections.abc import Callable

from ..errors import ConfigError

__all__ = ["BudgetLease", "Leases"]


class BudgetLease:
    """``nbytes`` of a tier's device budget, held by ``owner`` until :meth:`release`.

    Use as a context manager, or release it in a ``finally``; releasing twice is a no-op."""

    __slots__ = ("nbytes", "owner", "_give_back")

    def __init__(self, nbytes: int, owner: str, give_back: Callable[[BudgetLease], None]):
        self.nbytes = nbytes
        self.owner = owner
        self._give_back: Callable[[BudgetLease], None] | None = give_back

    @property
    def active(self) -> bool:
        return self._give_back is not None

    def release(self) -> None:
        """Give the bytes back to the tier; the budget it enforces shrinks to match."""
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back(self)

    def __enter__(self) -> BudgetLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "" if self.active else ", released"
        return f"<BudgetLease {self.nbytes:,} B for {self.owner}{state}>"


class Leases:
    """The live leases of one tier, and the budget they make (pure bookkeeping: the tier
    holds its lock around every call and does the evicting)."""

    def __init__(self) -> None:
        self._live: list[BudgetLease] = []

    def __iter__(self):
        return iter(list(self._live))

    def __len__(self) -> int:
        return len(self._live)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self._live)

    def room(self, configured: int | None) -> int | None:
        """Bytes a new lease may take: the configured budget less the leases; None where nothing
        is configured (any lease fits, and the enforced budget grows by it)."""
        return None if configured is None else max(configured - self.nbytes, 0)

    def enforced(self, configured: int | None) -> int | None:
        """The budget the tier holds to (NOTE [budget leases])."""
        if configured is not None:
            return configured
        return self.nbytes if self._live else None

    @staticmethod
    def check(nbytes: object) -> int:
        """``nbytes`` as an int, or ConfigError (a ValueError) if it is not a size."""
        # Integral, not int: figures from the driver or numpy (np.int64) are whole numbers too
        if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or nbytes < 0:
            raise ConfigError(f"a budget lease is a number of bytes >= 0, got {nbytes!r}")
        return int(nbytes)

    def add(self, nbytes: int, owner: str, give_back: Callable[[BudgetLease], None]) -> BudgetLease:
        lease = BudgetLease(self.check(nbytes), owner, give_back)
        self._live.append(lease)
        return lease

    def remove(self, lease: BudgetLease) -> None:
        self._live = [x for x in self._live if x is not lease]
