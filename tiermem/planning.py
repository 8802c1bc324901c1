"""The plans behind the handles, as pure functions you can call on a CPU: which groups of a module
stay resident and which stream (:func:`plan_residency`, :func:`plan_host` for the disk tier), and
what a training step keeps, swaps or moves (:func:`plan_training` over a :class:`StepTrace`);
and :func:`parse_bytes`, the one reader of the sizes they take ("8GiB", "25%")."""
from ._limits import parse_bytes
from ._module import Plan, plan_host, plan_residency
from ._trainplan import StepTrace, TrainPlan, plan_training

__all__ = ["Plan", "plan_residency", "plan_host", "StepTrace", "TrainPlan", "plan_training", "parse_bytes"]
