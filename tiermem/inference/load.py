"""Checkpoints on disk: safetensors files read straight into tiermem's homes, and load_pretrained.

    model, handle = tiermem.load_pretrained("path/to/checkpoint", budget="8GB")

NOTE [reading a checkpoint]
    A safetensors file is an 8-byte header length, a JSON header naming each tensor's dtype, shape
    and byte range, then the bytes, each tensor contiguous. So a tensor that keeps the file's dtype
    needs no parsing: its bytes are read with ``os.preadv`` straight into the memory that will hold
    it (the pinned home of a streamed group, or a disk tier's staging buffer), with no host copy
    in between and no file mapping in the process's resident set. Reads are split into chunks
    served by a few threads (``os.preadv`` lets go of the GIL), since one thread reading through
    the page cache stays well under what an NVMe drive or a warm cache can give. The headers are
    parsed and checked against the file sizes and the model before anything is allocated, so a
    bad checkpoint (a missing shard or tensor, a wrong dtype or shape, a truncated file) is refused
    with :class:`CheckpointError` and nothing to undo. A tensor whose dtype must change (``dtype=``)
    is read into a host tensor of its own and converted; that costs one tensor of host memory at
    a time. A disk tier may read through KvikIO instead (NOTE [kvikio reader] in inference/kvikio.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import os
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from ..base import dtypes as _dtypes
from ..errors import CheckpointError, ConfigError, ConfigTypeError, TierMemError
from .configs import check_causal, read_config, reason
from .prequant import QuantizedCheckpoint, scheme_of
from .weights import check_weights

__all__ = ["FileTensor", "Checkpoint", "Reader", "load_pretrained", "empty_weights", "model_weights", "build_model",
           "checkpoint_weights", "weights_dtype", "weights_source", "check_dtype"]

# safetensors' dtype names -> tiermem's canonical names
_ST_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32", "U64": "uint64"}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CHUNK = 16 << 20        # bytes per read call: large enough for the drive, small enough to spread over threads


@dataclasses.dataclass(frozen=True)
class FileTensor:
    """One tensor's bytes in a safetensors file: ``nbytes`` from byte ``offset`` of ``path``."""

    name: str
    path: str
    offset: int
    nbytes: int
    dtype: str              # canonical (tiermem.base.dtypes)
    shape: tuple[int, ...]

    def tensor(self) -> Any:
        """A new CPU torch tensor holding this tensor (one tensor of host memory)."""
        import torch
        out = torch.empty(self.shape, dtype=_dtypes.to_torch(self.dtype))
        if self.nbytes:
            Reader.shared().read([(self, _bytes_of(out))])
        return out


# NOTE [merged tensors]
# transformers 5 builds some parameters from several checkpoint tensors as it loads them (its
# WeightConverter rules): Mixtral's and Qwen2-MoE's experts are saved one tensor per expert and
# projection, and the model holds them stacked, ``experts.gate_up_proj`` of shape (experts,
# 2 x intermediate, hidden) from each expert's w1 then w3. Stacking along dim 0, and
# concatenating along the first dim that the stack left whole, lay the sources' bytes end to
# end: a row-major (E, a + b, h) tensor is, for each expert, a's bytes then b's. So such a
# parameter is read in place as well, as a list of file ranges (:class:`Pieces`), and every
# reader (the home, the resident fill, the disk tier) reads it as it reads one tensor. Other
# operations (a transpose, a split, tensor-parallel shards) do not lay bytes end to end; a
# checkpoint that needs them is refused with the way around it.
@dataclasses.dataclass(frozen=True)
class Pieces(FileTensor):
    """A parameter whose bytes are ``pieces``' end to end (NOTE [merged tensors]); its ``path``
    is its first piece's, and ``offset`` is -1."""

    pieces: tuple[FileTensor, ...] = ()


def _ranges(ft: FileTensor, start: int, mv: memoryview) -> list[tuple[str, int, memoryview]]:
    """The (file, offset, destination) reads that fill ``mv`` with ``ft``'s bytes from ``start``."""
    if not isinstance(ft, Pieces):
        return [(ft.path, ft.offset + start, mv)]
    out, pos, end = [], 0, start + len(mv)
    for p in ft.pieces:
        lo, hi = max(start, pos), min(end, pos + p.nbytes)
        if lo < hi:
            out.append((p.path, p.offset + lo - pos, mv[lo - start:hi - start]))
        pos += p.nbytes
    return out


