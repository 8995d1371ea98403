"""Loss-mask spans for any chat template, found by rendering growing prefixes of the conversation.

No template marker is hard-coded. For assistant message i:
- its span starts where `render(messages[:i], add_generation_prompt=True)` ends: the generation-prompt
  header (`<|im_start|>assistant\\n`, `<｜Assistant｜>`, ...) is context, not a target;
- it ends where `render(messages[:i+1])` ends, cut just after the first stop token in between: the
  end-of-turn token IS in the span (the draft must learn to predict it), template text after it
  (ChatML's newline) is not, since the target never generates it.

What must hold for every `TokenizedSequence` built here:
- `input_ids` is the rendered text tokenized without added special tokens (templates add their own);
- spans are half-open [start, end) over positions of the UNshifted sequence (tokens start..end-1 are
  targets); the trainer shifts at read time;
- both renders above tokenize to a prefix of the full sequence. A template that breaks this (one that
  rewrites earlier turns, e.g. drops their reasoning, or a tokenizer merge across a boundary) makes
  the conversation fail with a `SpanError` that names the message: spans are never guessed;
- a sequence without any assistant token is a `SpanError`, never an all-ones mask;
- images: the template renders the target's image placeholder where a message had an image
  (`conversations.IMAGE_MARK`), and the sequence holds it once per image, as SGLang expects ids before
  it expands each image to its features; `images` are the images in that order, and spans count each
  image as that one token (the capture plugin moves them onto the expanded ids).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from client.conversations import IMAGE_MARK

__all__ = ["IMAGE_PLACEHOLDERS", "ChatTokenizer", "SpanError", "TokenizedSequence", "image_placeholder"]

Messages = Sequence[dict[str, str]]


class SpanError(ValueError):
    """The chat template cannot give this conversation a trustworthy loss mask; the message says why."""


@dataclasses.dataclass(frozen=True, slots=True)
class TokenizedSequence:
    """A sequence to capture and its loss-mask spans."""

    input_ids: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]
    """Half-open [start, end) ranges of assistant tokens, sorted, over the unshifted sequence."""
    turns: tuple[int, ...]
    """Index (in the message list) of the assistant message each span comes from."""
    images: tuple[str, ...] = ()
    """The images of the sequence's messages, in order (URLs SGLang loads: `image_data`)."""

    @property
    def num_loss_tokens(self) -> int:
        return sum(end - start for start, end in self.spans)

    def loss_token_ids(self) -> list[int]:
        return [token for start, end in self.spans for token in self.input_ids[start:end]]


def _is_prefix(prefix: Sequence[int], full: Sequence[int]) -> bool:
    return len(prefix) <= len(full) and list(full[: len(prefix)]) == list(prefix)


IMAGE_PLACEHOLDERS = {
    "<|media_pad|>": ("<|media_start|>", "image<|media_content|>", "<|media_end|>"),  # Kimi-K2.5
    "<|image_pad|>": ("<|vision_start|>", "", "<|vision_end|>"),  # Qwen2.5-VL, Qwen3-VL
}
"""The image placeholder token of each vision target known here, and the text its template puts around it
(used where the tokenizer has the opening token: start, text after it, end)."""


def image_placeholder(tokenizer: Any) -> tuple[str, int] | None:
    """(the text an image becomes in a prompt, the placeholder's id) for a tokenizer of a known vision target."""
    vocab = tokenizer.get_vocab()
    for token, (opening, after_opening, closing) in IMAGE_PLACEHOLDERS.items():
        if token in vocab:
            wrapped = opening in vocab and closing in vocab
            return (f"{opening}{after_opening}{token}{closing}" if wrapped else token), vocab[token]
    return None


