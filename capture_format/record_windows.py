"""A row range of a record, read without decoding the frames it does not touch.

A record's states may lie in a chain of frames: prefix blocks (shared prefixes, or the parts a long
record is stored in, see `prefix_blocks.py`) and the record's own frame, which holds the last rows. A
64K-token record at hidden size 7168 is gigabytes; `IndexedShards.read_window(entry, start, end)` hands
out its rows [start, end) holding only the frames those rows lie in.

Shapes: T tokens; S rows of states of the whole (resolved) record, T or T - 1 (the last token of a
record captured while generating has no state); K capture layers; H hidden size; W = end - start.

What must hold:
- a window equals read_record(entry)'s aux[start:end] and final[start:end], with the record's ids,
  spans and metadata (a record with images: all its input embeddings, it is one frame), and is handed
  out only after the checks read_record makes: the record's own frame header and ids and every chain
  block's header are checked against their index entries
  (`token_ids.read_frame_start`), and the chain against the record (`prefix_blocks.walk_chain`);
- only frames whose rows overlap [start, end) are decoded, each fully verified (stored and decoded
  checksums); the others are read up to the end of their header (the record's own frame: of its ids);
- 0 <= start < end <= S, or ValueError naming the range and S (checked before any block is read);
- `read_layout` gives S and where each frame's rows end from headers alone, so a planner can cut
  windows (aligned on frames, a pass decodes each frame once) without reading a state.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from capture_format.frame_header import FrameInfo
from capture_format.prefix_blocks import ChainLink, walk_chain
from capture_format.records import STATE_DTYPES, CaptureRecord, mask_from_spans, num_span_positions
from capture_format.token_ids import FrameStart

__all__ = ["RecordLayout", "RecordWindow", "WalkedRecord", "check_window", "cut_window", "walk_record"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordLayout:
    """Where a record's rows of states lie, from frame headers alone."""

    record_id: str
    num_tokens: int
    """T."""
    num_states: int
    """S of the resolved record: T, or T - 1 when the last token has no state."""
    frame_ends: tuple[int, ...]
    """The row where each frame's rows end, its chain's blocks from token 0 on, then its own frame; the
    last is num_states, a frame's rows start where the previous one's end."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class RecordWindow:
    """Rows [start, end) of a record's states, with all of its tokens. eq=False: arrays have no single truth."""

    record_id: str
    sample_id: str
    model_fingerprint: str
    capture_layers: tuple[int, ...]
    hidden_size: int
    dtype: str
    token_ids: np.ndarray
    """int32 [T]: every token of the record, not only the window's."""
    loss_spans: tuple[tuple[int, int], ...]
    """Token ranges of the whole record (as in CaptureRecord)."""
    metadata: dict[str, Any] = field(repr=False)
    num_states: int
    """S of the whole resolved record."""
    start: int
    end: int
    aux: np.ndarray
    """[W, K, H]: aux[i] is the record's row start + i, the states of token start + i."""
    final: np.ndarray
    """[W, H]."""
    input_embed_spans: tuple[tuple[int, int], ...] = ()
    """The record's image positions (CaptureRecord.input_embed_spans), all of them."""
    input_embeds: np.ndarray | None = None
    """[E, H]: the record's input embeddings at every image position, whatever the window (they are few)."""

    def __post_init__(self) -> None:
        width, num_layers, hidden = self.end - self.start, len(self.capture_layers), self.hidden_size
        assert 0 <= self.start < self.end <= self.num_states <= self.token_ids.shape[0]
        assert self.aux.shape == (width, num_layers, hidden) and self.final.shape == (width, hidden)
        num_embeds = num_span_positions(self.input_embed_spans)
        assert (self.input_embeds is None) == (num_embeds == 0)
        assert self.input_embeds is None or self.input_embeds.shape == (num_embeds, hidden)
        for array in (self.token_ids, self.aux, self.final, self.input_embeds):
            if array is not None:
                array.flags.writeable = False

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def loss_mask(self) -> np.ndarray:
        """uint8 [T]: 1 on tokens inside a loss span (of the whole record)."""
        return mask_from_spans(self.loss_spans, self.num_tokens)


