"""The sender thread: encodes captured sequences into frames and ships them to the collector.

What must hold:
- `submit()` (called on the scheduler's thread) never blocks and never raises: past the in-flight
  byte budget a capture is dropped and counted;
- what is queued is coalesced into one POST of several frames (up to `batch_max_bytes` of captures,
  waiting at most `batch_max_age_s` for more), and every frame gets its own verdict (`delivery.py`);
- frames reach the collector in capture order, except one the collector asked to have re-sent; while
  it is unreachable (connection error, deadline, redirect, 5xx, 507) frames go to the bounded spool,
  which is drained oldest first once it answers again, and anything behind a non-empty spool queues
  behind it;
- a frame the collector rejects as bad (4xx) is dropped and counted, not retried forever;
- re-sending is safe: the collector acknowledges a record id it already has as a duplicate;
- a capture's host buffers are released once its frame is encoded (or it is dropped);
- the parts of a capture sent in parts are encoded in order, and its record carries the digest of exactly
  the part frames encoded for it (`capture_format.parts`); a record whose parts were not all encoded here
  is dropped and counted (`part_lost`), never sent to close parts it does not have.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
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
from sglang_patch.stats import CaptureStats

logger = logging.getLogger("eagle_tap.plugin")

# torch dtype -> (record dtype, numpy view of the same bytes); numpy has no bfloat16, so its bits go as uint16.
_STATE_DTYPES = {
    torch.bfloat16: ("bfloat16", torch.int16, np.uint16),
    torch.float16: ("float16", torch.float16, np.float16),
    torch.float32: ("float32", torch.float32, np.float32),
}
_LOG_EVERY_S = 60.0


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
    aux_rows, final_rows = captured.states()  # (S', K*H), (S', H): the rows from token first_row on
    dtype_name, view_dtype, numpy_dtype = _STATE_DTYPES[aux_rows.dtype]
    held, num_layers = aux_rows.shape[0], len(model.capture_layers)
    aux = aux_rows.view(view_dtype).numpy().view(numpy_dtype).reshape(held, num_layers, model.hidden_size)
    final = final_rows.view(view_dtype).numpy().view(numpy_dtype).reshape(held, model.hidden_size)
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
                  "input_embeds": embeds.to(aux_rows.dtype).view(view_dtype).numpy().view(numpy_dtype)}
    records.append(CaptureRecord(
        record_id=captured.tag.record_id, sample_id=captured.tag.sample_id, token_ids=token_ids,
        loss_spans=captured.loss_spans, aux=aux[own - first_row :],  # (S - own, K, H)
        final=final[own - first_row :], metadata=captured.metadata,  # (S - own, H)
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
    metadata = captured.metadata
    if captured.parts_before:
        if parts_digest is None:
            raise ValueError(f"it closes {captured.parts_before} parts and their digest is unknown")
        metadata = closing_metadata(metadata, captured.parts_before, parts_digest)
    return CaptureRecord(
        record_id=captured.tag.record_id, sample_id=captured.tag.sample_id, token_ids=token_ids,
        loss_spans=captured.loss_spans, aux=aux, final=final, states_prefix=reference, metadata=metadata, **shared)


class Sender:
    """One background thread per capturing process; see the module docstring for its guarantees."""

    def __init__(self, *, settings: CaptureSettings, model: ModelIdentity, stats: CaptureStats, spool: Spool,
                 stats_path: Path, every_second: Callable[[], None] | None = None) -> None:
        self._settings = settings
        self._model = model
        self._stats = stats
        self._spool = spool
        self.stats_path = stats_path
        self._every_second = every_second
        """Called on this thread about once a second, before the stats are written (e.g. the ranks' check)."""
        token = settings.token.get_secret_value() if settings.token is not None else None
        self._client = CollectorClient(settings.collector_url, token=token, deadline_s=settings.send_timeout_s)
        self._queue: collections.deque[tuple[float, CapturedSequence]] = collections.deque()  # (queued at, capture)
        self._parts: dict[str, tuple[PartsDigest, float]] = {}
        """Captures sent in parts whose closing record has not come: the digest of their parts so far, and
        when the last one was encoded (sender thread only)."""
        self._inflight_bytes = 0
        self._condition = threading.Condition()
        self._stopping = False
        self._retry_at = 0.0
        self._backoff_s = 0.5
        self._stats_written_at = 0.0
        self._logged_summary = ""
        self._logged_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="eagle-tap-sender", daemon=True)
        self._thread.start()

    def submit(self, captured: CapturedSequence) -> bool:
        """Queues a capture (or a part of one); False when it was dropped (counted) for want of room."""
        size = captured.raw_nbytes
        with self._condition:
            if self._inflight_bytes + size > self._settings.inflight_max_bytes:
                captured.release()
                self._stats.drop("inflight_budget")
                return False
            self._inflight_bytes += size
            self._queue.append((time.monotonic(), captured))
            self._condition.notify()
            return True

    def idle(self) -> bool:
        """Nothing queued in memory and nothing spooled."""
        with self._condition:
            return not self._queue and self._inflight_bytes == 0 and len(self._spool) == 0

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread; what is still queued in memory goes to the spool."""
        with self._condition:
            self._stopping = True
            self._condition.notify()
        self._thread.join(timeout_s)
        self._client.close()
        self._stats.write(self.stats_path)
        logger.info(self._stats.summary())

    def _lower_priority(self) -> None:
        """Lowers this thread's priority by `sender_nice` (Linux: setpriority on a thread id affects that
        thread only): the forward's threads go first when the CPU is short."""
        if self._settings.sender_nice <= 0 or not hasattr(os, "setpriority"):
            return
        try:
            thread_id = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, thread_id,
                           min(os.getpriority(os.PRIO_PROCESS, thread_id) + self._settings.sender_nice, 19))
        except OSError as error:
            logger.warning("eagle-tap: could not lower the sender thread's priority: %s", error)

    def _run(self) -> None:
        self._lower_priority()
        cpu_ns = time.thread_time_ns()
        while True:
            now_cpu_ns = time.thread_time_ns()  # the sender's own CPU: encoding, HTTP, spool
            self._stats.add("sender_cpu_ns", now_cpu_ns - cpu_ns)
            cpu_ns = now_cpu_ns
            batch, stopping = self._next_batch()
            try:
                if batch:
                    if not stopping:
                        self._drain_spool()  # under steady load the queue is never empty: drain first
                    self._ship(batch, spool_only=stopping)
                elif stopping:
                    return
                else:
                    self._drain_spool()
                self._write_stats()
            except Exception:  # never let the thread die: capture stops, serving does not notice
                self._stats.add("sender_errors")
                logger.exception("eagle-tap sender error")

    def _next_batch(self) -> tuple[list[CapturedSequence], bool]:
        """What is queued, up to batch_max_bytes; waits up to batch_max_age_s (from the oldest) for more."""
        max_bytes, max_age_s = self._settings.batch_max_bytes, self._settings.batch_max_age_s
        with self._condition:
            if not self._queue and not self._stopping:
                self._condition.wait(timeout=0.5)
            while self._queue and not self._stopping and self._inflight_bytes < max_bytes:
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

    def _encode(self, captured: CapturedSequence) -> list[bytes]:
        record_id = captured.tag.record_id
        try:
            digest = self._parts_digest(captured)
            if digest is None:
                return []
            frames = [encode_frame(record, self._model.codec)
                      for record in to_records(captured, self._model, digest.hexdigest() if digest else None)]
            if captured.part_index is not None:
                part = inspect_frame_header(frames[0])
                digest.update(part.record_id, part.header_xxh3_64)
                self._parts[record_id] = (digest, time.monotonic())
            return frames
        except ValueError as error:
            self._parts.pop(record_id, None)
            self._stats.drop("invalid_record")
            logger.error("eagle-tap: capture %s is not a valid record: %s", record_id, error)
            return []
        finally:
            captured.release()
            with self._condition:
                self._inflight_bytes -= captured.raw_nbytes

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

    def _ship(self, batch: list[CapturedSequence], *, spool_only: bool) -> None:
        frames = []
        for captured in batch:
            encoded = self._encode(captured)
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
        now = time.monotonic()
        if now - self._stats_written_at >= 1.0:
            self._stats_written_at = now
            if self._every_second is not None:
                self._every_second()
            self._stats.set("spool_frames", len(self._spool))
            self._stats.set("spool_bytes", self._spool.num_bytes)
            with self._condition:
                self._stats.set("inflight_bytes", self._inflight_bytes)
            self._stats.write(self.stats_path)
        if now - self._logged_at >= _LOG_EVERY_S:
            self._logged_at = now
            summary = self._stats.summary()
            if summary != self._logged_summary:  # an idle server's log stays quiet
                self._logged_summary = summary
                logger.info(summary)
