"""Loss-mask spans from chat templates: the tiny model's, Llama-3, ChatML/Qwen3 with thinking, DeepSeek-V3, Kimi-K2.

Oracle: the text itself. For a hand-made conversation, the tokens inside each span must decode to
exactly that assistant message's text plus the template's end-of-turn marker, the tokens just before
it must decode to the template's assistant header, and with the mask shifted as the trainer shifts it
(mask[t + 1] weights the prediction of token t + 1 from position t) the predicted tokens are exactly the
span tokens. The templates are written here, modeled on the real ones, and run with the tiny model's
byte-level tokenizer (which tokenizes any text), with each template's markers added as special tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from client.spans import ChatTokenizer, SpanError

LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"""

# Like Qwen3's: reasoning is kept only for assistant turns after the last user message.
QWEN3_TEMPLATE = r"""{%- set ns = namespace(last_query_index=-1) %}
{%- for message in messages %}
{%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'system' or message.role == 'user' %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content %}
{%- set reasoning_content = '' %}
{%- if '</think>' in content %}
{%- set reasoning_content = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query_index and reasoning_content %}
{{- '<|im_start|>assistant\n<think>\n' + reasoning_content + '\n</think>\n\n' + content + '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

DEEPSEEK_V3_TEMPLATE = r"""{{- bos_token }}
{%- set ns = namespace(system_prompt='') %}
{%- for message in messages %}
{%- if message['role'] == 'system' %}{%- set ns.system_prompt = message['content'] %}{%- endif %}
{%- endfor %}
{{- ns.system_prompt }}
{%- for message in messages %}
{%- if message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] }}
{%- elif message['role'] == 'assistant' %}{{- '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}"""

KIMI_K2_TEMPLATE = r"""{%- if messages|length == 0 or messages[0]['role'] != 'system' %}
{{- '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' %}{{- '<|im_system|>system<|im_middle|>' + message['content'] + '<|im_end|>' }}
{%- elif message['role'] == 'user' %}{{- '<|im_user|>user<|im_middle|>' + message['content'] + '<|im_end|>' }}
{%- else %}{{- '<|im_assistant|>assistant<|im_middle|>' + message['content'] + '<|im_end|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}"""

# DeepSeek-R1 style: strips the reasoning from every assistant message, but opens a <think> block in the prompt.
DEEPSEEK_R1_TEMPLATE = r"""{{- bos_token }}
{%- for message in messages %}
{%- if message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] }}
{%- elif message['role'] == 'assistant' %}
{%- set content = message['content'] %}
{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}{%- endif %}
{{- '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<｜Assistant｜><think>\n' }}{%- endif %}"""

# name -> (template or None for the tiny model's own, special tokens to add, assistant header, end-of-turn marker)
TEMPLATES = {
    "tiny": (None, [], "<|assistant|>", "<|eos|>"),
    "llama3": (LLAMA3_TEMPLATE, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "qwen3": (QWEN3_TEMPLATE, ["<|im_start|>", "<|im_end|>"], "<|im_start|>assistant\n", "<|im_end|>"),
    "deepseek_v3": (DEEPSEEK_V3_TEMPLATE, ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
                    "<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
    "kimi_k2": (KIMI_K2_TEMPLATE, ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"],
                "<|im_assistant|>assistant<|im_middle|>", "<|im_end|>"),
}

SYSTEM = {"role": "system", "content": "You answer questions about Python's standard library."}
SINGLE_TURN = [
    SYSTEM,
    {"role": "user", "content": "What does `os.path.join` do?"},
    {"role": "assistant", "content": "It joins path parts with the separator of the platform."},
]
MULTI_TURN = [
    SYSTEM,
    {"role": "user", "content": "How do I read a file?"},
    {"role": "assistant", "content": "Call `open(path).read()`."},
    {"role": "user", "content": "And write one?"},
    {"role": "assistant", "content": "Open it with mode 'w', then call write().\nClose it after."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome."},
]


# Llama-3's pre-tokenizer keeps a run of newlines whole ("\n\n" before "It" stays one piece); the tiny
# tokenizer's GPT-2 rule splits "\n\nIt" as "\n" "\n" "It", which would break the prefix property at the
# header every Llama-3 turn ends with. The Llama-3 case uses Llama-3's rule, as its real tokenizer does.
LLAMA3_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                        r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def use_llama3_pre_tokenizer(tokenizer) -> None:
    from tokenizers import Regex, pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def make_chat(tiny_model_dir, name: str, *, add_markers: bool = True, pre_tokenizer: str = "model") -> ChatTokenizer:
    from transformers import AutoTokenizer

    template, markers, _, end_of_turn = TEMPLATES[name]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    if name == "llama3" and pre_tokenizer == "model":
        use_llama3_pre_tokenizer(tokenizer)
    if template is not None:
        tokenizer.chat_template = template
    if markers and add_markers:
        tokenizer.add_tokens(markers, special_tokens=True)
    stop_ids = {tokenizer.eos_token_id}
    if add_markers:
        stop_ids.add(tokenizer.convert_tokens_to_ids(end_of_turn))
    return ChatTokenizer(tokenizer, stop_ids)


def check_spans_hold_exactly_the_answers(chat: ChatTokenizer, name: str, messages, sequence, turns) -> None:
    _, _, header, end_of_turn = TEMPLATES[name]
    ids = list(sequence.input_ids)
    assert list(sequence.turns) == turns
    for (start, end), turn in zip(sequence.spans, turns):
        assert chat.decode(ids[start:end]) == messages[turn]["content"] + end_of_turn
        assert chat.decode(ids[:start]).endswith(header), "the span must start right after the assistant header"
    # As the trainer reads it: the prediction made at position t is for token t + 1, weighted by mask[t + 1].
    mask = np.zeros(len(ids), dtype=bool)
    for start, end in sequence.spans:
        mask[start:end] = True
    targets = np.asarray(ids[1:])[mask[1:]]
    assert targets.tolist() == sequence.loss_token_ids()
    assert chat.decode(targets.tolist()) == "".join(messages[turn]["content"] + end_of_turn for turn in turns)
    assert not mask.all() and mask.sum() == sequence.num_loss_tokens


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("messages", [SINGLE_TURN, MULTI_TURN, SINGLE_TURN[1:]], ids=["system", "multi_turn", "plain"])
def test_spans_decode_exactly_to_the_assistant_turns(tiny_model_dir, name, messages):
    chat = make_chat(tiny_model_dir, name)
    turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    sequence = chat.tokenize_conversation(messages)
    assert list(sequence.input_ids) == chat.render_ids(messages, add_generation_prompt=False)[: len(sequence.input_ids)]
    check_spans_hold_exactly_the_answers(chat, name, messages, sequence, turns)
    for turn in turns:  # one record per turn: the conversation through that turn, a span on it alone
        check_spans_hold_exactly_the_answers(chat, name, messages, chat.tokenize_turn(messages, turn), [turn])


def test_template_text_after_the_end_of_turn_token_is_not_in_the_span(tiny_model_dir):
    chat = make_chat(tiny_model_dir, "qwen3")
    sequence = chat.tokenize_conversation(SINGLE_TURN)
    full_text = chat.decode(chat.render_ids(SINGLE_TURN, add_generation_prompt=False))
    assert full_text.endswith("<|im_end|>\n")  # ChatML's newline: the target never generates it
    start, end = sequence.spans[-1]
    assert end == len(sequence.input_ids) - 1 and chat.decode(sequence.input_ids[end:]) == "\n"


def test_trailing_user_turn_is_dropped_and_empty_answer_keeps_its_end_of_turn(tiny_model_dir):
    chat = make_chat(tiny_model_dir, "llama3")
    messages = [*SINGLE_TURN[:2], {"role": "assistant", "content": ""}, {"role": "user", "content": "Hello?"}]
    sequence = chat.tokenize_conversation(messages)
    assert chat.decode(sequence.input_ids[slice(*sequence.spans[0])]) == "<|eot_id|>"
    assert not chat.decode(sequence.input_ids).endswith("Hello?<|eot_id|>")


def test_qwen3_thinking_single_turn_keeps_the_reasoning_in_the_span(tiny_model_dir):
    chat = make_chat(tiny_model_dir, "qwen3")
    answer = "<think>\nThe user asks about join.\n</think>\n\nIt joins path parts."
    messages = [SINGLE_TURN[1], {"role": "assistant", "content": answer}]
    sequence = chat.tokenize_conversation(messages)
    check_spans_hold_exactly_the_answers(chat, "qwen3", messages, sequence, [1])


def test_qwen3_thinking_multi_turn_fails_as_one_record_and_works_per_turn(tiny_model_dir):
    chat = make_chat(tiny_model_dir, "qwen3")
    messages = [
        {"role": "user", "content": "Pick a number."},
        {"role": "assistant", "content": "<think>\nAny number will do.\n</think>\n\nSeven."},
        {"role": "user", "content": "Double it."},
        {"role": "assistant", "content": "<think>\n7 * 2 = 14.\n</think>\n\nFourteen."},
    ]
    # The template drops the first turn's reasoning once a later user message exists: no single sequence
    # holds both turns as the target generated them, so the conversation must fail, not get a guessed mask.
    with pytest.raises(SpanError, match="message 1.*rewrites earlier turns"):
        chat.tokenize_conversation(messages)
    for turn in (1, 3):
        check_spans_hold_exactly_the_answers(chat, "qwen3", messages, chat.tokenize_turn(messages, turn), [turn])
    history = chat.decode(chat.tokenize_turn(messages, 3).input_ids)
    assert "Any number will do." not in history  # the rewritten history, as the target sees it at turn 3


def test_a_template_that_strips_what_its_prompt_opens_fails_with_a_reason(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = DEEPSEEK_R1_TEMPLATE
    tokenizer.add_tokens(["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"], special_tokens=True)
    chat = ChatTokenizer(tokenizer, {tokenizer.convert_tokens_to_ids("<｜end▁of▁sentence｜>")})
    messages = [SINGLE_TURN[1], {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nIt joins paths."}]
    with pytest.raises(SpanError, match="generation prompt before message 1"):
        chat.tokenize_conversation(messages)


def test_no_assistant_turn_is_an_error_never_an_all_ones_mask(tiny_model_dir):
    chat = make_chat(tiny_model_dir, "tiny")
    with pytest.raises(SpanError, match="no assistant"):
        chat.tokenize_conversation(SINGLE_TURN[:2])
    empty = [SINGLE_TURN[1], {"role": "assistant", "content": ""}]
    sequence = chat.tokenize_conversation(empty)  # the end-of-turn token alone is still something to learn
    assert chat.decode(sequence.input_ids[slice(*sequence.spans[0])]) == "<|eos|>"


def test_a_template_error_is_a_span_error(tiny_model_dir):
    chat = make_chat(tiny_model_dir, "tiny")
    with pytest.raises(SpanError, match="chat template failed"):
        chat.tokenize_conversation([{"role": "tool", "content": "{}"}, {"role": "assistant", "content": "ok"}])


def test_a_tokenizer_that_merges_across_the_header_boundary_fails_with_that_reason(tiny_model_dir):
    chat = make_chat(tiny_model_dir, "llama3", pre_tokenizer="tiny")  # "\n\n" + "It" re-splits as "\n" "\n" "It"
    with pytest.raises(SpanError, match="generation prompt before message 2.*merges tokens across that boundary"):
        chat.tokenize_conversation(SINGLE_TURN)


def test_markers_that_are_plain_text_still_give_exact_spans(tiny_model_dir):
    chat = make_chat(tiny_model_dir, "kimi_k2", add_markers=False)  # markers split into byte-level pieces
    assert chat.stop_token_ids == {chat.tokenizer.eos_token_id}  # no end-of-turn token to cut at
    sequence = chat.tokenize_conversation(MULTI_TURN)
    for (start, end), turn in zip(sequence.spans, sequence.turns):  # a span runs to where the turn's render ends
        assert chat.decode(sequence.input_ids[start:end]) == MULTI_TURN[turn]["content"] + "<|im_end|>"
