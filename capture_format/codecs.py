"""Codecs: how one tensor's little-endian bytes are stored inside a frame.

The interface, the `TensorLayout` a codec is told (dtype and shape, from the frame header) and what
must hold for every codec are in `codec_base.py`; the lossy codecs are in `codecs_lossy.py`.
Lossless codecs (`decode(encode(data)) == data` bit for bit: NaN payloads, signed zeros and
subnormals survive) and their stored layouts (all integers little-endian):
- `raw`: the bytes themselves.
- `zstd:N`: one zstd frame (level N, 1..22) with its content size in the frame header and no zstd
  checksum (frames carry xxh3 checksums). Bare `zstd` means `zstd:1`: on hidden states levels 1-19
  compress within 1% of each other and level 1 is the fastest.
- `bf16-split`, for 2-byte elements: `[u64 Z][Z bytes: zstd frame of the high-byte plane]
  [N bytes: low-byte plane]`, N = number of elements. The high byte of a bfloat16 holds the sign
  and the top 7 exponent bits, which repeat a lot in hidden states; the low byte (last exponent bit
  and 7 mantissa bits) is close to random, so compressing it costs time and gains nothing. The high
  plane is nearly independent bytes with a skewed histogram: the gain is zstd's entropy coding, not
  its matches, so it is compressed with a 256-entry match table (`ENTROPY_PLANE_PARAMS`).
- `bf16-channel`, for 2-byte elements: `[u64 Z][C bytes: reference high byte per channel]
  [Z bytes: zstd frame of the aligned high plane][N bytes: low-byte plane]`, C = values per token
  (every axis but the first). Each channel of a hidden state has its own typical magnitude, so the
  high bytes of one channel cluster around a value of their own: their entropy given the channel
  (2.47 bits on the tiny target) is well below their entropy overall (3.39). The encoder takes as
  the reference of each channel the high byte of its mean |value| over up to 32 evenly spaced
  tokens, and stores `(high - reference) mod 256` for every value of the channel: the histogram
  zstd's entropy coder sees is then that of one channel. The decoder adds the reference back. How
  the encoder picks references is not part of the format: any byte per channel decodes.
A new codec is a `Codec` subclass plus its spec strings in `_build_registry`; frame headers name the
codec per tensor, so old frames still read.
"""

from __future__ import annotations

import struct

import numpy as np

from capture_format.codec_base import (
    ELEMENT_DTYPES,
    Codec,
    EncodedTensor,
    ErrorSums,
    TensorLayout,
    check_zstd_content_size,
    entropy_plane_compressor,
    read_into,
    zstd_compressor,
    zstd_decompressor,
)
from capture_format.codecs_lossy import LOSSY_CODECS
from capture_format.errors import CodecError, UnknownCodecError, describe

__all__ = ["AVAILABLE_CODECS", "ELEMENT_DTYPES", "Codec", "EncodedTensor", "ErrorSums", "TensorLayout", "get_codec"]

ZSTD_LEVELS = range(1, 23)
AVAILABLE_CODECS = "raw, zstd:N (1-22), bf16-split, bf16-channel; lossy: " + ", ".join(LOSSY_CODECS)

_PLANE_NBYTES = struct.Struct("<Q")
_MERGE_CHUNK_NBYTES = 1 << 20  # decompress a high plane in cache-sized chunks
_REFERENCE_SAMPLE_TOKENS = 32


class RawCodec(Codec):
    spec = "raw"

    def _check_stored(self, stored: memoryview, layout: TensorLayout) -> None:
        if stored.nbytes != layout.raw_nbytes:
            raise CodecError(f"raw: {stored.nbytes} stored bytes; expected {layout.raw_nbytes}")

    def _encode(self, data: np.ndarray, layout: TensorLayout) -> EncodedTensor:
        return EncodedTensor([data], data, None)

    def _decode(self, stored: memoryview, layout: TensorLayout) -> memoryview:
        return stored  # no copy: the decoded tensor views the caller's buffer


class ZstdCodec(Codec):
    def __init__(self, level: int) -> None:
        self.level = level
        self.spec = f"zstd:{level}"

    def _check_stored(self, stored: memoryview, layout: TensorLayout) -> None:
        check_zstd_content_size(stored, layout.raw_nbytes, f"{self.spec} stored data")

    def _encode(self, data: np.ndarray, layout: TensorLayout) -> EncodedTensor:
        return EncodedTensor([zstd_compressor(self.level).compress(data)], data, None)

    def _decode(self, stored: memoryview, layout: TensorLayout) -> memoryview:
        # The content size was checked against raw_nbytes, so this allocates exactly raw_nbytes.
        return memoryview(zstd_decompressor().decompress(stored, allow_extra_data=False))


