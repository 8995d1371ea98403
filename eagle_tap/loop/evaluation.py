"""How the loop judges a draft: `eagle-tap eval`'s figures on exactly the records a round names, at the replicas'
chain length, and the simulated served walk on the probe prompts that a swap's probe is later held to."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from eagle_tap.loop.state import LoopState

__all__ = ["evaluate_draft", "ids_digest", "probe_prompts", "simulate_probe", "write_ids"]


def ids_digest(record_ids: list[str]) -> str:
    """sha256 over the sorted record ids (a round's training set, named in one string)."""
    return hashlib.sha256("\n".join(sorted(record_ids)).encode()).hexdigest()


def write_ids(path: Path, record_ids: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{record_id}\n" for record_id in record_ids), encoding="utf-8")
    return path


def evaluate_draft(loop: LoopState, draft_dir: Path, shards: str, record_ids: list[str], *,
                   served_max_new_tokens: int | None = None) -> dict[str, Any]:
    """eval's figures for an exported draft on exactly these records, at the replicas' chain length."""
    from trainer.evaluate import evaluate

    ids_file = write_ids(Path(loop.config.work_dir) / "ids" / f"{ids_digest(record_ids)[:16]}.txt", record_ids)
    # eval warns that an exported draft lists no training records; the round keeps held-out and training
    # records apart itself (maybe_run_round), so the warning would only repeat on every evaluation.
    eval_log = logging.getLogger("trainer.evaluate")
    level = eval_log.level
    eval_log.setLevel(logging.ERROR)
    try:
        result = evaluate(draft_dir, shards, record_ids=str(ids_file), target=loop.config.target,
                          vocab=loop.config.vocab, max_length=loop.config.max_length,
                          served_max_new_tokens=served_max_new_tokens)
    finally:
        eval_log.setLevel(level)
    index = result["chain_lengths"].index(loop.config.num_steps)
    draft = result["drafts"]["draft"]
    return {"served_walk": draft["served_walk_acceptance_length"][index],
            "acceptance_length": draft["acceptance_length"][index], "num_records": result["num_records"],
            "step_accuracy": draft.get("step_accuracy")}


def probe_prompts(loop: LoopState) -> list:
    """The first probe_records prompts of the regression set (read once), or none."""
    config = loop.config
    if not config.regression_shards or config.probe_records <= 0:
        return []
    if loop.probe_prompt_cache is None:
        from eagle_tap.serve.evaluate import prompts_from_shards

        loop.probe_prompt_cache, _ = prompts_from_shards(Path(config.regression_shards),
                                                         max_prompts=config.probe_records)
    return loop.probe_prompt_cache


def simulate_probe(loop: LoopState, draft_dir: Path) -> dict[str, Any] | None:
    """The draft's simulated served walk on the probe records (what a probe after a swap is held to)."""
    prompts = probe_prompts(loop)
    if not prompts:
        return None
    ids = [prompt.key for prompt in prompts]
    result = evaluate_draft(loop, draft_dir, loop.config.regression_shards, ids,
                            served_max_new_tokens=loop.config.probe_max_new_tokens)
    return {"served_walk": result["served_walk"], "num_steps": loop.config.num_steps,
            "max_new_tokens": loop.config.probe_max_new_tokens, "record_ids": ids}
