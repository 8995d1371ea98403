"""Training batches from capture shards: the read-time shift, batch plans, and a resumable dataset.

The shift (`shift_record`, the only place it happens). A record holds the sequence as the server
saw it. Row r of the draft's input pairs the target's state at position r with the embedding of
the NEXT token r+1, and predicts token r+2, whose target distribution is
softmax(lm_head(final[r+1])) (SGLang's draft-extend rotates input ids left by one the same way).
The loss mask of row r is the record's mask at the predicted token r+2 (loss spans mark the
tokens the draft learns to predict). A record of T tokens gives T-1 rows; the last row's token
r+2 lies past the record, so its mask is 0. Worked example, T = 5, loss span (2, 5):

    record  t           0    1    2    3    4
            token_ids   a    b    c    d    e
            loss mask   0    0    1    1    1
            aux         A0   A1   A2   A3   A4     inputs of the capture layers at t
            final       F0   F1   F2   F3   F4     softmax(lm_head(F_t)) = target's guess of token t+1

    rows    r                        0    1    2    3
            aux         aux[r]       A0   A1   A2   A3
            input_ids   ids[r+1]     b    c    d    e
            final       final[r+1]   F1   F2   F3   F4   -> target distribution of c, d, e, (past e)
            loss_mask   mask[r+2]    1    1    1    0
            label_ids   ids[r+2]     c    d    e    -1
            positions   r            0    1    2    3

A record whose last token has no state (S = T - 1 rows of states: the server sampled that token and
never ran a forward on it) gives the same T - 1 rows. Only its last row, r = T - 2, would read the
missing final[T - 1]; that row predicts token T, past the record, so its mask is 0 and its target is
never read: it gets zeros. aux[T - 1] is never read by any record. So such a record trains exactly
like a prefill capture of the same T tokens, including on its last token (often the end of turn).

Test-time-training step i (trainer/ttt.py) reads row r + i of the same record for input ids,
targets and mask, at position r + i, with the draft's own hidden state of row r.

Batches. An epoch's plan is made from the index alone (token counts), so it is cheap and
deterministic: records are shuffled by (seed, epoch), dealt to ranks round-robin, and each rank
groups its records into batches of `batch_size` rows: one record per row (padding), or records
packed back to back into rows of up to `max_length` positions (packing; `doc_ids` keep records
apart). Every rank gets the same number of batches per epoch (the smallest count), so DDP ranks
step together. Batches are numbered globally across epochs; DataLoader worker w of W makes the
batches g with g % W == w, so the loader yields them in order. The dataset's whole state is the
number of batches consumed: resuming from it yields exactly the batches an uninterrupted run
would have. A record whose checksums fail is reported and left out of its batch.

Records. `record_ids` names a text file of record ids (one per line, `#` starts a comment): then
only those records of the shard set exist for the dataset, in the file's order (so an unshuffled
pass reads them in that order), and every other record is ignored. The selection is made on the
index alone, local or remote, before any plan; an id the shards lack is an error naming it, as
is an empty selection.

Shards may sit in an object store (`shards = "s3://bucket/prefix"`, capture_format/remote_shards.py):
then each record is fetched alone (a rank fetches only its own) into a bounded local cache, and the
records of the next batch are fetched while the current one is used, so the store's latency hides
behind the training step.

Shape legend: B rows, S positions per row, K capture layers, H hidden size.
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
from capture_format.errors import InvalidRecordError
from capture_format.records import check_record_id
from capture_format.remote_shards import RemoteShardDirectory

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
    """Positions per row; a longer record is cut to its first max_length + 1 tokens."""
    packing: bool = False
    """Pack several records into each row (True) or put one record per row, padded (False)."""
    shuffle: bool = True
    """Shuffle records each epoch by (seed, epoch)."""
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


def shift_record(record: cf.CaptureRecord, max_length: int) -> dict[str, np.ndarray]:
    """The record's rows as in the module docstring: n = min(T - 1, max_length) rows."""
    num_rows = min(record.num_tokens - 1, max_length)
    ids = record.token_ids.astype(np.int64)
    mask_past_end = np.append(record.loss_mask(), 0)  # (T + 1,): the token after the record is never learned
    final = record.final[1 : num_rows + 1]
    if final.shape[0] < num_rows:  # the last token has no state (captured while generating): see below
        final = np.concatenate([final, np.zeros_like(record.final[:1])])
    return {
        "aux": record.aux[:num_rows].reshape(num_rows, -1),  # (n, K*H): target states at r
        "input_ids": ids[1 : num_rows + 1],  # (n,): token r+1
        "final": final,  # (n, H): its logits are the target distribution of token r+2
        "loss_mask": mask_past_end[2 : num_rows + 2].astype(bool),  # (n,): learn token r+2?
        "label_ids": np.append(ids, -1)[2 : num_rows + 2],  # (n,): token r+2, -1 past the end
    }


