"""Codecs: bit-exact round trips, spec parsing, size checks on hostile stored bytes, layouts."""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zstandard

from capture_format import CodecError, UnknownCodecError, bfloat16_bits_from_float32, codec_for_states, get_codec

LOSSLESS_SPECS = ["raw", "zstd", "zstd:1", "zstd:3", "zstd:19", "bf16-split"]
BF16_EDGE_BITS = np.array(
    [
        0x0000, 0x8000,  # +0, -0
        0x0001, 0x8001, 0x007F, 0x807F,  # smallest and largest subnormals, both signs
        0x0080, 0x8080,  # smallest normals
        0x7F7F, 0xFF7F,  # largest finite, smallest (most negative) finite
        0x7F80, 0xFF80,  # +inf, -inf
        0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FFF, 0x7FA5,  # NaNs: quiet, negative, signalling, payloads
        0x3F80, 0xBF80,  # +1, -1
    ],
    dtype=np.uint16,
)


def residual_like_bf16(num_values: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    channel_scale = np.exp(rng.normal(0.0, 0.5, size=256)).astype(np.float32)
    values = rng.standard_normal((num_values // 256, 256), dtype=np.float32) * channel_scale
    return bfloat16_bits_from_float32(values).reshape(-1)


@pytest.mark.parametrize("spec", LOSSLESS_SPECS)
def test_bf16_edge_values_round_trip_bit_exact(spec: str) -> None:
    codec = get_codec(spec)
    stored = codec.encode(BF16_EDGE_BITS, 2)
    decoded = np.frombuffer(codec.decode(stored, BF16_EDGE_BITS.nbytes), dtype=np.uint16)
    assert decoded.tolist() == BF16_EDGE_BITS.tolist()


@pytest.mark.parametrize("spec", LOSSLESS_SPECS)
@pytest.mark.parametrize("num_values", [0, 1, 7, 4096, (1 << 20) + 3])
def test_random_bf16_round_trips(spec: str, num_values: int) -> None:
    bits = np.random.default_rng(num_values).integers(0, 1 << 16, size=num_values, dtype=np.uint16)
    codec = get_codec(spec)
    assert bytes(codec.decode(codec.encode(bits, 2), bits.nbytes)) == bits.tobytes()


@pytest.mark.parametrize("spec", ["raw", "zstd:1", "zstd:5"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int32])
def test_other_dtypes_round_trip_with_raw_and_zstd(spec: str, dtype: type) -> None:
    values = (np.random.default_rng(1).standard_normal(1000) * 100).astype(dtype)
    values[:4] = [0, -0.0, 1, -1] if dtype is not np.int32 else [0, -1, 2**31 - 1, -(2**31)]
    codec = get_codec(spec)
    stored = codec.encode(values, values.itemsize)
    decoded = np.frombuffer(codec.decode(stored, values.nbytes), dtype=dtype)
    assert decoded.tobytes() == values.tobytes()


def test_bf16_split_round_trips_float16() -> None:
    values = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 6e-8, 65504, -65504, 1.5], dtype=np.float16)
    codec = get_codec("bf16-split")
    assert bytes(codec.decode(codec.encode(values, 2), values.nbytes)) == values.tobytes()


def test_bf16_split_rejects_float32_with_a_clear_message() -> None:
    with pytest.raises(CodecError, match="needs 2-byte elements .* got 4-byte elements: use raw or zstd:N"):
        get_codec("bf16-split").encode(np.zeros(4, dtype=np.float32), 4)


def test_encode_rejects_partial_elements_and_strided_arrays() -> None:
    with pytest.raises(CodecError, match="not a whole number of 2-byte elements"):
        get_codec("raw").encode(b"abc", 2)
    with pytest.raises(CodecError, match="non-contiguous"):
        get_codec("zstd").encode(np.zeros((4, 4), dtype=np.uint16)[:, 1], 2)


@pytest.mark.parametrize(
    "spec", ["zstdd", "zstd:0", "zstd:23", "zstd:x", "zstd:", "ZSTD:1", "raw:1", "bf16", " raw", ""]
)
def test_unknown_specs_list_the_available_codecs(spec: str) -> None:
    with pytest.raises(UnknownCodecError) as caught:
        get_codec(spec)
    assert str(caught.value) == f"unknown codec {spec!r}; available: raw, zstd:N (1-22), bf16-split"


def test_bare_zstd_means_level_1_and_specs_are_canonical() -> None:
    assert get_codec("zstd") is get_codec("zstd:1")
    assert [get_codec(spec).spec for spec in ("raw", "zstd", "zstd:22", "bf16-split")] == [
        "raw",
        "zstd:1",
        "zstd:22",
        "bf16-split",
    ]
    with pytest.raises(UnknownCodecError):
        get_codec(None)  # type: ignore[arg-type]


def test_bf16_split_layout_is_length_prefix_high_plane_zstd_then_low_plane_raw() -> None:
    bits = np.array([0x1234, 0xABCD, 0x7F80, 0x0001], dtype=np.uint16)
    stored = get_codec("bf16-split").encode(bits, 2)
    (high_nbytes,) = struct.unpack_from("<Q", stored)
    high_plane = zstandard.ZstdDecompressor().decompress(stored[8 : 8 + high_nbytes])
    assert high_plane == bytes([0x12, 0xAB, 0x7F, 0x00])
    assert stored[8 + high_nbytes :] == bytes([0x34, 0xCD, 0x80, 0x01])
    assert zstandard.frame_content_size(stored[8 : 8 + high_nbytes]) == 4


def test_bf16_split_known_answer_decodes() -> None:
    # Stored bytes written by hand from the documented layout, with a raw-block zstd frame, so the
    # test does not depend on what a zstd version chooses to emit.
    high_frame = bytes.fromhex("28b52ffd" "20" "04" "21000012ab7f00")  # magic, FHD, content size 4, raw block
    stored = struct.pack("<Q", len(high_frame)) + high_frame + bytes([0x34, 0xCD, 0x80, 0x01])
    decoded = np.frombuffer(get_codec("bf16-split").decode(stored, 8), dtype="<u2")
    assert decoded.tolist() == [0x1234, 0xABCD, 0x7F80, 0x0001]


def test_bf16_split_compresses_residual_like_states() -> None:
    bits = residual_like_bf16(1 << 18)
    ratio = bits.nbytes / len(get_codec("bf16-split").encode(bits, 2))
    plain_ratio = bits.nbytes / len(get_codec("zstd:1").encode(bits, 2))
    assert ratio > 1.35 and ratio > plain_ratio


def test_decode_rejects_a_wrong_raw_size() -> None:
    bits = residual_like_bf16(1024)
    for spec in ("raw", "zstd:1", "bf16-split"):
        stored = get_codec(spec).encode(bits, 2)
        with pytest.raises(CodecError):
            get_codec(spec).decode(stored, bits.nbytes + 2)


def test_zstd_decode_checks_the_declared_content_size_before_allocating() -> None:
    # A small frame that would expand to 256 MiB of zeros: rejected from its header, not decompressed.
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(1 << 28))
    assert len(bomb) < 100_000
    with pytest.raises(CodecError, match="declaring 268435456 content bytes; expected 1024"):
        get_codec("zstd:1").decode(bomb, 1024)
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(bytes(1024))
    with pytest.raises(CodecError, match="declaring no content size"):
        get_codec("zstd:1").decode(unsized, 1024)
    with pytest.raises(CodecError, match="does not start with a zstd frame header"):
        get_codec("zstd:1").decode(b"not zstd at all", 1024)


