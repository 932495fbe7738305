"""Transparent huge pages for the memory onnxruntime allocates while a session loads (Linux).

A decode step reads every weight once: for minimind-3 fp32, 255 MB of
prepacked weights, about 62,000 pages of 4 KiB, each a TLB miss and a page
walk whose tables the stream itself keeps evicting from the caches. In 2 MiB
pages the same weights span 128 pages. onnxruntime has no option for huge
pages, and with the kernel's usual setting (`madvise`) a process gets them
only where it asks. numpy asks for its large arrays, so the bandwidth probe of
the benchmark already reads huge pages; the session's weights did not.

`back_with_huge_pages` asks after the fact: it advises the anonymous memory
that appeared since a snapshot and collapses it into huge pages at once
(`MADV_COLLAPSE`, Linux 6.1 and later). The contents do not change. Only
regions that are nearly all resident are taken, so the RSS does not grow by
more than the holes they had (below 10%).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
RESIDENT_SHARE = 0.9  # a region sparser than this would grow when collapsed
SMAPS = Path("/proc/self/smaps")

Regions = dict[tuple[int, int], int]  # (start, end) address -> resident bytes


def smaps_mappings():
    """(start, end, fields of the header line, {field: kB}) for each mapping of /proc/self/smaps."""
    mapping = None
    # Mapped file paths are bytes, not necessarily UTF-8 (a folder named so): undecodable ones are replaced.
    for line in SMAPS.read_text(errors="replace").split("\n"):  # only newlines end a line, not \x1c in a path
        fields = line.split()
        if not fields:
            continue
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header: "start-end perms ... [path]"
            if mapping is not None:
                yield mapping
            start, end = (int(part, 16) for part in fields[0].split("-"))
            mapping = (start, end, fields, {})
        elif mapping is not None and fields[0].endswith(":") and fields[1:2] and fields[1].isdigit():
            mapping[3][fields[0][:-1]] = int(fields[1])
    if mapping is not None:
        yield mapping


def private_anonymous_regions() -> Regions:
    """This process's private, writable mappings backed by no file; empty where /proc is missing."""
    if not sys.platform.startswith("linux") or not SMAPS.is_file():
        return {}
    # No path (not a file, nor [heap] or [stack]) and private, writable.
    return {
        (start, end): sizes["Rss"] * 1024
        for start, end, header, sizes in smaps_mappings()
        if len(header) < 6 and header[1] == "rw-p"
    }


def _unmapped_before(start: int, end: int, before: Regions) -> list[tuple[int, int]]:
    """The parts of [start, end) outside every region of `before`: the kernel merges a new mapping into an
    adjacent old one, so a region that is new as a whole may hold memory that was there already."""
    parts = [(start, end)]
    for old_start, old_end in before:
        if old_start < end and start < old_end:
            parts = [
                piece
                for lo, hi in parts
                for piece in ((lo, min(hi, old_start)), (max(lo, old_end), hi))
                if piece[0] < piece[1]
            ]
    return parts


def back_with_huge_pages(before: Regions) -> int:
    """Collapse the dense anonymous memory mapped since `before` into huge pages; the bytes collapsed.

    Returns 0 where the kernel cannot (no transparent huge pages, or older than 6.1),
    leaving the memory as it was.
    """
    spans = [
        (lo, hi)
        for (start, end), resident in private_anonymous_regions().items()
        if resident >= RESIDENT_SHARE * (end - start)
        for lo, hi in _unmapped_before(start, end, before)
    ]
    if not spans:  # also where there is no /proc/self/smaps, nor (Windows) a C library to load by CDLL(None)
        return 0
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    collapsed = 0
    for start, end in spans:
        first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
        if last <= first:
            continue
        if madvise(first, last - first, MADV_HUGEPAGE) or madvise(first, last - first, MADV_COLLAPSE):
            code = ctypes.get_errno()
            log.debug("no huge pages for %#x-%#x: %s", first, last, errno.errorcode.get(code, code))
            if code == errno.EINVAL:  # no transparent huge pages, or no MADV_COLLAPSE: same for every region
                return collapsed
            continue
        collapsed += last - first
    return collapsed
