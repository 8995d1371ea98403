"""The sender: a thread that ships frames to the collector, and a pool of threads that encode them.

Encoding (numpy's byte shuffles, zstd, xxhash: all release the GIL) is the sender's per-byte work, so it
runs on `sender_threads` encoder threads, up to one batch each ahead of the batch the sender thread posts:
at Kimi-K2's width (57,344 raw bytes a token) one core encodes a few thousand tokens a second, a production
engine makes tens of thousands. With one encoder thread the sender thread encodes itself (no pool). A record
closing parts is encoded on the sender thread, once the digest of its parts is known.

What must hold:
- `submit()` (called on the scheduler's thread) never blocks and never raises: past the in-flight
  byte budget a capture is dropped and counted;
- what is queued is coalesced into one POST of several frames (up to `batch_max_bytes` of captures,
  waiting at most `batch_max_age_s` for more), and every frame gets its own verdict (`delivery.py`);
- frames reach the collector in capture order, except one the collector asked to have re-sent (encoder
  threads encode a batch's captures side by side, but the sender thread collects their frames in queue order
  and posts one batch after the other, so the parts of a capture reach the collector in order); while
  it is unreachable (connection error, deadline, redirect, 5xx, 507) frames go to the bounded spool,
  which is drained oldest first once it answers again, and anything behind a non-empty spool queues
  behind it;
- a frame the collector rejects as bad (4xx) is dropped and counted, not retried forever;
- re-sending is safe: the collector acknowledges a record id it already has as a duplicate;
- a capture's host buffers are released once its frame is encoded (or it is dropped); the encoded frames
  of at most `sender_threads + 1` batches wait for their POST (with one thread, one batch's);
- the parts of a capture sent in parts are taken into its digest in order (on the sender thread, as their
  frames are collected), and its record carries the digest of exactly the part frames encoded for it
  (`capture_format.parts`); the closing record is encoded once all its parts are collected; a record whose
  parts were not all encoded here is dropped and counted (`part_lost`), never sent to close parts it does not
  have;
- `sender_cpu_ns` counts the CPU of the sender thread and of the encoder threads' encoding.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from capture_format import CaptureRecord, StatesPrefix, encode_frame
from capture_format.frames import inspect_frame_header
from capture_format.parts import SENDER_MAX_BACKOFF_S, PartsDigest, closing_metadata, part_metadata
from capture_format.prefix_blocks import BLOCK_KIND, block_record_id, prefix_key, prefix_keys, states_namespace
from sglang_patch.capture import CapturedSequence
from sglang_patch.device_copy import host_cat
from sglang_patch.delivery import CollectorClient, Verdict
from sglang_patch.settings import CaptureSettings
from sglang_patch.spool import Spool
from sglang_patch.stats import CaptureStats, StatsFile

logger = logging.getLogger("eagle_tap.plugin")

# torch dtype -> (record dtype, numpy view of the same bytes); numpy has no bfloat16, so its bits go as uint16.
_STATE_DTYPES = {
    torch.bfloat16: ("bfloat16", torch.int16, np.uint16),
    torch.float16: ("float16", torch.float16, np.float16),
    torch.float32: ("float32", torch.float32, np.float32),
}
_LOG_EVERY_S = 60.0
_STATS_EVERY_S = 1.0
"""The stats file is rewritten about this often (readers wait for a snapshot newer than a time)."""
ENCODE_BYTES_S_PER_THREAD = 200e6
"""Raw state bytes a second one encoder thread is sized for (bf16-split measured 380-580 MB/s on a quiet core)."""
SIZED_TOKENS_S = 10_000
"""Captured tokens a second the default pool is sized for (a third of a TP8 engine of Kimi-K2.5)."""
MAX_DEFAULT_ENCODE_THREADS = 8


def default_encode_threads(raw_bytes_per_token: int, num_cores: int | None = None) -> int:
    """Encoder threads for `sender_threads=0`: enough for SIZED_TOKENS_S captured tokens a second of this width
    at ENCODE_BYTES_S_PER_THREAD each, but at most a quarter of the cores this process may run on (the rest
    serve) and MAX_DEFAULT_ENCODE_THREADS; at least 1. 57,344 B/token (Kimi-K2): 3 threads on 12+ cores; 1,024
    B/token (the tiny target): 1."""
    if num_cores is None:
        num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    wanted = math.ceil(raw_bytes_per_token * SIZED_TOKENS_S / ENCODE_BYTES_S_PER_THREAD)
    return max(1, min(wanted, num_cores // 4, MAX_DEFAULT_ENCODE_THREADS))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelIdentity:
    """What every record of this server shares."""

    capture_layers: tuple[int, ...]
    hidden_size: int
    model_fingerprint: str
    state_dtype: str
    """Record dtype of the aux and final states (`bfloat16`, `float16`, `float32`): the serving dtype."""
    codec: str
    """Codec of the states in every frame, checked against state_dtype before capture starts."""

    @property
    def raw_bytes_per_token(self) -> int:
        """Raw bytes of one token's aux and final states."""
        itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[self.state_dtype]
        return (len(self.capture_layers) + 1) * self.hidden_size * itemsize


