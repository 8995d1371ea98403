"""What every codec is: the `Codec` interface, the `TensorLayout` it is told, shared zstd contexts.

What must hold for every codec (subclasses of `Codec`, registered in `codecs.py`):
- `decode(encode_tensor(data, layout).parts, layout)` returns exactly `encode_tensor(...).decoded`,
  bit for bit: for a lossless codec that is `data` itself, for a lossy one its dequantised copy in
  the same dtype (what a reader gets, and what a frame's `raw_xxh3_64` hashes);
- `decode` returns exactly `layout.raw_nbytes` bytes or raises `CodecError`, and `check_stored`
  checks every size the stored bytes declare against the layout before anything is allocated, so
  hostile bytes cannot make a codec allocate more than the layout implies (what a decoder
  allocates besides its output is a fixed number of chunk-sized buffers);
- a codec object is stateless and shared by threads: zstd contexts, which are not thread-safe,
  live in thread-local storage and are reused across calls.
"""

from __future__ import annotations

import abc
import math
import threading
from dataclasses import dataclass
from typing import Union

import numpy as np
import zstandard

from capture_format.errors import CodecError
from capture_format.records import STATE_DTYPES, TOKEN_ID_DTYPE

__all__ = ["ELEMENT_DTYPES", "Buffer", "Codec", "EncodedTensor", "ErrorSums", "TensorLayout"]

Buffer = Union[bytes, bytearray, memoryview, np.ndarray]
ELEMENT_DTYPES: dict[str, np.dtype] = {"int32": TOKEN_ID_DTYPE, **STATE_DTYPES}
"""numpy dtype of each element type label a frame header may name."""

_thread_state = threading.local()


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """What a codec is told about a tensor besides its bytes; a frame header holds both fields.

    The first axis is the token axis; the last is the channel axis (a row is one token's states
    of one layer). Lossless codecs use the element size; row and channel codecs use the shape.
    """

    dtype: str
    """Element type label: int32, bfloat16, float16 or float32."""
    shape: tuple[int, ...]

    @classmethod
    def of(cls, array: np.ndarray, dtype: str) -> TensorLayout:
        return cls(dtype, tuple(array.shape))

    @property
    def itemsize(self) -> int:
        return ELEMENT_DTYPES[self.dtype].itemsize

    @property
    def num_values(self) -> int:
        return math.prod(self.shape)

    @property
    def raw_nbytes(self) -> int:
        return self.num_values * self.itemsize

    @property
    def row_length(self) -> int:
        """Values per row: the last dimension (a 0-d tensor is one row of one value)."""
        return self.shape[-1] if self.shape else 1

    @property
    def num_rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def num_tokens(self) -> int:
        """Length of the token axis (1 for a 0-d tensor)."""
        return self.shape[0] if self.shape else 1


@dataclass(frozen=True, slots=True)
class ErrorSums:
    """What a lossy encoder measured against its input: sums over every value of the tensor, in float64,
    so that records and shards add up exactly. Relative RMS error = sqrt(error_sq_sum / value_sq_sum)."""

    error_sq_sum: float
    """Sum of (decoded - input)^2."""
    value_sq_sum: float
    """Sum of input^2."""
    max_abs_error: float
    """Largest |decoded - input|."""

    def __add__(self, other: ErrorSums) -> ErrorSums:
        return ErrorSums(self.error_sq_sum + other.error_sq_sum, self.value_sq_sum + other.value_sq_sum,
                         max(self.max_abs_error, other.max_abs_error))

    @property
    def relative_rms_error(self) -> float:
        return math.sqrt(self.error_sq_sum / self.value_sq_sum) if self.value_sq_sum > 0 else 0.0


@dataclass(frozen=True, slots=True)
class EncodedTensor:
    """One tensor encoded: its stored bytes (in pieces), what decoding them gives, and for a lossy codec
    the error measured while encoding."""

    parts: list[Buffer]
    """Pieces whose concatenation is the stored bytes: a frame joins them once."""
    decoded: Buffer
    """Exactly what `decode` of the stored bytes returns (the input itself for a lossless codec)."""
    error: ErrorSums | None


def zstd_compressor(level: int) -> zstandard.ZstdCompressor:
    compressors = getattr(_thread_state, "compressors", None)
    if compressors is None:
        compressors = _thread_state.compressors = {}
    if level not in compressors:
        compressors[level] = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
    return compressors[level]


ENTROPY_PLANE_PARAMS = {"strategy": zstandard.STRATEGY_FAST, "hash_log": 8, "search_log": 1, "min_match": 7}
"""zstd parameters for byte planes whose gain is entropy coding, not matches (a 256-entry match table):
1.4-3x faster than level 1 at a ratio within 0.5-1.5%. Any zstd decoder reads what they write."""