class _Cast:
    """A checkpoint tensor converted to another dtype as it is read (NOTE [reading a checkpoint])."""

    def __init__(self, src: FileTensor, dtype: str):
        self.src, self.dtype, self.shape, self.name = src, dtype, src.shape, src.name

    def tensor(self) -> Any:
        return self.src.tensor().to(_dtypes.to_torch(self.dtype))


def _bytes_of(t: Any) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    import ctypes
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def host_bytes(ptr: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` of host memory at ``ptr`` (pinned memory is host memory)."""
    import ctypes
    return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")


class Reader:
    """Reads byte ranges of files into memory with ``os.preadv`` on ``threads`` threads, in chunks
    of ``chunk`` bytes (NOTE [reading a checkpoint]). With ``drop_cache`` each chunk read is
    dropped from the page cache (posix_fadvise DONTNEED), so a disk tier does not keep a second
    copy of what it streams in the host's memory. Thread-safe; file descriptors are cached."""

    _shared: Reader | None = None
    _shared_lock = threading.Lock()

    def __init__(self, threads: int = 4, chunk: int = CHUNK, drop_cache: bool = False):
        self.threads, self.chunk, self.drop_cache = max(1, int(threads)), max(4096, int(chunk)), drop_cache
        self._pool: ThreadPoolExecutor | None = None        # made at the first read of several chunks
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.seconds = 0.0

    @classmethod
    def shared(cls) -> Reader:
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = Reader(threads=min(16, os.cpu_count() or 1))
            return cls._shared

    def fd(self, path: str) -> int:
        """This reader's (cached) read-only descriptor of ``path``."""
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                try:
                    fd = self._fds[path] = os.open(path, os.O_RDONLY)
                except FileNotFoundError:       # gone since its header was read
                    raise CheckpointError(f"{path} does not exist", path) from None
            return fd

    def _read_chunk(self, path: str, offset: int, mv: memoryview) -> None:
        fd = self.fd(path)
        done, n = 0, len(mv)
        while done < n:
            got = os.preadv(fd, [mv[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"{path} ends at byte {offset + done:,}, before the {n:,} bytes asked from "
                                      f"byte {offset:,}: the file is truncated", path)
            done += got
        if self.drop_cache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)

    def read(self, jobs: list[tuple[FileTensor, memoryview]]) -> int:
        """Read each tensor's bytes into its memoryview (same length); returns the bytes read."""
        for ft, mv in jobs:
            if len(mv) != ft.nbytes:
                raise TierMemError(f"{ft.name}: {len(mv):,} bytes of room for {ft.nbytes:,} bytes")
        return self.read_ranges([r for ft, mv in jobs for r in _ranges(ft, 0, mv)])

    def read_range(self, ft: FileTensor, start: int, mv: memoryview) -> int:
        """Read ``len(mv)`` bytes of ``ft`` from its byte ``start``."""
        return self.read_parts([(ft, start, mv)])

    def read_parts(self, parts: list[tuple[FileTensor, int, memoryview]]) -> int:
        """Read each ``(ft, start, mv)``: ``len(mv)`` bytes of ``ft`` from its byte ``start``, all
        at once on the reader's threads; returns the bytes read."""
        ranges = []
        for ft, start, mv in parts:
            if start < 0 or start + len(mv) > ft.nbytes:
                raise TierMemError(f"{ft.name}: bytes {start:,}..{start + len(mv):,} of {ft.nbytes:,}")
            ranges += _ranges(ft, start, mv)
        return self.read_ranges(ranges)

    def read_ranges(self, ranges: list[tuple[str, int, memoryview]]) -> int:
        """Read each (file, byte offset, destination) range whole; returns the bytes read. The one
        method a reader of another kind replaces (tiermem.inference.kvikio.KvikioReader)."""
        import time
        parts = []
        for path, offset, mv in ranges:
            for s in range(0, len(mv), self.chunk):
                parts.append((path, offset + s, mv[s:s + self.chunk]))
        t0 = time.perf_counter()
        if len(parts) == 1:
            self._read_chunk(*parts[0])
        else:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tiermem-read")
            futures = [self._pool.submit(self._read_chunk, *p) for p in parts]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                # The caller frees the destination when this raises: no read may still write it.
                for f in futures:
                    f.cancel()
                wait(futures)
                raise
        total = sum(len(p[2]) for p in parts)
        self.account(total, time.perf_counter() - t0)
        return total

    def account(self, nbytes: int, seconds: float) -> None:
        """Count ``nbytes`` read in ``seconds`` in :attr:`bytes_read` and :attr:`seconds`."""
        with self._lock:
            self.bytes_read += nbytes
            self.seconds += seconds

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


def _parse_header(path: str) -> dict[str, FileTensor]:
    """The tensors of one safetensors file, checked against its size (NOTE [reading a checkpoint])."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is {size} bytes: too short for a safetensors header (truncated?)", path)
            n = int.from_bytes(head, "little")
            if n > size - 8 or n > 100 << 20:
                raise CheckpointError(f"{path}: its header says {n:,} bytes of JSON but the file has {size - 8:,} "
                                      "after the length (truncated, or not a safetensors file)", path)
            meta = json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist", path) from None
    except (ValueError, UnicodeDecodeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({e})", path) from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: the safetensors header is JSON but not an object of tensors "
                              f"(a {type(meta).__name__})", path)
    base = 8 + n
    out = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        out[name] = _entry(path, name, info, base, size)
    return out


def _entry(path: str, name: str, info: Any, base: int, size: int) -> FileTensor:
    """One tensor's header entry, checked: a dtype tiermem reads, a shape of sizes, and a byte range
    inside the file that is exactly the shape's bytes."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise CheckpointError(f"{path}: tensor {name!r} has a malformed entry {_short(info)} (a safetensors entry "
                              "has dtype, shape and data_offsets)", path)
    dtype = _ST_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {_short(info['dtype'])}, which tiermem cannot read "
                              f"(it reads {', '.join(_ST_DTYPES)})", path)
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(type(x) is int and x >= 0 for x in shape):
        raise CheckpointError(f"{path}: tensor {name!r} has shape {_short(shape)}, not a list of sizes", path)
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(x) is int for x in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{path}: tensor {name!r} has data_offsets {_short(offsets)}, not a [begin, end] byte "
                              "range", path)
    begin, end = offsets
    want = math.prod(shape) * _dtypes.itemsize(dtype)
    if end - begin != want:
        raise CheckpointError(f"{path}: tensor {name!r} ({dtype}, {list(shape)}) needs {want:,} bytes but its "
                              f"entry spans {end - begin:,}", path)
    if base + end > size:
        raise CheckpointError(f"{path} is {size:,} bytes but tensor {name!r} ends at byte {base + end:,}: the file "
                              "is truncated, or its header's offsets point past its end", path)
    return FileTensor(name, path, base + begin, want, dtype, tuple(shape))


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


class Checkpoint(Mapping):
    """The tensors of a checkpoint as :class:`FileTensor` s, by name: a folder as ``save_pretrained``
    writes it (``model.safetensors``, or shards listed in ``model.safetensors.index.json``), or
    one ``.safetensors`` file. Only the headers are read; every shard named must exist and hold
    the tensors the index says it does."""

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        self.path = path
        if os.path.isdir(path):
            index = os.path.join(path, INDEX)
            single = os.path.join(path, SINGLE)
            if os.path.exists(index):
                try:
                    with open(index, "rb") as f:
                        wmap = json.load(f)["weight_map"]
                except (ValueError, KeyError, TypeError) as e:
                    why = "not valid JSON" if isinstance(e, ValueError) else "no weight_map"
                    raise CheckpointError(f"{index} is not an index of shards: {why} ({e})", index) from None
                if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
                    raise CheckpointError(f"{index}: its weight_map is not an object of tensor name -> shard file",
                                          index)
                shards = sorted(set(wmap.values()))
                missing = [s for s in shards if not os.path.exists(os.path.join(path, s))]
                if missing:
                    raise CheckpointError(f"{path}: the index names {len(missing)} shard(s) that are missing: "
                                          f"{', '.join(missing[:5])}", os.path.join(path, missing[0]))
                headers = {s: _parse_header(os.path.join(path, s)) for s in shards}
                self._tensors = {}
                for name, shard in wmap.items():
                    got = headers[shard].get(name)
                    if got is None:
                        raise CheckpointError(f"{path}: the index puts {name!r} in {shard}, which has no such "
                                              "tensor", os.path.join(path, shard))
                    self._tensors[name] = got
            elif os.path.exists(single):
                self._tensors = _parse_header(single)
            else:
                raise CheckpointError(f"{path} holds neither {SINGLE} nor {INDEX}: not a safetensors checkpoint "
                                      "as save_pretrained writes it", path)
        else:
            self._tensors = _parse_header(path)

    def __getitem__(self, name: str) -> FileTensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())

    @property
    def files(self) -> list[str]:
        return sorted({t.path for t in self._tensors.values()})

    def dtypes(self) -> dict[str, int]:
        """Bytes per dtype."""
        out: dict[str, int] = {}
        for t in self._tensors.values():
            out[t.dtype] = out.get(t.dtype, 0) + t.nbytes
        return out


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Within the block, new modules put their parameters on the meta device (no memory), marked
    as initialized for transformers, while their buffers are built for real: non-persistent
    buffers (rotary frequencies) are computed in ``__init__`` and are in no checkpoint. Process-wide, not thread-local: it patches
    ``nn.Module.register_parameter`` and restores it on exit."""
    import torch
    nn = torch.nn
    old = nn.Module.register_parameter

    def register(module: Any, name: str, param: Any) -> None:
        old(module, name, param)
        if param is not None and not param.is_meta:
            p = module._parameters[name]
            meta = module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)
            # transformers' init functions skip a tensor so marked, as they do one from_pretrained
            # loaded; initializing meta tensors changes nothing and was most of the time that
            # building a model on the meta device took (docs/inference.md, "Loading a checkpoint").
            meta._is_hf_initialized = True

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = old


def _no_init(transformers: Any) -> Any:
    """transformers' own switch that skips weight initialization, as its from_pretrained uses:
    on meta tensors it changes nothing, and it halved building the 12.5 GB Qwen2 of
    bench/offload_disk.py (0.12 to 0.06 s on a CPU machine). A null context where it is missing."""
    for where in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            return importlib.import_module(where).no_init_weights()
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext()


def _tie(model: Any) -> None:
    """NOTE [tied checkpoints]
    transformers writes a tied weight once (a model with ``tie_word_embeddings=True`` has no
    ``lm_head.weight`` in its files: docs/facts.md) and ties the two names after loading; with
    weight initialization switched off (``_no_init``), building from the config leaves them two
    meta tensors. Tied here, as from_pretrained does, they are one parameter under two names, and
    NOTE [weight source] gives it the bytes of whichever name the checkpoint has."""
    tie = getattr(model, "tie_weights", None)
    if tie is not None:
        tie()


class Loaded(tuple):
    """(model, handle) from :func:`load_pretrained`; also ``.model`` and ``.handle``."""

    def __new__(cls, model: Any, handle: Any) -> Loaded:
        return super().__new__(cls, (model, handle))

    model = property(lambda self: self[0])
    handle = property(lambda self: self[1])


def model_weights(ckpt: Mapping[str, FileTensor], model: Any) -> dict[str, FileTensor]:
    """The checkpoint's tensors under the model's state-dict names. transformers renames some
    keys as it loads them (GPT-NeoX's ``embed_out`` is the model's ``lm_head``) and merges others
    (Mixtral's experts, stacked); its own rules are applied here, merges as :class:`Pieces`
    (NOTE [merged tensors]). A merge whose bytes are not laid end to end raises
    :class:`CheckpointError`."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
        mapping = get_model_conversion_mapping(model)
    except Exception:        # a transformers without these rules reads the names as they are
        return _tied_names(dict(ckpt), model)
    renames = [m for m in mapping if isinstance(m, WeightRenaming)]
    merges = [m for m in mapping if isinstance(m, WeightConverter)]
    meta = model.state_dict()
    out: dict[str, FileTensor] = {}
    pending: dict[str, tuple[Any, dict[int, dict[int | None, FileTensor]]]] = {}
    for k, v in ckpt.items():
        name, pattern = rename_source_key(k, renames, merges, getattr(model, "base_model_prefix", None), meta)
        if pattern is None:
            out[name] = v
            continue
        conv = next(c for c in merges if pattern in c.source_patterns)
        at = _star(pattern, k)
        pending.setdefault(name, (conv, {}))[1].setdefault(conv.source_patterns.index(pattern), {})[at] = v
    path = getattr(ckpt, "path", "")
    for name, (conv, sources) in pending.items():
        m = meta.get(name)
        out[name] = _merged(name, conv, sources, None if m is None else tuple(m.shape), path)
    return _tied_names(out, model)


def _tied_names(out: dict[str, FileTensor], model: Any) -> dict[str, FileTensor]:
    """``out`` with each tied name the checkpoint lacks given its partner's tensor: where tying
    (NOTE [tied checkpoints]) still leaves two parameters, each takes the one saved tensor."""
    tied = getattr(model, "all_tied_weights_keys", None)
    if not isinstance(tied, Mapping):
        try:
            tied = model.get_expanded_tied_weights_keys(all_submodels=True)
        except Exception:   # not a transformers model, or one without the mapping: nothing to add
            return out
    for target, source in tied.items():
        if target not in out and source in out:
            out[target] = out[source]
        elif source not in out and target in out:
            out[source] = out[target]
    return out


def _star(pattern: str, key: str) -> int | None:
    """The number that ``*`` stands for in ``key`` (an expert's index), or None."""
    import re
    if "*" not in pattern:
        return None
    rx = re.escape(pattern).replace(r"\*", r"(\d+)")
    found = re.search(rx, key)
    return int(found.group(1)) if found else None


def _merged(name: str, conv: Any, sources: dict[int, dict[int | None, FileTensor]], want: tuple[int, ...] | None,
            path: str) -> Pieces:
    """The :class:`Pieces` of one merged parameter (NOTE [merged tensors])."""
    ops = [(type(o).__name__, getattr(o, "dim", None), getattr(o, "num_shards_attribute", None)) for o in conv.operations]
    kinds = [(k, d) for k, d, shards in ops if shards is None]
    nsrc = len(conv.source_patterns)

    def refuse(why: str) -> CheckpointError:
        return CheckpointError(f"{name}: transformers builds it from {', '.join(conv.source_patterns)} by "
                               f"{[k for k, _, _ in ops]}; {why}, so load_pretrained cannot read it in place; load this "
                               "model with transformers and call tiermem.wrap_module", path)
    if len(kinds) != len(ops) or kinds not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)],
                                               [("Concatenate", 0)]):
        raise refuse("its bytes are not the sources' end to end")
    if set(sources) != set(range(nsrc)):
        raise refuse(f"the checkpoint has {len(sources)} of its {nsrc} sources")
    if any(not isinstance(v, FileTensor) for s in sources.values() for v in s.values()):
        # NOTE [checkpoints already quantized]: a weight and its scale per expert are not one range
        raise refuse("its sources are saved quantized, each with its own scale")
    stacked = kinds[0][0] == "MergeModulelist"
    index = sorted(sources[0], key=lambda i: -1 if i is None else i)
    if stacked and (None in index or index != list(range(len(index)))):
        raise refuse(f"its stacked tensors are numbered {index[:8]}, not 0 to {len(index) - 1}")
    if any(sorted(s, key=lambda i: -1 if i is None else i) != index for s in sources.values()):
        raise refuse("its sources do not have the same members")
    pieces = tuple(sources[s][i] for i in index for s in range(nsrc))
    first = pieces[0]
    if any(p.dtype != first.dtype or tuple(p.shape[1:]) != tuple(first.shape[1:]) or len(p.shape) != len(first.shape)
           or (stacked and nsrc == 1 and tuple(p.shape) != tuple(first.shape)) for p in pieces):
        raise refuse("its pieces differ in dtype or shape")
    rows = sum(sources[s][index[0]].shape[0] for s in range(nsrc)) if first.shape else 0
    if stacked:
        shape = (len(index), *first.shape) if nsrc == 1 else (len(index), rows, *first.shape[1:])
        if nsrc > 1 and any(sum(sources[s][i].shape[0] for s in range(nsrc)) != rows for i in index):
            raise refuse("its experts' pieces differ in shape")
    else:
        shape = (rows, *first.shape[1:])
    shape = tuple(int(x) for x in shape)
    if want is not None and shape != want:
        raise refuse(f"its pieces make shape {shape}, the model's is {want}")
    return Pieces(name=name, path=first.path, offset=-1, nbytes=sum(p.nbytes for p in pieces), dtype=first.dtype,
                  shape=shape, pieces=pieces)


def config_dtype(config: Any) -> Any:
    """The dtype a transformers config names, or None (read from its fields: transformers 5
    warns on every read of the old ``torch_dtype`` attribute)."""
    fields = vars(config)
    return fields.get("dtype") or fields.get("torch_dtype")


def to_torch_dtype(dt: Any) -> Any:
    import torch
    if dt is None or isinstance(dt, torch.dtype):
        return dt
    if str(dt) == "auto":
        return None
    return _dtypes.to_torch(str(dt))


FLOATING = ("float16", "bfloat16", "float32", "float64")     # what a model's weights can be built in


def check_dtype(dtype: Any, what: str = "dtype") -> str | None:
    """The canonical name of a weight dtype (a torch dtype or its name; None or "auto": none
    given), or :class:`ConfigError`. Needs no torch."""
    if dtype is None or str(dtype) == "auto":
        return None
    try:
        name = _dtypes.canonical(dtype)
    except TierMemError:
        name = None
    if name not in FLOATING:
        raise ConfigError(f"{what}={str(dtype).replace('torch.', '')!r} is not a dtype weights are built in: use "
                          f"{', '.join(FLOATING)}")
    return name


def weights_dtype(dtype: Any, config: Any, ckpt: Checkpoint | None, fallback: str) -> Any:
    """The torch dtype a model is built in: ``dtype`` if given, else its config's, else the
    checkpoint's most common floating dtype, else ``fallback``."""
    import torch
    if isinstance(dtype, torch.dtype) or check_dtype(dtype) is not None:
        return _dtypes.to_torch(check_dtype(dtype))
    named = check_dtype(config_dtype(config), what=f"{type(config).__name__}'s dtype")
    if named is not None:
        return _dtypes.to_torch(named)
    floating = {k: v for k, v in (ckpt.dtypes() if ckpt is not None else {}).items() if k in FLOATING}
    return _dtypes.to_torch(max(floating, key=floating.get) if floating else fallback)


def build_model(config: Any, dtype: Any, model_class: Any = None) -> Any:
    """``model_class`` (default ``AutoModelForCausalLM``, for a causal LM's config only, which the
    caller checks: :func:`check_causal`) built from ``config`` in ``dtype`` on the meta device
    (:func:`empty_weights`), its tied weights tied (NOTE [tied checkpoints]); a config
    transformers cannot build raises :class:`ConfigError`."""
    import transformers
    builder = model_class or transformers.AutoModelForCausalLM
    try:
        with empty_weights(), _no_init(transformers):
            model = builder.from_config(config, dtype=dtype)
    except (ValueError, TypeError, AttributeError, KeyError, IndexError, ZeroDivisionError, RuntimeError) as e:
        # A config's values reach the model's __init__ unchecked where its class does not check
        # them: a bad one fails there, in whatever way that layer fails.
        raise ConfigError(f"transformers cannot build {getattr(config, 'model_type', 'a model')} from this config: "
                          f"{reason(e)}") from e
    _tie(model)
    return model


def weights_source(ckpt: Checkpoint, config: Any, dtype: Any) -> Mapping[str, Any]:
    """``ckpt``, or where its config says it is saved quantized one scale per row, its tensors
    with each weight and its scale as one source that reads as ``dtype`` (NOTE [checkpoints
    already quantized] in inference/prequant.py); another quantization scheme raises
    :class:`CheckpointError`."""
    fmt = scheme_of(config, ckpt.path)
    return ckpt if fmt is None else QuantizedCheckpoint(ckpt, fmt, _dtypes.canonical(dtype))


def checkpoint_weights(ckpt: Checkpoint, model: Any, cast: str | None = None,
                       defaulted: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The checkpoint's tensors under ``model``'s names (:func:`model_weights`), floating ones of
    another dtype converted to ``cast`` as they are read, checked against ``model`` built on the
    meta device (inference/weights.py): a checkpoint that is not the model's raises
    :class:`CheckpointError` before anything is allocated, naming the size fields its config left
    to transformers' defaults (``defaulted``), the likely cause. Reads no tensor's bytes;
    load_pretrained and the plan command share it."""
    weights: dict[str, Any] = model_weights(ckpt, model)
    if cast is not None:
        weights = {k: (_Cast(v, cast) if v.dtype != cast and v.dtype.startswith(("float", "bfloat")) else v)
                   for k, v in weights.items()}
    try:
        check_weights(model, weights)
    except CheckpointError as e:
        path = e.path or ckpt.path
        note = (f"; {os.path.join(ckpt.path, 'config.json')} does not set {', '.join(defaulted)}, so transformers' "
                "defaults were used" if defaulted else "")
        raise CheckpointError(f"{path}: {e}{note}", path) from None
    return weights


def load_pretrained(path: str | os.PathLike, budget: int | str | None = None, host_budget: int | str | None = None,
                    dtype: Any = None, *, tier: Any = None, model_class: Any = None,
                    make_tier: Any = None, options: Any = None, **kwargs: Any) -> Loaded:
    """A transformers causal LM from a local checkpoint folder (``config.json`` plus safetensors, as
    ``save_pretrained`` writes them), ready to run within ``budget`` bytes of device memory
    (bytes, "8GB", or a share of the device like "25%": NOTE [sizes]); returns ``(model, handle)``.

    The model is built on the meta device and each tensor is read from the files straight into
    its tiermem home (NOTE [reading a checkpoint], NOTE [weight source]): resident groups into
    device memory, streamed groups into pinned host memory, and with ``host_budget`` (bytes) the
    groups the pinned home cannot hold stay in the files and are read from disk ahead of use
    (NOTE [disk tier]). No full host copy of the model is made. ``dtype`` (a torch dtype or its
    name) converts floating tensors as they are read; by default the model takes the dtype of
    its config (else of the checkpoint) and a tensor of another dtype is refused. A bad
    checkpoint raises :class:`CheckpointError` (a ValueError) with nothing left allocated.
    ``model_class`` (default ``transformers.AutoModelForCausalLM``) builds the model from its
    config; ``options`` and other keyword arguments are :func:`tiermem.wrap_module`'s
    (:class:`tiermem.handles.ModuleOptions`: ``mode``, ``lookahead``, ``disk_reader``...), but
    for ``weights``, which the checkpoint gives, and ``host_budget``, an argument here, which
    where given replaces the options'; ``tier`` defaults to the default Tier.
    """
    if "weights" in kwargs or getattr(options, "weights", None) is not None:
        raise ConfigTypeError("load_pretrained reads the weights from the checkpoint: it takes no weights option")
    try:
        import transformers
    except ImportError as e:
        raise TierMemError("load_pretrained needs transformers; pip install transformers") from e
    check_dtype(dtype)
    path = os.fspath(path)
    ckpt = Checkpoint(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is a file: load_pretrained takes a folder with config.json as save_pretrained "
                              "writes it", path)
    config, _, unset = read_config(path)
    if model_class is None:
        check_causal(config, os.path.join(path, "config.json"))
    want = weights_dtype(dtype, config, ckpt, fallback="float32")
    source = weights_source(ckpt, config, want)
    model = build_model(config, want, model_class)
    model.eval()
    weights = checkpoint_weights(source, model, _dtypes.canonical(want) if dtype is not None else None, unset)
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        model.generation_config = transformers.GenerationConfig.from_pretrained(path, local_files_only=True)
    if tier is None:
        if make_tier is None:
            raise ConfigError("load_pretrained needs a tier (tiermem.load_pretrained uses the default one)")
        tier = make_tier()
    try:
        if host_budget is not None:      # given here, it replaces the options'
            kwargs["host_budget"] = host_budget
        handle = tier.wrap_module(model, budget, options=options, weights=weights, **kwargs)
    except CheckpointError as e:
        e.path = e.path or path
        raise
    return Loaded(model, handle)
