"""Regenerate a conversation's assistant turns with the target, so the draft learns the target's own answers.

For each assistant turn in order (and for a final user message with no answer, which makes prompt-only
datasets usable), the conversation so far is rendered with the generation prompt and sent to
/generate with the run's sampling settings. What is kept:
- the generated token ids, verbatim, including the stop token that ended the turn: the newest turn of
  every captured sequence is exactly what the target produced, never a decode/re-encode round trip;
- the decoded text replaces the turn's content for the later turns' history, which is what a chat
  server does too: the target sees earlier turns re-rendered by its chat template.
So with one record per turn every record is prompt ids + generated ids. With one record per
conversation the earlier turns are the template's rendering of their generated text (checked to be a
prefix of the last prompt, see spans.py) and the last turn is verbatim.

One pass: `tag_turn(index, prompt_ids, messages)` may return the `custom_params` of a capture tag in
"generate" mode for a turn's request; the plugin then records that request as it is generated
(prompt + generated ids, the same sequence a second, prefill-only request would send) and no second
request is needed. The loss spans it was given (earlier turns) are kept; the generated ids are added.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from capture_format.tag import TAG_KEY
from client.spans import ChatTokenizer, SpanError, TokenizedSequence

__all__ = ["RegeneratedTurn", "SamplingConfig", "conversation_sequence", "earlier_turn_spans", "regenerate_turns",
           "turns_to_generate"]

Generate = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
OPT_OUT = {TAG_KEY: {"opt_out": True}}
TagTurn = Callable[[int, tuple[int, ...], Sequence[dict[str, str]]], "dict[str, Any] | None"]


@dataclasses.dataclass(kw_only=True, slots=True)
class SamplingConfig:
    """Sampling settings of the regeneration requests."""

    temperature: float = 0.7
    """Sampling temperature; 0 is greedy."""
    top_p: float = 0.95
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k cut; -1 keeps all tokens."""
    max_new_tokens: int = 1024
    """Longest regenerated turn; a turn cut by this limit has no end-of-turn token."""


@dataclasses.dataclass(frozen=True, slots=True)
class RegeneratedTurn:
    """One assistant turn as the target produced it."""

    index: int
    """Index of the assistant message in the conversation."""
    prompt_ids: tuple[int, ...]
    generated_ids: tuple[int, ...]
    finish_reason: str
    """SGLang's finish reason type: `stop` (ended with a stop token) or `length` (cut by max_new_tokens)."""
    images: tuple[str, ...] = ()
    """The images of the prompt, in order (sent as `image_data`; the prompt holds one placeholder each)."""

    def sequence(self) -> TokenizedSequence:
        """prompt + generated ids, with the generated ids as the span."""
        start = len(self.prompt_ids)
        ids = self.prompt_ids + self.generated_ids
        return TokenizedSequence(ids, ((start, len(ids)),), (self.index,), self.images)


def turns_to_generate(messages: Sequence[dict[str, str]]) -> tuple[list[dict[str, str]], list[int]]:
    """Messages with an empty assistant turn appended after a final user message, and the turns to generate."""
    messages = [dict(message) for message in messages]
    if messages and messages[-1]["role"] == "user":
        messages.append({"role": "assistant", "content": ""})
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()  # trailing system messages: nothing to answer
    return messages, [index for index, message in enumerate(messages) if message["role"] == "assistant"]


def _sampling_params(config: SamplingConfig, stop_token_ids: frozenset[int]) -> dict[str, Any]:
    return {
        "temperature": config.temperature,
        "top_p": config.top_p,
        "top_k": config.top_k,
        "max_new_tokens": config.max_new_tokens,
        "stop_token_ids": sorted(stop_token_ids),
    }


async def regenerate_turns(chat: ChatTokenizer, messages: Sequence[dict[str, str]], generate: Generate,
                           config: SamplingConfig, tag_turn: TagTurn | None = None
                           ) -> tuple[list[dict[str, str]], list[RegeneratedTurn]]:
    """Generates every assistant turn in order; returns the new messages and each turn as generated."""
    messages, turns = turns_to_generate(messages)
    if not turns:
        raise SpanError("nothing to regenerate: no assistant turn and no final user message")
    regenerated = []
    for index in turns:
        prompt_ids = chat.render_ids(messages[:index], add_generation_prompt=True)
        images = tuple(image for message in messages[:index] for image in message.get("images", ()))
        sampling_params = _sampling_params(config, chat.stop_token_ids)
        custom_params = tag_turn(index, tuple(prompt_ids), messages) if tag_turn is not None else None
        # A turn not captured by this request opts out of the server's live sampling: fire decides what
        # it captures, and a turn generated only as history must not come back as a live record.
        sampling_params["custom_params"] = custom_params if custom_params is not None else OPT_OUT
        answer = await generate({"input_ids": prompt_ids, **({"image_data": list(images)} if images else {}),
                                 "sampling_params": sampling_params})
        generated_ids = tuple(int(token) for token in answer["output_ids"])
        if not generated_ids:
            raise SpanError(f"the target generated nothing for message {index}")
        finish = answer["meta_info"].get("finish_reason") or {}
        regenerated.append(RegeneratedTurn(index=index, prompt_ids=tuple(prompt_ids), generated_ids=generated_ids,
                                           finish_reason=str(finish.get("type", "unknown")), images=images))
        text_ids = generated_ids[:-1] if generated_ids[-1] in chat.stop_token_ids else generated_ids
        messages[index] = {"role": "assistant", "content": chat.decode(text_ids)}  # reasoning is inline now
    return messages, regenerated


def earlier_turn_spans(chat: ChatTokenizer, messages: Sequence[dict[str, str]], earlier_turns: Sequence[int],
                       last_index: int, last_prompt_ids: Sequence[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """Spans (and their turn indices) of earlier assistant turns as the template renders them into the last prompt."""
    spans, span_turns = [], []
    for index in earlier_turns:
        span = chat.assistant_span(messages[:last_index], index, last_prompt_ids)
        if span is not None:
            spans.append(span)
            span_turns.append(index)
    return spans, span_turns


def conversation_sequence(chat: ChatTokenizer, messages: Sequence[dict[str, str]],
                          regenerated: Sequence[RegeneratedTurn]) -> TokenizedSequence:
    """The whole regenerated conversation as one sequence: the last prompt + the last turn's ids verbatim."""
    last = regenerated[-1]
    ids = last.prompt_ids + last.generated_ids
    spans, span_turns = earlier_turn_spans(chat, messages, [turn.index for turn in regenerated[:-1]], last.index,
                                           last.prompt_ids)
    spans.append((len(last.prompt_ids), len(ids)))
    span_turns.append(last.index)
    return TokenizedSequence(ids, tuple(spans), tuple(span_turns), last.images)
