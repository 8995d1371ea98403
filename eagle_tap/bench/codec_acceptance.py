"""What a lossy codec costs the draft: acceptance of drafts trained on decoded states, against lossless.

Data: the demo's captures (`eagle-tap demo`: the tiny target's own answers captured from a live CPU
SGLang server, train and held-out shards); a folder of an earlier demo, or captured here once.
For each codec the training shards are re-encoded with it (`capture_format.shard_codecs.recode_shards`,
what `eagle-tap shards recode` does); the first codec is the lossless baseline, the captures as stored.
For every codec and every seed, one draft is trained with the same settings, steps and seed (the seed
sets both the draft's initialisation and the data order, so runs pair up across codecs), then
evaluated on the same lossless held-out shards: TTT step-0 accuracy and simulated acceptance length.
The vocab mapping and draft config are built once, from the lossless training shards.

A codec is called within seed noise when the gap between its mean acceptance length and the
lossless mean is at most the larger of the two seed standard deviations.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["AcceptanceConfig", "measure_acceptance"]


@dataclass(kw_only=True, slots=True)
class AcceptanceConfig:
    """Which captures, which codecs, how many seeds and steps."""

    demo_run: str | None = None
    """Folder an `eagle-tap demo` wrote (captures/train, captures/heldout); None: capture one here (CPU SGLang)."""
    codecs: tuple[str, ...] = ("bf16-split", "int8-row", "e4m3-row", "int8-channel")
    """The first is the lossless baseline (the captures as stored); the others re-encode the training shards."""
    seeds: tuple[int, ...] = (0, 1, 2)
    train_steps: int = 100
    """Optimizer steps per run (the demo's other settings: batch 8, lr 3e-3, draft vocab 1024)."""
    ttt_steps: int = 3
    """TTT unroll while training: the acceptance length at chain_length needs no more, and training cost grows
    with it (7 steps: about 1.7 CPU-s per step on the project's machine; 12 runs would take 35 minutes)."""
    chain_length: int = 3
    """k of the acceptance length reported (draft tokens per verify step; the demo serves k = 3)."""
    num_threads: int | None = 1
    """torch threads per training run (None: torch's default; one leaves the other core to other work)."""


def _train_one(work: Path, shards: Path, seed: int, config: AcceptanceConfig, name: str) -> Path:
    from trainer.config import Config as TrainConfig
    from trainer.config import DataConfig, ObjectiveConfig, OptimizerConfig
    from trainer.train import train

    from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

    run_dir = work / "runs" / f"{name}-seed{seed}"
    train(TrainConfig(
        target=str(TINY_MODEL_DIR), draft_config=str(work / "draft-config.json"), vocab=str(work / "vocab"),
        out_dir=str(run_dir), seed=seed, num_threads=config.num_threads,
        data=DataConfig(shards=str(shards), batch_size=8, max_length=512, seed=seed),
        objective=ObjectiveConfig(ttt_steps=config.ttt_steps),
        optimizer=OptimizerConfig(learning_rate=3e-3, warmup_steps=max(1, config.train_steps // 10)),
        num_steps=config.train_steps, log_every=max(1, config.train_steps // 5), checkpoint_every=0, eval_every=0,
        progress_bar=False))
    return run_dir


def _captures(config: AcceptanceConfig, work: Path, log) -> tuple[Path, Path]:
    if config.demo_run is not None:
        captures = Path(config.demo_run) / "captures"
        if not (captures / "train").is_dir() or not (captures / "heldout").is_dir():
            raise ValueError(f"{config.demo_run} has no captures/train and captures/heldout: is it a demo's folder?")
        return captures / "train", captures / "heldout"
    from eagle_tap.demo.run import Config as DemoConfig
    from eagle_tap.demo.run import capture, prepare_out_dir, split_conversations

    log("codec acceptance: capturing the demo conversations from a CPU SGLang server ...")
    demo = DemoConfig(out_dir=work / "demo")
    out = prepare_out_dir(demo.out_dir, replace=False)
    train_data, heldout_data = split_conversations(demo, out / "data")
    result = capture(demo, out, train_data, heldout_data)
    if result["processes_left"]:
        raise RuntimeError(f"capture left processes running: {result['processes_left']}")
    return out / "captures" / "train", out / "captures" / "heldout"


def _spread(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def measure_acceptance(config: AcceptanceConfig, work: Path, log) -> dict[str, Any]:
    """Rows (one per codec: ratio, error, step-0 accuracy and acceptance length with their spread) and the runs."""
    import capture_format as cf
    from capture_format.shard_codecs import codec_summary, recode_shards
    from trainer.draft_config import build_draft_config
    from trainer.evaluate import evaluate
    from trainer.vocab import build_vocab_mapping

    from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

    if config.ttt_steps < config.chain_length:
        raise ValueError(f"ttt_steps {config.ttt_steps} must be at least chain_length {config.chain_length}")
    if len(config.seeds) < 2:
        raise ValueError(f"the acceptance table needs at least 2 seeds for a spread; got {config.seeds}")
    train_shards, heldout_shards = _captures(config, work, log)
    mapping, _ = build_vocab_mapping(target_dir=TINY_MODEL_DIR, draft_vocab_size=1024, out_dir=work / "vocab",
                                     shard_dir=train_shards, if_fewer="shrink")
    draft_config = build_draft_config(TINY_MODEL_DIR, draft_vocab_size=int(mapping.d2t.size))
    (work / "draft-config.json").write_text(json.dumps(draft_config, indent=2) + "\n", encoding="utf-8")
    rows, runs = [], []
    started = time.perf_counter()
    for position, codec in enumerate(config.codecs):
        shards = train_shards
        if position:
            shards = work / "shards" / codec
            with cf.ShardDirectory(train_shards) as source:
                recode_shards(source, shards, codec)
        with cf.ShardDirectory(shards) as directory:
            tallies, _ = codec_summary(directory)
        tally = tallies[codec] if codec in tallies else next(iter(tallies.values()))
        accuracies, lengths = [], []
        for seed in config.seeds:
            log(f"codec acceptance: {codec}, seed {seed}: training {config.train_steps} steps ...")
            run_dir = _train_one(work, shards, seed, config, codec.replace(":", "-"))
            result = evaluate(run_dir, heldout_shards, max_length=512)
            draft = result["drafts"]["draft"]
            accuracy, length = draft["step_accuracy"][0], draft["acceptance_length"][config.chain_length - 1]
            accuracies.append(accuracy)
            lengths.append(length)
            runs.append({"codec": codec, "seed": seed, "step0_accuracy": accuracy,
                         f"acceptance_length_k{config.chain_length}": length,
                         "acceptance_length": draft["acceptance_length"]})
        accuracy_mean, accuracy_std = _spread(accuracies)
        length_mean, length_std = _spread(lengths)
        rows.append({"codec": codec, "lossy": tally.lossy, "ratio": tally.ratio,
                     "relative_error": tally.error.relative_rms_error if tally.error else 0.0,
                     "step0_accuracy": accuracy_mean, "step0_accuracy_std": accuracy_std,
                     "acceptance_length": length_mean, "acceptance_length_std": length_std,
                     "per_seed_acceptance_length": lengths})
    baseline = rows[0]
    for row in rows:
        row["acceptance_delta"] = row["acceptance_length"] - baseline["acceptance_length"]
        noise = max(row["acceptance_length_std"], baseline["acceptance_length_std"])
        row["within_seed_noise"] = abs(row["acceptance_delta"]) <= noise
    return {"rows": rows, "runs": runs, "train_shards": str(train_shards), "heldout_shards": str(heldout_shards),
            "training_wall_s": time.perf_counter() - started}
