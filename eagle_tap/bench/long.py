"""Long records: peak memory of the capturing server, the collector and a training step against record length.

One collector, one SGLang server with the capture plugin and one with the plugin excluded through SGLang's own
allow-list (SGLANG_PLUGINS), both serving the tiny target (bf16) with its declared context raised in a copy whose
other files are links, prefill chunked at `chunk_tokens`, the plugin cutting captures into parts of `part_tokens`.
Per record length L in `lengths`, shortest first, both servers get the same request: L - `new_tokens` random
prompt ids (past the special tokens), `new_tokens` greedy tokens, end of sequence ignored; the capturing server's
request is tagged (generate mode, loss on every token), so its record holds L tokens. Then, with the servers
stopped, one `eagle-tap train` subprocess per length trains a few steps on that length's record alone
(`data.record_ids`, batch 1, `train_max_length` positions).

What is measured, per length:
- server: the peak RSS of the scheduler process (the child of the launcher that holds the model and runs the
  capture hook and the sender) above its RSS just before the request: its peak is reset first
  (`echo 5 > /proc/<pid>/clear_refs` resets VmHWM) and read (VmHWM) once the response came back and, capturing,
  once the collector held the record. SGLang's own forward memory is in that figure too, so the same request on
  the server without the plugin is measured alike and the difference is the plugin's share (noisy: the two
  processes' allocators need not give memory back alike);
- the plugin's own bound: its `most_rows_held` gauge (the most rows one capture held at once, over the server's
  life so far) times the bytes of one row (capture layers + final state);
- collector: its process's peak RSS above idle, reset and read the same way, until the record is in a sealed shard;
- training: the peak RSS of the whole training process (ru_maxrss from wait4: imports, target weights, the
  record's reads and the steps);
- the capture's wall time (request sent until the collector holds the record), its stored bytes and parts.

Goal: the plugin's and the collector's peaks flat in length (64K within 1.2x of 8K), the trainer's peak set by
max_length, not by record length. Memory only: timings are reported, not compared.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from capture_format import ShardDirectory
from capture_format.tag import CaptureTag
from eagle_tap.bench.capture import start_all
from eagle_tap.testbed.collector_process import CollectorProcess
from eagle_tap.serve.sglang_server import ServerConfig, SGLangServer
from eagle_tap.serve.http_api import post_json
from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR
from sglang_patch.stats import read_stats_file

MB = 1e6
COLUMNS = [
    ["length", "length", "d"],
    ["tokens", "tokens", "d"],
    ["parts", "parts", "d"],
    ["capture_s", "capture until stored (s)", ",.1f"],
    ["stored_mb", "stored MB", ",.1f"],
    ["server_peak_mb", "server peak above idle, capturing (MB)", ",.1f"],
    ["plain_peak_mb", "no plugin (MB)", ",.1f"],
    ["plugin_share_mb", "plugin share (MB)", ",.1f"],
    ["rows_held_mb", "most_rows_held x row bytes (MB)", ",.1f"],
    ["collector_peak_mb", "collector peak above idle (MB)", ",.1f"],
    ["train_peak_mb", "training process peak (MB)", ",.0f"],
    ["train_s", "training wall (s)", ",.1f"],
]
FLAT_GOAL = 1.2
"""Peak at the longest length over the peak at the reference length, at most."""
REFERENCE_LENGTH = 8192
FIRST_ID = 7
"""Prompt ids are drawn from [FIRST_ID, vocab size): past the tiny tokenizer's special tokens."""


@dataclass(kw_only=True, slots=True)
class Config:
    """Record lengths, how the server chunks and cuts them, and the training runs."""

    lengths: tuple[int, ...] = (1024, 8192, 32768, 65536)
    """Tokens per record (prompt + generated), one capture each, shortest first."""
    new_tokens: int = 32
    """Tokens generated per request (greedy, end of sequence ignored)."""
    chunk_tokens: int = 2048
    """SGLang's --chunked-prefill-size."""
    part_tokens: int = 2048
    """EAGLE_TAP_PART_MAX_TOKENS: the plugin sends a capture in parts of at most this many rows."""
    train_max_length: int = 2048
    """Positions per training row (trainer data.max_length)."""
    train_steps: int = 3
    """Optimizer steps per training run (batch 1: the one record)."""
    ttt_steps: int = 3
    """TTT unroll length of the training runs."""
    draft_vocab_size: int = 512
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not self.lengths or any(length <= self.new_tokens for length in self.lengths):
            raise ValueError(f"every length must exceed new_tokens ({self.new_tokens}); got {self.lengths}")
        if list(self.lengths) != sorted(set(self.lengths)):
            raise ValueError(f"lengths must be distinct and increasing; got {self.lengths}")

    @classmethod
    def quick(cls) -> Config:
        return cls(lengths=(512, 2048), chunk_tokens=512, part_tokens=256, train_max_length=256, train_steps=1,
                   ttt_steps=2, new_tokens=16)


