"""tiermem's one exception hierarchy.

Every error tiermem raises derives from :class:`TierMemError`. Errors that are also a standard
kind (a bad value, running out of memory) derive from that kind as well, so ``except MemoryError``
and ``except ValueError`` keep working in code that does not know tiermem.

A bad argument raises a :class:`ConfigError` (a ``ValueError``); one of the wrong type raises a
:class:`ConfigTypeError`, which is also a ``TypeError``. A role or policy that does not exist raises
:class:`RoleError` and a tensor that cannot be wrapped :class:`WrapError`, both ConfigErrors too.
They are raised before tiermem looks for a GPU, so code can be checked on a machine without one.
"""
from __future__ import annotations

__all__ = [
    "TierMemError",
    "ConfigError",
    "ConfigTypeError",
    "CUDAError",
    "CUDAOutOfMemoryError",
    "CUDAUnavailableError",
    "OutOfBudgetError",
    "CapExceededError",
    "DeviceFullError",
    "RoleError",
    "WrapError",
    "ViewError",
    "BuildError",
    "CheckpointError",
    "HostBudgetError",
]


def _fmt(n: int) -> str:
    return f"{n:,} bytes ({n / 2**30:.2f} GiB)"


class TierMemError(Exception):
    """Base class of every error tiermem raises."""


class ConfigError(TierMemError, ValueError):
    """A setting, option or argument that tiermem cannot use: a malformed or out-of-range size, an
    unknown mode, a lookahead below 1. The message names the argument and the bad value."""


class ConfigTypeError(ConfigError, TypeError):
    """An argument of the wrong type (a bool where bytes go, a non-int device). It is a
    :class:`ConfigError` as well, so ``except ConfigError`` catches every bad argument."""


class CUDAError(TierMemError):
    """A CUDA runtime call failed. ``status`` is the numeric cudaError_t, ``name`` its enum name."""

    def __init__(self, call: str, status: int, name: str):
        self.call = call
        self.status = int(status)
        self.name = name
        super().__init__(f"{call} failed: {name} ({self.status})")


class CUDAOutOfMemoryError(CUDAError, MemoryError):
    """The driver has no device memory left for a cudaMalloc (cudaErrorMemoryAllocation)."""


class CUDAUnavailableError(TierMemError):
    """No usable CUDA: the driver, the GPU or a CUDA package is missing. The message says which."""


class OutOfBudgetError(TierMemError, MemoryError):
    """A request would take more bytes than a limit allows.

    ``asked`` is the request, ``used`` what was already taken, ``limit`` the limit, all in bytes.
    """

    what = "device budget"

    def __init__(self, asked: int, used: int, limit: int, hint: str = ""):
        self.asked, self.used, self.limit = int(asked), int(used), int(limit)
        msg = (f"{self.what}: asked for {_fmt(self.asked)} with {_fmt(self.used)} in use; "
               f"the limit is {_fmt(self.limit)}")
        super().__init__(msg + (f". {hint}" if hint else ""))


class CapExceededError(OutOfBudgetError):
    """A managed allocation would pass the cap on total managed memory (see NOTE [managed cap])."""

    what = "managed-memory cap"


class RoleError(ConfigError):
    """An unknown role, or a policy setting that does not exist."""


class WrapError(ConfigError):
    """A tensor cannot be wrapped or unwrapped as asked (already wrapped, sparse, meta, ...)."""


class ViewError(TierMemError, TypeError):
    """A view cannot be made (no torch, a dtype the consumer lacks, a tensor already freed)."""


class BuildError(TierMemError):
    """A compiled part of tiermem (the torch allocator) cannot be built: no C compiler, no CUDA
    headers of the right version, or the compiler failed. The message says what to install."""


class DeviceFullError(OutOfBudgetError):
    """The device has too little free memory for a request tiermem checks before it starts
    (``asked`` bytes needed, ``limit`` bytes free), e.g. restoring a module with ``unwrap()``."""

    what = "free device memory"


class CheckpointError(TierMemError, ValueError):
    """A checkpoint cannot be loaded as asked: a missing shard or tensor, a tensor whose dtype or
    shape is not the model's, a truncated or malformed file. ``path`` names the file or folder.
    Raised before anything is allocated, or after a failed adoption gave every byte back."""

    def __init__(self, msg: str, path: str = ""):
        self.path = str(path)
        super().__init__(msg)


class HostBudgetError(OutOfBudgetError):
    """The pinned host memory a module needs does not fit its ``host_budget`` (NOTE [disk tier])."""

    what = "host budget"
