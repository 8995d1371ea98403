"""Live capture on a replica that serves an EAGLE-3 draft: what it costs, and what its records say.

Servers (CPU, the tiny target), each serving the same draft with SGLang's EAGLE-3 speculative decoding, a
chain of `num_steps` drafts (top-k 1), bf16 as the demo serves it: one with the plugin not loaded
(SGLANG_PLUGINS names no plugin), and per rate in `live_rates` one sampling that share of its requests
live, each capturing server with its own collector. The draft is the one the served benchmark serves (a
demo run at `draft_run`'s size: `served.demo_run`), or the exported folder `draft_dir`. Beside them, a server of
the same target without the draft samples `draftless_rate` of the same requests (its own collector): what the
same records cost the capture path on a draftless replica, the like-for-like reference for the sender's and the
collector's cost per token (the draftless capture benchmark's records are 384-token prefills, these ~45-token
generations, and a record's fixed costs weigh per token in proportion).

Workload, as part 2 of the live benchmark: untagged requests, radix cache on, greedy answers of up to
`max_new_tokens`, alternating rounds, every server the same prompts in a round; here each prompt is a
different demo conversation's first user turn (the draft's own domain), rendered with the chat template.
A capturing server's sampled records are stored before the next server's round starts.

Reported per rate:
- served throughput (generated tokens/s) with the plugin / without, median of rounds; the same for server CPU;
- coverage: of the requests `sglang_patch.selection.is_sampled` picks by request id, those whose record
  reads back complete (token ids = prompt + answer, a state for every token but the last);
- the acceptance length the records carry (`served_draft` metadata), pooled over those requests:
  (accepted drafts + verify steps) / verify steps, tokens per verify step; beside it SGLang's meta_info of
  the same requests, by the same definition and by its own `spec_accept_length` (completion tokens / verify
  steps, which also counts the first token, the prefill's); and how many records agree with meta_info;
- capture CPU per captured token over the measured rounds: the plugin's hooks on the scheduler's thread (stats
  `hook_cpu_ns`: after each forward, and after the scheduler processed a batch of a running generate capture),
  its sender thread (`sender_cpu_ns`), its copy thread (`copy_cpu_ns`: the joins of kept rows) and the
  collector's process; and the sender's and the collector's against the draftless server's, same requests.
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle_tap.bench import served
from eagle_tap.bench.capture import start_all, threads_cpu_s, tree_cpu_s
from eagle_tap.bench.live import (
    answer_all,
    chat_tokenizer,
    collector_cpu_storing,
    count_complete,
    demo_prompts,
    frames_out,
    stored_records,
    warm_up,
)
from eagle_tap.testbed.collector_process import CollectorProcess
from eagle_tap.serve.draft import SpeculativeConfig
from eagle_tap.serve.sglang_server import ServerConfig, SGLangServer
from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR
from sglang_patch.selection import is_sampled
from sglang_patch.speculative import METADATA_KEY
from sglang_patch.stats import read_stats_file

LIVE_GOAL = 0.95
"""Served throughput with the plugin at 10% / without."""


@dataclass(kw_only=True, slots=True)
class Config:
    """The draft, the servers and the workload."""

    draft_run: served.Config = field(default_factory=served.Config)
    """Size of the demo run that trains the draft (the served benchmark's run)."""
    draft_dir: str | None = None
    """Serve this exported draft folder (e.g. an earlier demo's `draft/`) instead of training one."""
    num_steps: int = 3
    """Drafts per verify step (a chain)."""
    num_requests: int = 16
    """Requests per server per round, each a different demo conversation's first turn."""
    max_new_tokens: int = 48
    rounds: int = 20
    """Many short rounds rather than a few long ones: on a shared machine a server, with or without the plugin,
    slows down now and then tenfold for tens of seconds (its CPU busy all along), and the median of many
    rounds leaves those rounds out."""
    concurrency: int = 8
    """Requests in flight per server."""
    live_rates: tuple[float, ...] = (0.1, 1.0)
    """EAGLE_TAP_LIVE_SAMPLE_RATE of each capturing server."""
    draftless_rate: float | None = 1.0
    """EAGLE_TAP_LIVE_SAMPLE_RATE of the server without the draft (None: no such server)."""

    @classmethod
    def quick(cls) -> Config:
        return cls(draft_run=served.Config.quick(), rounds=6)


def server_name(rate: float) -> str:
    return f"live{rate:g}"


def draftless_name(rate: float) -> str:
    return f"draftless{rate:g}"


def meta_info_acceptance(meta_infos: list[dict]) -> dict[str, float]:
    """Tokens per verify step pooled over SGLang's meta_info of some requests, two ways: by the records'
    definition, (correct drafts + verify steps) / verify steps, and by SGLang's `spec_accept_length`,
    completion tokens / verify steps."""
    verify_ct = sum(meta["spec_verify_ct"] for meta in meta_infos)
    correct = sum(meta["spec_num_correct_drafts"] for meta in meta_infos)
    completion = sum(meta["completion_tokens"] for meta in meta_infos)
    return {"meta_info": (correct + verify_ct) / verify_ct if verify_ct else float("nan"),
            "meta_info_completion": completion / verify_ct if verify_ct else float("nan")}


def pooled_acceptance(records: dict[str, Any], meta_infos: dict[str, dict], record_ids: list[str]) -> dict[str, Any]:
    """Tokens per verify step over the stored records among record_ids, from their `served_draft` metadata and
    from SGLang's meta_info of the same requests (meta_infos: record id -> meta_info), and how many agree."""
    served = {record_id: records[record_id].metadata[METADATA_KEY] for record_id in record_ids
              if record_id in records and METADATA_KEY in records[record_id].metadata}
    steps = sum(draft["verify_steps"] for draft in served.values())
    accepted = sum(draft["accepted_drafts"] for draft in served.values())
    agreeing = sum((draft["verify_steps"], draft["accepted_drafts"])
                   == (meta_infos[record_id]["spec_verify_ct"], meta_infos[record_id]["spec_num_correct_drafts"])
                   for record_id, draft in served.items())
    return {"records": (accepted + steps) / steps if steps else float("nan"),
            **meta_info_acceptance([meta_infos[record_id] for record_id in served]),
            "records_compared": len(served), "records_agreeing": agreeing}


@contextlib.contextmanager
def spec_servers(config: Config, draft: Path, work: Path) -> Iterator[tuple[dict[str, SGLangServer],
                                                                           dict[str, tuple[float, CollectorProcess]]]]:
    """Started and stopped on exit: ({"absent": the server without the plugin, per rate its capturing server, and
    the draftless capturing server}, {capturing server's name: (rate, its own collector)}), every server but the
    draftless one serving the same draft."""
    speculative = SpeculativeConfig(draft_dir=draft, num_steps=config.num_steps)
    servers: dict[str, SGLangServer] = {}
    capturing: dict[str, tuple[float, CollectorProcess]] = {}

    def add_capturing(name: str, rate: float, served: SpeculativeConfig | None) -> None:
        capturing[name] = (rate, CollectorProcess(work / f"collector-{name}" / "data"))
        servers[name] = SGLangServer(ServerConfig(
            model_path=TINY_MODEL_DIR, speculative=served, log_path=work / f"{name}.log",
            env={"EAGLE_TAP_COLLECTOR_URL": capturing[name][1].url, "EAGLE_TAP_SPOOL_DIR": str(work / f"spool-{name}"),
                 "EAGLE_TAP_LIVE_SAMPLE_RATE": str(rate)}))

    try:
        servers["absent"] = SGLangServer(ServerConfig(model_path=TINY_MODEL_DIR, speculative=speculative,
                                                      log_path=work / "absent.log",
                                                      env={"SGLANG_PLUGINS": "none-loaded"}))
        for rate in config.live_rates:
            add_capturing(server_name(rate), rate, speculative)
        if config.draftless_rate is not None:
            add_capturing(draftless_name(config.draftless_rate), config.draftless_rate, None)
        start_all(list(servers.values()))
        yield servers, capturing
    finally:
        for server in servers.values():
            server.stop()
        for _, collector in capturing.values():
            collector.stop()


def measure(config: Config, draft: Path, work: Path) -> dict[str, Any]:
    """Runs the servers, the rounds and the read-back; returns the measured numbers (see the module docstring)."""
    chat = chat_tokenizer()
    prompts = demo_prompts(chat, config.rounds * config.num_requests)
    if len(prompts) < config.rounds * config.num_requests:
        raise ValueError(f"{config.rounds} rounds of {config.num_requests} different requests need "
                         f"{config.rounds * config.num_requests} demo conversations; the bundled file has {len(prompts)}")
    warmup = prompts[: config.concurrency]  # sent with fresh cache salts: the radix cache keeps nothing of them
    rows: list[dict[str, Any]] = []
    expected: dict[str, list[int]] = {}  # record id -> prompt + answer of every sampled request
    meta_infos: dict[str, dict] = {}  # record id -> SGLang's meta_info of the same request
    absent_meta_infos: list[dict] = []
    stats_after = {}
    with spec_servers(config, draft, work) as (servers, capturing):
        sampled_by: dict[str, list[str]] = {name: [] for name in capturing}  # its sampled requests' record ids
        stats_before = warm_up(servers, capturing, warmup, config.max_new_tokens, config.concurrency, work)
        frames_due = {name: frames_out(stats) for name, stats in stats_before.items()}  # one frame a record
        for number in range(config.rounds):
            batch = prompts[number * config.num_requests : (number + 1) * config.num_requests]
            row: dict[str, Any] = {"round": number}
            for name in list(servers) if number % 2 == 0 else list(reversed(servers)):
                server, rids = servers[name], [f"spec{number}x{name}x{i:04d}" for i in range(len(batch))]
                collector_cpu = threads_cpu_s(capturing[name][1].process.pid) if name in capturing else 0.0
                cpu, started = tree_cpu_s(server.pid), time.perf_counter()
                answers, answered = answer_all(server, batch, config.max_new_tokens, rids, config.concurrency)
                row[f"{name}_s"] = time.perf_counter() - started
                row[f"{name}_cpu_s"] = tree_cpu_s(server.pid) - cpu
                row[f"{name}_tokens"] = sum(len(answer["output_ids"]) for answer in answers)
                if name not in capturing:
                    absent_meta_infos += [answer["meta_info"] for answer in answers]
                    continue
                rate, collector = capturing[name]
                sampled = []
                for rid, ids, answer in zip(rids, batch, answers):
                    if is_sampled(rid, rate):
                        sampled.append(f"live-{rid}")
                        expected[sampled[-1]], meta_infos[sampled[-1]] = ids + answer["output_ids"], answer["meta_info"]
                sampled_by[name] += sampled
                frames_due[name] += len(sampled)
                row[f"{name}_collector_cpu_s"] = collector_cpu_storing(
                    collector, [f"live-{rid}" for rid in answered if is_sampled(rid, rate)], collector_cpu,
                    plugin_stats=(work / f"spool-{name}" / "dp0" / "stats.json", frames_due[name]))
            for name in map(server_name, config.live_rates):  # generated tokens/s (answers may differ a little)
                row[f"{name}_ratio"] = (row[f"{name}_tokens"] / row[f"{name}_s"]) / (row["absent_tokens"] / row["absent_s"])
                row[f"{name}_cpu_ratio"] = row["absent_cpu_s"] / row[f"{name}_cpu_s"]
            rows.append(row)
        for name in capturing:
            stats_after[name] = read_stats_file(work / f"spool-{name}" / "dp0" / "stats.json", newer_than=time.time())
    result: dict[str, Any] = {
        "rounds": rows, "absent_tokens_s": statistics.median(row["absent_tokens"] / row["absent_s"] for row in rows),
        "absent_acceptance": meta_info_acceptance(absent_meta_infos)}  # all its requests, SGLang's own counts
    for name, (rate, collector) in capturing.items():
        records, unreadable, _, _ = stored_records(collector.data_dir, "live-spec")
        ids = sampled_by[name]
        complete = count_complete(records, expected, ids)
        before, after = stats_before[name], stats_after[name]
        tokens = after.get("captured_tokens", 0) - before.get("captured_tokens", 0)

        def per_token_us(spent_s: float) -> float:
            return spent_s * 1e6 / tokens if tokens else float("nan")

        cpu_us = {"hook": per_token_us((after.get("hook_cpu_ns", 0) - before.get("hook_cpu_ns", 0)) / 1e9),
                  "sender": per_token_us((after.get("sender_cpu_ns", 0) - before.get("sender_cpu_ns", 0)) / 1e9),
                  "copy": per_token_us((after.get("copy_cpu_ns", 0) - before.get("copy_cpu_ns", 0)) / 1e9),
                  "collector": per_token_us(sum(row[f"{name}_collector_cpu_s"] for row in rows))}
        entry: dict[str, Any] = {"rate": rate, "ratio": None, "ratio_range": None, "cpu_ratio": None, "acceptance": None}
        if f"{name}_ratio" in rows[0]:  # serves the draft (the draftless server's throughput is not compared)
            ratios = [row[f"{name}_ratio"] for row in rows]
            entry.update(ratio=statistics.median(ratios), ratio_range=[min(ratios), max(ratios)],
                         cpu_ratio=statistics.median(row[f"{name}_cpu_ratio"] for row in rows),
                         acceptance=pooled_acceptance(records, meta_infos, ids))
        result[name] = {**entry,
                        "sampled": len(ids), "complete": complete, "unreadable": unreadable,
                        "coverage": complete / len(ids) if ids else float("nan"),
                        "captured_tokens": tokens, "cpu_us_per_token": {**cpu_us, "total": sum(cpu_us.values())},
                        "hook_calls": after.get("hook_calls", 0) - before.get("hook_calls", 0),
                        "dropped": after.get("dropped") or {}, "hook_errors": after.get("hook_errors", 0)}
    return result


def _per_call_us(entry: dict[str, Any]) -> float:
    """A forward hook call's CPU (the calls that return at once, before any work, are not counted)."""
    calls = entry["hook_calls"]
    return entry["cpu_us_per_token"]["hook"] * entry["captured_tokens"] / calls if calls else float("nan")


def report(config: Config, measured: dict[str, Any], draft_note: str) -> dict[str, Any]:
    """The bench report's entry: a table with one column per rate and one for the draftless server, the notes, and
    `measured` as the summary."""
    names = [server_name(rate) for rate in config.live_rates]
    columns = [["item", "measure", "s"], *([name, f"live {rate:.0%}", "s"] for name, rate in zip(names, config.live_rates))]
    reference = None if config.draftless_rate is None else draftless_name(config.draftless_rate)
    if reference is not None:
        columns.append([reference, f"draftless, live {config.draftless_rate:.0%}", "s"])

    def row(item: str, value, *, draft_only: bool = False) -> dict[str, str]:
        cells = {"item": item, **{name: value(measured[name]) for name in names}}
        if reference is not None:
            cells[reference] = "-" if draft_only else value(measured[reference])
        return cells

    def against_draftless(entry: dict[str, Any]) -> str:
        own, theirs = entry["cpu_us_per_token"], measured[reference]["cpu_us_per_token"]
        return f"{own['sender'] / theirs['sender']:.2f}x, {own['collector'] / theirs['collector']:.2f}x"

    rows = [
        row(f"served throughput / no plugin (generated tok/s, median of {config.rounds} rounds; their range)",
            lambda entry: f"{entry['ratio']:.3f} ({entry['ratio_range'][0]:.2f}-{entry['ratio_range'][1]:.2f})",
            draft_only=True),
        row("server CPU, no plugin / with it (median)", lambda entry: f"{entry['cpu_ratio']:.3f}", draft_only=True),
        row("coverage: complete records / sampled requests",
            lambda entry: f"{entry['coverage']:.4f} ({entry['complete']}/{entry['sampled']}, "
            f"{entry['unreadable']} unreadable)"),
        row("acceptance length, records: (accepted drafts + verify steps) / verify steps",
            lambda entry: f"{entry['acceptance']['records']:.3f}", draft_only=True),
        row("  SGLang meta_info, same requests: (spec_num_correct_drafts + spec_verify_ct) / spec_verify_ct",
            lambda entry: f"{entry['acceptance']['meta_info']:.3f}", draft_only=True),
        row("  SGLang meta_info, same requests: completion_tokens / spec_verify_ct (its spec_accept_length)",
            lambda entry: f"{entry['acceptance']['meta_info_completion']:.3f}", draft_only=True),
        row("  records whose verify steps and accepted drafts equal meta_info's",
            lambda entry: f"{entry['acceptance']['records_agreeing']}/{entry['acceptance']['records_compared']}",
            draft_only=True),
        row("capture CPU per captured token: forward hooks (hook_cpu_ns)",
            lambda entry: f"{entry['cpu_us_per_token']['hook']:.2f} us"),
        row("  forward hook calls that did work; CPU per call",
            lambda entry: f"{entry['hook_calls']:,}; {_per_call_us(entry):.2f} us"),
        row("  sender thread (sender_cpu_ns)", lambda entry: f"{entry['cpu_us_per_token']['sender']:.2f} us"),
        row("  copy thread (copy_cpu_ns: joins of kept rows)",
            lambda entry: f"{entry['cpu_us_per_token'].get('copy', 0.0):.2f} us"),
        row("  collector process", lambda entry: f"{entry['cpu_us_per_token']['collector']:.2f} us"),
        row("  all four (captured tokens)",
            lambda entry: f"{entry['cpu_us_per_token']['total']:.2f} us ({entry['captured_tokens']:,})"),
        *([row("  sender, collector per token / the draftless server's (same requests)", against_draftless,
               draft_only=True)] if reference is not None else []),
    ]
    absent = measured["absent_acceptance"]
    problems = [f"{name}: " + ", ".join([*(f"{count} {reason}" for reason, count in measured[name]["dropped"].items()),
                                          f"{measured[name]['hook_errors']} hook errors"])
                for name in [*names, *([reference] if reference else [])]
                if measured[name]["dropped"] or measured[name]["hook_errors"]]
    notes = [
        f"{config.num_requests} requests per server per round (each a different demo conversation's first turn), "
        f"greedy answers of up to {config.max_new_tokens} tokens, concurrency {config.concurrency}, radix cache on, "
        f"{config.rounds} alternating rounds; goal: served throughput >= {LIVE_GOAL} of no plugin at 10%",
        f"{draft_note}; served as a chain of {config.num_steps} (top-k 1) in bf16 by every server",
        "acceptance length: the records' figure and the first meta_info figure count tokens per verify step "
        "(accepted drafts + 1); completion_tokens / spec_verify_ct also counts the first token, which the prefill "
        "produced, and leaves out what a finished request's last step accepted past its end (a stop, max_new_tokens)",
        f"no plugin: {measured['absent_tokens_s']:,.1f} generated tok/s (median), acceptance over all its requests "
        f"{absent['meta_info']:.3f} (same definition) / {absent['meta_info_completion']:.3f} (completion tokens)",
        "capture CPU: thread CPU of the plugin's hooks on the scheduler's thread (after each forward, and after the "
        "scheduler processed a batch of a running generate capture), of its sender and copy threads, and the "
        "collector's process CPU from each round's start until its records were stored (its idle CPU included, which "
        "is most of it when few records come), per token of the records captured in the measured rounds",
        *([f"draftless, live {config.draftless_rate:.0%}: the same target without the draft, sent the same requests "
           "and capturing them: what the same records cost the capture path on a draftless replica (its throughput is "
           "not compared: it decodes a token a step)"] if reference is not None else []),
        "captures dropped (by reason) and hook errors: " + ("; ".join(problems) or "none"),
    ]
    rates = " and ".join(f"{rate:.0%}" for rate in config.live_rates)
    return {"title": f"Live capture on a replica serving an EAGLE-3 draft: the plugin at {rates} vs not loaded"
                     + (", and a draftless replica capturing the same requests" if reference is not None else ""),
            "parameters": asdict(config), "columns": columns, "rows": rows, "summary": measured, "notes": notes}


def run(config: Config) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="eagle-tap-bench-spec-capture-"))
    try:
        with contextlib.ExitStack() as stack:
            if config.draft_dir is not None:
                draft, draft_note = Path(config.draft_dir), f"draft {config.draft_dir}"
            else:
                draft, summary = stack.enter_context(served.demo_run(config.draft_run))
                draft_note = (f"the draft of a demo run (as the served benchmark's): trained for "
                              f"{summary['training']['steps']} steps on {summary['conversations']['train']} captured "
                              f"conversations, SGLang acceptance on held-out ones "
                              f"{summary['served']['results']['draft']['acceptance_length']:.3f}")
            measured = measure(config, draft, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report(config, measured, draft_note)
