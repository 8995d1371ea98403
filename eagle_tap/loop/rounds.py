"""One round of the loop: new records -> held out / trained on -> candidate -> evaluated beside the promoted one -> gate.

- New records: records of the shard set that no earlier round trained on or held out, in the order the
  collectors stored them (shard by shard, in each shard by offset). A round starts once there are
  `min_new_records` of them, or once the oldest has waited `max_age_s` (given enough to hold some out).
- The newest `heldout_fraction` of them (at least `min_heldout_records`) are held out: the candidate never
  trains on them, and both drafts are judged on them.
- Coverage first: the share of the new records' loss tokens inside the draft vocabulary. Below
  `min_coverage` the round trains nothing and says that a new mapping (a retrain and a restart) is needed:
  SGLang keeps the mapping a replica started with, so no swap can fix it.
- The candidate starts from the promoted version's weights (`init_from`, same vocab mapping) and trains on
  the rest of the new records plus `replay_ratio` times as many records of earlier rounds (replay keeps what
  older traffic taught), with a fresh optimizer.
- Evaluation: `eagle-tap eval`'s served walk at the replicas' chain length (the simulation of what SGLang
  counts per verify step), for candidate and promoted version, on the held-out records and on the
  regression set.
- Gate: promote only if the candidate's served walk on the held-out records beats the promoted version's by
  `gate_margin` and falls on the regression set by at most `regression_tolerance`.
What must hold: every round that decided anything is written down (rounds/rNNNN.json, and the version with
its eval); a candidate is stored as a version before any decision about it.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

from eagle_tap.loop.evaluation import evaluate_draft, ids_digest, simulate_probe, write_ids
from eagle_tap.loop.state import LoopState


def shard_entries(shards: str) -> list[Any]:
    """Every record's index entry, in the order the collectors stored them."""
    import capture_format as cf

    with cf.open_shard_directory(shards, skip_damaged=True) as directory:
        return list(directory.iter_index())


def new_records(loop: LoopState, entries: list[Any] | None = None, rounds: list[dict[str, Any]] | None = None) -> list[Any]:
    """The entries (default: the shard set's) that no counted round used (rounds: counted_rounds(), if at hand)."""
    used = loop.registry.used_record_ids(rounds)
    now = time.time()
    entries = [entry for entry in (shard_entries(loop.config.shards) if entries is None else entries)
               if entry.record_id not in used]
    for entry in entries:
        loop.first_seen.setdefault(entry.record_id, now)
    return entries


def due(loop: LoopState, entries: list[Any]) -> str | None:
    """Why a round starts now, or None."""
    config = loop.config
    if len(entries) >= config.min_new_records:
        return f"{len(entries)} new records (at least {config.min_new_records})"
    if config.max_age_s is not None and len(entries) > config.min_heldout_records:
        oldest = min(loop.first_seen[entry.record_id] for entry in entries)
        if time.time() - oldest >= config.max_age_s:
            return f"{len(entries)} new records, the oldest waiting {time.time() - oldest:.0f} s"
    return None


def coverage(loop: LoopState, entries: list[Any]) -> dict[str, Any]:
    """Share of the entries' loss tokens that the draft vocabulary holds."""
    import capture_format as cf
    import numpy as np

    from trainer.vocab import load_vocab_mapping

    mapping = load_vocab_mapping(loop.config.vocab)
    in_draft = np.zeros(mapping.t2d.size, dtype=bool)
    in_draft[mapping.draft_token_ids] = True
    total = covered = 0
    with cf.open_shard_directory(loop.config.shards, skip_damaged=True) as directory:
        for entry in entries:
            tokens = directory.read_token_ids(entry)
            loss_ids = tokens.token_ids[tokens.loss_mask().astype(bool)]
            total += int(loss_ids.size)
            covered += int(in_draft[loss_ids].sum())
    return {"loss_tokens": total, "covered": covered, "coverage": covered / total if total else 1.0}


DEFAULT_TRAIN_LAUNCHER = "{python} -m torch.distributed.run --standalone --nproc-per-node {processes}"
"""How train_candidate starts train_processes > 1 processes when no train_launcher is configured."""


