"""Reading a long record in windows: a record stored as a chain of parts behind a shared-prefix block.

The record here: 130 tokens captured while generating (S = 129 rows), a shared system-prompt block
[0, 16), parts [16, 40), [40, 47), [47, 90), [90, 100) and its own frame [100, 129). Every window is
compared with the slice of read_record's resolved record, from a folder and from an S3 API (moto).
"""

from __future__ import annotations

import itertools
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import capture_format as cf
from capture_format import remote_shards, shard_reader
from capture_format.object_store import RecordCache, s3_filesystem
from capture_format.prefix_blocks import BLOCK_KIND, BlockCache, DanglingPrefixError, prefix_key, states_namespace
from capture_format.remote_shards import RemoteShardDirectory
from capture_format.shard_index import format_index, shard_stem
from eagle_tap.testbed.s3_server import S3Server

LAYERS = (2, 5, 7)
FRAME_ENDS = (16, 40, 47, 90, 100, 129)  # the shared block, four parts, the record's own frame
NUM_TOKENS = 130


def long_record(record_id: str, ids: np.ndarray, ends: tuple[int, ...], hidden: int,
                seed: int = 0) -> tuple[list[cf.CaptureRecord], cf.CaptureRecord]:
    """(the chain's blocks, the closing record) of a generate-mode record (S = T - 1) whose frames end at ends;
    the first block is a shared prefix, the others parts of this capture. States are random bf16 bits."""
    rng = np.random.default_rng(seed)
    num_states = len(ids) - 1
    aux = rng.integers(0, 0x7F00, (num_states, len(LAYERS), hidden), dtype=np.uint16)  # [S, K, H] bf16 bits
    final = rng.integers(0, 0x7F00, (num_states, hidden), dtype=np.uint16)  # [S, H]
    space = states_namespace("tiny@1", LAYERS, hidden, "bfloat16")
    common = dict(sample_id=record_id, model_fingerprint="tiny@1", capture_layers=LAYERS, hidden_size=hidden,
                  dtype="bfloat16")
    blocks = []
    for index, (first, end) in enumerate(zip((0, *ends), ends[:-1])):
        part = {"capture_part": {"record_id": record_id, "index": index - 1}} if index else {}
        metadata = {"kind": BLOCK_KIND, **part}
        blocks.append(cf.CaptureRecord(
            record_id=cf.block_record_id(prefix_key(ids[:end], space)), token_ids=ids[:end], loss_spans=(),
            aux=aux[first:end], final=final[first:end], metadata=metadata,
            states_prefix=cf.StatesPrefix(prefix_key(ids[:first], space), first) if first else None, **common))
    last = ends[-2]
    closing = cf.CaptureRecord(record_id=record_id, token_ids=ids, loss_spans=((20, 60), (100, len(ids))),
                               aux=aux[last:], final=final[last:], metadata={"turns": 3},
                               states_prefix=cf.StatesPrefix(prefix_key(ids[:last], space), last), **common)
    return blocks, closing


