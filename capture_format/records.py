"""The capture record: one sequence as the server saw it, with its captured hidden states.

What must hold for every `CaptureRecord` (checked when it is built, so no invalid record exists):
- ids are safe to use in file names and logs: `record_id` and `sample_id` match `RECORD_ID_PATTERN`
  and `SAMPLE_ID_PATTERN` and contain no '..';
- shapes agree: token_ids [T], aux [S, K, H], final [S, H], with K == len(capture_layers),
  H == hidden_size, 1 <= T <= MAX_TOKENS, K <= MAX_CAPTURE_LAYERS, H <= MAX_HIDDEN_SIZE, and S, the
  number of states, either T or T - 1 >= 1. S == T - 1 says the last token has no state: it is the
  token a server sampled last, on which no forward ever ran (a capture made while generating);
  every other token t has its states at row t;
- a record may leave the states of its first P tokens to a shared prefix stored once elsewhere
  (`states_prefix`, see `prefix_blocks.py`): then 1 <= P < T, S is T - P or T - P - 1 (>= 1), and
  token t >= P has its states at row t - P;
- dtypes agree: token_ids int32 (non-negative), aux and final in the numpy dtype of `dtype`
  (bfloat16 travels as uint16 bit patterns, see `bfloat16.py`), all little-endian;
- loss_spans are sorted, non-overlapping, non-empty half-open [start, end) pairs within [0, T];
- metadata is a JSON object of at most MAX_METADATA_NBYTES encoded; the record keeps its JSON
  round trip, so what is decoded from a frame equals what was encoded;
- a record of a request with images (schema 2) marks the image positions with `input_embed_spans` (sorted,
  non-overlapping, non-empty half-open pairs within [0, T], none overlapping a loss span: an image position
  is never a loss position) and holds `input_embeds` [E, H], E the positions they cover, in the states'
  dtype: row e is the target's input embedding (its vision tower and projector's output, what SGLang puts
  there instead of the placeholder id's embedding) at the e-th image position, in order. Such a record
  holds every token's states itself (no `states_prefix`): a prefix's key is made of token ids, which are
  the same placeholder for any image. A record without image positions is schema 1, as before.
Arrays are stored as read-only views: a record never changes after it is built.
"""

from __future__ import annotations

import json
import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from capture_format.errors import InvalidRecordError, describe

__all__ = [
    "AUX_SEMANTICS",
    "FINAL_SEMANTICS",
    "MAX_CAPTURE_LAYERS",
    "MAX_HIDDEN_SIZE",
    "MAX_LAYER_INDEX",
    "MAX_LOSS_SPANS",
    "MAX_METADATA_NBYTES",
    "MAX_MODEL_FINGERPRINT_CHARS",
    "MAX_RECORD_ID_CHARS",
    "MAX_RECORD_RAW_NBYTES",
    "MAX_SAMPLE_ID_CHARS",
    "MAX_TOKENS",
    "INPUT_EMBEDS_SEMANTICS",
    "RECORD_ID_PATTERN",
    "SAMPLE_ID_PATTERN",
    "SCHEMA_VERSION",
    "SCHEMA_VERSIONS",
    "STATE_DTYPES",
    "TOKEN_ID_DTYPE",
    "CaptureRecord",
    "StatesPrefix",
    "mask_from_spans",
    "num_span_positions",
    "spans_from_mask",
]

SCHEMA_VERSION = 2
"""The newest version this code writes: 2 for a record with image positions, 1 for any other."""
SCHEMA_VERSIONS = (1, 2)
"""1: text only. 2: adds input_embed_spans and input_embeds (images). A reader rejects versions it does not know."""
INPUT_EMBEDS_SEMANTICS = "target-input-embeddings"
"""input_embeds[e] is the target's input to its first decoder layer at the e-th position of input_embed_spans."""
AUX_SEMANTICS = "decoder-layer-input-residual"
"""aux[t, k] is the residual stream entering decoder layer capture_layers[k] at token t."""
FINAL_SEMANTICS = "post-final-norm"
"""final[t] is the last decoder layer's output after the final norm: logits = lm_head(final)."""

