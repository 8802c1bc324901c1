"""Every error tiermem raises. All derive from :class:`TierMemError`; the errors for a bad value
are also ``ValueError`` (``ConfigError``) or ``TypeError`` (``ConfigTypeError``), and the limits'
errors are also ``MemoryError`` (``OutOfBudgetError``). The four most used stand at the top level
too: TierMemError, ConfigError, OutOfBudgetError, CUDAError."""
from ._errors import (BuildError, CapExceededError, CheckpointError, ConfigError, ConfigTypeError, CUDAError,
                      CUDAOutOfMemoryError, CUDAUnavailableError, DeviceFullError, HostBudgetError, OutOfBudgetError,
                      RoleError, TierMemError, ViewError, WrapError)

__all__ = ["TierMemError", "ConfigError", "ConfigTypeError", "RoleError", "WrapError", "ViewError", "OutOfBudgetError",
           "CapExceededError", "HostBudgetError", "DeviceFullError", "CUDAError", "CUDAOutOfMemoryError",
           "CUDAUnavailableError", "BuildError", "CheckpointError"]
