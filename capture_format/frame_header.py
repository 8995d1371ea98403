"""The JSON header of a frame: what it holds and how it is checked.

What must hold for a header `parse_header` accepts:
- it is a JSON object (UTF-8, no duplicate keys, no NaN/Infinity) with exactly HEADER_KEYS, and
  "states_prefix" where the record leaves its first tokens' states to a shared prefix; a schema 2
  header (a record with image positions) also has exactly "input_embed_spans" and "input_embeds_semantics",
  a schema 1 header neither;
- record fields obey the record rules (`records.py`) and the semantics labels are the known ones;
- "tensors" lists token_ids, aux, final (and input_embeds in schema 2) in this order, each with exactly
  TENSOR_KEYS, the dtype and shape the record fields imply ([T], [S, K, H], [S, H], [E, H]; S = T - P or
  T - P - 1 with P the shared prefix's tokens or 0, E the positions input_embed_spans cover, see
  `records.py`), raw_nbytes == product(shape) * itemsize,
  a known codec that accepts the element size, and hex xxh3_64 checksums;
- stored tensors tile the payload: offsets start at 0, each tensor starts where the previous ends,
  the last ends at payload_nbytes (no gaps, no overlap, nothing outside).
Everything a reader will allocate is bounded by these checks before any tensor is decoded.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from capture_format import records
from capture_format.codec_base import ELEMENT_DTYPES, TensorLayout
from capture_format.codecs import get_codec
from capture_format.errors import CodecError, FrameError, check_json_type, describe

__all__ = ["FrameInfo", "TensorInfo", "dump_header", "load_header", "parse_header"]

TENSOR_NAMES = ("token_ids", "aux", "final")
IMAGE_TENSOR_NAMES = (*TENSOR_NAMES, "input_embeds")
"""The tensors of a schema 2 frame (a record with image positions)."""
TOKEN_IDS_DTYPE_LABEL = "int32"
HEADER_KEYS = frozenset(
    {
        "aux_semantics",
        "capture_layers",
        "dtype",
        "final_semantics",
        "hidden_size",
        "loss_spans",
        "metadata",
        "model_fingerprint",
        "record_id",
        "sample_id",
        "schema_version",
        "tensors",
    }
)
OPTIONAL_HEADER_KEYS = frozenset({"states_prefix"})
IMAGE_HEADER_KEYS = frozenset({"input_embed_spans", "input_embeds_semantics"})
"""Exactly in a schema 2 header."""
TENSOR_KEYS = frozenset(
    {"codec", "dtype", "name", "offset", "raw_nbytes", "raw_xxh3_64", "shape", "stored_nbytes", "stored_xxh3_64"}
)
_CHECKSUM_PATTERN = re.compile(r"[0-9a-f]{16}", re.ASCII)


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorInfo:
    """Where one tensor lies in the payload and how to check and decode it."""

    name: str
    dtype: str
    """Element type label: "int32" for token_ids, the record dtype for aux and final."""
    shape: tuple[int, ...]
    codec: str
    """Canonical codec spec (see codecs.get_codec)."""
    offset: int
    """Start of the stored bytes, counted from the start of the payload."""
    raw_nbytes: int
    stored_nbytes: int
    stored_xxh3_64: str
    """Hex xxh3_64 of the stored bytes: checkable without decoding."""
    raw_xxh3_64: str
    """Hex xxh3_64 of the decoded little-endian bytes (for a lossy codec: of its decoded output)."""

    @property
    def layout(self) -> TensorLayout:
        """What the codec is told to decode this tensor."""
        return TensorLayout(self.dtype, self.shape)


@dataclass(frozen=True, kw_only=True, slots=True)
class FrameInfo:
    """A checked frame, tensors not decoded: what a collector needs to accept and index it."""

    record_id: str
    sample_id: str
    model_fingerprint: str
    capture_layers: tuple[int, ...]
    hidden_size: int
    dtype: str
    loss_spans: tuple[tuple[int, int], ...]
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    """token_ids, aux, final (and input_embeds in schema 2), in payload order."""
    header_nbytes: int
    frame_nbytes: int
    """Total length of the frame: prefix, header and payload."""
    header_xxh3_64: str
    """Hex checksum of the prefix fields and header; identifies the frame's exact header."""
    states_prefix: records.StatesPrefix | None = None
    """The shared prefix holding the first tokens' states, or None (records.CaptureRecord.states_prefix)."""
    input_embed_spans: tuple[tuple[int, int], ...] = ()
    """The image positions (records.CaptureRecord.input_embed_spans); () in schema 1."""

    @property
    def schema_version(self) -> int:
        return records.schema_version_for(bool(self.input_embed_spans))

    @property
    def num_tokens(self) -> int:
        return self.tensors[0].shape[0]

    @property
    def ids_xxh3_64(self) -> str:
        """Hex xxh3_64 of the token ids as little-endian int32 bytes."""
        return self.tensors[0].raw_xxh3_64

    @property
    def raw_nbytes(self) -> int:
        return sum(tensor.raw_nbytes for tensor in self.tensors)

    @property
    def stored_nbytes(self) -> int:
        return sum(tensor.stored_nbytes for tensor in self.tensors)

    @property
    def lossy(self) -> bool:
        """True when a tensor of the frame is stored with a lossy codec."""
        return any(get_codec(tensor.codec).lossy for tensor in self.tensors)


