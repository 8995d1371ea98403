"""Counters of the capture plugin, shared by the forward hook and the sender thread.

Written as JSON to a stats file (atomically, about once a second) that clients and tests read, and
logged periodically. Drop reasons are open-ended strings so each path names its own.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from pathlib import Path

from capture_format.files import write_file_atomically


def read_stats_file(path: Path, *, newer_than: float | None = None, timeout_s: float = 10.0) -> dict:
    """The counters a stats file holds ({} while there is none). With newer_than (a `time.time()`), waits up
    to timeout_s for a snapshot written after it, since the file is rewritten only about once a second."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        if newer_than is None or stats.get("updated_at", 0) > newer_than or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


class CaptureStats:
    """Thread-safe counters; `snapshot()` is what the stats file holds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._dropped: collections.Counter[str] = collections.Counter()
        self._texts: dict[str, str] = {}
        self.started_at = time.time()
        self.status = "starting"
        """What this process is doing: `starting`, `capturing` or `dormant: <why>`."""

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def add_hook_time(self, wall_ns: int, cpu_ns: int) -> None:
        """One hook call's time on the scheduler's thread (`hook_ns`, `hook_cpu_ns`, `hook_calls`): after a forward,
        and after the scheduler processed a batch of a running generate capture. One lock: it runs that often."""
        with self._lock:
            counts = self._counts
            counts["hook_ns"] += wall_ns
            counts["hook_cpu_ns"] += cpu_ns
            counts["hook_calls"] += 1

    def set(self, name: str, value: int) -> None:
        """A gauge: the current value, not a count."""
        with self._lock:
            self._counts[name] = value

    def set_text(self, name: str, value: str) -> None:
        """A text gauge (e.g. a digest), shown as it is."""
        with self._lock:
            self._texts[name] = value

    def drop(self, reason: str) -> None:
        with self._lock:
            self._dropped[reason] += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "pid": os.getpid(),
                "status": self.status,
                "started_at": self.started_at,
                "updated_at": time.time(),
                **{name: self._counts[name] for name in sorted(self._counts)},
                **dict(sorted(self._texts.items())),
                "dropped": dict(sorted(self._dropped.items())),
            }

    def summary(self) -> str:
        """One log line: what was captured, where it went, and what was dropped why."""
        snapshot = self.snapshot()
        counts = " ".join(f"{name}={snapshot.get(name, 0)}" for name in (
            "captured", "captured_tokens", "sent", "duplicates", "spooled", "resent_from_spool", "spool_frames",
            "bytes_raw", "bytes_stored"))
        return f"eagle-tap capture [{snapshot['status']}]: {counts} dropped={snapshot['dropped']}"

    def write(self, path: Path) -> None:
        """Replace `path` with the current snapshot (temp file + rename, so readers never see half)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomically(path, json.dumps(self.snapshot(), indent=1, sort_keys=True), durable=False)
