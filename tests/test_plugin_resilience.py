"""Serving never depends on capture: a collector that is down, a spool that is full, settings that are wrong."""

from __future__ import annotations

import logging
import os

import pytest

from eagle_tap.serve.sglang_server import free_port
from sglang_patch.settings import load_settings
from capture_helpers import generate, locate, read_stats, stored_record, wait_for
from test_plugin_capture import prompt_ids

pytestmark = pytest.mark.sglang


def capture_env(collector_url: str, spool_dir, **settings: str) -> dict[str, str]:
    return {"EAGLE_TAP_COLLECTOR_URL": collector_url, "EAGLE_TAP_SPOOL_DIR": str(spool_dir),
            **{f"EAGLE_TAP_{name.upper()}": value for name, value in settings.items()}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_collector_down_spools_then_delivers_in_order_when_back(start_sglang_for_test, start_collector,
                                                                tiny_model_dir, tokenizer, tmp_path):
    port = free_port()
    spool_dir = tmp_path / "spool"
    server = start_sglang_for_test(tiny_model_dir, env=capture_env(f"http://127.0.0.1:{port}", spool_dir))
    record_ids = []
    for index in range(6):
        ids = prompt_ids(tokenizer, 200 + index, 30 + 7 * index)
        tagged = generate(server, ids, record_id=f"late-{index}", max_new_tokens=4)
        untagged = generate(server, ids, max_new_tokens=4)
        assert tagged["output_ids"] == untagged["output_ids"] and len(tagged["output_ids"]) == 4
        record_ids.append(f"late-{index}")
    stats = wait_for(lambda: (s := read_stats(spool_dir)).get("spool_frames") == 6 and s, 30, "six spooled frames")
    assert stats.get("sent", 0) == 0 and stats["spooled"] == 6 and stats["send_failures"] >= 1

    collector = start_collector(port=port)
    stats = wait_for(lambda: (s := read_stats(spool_dir)).get("resent_from_spool") == 6 and s, 60, "the spool to drain")
    assert stats["spool_frames"] == 0 and stats["dropped"] == {}
    for index, record_id in enumerate(record_ids):
        assert stored_record(collector, record_id).token_ids.tolist() == prompt_ids(tokenizer, 200 + index, 30 + 7 * index)
    offsets = [locate(collector, record_id)["offset"] for record_id in record_ids]
    assert offsets == sorted(offsets), "spooled frames must reach the collector in capture order"


def test_a_full_spool_drops_and_counts_while_serving_goes_on(start_sglang_for_test, tiny_model_dir, tokenizer,
                                                             tmp_path):
    spool_dir = tmp_path / "spool"
    server = start_sglang_for_test(tiny_model_dir, env=capture_env(f"http://127.0.0.1:{free_port()}", spool_dir,
                                                          spool_max_bytes="20000"))
    for index in range(5):
        ids = prompt_ids(tokenizer, 300 + index, 60)
        assert len(generate(server, ids, record_id=f"full-{index}", max_new_tokens=3)["output_ids"]) == 3
    stats = wait_for(lambda: (s := read_stats(spool_dir)).get("dropped", {}).get("spool_full") == 5 and s, 30,
                     "five spool_full drops")
    assert stats["captured"] == 5 and stats.get("spooled", 0) == 0 and stats["spool_bytes"] == 0


def test_capture_layers_the_model_does_not_have_leave_a_dormant_plugin_and_a_serving_server(
        start_sglang_for_test, tiny_model_dir, tokenizer, tmp_path):
    spool_dir = tmp_path / "spool"
    server = start_sglang_for_test(tiny_model_dir, env=capture_env(f"http://127.0.0.1:{free_port()}", spool_dir,
                                                          capture_layers="3,99"))
    ids = prompt_ids(tokenizer, 400, 20)
    assert len(generate(server, ids, record_id="never", max_new_tokens=2)["output_ids"]) == 2
    log = server.log_path.read_text(errors="replace")
    assert "eagle-tap capture disabled: LayerConfigError" in log and "out of range for a 8-layer model" in log
    stats = wait_for(lambda: read_stats(spool_dir, rank_dir=""), 10, "the dormant status")
    assert stats["status"].startswith("dormant") and "captured" not in stats


def test_a_spool_directory_others_can_write_leaves_capture_off_and_serving_on(start_sglang_for_test, tiny_model_dir,
                                                                               tokenizer, tmp_path):
    spool_dir = tmp_path / "shared"
    spool_dir.mkdir()
    os.chmod(spool_dir, 0o777)  # like a directory under /tmp that another local user made first
    server = start_sglang_for_test(tiny_model_dir, env=capture_env(f"http://127.0.0.1:{free_port()}", spool_dir))
    ids = prompt_ids(tokenizer, 500, 20)
    assert len(generate(server, ids, record_id="not-here", max_new_tokens=2)["output_ids"]) == 2
    log = server.log_path.read_text(errors="replace")
    assert "eagle-tap capture disabled in this process" in log and "it must be private: chmod 700" in log
    assert list(spool_dir.iterdir()) == [], "nothing is written into a directory others control"


def test_a_codec_that_cannot_store_fp32_states_is_refused_at_start_up(start_sglang_for_test, tiny_model_dir, tokenizer,
                                                                       tmp_path):
    spool_dir = tmp_path / "spool"
    server = start_sglang_for_test(tiny_model_dir, extra_args=("--dtype", "float32"),
                          env=capture_env(f"http://127.0.0.1:{free_port()}", spool_dir, codec="bf16-split"))
    ids = prompt_ids(tokenizer, 410, 20)
    assert len(generate(server, ids, record_id="never-fp32", max_new_tokens=2)["output_ids"]) == 2
    stats = wait_for(lambda: read_stats(spool_dir, rank_dir=""), 10, "the dormant status")
    assert stats["status"].startswith("dormant: EAGLE_TAP_CODEC=bf16-split cannot store the float32 states")
    assert "captured" not in stats
    log = server.log_path.read_text(errors="replace")
    assert "eagle-tap capture disabled in this process: EAGLE_TAP_CODEC=bf16-split" in log and "2-byte elements" in log


def test_deepseek_refuses_capture_layer_1_as_its_first_layer(start_sglang_for_test, random_target, tmp_path):
    """DeepSeek's SGLang class shifts ids only when the first is 1, so the input of layer 1 cannot come first."""
    spool_dir = tmp_path / "spool"
    server = start_sglang_for_test(random_target("deepseek_v3"),
                          env=capture_env(f"http://127.0.0.1:{free_port()}", spool_dir, capture_layers="1,3,5"))
    assert len(generate(server, list(range(10, 30)), record_id="never-layer-1", max_new_tokens=2)["output_ids"]) == 2
    log = server.log_path.read_text(errors="replace")
    assert "eagle-tap capture disabled: LayerConfigError: DeepseekV3ForCausalLM cannot capture layer 1" in log
    stats = wait_for(lambda: read_stats(spool_dir, rank_dir=""), 10, "the dormant status")
    assert stats["status"].startswith("dormant") and "captured" not in stats


@pytest.mark.parametrize("variable, value, message", [
    ("EAGLE_TAP_COLLECTOR_URL", "not a url", "must be an http(s) URL"),
    ("EAGLE_TAP_CODEC", "zstdd", "unknown codec 'zstdd'"),
    ("EAGLE_TAP_CAPTURE_LAYERS", "three", "decoder-layer indices"),
    ("EAGLE_TAP_SAMPLE_RATE", "1.5", "less than or equal to 1"),
])
def test_bad_settings_are_logged_and_leave_capture_off(monkeypatch, caplog, variable, value, message):
    monkeypatch.setenv("EAGLE_TAP_COLLECTOR_URL", "http://127.0.0.1:9")
    monkeypatch.setenv(variable, value)
    with caplog.at_level(logging.ERROR, logger="eagle_tap.plugin"):
        assert load_settings() is None
    assert message in caplog.text and "eagle-tap capture disabled" in caplog.text


def test_a_token_that_cannot_stand_in_a_header_is_refused_and_not_logged(monkeypatch, caplog):
    monkeypatch.setenv("EAGLE_TAP_COLLECTOR_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("EAGLE_TAP_COLLECTOR_TOKEN", "s3cret-value\r\nX-Evil: 1")
    with caplog.at_level(logging.ERROR, logger="eagle_tap.plugin"):
        assert load_settings() is None
    assert "printable ASCII" in caplog.text and "s3cret" not in caplog.text