def record_dtype(dtype: torch.dtype) -> str | None:
    """The record dtype name of states held as `dtype`, or None when records cannot hold it."""
    entry = _STATE_DTYPES.get(dtype)
    return entry[0] if entry is not None else None


def to_records(captured: CapturedSequence, model: ModelIdentity, parts_digest: str | None = None) -> list[CaptureRecord]:
    """The records of a capture: in prefix mode the blocks it sends, then its own record (none for a
    blocks-only capture); of a part, the part (`capture_format.parts`); of a record closing parts, the record
    (parts_digest: their `PartsDigest`). Their arrays are views of the capture's host buffers (encode before
    release). ValueError if the capture cannot make valid records (e.g. its token ids are not those it was
    planned on)."""
    aux_rows, final_rows = captured.state_arrays()  # (S', K*H), (S', H): the rows from token first_row on
    dtype_name, view_dtype, numpy_dtype = _STATE_DTYPES[captured.state_dtype]
    held, num_layers = aux_rows.shape[0], len(model.capture_layers)
    aux = aux_rows.view(numpy_dtype).reshape(held, num_layers, model.hidden_size)
    final = final_rows.view(numpy_dtype).reshape(held, model.hidden_size)
    token_ids = np.asarray(captured.token_ids, dtype=np.int32)
    shared = {"model_fingerprint": model.model_fingerprint, "capture_layers": model.capture_layers,
              "hidden_size": model.hidden_size, "dtype": dtype_name}
    plan, first_row = captured.prefix, captured.first_row
    namespace = states_namespace(model.model_fingerprint, model.capture_layers, model.hidden_size, dtype_name)
    if captured.part_index is not None or (captured.rows_start is not None and not captured.blocks_only):
        # a part, or the record after its blocks or parts went ahead
        return [_part_or_closing(captured, token_ids, aux, final, shared, namespace, parts_digest)]
    keys: dict[int, str] = {}  # block end -> content key of the states of token_ids[:end] (this model's)
    if plan is not None and plan.keys:
        if prefix_key(token_ids[: plan.record_prefix]) != plan.keys[-1]:
            raise ValueError("its token ids are not the prompt its shared-prefix blocks were planned on")
        ends = range(plan.block_tokens, plan.record_prefix + 1, plan.block_tokens)
        keys = dict(zip(ends, prefix_keys(token_ids, ends, namespace)))

    def reference(end: int) -> StatesPrefix | None:
        return StatesPrefix(keys[end], end) if end else None

    records = []
    if plan is not None:
        for end in plan.sent_here if captured.block_ends is None else captured.block_ends:
            start = end - plan.block_tokens
            rows = slice(start - first_row, end - first_row)
            block_id = block_record_id(keys[end])
            records.append(CaptureRecord(record_id=block_id, sample_id=block_id, token_ids=token_ids[:end],
                                         loss_spans=(), aux=aux[rows], final=final[rows],
                                         metadata={"kind": BLOCK_KIND}, states_prefix=reference(start), **shared))
    if captured.blocks_only:
        return records
    own = plan.record_prefix if plan is not None else 0
    images = {}
    if captured.input_embed_spans:  # a request with images: never in blocks or parts
        embeds = host_cat(captured.input_embeds) if len(captured.input_embeds) > 1 else captured.input_embeds[0]
        images = {"input_embed_spans": captured.input_embed_spans,  # (E, H)
                  "input_embeds": embeds.to(captured.state_dtype).view(view_dtype).numpy().view(numpy_dtype)}
    records.append(CaptureRecord(
        record_id=captured.tag.record_id, sample_id=captured.tag.sample_id, token_ids=token_ids,
        loss_spans=captured.loss_spans, aux=aux[own - first_row :],  # (S - own, K, H)
        final=final[own - first_row :], metadata=captured.record_metadata(),  # (S - own, H)
        states_prefix=reference(own), **images, **shared))
    return records


