"""The disk tier's reads through KvikIO: ``load_pretrained(..., disk_reader="kvikio")``.

NOTE [kvikio reader]
    KvikIO (RAPIDS) reads files into host or device memory on its own C++ thread pool, through
    cuFile (GPUDirect Storage) where the system allows it, else through POSIX reads of its own
    ("compatibility mode"). The disk tier reads into pinned staging buffers, which are host
    memory: kvikio serves those with its POSIX path whatever the mode, so what it may add over
    :class:`tiermem.inference.load.Reader` is its thread pool and O_DIRECT reads of the aligned parts of a
    range (``auto_direct_io_read``), which skip the page cache. Both readers were measured side
    by side on the same files (bench/offload_disk.py, ``read.kvikio_*``, and a prefill with each
    reader); the default stays the one that was faster there (docs/inference.md, "Reading from
    disk"). The kvikio reader keeps the POSIX reader's contract: each range is read whole (a short
    read is a truncated file), and each range read is dropped from the page cache (its unaligned
    edges go through the cache even with O_DIRECT), so a host short of memory keeps no second
    copy of what streams. kvikio's thread count and direct-I/O setting are process-wide: a
    reader raises them for its life, never lowers them (another kvikio user in the process keeps
    at least what it set), and ``close()`` puts back each one it changed unless someone changed
    it again since (tests/test_gpu_load.py).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any

from ..errors import CheckpointError, ConfigError
from .load import CHUNK, Reader

__all__ = ["KvikioReader", "available", "require"]


def require() -> Any:
    """The kvikio module, or a ConfigError saying how to get it."""
    try:
        import kvikio
        import kvikio.defaults  # a submodule kvikio's __init__ does not import
    except ImportError as e:        # also a wheel whose native library fails to load
        raise ConfigError("disk_reader='kvikio' needs KvikIO: pip install kvikio-cu13 (or kvikio-cu12 for "
                          f"CUDA 12); it could not be imported ({e})") from e
    return kvikio


def available() -> bool:
    """Whether KvikIO can be imported here."""
    try:
        require()
    except ConfigError:
        return False
    return True


class KvikioReader(Reader):
    """:class:`tiermem.inference.load.Reader`'s ``read`` and ``read_range`` with the bytes read by KvikIO
    (NOTE [kvikio reader]): every range is one ``CuFile.pread``, split by kvikio into ``chunk``
    byte tasks over its pool of ``threads``, all ranges of a call in flight at once."""

    def __init__(self, threads: int = 8, chunk: int = CHUNK, drop_cache: bool = False, direct: bool = True):
        self._kv = require()
        super().__init__(threads=threads, chunk=chunk, drop_cache=drop_cache)
        d = self._kv.defaults
        self._changed: list[tuple[str, Any, Any]] = []     # (setting, before, ours), for close()
        if d.get("num_threads") < self.threads:
            self._set("num_threads", self.threads)
        if direct and not d.get("auto_direct_io_read"):
            self._set("auto_direct_io_read", True)
        self.direct = bool(d.get("auto_direct_io_read"))
        self.compat_mode = bool(d.is_compat_mode_preferred())
        self._files: dict[str, Any] = {}
        self._klock = threading.Lock()

    def _set(self, key: str, value: Any) -> None:
        d = self._kv.defaults
        self._changed.append((key, d.get(key), value))
        d.set(key, value)

    def _file(self, path: str) -> Any:
        with self._klock:
            f = self._files.get(path)
            if f is None:
                try:
                    f = self._files[path] = self._kv.CuFile(path, "r")
                except RuntimeError as e:
                    if not os.path.exists(path):
                        raise CheckpointError(f"{path} does not exist", path) from None
                    raise CheckpointError(f"kvikio could not open {path}: {e}", path) from e
            return f

    def read_ranges(self, ranges: list[tuple[str, int, memoryview]]) -> int:
        t0 = time.perf_counter()
        futures, error = [], None
        for path, offset, mv in ranges:
            if not len(mv):
                continue
            try:
                futures.append((path, offset, mv, self._file(path).pread(mv, len(mv), offset, task_size=self.chunk)))
            except (CheckpointError, RuntimeError) as e:    # reads already queued finish before it leaves
                error = e if isinstance(e, CheckpointError) else CheckpointError(
                    f"kvikio could not read {path} from byte {offset:,}: {e}", path)
                break
        for path, offset, mv, fut in futures:        # every read is waited for before any error leaves
            try:
                got = fut.get()
            except RuntimeError as e:       # kvikio reports a read past the end as a POSIX "EOF" error
                size = os.path.getsize(path)
                got = -1 if offset + len(mv) <= size else max(0, size - offset)
                if got < 0:
                    error = error or CheckpointError(f"kvikio failed reading {len(mv):,} bytes of {path} from "
                                                     f"byte {offset:,}: {e}", path)
                    continue
            if got != len(mv):
                error = error or CheckpointError(f"{path} ends before the {len(mv):,} bytes asked from byte "
                                                 f"{offset:,} (kvikio read {got:,}): the file is truncated", path)
            elif self.drop_cache and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.fd(path), offset, len(mv), os.POSIX_FADV_DONTNEED)
        if error is not None:
            raise error
        total = sum(len(mv) for _, _, mv in ranges)
        self.account(total, time.perf_counter() - t0)
        return total

    def close(self) -> None:
        with self._klock:
            files, self._files = self._files, {}
        for f in files.values():
            f.close()
        d = self._kv.defaults
        changed, self._changed = self._changed, []
        for key, before, ours in reversed(changed):
            if d.get(key) == ours:
                d.set(key, before)
        super().close()
