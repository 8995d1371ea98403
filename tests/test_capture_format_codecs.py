"""Codecs: bit-exact round trips, spec parsing, size checks on hostile stored bytes, layouts."""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zstandard

from capture_format import (
    CodecError,
    TensorLayout,
    UnknownCodecError,
    bfloat16_bits_from_float32,
    codec_for_states,
    get_codec,
)

LOSSLESS_SPECS = ["raw", "zstd", "zstd:1", "zstd:3", "zstd:19", "bf16-split", "bf16-channel"]
BF16_SPECS = ["bf16-split", "bf16-channel"]
_LABELS = {np.dtype(np.uint16): "bfloat16", np.dtype(np.float16): "float16", np.dtype(np.float32): "float32",
           np.dtype(np.int32): "int32"}


def layout(array: np.ndarray, dtype: str | None = None) -> TensorLayout:
    """The layout of array; uint16 arrays hold bfloat16 bits."""
    return TensorLayout(dtype or _LABELS[array.dtype], tuple(array.shape))
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
    stored = codec.encode(BF16_EDGE_BITS, layout(BF16_EDGE_BITS))
    decoded = np.frombuffer(codec.decode(stored, layout(BF16_EDGE_BITS)), dtype=np.uint16)
    assert decoded.tolist() == BF16_EDGE_BITS.tolist()


@pytest.mark.parametrize("spec", LOSSLESS_SPECS)
@pytest.mark.parametrize("num_values", [0, 1, 7, 4096, (1 << 20) + 3])
def test_random_bf16_round_trips(spec: str, num_values: int) -> None:
    bits = np.random.default_rng(num_values).integers(0, 1 << 16, size=num_values, dtype=np.uint16)
    codec = get_codec(spec)
    assert bytes(codec.decode(codec.encode(bits, layout(bits)), layout(bits))) == bits.tobytes()


@pytest.mark.parametrize("spec", LOSSLESS_SPECS)
@pytest.mark.parametrize("shape", [(0, 3, 8), (1, 3, 8), (5, 1, 7), (37, 3, 128), (3000, 2, 64), (2, 1 << 19)])
def test_random_bf16_tensors_of_many_shapes_round_trip(spec: str, shape: tuple[int, ...]) -> None:
    # bf16-channel keeps one reference per channel and decodes in chunks of whole tokens: shapes matter.
    bits = np.random.default_rng(len(shape)).integers(0, 1 << 16, size=shape, dtype=np.uint16)
    codec = get_codec(spec)
    assert bytes(codec.decode(codec.encode(bits, layout(bits)), layout(bits))) == bits.tobytes()


@pytest.mark.parametrize("spec", ["raw", "zstd:1", "zstd:5"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int32])
def test_other_dtypes_round_trip_with_raw_and_zstd(spec: str, dtype: type) -> None:
    values = (np.random.default_rng(1).standard_normal(1000) * 100).astype(dtype)
    values[:4] = [0, -0.0, 1, -1] if dtype is not np.int32 else [0, -1, 2**31 - 1, -(2**31)]
    codec = get_codec(spec)
    stored = codec.encode(values, layout(values))
    decoded = np.frombuffer(codec.decode(stored, layout(values)), dtype=dtype)
    assert decoded.tobytes() == values.tobytes()


@pytest.mark.parametrize("spec", BF16_SPECS)
def test_bf16_split_round_trips_float16(spec: str) -> None:
    values = np.array([[0.0, -0.0, np.inf], [-np.inf, np.nan, 6e-8], [65504, -65504, 1.5]], dtype=np.float16)
    codec = get_codec(spec)
    assert bytes(codec.decode(codec.encode(values, layout(values)), layout(values))) == values.tobytes()


@pytest.mark.parametrize("spec", BF16_SPECS)
def test_bf16_split_rejects_float32_with_a_clear_message(spec: str) -> None:
    values = np.zeros(4, dtype=np.float32)
    with pytest.raises(CodecError, match="needs 2-byte elements .* got float32 .4-byte elements.: use raw or zstd:N"):
        get_codec(spec).encode(values, layout(values))


