"""Dtype names shared by torch, CuPy and NumPy views.

tiermem keeps a dtype as a canonical name ("float16", "bfloat16", ...) so that a buffer can be
viewed from any framework. Views are made as bytes and reinterpreted, which is how bfloat16 and
float8, which NumPy and the CUDA array interface cannot name, still reach torch zero-copy.
"""
from __future__ import annotations

from typing import Any

from ..errors import ViewError

__all__ = ["canonical", "names", "itemsize", "to_torch", "to_numpy"]

_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4,
    "int64": 8, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "long": "int64", "int": "int32",
            "short": "int16", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "bool_": "bool",
            "cfloat": "complex64", "cdouble": "complex128"}


def canonical(dtype: Any) -> str:
    """The canonical name of a torch, NumPy or CuPy dtype, or of a dtype string."""
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch."):]
    name = _ALIASES.get(name, name)
    if name not in _ITEMSIZE:
        try:  # NumPy spellings such as '<f4' or numpy.float32
            import numpy as np
            name = np.dtype(dtype).name
        except Exception:
            raise ViewError(f"unsupported dtype {dtype!r}; tiermem knows {sorted(_ITEMSIZE)}") from None
        if name not in _ITEMSIZE:
            raise ViewError(f"unsupported dtype {dtype!r}; tiermem knows {sorted(_ITEMSIZE)}")
    return name


def names() -> list[str]:
    """The canonical names tiermem holds, smallest items first."""
    return sorted(_ITEMSIZE, key=lambda n: (_ITEMSIZE[n], n))


def itemsize(name: str) -> int:
    return _ITEMSIZE[canonical(name)]


def to_torch(name: str):
    import torch
    dt = getattr(torch, canonical(name), None)
    if dt is None:
        raise ViewError(f"this torch ({torch.__version__}) has no dtype {name}")
    return dt


def to_numpy(name: str):
    """The NumPy dtype for ``name``; bfloat16 and float8 have none and raise :class:`ViewError`."""
    import numpy as np
    try:
        return np.dtype(canonical(name))
    except TypeError:
        raise ViewError(f"NumPy and CuPy have no {name} dtype; use the torch view") from None
