"""Capture layers and SGLang's aux-hidden-state layer ids: the one translation, both directions.

A *capture layer* `c` is the 0-based index of a decoder layer whose INPUT residual stream (hidden +
residual, i.e. the output of layer `c - 1`) is captured. That is what every record stores.

SGLang names the same states with *layer ids* (`--return-aux-hidden-state-layer-ids` when capturing,
`eagle_aux_hidden_state_layer_ids` in a draft's config when serving). Each model class turns ids into
the loop indices it captures at (`layers_to_capture`, the input of that layer) in its
`set_eagle3_layers_to_capture`, and the classes disagree (read from sglang 0.5.23):

- `shift-always` (Llama, Qwen2/3, ...): layers_to_capture = [id + 1 for id in ids].
- `shift-if-first-is-one` (DeepSeek-V2/V3, Kimi-K2.5, GLM-4-MoE-Lite): ids + 1 only when ids[0] == 1,
  else ids as given. Capture layer 1 as the first one is unreachable there.

What must hold: `capture_layers_from_sglang_ids(arch, capture_layers_to_sglang_ids(arch, c, L), L) == c`
for every valid `c`, and SGLang given those ids captures exactly the inputs of layers `c`.
"""

from __future__ import annotations

from collections.abc import Sequence

from capture_format.errors import CaptureFormatError

SHIFT_ALWAYS = "shift-always"
SHIFT_IF_FIRST_IS_ONE = "shift-if-first-is-one"

# Architecture (HF `architectures[0]`) -> how its SGLang class maps layer ids to captured layer inputs.
LAYER_ID_CONVENTIONS: dict[str, str] = {
    "LlamaForCausalLM": SHIFT_ALWAYS,
    "Phi3ForCausalLM": SHIFT_ALWAYS,
    "InternLM3ForCausalLM": SHIFT_ALWAYS,
    "Qwen2ForCausalLM": SHIFT_ALWAYS,
    "Qwen3ForCausalLM": SHIFT_ALWAYS,
    "Qwen2MoeForCausalLM": SHIFT_ALWAYS,
    "Qwen3MoeForCausalLM": SHIFT_ALWAYS,
    "Glm4MoeForCausalLM": SHIFT_ALWAYS,
    "DeepseekV2ForCausalLM": SHIFT_IF_FIRST_IS_ONE,
    "DeepseekV3ForCausalLM": SHIFT_IF_FIRST_IS_ONE,
    "DeepseekV32ForCausalLM": SHIFT_IF_FIRST_IS_ONE,
    "KimiK25ForConditionalGeneration": SHIFT_IF_FIRST_IS_ONE,
    "Glm4MoeLiteForCausalLM": SHIFT_IF_FIRST_IS_ONE,
}


class LayerConfigError(CaptureFormatError):
    """Capture layers or layer ids that are invalid for the model, or an architecture with no known rule."""


def default_capture_layers(num_layers: int) -> list[int]:
    """`[3, L//2 + 1, L - 2]`: 3/31/59 for the 61-layer DeepSeek-V3 / Kimi-K2 family, 3/5/6 for 8 layers."""
    layers = [3, num_layers // 2 + 1, num_layers - 2]
    if not all(a < b for a, b in zip(layers, layers[1:])):
        raise LayerConfigError(
            f"the default capture layers {layers} are not distinct for a {num_layers}-layer model; "
            "name the capture layers explicitly"
        )
    return layers


def validate_capture_layers(capture_layers: Sequence[int], num_layers: int) -> list[int]:
    """Check capture layers against a model: strictly increasing, each an input of a real layer."""
    layers = [int(layer) for layer in capture_layers]
    if not layers:
        raise LayerConfigError("capture layers must not be empty")
    if any(b <= a for a, b in zip(layers, layers[1:])):
        raise LayerConfigError(f"capture layers must be strictly increasing, got {layers}")
    # The input of layer 0 is the embedding; the last layer's output is the final state, captured apart.
    if layers[0] < 1 or layers[-1] > num_layers - 1:
        raise LayerConfigError(
            f"capture layers {layers} are out of range for a {num_layers}-layer model: each must be the input "
            f"of a decoder layer after the first, 1..{num_layers - 1}"
        )
    return layers


def _convention(architecture: str) -> str:
    try:
        return LAYER_ID_CONVENTIONS[architecture]
    except KeyError:
        raise LayerConfigError(
            f"no known SGLang layer-id rule for architecture {architecture!r}; known: "
            f"{', '.join(sorted(LAYER_ID_CONVENTIONS))}"
        ) from None


def capture_layers_to_sglang_ids(architecture: str, capture_layers: Sequence[int], num_layers: int) -> list[int]:
    """SGLang layer ids that make `architecture` capture the inputs of `capture_layers`."""
    layers = validate_capture_layers(capture_layers, num_layers)
    if _convention(architecture) == SHIFT_ALWAYS:
        return [layer - 1 for layer in layers]
    if layers[0] == 1:
        raise LayerConfigError(
            f"{architecture} cannot capture layer 1 as its first capture layer: SGLang shifts its ids only when the "
            "first id is 1, which makes the input of layer 1 unreachable; pick layers starting at 2 or later"
        )
    return layers


def capture_layers_from_sglang_ids(architecture: str, sglang_ids: Sequence[int], num_layers: int) -> list[int]:
    """The capture layers `architecture` records when given SGLang layer ids `sglang_ids`."""
    ids = [int(layer_id) for layer_id in sglang_ids]
    if not ids:
        raise LayerConfigError("SGLang layer ids must not be empty")
    shifted = _convention(architecture) == SHIFT_ALWAYS or ids[0] == 1
    return validate_capture_layers([layer_id + 1 for layer_id in ids] if shifted else ids, num_layers)
