"""Capture at Kimi-K2.5's width: what each stage costs per token, and the cores it takes at a production rate.

Kimi-K2.5's states are 4 x 7168 bf16 = 57,344 bytes a token (three aux layers and the final state); a TP8
engine of it makes about 30,000 tokens/s, 1.7 GB/s of raw states. Two parts, one run:

1. The sender alone (no SGLang), `num_captures` captures of `capture_tokens` tokens of residual-like bf16
   states (Gaussian with a log-normal scale per channel) at `hidden_size`, K=3:
   - encoding only: `capture_format.encode_frame` (bf16-split, the bf16 default) on a pool of 1, 2, ... threads
     of this process, `trials` times each: MB/s of raw states in all and per thread;
   - the plugin's `Sender` with `sender_threads` = each count, against a real collector process (fsync): MB/s
     of raw states from the first submit to the last acknowledgement, the sender's CPU (`sender_cpu_ns`: its
     thread and its encoders) and the collector process's CPU per token.
2. Served (CPU SGLang servers): a random thin Llama target of that width (`num_layers` layers, 2 heads of 64,
   intermediate 256: attention and MLP far narrower than the residual stream, so a CPU forward stays cheap,
   while every state the plugin captures has the full width), per mode (draftless; serving a random EAGLE-3
   draft of the same width, a chain of `num_steps`) one server without the plugin (SGLANG_PLUGINS names no
   plugin) and one per live rate with its own collector; alternating rounds of `num_requests` untagged greedy
   requests (windows of a Python source file), every server the same prompts in a round. One more server, the
   same thin target at hidden 128 capturing all it serves, gives the scheduler thread's CPU at hidden 128.

Reported per capturing server: served generated tokens/s over the no-plugin server's (median of rounds), and
per captured token: the plugin's forward hooks on the scheduler's thread (`hook_cpu_ns`), its sender
(`sender_cpu_ns`), the collector's process CPU (idle included) over the measured rounds, the stored frame bytes;
from those, raw MB/s per core of each stage and the cores each stage needs per 10,000 tokens/s, and for a
TP8 engine (30,000 tokens/s). On a machine that other work shares, the thread-scaling figures are noisy:
the report says how many cores there were and how far the trials spread.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle_tap.bench.capture import prompts as source_prompts
from eagle_tap.bench.capture import main_thread_cpu_s, start_all, threads_cpu_s, tree_cpu_s
from eagle_tap.bench.live import answer_all, collector_cpu_storing, frames_out, warm_up
from eagle_tap.testbed.collector_process import CollectorProcess
from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

KIMI_HIDDEN_SIZE = 7168
NARROW_HIDDEN_SIZE = 128
NUM_AUX_LAYERS = 3
TP8_TOKENS_S = 30_000
"""A production TP8 engine of Kimi-K2.5 (TorchSpec's run: ~3 samples/s of ~10K tokens)."""
PER_CORE_GOAL_MB_S = 215
"""Raw MB/s of states each stage should take per core: 3,750 tokens/s at Kimi's width, 30,000 on 8 cores."""
MODES = ("draftless", "draft")


@dataclass(kw_only=True, slots=True)
class Config:
    """The width, the sender-alone runs, the servers and their workload."""

    hidden_size: int = KIMI_HIDDEN_SIZE
    """Width of the states (the wide target's and the sender-alone captures')."""
    thread_counts: tuple[int, ...] = ()
    """Encoder threads to measure the sender alone at; empty: 1, 2 and this machine's cores."""
    trials: int = 2
    """Runs of each sender-alone measure (their spread is reported)."""
    num_captures: int = 24
    capture_tokens: int = 256
    """Tokens per sender-alone capture (256 at 7168: 14.7 MB raw, about half a POST)."""
    modes: tuple[str, ...] = MODES
    """Served modes: `draftless`, `draft` (serving a random EAGLE-3 draft)."""
    live_rates: tuple[float, ...] = (0.1, 1.0)
    num_layers: int = 8
    """Decoder layers of the thin targets (default capture layers 3/5/6)."""
    num_steps: int = 3
    """Drafts per verify step (a chain) in `draft` mode."""
    num_requests: int = 8
    """Requests per server per round (all in flight at once: one decode batch)."""
    prompt_tokens: int = 64
    max_new_tokens: int = 12
    """Few: on a CPU a decode step of the wide target costs its 4,096 x 7168 vocab projection (about 0.1-0.2 s for
    8 rows on a shared 2-core machine), and a random draft's steps its 3H -> H input projection."""
    rounds: int = 4
    concurrency: int = 8
    server_sender_threads: int = 0
    """EAGLE_TAP_SENDER_THREADS of the capturing servers; 0: the plugin's default for the width and cores."""

    def __post_init__(self) -> None:
        unknown = [mode for mode in self.modes if mode not in MODES]
        if unknown or "draftless" not in self.modes:
            raise ValueError(f"modes must be draftless (where the hidden-128 server runs) and maybe draft; got "
                             f"{self.modes!r}")
        if self.hidden_size % 64 or self.hidden_size < NARROW_HIDDEN_SIZE:
            raise ValueError(f"hidden_size must be a multiple of 64 of at least {NARROW_HIDDEN_SIZE}; got {self.hidden_size}")
        if 1.0 not in self.live_rates:
            raise ValueError(f"live_rates must include 1.0 (the rate the hidden-128 server is compared at); got "
                             f"{self.live_rates!r}")

    @classmethod
    def quick(cls) -> Config:
        return cls(thread_counts=(1, 2), trials=1, num_captures=8, capture_tokens=128, modes=("draftless",),
                   live_rates=(1.0,), num_layers=8, num_requests=4, prompt_tokens=32, max_new_tokens=8, rounds=2,
                   concurrency=4)


def raw_bytes_per_token(hidden_size: int) -> int:
    return (NUM_AUX_LAYERS + 1) * hidden_size * 2


# The sender alone ---------------------------------------------------------------------------------

def capture_states(config: Config):
    """bf16 bits (T, K+1, H) of one capture, shared by every capture of a run (read-only)."""
    from eagle_tap.bench.codecs import residual_like_states

    bits = residual_like_states(config.capture_tokens * (NUM_AUX_LAYERS + 1), config.hidden_size, seed=0)
    return bits.reshape(config.capture_tokens, NUM_AUX_LAYERS + 1, config.hidden_size)  # (T, K+1, H)


def encode_only(config: Config, threads: int, states) -> dict[str, float]:
    """MB/s of raw states `threads` threads encode num_captures records at (encode_frame, bf16-split)."""
    import numpy as np

    import capture_format as cf

    def record(index: int) -> cf.CaptureRecord:
        return cf.CaptureRecord(
            record_id=f"wide-{index}", sample_id="bench", model_fingerprint="bench@0",
            capture_layers=tuple(range(1, NUM_AUX_LAYERS + 1)), hidden_size=config.hidden_size, dtype="bfloat16",
            token_ids=np.arange(config.capture_tokens, dtype=np.int32), loss_spans=((0, config.capture_tokens),),
            aux=states[:, :NUM_AUX_LAYERS], final=states[:, NUM_AUX_LAYERS])

    records = [record(index) for index in range(config.num_captures)]
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(cf.encode_frame, records[:threads]))  # warm the threads and zstd's contexts
        started = time.perf_counter()
        stored = sum(map(len, pool.map(cf.encode_frame, records)))
        elapsed = time.perf_counter() - started
    raw = config.num_captures * config.capture_tokens * raw_bytes_per_token(config.hidden_size)
    return {"mb_s": raw / elapsed / 1e6, "ratio": raw / stored}


