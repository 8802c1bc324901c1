"""The classes tiermem's calls return, for annotations and isinstance checks: a move in flight
(:class:`Transfer`), the handles of :func:`tiermem.wrap_module` and :func:`tiermem.wrap_training`,
a budget lease, a checkpoint's index, what the driver reports; and :func:`parse_bytes`, the one
reader of sizes ("8GiB", "25%")."""
from ._cuda import Capabilities, RangeInfo
from ._lease import BudgetLease
from ._limits import parse_bytes
from ._load import Checkpoint
from ._module import TieredModule
from ._train import TieredTraining
from ._transfer import Transfer

__all__ = ["Transfer", "TieredModule", "TieredTraining", "BudgetLease", "Checkpoint", "Capabilities", "RangeInfo",
           "parse_bytes"]
