"""`eagle-tap demo`: the whole pipeline on this machine, from a live server to a draft SGLang can serve.

Stages (each timed; all files under one out_dir):
1. split the bundled conversations into a training and a held-out set (every `heldout_every`-th one);
2. start a collector and a CPU SGLang server with the capture plugin, serving the bundled tiny target;
3. while ordinary untagged chat requests keep coming, `fire --regenerate` the training set (the target
   answers each turn and the plugin captures prompt + answer as it is generated, in one pass); the
   plugin also captures that ordinary traffic as live records (`live_sample_rate`; the questions
   come from the training set, so nothing held out is trained on), which join the training shards
   and are reported apart. Then the traffic stops, its last live records are stored, the collector
   restarts on the same port with a second data directory and the held-out set is fired, so the two
   never share a shard;
4. stop every process the demo started;
5. vocab mapping, draft config, a short training run, offline evaluation against the baselines, export;
6. serve the exported draft (and the run's untrained initialisation) with SGLang's EAGLE-3 speculative
   decoding and answer the held-out conversations with and without it: SGLang's own acceptance
   figures, the decode speed ratio, and whether every output equals the no-draft one.

What must hold: every process started is stopped on success, on error and on Ctrl-C (checked at the
end: `summary["processes_left"]` is empty); out_dir is only ever replaced when it holds a demo's own
marker file; the summary's numbers come from the collector's and trainer's own reports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import secrets
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagle_tap.demo import CONVERSATIONS_PATH

__all__ = ["Config", "run_demo"]

MARKER_NAME = ".eagle-tap-demo"


@dataclasses.dataclass(kw_only=True, slots=True)
class Config:
    """One demo run."""

    out_dir: Path
    """Everything the demo writes goes here (captures, runs, logs, export, summary.json)."""
    replace: bool = False
    """Delete out_dir first when it holds an earlier demo (never a folder the demo did not make)."""
    conversations: Path = CONVERSATIONS_PATH
    """JSONL conversations to fire (OpenAI `messages` rows)."""
    num_conversations: int | None = None
    """Use only the first N conversations (None: all)."""
    heldout_every: int = 8
    """Every N-th conversation is held out for evaluation and never trained on."""
    max_new_tokens: int = 128
    """Longest regenerated assistant turn."""
    train_temperature: float = 0.7
    """Sampling temperature of the target's answers in the training set (variety for the draft to learn)."""
    heldout_temperature: float = 0.0
    """Of the held-out answers: greedy, as served speculative decoding is checked, so that the simulated and
    the served acceptance are measured on the same text."""
    fire_concurrency: int = 8
    """Conversations in flight while firing."""
    serving_concurrency: int = 2
    """Threads sending ordinary untagged chat requests while the training set is captured."""
    live_sample_rate: float = 1.0
    """Share of that ordinary traffic the plugin captures as live records (EAGLE_TAP_LIVE_SAMPLE_RATE)."""
    two_pass: bool = False
    """Fire with --two-pass (generate, then capture each sequence by a second prefill) instead of one pass."""
    draft_vocab_size: int = 1024
    """Draft vocabulary (shrunk to the distinct tokens seen when fewer)."""
    train_steps: int = 600
    """Optimizer steps of the training run."""
    ttt_steps: int = 7
    """Test-time-training unroll length while training."""
    batch_size: int = 8
    """Records per training batch."""
    max_length: int = 512
    """Positions per record in training and evaluation (the bundled conversations are shorter)."""
    learning_rate: float = 3e-3
    """Peak learning rate (a tiny draft on little data learns fast)."""
    served_steps: int = 3
    """Draft tokens per verify step when the exported draft is served (compared with eval's k)."""
    served_max_new_tokens: int = 48
    """Tokens generated per held-out conversation when serving with and without the draft."""
    seed: int = 0
    """Seeds the draft's initialisation and the data order."""


def run_demo(config: Config) -> dict[str, Any]:
    """Runs every stage, prints the summary, writes out_dir/summary.json and returns it."""
    out = prepare_out_dir(config.out_dir, replace=config.replace)
    started_s = time.monotonic()
    timings: dict[str, float] = {}
    summary: dict[str, Any] = {"out_dir": str(out), "target": verify_target()}
    train_data, heldout_data = split_conversations(config, out / "data")
    from client.conversations import count_rows

    summary["conversations"] = {"train": count_rows(train_data), "heldout": count_rows(heldout_data),
                                "source": str(config.conversations)}
    with _timed(timings, "capture"):
        summary["capture"] = capture(config, out, train_data, heldout_data)
    with _timed(timings, "train"):
        summary["training"] = train_draft(config, out)
    with _timed(timings, "eval"):
        summary["evaluation"] = evaluate_draft(config, out)
    with _timed(timings, "export"):
        summary["export"] = export_draft(out)
    with _timed(timings, "served"):
        summary["served"] = serve_drafts(config, out, summary["evaluation"])
    summary["timings_s"] = timings
    summary["wall_s"] = round(time.monotonic() - started_s, 1)
    summary["processes_left"] = summary["capture"]["processes_left"] + still_running(descendants())
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    from eagle_tap.demo.report import format_summary

    print(format_summary(summary), flush=True)
    return summary