def long_target(context_length: int, out_dir: Path) -> Path:
    """The tiny target with max_position_embeddings raised to context_length (RoPE past its 2,048 trained positions;
    the states are still the model's, which is all a capture promises); every other file links to the original."""
    out_dir.mkdir(parents=True)
    for path in TINY_MODEL_DIR.iterdir():
        if path.name != "config.json":
            (out_dir / path.name).symlink_to(path)
    config = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": context_length}))
    return out_dir


def _status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise ValueError(f"no {field} in /proc/{pid}/status")


class PeakRss:
    """A process's peak resident memory over a stretch of time: reset on start(), read by bytes_above_start()."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start_bytes = 0

    def start(self) -> None:
        with open(f"/proc/{self.pid}/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")  # VmHWM := VmRSS (Linux)
        self.start_bytes = _status_kb(self.pid, "VmRSS") * 1024

    def peak_bytes(self) -> int:
        return _status_kb(self.pid, "VmHWM") * 1024

    def bytes_above_start(self) -> int:
        return self.peak_bytes() - self.start_bytes


def scheduler_pid(server: SGLangServer) -> int:
    """The server's scheduler process: the launcher's child SGLang names `sglang::scheduler` (it holds the model)."""
    import psutil

    for child in psutil.Process(server.pid).children(recursive=True):
        if child.name().startswith("sglang::scheduler"):
            return child.pid
    raise RuntimeError(f"no sglang::scheduler process under the server's pid {server.pid}")



def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)
    return value


def sealed_layout(data_dir: Path, record_id: str) -> dict[str, Any] | None:
    """Parts and row bytes of record_id once it is in a sealed shard (read from headers and one row); else None."""
    with ShardDirectory(data_dir) as shards:
        entry = next((entry for entry in shards.iter_index() if entry.record_id == record_id), None)
        if entry is None:
            return None
        layout = shards.read_layout(entry)
        row = shards.read_window(entry, 0, 1)
        return {"tokens": layout.num_tokens, "states": layout.num_states, "parts": len(layout.frame_ends),
                "row_bytes": row.aux[0].nbytes + row.final[0].nbytes}


def generate(server: SGLangServer, ids: list[int], new_tokens: int, tag: CaptureTag | None) -> dict:
    sampling = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    if tag is not None:
        sampling["custom_params"] = tag.to_custom_params()
    return post_json(f"{server.url}/generate", {"input_ids": ids, "sampling_params": sampling}, timeout_s=3600)


def measure_length(length: int, config: Config, servers: dict[str, SGLangServer], collector: CollectorProcess,
                   spool_dir: Path) -> dict[str, Any]:
    """Both servers' and the collector's peaks for one length, and the capture's time, bytes and parts."""
    ids = np.random.default_rng(length).integers(FIRST_ID, 4096, length - config.new_tokens).tolist()
    plain = PeakRss(scheduler_pid(servers["plain"]))
    plain.start()
    generate(servers["plain"], ids, config.new_tokens, None)
    plain_peak = plain.bytes_above_start()

    record_id = f"long-{length}"
    tag = CaptureTag(record_id=record_id, sample_id=record_id, loss_spans=((0, len(ids)),), mode="generate")
    server, collector_rss = PeakRss(scheduler_pid(servers["capturing"])), PeakRss(collector.process.pid)
    frame_bytes_before = collector.stats()["frame_nbytes"]
    server.start()
    collector_rss.start()
    started = time.perf_counter()
    answer = generate(servers["capturing"], ids, config.new_tokens, tag)
    served_s = time.perf_counter() - started
    wait_until(lambda: collector.has_record(record_id), 600, f"the collector to hold {record_id}")
    capture_s = time.perf_counter() - started
    server_peak = server.bytes_above_start()
    layout = wait_until(lambda: sealed_layout(collector.data_dir, record_id), 120, f"{record_id} in a sealed shard",
                        poll_s=0.2)
    collector_peak = collector_rss.bytes_above_start()
    stats = read_stats_file(spool_dir / "dp0" / "stats.json", newer_than=time.time())
    if layout["tokens"] != len(ids) + len(answer["output_ids"]):
        raise RuntimeError(f"{record_id} holds {layout['tokens']} tokens; the request had "
                           f"{len(ids)} + {len(answer['output_ids'])}")
    rows_held_bytes = stats.get("most_rows_held", 0) * layout["row_bytes"]
    return {
        "length": length, "tokens": layout["tokens"], "parts": layout["parts"], "capture_s": capture_s,
        "served_s": served_s, "stored_mb": (collector.stats()["frame_nbytes"] - frame_bytes_before) / MB,
        "server_peak_mb": server_peak / MB, "plain_peak_mb": plain_peak / MB,
        "plugin_share_mb": (server_peak - plain_peak) / MB, "rows_held_mb": rows_held_bytes / MB,
        "most_rows_held": stats.get("most_rows_held"), "row_bytes": layout["row_bytes"],
        "collector_peak_mb": collector_peak / MB,
        "server_peak_absolute_mb": server.peak_bytes() / MB, "plain_peak_absolute_mb": plain.peak_bytes() / MB,
        "collector_peak_absolute_mb": collector_rss.peak_bytes() / MB, "dropped": stats.get("dropped") or {},
    }