def dump_header(header: dict[str, Any]) -> bytes:
    """Canonical header bytes: compact JSON, sorted keys, UTF-8."""
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8")


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    mapping = dict(pairs)
    if len(mapping) != len(pairs):
        repeated = sorted(key for key, count in Counter(key for key, _ in pairs).items() if count > 1)
        raise ValueError(f"duplicate keys {describe(repeated)}")
    return mapping


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def load_header(header_bytes: memoryview) -> dict[str, Any]:
    """Parses header bytes into a dict; FrameError if they are not a UTF-8 JSON object."""
    try:
        header = json.loads(
            str(header_bytes, "utf-8"),
            object_pairs_hook=_object_without_duplicates,
            parse_constant=_reject_constant,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise FrameError(f"frame header is not valid UTF-8 JSON: {describe(str(err), max_chars=200)}") from None
    if not isinstance(header, dict):
        raise FrameError(f"frame header must be a JSON object; got {type(header).__name__}")
    return header


def _check_keys(mapping: dict[str, Any], expected: frozenset[str], where: str,
                optional: frozenset[str] = frozenset()) -> None:
    if mapping.keys() - optional != expected:
        missing = sorted(expected - mapping.keys())
        unexpected = sorted(mapping.keys() - expected - optional)
        raise FrameError(f"{where}: missing fields {missing}, unexpected fields {describe(unexpected)}")


def _typed(mapping: dict[str, Any], key: str, expected: type, where: str) -> Any:
    return check_json_type(mapping[key], expected, f"{where} field {key!r}", FrameError)


def _parse_tensor(entry: object, name: str, dtype: str, expected_offset: int,
                  names: tuple[str, ...] = TENSOR_NAMES) -> TensorInfo:
    where = f"tensor {name!r}"
    if not isinstance(entry, dict):
        raise FrameError(f"{where} must be a JSON object; got {describe(entry)}")
    _check_keys(entry, TENSOR_KEYS, where)
    if _typed(entry, "name", str, where) != name:
        raise FrameError(f"tensor {describe(entry['name'])} is out of place; tensors must be {list(names)}")
    if _typed(entry, "dtype", str, where) != dtype:
        raise FrameError(f"{where} has dtype {describe(entry['dtype'])}; expected {dtype!r}")
    shape = _typed(entry, "shape", list, where)
    if not all(isinstance(size, int) and not isinstance(size, bool) for size in shape):
        raise FrameError(f"{where} shape {describe(shape)} must be a list of ints")
    codec = get_codec(_typed(entry, "codec", str, where))
    try:
        codec.check_dtype(dtype)
    except CodecError as err:
        raise FrameError(f"{where}: {err}") from None
    checksums = {key: _typed(entry, key, str, where) for key in ("stored_xxh3_64", "raw_xxh3_64")}
    for key, checksum in checksums.items():
        if _CHECKSUM_PATTERN.fullmatch(checksum) is None:
            raise FrameError(f"{where} field {key!r} must be 16 lowercase hex digits; got {describe(checksum)}")
    offset = _typed(entry, "offset", int, where)
    if offset != expected_offset:
        raise FrameError(f"{where} starts at payload offset {offset}; the previous tensor ends at {expected_offset}")
    stored_nbytes = _typed(entry, "stored_nbytes", int, where)
    if stored_nbytes < 0:
        raise FrameError(f"{where} has negative stored_nbytes {stored_nbytes}")
    return TensorInfo(
        name=name,
        dtype=dtype,
        shape=tuple(shape),
        codec=codec.spec,
        offset=offset,
        raw_nbytes=_typed(entry, "raw_nbytes", int, where),
        stored_nbytes=stored_nbytes,
        **checksums,
    )


def _check_shape(tensor: TensorInfo, expected: tuple[int, ...]) -> None:
    if tensor.shape != expected:
        raise FrameError(
            f"tensor {tensor.name!r} has shape {list(tensor.shape)}; the record fields imply {list(expected)}"
        )
    expected_nbytes = ELEMENT_DTYPES[tensor.dtype].itemsize
    for size in expected:
        expected_nbytes *= size
    if tensor.raw_nbytes != expected_nbytes:
        raise FrameError(
            f"tensor {tensor.name!r} declares raw_nbytes {tensor.raw_nbytes}; shape {list(expected)} "
            f"of {tensor.dtype} holds {expected_nbytes}"
        )


def parse_header(
    header: dict[str, Any], *, header_nbytes: int, payload_nbytes: int, frame_nbytes: int, header_xxh3_64: str
) -> FrameInfo:
    """Checks a loaded header against the rules above and returns what it describes."""
    if "schema_version" not in header:
        _check_keys(header, HEADER_KEYS, "frame header", OPTIONAL_HEADER_KEYS)  # names what is missing
    version = records.check_schema_version(header["schema_version"])
    image_keys = IMAGE_HEADER_KEYS if version == 2 else frozenset()
    _check_keys(header, HEADER_KEYS | image_keys, f"frame header (schema {version})", OPTIONAL_HEADER_KEYS)
    if version == 2 and header["input_embeds_semantics"] != records.INPUT_EMBEDS_SEMANTICS:
        label = describe(header["input_embeds_semantics"])
        raise FrameError(f"frame header field 'input_embeds_semantics' is {label}; this reader knows "
                         f"{records.INPUT_EMBEDS_SEMANTICS!r}")
    for key, known in (("aux_semantics", records.AUX_SEMANTICS), ("final_semantics", records.FINAL_SEMANTICS)):
        if header[key] != known:
            raise FrameError(f"frame header field {key!r} is {describe(header[key])}; this reader knows {known!r}")
    capture_layers = records.check_capture_layers(_typed(header, "capture_layers", list, "frame header"))
    hidden_size = records.check_hidden_size(header["hidden_size"])
    dtype = records.check_dtype(header["dtype"])
    entries = _typed(header, "tensors", list, "frame header")
    names = IMAGE_TENSOR_NAMES if version == 2 else TENSOR_NAMES
    if len(entries) != len(names):
        raise FrameError(f"frame header lists {len(entries)} tensors; schema {version} expects {list(names)}")
    tensors = []
    offset = 0
    for entry, name in zip(entries, names):
        tensor = _parse_tensor(entry, name, TOKEN_IDS_DTYPE_LABEL if name == "token_ids" else dtype, offset, names)
        tensors.append(tensor)
        offset += tensor.stored_nbytes
    if offset != payload_nbytes:
        raise FrameError(
            f"tensors cover {offset} stored bytes; the frame prefix declares a {payload_nbytes}-byte payload"
        )
    token_ids, aux, final = tensors[:3]
    if len(token_ids.shape) != 1:
        raise FrameError(f"tensor 'token_ids' must be 1-D; got shape {describe(list(token_ids.shape))}")
    num_tokens = records.check_num_tokens(token_ids.shape[0])
    _check_shape(token_ids, (num_tokens,))
    if "states_prefix" in header:
        states_prefix = records.check_states_prefix(_typed(header, "states_prefix", dict, "frame header"), num_tokens)
    else:
        states_prefix = None
    # States for every token past the shared prefix, or for all but the last (records.check_num_states).
    held = num_tokens - (states_prefix.num_tokens if states_prefix else 0)
    last_has_no_state = held >= 2 and len(aux.shape) > 0 and aux.shape[0] == held - 1
    num_states = held - 1 if last_has_no_state else held
    _check_shape(aux, (num_states, len(capture_layers), hidden_size))
    _check_shape(final, (num_states, hidden_size))
    loss_spans = records.check_loss_spans(_typed(header, "loss_spans", list, "frame header"), num_tokens)
    embed_spans: tuple[tuple[int, int], ...] = ()
    if version == 2:
        embed_spans = records.check_input_embed_spans(_typed(header, "input_embed_spans", list, "frame header"),
                                                      num_tokens, loss_spans)
        if not embed_spans:
            raise FrameError("a schema 2 frame header marks no image position; a record without any is schema 1")
        if states_prefix is not None:
            raise FrameError("a schema 2 frame (image positions) cannot leave states to a shared prefix")
        _check_shape(tensors[3], (records.num_span_positions(embed_spans), hidden_size))
    raw_nbytes = sum(tensor.raw_nbytes for tensor in tensors)
    if raw_nbytes > records.MAX_RECORD_RAW_NBYTES:
        raise FrameError(f"frame declares {raw_nbytes} raw bytes; at most {records.MAX_RECORD_RAW_NBYTES} are accepted")
    return FrameInfo(
        record_id=records.check_record_id(header["record_id"]),
        sample_id=records.check_sample_id(header["sample_id"]),
        model_fingerprint=records.check_model_fingerprint(header["model_fingerprint"]),
        capture_layers=capture_layers,
        hidden_size=hidden_size,
        dtype=dtype,
        loss_spans=loss_spans,
        metadata=records.check_metadata(_typed(header, "metadata", dict, "frame header")),
        tensors=tuple(tensors),
        header_nbytes=header_nbytes,
        frame_nbytes=frame_nbytes,
        header_xxh3_64=header_xxh3_64,
        states_prefix=states_prefix,
        input_embed_spans=embed_spans,
    )
