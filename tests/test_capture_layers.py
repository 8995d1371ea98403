"""The one translation between capture layers and SGLang layer ids, table-tested both ways."""

import pytest

from capture_format.layers import (
    LayerConfigError,
    capture_layers_from_sglang_ids,
    capture_layers_to_sglang_ids,
    default_capture_layers,
)


@pytest.mark.parametrize("num_layers, expected", [(61, [3, 31, 59]), (8, [3, 5, 6]), (32, [3, 17, 30])])
def test_default_capture_layers(num_layers, expected):
    assert default_capture_layers(num_layers) == expected


def test_default_capture_layers_refuses_a_model_too_small_to_keep_them_distinct():
    with pytest.raises(LayerConfigError, match="not distinct"):
        default_capture_layers(5)


# (architecture, num_layers, capture layers, SGLang ids)
KNOWN_ANSWERS = [
    ("LlamaForCausalLM", 8, [3, 5, 6], [2, 4, 5]),
    ("LlamaForCausalLM", 32, [3, 17, 30], [2, 16, 29]),
    ("LlamaForCausalLM", 8, [1, 7], [0, 6]),
    ("Qwen3ForCausalLM", 36, [2, 18, 33], [1, 17, 32]),
    ("DeepseekV3ForCausalLM", 61, [3, 31, 59], [3, 31, 59]),
    ("KimiK25ForConditionalGeneration", 61, [3, 31, 59], [3, 31, 59]),
    ("DeepseekV3ForCausalLM", 61, [2, 30, 59], [2, 30, 59]),
    ("DeepseekV2ForCausalLM", 27, [4, 14, 25], [4, 14, 25]),
]


@pytest.mark.parametrize("architecture, num_layers, capture_layers, sglang_ids", KNOWN_ANSWERS)
def test_translation_both_ways(architecture, num_layers, capture_layers, sglang_ids):
    assert capture_layers_to_sglang_ids(architecture, capture_layers, num_layers) == sglang_ids
    assert capture_layers_from_sglang_ids(architecture, sglang_ids, num_layers) == capture_layers


def test_deepseek_ids_starting_at_one_are_read_as_shifted():
    # SGLang's DeepseekV2 class captures layers [2, 31, 60] for ids [1, 30, 59].
    assert capture_layers_from_sglang_ids("DeepseekV3ForCausalLM", [1, 30, 59], 61) == [2, 31, 60]


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "DeepseekV3ForCausalLM"])
@pytest.mark.parametrize("num_layers", [8, 27, 61])
def test_round_trip_for_every_valid_pair_of_layers(architecture, num_layers):
    for first in range(1, num_layers):
        for second in range(first + 1, num_layers):
            layers = [first, second]
            try:
                ids = capture_layers_to_sglang_ids(architecture, layers, num_layers)
            except LayerConfigError:
                assert architecture == "DeepseekV3ForCausalLM" and first == 1
                continue
            assert capture_layers_from_sglang_ids(architecture, ids, num_layers) == layers


@pytest.mark.parametrize("capture_layers, message", [
    ([], "must not be empty"),
    ([5, 3], "strictly increasing"),
    ([3, 3], "strictly increasing"),
    ([0, 3], "out of range"),
    ([3, 8], "out of range"),
])
def test_invalid_capture_layers_are_refused(capture_layers, message):
    with pytest.raises(LayerConfigError, match=message):
        capture_layers_to_sglang_ids("LlamaForCausalLM", capture_layers, 8)


def test_deepseek_cannot_start_at_layer_one():
    with pytest.raises(LayerConfigError, match="layer 1"):
        capture_layers_to_sglang_ids("DeepseekV3ForCausalLM", [1, 30, 59], 61)


def test_unknown_architecture_names_the_known_ones():
    with pytest.raises(LayerConfigError, match="MistralForCausalLM.*known: .*LlamaForCausalLM"):
        capture_layers_to_sglang_ids("MistralForCausalLM", [3, 5], 8)