IDS = np.arange(1000, 1000 + NUM_TOKENS, dtype=np.int32)
BLOCKS, RECORD = long_record("long", IDS, FRAME_ENDS, hidden=16)


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The blocks and the record in two shards (parts before the record, as a collector would store them)."""
    path = tmp_path_factory.mktemp("shards")
    cf.write_shards(BLOCKS[:3], path, records_per_shard=3)
    cf.write_shards([*BLOCKS[3:], RECORD], path, records_per_shard=3)
    return path


def entry_of(shards: shard_reader.IndexedShards, record_id: str) -> cf.IndexEntry:
    return next(entry for shard in shards.shards for entry in shard.entries if entry.record_id == record_id)


def boundary_windows() -> list[tuple[int, int]]:
    """Every window between rows next to a frame boundary: first row, last row, the whole record, each frame,
    windows inside one frame and windows crossing one or several boundaries."""
    rows = sorted({row + step for row in (0, *FRAME_ENDS) for step in (-1, 0, 1) if 0 <= row + step <= FRAME_ENDS[-1]})
    return [(start, end) for start, end in itertools.combinations(rows, 2)]


def check_windows(shards: shard_reader.IndexedShards, windows: list[tuple[int, int]]) -> None:
    entry = entry_of(shards, "long")
    whole = shards.read_record(entry)
    assert whole.num_states == FRAME_ENDS[-1] and whole.num_tokens == NUM_TOKENS
    for start, end in windows:
        window = shards.read_window(entry, start, end)
        assert (window.start, window.end, window.num_states) == (start, end, FRAME_ENDS[-1])
        assert np.array_equal(window.aux, whole.aux[start:end]), (start, end)
        assert np.array_equal(window.final, whole.final[start:end]), (start, end)
        assert np.array_equal(window.token_ids, IDS) and window.loss_spans == RECORD.loss_spans
        assert window.metadata == {"turns": 3} and not window.aux.flags.writeable


def test_every_window_is_the_slice_of_the_resolved_record(shard_dir: Path) -> None:
    with cf.ShardDirectory(shard_dir) as shards:
        assert [entry.record_id for entry in shards.iter_index()] == ["long"]  # parts are not training samples
        layout = shards.read_layout(entry_of(shards, "long"))
        assert (layout.num_tokens, layout.num_states, layout.frame_ends) == (NUM_TOKENS, 129, FRAME_ENDS)
        windows = boundary_windows()
        assert (0, 1) in windows and (128, 129) in windows and (0, 129) in windows and (15, 101) in windows
        check_windows(shards, windows)


def test_a_window_decodes_only_the_frames_it_overlaps(shard_dir: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[str] = []

    def counting_decode(data, **kwargs):
        record = cf.decode_frame(data, **kwargs)
        decoded.append(record.record_id)
        return record

    monkeypatch.setattr(shard_reader, "decode_frame", counting_decode)
    names = {block.record_id: f"part ending at {end}" for block, end in zip(BLOCKS, FRAME_ENDS)} | {"long": "own"}
    with cf.ShardDirectory(shard_dir) as shards:
        entry = entry_of(shards, "long")
        for (start, end), expected in (((41, 46), ["part ending at 47"]), ((98, 102), ["part ending at 100", "own"]),
                                       ((0, 1), ["part ending at 16"]), ((128, 129), ["own"]),
                                       ((47, 90), ["part ending at 90"])):
            decoded.clear()
            shards.read_window(entry, start, end)
            assert [names[name] for name in decoded] == expected, (start, end)

    # A damaged part outside the window is never decoded: the window reads; one overlapping it is refused.
    copy = tmp_path / "damaged"
    copy.mkdir()
    for path in shard_dir.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    with cf.ShardDirectory(copy) as shards:
        part = entry_of(shards, BLOCKS[3].record_id)  # rows [47, 90)
        data = bytearray(part.shard_path.read_bytes())
        data[part.offset + part.length - 3] ^= 0x40  # in its payload: its header still checks
        part.shard_path.write_bytes(bytes(data))
        entry = entry_of(shards, "long")
        assert shards.read_window(entry, 0, 47).aux.shape == (47, len(LAYERS), 16)
        assert shards.read_window(entry, 90, 129).final.shape == (39, 16)
        with pytest.raises(cf.ChecksumError, match=f"{part.shard_path} at offset {part.offset}"):
            shards.read_window(entry, 46, 48)
        with pytest.raises(cf.ChecksumError, match="stored bytes hash to"):
            shards.read_record(entry)


def test_a_bad_range_is_refused_naming_the_range_and_the_number_of_states(shard_dir: Path) -> None:
    with cf.ShardDirectory(shard_dir) as shards:
        entry = entry_of(shards, "long")
        for start, end in ((-1, 5), (5, 5), (10, 3), (0, 130), (129, 130)):
            with pytest.raises(ValueError, match=rf"window \[{start}, {end}\) of record long is not a range of its "
                                                 r"129 rows of states: 0 <= start < end <= 129"):
                shards.read_window(entry, start, end)


def test_a_dangling_or_mismatched_chain_is_refused_like_read_record(tmp_path: Path) -> None:
    # Without the part [47, 90), even a window that does not touch it is refused: the chain is checked whole.
    cf.write_shards([*BLOCKS[:3], *BLOCKS[4:], RECORD], tmp_path / "missing", records_per_shard=8)
    # A part under the right id holding other ids (a forged or corrupt store).
    other_ids = IDS.copy()
    other_ids[50] = 7
    forged = BLOCKS[3]
    forged_blocks = [*BLOCKS[:3], cf.CaptureRecord(
        record_id=forged.record_id, sample_id="long", model_fingerprint="tiny@1", capture_layers=LAYERS,
        hidden_size=16, dtype="bfloat16", token_ids=other_ids[:90], loss_spans=(), aux=forged.aux,
        final=forged.final, metadata=forged.metadata, states_prefix=forged.states_prefix), *BLOCKS[4:], RECORD]
    cf.write_shards(forged_blocks, tmp_path / "forged", records_per_shard=8)
    for folder, message in (("missing", "is not in the shards read"), ("forged", "holds other token ids")):
        with cf.ShardDirectory(tmp_path / folder) as shards:
            entry = entry_of(shards, "long")
            with pytest.raises(DanglingPrefixError, match=message):
                shards.read_record(entry)
            for start, end in ((0, 10), (50, 60), (120, 129)):
                with pytest.raises(DanglingPrefixError, match=message):
                    shards.read_window(entry, start, end)
            with pytest.raises(DanglingPrefixError, match=message):
                shards.read_layout(entry)


def test_the_caches_count_parts_and_never_keep_one_larger_than_their_bound(tmp_path: Path) -> None:
    part = BLOCKS[3]  # rows [47, 90), the largest frame of the chain
    blocks = BlockCache(max_bytes=part.raw_nbytes - 1)
    for block in (BLOCKS[1], BLOCKS[2], part):  # the largest is not kept and evicts nothing
        blocks.put(block)
    assert [blocks.get(block.record_id) is not None for block in BLOCKS] == [False, True, True, False, False]
    blocks.get(BLOCKS[1].record_id)
    blocks.put(BLOCKS[0])  # past the bound: the least recently used part goes, alone
    assert [blocks.get(block.record_id) is not None for block in BLOCKS] == [True, True, False, False, False]

    frames = RecordCache(tmp_path / "frames", max_bytes=3000)
    for name in "abc":
        frames.put(f"{name}.frame", bytes(1000))
        time.sleep(0.01)
    frames.put("big.frame", bytes(3001))  # larger than the whole cache: not kept, nothing evicted
    assert frames.get("big.frame") is None and frames.num_bytes == 3000 and frames.num_evicted == 0
    assert all(frames.get(f"{name}.frame") is not None for name in "abc")


@pytest.fixture(scope="module")
def bucket(shard_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The shards of shard_dir under s3://windows/p, on moto's S3 server; its environment set as a user sets it."""
    server = S3Server(log_path=tmp_path_factory.mktemp("s3") / "moto.log").start()
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in server.environment().items():
                patch.setenv(name, value)
            server.create_bucket("windows")
            fs = s3_filesystem()
            with cf.ShardDirectory(shard_dir) as shards:
                for index in shards.shards:
                    fs.pipe_file(f"windows/p/{index.shard_path.name}", index.shard_path.read_bytes())
                    fs.pipe_file(f"windows/p/{shard_stem(index.shard_path.name)}.index.json",
                                 format_index(index).encode())
            yield "s3://windows/p"
    finally:
        server.stop()