def sender_to_collector(config: Config, threads: int, states, work: Path, *, chunks: int = 1, gap_s: float = 0.0,
                        batch_max_age_s: float = 0.0) -> dict[str, float]:
    """The plugin's Sender with `threads` encoders against a real collector (fsync): raw MB/s, CPU per token (the
    collector's also on its event loop alone), POSTs. Each capture is `chunks` row blocks, one submitted every
    `gap_s` seconds; the sender waits up to `batch_max_age_s` to fill a POST."""
    import torch

    from capture_format.tag import CaptureTag
    from sglang_patch.capture import CapturedSequence
    from sglang_patch.device_copy import HostRows
    from sglang_patch.sender import ModelIdentity, Sender
    from sglang_patch.settings import CaptureSettings
    from sglang_patch.spool import Spool
    from sglang_patch.stats import CaptureStats

    tokens, hidden = config.capture_tokens, config.hidden_size
    rows = torch.from_numpy(states.view("int16")).view(torch.bfloat16)  # (T, K+1, H)
    aux, final = rows[:, :NUM_AUX_LAYERS].reshape(tokens, NUM_AUX_LAYERS * hidden), rows[:, NUM_AUX_LAYERS]
    cuts = [round(index * tokens / chunks) for index in range(chunks + 1)]
    model = ModelIdentity(capture_layers=tuple(range(1, NUM_AUX_LAYERS + 1)), hidden_size=hidden,
                          model_fingerprint="bench@0", state_dtype="bfloat16", codec="bf16-split")
    collector = CollectorProcess(work / "data", extra_args=("--min-free-bytes", "0", "--log-level", "warning"))
    try:
        settings = CaptureSettings(collector_url=collector.url, spool_dir=work / "spool", sender_threads=threads,
                                   sender_nice=0, batch_max_age_s=batch_max_age_s, inflight_max_bytes=8 << 30)
        stats = CaptureStats()
        sender = Sender(settings=settings, model=model, stats=stats, spool=Spool(settings.spool_dir / "dp0", 1 << 30),
                        stats_path=work / "stats.json")
        try:
            pid = collector.process.pid
            collector_cpu_s, loop_cpu_s, started = tree_cpu_s(pid), main_thread_cpu_s(pid), time.perf_counter()
            for index in range(config.num_captures):
                tag = CaptureTag(record_id=f"wide-{threads}-{index}", sample_id="bench", loss_spans=((0, tokens),))
                blocks = [HostRows(aux=aux[start:end], final=final[start:end]) for start, end in zip(cuts, cuts[1:])]
                sender.submit(CapturedSequence(tag=tag, token_ids=list(range(tokens)), chunks=blocks,
                                               loss_spans=tag.loss_spans, num_states=tokens, metadata={}))
                if gap_s:
                    time.sleep(gap_s)
            while stats.snapshot().get("sent", 0) < config.num_captures:
                if time.perf_counter() - started > 600 or stats.snapshot()["dropped"]:
                    raise RuntimeError(f"the sender stored {stats.snapshot().get('sent', 0)} of {config.num_captures} "
                                       f"captures: {stats.summary()}")
                time.sleep(0.005)
            elapsed = time.perf_counter() - started
            collector_cpu_s, loop_cpu_s = tree_cpu_s(pid) - collector_cpu_s, main_thread_cpu_s(pid) - loop_cpu_s
        finally:
            sender.close()
    finally:
        collector.stop()
        shutil.rmtree(work, ignore_errors=True)
    snapshot, num_tokens = stats.snapshot(), config.num_captures * tokens
    return {"mb_s": num_tokens * raw_bytes_per_token(hidden) / elapsed / 1e6,
            "sender_us": snapshot["sender_cpu_ns"] / 1e3 / num_tokens,
            "collector_us": collector_cpu_s * 1e6 / num_tokens,
            "collector_loop_us": loop_cpu_s * 1e6 / num_tokens,
            "stored_bytes": snapshot["bytes_stored"] / num_tokens, "posts": snapshot["posts"]}