@contextlib.contextmanager
def _timed(timings: dict[str, float], stage: str) -> Iterator[None]:
    print(f"\n=== {stage} ===", flush=True)
    started_s = time.monotonic()
    yield
    timings[stage] = round(time.monotonic() - started_s, 1)


def prepare_out_dir(out: Path, *, replace: bool) -> Path:
    """An empty out_dir marked as the demo's; an earlier demo's is removed only with replace=True."""
    out = out.resolve()
    if out.exists() and any(out.iterdir()):
        if not (out / MARKER_NAME).exists():
            raise ValueError(f"{out} exists and is not a demo folder; choose another --out")
        if not replace:
            raise ValueError(f"{out} holds an earlier demo; pass --replace to delete it, or choose another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER_NAME).write_text("made by `eagle-tap demo`; --replace may delete this folder\n")
    return out


def verify_target() -> dict[str, Any]:
    """The bundled tiny target, checked against the digest its build recorded."""
    from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

    info = json.loads((TINY_MODEL_DIR / "BUILD_INFO.json").read_text(encoding="utf-8"))
    digest = hashlib.sha256((TINY_MODEL_DIR / "model.safetensors").read_bytes()).hexdigest()
    if digest != info["model_safetensors_sha256"]:
        raise ValueError(f"{TINY_MODEL_DIR}/model.safetensors does not match BUILD_INFO.json (sha256 {digest}); "
                         f"rebuild it with `{info['build_command']}`")
    model = json.loads((TINY_MODEL_DIR / "config.json").read_text(encoding="utf-8"))
    return {"path": str(TINY_MODEL_DIR), "sha256": digest, "num_layers": model["num_hidden_layers"],
            "hidden_size": model["hidden_size"], "vocab_size": model["vocab_size"],
            "build_command": info["build_command"]}


def split_conversations(config: Config, data_dir: Path) -> tuple[Path, Path]:
    """train.jsonl and heldout.jsonl: every heldout_every-th row is held out."""
    if config.heldout_every < 2:
        raise ValueError(f"heldout_every must be at least 2, not {config.heldout_every}")
    if config.num_conversations is not None and config.num_conversations < 2:
        raise ValueError(f"num_conversations must be at least 2, not {config.num_conversations}")
    rows = [line for line in config.conversations.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = rows[: config.num_conversations]
    heldout = rows[config.heldout_every - 1 :: config.heldout_every]
    train = [row for number, row in enumerate(rows, start=1) if number % config.heldout_every]
    if not heldout or not train:
        raise ValueError(f"{len(rows)} conversations cannot make both a training and a held-out set "
                         f"(every {config.heldout_every}th is held out)")
    data_dir.mkdir(parents=True, exist_ok=True)
    paths = data_dir / "train.jsonl", data_dir / "heldout.jsonl"
    for path, part in zip(paths, (train, heldout)):
        path.write_text("\n".join(part) + "\n", encoding="utf-8")
    return paths


def user_questions(path: Path) -> list[str]:
    """The first user message of every conversation (read as `fire` reads them): the ordinary traffic's prompts."""
    from client.conversations import Conversation, read_conversations

    questions = []
    for item in read_conversations(path):
        if isinstance(item, Conversation):
            questions += [message["content"] for message in item.messages if message["role"] == "user"][:1]
    if not questions:
        raise ValueError(f"{path} holds no conversation with a user message")
    return questions


def capture(config: Config, out: Path, train_data: Path, heldout_data: Path) -> dict[str, Any]:
    """Stages 2-4: collector + server with the plugin, both fire runs under ordinary traffic, everything stopped."""
    from eagle_tap.demo.traffic import ServingTraffic
    from eagle_tap.serve.sglang_server import ServerConfig, SGLangServer, free_port
    from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

    token = secrets.token_hex(16)
    collector_port = free_port()
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    plugin_env = {"EAGLE_TAP_COLLECTOR_URL": f"http://127.0.0.1:{collector_port}", "EAGLE_TAP_TOKEN": token,
                  "EAGLE_TAP_SPOOL_DIR": str(out / "spool"), "EAGLE_TAP_LIVE_SAMPLE_RATE": str(config.live_sample_rate)}
    result: dict[str, Any] = {"collector": {}, "fire": {}, "two_pass": config.two_pass}
    started: dict[int, Any] = {}  # every process seen below us once all are up: the stops must end them all

    def remember() -> None:
        started.update((process.pid, process) for process in descendants())

    with contextlib.ExitStack() as stack:
        collector = start_collector(stack, out / "captures" / "train", collector_port, token)
        print(f"collector {collector.url} -> {collector.data_dir}", flush=True)
        print("starting SGLang (CPU) with the capture plugin ...", flush=True)
        server = SGLangServer(ServerConfig(model_path=TINY_MODEL_DIR, env=plugin_env, log_path=logs / "sglang.log"))
        traffic = ServingTraffic(server.url, user_questions(train_data), concurrency=config.serving_concurrency)
        stack.callback(traffic.stop)  # registered first, runs after the server's stop: no wait on a stuck server
        stack.enter_context(server)
        remember()
        print(f"SGLang {server.url} (log: {logs / 'sglang.log'})", flush=True)
        traffic.start()
        for name, data_path in (("train", train_data), ("heldout", heldout_data)):
            if name == "heldout":  # a fresh data directory on the same port: the held-out set gets its own shards
                result["serving"] = traffic.stop()  # no live record may reach the held-out shards
                _wait_for_live_records(collector, token, out / "spool", result["fire"]["train"]["num_records"])
                result["collector"]["train"] = stop_collector(collector, token)
                result["live"] = {**_live_records(collector.data_dir), "sample_rate": config.live_sample_rate}
                collector = start_collector(stack, out / "captures" / "heldout", collector_port, token)
                remember()
                print(f"collector restarted -> {collector.data_dir}", flush=True)
            temperature = config.heldout_temperature if name == "heldout" else config.train_temperature
            print(f"firing the {name} conversations (--regenerate, temperature {temperature}) ...", flush=True)
            result["fire"][name] = fire(config, server.url, collector.url, token, data_path,
                                        out / "runs" / f"fire-{name}", temperature)
        result["collector"]["heldout"] = stop_collector(collector, token)
        result["plugin"] = _plugin_stats(out / "spool")
    result["processes_started"] = len(started)
    result["processes_left"] = still_running(list(started.values()))
    result["shards"] = {name: str(out / "captures" / name) for name in ("train", "heldout")}
    return result


def start_collector(stack: contextlib.ExitStack, data_dir: Path, port: int, token: str,
                     extra_args: tuple[str, ...] = ()):
    """A collector writing out_dir/captures/<name> (data_dir), logging to out_dir/logs, stopped by the stack."""
    from eagle_tap.testbed.collector_process import CollectorProcess

    # The token goes through the environment: a --token flag would show in the process list.
    collector = CollectorProcess(data_dir, port=port, env={"EAGLE_TAP_COLLECTOR_TOKEN": token}, extra_args=extra_args,
                                 log_path=data_dir.parent.parent / "logs" / "collector.log")
    stack.callback(collector.stop)
    return collector


def _wait_for_live_records(collector, token: str, spool_dir: Path, num_fired: int,
                           timeout_s: float = 120.0) -> None:
    """Once the ordinary traffic stopped: waits until the collector holds every live record the plugin
    captured (next to the fired ones), so none is spooled into the held-out directory."""
    deadline = time.monotonic() + timeout_s
    while True:
        captured = _plugin_stats(spool_dir).get("captured_live", 0)
        stored = collector.stats(token)["num_records"] - num_fired
        if stored >= captured:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the collector holds {stored} of the {captured} live records the plugin captured "
                               f"after {timeout_s:.0f} s; see {spool_dir}")
        time.sleep(0.2)


def _live_records(shard_dir: Path) -> dict[str, Any]:
    """How many live records (and tokens) a sealed shard directory holds."""
    import capture_format as cf

    with cf.ShardDirectory(shard_dir) as shards:
        live = [entry for entry in shards.iter_index() if entry.record_id.startswith("live-")]
    return {"num_records": len(live), "num_tokens": sum(entry.num_tokens for entry in live)}


def stop_collector(collector, token: str) -> dict[str, Any]:
    """The collector's own totals, read just before it is stopped (SIGTERM seals its open shard)."""
    stats = collector.stats(token)
    collector.stop()
    return {key: stats[key] for key in ("num_records", "num_tokens", "raw_nbytes", "stored_nbytes", "frame_nbytes",
                                        "compression_ratio", "num_duplicates", "num_rejects", "durability")}


def fire(config: Config, server_url: str, collector_url: str, token: str, data_path: Path, run_dir: Path,
         temperature: float):
    """`eagle-tap fire` of one conversation file at the server, every record confirmed by the collector."""
    from client.endpoints import HttpConfig
    from client.fire import FireConfig, run_fire
    from client.regenerate import SamplingConfig

    fire_config = FireConfig(
        server_url=server_url, collector_url=collector_url, data_path=data_path, run_dir=run_dir, mode="regenerate",
        two_pass=config.two_pass,
        run_id=f"demo-{data_path.stem}", concurrency=config.fire_concurrency, collector_token=token,
        sampling=SamplingConfig(temperature=temperature, max_new_tokens=config.max_new_tokens),
        http=HttpConfig(max_connections=2 * config.fire_concurrency + 4))
    exit_code = run_fire(fire_config)
    if exit_code == 130:  # fire took the signal itself; from here on the stops must not be cut short
        from capture_format.command_line import ignore_further_signals

        ignore_further_signals()
        raise KeyboardInterrupt
    totals = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))["totals"]
    states = totals["records_by_state"]
    if exit_code != 0:  # a record still in flight could land in the next (held-out) data directory
        raise RuntimeError(f"fire of {data_path.name} did not end with every record stored: {states['confirmed']} "
                           f"confirmed, {states['failed']} failed {totals['failed_by_reason']}, {states['served']} "
                           f"served and {states['sent']} sent but unconfirmed; see {run_dir}/manifest.sqlite and "
                           f"the logs in {run_dir.parent.parent / 'logs'}")
    return {"exit_code": exit_code, "run_dir": str(run_dir), "num_samples": totals["num_samples"],
            "num_records": totals["num_records"], "num_tokens": totals["num_tokens"],
            "num_loss_tokens": totals["num_loss_tokens"], "records_by_state": totals["records_by_state"],
            "failed_by_reason": totals["failed_by_reason"]}


