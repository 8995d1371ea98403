"""Capture benchmark: the same SGLang binary and prompts, with the capture plugin capturing vs. not loaded.

Starts a collector and two SGLang servers of the same model (CPU here): one with the plugin
capturing (EAGLE_TAP_COLLECTOR_URL set), one with the plugin excluded through SGLang's own
allow-list (SGLANG_PLUGINS), which is the same as not installing it. Rounds alternate between the
two so drift on the machine hits both; each round sends the same tagged prefill-only capture
requests (unique cache_salt, max_new_tokens 1) with bounded concurrency. Reports tokens/s per
server per round, the median ratio capturing / not loaded, and the plugin's and collector's counts.

Two ratios, because capture work goes on after the last response: "served" counts until the last
response (what clients see), "stored" until the collector holds every record of the round (what a
capture job gets). Each capturing round is drained before the next round starts, so no capture work
spills into the plain server's round.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import statistics
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from capture_format.tag import CaptureTag
from eagle_tap.testbed.collector_process import CollectorProcess
from sglang_patch.stats import read_stats_file
from eagle_tap.serve.sglang_server import ServerConfig, SGLangServer
from eagle_tap.serve.http_api import post_json
from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

COLUMNS = [
    ["round", "round", "d"],
    ["plain_tokens_s", "plugin not loaded (tok/s)", ",.0f"],
    ["capturing_tokens_s", "plugin capturing, served (tok/s)", ",.0f"],
    ["ratio", "ratio served", ".3f"],
    ["drain_s", "then until stored (s)", ".3f"],
    ["stored_ratio", "ratio stored", ".3f"],
    ["plain_cpu_us_token", "plain server CPU (us/token)", ",.1f"],
    ["capturing_cpu_us_token", "capturing server CPU, until stored (us/token)", ",.1f"],
    ["collector_cpu_us_token", "collector CPU (us/token)", ",.1f"],
]
RATIO_GOAL = 0.90


@dataclass(kw_only=True, slots=True)
class Config:
    """Which model, how many requests of how many tokens, how many rounds."""

    model: str = str(TINY_MODEL_DIR)
    """HF model folder both servers serve."""
    device: str = "cpu"
    num_requests: int = 48
    num_tokens: int = 384
    """Prompt tokens per request."""
    rounds: int = 5
    concurrency: int = 8
    """Requests in flight per server."""

    @classmethod
    def quick(cls) -> Config:
        return cls(rounds=3)


def prompts(model_dir: Path, num_requests: int, num_tokens: int) -> list[list[int]]:
    """num_requests overlapping windows of num_tokens tokens of a Python source file."""
    from transformers import AutoTokenizer

    from eagle_tap.bench.codecs import quiet_transformers

    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        ids = tokenizer(Path(json.__file__).read_text() * 4, add_special_tokens=False)["input_ids"]
    stride = 97
    if (num_requests - 1) * stride + num_tokens > len(ids):
        raise ValueError(f"{num_requests} prompts of {num_tokens} tokens need more text than the bench has")
    return [ids[i * stride : i * stride + num_tokens] for i in range(num_requests)]


def run_round(server: SGLangServer, batch: list[list[int]], round_name: str, concurrency: int) -> float:
    """Seconds to prefill every prompt in `batch` as a tagged capture request (until the last response)."""
    def one(index_ids: tuple[int, list[int]]) -> None:
        index, ids = index_ids
        tag = CaptureTag(record_id=f"{round_name}-{index}", sample_id=f"s{index}", loss_spans=((0, len(ids)),))
        post_json(f"{server.url}/generate", {
            "input_ids": ids, "cache_salt": uuid.uuid4().hex,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0, "custom_params": tag.to_custom_params()},
        }, timeout_s=600)

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, enumerate(batch)))
    return time.perf_counter() - started


def wait_stored(collector: CollectorProcess, num_records: int, timeout_s: float = 120.0) -> tuple[float, int]:
    """Seconds until the collector holds num_records records, asking every 5 ms, and how many times it asked
    (`GET /v1/stats`: `stats_get_cpu_s` is what each cost the collector)."""
    started, asked = time.perf_counter(), 1
    while (stored := collector.stats()["num_records"]) < num_records:
        if time.perf_counter() - started > timeout_s:
            raise RuntimeError(f"the collector holds {stored} of {num_records} records after {timeout_s:.0f} s")
        time.sleep(0.005)
        asked += 1
    return time.perf_counter() - started, asked


def stats_get_cpu_s(collector: CollectorProcess, times: int = 200) -> float:
    """The collector's CPU seconds (`threads_cpu_s`) per `GET /v1/stats` while it stores nothing, over `times` of
    them: what `wait_stored`'s asking added to its CPU, taken off a round's (about 0.6 ms each here, and a round's
    drain asks about a hundred times)."""
    before = threads_cpu_s(collector.process.pid)
    for _ in range(times):
        collector.stats()
    return (threads_cpu_s(collector.process.pid) - before) / times


def tree_cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a process and its live descendants so far."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def threads_cpu_s(pid: int) -> float:
    """CPU seconds of a process's live threads so far, to the nanosecond (`/proc/<pid>/task/*/schedstat`, user and
    system): `tree_cpu_s` counts 10 ms ticks, coarser than a round's work at a low sampling rate (spec-capture at
    10% stores a few milliseconds of records a round). Threads that ended are not counted: for a process whose
    threads live as long as it does, as the collector's (its check threads are a pool's, kept)."""
    total_ns = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total_ns += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return total_ns / 1e9


def main_thread_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process's main thread so far (a collector's: its event loop)."""
    import psutil

    for thread in psutil.Process(pid).threads():
        if thread.id == pid:
            return thread.user_time + thread.system_time
    return 0.0


