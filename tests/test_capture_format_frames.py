"""Frames: known-answer bytes, round trips, and hostile or damaged input always raising typed errors."""

from __future__ import annotations

import copy
import importlib.util
import json
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import xxhash
import zstandard

from capture_format import (
    CaptureFormatError,
    CaptureRecord,
    ChecksumError,
    CodecError,
    FrameError,
    InvalidRecordError,
    UnknownCodecError,
    decode_frame,
    encode_frame,
    float32_from_bfloat16_bits,
    inspect_frame,
    parse_frame_prefix,
    read_frame_prefix,
    verify_inspected_frame,
)

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent
FIXTURE = (REPOSITORY_ROOT / "tests" / "fixtures" / "known_answer_frame.bin").read_bytes()
_spec = importlib.util.spec_from_file_location(
    "make_known_answer_frame", REPOSITORY_ROOT / "scripts" / "make_known_answer_frame.py"
)
known_answer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(known_answer)


def split_frame(frame: bytes) -> tuple[dict, bytes]:
    header_nbytes = struct.unpack_from("<I", frame, 12)[0]
    return json.loads(frame[32 : 32 + header_nbytes]), frame[32 + header_nbytes :]


def build_frame(header: dict, payload: bytes) -> bytes:
    """Frame bytes written from the documented layout, independently of capture_format."""
    header_bytes = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    unsigned_prefix = struct.pack("<8sHHIQ", b"ETAPFRAM", 1, 0, len(header_bytes), len(payload))
    checksum = xxhash.xxh3_64_intdigest(unsigned_prefix + header_bytes)
    return unsigned_prefix + struct.pack("<Q", checksum) + header_bytes + payload


def make_record(dtype: str = "bfloat16", num_tokens: int = 6, seed: int = 0) -> CaptureRecord:
    rng = np.random.default_rng(seed)
    numpy_dtype = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}[dtype]
    if dtype == "bfloat16":
        aux = rng.integers(0, 1 << 16, size=(num_tokens, 2, 16), dtype=np.uint16)
        final = rng.integers(0, 1 << 16, size=(num_tokens, 16), dtype=np.uint16)
    else:
        aux = rng.standard_normal((num_tokens, 2, 16)).astype(numpy_dtype)
        final = rng.standard_normal((num_tokens, 16)).astype(numpy_dtype)
    return CaptureRecord(
        record_id=f"rec-{seed}",
        sample_id="sample-1",
        model_fingerprint="tiny@1",
        capture_layers=(0, 3),
        hidden_size=16,
        dtype=dtype,
        token_ids=rng.integers(0, 32000, size=num_tokens, dtype=np.int32),
        loss_spans=((1, num_tokens),),
        aux=aux,
        final=final,
        metadata={"turn": 2, "source": "ünïcode ok"},
    )


def assert_same_record(decoded: CaptureRecord, original: CaptureRecord) -> None:
    fields = ("record_id", "sample_id", "model_fingerprint", "capture_layers", "hidden_size", "dtype", "loss_spans")
    for name in (*fields, "metadata"):
        assert getattr(decoded, name) == getattr(original, name), name
    for name in ("token_ids", "aux", "final"):
        assert getattr(decoded, name).dtype == getattr(original, name).dtype
        assert getattr(decoded, name).tobytes() == getattr(original, name).tobytes(), name


# Known answer -----------------------------------------------------------------------------------


def test_known_answer_record_encodes_to_the_fixture_bytes() -> None:
    assert encode_frame(known_answer.known_answer_record(), codec=known_answer.KNOWN_ANSWER_CODEC) == FIXTURE


