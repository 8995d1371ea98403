"""Training batches from capture shards: the read-time shift, windows, batch plans, and a resumable dataset.

The shift (`shift_window`, the only place it happens). A record holds the sequence as the server
saw it. Row r of the draft's input pairs the target's state at position r with the embedding of
the NEXT token r+1, and predicts token r+2, whose target distribution is
softmax(lm_head(final[r+1])) (SGLang's draft-extend rotates input ids left by one the same way).
The loss mask of row r is the record's mask at the predicted token r+2 (loss spans mark the
tokens the draft learns to predict). A record of T tokens gives n = T-1 rows; the last row's token
r+2 lies past the record, so its mask is 0. Worked example, T = 5, loss span (2, 5):

    record  t           0    1    2    3    4
            token_ids   a    b    c    d    e
            loss mask   0    0    1    1    1
            aux         A0   A1   A2   A3   A4     inputs of the capture layers at t
            final       F0   F1   F2   F3   F4     softmax(lm_head(F_t)) = target's guess of token t+1

    rows    r                        0    1    2    3
            aux         aux[r]       A0   A1   A2   A3
            input_ids   ids[r+1]     b    c    d    e
            final       final[r+1]   F1   F2   F3   0    -> target distribution of c, d, e; none past e
            loss_mask   mask[r+2]    1    1    1    0
            label_ids   ids[r+2]     c    d    e    -1
            positions   r            0    1    2    3

The last row, r = T - 2, predicts token T, past the record: its mask is 0, its target is never read,
and its final is zeros. So a record whose last token has no state (S = T - 1 rows of states: the
server sampled that token and never ran a forward on it) gives the same T - 1 rows as a prefill
capture of the same T tokens: only that row would read the missing final[T - 1], and aux[T - 1] is
never read by any record. It trains on its last token too (often the end of turn).

Test-time-training step i (trainer/ttt.py) reads row r + i of the same record for input ids,
targets and mask, at position r + i, with the draft's own hidden state of row r.

Images. Where token r+1 is an image position of the record (`input_embed_spans`), row r's input is not
the embedding of its id (the image placeholder) but the target's own input embedding there, as SGLang
hands an EAGLE-3 draft `mm_input_embeds` rotated left by one like the ids: `input_embeds` (n, H) holds
it and `input_embed_mask` (n,) marks those rows; a batch carries them, (B, S, H) and (B, S), only when
one of its records has images. An image position is never in a loss span (capture_format records), so
no row predicts one and the vocabulary counts never see one.

Windows: every token of a long record is trained. A record of n rows with n > max_length (M) is
cut into windows of at most M rows, each a unit of the batch plan with the states of its own rows
only (`read_windows`: IndexedShards.read_window decodes only the frames those rows lie in). L = `window_overlap` rows (train and eval pass ttt_steps - 1, the farthest the unroll reads
ahead) are carried twice: window k holds rows [k(M-L), min(k(M-L) + M, n)), and its first L rows
(k > 0) repeat the last rows of window k-1 with loss mask 0 there. A row's target (token r+2) is
learned in exactly one window, the one whose own rows hold it, and the unroll reaches it at step i
from start row r - i as in the whole record: that start row is at most L rows back, so it is in the
same window. Example: T = 12 (n = 11 rows), M = 5, ttt_steps 3 (L = 2):

    row r                 0  1  2  3  4  5  6  7  8  9  10
    window 0 (rows 0-4)   x  x  x  x  x                         x: target token r+2 learned here
    window 1 (rows 3-7)            .  .  x  x  x                .: carried, mask 0 (window 0 learns it)
    window 2 (rows 6-10)                    .  .  x  x  (x)     (x): row 10 predicts token 12, past the record
    chain start rows      0  0  0  1  1  1  2  2  2  2  2       eval: the window that starts a chain at r

Token 7 (row 5) is learned only in window 1: at step 0 from row 5, step 1 from row 4 and step 2 from
row 3, all in window 1. Rows 3 and 4 are in window 1 to start those chains; their own targets
(tokens 5 and 6) are window 0's. At a boundary the target's states are the same as in the whole
record (aux[r] and final[r+1] were computed by the target over the whole context), but the draft's
own attention sees only its window: in window 1 row 3's chain attends to no earlier draft keys,
where in the whole record it would see rows 0-2. positions stay the record's own (r), as serving
numbers them. Eval's chains of J = L + 1 proposals start in the window that holds the rows they
read: window k starts chains at its rows before its last L (at all of them in a record's last
window), so every start row is counted once too (`start_mask`). M must exceed L.

Batches. An epoch's plan is made from the index alone (token counts), so it is cheap and
deterministic: windows (a record up to max_length rows is one window) are shuffled by (seed, epoch)
and laid into rows: one window per row (padding), or windows packed back to back into rows of up to
`max_length` positions (packing; `doc_ids` keep windows apart, two windows of one record included).
The rows are dealt to ranks round-robin and each rank groups its rows into batches of `batch_size`.
So batch g of N ranks together holds the rows of batch g of one process with batch_size N times as
large, packed or not (the trainer then makes a DDP step equal that process's step: trainer/train.py).
Every rank gets the same number of batches per epoch (the smallest count), so DDP ranks step
together. The one difference from one process: when an epoch's last global batch has fewer rows
than there are ranks, some rank has none of it, so the ranks drop it where one process trains on
it, and from there the two runs read different batches. Rows, not records, are dealt, so a long
record's windows may go to several ranks (each reads only its own). Batches are
numbered globally across epochs; DataLoader worker w of W makes the batches g with g % W == w, so
the loader yields them in order. The dataset's whole state is the number of batches consumed:
resuming from it yields exactly the batches an uninterrupted run would have. A record whose
checksums fail is reported and left out of its batch (each of its windows).

Records. `record_ids` names a text file of record ids (one per line, `#` starts a comment): then
only those records of the shard set exist for the dataset, in the file's order (so an unshuffled
pass reads them in that order), and every other record is ignored. The selection is made on the
index alone, local or remote, before any plan; an id the shards lack is an error naming it, as
is an empty selection.

Shards may sit in an object store (`shards = "s3://bucket/prefix"`, capture_format/remote_shards.py):
then each record is fetched alone (a rank fetches only its own) into a bounded local cache, and the
records of the next batch are fetched while the current one is used, so the store's latency hides
behind the training step.

Shape legend: B rows, S positions per row, K capture layers, H hidden size, n rows of a window.
"""