STATE_DTYPES: dict[str, np.dtype] = {
    "bfloat16": np.dtype("<u2"),  # bit patterns: numpy has no bfloat16
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
}
"""numpy dtype of aux and final for each accepted `dtype` label."""
TOKEN_ID_DTYPE = np.dtype("<i4")

MAX_TOKENS = 1 << 20
MAX_CAPTURE_LAYERS = 64
MAX_LAYER_INDEX = 65_535
MAX_HIDDEN_SIZE = 65_536
MAX_LOSS_SPANS = 65_536
MAX_METADATA_NBYTES = 64 * 1024
MAX_MODEL_FINGERPRINT_CHARS = 256
MAX_RECORD_RAW_NBYTES = 8 << 30
"""Bound on token_ids + aux + final + input_embeds bytes: a record must fit in one HTTP body and in memory."""

PREFIX_KEY_PATTERN = re.compile(r"[0-9a-f]{32}", re.ASCII)
"""A shared prefix's content key: 128 bits of BLAKE2b over the states' namespace and its token ids
(`prefix_blocks.prefix_key`)."""

MAX_RECORD_ID_CHARS = 128
MAX_SAMPLE_ID_CHARS = 256
RECORD_ID_PATTERN = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:-]{{0,{MAX_RECORD_ID_CHARS - 1}}}", re.ASCII)
SAMPLE_ID_PATTERN = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:-]{{0,{MAX_SAMPLE_ID_CHARS - 1}}}", re.ASCII)


def _check_id(value: object, name: str, pattern: re.Pattern[str], max_chars: int) -> str:
    if not isinstance(value, str):
        raise InvalidRecordError(f"{name} must be a str; got {type(value).__name__} {describe(value)}")
    if pattern.fullmatch(value) is None or ".." in value:
        raise InvalidRecordError(
            f"{name} {describe(value)} is not allowed: use 1-{max_chars} characters from "
            "A-Z a-z 0-9 . _ : -, starting with a letter or digit, with no '..'"
        )
    return value


def check_record_id(value: object) -> str:
    """Returns value if it is a valid record id, else raises InvalidRecordError."""
    return _check_id(value, "record_id", RECORD_ID_PATTERN, MAX_RECORD_ID_CHARS)


def check_sample_id(value: object) -> str:
    """Returns value if it is a valid sample id, else raises InvalidRecordError."""
    return _check_id(value, "sample_id", SAMPLE_ID_PATTERN, MAX_SAMPLE_ID_CHARS)


def _check_int(value: object, name: str, low: int, high: int) -> int:
    # bool is an int subclass; True must not pass as a hidden size of 1.
    if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)):
        raise InvalidRecordError(f"{name} must be an int; got {type(value).__name__} {describe(value)}")
    if not low <= value <= high:
        raise InvalidRecordError(f"{name} {value} is out of range; accepted: {low}..{high}")
    return int(value)


def _as_sequence(value: object, name: str, expected: str) -> Sequence[Any]:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise InvalidRecordError(f"{name} must be {expected}; got {type(value).__name__} {describe(value)}")
    return value


def check_schema_version(value: object) -> int:
    if type(value) is not int or value not in SCHEMA_VERSIONS:
        accepted = ", ".join(map(str, SCHEMA_VERSIONS))
        raise InvalidRecordError(f"schema_version {describe(value)} is not supported; accepted: {accepted}")
    return value


def schema_version_for(has_input_embeds: bool) -> int:
    """The version a record is written with: 2 only where it has image positions, so readers of version 1
    read every text record and refuse, by its version, one they could not read whole."""
    return 2 if has_input_embeds else 1


def check_model_fingerprint(value: object) -> str:
    if not isinstance(value, str):
        raise InvalidRecordError(f"model_fingerprint must be a str; got {type(value).__name__}")
    if not 1 <= len(value) <= MAX_MODEL_FINGERPRINT_CHARS or not value.isprintable():
        raise InvalidRecordError(
            f"model_fingerprint {describe(value)} must be 1-{MAX_MODEL_FINGERPRINT_CHARS} printable characters"
        )
    return value


