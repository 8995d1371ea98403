"""Process-wide glibc malloc tuning for the collector's serving process.

Why: every request passes multi-MB of body through buffers that the HTTP stack allocates per read
(event-loop read buffers, uvicorn's body buffer, the bytes handed to the app). With glibc's
defaults, allocations above the mmap threshold get fresh pages and freed heap tops are returned
to the kernel, so each one page-faults anew: that was ~40% of the serving process's CPU in
`perf` here, and receive ran at ~0.6-0.9 GB/s instead of ~3 GB/s. Raising both thresholds keeps
freed memory mapped and reused. Only the `collect` command calls this (it changes the process,
not the app); elsewhere (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import logging

__all__ = ["keep_freed_memory"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
"""Allocations below this come from the heap (glibc's maximum for this setting on 64-bit)."""


def keep_freed_memory(retained_bytes: int) -> bool:
    """Lets glibc keep up to retained_bytes of freed heap mapped; False where mallopt is unavailable."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, min(retained_bytes, 2**31 - 1))
    )
    if not applied:
        log.warning("glibc mallopt refused the thresholds; receive throughput may be lower")
    return applied
