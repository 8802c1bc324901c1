"""Keyword arguments checked against the function that takes them.

The module-level functions pass ``**kwargs`` on to a Tier's method, which makes the default Tier
(and so looks for a GPU) first: a misspelt keyword would only meet Python's TypeError after that,
or on a machine without a GPU never. :func:`check_keywords` refuses it up front, reading the
names from the signature of the function that will take them, so the list never drifts from it.
"""
from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import ConfigTypeError

__all__ = ["check_keywords", "check_names", "keywords_of"]


def keywords_of(fn: Callable[..., Any], skip: Iterable[str] = ()) -> list[str] | None:
    """The keyword arguments ``fn`` takes, less ``skip`` and private ones (a leading ``_``), in
    order; None when it takes any (``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    skip = set(skip) | {"self"}
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name not in skip and not p.name.startswith("_")]


def check_keywords(call: str, fn: Callable[..., Any], given: Iterable[str], skip: Iterable[str] = ()) -> None:
    """Raise :class:`ConfigTypeError` (a TypeError, as Python's own) for the first name in ``given``
    that ``fn`` does not take as a keyword (``skip`` names ones it takes but ``call`` does not),
    with the closest name it does take."""
    known = keywords_of(fn, skip)
    if known is not None:
        check_names(call, known, given)


def check_names(call: str, known: Iterable[str], given: Iterable[str]) -> None:
    """Raise :class:`ConfigTypeError` for the first name in ``given`` that is not in ``known`` (the
    keywords ``call`` takes), with the closest name it does take."""
    known = list(known)
    for name in given:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigTypeError(f"{call}() got an unknown keyword argument {name!r}; {hint}"
                                  f"it takes {', '.join(known)}")