def start_all(servers: list[SGLangServer]) -> None:
    """Starts the servers at once (start-up is mostly waiting); raises the first failure."""
    with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
        for future in [pool.submit(server.start) for server in servers]:
            future.result()


def run(config: Config) -> dict[str, Any]:
    model = Path(config.model)
    work = Path(tempfile.mkdtemp(prefix="eagle-tap-bench-capture-"))
    batch = prompts(model, config.num_requests, config.num_tokens)
    spool_dir = work / "spool"
    collector = CollectorProcess(work / "collector" / "data")
    capturing = SGLangServer(ServerConfig(model_path=model, device=config.device, log_path=work / "capturing.log", env={
        "EAGLE_TAP_COLLECTOR_URL": collector.url, "EAGLE_TAP_SPOOL_DIR": str(spool_dir)}))
    plain = SGLangServer(ServerConfig(model_path=model, device=config.device, log_path=work / "plain.log",
                                      env={"SGLANG_PLUGINS": "none-loaded"}))
    rows = []
    started = time.perf_counter()
    try:
        start_all([capturing, plain])
        startup_s = time.perf_counter() - started
        num_tokens = sum(map(len, batch))
        run_round(plain, batch[:4], "warmup-plain", config.concurrency)
        run_round(capturing, batch[:4], "warmup-capturing", config.concurrency)
        num_sent = 4
        wait_stored(collector, num_sent)
        stats_before = read_stats_file(spool_dir / "dp0" / "stats.json", newer_than=time.time())
        for round_number in range(config.rounds):
            cpu_before = tree_cpu_s(plain.pid)
            plain_s = run_round(plain, batch, f"plain-{round_number}", config.concurrency)
            plain_cpu_s = tree_cpu_s(plain.pid) - cpu_before
            cpu_before, collector_before = tree_cpu_s(capturing.pid), threads_cpu_s(collector.process.pid)
            capturing_s = run_round(capturing, batch, f"capturing-{round_number}", config.concurrency)
            num_sent += len(batch)
            drain_s, asked = wait_stored(collector, num_sent)
            capturing_cpu_s = tree_cpu_s(capturing.pid) - cpu_before
            collector_cpu_s = threads_cpu_s(collector.process.pid) - collector_before
            rows.append({"round": round_number, "plain_tokens_s": num_tokens / plain_s,
                         "capturing_tokens_s": num_tokens / capturing_s, "ratio": plain_s / capturing_s,
                         "drain_s": drain_s, "stored_ratio": plain_s / (capturing_s + drain_s),
                         "plain_cpu_us_token": plain_cpu_s / num_tokens * 1e6,
                         "capturing_cpu_us_token": capturing_cpu_s / num_tokens * 1e6,
                         "collector_cpu_s": collector_cpu_s, "asked": asked})
        plugin_stats = read_stats_file(spool_dir / "dp0" / "stats.json", newer_than=time.time())
        stored_stats = collector.stats()
        asking_s = stats_get_cpu_s(collector)
        for row in rows:  # the collector's CPU storing the round's records, less the asking
            row["collector_cpu_us_token"] = (row.pop("collector_cpu_s") - row["asked"] * asking_s) / num_tokens * 1e6
    finally:
        capturing.stop()
        plain.stop()
        collector.stop()
        shutil.rmtree(work, ignore_errors=True)

    ratio = statistics.median(row["ratio"] for row in rows)
    stored_ratio = statistics.median(row["stored_ratio"] for row in rows)
    measured_tokens = plugin_stats.get("captured_tokens", 0) - stats_before.get("captured_tokens", 0)

    def per_token_us(counter: str) -> float:
        spent_ns = plugin_stats.get(counter, 0) - stats_before.get(counter, 0)
        return spent_ns / 1e3 / measured_tokens if measured_tokens else float("nan")

    hook_us, hook_cpu_us, sender_us = per_token_us("hook_ns"), per_token_us("hook_cpu_ns"), per_token_us("sender_cpu_ns")
    copy_us = per_token_us("copy_cpu_ns")
    plain_cpu_us = statistics.median(row["plain_cpu_us_token"] for row in rows)
    capturing_cpu_us = statistics.median(row["capturing_cpu_us_token"] for row in rows)
    collector_cpu_us = statistics.median(row["collector_cpu_us_token"] for row in rows)
    # Capture's own CPU (thread CPU of the hook and the sender, the collector's process): unlike wall
    # time it does not grow when other work preempts us. The server's CPU per token also counts its
    # idle polling, so it grows when rounds slow down: the CPU ratio is a bound, best on a quiet machine.
    capture_cpu_us = hook_cpu_us + sender_us + copy_us + collector_cpu_us
    capture_cpu_ratio = plain_cpu_us / (plain_cpu_us + capture_cpu_us)
    dropped = plugin_stats.get("dropped") or {}  # reason -> count
    dropped_text = ", ".join(f"{count} {reason}" for reason, count in dropped.items()) or "none"
    summary = {
        "median_ratio": ratio, "median_stored_ratio": stored_ratio, "ratio_goal": RATIO_GOAL,
        "server_startup_s": startup_s,
        "hook_us_per_token": hook_us, "hook_cpu_us_per_token": hook_cpu_us, "sender_cpu_us_per_token": sender_us,
        "copy_cpu_us_per_token": copy_us,
        "capture_cpu_us_per_token": capture_cpu_us,
        "plain_cpu_us_per_token": plain_cpu_us, "capturing_cpu_us_per_token": capturing_cpu_us,
        "collector_cpu_us_per_token": collector_cpu_us, "collector_stats_get_ms": asking_s * 1e3,
        "cpu_ratio": capture_cpu_ratio,
        "plugin": {key: plugin_stats.get(key) for key in
                   ("captured", "captured_tokens", "bytes_raw", "bytes_stored", "dropped")},
        "collector": {key: stored_stats.get(key) for key in ("num_records", "compression_ratio")},
    }
    notes = [
        f"{config.num_requests} requests x {config.num_tokens} tokens, concurrency {config.concurrency}, "
        f"model {model.name} on {config.device}, {config.rounds} alternating rounds after a warm-up",
        f"median ratio capturing / not loaded: **{ratio:.3f}** served (goal >= {RATIO_GOAL:.2f}), "
        f"**{stored_ratio:.3f}** stored; the plugin's sender and the collector share the server's cores here",
        f"capture CPU per captured token: scheduler thread in the hook {hook_cpu_us:.2f} us CPU "
        f"({hook_us:.2f} us wall), sender thread {sender_us:.2f} us, copy thread {copy_us:.2f} us, "
        f"collector {collector_cpu_us:.2f} us (less "
        f"this benchmark's asking: {asking_s * 1e3:.2f} ms of its CPU a GET of /v1/stats, "
        f"{statistics.median(row['asked'] for row in rows):.0f} a round): "
        f"**{capture_cpu_us:.2f} us** in all, against {plain_cpu_us:.1f} us of the plain server (median; it "
        f"counts its idle polling too); CPU ratio plain / (plain + capture) **{capture_cpu_ratio:.3f}**: read the "
        f"goal against it when other work shares the machine",
        f"plugin: captured {plugin_stats.get('captured')} records, {plugin_stats.get('captured_tokens')} tokens, "
        f"raw {plugin_stats.get('bytes_raw', 0) / 1e6:.1f} MB -> "
        f"stored {plugin_stats.get('bytes_stored', 0) / 1e6:.1f} MB, "
        f"dropped {dropped_text}; collector: {stored_stats.get('num_records')} records, "
        f"compression ratio {stored_stats.get('compression_ratio')}",
    ]
    return {"title": "Capture throughput: SGLang with the plugin capturing vs not loaded",
            "parameters": asdict(config), "columns": COLUMNS, "rows": rows, "summary": summary, "notes": notes}
