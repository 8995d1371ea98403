"""Codecs: how one tensor's little-endian bytes are stored inside a frame.

What must hold:
- `decode(encode(data, itemsize), len(data)) == data`, bit for bit, for every codec here
  (all are lossless; NaN payloads, signed zeros and subnormals survive);
- `decode` returns exactly raw_nbytes bytes or raises `CodecError`, and checks the sizes the stored
  bytes declare before it allocates, so hostile bytes cannot make it allocate more than raw_nbytes;
- a codec object is stateless and shared by threads: zstd contexts, which are not thread-safe,
  live in thread-local storage and are reused across calls.

Stored layouts (all integers little-endian):
- `raw`: the bytes themselves.
- `zstd:N`: one zstd frame (level N, 1..22) with its content size in the frame header and no zstd
  checksum (frames carry xxh3 checksums). Bare `zstd` means `zstd:1`: on hidden states levels 1-19
  compress within 1% of each other and level 1 is the fastest.
- `bf16-split`, for 2-byte elements: `[u64 H][H bytes: zstd frame of the high-byte plane]
  [N bytes: low-byte plane]`, N = number of elements. The high byte of a bfloat16 holds the sign
  and the top 7 exponent bits, which repeat a lot in hidden states; the low byte (last exponent bit
  and 7 mantissa bits) is close to random, so compressing it costs time and gains nothing. The high
  plane is nearly independent bytes with a skewed histogram: the gain is zstd's entropy coding, not
  its matches, so it is compressed with a 256-entry match table (`_HIGH_PLANE_PARAMS`), 1.4-3x faster
  than level 1 at a ratio within 0.5% (tiny model's states) or 1.5% better (residual-like states).
  Any zstd decoder reads it; the choice of parameters is not part of the format.
A new codec (for instance a lossy fp8-e4m3 with per-row scales) is a `Codec` subclass plus its
spec strings in `_build_registry`; frame headers name the codec per tensor, so old frames still read.
"""

from __future__ import annotations

import abc
import struct
import threading
from typing import Union

import numpy as np
import zstandard

from capture_format.errors import CodecError, UnknownCodecError, describe

__all__ = ["AVAILABLE_CODECS", "Codec", "get_codec"]

Buffer = Union[bytes, bytearray, memoryview, np.ndarray]
ZSTD_LEVELS = range(1, 23)
AVAILABLE_CODECS = "raw, zstd:N (1-22), bf16-split"

_thread_state = threading.local()


def _zstd_compressor(level: int) -> zstandard.ZstdCompressor:
    compressors = getattr(_thread_state, "compressors", None)
    if compressors is None:
        compressors = _thread_state.compressors = {}
    if level not in compressors:
        compressors[level] = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
    return compressors[level]


_HIGH_PLANE_PARAMS = {"strategy": zstandard.STRATEGY_FAST, "hash_log": 8, "search_log": 1, "min_match": 7}


def _high_plane_compressor() -> zstandard.ZstdCompressor:
    compressor = getattr(_thread_state, "high_plane_compressor", None)
    if compressor is None:
        params = zstandard.ZstdCompressionParameters.from_level(
            1, write_content_size=True, write_checksum=False, **_HIGH_PLANE_PARAMS)
        compressor = _thread_state.high_plane_compressor = zstandard.ZstdCompressor(compression_params=params)
    return compressor


def _zstd_decompressor() -> zstandard.ZstdDecompressor:
    decompressor = getattr(_thread_state, "decompressor", None)
    if decompressor is None:
        decompressor = _thread_state.decompressor = zstandard.ZstdDecompressor()
    return decompressor


def _check_zstd_content_size(frame: memoryview, expected_nbytes: int, what: str) -> None:
    try:
        content_nbytes = zstandard.frame_content_size(frame)
    except zstandard.ZstdError:
        raise CodecError(f"{what} does not start with a zstd frame header") from None
    if content_nbytes != expected_nbytes:
        declared = "no content size" if content_nbytes < 0 else f"{content_nbytes} content bytes"
        raise CodecError(f"{what} is a zstd frame declaring {declared}; expected {expected_nbytes}")