def train_inputs(model: Path, shards: Path, config: Config, work: Path) -> dict[str, Path]:
    """Draft config and vocab mapping (over the captured records) for the training runs."""
    from trainer.draft_config import build_draft_config
    from trainer.vocab import build_vocab_mapping

    draft_config = work / "draft.json"
    draft_config.write_text(json.dumps(build_draft_config(model, draft_vocab_size=config.draft_vocab_size)))
    build_vocab_mapping(target_dir=model, draft_vocab_size=config.draft_vocab_size, out_dir=work / "vocab",
                        shard_dir=shards, if_fewer="fill")
    return {"draft_config": draft_config, "vocab": work / "vocab"}


def train_one(length: int, model: Path, shards: Path, inputs: dict[str, Path], config: Config,
              work: Path) -> dict[str, Any]:
    """Peak RSS and wall time of an `eagle-tap train` subprocess on the record of this length alone."""
    run_dir = work / f"train-{length}"
    run_dir.mkdir()
    (run_dir / "record_ids.txt").write_text(f"long-{length}\n")
    from trainer.config import Config as TrainConfig
    from trainer.config import DataConfig, ObjectiveConfig, OptimizerConfig
    from trainer.config_io import config_to_dict

    settings = TrainConfig(
        target=str(model), draft_config=str(inputs["draft_config"]), vocab=str(inputs["vocab"]),
        out_dir=str(run_dir / "out"),
        data=DataConfig(shards=str(shards), batch_size=1, max_length=config.train_max_length,
                        record_ids=str(run_dir / "record_ids.txt")),
        objective=ObjectiveConfig(ttt_steps=config.ttt_steps), optimizer=OptimizerConfig(warmup_steps=1),
        num_steps=config.train_steps, log_every=1, checkpoint_every=0, progress_bar=False, device="cpu")
    (run_dir / "config.json").write_text(json.dumps(config_to_dict(settings), indent=2))
    started = time.perf_counter()
    with open(run_dir / "train.log", "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "eagle_tap.cli", "train", "--config",
                                    str(run_dir / "config.json")], stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
        try:
            _, status, usage = os.wait4(process.pid, 0)  # this child's own rusage: ru_maxrss in KiB on Linux
        except BaseException:
            process.kill()
            process.wait()
            raise
        process.returncode = os.waitstatus_to_exitcode(status)
    wall_s = time.perf_counter() - started
    if process.returncode != 0:
        tail = (run_dir / "train.log").read_text(errors="replace").splitlines()[-20:]
        raise RuntimeError(f"training on long-{length} exited with {process.returncode}:\n" + "\n".join(tail))
    from trainer.metrics import read_metrics

    steps = read_metrics(run_dir / "out" / "metrics.jsonl", "train")
    return {"train_peak_mb": usage.ru_maxrss * 1024 / MB, "train_s": wall_s, "train_steps": len(steps),
            "train_loss_tokens": sum(line.get("num_loss_tokens", 0) for line in steps)}