def sender_alone(config: Config, work: Path) -> list[dict[str, Any]]:
    states = capture_states(config)
    counts = config.thread_counts or tuple(sorted({1, 2, os.cpu_count() or 1}))
    rows = []
    for trial in range(config.trials):
        for threads in counts:
            rows.append({"part": "encode only", "threads": threads, "trial": trial,
                         **encode_only(config, threads, states)})
            rows.append({"part": "Sender -> collector (fsync)", "threads": threads, "trial": trial,
                         **sender_to_collector(config, threads, states, work / f"sender-{threads}-{trial}")})
    for row in rows:
        one = next(other for other in rows if other["part"] == row["part"] and other["trial"] == row["trial"]
                   and other["threads"] == counts[0])
        row["mb_s_per_thread"] = row["mb_s"] / row["threads"]
        row["speedup"] = row["mb_s"] / one["mb_s"] * counts[0]
    return rows


# Served -------------------------------------------------------------------------------------------

def thin_target(hidden_size: int, num_layers: int, out_dir: Path) -> Path:
    """A random bf16 Llama of this width whose attention (2 heads of 64, 1 KV head) and MLP (256) are thin, with the
    tiny tokenizer's vocab: its states have the width, its forward costs little more than its vocab projection."""
    from eagle_tap.testbed.tiny_model.random import build_wide_llama

    return build_wide_llama(out_dir, hidden_size=hidden_size, num_layers=num_layers, intermediate_size=256, head_dim=64,
                            num_heads=2, num_kv_heads=1)