def entropy_plane_compressor() -> zstandard.ZstdCompressor:
    compressor = getattr(_thread_state, "entropy_plane_compressor", None)
    if compressor is None:
        params = zstandard.ZstdCompressionParameters.from_level(
            1, write_content_size=True, write_checksum=False, **ENTROPY_PLANE_PARAMS)
        compressor = _thread_state.entropy_plane_compressor = zstandard.ZstdCompressor(compression_params=params)
    return compressor


def zstd_decompressor() -> zstandard.ZstdDecompressor:
    decompressor = getattr(_thread_state, "decompressor", None)
    if decompressor is None:
        decompressor = _thread_state.decompressor = zstandard.ZstdDecompressor()
    return decompressor


def check_zstd_content_size(frame: memoryview, expected_nbytes: int, what: str) -> None:
    try:
        content_nbytes = zstandard.frame_content_size(frame)
    except zstandard.ZstdError:
        raise CodecError(f"{what} does not start with a zstd frame header") from None
    if content_nbytes != expected_nbytes:
        declared = "no content size" if content_nbytes < 0 else f"{content_nbytes} content bytes"
        raise CodecError(f"{what} is a zstd frame declaring {declared}; expected {expected_nbytes}")


def read_into(reader, buffer: np.ndarray, wanted: int) -> int:
    """Fills buffer[:wanted] from a zstd stream reader (readinto may return less than asked); returns how
    many bytes came, fewer than wanted only where the stream ended."""
    num_read = 0
    while num_read < wanted:
        got = reader.readinto(buffer[num_read:wanted])
        if got == 0:
            break
        num_read += got
    return num_read


def byte_view(data: Buffer) -> np.ndarray:
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
    lossy: bool = False
    """True when decoding gives an approximation of the input (frames then hash the decoded bytes)."""
    dtypes: tuple[str, ...] = tuple(ELEMENT_DTYPES)
    """Element types this codec stores."""

    def check_dtype(self, dtype: str) -> None:
        """Raises CodecError if this codec cannot store elements of type dtype (an ELEMENT_DTYPES label)."""
        if dtype not in self.dtypes:
            raise CodecError(f"codec {self.spec!r} stores {', '.join(self.dtypes)}; got {dtype}: use raw or zstd:N")

    def encode(self, data: Buffer, layout: TensorLayout) -> bytes:
        """Returns the stored bytes of data (a C-contiguous buffer laid out as layout says)."""
        return b"".join(self.encode_tensor(data, layout).parts)

    def encode_tensor(self, data: Buffer, layout: TensorLayout) -> EncodedTensor:
        """Stored bytes in pieces, the decoded bytes and the measured error; see EncodedTensor."""
        self.check_dtype(layout.dtype)
        view = byte_view(data)
        if view.nbytes != layout.raw_nbytes:
            raise CodecError(
                f"{view.nbytes} bytes do not hold a {layout.dtype} tensor of shape {list(layout.shape)} "
                f"({layout.raw_nbytes} bytes)"
            )
        return self._encode(view, layout)

    def decode(self, stored: Buffer, layout: TensorLayout) -> memoryview:
        """Returns the bytes (exactly layout.raw_nbytes) that encode turned into stored."""
        view = memoryview(stored).cast("B")
        self.check_stored(view, layout)
        try:
            raw = self._decode(view, layout)
        except zstandard.ZstdError as err:
            raise CodecError(f"{self.spec}: stored bytes do not decompress: {err}") from None
        if raw.nbytes != layout.raw_nbytes:
            raise CodecError(f"{self.spec}: decoded {raw.nbytes} bytes; expected {layout.raw_nbytes}")
        return raw

    def check_stored(self, stored: memoryview, layout: TensorLayout) -> None:
        """Raises CodecError unless the sizes stored declares fit layout. Cheap: no decoding."""
        self.check_dtype(layout.dtype)
        self._check_stored(stored, layout)

    def stored_error(self, stored: memoryview, layout: TensorLayout) -> ErrorSums | None:
        """The error a lossy encoder measured and stored with the data (None for a lossless codec).
        Call check_stored first."""
        return None

    @abc.abstractmethod
    def _check_stored(self, stored: memoryview, layout: TensorLayout) -> None: ...

    @abc.abstractmethod
    def _encode(self, data: np.ndarray, layout: TensorLayout) -> EncodedTensor: ...

    @abc.abstractmethod
    def _decode(self, stored: memoryview, layout: TensorLayout) -> memoryview: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"