from __future__ import annotations

import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import capture_format as cf
from capture_format.remote_shards import RemoteShardDirectory
from trainer.record_ids import read_record_ids, select_records

log = logging.getLogger(__name__)

Shards = cf.ShardDirectory | RemoteShardDirectory
"""A local folder or an object-store prefix of sealed shards, read alike."""



@dataclass(kw_only=True, slots=True)
class Config:
    """Where training records come from and how they become batches."""

    shards: str
    """Directory of sealed capture shards (as the collector writes them)."""
    batch_size: int = 8
    """Rows per batch, per rank."""
    max_length: int = 2048
    """Positions per row; a record with more rows (tokens - 1) is trained as consecutive windows of up to this many
    rows that together learn each of its tokens once (trainer/data.py)."""
    packing: bool = False
    """Pack several windows (records) into each row (True) or put one per row, padded (False)."""
    shuffle: bool = True
    """Shuffle windows (records) each epoch by (seed, epoch)."""
    seed: int = 0
    """Seed of the shuffle."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0: read in the training process)."""
    cache_dir: str | None = None
    """Shards in an object store (s3://...): local folder of fetched records (None: EAGLE_TAP_CACHE_DIR or
    ~/.cache/eagle-tap/records). Ranks and workers of one machine may share it."""
    cache_max_bytes: int | None = None
    """Bytes the record cache may hold (None: EAGLE_TAP_CACHE_MAX_BYTES or 8 GiB); least recently used go first."""
    record_ids: str | None = None
    """Text file of record ids to read (one per line, `#` comments): every other record of shards is ignored;
    an id the shards lack is an error. None: every record."""

    def open_shards(self, skip_damaged: bool = True) -> Shards:
        """The shards this config names, local or remote, with its record cache."""
        cache = cf.RecordCache(self.cache_dir, self.cache_max_bytes) if cf.is_remote(self.shards) else None
        return cf.open_shard_directory(self.shards, skip_damaged=skip_damaged, cache=cache)


