"""Ordinary mistakes through the real `eagle-tap` command: one line on stderr, exit 2, nothing half-written.

Each case runs the installed command in a subprocess, as a person would; `--debug` brings the traceback back.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import trainer_data  # noqa: E402

EAGLE_TAP = [sys.executable, "-m", "eagle_tap.cli"]


def run(*argv: str, as_nobody: bool = False, timeout_s: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "EAGLE_TAP_DEBUG": ""}
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if as_nobody else []
    return subprocess.run([*prefix, *EAGLE_TAP, *argv], capture_output=True, text=True, timeout=timeout_s, env=env)


def assert_one_line_error(result: subprocess.CompletedProcess, command: str, *phrases: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    error_lines = [line for line in result.stderr.splitlines() if line.startswith(f"eagle-tap {command}: error: ")]
    assert len(error_lines) == 1, result.stderr
    for phrase in phrases:
        assert phrase in error_lines[0], error_lines[0]


@pytest.mark.parametrize("command", [["shards", "verify"], ["shards", "stats"]])
def test_shard_tools_on_a_missing_folder(tmp_path: Path, command: list[str]) -> None:
    result = run(*command, "--shards", str(tmp_path / "nope"))
    assert_one_line_error(result, " ".join(command), "shards folder", "does not exist")


def test_shard_tools_name_the_folder_with_shards_and_still_take_it_bare(tmp_path: Path) -> None:
    usage = run("shards", "repair", "--help")
    assert usage.returncode == 0 and "--shards DIR" in usage.stdout
    bare = run("shards", "stats", str(tmp_path / "nope"))  # the form before --shards
    assert_one_line_error(bare, "shards stats", "shards folder", "does not exist")
    assert_one_line_error(run("shards", "verify"), "shards verify", "--shards is required")
    assert_one_line_error(run("shards", "verify", "--shards", str(tmp_path), str(tmp_path)), "shards verify",
                          "not allowed with argument --shards")


def test_verify_on_an_empty_folder_warns_and_fails(tmp_path: Path) -> None:
    result = run("shards", "verify", "--shards", str(tmp_path))
    assert result.returncode == 1
    assert "warning:" in result.stdout and "holds no shard files" in result.stdout and "OK" not in result.stdout


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    result = run("--debug", "shards", "stats", "--shards", str(tmp_path / "nope"))
    assert result.returncode == 1 and "Traceback" in result.stderr and "ShardError" in result.stderr
    after = run("shards", "stats", "--shards", str(tmp_path / "nope"), "--debug")  # after the subcommand too
    assert after.returncode == 1 and "Traceback" in after.stderr


def _train_config(tmp_path: Path, shards: Path, out_dir: Path) -> Path:
    inputs = trainer_data.prepared_inputs()
    config = {
        "target": str(inputs["target"]), "draft_config": str(inputs["draft_config"]), "vocab": str(inputs["vocab"]),
        "out_dir": str(out_dir), "data": {"shards": str(shards), "batch_size": 8, "max_length": 256},
        "objective": {"ttt_steps": 3}, "num_steps": 4, "log_every": 2, "checkpoint_every": 0, "num_threads": 1,
        "progress_bar": False,
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    return path


def test_train_vocab_and_eval_on_a_missing_shards_folder_write_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "no-shards"
    out_dir = tmp_path / "run"
    assert_one_line_error(run("train", "--config", str(_train_config(tmp_path, missing, out_dir))), "train",
                          "no-shards", "does not exist")
    assert not out_dir.exists(), "train must not leave a half-made out_dir behind"
    vocab_out = tmp_path / "vocab"
    result = run("vocab", "--target", str(trainer_data.TINY_MODEL_DIR), "--out", str(vocab_out), "--shards",
                 str(missing), "--draft-vocab-size", "64")
    assert_one_line_error(result, "vocab", "does not exist")
    assert not vocab_out.exists()


def test_train_names_an_unknown_or_mistyped_setting_and_writes_nothing(tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    path = _train_config(tmp_path, trainer_data.prepared_inputs()["train_shards"], out_dir)
    config = json.loads(path.read_text())
    config["data"]["batch_szie"] = config["data"].pop("batch_size")
    path.write_text(json.dumps(config))
    assert_one_line_error(run("train", "--config", str(path)), "train", str(path), "unknown setting data.batch_szie",
                          "accepted in data: shards, batch_size, max_length")
    config["data"]["batch_size"] = config["data"].pop("batch_szie")
    toml = tmp_path / "run.toml"  # the same settings as TOML, with a number in quotes
    top_level = [f"{key} = {json.dumps(value)}" for key, value in config.items() if not isinstance(value, dict)]
    toml.write_text("\n".join([*top_level, "[data]", f"shards = {json.dumps(config['data']['shards'])}",
                               'batch_size = "8"']) + "\n")
    assert_one_line_error(run("train", "--config", str(toml)), "train", "data.batch_size: input should be a valid "
                          "integer; got str '8'")
    assert_one_line_error(run("train", "--config", str(toml), "data.batch_size=8", "num_steps=4.5"), "train",
                          "num_steps: input should be a valid integer; got float 4.5")
    assert not out_dir.exists(), "a config that does not fit must be refused before anything is written"


def test_a_moved_run_folder_still_evaluates_and_exports(tmp_path: Path) -> None:
    inputs = trainer_data.prepared_inputs()
    training_shards = tmp_path / "train-shards"
    shutil.copytree(inputs["train_shards"], training_shards)
    result = run("train", "--config", str(_train_config(tmp_path, training_shards, tmp_path / "run")), timeout_s=600)
    assert result.returncode == 0, result.stderr[-2000:]
    moved = tmp_path / "elsewhere" / "run"
    moved.parent.mkdir()
    (tmp_path / "run").rename(moved)
    moved_shards = tmp_path / "elsewhere" / "train-shards"
    training_shards.rename(moved_shards)

    refused = run("eval", "--run", str(moved), "--shards", str(moved_shards))
    assert_one_line_error(refused, "eval", "64 records", "training records", "held-out")
    assert not (moved / "eval").exists()

    result = run("eval", "--checkpoint", str(moved), "--shards", str(inputs["heldout_shards"]), "--max-records", "4",
                 timeout_s=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (moved / "eval" / "eval.json").is_file()

    export_dir = tmp_path / "exported"
    result = run("export", "--run", str(moved), "--out", str(export_dir))  # no --eval-result
    assert result.returncode == 0, result.stderr[-2000:]
    card = (export_dir / "README.md").read_text()
    assert str(tmp_path) not in card and "/work/" not in card and "Vocab coverage" in card


def test_export_of_a_folder_without_a_draft(tmp_path: Path) -> None:
    assert_one_line_error(run("export", "--run", str(tmp_path), "--out", str(tmp_path / "x")), "export",
                          "holds no trained draft")
    assert not (tmp_path / "x").exists()


def test_vocab_refuses_frequencies_of_another_tokenizer(tmp_path: Path) -> None:
    from capture_format.fingerprint import tokenizer_fingerprint
    from capture_format.token_frequencies import write_token_frequencies

    other = tmp_path / "other-model"
    shutil.copytree(trainer_data.TINY_MODEL_DIR, other)
    tokenizer_config = json.loads((other / "tokenizer_config.json").read_text())
    tokenizer_config["model_max_length"] = 77  # any change to the files that decide ids is another tokenizer
    (other / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    frequencies = write_token_frequencies(tmp_path / "token_frequencies.json", {5: 3, 9: 2}, vocab_size=4096,
                                          num_records=1, tokenizer_fingerprint=tokenizer_fingerprint(other))
    result = run("vocab", "--target", str(trainer_data.TINY_MODEL_DIR), "--out", str(tmp_path / "vocab"),
                 "--frequencies", str(frequencies), "--draft-vocab-size", "64")
    assert_one_line_error(result, "vocab", "was counted with tokenizer")
    assert not (tmp_path / "vocab").exists()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_fire_checks_urls_and_that_server_and_collector_answer(tmp_path: Path) -> None:
    data = Path(__file__).parent / "fixtures" / "conversations_small.jsonl"
    down = f"http://127.0.0.1:{_free_port()}"
    result = run("fire", "--server", down, "--collector", down, "--data", str(data), "--out", str(tmp_path / "run"))
    assert_one_line_error(result, "fire", "the SGLang server", "does not answer", "--server")
    assert not (tmp_path / "run").exists()
    result = run("fire", "--server", "127.0.0.1:30000", "--collector", down, "--data", str(data), "--out",
                 str(tmp_path / "run"))
    assert_one_line_error(result, "fire", "'127.0.0.1:30000' is not an http(s) URL")


def test_collect_refuses_bad_settings_with_one_line(tmp_path: Path) -> None:
    assert_one_line_error(run("collect", "--data-dir", str(tmp_path / "d"), "--host", "0.0.0.0", "--port", "0"),
                          "collect", "not loopback and no token")
    assert_one_line_error(run("collect", "--data-dir", str(tmp_path / "d"), "--token-file", str(tmp_path / "none")),
                          "collect", "--token-file", "No such file")
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    assert_one_line_error(run("collect", "--data-dir", str(not_a_folder / "sub"), "--port", "0"), "collect",
                          "is not writable")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = run("collect", "--data-dir", str(tmp_path / "d"), "--port", str(taken.getsockname()[1]))
    assert_one_line_error(result, "collect", "cannot listen", "in use")


def test_collect_refuses_a_read_only_data_folder_before_listening(tmp_path: Path) -> None:
    top = Path(tempfile.mkdtemp(prefix="eagle-tap-read-only-"))  # pytest's own tmp folders are private to root
    read_only = top / "captures"
    read_only.mkdir()
    read_only.chmod(0o555)
    top.chmod(0o755)
    # root writes anywhere: run the collector as `nobody` there, so the folder's mode applies
    assert os.geteuid() != 0 or shutil.which("setpriv"), "as root this test needs setpriv (util-linux)"
    result = run("collect", "--data-dir", str(read_only), "--port", "0", as_nobody=os.geteuid() == 0, timeout_s=60)
    assert_one_line_error(result, "collect", "is not writable", "Permission denied")
    assert "listening" not in result.stdout
    shutil.rmtree(top)
