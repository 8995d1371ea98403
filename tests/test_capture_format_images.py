"""Records of requests with images (schema 2): image positions and the target's input embeddings there, through
records, frames and shards; text records stay schema 1, readable by readers that know only schema 1."""

from __future__ import annotations

import numpy as np
import pytest

import capture_format as cf
from capture_format import frame_header, records
from capture_format.shard_index import SEALED_SUFFIX
from capture_format import CaptureRecord, FrameError, InvalidRecordError, StatesPrefix, decode_frame, encode_frame
from test_capture_format_frames import REPOSITORY_ROOT, build_frame, known_answer, split_frame

HIDDEN = 16
IMAGE_SPANS = ((2, 6), (9, 11))  # two images: 4 and 2 placeholder positions
NUM_TOKENS = 14


def image_record(dtype: str = "bfloat16", seed: int = 0, **fields) -> CaptureRecord:
    rng = np.random.default_rng(seed)
    if dtype == "bfloat16":
        def states(*shape: int) -> np.ndarray:
            return cf.bfloat16_bits_from_float32(rng.standard_normal(shape).astype(np.float32))
    else:
        def states(*shape: int) -> np.ndarray:
            return rng.standard_normal(shape).astype(np.dtype(records.STATE_DTYPES[dtype]))
    token_ids = rng.integers(0, 1000, size=NUM_TOKENS).astype(np.int32)
    for start, end in IMAGE_SPANS:
        token_ids[start:end] = 4096  # the placeholder id, as the server expanded it
    values = dict(record_id=f"img-{seed}", sample_id="sample-img", model_fingerprint="tiny-kimi@1",
                  capture_layers=(1, 3), hidden_size=HIDDEN, dtype=dtype, token_ids=token_ids,
                  loss_spans=((11, NUM_TOKENS),), aux=states(NUM_TOKENS - 1, 2, HIDDEN),
                  final=states(NUM_TOKENS - 1, HIDDEN), metadata={"images": 2},
                  input_embed_spans=IMAGE_SPANS, input_embeds=states(6, HIDDEN))
    values.update(fields)
    return CaptureRecord(**values)


def text_record() -> CaptureRecord:
    record = image_record()
    return CaptureRecord(record_id="text-0", sample_id="sample-text", model_fingerprint=record.model_fingerprint,
                         capture_layers=record.capture_layers, hidden_size=HIDDEN, dtype=record.dtype,
                         token_ids=record.token_ids, loss_spans=record.loss_spans, aux=record.aux,
                         final=record.final)


def test_the_known_answer_image_record_encodes_to_the_fixture_bytes_and_decodes_to_known_values():
    fixture = (REPOSITORY_ROOT / "tests" / "fixtures" / "known_answer_image_frame.bin").read_bytes()
    assert encode_frame(known_answer.known_answer_image_record(), codec=known_answer.KNOWN_ANSWER_CODEC) == fixture
    # magic, format_version 1, flags 0, header_nbytes 1179, payload_nbytes 372, header checksum
    assert len(fixture) == 1583 and fixture[:32] == bytes.fromhex(
        "455441504652414d" "0100" "0000" "9b040000" "7401000000000000" "7cb62c9dae58bf26")
    # input_embeds, the last tensor: bytes 0x60f..0x62f, bf16 rows (e + 1) * 0.0625 * (h - 3.5)
    assert fixture[0x60F:0x61F] == bytes.fromhex("60be20bec0bd00bd003dc03d203e603e")
    record = decode_frame(fixture)
    assert record.schema_version == 2 and record.input_embed_spans == ((1, 3),) and record.loss_spans == ((3, 5),)
    assert record.token_ids.tolist() == [1, 4096, 4096, 3186, 2] and record.input_embed_mask().tolist() == [0, 1, 1, 0, 0]
    embeds = cf.float32_from_bfloat16_bits(record.input_embeds)
    assert embeds[1].tolist() == [-0.4375, -0.3125, -0.1875, -0.0625, 0.0625, 0.1875, 0.3125, 0.4375]


@pytest.mark.parametrize("dtype, codec", [("bfloat16", None), ("bfloat16", "raw"), ("bfloat16", "zstd:3"),
                                          ("float32", None), ("float16", "raw")])
