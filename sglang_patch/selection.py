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

Shared prefixes (`EAGLE_TAP_PREFIX_BLOCK_TOKENS` = B > 0, `capture_format.prefix_blocks`). Instead of
its own cache namespace, a selected request gets a `PrefixPlan`: its prompt is cut at multiples of B
(block ends before its last token), and of those blocks, the ones whose content key this process has
already promised are reused: the request's radix-cache match is capped at the longest reused prefix
(`prefix_cap`, applied by an AFTER hook on `Req._compute_max_prefix_len`, SGLang's own limit for
logprob requests), so its prefill computes every row past it while the cache serves the rest; the
other blocks are promised now and sent with its capture. Its record refers to its last block and
holds only the rows past it. The promises are first-in first-out (`MAX_KNOWN_BLOCKS`, not refreshed
by use), and every `REFRESH_AFTER_USES`-th request that would reuse a chain computes and sends it
again, so a block whose capture was lost (dropped under load, aborted before its prefill) comes back
after at most that many references to it, which dangle until then (a reader counts and skips them).

What must hold:
- the decision for a request is made once, here, and depends only on the settings and the request
  (deterministic in its id: a re-sent request is sampled the same way), so every tensor-parallel
  rank salts it alike and schedules it alike; in prefix mode the promises and caps change only here,
  in request order, the same on every rank (never by what this rank's sender achieved), so every
  rank caps a request's cache match alike;
- a request that is not selected costs a dict lookup and a hash; nothing about it is kept;
- the decisions waiting for their request's first forward are bounded (`MAX_WAITING`, then the
  oldest are dropped and counted) and expire after the partial TTL (a request aborted while queued).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import xxhash

from capture_format.errors import InvalidRecordError
from capture_format.prefix_blocks import prefix_keys
from capture_format.records import check_record_id
from capture_format.tag import CaptureTag, opted_out
from sglang_patch.stats import CaptureStats

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # sglang.srt.constants.HEALTH_CHECK_RID_PREFIX in 0.5.23
MAX_WAITING = 65536
MAX_KNOWN_BLOCKS = 16384
"""Block keys promised, first in first out: each block is sent again at least once per this many promises."""
REFRESH_AFTER_USES = 64
"""Every this-many-th request that would reuse a promised chain computes and sends it again instead, so a
lost block (its capture dropped, or its request aborted before its prefill) leaves at most this many
records dangling, however popular its prefix."""
MAX_CAPS = 65536
DECISION_CHECKPOINT = 8
"""Every this many decisions the selector keeps the digest so far (`Selector.checkpoints`)."""
MAX_CHECKPOINTS = 256
LIVE_SOURCE = "live"


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixPlan:
    """How a selected request's prompt splits into shared-prefix blocks (see the module docstring)."""

    block_tokens: int
    reused: int
    """Tokens whose states come from blocks already promised (0 or a multiple of block_tokens): the
    request's cache match is capped here and its capture holds the rows from here on."""
    keys: tuple[str, ...]
    """Keys of the prompt's first k * block_tokens tokens, k = 1, 2, ... (ends before its last token), in
    no namespace: this process's promises (the sender names the blocks in its model's namespace)."""
    sent_here: tuple[int, ...]
    """Ends of the blocks this capture sends (its own rows), increasing."""

    @property
    def record_prefix(self) -> int:
        """Tokens the record leaves to blocks: all of the prompt's blocks."""
        return len(self.keys) * self.block_tokens


@dataclasses.dataclass(frozen=True, slots=True)
class Selection:
    """A request chosen for capture, waiting for its first forward."""

    tag: CaptureTag
    prefix: PrefixPlan | None
    decided_at: float
    images: bool = False
    """The request has images (SGLang's mm_inputs): its record holds their input embeddings, never a prefix."""


def is_sampled(key: str, sample_rate: float) -> bool:
    """Deterministic per key (a record id or a request id), so a re-sent request is sampled the same way.

    The key's 64-bit xxh3, every bit of which depends on every byte of the key. CRC32, used before, is linear in the
    key's bits, and ids that differ in a digit or two kept far from the rate: 15 of the 320 ids
    `spec<round>xlive0.1x<index>` of the spec-capture benchmark at 10% (0 of its quick run's 96); xxh3 keeps 32 of
    them (uuid4 hex, SGLang's own request ids, about 10% with either)."""
    if sample_rate >= 1.0:
        return True
    return xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogatepass")) / 2**64 < sample_rate


def live_record_id(rid: str) -> str:
    """The record id of a live capture: the request id where it is a valid record id, else its hash."""
    try:
        return check_record_id(f"live-{rid}")
    except InvalidRecordError:
        return f"live-{xxhash.xxh3_64_hexdigest(rid.encode('utf-8', 'surrogatepass'))}"


