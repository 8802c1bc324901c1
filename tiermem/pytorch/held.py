"""What a module tiermem holds refuses: being copied or pickled (NOTE [held modules]); and the
instance attributes tiermem sets on objects it holds, put back as they were (:class:`InstancePatch`)."""
from __future__ import annotations

from typing import Any, NoReturn

from ..errors import WrapError

__all__ = ["CopyGuard", "InstancePatch"]

# NOTE [held modules]
#     A module that wrap_module or wrap_training holds carries tiermem's hooks, a reference to its
#     handle, and parameters bound to tiermem's memory (a pinned home, managed memory). copy.deepcopy
#     would copy the hooks with it, still calling the original's handle, and would copy every
#     streamed parameter into memory no budget counts; pickling fails on the hooks with an error
#     that names none of this. So both are refused, with what to do instead: copy the module
#     before wrapping it or after unwrap(), or save its state_dict(), whose tensors read the
#     current values. copy.deepcopy and pickle look __deepcopy__ and __reduce_ex__ up on the
#     instance, so the guard is two instance attributes, taken away by remove().

_WHY = ("{what} a module that tiermem holds would take tiermem's hooks and memory with it: {how} it "
        "before wrapping or after unwrap(), or use its state_dict() (NOTE [held modules])")


class InstancePatch:
    """Sets ``attrs`` as instance attributes of ``obj`` (over whatever its class gives) until
    remove(), which puts back the instance's own values where it had them and removes the rest.
    ``object.__setattr__`` goes past a module's own ``__setattr__``, which would register a
    module-valued attribute as a child."""

    def __init__(self, obj: Any, attrs: dict[str, Any]):
        self.obj = obj
        own = vars(obj)
        self.old = {n: own[n] for n in attrs if n in own}
        self.names = tuple(attrs)
        for n, v in attrs.items():
            object.__setattr__(obj, n, v)

    def remove(self) -> None:
        for n in self.names:
            if n in self.old:
                object.__setattr__(self.obj, n, self.old[n])
            else:
                vars(self.obj).pop(n, None)


class CopyGuard(InstancePatch):
    """Makes copy.deepcopy and pickle of ``module`` raise WrapError until remove()."""

    def __init__(self, module: Any):
        super().__init__(module, {"__deepcopy__": _refuse_deepcopy, "__reduce_ex__": _refuse_pickle})


def _refuse_deepcopy(memo: Any = None) -> NoReturn:
    raise WrapError(_WHY.format(what="copy.deepcopy of", how="copy"))


def _refuse_pickle(protocol: Any = None) -> NoReturn:
    raise WrapError(_WHY.format(what="pickling (or copy.copy of)", how="pickle"))
