"""Shards: write, seal, read back through the index, detect corruption, recover torn tails."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest

from capture_format import (
    CaptureRecord,
    ChecksumError,
    FrameError,
    ShardDirectory,
    ShardError,
    ShardWriter,
    encode_frame,
    inspect_frame,
    load_index,
    recover_open_shard,
    verify_shard,
)


def make_record(
    index: int, *, num_tokens: int = 7, fingerprint: str = "tiny@1", layers: tuple = (1, 4)
) -> CaptureRecord:
    rng = np.random.default_rng(index)
    return CaptureRecord(
        record_id=f"rec-{index:04d}",
        sample_id=f"sample-{index // 2}",
        model_fingerprint=fingerprint,
        capture_layers=layers,
        hidden_size=32,
        dtype="bfloat16",
        token_ids=rng.integers(0, 1000, size=num_tokens, dtype=np.int32),
        loss_spans=((2, num_tokens),),
        aux=rng.integers(0, 1 << 16, size=(num_tokens, len(layers), 32), dtype=np.uint16),
        final=rng.integers(0, 1 << 16, size=(num_tokens, 32), dtype=np.uint16),
    )


def write_shard(directory: Path, records: list[CaptureRecord]) -> Path:
    writer = ShardWriter(directory)
    for record in records:
        frame = encode_frame(record)
        writer.append(frame, inspect_frame(frame))
    writer.flush()
    return writer.seal().shard_path


def assert_same_record(decoded: CaptureRecord, original: CaptureRecord) -> None:
    assert decoded.record_id == original.record_id
    assert decoded.loss_spans == original.loss_spans
    for name in ("token_ids", "aux", "final"):
        assert getattr(decoded, name).tobytes() == getattr(original, name).tobytes()


def test_write_seal_and_read_back_through_the_index(tmp_path: Path) -> None:
    records = [make_record(index, num_tokens=3 + index) for index in range(5)]
    writer = ShardWriter(tmp_path)
    assert writer.path.name == "shard-000001.etap.open"
    offsets = []
    for record in records:
        frame = encode_frame(record)
        offsets.append(writer.append(frame, inspect_frame(frame)))
        writer.flush(durable=False)
    assert writer.num_records == 5 and writer.bytes_written == writer.path.stat().st_size
    writer.flush()
    index = writer.seal()
    assert sorted(os.listdir(tmp_path)) == ["shard-000001.etap", "shard-000001.index.json"]
    assert [entry.offset for entry in index.entries] == offsets
    assert (index.num_records, index.num_tokens) == (5, sum(3 + index for index in range(5)))
    with ShardDirectory(tmp_path) as shards:
        entries = list(shards.iter_index())
        assert [entry.record_id for entry in entries] == [record.record_id for record in records]
        for entry, record in zip(reversed(entries), reversed(records)):
            assert_same_record(shards.read_record(entry), record)
    assert verify_shard(index.shard_path).ok


def test_index_file_fields(tmp_path: Path) -> None:
    shard_path = write_shard(tmp_path, [make_record(0), make_record(1)])
    data = json.loads((tmp_path / "shard-000001.index.json").read_text())
    assert data["format_version"] == 1 and data["shard"] == "shard-000001.etap"
    assert data["shard_nbytes"] == shard_path.stat().st_size
    assert (data["num_records"], data["num_tokens"]) == (2, 14)
    assert (data["model_fingerprint"], data["capture_layers"], data["hidden_size"], data["dtype"]) == (
        "tiny@1",
        [1, 4],
        32,
        "bfloat16",
    )
    assert data["raw_nbytes"] == 2 * make_record(0).raw_nbytes
    first = data["records"][0]
    assert sorted(first) == sorted(
        ["record_id", "sample_id", "offset", "length", "num_tokens", "header_xxh3_64", "ids_xxh3_64"]
    )
    info = inspect_frame(encode_frame(make_record(0)))
    assert (first["header_xxh3_64"], first["ids_xxh3_64"], first["length"]) == (
        info.header_xxh3_64,
        info.ids_xxh3_64,
        info.frame_nbytes,
    )
    assert not list(tmp_path.glob("*.tmp"))


def test_mixed_shards_keep_differing_fields_per_record(tmp_path: Path) -> None:
    records = [make_record(0), make_record(1, fingerprint="other@2", layers=(0, 2, 5))]
    write_shard(tmp_path, records)
    data = json.loads((tmp_path / "shard-000001.index.json").read_text())
    assert data["model_fingerprint"] is None and data["capture_layers"] is None and data["hidden_size"] == 32
    assert data["records"][1]["capture_layers"] == [0, 2, 5]
    entries = list(ShardDirectory(tmp_path).iter_index())
    assert [(entry.model_fingerprint, entry.capture_layers) for entry in entries] == [
        ("tiny@1", (1, 4)),
        ("other@2", (0, 2, 5)),
    ]


def test_writers_number_shards_in_sequence(tmp_path: Path) -> None:
    write_shard(tmp_path, [make_record(0)])
    second = ShardWriter(tmp_path)
    assert second.number == 2
    second.close()
    with pytest.raises(FileExistsError):
        ShardWriter(tmp_path, number=2)
    assert ShardWriter(tmp_path).number == 3


def test_corrupt_byte_in_a_sealed_shard_names_shard_and_offset(tmp_path: Path) -> None:
    shard_path = write_shard(tmp_path, [make_record(index) for index in range(3)])
    entries = list(ShardDirectory(tmp_path).iter_index())
    damaged = entries[1]
    with open(shard_path, "r+b") as file:
        file.seek(damaged.offset + damaged.length - 10)  # inside the stored low plane of final
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0x10]))
    with ShardDirectory(tmp_path) as shards:
        with pytest.raises(ChecksumError) as caught:
            shards.read_record(damaged)
        assert f"{shard_path} at offset {damaged.offset}" in str(caught.value)
        assert "tensor 'final': stored bytes hash to" in str(caught.value)
        assert_same_record(shards.read_record(entries[2]), make_record(2))
    report = verify_shard(shard_path)
    assert (report.ok, report.num_records, report.num_verified, len(report.problems)) == (False, 3, 2, 1)
    assert f"at offset {damaged.offset}" in report.problems[0]


def test_index_that_does_not_match_the_frame_is_detected(tmp_path: Path) -> None:
    write_shard(tmp_path, [make_record(0), make_record(1)])
    index_path = tmp_path / "shard-000001.index.json"
    data = json.loads(index_path.read_text())
    data["records"][1]["header_xxh3_64"] = "0" * 16
    index_path.write_text(json.dumps(data))
    with ShardDirectory(tmp_path) as shards:
        entry = list(shards.iter_index())[1]
        with pytest.raises(ChecksumError, match="differs from the index's 0000000000000000"):
            shards.read_record(entry)
    data["records"][1]["header_xxh3_64"] = inspect_frame(encode_frame(make_record(1))).header_xxh3_64
    data["records"][1]["record_id"] = "rec-9999"
    index_path.write_text(json.dumps(data))
    with ShardDirectory(tmp_path) as shards:
        with pytest.raises(FrameError, match="frame has record_id 'rec-0001'; the index says 'rec-9999'"):
            shards.read_record(list(shards.iter_index())[1])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda data: "{not json", "not valid JSON"),
        (lambda data: {**data, "format_version": 2}, "format_version 2 is not supported"),
        (lambda data: {**data, "shard": "shard-000009.etap"}, "describes shard 'shard-000009.etap'"),
        (lambda data: {**data, "num_tokens": 1}, "index says num_tokens 1"),
        (lambda data: {**data, "records": data["records"][::-1]}, "entries must tile the shard"),
        (lambda data: {**data, "records": data["records"][:1]}, "index says shard_nbytes"),
        (lambda data: {**data, "extra": 1}, "index has fields"),
        (
            lambda data: {**data, "records": [{**data["records"][0], "record_id": "../x"}, *data["records"][1:]]},
            "record_id '../x'",
        ),
    ],
)
def test_malformed_indexes_are_shard_errors_naming_the_index(tmp_path: Path, damage, message: str) -> None:
    write_shard(tmp_path, [make_record(0), make_record(1)])
    index_path = tmp_path / "shard-000001.index.json"
    damaged = damage(json.loads(index_path.read_text()))
    index_path.write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
    with pytest.raises(ShardError, match=message) as caught:
        ShardDirectory(tmp_path)
    assert "shard-000001.index.json" in str(caught.value)


def test_missing_index_or_wrong_size_is_a_shard_error(tmp_path: Path) -> None:
    shard_path = write_shard(tmp_path, [make_record(0)])
    with open(shard_path, "ab") as file:
        file.write(b"extra")
    with pytest.raises(ShardError, match="its index says"):
        ShardDirectory(tmp_path)
    assert "its index says" in verify_shard(shard_path).problems[0]
    (tmp_path / "shard-000001.index.json").unlink()
    with pytest.raises(ShardError, match="has no index shard-000001.index.json"):
        ShardDirectory(tmp_path)


def _open_shard_with_tail(directory: Path, records: list[CaptureRecord], tail: bytes) -> Path:
    writer = ShardWriter(directory)
    for record in records:
        frame = encode_frame(record)
        writer.append(frame, inspect_frame(frame))
    writer.close()
    with open(writer.path, "ab") as file:
        file.write(tail)
    return writer.path


@pytest.mark.parametrize("cut_fraction", [0.0, 0.01, 0.5, 0.99])
def test_torn_tail_recovery_keeps_every_complete_frame(tmp_path: Path, cut_fraction: float) -> None:
    records = [make_record(index) for index in range(4)]
    torn = encode_frame(make_record(99))
    tail = torn[: max(1, int(len(torn) * cut_fraction))]
    open_path = _open_shard_with_tail(tmp_path, records, tail)
    kept_nbytes = open_path.stat().st_size - len(tail)
    report = recover_open_shard(open_path)
    assert (report.num_records, report.bytes_kept, report.bytes_cut) == (4, kept_nbytes, len(tail))
    assert report.sealed_path == tmp_path / "shard-000001.etap" and not open_path.exists()
    assert f"frame at offset {kept_nbytes}" in report.stop_reason
    with ShardDirectory(tmp_path) as shards:
        for entry, record in zip(shards.iter_index(), records, strict=True):
            assert_same_record(shards.read_record(entry), record)
    assert verify_shard(report.sealed_path).ok


def test_recovery_steps_over_a_bad_payload_and_keeps_the_frames_behind_it(tmp_path: Path) -> None:
    damaged = bytearray(encode_frame(make_record(9)))
    damaged[-5] ^= 0xFF  # payload damaged, header (and so the frame's length) intact
    open_path = _open_shard_with_tail(tmp_path, [make_record(0)], bytes(damaged) + encode_frame(make_record(10)))
    report = recover_open_shard(open_path)
    assert report.num_records == 2 and report.stop_reason is None
    assert len(report.dropped) == 1 and "stored bytes hash to" in report.dropped[0]
    assert report.bytes_cut == len(damaged)
    with ShardDirectory(tmp_path) as shards:  # the sealed shard's index tiles it and both records read back
        assert [shards.read_record(entry).record_id for entry in shards.iter_index()] == [
            make_record(0).record_id, make_record(10).record_id]
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]


def test_recovery_stops_at_a_bad_header_and_keeps_a_clean_shard_as_is(tmp_path: Path) -> None:
    damaged = bytearray(encode_frame(make_record(9)))
    damaged[40] ^= 0xFF  # in the header: its length cannot be trusted, so nothing behind it can be found
    open_path = _open_shard_with_tail(tmp_path, [make_record(0)], bytes(damaged) + encode_frame(make_record(10)))
    report = recover_open_shard(open_path)
    assert report.num_records == 1 and "header checksum" in report.stop_reason and report.dropped == ()
    clean_path = _open_shard_with_tail(tmp_path, [make_record(1), make_record(2)], b"")
    clean = recover_open_shard(clean_path)
    assert (clean.num_records, clean.bytes_cut, clean.stop_reason) == (2, 0, None)
    assert ShardDirectory(tmp_path).num_records == 3


def test_recovery_of_a_shard_without_a_complete_frame_removes_it(tmp_path: Path) -> None:
    open_path = _open_shard_with_tail(tmp_path, [], b"ETAPFRAM\x01\x00")
    report = recover_open_shard(open_path)
    assert (report.sealed_path, report.num_records, report.bytes_cut) == (None, 0, 10)
    assert os.listdir(tmp_path) == []
    with pytest.raises(ShardError, match="not an open shard name"):
        recover_open_shard(tmp_path / "shard-000001.etap")


def test_recovery_refuses_a_shard_a_writer_holds(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path)
    with pytest.raises(ShardError, match="locked by another writer"):
        recover_open_shard(writer.path)
    writer.close()
    assert recover_open_shard(writer.path).sealed_path is None


def test_append_checks_the_frame_against_its_info_and_refuses_after_seal(tmp_path: Path) -> None:
    frame = encode_frame(make_record(0))
    writer = ShardWriter(tmp_path)
    with pytest.raises(ShardError, match="its FrameInfo says"):
        writer.append(frame[:-1], inspect_frame(frame))
    writer.append(frame, inspect_frame(frame))
    writer.seal()
    with pytest.raises(ShardError, match="the shard is sealed"):
        writer.append(frame, inspect_frame(frame))


def test_a_failed_write_is_cut_back_so_later_frames_stay_readable(tmp_path: Path, monkeypatch) -> None:
    frames = [encode_frame(make_record(index)) for index in range(3)]
    writer = ShardWriter(tmp_path)
    writer.append(frames[0], inspect_frame(frames[0]))
    real_pwrite = os.pwrite

    def write_half_then_fail(fd: int, data, offset: int) -> int:
        real_pwrite(fd, bytes(data)[: len(data) // 2], offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", write_half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        writer.append(frames[1], inspect_frame(frames[1]))
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    assert writer.path.stat().st_size == len(frames[0])
    writer.append(frames[2], inspect_frame(frames[2]))
    index = writer.seal()
    assert [entry.record_id for entry in index.entries] == ["rec-0000", "rec-0002"]
    assert verify_shard(index.shard_path).ok


def test_load_index_and_open_shards_are_listed(tmp_path: Path) -> None:
    shard_path = write_shard(tmp_path, [make_record(0)])
    open_writer = ShardWriter(tmp_path)
    shards = ShardDirectory(tmp_path)
    assert shards.open_shard_paths == (open_writer.path,)
    assert [shard.shard_path for shard in shards.shards] == [shard_path]
    assert load_index(shard_path).entries == shards.shards[0].entries
    open_writer.close()


def test_a_long_missing_folder_is_named_by_its_end(tmp_path):
    """A long path is cut at its start, so the error still names the folder that is missing."""
    missing = tmp_path.joinpath(*["deep" * 8] * 6, "no-shards")
    with pytest.raises(ShardError, match=r"shards folder \.\.\..*/no-shards' \(\d+ chars\) does not exist"):
        ShardDirectory(missing)
