"""Anonymous host pages made resident on several threads (tiermem/base/hostpages.py), the memory a
large pinned block is registered from (NOTE [pinned by registration]). OS calls only: no GPU."""
from __future__ import annotations

import ctypes
import os

import pytest

from tiermem.base import hostpages as _hostpages

pytestmark = pytest.mark.skipif(not _hostpages.available(), reason="needs anonymous mappings (Linux)")

MiB = 1 << 20


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    pytest.skip("no RssAnon in /proc/self/status")


@pytest.mark.parametrize("nbytes,threads", [(4096, 8), (3 * MiB + 123, 1), (64 * MiB + 4096, 8), (48 * MiB, 3)])
def test_pages_are_zeroed_resident_writable_and_given_back(nbytes, threads):
    before = _rss_kb()
    ptr = _hostpages.map_pages(nbytes, threads)
    try:
        assert ptr % (2 * MiB if nbytes >= 2 * MiB else 4096) == 0     # huge pages need 2 MiB alignment
        if nbytes >= 32 * MiB:
            assert _rss_kb() - before >= 0.9 * nbytes / 1024     # written, so resident already
        view = (ctypes.c_ubyte * nbytes).from_address(ptr)
        assert bytes(view[:4096]) == bytes(4096) and bytes(view[nbytes - 4096:]) == bytes(4096)
        pattern = os.urandom(4096)
        ctypes.memmove(ptr + nbytes - 4096, pattern, 4096)
        assert bytes(view[nbytes - 4096:]) == pattern
    finally:
        _hostpages.unmap_pages(ptr, nbytes)
    if nbytes >= 32 * MiB:
        assert _rss_kb() - before < 0.1 * nbytes / 1024


def test_untouched_pages_fault_in_as_zeros_where_first_written():
    """touch=False (NOTE [filled before pinning]): nothing is resident until written, and what
    is read before any write is zero."""
    n = 64 * MiB
    before = _rss_kb()
    ptr = _hostpages.map_pages(n, 8, touch=False)
    try:
        assert _rss_kb() - before < 0.1 * n / 1024
        pattern = os.urandom(4096)
        ctypes.memmove(ptr + n // 2, pattern, 4096)
        view = (ctypes.c_ubyte * n).from_address(ptr)
        assert bytes(view[n // 2:n // 2 + 4096]) == pattern and bytes(view[:4096]) == bytes(4096)
    finally:
        _hostpages.unmap_pages(ptr, n)


def test_an_aligned_block_leaves_no_mapping_around_it():
    """The 2 MiB mapped beyond an aligned block are given back: nothing of ours is left mapped
    around it, whatever the kernel's alignment."""
    def mapped() -> int:
        with open("/proc/self/maps") as f:
            return sum(int(b, 16) - int(a, 16) for a, b in (line.split()[0].split("-") for line in f))
    n = 6 * MiB + 4096
    before = mapped()
    ptrs = [_hostpages.map_pages(n, 2, touch=False) for _ in range(8)]
    try:
        assert all(p % (2 * MiB) == 0 for p in ptrs)
        assert mapped() - before <= 8 * (n + 4096) + 8 * MiB     # each block, not each block plus 2 MiB
    finally:
        for p in ptrs:
            _hostpages.unmap_pages(p, n)
    assert mapped() - before <= 8 * MiB


def test_a_mapping_the_kernel_refuses_is_a_memory_error():
    with pytest.raises(MemoryError, match="mmap of"):
        _hostpages.map_pages(1 << 62)


def test_unmapping_a_bad_address_raises():
    with pytest.raises(OSError):
        _hostpages.unmap_pages(4097, 4096)     # not page-aligned: EINVAL