Window = tuple[int, int, int]
"""A unit of the batch plan: (record index, first row, end row): rows [first, end) of the record's T - 1."""


def record_windows(num_tokens: int, max_length: int, overlap: int) -> list[tuple[int, int]]:
    """(first row, end row) of each window of a record of num_tokens tokens (module docstring); [] for T < 2."""
    if max_length <= overlap:
        raise ValueError(f"max_length {max_length} must exceed the rows each window repeats ({overlap}, the TTT "
                         f"unroll's steps - 1): use max_length >= {overlap + 1}")
    total = max(num_tokens - 1, 0)
    windows, first = [], 0
    while first < total:
        end = min(first + max_length, total)
        windows.append((first, end))
        if end == total:
            break
        first = end - overlap
    return windows


def read_windows(shards: Shards, entry: cf.IndexEntry, windows: Sequence[tuple[int, int]]) -> list[cf.RecordWindow]:
    """The states each window of rows [first, end) of the record at entry needs: positions first..end (the shift
    reads final[end]), or first..end-1 for the record's last window (its last row's target is past the record).
    Only the frames of the record those rows lie in are decoded. The one place training and eval read records."""
    last_row = entry.num_tokens - 1
    return [shards.read_window(entry, first, end + 1 if end < last_row else end) for first, end in windows]


def shift_window(rows: cf.RecordWindow, first: int, end: int, overlap: int = 0) -> dict[str, np.ndarray]:
    """Rows [first, end) of the record as in the module docstring (rows.start must be first; n = end - first).

    loss_mask is 0 on the first `overlap` rows of a window after a record's first (an earlier window learns
    their targets); start_mask marks the rows whose chains this window starts (not its last `overlap` rows,
    unless it is the record's last window)."""
    assert rows.start == first and first < end, (rows.start, first, end)
    num_tokens = int(rows.token_ids.shape[0])
    n = end - first
    ids = rows.token_ids.astype(np.int64)
    mask_past_end = cf.mask_from_spans(rows.loss_spans, num_tokens + 2, bool)  # (T + 2,): none past the record
    learned = mask_past_end[first + 2 : end + 2].copy()  # (n,): learn token r+2?
    owned = learned.copy()
    owned[: overlap if first > 0 else 0] = False
    starts = learned.copy()
    starts[max(n - overlap, 0) if end < num_tokens - 1 else n :] = False
    final = np.zeros((n, rows.final.shape[1]), dtype=rows.final.dtype)  # (n, H)
    with_target = min(end, num_tokens - 2) - first  # rows whose token r+2 is in the record: the module docstring
    final[:with_target] = rows.final[1 : with_target + 1]
    return {
        "aux": rows.aux[:n].reshape(n, -1),  # (n, K*H): target states at r
        "input_ids": ids[first + 1 : end + 1],  # (n,): token r+1
        "final": final,  # (n, H): its logits are the target distribution of token r+2
        "loss_mask": owned,  # (n,): learn token r+2 here?
        "start_mask": starts,  # (n,): a chain starts here (eval), learned token r+2
        "label_ids": np.append(ids, -1)[first + 2 : end + 2],  # (n,): token r+2, -1 past the end
        "positions": np.arange(first, end),  # (n,): the record's own positions
        **image_inputs(rows, first, end),
    }


def image_inputs(rows: cf.RecordWindow, first: int, end: int) -> dict[str, np.ndarray]:
    """{"input_embeds": (n, H), "input_embed_mask": (n,)}: row r's input where token r+1 is an image position
    (the module docstring); {} for a record without images."""
    if rows.input_embeds is None:
        return {}
    image_mask = cf.mask_from_spans(rows.input_embed_spans, rows.num_tokens + 1, bool)  # (T + 1,): token T is none
    row_of_position = np.cumsum(image_mask) - 1  # (T + 1,): which input_embeds row an image position is
    mask = image_mask[first + 1 : end + 1]  # (n,): token r+1 is an image position
    embeds = np.zeros((end - first, rows.hidden_size), dtype=rows.input_embeds.dtype)  # (n, H)
    embeds[mask] = rows.input_embeds[row_of_position[first + 1 : end + 1][mask]]
    return {"input_embeds": embeds, "input_embed_mask": mask}