def _byte_view(data: Buffer) -> np.ndarray:
    """The bytes of data as a 1-D uint8 array, without copying."""
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise CodecError(
                f"cannot encode a non-contiguous array of shape {data.shape}; pass np.ascontiguousarray(...)"
            )
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


class Codec(abc.ABC):
    """Turns a tensor's bytes into stored bytes and back. `spec` is the name frame headers carry."""

    spec: str

    def check_itemsize(self, itemsize: int) -> None:
        """Raises CodecError if this codec cannot store elements of itemsize bytes."""

    def encode(self, data: Buffer, itemsize: int) -> bytes:
        """Returns the stored bytes of data (a C-contiguous buffer of itemsize-byte elements)."""
        return b"".join(self.encode_parts(data, itemsize))

    def encode_parts(self, data: Buffer, itemsize: int) -> list[Buffer]:
        """Like encode, as pieces whose concatenation is the stored bytes: a frame joins them once."""
        self.check_itemsize(itemsize)
        view = _byte_view(data)
        if view.nbytes % itemsize:
            raise CodecError(f"{view.nbytes} bytes are not a whole number of {itemsize}-byte elements")
        return self._encode_parts(view)

    def decode(self, stored: Buffer, raw_nbytes: int) -> memoryview:
        """Returns the raw bytes (exactly raw_nbytes) that encode turned into stored."""
        view = memoryview(stored).cast("B")
        self.check_stored(view, raw_nbytes)
        try:
            raw = self._decode(view, raw_nbytes)
        except zstandard.ZstdError as err:
            raise CodecError(f"{self.spec}: stored bytes do not decompress: {err}") from None
        if raw.nbytes != raw_nbytes:
            raise CodecError(f"{self.spec}: decoded {raw.nbytes} bytes; expected {raw_nbytes}")
        return raw

    @abc.abstractmethod
    def check_stored(self, stored: memoryview, raw_nbytes: int) -> None:
        """Raises CodecError unless the sizes stored declares fit raw_nbytes. Cheap: no decoding."""

    @abc.abstractmethod
    def _encode_parts(self, data: np.ndarray) -> list[Buffer]: ...

    @abc.abstractmethod
    def _decode(self, stored: memoryview, raw_nbytes: int) -> memoryview: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


class RawCodec(Codec):
    spec = "raw"

    def check_stored(self, stored: memoryview, raw_nbytes: int) -> None:
        if stored.nbytes != raw_nbytes:
            raise CodecError(f"raw: {stored.nbytes} stored bytes; expected {raw_nbytes}")

    def _encode_parts(self, data: np.ndarray) -> list[Buffer]:
        return [data]

    def _decode(self, stored: memoryview, raw_nbytes: int) -> memoryview:
        return stored  # no copy: the decoded tensor views the caller's buffer


class ZstdCodec(Codec):
    def __init__(self, level: int) -> None:
        self.level = level
        self.spec = f"zstd:{level}"

    def check_stored(self, stored: memoryview, raw_nbytes: int) -> None:
        _check_zstd_content_size(stored, raw_nbytes, f"{self.spec} stored data")

    def _encode_parts(self, data: np.ndarray) -> list[Buffer]:
        return [_zstd_compressor(self.level).compress(data)]

    def _decode(self, stored: memoryview, raw_nbytes: int) -> memoryview:
        # The content size was checked against raw_nbytes, so this allocates exactly raw_nbytes.
        return memoryview(_zstd_decompressor().decompress(stored, allow_extra_data=False))