def train_candidate(loop: LoopState, round_dir: Path, init_from: Path, record_ids: list[str]) -> dict[str, Any]:
    """Trains the round's candidate from init_from on record_ids and exports it: in this process, or as `eagle-tap
    train` under the configured launcher (LoopConfig.train_processes, train_launcher)."""
    from trainer.config import Config as TrainConfig
    from trainer.config import DataConfig, ObjectiveConfig, OptimizerConfig
    from trainer.export import export
    from trainer.train import train

    config = loop.config
    processes = config.train_processes  # divides batch_size (LoopConfig checks it)
    run_dir = round_dir / "train"
    train_config = TrainConfig(
        target=config.target, draft_config=config.draft_config, vocab=config.vocab, out_dir=str(run_dir),
        seed=config.seed, init_from=str(init_from),
        data=DataConfig(shards=config.shards, record_ids=str(write_ids(round_dir / "train-records.txt", record_ids)),
                        batch_size=config.batch_size // processes, max_length=config.max_length, seed=config.seed),
        objective=ObjectiveConfig(ttt_steps=config.ttt_steps),
        optimizer=OptimizerConfig(learning_rate=config.learning_rate, warmup_steps=config.warmup_steps),
        num_steps=config.train_steps, log_every=max(1, config.train_steps // 10), checkpoint_every=0,
        progress_bar=sys.stderr.isatty(), num_threads=config.train_num_threads)
    launcher = config.train_launcher or (DEFAULT_TRAIN_LAUNCHER if processes > 1 else None)
    if launcher is None:
        summary = train(train_config)
        steps, first_loss, last_loss = summary["step"], summary["first_loss"], summary["last_loss"]
    else:
        steps, first_loss, last_loss = launch_training(loop, launcher, train_config, round_dir)
    folder = export(run_dir, round_dir / "export")
    return {"run_dir": str(run_dir), "export": str(folder), "steps": steps, "processes": processes,
            "launcher": launcher, "first_loss": first_loss, "last_loss": last_loss}


def launch_training(loop: LoopState, launcher: str, train_config: Any, round_dir: Path) -> tuple[int, float, float]:
    """`eagle-tap train --config` on the round's config under launcher; its log goes to round_dir/train.log. The
    last step and the first and last logged losses, read back from the run's metrics.jsonl."""
    import dataclasses
    import json
    import shlex
    import subprocess

    from trainer.config_io import config_to_dict
    from trainer.metrics import read_metrics

    config_path = round_dir / "train-config.json"
    train_config = dataclasses.replace(train_config, progress_bar=False)  # its output goes to a log file
    config_path.write_text(json.dumps(config_to_dict(train_config), indent=2) + "\n", encoding="utf-8")
    command = [*shlex.split(launcher.format(python=shlex.quote(sys.executable), processes=loop.config.train_processes)),
               "-m", "eagle_tap.cli", "train", "--config", str(config_path)]
    loop.say(f"training the round's candidate: {shlex.join(command)}")
    log_path = round_dir / "train.log"
    with open(log_path, "wb") as log:
        finished = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if finished.returncode != 0:
        tail = log_path.read_bytes()[-3000:].decode("utf-8", "replace")
        raise RuntimeError(f"the round's training exited with {finished.returncode} ({shlex.join(command)}); "
                           f"the end of {log_path}:\n{tail}")
    lines = read_metrics(Path(train_config.out_dir) / "metrics.jsonl", "train")
    if not lines:
        raise RuntimeError(f"the round's training wrote no train line to {train_config.out_dir}/metrics.jsonl")
    return int(lines[-1]["step"]), float(lines[0]["loss"]), float(lines[-1]["loss"])


def gate(loop: LoopState, new: dict[str, dict[str, Any]], regression: dict[str, dict[str, Any]] | None) -> tuple[bool, str]:
    config = loop.config
    gain = new["candidate"]["served_walk"] - new["serving"]["served_walk"]
    if gain < config.gate_margin:
        return False, (f"on the held-out new records the candidate's served walk {new['candidate']['served_walk']:.3f} "
                       f"is {gain:+.3f} against the promoted version's {new['serving']['served_walk']:.3f}; "
                       f"the gate asks for +{config.gate_margin:.3f}")
    why = f"held-out new records: {new['serving']['served_walk']:.3f} -> {new['candidate']['served_walk']:.3f}"
    if regression is not None:
        drop = regression["serving"]["served_walk"] - regression["candidate"]["served_walk"]
        if drop > config.regression_tolerance:
            return False, (f"{why}, but on the regression set it falls {drop:.3f} "
                           f"({regression['serving']['served_walk']:.3f} -> {regression['candidate']['served_walk']:.3f}),"
                           f" more than the tolerance {config.regression_tolerance:.3f}")
        why += (f"; regression set: {regression['serving']['served_walk']:.3f} -> "
                f"{regression['candidate']['served_walk']:.3f}")
    return True, why


def judge(loop: LoopState, candidate_dir: Path, serving_dir: Path, record_ids: list[str]) -> dict[str, Any]:
    """Candidate and promoted version evaluated on these records of the shard set (`heldout`) and on the
    regression set, and the gate's verdict on them (`gate`: passed, why)."""
    config = loop.config
    evaluation: dict[str, Any] = {"heldout": {}, "regression": None}
    for label, folder in (("candidate", candidate_dir), ("serving", serving_dir)):
        evaluation["heldout"][label] = evaluate_draft(loop, folder, config.shards, record_ids)
    if config.regression_shards:
        regression_ids = [entry.record_id for entry in shard_entries(config.regression_shards)]
        evaluation["regression"] = {label: evaluate_draft(loop, folder, config.regression_shards, regression_ids)
                                    for label, folder in (("candidate", candidate_dir), ("serving", serving_dir))}
    passed, why = gate(loop, evaluation["heldout"], evaluation["regression"])
    evaluation["gate"] = {"passed": passed, "why": why, "margin": config.gate_margin,
                          "regression_tolerance": config.regression_tolerance}
    return evaluation


def maybe_run_round(loop: LoopState) -> dict[str, Any] | None:
    """Runs a round when one is due (module docstring); None when not."""
    config = loop.config
    registry = loop.registry
    stored, counted = shard_entries(config.shards), registry.counted_rounds()  # read once per tick
    entries = new_records(loop, stored, counted)
    reason = due(loop, entries)
    if reason is None:
        return None
    state = registry.state()
    serving = state["promoted"]
    if serving is None:
        raise RuntimeError(f"{registry.url} has no promoted version: run `eagle-tap loop init` first")
    number = max((int(earlier[1:]) for earlier in registry.round_names()), default=0) + 1
    name = f"r{number:04d}"
    round_dir = Path(config.work_dir) / name
    num_heldout = max(config.min_heldout_records, round(len(entries) * config.heldout_fraction))
    heldout, fresh = entries[-num_heldout:], entries[:-num_heldout]
    # A request sent again (greedy, or the same prompt) gives a record with the same tokens under another id:
    # it must not train a candidate that is judged on its twin.
    heldout_sequences = {entry.ids_xxh3_64 for entry in heldout}
    twins = [entry for entry in fresh if entry.ids_xxh3_64 in heldout_sequences]
    fresh = [entry for entry in fresh if entry.ids_xxh3_64 not in heldout_sequences]
    new_ids, heldout_ids = [entry.record_id for entry in fresh], [entry.record_id for entry in heldout]
    available = {entry.record_id for entry in stored if entry.ids_xxh3_64 not in heldout_sequences}
    older = sorted(record_id for earlier in counted  # an abandoned round's records are new again
                   for record_id in earlier.get("new_record_ids", ()) if record_id in available)
    rng = random.Random(config.seed * 1_000_003 + number)
    replay_ids = rng.sample(older, min(len(older), round(config.replay_ratio * len(new_ids))))
    info: dict[str, Any] = {"round": name, "started_at": time.time(), "why": reason, "serving": serving,
                            "new_record_ids": new_ids, "heldout_record_ids": heldout_ids, "replay_record_ids": replay_ids,
                            "left_out_twins_of_heldout": [entry.record_id for entry in twins]}
    loop.say(f"round {name}: {reason}; {len(new_ids)} new records to train on, {len(heldout_ids)} held out, "
             f"{len(replay_ids)} replayed")
    registry.event("round_started", round=name, why=reason, new=len(new_ids), heldout=len(heldout_ids),
                   replay=len(replay_ids))
    info["coverage"] = coverage(loop, entries)
    if info["coverage"]["coverage"] < config.min_coverage:
        info["decision"] = "coverage_low"
        info["why_decided"] = (f"the draft vocabulary covers {info['coverage']['coverage']:.1%} of the new records' "
                               f"loss tokens (at least {config.min_coverage:.0%} asked): a new mapping is needed, which "
                               "means `eagle-tap vocab`, a full retrain and a restart of the replicas; no swap can "
                               "change the mapping SGLang serves with")
        registry.write_round(name, info)
        registry.event("coverage_low", round=name, why=info["why_decided"], **info["coverage"])
        loop.say(f"round {name}: {info['why_decided']}")
        return {"round": name, "decision": "coverage_low", "why": info["why_decided"]}
    serving_dir = registry.local_copy(serving)
    info["training"] = train_candidate(loop, round_dir, serving_dir, new_ids + replay_ids)
    candidate_dir = Path(info["training"]["export"])
    evaluation = judge(loop, candidate_dir, serving_dir, heldout_ids)
    passed, why = evaluation["gate"]["passed"], evaluation["gate"]["why"]
    made = {"round": name, "init_from": serving, "steps": info["training"]["steps"],
            "new_records": len(new_ids), "replay_records": len(replay_ids), "heldout_records": len(heldout_ids),
            "training_records_sha256": ids_digest(new_ids + replay_ids), "heldout_records_sha256": ids_digest(heldout_ids),
            "first_loss": info["training"]["first_loss"], "last_loss": info["training"]["last_loss"]}
    version = registry.add_version(candidate_dir, parent=serving, made=made, evaluation=evaluation)
    registry.set_version_info(version.name, probe=simulate_probe(loop, candidate_dir))
    info.update(version=version.name, evaluation=evaluation, decision="promote" if passed else "reject",
                why_decided=why)
    if not passed:
        registry.set_version_state(version.name, "rejected", why)
    registry.write_round(name, info)
    registry.event("gate", round=name, version=version.name, passed=passed, why=why)
    loop.say(f"round {name}: coverage {info['coverage']['coverage']:.1%}; {version.name} "
             f"{'passes' if passed else 'fails'} the gate: {why}")
    return {"round": name, "version": version.name, "decision": info["decision"], "why": why,
            "evaluation": evaluation}