class Bf16SplitCodec(Codec):
    """High plane zstd-compressed, low plane raw; with `by_channel`, the high plane aligned per channel."""

    dtypes = ("bfloat16", "float16")

    def __init__(self, spec: str, *, by_channel: bool) -> None:
        self.spec = spec
        self.by_channel = by_channel

    def check_dtype(self, dtype: str) -> None:
        if dtype not in self.dtypes:
            itemsize = ELEMENT_DTYPES[dtype].itemsize if dtype in ELEMENT_DTYPES else "?"
            raise CodecError(
                f"codec {self.spec!r} needs 2-byte elements (bfloat16 or float16); got {dtype} ({itemsize}-byte "
                "elements): use raw or zstd:N"
            )

    def _num_references(self, layout: TensorLayout) -> int:
        return layout.num_values // layout.num_tokens if self.by_channel and layout.num_tokens else 0

    def _check_stored(self, stored: memoryview, layout: TensorLayout) -> None:
        prefix_nbytes = _PLANE_NBYTES.size
        if stored.nbytes < prefix_nbytes:
            raise CodecError(
                f"{self.spec} stored data is {stored.nbytes} bytes; shorter than its {prefix_nbytes}-byte prefix"
            )
        (high_nbytes,) = _PLANE_NBYTES.unpack_from(stored)
        num_values, num_references = layout.num_values, self._num_references(layout)
        expected = prefix_nbytes + num_references + high_nbytes + num_values
        if expected != stored.nbytes:
            raise CodecError(
                f"{self.spec} stored data is {stored.nbytes} bytes; {num_references} channel references, a "
                f"{high_nbytes}-byte high plane and a {num_values}-byte low plane need {expected}"
            )
        high_start = prefix_nbytes + num_references
        check_zstd_content_size(stored[high_start : high_start + high_nbytes], num_values, f"{self.spec} high plane")

    def _references(self, values: np.ndarray, layout: TensorLayout) -> np.ndarray:
        """uint8 [C]: the high byte of each channel's mean |value| over up to 32 evenly spaced tokens."""
        rows = values.reshape(layout.num_tokens, -1)  # (T, C)
        sample = rows[np.linspace(0, rows.shape[0] - 1, min(rows.shape[0], _REFERENCE_SAMPLE_TOKENS)).astype(np.intp)]
        if layout.dtype == "bfloat16":
            magnitudes = (sample.astype(np.uint32) << 16).view(np.float32)
        else:
            magnitudes = sample.view(np.float16).astype(np.float32)
        with np.errstate(all="ignore"):  # NaN and inf give some reference byte: any byte decodes
            mean_abs = np.abs(magnitudes).mean(axis=0, dtype=np.float32)  # (C,)
            if layout.dtype == "bfloat16":
                return (mean_abs.view(np.uint32) >> 24).astype(np.uint8)
            return (mean_abs.astype(np.float16).view(np.uint16) >> 8).astype(np.uint8)

    def _encode(self, data: np.ndarray, layout: TensorLayout) -> EncodedTensor:
        values = data.view("<u2")  # [N]
        # Shifts and a truncating cast read memory in order: ~5x faster than copying strided byte columns.
        high_plane = (values >> 8).astype(np.uint8)
        parts = []
        if self._num_references(layout):
            references = self._references(values, layout)
            high_by_token = high_plane.reshape(layout.num_tokens, -1)  # (T, C)
            np.subtract(high_by_token, references, out=high_by_token)  # wraps mod 256
            parts.append(references)
        compressed_high = entropy_plane_compressor().compress(high_plane)
        return EncodedTensor([_PLANE_NBYTES.pack(len(compressed_high)), *parts, compressed_high,
                              values.astype(np.uint8)], data, None)

    def _decode(self, stored: memoryview, layout: TensorLayout) -> memoryview:
        num_values, num_references = layout.num_values, self._num_references(layout)
        (high_nbytes,) = _PLANE_NBYTES.unpack_from(stored)
        high_start = _PLANE_NBYTES.size + num_references
        references = np.frombuffer(stored, dtype=np.uint8, count=num_references, offset=_PLANE_NBYTES.size)
        low_plane = np.frombuffer(stored, dtype=np.uint8, count=num_values, offset=high_start + high_nbytes)
        values = np.empty(num_values, dtype="<u2")
        # Decompressing chunk by chunk and merging while the chunk is in cache avoids a second
        # full-size buffer for the high plane (its page faults cost more than the merge itself).
        # A chunk holds whole tokens when references are added back, so they broadcast per row.
        chunk_nbytes = min(_MERGE_CHUNK_NBYTES, num_values)
        if num_references:
            chunk_nbytes = max(1, _MERGE_CHUNK_NBYTES // num_references) * num_references
        chunk = np.empty(min(chunk_nbytes, num_values), dtype=np.uint8)
        with zstd_decompressor().stream_reader(stored[high_start : high_start + high_nbytes]) as reader:
            position = 0
            while position < num_values:
                wanted = min(chunk.size, num_values - position)
                num_read = read_into(reader, chunk, wanted)
                if num_read < wanted:
                    raise CodecError(f"{self.spec} high plane ended after {position + num_read} of "
                                     f"{num_values} bytes")
                high = chunk[:num_read]
                if num_references:
                    by_token = high.reshape(-1, num_references)
                    np.add(by_token, references, out=by_token)  # wraps mod 256
                merged = values[position : position + num_read]
                np.left_shift(high, 8, out=merged, dtype=np.uint16)
                np.bitwise_or(merged, low_plane[position : position + num_read], out=merged)
                position += num_read
            if reader.read(1):
                raise CodecError(f"{self.spec} high plane holds more than {num_values} bytes")
        return memoryview(values.view(np.uint8))


def _build_registry() -> dict[str, Codec]:
    registry: dict[str, Codec] = {
        "raw": RawCodec(),
        "bf16-split": Bf16SplitCodec("bf16-split", by_channel=False),
        "bf16-channel": Bf16SplitCodec("bf16-channel", by_channel=True),
        **LOSSY_CODECS,
    }
    for level in ZSTD_LEVELS:
        registry[f"zstd:{level}"] = ZstdCodec(level)
    registry["zstd"] = registry["zstd:1"]
    return registry


_REGISTRY = _build_registry()


def get_codec(spec: str) -> Codec:
    """Returns the codec a spec string names ('raw', 'zstd', 'zstd:N', 'bf16-split', a lossy one, ...)."""
    codec = _REGISTRY.get(spec) if isinstance(spec, str) else None
    if codec is None:
        raise UnknownCodecError(f"unknown codec {describe(spec)}; available: {AVAILABLE_CODECS}")
    return codec
