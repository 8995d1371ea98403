"""Wire frames: one capture record as self-delimiting bytes.

Layout (integers little-endian):

    offset  size  field
    0       8     magic b"ETAPFRAM"
    8       2     u16 format_version (1)
    10      2     u16 flags (0; a reader rejects flags it does not know)
    12      4     u32 header_nbytes
    16      8     u64 payload_nbytes
    24      8     u64 header_xxh3_64: xxh3_64 of bytes 0..24 followed by the header bytes
    32      ...   header: compact JSON, sorted keys, UTF-8 (see frame_header.py)
    ...     ...   payload: stored tensors token_ids, aux, final (and input_embeds in schema 2), back to back

What must hold:
- a frame's length is known from its first FRAME_PREFIX_NBYTES bytes (`read_frame_prefix`), and the
  buffer handed to `inspect_frame`/`decode_frame` is exactly one frame (no missing or trailing byte);
- the header checksum also covers the length fields, so a flipped size bit is a ChecksumError
  rather than a misread frame;
- sizes are checked against the buffer and the limits before anything is allocated, and every
  problem raises a CaptureFormatError subclass (FrameError, ChecksumError, UnknownCodecError,
  InvalidRecordError): a corrupt frame never decodes to a record.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from capture_format.codec_base import ErrorSums, TensorLayout
from capture_format.codecs import Codec, get_codec
from capture_format.errors import ChecksumError, CodecError, FrameError, InvalidRecordError
from capture_format.frame_header import (
    ELEMENT_DTYPES,
    TOKEN_IDS_DTYPE_LABEL,
    FrameInfo,
    TensorInfo,
    dump_header,
    load_header,
    parse_header,
)
from capture_format.records import (
    AUX_SEMANTICS,
    FINAL_SEMANTICS,
    INPUT_EMBEDS_SEMANTICS,
    MAX_RECORD_RAW_NBYTES,
    STATE_DTYPES,
    CaptureRecord,
)

__all__ = [
    "DEFAULT_CODECS",
    "FRAME_FORMAT_VERSION",
    "FRAME_MAGIC",
    "FRAME_PREFIX_NBYTES",
    "MAX_FRAME_NBYTES",
    "FramePrefix",
    "codec_for_states",
    "decode_frame",
    "encode_frame",
    "check_header",
    "decode_tensor",
    "frame_errors",
    "inspect_frame",
    "inspect_frame_header",
    "verify_inspected_frame",
    "parse_frame_prefix",
    "read_frame_prefix",
]

FRAME_MAGIC = b"ETAPFRAM"
FRAME_FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sHHIQQ")
FRAME_PREFIX_NBYTES = _PREFIX.size
_CHECKSUMMED_PREFIX_NBYTES = 24  # the header checksum covers the prefix up to the checksum itself
MAX_HEADER_NBYTES = 4 << 20  # 64 KiB of metadata plus up to 65,536 loss spans fit with room to spare
MAX_PAYLOAD_NBYTES = MAX_RECORD_RAW_NBYTES + MAX_RECORD_RAW_NBYTES // 64  # room for codec overhead
MAX_FRAME_NBYTES = FRAME_PREFIX_NBYTES + MAX_HEADER_NBYTES + MAX_PAYLOAD_NBYTES
DEFAULT_CODECS = {"bfloat16": "bf16-split", "float16": "zstd:1", "float32": "zstd:1"}
"""Codec encode_frame applies to aux and final when none is given, by record dtype."""
TOKEN_IDS_CODEC = "raw"  # 4 bytes per token against ~10-60 KB of states: not worth compressing


def _header_checksum(prefix: bytes | memoryview, header: bytes | memoryview) -> str:
    digest = xxhash.xxh3_64(prefix[:_CHECKSUMMED_PREFIX_NBYTES])
    digest.update(header)
    return digest.hexdigest()


def codec_for_states(dtype: str, codec: str | None = None) -> Codec:
    """The codec for states of `dtype` (a STATE_DTYPES name): `codec`, or DEFAULT_CODECS[dtype] when None.

    Raises CodecError when the codec cannot store such elements (bf16-split and 4-byte float32), so a
    writer can refuse the pairing once, up front, instead of failing every record.
    """
    if dtype not in STATE_DTYPES:
        raise CodecError(f"states of dtype {dtype!r} are not supported; accepted: {', '.join(STATE_DTYPES)}")
    state_codec = get_codec(codec if codec is not None else DEFAULT_CODECS[dtype])
    state_codec.check_dtype(dtype)
    return state_codec


def encode_frame(record: CaptureRecord, codec: str | None = None) -> bytes:
    """Returns record as one frame; codec applies to aux, final and input_embeds (default: DEFAULT_CODECS[dtype]).

    A tensor's raw_xxh3_64 hashes what decoding gives: the input itself, or for a lossy codec its
    decoded (dequantised) output, so a reader's decoded checksum protects what it trains on."""
    state_codec = codec_for_states(record.dtype, codec)
    tensor_sources = (
        ("token_ids", TOKEN_IDS_DTYPE_LABEL, record.token_ids, get_codec(TOKEN_IDS_CODEC)),
        ("aux", record.dtype, record.aux, state_codec),
        ("final", record.dtype, record.final, state_codec),
        *((("input_embeds", record.dtype, record.input_embeds, state_codec),) if record.input_embeds is not None
          else ()),
    )
    tensor_entries = []
    stored_parts = []
    offset = 0
    for name, dtype, array, tensor_codec in tensor_sources:
        data = np.ascontiguousarray(array)  # record arrays are little-endian; views may be strided
        encoded = tensor_codec.encode_tensor(data, TensorLayout.of(data, dtype))
        parts = encoded.parts
        stored_digest = xxhash.xxh3_64()
        for part in parts:
            stored_digest.update(part)
        stored_nbytes = sum(memoryview(part).nbytes for part in parts)
        tensor_entries.append(
            {
                "name": name,
                "dtype": dtype,
                "shape": list(data.shape),
                "codec": tensor_codec.spec,
                "offset": offset,
                "raw_nbytes": data.nbytes,
                "stored_nbytes": stored_nbytes,
                "stored_xxh3_64": stored_digest.hexdigest(),
                "raw_xxh3_64": xxhash.xxh3_64_hexdigest(encoded.decoded),
            }
        )
        stored_parts.extend(parts)
        offset += stored_nbytes
    header = dump_header(
        {
            "schema_version": record.schema_version,
            "record_id": record.record_id,
            "sample_id": record.sample_id,
            "model_fingerprint": record.model_fingerprint,
            "capture_layers": list(record.capture_layers),
            "hidden_size": record.hidden_size,
            "dtype": record.dtype,
            "aux_semantics": AUX_SEMANTICS,
            "final_semantics": FINAL_SEMANTICS,
            "loss_spans": [list(span) for span in record.loss_spans],
            "metadata": record.metadata,
            "tensors": tensor_entries,
            **({"states_prefix": record.states_prefix.to_json()} if record.states_prefix else {}),
            **({"input_embed_spans": [list(span) for span in record.input_embed_spans],
                "input_embeds_semantics": INPUT_EMBEDS_SEMANTICS} if record.input_embed_spans else {}),
        }
    )
    # Record limits (ids, spans, metadata, sizes) keep every valid record within the frame limits.
    assert len(header) <= MAX_HEADER_NBYTES and offset <= MAX_PAYLOAD_NBYTES
    unsigned_prefix = _PREFIX.pack(FRAME_MAGIC, FRAME_FORMAT_VERSION, 0, len(header), offset, 0)
    checksum = int(_header_checksum(unsigned_prefix, header), 16)
    prefix = _PREFIX.pack(FRAME_MAGIC, FRAME_FORMAT_VERSION, 0, len(header), offset, checksum)
    return b"".join([prefix, header, *stored_parts])


