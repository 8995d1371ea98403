"""Delivering frames to the collector, several per POST, each with its own verdict.

`deliver(frames)` POSTs the frames back to back to `/v1/batches` and returns one verdict per frame:
"sent" (stored), "duplicate" (already stored), "rejected" (bad: never send it again) or "retry"
(not stored now: spool it and send it again). A collector without the batch route (404/405) is sent
one frame per POST to `/v1/records` from then on.

What must hold: a frame is only ever "sent", "duplicate" or "rejected" on an explicit answer for
that frame; anything else (no answer, a deadline, a redirect, an answer too large or unreadable, a
frame the answer does not mention) is "retry", so nothing is dropped silently.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence

from sglang_patch.bounded_http import BoundedPoster, PostFailed, PostResponse

__all__ = ["CollectorClient", "Verdict"]

logger = logging.getLogger("eagle_tap.plugin")

BATCH_CONTENT_TYPE = "application/x-eagle-tap-frames"
FRAME_CONTENT_TYPE = "application/octet-stream"
MAX_RESPONSE_BYTES = 256 << 10
"""An answer lists at most 1,024 frames at well under 256 bytes each; anything larger is not read."""
_RETRY_STATUS = {408, 429, 507}


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    outcome: str
    """"sent", "duplicate", "rejected" or "retry"."""
    why: str = ""


class CollectorClient:
    """The sender thread's connection to one collector."""

    def __init__(self, collector_url: str, *, token: str | None, deadline_s: float) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        self._poster = BoundedPoster(headers=headers, deadline_s=deadline_s, max_response_bytes=MAX_RESPONSE_BYTES)
        self._batch_url = f"{collector_url}/v1/batches"
        self._record_url = f"{collector_url}/v1/records"
        self._batches = True
        self.num_posts = 0

    def close(self) -> None:
        self._poster.close()

    def deliver(self, frames: Sequence[bytes]) -> list[Verdict]:
        """One verdict per frame, in order."""
        if self._batches:
            verdicts = self._post_batch(frames)
            if verdicts is not None:
                return verdicts
        verdicts = []
        for frame in frames:
            verdicts.append(self._post_one(frame))
            if verdicts[-1].outcome == "retry":  # the collector is not taking frames now: keep the order
                verdicts.extend(Verdict("retry", verdicts[-1].why) for _ in frames[len(verdicts):])
                break
        return verdicts

    def _post(self, url: str, parts: Sequence[bytes], content_type: str) -> PostResponse | Verdict:
        self.num_posts += 1
        try:
            response = self._poster.post(url, parts, content_type)
        except PostFailed as error:
            return Verdict("retry", str(error))
        if 300 <= response.status < 400:
            return Verdict("retry", f"HTTP {response.status} redirect to {response.headers.get('location', '?')[:200]!r}"
                                    " not followed: point EAGLE_TAP_COLLECTOR_URL at the collector itself")
        if response.status in _RETRY_STATUS or response.status >= 500:
            return Verdict("retry", f"HTTP {response.status}: {_excerpt(response.body)}")
        return response

    def _post_batch(self, frames: Sequence[bytes]) -> list[Verdict] | None:
        """Verdicts, or None when this collector has no batch route."""
        answer = self._post(self._batch_url, frames, BATCH_CONTENT_TYPE)
        if isinstance(answer, Verdict):
            return [answer] * len(frames)
        if answer.status in (404, 405):
            logger.warning("eagle-tap: the collector has no %s (HTTP %d); sending one frame per POST",
                           self._batch_url, answer.status)
            self._batches = False
            return None
        if answer.status != 200:
            return [Verdict("rejected", f"HTTP {answer.status}: {_excerpt(answer.body)}")] * len(frames)
        try:
            results = json.loads(answer.body)["results"]
            verdicts = [_batch_verdict(result) for result in results[: len(frames)]]
        except (ValueError, KeyError, TypeError) as error:
            return [Verdict("retry", f"unreadable batch answer ({type(error).__name__}): {_excerpt(answer.body)}")] \
                * len(frames)
        unread = Verdict("retry", "the collector did not get to this frame of the batch")
        return verdicts + [unread] * (len(frames) - len(verdicts))

    def _post_one(self, frame: bytes) -> Verdict:
        answer = self._post(self._record_url, [frame], FRAME_CONTENT_TYPE)
        if isinstance(answer, Verdict):
            return answer
        if answer.status == 201:
            return Verdict("sent")
        if answer.status == 200:
            return Verdict("duplicate")
        return Verdict("rejected", f"HTTP {answer.status}: {_excerpt(answer.body)}")


def _batch_verdict(result: dict) -> Verdict:
    status = result["status"]
    if status == "stored":
        return Verdict("sent")
    if status in ("duplicate", "rejected", "retry"):
        return Verdict(status, f"{result.get('error', '')}: {str(result.get('detail', ''))[:300]}")
    raise ValueError(f"unknown frame status {status!r}")


def _excerpt(body: bytes) -> str:
    return body[:300].decode("utf-8", errors="replace")
