"""`eagle-tap demo` end to end, as a user runs it (a subprocess), on a small slice of the bundled conversations.

What the demo claims is checked against the parts themselves: the shards on disk, the collector's
totals, the export folder, and the machine's process table after it exits (or after it is killed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import capture_format as cf
from capture_format.shard_index import SEALED_SUFFIX
from eagle_tap.cli import main
from eagle_tap.demo import CONVERSATIONS_PATH
from eagle_tap.demo.run import MARKER_NAME

pytestmark = pytest.mark.sglang

BYTES_PER_TOKEN = 4 * 128 * 2 + 4  # 3 capture layers + the final state, hidden 128, bf16; plus the int32 token id


def demo_command(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "eagle_tap.cli", "demo", "--out", str(out), "--num-conversations", "24",
            "--heldout-every", "4", "--max-new-tokens", "32", "--train-steps", "8", "--ttt-steps", "2",
            "--served-max-new-tokens", "12", *extra]


def processes_of(out: Path) -> list[str]:
    """Processes anywhere on the machine that belong to the demo at `out` (by command line or plugin settings)."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            command = " ".join(process.info["cmdline"] or [])
            spool = process.environ().get("EAGLE_TAP_SPOOL_DIR", "")
        except psutil.Error:
            continue
        if process.pid != os.getpid() and (str(out) in command or spool.startswith(str(out))):
            found.append(f"{process.pid} {command[:100]}")
    return found


def record_ids(shard_dir: Path) -> set[str]:
    with cf.ShardDirectory(shard_dir) as shards:
        return {entry.record_id for entry in shards.iter_index()}