@dataclass(frozen=True, kw_only=True, slots=True)
class FramePrefix:
    """The fixed-size start of a frame. Its lengths are trusted only once the header checksum matches."""

    header_nbytes: int
    payload_nbytes: int
    header_xxh3_64: str

    @property
    def frame_nbytes(self) -> int:
        return FRAME_PREFIX_NBYTES + self.header_nbytes + self.payload_nbytes


def parse_frame_prefix(first_bytes: bytes | bytearray | memoryview) -> FramePrefix:
    """Reads the prefix at the start of first_bytes (at least FRAME_PREFIX_NBYTES long).

    Checks magic, version, flags and the size limits, so a streaming receiver can bound what it reads.
    """
    view = memoryview(first_bytes).cast("B")
    if view.nbytes < FRAME_PREFIX_NBYTES:
        raise FrameError(f"frame is truncated: {view.nbytes} bytes, shorter than the {FRAME_PREFIX_NBYTES}-byte prefix")
    magic, version, flags, header_nbytes, payload_nbytes, checksum = _PREFIX.unpack_from(view)
    if magic != FRAME_MAGIC:
        raise FrameError(f"not a frame: magic is {magic!r}; expected {FRAME_MAGIC!r}")
    if version != FRAME_FORMAT_VERSION:
        raise FrameError(f"frame format_version {version} is not supported; accepted: {FRAME_FORMAT_VERSION}")
    if flags != 0:
        raise FrameError(f"frame flags {flags:#06x} are not supported; accepted: 0x0000")
    if header_nbytes > MAX_HEADER_NBYTES:
        raise FrameError(f"frame header is {header_nbytes} bytes; at most {MAX_HEADER_NBYTES} are accepted")
    if payload_nbytes > MAX_PAYLOAD_NBYTES:
        raise FrameError(f"frame payload is {payload_nbytes} bytes; at most {MAX_PAYLOAD_NBYTES} are accepted")
    return FramePrefix(header_nbytes=header_nbytes, payload_nbytes=payload_nbytes, header_xxh3_64=f"{checksum:016x}")


