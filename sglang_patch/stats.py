"""Counters of the capture plugin, shared by the forward hook and the sender thread.

Written as JSON to a stats file about once a second while they change (`StatsFile`: in place, each snapshot
numbered at its start and its end so a reader can tell a torn read) that clients and tests read
(`read_stats_file`), and logged periodically. Drop reasons are open-ended strings so each path names its own.

A snapshot marked `"quiet": true` says its writer is idle and nothing changed for a second before it: the
writer sleeps until the next change (`CaptureStats.call_on_change`) and rewrites the file then, so the
snapshot stays current however old its `updated_at` is (an idle replica's sender does not wake at all).
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from capture_format.files import write_file_atomically


_TORN_READS_RETRIED = 100


def read_stats_file(path: Path, *, newer_than: float | None = None, timeout_s: float = 10.0) -> dict:
    """The counters a stats file holds ({} while there is none). With newer_than (a `time.time()`), waits up
    to timeout_s for a snapshot written after it, since the file is rewritten only about once a second, or for
    a quiet one (current until the next change: see the module docstring; a change just before newer_than may
    take its writer a wake-up, ~1 ms, to show). A read that met a rewrite in place (`StatsFile`) is read again;
    ValueError if the file never reads whole."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = _read_whole(path)
        if (newer_than is None or stats.get("updated_at", 0) > newer_than or stats.get("quiet")
                or time.monotonic() > deadline):
            return stats
        time.sleep(0.2)


def _read_whole(path: Path) -> dict:
    for _ in range(_TORN_READS_RETRIED):
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        try:
            stats = json.loads(text)
        except ValueError:  # a rewrite in place was under way (or a half-written file of an older plugin)
            stats = None
        if isinstance(stats, dict) and stats.get("snapshot") == stats.get("snapshot_end"):
            return stats
        time.sleep(0.01)
    raise ValueError(f"{path} did not read as one whole snapshot in {_TORN_READS_RETRIED} tries")


