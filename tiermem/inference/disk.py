"""The disk tier: streamed groups that the pinned home cannot hold are read from their checkpoint
files ahead of use, through a few pinned staging buffers, on a reader thread.

NOTE [disk tier]
    With ``host_budget``, a module whose streamed bytes do not fit in that much pinned memory keeps
    only part of them in its pinned home; the other groups stay where they already are, in the
    safetensors files (their byte ranges are in the headers, NOTE [reading a checkpoint]), so
    nothing is written and no cache file is needed. A reader thread reads those groups in the
    order a forward uses them (learned on the first forward, like the slots' order) into
    ``stages`` pinned staging buffers, each the size of the largest such group or part of one (a
    group bigger than a slot is read a part at a time, NOTE [split groups] in
    inference/split.py, so a staging buffer is never bigger than a slot), and keeps reading
    as long as a buffer is free, across forwards: while the GPU runs one layer and the link copies
    the next groups into their slots, the drive is already reading the groups after them. A
    staging buffer goes back to the reader once its copy into a slot is done (an event the reader
    waits on). Pinned memory is the home plus the staging buffers, never more than host_budget.

    Reads are plain POSIX reads (``os.preadv``, several threads, NOTE [reading a checkpoint]), or
    KvikIO's with ``disk_reader="kvikio"`` (NOTE [kvikio reader]), each chunk dropped from the
    page cache once read: a host whose memory is short (the reason to set host_budget) would not
    keep it, and a cache holding the model would make the next forward read memory, not the drive. A forward that uses groups in another order than the one learned
    (or before any is learned) gets each missing group read on demand: the reader drops what it
    read ahead and starts again from the group asked for. Such a group must be read whole before
    its layer runs; the slots' lookahead does the rest.

    A group on disk has no home: outside a forward its tensors point at slot 0 (a device tensor of
    the right shape, whose contents are whatever the slot last held), so ``model.device`` and the
    like still say the device; unwrap reads them from the files. A forward that records gradients
    reads weights in place from their home (NOTE [trainable weights in the pinned home]) and so
    cannot run with a disk tier; it is refused. Groups with buffers (a forward may write them) and
    groups whose tensors are not in the files byte for byte (a dtype converted as it was loaded)
    stay in the home.

NOTE [disk read errors]
    The reader reads ahead, across forwards, so a read can fail (a drive's EIO, a failed fence
    wait) while no forward needs that group, or after the forward that started it has returned.
    Raising it from whatever call comes next would fail an operation that did nothing wrong, and
    a read ahead is only a guess. So a failed read is kept with its group; the forward that needs
    the group has it read again, on demand, and raises only if that read fails too. A transient
    error costs one read; a lasting one reaches the forward that needs the data, as the read
    that would have served it. The reader runs on its own thread, where Python never delivers a
    Ctrl-C; an interrupt there (only a test injects one) is handled the same way.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any

from ..errors import ConfigError, TierMemError
from .load import FileTensor, Reader, host_bytes

__all__ = ["DiskTier", "STAGES", "READERS", "make_reader"]

STAGES = 3          # staging buffers: one being read, one being copied in, one ready
READERS = ("posix", "kvikio")    # disk_reader's choices; the first is the default (NOTE [kvikio reader])
READ_THREADS = 8


def make_reader(kind: str) -> Reader:
    """A disk tier's reader of ``kind`` (one of READERS), dropping what it reads from the page cache."""
    if kind == "posix":
        return Reader(threads=READ_THREADS, drop_cache=True)
    if kind == "kvikio":
        from .kvikio import KvikioReader
        return KvikioReader(threads=READ_THREADS, drop_cache=True)
    raise ConfigError(f"disk_reader must be one of {', '.join(map(repr, READERS))}, got {kind!r}")