def test_an_image_record_round_trips_through_a_frame_as_schema_2(dtype, codec):
    record = image_record(dtype)
    assert record.schema_version == 2 and record.input_embed_mask().tolist() == [
        1 if any(start <= t < end for start, end in IMAGE_SPANS) else 0 for t in range(NUM_TOKENS)]
    frame = encode_frame(record, codec)
    header, _ = split_frame(frame)
    assert header["schema_version"] == 2 and header["input_embed_spans"] == [[2, 6], [9, 11]]
    assert header["input_embeds_semantics"] == cf.INPUT_EMBEDS_SEMANTICS
    assert [tensor["name"] for tensor in header["tensors"]] == ["token_ids", "aux", "final", "input_embeds"]
    assert header["tensors"][3]["shape"] == [6, HIDDEN]
    info = cf.inspect_frame(frame)
    assert info.schema_version == 2 and info.input_embed_spans == IMAGE_SPANS
    embeds_nbytes = 6 * HIDDEN * record.input_embeds.itemsize
    assert info.raw_nbytes == record.raw_nbytes == 4 * NUM_TOKENS + record.aux.nbytes + record.final.nbytes + embeds_nbytes
    decoded = decode_frame(frame)
    assert decoded.schema_version == 2 and decoded.input_embed_spans == IMAGE_SPANS
    for name in ("token_ids", "aux", "final", "input_embeds"):
        np.testing.assert_array_equal(getattr(decoded, name), getattr(record, name))


def test_a_lossy_codec_stores_the_input_embeddings_like_the_states():
    record = image_record("bfloat16")
    decoded = decode_frame(encode_frame(record, "int8-row"))
    embeds = cf.float32_from_bfloat16_bits(decoded.input_embeds)
    original = cf.float32_from_bfloat16_bits(record.input_embeds)
    assert decoded.input_embeds.shape == (6, HIDDEN) and not np.array_equal(embeds, original)
    assert np.abs(embeds - original).max() < 0.02 * np.abs(original).max()


def test_a_text_record_is_still_schema_1_with_the_schema_1_header():
    record = text_record()
    assert record.schema_version == 1 and record.input_embeds is None and record.input_embed_spans == ()
    header, _ = split_frame(encode_frame(record))
    assert header["schema_version"] == 1 and set(header) == frame_header.HEADER_KEYS
    assert [tensor["name"] for tensor in header["tensors"]] == ["token_ids", "aux", "final"]
    assert decode_frame(encode_frame(record)).input_embeds is None


def test_a_reader_of_schema_1_only_reads_text_frames_and_refuses_an_image_frame_by_its_version(monkeypatch):
    text, image = encode_frame(text_record()), encode_frame(image_record())
    monkeypatch.setattr(records, "SCHEMA_VERSIONS", (1,))  # what every reader before schema 2 accepts
    assert decode_frame(text).record_id == "text-0"
    with pytest.raises(InvalidRecordError, match="schema_version 2 is not supported; accepted: 1$"):
        decode_frame(image)


@pytest.mark.parametrize("fields, message", [
    ({"loss_spans": ((5, 8),)}, r"input embed span \(2, 6\) overlaps loss span \(5, 8\): an image position is never"),
    ({"input_embeds": None}, "input_embed_spans mark 6 image positions; input_embeds is missing"),
    ({"input_embed_spans": ()}, "input_embeds given without input_embed_spans"),
    ({"input_embed_spans": ((2, 6), (8, 11))}, r"input_embeds has shape \(6, 16\); expected \(7, 16\)"),
    ({"input_embed_spans": ((6, 2),)}, r"input embed span \(6, 2\) must be non-empty, sorted"),
    ({"input_embed_spans": ((2, 6), (4, 6))}, "must be non-empty, sorted and not overlap"),
    ({"input_embed_spans": ((2, 15),)}, "input embed span end 15 is out of range"),
    ({"input_embeds": np.zeros((6, HIDDEN), np.float32)}, "input_embeds has dtype <f4; expected <u2"),
    ({"schema_version": 1}, "schema_version 1 does not fit this record: one with image positions is 2"),
    ({"states_prefix": StatesPrefix("0" * 32, 4), "aux": np.zeros((9, 2, HIDDEN), np.uint16),
      "final": np.zeros((9, HIDDEN), np.uint16)}, "a record with image positions holds every token's states itself"),
])
def test_records_that_break_the_image_rules_are_refused_with_the_rule_named(fields, message):
    with pytest.raises(InvalidRecordError, match=message):
        image_record(**fields)


