"""Checkpoints saved already quantized, one scale per output row: read as they are
(NOTE [checkpoints already quantized]).

NOTE [checkpoints already quantized]
    Two common schemes store a Linear's weight as 8-bit values and one scale per output row,
    the weight being ``values * scale`` (symmetric, no zero point):
      - transformers' ``fbgemm_fp8``: ``weight`` in float8_e4m3fn and ``weight_scale`` (rows, 1)
        in fp32;
      - ``compressed-tensors`` with one config group whose weights are 8-bit, ``int`` or
        ``float``, symmetric, with the ``channel`` strategy (formats ``int-quantized``,
        ``float-quantized`` or ``naive-quantized``): ``weight`` in int8 or float8_e4m3fn and
        ``weight_scale`` (rows, 1) in fp32, bf16 or fp16.
    That is exactly the int8 and fp8 packing of quantized streaming (NOTE [quantized streaming]
    in inference/quant.py: one fp32 scale per row, the weight ``(values.float() * scale)``
    rounded once). So with ``stream_dtype`` equal to the checkpoint's format, a streamed
    weight's values and scales go into its packed home as the file holds them (the scales
    widened to fp32, which is exact), with no round trip through the model's dtype and no second
    rounding. Everywhere else (resident groups, another ``stream_dtype``, none) the weight is
    dequantized by that formula as it is read. The model is built from its config with plain
    Linear layers (``from_config`` applies no quantizer), so a checkpoint loads wherever
    transformers can build its architecture, with no quantization package. Activation scales
    (``input_scale``, ``input_scale_ub``) are not used: the weights are dequantized and the
    activations stay in the model's dtype. Other schemes (block scales, groups of columns, zero
    points, 4-bit packings) are refused with the scheme named, and so are a mixture's experts
    saved one tensor per expert, each with its own scale: transformers stacks them, and a stack
    is read in place only where its sources' bytes lie end to end (NOTE [merged tensors] in
    inference/load.py).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ..base import dtypes as _dtypes
from ..errors import CheckpointError

__all__ = ["Prequantized", "QuantizedCheckpoint", "scheme_of", "copy_packed"]

_ACTIVATION_SCALES = ("input_scale", "input_scale_ub")
_CT_FORMATS = ("int-quantized", "float-quantized", "naive-quantized")


def _get(obj: Any, key: str, default: Any = None) -> Any:
    return obj.get(key, default) if isinstance(obj, Mapping) else getattr(obj, key, default)


def scheme_of(config: Any, where: str = "") -> str | None:
    """The packing format ("int8" or "fp8") of a checkpoint whose config says it is quantized
    one scale per row, None for one that is not quantized; :class:`CheckpointError` for another
    scheme (NOTE [checkpoints already quantized])."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    method = _get(qc, "quant_method")
    if method == "fbgemm_fp8":
        return "fp8"
    if method == "compressed-tensors":
        groups = _get(qc, "config_groups") or {}
        fmt = _get(qc, "format")
        if len(groups) == 1:
            w = _get(next(iter(groups.values())), "weights") or {}
            kind = _get(w, "type")
            if (fmt in _CT_FORMATS and _get(w, "num_bits") == 8 and _get(w, "strategy") == "channel"
                    and _get(w, "symmetric", True) and kind in ("int", "float")
                    and not _get(w, "dynamic", False)):
                return "int8" if kind == "int" else "fp8"
        raise CheckpointError(f"{where}: its compressed-tensors scheme (format {fmt!r}, {len(groups)} config "
                              "group(s)) is not one scale per row of 8-bit weights; tiermem reads that one only "
                              "(NOTE [checkpoints already quantized]): dequantize it first", where)
    raise CheckpointError(f"{where}: quantization_config.quant_method={method!r} is not read as it is; tiermem reads "
                          "fbgemm_fp8 and compressed-tensors' 8-bit channel-wise weights (NOTE [checkpoints already "
                          "quantized]): dequantize it first", where)


class Prequantized:
    """A weight stored as 8-bit ``values`` and one scale per row (``scale``), each a checkpoint
    tensor (inference/load.py's FileTensor): read as the model's
    ``dtype`` by :meth:`tensor` (dequantized), or copied as it is into a packed home of the same
    format by :func:`copy_packed`."""

    def __init__(self, name: str, values: Any, scale: Any, fmt: str, dtype: str):
        self.name, self.values, self.scale, self.fmt = name, values, scale, fmt
        self.dtype, self.shape = dtype, tuple(values.shape)

    def parts(self) -> tuple[Any, Any]:
        """(values, scales as fp32 of shape (rows, 1)), read now."""
        import torch
        return self.values.tensor(), self.scale.tensor().to(torch.float32).reshape(self.shape[0], 1)

    def tensor(self) -> Any:
        """The weight in the model's dtype: ``(values.float() * scale)`` rounded once."""
        q, s = self.parts()
        return (q.float() * s).to(_dtypes.to_torch(self.dtype))


def copy_packed(src: Any, p: Any, q_out: Any, s_out: Any) -> bool:
    """Write ``src``'s values and scales into the packed views ``q_out`` and ``s_out`` as they are
    where ``src`` is :class:`Prequantized` in ``p``'s format with a scale per row; False (nothing
    written) otherwise."""
    if not isinstance(src, Prequantized) or src.fmt != p.fmt or p.group != p.cols or p.rows != src.shape[0]:
        return False
    q, s = src.parts()
    q_out.copy_(q.reshape(q_out.shape).view(q_out.dtype) if q.dtype != q_out.dtype else q.reshape(q_out.shape))
    s_out.copy_(s.reshape(s_out.shape))
    return True


class QuantizedCheckpoint(Mapping):
    """A checkpoint's tensors with each quantized weight and its scale given as one
    :class:`Prequantized` under the weight's name, its scales and activation scales left out."""

    def __init__(self, ckpt: Mapping[str, Any], fmt: str, dtype: str):
        self.path = getattr(ckpt, "path", "")
        want = {"int8": "int8", "fp8": "float8_e4m3fn"}[fmt]
        self._tensors: dict[str, Any] = {}
        scales = {k[:-len(".weight_scale")] for k in ckpt if k.endswith(".weight_scale")}
        for name, ft in ckpt.items():
            base, _, leaf = name.rpartition(".")
            if leaf == "weight_scale" or leaf in _ACTIVATION_SCALES:
                continue
            if leaf == "weight" and base in scales:
                if ft.dtype != want or len(ft.shape) != 2:
                    raise CheckpointError(f"{self.path}: {name} is {ft.dtype} {list(ft.shape)}, where its "
                                          f"quantization_config says {want} rows", self.path)
                sc = ckpt[f"{base}.weight_scale"]
                if sc.shape not in ((ft.shape[0], 1), (ft.shape[0],)):
                    raise CheckpointError(f"{self.path}: {base}.weight_scale is {list(sc.shape)}, not one scale per "
                                          f"row of {name} {list(ft.shape)} (NOTE [checkpoints already quantized])",
                                          self.path)
                self._tensors[name] = Prequantized(name, ft, sc, fmt, dtype)
            else:
                self._tensors[name] = ft

    def __getitem__(self, name: str) -> Any:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)
