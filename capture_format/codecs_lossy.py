"""Lossy codecs: every value in one byte, with a float32 scale per row or per channel, then zstd.

Opt-in only (`EAGLE_TAP_CODEC`, `encode_frame(record, codec)`); the default codecs are lossless.
Specs (a row is one token's states at one layer: the last axis; a channel is one position of every
axis but the first, token, axis):
- `int8-row`: scale = row absmax / 127, code = rint(value / scale) as int8;
- `e4m3-row`: scale = row absmax / 448, code = value / scale rounded to fp8 e4m3fn (nearest, ties
  to even; 3 mantissa bits, so relative error <= 2^-4 down to |value| = scale * 2^-6);
- `int8-channel`: as int8-row with one scale per channel (absmax over the tensor's tokens): a
  channel that is large at every token (an outlier channel) no longer sets the step of its rows.

Stored layout (little-endian): `[f64 error_sq_sum][f64 value_sq_sum][f64 max_abs_error][u64 Z]
[Z bytes: zstd frame of the N one-byte codes][S float32 scales]`, N = number of values, S = number
of rows or channels. The three f64 are what the encoder measured between its input and the decoded
output (`ErrorSums`): `shards stats`, `verify` and the trainer report them without the input.

What must hold, beyond `codec_base`:
- decoding is deterministic: value = float32(code) * scale in float32, then rounded to the tensor's
  dtype (bfloat16: nearest, ties to even). The encoder computes the decoded bytes with the same
  function, so a frame's `raw_xxh3_64` (which hashes the decoded bytes) holds on every reader, and
  decoding gives the dtype the input had;
- non-finite input (NaN, +-inf) is refused with CodecError (the plugin then drops and counts the
  record): a codec with a scale cannot represent it. An all-zero row gets scale 0 and decodes to zeros;
  e4m3 keeps the sign of a zero, int8 (which has one zero) does not;
- stored scales must be finite and >= 0 and the stored error sums finite and >= 0, checked before
  decoding; the e4m3fn NaN codes (0x7f, 0xff), which the encoder never writes, decode to NaN.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from capture_format.codec_base import (
    Codec,
    EncodedTensor,
    ErrorSums,
    TensorLayout,
    check_zstd_content_size,
    read_into,
    zstd_compressor,
    zstd_decompressor,
)
from capture_format.errors import CodecError

__all__ = ["LOSSY_CODECS", "ScaledByteCodec"]

_FIXED = struct.Struct("<dddQ")  # error_sq_sum, value_sq_sum, max_abs_error, compressed code plane size
_CHUNK_VALUES = 1 << 18  # rows are processed in chunks of about this many values: temporaries stay in cache
_FLOAT_DTYPES = {"bfloat16": np.dtype("<u2"), "float16": np.dtype("<f2"), "float32": np.dtype("<f4")}


def _e4m3_table() -> np.ndarray:
    """float32 [256]: the value of each fp8 e4m3fn code (1 sign, 4 exponent bits with bias 7, 3 mantissa bits;
    no infinities; 0x7f and 0xff are NaN)."""
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    table = np.where(codes & 0x80, -magnitude, magnitude).astype(np.float32)
    table[[0x7F, 0xFF]] = np.nan
    return table


_E4M3_VALUES = _e4m3_table()
_E4M3_MAX = 448.0
_E4M3_MIN_NORMAL = np.float32(2.0**-6)


def _e4m3_codes(scaled: np.ndarray) -> np.ndarray:
    """uint8 codes of float32 values with |value| <= 448, rounded to nearest e4m3fn (ties to even)."""
    bits = scaled.view(np.uint32)
    sign = ((bits >> 24) & 0x80).astype(np.uint8)
    magnitude_bits = bits & np.uint32(0x7FFFFFFF)
    magnitude = magnitude_bits.view(np.float32)
    # Normal range: round the float32 mantissa to 3 bits (the carry may bump the exponent), then rebias 127 -> 7.
    rounded = (magnitude_bits + (np.uint32(0x7FFFF) + ((magnitude_bits >> 20) & 1))) >> 20
    normal = rounded.astype(np.int32) - (120 << 3)
    subnormal = np.rint(magnitude * np.float32(512)).astype(np.int32)  # steps of 2^-9; 8 is the smallest normal
    codes = np.where(magnitude < _E4M3_MIN_NORMAL, subnormal, normal)
    np.clip(codes, 0, 0x7E, out=codes)
    return codes.astype(np.uint8) | sign


def _to_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32)


def _from_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    """values in dtype's numpy type, rounded to nearest (ties to even); values are finite or +-inf."""
    if dtype == "bfloat16":
        bits = values.view(np.uint32)
        return ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    return values.astype(_FLOAT_DTYPES[dtype])