def test_encode_rejects_bytes_that_do_not_fit_the_layout_and_strided_arrays() -> None:
    with pytest.raises(CodecError, match=r"3 bytes do not hold a bfloat16 tensor of shape \[2\] \(4 bytes\)"):
        get_codec("raw").encode(b"abc", TensorLayout("bfloat16", (2,)))
    with pytest.raises(CodecError, match="non-contiguous"):
        get_codec("zstd").encode(np.zeros((4, 4), dtype=np.uint16)[:, 1], TensorLayout("bfloat16", (4,)))


@pytest.mark.parametrize(
    "spec", ["zstdd", "zstd:0", "zstd:23", "zstd:x", "zstd:", "ZSTD:1", "raw:1", "bf16", " raw", ""]
)
def test_unknown_specs_list_the_available_codecs(spec: str) -> None:
    with pytest.raises(UnknownCodecError) as caught:
        get_codec(spec)
    assert str(caught.value) == (f"unknown codec {spec!r}; available: raw, zstd:N (1-22), bf16-split, bf16-channel; "
                                 "lossy: int8-row, e4m3-row, int8-channel")


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
    stored = get_codec("bf16-split").encode(bits, layout(bits))
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
    decoded = np.frombuffer(get_codec("bf16-split").decode(stored, TensorLayout("bfloat16", (4,))), dtype="<u2")
    assert decoded.tolist() == [0x1234, 0xABCD, 0x7F80, 0x0001]


def test_bf16_channel_known_answer_decodes() -> None:
    # Two tokens of two channels; references 0x3f, 0xc0; the aligned high plane in a raw-block zstd frame.
    high_frame = bytes.fromhex("28b52ffd" "20" "04" "210000" "00000140")
    low_plane = bytes([0x80, 0x00, 0x40, 0x01])
    stored = struct.pack("<Q", len(high_frame)) + bytes([0x3F, 0xC0]) + high_frame + low_plane
    decoded = np.frombuffer(get_codec("bf16-channel").decode(stored, TensorLayout("bfloat16", (2, 2))), dtype="<u2")
    assert decoded.tolist() == [0x3F80, 0xC000, 0x4040, 0x0001]  # 0x40 + 0xc0 wraps to 0x00


def test_bf16_channel_layout_holds_one_reference_per_channel_then_the_aligned_plane() -> None:
    bits = np.array([[[0x3F80, 0xC100]], [[0x3F00, 0xC180]], [[0x4000, 0xC100]]], dtype=np.uint16)  # (T=3, K=1, H=2)
    stored = get_codec("bf16-channel").encode(bits, layout(bits))
    (high_nbytes,) = struct.unpack_from("<Q", stored)
    references = np.frombuffer(stored[8:10], dtype=np.uint8)
    aligned = np.frombuffer(zstandard.ZstdDecompressor().decompress(stored[10 : 10 + high_nbytes]), np.uint8)
    assert (aligned.reshape(3, 2) + references).tolist() == (bits.reshape(3, 2) >> 8).tolist()  # uint8: mod 256
    assert references.tolist() == [0x3F, 0x41]  # high bytes of the mean |value|: 1.17 and 10.7
    assert stored[10 + high_nbytes :] == (bits.reshape(-1) & 0xFF).astype(np.uint8).tobytes()


def test_bf16_split_compresses_residual_like_states() -> None:
    bits = residual_like_bf16(1 << 18)
    ratio = bits.nbytes / len(get_codec("bf16-split").encode(bits, layout(bits)))
    plain_ratio = bits.nbytes / len(get_codec("zstd:1").encode(bits, layout(bits)))
    assert ratio > 1.35 and ratio > plain_ratio


def test_decode_rejects_a_wrong_raw_size() -> None:
    bits = residual_like_bf16(1024)
    for spec in ("raw", "zstd:1", "bf16-split", "bf16-channel"):
        stored = get_codec(spec).encode(bits, layout(bits))
        with pytest.raises(CodecError):
            get_codec(spec).decode(stored, TensorLayout("bfloat16", (bits.size + 1,)))


