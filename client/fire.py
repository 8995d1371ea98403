"""`eagle-tap fire`: send a dataset's conversations to the server as capture requests, and track them.

One asyncio loop, one `httpx.AsyncClient` (endpoints.py), at most `concurrency` samples in flight
(a semaphore taken before a sample's task exists, so memory stays bounded on any dataset size).

What must hold:
- a re-run of the same command resumes: records left `sent`/`served` are checked with the collector
  first, a sample whose records are all confirmed is skipped, a confirmed record is never sent again;
- a bad row, a template the spans cannot trust, or a request that fails after its retries fails that
  sample (with its line and reason, in the manifest), never the run;
- Ctrl-C (or SIGTERM) cancels what is in flight, leaves the manifest consistent, writes the token
  frequencies and the summary, and returns 130.
Tokenizer calls stay on the loop's thread: HF fast tokenizers are not safe to share across threads,
and a render costs milliseconds against the server's prefill.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from capture_format.files import write_file_atomically
from capture_format.tag import CaptureTag
from capture_format.fingerprint import tokenizer_fingerprint
from capture_format.token_frequencies import FREQUENCIES_NAME, write_token_frequencies

from client.confirm import Confirmer
from client.conversations import BadRow, Conversation, count_rows, data_format, read_conversations
from client.endpoints import Endpoints, HttpConfig, RequestFailed, check_url
from client.manifest import Manifest
from client.regenerate import SamplingConfig
from client.report import Progress, RunStats, format_summary
from client.samples import (MODES, RECORDS_PER, PlannedRecord, build_sequences, capture_payload, check_run_id,
                            plan_records)
from client.spans import ChatTokenizer, SpanError

__all__ = ["FireConfig", "run_fire"]

EXIT_INTERRUPTED = 130
SUMMARY_NAME = "summary.json"


@dataclasses.dataclass(kw_only=True, slots=True)
class FireConfig:
    """One `eagle-tap fire` run."""

    server_url: str
    """SGLang server base URL (capture plugin enabled)."""
    collector_url: str
    """Collector base URL, asked whether records are stored."""
    data_path: Path
    """JSONL, Parquet or a `datasets` save_to_disk folder."""
    run_dir: Path
    """Where the manifest, the token frequencies and the summary live; re-use it to resume."""
    mode: str = "as-is"
    """`as-is` (the dataset's answers) or `regenerate` (the target's answers)."""
    records_per: str = "conversation"
    """`conversation` (one record, a span per assistant turn) or `turn` (one record per assistant turn)."""
    tokenizer_path: str | None = None
    """Target tokenizer; default: the server's tokenizer path, when it is a folder here."""
    trust_remote_code: bool = False
    """Run the tokenizer code shipped with the model (needed by tokenizers such as Kimi-K2's)."""
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra chat-template variables (e.g. `{"enable_thinking": true}`)."""
    extra_stop_token_ids: tuple[int, ...] = ()
    """End-of-turn tokens besides the tokenizer's eos and generation_config.json's eos ids."""
    data_split: str | None = None
    """Split of a `datasets` folder holding several."""
    run_id: str | None = None
    """Prefix of every record id; default: a random one, kept in the manifest."""
    concurrency: int = 8
    """Samples in flight at once."""
    max_samples: int | None = None
    """Process only the first N conversations of the dataset."""
    confirm_timeout_s: float = 120.0
    """How long a served record may take to be stored before it is reported unconfirmed."""
    capture_max_new_tokens: int = 0
    """max_new_tokens of capture requests: 0 runs only the prefill (SGLang 0.5.23); use 1 where 0 is refused."""
    two_pass: bool = False
    """In regenerate mode: generate each turn, then capture the whole sequence with a second, prefill-only
    request (the default captures each turn while it is generated, in one pass)."""
    collector_token: str | None = None
    """Bearer token of the collector."""
    progress: str = "auto"
    """Progress bar: `auto` (on a terminal), `on`, `off`."""
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    http: HttpConfig = dataclasses.field(default_factory=HttpConfig)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; available: {', '.join(MODES)}")
        if self.records_per not in RECORDS_PER:
            raise ValueError(f"unknown records-per {self.records_per!r}; available: {', '.join(RECORDS_PER)}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.two_pass and self.mode != "regenerate":
            raise ValueError("--two-pass applies to --regenerate only (as-is captures always take one prefill)")
        if self.capture_max_new_tokens not in (0, 1):
            raise ValueError(f"capture max_new_tokens must be 0 or 1, got {self.capture_max_new_tokens}")
        if self.run_id is not None:
            check_run_id(self.run_id)
        check_url("--server", self.server_url)
        check_url("--collector", self.collector_url)
        data_format(self.data_path)  # a missing or unknown data file is refused before anything starts


class _Run:
    def __init__(self, config: FireConfig, manifest: Manifest, endpoints: Endpoints, chat: ChatTokenizer,
                 run_id: str, progress: Progress) -> None:
        self.config, self.manifest, self.endpoints, self.chat = config, manifest, endpoints, chat
        self.run_id, self.progress = run_id, progress
        self.tokenizer_fingerprint: str | None = None
        """Written into token_frequencies.json so `eagle-tap vocab` refuses it for another tokenizer."""
        self.stats = RunStats()
        self.confirmer = Confirmer(endpoints, manifest, timeout_s=config.confirm_timeout_s)

    def _conversations(self) -> Iterator[Conversation]:
        seen: set[str] = set()
        num_taken = 0
        for item in read_conversations(self.config.data_path, split=self.config.data_split):
            if self.config.max_samples is not None and num_taken >= self.config.max_samples:
                return
            self.stats.num_rows_read += 1
            if isinstance(item, BadRow):
                self._bad_row(item.source, item.line, item.reason)
                continue
            if item.key in seen:
                self.stats.num_duplicate_rows += 1
                self.progress.advance()
                continue
            seen.add(item.key)
            num_taken += 1
            yield item

    def _bad_row(self, source: str, line: int, reason: str) -> None:
        self.stats.num_bad_rows += 1
        self.manifest.add_bad_row(line, source, reason)
        self.progress.note(f"{source}:{line}: bad row: {reason}")
        self.progress.advance()

    async def _recheck_earlier_runs(self) -> None:
        unsettled = self.manifest.in_states("sent", "served")
        if unsettled:
            self.stats.num_rechecked_confirmed = len(await self.confirmer.check_once(unsettled))

    async def work(self) -> None:
        await self._recheck_earlier_runs()
        confirming = asyncio.create_task(self.confirmer.run())
        slots = asyncio.Semaphore(self.config.concurrency)
        tasks: set[asyncio.Task] = set()
        try:
            states = self.manifest.states()
            for conversation in self._conversations():
                planned = plan_records(conversation, run_id=self.run_id, mode=self.config.mode,
                                       records_per=self.config.records_per)
                if not planned:
                    hint = "" if self.config.mode == "regenerate" else " (--regenerate answers prompt-only rows)"
                    self._bad_row(conversation.source, conversation.line, f"no assistant message to capture{hint}")
                    continue
                todo = [record for record in planned if states.get(record.record_id) != "confirmed"]
                if not todo:
                    self.stats.num_samples_skipped += 1
                    self.progress.advance()
                    continue
                await slots.acquire()
                task = asyncio.create_task(self._sample(conversation, planned, todo))
                tasks.add(task)

                def release(done: asyncio.Task) -> None:
                    tasks.discard(done)
                    slots.release()

                task.add_done_callback(release)
            await asyncio.gather(*tasks)
            self.confirmer.finish()
            await confirming
        finally:  # on Ctrl-C: stop everything in flight; a cancelled request leaves its record `sent`
            unfinished = [*tasks, confirming]
            for task in unfinished:
                task.cancel()
            await asyncio.gather(*unfinished, return_exceptions=True)

    def _fail(self, conversation: Conversation, records: list[PlannedRecord], reason: str) -> None:
        self.stats.num_sample_failures += 1
        for record in records:
            self.manifest.mark_failed(record.record_id, sample_key=conversation.key, line=conversation.line,
                                      reason=reason)
        self.progress.note(f"{conversation.source}:{conversation.line}: failed: {reason}")

    async def _generate(self, payload: dict[str, Any]) -> dict[str, Any]:
        self.stats.num_generate_requests += 1
        return await self.endpoints.generate(payload)

    def _metadata(self, conversation: Conversation, turns) -> dict[str, Any]:
        """What a record says of where it came from (no text)."""
        return {"source": conversation.source, "line": conversation.line, "mode": self.config.mode,
                "turns": list(turns)}

    def _tag_generation(self, conversation: Conversation, todo: list[PlannedRecord]):
        """One pass: the tag that has the plugin record a turn while it is generated (`build_sequences`)."""
        wanted = {record.record_id for record in todo}

        def tag(record: PlannedRecord, spans: tuple[tuple[int, int], ...], turns: tuple[int, ...],
                prompt_ids: tuple[int, ...]) -> dict[str, Any] | None:
            if record.record_id not in wanted:
                return None  # stored by an earlier run: the turn is generated for the history only
            metadata = {**self._metadata(conversation, turns), "passes": 1}
            self.manifest.mark_sent(record.record_id, sample_key=conversation.key, line=conversation.line,
                                    num_tokens=len(prompt_ids), num_loss_tokens=sum(end - start for start, end in spans))
            self.stats.num_capture_requests += 1
            return CaptureTag(record_id=record.record_id, sample_id=conversation.key, loss_spans=spans,
                              metadata=metadata, mode="generate").to_custom_params()

        return tag

    async def _sample(self, conversation: Conversation, planned: list[PlannedRecord],
                      todo: list[PlannedRecord]) -> None:
        num_tokens = 0
        served: set[str] = set()
        one_pass = self.config.mode == "regenerate" and not self.config.two_pass
        try:
            sequences, finish_reasons = await build_sequences(
                self.chat, conversation, planned, mode=self.config.mode, generate=self._generate,
                sampling=self.config.sampling,
                tag_generation=self._tag_generation(conversation, todo) if one_pass else None)
            if one_pass:  # every record was captured while its last turn was generated
                for record in todo:
                    sequence = sequences[record.record_id]
                    self.manifest.mark_served(record.record_id, sequence.loss_token_ids(),
                                              num_tokens=len(sequence.input_ids),
                                              num_loss_tokens=sequence.num_loss_tokens)
                    self.confirmer.add(record.record_id)
                    served.add(record.record_id)
                    num_tokens += len(sequence.input_ids)
                todo = []
            for record in todo:
                sequence = sequences[record.record_id]
                metadata = self._metadata(conversation, sequence.turns)
                if finish_reasons:  # per span: `stop` ends with the end-of-turn token, `length` was cut
                    metadata["finish_reasons"] = [finish_reasons[turn] for turn in sequence.turns]
                payload = capture_payload(sequence, record_id=record.record_id, sample_id=conversation.key,
                                          metadata=metadata, max_new_tokens=self.config.capture_max_new_tokens)
                self.manifest.mark_sent(record.record_id, sample_key=conversation.key, line=conversation.line,
                                        num_tokens=len(sequence.input_ids), num_loss_tokens=sequence.num_loss_tokens)
                self.stats.num_capture_requests += 1
                await self.endpoints.generate(payload)
                self.manifest.mark_served(record.record_id, sequence.loss_token_ids())
                self.confirmer.add(record.record_id)
                served.add(record.record_id)
                num_tokens += len(sequence.input_ids)
        except SpanError as err:
            self._fail(conversation, todo, f"template: {err}")
        except RequestFailed as err:
            self._fail(conversation, [record for record in todo if record.record_id not in served], err.reason)
        except Exception as err:  # a bug must not end a long run; it is reported with its traceback
            traceback.print_exc(file=sys.stderr)
            self._fail(conversation, todo, f"error: {type(err).__name__}: {err}")
        self.progress.advance(num_tokens)


def _tokenizer_fingerprint(path: str) -> str | None:
    try:
        return tokenizer_fingerprint(path)
    except ValueError:  # a tokenizer folder without the model's config.json: no fingerprint to give
        return None


def _chat_tokenizer(config: FireConfig, path: str) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(path, extra_stop_token_ids=config.extra_stop_token_ids,
                                         template_kwargs=config.template_kwargs,
                                         trust_remote_code=config.trust_remote_code)


async def _load_chat(config: FireConfig, endpoints: Endpoints) -> tuple[ChatTokenizer, str]:
    """The tokenizer and its path, after one check that the server and the collector answer. A local
    --tokenizer loads first, so a mistake in it is reported before the servers are asked anything."""
    if config.tokenizer_path is not None:
        chat = _chat_tokenizer(config, config.tokenizer_path)
        await endpoints.check_reachable()
        return chat, config.tokenizer_path
    await endpoints.check_reachable()
    info = await endpoints.model_info()
    path = info.get("tokenizer_path") or info.get("model_path")
    if not path or not Path(path).exists():
        raise ValueError(f"the server's tokenizer {path!r} is not a folder on this machine; pass --tokenizer")
    return _chat_tokenizer(config, path), path


def _finish(run: _Run, started_s: float) -> int:
    run.stats.wall_s = time.monotonic() - started_s
    run.progress.close()
    totals = run.manifest.totals()
    write_token_frequencies(run.config.run_dir / FREQUENCIES_NAME, run.manifest.token_counts(),
                            vocab_size=len(run.chat.tokenizer), num_records=totals["num_counted_records"],
                            tokenizer_fingerprint=run.tokenizer_fingerprint)
    summary = {"run_id": run.run_id, "totals": totals, "this_run": dataclasses.asdict(run.stats)}
    write_file_atomically(run.config.run_dir / SUMMARY_NAME, json.dumps(summary, indent=1) + "\n")
    print(format_summary(totals, run.stats), flush=True)
    if run.stats.interrupted:
        return EXIT_INTERRUPTED
    states = totals["records_by_state"]
    return 1 if states["failed"] or states["served"] or states["sent"] else 0


async def _fire(config: FireConfig, transport: httpx.AsyncBaseTransport | None) -> int:
    started_s = time.monotonic()
    endpoints = Endpoints(config.server_url, config.collector_url, config.http,
                          collector_token=config.collector_token, transport=transport)
    try:  # before the run folder exists: a down server or a bad tokenizer leaves nothing behind
        chat, tokenizer_path = await _load_chat(config, endpoints)
    except BaseException:
        await endpoints.aclose()
        raise
    manifest = Manifest(config.run_dir)
    try:
        identity = {"run_id": config.run_id or f"r{secrets.token_hex(5)}", "data": str(config.data_path.resolve()),
                    "mode": config.mode, "records_per": config.records_per, "data_split": str(config.data_split)}
        stored = manifest.bind_run(identity)
        if config.run_id is not None and stored["run_id"] != config.run_id:
            raise ValueError(f"{config.run_dir} belongs to run {stored['run_id']!r}, not {config.run_id!r}")
        total = count_rows(config.data_path, split=config.data_split)
        if config.max_samples is not None:
            total = min(total, config.max_samples)
        run = _Run(config, manifest, endpoints, chat, stored["run_id"], Progress(total, config.progress))
        run.tokenizer_fingerprint = _tokenizer_fingerprint(tokenizer_path)
        work = asyncio.create_task(run.work())

        def interrupt() -> None:
            run.stats.interrupted = True
            work.cancel()

        loop = asyncio.get_running_loop()
        # Signal handlers can only be set on the main thread; elsewhere Ctrl-C is the caller's business.
        previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
        on_main_thread = threading.current_thread() is threading.main_thread()
        if on_main_thread:
            for signum in previous:
                loop.add_signal_handler(signum, interrupt)
        try:
            await work
        except asyncio.CancelledError:
            if not run.stats.interrupted:
                raise
        finally:
            if on_main_thread:
                for signum, handler in previous.items():
                    loop.remove_signal_handler(signum)
                    signal.signal(signum, handler)
        return _finish(run, started_s)
    finally:
        manifest.close()
        await endpoints.aclose()


def run_fire(config: FireConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> int:
    """Runs `config` to the end (or to Ctrl-C) and returns the exit code: 0 all confirmed, 1 failures, 130 stopped."""
    return asyncio.run(_fire(config, transport))
