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
- the only work done here is copying the captured rows off the device, once per forward for all
  captured requests (`device_copy.py`: never waits for the device on CUDA); compression and I/O
  happen in the sender thread;
- every host buffer a dropped capture holds is released (a leaked pinned slab would starve capture);
- untagged requests cost one dict lookup each.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Callable

import torch

from capture_format.tag import CaptureTag
from sglang_patch.device_copy import HostCopier, HostRows, RowCopier
from sglang_patch.stats import CaptureStats


@dataclasses.dataclass(kw_only=True, slots=True)
class CapturedSequence:
    """A complete capture in host memory (its last copies may still be landing), waiting for the sender."""

    tag: CaptureTag
    token_ids: list[int]
    chunks: list[HostRows]

    @property
    def raw_nbytes(self) -> int:
        return sum(chunk.nbytes for chunk in self.chunks) + 4 * len(self.token_ids)

    def states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux (T, K*H), final (T, H)) on CPU, once every chunk's copy has landed. Views of the host
        buffers while there is one chunk: read them before `release()`."""
        for chunk in self.chunks:
            chunk.wait()
        if len(self.chunks) == 1:
            return self.chunks[0].aux, self.chunks[0].final
        return torch.cat([chunk.aux for chunk in self.chunks]), torch.cat([chunk.final for chunk in self.chunks])

    def release(self) -> None:
        for chunk in self.chunks:
            chunk.release()


@dataclasses.dataclass(kw_only=True, slots=True)
class _Partial:
    tag: CaptureTag
    chunks: list[HostRows]
    num_rows: int
    updated_at: float

    def release(self) -> None:
        for chunk in self.chunks:
            chunk.release()


def is_sampled(record_id: str, sample_rate: float) -> bool:
    """Deterministic per record id, so a re-sent request is sampled the same way."""
    if sample_rate >= 1.0:
        return True
    return zlib.crc32(record_id.encode()) / 2**32 < sample_rate


class CaptureAssembler:
    """Turns the rows of EXTEND batches into complete `CapturedSequence`s, handed to `emit`."""

    def __init__(self, *, stats: CaptureStats, emit: Callable[[CapturedSequence], None],
                 sample_rate: float = 1.0, partial_ttl_s: float = 600.0, copier: RowCopier | None = None) -> None:
        self._stats = stats
        self._copier = copier or HostCopier()
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
        taken: list[tuple[object, _Partial]] = []  # (req, partial) of each captured request, in batch order
        ranges: list[tuple[int, int]] = []  # its rows in aux and final
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
                    partial.release()
                self._abandoned.pop(rid, None)
                partial = self._partials[rid] = _Partial(tag=tag, chunks=[], num_rows=0, updated_at=now)
                self._stats.add("started")
            elif partial is None:
                if rid not in self._abandoned:
                    self._abandon(rid, "cached_prefix", now)  # its first rows were never computed here
                continue
            elif partial.num_rows != prefix_len:
                self._abandon(rid, "gap", now)
                continue
            taken.append((req, partial))
            ranges.append((start, offset))
        if taken:
            self._copy(taken, ranges, aux, final, now)
        if now - self._last_sweep > 1.0:
            self._sweep(now)

    def _copy(self, taken: list[tuple[object, _Partial]], ranges: list[tuple[int, int]],
              aux: torch.Tensor, final: torch.Tensor, now: float) -> None:
        # The only forward-path work: one copy of every captured request's rows off the device.
        copied = self._copier.copy(aux, final, ranges)
        if copied is None:  # no host buffer free: drop these captures rather than wait
            for req, _ in taken:
                self._abandon(req.rid, "host_buffers_full", now)
            return
        for (req, partial), rows in zip(taken, copied):
            partial.chunks.append(rows)
            partial.num_rows += rows.aux.shape[0]
            partial.updated_at = now
            if partial.num_rows == len(req.full_untruncated_fill_ids):
                del self._partials[req.rid]
                self._finish(req, partial)

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
            partial.release()
            self._stats.drop("spans_out_of_range")
            return
        self._stats.add("captured")
        self._stats.add("captured_tokens", len(token_ids))
        self._emit(CapturedSequence(tag=partial.tag, token_ids=token_ids, chunks=partial.chunks))

    def _abandon(self, rid: str, reason: str, now: float) -> None:
        partial = self._partials.pop(rid, None)
        if partial is not None:
            partial.release()
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