def test_known_answer_fixture_decodes_to_known_values() -> None:
    assert len(FIXTURE) == 1269
    # magic, format_version 1, flags 0, header_nbytes 897, payload_nbytes 340, header checksum
    assert FIXTURE[:32] == bytes.fromhex(
        "455441504652414d" "0100" "0000" "81030000" "5401000000000000" "8e711f744f06475b"
    )
    assert read_frame_prefix(FIXTURE[:32]) == 1269
    info = inspect_frame(FIXTURE)
    assert (info.header_nbytes, info.frame_nbytes, info.raw_nbytes, info.stored_nbytes) == (897, 1269, 340, 340)
    assert info.header_xxh3_64 == "5b47064f741f718e"
    assert info.ids_xxh3_64 == xxhash.xxh3_64_hexdigest(np.array([1, 15043, 29892, 3186, 2], dtype="<i4").tobytes())
    record = decode_frame(FIXTURE)
    assert (record.record_id, record.sample_id, record.model_fingerprint) == (
        "known-answer-0001",
        "sample-0001",
        "tiny-llama-test@0000",
    )
    assert (record.capture_layers, record.hidden_size, record.dtype) == ((1, 3, 6), 8, "bfloat16")
    assert record.token_ids.tolist() == [1, 15043, 29892, 3186, 2]
    assert record.loss_spans == ((2, 5),)
    assert record.loss_mask().tolist() == [0, 0, 1, 1, 1]
    assert record.metadata == {"source": "scripts/make_known_answer_frame.py"}
    assert record.aux[0, 0].tolist() == [0x0000, 0x8000, 0x0001, 0x7F7F, 0x7F80, 0xFF80, 0x7FC1, 0xFF81]
    aux = float32_from_bfloat16_bits(record.aux)
    assert aux[4, 2].tolist() == [-4.375, -3.125, -1.875, -0.625, 0.625, 1.875, 3.125, 4.375]
    assert aux[1, 1].tolist() == [-3.5, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5]
    final = float32_from_bfloat16_bits(record.final)
    assert final[0].tolist() == [-0.5, -0.375, -0.25, -0.125, 0.0, 0.125, 0.25, 0.375]
    assert final[4, 7] == 1.375


def test_frame_layout_matches_an_independent_writer() -> None:
    header, payload = split_frame(FIXTURE)
    assert build_frame(header, payload) == FIXTURE
    assert [tensor["name"] for tensor in header["tensors"]] == ["token_ids", "aux", "final"]
    assert payload[:20] == np.array([1, 15043, 29892, 3186, 2], dtype="<i4").tobytes()


# Round trips ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "codec"),
    [
        ("bfloat16", None),
        ("bfloat16", "bf16-split"),
        ("bfloat16", "raw"),
        ("bfloat16", "zstd:1"),
        ("bfloat16", "zstd:7"),
        ("bfloat16", "bf16-channel"),
        ("float16", "bf16-channel"),
        ("float16", None),
        ("float16", "bf16-split"),
        ("float16", "raw"),
        ("float32", None),
        ("float32", "raw"),
        ("float32", "zstd:3"),
    ],
)
def test_records_round_trip_through_frames(dtype: str, codec: str | None) -> None:
    record = make_record(dtype)
    frame = encode_frame(record, codec)
    assert_same_record(decode_frame(frame), record)
    assert_same_record(decode_frame(bytearray(frame), verify=False), record)
    assert_same_record(decode_frame(memoryview(frame)), record)


def test_default_codec_is_bf16_split_for_bfloat16() -> None:
    header, _ = split_frame(encode_frame(make_record()))
    assert [tensor["codec"] for tensor in header["tensors"]] == ["raw", "bf16-split", "bf16-split"]


def test_bf16_split_is_rejected_for_float32_records() -> None:
    with pytest.raises(CodecError, match="bf16-split.*got float32 .4-byte elements"):
        encode_frame(make_record("float32"), "bf16-split")
    with pytest.raises(UnknownCodecError, match="available: raw, zstd:N"):
        encode_frame(make_record(), "zstdd")


def test_strided_and_big_endian_inputs_are_not_a_problem_for_the_encoder() -> None:
    record = make_record()
    strided = CaptureRecord(
        record_id="strided",
        sample_id="s",
        model_fingerprint="m",
        capture_layers=(0, 3),
        hidden_size=16,
        dtype="bfloat16",
        token_ids=record.token_ids,
        loss_spans=(),
        aux=np.repeat(record.aux, 2, axis=2)[:, :, ::2],
        final=record.final.T.copy().T,
    )
    assert_same_record(decode_frame(encode_frame(strided)), strided)


