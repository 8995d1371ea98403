"""Both draft layouts of an MLA target, trained on the same records and served by SGLang's EAGLE-3 (CPU).

`eagle-tap bench --only draft-layouts` and `--only served-images` at their quick size, in fp32: on the tiny
DeepSeek-V3, and on the tiny Kimi-K2.5 (`KimiK25ForConditionalGeneration`) with half the conversations
sending an image. A capture server with the plugin and a real collector, `fire --regenerate`, one vocab
mapping, the Llama and the MLA draft trained, evaluated and exported, then each served by its own SGLang
server, on the held-out conversations (their images sent along), its answers compared with the capture
server's (draftless; it captures nothing then).
"""

from __future__ import annotations

import pytest

from eagle_tap.bench import draft_layouts, served_images

pytestmark = pytest.mark.sglang


@pytest.mark.timeout(1200)  # three servers, two fires, two trainings: 225-260 s in the suite, up to 1,027 on all cores
@pytest.mark.parametrize("bench", [draft_layouts, served_images], ids=["deepseek_v3", "kimi_k25-images"])
def test_llama_and_mla_drafts_trained_on_the_same_records_serve_the_targets_greedy_answers(bench, tmp_path):
    config = bench.Config.quick()
    config.dtype, config.work_dir = "float32", str(tmp_path)
    config.train_steps = 200  # 60 (the bench's quick size) leaves image requests near no acceptance at all
    result = draft_layouts.run(config)
    rows = {row["item"]: row for row in result["rows"]}
    print({item: {key: value for key, value in row.items() if key != "mismatches"} for item, row in rows.items()})
    kinds = [", image requests", ", text requests"] if config.images else [""]
    assert sorted(rows) == sorted(layout + kind for layout in ("llama", "mla") for kind in kinds)
    for item, row in rows.items():
        layout = item.split(",")[0]
        assert row["architecture"] == {"llama": "LlamaForCausalLMEagle3", "mla": "Eagle3DeepseekV2ForCausalLM"}[layout]
        # One latent (64) and the shared rope key (16) per token, against K and V of 4 heads of 32.
        assert row["kv_bytes"] == {"llama": 2 * 4 * 32 * 2, "mla": (64 + 16) * 2}[layout]
        # Speculative decoding never changes a greedy fp32 answer, whichever layout drafts it, image or not.
        num_identical, num_prompts = map(int, row["identical"].split("/"))
        assert num_prompts >= 2 and num_identical == num_prompts, (item, row["mismatches"])
        # The drafts learned the held-out conversations (every position of their records, a few hundred; 1.36-2.45
        # seen at 200 steps, an untrained draft about 1.0).
        assert row["simulated"] > 1.1, (item, row)
        # SGLang's acceptance follows the trainer's simulated walk of the same draft on the same conversations: a
        # served draft computing something else than the one trained (a wrong tensor, rope or norm; image rows
        # fed other embeddings) would accept less than the walk. Two or three prompts of 16 tokens walk only
        # 1.05-1.35 on image requests, depending on the machine's float rounding of the training set, so the
        # walk is only asked to accept something; in fp32 served and walk agree within a few accepted tokens.
        assert row["simulated_walk"] > 1.0, (item, row)
        assert 0.9 <= row["served_over_walk"] <= 1.2, (item, row)
