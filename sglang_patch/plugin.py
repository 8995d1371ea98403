"""The plugin's entry point: what it hooks in SGLang, and the server flags it turns on.

SGLang calls `register()` (entry point `sglang.srt.plugins: eagle_tap`) early in every process it
starts: the main process, each scheduler, the detokenizer. With `EAGLE_TAP_COLLECTOR_URL` unset it
does nothing. Otherwise, on a tested SGLang version, it registers:

1. a resolution hook on the server-argument step `handle_return_hidden_states_mode` (main process),
   which declares the flags of SGLang's own aux-hidden-state capture, the path EAGLE-3 serving uses:
   `--enable-return-aux-hidden-states --speculative-algorithm EAGLE3 --return-aux-hidden-state-layer-ids
   <ids>` with the ids translated from our capture layers for the model's architecture. In that mode
   SGLang resets the speculative algorithm to None (no draft runs) and keeps the post-norm final state.
   A user who passes those flags explicitly keeps them; capture layers are then derived from them.
2. an AFTER hook on `TpModelWorker.forward_batch_generation` (schedulers), which hands the rows of each
   EXTEND batch (and DECODE batch, while a generate capture runs) to the `CaptureAssembler`; only
   attention-TP rank 0 (and context-parallel rank 0) ships;
3. a BEFORE hook on `Scheduler.handle_generate_request`, which decides per request whether it is
   captured before it is scheduled (`selection.py`), and an AFTER hook on
   `Scheduler.process_batch_result`, which emits generate captures whose request finished, and one on
   `Scheduler.send_abort_output`, which frees the capture of a request ended outside a batch;
4. with `EAGLE_TAP_PREFIX_BLOCK_TOKENS` > 0, an AFTER hook on `Req._compute_max_prefix_len`, which caps
   the radix-cache match of a captured request where its reused shared-prefix blocks end;
5. for a server that serves an EAGLE-3 draft (`speculative.py`): no flag is declared (the target already
   captures the draft's aux layers); BEFORE and AFTER hooks on `EAGLEWorkerV2.forward_batch_generation`
   take the verify steps' rows, an AFTER hook on `LogitsProcessor.__init__` keeps the target's post-norm
   final state, and AFTER hooks on the scheduler's weight updates make the draft be identified again.
   A speculative server the plugin cannot capture correctly is refused with one log line, served unchanged.

Nothing here raises into SGLang: every failure is logged, counted and turns capture off, never serving.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

from capture_format import (
    capture_layers_from_sglang_ids,
    capture_layers_to_sglang_ids,
    default_capture_layers,
)
from sglang_patch import SUPPORTED_SGLANG_VERSIONS
from sglang_patch.settings import CaptureSettings, load_settings
from sglang_patch.speculative import SpecCaptureRefused, spec_capture_layers, spec_serving

logger = logging.getLogger("eagle_tap.plugin")

FORWARD_TARGET = "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation"
REQUEST_TARGET = "sglang.srt.managers.scheduler.Scheduler.handle_generate_request"
PROCESSED_TARGET = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
ABORT_TARGET = "sglang.srt.managers.scheduler.Scheduler.send_abort_output"
PREFIX_CAP_TARGET = "sglang.srt.managers.schedule_batch.Req._compute_max_prefix_len"
SPEC_FORWARD_TARGET = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation"
LOGITS_INIT_TARGET = "sglang.srt.layers.logits_processor.LogitsProcessor.__init__"
WEIGHT_UPDATE_TARGETS = tuple(
    f"sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager.{method}"
    for method in ("update_weights_from_disk", "update_weights_from_distributed", "update_weights_from_tensor",
                   "update_weights_from_ipc"))
RESOLUTION_STEP = "handle_return_hidden_states_mode"

_registered = False


def register() -> None:
    """SGLang's plugin entry point; safe to call more than once per process."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        settings = load_settings()
        if settings is None or not settings.enabled:
            return
        import sglang

        if sglang.__version__ not in SUPPORTED_SGLANG_VERSIONS:
            logger.error(
                "eagle-tap capture disabled: SGLang %s is not a version this plugin was tested with (%s); "
                "serving continues without capture", sglang.__version__, ", ".join(SUPPORTED_SGLANG_VERSIONS))
            return
        from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        from sglang_patch.forward_hook import CaptureHook

        register_resolution_hook(RESOLUTION_STEP)(functools.partial(enable_aux_capture, settings=settings))
        hook = CaptureHook(settings)
        HookRegistry.register(FORWARD_TARGET, hook, HookType.AFTER)
        HookRegistry.register(REQUEST_TARGET, hook.on_request, HookType.BEFORE)
        HookRegistry.register(PROCESSED_TARGET, hook.on_batch_processed, HookType.AFTER)
        HookRegistry.register(ABORT_TARGET, hook.on_abort_output, HookType.AFTER)
        if settings.prefix_block_tokens:
            HookRegistry.register(PREFIX_CAP_TARGET, hook.on_max_prefix_len, HookType.AFTER)
        HookRegistry.register(SPEC_FORWARD_TARGET, hook.on_spec_forward_begin, HookType.BEFORE)
        HookRegistry.register(SPEC_FORWARD_TARGET, hook.on_spec_forward, HookType.AFTER)
        HookRegistry.register(LOGITS_INIT_TARGET, keep_final_state_under_eagle3, HookType.AFTER)
        for target in WEIGHT_UPDATE_TARGETS:
            HookRegistry.register(target, hook.on_weights_updated, HookType.AFTER)
        logger.info("eagle-tap capture plugin registered; collector %s", settings.collector_url)
    except Exception:
        logger.exception("eagle-tap capture disabled: the plugin failed to register; serving is unaffected")


