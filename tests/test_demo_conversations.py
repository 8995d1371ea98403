"""The bundled demo conversations: the committed file, as `eagle-tap fire` reads it and the tiny model masks it.

What must hold: `eagle_tap/demo/conversations.jsonl` is the source of truth (edit it, one JSON object
per line, ids demo-0001...); the client's reader takes every row; there are enough
distinct conversations of every kind; and with the tiny model's own chat template every conversation
fits the model's context and gets loss spans holding exactly its assistant messages.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from client.conversations import Conversation, count_rows, read_conversations
from client.spans import ChatTokenizer
from eagle_tap.demo import CONVERSATIONS_PATH
from test_client_spans import check_spans_hold_exactly_the_answers

KINDS = ("chat", "code", "math", "multi-turn")
MIN_ROWS, MIN_ROWS_PER_KIND, MIN_MULTI_ANSWER_ROWS = 300, 40, 40


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return [json.loads(line) for line in CONVERSATIONS_PATH.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def conversations() -> list[Conversation]:
    items = list(read_conversations(CONVERSATIONS_PATH))
    bad = [str(item) for item in items if not isinstance(item, Conversation)]
    assert not bad, f"rows the client would skip: {bad[:3]}"
    return items


def test_the_client_reads_every_row_as_the_conversation_written(rows, conversations):
    assert count_rows(CONVERSATIONS_PATH) == len(conversations) == len(rows)
    for row, conversation in zip(rows, conversations):
        assert list(conversation.messages) == row["messages"]


def test_there_are_enough_distinct_conversations_of_every_kind(rows, conversations):
    assert len(rows) >= MIN_ROWS
    assert [row["id"] for row in rows] == [f"demo-{number:04d}" for number in range(1, len(rows) + 1)]
    # The client keys a sample by its messages: a repeated conversation would be captured once.
    assert len({conversation.key for conversation in conversations}) == len(conversations)
    num_per_kind = Counter(row["kind"] for row in rows)
    assert set(num_per_kind) == set(KINDS)
    assert min(num_per_kind.values()) >= MIN_ROWS_PER_KIND, num_per_kind
    num_answers = [sum(message["role"] == "assistant" for message in row["messages"]) for row in rows]
    assert sum(count >= 2 for count in num_answers) >= MIN_MULTI_ANSWER_ROWS
    assert any(row["messages"][0]["role"] == "system" for row in rows)


def test_every_row_alternates_and_ends_with_an_answer(rows):
    for row in rows:
        roles = [message["role"] for message in row["messages"]]
        body = roles[1:] if roles[0] == "system" else roles
        assert body and body == ["user", "assistant"] * (len(body) // 2), (row["id"], roles)
        assert all(message["content"].strip() for message in row["messages"]), row["id"]


def test_every_conversation_gets_exact_spans_from_the_tiny_template(tiny_model_dir, conversations):
    chat = ChatTokenizer.from_pretrained(tiny_model_dir)  # as `eagle-tap fire` loads it
    for conversation in conversations:
        messages = list(conversation.messages)
        turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
        sequence = chat.tokenize_conversation(messages)
        assert len(sequence.input_ids) <= chat.tokenizer.model_max_length, conversation.line
        check_spans_hold_exactly_the_answers(chat, "tiny", messages, sequence, turns)
