"""The single writer: one thread owns the open shard, appends frames, group-commits, seals.

What must hold:
- frames are appended in submission order; a job is reported done only after the fdatasync that
  covers it returned (durability "fsync") or after its write returned ("none");
- one fdatasync covers every frame appended since the last one: jobs queued while a sync runs
  form the next group (bounded by max_group_commit_bytes), so concurrent requests share a sync;
- a shard is sealed (sync, index, rename) once it reaches seal_after_bytes, or seal_after_s after
  its first frame, also when no traffic comes; it is created lazily, so no empty shard is left;
- a failed write of one frame fails that job only (ShardWriter cuts it back). A failed sync
  leaves the durability of everything since the previous sync unknown: those jobs fail and the
  writer stops accepting work (`failed_reason`), since acknowledging anything after it would lie;
- a shard whose seal failed after its data was synced is left open for start-up recovery;
- every submitted job is reported exactly once, also when the thread meets a bug or is stopped.
The thread never touches asyncio: it hands results to `deliver`, which must be thread-safe.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capture_format import FrameInfo, ShardError, ShardWriter
from collector_service.settings import DurabilityMode

__all__ = ["CommitObserver", "ShardEvent", "WriteJob", "WriteResult", "WriterThread", "is_out_of_space"]

log = logging.getLogger(__name__)

CommitObserver = Callable[[int, float], None]
"""Called by the writer thread after each group commit with (records committed, seconds the sync took)."""


@dataclass(frozen=True, slots=True)
class WriteJob:
    view: memoryview
    info: FrameInfo
    token: Any
    """Opaque to the writer: handed back in the result (the store's future and buffer)."""


@dataclass(frozen=True, slots=True)
class WriteResult:
    job: WriteJob
    shard_number: int = -1
    offset: int = -1
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class ShardEvent:
    """A change of shard state: "open" (first frame written), "sealed", or "abandoned" (left for recovery)."""

    shard_number: int
    state: str
    detail: str = ""


@dataclass(slots=True)
class _OpenShard:
    writer: ShardWriter
    unsynced: list[WriteResult] = field(default_factory=list)


_STOP = object()


def is_out_of_space(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)


class WriterThread:
    """Owns the open shard of data_dir; `submit` jobs from any thread, `stop` once."""

    def __init__(
        self,
        data_dir: Path,
        *,
        durability: DurabilityMode,
        seal_after_bytes: int,
        seal_after_s: float,
        max_group_commit_bytes: int,
        seal_on_shutdown: bool,
        deliver: Callable[[list[WriteResult], list[ShardEvent]], None],
        observe_commit: CommitObserver | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.durability = durability
        self.seal_after_bytes = seal_after_bytes
        self.seal_after_s = seal_after_s
        self.max_group_commit_bytes = max_group_commit_bytes
        self.seal_on_shutdown = seal_on_shutdown
        self._deliver = deliver
        self._observe_commit = observe_commit or (lambda num_records, seconds: None)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._open: _OpenShard | None = None
        self._events: list[ShardEvent] = []
        self.failed_reason: str | None = None
        """Set once a sync failed: nothing more is written (see the module docstring)."""
        self.last_write_error: str | None = None
        """Why the latest append (or opening a shard for it) failed; None once one succeeds. /healthz shows it."""
        self._thread = threading.Thread(target=self._run, name="collector-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: WriteJob) -> None:
        self._queue.put(job)

    def stop(self) -> None:
        """Asks the thread to finish queued jobs, seal (if seal_on_shutdown) and exit; join() waits."""
        self._queue.put(_STOP)

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        stopping = False
        while not stopping:
            try:
                first = self._queue.get(timeout=self._seconds_until_age_seal())
            except queue.Empty:
                self._seal_if_old()
                self._flush_events([])
                continue
            if first is _STOP:
                break
            batch, batch_nbytes = [first], first.view.nbytes
            while batch_nbytes < self.max_group_commit_bytes:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is _STOP:
                    stopping = True
                    break
                batch.append(job)
                batch_nbytes += job.view.nbytes
            try:
                results = self._write_group(batch)
            except Exception as err:  # a bug, not an I/O error: fail the batch, never leave a request hanging
                log.exception("writer failed on a group of %d frames", len(batch))
                self.failed_reason = f"the writer failed: {err!r}"
                results = [WriteResult(job=job, error=err) for job in batch]
                if self._open is not None:
                    self._open.unsynced.clear()  # reported failed just now: never report them again
            self._flush_events(results)
        self._shut_down()

    def _seconds_until_age_seal(self) -> float | None:
        if self._open is None:
            return None
        return max(0.0, self._open.writer.opened_at + self.seal_after_s - time.monotonic())

    def _write_group(self, batch: list[WriteJob]) -> list[WriteResult]:
        """Appends batch, syncs once, seals what is full or old; returns the finished jobs' results."""
        done: list[WriteResult] = []
        for job in batch:
            if self.failed_reason is not None:
                done.append(WriteResult(job=job, error=OSError(errno.EIO, self.failed_reason)))
                continue
            try:
                if self._open is None:
                    self._open = _OpenShard(ShardWriter(self.data_dir))
                    self._events.append(ShardEvent(self._open.writer.number, "open"))
                writer = self._open.writer
                offset = writer.append(job.view, job.info)
            except (OSError, ShardError) as err:
                self.last_write_error = f"writing to {self.data_dir} failed: {err}"
                done.append(WriteResult(job=job, error=err))
                continue
            self.last_write_error = None
            self._open.unsynced.append(WriteResult(job=job, shard_number=writer.number, offset=offset))
            if writer.bytes_written >= self.seal_after_bytes:
                done.extend(self._sync_and_seal())
        done.extend(self._sync())
        self._seal_if_old()
        return done

    def _sync(self) -> list[WriteResult]:
        """fdatasync the open shard (unless durability is "none"); returns the jobs it covered."""
        if self._open is None or not self._open.unsynced:
            return []
        synced, self._open.unsynced = self._open.unsynced, []
        started = time.perf_counter()
        try:
            self._open.writer.flush(durable=self.durability == "fsync")
        except (OSError, ShardError) as err:
            self.failed_reason = f"syncing {self._open.writer.path} failed: {err}"
            log.error("%s; refusing further writes until restart", self.failed_reason)
            self._abandon(self.failed_reason)
            return [WriteResult(job=result.job, error=err) for result in synced]
        self._observe_commit(len(synced), time.perf_counter() - started)
        return synced

    def _sync_and_seal(self) -> list[WriteResult]:
        synced = self._sync()
        if self._open is None:
            return synced
        writer = self._open.writer
        try:
            writer.seal()
        except (OSError, ShardError) as err:
            log.error("sealing %s failed: %s; it stays open for start-up recovery", writer.path, err)
            self._abandon(f"seal failed: {err}")
            return synced
        self._events.append(ShardEvent(writer.number, "sealed"))
        self._open = None
        return synced

    def _abandon(self, detail: str) -> None:
        assert self._open is not None
        self._open.writer.close()
        self._events.append(ShardEvent(self._open.writer.number, "abandoned", detail))
        self._open = None

    def _seal_if_old(self) -> None:
        seconds = self._seconds_until_age_seal()
        if seconds is not None and seconds <= 0 and not self._open.unsynced:
            self._sync_and_seal()

    def _flush_events(self, results: list[WriteResult]) -> None:
        if results or self._events:
            events, self._events = self._events, []
            self._deliver(results, events)

    def _shut_down(self) -> None:
        results: list[WriteResult] = []
        while True:  # jobs that raced with stop are refused, never silently dropped
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not _STOP:
                results.append(WriteResult(job=job, error=OSError(errno.ESHUTDOWN, "the collector is stopping")))
        if self._open is not None:
            if self.seal_on_shutdown:
                results.extend(self._sync_and_seal())
            else:
                results.extend(self._sync())
                if self._open is not None:
                    self._open.writer.close()
                    self._open = None
        self._flush_events(results)
