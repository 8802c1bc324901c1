"""The wrapped optimizer for a training loop that calls ``optimizer.step()`` itself (NOTE [a loop's
optimizer]).

NOTE [a loop's optimizer]
    The handle steps the optimizer itself, each streamed block inside backward as soon as its
    gradients are complete and the rest at the step's end (NOTE [training transport]), and it
    refuses a caller's ``optimizer.step()``, which would update the parameters twice. Loops that
    own the step (transformers' Trainer, accelerate's) call it after backward all the same. So
    ``train.stepped_optimizer()`` gives them an optimizer whose ``step()`` does nothing, the handle
    having stepped already, and whose groups and states are the wrapped optimizer's own objects:
    a learning-rate schedule built on it sets the rates the handle steps with, ``zero_grad``,
    ``state_dict`` and ``load_state_dict`` reach the wrapped optimizer (and tiermem's guards on
    it, NOTE [zero_grad], NOTE [loaded states]). A ``step()`` inside ``train.step()``, a closure,
    or a new parameter group is refused: each would take the step out of the handle's hands.
"""
from __future__ import annotations

import weakref
from typing import Any

from ..errors import TierMemError

__all__ = ["stepped_optimizer"]


def stepped_optimizer(handle: Any) -> Any:
    """NOTE [a loop's optimizer]: a ``torch.optim.Optimizer`` over ``handle``'s optimizer whose
    ``step()`` does nothing."""
    import torch

    class SteppedOptimizer(torch.optim.Optimizer):
        """The optimizer tiermem steps, as a loop that steps it sees it (NOTE [a loop's optimizer])."""

        def __init__(self, inner: Any, train: Any):
            self._ready = False
            super().__init__([{"params": list(g["params"])} for g in inner.param_groups], dict(inner.defaults))
            self.inner = inner
            self._train = weakref.ref(train)
            self._ready = True

        # The wrapped optimizer's groups and states, whatever objects they are now: a load_state_dict
        # (accelerate's prepare makes one) gives it new group dicts, which a schedule must set.
        @property
        def param_groups(self) -> list[dict[str, Any]]:
            return self.inner.param_groups if self.__dict__.get("_ready") else self.__dict__["_groups"]

        @param_groups.setter
        def param_groups(self, groups: list[dict[str, Any]]) -> None:
            if self.__dict__.get("_ready"):
                self.inner.param_groups = groups
            else:
                self.__dict__["_groups"] = groups

        @property
        def state(self) -> Any:
            return self.inner.state if self.__dict__.get("_ready") else self.__dict__["_state"]

        @state.setter
        def state(self, state: Any) -> None:
            if self.__dict__.get("_ready"):
                self.inner.state = state
            else:
                self.__dict__["_state"] = state

        def step(self, closure: Any = None) -> None:
            train = self._train()
            if closure is not None:
                raise TierMemError("a closure would run a forward and backward outside train.step(): tiermem "
                                   "steps the optimizer inside the step, so no closure is taken")
            if train is not None and train.state.in_step:
                raise TierMemError("the loop's optimizer.step() runs after train.step() closes, not inside it "
                                   "(NOTE [a loop's optimizer])")
            return None                         # the handle stepped every block already

        def zero_grad(self, set_to_none: bool = True) -> None:
            self.inner.zero_grad(set_to_none=set_to_none)

        def state_dict(self) -> dict[str, Any]:
            return self.inner.state_dict()

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.inner.load_state_dict(state_dict)

        def add_param_group(self, param_group: dict[str, Any]) -> None:
            if getattr(self, "_ready", False):
                raise TierMemError("wrap_training holds the optimizer's parameters as they were at wrap; add the "
                                   "group before wrapping (unwrap, add it, wrap again)")
            super().add_param_group(param_group)

        def __repr__(self) -> str:
            return f"SteppedOptimizer({self.inner!r})"

    return SteppedOptimizer(handle.opt, handle)
