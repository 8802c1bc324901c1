"""The objects tiermem's calls hand back, for annotations and isinstance checks: a move in flight
(:class:`Transfer`), the handles of :func:`tiermem.wrap_module` and :func:`tiermem.wrap_training`,
a budget lease, a checkpoint's index, and what the driver reports about the device and a range."""
from ._cuda import Capabilities, RangeInfo
from ._lease import BudgetLease
from ._load import Checkpoint
from ._module import TieredModule
from ._train import TieredTraining
from ._transfer import Transfer

__all__ = ["Transfer", "TieredModule", "TieredTraining", "BudgetLease", "Checkpoint", "Capabilities", "RangeInfo"]
