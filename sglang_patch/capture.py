"""Row-to-request mapping and chunk assembly: what runs on the scheduler's thread after each forward.

An EXTEND batch lays its rows out request by request in `batch.reqs` order; request `i` owns
`extend_lens[i]` rows starting at the sum of the lengths before it, covering tokens
`[prefix_lens[i], prefix_lens[i] + extend_lens[i])` of its sequence. Chunked prefill splits one
request over several batches; its chunks are accumulated here and a record is emitted at the chunk
that ends the sequence.

What must hold:
- a record holds exactly the rows of its own request, for every token of the sequence, in order;
  anything else (a first chunk with a cached prefix, a gap between chunks, a chunk that never comes)
  drops the capture with a counted reason and never emits it;
- the only work done here is copying the request's rows off the device; compression and I/O happen
  in the sender thread;
- untagged requests cost one dict lookup each.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Callable

import torch

from capture_format.tag import CaptureTag
from sglang_patch.stats import CaptureStats


@dataclasses.dataclass(kw_only=True, slots=True)
class CapturedSequence:
    """A complete capture, copied to host memory, waiting for the sender."""

    tag: CaptureTag
    token_ids: list[int]
    aux: torch.Tensor  # (T, K*H) on CPU
    final: torch.Tensor  # (T, H) on CPU

    @property
    def raw_nbytes(self) -> int:
        return self.aux.nbytes + self.final.nbytes + 4 * len(self.token_ids)


@dataclasses.dataclass(kw_only=True, slots=True)
class _Partial:
    tag: CaptureTag
    aux_chunks: list[torch.Tensor]
    final_chunks: list[torch.Tensor]
    num_rows: int
    updated_at: float


def is_sampled(record_id: str, sample_rate: float) -> bool:
    """Deterministic per record id, so a re-sent request is sampled the same way."""
    if sample_rate >= 1.0:
        return True
    return zlib.crc32(record_id.encode()) / 2**32 < sample_rate


class CaptureAssembler:
    """Turns the rows of EXTEND batches into complete `CapturedSequence`s, handed to `emit`."""

    def __init__(self, *, stats: CaptureStats, emit: Callable[[CapturedSequence], None],
                 sample_rate: float = 1.0, partial_ttl_s: float = 600.0) -> None:
        self._stats = stats
        self._emit = emit
        self._sample_rate = sample_rate
        self._partial_ttl_s = partial_ttl_s
        self._partials: dict[str, _Partial] = {}
        # Requests whose capture was dropped mid-way: their later chunks are ignored, not re-counted.
        self._abandoned: dict[str, float] = {}
        self._last_sweep = time.monotonic()

    @property
    def num_partials(self) -> int:
        return len(self._partials)

    def on_extend(self, reqs: list, prefix_lens: list[int], extend_lens: list[int],
                  aux: torch.Tensor, final: torch.Tensor) -> None:
        """Take the rows of one EXTEND batch. aux: (rows, K*H), final: (rows, H), device tensors."""
        now = time.monotonic()
        offset = 0
        for req, prefix_len, extend_len in zip(reqs, prefix_lens, extend_lens):
            start, offset = offset, offset + extend_len
            tag = self._tag_of(req, first_chunk=prefix_len == 0)
            if tag is None:
                continue
            rid = req.rid
            partial = self._partials.get(rid)
            if prefix_len == 0:
                if partial is not None:
                    self._stats.add("restarted")  # retracted and prefilled again from scratch
                self._abandoned.pop(rid, None)
                partial = self._partials[rid] = _Partial(tag=tag, aux_chunks=[], final_chunks=[], num_rows=0,
                                                         updated_at=now)
                self._stats.add("started")
            elif partial is None:
                if rid not in self._abandoned:
                    self._abandon(rid, "cached_prefix", now)  # its first rows were never computed here
                continue
            elif partial.num_rows != prefix_len:
                self._abandon(rid, "gap", now)
                continue
            # The only forward-path work: copy this request's rows off the device (or out of static buffers).
            partial.aux_chunks.append(aux[start:offset].to("cpu", copy=True))  # (n, K*H)
            partial.final_chunks.append(final[start:offset].to("cpu", copy=True))  # (n, H)
            partial.num_rows += extend_len
            partial.updated_at = now
            if partial.num_rows == len(req.full_untruncated_fill_ids):
                del self._partials[rid]
                self._finish(req, partial)
        if now - self._last_sweep > 1.0:
            self._sweep(now)

    def _tag_of(self, req, *, first_chunk: bool) -> CaptureTag | None:
        partial = self._partials.get(req.rid)
        if partial is not None:
            return partial.tag
        custom_params = getattr(req.sampling_params, "custom_params", None)
        if not custom_params:
            return None
        try:
            tag = CaptureTag.from_custom_params(custom_params)
        except ValueError:
            if first_chunk:
                self._stats.drop("invalid_tag")
            return None
        if tag is not None and not is_sampled(tag.record_id, self._sample_rate):
            if first_chunk:
                self._stats.add("sampled_out")
            return None
        return tag

    def _finish(self, req, partial: _Partial) -> None:
        token_ids = list(req.full_untruncated_fill_ids)
        spans = partial.tag.loss_spans
        if spans and spans[-1][1] > len(token_ids):
            self._stats.drop("spans_out_of_range")
            return
        aux = partial.aux_chunks[0] if len(partial.aux_chunks) == 1 else torch.cat(partial.aux_chunks)
        final = partial.final_chunks[0] if len(partial.final_chunks) == 1 else torch.cat(partial.final_chunks)
        self._stats.add("captured")
        self._stats.add("captured_tokens", len(token_ids))
        self._emit(CapturedSequence(tag=partial.tag, token_ids=token_ids, aux=aux, final=final))

    def _abandon(self, rid: str, reason: str, now: float) -> None:
        self._partials.pop(rid, None)
        self._abandoned[rid] = now
        self._stats.drop(reason)

    def _sweep(self, now: float) -> None:
        self._last_sweep = now
        for rid, partial in list(self._partials.items()):
            if now - partial.updated_at > self._partial_ttl_s:
                self._abandon(rid, "expired", now)
        for rid, abandoned_at in list(self._abandoned.items()):
            if now - abandoned_at > self._partial_ttl_s:
                del self._abandoned[rid]