class Selector:
    """Decides per request whether it is captured; the assembler takes the decision at its first forward."""

    def __init__(self, *, stats: CaptureStats, sample_rate: float, live_sample_rate: float,
                 ttl_s: float = 600.0, prefix_block_tokens: int = 0) -> None:
        self._stats = stats
        self._sample_rate = sample_rate
        self._live_sample_rate = live_sample_rate
        self._ttl_s = ttl_s
        self._block_tokens = prefix_block_tokens
        self._waiting: collections.OrderedDict[str, Selection] = collections.OrderedDict()
        self._known_blocks: collections.OrderedDict[str, int] = collections.OrderedDict()  # promised key -> reuses
        self._caps: collections.OrderedDict[str, int] = collections.OrderedDict()  # rid -> cache match cap
        self.keep_decisions = True
        """False in a process that does not capture (another rank ships, or capture is off): requests are
        still salted alike on every rank, but no decision waits for a forward that will not take it."""
        self._decisions = xxhash.xxh3_64()
        self._num_decisions = 0
        self.checkpoints: collections.OrderedDict[int, str] = collections.OrderedDict()
        """Digest of every decision so far that changes how a request is scheduled (selected or not, its cache
        salt or cap, its plan), taken every DECISION_CHECKPOINT decisions (the last MAX_CHECKPOINTS): equal on
        every rank of a server whose ranks decide alike, whenever each rank happens to write its stats."""

    def _note_decision(self, rid: str, what: str) -> None:
        self._decisions.update(f"{rid}\0{what}\n".encode("utf-8", "surrogatepass"))
        self._num_decisions += 1
        self._stats.set("decisions", self._num_decisions)
        if self._num_decisions % DECISION_CHECKPOINT == 0:
            digest = self._decisions.hexdigest()
            self.checkpoints[self._num_decisions] = digest
            while len(self.checkpoints) > MAX_CHECKPOINTS:
                self.checkpoints.popitem(last=False)
            self._stats.set_text("decisions_checkpoint", f"{self._num_decisions}:{digest}")

    def on_request(self, recv_req: Any) -> None:
        """BEFORE hook body: decide for a `TokenizedGenerateReqInput`; a selected one gets its own cache salt."""
        rid = recv_req.rid
        if not isinstance(rid, str) or rid.startswith(HEALTH_CHECK_RID_PREFIX):
            return
        tag = self.choose(rid, getattr(recv_req.sampling_params, "custom_params", None),
                          token_ids_only=getattr(recv_req, "input_embeds", None) is None,
                          num_samples=getattr(recv_req.sampling_params, "n", 1) or 1)
        if tag is None:
            self._note_decision(rid, "-")
            return
        input_ids = getattr(recv_req, "input_ids", None)
        # A prefix key is made of ids, the same placeholder for any image: a request with images shares none.
        images = getattr(recv_req, "mm_inputs", None) is not None
        plan = self._plan_prefix(input_ids) if self._block_tokens and input_ids and not images else None
        self._note_decision(rid, tag.record_id if plan is None else f"{tag.record_id}:{plan.reused}:{plan.sent_here}")
        if plan is not None:  # the cache may serve its reused blocks, nothing past them (0: nothing)
            self._caps[rid] = plan.reused
            self._caps.move_to_end(rid)
            while len(self._caps) > MAX_CAPS:
                self._caps.popitem(last=False)
        else:
            # Its own radix-cache namespace: the prefill computes (and the plugin captures) every prompt row.
            salt = getattr(recv_req, "cache_salt", None)
            recv_req.cache_salt = f"{salt}|eagle-tap:{rid}" if salt else f"eagle-tap:{rid}"
        if not self.keep_decisions:
            self._waiting.clear()
            return
        now = time.monotonic()
        self._waiting[rid] = Selection(tag, plan, now, images)
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
        if tag is not None and not token_ids_only:
            # Embeddings the client gave instead of ids: no token of them is known, and the plugin does not
            # store them (images are stored: their input embeddings go into the record, `capture.py`).
            self._stats.drop("tagged_not_token_ids")
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

    def _plan_prefix(self, input_ids: list[int]) -> PrefixPlan:
        """Cuts a prompt into blocks, reuses the longest promised prefix and promises the blocks past it."""
        size = self._block_tokens
        ends = range(size, len(input_ids), size)  # blocks end before the last token: the record keeps a row
        keys = prefix_keys(input_ids, ends) if len(ends) else []
        known = self._known_blocks
        longest = next((index for index in reversed(range(len(keys))) if keys[index] in known), None)
        reused, refresh = 0, False
        if longest is not None:
            known[keys[longest]] += 1
            refresh = known[keys[longest]] >= REFRESH_AFTER_USES
            if refresh:  # this request computes and sends the whole chain again (a lost block comes back)
                self._stats.add("prefix_chains_refreshed")
            else:
                reused = ends[longest]
        sent_here = tuple(end for end, key in zip(ends, keys) if end > reused and (refresh or key not in known))
        for end in sent_here:
            key = keys[end // size - 1]
            known.pop(key, None)
            known[key] = 0  # promised now: last out, no use yet
        while len(known) > MAX_KNOWN_BLOCKS:
            known.popitem(last=False)
        if reused:
            self._stats.add("prefix_tokens_reused", reused)
        return PrefixPlan(size, reused, tuple(keys), sent_here)

    def prefix_cap(self, rid: str) -> int | None:
        """The longest cache match a selected request may use (prefix mode), or None: not limited."""
        return self._caps.get(rid)

    def take(self, rid: str) -> Selection | None:
        """The decision for a request at its first forward (removed: it is taken once)."""
        return self._waiting.pop(rid, None)

    def _expire(self, now: float) -> None:
        while self._waiting:
            rid, selection = next(iter(self._waiting.items()))
            if now - selection.decided_at <= self._ttl_s:
                break
            del self._waiting[rid]
            self._stats.drop("expired_before_scheduling")

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)
