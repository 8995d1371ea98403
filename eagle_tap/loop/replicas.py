"""Replicas of the closed loop: what one serves, putting a registry version into it, checking it, and the probe.

A swap goes through `eagle_tap.serve.swap.swap_draft` (SGLang's own weight-update session, selector draft,
tensors as shared-memory handles: the loop runs on the replica's host; see docs/loop.md for why this path and
not the plugin). Around it:
- before any replica is touched: the version's files match the sha256 its version.json recorded, and the
  draft can take the served one's place (same architecture, sizes, aux layer ids, vocab mapping, tensor
  shapes: `trainer.draft_fit.check_draft_fits` against the folder the replica was started from, or, where that folder is not
  on this host, against the version the registry says it serves) and was made for the target it serves;
- after the swap, `verify`: the target's checksum did not move (where the swap checked it: the loop does on a
  replica it meets first or again after a restart, not on every swap), the draft's moved (or already was this
  version's), and equals the checksum recorded for this version on a replica of the same dtype and
  parallelism when one is known; and a probe (greedy prompts whose answers the version's served walk was
  simulated on) gives a served acceptance length no lower than that simulation allows.
A version that fails verification is swapped out again for the one the replica served before.

What must hold: nothing here changes the registry; the loop (eagle_tap.loop.run) records what happened.
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle_tap.serve.draft import DraftMismatchError
from eagle_tap.serve.evaluate import Prompt
from eagle_tap.serve.swap import SwapResult, swap_draft
from eagle_tap.serve.http_api import post_json, weights_checksum
from trainer.draft_fit import check_draft_fits, in_place_of


class ReplicaDown(RuntimeError):
    """The replica did not answer (not started, restarting, or gone)."""


def get_json(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
        raise ReplicaDown(f"{url}: {error}") from None


def is_up(url: str, timeout_s: float = 30.0) -> bool:
    """SGLang's /health runs a one-token request and waits (up to its 20 s) for the scheduler's next output: a
    busy replica on a loaded host takes seconds to answer it, and a short timeout would report it down (a
    promotion then skips it). A replica that is really down refuses the connection at once."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Serving:
    """What a replica serves, from its /server_info."""

    url: str
    model_path: str
    draft_path: str | None
    algorithm: str | None
    num_steps: int | None
    dtype: str
    tp_size: int

    @property
    def weights_key(self) -> str:
        """Replicas with the same key hold the same draft tensors for the same version: SGLang's checksums match."""
        return f"{self.dtype}/tp{self.tp_size}"


def serving(url: str) -> Serving:
    info = get_json(f"{url}/server_info")
    return Serving(url=url, model_path=str(info.get("model_path")), draft_path=info.get("speculative_draft_model_path"),
                   algorithm=info.get("speculative_algorithm"), num_steps=info.get("speculative_num_steps"),
                   dtype=str(info.get("dtype")), tp_size=int(info.get("tp_size") or 1))


def check_fits_replica(candidate_dir: Path, replica: Serving, fallback_dir: Path | None) -> None:
    """DraftMismatchError unless candidate_dir can take the place of what the replica serves (module docstring)."""
    if replica.algorithm != "EAGLE3" or not replica.draft_path:
        raise DraftMismatchError(f"{replica.url} serves no EAGLE-3 draft (algorithm {replica.algorithm}): "
                                 "there is nothing to swap")
    launched = Path(replica.draft_path)
    reference = launched if (launched / "config.json").is_file() else fallback_dir
    if reference is None:
        raise DraftMismatchError(f"{replica.url} was started from {launched}, which is not on this host, and the "
                                 "registry records no version for it: start it from a registry version")
    target = Path(replica.model_path)
    check_draft_fits(candidate_dir, **in_place_of(reference),
                     target_dir=target if (target / "config.json").is_file() else None)


@dataclasses.dataclass(kw_only=True, slots=True)
class Verification:
    """What `verify` found after a swap."""

    ok: bool
    why: str
    draft_checksum: str
    probe: dict[str, Any] | None = None


