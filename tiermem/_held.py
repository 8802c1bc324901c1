"""What a module tiermem holds refuses: being copied or pickled (NOTE [held modules])."""
from __future__ import annotations

from typing import Any, NoReturn

from ._errors import WrapError

__all__ = ["CopyGuard"]

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


class CopyGuard:
    """Makes copy.deepcopy and pickle of ``module`` raise WrapError until remove()."""

    NAMES = ("__deepcopy__", "__reduce_ex__")

    def __init__(self, module: Any):
        self.module = module
        self.old = {n: vars(module)[n] for n in self.NAMES if n in vars(module)}
        object.__setattr__(module, "__deepcopy__", _refuse_deepcopy)
        object.__setattr__(module, "__reduce_ex__", _refuse_pickle)

    def remove(self) -> None:
        for n in self.NAMES:
            if n in self.old:
                object.__setattr__(self.module, n, self.old[n])
            else:
                vars(self.module).pop(n, None)


def _refuse_deepcopy(memo: Any = None) -> NoReturn:
    raise WrapError(_WHY.format(what="copy.deepcopy of", how="copy"))


def _refuse_pickle(protocol: Any = None) -> NoReturn:
    raise WrapError(_WHY.format(what="pickling (or copy.copy of)", how="pickle"))
