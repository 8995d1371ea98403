"""The whole pipeline on a DeepSeek-V3 target (MLA, MoE, yarn rope: Kimi-K2.5's architecture), as a user runs it.

A tiny random DeepSeek-V3 served by a CPU SGLang server with the plugin; `eagle-tap fire` into a training
and a held-out collector; `vocab`, `draft-config`, `train`, `eval`, `export`. The export's
`eagle_aux_hidden_state_layer_ids`, handed to SGLang's own `DeepseekV3ForCausalLM.set_eagle3_layers_to_capture`,
must make it capture exactly the layers the records hold.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import capture_format as cf
from eagle_tap.cli import main
from eagle_tap.demo import CONVERSATIONS_PATH

pytestmark = pytest.mark.sglang

NUM_CONVERSATIONS = 20
HELDOUT_EVERY = 5


def sglang_layers_to_capture(architecture: str, layer_ids: list[int]) -> list[int]:
    """Run in a fresh process: the decoder-layer inputs SGLang's model class captures for `layer_ids`."""
    from types import SimpleNamespace

    from eagle_tap.serve.sglang_server import use_cpu_stand_ins_in_this_process

    use_cpu_stand_ins_in_this_process()
    from sglang.srt.models import deepseek_v2

    model = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True), model=SimpleNamespace())
    getattr(deepseek_v2, architecture).set_eagle3_layers_to_capture(model, layer_ids)
    return list(model.model.layers_to_capture)


def fire(server, collector, data: Path, run_dir: Path) -> None:
    assert main(["fire", "--server", server.url, "--collector", collector.url, "--data", str(data),
                 "--out", str(run_dir), "--concurrency", "4", "--progress", "off"]) == 0


def test_capture_train_eval_export_on_a_deepseek_v3_target(start_sglang, start_collector, random_target, tmp_path):
    target = random_target("deepseek_v3")
    rows = CONVERSATIONS_PATH.read_text(encoding="utf-8").splitlines()[:NUM_CONVERSATIONS]
    data = {"train": tmp_path / "train.jsonl", "heldout": tmp_path / "heldout.jsonl"}
    data["train"].write_text("".join(row + "\n" for index, row in enumerate(rows) if index % HELDOUT_EVERY))
    data["heldout"].write_text("".join(row + "\n" for index, row in enumerate(rows) if not index % HELDOUT_EVERY))

    train_collector = start_collector()
    server = start_sglang(target, env={"EAGLE_TAP_COLLECTOR_URL": train_collector.url,
                                       "EAGLE_TAP_SPOOL_DIR": str(tmp_path / "spool")})
    fire(server, train_collector, data["train"], tmp_path / "fire-train")
    port, train_shards = train_collector.port, train_collector.data_dir
    train_collector.stop()  # seals its shard; the held-out records go to their own directory on the same port
    heldout_collector = start_collector(port=port)
    fire(server, heldout_collector, data["heldout"], tmp_path / "fire-heldout")
    heldout_collector.stop()

    with cf.ShardDirectory(train_shards) as shards:
        entries = list(shards.iter_index())
        record = shards.read_record(entries[0])
    assert len(entries) == NUM_CONVERSATIONS - NUM_CONVERSATIONS // HELDOUT_EVERY
    assert record.capture_layers == (3, 5, 6) and record.dtype == "bfloat16" and record.hidden_size == 128

    vocab, draft_config, run = tmp_path / "vocab", tmp_path / "draft-config.json", tmp_path / "run"
    assert main(["vocab", "--shards", str(train_shards), "--target", str(target), "--draft-vocab-size", "256",
                 "--out", str(vocab)]) == 0
    assert main(["draft-config", "--target", str(target), "--draft-vocab-size", "256",
                 "--out", str(draft_config)]) == 0
    train_config = tmp_path / "train.json"
    train_config.write_text(json.dumps({
        "target": str(target), "draft_config": str(draft_config), "vocab": str(vocab), "out_dir": str(run),
        "data": {"shards": str(train_shards), "batch_size": 4, "max_length": 256}, "objective": {"ttt_steps": 2},
        "optimizer": {"warmup_steps": 2}, "num_steps": 6, "log_every": 2, "checkpoint_every": 0,
        "num_threads": 1, "progress_bar": False}))
    assert main(["train", "--config", str(train_config)]) == 0
    assert main(["eval", "--checkpoint", str(run), "--shards", str(heldout_collector.data_dir)]) == 0
    export_dir = tmp_path / "draft"
    assert main(["export", "--checkpoint", str(run), "--out", str(export_dir)]) == 0

    exported = json.loads((export_dir / "config.json").read_text())
    layer_ids = exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert exported["eagle_tap"]["capture_layers"] == list(record.capture_layers)
    script = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_pipeline_deepseek as t; "
              "print('RESULT', json.dumps(t.sglang_layers_to_capture(sys.argv[2], json.loads(sys.argv[3]))))")
    done = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent), "DeepseekV3ForCausalLM",
                           json.dumps(layer_ids)], capture_output=True, text=True, timeout=240)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads(lines[-1].removeprefix("RESULT ")) == list(record.capture_layers)