class Bf16SplitCodec(Codec):
    spec = "bf16-split"
    _HIGH_PLANE_NBYTES = struct.Struct("<Q")
    _MERGE_CHUNK_NBYTES = 1 << 20  # decompress the high plane in cache-sized chunks

    def check_itemsize(self, itemsize: int) -> None:
        if itemsize != 2:
            raise CodecError(
                f"codec 'bf16-split' needs 2-byte elements (bfloat16 or float16); got {itemsize}-byte "
                "elements: use raw or zstd:N"
            )

    def check_stored(self, stored: memoryview, raw_nbytes: int) -> None:
        if raw_nbytes % 2:
            raise CodecError(f"bf16-split stores 2-byte elements; raw size {raw_nbytes} is odd")
        prefix_nbytes = self._HIGH_PLANE_NBYTES.size
        if stored.nbytes < prefix_nbytes:
            raise CodecError(
                f"bf16-split stored data is {stored.nbytes} bytes; shorter than its {prefix_nbytes}-byte prefix"
            )
        (high_nbytes,) = self._HIGH_PLANE_NBYTES.unpack_from(stored)
        num_values = raw_nbytes // 2
        if prefix_nbytes + high_nbytes + num_values != stored.nbytes:
            raise CodecError(
                f"bf16-split stored data is {stored.nbytes} bytes; a {high_nbytes}-byte high plane and a "
                f"{num_values}-byte low plane need {prefix_nbytes + high_nbytes + num_values}"
            )
        high_plane = stored[prefix_nbytes : prefix_nbytes + high_nbytes]
        _check_zstd_content_size(high_plane, num_values, "bf16-split high plane")

    def _encode_parts(self, data: np.ndarray) -> list[Buffer]:
        values = data.view("<u2").reshape(-1)  # [N]
        # Shifts and a truncating cast read memory in order: ~5x faster than copying strided byte columns.
        compressed_high = _high_plane_compressor().compress((values >> 8).astype(np.uint8))
        low_plane = values.astype(np.uint8)
        return [self._HIGH_PLANE_NBYTES.pack(len(compressed_high)), compressed_high, low_plane]

    def _decode(self, stored: memoryview, raw_nbytes: int) -> memoryview:
        num_values = raw_nbytes // 2
        (high_nbytes,) = self._HIGH_PLANE_NBYTES.unpack_from(stored)
        high_start = self._HIGH_PLANE_NBYTES.size
        low_plane = np.frombuffer(stored, dtype=np.uint8, count=num_values, offset=high_start + high_nbytes)
        values = np.empty(num_values, dtype="<u2")
        # Decompressing chunk by chunk and merging while the chunk is in cache avoids a second
        # full-size buffer for the high plane (its page faults cost more than the merge itself).
        chunk = np.empty(min(self._MERGE_CHUNK_NBYTES, num_values), dtype=np.uint8)
        with _zstd_decompressor().stream_reader(stored[high_start : high_start + high_nbytes]) as reader:
            position = 0
            while position < num_values:
                num_read = reader.readinto(chunk[: num_values - position])
                if num_read == 0:
                    raise CodecError(f"bf16-split high plane ended after {position} of {num_values} bytes")
                merged = values[position : position + num_read]
                np.left_shift(chunk[:num_read], 8, out=merged, dtype=np.uint16)
                np.bitwise_or(merged, low_plane[position : position + num_read], out=merged)
                position += num_read
            if reader.read(1):
                raise CodecError(f"bf16-split high plane holds more than {num_values} bytes")
        return memoryview(values.view(np.uint8))


def _build_registry() -> dict[str, Codec]:
    registry: dict[str, Codec] = {"raw": RawCodec(), "bf16-split": Bf16SplitCodec()}
    for level in ZSTD_LEVELS:
        registry[f"zstd:{level}"] = ZstdCodec(level)
    registry["zstd"] = registry["zstd:1"]
    return registry


_REGISTRY = _build_registry()


def get_codec(spec: str) -> Codec:
    """Returns the codec a spec string names ('raw', 'zstd', 'zstd:N', 'bf16-split')."""
    codec = _REGISTRY.get(spec) if isinstance(spec, str) else None
    if codec is None:
        raise UnknownCodecError(f"unknown codec {describe(spec)}; available: {AVAILABLE_CODECS}")
    return codec