def report(config: Config, rows: list[dict[str, Any]], context_length: int) -> dict[str, Any]:
    """The benchmark's result from its measured rows: ratios of the longest length's peaks to the reference's."""
    longest = max(config.lengths)
    reference = REFERENCE_LENGTH if REFERENCE_LENGTH in config.lengths and REFERENCE_LENGTH < longest else min(
        config.lengths)
    by_length = {row["length"]: row for row in rows}
    keys = ("plugin_share_mb", "rows_held_mb", "collector_peak_mb", "train_peak_mb", "server_peak_mb",
            "plain_peak_mb")
    ratios = {key: by_length[longest][key] / by_length[reference][key] if by_length[reference][key] > 0 else None
              for key in keys}

    def verdict(key: str, goal: bool = True) -> str:
        low, high, ratio = by_length[reference][key], by_length[longest][key], ratios[key]
        text = f"{low:,.1f} -> {high:,.1f} MB"
        if ratio is None:
            return text
        if high < 0:  # the capturing server peaked lower than the plain one: the difference is their noise
            return f"{text} (below the noise of two servers' peaks)"
        return f"{text}, {ratio:.2f}x" + (f" ({'met' if ratio <= FLAT_GOAL else 'missed'})" if goal else "")

    dropped = {f"{row['length']}: {reason}": count for row in rows for reason, count in row["dropped"].items()}
    summary = {"reference_length": reference, "longest_length": longest, "ratios_longest_over_reference": ratios,
               "flat_goal": FLAT_GOAL, "context_length": context_length, "dropped": dropped}
    notes = [
        f"the tiny target (hidden 128, 8 layers, bf16) on {config.device}, context {context_length:,}, prefill "
        f"chunked at {config.chunk_tokens:,}, parts of {config.part_tokens:,} rows; per length one request of "
        f"length - {config.new_tokens} random prompt ids and {config.new_tokens} greedy tokens to each server, "
        f"the capturing one's tagged (generate mode)",
        "server: the scheduler process's peak RSS (VmHWM, reset before the request) above its RSS before it, until "
        "the response and, capturing, until the collector held the record; plugin share = capturing - no plugin; "
        "most_rows_held: the plugin's gauge (over the server's life so far) x bytes of one row",
        f"training: `eagle-tap train` on the record of that length alone, batch 1, max_length "
        f"{config.train_max_length:,}, {config.train_steps} steps, TTT {config.ttt_steps}: the whole process's peak "
        f"RSS (imports and target weights included)",
        f"{reference:,} -> {longest:,} tokens (goal <= {FLAT_GOAL}x): plugin share {verdict('plugin_share_mb')}, "
        f"its most_rows_held {verdict('rows_held_mb')}; collector {verdict('collector_peak_mb')}; training process "
        f"{verdict('train_peak_mb')}; SGLang's own forward (no plugin) {verdict('plain_peak_mb', goal=False)}, the "
        f"capturing server in all {verdict('server_peak_mb', goal=False)}",
        f"captures dropped: {', '.join(f'{key} {count}' for key, count in dropped.items()) or 'none'}",
    ]
    return {"title": "Long records: peak memory of capture, collector and training against record length",
            "parameters": asdict(config), "columns": COLUMNS, "rows": rows, "summary": summary, "notes": notes}


def run(config: Config) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="eagle-tap-bench-long-"))
    context_length = max(config.lengths) + 1024
    model = long_target(context_length, work / "target")
    spool_dir = work / "spool"
    server_args = ("--chunked-prefill-size", str(config.chunk_tokens), "--context-length", str(context_length))
    collector = CollectorProcess(work / "collector" / "data", extra_args=("--seal-after-s", "1"))
    servers = {
        "capturing": SGLangServer(ServerConfig(
            model_path=model, device=config.device, log_path=work / "capturing.log", extra_args=server_args,
            env={"EAGLE_TAP_COLLECTOR_URL": collector.url, "EAGLE_TAP_SPOOL_DIR": str(spool_dir),
                 "EAGLE_TAP_PART_MAX_TOKENS": str(config.part_tokens)})),
        "plain": SGLangServer(ServerConfig(model_path=model, device=config.device, log_path=work / "plain.log",
                                           extra_args=server_args, env={"SGLANG_PLUGINS": "none-loaded"})),
    }
    rows = []
    try:
        start_all(list(servers.values()))
        for length in config.lengths:
            rows.append(measure_length(length, config, servers, collector, spool_dir))
        for server in servers.values():  # training gets the cores and the memory to itself
            server.stop()
        collector.stop()  # seals its open shard
        shards = collector.data_dir
        inputs = train_inputs(model, shards, config, work)
        for row in rows:
            row.update(train_one(row["length"], model, shards, inputs, config, work))
    finally:
        for server in servers.values():
            server.stop()
        collector.stop()
        shutil.rmtree(work, ignore_errors=True)

    return report(config, rows, context_length)