def test_the_demo_runs_every_stage_and_leaves_no_process(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    done = subprocess.run(demo_command(out), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "eagle-tap demo finished" in done.stdout and "every process it started is stopped" in done.stdout
    assert processes_of(out) == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes_left"] == [] and summary["capture"]["processes_started"] >= 3  # server tree + collector

    # 24 conversations: every 4th held out; each one record, confirmed, in its own shard directory. The
    # ordinary chat traffic sent while the training set was fired is there too, as live records.
    capture = summary["capture"]
    assert summary["conversations"] == {"train": 18, "heldout": 6, "source": summary["conversations"]["source"]}
    train_ids, heldout_ids = record_ids(out / "captures" / "train"), record_ids(out / "captures" / "heldout")
    live_ids = {record_id for record_id in train_ids if record_id.startswith("live-")}
    live = capture["live"]
    assert len(train_ids - live_ids) == 18 and len(heldout_ids) == 6 and not train_ids & heldout_ids
    assert len(live_ids) == live["num_records"] >= 1 and live["sample_rate"] == 1.0
    for name, ids in (("train", train_ids), ("heldout", heldout_ids)):
        stored, fired = capture["collector"][name], capture["fire"][name]
        live_records, live_tokens = (live["num_records"], live["num_tokens"]) if name == "train" else (0, 0)
        assert fired["records_by_state"]["confirmed"] + live_records == stored["num_records"] == len(ids)
        assert stored["num_tokens"] == fired["num_tokens"] + live_tokens
        # Captured in one pass: every record's last token has no state.
        num_states = stored["num_tokens"] - stored["num_records"]
        assert stored["raw_nbytes"] == 4 * stored["num_tokens"] + num_states * (BYTES_PER_TOKEN - 4)
        assert stored["stored_nbytes"] < stored["raw_nbytes"]
        shards = sorted((out / "captures" / name).glob(f"*{SEALED_SUFFIX}"))
        assert shards and all(cf.verify_shard(shard).ok for shard in shards)
    assert capture["plugin"]["dropped"] == {} and capture["plugin"]["captured"] == 24 + live["num_records"]
    assert capture["plugin"]["captured_live"] == live["num_records"]

    # Ordinary traffic was answered all along.
    assert capture["serving"]["num_answered"] > 0 and capture["serving"]["num_failed"] == 0

    training, evaluation = summary["training"], summary["evaluation"]
    assert training["steps"] == 8 and all(Path(plot).stat().st_size > 1000 for plot in training["plots"])
    result = json.loads(Path(evaluation["eval_json"]).read_text())
    assert result["num_records"] == 6 and result["held_out"]
    assert sorted(summary["export"]["files"]) == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((out / "draft" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]

    # The exported draft and the untrained one were served by SGLang with speculative decoding; greedy outputs
    # equal the no-draft ones, and every figure is SGLang's own count.
    served = summary["served"]
    assert served["num_prompts"] == 6 and set(served["results"]) == {"draft", "untrained"}
    for result in served["results"].values():
        # bf16: an output may differ only where the no-draft server's top two logits were all but tied.
        assert result["num_identical_outputs"] + len(result["mismatches"]) == 6 and result["num_verify_steps"] > 0
        assert all(mismatch["top2_logprob_gap"] < 0.1 for mismatch in result["mismatches"]), result["mismatches"]
        assert 1.0 <= result["acceptance_length"] <= 1 + served["num_steps"]
    assert "acceptance length, served" in done.stdout and "simulated, served walk" in done.stdout

    # Running it again at the same folder needs --replace (the folder is the demo's own).
    assert main(["demo", "--out", str(out)]) == 2
    assert (out / "summary.json").exists()


def test_a_killed_demo_stops_every_process_it_started(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    demo = subprocess.Popen(demo_command(out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "runs" / "fire-train" / "manifest.sqlite").exists():  # the server is up and firing
            assert demo.poll() is None and time.monotonic() < deadline, "the demo never started firing"
            time.sleep(0.5)
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=120) == 130
    finally:
        if demo.poll() is None:
            demo.kill()
    assert "interrupted" in demo.stderr.read()
    assert processes_of(out) == []


def test_a_failed_capture_stops_the_demo_before_training_and_every_process(tmp_path: Path) -> None:
    # A conversation longer than the target's context cannot be served: fire fails that record and exits 1. The
    # demo must not go on to hold out (or train on) a set with a record missing or still in flight.
    rows = [{"messages": [{"role": "user", "content": "alpha beta " * 1500}, {"role": "assistant", "content": "ok"}]}]
    rows += [json.loads(line) for line in CONVERSATIONS_PATH.read_text().splitlines()[:3]]
    conversations = tmp_path / "conversations.jsonl"
    conversations.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "demo"
    done = subprocess.run([*demo_command(out), "--conversations", str(conversations), "--num-conversations", "4",
                           "--heldout-every", "2"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "fire of train.jsonl did not end with every record stored: 1 confirmed, 1 failed" in done.stderr
    assert "every process it started is stopped" in done.stderr
    assert processes_of(out) == [] and not (out / "runs" / "train").exists()


def test_the_demo_never_deletes_a_folder_it_did_not_make(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["demo", "--out", str(tmp_path), "--replace"]) == 2
    assert "is not a demo folder" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine" and not (tmp_path / MARKER_NAME).exists()


def test_the_loop_demo_shifts_the_traffic_runs_its_rounds_and_drops_no_request(tmp_path: Path) -> None:
    """`demo --loop` at a small size: both replicas measured before and after, two rounds decided, every request
    answered, every swap verified, the registry consistent and every process stopped."""
    out = tmp_path / "loop-demo"
    command = [sys.executable, "-m", "eagle_tap.cli", "demo", "--loop", "--out", str(out), "--num-conversations", "24",
               "--heldout-every", "6", "--max-new-tokens", "24", "--train-steps", "30", "--round-steps", "8",
               "--min-new-records", "8", "--ttt-steps", "2", "--served-max-new-tokens", "12", "--rounds", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "closed loop: summary" in done.stdout and processes_of(out) == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes_left"] == [] and summary["failed_requests"] == 0
    assert sum(client["num_answered"] for client in summary["traffic"]) > 0
    for when in ("served_before", "served_after"):
        for domain in ("old", "new"):
            per_replica = summary[when][domain]
            assert len(per_replica) == 2 and all(figures["verify_steps"] > 0 for figures in per_replica.values())
    assert len(summary["rounds"]) == 2
    for item in summary["rounds"]:
        assert item["decision"] in ("promote", "reject") and item["new_records"] > 0 and item["heldout_records"] >= 4
        assert item["heldout_served_walk"]["serving"] > 0 and item["heldout_served_walk"]["candidate"] > 0
    state = json.loads((out / "registry" / "state.json").read_text())
    assert state["pending"] is None and state["promoted"] == summary["promoted"]
    assert {record["version"] for record in state["replicas"].values()} == {summary["promoted"]}
    assert all(event["kind"] == "swapped" for event in summary["swaps"]) and summary["rollbacks"] == []
    scratch = summary["from_scratch"]
    assert scratch["records"] > 0 and all(scratch[domain]["from_scratch"] > 0 for domain in ("old", "new"))