def test_windows_from_an_object_store_equal_the_local_ones_and_fetch_only_their_parts(
        bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for start_nbytes in (remote_shards.FRAME_START_NBYTES, 100):  # 100: headers and ids take a second GET
        monkeypatch.setattr(remote_shards, "FRAME_START_NBYTES", start_nbytes)
        with RemoteShardDirectory(bucket, cache=RecordCache(tmp_path / f"all-{start_nbytes}")) as shards:
            check_windows(shards, [(0, 1), (128, 129), (0, 129), (15, 101), (46, 48), (99, 101), (50, 60)])
    monkeypatch.undo()
    with RemoteShardDirectory(bucket, cache=RecordCache(tmp_path / "one")) as shards:
        entry = entry_of(shards, "long")
        window = shards.read_window(entry, 50, 60)  # inside the part [47, 90)
        assert shards.num_fetched_records == 1 and len(list((tmp_path / "one").iterdir())) == 1
        assert np.array_equal(window.aux, BLOCKS[3].aux[3:13])
        part = entry_of(shards, BLOCKS[3].record_id)
        assert shards.num_fetched_bytes < part.length + 6 * (64 << 10)  # the others' headers, the record's ids
    # A cache smaller than the record holds the parts read last; a part larger than it is read, not kept.
    largest = max(entry_of(shards, block.record_id).length for block in BLOCKS)
    cache = RecordCache(tmp_path / "small", max_bytes=largest - 1)
    with RemoteShardDirectory(bucket, cache=cache) as shards:
        entry = entry_of(shards, "long")
        for start, end in zip((0, *FRAME_ENDS[:-1]), FRAME_ENDS):
            window = shards.read_window(entry, start, end)
            assert window.aux.shape[0] == end - start
            assert cache.num_bytes <= largest - 1
        # Each frame came and went alone (the largest never came): the last one read is what is left.
        assert {path.name for path in (tmp_path / "small").iterdir()} == {shards._key(entry)}
        assert cache.num_evicted == 4 and shards.num_fetched_records == 6


def test_a_window_of_a_long_record_holds_its_parts_not_the_record(tmp_path: Path) -> None:
    # 4097 tokens, hidden 1024, bf16: 32 MiB of states in 16 frames of 2 MiB (the last is the record's own).
    ends = tuple(range(256, 4097, 256))
    assert ends[-1] == 4096
    blocks, record = long_record("big", np.arange(4097, dtype=np.int32), ends, hidden=1024, seed=1)
    part_nbytes = blocks[1].raw_nbytes
    record_nbytes = sum(block.raw_nbytes for block in blocks) + record.raw_nbytes
    cf.write_shards([*blocks, record], tmp_path, records_per_shard=16)
    peaks = {}
    for name, read in (("window", lambda shards, entry: shards.read_window(entry, 300, 400)),
                       ("window across two parts", lambda shards, entry: shards.read_window(entry, 1000, 1050)),
                       ("read_record", lambda shards, entry: shards.read_record(entry))):
        with cf.ShardDirectory(tmp_path) as shards:  # a new reader each: nothing cached
            entry = entry_of(shards, "big")
            tracemalloc.start()
            try:
                result = read(shards, entry)
                _, peaks[name] = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            del result
    print(f"\npeak memory reading a 4097-token record of {record_nbytes / 1e6:.1f} MB in 16 frames of "
          f"{part_nbytes / 1e6:.1f} MB: " + ", ".join(f"{name} {peak / 1e6:.1f} MB" for name, peak in peaks.items()))
    # Decoding a frame holds its bytes and its states (~2 parts); the first of two stays in the block cache.
    assert peaks["window"] < 2.5 * part_nbytes, peaks
    assert peaks["window across two parts"] < 4.5 * part_nbytes, peaks
    assert peaks["read_record"] > record_nbytes > 3 * peaks["window across two parts"], peaks
