"""Dataset readers: every row is a Conversation or a BadRow with its line number; formats agree on keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from client.conversations import BadRow, Conversation, count_rows, messages_from_row, read_conversations

FIXTURES = Path(__file__).parent / "fixtures"
SMALL = FIXTURES / "conversations_small.jsonl"
BROKEN = FIXTURES / "conversations_broken.jsonl"


def test_common_shapes_become_the_same_messages():
    openai = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                           {"role": "assistant", "content": "A"}]}
    sharegpt = {"system": "S", "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}
    parts = {"conversations": [{"role": "system", "content": "S"},
                               {"role": "user", "content": [{"type": "text", "text": "Q"}]},
                               {"role": "assistant", "content": "A"}]}
    assert messages_from_row(openai) == messages_from_row(sharegpt) == messages_from_row(parts)
    assert messages_from_row({"prompt": "Q", "response": "A"}) == openai["messages"][1:]
    assert messages_from_row({"prompt": "Q"}) == [{"role": "user", "content": "Q"}]
    reasoning = {"messages": [{"role": "user", "content": "Q"},
                              {"role": "assistant", "content": "A", "reasoning_content": "R"}]}
    assert messages_from_row(reasoning)[1] == {"role": "assistant", "content": "A", "reasoning_content": "R"}


def test_bad_rows_are_reported_with_their_line_and_never_raise():
    items = list(read_conversations(BROKEN))
    bad = {item.line: item.reason for item in items if isinstance(item, BadRow)}
    good = [item.line for item in items if isinstance(item, Conversation)]
    assert good == [1, 10, 11]  # line 9 is blank: skipped, but it still counts for the numbering
    assert sorted(bad) == [2, 3, 4, 5, 6, 7, 8, 12, 13]
    assert "not valid JSON" in bad[2] and "JSON object" in bad[3] and "unknown role 'wizard'" in bad[4]
    assert "'role' and 'content'" in bad[5] and "non-empty" in bad[6] and "got int" in bad[7]
    assert "expected 'messages'" in bad[8] and "image 'x' is not a data URL, an http(s) URL or an image file" in bad[12]
    assert "starts with an assistant message" in bad[13]
    assert str(next(item for item in items if isinstance(item, BadRow))).startswith("conversations_broken.jsonl:2:")
    assert count_rows(BROKEN) == len(items)


def test_invalid_utf8_is_a_bad_row(tmp_path):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "\xff\xfe"}\n')
    items = list(read_conversations(path))
    assert isinstance(items[0], Conversation) and isinstance(items[1], BadRow) and items[1].line == 2


def test_parquet_and_datasets_folder_give_the_same_conversations_as_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    rows = [json.loads(line) for line in SMALL.read_text().splitlines()]
    openai_rows = [{"messages": messages_from_row(row)} for row in rows]  # one schema per columnar file
    expected = [(item.line, item.key) for item in read_conversations(SMALL)]

    parquet_path = tmp_path / "small.parquet"
    pq.write_table(pa.Table.from_pylist(openai_rows), parquet_path)
    assert [(item.line, item.key) for item in read_conversations(parquet_path)] == expected
    assert count_rows(parquet_path) == len(rows)

    folder = tmp_path / "small_hf"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(openai_rows)}).save_to_disk(str(folder))
    assert [(item.line, item.key) for item in read_conversations(folder)] == expected
    assert [(item.line, item.key) for item in read_conversations(folder, split="train")] == expected
    with pytest.raises(ValueError, match="splits"):
        list(read_conversations(folder, split="test"))


def test_the_key_is_the_content_not_the_position(tmp_path):
    lines = SMALL.read_text().splitlines()
    reversed_path = tmp_path / "reversed.jsonl"
    reversed_path.write_text("\n".join(reversed(lines)) + "\n")
    forward = {item.key for item in read_conversations(SMALL)}
    assert {item.key for item in read_conversations(reversed_path)} == forward and len(forward) == len(lines)


def test_unknown_or_missing_data_is_refused(tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown data format 'data.csv'; accepted: .jsonl"):
        read_conversations(tmp_path / "data.csv")
    with pytest.raises(ValueError, match="no data at"):
        count_rows(tmp_path / "missing.jsonl")
