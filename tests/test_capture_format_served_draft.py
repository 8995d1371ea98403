"""The serving draft's signal in records: decoding it, pooling it, and `eagle-tap shards stats` printing it.

Expected numbers are worked out by hand from the per-step lists in the comments, never by the code under test.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

import capture_format as cf
import capture_format.served_draft as served_draft
from capture_format.errors import InvalidRecordError
from capture_format.served_draft import ServedDraft, decode_steps, pool_served_drafts
from eagle_tap.cli import main as eagle_tap_main
from sglang_patch import speculative

sys.path.insert(0, str(Path(__file__).parent))
from test_collector_shards import finite_record  # noqa: E402

DRAFT_A, DRAFT_B = "a1" * 16, "b2" * 16
SERVING_A = speculative.SpecServing(algorithm="EAGLE3", draft_path="/drafts/a", num_steps=3, topk=1,
                                    num_draft_tokens=4)
SERVING_B = speculative.SpecServing(algorithm="EAGLE3", draft_path="/drafts/b", num_steps=2, topk=1,
                                    num_draft_tokens=3)
EXAMPLE = {"draft": "06e9c25b75670e1631a4739f7222389b", "algorithm": "EAGLE3", "num_steps": 3, "topk": 1,
           "num_draft_tokens": 4, "verify_steps": 6, "accepted_drafts": 2, "accepted_at_position": [2, 0, 0],
           "accepted_per_step": "001001"}


def served(draft: str, serving: speculative.SpecServing, accepted: list[int]) -> dict:
    """A record's metadata as the plugin writes it."""
    return {"source": "test", speculative.METADATA_KEY: speculative.served_draft_metadata(
        draft=draft, spec=serving, accepted=accepted)}


# Draft A served 3 steps top-1: steps 3,1,0,2 | 2,1 | none (prefill only): 6 verify steps, 9 accepted drafts,
# (9 + 6) / 6 = 2.5 tokens per step; steps accepting >= 1: 5 of 6, >= 2: 3 of 6, >= 3: 1 of 6.
# Draft B served 2 steps top-1: steps 0,0: 1.0 tokens per step, no position accepted. Two records without a draft.
MIXED_METADATA = [served(DRAFT_A, SERVING_A, [3, 1, 0, 2]), {"source": "test"}, served(DRAFT_B, SERVING_B, [0, 0]),
                  served(DRAFT_A, SERVING_A, [2, 1]), served(DRAFT_A, SERVING_A, []), {}]


@pytest.mark.parametrize(("text", "steps"), [("", []), ("3102", [3, 1, 0, 2]), ("00", [0, 0]),
                                             ("9az", [9, 10, 35])])
def test_decode_steps_known_answers(text: str, steps: list[int]) -> None:
    assert decode_steps(text) == steps


def test_decode_steps_names_a_bad_digit() -> None:
    with pytest.raises(InvalidRecordError, match=r"holds '\?'.*0123456789abc"):
        decode_steps("12?")


def test_the_plugin_takes_the_key_and_digits_from_capture_format() -> None:
    assert speculative.METADATA_KEY == "served_draft" == served_draft.METADATA_KEY
    metadata = served(DRAFT_A, SERVING_A, [3, 1, 0, 2, 35])
    assert metadata["served_draft"]["accepted_per_step"] == "3102z"
    assert speculative.accepted_from_metadata(metadata["served_draft"]) == [3, 1, 0, 2, 35]


def test_a_record_s_served_draft_read_from_its_metadata() -> None:
    assert ServedDraft.from_metadata({"source": "x"}) is None
    record = ServedDraft.from_metadata({"served_draft": EXAMPLE})
    assert (record.draft, record.algorithm, record.num_steps, record.topk) == (EXAMPLE["draft"], "EAGLE3", 3, 1)
    assert (record.verify_steps, record.accepted_drafts) == (6, 2)
    assert record.accepted_at_position == (2, 0, 0) and record.accepted_per_step == (0, 0, 1, 0, 0, 1)
    long_record = {**EXAMPLE, "accepted_per_step": None}  # a very long record lists no per-step digits
    assert ServedDraft.from_metadata({"served_draft": long_record}).accepted_per_step is None
    prefill_only = ServedDraft.from_metadata(served(DRAFT_A, SERVING_A, []))
    assert prefill_only.verify_steps == 0 and prefill_only.accepted_at_position == (0, 0, 0)