def check_capture_layers(value: object) -> tuple[int, ...]:
    """Returns the layers as a tuple: 1..MAX_CAPTURE_LAYERS distinct indices in increasing order."""
    values = _as_sequence(value, "capture_layers", "a sequence of ints")
    if not 1 <= len(values) <= MAX_CAPTURE_LAYERS:
        raise InvalidRecordError(f"capture_layers needs 1-{MAX_CAPTURE_LAYERS} layers; got {len(values)}")
    layers = tuple(_check_int(layer, "capture layer", 0, MAX_LAYER_INDEX) for layer in values)
    # Increasing order keeps aux[:, k] in one canonical order for the trainer and the exporter.
    if any(later <= earlier for earlier, later in zip(layers, layers[1:])):
        raise InvalidRecordError(f"capture_layers {list(layers)} must be strictly increasing")
    return layers


def check_hidden_size(value: object) -> int:
    return _check_int(value, "hidden_size", 1, MAX_HIDDEN_SIZE)


def check_num_tokens(value: object) -> int:
    return _check_int(value, "number of tokens", 1, MAX_TOKENS)


def check_num_states(value: object, num_tokens: int, prefix_tokens: int = 0) -> int:
    """Rows of states for a record of num_tokens tokens whose first prefix_tokens are stored elsewhere:
    num_tokens - prefix_tokens, or one fewer (>= 1) when the last token has no state."""
    held = num_tokens - prefix_tokens
    if value not in (held, held - 1) or value == 0 or isinstance(value, bool):
        shared = f" past its {prefix_tokens}-token shared prefix" if prefix_tokens else ""
        raise InvalidRecordError(
            f"a record of {num_tokens} tokens holds states for all {held} tokens{shared}, or for all but the "
            f"last ({held - 1}, at least 1); got {describe(value)} rows")
    return int(value)


@dataclass(frozen=True, slots=True)
class StatesPrefix:
    """The first `num_tokens` tokens of a record have their states in a shared prefix stored once,
    named by `key`, the content key of exactly those token ids (see `prefix_blocks.py`)."""

    key: str
    num_tokens: int

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "num_tokens": self.num_tokens}


def check_states_prefix(value: object, num_tokens: int) -> StatesPrefix | None:
    """None, or a StatesPrefix (or its JSON object) whose key is well formed and which leaves the
    record at least one token of its own: 1 <= prefix tokens < num_tokens."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        if set(value) != {"key", "num_tokens"}:
            raise InvalidRecordError(f"states_prefix must have exactly the fields key and num_tokens; got "
                                     f"{describe(sorted(value))}")
        value = StatesPrefix(value["key"], value["num_tokens"])
    if not isinstance(value, StatesPrefix):
        raise InvalidRecordError(f"states_prefix must be a StatesPrefix or None; got {type(value).__name__}")
    if not isinstance(value.key, str) or PREFIX_KEY_PATTERN.fullmatch(value.key) is None:
        raise InvalidRecordError(f"states_prefix key {describe(value.key)} must be 32 lowercase hex digits")
    prefix_tokens = _check_int(value.num_tokens, "states_prefix num_tokens", 1, max(num_tokens - 1, 1))
    if prefix_tokens >= num_tokens:
        raise InvalidRecordError(f"a shared prefix of {prefix_tokens} tokens leaves none of the record's "
                                 f"{num_tokens} tokens to it")
    return StatesPrefix(value.key, prefix_tokens)


def check_dtype(value: object) -> str:
    if not isinstance(value, str) or value not in STATE_DTYPES:
        raise InvalidRecordError(f"dtype {describe(value)} is not supported; accepted: {', '.join(STATE_DTYPES)}")
    return value


def check_loss_spans(value: object, num_tokens: int) -> tuple[tuple[int, int], ...]:
    """Returns the spans as a tuple of (start, end) pairs after checking order and bounds."""
    return _check_spans(value, num_tokens, "loss")


def check_input_embed_spans(value: object, num_tokens: int,
                            loss_spans: tuple[tuple[int, int], ...] = ()) -> tuple[tuple[int, int], ...]:
    """The image positions as (start, end) pairs: ordered and bounded like loss spans, and none in a loss span."""
    spans = _check_spans(value, num_tokens, "input embed")
    overlap = spans_overlap(spans, loss_spans)
    if overlap is not None:
        raise InvalidRecordError(f"input embed span {overlap[0]} overlaps loss span {overlap[1]}: an image "
                                 "position is never a loss position")
    return spans


def spans_overlap(first: Sequence[tuple[int, int]],
                  second: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The first pair of overlapping spans, one from each sorted list, or None."""
    i = j = 0
    while i < len(first) and j < len(second):
        if first[i][0] < second[j][1] and second[j][0] < first[i][1]:
            return tuple(first[i]), tuple(second[j])
        if first[i][1] <= second[j][1]:
            i += 1
        else:
            j += 1
    return None


