"""From one conversation to its capture requests: record ids, token sequences and request bodies.

Record ids are `{run_id}:{sample_key}:{part}`: `part` is `conv` (one record per conversation) or
`t{i}` (one record per assistant turn, i = the turn's message index). They depend only on the run, the
conversation's content and the turn, so a resumed run plans the same ids and the collector (which
stores an id once) never holds a sample twice. They satisfy capture_format's record id rule: the run id
is checked, the sample key is hex, the separators are ':'.

Two ways to capture. Two passes (`as-is` always, `regenerate --two-pass`): a capture request sends the
whole sequence as `input_ids`, asks for `max_new_tokens` 0 (SGLang 0.5.23 runs the prefill and
generates nothing; 1 works everywhere), and carries a fresh `cache_salt` so the radix cache cannot
skip part of the prefill, and the capture tag. One pass (`regenerate`, the default): the request that
generates a turn carries a capture tag in "generate" mode (`tag_generation`), and the plugin records
the turn as it is generated; its record is the same sequence, with no state for its last token.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from capture_format.records import check_record_id
from capture_format.tag import CaptureTag
from client.conversations import Conversation
from client.regenerate import (
    Generate,
    SamplingConfig,
    conversation_sequence,
    earlier_turn_spans,
    regenerate_turns,
    turns_to_generate,
)
from client.spans import ChatTokenizer, SpanError, TokenizedSequence

__all__ = ["MODES", "RECORDS_PER", "PlannedRecord", "build_sequences", "capture_payload", "check_run_id",
           "plan_records"]

MODES = ("as-is", "regenerate")
RECORDS_PER = ("conversation", "turn")
MAX_RUN_ID_CHARS = 40


def check_run_id(run_id: str) -> str:
    """A run id that keeps every record id valid; raises ValueError saying what is accepted."""
    if len(run_id) > MAX_RUN_ID_CHARS or ":" in run_id:
        raise ValueError(f"run id {run_id!r}: at most {MAX_RUN_ID_CHARS} characters of [A-Za-z0-9._-], "
                         "starting with a letter or digit")
    check_record_id(run_id)
    return run_id


@dataclasses.dataclass(frozen=True, slots=True)
class PlannedRecord:
    """A record a conversation will produce."""

    record_id: str
    turn: int | None
    """Message index of the assistant turn it captures alone; None for the whole conversation."""


def plan_records(conversation: Conversation, *, run_id: str, mode: str, records_per: str) -> list[PlannedRecord]:
    """The records of `conversation`; empty when it has nothing to capture in this mode."""
    if mode == "regenerate":
        _, turns = turns_to_generate(conversation.messages)
    else:
        turns = [index for index, message in enumerate(conversation.messages) if message["role"] == "assistant"]
    if not turns:
        return []
    if records_per == "conversation":
        return [PlannedRecord(f"{run_id}:{conversation.key}:conv", None)]
    return [PlannedRecord(f"{run_id}:{conversation.key}:t{turn}", turn) for turn in turns]


def _as_is(chat: ChatTokenizer, messages: Sequence[dict[str, str]], planned: Sequence[PlannedRecord]):
    sequences = {}
    for record in planned:
        if record.turn is None:
            sequences[record.record_id] = chat.tokenize_conversation(messages)
        else:
            sequences[record.record_id] = chat.tokenize_turn(messages, record.turn)
    return sequences


def _placeholder_answers(messages: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    """`messages` with every empty assistant turn given some text: enough to check the template's prefix property."""
    messages, _ = turns_to_generate(messages)
    return [{**message, "content": message["content"] or "ok"} if message["role"] == "assistant" else message
            for message in messages]


TagGeneration = Callable[[PlannedRecord, tuple[tuple[int, int], ...], tuple[int, ...], tuple[int, ...]],
                         "dict[str, Any] | None"]
"""(record, loss spans given, turns those spans and the generated one belong to, prompt ids) -> the
custom_params of the request that generates the record's last turn, or None to leave it untagged."""


async def build_sequences(chat: ChatTokenizer, conversation: Conversation, planned: Sequence[PlannedRecord], *,
                          mode: str, generate: Generate, sampling: SamplingConfig,
                          tag_generation: TagGeneration | None = None
                          ) -> tuple[dict[str, TokenizedSequence], dict[int, str]]:
    """record id -> sequence for every planned record, and each regenerated turn's finish reason.

    With `tag_generation` (regenerate mode), the request generating each record's last turn carries the
    tag it returns: the record is captured in that one pass.
    Raises `SpanError` when the template cannot give a trustworthy mask, and whatever `generate` raises.
    """
    if mode == "as-is":
        return _as_is(chat, conversation.messages, planned), {}
    whole = planned[0].turn is None
    if whole:  # fail before spending generations on a conversation the template cannot mask
        chat.tokenize_conversation(_placeholder_answers(conversation.messages))
    _, turn_indices = turns_to_generate(conversation.messages)
    by_turn = {record.turn: record for record in planned}

    def tag_turn(index: int, prompt_ids: tuple[int, ...], messages: Sequence[dict[str, str]]):
        if tag_generation is None:
            return None
        if not whole:
            record = by_turn.get(index)
            return tag_generation(record, (), (index,), prompt_ids) if record is not None else None
        if index != turn_indices[-1]:
            return None
        spans, span_turns = earlier_turn_spans(chat, messages, turn_indices[:-1], index, prompt_ids)
        return tag_generation(planned[0], tuple(spans), (*span_turns, index), prompt_ids)

    messages, turns = await regenerate_turns(chat, conversation.messages, generate, sampling, tag_turn)
    finish_reasons = {turn.index: turn.finish_reason for turn in turns}
    if whole:
        return {planned[0].record_id: conversation_sequence(chat, messages, turns)}, finish_reasons
    by_index = {turn.index: turn.sequence() for turn in turns}
    return {record.record_id: by_index[record.turn] for record in planned}, finish_reasons


def capture_payload(sequence: TokenizedSequence, *, record_id: str, sample_id: str, metadata: dict[str, Any],
                    max_new_tokens: int) -> dict[str, Any]:
    """The /generate body that captures `sequence` as record `record_id`."""
    if not sequence.spans:
        raise SpanError("no assistant tokens")  # never send an unmasked record
    tag = CaptureTag(record_id=record_id, sample_id=sample_id, loss_spans=sequence.spans, metadata=metadata)
    return {
        "input_ids": list(sequence.input_ids),  # one placeholder per image: SGLang expands it
        **({"image_data": list(sequence.images)} if sequence.images else {}),
        "cache_salt": uuid.uuid4().hex,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                            "custom_params": tag.to_custom_params()},
    }