def test_inspect_frame_reports_what_the_collector_needs() -> None:
    record = make_record(num_tokens=9)
    frame = encode_frame(record)
    info = inspect_frame(frame)
    assert (info.record_id, info.sample_id, info.model_fingerprint) == ("rec-0", "sample-1", "tiny@1")
    assert (info.num_tokens, info.capture_layers, info.hidden_size, info.dtype) == (9, (0, 3), 16, "bfloat16")
    assert info.frame_nbytes == len(frame) == read_frame_prefix(frame[:32])
    assert info.raw_nbytes == record.raw_nbytes
    assert info.stored_nbytes == len(frame) - 32 - info.header_nbytes
    assert info.ids_xxh3_64 == xxhash.xxh3_64_hexdigest(record.token_ids.tobytes())
    assert info.header_xxh3_64 == parse_frame_prefix(frame).header_xxh3_64


# Damage -----------------------------------------------------------------------------------------

DAMAGE_FRAMES = {"raw": FIXTURE, **{codec: encode_frame(known_answer.known_answer_record(), codec)
                                    for codec in ("bf16-split", "bf16-channel")},
                 # Lossy codecs refuse the known answer's NaN and inf: a finite record instead.
                 **{codec: encode_frame(make_record("float16", num_tokens=3), codec) for codec in ("int8-row", "e4m3-row")}}


@pytest.mark.parametrize("codec", DAMAGE_FRAMES)
def test_every_truncation_is_a_frame_error(codec: str) -> None:
    frame = DAMAGE_FRAMES[codec]
    for cut in range(len(frame)):
        with pytest.raises(FrameError, match="truncated"):
            decode_frame(frame[:cut])
        with pytest.raises(FrameError, match="truncated"):
            inspect_frame(frame[:cut])
    with pytest.raises(FrameError, match="shorter than the 32-byte prefix"):
        read_frame_prefix(frame[:31])


@pytest.mark.parametrize("codec", DAMAGE_FRAMES)
def test_every_single_bit_flip_is_detected(codec: str) -> None:
    frame = DAMAGE_FRAMES[codec]
    payload_start = 32 + struct.unpack_from("<I", frame, 12)[0]
    for position in range(len(frame)):
        for bit in range(8):
            damaged = bytearray(frame)
            damaged[position] ^= 1 << bit
            damaged = bytes(damaged)
            expected = ChecksumError if position >= payload_start else CaptureFormatError
            with pytest.raises(expected):
                inspect_frame(damaged)
            with pytest.raises(expected):
                decode_frame(damaged)


def test_trailing_bytes_are_rejected() -> None:
    with pytest.raises(FrameError, match="1 trailing bytes after a 1269-byte frame"):
        decode_frame(FIXTURE + b"\x00")
    with pytest.raises(FrameError, match="trailing"):
        inspect_frame(FIXTURE + FIXTURE)


def test_verify_false_skips_tensor_checksums_only() -> None:
    damaged = bytearray(FIXTURE)
    damaged[-1] ^= 0x01  # last byte of final: the raw codec decodes anything
    assert decode_frame(bytes(damaged), verify=False).final[-1, -1] != decode_frame(FIXTURE).final[-1, -1]
    with pytest.raises(ChecksumError, match="tensor 'final': stored bytes hash to"):
        decode_frame(bytes(damaged))
    damaged_header = bytearray(FIXTURE)
    damaged_header[100] ^= 0x01
    with pytest.raises(ChecksumError, match="header checksum mismatch"):
        decode_frame(bytes(damaged_header), verify=False)


