"""The record store as the event loop sees it: dedupe, submission to the writer, stats.

What must hold:
- an id is acknowledged "stored" once, after the writer reported its frame durable; any later
  POST of it, in this process or after a restart (the catalog rebuilds the ids), is "duplicate";
- concurrent POSTs of one new id write it once: the first claims the id, the others wait for it
  and then answer "duplicate" (or try again if the first write failed);
- every buffer handed to the writer goes back to the pool only after the writer is done with it;
- all state here is touched from the event loop thread only; the writer thread reports through
  loop.call_soon_threadsafe. Disk I/O never runs on the loop;
- with upload_to, each shard the writer seals is handed to the uploader thread (collector_service/
  uploader.py) and nothing waits for its upload.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from capture_format import CaptureFormatError, inspect_frame
from capture_format.object_store import parse_location
from capture_format.parts import ClosingParts, PartOf, capture_part_of, closing_parts_of
from collector_service.buffers import BufferPool
from collector_service.catalog import Catalog, RecordLocation, open_catalog, shard_name
from collector_service.errors import ApiError
from collector_service.parts import CaptureParts, StagedPart
from collector_service.receive import ReceivedFrame
from collector_service.settings import CollectorSettings
from collector_service.uploader import Uploader, finish_uploaded, resolve_collector_id
from collector_service.writer import (
    CommitObserver,
    ShardEvent,
    WriteJob,
    WriteResult,
    WriterThread,
    is_out_of_space,
)

__all__ = ["RecordStore", "SubmitOutcome"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SubmitOutcome:
    status: str
    """"stored" (new, durable now) or "duplicate" (already stored; nothing written)."""
    record_id: str
    location: RecordLocation | None
    """Where it is stored; None for a part of a capture sent in parts (kept apart until its record comes)."""
    same_frame: bool
    """For a duplicate: whether its header checksum equals the stored frame's."""


