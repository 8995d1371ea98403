"""Lossy codecs: error within the stated bounds, exact shapes and dtypes, hostile stored bytes, NaN/inf, frames."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import xxhash
import zstandard

from capture_format import (
    FRAME_PREFIX_NBYTES,
    CaptureRecord,
    ChecksumError,
    CodecError,
    TensorLayout,
    bfloat16_bits_from_float32,
    decode_frame,
    encode_frame,
    float32_from_bfloat16_bits,
    frame_errors,
    get_codec,
    inspect_frame,
)
from capture_format.codecs_lossy import _E4M3_VALUES, _e4m3_codes

LOSSY_SPECS = ["int8-row", "e4m3-row", "int8-channel"]
FIXED_NBYTES = 32  # three f64 error sums and the u64 code plane size


def states(shape: tuple[int, ...], seed: int = 0, outlier_channel: int | None = None) -> np.ndarray:
    """float32 residual-like states: Gaussian with a log-normal scale per channel, optionally one channel 50x."""
    rng = np.random.default_rng(seed)
    channel_scale = np.exp(rng.normal(0.0, 0.5, size=shape[-1])).astype(np.float32)
    if outlier_channel is not None:
        channel_scale[outlier_channel] *= 50
    return (rng.standard_normal(shape, dtype=np.float32) * channel_scale).astype(np.float32)


def as_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return bfloat16_bits_from_float32(values).reshape(values.shape)
    return values.astype(np.float16 if dtype == "float16" else np.float32)


def to_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    return float32_from_bfloat16_bits(array).reshape(array.shape) if dtype == "bfloat16" else array.astype(np.float32)


def round_trip(spec: str, array: np.ndarray, dtype: str):
    layout = TensorLayout(dtype, tuple(array.shape))
    codec = get_codec(spec)
    encoded = codec.encode_tensor(array, layout)
    stored = b"".join(bytes(memoryview(part).cast("B")) for part in encoded.parts)
    decoded = np.frombuffer(codec.decode(stored, layout), dtype=array.dtype).reshape(array.shape)
    return encoded, stored, decoded


@pytest.mark.parametrize("spec", LOSSY_SPECS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 3, 64), (300, 2, 128), (64, 4096)])
def test_decoding_gives_the_input_dtype_and_shape_within_the_stated_bound(spec, dtype, shape) -> None:
    array = as_dtype(states(shape, seed=len(shape)), dtype)
    encoded, stored, decoded = round_trip(spec, array, dtype)
    assert decoded.dtype == array.dtype and decoded.shape == array.shape
    assert bytes(memoryview(encoded.decoded).cast("B")) == decoded.tobytes()  # what the frame hashes
    original, approx = to_float32(array, dtype), to_float32(decoded, dtype)
    output_rounding = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-23}[dtype]
    if spec == "e4m3-row":
        rows, approx_rows = original.reshape(-1, shape[-1]), approx.reshape(-1, shape[-1])
        scale = np.abs(rows).max(axis=1, keepdims=True) / 448
        # 3 mantissa bits: half a step is 2^-4 of |value|; below the smallest normal, steps of scale * 2^-9.
        bound = np.maximum(np.abs(rows) * 2.0**-4, scale * 2.0**-10) * (1 + 1e-5)
        bound = bound + np.abs(approx_rows) * output_rounding
        assert (np.abs(approx_rows - rows) <= bound).all()
    else:
        axis = 1 if spec == "int8-row" else 0
        grid = original.reshape(-1, shape[-1]) if spec == "int8-row" else original.reshape(shape[0], -1)
        approx_grid = approx.reshape(grid.shape)
        half_step = np.abs(grid).max(axis=axis, keepdims=True) / 127 / 2 * (1 + 1e-5)
        assert (np.abs(approx_grid - grid) <= half_step + np.abs(approx_grid) * output_rounding).all()
    # The stored error sums are what the encoder measured between its input and the decoded output.
    error = (approx - original).astype(np.float64)
    assert encoded.error.error_sq_sum == pytest.approx(float((error**2).sum()), rel=1e-3, abs=1e-12)
    assert encoded.error.value_sq_sum == pytest.approx(float((original.astype(np.float64) ** 2).sum()), rel=1e-4)
    assert encoded.error.max_abs_error == pytest.approx(float(np.abs(error).max()), rel=1e-6)
    assert get_codec(spec).stored_error(memoryview(stored), TensorLayout(dtype, shape)) == encoded.error


@pytest.mark.parametrize("spec, max_relative_error, min_ratio", [
    ("int8-row", 0.012, 1.8), ("e4m3-row", 0.03, 2.0), ("int8-channel", 0.012, 1.8)])
def test_residual_like_states_compress_and_keep_a_small_error(spec, max_relative_error, min_ratio) -> None:
    array = as_dtype(states((512, 3, 256)), "bfloat16")
    encoded, stored, _ = round_trip(spec, array, "bfloat16")
    assert encoded.error.relative_rms_error < max_relative_error
    assert array.nbytes / len(stored) > min_ratio


def test_a_per_channel_scale_keeps_an_outlier_channel_from_costing_its_rows_precision() -> None:
    array = as_dtype(states((512, 1, 256), outlier_channel=17), "bfloat16")
    row_error = round_trip("int8-row", array, "bfloat16")[0].error
    channel_error = round_trip("int8-channel", array, "bfloat16")[0].error
    typical = np.delete(to_float32(array, "bfloat16"), 17, axis=-1)
    # Measured on the other channels: the row scale follows the outlier, the channel scale does not.
    row_decoded = to_float32(round_trip("int8-row", array, "bfloat16")[2], "bfloat16")
    channel_decoded = to_float32(round_trip("int8-channel", array, "bfloat16")[2], "bfloat16")
    row_rms = np.sqrt(((np.delete(row_decoded, 17, axis=-1) - typical) ** 2).mean())
    channel_rms = np.sqrt(((np.delete(channel_decoded, 17, axis=-1) - typical) ** 2).mean())
    assert channel_rms < row_rms / 5
    assert channel_error.relative_rms_error < row_error.relative_rms_error


def test_e4m3_codes_round_to_nearest_even_over_every_code() -> None:
    finite = np.array([code for code in range(256) if code not in (0x7F, 0xFF)])
    values = _E4M3_VALUES[finite]
    assert (_E4M3_VALUES[_e4m3_codes(values)] == values).all()  # every representable value maps to itself
    positive = np.sort(_E4M3_VALUES[:0x7F])
    midpoints = ((positive[:-1] + positive[1:]) / 2).astype(np.float32)
    rounded = _E4M3_VALUES[_e4m3_codes(midpoints)]
    lower_codes = _e4m3_codes(positive[:-1])
    even = np.where(lower_codes % 2 == 0, positive[:-1], positive[1:])  # a tie goes to the even code
    assert (rounded == even).all()
    assert _E4M3_VALUES[0x7E] == 448 and _e4m3_codes(np.float32([448, -448])).tolist() == [0x7E, 0xFE]


@pytest.mark.parametrize("spec", LOSSY_SPECS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_refused(spec, bad) -> None:
    values = states((4, 2, 8))
    values[2, 1, 3] = bad
    array = as_dtype(values, "bfloat16")
    with pytest.raises(CodecError, match="cannot store NaN or infinity .* lossless codec"):
        get_codec(spec).encode(array, TensorLayout("bfloat16", array.shape))


@pytest.mark.parametrize("spec", LOSSY_SPECS)
def test_zero_rows_decode_to_zeros_and_only_e4m3_keeps_the_sign_of_zero(spec) -> None:
    values = states((3, 8))
    values[1] = 0.0
    values[1, ::2] = -0.0
    _, _, decoded = round_trip(spec, as_dtype(values, "float32"), "float32")
    assert (decoded[1] == 0).all()
    assert np.signbit(decoded[1]).tolist() == (np.signbit(values[1]).tolist() if spec == "e4m3-row" else [False] * 8)


@pytest.mark.parametrize("spec", LOSSY_SPECS)
def test_hostile_stored_bytes_are_refused_before_decoding(spec) -> None:
    array = as_dtype(states((16, 2, 32)), "bfloat16")
    layout = TensorLayout("bfloat16", array.shape)
    codec = get_codec(spec)
    stored = codec.encode(array, layout)
    (codes_nbytes,) = struct.unpack_from("<Q", stored, 24)
    with pytest.raises(CodecError, match="shorter than its 32-byte prefix"):
        codec.decode(stored[:31], layout)
    with pytest.raises(CodecError, match="need"):
        codec.decode(stored[:-1], layout)
    with pytest.raises(CodecError, match="need"):
        codec.decode(stored[:24] + struct.pack("<Q", codes_nbytes + 1) + stored[32:], layout)
    # A code plane that would expand far past the layout is refused from its zstd header.
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 24))
    with pytest.raises(CodecError, match="declaring 16777216 content bytes; expected 1024"):
        codec.decode(stored[:24] + struct.pack("<Q", len(bomb)) + bomb + stored[32 + codes_nbytes :], layout)
    scales_at = FIXED_NBYTES + codes_nbytes
    for bad_scale in (np.nan, np.inf, -1.0):
        hostile = stored[:scales_at] + np.float32(bad_scale).tobytes() + stored[scales_at + 4 :]
        with pytest.raises(CodecError, match="scales must be finite and >= 0"):
            codec.decode(hostile, layout)
    hostile = struct.pack("<d", float("nan")) + stored[8:]
    with pytest.raises(CodecError, match="error sums"):
        codec.decode(hostile, layout)
    with pytest.raises(CodecError, match="need|declaring 1024 content bytes; expected 992"):  # told another shape
        codec.decode(stored, TensorLayout("bfloat16", (16, 2, 31)))


def test_lossless_codecs_measure_no_error_and_say_so() -> None:
    array = as_dtype(states((8, 16)), "bfloat16")
    for spec in ("raw", "zstd:1", "bf16-split", "bf16-channel"):
        encoded = get_codec(spec).encode_tensor(array, TensorLayout("bfloat16", array.shape))
        assert encoded.error is None and not get_codec(spec).lossy
    assert all(get_codec(spec).lossy for spec in LOSSY_SPECS)


def lossy_record(dtype: str = "bfloat16") -> CaptureRecord:
    values = states((40, 3, 64), seed=3)
    return CaptureRecord(
        record_id="lossy-1", sample_id="sample-1", model_fingerprint="tiny@1", capture_layers=(1, 2, 3),
        hidden_size=64, dtype=dtype, token_ids=np.arange(40, dtype=np.int32), loss_spans=((10, 40),),
        aux=as_dtype(values, dtype), final=as_dtype(values[:, 0] * 3, dtype),
    )


@pytest.mark.parametrize("spec", LOSSY_SPECS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_a_lossy_frame_says_so_and_its_checksums_protect_the_decoded_states(spec, dtype) -> None:
    record = lossy_record(dtype)
    frame = encode_frame(record, spec)
    info = inspect_frame(frame)
    assert info.lossy and [tensor.codec for tensor in info.tensors] == ["raw", spec, spec]
    decoded = decode_frame(frame)
    assert decoded.aux.dtype == record.aux.dtype and decoded.aux.shape == record.aux.shape
    assert decoded.final.shape == record.final.shape
    assert (decoded.token_ids == record.token_ids).all()
    aux_info = info.tensors[1]
    assert aux_info.raw_xxh3_64 == xxhash.xxh3_64_hexdigest(decoded.aux.tobytes())  # the decoded bytes
    assert aux_info.raw_xxh3_64 != xxhash.xxh3_64_hexdigest(record.aux.tobytes())
    errors = frame_errors(frame, info)
    assert set(errors) == {"aux", "final"} and errors["aux"][0] == spec
    measured = np.sqrt(((to_float32(decoded.aux, dtype) - to_float32(record.aux, dtype)) ** 2).sum()
                       / (to_float32(record.aux, dtype) ** 2).sum())
    assert errors["aux"][1].relative_rms_error == pytest.approx(measured, rel=1e-3)
    assert decode_frame(encode_frame(decoded, "bf16-split" if dtype != "float32" else "zstd:1")).aux.tobytes() == (
        decoded.aux.tobytes())  # decoded states store losslessly as they are
    lossless = encode_frame(record)
    assert not inspect_frame(lossless).lossy and frame_errors(lossless, inspect_frame(lossless)) == {}


def test_a_lossy_frame_with_a_stored_byte_changed_and_its_checksum_fixed_fails_the_decoded_checksum() -> None:
    frame = bytearray(encode_frame(lossy_record(), "int8-row"))
    info = inspect_frame(frame)
    aux = info.tensors[1]
    payload_start = FRAME_PREFIX_NBYTES + info.header_nbytes
    scales_end = payload_start + aux.offset + aux.stored_nbytes
    frame[scales_end - 2] ^= 0x01  # a scale, which checks still accept, now decodes to other values
    header = json.loads(bytes(frame[FRAME_PREFIX_NBYTES:payload_start]))
    header["tensors"][1]["stored_xxh3_64"] = xxhash.xxh3_64_hexdigest(
        bytes(frame[payload_start + aux.offset : scales_end]))
    header_bytes = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    prefix = bytearray(frame[:FRAME_PREFIX_NBYTES])
    struct.pack_into("<I", prefix, 12, len(header_bytes))
    digest = xxhash.xxh3_64(bytes(prefix[:24]))
    digest.update(header_bytes)
    struct.pack_into("<Q", prefix, 24, digest.intdigest())
    forged = bytes(prefix) + header_bytes + bytes(frame[payload_start:])
    inspect_frame(forged)  # stored bytes and their sizes look fine ...
    with pytest.raises(ChecksumError, match="decoded bytes hash to"):
        decode_frame(forged)  # ... but what they decode to is not what the encoder hashed