@pytest.mark.parametrize(
    ("prefix_fields", "message"),
    [
        ((b"ETAPFRAX", 1, 0), "not a frame: magic is b'ETAPFRAX'"),
        ((b"ETAPFRAM", 2, 0), "format_version 2 is not supported; accepted: 1"),
        ((b"ETAPFRAM", 1, 4), "flags 0x0004 are not supported"),
    ],
)
def test_bad_prefixes_are_rejected(prefix_fields: tuple, message: str) -> None:
    frame = struct.pack("<8sHH", *prefix_fields) + FIXTURE[12:]
    with pytest.raises(FrameError, match=message):
        decode_frame(frame)
    with pytest.raises(FrameError, match=message):
        read_frame_prefix(frame)


def test_declared_sizes_beyond_the_limits_are_rejected_from_the_prefix() -> None:
    huge_header = FIXTURE[:12] + struct.pack("<I", 1 << 30) + FIXTURE[16:32]
    with pytest.raises(FrameError, match="frame header is 1073741824 bytes; at most"):
        read_frame_prefix(huge_header)
    huge_payload = FIXTURE[:16] + struct.pack("<Q", 1 << 62) + FIXTURE[24:32]
    with pytest.raises(FrameError, match="frame payload is 4611686018427387904 bytes; at most"):
        read_frame_prefix(huge_payload)
    big_payload = FIXTURE[:16] + struct.pack("<Q", 1 << 32) + FIXTURE[24:]
    with pytest.raises(FrameError, match="truncated"):
        inspect_frame(big_payload)


def _set(path: tuple, value: object) -> Callable[[dict], None]:
    def mutate(header: dict) -> None:
        target = header
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


def _delete(key: str) -> Callable[[dict], None]:
    return lambda header: header.pop(key)


HOSTILE_HEADERS = [
    (_set(("hidden_size",), -1), InvalidRecordError, "hidden_size -1 is out of range"),
    (_set(("hidden_size",), 1 << 40), InvalidRecordError, "hidden_size 1099511627776 is out of range"),
    (_set(("hidden_size",), True), InvalidRecordError, "hidden_size must be an int"),
    (_set(("hidden_size",), "8"), InvalidRecordError, "hidden_size must be an int"),
    (_set(("hidden_size",), 9), FrameError, r"tensor 'aux' has shape \[5, 3, 8\]; the record fields imply \[5, 3, 9\]"),
    (_set(("capture_layers",), "1,3,6"), FrameError, "field 'capture_layers' must be list"),
    (_set(("capture_layers",), [1, 3]), FrameError, "imply"),
    (_set(("dtype",), "bfloat8"), InvalidRecordError, "dtype 'bfloat8' is not supported"),
    (_set(("dtype",), "float16"), FrameError, "tensor 'aux' has dtype 'bfloat16'; expected 'float16'"),
    (_set(("record_id",), "../etc/passwd"), InvalidRecordError, "record_id '../etc/passwd' is not allowed"),
    (_set(("sample_id",), None), InvalidRecordError, "sample_id must be a str"),
    (_set(("schema_version",), 3), InvalidRecordError, "schema_version 3 is not supported"),
    (_set(("aux_semantics",), "post-attention"), FrameError, "aux_semantics"),
    (_set(("loss_spans",), [[4, 2]]), InvalidRecordError, "loss span"),
    (_set(("loss_spans",), [[0, 6]]), InvalidRecordError, "loss span end 6 is out of range"),
    (_set(("metadata",), []), FrameError, "field 'metadata' must be dict"),
    (_set(("unexpected",), 1), FrameError, r"unexpected fields \['unexpected'\]"),
    (_delete("model_fingerprint"), FrameError, r"missing fields \['model_fingerprint'\]"),
    (_set(("tensors",), {}), FrameError, "field 'tensors' must be list"),
    (lambda header: header["tensors"].pop(), FrameError, "lists 2 tensors"),
    (lambda header: header["tensors"].reverse(), FrameError, "out of place"),
    (_set(("tensors", 0, "shape"), [0]), InvalidRecordError, "number of tokens 0 is out of range"),
    (_set(("tensors", 0, "shape"), [-5]), InvalidRecordError, "out of range"),
    (_set(("tensors", 0, "shape"), [5, 1]), FrameError, "must be 1-D"),
    (_set(("tensors", 0, "shape"), [True]), FrameError, "must be a list of ints"),
    (_set(("tensors", 0, "shape"), [1 << 20]), FrameError, r"declares raw_nbytes 20; shape \[1048576\]"),
    (_set(("tensors", 0, "raw_nbytes"), 24), FrameError, "declares raw_nbytes 24; shape \\[5\\] of int32 holds 20"),
    (_set(("tensors", 1, "raw_nbytes"), 1 << 40), FrameError, "declares raw_nbytes 1099511627776"),
    (_set(("tensors", 1, "offset"), 0), FrameError, "starts at payload offset 0; the previous tensor ends at 20"),
    (_set(("tensors", 2, "offset"), 1 << 40), FrameError, "starts at payload offset"),
    (_set(("tensors", 1, "stored_nbytes"), -240), FrameError, "negative stored_nbytes"),
    (
        _set(("tensors", 2, "stored_nbytes"), 81),
        FrameError,
        "tensors cover 341 stored bytes; the frame prefix declares a 340-byte payload",
    ),
    (_set(("tensors", 1, "codec"), "zstdd"), UnknownCodecError, "unknown codec 'zstdd'"),
    (_set(("tensors", 0, "codec"), "bf16-split"), FrameError, "'token_ids': codec 'bf16-split' needs 2-byte elements"),
    (_set(("tensors", 1, "codec"), "zstd:1"), FrameError, "'aux': zstd:1 stored data does not start with a zstd frame"),
    (_set(("tensors", 1, "stored_xxh3_64"), "0" * 16), ChecksumError, "tensor 'aux': stored bytes hash to"),
    (_set(("tensors", 1, "stored_xxh3_64"), "XYZ"), FrameError, "must be 16 lowercase hex digits"),
    (_set(("tensors", 1, "extra"), 1), FrameError, "unexpected fields"),
    (_set(("tensors", 1, "dtype"), "int32"), FrameError, "has dtype 'int32'; expected 'bfloat16'"),
]