def _part_or_closing(captured: CapturedSequence, token_ids: np.ndarray, aux: np.ndarray, final: np.ndarray,
                     shared: dict, namespace: str, parts_digest: str | None) -> CaptureRecord:
    """A part (rows [first_row, end) of tokens token_ids[:end]), or the record holding the rows from first_row on,
    closing the parts before it (if any)."""
    start = captured.first_row
    reference = StatesPrefix(prefix_key(token_ids[:start], namespace), start) if start else None
    if captured.part_index is not None:
        block_id = block_record_id(prefix_key(token_ids, namespace))
        return CaptureRecord(record_id=block_id, sample_id=block_id, token_ids=token_ids, loss_spans=(),
                             aux=aux, final=final, metadata=part_metadata(captured.tag.record_id, captured.part_index),
                             states_prefix=reference, **shared)
    metadata = captured.record_metadata()
    if captured.parts_before:
        if parts_digest is None:
            raise ValueError(f"it closes {captured.parts_before} parts and their digest is unknown")
        metadata = closing_metadata(metadata, captured.parts_before, parts_digest)
    return CaptureRecord(
        record_id=captured.tag.record_id, sample_id=captured.tag.sample_id, token_ids=token_ids,
        loss_spans=captured.loss_spans, aux=aux, final=final, states_prefix=reference, metadata=metadata, **shared)


_Job = tuple[CapturedSequence, "Future[list[bytes] | str] | None"]
"""A capture of a batch and its frames being encoded (or why it is no valid record); None: encoded when collected."""


