"""The AFTER hook on `TpModelWorker.forward_batch_generation`, one instance per scheduler process.

SGLang calls it as `hook(result, worker, batch, ...)` after every forward; it returns None, so the
result is passed on unchanged. On its first call it decides once whether this process captures:
SGLang's aux capture must be on, and this must be the sending rank (attention-TP rank 0 and
context-parallel rank 0; each data-parallel group sends its own). EXTEND and MIXED batches go to the
assembler; DECODE batches only while a generate-mode capture runs; every other call returns at once.

The same object holds more hooks of the scheduler process (`plugin.py` registers them):
`on_request`, BEFORE `Scheduler.handle_generate_request` (which requests are captured: `selection.py`),
`on_max_prefix_len`, AFTER `Req._compute_max_prefix_len` (in prefix mode, how much of a captured
request the radix cache may serve), and `on_batch_processed`, AFTER `Scheduler.process_batch_result`
(generate captures whose request finished are emitted).

On a replica that serves an EAGLE-3 draft (`speculative.py`) the same hook takes the extend rows; the
verify rows come through `on_spec_forward`, AFTER `EAGLEWorkerV2.forward_batch_generation`, and
`on_batch_processed` keeps the accepted ones. `on_spec_forward_begin` (BEFORE it) remembers the
speculative worker; the draft's identity is computed from it at the first forward (SGLang's own health
check), and again at the first forward after a weight update (`on_weights_updated`).
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from capture_format import CodecError, capture_layers_from_sglang_ids, codec_for_states
from capture_format.fingerprint import model_fingerprint_or_marker
from sglang_patch.capture import CaptureAssembler
from sglang_patch.device_copy import CudaRowCopier, DeferredHostCopier, HostCopier, RowCopier
from sglang_patch.selection import Selector
from sglang_patch.sender import ModelIdentity, Sender, record_dtype
from sglang_patch.settings import CaptureSettings
from sglang_patch.speculative import SpecCaptureRefused, SpecServing, draft_digest, spec_capture_layers, spec_serving
from sglang_patch.spool import Spool, SpoolDirectoryError, check_private_directory
from sglang_patch.stats import CaptureStats, HookTimer

logger = logging.getLogger("eagle_tap.plugin")

_CAPTURED_MODES = ("EXTEND", "MIXED")


def _parallel_rank(name: str) -> int:
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(getattr(get_parallel(), name))
    except Exception:  # not published in this setup (e.g. no context parallelism): rank 0 of a group of one
        return 0


def _parallel_width(name: str) -> int:
    """A parallel group's width (e.g. `attn_tp_size`); 1 where SGLang does not publish it, as `_parallel_rank`."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(getattr(get_parallel(), name))
    except Exception:
        return 1


def _has_graph_runner(worker: Any) -> bool:
    """Whether the worker's model runner replays graphs (on CPU: `--enable-torch-compile`), or cannot be read
    (then assumed to); `device_copy.DeferredHostCopier` says why it matters."""
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        return True
    runners = (getattr(runner, "decode_cuda_graph_runner", None), getattr(runner, "prefill_cuda_graph_runner", None))
    return any(graph is not None and type(graph).__name__ != "EagerRunner" for graph in runners)