@pytest.mark.parametrize(("mutate", "error", "message"), HOSTILE_HEADERS)
def test_hostile_headers_with_valid_checksums_are_rejected(mutate: Callable, error: type, message: str) -> None:
    header, payload = split_frame(FIXTURE)
    header = copy.deepcopy(header)
    mutate(header)
    frame = build_frame(header, payload)
    with pytest.raises(error, match=message):
        inspect_frame(frame)
    with pytest.raises(error, match=message):
        decode_frame(frame)


@pytest.mark.parametrize(
    ("header_bytes", "message"),
    [
        (b"\xff\xfe", "not valid UTF-8 JSON"),
        (b"{not json", "not valid UTF-8 JSON"),
        (b"[1, 2]", "must be a JSON object; got list"),
        (b'{"a": 1, "a": 2}', "duplicate keys"),
        (b'{"a": NaN}', "NaN is not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid UTF-8 JSON"),
        (b'{"a": 1' + b"0" * 5000 + b"}", "not valid UTF-8 JSON"),
    ],
)
def test_malformed_header_json_is_a_frame_error(header_bytes: bytes, message: str) -> None:
    unsigned_prefix = struct.pack("<8sHHIQ", b"ETAPFRAM", 1, 0, len(header_bytes), 0)
    checksum = xxhash.xxh3_64_intdigest(unsigned_prefix + header_bytes)
    frame = unsigned_prefix + struct.pack("<Q", checksum) + header_bytes
    with pytest.raises(FrameError, match=message):
        inspect_frame(frame)


def _resign_tensor(header: dict, payload: bytes, index: int, stored: bytes) -> tuple[dict, bytes]:
    """Replaces one tensor's stored bytes, fixing offsets, sizes and the stored checksum."""
    tensors = header["tensors"]
    pieces = [payload[t["offset"] : t["offset"] + t["stored_nbytes"]] for t in tensors]
    pieces[index] = stored
    offset = 0
    for tensor, piece in zip(tensors, pieces):
        tensor.update(offset=offset, stored_nbytes=len(piece), stored_xxh3_64=xxhash.xxh3_64_hexdigest(piece))
        offset += len(piece)
    return header, b"".join(pieces)


