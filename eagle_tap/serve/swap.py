"""Put an exported draft into a running SGLang replica in place, through SGLang 0.5.23's own weight-update API.

The sequence (run against SGLang's CPU speculative path; `tests/test_spec_capture.py` swaps for real):
`POST /pause_generation {"mode": "in_place"}` (running requests wait where they are, none is dropped),
`/begin_weight_update {"selector": "draft"}`, `/update_weights_from_tensor {"serialized_named_tensors":
[payload], "selector": "draft", "flush_cache": false}`, `/end_weight_update`, `/continue_generation`.
The payload is SGLang's own `MultiprocessingSerializer` over the draft's tensors with torch's `file_system`
sharing strategy: the tensors travel as shared-memory handles, so the sender must run on the replica's host
(the default `file_descriptor` strategy makes the scheduler fail with `AuthenticationError` and exit).
`/update_weights_from_disk` is never used: it has no selector and loads the path into the target too.
At tensor parallel size N, SGLang hands rank r `serialized_named_tensors[r]`: the same payload is sent N times
(one serialisation, so the ranks map the same shared memory), and each rank's loader takes its shard of it.

What must hold:
- a draft that cannot take the serving one's place (another vocab mapping, which SGLang would silently keep
  using, another hidden size, aux layer ids, vocab or tensor shapes) is refused before the replica is touched;
- `embed_tokens` (the target's own tensor, shared by the draft) and `d2t`/`t2d` (copied once at start-up,
  ignored after) are never sent;
- generation is paused only around the three weight-update calls, and continued even when one fails;
- the result says what changed: the draft's checksums (`/weights_checker`) before and after, and with
  `check_target` the target's too, which must not move (`SwapResult.target_unchanged`).

Why the target's checksum is asked for only on request: SGLang computes it on the scheduler's thread by
dequantising and hashing every weight of the target, so each call stalls serving for as long as that takes
(at width 2048 a swap call took 1,154 ms with them and 450 ms without, `eagle-tap bench --only swap`) and
grows with the target, which a draft update cannot change. The loop asks for it when it meets a replica for the first time
or after the replica was restarted or found down (`eagle_tap.loop.run`), and keeps the figure in its registry.
"""

from __future__ import annotations

import base64
import dataclasses
import time
from pathlib import Path
from typing import Any

from eagle_tap.serve.http_api import post_json, tp_size, weights_checksum
from trainer.draft_fit import check_draft_fits, in_place_of

NEVER_SENT = ("d2t", "t2d")
"""Tensors of an exported draft that stay out of a swap (besides any `embed_tokens`)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SwapResult:
    """What one swap did, in SGLang's own figures."""

    draft_checksum_before: str
    draft_checksum_after: str
    paused_s: float
    """How long generation was paused (pause to continue), the scheduler's stall for running requests."""
    num_tensors: int
    target_checksum_before: str | None = None
    """SGLang's checksum of the target before the swap; None when the swap was not asked to check the target."""
    target_checksum_after: str | None = None

    @property
    def target_checked(self) -> bool:
        return self.target_checksum_before is not None

    @property
    def target_unchanged(self) -> bool | None:
        """Whether the target's weights stayed as they were; None when the target was not checked."""
        return self.target_checksum_after == self.target_checksum_before if self.target_checked else None


def draft_tensors(draft_dir: str | Path) -> list[tuple[str, Any]]:
    """The tensors a swap sends, under the exported names (SGLang's EAGLE-3 draft maps them itself)."""
    from safetensors.torch import load_file

    tensors = load_file(Path(draft_dir) / "model.safetensors")
    return [(name, tensor) for name, tensor in sorted(tensors.items())
            if name not in NEVER_SENT and "embed_tokens" not in name]


def _serialize(named: list[tuple[str, Any]]) -> str:
    import torch
    from sglang.srt.utils import MultiprocessingSerializer

    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")  # a file descriptor cannot cross to the server
    try:
        return base64.b64encode(MultiprocessingSerializer.serialize(named)).decode()
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)


def swap_draft(url: str, candidate_dir: str | Path, *, serving_dir: str | Path | None,
               check_target: bool = False, num_ranks: int | None = None) -> SwapResult:
    """Replace the weights of the draft the replica at url serves by candidate_dir's, in place. serving_dir: the
    folder of the draft it serves, which the candidate is checked against first (trainer.draft_fit); None when
    the caller checked it already (the loop's `prepare_swap`), so each swap runs the check once. check_target:
    also take the target's checksum before and after (a stall of the scheduler each: module docstring).
    num_ranks: the replica's tensor-parallel size (None: asked from its /server_info)."""
    if serving_dir is not None:
        check_draft_fits(candidate_dir, **in_place_of(serving_dir))
    named = draft_tensors(candidate_dir)  # kept alive until the update returned: the payload only points at them
    payload = _serialize(named)
    num_ranks = tp_size(url) if num_ranks is None else num_ranks
    draft_before = weights_checksum(url, "draft")
    target_before = weights_checksum(url, "target") if check_target else None
    post_json(f"{url}/pause_generation", {"mode": "in_place"})
    paused_at = time.perf_counter()
    try:
        post_json(f"{url}/begin_weight_update", {"selector": "draft"})
        try:
            answer = post_json(f"{url}/update_weights_from_tensor", {
                "serialized_named_tensors": [payload] * num_ranks, "selector": "draft", "flush_cache": False})
        finally:
            post_json(f"{url}/end_weight_update", {})
    finally:
        post_json(f"{url}/continue_generation", {})
        paused_s = time.perf_counter() - paused_at
    if not answer.get("success", False):
        raise RuntimeError(f"SGLang refused the draft update: {answer.get('message')}")
    return SwapResult(draft_checksum_before=draft_before, draft_checksum_after=weights_checksum(url, "draft"),
                      target_checksum_before=target_before,
                      target_checksum_after=weights_checksum(url, "target") if check_target else None,
                      paused_s=paused_s, num_tensors=len(named))