def _check_spans(value: object, num_tokens: int, kind: str) -> tuple[tuple[int, int], ...]:
    field_name = f"{kind.replace(' ', '_')}_spans"
    pairs = _as_sequence(value, field_name, "a sequence of (start, end) pairs")
    if len(pairs) > MAX_LOSS_SPANS:
        raise InvalidRecordError(f"{field_name} has {len(pairs)} spans; at most {MAX_LOSS_SPANS} are accepted")
    spans = []
    previous_end = 0
    for span in pairs:
        if not isinstance(span, Sequence) or isinstance(span, str) or len(span) != 2:
            raise InvalidRecordError(f"{kind} span {describe(span)} must be a (start, end) pair")
        start = _check_int(span[0], f"{kind} span start", 0, num_tokens)
        end = _check_int(span[1], f"{kind} span end", 0, num_tokens)
        if not previous_end <= start < end:
            raise InvalidRecordError(
                f"{kind} span ({start}, {end}) must be non-empty, sorted and not overlap the previous span "
                f"(which ends at {previous_end}); spans are half-open within [0, {num_tokens}]"
            )
        spans.append((start, end))
        previous_end = end
    return tuple(spans)


def check_metadata(value: object) -> dict[str, Any]:
    """Returns the JSON round trip of value: a JSON object of at most MAX_METADATA_NBYTES bytes."""
    if not isinstance(value, Mapping):
        raise InvalidRecordError(f"metadata must be a dict; got {type(value).__name__}")
    if not all(isinstance(key, str) for key in value):
        raise InvalidRecordError(f"metadata keys must be str; got {describe(list(value))}")
    try:
        encoded = json.dumps(dict(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as err:
        raise InvalidRecordError(f"metadata is not JSON-serialisable: {err}") from None
    nbytes = len(encoded.encode("utf-8"))
    if nbytes > MAX_METADATA_NBYTES:
        raise InvalidRecordError(f"metadata is {nbytes} bytes as JSON; at most {MAX_METADATA_NBYTES} are accepted")
    return json.loads(encoded)


def _check_array(value: object, name: str, dtype: np.dtype, shape: tuple[int, ...], dtype_hint: str) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise InvalidRecordError(f"{name} must be a numpy array; got {type(value).__name__}")
    if value.dtype != dtype:
        raise InvalidRecordError(f"{name} has dtype {value.dtype.str}; expected {dtype.str} ({dtype_hint})")
    if value.shape != shape:
        raise InvalidRecordError(f"{name} has shape {value.shape}; expected {shape}")
    read_only = value.view()
    read_only.flags.writeable = False
    return read_only


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class CaptureRecord:
    """One captured sequence. eq=False: numpy arrays have no single truth value to compare by."""

    record_id: str
    """Unique id of this capture; the collector deduplicates on it."""
    sample_id: str
    """Id of the dataset sample (conversation) the sequence came from."""
    model_fingerprint: str
    """Identifies the target model (name and weights revision) the states came from."""
    capture_layers: tuple[int, ...]
    """0-based decoder layers whose input residual stream is in aux, increasing."""
    hidden_size: int
    """H: width of every captured state."""
    dtype: str
    """Element type of aux and final: one of STATE_DTYPES."""
    token_ids: np.ndarray
    """int32 [T]: the sequence as the server saw it (prompt and completion)."""
    loss_spans: tuple[tuple[int, int], ...]
    """Half-open token ranges the draft model learns to predict (assistant tokens)."""
    aux: np.ndarray
    """[S, K, H]: states entering the capture layers (AUX_SEMANTICS); S is T, or T - 1 when the last
    token has no state (see `num_states`), less the tokens of a shared prefix."""
    final: np.ndarray
    """[S, H]: last hidden state after the final norm (FINAL_SEMANTICS)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form JSON object (client, dataset, sampling settings)."""
    schema_version: int | None = None
    """Version of these rules (SCHEMA_VERSIONS); None: the one the record needs (`schema_version_for`). A
    version given must be that one. A reader rejects versions it does not know."""
    states_prefix: StatesPrefix | None = None
    """None, or the shared prefix holding the states of the first tokens (then aux and final start at
    token states_prefix.num_tokens). Readers of shards resolve it: `prefix_blocks.resolve_prefix`."""
    input_embed_spans: tuple[tuple[int, int], ...] = ()
    """Half-open token ranges of the image positions, where the target's input is not its embedding of the
    token id (the ids there are the image placeholder, as the server expanded it); () for a text record."""
    input_embeds: np.ndarray | None = None
    """[E, H] (INPUT_EMBEDS_SEMANTICS): the target's input embeddings at the image positions, in order, E their
    number; None exactly when there are none."""

    def __post_init__(self) -> None:
        set_field = object.__setattr__  # frozen: assignments inside __post_init__ go through object
        if self.schema_version is not None:
            check_schema_version(self.schema_version)
        set_field(self, "record_id", check_record_id(self.record_id))
        set_field(self, "sample_id", check_sample_id(self.sample_id))
        set_field(self, "model_fingerprint", check_model_fingerprint(self.model_fingerprint))
        layers = check_capture_layers(self.capture_layers)
        set_field(self, "capture_layers", layers)
        hidden_size = check_hidden_size(self.hidden_size)
        state_dtype = STATE_DTYPES[check_dtype(self.dtype)]
        if not isinstance(self.token_ids, np.ndarray) or self.token_ids.ndim != 1:
            raise InvalidRecordError(f"token_ids must be a 1-D numpy array; got {describe(self.token_ids)}")
        num_tokens = check_num_tokens(self.token_ids.shape[0])
        token_ids = _check_array(self.token_ids, "token_ids", TOKEN_ID_DTYPE, (num_tokens,), "int32")
        if int(token_ids.min()) < 0:
            raise InvalidRecordError(f"token_ids must be non-negative; got minimum {int(token_ids.min())}")
        hint = "uint16 bit patterns" if self.dtype == "bfloat16" else self.dtype
        states_prefix = check_states_prefix(self.states_prefix, num_tokens)
        set_field(self, "states_prefix", states_prefix)
        num_states = check_num_states(self.aux.shape[0] if isinstance(self.aux, np.ndarray) and self.aux.ndim
                                      else None, num_tokens, states_prefix.num_tokens if states_prefix else 0)
        aux = _check_array(self.aux, "aux", state_dtype, (num_states, len(layers), hidden_size), hint)
        final = _check_array(self.final, "final", state_dtype, (num_states, hidden_size), hint)
        loss_spans = check_loss_spans(self.loss_spans, num_tokens)
        embed_spans = check_input_embed_spans(self.input_embed_spans, num_tokens, loss_spans)
        input_embeds = self._checked_input_embeds(embed_spans, state_dtype, hidden_size, hint)
        version = schema_version_for(input_embeds is not None)
        if self.schema_version not in (None, version):
            kind = "with" if input_embeds is not None else "without"
            raise InvalidRecordError(f"schema_version {self.schema_version} does not fit this record: one {kind} "
                                     f"image positions is {version}")
        if input_embeds is not None and states_prefix is not None:
            raise InvalidRecordError("a record with image positions holds every token's states itself (no "
                                     "states_prefix): a prefix key over token ids cannot tell two images apart")
        embeds_nbytes = 0 if input_embeds is None else input_embeds.nbytes
        raw_nbytes = token_ids.nbytes + aux.nbytes + final.nbytes + embeds_nbytes
        if raw_nbytes > MAX_RECORD_RAW_NBYTES:
            raise InvalidRecordError(f"record holds {raw_nbytes} bytes; at most {MAX_RECORD_RAW_NBYTES} are accepted")
        set_field(self, "schema_version", version)
        set_field(self, "token_ids", token_ids)
        set_field(self, "aux", aux)
        set_field(self, "final", final)
        set_field(self, "loss_spans", loss_spans)
        set_field(self, "input_embed_spans", embed_spans)
        set_field(self, "input_embeds", input_embeds)
        set_field(self, "metadata", check_metadata(self.metadata))

    def _checked_input_embeds(self, spans: tuple[tuple[int, int], ...], dtype: np.dtype, hidden_size: int,
                              hint: str) -> np.ndarray | None:
        num_rows = num_span_positions(spans)
        if self.input_embeds is None:
            if spans:
                raise InvalidRecordError(f"input_embed_spans mark {num_rows} image positions; input_embeds is missing")
            return None
        if not spans:
            raise InvalidRecordError("input_embeds given without input_embed_spans to place them")
        return _check_array(self.input_embeds, "input_embeds", dtype, (num_rows, hidden_size), hint)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_states(self) -> int:
        """S: rows of aux and final; num_tokens - 1 when the last token has no state (less a shared prefix)."""
        return int(self.aux.shape[0])

    @property
    def first_state_token(self) -> int:
        """The token whose states are row 0: 0, or the length of the shared prefix."""
        return self.states_prefix.num_tokens if self.states_prefix else 0

    @property
    def raw_nbytes(self) -> int:
        """Bytes of token_ids, aux, final and input_embeds uncompressed."""
        embeds = 0 if self.input_embeds is None else self.input_embeds.nbytes
        return self.token_ids.nbytes + self.aux.nbytes + self.final.nbytes + embeds

    def input_embed_mask(self) -> np.ndarray:
        """uint8 [T]: 1 on the image positions, 0 elsewhere."""
        return mask_from_spans(self.input_embed_spans, self.num_tokens)

    def loss_mask(self) -> np.ndarray:
        """uint8 [T]: 1 on tokens inside a loss span, 0 elsewhere."""
        return mask_from_spans(self.loss_spans, self.num_tokens)


def spans_from_mask(mask: np.ndarray | Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Returns the maximal runs of 1s in a 0/1 mask [T] as sorted half-open (start, end) pairs."""
    values = np.asarray(mask)
    if values.ndim != 1 or values.dtype.kind not in "biu":
        raise InvalidRecordError(f"mask must be a 1-D bool or integer array; got {values.dtype} {values.shape}")
    if values.dtype.kind != "b" and not np.isin(values, (0, 1)).all():
        raise InvalidRecordError("mask values must be 0 or 1")
    padded = np.concatenate(([0], values.astype(np.int8), [0]))
    edges = np.flatnonzero(np.diff(padded))  # rising edges at even positions, falling at odd
    return tuple(zip(edges[0::2].tolist(), edges[1::2].tolist()))


def mask_from_spans(spans: Sequence[tuple[int, int]], length: int, dtype: np.dtype | type = np.uint8) -> np.ndarray:
    """[length] of dtype: 1 (True) on the positions of the half-open spans, 0 elsewhere; `spans_from_mask` goes back."""
    mask = np.zeros(length, dtype=dtype)
    for start, end in spans:
        mask[start:end] = 1
    return mask


def num_span_positions(spans: Sequence[tuple[int, int]]) -> int:
    """How many positions the half-open spans cover (they do not overlap)."""
    return sum(end - start for start, end in spans)
