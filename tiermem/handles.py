"""The objects tiermem's calls hand back, for annotations and isinstance checks: a move in flight
(:class:`Transfer`), the handles of :func:`tiermem.wrap_module` and :func:`tiermem.wrap_training`
and the options of the first (:class:`ModuleOptions`), a budget lease, a checkpoint's index, and
what the driver reports about the device and a range."""
from .core.leases import BudgetLease
from .core.transfer import Transfer
from .cuda.runtime import Capabilities, RangeInfo
from .inference.load import Checkpoint
from .inference.module import TieredModule
from .inference.options import ModuleOptions
from .training.handle import TieredTraining

__all__ = ["Transfer", "TieredModule", "ModuleOptions", "TieredTraining", "BudgetLease", "Checkpoint", "Capabilities", "RangeInfo"]