def _plugin_stats(spool_dir: Path) -> dict[str, Any]:
    """The plugin's counters as of now (a snapshot written after this call)."""
    from sglang_patch.stats import read_stats_file

    return read_stats_file(spool_dir / "dp0" / "stats.json", newer_than=time.time())


def train_draft(config: Config, out: Path) -> dict[str, Any]:
    """Vocab mapping from the training captures, draft config, and a short training run."""
    from trainer.config import Config as TrainConfig
    from trainer.config import DataConfig, ObjectiveConfig, OptimizerConfig
    from trainer.draft_config import build_draft_config
    from trainer.train import train
    from trainer.vocab import build_vocab_mapping, coverage_report

    from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

    shards = out / "captures" / "train"
    mapping, counts = build_vocab_mapping(target_dir=TINY_MODEL_DIR, draft_vocab_size=config.draft_vocab_size,
                                          out_dir=out / "vocab", shard_dir=shards, if_fewer="shrink")
    print(coverage_report(counts, mapping), flush=True)
    draft_config = build_draft_config(TINY_MODEL_DIR, draft_vocab_size=int(mapping.d2t.size))
    draft_config_path = out / "draft-config.json"
    draft_config_path.write_text(json.dumps(draft_config, indent=2) + "\n", encoding="utf-8")
    run_dir = out / "runs" / "train"
    summary = train(TrainConfig(
        target=str(TINY_MODEL_DIR), draft_config=str(draft_config_path), vocab=str(out / "vocab"),
        out_dir=str(run_dir), seed=config.seed,
        data=DataConfig(shards=str(shards), batch_size=config.batch_size, max_length=config.max_length,
                        seed=config.seed),
        objective=ObjectiveConfig(ttt_steps=config.ttt_steps),
        optimizer=OptimizerConfig(learning_rate=config.learning_rate, warmup_steps=max(1, config.train_steps // 10)),
        num_steps=config.train_steps, log_every=max(1, config.train_steps // 20), checkpoint_every=0,
        eval_shards=str(out / "captures" / "heldout"), eval_every=0,
        progress_bar=sys.stderr.isatty()))  # a bar in a terminal; no redrawn lines in a log file
    first, last = summary["first_logged"], summary["last_logged"]
    return {"run_dir": str(run_dir), "steps": summary["step"], "draft_vocab_size": int(mapping.d2t.size),
            "vocab_coverage": mapping.meta["coverage"], "num_loss_tokens_counted": int(counts.sum()),
            "first_loss": first["loss"], "first_loss_step": first["step"], "last_loss": last["loss"],
            "last_step0_accuracy": last["step_accuracy"][0],
            "heldout_step_accuracy": summary["eval"]["step_accuracy"],
            "plots": [str(run_dir / name) for name in ("loss.png", "accuracy.png")]}


def evaluate_draft(config: Config, out: Path) -> dict[str, Any]:
    from trainer.evaluate import evaluate, format_table, write_result

    result = evaluate(out / "runs" / "train", out / "captures" / "heldout", max_length=config.max_length,
                      served_max_new_tokens=config.served_max_new_tokens)
    path = write_result(result, out / "runs" / "eval")
    return {"eval_json": str(path), "plot": str(path.parent / "acceptance.png"), "table": format_table(result),
            "num_records": result["num_records"], "num_start_positions": result["num_start_positions"],
            "acceptance_length": {name: values["acceptance_length"] for name, values in result["drafts"].items()},
            "served_walk_acceptance_length": {name: values["served_walk_acceptance_length"]
                                              for name, values in result["drafts"].items()},
            "step_accuracy": {name: values["step_accuracy"] for name, values in result["drafts"].items()}}


def export_draft(out: Path) -> dict[str, Any]:
    from trainer.export import export

    folder = export(out / "runs" / "train", out / "draft", eval_result=out / "runs" / "eval" / "eval.json")
    return {"path": str(folder), "files": sorted(path.name for path in folder.iterdir())}


def serve_drafts(config: Config, out: Path, evaluation: dict[str, Any]) -> dict[str, Any]:
    """The held-out records' last turns answered greedily by SGLang without a draft, with the trained draft and
    with the untrained one (one server at a time); SGLang's acceptance figures beside eval's simulated ones on
    the same records (captured greedily too, so both score the same text)."""
    from trainer.export import export

    from eagle_tap.serve.draft import SpeculativeConfig
    from eagle_tap.serve.evaluate import generate_with_and_without, plot_served, prompts_from_shards, summarize
    from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

    drafts = {"draft": out / "draft", "untrained": export(out / "runs" / "train", out / "draft-untrained",
                                                          untrained=True)}
    prompts, _ = prompts_from_shards(out / "captures" / "heldout")
    served_dir = out / "runs" / "served"
    served_dir.mkdir(parents=True, exist_ok=True)
    speculative = {name: SpeculativeConfig(draft_dir=folder, num_steps=config.served_steps)
                   for name, folder in drafts.items()}
    print(f"serving with each draft and without ({len(prompts)} held-out conversations, greedy) ...", flush=True)
    runs, mismatches = generate_with_and_without(TINY_MODEL_DIR, prompts, speculative,
                                                 max_new_tokens=config.served_max_new_tokens, log_dir=out / "logs",
                                                 log=lambda line: print(line, flush=True))
    k_index = evaluation_chain_index(evaluation, config.served_steps)
    results = {}
    for name in drafts:
        result = summarize(prompts, runs["baseline"], runs[name], config.served_steps)
        result["simulated_acceptance_length"] = evaluation["acceptance_length"][name][k_index]
        result["simulated_walk_acceptance_length"] = evaluation["served_walk_acceptance_length"][name][k_index]
        result["mismatches"] = mismatches[name]
        results[name] = result
    (served_dir / "eval_served.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    plot_served(results["draft"], served_dir / "acceptance_served.png")
    return {"num_steps": config.served_steps, "max_new_tokens": config.served_max_new_tokens,
            "num_prompts": len(prompts), "results": results, "eval_served_json": str(served_dir / "eval_served.json"),
            "plot": str(served_dir / "acceptance_served.png")}


def evaluation_chain_index(evaluation: dict[str, Any], num_steps: int) -> int:
    """Index of chain length num_steps in eval's acceptance lists (k = 1, 2, ...)."""
    if not 1 <= num_steps <= len(evaluation["acceptance_length"]["draft"]):
        raise ValueError(f"served_steps {num_steps} is outside eval's chain lengths")
    return num_steps - 1


def descendants() -> list:
    """Every process this one started, and theirs (psutil.Process objects)."""
    import psutil

    return psutil.Process().children(recursive=True)


def still_running(processes: list) -> list[str]:
    """'pid command' of each process that is still running (an exited zombie does not count)."""
    import psutil

    left = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{process.pid} {' '.join(process.cmdline())[:120]}")
    return left