def shift_record(record: cf.CaptureRecord) -> dict[str, np.ndarray]:
    """The whole record's n = T - 1 rows as in the module docstring (one window)."""
    rows = cf.RecordWindow(
        record_id=record.record_id, sample_id=record.sample_id, model_fingerprint=record.model_fingerprint,
        capture_layers=record.capture_layers, hidden_size=record.hidden_size, dtype=record.dtype,
        token_ids=record.token_ids, loss_spans=record.loss_spans, metadata=record.metadata,
        num_states=record.num_states, start=0, end=record.num_states, aux=record.aux, final=record.final,
        input_embed_spans=record.input_embed_spans, input_embeds=record.input_embeds)
    return shift_window(rows, 0, record.num_tokens - 1)


def plan_rows(windows: Sequence[Window], config: Config) -> list[list[Window]]:
    """Rows of windows: one per row, or packed greedily in order into rows of <= max_length."""
    if not config.packing:
        return [[window] for window in windows]
    rows: list[list[Window]] = []
    used = config.max_length
    for window in windows:
        length = window[2] - window[1]
        if used + length > config.max_length:
            rows.append([])
            used = 0
        rows[-1].append(window)
        used += length
    return rows


def plan_epoch(
    windows: Sequence[Window], config: Config, epoch: int, rank: int, world_size: int, equal_per_rank: bool = True
) -> list[list[list[Window]]]:
    """This rank's batches (lists of rows of windows) for one epoch; windows: every window of the data, in order."""
    order = np.arange(len(windows))
    if config.shuffle:
        order = np.random.default_rng([config.seed, epoch]).permutation(len(windows))
    # Rows are packed before they are dealt, so batch g of the W ranks together is batch g of one process with
    # W times the batch size: the same rows, whatever the packing.
    rows = plan_rows([windows[index] for index in order], config)
    per_rank = []
    for other_rank in range(world_size):
        mine = rows[other_rank::world_size]
        per_rank.append([mine[start : start + config.batch_size] for start in range(0, len(mine), config.batch_size)])
    if not equal_per_rank:
        return per_rank[rank]
    num_batches = min(len(batches) for batches in per_rank)
    if num_batches == 0:
        raise ValueError(
            f"{len(windows)} usable windows of records ({len(rows)} rows) are too few for {world_size} ranks: some "
            "rank gets no batch; capture more records or use fewer ranks"
        )
    return per_rank[rank][:num_batches]