def test_zstd_decode_rejects_trailing_data() -> None:
    stored = get_codec("zstd:1").encode(bytes(100), 1)
    with pytest.raises(CodecError, match="do not decompress"):
        get_codec("zstd:1").decode(stored + b"junk", 100)


def test_bf16_split_decode_rejects_lying_planes() -> None:
    bits = residual_like_bf16(4096)
    stored = get_codec("bf16-split").encode(bits, 2)
    (high_nbytes,) = struct.unpack_from("<Q", stored)
    lying_prefix = struct.pack("<Q", high_nbytes + 1) + stored[8:]
    with pytest.raises(CodecError, match="need"):
        get_codec("bf16-split").decode(lying_prefix, bits.nbytes)
    other_plane = zstandard.ZstdCompressor(level=1).compress(bytes(100))
    swapped = struct.pack("<Q", len(other_plane)) + other_plane + stored[8 + high_nbytes :]
    with pytest.raises(CodecError):
        get_codec("bf16-split").decode(swapped, bits.nbytes)
    with pytest.raises(CodecError, match="shorter than its 8-byte prefix"):
        get_codec("bf16-split").decode(b"\x01", 2)
    with pytest.raises(CodecError, match="odd"):
        get_codec("bf16-split").decode(stored, bits.nbytes - 1)


def test_codecs_are_safe_to_share_between_threads() -> None:
    arrays = [residual_like_bf16(1 << 16, seed) for seed in range(16)]

    def round_trip(bits: np.ndarray) -> bool:
        ok = True
        for spec in ("zstd:1", "zstd:3", "bf16-split"):
            codec = get_codec(spec)
            ok &= bytes(codec.decode(codec.encode(bits, 2), bits.nbytes)) == bits.tobytes()
        return ok

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert all(pool.map(round_trip, arrays))


@pytest.mark.parametrize("dtype, codec, chosen", [
    ("bfloat16", None, "bf16-split"),
    ("float16", None, "zstd:1"),
    ("float32", None, "zstd:1"),
    ("float32", "raw", "raw"),
    ("bfloat16", "zstd:3", "zstd:3"),
])
def test_the_codec_for_states_fits_their_dtype(dtype, codec, chosen):
    assert codec_for_states(dtype, codec).spec == chosen


def test_a_codec_that_cannot_store_the_states_dtype_is_refused():
    with pytest.raises(CodecError, match="needs 2-byte elements"):
        codec_for_states("float32", "bf16-split")