def probe_acceptance(url: str, prompts: Sequence[Prompt], max_new_tokens: int, timeout_s: float = 300.0
                     ) -> dict[str, Any]:
    """Served acceptance length on the probe prompts (greedy): SGLang's pooled (accepted + steps) / steps."""
    import httpx

    from eagle_tap.serve.evaluate import generate

    verify_steps = accepted = 0
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
        for prompt in prompts:
            meta = generate(client, url, prompt, max_new_tokens).meta_info
            if "spec_verify_ct" not in meta:
                raise ValueError(f"{url} answered a probe without speculative figures: it is not serving a draft")
            verify_steps += int(meta["spec_verify_ct"])
            accepted += int(meta["spec_num_correct_drafts"])
    return {"num_prompts": len(prompts), "verify_steps": verify_steps, "accepted_drafts": accepted,
            "acceptance_length": (accepted + verify_steps) / verify_steps if verify_steps else float("nan")}


def verify(url: str, swap: SwapResult, *, known_checksum: str | None, probe_prompts: Sequence[Prompt],
           probe_max_new_tokens: int, simulated: float | None, tolerance: float) -> Verification:
    """The checks after a swap (module docstring). simulated: the version's served walk on the probe prompts."""
    after = swap.draft_checksum_after
    if swap.target_unchanged is False:
        return Verification(ok=False, why="the target's weights changed during the draft swap", draft_checksum=after)
    if known_checksum is not None and after != known_checksum:
        return Verification(ok=False, why=f"the draft checksum {after[:16]} differs from this version's on other "
                            f"replicas ({known_checksum[:16]})", draft_checksum=after)
    if not probe_prompts or simulated is None:
        return Verification(ok=True, why="checksums only (no probe set or no simulated figure)", draft_checksum=after)
    probe = probe_acceptance(url, probe_prompts, probe_max_new_tokens)
    probe["simulated_acceptance_length"] = simulated
    probe["tolerance"] = tolerance
    floor = simulated * (1.0 - tolerance)
    if not probe["acceptance_length"] >= floor:
        return Verification(ok=False, probe=probe, draft_checksum=after,
                            why=f"served acceptance {probe['acceptance_length']:.3f} on {len(probe_prompts)} probe "
                            f"prompts is below {floor:.3f} (simulated served walk {simulated:.3f}, tolerance "
                            f"{tolerance:.0%})")
    return Verification(ok=True, probe=probe, draft_checksum=after,
                        why=f"served acceptance {probe['acceptance_length']:.3f}, simulated {simulated:.3f}")


def prepare_swap(url: str, version_dir: Path, *, reference_dir: Path | None) -> tuple[Serving, Path]:
    """The checks before a swap, touching nothing: (what the replica serves, the folder to check the draft
    against). DraftMismatchError or ReplicaDown."""
    replica = serving(url)
    check_fits_replica(version_dir, replica, reference_dir)
    launched = Path(replica.draft_path)
    return replica, launched if (launched / "config.json").is_file() else reference_dir


def swap_in(url: str, version_dir: Path, *, reference_dir: Path | None) -> tuple[Serving, SwapResult, float]:
    """Check, then swap the draft in version_dir into url; (what the replica serves, SGLang's result, wall seconds
    of the swap)."""
    replica, _ = prepare_swap(url, version_dir, reference_dir=reference_dir)
    started = time.perf_counter()
    result = swap_draft(url, version_dir, serving_dir=None, num_ranks=replica.tp_size)  # prepare_swap checked it
    return replica, result, time.perf_counter() - started


def draft_checksum(url: str) -> str:
    try:
        return weights_checksum(url, "draft")
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
        raise ReplicaDown(f"{url}: {error}") from None


def release(url: str, timeout_s: float = 30.0) -> bool:
    """End what a process killed in the middle of a swap may have left on the replica: a weight-update session
    open (SGLang would refuse the next `begin_weight_update`) and generation paused (every request would wait,
    /health too). Harmless on a replica left as it should be: SGLang answers that no session is open, and
    `continue_generation` on a running replica changes nothing. Only the one process that keeps a replica may
    call it (a loop, or the agent holding its agent.lock). False when the replica did not answer."""
    try:
        post_json(f"{url}/end_weight_update", {}, timeout_s=timeout_s)
    except urllib.error.HTTPError:
        pass  # no session was open: SGLang answers 400
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False
    try:
        post_json(f"{url}/continue_generation", {}, timeout_s=timeout_s)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False
    return True