@dataclass(frozen=True, slots=True, eq=False)
class WalkedRecord:
    """A record's checked header and ids and its checked chain: what a window needs before any state."""

    info: FrameInfo
    token_ids: np.ndarray
    """int32 [T]."""
    links: tuple[ChainLink, ...]
    """The chain's blocks from token 0 on, then the record's own frame."""

    @property
    def layout(self) -> RecordLayout:
        ends = tuple(link.first_state_token + link.num_states for link in self.links)
        return RecordLayout(record_id=self.info.record_id, num_tokens=self.info.num_tokens, num_states=ends[-1],
                            frame_ends=ends)


def check_window(info: FrameInfo, start: int, end: int) -> tuple[int, int]:
    """(start, end) as ints if 0 <= start < end <= S of the record whose own header is info, else ValueError."""
    start, end = operator.index(start), operator.index(end)
    own = ChainLink.of_frame(info)
    num_states = own.first_state_token + own.num_states
    if not 0 <= start < end <= num_states:
        raise ValueError(f"window [{start}, {end}) of record {info.record_id} is not a range of its {num_states} "
                         f"rows of states: 0 <= start < end <= {num_states}")
    return start, end


def walk_record(own: FrameStart, read_link: Callable[[str], ChainLink | None]) -> WalkedRecord:
    """The record whose checked frame start (header and ids) is own, with its chain walked and checked
    (prefix_blocks.walk_chain). Raises DanglingPrefixError."""
    assert own.token_ids is not None
    link = ChainLink.of_frame(own.info)
    return WalkedRecord(own.info, own.token_ids, walk_chain(link, own.token_ids, read_link) + (link,))


def cut_window(walked: WalkedRecord, start: int, end: int, read_frame: Callable[[int], CaptureRecord]) -> RecordWindow:
    """Rows [start, end) (checked by check_window) of the walked record; read_frame(i) decodes and verifies
    walked.links[i]'s frame and is called only for frames whose rows overlap [start, end), in order."""
    info, ends = walked.info, walked.layout.frame_ends
    overlapping = [index for index, frame_end in enumerate(ends)
                   if frame_end > start and (ends[index - 1] if index else 0) < end]
    width = end - start
    aux = final = input_embeds = None
    if len(overlapping) > 1:  # filled frame by frame: one decoded frame at a time besides the window
        aux = np.empty((width, len(info.capture_layers), info.hidden_size), STATE_DTYPES[info.dtype])  # [W, K, H]
        final = np.empty((width, info.hidden_size), STATE_DTYPES[info.dtype])  # [W, H]
    for index in overlapping:
        frame_start = ends[index - 1] if index else 0
        frame = read_frame(index)
        assert frame.record_id == walked.links[index].record_id and frame.num_states == ends[index] - frame_start
        low, high = max(start, frame_start), min(end, ends[index])  # rows of the record in this frame
        if index == len(ends) - 1:  # the record's own frame: a record with images has only that one
            input_embeds = frame.input_embeds
        if aux is None:  # the window lies in one frame: a view of it, no copy
            aux = frame.aux[low - frame_start : high - frame_start]  # [W, K, H]
            final = frame.final[low - frame_start : high - frame_start]  # [W, H]
        else:
            aux[low - start : high - start] = frame.aux[low - frame_start : high - frame_start]
            final[low - start : high - start] = frame.final[low - frame_start : high - frame_start]
        del frame
    assert aux is not None and final is not None
    return RecordWindow(record_id=info.record_id, sample_id=info.sample_id, model_fingerprint=info.model_fingerprint,
                        capture_layers=info.capture_layers, hidden_size=info.hidden_size, dtype=info.dtype,
                        token_ids=walked.token_ids, loss_spans=info.loss_spans, metadata=info.metadata,
                        num_states=ends[-1], start=start, end=end, aux=aux, final=final,
                        input_embed_spans=info.input_embed_spans, input_embeds=input_embeds)