def collate(
    rows: list[list[dict[str, np.ndarray]]], record_ids: list[str], *, state_dtype: str, aux_width: int, hidden: int
) -> dict[str, Any]:
    """Tensors of one batch from rows of shifted windows; pad positions have doc_ids -1 and masks 0.

    aux_width = K*H and hidden = H size the batch even when every record of it was skipped. input_embeds (B, S, H)
    and input_embed_mask (B, S) are there only when a window of the batch has images (`image_inputs`).
    """
    width = max(1, max(sum(len(part["input_ids"]) for part in row) for row in rows))
    numpy_dtype = cf.STATE_DTYPES[state_dtype]
    num_rows_ = len(rows)
    aux = np.zeros((num_rows_, width, aux_width), dtype=numpy_dtype)  # (B, S, K*H)
    final = np.zeros((num_rows_, width, hidden), dtype=numpy_dtype)  # (B, S, H)
    input_ids = np.zeros((num_rows_, width), dtype=np.int64)  # (B, S)
    label_ids = np.full((num_rows_, width), -1, dtype=np.int64)  # (B, S)
    loss_mask = np.zeros((num_rows_, width), dtype=bool)  # (B, S)
    start_mask = np.zeros((num_rows_, width), dtype=bool)  # (B, S)
    positions = np.zeros((num_rows_, width), dtype=np.int64)  # (B, S)
    doc_ids = np.full((num_rows_, width), -1, dtype=np.int64)  # (B, S)
    with_images = any("input_embeds" in part for row in rows for part in row)
    input_embeds = np.zeros((num_rows_, width, hidden) if with_images else (0,), dtype=numpy_dtype)  # (B, S, H)
    input_embed_mask = np.zeros((num_rows_, width), dtype=bool)  # (B, S)
    for b, row in enumerate(rows):
        start = 0
        for doc, part in enumerate(row):
            end = start + len(part["input_ids"])
            aux[b, start:end] = part["aux"]
            final[b, start:end] = part["final"]
            input_ids[b, start:end] = part["input_ids"]
            label_ids[b, start:end] = part["label_ids"]
            loss_mask[b, start:end] = part["loss_mask"]
            start_mask[b, start:end] = part["start_mask"]
            positions[b, start:end] = part["positions"]
            doc_ids[b, start:end] = doc
            if "input_embeds" in part:
                input_embeds[b, start:end] = part["input_embeds"]
                input_embed_mask[b, start:end] = part["input_embed_mask"]
            start = end

    def states(array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        return tensor.view(torch.bfloat16) if state_dtype == "bfloat16" else tensor

    return {
        "aux": states(aux),
        "final": states(final),
        "input_ids": torch.from_numpy(input_ids),
        "label_ids": torch.from_numpy(label_ids),
        "loss_mask": torch.from_numpy(loss_mask),
        "start_mask": torch.from_numpy(start_mask),
        "position_ids": torch.from_numpy(positions),
        "doc_ids": torch.from_numpy(doc_ids),
        "record_ids": record_ids,
        **({"input_embeds": states(input_embeds), "input_embed_mask": torch.from_numpy(input_embed_mask)}
           if with_images else {}),
    }


def open_shards(shards: str | Path | Config) -> Shards:
    """The readable shards of a folder or an s3:// prefix; damaged ones are skipped, named and counted in a warning."""
    config = shards if isinstance(shards, Config) else Config(shards=str(shards))
    directory = config.open_shards()
    if directory.damaged:
        log.warning("skipping %d damaged shard(s) of %s (`eagle-tap shards repair` rebuilds an index): %s",
                    len(directory.damaged), config.shards, "; ".join(damaged.reason for damaged in directory.damaged))
    if directory.open_shard_paths and cf.is_remote(config.shards):
        log.warning("%d shard(s) of %s have no index in the store yet (an upload under way) and are not read",
                    len(directory.open_shard_paths), config.shards)
    return directory


def require_records(shards: str | Path | Config) -> list[cf.IndexEntry]:
    """Every readable index entry of a shard folder or prefix (of a Config: only those of its record_ids, in
    the file's order); ValueError (ShardError) if it is missing, holds none, or lacks a selected record."""
    config = shards if isinstance(shards, Config) else Config(shards=str(shards))
    with open_shards(config) as directory:
        entries = list(directory.iter_index())
    if not entries:
        raise ValueError(f"{config.shards} holds no sealed shard with records")
    if config.record_ids is not None:
        entries = select_records(entries, read_record_ids(config.record_ids), config.shards, config.record_ids)
    return entries


class ShardDataset(torch.utils.data.IterableDataset):
    """Batches of this rank's share of a shard directory's windows, across epochs, from batch `start_batch` on.

    window_overlap: rows a window repeats from the one before (the module docstring; train and eval pass
    ttt_steps - 1). Checks every index entry against what the draft expects (capture layers, hidden size,
    target fingerprint) when built, so a mismatched capture fails before training starts.
    """

    def __init__(
        self,
        config: Config,
        *,
        rank: int = 0,
        world_size: int = 1,
        start_batch: int = 0,
        num_epochs: int | None = None,
        equal_per_rank: bool = True,
        window_overlap: int = 0,
        capture_layers: Sequence[int] | None = None,
        hidden_size: int | None = None,
        model_fingerprint: str | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.start_batch = start_batch
        self.num_epochs = num_epochs
        self.equal_per_rank = equal_per_rank
        self.window_overlap = window_overlap
        self.entries = require_records(config)
        expected = {"capture_layers": None if capture_layers is None else tuple(capture_layers),
                    "hidden_size": hidden_size, "model_fingerprint": model_fingerprint, "dtype": None}
        for name, value in expected.items():
            found = {getattr(entry, name) for entry in self.entries}
            if len(found) != 1 or (value is not None and found != {value}):
                raise ValueError(
                    f"records in {config.shards} have {name} {sorted(found)}; "
                    + ("they must agree" if value is None else f"the draft expects {value}")
                )
        self.state_dtype = self.entries[0].dtype
        self.windows: list[Window] = [
            (index, first, end) for index, entry in enumerate(self.entries)
            for first, end in record_windows(entry.num_tokens, config.max_length, window_overlap)]

    def plan(self, epoch: int) -> list[list[list[Window]]]:
        return plan_epoch(self.windows, self.config, epoch, self.rank, self.world_size, self.equal_per_rank)

    def batch_indices(self) -> Iterator[tuple[int, int, list[list[Window]]]]:
        """(global batch number, epoch, rows of windows), from start_batch on."""
        first_of_epoch = 0
        epochs = itertools.count() if self.num_epochs is None else range(self.num_epochs)
        for epoch in epochs:
            batches = self.plan(epoch)
            for number in range(max(self.start_batch, first_of_epoch), first_of_epoch + len(batches)):
                yield number, epoch, batches[number - first_of_epoch]
            first_of_epoch += len(batches)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        worker = torch.utils.data.get_worker_info()
        worker_id, num_workers = (0, 1) if worker is None else (worker.id, worker.num_workers)
        mine = ((number, epoch, rows) for number, epoch, rows in self.batch_indices() if number % num_workers == worker_id)
        # From an object store, the next batch's records are fetched while this one is read and trained on.
        with self.config.open_shards() as shards, ThreadPoolExecutor(1, thread_name_prefix="prefetch") as fetcher:
            current = next(mine, None)
            fetched = fetcher.submit(shards.prefetch, self._entries_of(current)) if current else None
            while current is not None:
                upcoming = next(mine, None)
                fetched.result()
                if upcoming is not None:
                    fetched = fetcher.submit(shards.prefetch, self._entries_of(upcoming))
                yield self._read_batch(shards, *current)
                current = upcoming

    def _entries_of(self, batch: tuple[int, int, list[list[Window]]]) -> list[cf.IndexEntry]:
        indices = dict.fromkeys(index for row in batch[2] for index, _, _ in row)
        return [self.entries[index] for index in indices]

    def _read_batch(self, shards: Shards, number: int, epoch: int, rows: list[list[Window]]) -> dict[str, Any]:
        wanted: dict[int, list[tuple[int, int]]] = {}
        for row in rows:
            for index, first, end in row:
                wanted.setdefault(index, []).append((first, end))
        read: dict[Window, cf.RecordWindow] = {}
        skipped = []
        for index, windows in wanted.items():
            entry = self.entries[index]
            try:
                parts = read_windows(shards, entry, windows)
            except cf.CaptureFormatError as error:
                log.error("skipping record %s: %s", entry.record_id, error)
                skipped += [entry.record_id] * len(windows)
                continue
            read.update(((index, *window), part) for window, part in zip(windows, parts, strict=True))
        shifted_rows, record_ids, metadata, placed = [], [], [], []
        for b, row in enumerate(rows):
            shifted_rows.append([])
            for window in row:
                if window not in read:
                    continue
                index, first, end = window
                placed.append((b, len(shifted_rows[-1]), first, end, self.entries[index].num_tokens - 1))
                shifted_rows[-1].append(shift_window(read[window], first, end, self.window_overlap))
                record_ids.append(self.entries[index].record_id)
                metadata.append(read[window].metadata)
        entry = self.entries[0]
        batch = collate(shifted_rows, record_ids, state_dtype=self.state_dtype,
                        aux_width=len(entry.capture_layers) * entry.hidden_size, hidden=entry.hidden_size)
        # Per window, in record_ids order: its record's metadata (`eagle-tap eval` reads what the serving draft
        # achieved) and where it lies: (batch row, doc id, first row, end row, rows of its record).
        batch.update(batch_number=number, epoch=epoch, skipped_record_ids=skipped, record_metadata=metadata,
                     windows=placed)
        return batch


def make_loader(dataset: ShardDataset, pin_memory: bool = False) -> torch.utils.data.DataLoader:
    """A DataLoader that yields the dataset's batches in order (batching happens in the dataset)."""
    num_workers = dataset.config.num_workers
    return torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=num_workers, pin_memory=pin_memory,
        prefetch_factor=2 if num_workers else None, persistent_workers=False,
    )

