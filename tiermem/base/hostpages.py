"""Anonymous host memory made resident fast: mapped with huge pages where the kernel gives them,
and written by several threads at once, so that page-locking it afterwards (``_cuda.RegisteredHost``)
only has to pin pages that exist (NOTE [pinned by registration] in cuda/runtime.py). Plain OS calls
through libc; no CUDA here, so it runs, and is tested, on any Linux machine."""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["available", "available_bytes", "map_pages", "unmap_pages"]

MADV_HUGEPAGE = 14       # <asm-generic/mman-common.h>; Python's mmap module names it only for its own objects
MADV_DONTFORK = 10
HUGE = 2 << 20           # a transparent huge page on x86-64 and most arm64 kernels
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = None
_lock = threading.Lock()


def _lib():
    global _libc
    with _lock:
        if _libc is None:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            lib.mmap.restype = ctypes.c_void_p
            lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
            lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            lib.memset.restype = ctypes.c_void_p
            lib.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
            _libc = lib
    return _libc


def available() -> bool:
    """Whether this platform maps anonymous memory through libc (Linux)."""
    return os.name == "posix" and hasattr(mmap, "MAP_ANONYMOUS")


def available_bytes() -> int | None:
    """Host memory the kernel says a new allocation can get without swapping (``MemAvailable``
    in /proc/meminfo), in bytes; None where there is no such figure."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def map_pages(nbytes: int, threads: int = 8, touch: bool = True) -> int:
    """``nbytes`` of private anonymous memory, zeroed, asked for in huge pages and left out of a
    forked child (a DataLoader worker must not share pages the GPU reads). With ``touch`` it is
    made resident, written by ``threads`` threads (``memset`` through ctypes lets go of the GIL):
    faulting pages in is the cost, and it spreads over cores. Without, the pages fault in (as
    zeros) where the caller first writes them. Returns the address; raises MemoryError if the
    kernel refuses the mapping."""
    lib = _lib()
    n = int(nbytes)
    # Mapped 2 MiB larger and trimmed to a 2 MiB boundary: a huge page needs an aligned 2 MiB of
    # the mapping, and a kernel that does not align large mappings itself would leave the first
    # and last pieces of every block in 4 KiB pages.
    extra = HUGE if n >= HUGE else 0
    raw = lib.mmap(None, n + extra, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if raw is None or raw == _MAP_FAILED:
        raise MemoryError(f"mmap of {n:,} bytes of host memory failed: {os.strerror(ctypes.get_errno())}")
    ptr = -(-raw // HUGE) * HUGE if extra else raw
    if ptr > raw:
        lib.munmap(raw, ptr - raw)
    if extra - (ptr - raw):
        lib.munmap(ptr + -(-n // mmap.PAGESIZE) * mmap.PAGESIZE, extra - (ptr - raw))
    try:
        lib.madvise(ptr, n, MADV_HUGEPAGE)   # advice only: without huge pages it is slower, not wrong
        lib.madvise(ptr, n, MADV_DONTFORK)
        if not touch:
            return ptr
        k = max(1, min(int(threads), n >> 24))   # at least 16 MiB per thread
        step = -(-n // k)
        step = -(-step // mmap.PAGESIZE) * mmap.PAGESIZE
        parts = [(ptr + s, min(step, n - s)) for s in range(0, n, step)]
        if len(parts) == 1:
            lib.memset(ptr, 0, n)
        else:
            with ThreadPoolExecutor(len(parts), thread_name_prefix="tiermem-pages") as ex:
                list(ex.map(lambda p: lib.memset(p[0], 0, p[1]), parts))
    except BaseException:
        lib.munmap(ptr, n)
        raise
    return ptr


def unmap_pages(ptr: int, nbytes: int) -> None:
    """Give back memory from :func:`map_pages`."""
    if _lib().munmap(ptr, int(nbytes)) != 0:
        raise OSError(ctypes.get_errno(), f"munmap failed: {os.strerror(ctypes.get_errno())}")