class ScaledByteCodec(Codec):
    """One byte per value (int8 or e4m3fn) times a float32 scale per row or per channel."""

    lossy = True
    dtypes = tuple(_FLOAT_DTYPES)

    def __init__(self, spec: str, *, code: str, per: str) -> None:
        assert code in ("int8", "e4m3") and per in ("row", "channel")
        self.spec, self.code, self.per = spec, code, per
        self._code_max = 127.0 if code == "int8" else _E4M3_MAX

    def _shape_2d(self, layout: TensorLayout) -> tuple[int, int]:
        """The tensor as (rows, row length) for per-row scales, (tokens, channels) for per-channel."""
        if self.per == "row":
            return layout.num_rows, layout.row_length
        return layout.num_tokens, (layout.num_values // layout.num_tokens if layout.num_tokens else 0)

    def _num_scales(self, layout: TensorLayout) -> int:
        num_rows, row_length = self._shape_2d(layout)
        return num_rows if self.per == "row" else row_length

    def _check_stored(self, stored: memoryview, layout: TensorLayout) -> None:
        if stored.nbytes < _FIXED.size:
            raise CodecError(f"{self.spec} stored data is {stored.nbytes} bytes; shorter than its "
                             f"{_FIXED.size}-byte prefix")
        *sums, codes_nbytes = _FIXED.unpack_from(stored)
        num_scales = self._num_scales(layout)
        expected = _FIXED.size + codes_nbytes + 4 * num_scales
        if stored.nbytes != expected:
            raise CodecError(f"{self.spec} stored data is {stored.nbytes} bytes; a {codes_nbytes}-byte code plane "
                             f"and {num_scales} scales need {expected}")
        if not all(math.isfinite(value) and value >= 0 for value in sums):
            raise CodecError(f"{self.spec} stored error sums {sums} must be finite and >= 0")
        check_zstd_content_size(stored[_FIXED.size : _FIXED.size + codes_nbytes], layout.num_values,
                                f"{self.spec} code plane")
        scales = np.frombuffer(stored, dtype="<f4", count=num_scales, offset=_FIXED.size + codes_nbytes)
        if not np.isfinite(scales).all() or (scales < 0).any():
            raise CodecError(f"{self.spec} stored scales must be finite and >= 0")

    def stored_error(self, stored: memoryview, layout: TensorLayout) -> ErrorSums:
        error_sq_sum, value_sq_sum, max_abs_error, _ = _FIXED.unpack_from(stored)
        return ErrorSums(error_sq_sum, value_sq_sum, max_abs_error)

    def _quantize(self, scaled: np.ndarray) -> np.ndarray:
        if self.code == "int8":
            return np.clip(np.rint(scaled), -127, 127).astype(np.int8).view(np.uint8)
        return _e4m3_codes(np.clip(scaled, -_E4M3_MAX, _E4M3_MAX))

    def _dequantize(self, codes: np.ndarray) -> np.ndarray:
        if self.code == "int8":
            return codes.view(np.int8).astype(np.float32)
        return _E4M3_VALUES[codes]

    def _encode(self, data: np.ndarray, layout: TensorLayout) -> EncodedTensor:
        num_rows, row_length = self._shape_2d(layout)
        values = data.view(_FLOAT_DTYPES[layout.dtype]).reshape(num_rows, row_length)
        chunk_rows = max(1, _CHUNK_VALUES // max(1, row_length))
        chunks = [slice(start, start + chunk_rows) for start in range(0, num_rows, chunk_rows)]
        absmax = np.zeros(num_rows if self.per == "row" else row_length, dtype=np.float32)
        for rows in chunks:  # a first pass: scales, and the refusal of what a scale cannot represent
            chunk = _to_float32(values[rows], layout.dtype)
            if not np.isfinite(chunk).all():
                bad = np.argwhere(~np.isfinite(chunk))[0]
                raise CodecError(f"{self.spec} cannot store NaN or infinity (row {rows.start + bad[0]}, value "
                                 f"{bad[1]}); store such states with a lossless codec")
            if self.per == "row":
                absmax[rows] = np.abs(chunk).max(axis=1, initial=0)
            else:
                np.maximum(absmax, np.abs(chunk).max(axis=0, initial=0), out=absmax)
        scales = (absmax / np.float32(self._code_max)).astype("<f4")
        with np.errstate(divide="ignore", over="ignore"):
            inverse = np.where(scales > 0, np.float32(1) / scales, np.float32(0)).astype(np.float32)
        codes = np.empty((num_rows, row_length), dtype=np.uint8)
        decoded = np.empty_like(values)
        error_sq_sum = value_sq_sum = max_abs_error = 0.0
        for rows in chunks:
            chunk = _to_float32(values[rows], layout.dtype)
            chunk_scales, chunk_inverse = (scales[rows, None], inverse[rows, None]) if self.per == "row" else (
                scales, inverse)
            codes[rows] = self._quantize(chunk * chunk_inverse)
            decoded[rows] = _from_float32(self._dequantize(codes[rows]) * chunk_scales, layout.dtype)
            error = (_to_float32(decoded[rows], layout.dtype) - chunk).reshape(-1)
            flat = chunk.reshape(-1)
            error_sq_sum += float(np.dot(error, error))
            value_sq_sum += float(np.dot(flat, flat))
            max_abs_error = max(max_abs_error, float(np.abs(error).max(initial=0)))
        compressed = zstd_compressor(1).compress(codes)
        prefix = _FIXED.pack(error_sq_sum, value_sq_sum, max_abs_error, len(compressed))
        return EncodedTensor([prefix, compressed, scales], decoded.reshape(-1).view(np.uint8),
                             ErrorSums(error_sq_sum, value_sq_sum, max_abs_error))

    def _decode(self, stored: memoryview, layout: TensorLayout) -> memoryview:
        num_rows, row_length = self._shape_2d(layout)
        codes_nbytes = _FIXED.unpack_from(stored)[3]
        scales = np.frombuffer(stored, dtype="<f4", count=self._num_scales(layout), offset=_FIXED.size + codes_nbytes)
        decoded = np.empty((num_rows, row_length), dtype=_FLOAT_DTYPES[layout.dtype])
        chunk_rows = max(1, _CHUNK_VALUES // max(1, row_length))
        codes = np.empty(chunk_rows * row_length, dtype=np.uint8)
        with zstd_decompressor().stream_reader(stored[_FIXED.size : _FIXED.size + codes_nbytes]) as reader:
            for start in range(0, num_rows, chunk_rows):
                rows = slice(start, min(start + chunk_rows, num_rows))
                wanted = (rows.stop - rows.start) * row_length
                num_read = read_into(reader, codes, wanted)
                if num_read < wanted:
                    raise CodecError(f"{self.spec} code plane ended after {start * row_length + num_read} of "
                                     f"{layout.num_values} bytes")
                chunk_scales = scales[rows, None] if self.per == "row" else scales
                chunk_codes = codes[:wanted].reshape(-1, row_length)
                decoded[rows] = _from_float32(self._dequantize(chunk_codes) * chunk_scales, layout.dtype)
            if reader.read(1):
                raise CodecError(f"{self.spec} code plane holds more than {layout.num_values} bytes")
        return memoryview(decoded.reshape(-1).view(np.uint8))


LOSSY_CODECS: dict[str, Codec] = {
    "int8-row": ScaledByteCodec("int8-row", code="int8", per="row"),
    "e4m3-row": ScaledByteCodec("e4m3-row", code="e4m3", per="row"),
    "int8-channel": ScaledByteCodec("int8-channel", code="int8", per="channel"),
}
"""Spec -> lossy codec; every one is opt-in."""