@pytest.mark.parametrize(("change", "message"), [
    ({"verify_steps": "6"}, r"verify_steps must be a non-negative int; got '6'"),
    ({"draft": ""}, r"draft must be a non-empty string"),
    ({"accepted_at_position": [2, 3, 0]}, r"cannot have accepted_at_position \[2, 3, 0\]"),
    ({"accepted_drafts": 3}, r"cannot have accepted_at_position"),
    ({"accepted_per_step": "0010"}, r"lists 4 steps accepting 1 drafts; the record says 6 and 2"),
    ({"topk": 0}, r"topk must be a positive int or null"),
])
def test_a_served_draft_that_breaks_the_layout_is_refused(change: dict, message: str) -> None:
    with pytest.raises(InvalidRecordError, match=message):
        ServedDraft.from_metadata({"served_draft": {**EXAMPLE, **change}})


def test_pooled_acceptance_per_draft_and_setting() -> None:
    tallies, num_without = pool_served_drafts(ServedDraft.from_metadata(item) for item in MIXED_METADATA)
    assert num_without == 2
    first, second = tallies
    assert (first.draft, first.num_records, first.verify_steps, first.accepted_drafts) == (DRAFT_A, 3, 6, 9)
    assert first.accepted_at_position == [5, 3, 1]
    assert first.acceptance_length == pytest.approx(2.5)
    assert first.position_acceptance == pytest.approx([5 / 6, 3 / 6, 1 / 6])
    assert (second.draft, second.num_records, second.acceptance_length) == (DRAFT_B, 1, 1.0)
    assert second.position_acceptance == [0.0, 0.0]
    assert served_draft.ServedDraftTally.from_json(first.to_json()) == first
    # The same draft served with another number of steps is another row, not blended into the first.
    five_steps = dataclasses.replace(SERVING_A, num_steps=5)
    tallies, _ = pool_served_drafts([ServedDraft.from_metadata(served(DRAFT_A, SERVING_A, [3])),
                                     ServedDraft.from_metadata(served(DRAFT_A, five_steps, [5]))])
    assert [(tally.num_steps, tally.acceptance_length) for tally in tallies] == [(3, 4.0), (5, 6.0)]


def write_records(directory: Path, metadatas: list[dict], records_per_shard: int = 4) -> None:
    records = [dataclasses.replace(finite_record(f"served-{index}", num_tokens=12), metadata=metadata)
               for index, metadata in enumerate(metadatas)]
    cf.write_shards(records, directory, records_per_shard=records_per_shard)


def stats_output(directory: Path, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert eagle_tap_main(["shards", "stats", "--shards", str(directory)]) == 0
    return capsys.readouterr().out


def test_shards_stats_pools_the_served_drafts_from_frame_headers(tmp_path: Path, capsys, monkeypatch) -> None:
    write_records(tmp_path, MIXED_METADATA)

    def no_decoding(*args, **kwargs):
        raise AssertionError("stats decoded a tensor: metadata sits in the frame header")

    monkeypatch.setattr("capture_format.shard_reader.decode_frame", no_decoding)
    monkeypatch.setattr("capture_format.token_ids.decode_tensor", no_decoding)
    output = stats_output(tmp_path, capsys)
    lines = output.splitlines()
    assert "records              6" in lines  # the totals above the new section are as before
    start = lines.index("served drafts: what the drafts serving the records achieved on their generations, "
                        "as SGLang counts it")
    table = [line.split() for line in lines[start + 1 : start + 4]]
    assert table[0] == ["draft", "algorithm", "steps/top-k", "records", "verify", "steps", "acceptance", "length",
                        "position", "1", "position", "2", "position", "3"]
    assert table[1] == ["a1a1a1a1a1a1", "EAGLE3", "3/1", "3", "6", "2.500", "0.833", "0.500", "0.167"]
    assert table[2] == ["b2b2b2b2b2b2", "EAGLE3", "2/1", "1", "2", "1.000", "0.000", "0.000", "-"]
    assert lines[start + 4] == "  records captured without a draft: 2"


def test_shards_stats_without_served_drafts_prints_no_such_section(tmp_path: Path, capsys) -> None:
    write_records(tmp_path, [{"source": "test"}, {}])
    output = stats_output(tmp_path, capsys)
    assert "served drafts" not in output and "without a draft" not in output
    assert output.rstrip().splitlines()[-1].startswith("codec ")


def test_shards_stats_names_a_record_whose_served_draft_does_not_read(tmp_path: Path, capsys) -> None:
    broken = {"served_draft": {**EXAMPLE, "accepted_per_step": "0010"}}
    write_records(tmp_path, [served(DRAFT_B, SERVING_B, [1, 0]), broken])
    output = stats_output(tmp_path, capsys)
    # Draft B: steps 1,0: (1 + 2) / 2 = 1.5 tokens per step, position 1 accepted by 1 of 2 steps.
    assert "  b2b2b2b2b2b2  EAGLE3     2/1" in output
    assert ["1", "2", "1.500", "0.500", "0.000"] == next(
        line.split()[3:] for line in output.splitlines() if "b2b2b2b2b2b2" in line)
    assert "record served-1: served_draft accepted_per_step lists 4 steps" in output