def test_a_text_record_claiming_schema_2_is_refused():
    record = text_record()
    with pytest.raises(InvalidRecordError, match="schema_version 2 does not fit this record: one without"):
        CaptureRecord(record_id="t", sample_id="t", model_fingerprint="m", capture_layers=(1,), hidden_size=HIDDEN,
                      dtype="bfloat16", token_ids=record.token_ids, loss_spans=(), aux=record.aux[:, :1],
                      final=record.final, schema_version=2)


def _lie(mutate) -> bytes:
    header, payload = split_frame(encode_frame(image_record()))
    mutate(header)
    return build_frame(header, payload)


def _text_header_with(key: str, value) -> bytes:
    header, payload = split_frame(encode_frame(text_record()))
    header[key] = value
    return build_frame(header, payload)


@pytest.mark.parametrize("frame, error, message", [
    (lambda: _lie(lambda h: h.pop("input_embed_spans")), FrameError, r"missing fields \['input_embed_spans'\]"),
    (lambda: _lie(lambda h: h.update(input_embeds_semantics="vision-tower")), FrameError,
     "'input_embeds_semantics' is 'vision-tower'; this reader knows 'target-input-embeddings'"),
    (lambda: _lie(lambda h: h.update(input_embed_spans=[])), FrameError, "marks no image position"),
    (lambda: _lie(lambda h: h.update(input_embed_spans=[[2, 6], [8, 11]])), FrameError,
     r"tensor 'input_embeds' has shape \[6, 16\]; the record fields imply \[7, 16\]"),
    (lambda: _lie(lambda h: h.update(input_embed_spans=[[2, 6], [10, 12]])), InvalidRecordError,
     r"overlaps loss span \(11, 14\)"),
    (lambda: _lie(lambda h: h["tensors"].pop()), FrameError, "lists 3 tensors; schema 2 expects"),
    (lambda: _lie(lambda h: h.update(schema_version=1)), FrameError, "unexpected fields"),
    (lambda: _text_header_with("input_embed_spans", [[2, 6]]), FrameError,
     r"frame header \(schema 1\): missing fields \[\], unexpected fields \['input_embed_spans'\]"),
    (lambda: _text_header_with("schema_version", 2), FrameError, "missing fields"),
])
def test_frame_headers_that_lie_about_images_are_refused(frame, error, message):
    with pytest.raises(error, match=message):
        cf.inspect_frame(frame())


def test_image_records_are_stored_in_shards_and_read_back_whole(tmp_path):
    stored = [image_record(seed=seed) for seed in range(3)] + [text_record()]
    cf.write_shards(stored, tmp_path, records_per_shard=2)
    with cf.ShardDirectory(tmp_path) as shards:
        entries = {entry.record_id: entry for entry in shards.iter_index()}
        assert set(entries) == {record.record_id for record in stored}
        for record in stored:
            read = shards.read_record(entries[record.record_id])
            assert read.schema_version == record.schema_version and read.input_embed_spans == record.input_embed_spans
            if record.input_embeds is None:
                assert read.input_embeds is None
            else:
                np.testing.assert_array_equal(read.input_embeds, record.input_embeds)
    shard_paths = sorted(tmp_path.glob(f"*{SEALED_SUFFIX}"))
    assert len(shard_paths) == 2 and all(cf.verify_shard(path).ok for path in shard_paths)


def test_shard_stats_count_the_records_with_images(tmp_path):
    import io

    from collector_service.shard_tools import print_stats

    cf.write_shards([image_record(seed=seed) for seed in range(2)] + [text_record()], tmp_path, records_per_shard=2)
    out = io.StringIO()
    print_stats(tmp_path, out=out)
    assert "records with images: 2 (12 image positions" in out.getvalue()