def test_codec_size_lies_are_caught_by_inspect_without_decompressing() -> None:
    header, payload = split_frame(encode_frame(known_answer.known_answer_record(), "zstd:1"))
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(1 << 24))
    header["tensors"][1]["codec"] = "zstd:1"
    frame = build_frame(*_resign_tensor(header, payload, 1, bomb))
    message = "tensor 'aux': zstd:1 stored data is a zstd frame declaring 16777216 content bytes; expected 240"
    with pytest.raises(FrameError, match=message):
        inspect_frame(frame)
    with pytest.raises(FrameError, match="declaring 16777216"):
        decode_frame(frame)


def test_decoded_checksum_mismatch_is_found_by_decode_not_inspect() -> None:
    header, payload = split_frame(FIXTURE)
    header["tensors"][2]["raw_xxh3_64"] = "0123456789abcdef"
    frame = build_frame(header, payload)
    info = inspect_frame(frame)  # stored bytes are intact: inspecting alone passes them
    for decode in (decode_frame, lambda frame: verify_inspected_frame(frame, info)):
        with pytest.raises(ChecksumError, match="'final': decoded bytes hash to .* the header says 0123456789abcdef"):
            decode(frame)


def test_negative_token_ids_in_a_well_formed_frame_are_an_invalid_record() -> None:
    header, payload = split_frame(FIXTURE)
    ids = np.array([1, -2, 3, 4, 5], dtype="<i4").tobytes()
    header["tensors"][0]["raw_xxh3_64"] = xxhash.xxh3_64_hexdigest(ids)
    frame = build_frame(*_resign_tensor(header, payload, 0, ids))
    info = inspect_frame(frame)
    for decode in (decode_frame, lambda frame: verify_inspected_frame(frame, info)):
        with pytest.raises(InvalidRecordError, match="non-negative"):
            decode(frame)



def test_random_garbage_never_escapes_as_an_untyped_error() -> None:
    rng = np.random.default_rng(7)
    for _ in range(300):
        garbage = rng.integers(0, 256, size=int(rng.integers(0, 200)), dtype=np.uint8).tobytes()
        for candidate in (garbage, FIXTURE[:32] + garbage, FIXTURE[: int(rng.integers(0, len(FIXTURE)))] + garbage):
            with pytest.raises(CaptureFormatError):
                decode_frame(candidate)


def test_a_record_whose_last_token_has_no_state_round_trips_and_its_header_is_checked() -> None:
    full = make_record(num_tokens=6, seed=3)
    generated = CaptureRecord(
        record_id=full.record_id, sample_id=full.sample_id, model_fingerprint=full.model_fingerprint,
        capture_layers=full.capture_layers, hidden_size=full.hidden_size, dtype=full.dtype,
        token_ids=full.token_ids, loss_spans=full.loss_spans, aux=full.aux[:5], final=full.final[:5],
        metadata=full.metadata)
    frame = encode_frame(generated)
    decoded = decode_frame(frame)
    assert (decoded.num_tokens, decoded.num_states) == (6, 5)
    assert_same_record(decoded, generated)
    # A header that claims two missing states is refused before anything is decoded.
    header, payload = split_frame(encode_frame(CaptureRecord(
        record_id="short", sample_id="s", model_fingerprint="tiny@1", capture_layers=(0, 3), hidden_size=16,
        dtype="bfloat16", token_ids=full.token_ids[:4], loss_spans=(), aux=full.aux[:4], final=full.final[:4])))
    header["tensors"][0]["shape"] = [6]
    header["tensors"][0]["raw_nbytes"] = 24
    with pytest.raises(FrameError, match=r"tensor 'aux' has shape \[4, 2, 16\]; the record fields imply \[6, 2, 16\]"):
        decode_frame(build_frame(header, payload))