def read_model_shape(model_path: str, trust_remote_code: bool = False) -> tuple[str, int, int]:
    """(architecture, number of decoder layers, hidden size) from a model's config."""
    config_path = Path(model_path) / "config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
    else:  # a hub id: let transformers find it in the local cache
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).to_dict()
    text_config = config.get("text_config") or config
    return (config.get("architectures") or ["?"])[0], int(text_config["num_hidden_layers"]), int(text_config["hidden_size"])


def enable_aux_capture(server_args: Any, previous, *, settings: CaptureSettings) -> None:
    """Resolution hook: declare SGLang's aux-capture flags for our capture layers, then run the step."""
    try:
        from sglang.srt.arg_groups.model_override_base import resolving_view
        from sglang.srt.arg_groups.overrides import declare_resolution

        cfg = resolving_view(server_args)
        architecture, num_layers, _ = read_model_shape(cfg.model_path, bool(cfg.trust_remote_code))
        if cfg.enable_return_aux_hidden_states and cfg.return_aux_hidden_state_layer_ids:
            layers = capture_layers_from_sglang_ids(architecture, cfg.return_aux_hidden_state_layer_ids, num_layers)
            if settings.capture_layers and list(settings.capture_layers) != layers:
                logger.warning("eagle-tap: EAGLE_TAP_CAPTURE_LAYERS=%s ignored: the server flags capture layers %s",
                               settings.capture_layers, layers)
        elif (spec := spec_serving(cfg)) is not None or cfg.speculative_draft_model_path is not None:
            try:
                if spec is None:
                    raise SpecCaptureRefused("the server names a draft model but no speculative algorithm")
                layers = spec_capture_layers(spec, architecture, num_layers, settings.capture_layers)
                logger.info("eagle-tap: capturing the inputs of layers %s of %s (%d layers) from the target's "
                            "forwards of EAGLE3 speculative decoding with the draft %s", layers, architecture,
                            num_layers, spec.draft_path)
            except SpecCaptureRefused as error:
                logger.error("eagle-tap capture disabled: %s; serving continues without capture", error)
        else:
            layers = settings.capture_layers or default_capture_layers(num_layers)
            ids = capture_layers_to_sglang_ids(architecture, layers, num_layers)
            declare_resolution(server_args, "eagle_tap_capture", enable_return_aux_hidden_states=True,
                               speculative_algorithm="EAGLE3", return_aux_hidden_state_layer_ids=ids)
            logger.info("eagle-tap: capturing the inputs of layers %s of %s (%d layers): SGLang flags "
                        "--enable-return-aux-hidden-states --speculative-algorithm EAGLE3 "
                        "--return-aux-hidden-state-layer-ids %s", layers, architecture, num_layers,
                        " ".join(map(str, ids)))
    except Exception as error:
        logger.error("eagle-tap capture disabled: %s: %s; serving continues without capture",
                     type(error).__name__, error)
    previous(server_args)


def keep_final_state_under_eagle3(result: Any, logits_processor: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `LogitsProcessor.__init__`: on a server that serves an EAGLE-3 draft, keep the post-norm final state
    next to the aux states, as SGLang's capture-only mode does (a reference to the forward's own tensor)."""
    try:
        from sglang.srt.runtime_context import get_spec

        spec = spec_serving(get_spec())
        if spec is not None and spec.algorithm == "EAGLE3":
            logits_processor.keep_last_hidden_states = True
    except Exception:
        logger.exception("eagle-tap: cannot keep the final state; records of this server will be dropped as "
                         "batches_without_states")
    return None