def read_frame_prefix(first_bytes: bytes | bytearray | memoryview) -> int:
    """Returns the total length of the frame that starts with first_bytes; see parse_frame_prefix."""
    return parse_frame_prefix(first_bytes).frame_nbytes


def _parse_frame(view: memoryview) -> FrameInfo:
    """Checks prefix, lengths, header checksum and header; touches no tensor byte."""
    prefix = parse_frame_prefix(view)
    header_nbytes, frame_nbytes = prefix.header_nbytes, prefix.frame_nbytes
    if view.nbytes < frame_nbytes:
        raise FrameError(f"frame is truncated: {view.nbytes} of its {frame_nbytes} bytes are present")
    if view.nbytes > frame_nbytes:
        raise FrameError(f"{view.nbytes - frame_nbytes} trailing bytes after a {frame_nbytes}-byte frame")
    return check_header(prefix, view, view[FRAME_PREFIX_NBYTES : FRAME_PREFIX_NBYTES + header_nbytes])


def check_header(prefix: FramePrefix, prefix_bytes: bytes | memoryview, header_bytes: bytes | memoryview) -> FrameInfo:
    """The frame's FrameInfo from its parsed prefix, the prefix's bytes and the header's bytes alone: the
    header checksum and every header rule, no payload byte (the token-only reader needs no more)."""
    actual_checksum = _header_checksum(prefix_bytes, header_bytes)
    if actual_checksum != prefix.header_xxh3_64:
        raise ChecksumError(
            f"frame header checksum mismatch: the prefix says {prefix.header_xxh3_64}, "
            f"prefix and header hash to {actual_checksum}"
        )
    return parse_header(
        load_header(memoryview(header_bytes)),
        header_nbytes=prefix.header_nbytes,
        payload_nbytes=prefix.payload_nbytes,
        frame_nbytes=prefix.frame_nbytes,
        header_xxh3_64=actual_checksum,
    )


def read_frame_header(fd: int, offset: int) -> tuple[FramePrefix, FrameInfo]:
    """The parsed prefix and checked header of the frame at offset in an open file; no payload byte is read."""
    head = os.pread(fd, FRAME_PREFIX_NBYTES, offset)
    prefix = parse_frame_prefix(head)
    return prefix, check_header(prefix, head, os.pread(fd, prefix.header_nbytes, offset + FRAME_PREFIX_NBYTES))


def _stored_bytes(view: memoryview, info: FrameInfo, tensor: TensorInfo) -> memoryview:
    start = FRAME_PREFIX_NBYTES + info.header_nbytes + tensor.offset
    return view[start : start + tensor.stored_nbytes]


def _verify_checksum(data: memoryview, expected: str, tensor: TensorInfo, what: str) -> None:
    actual = xxhash.xxh3_64_hexdigest(data)
    if actual != expected:
        raise ChecksumError(f"tensor {tensor.name!r}: {what} bytes hash to {actual}; the header says {expected}")


def decode_tensor(stored: bytes | memoryview, tensor: TensorInfo, *, verify: bool = True) -> np.ndarray:
    """One tensor's array from its stored bytes; verify checks the stored and decoded checksums."""
    return _decode_tensor(stored, tensor, verify_stored=verify, verify_decoded=verify)