def server_name(mode: str, rate: float) -> str:
    return f"{mode}-live{rate:g}"


@contextlib.contextmanager
def mode_servers(config: Config, mode: str, targets: dict[int, Path], work: Path) -> Iterator[
        tuple[dict[str, Any], dict[str, tuple[float, CollectorProcess]]]]:
    """Started and stopped on exit: ({"absent": no plugin, per rate a capturing server, draftless also
    "narrow": the hidden-128 target at 100%}, {capturing server's name: (rate, its collector)})."""
    from eagle_tap.bench.swap import random_draft
    from eagle_tap.serve.draft import SpeculativeConfig
    from eagle_tap.serve.sglang_server import ServerConfig, SGLangServer

    wide = targets[config.hidden_size]
    speculative = None
    if mode == "draft":
        speculative = SpeculativeConfig(draft_dir=random_draft(wide, work / "draft", seed=0), num_steps=config.num_steps)
    servers: dict[str, SGLangServer] = {}
    capturing: dict[str, tuple[float, CollectorProcess]] = {}
    extra = ("--max-total-tokens", "16384")

    def plugin_env(name: str, rate: float) -> dict[str, str]:
        capturing[name] = (rate, CollectorProcess(work / f"collector-{name}" / "data"))
        env = {"EAGLE_TAP_COLLECTOR_URL": capturing[name][1].url, "EAGLE_TAP_SPOOL_DIR": str(work / f"spool-{name}"),
               "EAGLE_TAP_LIVE_SAMPLE_RATE": str(rate)}
        if config.server_sender_threads:
            env["EAGLE_TAP_SENDER_THREADS"] = str(config.server_sender_threads)
        return env

    try:
        servers["absent"] = SGLangServer(ServerConfig(model_path=wide, speculative=speculative, extra_args=extra,
                                                      log_path=work / f"{mode}-absent.log",
                                                      env={"SGLANG_PLUGINS": "none-loaded"}))
        for rate in config.live_rates:
            name = server_name(mode, rate)
            servers[name] = SGLangServer(ServerConfig(model_path=wide, speculative=speculative, extra_args=extra,
                                                      log_path=work / f"{name}.log", env=plugin_env(name, rate)))
        if mode == "draftless":
            servers["narrow"] = SGLangServer(ServerConfig(model_path=targets[NARROW_HIDDEN_SIZE], extra_args=extra,
                                                          log_path=work / "narrow.log", env=plugin_env("narrow", 1.0)))
        start_all(list(servers.values()))
        yield servers, capturing
    finally:
        for server in servers.values():
            server.stop()
        for _, collector in capturing.values():
            collector.stop()


