"""The exported draft's layer ids make SGLang capture exactly the states our records hold.

A server started with the export's `eagle_aux_hidden_state_layer_ids` (SGLang's own aux-capture flags,
no plugin) returns, for the same input, aux states equal bit for bit to the record the plugin captured:
what serving would feed the draft is what it was trained on.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from capture_helpers import aux_as_float, generate, stored_record
from eagle_tap.cli import main
from test_plugin_capture import prompt_ids
from test_trainer_export import trained_run

pytestmark = pytest.mark.sglang


def test_exported_layer_ids_capture_the_states_the_records_hold(capture_server, collector, start_sglang,
                                                               tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    export_dir = tmp_path / "draft"
    assert main(["export", "--checkpoint", str(trained_run()), "--out", str(export_dir)]) == 0
    config = json.loads((export_dir / "config.json").read_text())
    layer_ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]

    input_ids = prompt_ids(AutoTokenizer.from_pretrained(tiny_model_dir), 500, 48)
    generate(capture_server[0], input_ids, record_id="export-check")
    record = stored_record(collector, "export-check")
    assert list(record.capture_layers) == config["eagle_tap"]["capture_layers"]

    serving = start_sglang(tiny_model_dir, env={"SGLANG_PLUGINS": "none-loaded"}, extra_args=(
        "--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
        "--return-aux-hidden-state-layer-ids", *map(str, layer_ids)))
    response = generate(serving, input_ids, return_hidden_states=True)
    served = np.asarray(response["meta_info"]["hidden_states"][0], dtype=np.float32)  # (T, K*H)
    np.testing.assert_array_equal(served, aux_as_float(record).reshape(len(input_ids), -1))