def num_rows(num_tokens: int, max_length: int) -> int:
    return max(min(num_tokens - 1, max_length), 0)


def plan_rows(records: Sequence[int], lengths: Sequence[int], config: Config) -> list[list[int]]:
    """Rows of record indices: one per row, or packed greedily in order into rows of <= max_length."""
    if not config.packing:
        return [[index] for index in records]
    rows: list[list[int]] = []
    used = config.max_length
    for index in records:
        if used + lengths[index] > config.max_length:
            rows.append([])
            used = 0
        rows[-1].append(index)
        used += lengths[index]
    return rows


def plan_epoch(
    lengths: Sequence[int], config: Config, epoch: int, rank: int, world_size: int, equal_per_rank: bool = True
) -> list[list[list[int]]]:
    """This rank's batches (lists of rows of record indices) for one epoch; lengths: rows per record."""
    order = np.arange(len(lengths))
    if config.shuffle:
        order = np.random.default_rng([config.seed, epoch]).permutation(len(lengths))
    order = [int(index) for index in order if lengths[index] > 0]
    per_rank = []
    for other_rank in range(world_size):
        rows = plan_rows(order[other_rank::world_size], lengths, config)
        per_rank.append([rows[start : start + config.batch_size] for start in range(0, len(rows), config.batch_size)])
    if not equal_per_rank:
        return per_rank[rank]
    num_batches = min(len(batches) for batches in per_rank)
    if num_batches == 0:
        raise ValueError(
            f"{len(order)} usable records are too few for {world_size} ranks: some rank gets no batch; "
            "capture more records or use fewer ranks"
        )
    return per_rank[rank][:num_batches]


def collate(
    rows: list[list[dict[str, np.ndarray]]], record_ids: list[str], *, state_dtype: str, aux_width: int, hidden: int
) -> dict[str, Any]:
    """Tensors of one batch from rows of shifted records; pad positions have doc_ids -1 and mask 0.

    aux_width = K*H and hidden = H size the batch even when every record of it was skipped.
    """
    width = max(1, max(sum(len(part["input_ids"]) for part in row) for row in rows))
    numpy_dtype = cf.STATE_DTYPES[state_dtype]
    num_rows_ = len(rows)
    aux = np.zeros((num_rows_, width, aux_width), dtype=numpy_dtype)  # (B, S, K*H)
    final = np.zeros((num_rows_, width, hidden), dtype=numpy_dtype)  # (B, S, H)
    input_ids = np.zeros((num_rows_, width), dtype=np.int64)  # (B, S)
    label_ids = np.full((num_rows_, width), -1, dtype=np.int64)  # (B, S)
    loss_mask = np.zeros((num_rows_, width), dtype=bool)  # (B, S)
    positions = np.zeros((num_rows_, width), dtype=np.int64)  # (B, S)
    doc_ids = np.full((num_rows_, width), -1, dtype=np.int64)  # (B, S)
    for b, row in enumerate(rows):
        start = 0
        for doc, part in enumerate(row):
            end = start + len(part["input_ids"])
            aux[b, start:end] = part["aux"]
            final[b, start:end] = part["final"]
            input_ids[b, start:end] = part["input_ids"]
            label_ids[b, start:end] = part["label_ids"]
            loss_mask[b, start:end] = part["loss_mask"]
            positions[b, start:end] = np.arange(end - start)
            doc_ids[b, start:end] = doc
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
        "position_ids": torch.from_numpy(positions),
        "doc_ids": torch.from_numpy(doc_ids),
        "record_ids": record_ids,
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


MAX_NAMED_IDS = 5
"""Missing record ids an error names (it counts them all)."""