class CaptureHook:
    """Callable registered with SGLang's HookRegistry; holds this process's capture state."""

    def __init__(self, settings: CaptureSettings) -> None:
        self._settings = settings
        self.stats = CaptureStats()
        self.selector = Selector(stats=self.stats, sample_rate=settings.sample_rate,
                                 live_sample_rate=settings.live_sample_rate, ttl_s=settings.partial_ttl_s,
                                 prefix_block_tokens=settings.prefix_block_tokens)
        self._assembler: CaptureAssembler | None = None
        self.sender: Sender | None = None
        self._disabled = False
        self._error_logged = False
        self._spec: SpecServing | None = None
        """How the server drafts, when this process captures on a replica that serves an EAGLE-3 draft."""
        self._draft_identity: str | None = None
        """Digest of the serving draft (config and weights); None until computed, and after a weight update."""
        self._spec_worker: Any = None
        """SGLang's speculative worker (`EAGLEWorkerV2`): the draft and target models are found through it."""
        self._step_timers = tuple(HookTimer(self.stats, seed=seed) for seed in (1, 2, 3))
        """The hooks of every step, each measured on some calls: a decode forward, a processed batch, a verify
        forward. An extend, rarer and heavier, is measured every time."""

    def __call__(self, result: Any, worker: Any, batch: Any = None, *args: Any, **kwargs: Any) -> None:
        if self._disabled:
            return None
        try:
            if self._assembler is None:
                try:
                    self._start(worker)
                except Exception as error:  # once, not on every forward
                    logger.exception("eagle-tap capture failed to start")
                    self._disable(f"start-up failed: {type(error).__name__}: {error}")
                if self._disabled:
                    return None
            if batch is None:
                return None
            mode = batch.forward_mode.name
            decode = mode == "DECODE"
            if not (decode and self._assembler.generating) and (mode not in _CAPTURED_MODES or self._assembler.idle):
                return None  # the checks that return at once are not counted in hook_ns: a few attribute reads
            logits_output = result.logits_output
            aux = getattr(logits_output, "hidden_states", None)
            final = getattr(logits_output, "last_hidden_states", None)
            if aux is None or final is None:
                self.stats.add("batches_without_states")
                return None
            if decode:  # every step: measured on some of them (`HookTimer`)
                timer = self._step_timers[0]
                started = timer.start()
                self._assembler.on_decode(batch.reqs, aux, final)
                if started is not None:
                    timer.stop(started)
                return None
            started_ns, started_cpu_ns = time.perf_counter_ns(), time.thread_time_ns()
            self._assembler.on_extend(batch.reqs, batch.prefix_lens, batch.extend_lens, aux, final,
                                      getattr(logits_output, "mm_input_embeds", None))
            # What the scheduler's thread spends on capture per forward (hook + device copy), not counting
            # preemption nor the counting itself.
            self.stats.add_hook_time(time.perf_counter_ns() - started_ns, time.thread_time_ns() - started_cpu_ns)
        except Exception:
            self._count_error("capture")
        return None

    def _count_error(self, hook: str) -> None:
        """Inside an `except`: counts the error; the first one of the process is logged with its traceback."""
        self.stats.add("hook_errors")
        if not self._error_logged:
            self._error_logged = True
            logger.exception("eagle-tap %s hook failed (serving is unaffected; further errors only counted)", hook)

    def on_request(self, scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any) -> None:
        """BEFORE `Scheduler.handle_generate_request`: decide whether this request is captured.

        Runs on every rank, capturing or not, even where capture is disabled: each tensor-parallel rank
        schedules its own copy of the request with its own radix cache, and SGLang needs them all to
        decide alike, so the cache salt must depend on the settings and the request only, never on
        this process's role (`Selector.keep_decisions` is what differs)."""
        try:
            self.selector.on_request(recv_req)
        except Exception:
            self._count_error("request")
        return None  # the arguments go on unchanged (but for the cache salt of a selected request)

    def on_max_prefix_len(self, result: Any, req: Any = None, *args: Any, **kwargs: Any) -> int | None:
        """AFTER `Req._compute_max_prefix_len`: in prefix mode, a selected request's cache match ends where
        its reused blocks end, so its prefill computes every row past them (`selection.PrefixPlan`).
        Like the cache salt, the cap depends only on the settings and the requests, alike on every rank."""
        try:
            cap = self.selector.prefix_cap(req.rid)
            return cap if cap is not None and cap < result else None
        except Exception:
            self._count_error("prefix cap")
            return None

    def on_batch_processed(self, result: Any, scheduler: Any, batch: Any = None, *args: Any, **kwargs: Any) -> None:
        """AFTER `Scheduler.process_batch_result`: emit the generate captures whose request just finished."""
        if self._disabled or self._assembler is None or batch is None or not self._assembler.generating:
            return None
        try:
            batch_result = args[0] if args else kwargs.get("result")
            num_correct = None if self._spec is None else getattr(batch_result, "num_correct_drafts_per_req_cpu", None)
            timer = self._step_timers[1]  # on the scheduler's thread too: counted with the forward hooks
            started = timer.start()
            self._assembler.on_processed(batch.reqs, num_correct)
            if started is not None:
                timer.stop(started)
        except Exception:
            self._count_error("finish")
        return None

    def on_spec_forward_begin(self, worker: Any, batch: Any = None, *args: Any, **kwargs: Any) -> None:
        """BEFORE `EAGLEWorkerV2.forward_batch_generation`: remember the speculative worker, whose draft the records
        of this forward are identified by (`served_draft`)."""
        self._spec_worker = worker
        return None

    def on_spec_forward(self, result: Any, worker: Any, batch: Any = None, *args: Any, **kwargs: Any) -> None:
        """AFTER `EAGLEWorkerV2.forward_batch_generation`: hand a verify step's candidate rows to the assembler."""
        if self._disabled or self._assembler is None or batch is None:
            return None
        try:
            if self._draft_identity is None:
                self.served_draft()  # identified at the first forward (SGLang's own health check), not at a record
            if not self._assembler.generating:
                return None
            mode = batch.forward_mode
            if mode.is_extend() or mode.is_idle() or getattr(batch, "is_extend_in_batch", False):
                return None  # extend rows came through the target's own forward (__call__)
            logits_output = result.logits_output
            aux = getattr(logits_output, "hidden_states", None)
            final = getattr(logits_output, "last_hidden_states", None)
            accept_index = getattr(result, "accept_index", None)
            if aux is None or final is None or accept_index is None:
                self.stats.add("batches_without_states")
                return None
            timer = self._step_timers[2]
            started = timer.start()
            self._assembler.on_verify(batch.reqs, aux, final, accept_index, int(result.speculative_num_draft_tokens))
            if started is not None:
                timer.stop(started)
        except Exception:
            self._count_error("verify")
        return None

    def on_weights_updated(self, result: Any, *args: Any, **kwargs: Any) -> None:
        """AFTER a weight update of the scheduler (any selector): the draft may have changed; identify it again."""
        self._draft_identity = None
        return None

    def served_draft(self) -> tuple[str, SpecServing] | None:
        """(identity, how it drafts) for the records of a replica that serves a draft; None on one without.
        The identity is computed here, on the scheduler's thread between forwards, when it is not known (see
        `on_spec_forward`); "unknown" if that fails (counted as a hook error, logged once)."""
        if self._spec is None:
            return None
        if self._draft_identity is None:
            try:
                started_ns = time.perf_counter_ns()
                self._draft_identity = draft_digest(
                    self._spec_worker.draft_worker.draft_runner.model, Path(self._spec.draft_path) / "config.json",
                    shared_with=self._spec_worker.target_worker.model_runner.model)
                logger.info("eagle-tap: serving draft %s identified as %s in %.0f ms", self._spec.draft_path,
                            self._draft_identity, (time.perf_counter_ns() - started_ns) / 1e6)
            except Exception:
                self._count_error("draft identity")
                return "unknown", self._spec
        return self._draft_identity, self._spec

    def on_abort_output(self, result: Any, scheduler: Any, abort_req: Any = None, req: Any = None,
                        *args: Any, **kwargs: Any) -> None:
        """AFTER `Scheduler.send_abort_output`: a request ended outside a batch (aborted while queued,
        retracted and aborted, rejected) frees its capture now."""
        if self._disabled or self._assembler is None or req is None:
            return None
        try:
            self._assembler.on_aborted(req.rid)
        except Exception:
            self._count_error("abort")
        return None

    def _disable(self, why: str) -> None:
        self._disabled = True
        self.selector.keep_decisions = False
        self.stats.status = f"dormant: {why}"
        try:
            if self._settings.stats_path is None:
                check_private_directory(self._settings.spool_dir)  # never write into a directory others control
            self.stats.write(self._settings.stats_path or self._settings.spool_dir / "stats.json")
        except (SpoolDirectoryError, OSError):
            pass  # nowhere safe to write the status: the log line below says why
        logger.error("eagle-tap capture disabled in this process: %s", why)

    def _peer_stats_paths(self, dp_rank: int) -> tuple[Path, str]:
        """(folder, file-name pattern) of the stats files of this data-parallel group's non-sending ranks."""
        if self._settings.stats_path is not None:
            path = self._settings.stats_path
            return path.parent, f"{path.stem}.attn-tp*{path.suffix}"
        return self._settings.spool_dir / f"dp{dp_rank}", "stats.attn-tp*.json"

    def _report_as_peer(self) -> None:
        """A rank that does not send still decides for every request (`Selector`); it writes its counts and its
        decisions' checkpoints next to the sending rank's stats, about once a second, so they can be compared."""
        tp_rank, cp_rank, dp_rank = (_parallel_rank(name) for name in ("attn_tp_rank", "attn_cp_rank", "attn_dp_rank"))
        self.stats.status = (f"not sending: attention-TP rank {tp_rank}, context-parallel rank {cp_rank} of "
                             f"data-parallel group {dp_rank} (rank 0 of the group sends)")
        try:
            if self._settings.stats_path is None:
                check_private_directory(self._settings.spool_dir)
        except (SpoolDirectoryError, OSError) as error:
            logger.error("eagle-tap: no stats file for this rank: %s", error)
            return
        folder, pattern = self._peer_stats_paths(dp_rank)
        path = folder / pattern.replace("*", f"{tp_rank}.cp{cp_rank}")
        threading.Thread(target=_write_every_second, args=(self.stats, path), name="eagle-tap-peer-stats",
                         daemon=True).start()

    def _check_peers(self) -> None:
        """On the sending rank, about once a second (sender thread): the other ranks of its group must have made
        the same decisions. A rank that decided otherwise salts or caps requests otherwise, so the ranks may
        no longer compute the same batches: capture stops for good, loudly, before it stores rows of them."""
        if self._disabled:
            return
        folder, pattern = self._peer_stats_paths(_parallel_rank("attn_dp_rank"))
        mine = self.selector.checkpoints
        for path in sorted(folder.glob(pattern)):
            try:
                count, _, digest = json.loads(path.read_text()).get("decisions_checkpoint", "").partition(":")
            except (OSError, ValueError):
                continue  # being replaced just now: read it at the next tick
            if count.isdigit() and int(count) in mine and mine[int(count)] != digest:
                self._disabled = True
                self.stats.drop("ranks_disagree")
                self.stats.status = (f"stopped: {path.name} decided otherwise than this rank by decision {count} "
                                     "(settings or plugin versions differ between ranks?); capture is off until "
                                     "the server restarts")
                logger.error("eagle-tap capture stopped: %s", self.stats.status)
                return

    def _row_copier(self, worker: Any) -> RowCopier:
        device = torch.device(getattr(worker, "device", None) or "cpu")  # ModelRunner.device, e.g. "cuda"
        if device.type == "cuda":
            return CudaRowCopier(torch.device("cuda", torch.cuda.current_device()), self._settings.host_buffer_bytes)
        if _has_graph_runner(worker):  # outputs of a replayed graph: copied before the hook returns
            return HostCopier()
        return DeferredHostCopier()

    def _start(self, worker: Any) -> None:
        from sglang.srt.runtime_context import get_exec, get_spec

        features = get_exec().features  # the resolved settings, what the model runner itself reads
        layer_ids = features.return_aux_hidden_state_layer_ids
        hf_config = getattr(worker.model_config, "hf_text_config", None) or worker.model_config.hf_config
        architecture = (getattr(worker.model_config.hf_config, "architectures", None) or ["?"])[0]
        spec = spec_serving(get_spec())
        if features.aux_hidden_state_capture == "eagle3" and layer_ids:
            capture_layers = capture_layers_from_sglang_ids(architecture, layer_ids, hf_config.num_hidden_layers)
            source = "SGLang's aux capture (no draft)"
        elif spec is not None:
            try:
                capture_layers = spec_capture_layers(spec, architecture, hf_config.num_hidden_layers,
                                                     self._settings.capture_layers)
            except SpecCaptureRefused as error:
                self._disable(f"this server serves a draft it cannot capture under: {error}")
                return
            self._spec = spec
            source = (f"the target's extend and verify forwards of EAGLE3 speculative decoding (draft "
                      f"{spec.draft_path}, {spec.num_steps} steps, top-k {spec.topk}, "
                      f"{spec.num_draft_tokens} draft tokens)")
        else:
            self._disable("SGLang's aux hidden-state capture is off (see the log line of the resolution hook)")
            return
        if _parallel_rank("attn_tp_rank") != 0 or _parallel_rank("attn_cp_rank") != 0:
            self._disabled = True  # another rank of this group ships the same rows
            self.selector.keep_decisions = False  # (it still salts alike: see on_request)
            self._report_as_peer()
            return
        # The states come out in the dtype the model runs in; the codec must be able to store them.
        state_dtype = record_dtype(worker.model_config.dtype)
        if state_dtype is None:
            self._disable(f"the model runs in {worker.model_config.dtype}, which records cannot hold "
                          "(bfloat16, float16, float32)")
            return
        try:
            codec = codec_for_states(state_dtype, self._settings.codec).spec
        except CodecError as error:
            self._disable(f"EAGLE_TAP_CODEC={self._settings.codec} cannot store the {state_dtype} states this "
                          f"server computes: {error}")
            return
        model = ModelIdentity(capture_layers=tuple(capture_layers), hidden_size=int(hf_config.hidden_size),
                              model_fingerprint=model_fingerprint_or_marker(worker.model_config.model_path),
                              state_dtype=state_dtype, codec=codec)
        dp_rank = _parallel_rank("attn_dp_rank")
        copier = self._row_copier(worker)
        copier.copy_thread_nice = self._settings.sender_nice
        copier.count_copy_cpu = functools.partial(self.stats.add, "copy_cpu_ns")  # capture's CPU off the scheduler
        try:
            check_private_directory(self._settings.spool_dir)
            spool = Spool(self._settings.spool_dir / f"dp{dp_rank}", self._settings.spool_max_bytes)
        except (SpoolDirectoryError, OSError) as error:
            self._disable(str(error))
            return
        # A group of one rank has no peer to check: its sender then skips the check (a glob of the stats folder,
        # ~1 ms of CPU a second on an idle sender here) and sleeps while nothing changes (`Sender._write_stats`).
        peer_ranks = _parallel_width("attn_tp_size") * _parallel_width("attn_cp_size") - 1
        self.stats.set("peer_ranks", peer_ranks)
        self.sender = Sender(settings=self._settings, model=model, stats=self.stats, spool=spool,
                             stats_path=self._settings.stats_path or spool.directory / "stats.json",
                             every_second=self._check_peers if peer_ranks else None)
        self._assembler = CaptureAssembler(stats=self.stats, emit=self.sender.submit, selector=self.selector,
                                           partial_ttl_s=self._settings.partial_ttl_s, copier=copier,
                                           served_draft=self.served_draft,
                                           part_max_tokens=self._settings.part_max_tokens,
                                           part_max_bytes=min(self._settings.part_max_bytes,
                                                              max(self._settings.inflight_max_bytes // 2, 1)))
        self.stats.status = "capturing"
        atexit.register(self.sender.close)
        logger.info("eagle-tap capturing layers %s (hidden %d, %s states, codec %s, %s) from %s to %s",
                    capture_layers, model.hidden_size, state_dtype, codec, model.model_fingerprint, source,
                    self._settings.collector_url)


def _write_every_second(stats: CaptureStats, path: Path) -> None:
    """A non-sending rank's stats file, rewritten when its decisions change (daemon thread, for the process's life)."""
    written = None
    while True:
        decisions = stats.snapshot().get("decisions")
        if decisions != written:
            try:
                stats.write(path)
                written = decisions
            except OSError as error:
                logger.error("eagle-tap: cannot write %s: %s", path, error)
                return
        time.sleep(1.0)
