"""The AFTER hook on `TpModelWorker.forward_batch_generation`, one instance per scheduler process.

SGLang calls it as `hook(result, worker, batch, ...)` after every forward; it returns None, so the
result is passed on unchanged. On its first call it decides once whether this process captures:
SGLang's aux capture must be on, and this must be the sending rank (attention-TP rank 0 and
context-parallel rank 0; each data-parallel group sends its own). Every later call that is not an
EXTEND (or MIXED) batch returns at once.
"""

from __future__ import annotations

import atexit
import logging
from typing import Any

from capture_format import capture_layers_from_sglang_ids
from capture_format.fingerprint import model_fingerprint_or_marker
from sglang_patch.capture import CaptureAssembler
from sglang_patch.sender import ModelIdentity, Sender
from sglang_patch.settings import CaptureSettings
from sglang_patch.spool import Spool
from sglang_patch.stats import CaptureStats

logger = logging.getLogger("eagle_tap.plugin")

_CAPTURED_MODES = ("EXTEND", "MIXED")


def _parallel_rank(name: str) -> int:
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(getattr(get_parallel(), name))
    except Exception:  # not published in this setup (e.g. no context parallelism): rank 0 of a group of one
        return 0


class CaptureHook:
    """Callable registered with SGLang's HookRegistry; holds this process's capture state."""

    def __init__(self, settings: CaptureSettings) -> None:
        self._settings = settings
        self.stats = CaptureStats()
        self._assembler: CaptureAssembler | None = None
        self.sender: Sender | None = None
        self._disabled = False
        self._error_logged = False

    def __call__(self, result: Any, worker: Any, batch: Any = None, *args: Any, **kwargs: Any) -> None:
        if self._disabled:
            return None
        try:
            if self._assembler is None:
                self._start(worker)
                if self._disabled:
                    return None
            if batch is None or batch.forward_mode.name not in _CAPTURED_MODES:
                return None
            logits_output = result.logits_output
            aux = getattr(logits_output, "hidden_states", None)
            final = getattr(logits_output, "last_hidden_states", None)
            if aux is None or final is None:
                self.stats.add("batches_without_states")
                return None
            self._assembler.on_extend(batch.reqs, batch.prefix_lens, batch.extend_lens, aux, final)
        except Exception:
            self.stats.add("hook_errors")
            if not self._error_logged:
                self._error_logged = True
                logger.exception("eagle-tap capture hook failed (serving is unaffected; further errors only counted)")
        return None

    def _disable(self, why: str) -> None:
        self._disabled = True
        self.stats.status = f"dormant: {why}"
        self.stats.write(self._settings.stats_path or self._settings.spool_dir / "stats.json")
        logger.error("eagle-tap capture disabled in this process: %s", why)

    def _start(self, worker: Any) -> None:
        from sglang.srt.runtime_context import get_exec

        features = get_exec().features  # the resolved settings, what the model runner itself reads
        layer_ids = features.return_aux_hidden_state_layer_ids
        if features.aux_hidden_state_capture != "eagle3" or not layer_ids:
            self._disable("SGLang's aux hidden-state capture is off (see the log line of the resolution hook)")
            return
        if _parallel_rank("attn_tp_rank") != 0 or _parallel_rank("attn_cp_rank") != 0:
            self._disabled = True  # another rank of this group ships the same rows
            return
        hf_config = getattr(worker.model_config, "hf_text_config", None) or worker.model_config.hf_config
        architecture = (getattr(worker.model_config.hf_config, "architectures", None) or ["?"])[0]
        capture_layers = capture_layers_from_sglang_ids(architecture, layer_ids, hf_config.num_hidden_layers)
        model = ModelIdentity(capture_layers=tuple(capture_layers), hidden_size=int(hf_config.hidden_size),
                              model_fingerprint=model_fingerprint_or_marker(worker.model_config.model_path))
        dp_rank = _parallel_rank("attn_dp_rank")
        spool = Spool(self._settings.spool_dir / f"dp{dp_rank}", self._settings.spool_max_bytes)
        self.sender = Sender(settings=self._settings, model=model, stats=self.stats, spool=spool,
                             stats_path=self._settings.stats_path or spool.directory / "stats.json")
        self._assembler = CaptureAssembler(stats=self.stats, emit=self.sender.submit,
                                           sample_rate=self._settings.sample_rate,
                                           partial_ttl_s=self._settings.partial_ttl_s)
        self.stats.status = "capturing"
        atexit.register(self.sender.close)
        logger.info("eagle-tap capturing layers %s (hidden %d, %s) to %s", capture_layers, model.hidden_size,
                    model.model_fingerprint, self._settings.collector_url)