class ChatTokenizer:
    """The target's tokenizer and chat template, with the stop tokens that end an assistant turn."""

    def __init__(self, tokenizer: Any, stop_token_ids: Iterable[int], template_kwargs: dict[str, Any] | None = None,
                 image: tuple[str, int] | None = None):
        self.tokenizer = tokenizer
        self.stop_token_ids = frozenset(int(token) for token in stop_token_ids)
        self.template_kwargs = dict(template_kwargs or {})
        self.image = image
        """(the text an image becomes in a prompt, the placeholder token's id); None: the target takes no image."""
        if not self.stop_token_ids:
            raise ValueError("no stop token: the tokenizer has no eos token; pass the end-of-turn token ids")

    @classmethod
    def from_pretrained(cls, path: str | Path, *, extra_stop_token_ids: Iterable[int] = (),
                        template_kwargs: dict[str, Any] | None = None, trust_remote_code: bool = False
                        ) -> "ChatTokenizer":
        """Loads the tokenizer at `path`; stop tokens are its eos plus `generation_config.json`'s eos ids.

        trust_remote_code runs the tokenizer code shipped with the model (Kimi-K2's tokenizer is such code)."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        if not tokenizer.chat_template:
            raise ValueError(f"the tokenizer at {path} has no chat template; spans come from the chat template")
        stop_ids = set(extra_stop_token_ids)
        if tokenizer.eos_token_id is not None:
            stop_ids.add(tokenizer.eos_token_id)
        generation_config = Path(path) / "generation_config.json"
        if generation_config.is_file():
            eos = json.loads(generation_config.read_text()).get("eos_token_id")
            stop_ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return cls(tokenizer, stop_ids, template_kwargs, image_placeholder(tokenizer))

    def _for_template(self, messages: Messages) -> list[dict[str, Any]]:
        """The messages as the template takes them: the placeholder text where each image was."""
        rendered = []
        for message in messages:
            if "images" not in message:
                rendered.append(message)
                continue
            if self.image is None:
                raise SpanError("a message has an image, and the target's tokenizer has no image placeholder token "
                                f"known here ({', '.join(IMAGE_PLACEHOLDERS)})")
            rendered.append({key: value.replace(IMAGE_MARK, self.image[0]) if key == "content" else value
                             for key, value in message.items() if key != "images"})
        return rendered

    def render_text(self, messages: Messages, *, add_generation_prompt: bool) -> str:
        """`messages` through the chat template, as text (an image as the target's placeholder)."""
        messages = self._for_template(messages)
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs)
        except Exception as err:  # jinja raises anything, including the template's own raise_exception
            raise SpanError(f"the chat template failed on the first {len(messages)} messages: {err}") from None

    def render_ids(self, messages: Messages, *, add_generation_prompt: bool) -> list[int]:
        """`messages` through the chat template, tokenized as the server would see them."""
        return self.encode(self.render_text(messages, add_generation_prompt=add_generation_prompt))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def cut_after_stop(self, token_ids: Sequence[int], start: int, end: int) -> int:
        """End of the span [start, end): just after the first stop token in it, else `end`."""
        for position in range(start, end):
            if token_ids[position] in self.stop_token_ids:
                return position + 1
        return end

    def _not_a_prefix(self, what: str, prefix_text: str, full_ids: Sequence[int]) -> SpanError:
        if self.decode(full_ids).startswith(prefix_text):
            cause = ("the tokenizer merges tokens across that boundary, so the ids differ although the text "
                     "matches (the target would see different ids when generating that turn)")
        else:
            cause = ("the chat template does not render the conversation as a growing prefix: it rewrites "
                     "earlier turns (e.g. drops their reasoning; per-turn records, --records-per turn, handle "
                     "that) or strips from a turn what its generation prompt opens")
        return SpanError(f"{what} does not tokenize to a prefix of the whole sequence: {cause}")

    def assistant_span(self, messages: Messages, index: int, full_ids: Sequence[int]) -> tuple[int, int] | None:
        """The span of assistant message `index` in `full_ids`; None when it adds no token."""
        prompt_text = self.render_text(messages[:index], add_generation_prompt=True)
        through_text = self.render_text(messages[: index + 1], add_generation_prompt=False)
        prompt_ids, through_ids = self.encode(prompt_text), self.encode(through_text)
        if not _is_prefix(prompt_ids, full_ids):
            raise self._not_a_prefix(f"the generation prompt before message {index}", prompt_text, full_ids)
        if not _is_prefix(through_ids, full_ids):
            raise self._not_a_prefix(f"the conversation through message {index}", through_text, full_ids)
        if len(through_ids) < len(prompt_ids):
            raise SpanError(
                f"the chat template renders assistant message {index} without the generation prompt it adds "
                "for that turn (e.g. it strips a reasoning block the prompt opens); cannot tell what the "
                "target would generate")
        start = len(prompt_ids)
        end = self.cut_after_stop(full_ids, start, len(through_ids))
        return (start, end) if end > start else None

    def _sequence(self, messages: Messages, full_ids: Sequence[int], turns: Sequence[int]) -> TokenizedSequence:
        spans, span_turns = [], []
        for index in turns:
            span = self.assistant_span(messages, index, full_ids)
            if span is not None:
                spans.append(span)
                span_turns.append(index)
        if not spans:
            raise SpanError("no assistant tokens: the conversation has no non-empty assistant turn")
        images = tuple(image for message in messages for image in message.get("images", ()))
        num_placeholders = list(full_ids).count(self.image[1]) if images else 0
        if num_placeholders != len(images):
            raise SpanError(f"the conversation has {len(images)} images and its rendered prompt holds "
                            f"{num_placeholders} image placeholders: the template or the text changes them")
        return TokenizedSequence(tuple(full_ids), tuple(spans), tuple(span_turns), images)

    def tokenize_conversation(self, messages: Messages) -> TokenizedSequence:
        """The whole conversation (through its last assistant message) with a span per assistant message."""
        turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
        if not turns:
            raise SpanError("no assistant message")
        messages = messages[: turns[-1] + 1]  # trailing user turns have nothing to learn from
        return self._sequence(messages, self.render_ids(messages, add_generation_prompt=False), turns)

    def tokenize_turn(self, messages: Messages, index: int) -> TokenizedSequence:
        """The conversation through assistant message `index`, with a span on that message only.

        Holds for any template that renders the newest turn as it generates it, including templates
        that rewrite earlier turns: the sequence is exactly what the target sees when answering.
        """
        if messages[index]["role"] != "assistant":
            raise SpanError(f"message {index} is a {messages[index]['role']!r} message, not an assistant one")
        messages = messages[: index + 1]
        return self._sequence(messages, self.render_ids(messages, add_generation_prompt=False), [index])
