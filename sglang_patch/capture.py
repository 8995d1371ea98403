"""Row-to-request mapping and chunk assembly: what runs on the scheduler's thread after each forward.

An EXTEND batch lays its rows out request by request in `batch.reqs` order; request `i` owns
`extend_lens[i]` rows starting at the sum of the lengths before it, covering tokens
`[prefix_lens[i], prefix_lens[i] + extend_lens[i])` of its sequence. Chunked prefill splits one
request over several batches; its chunks are accumulated here. A DECODE batch has one row per
request, in `batch.reqs` order: the state of the token the step reads (the last one sampled).

In prefix mode (`selection.PrefixPlan`) a capture holds the rows from the end of the prompt's reused
blocks on (its first row): the cache may serve the tokens before it, and rows of tokens before it
that a prefill computes anyway are skipped.

On a replica that serves an EAGLE-3 draft (`speculative.py`) a decode step is a verify forward: `on_verify`
hands the copier one block of candidate rows for all the step's captured requests (each request's accepted
path, `num_steps + 1` rows), and after the scheduler processed the step `on_verify_processed` notes, per
request, how many of its rows the step accepted (a reference into the block, no copy, no tensor op); every
`_RUN_MAX_STEPS` steps and at a part boundary the rows noted are joined into one block on the copy thread
(`RowCopier.join_all`), so a record reaches the sender in a few blocks, not one per step, and every capture's at
once when the forward outputs they keep alive together reach `_RUN_MAX_BYTES`; the rows noted
since the last join go with the record unjoined, and the sender joins them (`CapturedSequence.run`). The counts go into
the record as `served_draft` metadata, made on the sender's thread too (`CapturedSequence.served`).

A capture in "prefill" mode is emitted at the chunk that ends the prompt. One in "generate" mode
(`capture_format.tag`) goes on taking one row per decode step (noted as a verify step's rows are: one
block of the step's captured rows, `RowCopier.gather_decode`, joined with the steps after it) and is
emitted when its request finishes (`on_finished`, after the scheduler processed the batch): prompt +
generated tokens, with states for all but the last token (no forward ran on it). A retracted request
(its KV freed under memory pressure) is prefilled again later over prompt + tokens so far; the rows it
already has are kept and only rows past them are taken from the new prefill.

A long capture is sent in parts (`capture_format.parts`): once a capture holds more rows than a part
(`part_max_tokens`, `part_max_bytes`), the oldest part's rows go to the sender as a part of their own,
and in prefix mode each of the plan's blocks goes as soon as its rows are held; the record that ends
the capture refers to the last of them and holds only the rows after it. A retracted request keeps
what it sent: its new prefill's rows before the first row still held are not taken again.

A request with images (SGLang's `multimodal_inputs`) is captured whole: no prefix blocks (`selection.py`),
no parts. Its extends also give the target's input embeddings of their tokens (`mm_input_embeds`, the
tensor SGLang hands an EAGLE-3 draft); the rows at its image positions (the items' `offsets`) are copied
with the states, and its record marks those positions and holds them (`capture_format` schema 2). Its
token ids there are the image placeholder id, not the radix cache's pad values SGLang puts in their
place, and no loss span covers them. A tag's loss spans count each image as one token (its placeholder, as
a client that tokenizes its prompt sends it, one per image, for SGLang to expand): they are moved onto the
expanded ids here.

What must hold:
- a record holds exactly the rows of its own request, for every token of the sequence (but the
  last, in generate mode), in order, with the parts sent before it; anything else (a first chunk with
  a cached prefix, a gap, a chunk that never comes, an aborted request, a row count that disagrees
  with the tokens at the end) drops the capture with a counted reason and never emits its record
  (parts already sent are then never closed: the collector removes them after its part timeout);
- a capture holds at most one part's rows plus one forward's (`most_rows_held` in the stats); parts
  are cut only within the tokens the request already has, and never take its newest row (nor, in
  generate mode, the one before: the overlap scheduler may run a step past the last token);
- the only work done here is queueing the copy of the captured rows off the device, once per forward for
  all captured requests (`device_copy.py`: never waits for the device on CUDA, copies nothing on this thread
  on CPU unless a CPU graph runner replays the forward, and for a small extend forward only notes each
  capture's rows as a piece of its outputs, `ForwardRows`, joined later as a step's are; a verify step costs a
  few Python operations per captured request and no tensor op on CPU; an image request's embedding rows are
  the exception: a plain copy, which waits on CUDA, once per extend that holds image positions, not yet
  through the row copier);
  compression and I/O happen in the sender thread;
- every host buffer a dropped capture holds is released (a leaked pinned slab would starve capture);
- requests that are not captured cost one dict lookup each in an extend batch, and nothing in Python in a decode
  or verify batch while few requests are captured (one look-up each past `_SCAN_MAX_CAPTURES`); a DECODE batch
  costs nothing while no generate capture is running.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from capture_format.records import num_span_positions
from capture_format.tag import CaptureTag
from sglang_patch.device_copy import (
    ForwardRows,
    HostCopier,
    HostRows,
    RowCopier,
    RowPiece,
    VerifyRows,
    host_copy,
    release_pieces,
)
from sglang_patch.selection import PrefixPlan, Selection, Selector, is_sampled
from sglang_patch.speculative import METADATA_KEY, SpecServing, served_draft_metadata, verified_steps
from sglang_patch.stats import CaptureStats

__all__ = ["CaptureAssembler", "CapturedSequence", "ImageInputs", "image_inputs_of", "is_sampled"]


@dataclasses.dataclass(frozen=True, slots=True)
class ImageInputs:
    """Where a request's images are: half-open spans of its token positions, and the placeholder id there."""

    spans: tuple[tuple[int, int], ...]
    placeholder_id: int | None

    @property
    def num_positions(self) -> int:
        return num_span_positions(self.spans)

    def expanded_spans(self, spans: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        """Spans over the ids with one placeholder per image, moved onto the expanded ids (image k's tokens at
        spans[k]); a span that covers a placeholder covers its whole image (then cut: `spans_without`)."""
        sent_starts, shifts, shift = [], [], 0  # image k's placeholder in the sent ids, and the shift past it
        for start, end in self.spans:
            sent_starts.append(start - shift)
            shift += end - start - 1
            shifts.append(shift)

        def moved(position: int) -> int:
            index = bisect.bisect_left(sent_starts, position)  # images whose placeholder is before `position`
            return position + (shifts[index - 1] if index else 0)

        return tuple((moved(start), moved(end)) for start, end in spans)

    def positions_in(self, start: int, end: int) -> list[int]:
        """The image positions p with start <= p < end, in order."""
        return [position for low, high in self.spans if low < end and start < high
                for position in range(max(low, start), min(high, end))]


def image_inputs_of(req) -> ImageInputs | None:
    """A request's images from SGLang's `req.multimodal_inputs` (item offsets are inclusive pairs); None: none."""
    inputs = getattr(req, "multimodal_inputs", None)
    if inputs is None:
        return None
    spans = sorted((int(start), int(end) + 1) for item in inputs.mm_items for start, end in (item.offsets or ()))
    if not spans:
        return None
    placeholder = getattr(inputs, "im_token_id", None)
    return ImageInputs(tuple(spans), int(placeholder) if placeholder is not None else None)


@dataclasses.dataclass(kw_only=True, slots=True)
class CapturedSequence:
    """A complete capture in host memory (its last copies may still be landing), waiting for the sender."""

    tag: CaptureTag
    token_ids: list[int] | np.ndarray
    """The sequence's token ids (a part's: int32, up to its end: a 64K-token Python list would be 2.3 MB)."""
    chunks: list[HostRows]
    loss_spans: tuple[tuple[int, int], ...]
    """The tag's spans, plus the generated tokens in generate mode."""
    num_states: int
    """Rows of states: len(token_ids), or one fewer when the last token has none (generate mode)."""
    metadata: dict
    """The tag's metadata, plus in generate mode how the generation ended (`finish_reason`); on a replica that
    serves a draft the record's also holds what the draft did (`record_metadata`, from `served`)."""
    prefix: PrefixPlan | None = None
    """Prefix mode: the blocks reused and sent; the chunks then hold the rows from token prefix.reused on."""
    blocks_only: bool = False
    """Send only this capture's blocks, not its record (a capture dropped after its prompt's rows were taken)."""
    part_index: int | None = None
    """A part of a capture sent in parts (`capture_format.parts`): token_ids are the tokens up to the part's
    end, the chunks its rows from rows_start on."""
    parts_before: int = 0
    """The record closes this many parts sent before it; its chunks hold the rows from rows_start on."""
    rows_start: int | None = None
    """The token of the chunks' first row, when rows were sent ahead of these (else from prefix)."""
    block_ends: tuple[int, ...] | None = None
    """Blocks only: the ends of the plan's blocks these chunks hold (None: all of prefix.sent_here)."""
    input_embed_spans: tuple[tuple[int, int], ...] = ()
    """A capture of a request with images: its image positions (`ImageInputs.spans`)."""
    input_embeds: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Host tensors (n, H) whose rows, joined, are the target's input embeddings at those positions, in order."""
    run: list[RowPiece] = dataclasses.field(default_factory=list)
    """A generate capture's last kept rows of decode or verify steps, after the chunks, not joined yet: the
    sender joins them (`states`), so a finishing capture costs the scheduler's thread no join."""
    served: tuple[str, SpecServing, list[int], int] | None = None
    """A generate capture on a replica that serves a draft: (draft identity, how it drafts, the drafts each
    verify step accepted, the tokens generated), made into the record's `served_draft` metadata off the
    scheduler's thread (`record_metadata`)."""
    run_held_nbytes: int = 0
    """Bytes the pieces of `run` keep alive by reference (on CPU: the forward outputs they are pieces of, each its
    share of a step shared by several captures, `_KeptOutputs.share_nbytes`); 0 where they are copies (CUDA's
    pinned slabs, which their pool bounds)."""
    _raw_nbytes: int | None = dataclasses.field(default=None, init=False, repr=False)

    def record_metadata(self) -> dict:
        """The record's metadata: `metadata`, with `served_draft` made from `served` (the sender's thread)."""
        if self.served is not None:
            draft, spec, accepted, num_generated = self.served
            self.metadata = {**self.metadata, METADATA_KEY: served_draft_metadata(
                draft=draft, spec=spec, accepted=verified_steps(accepted, num_generated))}
            self.served = None
        return self.metadata

    @property
    def first_row(self) -> int:
        """The token whose states are the first row of the chunks."""
        if self.rows_start is not None:
            return self.rows_start
        return self.prefix.reused if self.prefix else 0

    @property
    def raw_nbytes(self) -> int:
        """Bytes of its states, token ids and input embeddings (the sender's in-flight count: computed once)."""
        if self._raw_nbytes is None:
            embeds = sum(rows.numel() * rows.element_size() for rows in self.input_embeds)
            run = sum(end - start for _, start, end in self.run) * self.run[0][0].row_nbytes if self.run else 0
            self._raw_nbytes = sum(chunk.nbytes for chunk in self.chunks) + run + 4 * len(self.token_ids) + embeds
        return self._raw_nbytes

    @property
    def inflight_nbytes(self) -> int:
        """What the sender counts in flight for it (`inflight_max_bytes`): `raw_nbytes` and `run_held_nbytes`. A
        finishing capture's last steps, or a small prefill's rows, may keep many times their own bytes alive; a
        forward shared by several captures is counted a share by each, so that records finishing together count
        it about once (at most `_RUN_MAX_BYTES` of forwards in all)."""
        return self.raw_nbytes + self.run_held_nbytes

    def state_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(aux (S, K*H), final (S, H)) as numpy integers of the states' width (their bytes: numpy has no bfloat16),
        once every chunk's copy has landed, S = num_states - first_row: the sender's input (`to_records`).

        The chunks' rows and the run's pieces are joined by one numpy concatenation on the calling thread (the
        sender's: a torch op there would start a second OpenMP team beside the forward's, `host_cat`) into one
        chunk that replaces them (their holds given up). One chunk, or one piece of an extend forward (a prefill
        capture's rows, on CPU), is read in place: views, to read before `release()` (cold, a copy of a 384-token
        record's rows at hidden 128 costs the sender ~110 us, the view ~26). Joining the pieces into a chunk of
        torch tensors first, then the chunks, cost a 62-token record of 16 pieces ~210 us cold against ~140
        (`scripts/bench_scheduler_hooks.py --records`)."""
        if self.run or len(self.chunks) > 1:
            sources = [(chunk, 0, chunk.aux.shape[0]) for chunk in self.chunks] + self.run
            first = sources[0][0]
            if len(sources) == 1 and type(first) is ForwardRows:
                start, end = sources[0][1:]
                self.chunks = [HostRows(aux=first.aux[start:end], final=first.final[start:end])]  # (n, K*H), (n, H)
            else:
                arrays = [rows.arrays(start, end) for rows, start, end in sources]  # each waits for its copy
                aux = torch.from_numpy(np.concatenate([aux for aux, _ in arrays])).view(first.aux.dtype)
                final = torch.from_numpy(np.concatenate([final for _, final in arrays])).view(first.final.dtype)
                for chunk in self.chunks:
                    chunk.release()
                self.chunks = [HostRows(aux=aux, final=final)]
            release_pieces(self.run)
            self.run = []
        chunk = self.chunks[0]
        aux, final = chunk.arrays(0, chunk.aux.shape[0])
        held = self.num_states - self.first_row
        return aux[:held], final[:held]

    @property
    def state_dtype(self) -> torch.dtype:
        """The dtype its rows are held in (the forward's, aux and final alike)."""
        return (self.chunks[0] if self.chunks else self.run[0][0]).aux.dtype

    def states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`state_arrays` as CPU tensors of `state_dtype`: (aux (S, K*H), final (S, H))."""
        aux, final = self.state_arrays()
        return torch.from_numpy(aux).view(self.state_dtype), torch.from_numpy(final).view(self.state_dtype)

    def release(self) -> None:
        for chunk in self.chunks:
            chunk.release()
        release_pieces(self.run)
        self.run = []


_RUN_MAX_STEPS = 64
"""Decode or verify steps whose kept rows a capture notes before they are joined into one block
(`RowCopier.join_all`): bounds the candidate rows it keeps alive to 64 steps' blocks, while a 48-token answer is
joined once, at its end."""
_RUN_MAX_BYTES = 64 << 20
"""The forward outputs that all running captures' unjoined rows keep alive, together (where the copier keeps
references: on CPU a decode or verify step's block is the whole forward's outputs, shared by the step's captures):
each step's counted once, and when they reach this every capture's rows are joined, in one hand-over to the copy
thread (`RowCopier.join_all`). Counted per capture instead (16 MiB each, before), a step of 32 captured requests at
hidden 7168 (7.3 MB of outputs) had every capture join every third step, each its own hand-over: 3.3-3.4 us of the
scheduler's thread per captured token against 1.9-2.0 now (`scripts/bench_scheduler_hooks.py --batch 32`, its
hidden-7168 rows). What the unjoined rows keep alive is then at most this and a step's outputs, in all."""
_SCAN_MAX_CAPTURES = 48
"""Up to this many running generate captures, a decode or verify step finds their requests in its batch by a scan
each (`_Partial.req`, as its last extend batch held it, by `list.index`, in C: the batch's requests that are not
captured cost nothing in Python); past it, by looking every request of the batch up in `_generating`. Cold, as after
a forward, a scan costs ~10 ns per request of the batch it passes and a look-up ~0.5 us, so the scans are cheaper
below about 50 captures whatever the batch's size. At 256 requests (`scripts/bench_scheduler_hooks.py --batch 256
[--draftless]`), all captured, a verify forward's hook took ~0.5 ms a step with the scans and ~0.15 with the
look-ups; one captured, a decode forward's hook ~0.1 ms with the look-ups and ~0.03 with its scan. Each step keeps
its two loops whole: handing the requests found from one loop to another cost batch 8 about 2 us a step, and 256
decode requests all captured 10-25%."""


def _first_verify_step(partial: _Partial, req) -> bool:
    """At a capture's first verify step: rows are added by verify steps from now on, so its prompt's must all be
    held (False: a prompt chunk never came); notes SGLang's count of the request's verify steps before it."""
    if partial.rows_end < len(req.origin_input_ids):
        return False
    partial.verify_ct_base = int(getattr(req, "spec_verify_ct", 0)) - len(partial.accepted)
    return True

# SGLang's finish reasons (schedule_batch.py), as the client's regenerate mode names them.
_FINISH_REASONS = {"FINISH_MATCHED_TOKEN": "stop", "FINISH_MATCHED_STR": "stop", "FINISHED_MATCHED_REGEX": "stop",
                   "FINISH_LENGTH": "length"}


@dataclasses.dataclass(kw_only=True, slots=True)
class _Partial:
    tag: CaptureTag
    prefix: PrefixPlan | None
    chunks: list[HostRows]
    num_rows: int
    updated_at: float
    pending: list[tuple[HostRows | VerifyRows, int, int]] = dataclasses.field(default_factory=list)
    """Verify steps' candidate rows, oldest first, until the scheduler says how many each step accepted: (the
    step's block, the first of this request's rows in it, the request's position in the verified batch); each
    holds the block's lease once."""
    run: list[RowPiece] = dataclasses.field(default_factory=list)
    """The rows kept of decode or verify steps, oldest first, not yet joined into a chunk: they follow the chunks."""
    run_held_nbytes: int = 0
    """This capture's share of the host bytes the blocks of `run` keep alive (`_KeptOutputs.share_nbytes`)."""
    run_cut_rows: int = 0
    """Held rows from which a part may be due (`_part_rows` + 2), set at the first verify step kept."""
    req: object = None
    """SGLang's `Req` of the request, as its last extend batch held it: a verify step finds the request's
    position in its batch by identity (`list.index`, a scan in C) instead of looking up every request."""
    accepted: list[int] = dataclasses.field(default_factory=list)
    """Draft tokens each verify step of this request accepted, in order."""
    verify_ct_base: int | None = None
    """SGLang's `req.spec_verify_ct` before this capture's first verify step."""
    chunks_start: int = 0
    """The token of the first row held in chunks: first_row, or the end of the last part sent."""
    num_parts: int = 0
    """Parts of this capture handed to the sender (`_cut_parts`)."""
    plan_sent: bool = False
    """Prefix mode: the plan's blocks were handed to the sender ahead of the first part."""
    images: ImageInputs | None = None
    """Where the request's images are; None for a text request."""
    embeds: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Host copies of the input embeddings at its image positions taken so far, in order (`ImageInputs`)."""
    num_embeds: int = 0
    """Image positions whose embeddings are in `embeds`."""

    @property
    def first_row(self) -> int:
        return self.prefix.reused if self.prefix else 0

    @property
    def rows_end(self) -> int:
        """One past the last token whose row is held (or was sent in a part)."""
        return self.chunks_start + self.num_rows

    def take_rows(self, end: int) -> list[HostRows]:
        """Removes and returns the held rows of tokens [chunks_start, end), cutting a chunk in two where needed."""
        assert not self.run, "verify rows are joined into a chunk before rows are taken"
        taken, count = [], end - self.chunks_start
        assert 0 < count <= self.num_rows, "rows taken must be held"
        while count:
            chunk = self.chunks[0]
            rows = chunk.aux.shape[0]
            if rows > count:
                chunk, self.chunks[0] = chunk.split(count)
                rows = count
            else:
                self.chunks.pop(0)
            taken.append(chunk)
            count -= rows
        self.num_rows -= end - self.chunks_start
        self.chunks_start = end
        return taken

    def note_rows(self, block: HostRows | VerifyRows, start: int, end: int) -> None:
        """Notes rows [start, end) of a decode or verify step's block as this capture's next rows; the hold on the
        block's lease moves to `run`."""
        self.run.append((block, start, end))
        self.run_held_nbytes += block.share_nbytes
        self.num_rows += end - start

    @property
    def run_full(self) -> bool:
        """The rows noted are due to be joined: `_RUN_MAX_STEPS` pieces (the bytes they keep alive are bounded for
        all captures together, `CaptureAssembler._join_runs_if_due`)."""
        return len(self.run) >= _RUN_MAX_STEPS

    def drop_pending(self) -> None:
        """Gives up the verify steps not processed yet (their holds on their blocks)."""
        release_pieces([(block, start, start) for block, start, _ in self.pending])
        self.pending = []

    def release(self) -> None:
        for chunk in self.chunks:
            chunk.release()
        self.drop_pending()
        release_pieces(self.run)
        self.run, self.run_held_nbytes = [], 0


class CaptureAssembler:
    """Turns the rows of EXTEND and DECODE batches into complete `CapturedSequence`s, handed to `emit`."""

    def __init__(self, *, stats: CaptureStats, emit: Callable[[CapturedSequence], bool | None],
                 selector: Selector | None = None, partial_ttl_s: float = 600.0,
                 copier: RowCopier | None = None,
                 served_draft: Callable[[], tuple[str, SpecServing] | None] | None = None,
                 part_max_tokens: int = 1 << 20, part_max_bytes: int = 1 << 62) -> None:
        self._stats = stats
        self._part_max_tokens = part_max_tokens
        self._part_max_bytes = part_max_bytes
        self._most_rows_held = 0
        self._served_draft = served_draft or (lambda: None)
        """(draft identity, how it drafts) on a replica that serves a draft; None on one without."""
        self._copier = copier or HostCopier()
        self._emit = emit
        """Hands a capture (or a part of one) to the sender; False when it was dropped there."""
        self.selector = selector or Selector(stats=stats, sample_rate=1.0, live_sample_rate=0.0, ttl_s=partial_ttl_s)
        self._partial_ttl_s = partial_ttl_s
        self._partials: dict[str, _Partial] = {}
        self._generating: dict[str, _Partial] = {}
        """The partials in generate mode: decode batches are looked at only while there is one."""
        self._kept_nbytes = 0
        """Bytes of the forward outputs noted into captures' runs since every run was last joined (each forward
        counted once, where the copier keeps references): bounded by `_RUN_MAX_BYTES`."""
        self._last_sweep = time.monotonic()

    @property
    def num_partials(self) -> int:
        return len(self._partials)

    @property
    def generating(self) -> bool:
        """Whether a generate-mode capture is running (decode rows and finishes matter)."""
        return bool(self._generating)

    @property
    def idle(self) -> bool:
        """Whether no capture is running nor any request waits for its first forward: an extend batch then has
        nothing to give (at a low sampling rate, most of them)."""
        return not self._partials and not self.selector.num_waiting

    def on_extend(self, reqs: list, prefix_lens: list[int], extend_lens: list[int],
                  aux: torch.Tensor, final: torch.Tensor, input_embeds: torch.Tensor | None = None) -> None:
        """Take the rows of one EXTEND (or MIXED) batch. aux: (rows, K*H), final: (rows, H), device tensors;
        input_embeds (rows, H): the target's input embeddings of the batch's tokens, where it has images."""
        now = time.monotonic()
        offset = 0
        taken: list[tuple[object, _Partial]] = []  # (req, partial) of each captured request, in batch order
        ranges: list[tuple[int, int]] = []  # its rows in aux and final
        for req, prefix_len, extend_len in zip(reqs, prefix_lens, extend_lens):
            start, offset = offset, offset + extend_len
            rid = req.rid
            partial = self._partials.get(rid)
            if partial is None:
                selection = self.selector.take(rid)
                if selection is None:
                    continue  # not captured, or its capture was dropped already
                partial = self._start(rid, selection, now)
                if prefix_len > partial.first_row:  # rows it needs were never computed here (a cache hit)
                    self._abandon(rid, "cached_prefix", now)
                    continue
                if selection.images:
                    partial.images = image_inputs_of(req)
                    if partial.images is not None:
                        spans = partial.images.expanded_spans(partial.tag.loss_spans)
                        partial.tag = dataclasses.replace(partial.tag, loss_spans=spans)
            elif prefix_len <= partial.first_row and partial.num_rows > 0:
                self._stats.add("restarted")  # retracted and prefilled again from its first row
                self._restart(partial, now)
            partial.req = req
            # Rows already held (a retracted request prefilled again), or before its first row, are not taken.
            first_new = partial.rows_end - prefix_len
            if first_new < 0:
                self._abandon(rid, "gap", now)
                continue
            if first_new >= extend_len:
                continue
            if partial.images is not None and not self._take_embeds(partial, input_embeds, start - prefix_len,
                                                                    prefix_len + first_new, prefix_len + extend_len):
                self._abandon(rid, "image_embeds_missing", now)
                continue
            taken.append((req, partial))
            ranges.append((start + first_new, offset))
        if taken:
            self._copy(taken, ranges, aux, final, now, prefill=True)
        self._maybe_sweep(now)

    def _take_embeds(self, partial: _Partial, input_embeds: torch.Tensor | None, row_of_token_0: int,
                     start: int, end: int) -> bool:
        """Copies the input embeddings of the image positions among tokens [start, end) (batch row of token t:
        row_of_token_0 + t); False when this batch's rows have none to give (the capture cannot be whole)."""
        positions = partial.images.positions_in(start, end)
        if not positions:
            return True
        if input_embeds is None or row_of_token_0 + end > input_embeds.shape[0]:
            return False
        rows = torch.tensor(positions, dtype=torch.long, device=input_embeds.device) + row_of_token_0  # (n,)
        partial.embeds.append(host_copy(input_embeds.index_select(0, rows)))  # (n, H)
        partial.num_embeds += len(positions)
        return True

    def on_decode(self, reqs: list, aux: torch.Tensor, final: torch.Tensor) -> None:
        """Take the rows of one DECODE batch: row i is the state of request i's newest token. One block for all
        captured requests (`RowCopier.gather_decode`: on CPU references to the forward's outputs, no tensor op),
        each capture noting its row in it; the rows noted are joined as a verify step's are (`_flush_run`)."""
        now = time.monotonic()
        taken: list[_Partial] = []
        positions: list[int] = []
        missing: list[str] = []  # a prompt chunk never came: this step's row would take the place of one of its rows
        generating = self._generating
        if len(generating) > _SCAN_MAX_CAPTURES:  # many: every request of the batch looked up
            for position, req in enumerate(reqs):
                partial = generating.get(req.rid)
                if partial is not None:
                    if partial.rows_end < len(req.origin_input_ids):
                        missing.append(req.rid)
                    else:
                        taken.append(partial)
                        positions.append(position)
        else:  # few: each capture's own request, by a scan
            for rid, partial in generating.items():
                try:
                    position = reqs.index(partial.req)
                except ValueError:  # not in this batch (its prefill is still running, or it was retracted)
                    continue
                if partial.rows_end < len(partial.req.origin_input_ids):
                    missing.append(rid)
                else:
                    taken.append(partial)
                    positions.append(position)
        for rid in missing:
            self._abandon(rid, "missing_rows", now)
        if taken:
            block = self._copier.gather_decode(aux, final, positions)
            if block is None:  # no host buffer free: drop these captures rather than wait
                for position in positions:
                    self._abandon(reqs[position].rid, "host_buffers_full", now)
            else:
                self._share_out(block, len(taken))
                for slot, (partial, position) in enumerate(zip(taken, positions)):
                    partial.note_rows(block, slot, slot + 1)
                    partial.updated_at = now
                    self._join_if_due(reqs[position], partial, now)
                self._join_runs_if_due()
        self._maybe_sweep(now)

    def on_verify(self, reqs: list, aux: torch.Tensor, final: torch.Tensor, accept_index: torch.Tensor,
                  num_draft_tokens: int) -> None:
        """Take the candidate rows of one verify forward (`speculative.py`): aux (bs * D, K*H), final (bs * D, H),
        accept_index (bs, num_steps + 1) the accepted tree path's rows, -1 past its end, D = num_draft_tokens.
        One block for all captured requests (`RowCopier.gather_verify`); the captured requests are found in the
        batch as `_SCAN_MAX_CAPTURES` says, and each one's position is noted for `on_verify_processed`."""
        now = time.monotonic()
        taken: list[_Partial] = []
        positions: list[int] = []
        missing: list[str] = []  # a prompt chunk never came (checked at a capture's first verify step)
        generating = self._generating
        if len(generating) > _SCAN_MAX_CAPTURES:  # many: every request of the batch looked up, as `on_decode` does
            for position, req in enumerate(reqs):
                partial = generating.get(req.rid)
                if partial is not None:
                    if partial.verify_ct_base is None and not _first_verify_step(partial, req):
                        missing.append(req.rid)
                    else:
                        taken.append(partial)
                        positions.append(position)
        else:  # few: each capture's own request, by a scan
            for rid, partial in generating.items():
                try:
                    position = reqs.index(partial.req)
                except ValueError:  # not in this batch (its prefill is still running, or it was retracted)
                    continue
                if partial.verify_ct_base is None and not _first_verify_step(partial, partial.req):
                    missing.append(rid)
                else:
                    taken.append(partial)
                    positions.append(position)
        for rid in missing:
            self._abandon(rid, "missing_rows", now)
        if taken:
            block = self._copier.gather_verify(aux, final, accept_index, positions, num_draft_tokens)
            if block is None:  # no host buffer free: drop these captures rather than wait
                for position in positions:
                    self._abandon(reqs[position].rid, "host_buffers_full", now)
            else:
                self._share_out(block, len(taken))
                width, start = accept_index.shape[1], 0
                for partial, position in zip(taken, positions):
                    partial.pending.append((block, start, position))
                    partial.updated_at = now
                    start += width
        self._maybe_sweep(now)

    def on_verify_processed(self, reqs: list, num_correct_drafts: list[int]) -> None:
        """After the scheduler processed a verify step: keep the rows of the tokens each captured request
        accepted (SGLang's own per-request count), note the count, and check that rows and tokens still agree.
        The rows kept are noted, not copied; they are joined into a chunk every `_RUN_MAX_STEPS` steps and
        where a part is due (`_flush_run`). Each capture finds its request at the position `on_verify` noted (the
        scheduler processes the batch it verified)."""
        now = time.monotonic()
        for rid, partial in list(self._generating.items()):  # a capture may be dropped on the way (`_cut_parts`)
            pending = partial.pending
            if not pending:
                continue
            req = partial.req
            block, start, position = pending[0]
            if position >= len(reqs) or reqs[position] is not req:
                try:
                    position = reqs.index(req)
                except ValueError:
                    continue
            del pending[0]
            accepted = partial.accepted
            # SGLang counts a step only for a request that was neither finished nor retracted before it.
            if int(getattr(req, "spec_verify_ct", 0)) - partial.verify_ct_base <= len(accepted):
                release_pieces([(block, start, start)])
                continue
            count = int(num_correct_drafts[position]) + 1
            # `_Partial.note_rows` and `run_full`, written out: this runs per captured request and step
            run = partial.run
            run.append((block, start, start + count))
            partial.run_held_nbytes += block.share_nbytes
            partial.num_rows += count
            accepted.append(count - 1)
            if (not req.finished() and partial.chunks_start + partial.num_rows
                    != len(req.origin_input_ids) + len(req.output_ids) - 1):
                self._abandon(rid, "misaligned", now)
                continue
            if len(run) >= _RUN_MAX_STEPS or partial.num_rows >= partial.run_cut_rows:
                self._join_if_due(req, partial, now)
        self._join_runs_if_due()

    def _share_out(self, block: HostRows | VerifyRows | ForwardRows, num_holders: int) -> None:
        """A forward's block that num_holders captures note rows of: where the copier keeps references, it counts
        once towards `_RUN_MAX_BYTES` and each holder counts its share of it (`_KeptOutputs.share_nbytes`)."""
        if self._copier.keeps_references:
            self._kept_nbytes += block.held_nbytes
            block.share_nbytes = -(-block.held_nbytes // num_holders)

    def _join_runs_if_due(self) -> None:
        """Once the forward outputs noted since the last time reach `_RUN_MAX_BYTES`, joins every capture's rows
        noted, in one hand-over to the copy thread (`RowCopier.join_all`): the forwards they kept alive go."""
        if self._kept_nbytes < _RUN_MAX_BYTES:
            return
        self._kept_nbytes = 0
        partials = [partial for partial in self._partials.values() if partial.run]
        if partials:
            self._flush_runs(partials)
            self._stats.add_many(("runs_joined_together", 1), ("runs_joined", len(partials)))

    def _join_if_due(self, req, partial: _Partial, now: float) -> None:
        """Joins the rows noted once they are `_RUN_MAX_STEPS` steps or past a part's rows (then hands the part to
        the sender)."""
        if not partial.run_cut_rows:
            partial.run_cut_rows = self._part_rows(partial) + 2
        if partial.run_full or partial.num_rows >= partial.run_cut_rows:
            self._flush_run(partial)
            self._cut_parts(req, partial, now)

    def _flush_run(self, partial: _Partial) -> None:
        """Joins one capture's rows noted into one chunk (`_flush_runs`)."""
        self._flush_runs((partial,))

    def _flush_runs(self, partials: Sequence[_Partial]) -> None:
        """Joins each capture's rows noted into one chunk, the copies handed to the copy thread at once
        (`RowCopier.join_all`). Rows held only grow between joins, so the gauge `_cut_parts` keeps is exact when kept
        here (not at every verify step)."""
        joined = []
        for partial in partials:
            if partial.num_rows > self._most_rows_held:
                self._most_rows_held = partial.num_rows
                self._stats.set("most_rows_held", partial.num_rows)
            if partial.run:
                joined.append(partial)
        if joined:
            for partial, chunk in zip(joined, self._copier.join_all([partial.run for partial in joined])):
                partial.chunks.append(chunk)
                partial.run, partial.run_held_nbytes = [], 0

    def on_processed(self, reqs: list, num_correct_drafts: list[int] | None) -> None:
        """After the scheduler processed a batch while a generate capture runs: a verify step's accepted rows
        (`on_verify_processed`, when num_correct_drafts is given), then the captures whose request finished."""
        if num_correct_drafts is not None:
            self.on_verify_processed(reqs, num_correct_drafts)
        self.on_finished(reqs)

    def on_finished(self, reqs: list) -> None:
        """After the scheduler processed a batch: emit (or drop) the generate captures whose request finished.

        It looks at the running generate captures' requests (`_Partial.req`), not at the batch's: at a low
        sampling rate most of a batch is not captured, and a look-up per request is the scheduler thread's
        time. A request finishes while the scheduler processes a batch that holds it (SGLang sets its finish
        reason there, an abort included), so the captures found finished here are those of `reqs`."""
        for rid, partial in list(self._generating.items()):
            req = partial.req
            if req is None or not req.finished():
                continue
            self._remove(rid)
            self._finish_generated(req, partial)

    def _start(self, rid: str, selection: Selection, now: float) -> _Partial:
        tag = selection.tag
        partial = self._partials[rid] = _Partial(tag=tag, prefix=selection.prefix, chunks=[], num_rows=0,
                                                 updated_at=now)
        partial.chunks_start = partial.first_row
        if tag.mode == "generate":
            self._generating[rid] = partial
        self._stats.add("started")
        return partial

    def _restart(self, partial: _Partial, now: float) -> None:
        # Rows already sent in parts stay sent: the new prefill's rows before chunks_start are not taken.
        partial.release()
        partial.chunks, partial.num_rows, partial.updated_at = [], 0, now
        partial.embeds, partial.num_embeds = [], 0  # an image request is never in parts: it restarts at 0

    def _part_rows(self, partial: _Partial) -> int:
        row_nbytes = (partial.chunks[0] if partial.chunks else partial.run[0][0]).row_nbytes
        return max(1, min(self._part_max_tokens, self._part_max_bytes // max(row_nbytes, 1)))

    def _cut_parts(self, req, partial: _Partial, now: float) -> bool:
        """Hands the held rows to the sender in parts while more than one part's rows are held (the newest
        rows stay: the record that closes the capture holds at least one). False when the capture was
        dropped (the sender had no room for a part)."""
        if partial.num_rows > self._most_rows_held:  # a gauge: the most rows one capture held at once
            self._most_rows_held = partial.num_rows
            self._stats.set("most_rows_held", partial.num_rows)
        # A generate capture keeps one row more: the overlap scheduler may run a step past its last token.
        spare = 1 + (partial.tag.mode == "generate")
        if partial.images is not None:  # sent whole (see the module docstring)
            return True
        if not partial.num_rows or partial.num_rows < self._part_rows(partial) + spare:
            return True  # nothing to hand over yet: the rows noted stay unjoined
        self._flush_run(partial)
        plan = partial.prefix
        if plan is not None and not partial.plan_sent:
            # The plan's blocks first (other records may refer to them), each as soon as its rows are held.
            upto = min(partial.rows_end, plan.record_prefix) // plan.block_tokens * plan.block_tokens
            if upto > partial.chunks_start and not self._send_blocks(partial, req.origin_input_ids, upto):
                return self._drop_streaming(req.rid, now)
            if not partial.plan_sent:  # the rest of the plan's rows (less than a block) are still to come
                return True
        while partial.num_rows >= self._part_rows(partial) + spare:
            start = partial.chunks_start
            end = start + self._part_rows(partial)
            token_ids = _token_ids(req, end)
            if token_ids is None:  # the scheduler has not appended the newest tokens yet: cut at the next step
                return True
            part = CapturedSequence(tag=partial.tag, token_ids=token_ids, loss_spans=(), metadata={},
                                    chunks=partial.take_rows(end), num_states=end, part_index=partial.num_parts,
                                    rows_start=start)
            if self._emit(part) is False:
                return self._drop_streaming(req.rid, now)
            partial.num_parts += 1
            self._stats.add("parts_cut")
        return True

    def _send_blocks(self, partial: _Partial, prompt, upto: int) -> bool:
        """Hands the sender the plan's blocks this capture sends that end by upto (a block end, at most the
        plan's last, with every row up to it held) and drops the rows before upto. False when the sender had
        no room (counted there)."""
        plan = partial.prefix
        ends = tuple(end for end in plan.sent_here if partial.chunks_start < end <= upto)
        if ends:
            start = partial.chunks_start
            blocks = CapturedSequence(tag=partial.tag, token_ids=_ids_array(prompt, plan.record_prefix), loss_spans=(),
                                      metadata={}, chunks=partial.take_rows(ends[-1]), num_states=ends[-1], prefix=plan,
                                      blocks_only=True, block_ends=ends, rows_start=start)
            if self._emit(blocks) is False:
                return False
        if partial.chunks_start < upto:  # rows of blocks promised by other captures: theirs send them
            for chunk in partial.take_rows(upto):
                chunk.release()
        partial.plan_sent = upto == plan.record_prefix
        return True

    def _drop_streaming(self, rid: str, now: float) -> bool:
        """The sender dropped a part (and counted why): the capture cannot close; its parts already sent are
        reclaimed by the collector after its part timeout."""
        partial = self._remove(rid)
        if partial is not None:
            partial.release()
        return False

    def _remove(self, rid: str) -> _Partial | None:
        partial = self._partials.pop(rid, None)
        if partial is not None:
            self._generating.pop(rid, None)
        return partial

    def _copy(self, taken: list[tuple[object, _Partial]], ranges: list[tuple[int, int]],
              aux: torch.Tensor, final: torch.Tensor, now: float, *, prefill: bool) -> None:
        # The only forward-path work: one copy of every captured request's rows off the device, or on CPU, for a
        # small forward, a reference to its outputs, each capture noting its rows as a piece of them (`run`).
        block = self._copier.keep_rows(aux, final)
        copied = None if block is not None else self._copier.copy(aux, final, ranges)
        if block is None and copied is None:  # no host buffer free: drop these captures rather than wait
            for req, _ in taken:
                self._abandon(req.rid, "host_buffers_full", now)
            return
        if block is not None:
            self._share_out(block, len(taken))
        for index, (req, partial) in enumerate(taken):
            if block is not None:  # after the rows it holds, a retracted request's steps' included
                partial.note_rows(block, *ranges[index])
                if partial.run_full:
                    self._flush_run(partial)
            else:
                if partial.run:  # a retracted request's new prefill: its rows follow those its steps kept
                    self._flush_run(partial)
                rows = copied[index]
                partial.chunks.append(rows)
                partial.num_rows += rows.aux.shape[0]
            partial.updated_at = now
            if not self._cut_parts(req, partial, now):
                continue
            if prefill and partial.tag.mode == "prefill" and partial.rows_end == len(req.full_untruncated_fill_ids):
                self._remove(req.rid)
                self._finish_prefill(req, partial)
        if block is not None:  # a prompt in many small chunks keeps no more alive than steps do
            self._join_runs_if_due()

    def _finish_prefill(self, req, partial: _Partial) -> None:
        # Rejected (e.g. too long): its ids were replaced by a placeholder.
        if type(getattr(req, "to_finish", None)).__name__ == "FINISH_ABORT":
            self._discard(partial, "aborted")
            return
        token_ids = list(req.full_untruncated_fill_ids)
        spans = partial.tag.loss_spans
        if spans and spans[-1][1] > len(token_ids):
            self._discard(partial, "spans_out_of_range")
            return
        served = self._served_draft()
        self._send(partial, token_ids, spans, len(token_ids), partial.tag.metadata,
                   None if served is None else (*served, [], 0))

    def _finish_generated(self, req, partial: _Partial) -> None:
        """The record of a finished request: prompt + generated tokens, states for all but the last."""
        finished = getattr(req, "finished_reason", None)
        reason = type(finished).__name__
        if reason == "FINISH_ABORT":
            self._discard(partial, "aborted", req)
            return
        if getattr(finished, "matched", None) == "NaN happened":  # SGLang's finish on non-finite logits
            self._discard(partial, "nan")
            return
        partial.drop_pending()  # steps after the finishing one (overlap scheduling)
        if partial.num_rows > self._most_rows_held:  # the gauge `_flush_run` keeps (the rows are joined later)
            self._most_rows_held = partial.num_rows
            self._stats.set("most_rows_held", partial.num_rows)
        token_ids = list(req.origin_input_ids)
        num_prompt = len(token_ids)
        token_ids += req.output_ids if req.finished_len is None else req.output_ids[: req.finished_len]
        num_generated = len(token_ids) - num_prompt
        if not num_generated:
            self._discard(partial, "nothing_generated", req)
            return
        num_states = len(token_ids) - 1
        spans = partial.tag.loss_spans
        if spans and spans[-1][1] > num_prompt:
            self._discard(partial, "spans_out_of_range")
            return
        # Rows past num_states come from forwards after the finishing one (the overlap scheduler may run
        # one more step before it learns the request is done); fewer mean a step was never captured.
        if partial.rows_end < num_states:
            self._discard(partial, "missing_rows", req)
            return
        if spans and spans[-1][1] == num_prompt:
            spans = (*spans[:-1], (spans[-1][0], len(token_ids)))
        else:
            spans = (*spans, (num_prompt, len(token_ids)))
        metadata = {**partial.tag.metadata, "finish_reason": _FINISH_REASONS.get(reason, reason)}
        served = self._served_draft()
        self._send(partial, token_ids, spans, num_states, metadata,
                   None if served is None else (*served, partial.accepted, num_generated))

    def _send(self, partial: _Partial, token_ids: list[int], spans: tuple[tuple[int, int], ...],
              num_states: int, metadata: dict, served: tuple | None = None) -> None:
        """Hands a finished capture's record to the sender (served: see `CapturedSequence.served`). The rows
        its last steps kept go unjoined (`CapturedSequence.run`) unless blocks must be cut from them first."""
        if partial.images is not None:
            self._flush_run(partial)
            self._send_with_images(partial, token_ids, spans, num_states, metadata, served)
            return
        live = partial.tag.metadata.get("source") == "live"
        self._stats.add_many(("captured", 1), ("captured_tokens", len(token_ids)), ("captured_live", int(live)))
        if partial.chunks_start != partial.first_row or partial.num_parts or partial.plan_sent:
            # Blocks or parts went ahead of it: the plan's last blocks go now, then the record of the rest.
            plan = partial.prefix
            if plan is not None and not partial.plan_sent:
                self._flush_run(partial)
                if not self._send_blocks(partial, token_ids, plan.record_prefix):
                    partial.release()
                    return
            self._emit(CapturedSequence(tag=partial.tag, token_ids=token_ids, chunks=partial.chunks, loss_spans=spans,
                                        num_states=num_states, metadata=metadata, parts_before=partial.num_parts,
                                        rows_start=partial.chunks_start, run=partial.run, served=served,
                                        run_held_nbytes=self._run_held_nbytes(partial)))
            return
        self._emit(CapturedSequence(tag=partial.tag, token_ids=token_ids, chunks=partial.chunks, loss_spans=spans,
                                    num_states=num_states, metadata=metadata, prefix=partial.prefix, run=partial.run,
                                    served=served, run_held_nbytes=self._run_held_nbytes(partial)))

    def _run_held_nbytes(self, partial: _Partial) -> int:
        """What a capture's unjoined rows keep alive beyond their own bytes' count: their forwards' outputs, where
        the copier keeps references (`CapturedSequence.run_held_nbytes`)."""
        return partial.run_held_nbytes if self._copier.keeps_references else 0

    def _send_with_images(self, partial: _Partial, token_ids: list[int], spans: tuple[tuple[int, int], ...],
                          num_states: int, metadata: dict, served: tuple | None) -> None:
        """The record of a request with images: the placeholder id at its image positions, no loss there, and
        the input embeddings of every one of them (else it is dropped: `image_embeds_missing`)."""
        images = partial.images
        if partial.num_embeds != images.num_positions or images.spans[-1][1] > len(token_ids):
            self._discard(partial, "image_embeds_missing")
            return
        token_ids = list(token_ids)
        if images.placeholder_id is not None:
            for start, end in images.spans:
                token_ids[start:end] = [images.placeholder_id] * (end - start)
        live = partial.tag.metadata.get("source") == "live"
        self._stats.add_many(("captured", 1), ("captured_images", 1), ("captured_tokens", len(token_ids)),
                             ("captured_live", int(live)))
        self._emit(CapturedSequence(tag=partial.tag, token_ids=token_ids, chunks=partial.chunks,
                                    loss_spans=spans_without(spans, images.spans), num_states=num_states,
                                    metadata=metadata, input_embed_spans=images.spans, input_embeds=partial.embeds,
                                    served=served))

    def on_aborted(self, rid: str) -> None:
        """A request the scheduler ended outside a batch (aborted while queued, e.g. after a retraction, or
        rejected): its capture, or the decision waiting for it, goes now rather than at the TTL."""
        self.selector.take(rid)
        if rid in self._partials:
            self._abandon(rid, "aborted", time.monotonic())

    def _discard(self, partial: _Partial, reason: str, req=None) -> None:
        """Drops a capture already out of the table: its host buffers go back, the reason is counted.

        Given the request of a generate capture that ended after its prompt's rows were taken, the blocks
        it promised are still sent (other records may already refer to them)."""
        self._stats.drop(reason)
        prefix = partial.prefix
        if (req is not None and prefix is not None and prefix.sent_here and not partial.plan_sent
                and partial.rows_end >= prefix.sent_here[-1]):
            self._flush_run(partial)
            self._send_blocks(partial, req.origin_input_ids, prefix.sent_here[-1])
        partial.release()

    def _abandon(self, rid: str, reason: str, now: float) -> None:
        # Later chunks of the request find neither a partial nor a decision (taken once): ignored, not re-counted.
        partial = self._remove(rid)
        if partial is None:
            self._stats.drop(reason)
        else:
            self._discard(partial, reason)

    def _maybe_sweep(self, now: float) -> None:
        if now - self._last_sweep > 1.0:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        self._last_sweep = now
        for rid, partial in list(self._partials.items()):
            if now - partial.updated_at > self._partial_ttl_s:
                self._abandon(rid, "expired", now)


def spans_without(spans: tuple[tuple[int, int], ...],
                  holes: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """The sorted half-open spans less every position in holes (sorted, non-overlapping)."""
    kept = []
    for start, end in spans:
        for low, high in holes:
            if high <= start or end <= low:
                continue
            if low > start:
                kept.append((start, low))
            start = max(start, high)
            if start >= end:
                break
        if start < end:
            kept.append((start, end))
    return tuple(kept)


def _ids_array(ids, end: int) -> np.ndarray:
    return np.asarray(ids[:end], dtype=np.int32)


def _token_ids(req, end: int) -> np.ndarray | None:
    """The request's first `end` token ids (prompt, then generated) as int32, or None while it has fewer."""
    prompt = req.origin_input_ids
    if end <= len(prompt):
        return _ids_array(prompt, end)
    generated = req.output_ids
    if end > len(prompt) + len(generated):
        return None
    return np.concatenate([_ids_array(prompt, len(prompt)), _ids_array(generated, end - len(prompt))])