KIB_OF_BYTES = TensorLayout("int32", (256,))


def test_zstd_decode_checks_the_declared_content_size_before_allocating() -> None:
    # A small frame that would expand to 256 MiB of zeros: rejected from its header, not decompressed.
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(1 << 28))
    assert len(bomb) < 100_000
    with pytest.raises(CodecError, match="declaring 268435456 content bytes; expected 1024"):
        get_codec("zstd:1").decode(bomb, KIB_OF_BYTES)
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(bytes(1024))
    with pytest.raises(CodecError, match="declaring no content size"):
        get_codec("zstd:1").decode(unsized, KIB_OF_BYTES)
    with pytest.raises(CodecError, match="does not start with a zstd frame header"):
        get_codec("zstd:1").decode(b"not zstd at all", KIB_OF_BYTES)


def test_zstd_decode_rejects_trailing_data() -> None:
    stored = get_codec("zstd:1").encode(bytes(100), TensorLayout("int32", (25,)))
    with pytest.raises(CodecError, match="do not decompress"):
        get_codec("zstd:1").decode(stored + b"junk", TensorLayout("int32", (25,)))


@pytest.mark.parametrize("spec", BF16_SPECS)
def test_bf16_split_decode_rejects_lying_planes(spec: str) -> None:
    bits = residual_like_bf16(4096).reshape(16, 256)
    codec = get_codec(spec)
    stored = codec.encode(bits, layout(bits))
    (high_nbytes,) = struct.unpack_from("<Q", stored)
    lying_prefix = struct.pack("<Q", high_nbytes + 1) + stored[8:]
    with pytest.raises(CodecError, match="need"):
        codec.decode(lying_prefix, layout(bits))
    other_plane = zstandard.ZstdCompressor(level=1).compress(bytes(100))
    references = stored[8 : 8 + 256] if spec == "bf16-channel" else b""
    swapped = struct.pack("<Q", len(other_plane)) + references + other_plane + stored[-bits.size :]
    with pytest.raises(CodecError, match="declaring 100 content bytes"):
        codec.decode(swapped, layout(bits))
    with pytest.raises(CodecError, match="shorter than its 8-byte prefix"):
        codec.decode(b"\x01", TensorLayout("bfloat16", (1,)))
    with pytest.raises(CodecError, match="need"):
        codec.decode(stored, TensorLayout("bfloat16", (16, 255)))


def test_codecs_are_safe_to_share_between_threads() -> None:
    arrays = [residual_like_bf16(1 << 16, seed) for seed in range(16)]

    def round_trip(bits: np.ndarray) -> bool:
        ok = True
        for spec in ("zstd:1", "zstd:3", "bf16-split", "bf16-channel"):
            codec = get_codec(spec)
            ok &= bytes(codec.decode(codec.encode(bits, layout(bits)), layout(bits))) == bits.tobytes()
        return ok

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert all(pool.map(round_trip, arrays))


@pytest.mark.parametrize("dtype, codec, chosen", [
    ("bfloat16", None, "bf16-split"),
    ("float16", None, "zstd:1"),
    ("float32", None, "zstd:1"),
    ("float32", "raw", "raw"),
    ("bfloat16", "zstd:3", "zstd:3"),
    ("bfloat16", "bf16-channel", "bf16-channel"),
    ("float32", "int8-row", "int8-row"),
    ("float16", "e4m3-row", "e4m3-row"),
])
def test_the_codec_for_states_fits_their_dtype(dtype, codec, chosen):
    assert codec_for_states(dtype, codec).spec == chosen


def test_a_codec_that_cannot_store_the_states_dtype_is_refused():
    with pytest.raises(CodecError, match="needs 2-byte elements"):
        codec_for_states("float32", "bf16-split")
    with pytest.raises(CodecError, match="stores bfloat16, float16, float32; got int32"):
        get_codec("int8-row").check_dtype("int32")