def _decode_tensor(stored: bytes | memoryview, tensor: TensorInfo, *, verify_stored: bool,
                   verify_decoded: bool) -> np.ndarray:
    if verify_stored:
        _verify_checksum(memoryview(stored), tensor.stored_xxh3_64, tensor, "stored")
    try:
        raw = get_codec(tensor.codec).decode(stored, tensor.layout)
    except CodecError as err:
        raise FrameError(f"tensor {tensor.name!r}: {err}") from None
    if verify_decoded:
        _verify_checksum(raw, tensor.raw_xxh3_64, tensor, "decoded")
    return np.frombuffer(raw, dtype=ELEMENT_DTYPES[tensor.dtype]).reshape(tensor.shape)


def inspect_frame_header(buf: bytes | bytearray | memoryview) -> FrameInfo:
    """Checks a whole frame's prefix, lengths, header checksum and header, touching no tensor byte.

    When this passes, the frame's length is trustworthy even if its payload is damaged: recovery
    uses it to step over one bad frame and keep the good ones behind it."""
    return _parse_frame(memoryview(buf).cast("B"))


def inspect_frame(buf: bytes | bytearray | memoryview) -> FrameInfo:
    """Checks a whole frame without decoding its tensors and returns what it describes.

    Verifies the prefix, the header (checksum, fields, shapes, sizes, layout), each tensor's stored
    checksum and the sizes its codec declares inside the stored bytes. This is the ingest check.
    """
    view = memoryview(buf).cast("B")
    info = _parse_frame(view)
    for tensor in info.tensors:
        stored = _stored_bytes(view, info, tensor)
        _verify_checksum(stored, tensor.stored_xxh3_64, tensor, "stored")
        try:
            get_codec(tensor.codec).check_stored(stored, tensor.layout)
        except CodecError as err:
            raise FrameError(f"tensor {tensor.name!r}: {err}") from None
    return info


def frame_errors(buf: bytes | bytearray | memoryview, info: FrameInfo) -> dict[str, tuple[str, ErrorSums]]:
    """tensor name -> (codec, error its encoder measured) for each lossy tensor of a frame inspect_frame passed."""
    view = memoryview(buf).cast("B")
    errors = {}
    for tensor in info.tensors:
        codec = get_codec(tensor.codec)
        if codec.lossy:
            errors[tensor.name] = (codec.spec, codec.stored_error(_stored_bytes(view, info, tensor), tensor.layout))
    return errors


def decode_frame(buf: bytes | bytearray | memoryview, *, verify: bool = True) -> CaptureRecord:
    """Returns the record in a frame. verify=True also checks stored and decoded tensor checksums.

    Prefix, header checksum and header are checked either way. With the raw codec the returned
    arrays view buf without copying: pass immutable bytes, or do not change buf afterwards.
    """
    view = memoryview(buf).cast("B")
    return _record(view, _parse_frame(view), verify_stored=verify, verify_decoded=verify)


def verify_inspected_frame(buf: bytes | bytearray | memoryview, info: FrameInfo) -> None:
    """Decodes each tensor of a frame `inspect_frame` passed (info: its answer) and checks what its header cannot
    vouch for: every decoded checksum and that no token id is negative (InvalidRecordError). Together with
    `inspect_frame`, what `decode_frame(buf)` checks, without building the record: the header's rules already
    cover every field the record would check again (the collector's ingest check, a third cheaper a short frame)."""
    view = memoryview(buf).cast("B")
    for tensor in info.tensors:
        array = _decode_tensor(_stored_bytes(view, info, tensor), tensor, verify_stored=False, verify_decoded=True)
        if tensor.name == "token_ids" and int(array.min()) < 0:  # the header allows no empty record
            raise InvalidRecordError(f"token_ids must be non-negative; got minimum {int(array.min())}")


def _record(view: memoryview, info: FrameInfo, *, verify_stored: bool, verify_decoded: bool) -> CaptureRecord:
    arrays = {}
    for tensor in info.tensors:
        arrays[tensor.name] = _decode_tensor(_stored_bytes(view, info, tensor), tensor, verify_stored=verify_stored,
                                             verify_decoded=verify_decoded)
    return CaptureRecord(
        record_id=info.record_id,
        sample_id=info.sample_id,
        model_fingerprint=info.model_fingerprint,
        capture_layers=info.capture_layers,
        hidden_size=info.hidden_size,
        dtype=info.dtype,
        token_ids=arrays["token_ids"],
        loss_spans=info.loss_spans,
        aux=arrays["aux"],
        final=arrays["final"],
        metadata=info.metadata,
        states_prefix=info.states_prefix,
        input_embed_spans=info.input_embed_spans,
        input_embeds=arrays.get("input_embeds"),
    )
