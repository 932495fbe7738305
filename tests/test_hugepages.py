"""Transparent huge pages for the memory a session maps while it loads (exporter.runtime.hugepages)."""

import ctypes
import mmap
import os
import platform
import re
import sys
from pathlib import Path

import pytest

from exporter.runtime import hugepages
from exporter.runtime.hugepages import (
    HUGE_PAGE,
    _unmapped_before,
    back_with_huge_pages,
    private_anonymous_regions,
    smaps_mappings,
)

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _collapse_unsupported() -> str | None:
    if not sys.platform.startswith("linux"):
        return "transparent huge pages are a Linux feature"
    if not THP_MODE.is_file() or "[never]" in THP_MODE.read_text():
        return "transparent huge pages are off in this kernel ([never] or absent)"
    version = tuple(int(part) for part in re.findall(r"\d+", platform.release())[:2])
    if version < (6, 1):
        return f"MADV_COLLAPSE needs Linux 6.1 or later, this is {platform.release()}"
    return None


def _huge_bytes_over(blocks) -> int:
    """AnonHugePages of every mapping that overlaps one of the blocks (start, end)."""
    return sum(
        sizes["AnonHugePages"] * 1024
        for start, end, _, sizes in smaps_mappings()
        if any(start < b_end and b_start < end for b_start, b_end in blocks)
    )


def _anonymous_block(pages: int) -> tuple[mmap.mmap, tuple[int, int]]:
    block = mmap.mmap(-1, pages * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    block[:] = bytes(range(256)) * (len(block) // 256)  # every page resident, with contents to check
    start = ctypes.addressof(ctypes.c_char.from_buffer(block))
    return block, (start, start + len(block))


@pytest.mark.skipif(_collapse_unsupported() is not None, reason=str(_collapse_unsupported()))
def test_only_memory_mapped_after_the_snapshot_is_collapsed_and_its_contents_stay():
    old, old_span = _anonymous_block(8)
    before = private_anonymous_regions()
    new, new_span = _anonymous_block(8)
    collapsed = back_with_huge_pages(before)
    # 8 huge pages of new memory hold 7 aligned ones (8 when the block happens to be aligned);
    # had the old block been collapsed too, there would be 14 or more.
    assert 7 * HUGE_PAGE <= collapsed <= 8 * HUGE_PAGE
    assert _huge_bytes_over([old_span, new_span]) == collapsed
    assert new[:] == bytes(range(256)) * (len(new) // 256)
    old.close()
    new.close()


def test_a_region_merged_with_older_memory_counts_only_its_new_part():
    before = {(100, 200): 100, (500, 600): 100}
    assert _unmapped_before(100, 400, before) == [(200, 400)]  # grew at its end
    assert _unmapped_before(0, 700, before) == [(0, 100), (200, 500), (600, 700)]
    assert _unmapped_before(120, 180, before) == []
    assert _unmapped_before(300, 400, before) == [(300, 400)]


def test_without_smaps_nothing_is_advised(monkeypatch):
    """Off Linux there is no /proc/self/smaps, hence no regions, and (Windows) no C library for CDLL(None)."""
    monkeypatch.setattr(hugepages, "private_anonymous_regions", dict)

    def no_c_library(*args, **kwargs):
        raise OSError("no C library to load")

    monkeypatch.setattr(ctypes, "CDLL", no_c_library)
    assert back_with_huge_pages({}) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_a_mapped_file_whose_path_is_not_utf8_is_read_past(tmp_path):
    # A folder name is bytes to Linux; an artifact folder so named was an internal error while loading.
    folder = Path(os.fsdecode(os.fsencode(tmp_path) + b"/bad\xffname"))
    folder.mkdir()
    (folder / "weights").write_bytes(b"\0" * mmap.PAGESIZE)
    with open(folder / "weights", "rb") as file, mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        assert mapped[0] == 0
        headers = [" ".join(header) for _, _, header, _ in smaps_mappings()]
    assert any(header.endswith("bad\ufffdname/weights") for header in headers)


@pytest.mark.skipif(_collapse_unsupported() is not None, reason=str(_collapse_unsupported()))
def test_only_the_whole_huge_pages_inside_a_region_are_advised():
    """A region that starts and ends off a 2 MiB boundary: the huge pages wholly inside it are collapsed and
    counted, nothing past either end. (Recent kernels place a large anonymous mapping on a 2 MiB boundary, so
    the test above always sees aligned regions; write-protecting a page at each end leaves an unaligned one.)"""
    before = private_anonymous_regions()
    block, (start, end) = _anonymous_block(10)
    mprotect = ctypes.CDLL(None, use_errno=True).mprotect
    mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for page in (start, end - mmap.PAGESIZE):  # each edge page becomes a read-only mapping of its own
        assert mprotect(page, mmap.PAGESIZE, mmap.PROT_READ) == 0
    span = (start + mmap.PAGESIZE, end - mmap.PAGESIZE)
    inside = (span[1] // HUGE_PAGE - -(-span[0] // HUGE_PAGE)) * HUGE_PAGE  # 8 huge pages when start is aligned
    collapsed = back_with_huge_pages(before)
    assert collapsed % HUGE_PAGE == 0 and collapsed >= inside >= 8 * HUGE_PAGE
    assert _huge_bytes_over([span]) == inside
    assert (
        block[mmap.PAGESIZE : len(block) - mmap.PAGESIZE]
        == (bytes(range(256)) * (len(block) // 256))[mmap.PAGESIZE : len(block) - mmap.PAGESIZE]
    )
    mprotect(start, len(block), mmap.PROT_READ | mmap.PROT_WRITE)
    block.close()


@pytest.mark.skipif(_collapse_unsupported() is not None, reason=str(_collapse_unsupported()))
def test_a_sparse_region_is_left_in_small_pages():
    """Collapsing fills a huge page's holes: a region mostly not resident would grow the RSS, so it is skipped."""
    before = private_anonymous_regions()
    block = mmap.mmap(-1, 8 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    block[: mmap.PAGESIZE] = b"\1" * mmap.PAGESIZE  # one resident page of 4096
    start = ctypes.addressof(ctypes.c_char.from_buffer(block))
    back_with_huge_pages(before)
    assert _huge_bytes_over([(start, start + len(block))]) == 0
    block.close()


@pytest.mark.parametrize("code, calls", [(12, 2), (22, 1)])  # ENOMEM: the next region is tried; EINVAL: none
def test_a_kernel_that_refuses_the_advice_leaves_the_memory_as_it_was(monkeypatch, code, calls):
    """Huge pages are an optimisation: a refusal is logged, never raised, and the runner loads as without."""
    monkeypatch.setattr(
        hugepages,
        "private_anonymous_regions",
        lambda: {(0, 4 * HUGE_PAGE): 4 * HUGE_PAGE, (8 * HUGE_PAGE, 12 * HUGE_PAGE): 4 * HUGE_PAGE},
    )
    advised = []

    def refuse(start, length, advice):
        advised.append((start, length, advice))
        ctypes.set_errno(code)
        return -1

    class Library:
        madvise = staticmethod(refuse)

    monkeypatch.setattr(ctypes, "CDLL", lambda *args, **kwargs: Library())
    assert back_with_huge_pages({}) == 0
    assert len(advised) == calls and advised[0] == (0, 4 * HUGE_PAGE, hugepages.MADV_HUGEPAGE)