def serve_mode(config: Config, mode: str, targets: dict[int, Path], work: Path) -> dict[str, dict[str, Any]]:
    """Alternating rounds on one mode's servers; per capturing server its ratio and per-token costs."""
    from sglang_patch.selection import is_sampled
    from sglang_patch.stats import read_stats_file

    prompts = source_prompts(TINY_MODEL_DIR, (config.rounds + 1) * config.num_requests, config.prompt_tokens)
    rows: list[dict[str, Any]] = []
    stats_after = {}
    with mode_servers(config, mode, targets, work) as (servers, capturing):
        stats_before = warm_up(servers, capturing, prompts[: config.num_requests], config.max_new_tokens,
                               config.concurrency, work, rid_prefix=mode)
        frames_due = {name: frames_out(stats) for name, stats in stats_before.items()}  # one frame a record
        for number in range(config.rounds):
            batch = prompts[(number + 1) * config.num_requests : (number + 2) * config.num_requests]
            row: dict[str, Any] = {}
            for name in list(servers) if number % 2 == 0 else list(reversed(servers)):
                server, rids = servers[name], [f"wide{number}x{mode}x{name}x{i:03d}" for i in range(len(batch))]
                collector_cpu = threads_cpu_s(capturing[name][1].process.pid) if name in capturing else 0.0
                started = time.perf_counter()
                answers, answered = answer_all(server, batch, config.max_new_tokens, rids, config.concurrency)
                row[f"{name}_tokens_s"] = sum(len(answer["output_ids"]) for answer in answers) / \
                    (time.perf_counter() - started)
                if name in capturing:  # the plugin's stats say when its frames went out: the collector is not asked
                    rate, collector = capturing[name]
                    sampled = [f"live-{rid}" for rid in answered if is_sampled(rid, rate)]
                    frames_due[name] += len(sampled)
                    row[f"{name}_collector_cpu_s"] = collector_cpu_storing(
                        collector, sampled, collector_cpu,
                        plugin_stats=(work / f"spool-{name}" / "dp0" / "stats.json", frames_due[name]))
            rows.append(row)
        for name in capturing:
            stats_after[name] = read_stats_file(work / f"spool-{name}" / "dp0" / "stats.json", newer_than=time.time())
    results = {}
    for name, (rate, _) in capturing.items():
        before, after = stats_before[name], stats_after[name]

        def delta(key: str) -> float:
            return after.get(key, 0) - before.get(key, 0)

        tokens = delta("captured_tokens")  # a record's last token has no state: raw_bytes is a little under the width's
        hidden = NARROW_HIDDEN_SIZE if name == "narrow" else config.hidden_size
        us = {"hook": delta("hook_cpu_ns") / 1e3, "sender": delta("sender_cpu_ns") / 1e3,
              "collector": sum(row[f"{name}_collector_cpu_s"] for row in rows) * 1e6}
        results[name] = {
            "mode": mode, "rate": rate, "hidden_size": hidden, "captured_tokens": tokens,
            "ratio": statistics.median(row[f"{name}_tokens_s"] / row["absent_tokens_s"] for row in rows),
            **{f"{stage}_us": spent / tokens if tokens else float("nan") for stage, spent in us.items()},
            "stored_bytes": delta("bytes_stored") / tokens if tokens else float("nan"),
            "raw_bytes": delta("bytes_raw") / tokens if tokens else float("nan"),
            "sender_threads": after.get("sender_threads"), "dropped": after.get("dropped") or {}}
        for stage in ("hook", "sender", "collector"):
            spent = results[name][f"{stage}_us"]
            results[name][f"{stage}_mb_s_per_core"] = results[name]["raw_bytes"] / spent if spent else float("inf")
            results[name][f"{stage}_cores_per_10k"] = spent * 10_000 / 1e6
    return results


# Report -------------------------------------------------------------------------------------------

SERVED_COLUMNS = [
    ["server", "server", "s"],
    ["ratio", "served tok/s / no plugin", ".3f"],
    ["hook_us", "scheduler thread us/token", ".2f"],
    ["sender_us", "sender us/token", ".1f"],
    ["collector_us", "collector us/token", ".1f"],
    ["stored_bytes", "stored B/token", ",.0f"],
    ["hook_cores_per_10k", "cores per 10k tok/s: scheduler", ".3f"],
    ["sender_cores_per_10k", "sender", ".2f"],
    ["collector_cores_per_10k", "collector", ".2f"],
]
SENDER_COLUMNS = [
    ["part", "part", "s"],
    ["threads", "threads", "d"],
    ["trial", "trial", "d"],
    ["mb_s", "raw MB/s", ",.0f"],
    ["mb_s_per_thread", "raw MB/s per thread", ",.0f"],
    ["speedup", "x one thread", ".2f"],
    ["sender_us", "sender CPU us/token", ".1f"],
    ["collector_us", "collector CPU us/token", ".1f"],
]


def run(config: Config) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="eagle-tap-bench-wide-capture-"))
    try:
        sender_rows = sender_alone(config, work / "sender")
        targets = {width: thin_target(width, config.num_layers, work / f"target-{width}")
                   for width in (NARROW_HIDDEN_SIZE, config.hidden_size)}
        served: dict[str, dict[str, Any]] = {}
        for mode in config.modes:
            served |= serve_mode(config, mode, targets, work / mode)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report(config, sender_rows, served)