class DiskTier:
    """Reads groups from files into ``stages`` pinned buffers of ``stage_bytes`` on a thread
    (NOTE [disk tier]). ``files[g]`` is [(FileTensor, from its byte, bytes, offset in the buffer)]
    for each ``g`` read (a streamed group, or a part of one: NOTE [split groups] in inference/split.py).
    The consumer calls :meth:`take` then :meth:`give_back` from one thread; the reader thread is
    this object's own."""

    def __init__(self, backend: Any, files: dict[Any, list[tuple[FileTensor, int]]], stage_bytes: int,
                 stages: int = STAGES, reader: Reader | str = READERS[0]):
        self.be = backend
        self.files = files
        self.stage_bytes = int(stage_bytes)
        self._own_reader = isinstance(reader, str)
        self.reader = make_reader(reader) if isinstance(reader, str) else reader
        self.stages: list[Any] = []
        self._cv = threading.Condition()
        self._free: collections.deque[int] = collections.deque()
        self._fence: list[Any] = []
        self._ready: collections.deque[tuple[Any, int]] = collections.deque()
        self._seq: list[Any] = []
        self._pos = 0
        self._want: Any = None
        self._busy: Any = None
        self._gen = 0
        self._stop = False
        self._failed: dict[int, BaseException] = {}     # id(group) -> why its last read failed
        self.stats = {"read_bytes": 0, "read_seconds": 0.0, "wait_seconds": 0.0, "reads": 0, "stage_reuse": 0,
                      "resyncs": 0, "dropped": 0, "retries": 0}
        self._thread: threading.Thread | None = None
        try:
            for _ in range(stages):
                self.stages.append(backend.host_alloc(self.stage_bytes, pooled=False))
                self._fence.append(None)
        except BaseException:
            self.close()
            raise
        self._free.extend(range(len(self.stages)))
        self._used = [False] * len(self.stages)
        self._thread = threading.Thread(target=self._run, name="tiermem-disk", daemon=True)
        self._thread.start()

    @property
    def pinned_bytes(self) -> int:
        return sum(s.nbytes for s in self.stages)

    # -- the consumer's side ------------------------------------------------------------------
    def set_sequence(self, seq: list[Any]) -> None:
        """The groups in the order forwards use them; the reader cycles through it."""
        with self._cv:
            if seq == self._seq:
                return
            self._seq = list(seq)
            self._pos = 0
            self._drop_ready()
            self._cv.notify_all()

    def take(self, g: Any, wait: bool = True) -> int | None:
        """The staging buffer (index) holding ``g``, read whole; without ``wait``, None unless it is
        the next one ready. The caller copies it out and then calls :meth:`give_back`.

        A read of ``g`` that failed (read ahead, maybe during an earlier forward) is made again
        once, on demand; if that fails too, its error is raised here (NOTE [disk read errors])."""
        t0 = time.perf_counter()
        retried = False
        with self._cv:
            while True:
                e = self._failed.pop(id(g), None)
                if e is not None:
                    if retried:
                        self._raise(e)
                    retried = True
                    self.stats["retries"] += 1
                    self._resync(g)
                    if not wait:
                        return None
                    continue
                if self._ready and self._ready[0][0] is g:
                    _, i = self._ready.popleft()
                    self._cv.notify_all()
                    self.stats["wait_seconds"] += time.perf_counter() - t0
                    return i
                if not wait:
                    return None
                if any(h is g for h, _ in self._ready):
                    while self._ready[0][0] is not g:       # groups this forward passed over
                        self._free.append(self._ready.popleft()[1])
                        self.stats["dropped"] += 1
                    continue
                if not self._coming(g):
                    self._resync(g)
                self._cv.wait()

    @staticmethod
    def _raise(e: BaseException) -> None:
        # An interrupt stays an interrupt and a tiermem error (a CUDAError) keeps its name;
        # anything else (a file's OSError) joins tiermem's hierarchy.
        if isinstance(e, TierMemError) or not isinstance(e, Exception):
            raise e
        raise TierMemError(f"the disk tier could not read a group: {e}") from e

    def give_back(self, i: int, fence: Any) -> None:
        """Staging buffer ``i`` is free once ``fence`` (the event after its copy out) is done."""
        with self._cv:
            self._fence[i] = fence
            self._free.append(i)
            self._cv.notify_all()

    def view(self, i: int) -> Any:
        return self.stages[i]

    def _coming(self, g: Any) -> bool:
        # Under the lock: g is being read now, or is the next read, with nothing ready before it.
        if self._busy is not None and self._busy[0] is g and self._busy[1] == self._gen:
            return True
        if self._ready:
            return False
        if self._want is not None:
            return self._want is g
        return bool(self._seq) and self._seq[self._pos % len(self._seq)] is g

    def _resync(self, g: Any) -> None:
        self._gen += 1
        self.stats["resyncs"] += 1
        self._drop_ready()
        if any(h is g for h in self._seq):
            self._pos = next(k for k, h in enumerate(self._seq) if h is g)
            self._want = None
        else:
            self._want = g
        self._cv.notify_all()

    def _drop_ready(self) -> None:
        while self._ready:
            self._free.append(self._ready.popleft()[1])
            self.stats["dropped"] += 1

    # -- the reader's side --------------------------------------------------------------------
    def _next(self) -> Any:
        if self._want is not None:
            g, self._want = self._want, None
            return g
        if self._seq:
            g = self._seq[self._pos % len(self._seq)]
            self._pos += 1
            return g
        return None

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and (not self._free or (self._want is None and not self._seq)):
                    self._cv.wait()
                if self._stop:
                    return
                i = self._free.popleft()
                g = self._next()
                gen = self._gen
                self._busy = (g, gen)
            try:
                if self._fence[i] is not None:
                    self.be.synchronize(self._fence[i])     # its last copy into a slot is done
                t0 = time.perf_counter()
                base = self.stages[i].ptr
                n = self.reader.read_parts([(ft, start, host_bytes(base + at, k)) for ft, start, k, at in self.files[g]])
                dt = time.perf_counter() - t0
            except BaseException as e:   # the consumer reads g again, or raises it (NOTE [disk read errors])
                with self._cv:
                    self._failed[id(g)] = e
                    self._busy = None
                    self._free.append(i)
                    self._cv.notify_all()
                continue
            with self._cv:
                self._busy = None
                self.stats["read_bytes"] += n
                self.stats["read_seconds"] += dt
                self.stats["reads"] += 1
                self.stats["stage_reuse"] += int(self._used[i])
                self._used[i] = True
                if gen == self._gen:
                    self._ready.append((g, i))
                else:
                    self._free.append(i)
                    self.stats["dropped"] += 1
                self._cv.notify_all()

    def close(self) -> None:
        """Stop the reader and give the staging buffers back. Idempotent; never raises."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        for s in self.stages:
            s.release()
        self.stages = []
        if self._own_reader:
            try:
                self.reader.close()
            except OSError:
                pass