class Sender:
    """One shipping thread per capturing process and its encoder threads; see the module docstring."""

    def __init__(self, *, settings: CaptureSettings, model: ModelIdentity, stats: CaptureStats, spool: Spool,
                 stats_path: Path, every_second: Callable[[], None] | None = None) -> None:
        self._settings = settings
        self._model = model
        self._stats = stats
        self._spool = spool
        self.stats_path = stats_path
        self._stats_file = StatsFile(stats_path)
        self._every_second = every_second
        """Called on this thread about once a second, before the stats are written (e.g. the ranks' check)."""
        token = settings.token.get_secret_value() if settings.token is not None else None
        self._client = CollectorClient(settings.collector_url, token=token, deadline_s=settings.send_timeout_s)
        self._queue: collections.deque[tuple[float, CapturedSequence]] = collections.deque()  # (queued at, capture)
        self._parts: dict[str, tuple[PartsDigest, float]] = {}
        """Captures sent in parts whose closing record has not come: the digest of their parts so far, and
        when the last one was collected (sender thread only)."""
        self._inflight_bytes = 0
        """What the captures not yet released keep in memory (`CapturedSequence.inflight_nbytes`): the bound."""
        self._inflight_raw_bytes = 0
        """Their raw bytes alone: what a batch is full of (`batch_max_bytes`)."""
        self._condition = threading.Condition()
        self._stopping = False
        self._retry_at = 0.0
        self._backoff_s = 0.5
        self._stats_written_at = 0.0
        self._changes_written = -1
        """The stats' change count the file holds (`CaptureStats.snapshot_and_changes`)."""
        self._quiet_written = False
        """Whether the file holds a quiet snapshot (see `_write_stats`)."""
        self._cpu_counted_ns = 0
        """The sender thread's CPU clock when its CPU was last counted (`_count_cpu`)."""
        self._logged_summary = ""
        self._logged_at = time.monotonic()
        self.num_encode_threads = settings.sender_threads or default_encode_threads(model.raw_bytes_per_token)
        self._stats.set("sender_threads", self.num_encode_threads)
        self._pool = None if self.num_encode_threads == 1 else ThreadPoolExecutor(
            self.num_encode_threads, thread_name_prefix="eagle-tap-encode", initializer=self._lower_priority)
        self._thread = threading.Thread(target=self._run, name="eagle-tap-sender", daemon=True)
        self._thread.start()

    def submit(self, captured: CapturedSequence) -> bool:
        """Queues a capture (or a part of one); False when it was dropped (counted) for want of room."""
        size, raw = captured.inflight_nbytes, captured.raw_nbytes
        with self._condition:
            if self._inflight_bytes + size > self._settings.inflight_max_bytes:
                captured.release()
                self._stats.drop("inflight_budget")
                return False
            self._inflight_bytes += size
            self._inflight_raw_bytes += raw
            self._queue.append((time.monotonic(), captured))
            # Wake the sender thread only when it has something to start: a first capture (it starts the batch's
            # age), or a full batch. Behind a first one it waits for the age anyway, and waking it for each
            # capture cost it a thread wake-up (tens of microseconds of CPU on the serving cores) a record.
            if len(self._queue) == 1 or self._inflight_raw_bytes >= self._settings.batch_max_bytes:
                self._condition.notify()
            return True

    def idle(self) -> bool:
        """Nothing queued in memory and nothing spooled."""
        with self._condition:
            return not self._queue and self._inflight_bytes == 0 and len(self._spool) == 0

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the threads; what is still queued in memory goes to the spool."""
        with self._condition:
            self._stopping = True
            self._condition.notify()
        self._thread.join(timeout_s)
        if self._pool is not None:
            self._pool.shutdown(wait=False)  # idle once the sender thread has collected what it handed over
        self._client.close()
        if not self._thread.is_alive():  # else it may still write: its descriptor stays open (a daemon thread)
            self._stats_file.close()
        self._stats.write(self.stats_path)
        logger.info(self._stats.summary())

    def _lower_priority(self) -> None:
        """Lowers the calling thread's priority by `sender_nice` (Linux: setpriority on a thread id affects that
        thread only): the forward's threads go first when the CPU is short."""
        if self._settings.sender_nice <= 0 or not hasattr(os, "setpriority"):
            return
        try:
            thread_id = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, thread_id,
                           min(os.getpriority(os.PRIO_PROCESS, thread_id) + self._settings.sender_nice, 19))
        except OSError as error:
            logger.warning("eagle-tap: could not lower the sender thread's priority: %s", error)

    def _count_cpu(self) -> None:
        """Counts the sender thread's own CPU since the last count (collecting, HTTP, spool, the stats file)."""
        now_ns = time.thread_time_ns()
        self._stats.add("sender_cpu_ns", now_ns - self._cpu_counted_ns, bookkeeping=True)
        self._cpu_counted_ns = now_ns

    def _run(self) -> None:
        self._lower_priority()
        self._cpu_counted_ns = time.thread_time_ns()
        pending: collections.deque[list[_Job]] = collections.deque()  # batches handed to the encoders, oldest first
        while True:
            self._count_cpu()
            batch, stopping = self._next_batch(wait=not pending)
            try:
                started = self._start_encoding(batch)
                if self._pool is None:
                    jobs = started
                else:  # keep every encoder busy: post the oldest batch once more are queued, or nothing more came
                    if started:
                        pending.append(started)
                    ready = pending and (not started or len(pending) > self.num_encode_threads)
                    jobs = pending.popleft() if ready else []
                if jobs:
                    if not stopping:
                        self._drain_spool()  # under steady load the queue is never empty: drain first
                    self._ship(jobs, spool_only=stopping)
                elif not pending and not started:
                    if stopping:
                        return
                    self._drain_spool()
                self._write_stats()
            except Exception:  # never let the thread die: capture stops, serving does not notice
                self._stats.add("sender_errors")
                logger.exception("eagle-tap sender error")

    def _next_batch(self, *, wait: bool = True) -> tuple[list[CapturedSequence], bool]:
        """What is queued, up to batch_max_bytes; waits up to batch_max_age_s (from the oldest) for more, unless
        told not to wait (a batch is being encoded: the encoders should not run dry)."""
        max_bytes, max_age_s = self._settings.batch_max_bytes, self._settings.batch_max_age_s
        with self._condition:
            if wait and not self._queue and not self._stopping:
                self._condition.wait(timeout=self._idle_wait_s())
            while wait and self._queue and not self._stopping and self._inflight_raw_bytes < max_bytes:
                wait_s = self._queue[0][0] + max_age_s - time.monotonic()
                if wait_s <= 0:
                    break
                self._condition.wait(timeout=wait_s)  # more may come: fewer, larger POSTs
            batch, batch_bytes = [], 0
            while self._queue and (not batch or batch_bytes + self._queue[0][1].raw_nbytes <= max_bytes):
                captured = self._queue.popleft()[1]
                batch.append(captured)
                batch_bytes += captured.raw_nbytes
            return batch, self._stopping

    def _idle_wait_s(self) -> float | None:
        """How long an idle sender sleeps (under the condition's lock): until its stats file is due (once a
        second) or the spool may be sent again, whichever comes first; None (until woken) once the file holds a
        quiet snapshot and nothing changed since: the next change (`CaptureStats.call_on_change`), a capture or
        `close` wakes it. A wake-up costs the thread CPU whatever it finds (0.3-0.6 ms here; an idle sender woke
        once a second, twice before that); at a low sampling rate the sender is idle most of the time."""
        if self._quiet_written and self._stats.call_on_change(self._wake, self._changes_written):
            return None
        due = self._stats_written_at + _STATS_EVERY_S
        if len(self._spool):
            due = min(due, self._retry_at)
        return min(max(due - time.monotonic(), 0.01), _STATS_EVERY_S)

    def _wake(self) -> None:
        """The stats changed while the sender slept quiet (called on the changing thread: only a notify)."""
        with self._condition:
            self._condition.notify()

    def _start_encoding(self, batch: list[CapturedSequence]) -> list[_Job]:
        """Hands a batch's captures to the encoder threads, except closing records, which need the digest of
        parts not collected yet (they are encoded when collected, as all captures are without a pool)."""
        if self._pool is None:
            return [(captured, None) for captured in batch]
        return [(captured, None if _closes_parts(captured) else self._pool.submit(self._encode, captured, None))
                for captured in batch]

    def _encode(self, captured: CapturedSequence, parts_digest: str | None) -> list[bytes] | str:
        """The frames of a capture, or why it makes no valid record; its buffers are released either way."""
        on_encoder = threading.current_thread() is not self._thread
        cpu_ns = time.thread_time_ns()
        try:
            return [encode_frame(record, self._model.codec)
                    for record in to_records(captured, self._model, parts_digest)]
        except ValueError as error:
            return str(error) or type(error).__name__
        finally:
            self._release(captured)
            if on_encoder:  # the sender thread's own CPU is counted by its loop
                self._stats.add("sender_cpu_ns", time.thread_time_ns() - cpu_ns, bookkeeping=True)

    def _release(self, captured: CapturedSequence) -> None:
        captured.release()
        with self._condition:
            self._inflight_bytes -= captured.inflight_nbytes
            self._inflight_raw_bytes -= captured.raw_nbytes

    def _collect(self, captured: CapturedSequence, job: "Future[list[bytes] | str] | None") -> list[bytes]:
        """The frames of a capture, in queue order (sender thread): parts enter their capture's digest here."""
        record_id = captured.tag.record_id
        digest = self._parts_digest(captured)
        if job is not None:
            encoded = job.result()
        elif digest is None:
            self._release(captured)
            return []
        else:
            encoded = self._encode(captured, digest.hexdigest() if _closes_parts(captured) else None)
        if digest is None:  # a part after a lost one (counted); encoded before that was known
            return []
        if isinstance(encoded, str):
            self._parts.pop(record_id, None)
            self._stats.drop("invalid_record")
            logger.error("eagle-tap: capture %s is not a valid record: %s", record_id, encoded)
            return []
        if captured.part_index is not None:
            part = inspect_frame_header(encoded[0])
            digest.update(part.record_id, part.header_xxh3_64)
            self._parts[record_id] = (digest, time.monotonic())
        return encoded

    def _parts_digest(self, captured: CapturedSequence) -> PartsDigest | bool | None:
        """The digest a part extends or a closing record carries; False for a capture sent whole; None when
        a part before it was lost (dropped here, counted)."""
        record_id = captured.tag.record_id
        if captured.part_index is None and not captured.parts_before:
            return False
        if captured.part_index == 0:
            self._forget_stale_parts()
            return PartsDigest()
        digest = self._parts.get(record_id, (None, 0.0))[0]
        expected = captured.parts_before if captured.part_index is None else captured.part_index
        if captured.part_index is None:
            self._parts.pop(record_id, None)
        if digest is None or digest.count != expected:
            self._parts.pop(record_id, None)
            self._stats.drop("part_lost")
            return None
        return digest

    def _forget_stale_parts(self) -> None:
        """Captures whose parts stopped coming (dropped before closing) are forgotten after twice the TTL."""
        oldest = time.monotonic() - 2 * self._settings.partial_ttl_s
        for record_id in [key for key, (_, at) in self._parts.items() if at < oldest]:
            del self._parts[record_id]

    def _ship(self, jobs: list[_Job], *, spool_only: bool) -> None:
        frames = []
        for index, (captured, job) in enumerate(jobs):
            try:
                encoded = self._collect(captured, job)
            except Exception:
                for later, later_job in jobs[index + 1 :]:  # an encoder releases what it was handed, not these
                    if later_job is None:
                        self._release(later)
                raise
            if encoded:
                self._stats.add("bytes_raw", captured.raw_nbytes)
                self._stats.add("bytes_stored", sum(len(frame) for frame in encoded))
                if captured.part_index is not None:
                    self._stats.add("parts_sent")
                else:
                    self._stats.add("prefix_blocks_sent", len(encoded) - (not captured.blocks_only))
                frames.extend(encoded)
        # Order: nothing overtakes what already waits in the spool.
        if spool_only or len(self._spool) or time.monotonic() < self._retry_at:
            for frame in frames:
                self._to_spool(frame)
            return
        for frame, verdict in zip(frames, self._deliver(frames)):
            if verdict.outcome == "retry":
                self._to_spool(frame)

    def _to_spool(self, frame: bytes) -> None:
        if self._spool.put(frame):
            self._stats.add("spooled")
        else:
            self._stats.drop("spool_full")

    def _drain_spool(self) -> None:
        while len(self._spool) and time.monotonic() >= self._retry_at:
            entries = self._spool.oldest(self._settings.batch_max_bytes)
            verdicts = self._deliver([frame for _, frame in entries])
            for (path, _), verdict in zip(entries, verdicts):
                if verdict.outcome != "retry":
                    self._spool.remove(path)
                    self._stats.add("resent_from_spool")
            if any(verdict.outcome == "retry" for verdict in verdicts):
                return

    def _deliver(self, frames: list[bytes]) -> list[Verdict]:
        """The collector's verdict on each frame, counted; the first retry verdict starts a backoff."""
        if not frames:
            return []
        verdicts = self._client.deliver(frames)
        self._stats.add("posts")
        retry = next((verdict for verdict in verdicts if verdict.outcome == "retry"), None)
        for verdict in verdicts:
            if verdict.outcome == "rejected":
                # A record refused because its parts expired at the collector is told apart from a bad frame.
                self._stats.drop("parts_expired" if verdict.why.startswith("parts_expired")
                                 else "rejected_by_collector")
                logger.error("eagle-tap: collector rejected a frame: %s", verdict.why[:500])
            elif verdict.outcome != "retry":
                self._stats.add({"sent": "sent", "duplicate": "duplicates"}[verdict.outcome])
        if retry is None:
            self._backoff_s = 0.5
        else:
            self._stats.add("send_failures")
            if self._backoff_s == 0.5:
                logger.warning("eagle-tap: collector not taking frames (%s); spooling to %s", retry.why[:500],
                               self._spool.directory)
            self._retry_at = time.monotonic() + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, SENDER_MAX_BACKOFF_S)
        return verdicts

    def _write_stats(self) -> None:
        """Rewrites the stats file once a second, marked quiet when nothing changed since the last write and
        nothing is queued, in flight or spooled: then the sender sleeps until the next change (`_idle_wait_s`),
        and writes nothing more until then; the first change after it is written at once (a reader takes a quiet
        snapshot as current). Never quiet where ranks are checked (`every_second`): that check runs each second."""
        now = time.monotonic()
        quiet_stale = self._quiet_written and self._stats.changes != self._changes_written
        if quiet_stale or now - self._stats_written_at >= _STATS_EVERY_S:
            self._stats_written_at = now
            if self._every_second is not None:
                self._every_second()
            self._stats.set("spool_frames", len(self._spool))
            self._stats.set("spool_bytes", self._spool.num_bytes)
            with self._condition:
                self._stats.set("inflight_bytes", self._inflight_bytes)
                idle = not self._queue and self._inflight_bytes == 0
            self._count_cpu()
            snapshot, changes = self._stats.snapshot_and_changes()
            quiet = (idle and changes == self._changes_written and self._every_second is None
                     and not len(self._spool))
            if not (quiet and self._quiet_written):  # a quiet file stays as it is until the next change
                self._stats_file.write({**snapshot, "quiet": quiet})
            self._changes_written, self._quiet_written = changes, quiet
        if now - self._logged_at >= _LOG_EVERY_S:
            self._logged_at = now
            summary = self._stats.summary()
            if summary != self._logged_summary:  # an idle server's log stays quiet
                self._logged_summary = summary
                logger.info(summary)


def _closes_parts(captured: CapturedSequence) -> bool:
    """A record that closes parts sent before it: it carries their digest."""
    return captured.part_index is None and bool(captured.parts_before)