def report(config: Config, sender_rows: list[dict[str, Any]], served: dict[str, dict[str, Any]]) -> dict[str, Any]:
    wide_rows = [{"server": f"{entry['mode']}, live {entry['rate']:.0%}", **entry}
                 for name, entry in served.items() if name != "narrow"]
    narrow = served["narrow"]
    wide_full = served[server_name("draftless", 1.0)]
    rows = [*wide_rows, {"server": f"draftless, live 100%, hidden {NARROW_HIDDEN_SIZE}", **narrow, "ratio": None}]

    def spread(part: str, threads: int, key: str = "mb_s") -> list[float]:
        return [row[key] for row in sender_rows if row["part"] == part and row["threads"] == threads]

    counts = sorted({row["threads"] for row in sender_rows})
    speedup_2 = {part: spread(part, 2, "speedup") if 2 in counts else []
                 for part in ("encode only", "Sender -> collector (fsync)")}
    per_core = {stage: min(row[f"{stage}_mb_s_per_core"] for row in wide_rows) for stage in ("hook", "sender", "collector")}
    tp8 = {stage: max(row[f"{stage}_cores_per_10k"] for row in wide_rows) * TP8_TOKENS_S / 10_000
           for stage in ("hook", "sender", "collector")}
    summary = {
        "hook_us_wide_over_narrow": wide_full["hook_us"] / narrow["hook_us"] if narrow["hook_us"] else float("nan"),
        "sender_speedup_2_threads": speedup_2,
        "worst_mb_s_per_core": per_core, "tp8_cores": tp8, "served": served, "cores": os.cpu_count(),
        "raw_bytes_per_token": raw_bytes_per_token(config.hidden_size),
    }
    drops = "; ".join(f"{name}: {entry['dropped']}" for name, entry in served.items() if entry["dropped"]) or "none"
    notes = [
        f"width {config.hidden_size}: {raw_bytes_per_token(config.hidden_size):,} raw bytes of states a token (K=3 + final, "
        f"bf16); thin random Llama targets of {config.num_layers} layers (2 heads of 64, MLP 256, vocab 4,096); draft "
        f"mode serves a random EAGLE-3 draft of the same width (chain of {config.num_steps}); {config.num_requests} "
        f"requests of {config.prompt_tokens} prompt tokens per server per round, greedy answers of up to "
        f"{config.max_new_tokens} tokens, concurrency {config.concurrency}, {config.rounds} alternating rounds",
        f"scheduler thread CPU per captured token at {config.hidden_size} / at {NARROW_HIDDEN_SIZE} (draftless, 100%): "
        f"{summary['hook_us_wide_over_narrow']:.2f} (goal <= 2)",
        "sender with 2 threads / 1 thread, per trial: " + "; ".join(
            f"{part}: {', '.join(f'{value:.2f}' for value in values)}" for part, values in speedup_2.items())
        + " (goal >= 1.7)",
        "raw MB/s per core, worst capturing server: " + ", ".join(
            f"{stage} {value:,.0f}" for stage, value in per_core.items()) + f" (goal >= {PER_CORE_GOAL_MB_S} each)",
        f"a TP8 engine ({TP8_TOKENS_S:,} tokens/s, all captured) at these costs: " + ", ".join(
            f"{stage} {cores:.1f} cores" for stage, cores in tp8.items()),
        f"machine: {os.cpu_count()} cores shared by the servers, their collectors, this process and any other work; "
        "thread scaling on fewer cores than threads cannot show, and the trials' spread is the noise",
        f"capturing servers' encoder threads: {sorted({entry['sender_threads'] for entry in served.values()})}; "
        f"captures dropped: {drops}",
    ]
    return {"title": f"Capture at Kimi-K2.5's width (hidden {config.hidden_size}): cost per stage and cores per "
                     "10,000 tokens/s", "parameters": asdict(config), "columns": SERVED_COLUMNS, "rows": rows,
            "tables": [{"title": "The sender alone (no SGLang): encoding threads, and the plugin's Sender against a "
                                 "real collector", "columns": SENDER_COLUMNS, "rows": sender_rows}],
            "summary": summary, "notes": notes}
