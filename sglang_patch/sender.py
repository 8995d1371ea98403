"""The sender thread: encodes captured sequences into frames and ships them to the collector.

What must hold:
- `submit()` (called on the scheduler's thread) never blocks and never raises: past the in-flight
  byte budget a capture is dropped and counted;
- frames reach the collector in capture order; while it is unreachable (connection error, timeout,
  5xx, 507) frames go to the bounded spool, which is drained oldest first once it answers again, and
  anything behind a non-empty spool queues behind it;
- a frame the collector rejects as bad (4xx) is dropped and counted, not retried forever;
- re-sending is safe: the collector acknowledges a record id it already has as a duplicate.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from capture_format import CaptureRecord, encode_frame
from sglang_patch.capture import CapturedSequence
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
_RETRY_STATUS = {408, 429, 507}
_MAX_BACKOFF_S = 10.0
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


def to_record(captured: CapturedSequence, model: ModelIdentity) -> CaptureRecord:
    dtype_name, view_dtype, numpy_dtype = _STATE_DTYPES[captured.aux.dtype]
    num_tokens, num_layers = len(captured.token_ids), len(model.capture_layers)
    aux = captured.aux.view(view_dtype).numpy().view(numpy_dtype)
    final = captured.final.view(view_dtype).numpy().view(numpy_dtype)
    return CaptureRecord(
        record_id=captured.tag.record_id,
        sample_id=captured.tag.sample_id,
        model_fingerprint=model.model_fingerprint,
        capture_layers=model.capture_layers,
        hidden_size=model.hidden_size,
        dtype=dtype_name,
        token_ids=np.asarray(captured.token_ids, dtype=np.int32),
        loss_spans=captured.tag.loss_spans,
        aux=aux.reshape(num_tokens, num_layers, model.hidden_size),  # (T, K, H)
        final=final.reshape(num_tokens, model.hidden_size),  # (T, H)
        metadata=captured.tag.metadata,
    )


class Sender:
    """One background thread per capturing process; see the module docstring for its guarantees."""

    def __init__(self, *, settings: CaptureSettings, model: ModelIdentity, stats: CaptureStats, spool: Spool,
                 stats_path: Path) -> None:
        self._settings = settings
        self._model = model
        self._stats = stats
        self._spool = spool
        self.stats_path = stats_path
        headers = {"Content-Type": "application/octet-stream"}
        if settings.token is not None:
            headers["Authorization"] = f"Bearer {settings.token.get_secret_value()}"
        self._client = httpx.Client(timeout=settings.send_timeout_s, headers=headers)
        self._records_url = f"{settings.collector_url}/v1/records"
        self._queue: collections.deque[CapturedSequence] = collections.deque()
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

    def submit(self, captured: CapturedSequence) -> None:
        size = captured.raw_nbytes
        with self._condition:
            if self._inflight_bytes + size > self._settings.inflight_max_bytes:
                self._stats.drop("inflight_budget")
                return
            self._inflight_bytes += size
            self._queue.append(captured)
            self._condition.notify()

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

    def _run(self) -> None:
        while True:
            with self._condition:
                if not self._queue and not self._stopping:
                    self._condition.wait(timeout=0.5)
                captured = self._queue.popleft() if self._queue else None
                stopping = self._stopping
            try:
                if captured is not None:
                    self._ship(captured, spool_only=stopping)
                elif stopping:
                    return
                else:
                    self._drain_spool()
                self._write_stats()
            except Exception:  # never let the thread die: capture stops, serving does not notice
                self._stats.add("sender_errors")
                logger.exception("eagle-tap sender error")

    def _ship(self, captured: CapturedSequence, *, spool_only: bool) -> None:
        try:
            frame = encode_frame(to_record(captured, self._model), self._model.codec)
        except ValueError as error:
            self._stats.drop("invalid_record")
            logger.error("eagle-tap: capture %s is not a valid record: %s", captured.tag.record_id, error)
            return
        finally:
            with self._condition:
                self._inflight_bytes -= captured.raw_nbytes
        self._stats.add("bytes_raw", captured.raw_nbytes)
        self._stats.add("bytes_stored", len(frame))
        # Order: nothing overtakes what already waits in the spool.
        if spool_only or len(self._spool) or time.monotonic() < self._retry_at or not self._post(frame):
            self._to_spool(frame)

    def _to_spool(self, frame: bytes) -> None:
        if self._spool.put(frame):
            self._stats.add("spooled")
        else:
            self._stats.drop("spool_full")

    def _drain_spool(self) -> None:
        while len(self._spool) and time.monotonic() >= self._retry_at:
            _, frame = self._spool.oldest()
            if not self._post(frame):
                return
            self._spool.remove_oldest()
            self._stats.add("resent_from_spool")

    def _post(self, frame: bytes) -> bool:
        """True when the collector is done with the frame (stored, duplicate or rejected); False to retry later."""
        try:
            response = self._client.post(self._records_url, content=frame)
        except httpx.HTTPError as error:
            return self._unreachable(f"{type(error).__name__}: {error}")
        if response.status_code in _RETRY_STATUS or response.status_code >= 500:
            return self._unreachable(f"HTTP {response.status_code}: {response.text[:200]}")
        self._backoff_s = 0.5
        if response.status_code in (200, 201):
            self._stats.add("duplicates" if response.status_code == 200 else "sent")
        else:
            self._stats.drop("rejected_by_collector")
            logger.error("eagle-tap: collector rejected a frame: HTTP %s %s", response.status_code, response.text[:500])
        return True

    def _unreachable(self, why: str) -> bool:
        self._stats.add("send_failures")
        if self._backoff_s == 0.5:
            logger.warning("eagle-tap: collector unreachable (%s); spooling to %s", why, self._spool.directory)
        self._retry_at = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, _MAX_BACKOFF_S)
        return False

    def _write_stats(self) -> None:
        now = time.monotonic()
        if now - self._stats_written_at >= 1.0:
            self._stats_written_at = now
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
