"""Capture on a replica that serves an EAGLE-3 draft: what the server runs, the draft's identity, its per-step signal.

On such a server (SGLang 0.5.23, `EAGLEWorkerV2`) the target's own forwards compute what a record holds:
- extend (prefill) forwards go through `TpModelWorker.forward_batch_generation(batch, capture_hidden_mode=FULL)`
  and carry the aux states of every prompt token (the draft reads them): the plugin's usual hook takes them;
- each decode step is a verify forward, `TpModelWorker.forward_batch_generation(batch=None, is_verify=True)`
  over `num_draft_tokens` rows per request, request after request: row 0 is the request's newest token (the
  bonus token of the step before), the others are draft tokens. The step accepts `accept_lens[i]` of them (the
  root and the accepted drafts, along the tree path `accept_index[i]`); their states are exactly the states of
  the tokens the request goes on with, so a verify step contributes `accept_lens[i]` rows where a draftless
  decode step contributes one, and the record is row for row the one a draftless replica stores.
  For top-k > 1 SGLang moves the accepted path's aux rows to the front of each request's block
  (`eagle_worker_common._finalize_accept_tree_path`) but not the final states: those are gathered through
  `accept_index`. The hook on `EAGLEWorkerV2.forward_batch_generation` hands the copier one block of
  `num_steps + 1` candidate rows per captured request for the whole forward (`RowCopier.gather_verify`: on CUDA
  device-side gathers and copies, no wait on the device; on CPU the gather runs on the copy thread); how many
  of them count is read after `Scheduler.process_batch_result`, from the same per-request numbers SGLang itself
  counts (`result.num_correct_drafts_per_req_cpu`), and noted, not copied, until a capture's kept rows are
  joined into one block (`capture.py`).
- the final state: SGLang keeps the post-norm `last_hidden_states` only in its capture-only mode
  (`LogitsProcessor.keep_last_hidden_states`); an AFTER hook on `LogitsProcessor.__init__` keeps it on a
  capturing EAGLE-3 replica too: a reference to the tensor the forward computed anyway, never a copy.

What must hold:
- capture never changes what SGLang computes or returns: the hooks only read, and keep one reference;
- a server the plugin cannot capture correctly (another speculative algorithm, a draft that names no aux
  layer ids, or names others than the capture layers asked for) is refused with one log line and served
  unchanged;
- the draft's identity is a digest of its config and of the weights the server holds (not a file name),
  computed at the first forward and again at the first forward after a weight update, on the device that
  holds the weights (no copy of them to the host).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from capture_format import capture_layers_from_sglang_ids
from capture_format.served_draft import METADATA_KEY, STEP_DIGITS, decode_steps

__all__ = ["METADATA_KEY", "MAX_STEPS_LISTED", "SpecCaptureRefused", "SpecServing", "accepted_from_metadata",
           "draft_digest", "draft_layer_ids", "served_draft_metadata", "spec_capture_layers", "spec_serving",
           "verified_steps"]

logger = logging.getLogger("eagle_tap.plugin")

MAX_STEPS_LISTED = 32_768
"""Past this many verify steps a record keeps the per-position counts, not one digit per step (metadata <= 64 KiB)."""


class SpecCaptureRefused(ValueError):
    """This speculative server cannot be captured correctly; the message says why, in one line."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class SpecServing:
    """How the server drafts, as resolved by SGLang."""

    algorithm: str
    """SGLang's speculative algorithm name, upper case (EAGLE3, EAGLE, NEXTN, STANDALONE, NGRAM, ...)."""
    draft_path: str | None
    """The draft model folder (`--speculative-draft-model-path`)."""
    num_steps: int | None = None
    """Draft steps per verify (`--speculative-num-steps`): the chain's depth."""
    topk: int | None = None
    """Branching of the draft tree (`--speculative-eagle-topk`); 1 is a chain."""
    num_draft_tokens: int | None = None
    """Rows per request in a verify forward (`--speculative-num-draft-tokens`), the root included."""


def _algorithm_name(value: Any) -> str:
    return str(getattr(value, "name", value) or "").upper()


def spec_serving(config: Any) -> SpecServing | None:
    """What `config` (SGLang's resolving view of the server args, or its `spec` config bag) says about drafting;
    None when the server runs no draft model."""
    algorithm = _algorithm_name(getattr(config, "speculative_algorithm", None))
    if algorithm in ("", "NONE"):
        return None
    def number(name: str) -> int | None:
        value = getattr(config, name, None)
        return None if value is None else int(value)
    return SpecServing(algorithm=algorithm, draft_path=getattr(config, "speculative_draft_model_path", None),
                       num_steps=number("speculative_num_steps"), topk=number("speculative_eagle_topk"),
                       num_draft_tokens=number("speculative_num_draft_tokens"))


def draft_layer_ids(draft_path: str | Path) -> list[int] | None:
    """The target layer ids an EAGLE-3 draft folder asks SGLang to capture (`eagle_config`), or None if unnamed."""
    config = json.loads((Path(draft_path) / "config.json").read_text(encoding="utf-8"))
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else [int(layer_id) for layer_id in ids]