class StatsFile:
    """One stats file rewritten about once a second by one thread (the sender's), in place.

    Why not temp file + rename each time: on ext4 a rename over the old file makes the new file's blocks
    allocated at once, and the rewrite cost the sender ~0.2-0.5 ms of CPU a second here (in place: ~5 us),
    which a replica sampling 10% of its traffic paid in good part per captured token. The first write (and a
    write after the file was replaced or removed) still goes through a temp file and a rename.

    What must hold: a reader never takes a torn read for a snapshot: each snapshot carries its number first
    (`snapshot`) and last (`snapshot_end`), and `read_stats_file` reads again while they differ or the text
    does not parse; the file never shrinks (a shorter snapshot is padded with spaces, which JSON ignores),
    so a rewrite is one `pwrite` at offset 0 and no reader sees a truncated file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._inode: tuple[int, int] | None = None
        self._size = 0
        self._number = 0

    def write(self, snapshot: dict) -> None:
        self._number += 1
        data = json.dumps({"snapshot": self._number, **snapshot, "snapshot_end": self._number}, indent=1).encode()
        if self._fd is not None and self._same_file():
            os.pwrite(self._fd, data.ljust(self._size), 0)
            self._size = max(self._size, len(data))
            return
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomically(self.path, data, durable=False)
        fd = os.open(self.path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        status = os.fstat(fd)
        self._fd, self._inode, self._size = fd, (status.st_dev, status.st_ino), len(data)

    def _same_file(self) -> bool:
        """Whether path still names the file held open (not replaced, e.g. by `CaptureStats.write`, nor removed)."""
        try:
            status = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (status.st_dev, status.st_ino) == self._inode

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class CaptureStats:
    """Thread-safe counters; `snapshot()` is what the stats file holds.

    Every change is counted (`changes`), except a writer's own bookkeeping (`add(..., bookkeeping=True)`: the
    sender's CPU) and a gauge set to the value it has, so the sender can tell that nothing happened since it
    wrote the file and sleep until something does (`call_on_change`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._dropped: collections.Counter[str] = collections.Counter()
        self._texts: dict[str, str] = {}
        self._changes = 0
        self._on_change: Callable[[], None] | None = None
        """Called once, after the lock is released, at the next change (`call_on_change`)."""
        self.started_at = time.time()
        self._status = "starting"

    @property
    def status(self) -> str:
        """What this process is doing: `starting`, `capturing` or `dormant: <why>`."""
        return self._status

    @status.setter
    def status(self, value: str) -> None:
        with self._lock:
            self._status = value
            wake = self._changed()
        if wake is not None:
            wake()

    def _changed(self) -> Callable[[], None] | None:
        """Under the lock: counts a change; returns the waiting callback (taken), to call once the lock is released."""
        self._changes += 1
        wake, self._on_change = self._on_change, None
        return wake

    @property
    def changes(self) -> int:
        """Changes counted so far (see the class docstring)."""
        return self._changes

    def call_on_change(self, callback: Callable[[], None], since: int) -> bool:
        """Has callback called (once, on the changing thread, outside the lock) at the next change, unless the
        stats changed already since `since` (a count from `snapshot_and_changes`): then False, and nothing set.
        The callback must be cheap and must not wait: the forward hook's thread may be the one to call it."""
        with self._lock:
            if self._changes != since:
                return False
            self._on_change = callback
            return True

    def add(self, name: str, amount: int = 1, *, bookkeeping: bool = False) -> None:
        """Adds to a count; `bookkeeping`: the writer's own (its CPU), not a change (see the class docstring)."""
        with self._lock:
            self._counts[name] += amount
            wake = None if bookkeeping else self._changed()
        if wake is not None:
            wake()

    def add_hook_time(self, wall_ns: int, cpu_ns: int, calls: int = 1) -> None:
        """Hook calls' time on the scheduler's thread (`hook_ns`, `hook_cpu_ns`, `hook_calls`): after a forward,
        and after the scheduler processed a batch of a running generate capture; for `calls` calls, an estimate
        (`HookTimer`). One lock: it runs that often."""
        with self._lock:
            counts = self._counts
            counts["hook_ns"] += wall_ns
            counts["hook_cpu_ns"] += cpu_ns
            counts["hook_calls"] += calls
            wake = self._changed()
        if wake is not None:
            wake()

    def add_many(self, *counts: tuple[str, int]) -> None:
        """Several counts under one lock (name, amount); an amount of 0 adds no name."""
        wake = None
        with self._lock:
            for name, amount in counts:
                if amount:
                    self._counts[name] += amount
                    wake = self._changed() or wake
        if wake is not None:
            wake()

    def set(self, name: str, value: int) -> None:
        """A gauge: the current value, not a count (set to the value it has: no change)."""
        with self._lock:
            if name in self._counts and self._counts[name] == value:
                return
            self._counts[name] = value
            wake = self._changed()
        if wake is not None:
            wake()

    def set_text(self, name: str, value: str) -> None:
        """A text gauge (e.g. a digest), shown as it is."""
        with self._lock:
            if self._texts.get(name) == value:
                return
            self._texts[name] = value
            wake = self._changed()
        if wake is not None:
            wake()

    def drop(self, reason: str) -> None:
        with self._lock:
            self._dropped[reason] += 1
            wake = self._changed()
        if wake is not None:
            wake()

    def snapshot(self) -> dict:
        return self.snapshot_and_changes()[0]

    def snapshot_and_changes(self) -> tuple[dict, int]:
        """The snapshot, and the count of changes it holds (for `call_on_change`)."""
        with self._lock:
            return {
                "pid": os.getpid(),
                "status": self._status,
                "started_at": self.started_at,
                "updated_at": time.time(),
                **{name: self._counts[name] for name in sorted(self._counts)},
                **dict(sorted(self._texts.items())),
                "dropped": dict(sorted(self._dropped.items())),
            }, self._changes

    def summary(self) -> str:
        """One log line: what was captured, where it went, and what was dropped why."""
        snapshot = self.snapshot()
        counts = " ".join(f"{name}={snapshot.get(name, 0)}" for name in (
            "captured", "captured_tokens", "sent", "duplicates", "spooled", "resent_from_spool", "spool_frames",
            "bytes_raw", "bytes_stored"))
        return f"eagle-tap capture [{snapshot['status']}]: {counts} dropped={snapshot['dropped']}"

    def write(self, path: Path) -> None:
        """Replace `path` with the current snapshot (temp file + rename, so readers never see half): a file written
        now and then; the sender rewrites its own in place (`StatsFile`)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomically(path, json.dumps(self.snapshot(), indent=1, sort_keys=True), durable=False)


class HookTimer:
    """The time of one hook of the scheduler's thread that runs every step (a decode or verify forward, the
    scheduler's processing of such a batch), measured on about one call in `every` and counted for all:

        started = timer.start()  # None on the calls not measured
        ...the hook's work...
        if started is not None:
            timer.stop(started)

    Measuring a call costs two reads of the thread's CPU clock (a system call, not the vDSO: 0.7 us warm and
    3.8 cold here, where the hook always runs cold, right after a forward), two of the wall clock and the
    stats lock: about 10 us of a verify step's ~30 us hook call on this machine's scheduler thread, paid for
    measuring alone. A call is measured when a congruential sequence modulo a prime says so (no pattern of the
    steps lines up with it); `hook_calls` counts every call (at the next measured one), `hook_ns` and
    `hook_cpu_ns` add a measured call's time `every` times: an unbiased estimate of all the calls' time."""

    __slots__ = ("_stats", "_every", "_state", "_untimed")

    def __init__(self, stats: CaptureStats, every: int = 8, seed: int = 1) -> None:
        self._stats = stats
        self._every = every
        self._state = seed
        self._untimed = 0
        """Calls since the last measured one, not yet in `hook_calls`."""

    def start(self) -> tuple[int, int] | None:
        """(wall, thread CPU) clocks now if this call is measured, else None (and the call is counted)."""
        # x -> (75 x + 74) mod 65,537 (a prime): it runs through 65,536 residues; literals, as it runs cold
        self._state = state = (self._state * 75 + 74) % 65_537
        if state % self._every:
            self._untimed += 1
            return None
        return time.perf_counter_ns(), time.thread_time_ns()

    def stop(self, started: tuple[int, int]) -> None:
        """After a measured call: its time, standing for `every` calls, and the calls counted since the last."""
        cpu_ns, wall_ns = time.thread_time_ns() - started[1], time.perf_counter_ns() - started[0]
        calls, self._untimed = self._untimed + 1, 0
        self._stats.add_hook_time(wall_ns * self._every, cpu_ns * self._every, calls)
