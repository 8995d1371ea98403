"""The capture tag a client sends in custom_params, and the model fingerprint stored in every record."""

import json
import shutil

import pytest

from capture_format.fingerprint import model_fingerprint
from capture_format.tag import TAG_KEY, CaptureTag, InvalidTagError
from capture_format.errors import InvalidRecordError


def test_tag_round_trips_through_custom_params():
    tag = CaptureTag(record_id="run7:s42", sample_id="s42", loss_spans=[[12, 30], [41, 55]], metadata={"turns": 2})
    params = json.loads(json.dumps(tag.to_custom_params()))  # what travels over HTTP
    assert params == {TAG_KEY: {"record_id": "run7:s42", "sample_id": "s42", "spans": [[12, 30], [41, 55]],
                                "meta": {"turns": 2}}}
    assert CaptureTag.from_custom_params(params) == tag


@pytest.mark.parametrize("params", [None, {}, {"other_plugin": {"x": 1}}])
def test_untagged_requests_have_no_tag(params):
    assert CaptureTag.from_custom_params(params) is None


@pytest.mark.parametrize("body, error, message", [
    ("yes", InvalidTagError, "must be an object"),
    ({"sample_id": "s"}, InvalidTagError, "missing 'record_id'"),
    ({"record_id": "a", "spans": [[0, 2]], "extra": 1}, InvalidTagError, "unknown capture tag fields"),
    ({"record_id": "../a"}, InvalidRecordError, "record_id '../a' is not allowed"),
    ({"record_id": "a", "spans": [[4, 2]]}, InvalidRecordError, "must be non-empty"),
    ({"record_id": "a", "spans": [[0, 5], [3, 8]]}, InvalidRecordError, "not overlap"),
    ({"record_id": "a", "meta": {"x": float("nan")}}, InvalidRecordError, "not JSON-serialisable"),
])
def test_malformed_tags_are_refused_with_the_reason(body, error, message):
    with pytest.raises(error, match=message):
        CaptureTag.from_custom_params({TAG_KEY: body})


def test_sample_id_defaults_to_the_record_id():
    assert CaptureTag.from_custom_params({TAG_KEY: {"record_id": "r1"}}).sample_id == "r1"


def test_fingerprint_changes_with_the_tokenizer_not_with_json_formatting(tiny_model_dir, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    original = model_fingerprint(tiny_model_dir)
    assert original.startswith("LlamaForCausalLM:") and original == model_fingerprint(copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config, indent=7))
    assert model_fingerprint(copy) == original
    (copy / "chat_template.jinja").write_text("{{ messages }}")
    assert model_fingerprint(copy) != original


def test_fingerprint_needs_a_config(tmp_path):
    with pytest.raises(ValueError, match="config.json is missing"):
        model_fingerprint(tmp_path)
