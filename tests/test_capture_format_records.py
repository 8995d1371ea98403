"""Capture records: id rules, shape and dtype rules, spans and masks, metadata, import isolation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from capture_format import (
    CaptureRecord,
    InvalidRecordError,
    bfloat16_bits_from_float32,
    float32_from_bfloat16_bits,
    spans_from_mask,
)
from capture_format.records import MAX_METADATA_NBYTES, MAX_TOKENS

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent


def make_record(**overrides: object) -> CaptureRecord:
    num_tokens, hidden_size = 4, 8
    layers = overrides.get("capture_layers", (2, 5, 7))
    fields: dict[str, object] = {
        "record_id": "rec-1",
        "sample_id": "sample-1",
        "model_fingerprint": "tiny@1",
        "capture_layers": layers,
        "hidden_size": hidden_size,
        "dtype": "bfloat16",
        "token_ids": np.arange(num_tokens, dtype=np.int32),
        "loss_spans": ((1, 3),),
        "aux": np.zeros((num_tokens, len(layers), hidden_size), dtype=np.uint16),
        "final": np.zeros((num_tokens, hidden_size), dtype=np.uint16),
    }
    fields.update(overrides)
    return CaptureRecord(**fields)


GOOD_IDS = ["a", "A9", "rec-000001", "run:7.sample_3-x", "x" * 128, "1.2.3", "a:b:c"]
BAD_IDS = [
    "",
    " ",
    " a",
    "a b",
    "a\n",
    "../x",
    "a/b",
    "a..b",
    "..",
    ".hidden",
    "-leading-dash",
    "x" * 129,
    "x" * 200,
    "é",
    "rec\u00e9",
    "rec\u200b",
    "a\\b",
    "a\x00",
]


@pytest.mark.parametrize("record_id", GOOD_IDS)
def test_good_record_ids_are_accepted(record_id: str) -> None:
    assert make_record(record_id=record_id).record_id == record_id


@pytest.mark.parametrize("record_id", BAD_IDS)
def test_bad_record_ids_are_rejected_showing_the_value(record_id: str) -> None:
    with pytest.raises(InvalidRecordError, match="record_id") as caught:
        make_record(record_id=record_id)
    assert repr(record_id)[:40] in str(caught.value)


def test_sample_ids_allow_256_characters_and_no_more() -> None:
    assert make_record(sample_id="s" * 256).sample_id == "s" * 256
    with pytest.raises(InvalidRecordError, match="sample_id"):
        make_record(sample_id="s" * 257)
    with pytest.raises(InvalidRecordError, match="sample_id"):
        make_record(sample_id="../etc/passwd")


def test_long_bad_values_are_cut_in_messages() -> None:
    with pytest.raises(InvalidRecordError) as caught:
        make_record(record_id="/" * 10_000)
    assert len(str(caught.value)) < 400


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"record_id": 7}, "record_id must be a str"),
        ({"hidden_size": True}, "hidden_size must be an int"),
        ({"hidden_size": 0}, "hidden_size 0 is out of range"),
        ({"hidden_size": 16}, r"aux has shape \(4, 3, 8\); expected \(4, 3, 16\)"),
        ({"dtype": "bf16"}, "dtype 'bf16' is not supported; accepted: bfloat16, float16, float32"),
        ({"dtype": "float32"}, "aux has dtype <u2; expected <f4"),
        ({"capture_layers": ()}, "needs 1-64 layers"),
        ({"capture_layers": (5, 2, 7)}, "strictly increasing"),
        ({"capture_layers": (1, 1, 7)}, "strictly increasing"),
        ({"capture_layers": (-1, 2, 7)}, "capture layer -1 is out of range"),
        ({"capture_layers": tuple(range(65))}, "needs 1-64 layers"),
        ({"token_ids": np.arange(4, dtype=np.int64)}, "token_ids has dtype <i8; expected <i4"),
        ({"token_ids": np.array([1, -2, 3, 4], dtype=np.int32)}, "non-negative"),
        ({"token_ids": np.zeros(0, dtype=np.int32)}, "number of tokens 0 is out of range"),
        ({"token_ids": [1, 2, 3, 4]}, "token_ids must be a 1-D numpy array"),
        ({"final": np.zeros((3, 8), dtype=np.uint16)}, r"final has shape \(3, 8\); expected \(4, 8\)"),
        ({"aux": np.zeros((4, 3, 8), dtype=">u2")}, "aux has dtype >u2; expected <u2"),
        ({"loss_spans": ((3, 1),)}, "must be non-empty, sorted"),
        ({"loss_spans": ((1, 1),)}, "must be non-empty, sorted"),
        ({"loss_spans": ((0, 3), (2, 4))}, "must be non-empty, sorted"),
        ({"loss_spans": ((2, 4), (0, 1))}, "must be non-empty, sorted"),
        ({"loss_spans": ((0, 5),)}, "loss span end 5 is out of range"),
        ({"loss_spans": ((0, 1, 2),)}, "must be a .start, end. pair"),
        ({"metadata": {"x": float("nan")}}, "not JSON-serialisable"),
        ({"metadata": {"x": object()}}, "not JSON-serialisable"),
        ({"metadata": {1: "x"}}, "metadata keys must be str"),
        ({"metadata": {"x": "y" * MAX_METADATA_NBYTES}}, "at most 65536 are accepted"),
        ({"model_fingerprint": ""}, "model_fingerprint"),
        ({"model_fingerprint": "a\nb"}, "model_fingerprint"),
        ({"schema_version": 3}, "schema_version 3 is not supported; accepted: 1, 2"),
    ],
)
def test_invalid_fields_are_rejected_with_a_message_naming_them(overrides: dict, message: str) -> None:
    with pytest.raises(InvalidRecordError, match=message):
        make_record(**overrides)


def test_too_many_tokens_are_rejected_before_arrays_are_checked() -> None:
    ids = np.zeros(MAX_TOKENS + 1, dtype=np.int32)
    with pytest.raises(InvalidRecordError, match="number of tokens 1048577 is out of range"):
        make_record(token_ids=ids)


def test_record_is_frozen_and_its_arrays_are_read_only() -> None:
    aux = np.zeros((4, 3, 8), dtype=np.uint16)
    record = make_record(aux=aux)
    with pytest.raises(AttributeError):
        record.record_id = "other"  # type: ignore[misc]
    with pytest.raises(ValueError, match="read-only"):
        record.aux[0, 0, 0] = 1
    aux[0, 0, 0] = 1  # the caller's own array stays writable
    assert np.shares_memory(record.aux, aux)


def test_fields_are_normalised() -> None:
    record = make_record(capture_layers=[np.int64(2), 5, 7], loss_spans=[[1, 3]], metadata={"b": (1, 2), "a": None})
    assert record.capture_layers == (2, 5, 7)
    assert type(record.capture_layers[0]) is int
    assert record.loss_spans == ((1, 3),)
    assert record.metadata == {"a": None, "b": [1, 2]}  # the JSON round trip is what a frame carries


def test_float16_and_float32_records() -> None:
    for dtype, numpy_dtype in (("float16", np.float16), ("float32", np.float32)):
        record = make_record(
            dtype=dtype, aux=np.ones((4, 3, 8), dtype=numpy_dtype), final=np.ones((4, 8), dtype=numpy_dtype)
        )
        assert record.raw_nbytes == 4 * 4 + (4 * 3 * 8 + 4 * 8) * np.dtype(numpy_dtype).itemsize


def test_loss_mask_and_spans_from_mask() -> None:
    record = make_record(loss_spans=((0, 1), (2, 4)))
    assert record.loss_mask().tolist() == [1, 0, 1, 1]
    assert record.loss_mask().dtype == np.uint8
    assert spans_from_mask(record.loss_mask()) == ((0, 1), (2, 4))
    assert spans_from_mask(np.zeros(5, dtype=np.uint8)) == ()
    assert spans_from_mask(np.ones(3, dtype=bool)) == ((0, 3),)
    assert spans_from_mask([0, 1, 1, 0, 1]) == ((1, 3), (4, 5))


def test_spans_from_mask_round_trips_random_masks() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        mask = (rng.random(int(rng.integers(1, 60))) < 0.4).astype(np.uint8)
        spans = spans_from_mask(mask)
        record = make_record(
            token_ids=np.zeros(mask.size, dtype=np.int32),
            aux=np.zeros((mask.size, 3, 8), dtype=np.uint16),
            final=np.zeros((mask.size, 8), dtype=np.uint16),
            loss_spans=spans,
        )
        assert np.array_equal(record.loss_mask(), mask)


@pytest.mark.parametrize("mask", [np.array([0, 2, 1]), np.zeros((2, 2), dtype=np.uint8), np.array([0.0, 1.0])])
def test_spans_from_mask_rejects_non_binary_masks(mask: np.ndarray) -> None:
    with pytest.raises(InvalidRecordError, match="mask"):
        spans_from_mask(mask)


def test_bfloat16_conversion_rounds_to_nearest_even_and_keeps_specials() -> None:
    values = np.array(
        [1.0, -2.5, 0.0, -0.0, np.inf, -np.inf, 1.00390625, 1.01171875, 3.4e38, 1e-40], dtype=np.float32
    )
    bits = bfloat16_bits_from_float32(values)
    # 1 + 2**-8 is a tie: rounds to even (1.0); 1 + 3 * 2**-8 is a tie: rounds up to 1 + 2**-6.
    assert bits.tolist() == [0x3F80, 0xC020, 0x0000, 0x8000, 0x7F80, 0xFF80, 0x3F80, 0x3F82, 0x7F80, 0x0001]
    nan_bits = bfloat16_bits_from_float32(np.array([np.nan, -np.nan], dtype=np.float32))
    assert np.isnan(float32_from_bfloat16_bits(nan_bits)).all()
    exact = np.array([0x0001, 0x7F7F, 0xFF7F, 0x3F80, 0x8000], dtype=np.uint16)
    assert np.array_equal(bfloat16_bits_from_float32(float32_from_bfloat16_bits(exact)), exact)


def test_importing_capture_format_pulls_in_no_heavy_framework() -> None:
    script = (
        "import sys, capture_format\n"
        "heavy = ('torch', 'fastapi', 'sglang', 'pydantic', 'starlette', 'transformers')\n"
        "print(sorted(name for name in sys.modules if name.split('.')[0] in heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPOSITORY_ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_a_record_may_leave_only_its_last_token_without_states() -> None:
    # A capture made while generating: the last sampled token never went through a forward.
    record = make_record(aux=np.zeros((3, 3, 8), dtype=np.uint16), final=np.zeros((3, 8), dtype=np.uint16))
    assert (record.num_tokens, record.num_states) == (4, 3)
    assert make_record().num_states == 4
    with pytest.raises(InvalidRecordError, match=r"all but the last \(3, at least 1\); got 2 rows"):
        make_record(aux=np.zeros((2, 3, 8), dtype=np.uint16), final=np.zeros((2, 8), dtype=np.uint16))
    with pytest.raises(InvalidRecordError, match=r"final has shape \(4, 8\); expected \(3, 8\)"):
        make_record(aux=np.zeros((3, 3, 8), dtype=np.uint16))  # aux and final must agree
    with pytest.raises(InvalidRecordError, match=r"got 0 rows"):
        make_record(token_ids=np.arange(1, dtype=np.int32), loss_spans=(),
                    aux=np.zeros((0, 3, 8), dtype=np.uint16), final=np.zeros((0, 8), dtype=np.uint16))