def read_record_ids(path: str | Path) -> list[str]:
    """The record ids of a text file, in order: one per line, `#` starts a comment, blank lines are skipped.

    ValueError when the file cannot be read, a line is not a record id, an id is listed twice, or none is."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read the record id file {path}: {error}") from None
    record_ids: list[str] = []
    line_of: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        record_id = line.partition("#")[0].strip()
        if not record_id:
            continue
        try:
            check_record_id(record_id)
        except InvalidRecordError as error:
            raise ValueError(f"{path}:{number}: {error} (one id per line, # for comments)") from None
        if record_id in line_of:
            raise ValueError(f"{path}:{number}: record id {record_id!r} is listed again (first on line "
                             f"{line_of[record_id]}); list each record once")
        line_of[record_id] = number
        record_ids.append(record_id)
    if not record_ids:
        raise ValueError(f"{path} lists no record id: the selection would be empty")
    return record_ids


def select_records(entries: Sequence[cf.IndexEntry], record_ids: Sequence[str], shards: str,
                   source: str) -> list[cf.IndexEntry]:
    """The entries of record_ids, in their order; ValueError naming up to MAX_NAMED_IDS ids shards lack and the count.

    source names where the ids came from (a file) in the error."""
    by_id: dict[str, cf.IndexEntry] = {}
    for entry in entries:
        by_id.setdefault(entry.record_id, entry)
    missing = [record_id for record_id in record_ids if record_id not in by_id]
    if missing:
        raise ValueError(f"{len(missing)} of {len(record_ids)} record ids of {source} are not in {shards}: "
                         f"{', '.join(missing[:MAX_NAMED_IDS])}{', ...' if len(missing) > MAX_NAMED_IDS else ''}")
    return [by_id[record_id] for record_id in record_ids]


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
    """Batches of this rank's share of a shard directory, across epochs, from batch `start_batch` on.

    Checks every index entry against what the draft expects (capture layers, hidden size, target
    fingerprint) when built, so a mismatched capture fails before training starts.
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
        self.lengths = [num_rows(entry.num_tokens, config.max_length) for entry in self.entries]
        self.num_truncated = sum(entry.num_tokens - 1 > config.max_length for entry in self.entries)
        if self.num_truncated:
            log.warning("%d of %d records are longer than max_length + 1 = %d tokens and are cut",
                        self.num_truncated, len(self.entries), config.max_length + 1)

    def plan(self, epoch: int) -> list[list[list[int]]]:
        return plan_epoch(self.lengths, self.config, epoch, self.rank, self.world_size, self.equal_per_rank)

    def batch_indices(self) -> Iterator[tuple[int, int, list[list[int]]]]:
        """(global batch number, epoch, rows of record indices), from start_batch on."""
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

    def _entries_of(self, batch: tuple[int, int, list[list[int]]]) -> list[cf.IndexEntry]:
        return [self.entries[index] for row in batch[2] for index in row]

    def _read_batch(self, shards: Shards, number: int, epoch: int, rows: list[list[int]]) -> dict[str, Any]:
        shifted_rows, record_ids, metadata, skipped = [], [], [], []
        for row in rows:
            shifted_rows.append([])
            for index in row:
                entry = self.entries[index]
                try:
                    record = shards.read_record(entry)
                except cf.CaptureFormatError as error:
                    log.error("skipping record %s: %s", entry.record_id, error)
                    skipped.append(entry.record_id)
                    continue
                shifted_rows[-1].append(shift_record(record, self.config.max_length))
                record_ids.append(entry.record_id)
                metadata.append(record.metadata)
        entry = self.entries[0]
        batch = collate(shifted_rows, record_ids, state_dtype=self.state_dtype,
                        aux_width=len(entry.capture_layers) * entry.hidden_size, hidden=entry.hidden_size)
        # Each record's metadata, in record_ids order: `eagle-tap eval` reads what the serving draft achieved.
        batch.update(batch_number=number, epoch=epoch, skipped_record_ids=skipped, record_metadata=metadata)
        return batch


def make_loader(dataset: ShardDataset, pin_memory: bool = False) -> torch.utils.data.DataLoader:
    """A DataLoader that yields the dataset's batches in order (batching happens in the dataset)."""
    num_workers = dataset.config.num_workers
    return torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=num_workers, pin_memory=pin_memory,
        prefetch_factor=2 if num_workers else None, persistent_workers=False,
    )

