"""The plans behind the handles, as pure functions you can call on a CPU: which groups of a module
stay resident and which stream (:func:`plan_residency`, :func:`plan_host` for the disk tier), which
layers of a KV cache stay on the device and how one budget splits between weights and cache
(:func:`plan_kv`, :func:`split_budget`), and
what a training step keeps, swaps or moves (:func:`plan_training` over a :class:`StepTrace`);
:func:`parse_bytes`, the one reader of the sizes they take ("8GiB", or "25%" of the device:
NOTE [sizes] in base/limits.py); :func:`weight_bytes`, to size a share of a module's weights; and
:func:`plan_arena`, where a step's temporaries would sit in one lifetime-planned arena."""
from .base.limits import parse_bytes
from .inference.groups import weight_bytes
from .inference.kvplan import KVPlan, KVShape, kv_shape, plan_kv, split_budget
from .inference.plan import Plan, plan_host, plan_residency
from .training.arena import ArenaPlan, Temp, live_peak, plan_arena, temps_from_trace
from .training.plan import StepTrace, TrainPlan, plan_training

__all__ = ["Plan", "plan_residency", "plan_host", "KVPlan", "KVShape", "kv_shape", "plan_kv", "split_budget", "StepTrace", "TrainPlan", "plan_training", "parse_bytes",
           "weight_bytes", "Temp", "ArenaPlan", "plan_arena", "live_peak", "temps_from_trace"]
