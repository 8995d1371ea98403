"""Conversations with images: OpenAI `image_url` parts read into data URLs, rendered with the target's image
placeholder once per image, and sent with `image_data`; spans count each image as that one token."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from client.conversations import IMAGE_MARK, BadRow, messages_from_row, read_conversations
from client.samples import capture_payload
from client.spans import ChatTokenizer, SpanError, image_placeholder
from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR
from eagle_tap.testbed.tiny_model.random import MEDIA_PLACEHOLDER, MEDIA_PLACEHOLDER_ID

IMAGES = Path(__file__).parent / "fixtures" / "images"
NOISE = IMAGES / "noise-56x70.png"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def kimi_chat(tmp_path: Path) -> ChatTokenizer:
    """The tiny Llama's tokenizer with Kimi-K2.5's placeholder added, as the tiny Kimi-K2.5 target has it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    tokenizer.add_special_tokens({"additional_special_tokens": [MEDIA_PLACEHOLDER]})
    assert tokenizer.convert_tokens_to_ids(MEDIA_PLACEHOLDER) == MEDIA_PLACEHOLDER_ID
    return ChatTokenizer(tokenizer, [tokenizer.eos_token_id], image=image_placeholder(tokenizer))


def test_image_parts_become_marks_and_data_urls_read_relative_to_the_data_file(tmp_path):
    data = tmp_path / "data.jsonl"
    (tmp_path / "pictures").mkdir()
    (tmp_path / "pictures" / "a.png").write_bytes(NOISE.read_bytes())
    row = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is "}, image_part("pictures/a.png"),
                                     {"type": "text", "text": " and "}, image_part("data:image/png;base64,AAAA")]},
        {"role": "assistant", "content": "two images"}]}
    data.write_text(json.dumps(row) + "\n")
    (conversation,) = read_conversations(data)
    user = conversation.messages[0]
    assert user["content"] == f"what is {IMAGE_MARK} and {IMAGE_MARK}"
    assert user["images"][0] == "data:image/png;base64," + base64.b64encode(NOISE.read_bytes()).decode()
    assert user["images"][1] == "data:image/png;base64,AAAA" and "images" not in conversation.messages[1]


@pytest.mark.parametrize("content, message", [
    ([image_part("missing.png")], "cannot read image 'missing.png'"),
    ([image_part("notes.txt")], "is not a data URL, an http(s) URL or an image file"),
    ([{"type": "image_url", "image_url": {}}], "an image_url part needs"),
    ([{"type": "text", "text": f"a {IMAGE_MARK}"}], "which marks images here"),
    ([{"type": "input_audio"}], "only text and image_url content parts"),
])
def test_bad_image_parts_are_bad_rows_that_name_the_problem(tmp_path, content, message):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": content},
                                             {"role": "assistant", "content": "x"}]}) + "\n")
    (row,) = read_conversations(data)
    assert isinstance(row, BadRow) and message in row.reason


def test_an_assistant_message_takes_no_image():
    row = {"messages": [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": [image_part("data:image/png;base64,AAAA")]}]}
    with pytest.raises(ValueError, match="only text content parts are supported here"):
        messages_from_row(row)


def test_the_prompt_holds_one_placeholder_per_image_and_the_payload_sends_the_images(tmp_path):
    chat = kimi_chat(tmp_path)
    first, second = "data:image/png;base64,AAAA", "data:image/png;base64,BBBB"
    messages = [{"role": "user", "content": f"look {IMAGE_MARK} here", "images": [first]},
                {"role": "assistant", "content": "a cat"},
                {"role": "user", "content": f"and {IMAGE_MARK}", "images": [second]},
                {"role": "assistant", "content": "a dog"}]
    sequence = chat.tokenize_conversation(messages)
    assert sequence.input_ids.count(MEDIA_PLACEHOLDER_ID) == 2 and sequence.images == (first, second)
    text = [{key: value for key, value in message.items() if key != "images"} for message in messages]
    for message in text:
        message["content"] = message["content"].replace(IMAGE_MARK, MEDIA_PLACEHOLDER)
    assert list(sequence.input_ids) == chat.encode(chat.tokenizer.apply_chat_template(text, tokenize=False))
    for (start, end), answer in zip(sequence.spans, ("a cat", "a dog")):
        assert chat.decode(sequence.input_ids[start:end]).startswith(answer)
    payload = capture_payload(sequence, record_id="r", sample_id="s", metadata={}, max_new_tokens=0)
    assert payload["image_data"] == [first, second] and payload["input_ids"] == list(sequence.input_ids)
    text_only = chat.tokenize_conversation([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert "image_data" not in capture_payload(text_only, record_id="t", sample_id="t", metadata={},
                                               max_new_tokens=0)


def test_a_target_without_an_image_placeholder_refuses_an_image_conversation():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    assert image_placeholder(tokenizer) is None
    chat = ChatTokenizer(tokenizer, [tokenizer.eos_token_id])
    with pytest.raises(SpanError, match="the target's tokenizer has no image placeholder token"):
        chat.tokenize_conversation([{"role": "user", "content": IMAGE_MARK, "images": ["data:image/png;base64,A"]},
                                    {"role": "assistant", "content": "x"}])


def test_regeneration_requests_send_the_images_of_their_prompt(tmp_path):
    import asyncio

    from client.regenerate import SamplingConfig, regenerate_turns

    chat = kimi_chat(tmp_path)
    image = "data:image/png;base64,AAAA"
    messages = [{"role": "user", "content": f"look {IMAGE_MARK}", "images": [image]},
                {"role": "assistant", "content": "old answer"}, {"role": "user", "content": "and now?"}]
    sent = []

    async def generate(payload):
        sent.append(payload)
        return {"output_ids": [11, 12, chat.tokenizer.eos_token_id], "meta_info": {"finish_reason": {"type": "stop"}}}

    _, turns = asyncio.run(regenerate_turns(chat, messages, generate, SamplingConfig(temperature=0)))
    assert [payload["image_data"] for payload in sent] == [[image], [image]]  # both prompts hold the image
    assert [payload["input_ids"].count(MEDIA_PLACEHOLDER_ID) for payload in sent] == [1, 1]
    assert all(turn.sequence().images == (image,) for turn in turns)