def spec_capture_layers(spec: SpecServing, architecture: str, num_layers: int,
                        requested: list[int] | None) -> list[int]:
    """The capture layers of an EAGLE-3 replica (the draft's aux layers), or SpecCaptureRefused."""
    if spec.algorithm != "EAGLE3":
        raise SpecCaptureRefused(f"the server drafts with {spec.algorithm}, whose target forwards do not compute the "
                                 "aux states of the capture layers; only EAGLE3 replicas capture")
    if not spec.draft_path:
        raise SpecCaptureRefused("the EAGLE3 server names no draft model path")
    try:
        ids = draft_layer_ids(spec.draft_path)
    except (OSError, ValueError) as error:
        raise SpecCaptureRefused(f"cannot read the draft's config in {spec.draft_path}: {error}") from None
    if ids is None:
        raise SpecCaptureRefused(f"the draft config in {spec.draft_path} names no eagle_config."
                                 "eagle_aux_hidden_state_layer_ids, so which layers SGLang captures is not written down")
    layers = capture_layers_from_sglang_ids(architecture, ids, num_layers)
    if requested and list(requested) != layers:
        raise SpecCaptureRefused(f"EAGLE_TAP_CAPTURE_LAYERS={list(requested)} but the serving draft reads layers "
                                 f"{layers} (SGLang ids {ids}); the target computes only the draft's layers")
    return layers


_FINGERPRINT_CHUNK = 1 << 22
"""Elements per step of `tensor_fingerprint` (a 32 MiB int64 temporary on the device, whatever the tensor's size)."""
_SAME_WIDTH_INTS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def tensor_fingerprint(tensor: Any) -> tuple[int, int]:
    """(sum, position-weighted sum) of a tensor's bits read as integers of its width, wrapping in int64, computed
    where the tensor lives: a changed bit changes it, and a draft of a GB on a GPU is read in milliseconds,
    never copied to the host (the identity is computed on the scheduler's thread)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    flat = flat.view(getattr(torch, _SAME_WIDTH_INTS[flat.element_size()]))
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    weighted = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _FINGERPRINT_CHUNK):
        part = flat[start : start + _FINGERPRINT_CHUNK].to(torch.int64)
        positions = torch.arange(start, start + part.numel(), dtype=torch.int64, device=flat.device) % 65_521 + 1
        total += part.sum()
        weighted += (part * positions).sum()
    return int(total), int(weighted)


def draft_digest(draft_model: Any, config_path: str | Path | None, shared_with: Any = None) -> str:
    """32 hex digits of BLAKE2b over the draft's config file and, by name, every parameter and buffer it holds
    (name, dtype, shape, `tensor_fingerprint`), leaving out tensors that are the target's own (`embed_tokens`:
    those sharing storage with `shared_with`)."""
    target_storages = set()
    if shared_with is not None:
        target_storages = {tensor.untyped_storage().data_ptr()
                           for tensor in (*shared_with.parameters(), *shared_with.buffers())}
    digest = hashlib.blake2b(digest_size=16)
    if config_path is not None and Path(config_path).is_file():
        digest.update(Path(config_path).read_bytes())
    tensors = dict(draft_model.named_parameters())
    tensors.update(draft_model.named_buffers())
    for name in sorted(tensors):
        tensor = tensors[name]
        if tensor.untyped_storage().data_ptr() in target_storages:
            continue
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|{tensor_fingerprint(tensor)}|".encode())
    return digest.hexdigest()


def verified_steps(accepted: list[int], num_generated: int) -> list[int]:
    """The verify steps that produced the first num_generated tokens: the first token comes from the prefill,
    each step adds its accepted drafts plus one. Steps after that (an overlap scheduler's extra step past the
    finish) are left out, as SGLang leaves them out of `spec_verify_ct`."""
    kept, tokens = [], 1
    for count in accepted:
        if tokens >= num_generated:
            break
        kept.append(count)
        tokens += count + 1
    return kept


def served_draft_metadata(*, draft: str, spec: SpecServing, accepted: list[int]) -> dict:
    """The record's `served_draft` metadata (its layout and how readers pool it: capture_format/served_draft.py):
    who drafted, how, and what each verify step of it accepted.

    `accepted_per_step`: one base-36 digit per verify step, the draft tokens it accepted (top-k 1: the
    first that many draft positions were right, the next one wrong unless all were accepted);
    `accepted_at_position[j]`: steps that accepted more than j drafts. A prefill-only record has 0 steps."""
    depth = spec.num_steps or max(accepted, default=0)
    metadata = {"draft": draft, "algorithm": spec.algorithm, "num_steps": spec.num_steps, "topk": spec.topk,
                "num_draft_tokens": spec.num_draft_tokens, "verify_steps": len(accepted),
                "accepted_drafts": sum(accepted),
                "accepted_at_position": [sum(count > position for count in accepted) for position in range(depth)]}
    if len(accepted) <= MAX_STEPS_LISTED and all(0 <= count < len(STEP_DIGITS) for count in accepted):
        metadata["accepted_per_step"] = "".join(STEP_DIGITS[count] for count in accepted)
    return metadata


def accepted_from_metadata(metadata: dict) -> list[int] | None:
    """The per-step accepted drafts of a record's `served_draft` metadata, or None where it lists none."""
    steps = metadata.get("accepted_per_step")
    return None if steps is None else decode_steps(steps)
