"""Which requests are captured, decided once per request when the scheduler receives it.

A BEFORE hook on `Scheduler.handle_generate_request` calls `Selector.on_request` before the request
is scheduled, so the decision can still change how it is scheduled: a selected request gets its own
radix-cache namespace (`cache_salt`), so its prefill computes every row of its prompt. Requests that
are not selected keep their cache hits. Two kinds of request are selected:
- tagged requests (`capture_format.tag`), kept by `EAGLE_TAP_SAMPLE_RATE` (a hash of the record id);
- with `EAGLE_TAP_LIVE_SAMPLE_RATE` > 0, that fraction of untagged generate requests ("live"), chosen
  by a hash of the request id, captured in one pass (prompt and generated tokens). Never: health
  checks, requests that opted out, requests given as embeddings or with images (their token ids
  do not describe what the model saw). A live record's metadata says where it came from and at
  which rate; it holds no text.

What must hold:
- the decision for a request is made once, here, and depends only on the settings and the request
  (deterministic in its id: a re-sent request is sampled the same way), so every tensor-parallel
  rank salts it alike and schedules it alike;
- a request that is not selected costs a dict lookup and a hash; nothing about it is kept;
- the decisions waiting for their request's first forward are bounded (`MAX_WAITING`, then the
  oldest are dropped and counted) and expire after the partial TTL (a request aborted while queued).
"""

from __future__ import annotations

import collections
import time
import zlib
from typing import Any

import xxhash

from capture_format.errors import InvalidRecordError
from capture_format.records import check_record_id
from capture_format.tag import CaptureTag, opted_out
from sglang_patch.stats import CaptureStats

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # sglang.srt.constants.HEALTH_CHECK_RID_PREFIX in 0.5.23
MAX_WAITING = 65536
LIVE_SOURCE = "live"


def is_sampled(key: str, sample_rate: float) -> bool:
    """Deterministic per key (a record id or a request id), so a re-sent request is sampled the same way."""
    if sample_rate >= 1.0:
        return True
    return zlib.crc32(key.encode()) / 2**32 < sample_rate


def live_record_id(rid: str) -> str:
    """The record id of a live capture: the request id where it is a valid record id, else its hash."""
    try:
        return check_record_id(f"live-{rid}")
    except InvalidRecordError:
        return f"live-{xxhash.xxh3_64_hexdigest(rid.encode('utf-8', 'surrogatepass'))}"


class Selector:
    """Decides per request whether it is captured; the assembler takes the decision at its first forward."""

    def __init__(self, *, stats: CaptureStats, sample_rate: float, live_sample_rate: float,
                 ttl_s: float = 600.0) -> None:
        self._stats = stats
        self._sample_rate = sample_rate
        self._live_sample_rate = live_sample_rate
        self._ttl_s = ttl_s
        self._waiting: collections.OrderedDict[str, tuple[CaptureTag, float]] = collections.OrderedDict()
        self.keep_decisions = True
        """False in a process that does not capture (another rank ships, or capture is off): requests are
        still salted alike on every rank, but no decision waits for a forward that will not take it."""

    def on_request(self, recv_req: Any) -> None:
        """BEFORE hook body: decide for a `TokenizedGenerateReqInput`; a selected one gets its own cache salt."""
        rid = recv_req.rid
        if not isinstance(rid, str) or rid.startswith(HEALTH_CHECK_RID_PREFIX):
            return
        tag = self.choose(rid, getattr(recv_req.sampling_params, "custom_params", None),
                          token_ids_only=getattr(recv_req, "input_embeds", None) is None
                          and getattr(recv_req, "mm_inputs", None) is None,
                          num_samples=getattr(recv_req.sampling_params, "n", 1) or 1)
        if tag is None:
            return
        # Its own radix-cache namespace: the prefill computes (and the plugin captures) every prompt row.
        salt = getattr(recv_req, "cache_salt", None)
        recv_req.cache_salt = f"{salt}|eagle-tap:{rid}" if salt else f"eagle-tap:{rid}"
        if not self.keep_decisions:
            self._waiting.clear()
            return
        now = time.monotonic()
        self._waiting[rid] = (tag, now)
        self._waiting.move_to_end(rid)
        while len(self._waiting) > MAX_WAITING:
            self._waiting.popitem(last=False)
            self._stats.drop("selection_overflow")
        self._expire(now)

    def choose(self, rid: str, custom_params: object, *, token_ids_only: bool = True,
               num_samples: int = 1) -> CaptureTag | None:
        """The capture tag of a request, or None when it is not captured (counted by why where it matters)."""
        try:
            tag = CaptureTag.from_custom_params(custom_params)
        except ValueError:
            self._stats.drop("invalid_tag")
            return None
        if tag is not None and tag.mode == "generate" and num_samples > 1:
            # n samples of one request would share the tag's record id: all but one would be lost.
            self._stats.drop("generate_tag_with_n_samples")
            return None
        if tag is not None:
            if not is_sampled(tag.record_id, self._sample_rate):
                self._stats.add("sampled_out")
                return None
            return tag
        if self._live_sample_rate <= 0.0 or not is_sampled(rid, self._live_sample_rate):
            return None
        if opted_out(custom_params):
            self._stats.add("live_opted_out")
            return None
        if not token_ids_only:
            self._stats.add("live_skipped_not_token_ids")
            return None
        self._stats.add("live_selected")
        record_id = live_record_id(rid)
        return CaptureTag(record_id=record_id, sample_id=record_id, loss_spans=(), mode="generate",
                          metadata={"source": LIVE_SOURCE, "live_sample_rate": self._live_sample_rate})

    def take(self, rid: str) -> CaptureTag | None:
        """The decision for a request at its first forward (removed: it is taken once)."""
        entry = self._waiting.pop(rid, None)
        return entry[0] if entry is not None else None

    def _expire(self, now: float) -> None:
        while self._waiting:
            rid, (_, decided_at) = next(iter(self._waiting.items()))
            if now - decided_at <= self._ttl_s:
                break
            del self._waiting[rid]
            self._stats.drop("expired_before_scheduling")

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)