class RecordStore:
    """Owns the catalog of stored ids, the writer thread and the receive buffers of one app."""

    def __init__(
        self, settings: CollectorSettings, catalog: Catalog, observe_commit: CommitObserver | None = None,
        uploader: Uploader | None = None,
    ) -> None:
        self.settings = settings
        self._uploader = uploader
        self.buffer_pool = BufferPool(settings.buffer_pool_bytes, settings.max_inflight_bytes)
        self.decode_slots = asyncio.Semaphore(settings.max_concurrent_decodes)
        """Frames being decoded at once (ingest decodes each once): bounds the CPU and memory it takes."""
        self._locations = catalog.locations
        self.totals = catalog.totals
        self.recoveries = catalog.recoveries
        self.quarantined = catalog.quarantined
        self.num_duplicates_on_disk = catalog.num_duplicates_on_disk
        self._in_flight: dict[str, asyncio.Future[RecordLocation]] = {}
        self._shard_states: dict[int, str] = {}
        """State of shards written by this process: "open", "sealed", "abandoned"."""
        self.num_ingested = 0
        self.num_ingested_nbytes = 0
        self.num_duplicates = 0
        self.num_group_commits = 0
        self.rejects: Counter[str] = Counter()
        self.started_at = time.monotonic()
        self.parts = CaptureParts(settings.data_dir, settings.part_timeout_s)
        self._sweeper: asyncio.Task | None = None
        self._accepting = True
        self._loop = asyncio.get_running_loop()
        self._writer = WriterThread(
            settings.data_dir,
            durability=settings.durability,
            seal_after_bytes=settings.seal_after_bytes,
            seal_after_s=settings.seal_after_s,
            max_group_commit_bytes=settings.max_group_commit_bytes,
            seal_on_shutdown=settings.seal_on_shutdown,
            deliver=self._deliver_from_thread,
            observe_commit=observe_commit,
        )

    @classmethod
    async def open(cls, settings: CollectorSettings, observe_commit: CommitObserver | None = None) -> RecordStore:
        """Recovers and indexes data_dir (in a thread), then starts the writer (and the uploader, if set)."""
        uploader = None
        if settings.upload_to is not None:
            collector_id = resolve_collector_id(settings.data_dir, settings.collector_id)
            await asyncio.to_thread(finish_uploaded, settings.data_dir, settings.keep_local)
        catalog = await asyncio.to_thread(open_catalog, settings.data_dir)
        if settings.upload_to is not None:
            uploader = Uploader(settings.data_dir, parse_location(settings.upload_to), collector_id,
                                keep_local=settings.keep_local, retry_initial_s=settings.upload_retry_initial_s,
                                retry_max_s=settings.upload_retry_max_s)
        store = cls(settings, catalog, observe_commit, uploader)
        store._writer.start()
        store._sweeper = asyncio.create_task(store._sweep_parts())
        if uploader is not None:
            uploader.start()
        return store

    async def close(self) -> None:
        """Stops accepting, lets the writer finish what it has, seals (if set) and joins it; then gives the
        uploader upload_drain_s to upload what is sealed."""
        self._accepting = False
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._writer.stop()
        await asyncio.to_thread(self._writer.join)
        # The writer's last report was scheduled on the loop before join returned: let it run.
        await asyncio.sleep(0)
        if self._uploader is not None:
            self._uploader.stop(self.settings.upload_drain_s)
            # An upload still running after the drain time is cut off with the process; the next start redoes it.
            await asyncio.to_thread(self._uploader.join, self.settings.upload_drain_s + 5.0)

    @property
    def failed_reason(self) -> str | None:
        if self._writer.failed_reason is not None:
            return self._writer.failed_reason
        if self._accepting and not self._writer.is_alive():
            return "the writer thread is not running"
        return None

    @property
    def storage_error(self) -> str | None:
        """Why the latest write failed (the disk is full, read-only, gone); None once one succeeds."""
        return self._writer.last_write_error

    def lookup(self, record_id: str) -> RecordLocation | None:
        return self._locations.get(record_id)

    def shard_name_of(self, location: RecordLocation) -> str:
        """File name of the shard holding location now (".etap.open" while it is being written)."""
        return shard_name(location.shard_number, self.is_sealed(location))

    def is_sealed(self, location: RecordLocation) -> bool:
        # Shards this process did not write were sealed by start-up recovery at the latest.
        return self._shard_states.get(location.shard_number, "sealed") == "sealed"

    def count_reject(self, reason: str) -> None:
        self.rejects[reason] += 1

    async def submit(self, frame: ReceivedFrame) -> SubmitOutcome:
        """Stores frame unless its id is stored (a part: keeps it for its capture; a record closing parts:
        stores them, then it); returns once it is durable. Consumes frame's buffer."""
        info = frame.info
        try:
            part = capture_part_of(info.record_id, info.metadata)
            closing = closing_parts_of(info.record_id, info.metadata)
        except CaptureFormatError as err:
            self.buffer_pool.release(frame.buffer)
            raise ApiError(422, "invalid_parts", str(err)) from None
        if part is not None:
            return await self._stage(frame, part)
        if closing is not None:
            return await self._close(frame, closing)
        return await self._store(frame)

    async def _stage(self, frame: ReceivedFrame, part: PartOf) -> SubmitOutcome:
        info = frame.info
        try:
            self._check_accepting()
            if part.record_id in self._locations:  # its capture is closed: this part is stored with it
                self.num_duplicates += 1
                return SubmitOutcome("duplicate", info.record_id, None, True)
            async with self.parts.lock(part.record_id):
                stored = info.record_id in self._locations  # the same tokens' block came before
                status = await asyncio.to_thread(self.parts.stage, part.record_id, part.index, info,
                                                 None if stored else frame.view)
            self.num_duplicates += status == "duplicate"
            return SubmitOutcome(status, info.record_id, None, True)
        finally:
            self.buffer_pool.release(frame.buffer)

    async def _close(self, frame: ReceivedFrame, closing: ClosingParts) -> SubmitOutcome:
        """Appends the parts the record closes (those not stored yet), then the record; removes the parts."""
        record_id = frame.info.record_id
        handed = False
        try:
            async with self.parts.lock(record_id):
                if record_id not in self._locations:
                    self._check_accepting()
                    parts = await asyncio.to_thread(self.parts.check_closing, frame.info, closing)
                    for part in parts:
                        if part.path is not None and part.record_id not in self._locations:
                            await self._store(await self._read_staged(part))
                handed = True
                outcome = await self._store(frame)
                if outcome.status == "stored":
                    await asyncio.to_thread(self.parts.remove, record_id)
                return outcome
        finally:
            if not handed:
                self.buffer_pool.release(frame.buffer)

    async def _read_staged(self, part: StagedPart) -> ReceivedFrame:
        """A staged part's frame, read back into a pool buffer and checked as on arrival (a part damaged on
        the data disk since is removed and named: 409)."""
        buffer = self.buffer_pool.acquire(part.nbytes)
        try:
            view = memoryview(buffer)[: part.nbytes]
            await asyncio.to_thread(_read_into, part.path, view)
            info = await asyncio.to_thread(inspect_frame, view)
        except (OSError, CaptureFormatError) as err:
            self.buffer_pool.release(buffer)
            await asyncio.to_thread(part.path.unlink, missing_ok=True)
            raise ApiError(409, "parts_missing", f"part {part.index} ({part.record_id}) kept on the data disk is "
                           f"unreadable now ({err}) and was removed: send the capture again") from None
        except BaseException:
            self.buffer_pool.release(buffer)
            raise
        return ReceivedFrame(buffer=buffer, view=view, info=info)

    async def _sweep_parts(self) -> None:
        """Removes expired parts now and then (also those left by an earlier run of the collector)."""
        interval_s = min(60.0, self.settings.part_timeout_s / 4)
        while True:
            try:
                await asyncio.to_thread(self.parts.sweep)
            except OSError as err:
                log.warning("could not sweep expired parts: %s", err)
            await asyncio.sleep(interval_s)

    async def _store(self, frame: ReceivedFrame) -> SubmitOutcome:
        """Stores frame unless its id is stored; returns once it is durable. Consumes frame's buffer."""
        record_id = frame.info.record_id
        submitted = False
        try:
            while True:
                location = self._locations.get(record_id)
                if location is not None:
                    self.num_duplicates += 1
                    return SubmitOutcome("duplicate", record_id, location,
                                         location.header_xxh3_64 == frame.info.header_xxh3_64)
                in_flight = self._in_flight.get(record_id)
                if in_flight is None:
                    break
                await asyncio.wait([in_flight])  # its outcome decides: duplicate, or our turn
            self._check_accepting()
            future: asyncio.Future[RecordLocation] = self._loop.create_future()
            future.add_done_callback(_retrieve_exception)
            self._in_flight[record_id] = future
            self._writer.submit(WriteJob(view=frame.view, info=frame.info, token=(future, frame.buffer)))
            submitted = True
            # shield: a cancelled request must not cancel the future other waiters rely on.
            location = await asyncio.shield(future)
            return SubmitOutcome("stored", record_id, location, True)
        finally:
            if not submitted:
                self.buffer_pool.release(frame.buffer)

    def _check_accepting(self) -> None:
        if not self._accepting:
            raise ApiError(503, "shutting_down", "the collector is stopping; send again later")
        reason = self.failed_reason
        if reason is not None:
            raise ApiError(503, "storage_failed", f"the collector cannot write: {reason}; restart it")

    def _deliver_from_thread(self, results: list[WriteResult], events: list[ShardEvent]) -> None:
        self._loop.call_soon_threadsafe(self._on_written, results, events)

    def _on_written(self, results: list[WriteResult], events: list[ShardEvent]) -> None:
        for event in events:
            self._shard_states[event.shard_number] = event.state
            if event.state == "sealed":
                self.totals.num_sealed_shards += 1
                if self._uploader is not None:
                    self._uploader.submit(self.settings.data_dir / shard_name(event.shard_number, True))
            elif event.state == "abandoned":
                log.error("shard %d left open for recovery: %s", event.shard_number, event.detail)
        if any(result.error is None for result in results):
            self.num_group_commits += 1
        for result in results:
            future, buffer = result.job.token
            info = result.job.info
            assert not future.done(), f"record {info.record_id!r} was reported twice"
            self._in_flight.pop(info.record_id, None)
            self.buffer_pool.release(buffer)
            if result.error is not None:
                future.set_exception(_api_error_from_write_error(result.error))
                continue
            location = RecordLocation(
                shard_number=result.shard_number,
                offset=result.offset,
                frame_nbytes=info.frame_nbytes,
                num_tokens=info.num_tokens,
                header_xxh3_64=info.header_xxh3_64,
            )
            self._locations[info.record_id] = location
            self.totals.add(num_tokens=info.num_tokens, raw_nbytes=info.raw_nbytes,
                            stored_nbytes=info.stored_nbytes, frame_nbytes=info.frame_nbytes)
            self.num_ingested += 1
            self.num_ingested_nbytes += info.frame_nbytes
            future.set_result(location)

    def stats(self) -> dict[str, Any]:
        totals = self.totals
        open_shards = sorted(number for number, state in self._shard_states.items() if state == "open")
        return {
            "num_records": totals.num_records,
            "num_tokens": totals.num_tokens,
            "raw_nbytes": totals.raw_nbytes,
            "stored_nbytes": totals.stored_nbytes,
            "frame_nbytes": totals.frame_nbytes,
            "compression_ratio": round(totals.raw_nbytes / totals.stored_nbytes, 4) if totals.stored_nbytes else None,
            "num_sealed_shards": totals.num_sealed_shards,
            "open_shards": [shard_name(number, False) for number in open_shards],
            "num_ingested": self.num_ingested,
            "num_ingested_nbytes": self.num_ingested_nbytes,
            "num_duplicates": self.num_duplicates,
            "num_duplicates_on_disk": self.num_duplicates_on_disk,
            "num_in_flight": len(self._in_flight),
            "num_group_commits": self.num_group_commits,
            "rejects": dict(sorted(self.rejects.items())),
            "num_rejects": sum(self.rejects.values()),
            "durability": self.settings.durability,
            "failed_reason": self.failed_reason,
            "recovered_shards": [
                {"shard": report.open_path.name, "num_records": report.num_records, "bytes_cut": report.bytes_cut}
                for report in self.recoveries
            ],
            "num_quarantined_shards": len(self.quarantined),
            "quarantined_shards": list(self.quarantined),
            "uptime_s": round(time.monotonic() - self.started_at, 3),
            "upload": None if self._uploader is None else self._uploader.stats(),
            "parts": self.parts.stats(),
        }


def _retrieve_exception(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # marks it retrieved: a failed write whose request went away is not an error


def _api_error_from_write_error(err: BaseException) -> ApiError:
    if is_out_of_space(err):
        return ApiError(507, "insufficient_storage", f"the data disk is full: {err}; nothing was stored")
    if isinstance(err, OSError) and err.errno == errno.ESHUTDOWN:
        return ApiError(503, "shutting_down", "the collector is stopping; send again later")
    return ApiError(503, "storage_failed", f"writing the record failed: {err}; nothing was acknowledged")


def _read_into(path, view: memoryview) -> None:
    with open(path, "rb") as file:
        if file.readinto(view) != len(view) or file.read(1):
            raise OSError(f"{path.name} is not {len(view)} bytes long")
