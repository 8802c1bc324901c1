"""The plans behind the handles, as pure functions you can call on a CPU: which groups of a module
stay resident and which stream (:func:`plan_residency`, :func:`plan_host` for the disk tier), and
what a training step keeps, swaps or moves (:func:`plan_training` over a :class:`StepTrace`);
:func:`parse_bytes`, the one reader of the sizes they take ("8GiB", or "25%" of the device:
NOTE [sizes] in _limits.py); and :func:`weight_bytes`, to size a share of a module's weights."""
from ._limits import parse_bytes
from ._module import Plan, plan_host, plan_residency, weight_bytes
from ._trainplan import StepTrace, TrainPlan, plan_training

__all__ = ["Plan", "plan_residency", "plan_host", "StepTrace", "TrainPlan", "plan_training", "parse_bytes",
           "weight_bytes"]
