"""Trainer benchmark: the input pipeline's records/s against what real training steps consume.

Pipeline: trainer/data.py's ShardDataset and make_loader as `eagle-tap train` builds them (index,
deterministic plan, every record read and its checksums verified, the read-time shift, collate), in
records/s and tokens/s with each loader_workers setting, counted from the first batch on (worker
start-up, paid once per run, is reported apart). Step: real optimizer steps of trainer/train.py
(`train_step`: the TTT objective's forward and backward, gradient clipping, AdamW, scheduler) for a
draft of the tiny target, on batches already in memory, at the same batch size. Ratio pipeline /
step > 1 means the loader keeps up with training; with num_workers 0 the loader runs in the
training process, so there its time adds to each step's.

Shards: synthetic records with the tiny target's shapes (hidden 128, capture layers 3/5/6, its
vocab and fingerprint): residual-like Gaussian bf16 states, random token ids, loss on the second
half, stored with the default codec through capture_format.write_shards. The draft config and the
vocab mapping (over these shards) come from the trainer's own code.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

import capture_format as cf
from eagle_tap.bench.codecs import residual_like_states
from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

COLUMNS = [
    ["item", "what", "s"],
    ["records", "records", "d"],
    ["first_batch_s", "first batch (s)", ".2f"],
    ["records_s", "records/s", ",.1f"],
    ["tokens_s", "tokens/s", ",.0f"],
    ["ratio_to_step", "ratio to training step", ".2f"],
]


@dataclass(kw_only=True, slots=True)
class Config:
    """Size of the synthetic capture, of batches, and of each measurement."""

    num_records: int = 256
    min_tokens: int = 128
    """Record lengths are uniform in [min_tokens, max_tokens]."""
    max_tokens: int = 512
    batch_size: int = 8
    """Rows per batch, one record per row (the trainer's default, no packing)."""
    max_length: int = 512
    """Positions per row (trainer data.max_length)."""
    loader_workers: tuple[int, ...] = (0, 2)
    """DataLoader num_workers settings to measure."""
    loader_passes: int = 8
    """Epochs the loader reads per measurement."""
    train_steps: int = 6
    """Timed optimizer steps, after one untimed warm-up step."""
    ttt_steps: int = 7
    """TTT unroll length (the trainer's default)."""
    draft_vocab_size: int = 512
    num_threads: int | None = None
    """torch threads of the training step (None: torch's default)."""
    seed: int = 0
    work_dir: str | None = None
    """Where shards, vocab and the run go (default: a temp dir, removed after)."""

    @classmethod
    def quick(cls) -> Config:
        return cls(num_records=64, max_tokens=256, max_length=256, loader_passes=2, train_steps=2)


def synthetic_records(model_dir: Path, config: Config) -> Iterator[cf.CaptureRecord]:
    """config.num_records records shaped like model_dir's captures (see the module docstring)."""
    from capture_format.fingerprint import model_fingerprint
    from trainer.vocab import read_model_config

    target = read_model_config(model_dir)
    hidden_size, vocab_size = target["hidden_size"], target["vocab_size"]
    capture_layers = tuple(cf.default_capture_layers(target["num_hidden_layers"]))
    fingerprint = model_fingerprint(model_dir)
    rng = np.random.default_rng(config.seed)
    for number in range(config.num_records):
        num_tokens = int(rng.integers(config.min_tokens, config.max_tokens + 1))
        states = residual_like_states(num_tokens * (len(capture_layers) + 1), hidden_size, config.seed + number)
        states = states.reshape(num_tokens, len(capture_layers) + 1, hidden_size)  # (T, K+1, H)
        yield cf.CaptureRecord(
            record_id=f"bench-{number:06d}",
            sample_id=f"bench-{number:06d}",
            model_fingerprint=fingerprint,
            capture_layers=capture_layers,
            hidden_size=hidden_size,
            dtype="bfloat16",
            token_ids=rng.integers(0, vocab_size, size=num_tokens, dtype=np.int32),
            loss_spans=((num_tokens // 2, num_tokens),),
            aux=states[:, :-1],
            final=states[:, -1],
        )


def prepare(work: Path, config: Config) -> dict[str, Any]:
    """Shards, draft config and vocab mapping for the tiny target in work; their paths and counts."""
    from trainer.draft_config import build_draft_config
    from trainer.vocab import build_vocab_mapping

    shards = work / "shards"
    indexes = cf.write_shards(synthetic_records(TINY_MODEL_DIR, config), shards, records_per_shard=64)
    draft_config = work / "draft.json"
    draft_config.write_text(json.dumps(build_draft_config(TINY_MODEL_DIR, draft_vocab_size=config.draft_vocab_size)))
    build_vocab_mapping(target_dir=TINY_MODEL_DIR, draft_vocab_size=config.draft_vocab_size, out_dir=work / "vocab",
                        shard_dir=shards, if_fewer="fill")
    return {"shards": shards, "draft_config": draft_config, "vocab": work / "vocab",
            "num_records": sum(index.num_records for index in indexes),
            "num_tokens": sum(index.num_tokens for index in indexes),
            "stored_bytes": sum(index.shard_path.stat().st_size for index in indexes)}


def measure_loader(data_config: Any, expected: dict[str, Any], num_passes: int,
                   tokens_of: dict[str, int]) -> dict[str, Any]:
    """Reads num_passes epochs through the trainer's loader. Rates count from the first batch on (training
    builds its loader once for all epochs, so worker start-up is paid once); first_batch_s is that start-up."""
    from trainer import data

    dataset = data.ShardDataset(data_config, num_epochs=num_passes, **expected)
    started = time.perf_counter()
    first_batch_at = None
    num_records = num_tokens = num_skipped = 0
    for batch in data.make_loader(dataset):
        num_skipped += len(batch["skipped_record_ids"])
        if first_batch_at is None:
            first_batch_at = time.perf_counter()
            num_first = len(batch["record_ids"])
            continue
        num_records += len(batch["record_ids"])
        num_tokens += sum(tokens_of[record_id] for record_id in batch["record_ids"])
    finished = time.perf_counter()
    if num_skipped:
        raise AssertionError(f"the loader skipped {num_skipped} records of freshly written shards")
    return {"records": num_first + num_records, "timed_records": num_records, "tokens": num_tokens,
            "seconds": finished - first_batch_at, "first_batch_s": first_batch_at - started}


def measure_steps(train_config: Any, expected_steps: int, tokens_of: dict[str, int]) -> dict[str, Any]:
    """Times expected_steps real optimizer steps after one warm-up step, on batches read beforehand."""
    import torch

    from trainer import data, distributed
    from trainer.train import start_run, train_step

    runtime = distributed.setup(train_config.device)
    threads = torch.get_num_threads()
    if train_config.num_threads:
        torch.set_num_threads(train_config.num_threads)
    try:
        run = start_run(train_config, runtime, resume=False)
        dataset = data.ShardDataset(train_config.data, **run.expected)
        cached = list(itertools.islice(data.make_loader(dataset), expected_steps + 1))  # read before timing
        batches = iter(cached)
        train_step(run, batches)  # warm-up: first-call allocations and optimizer state creation
        started = time.perf_counter()
        num_records = num_tokens = 0
        losses = []
        for _ in range(expected_steps):
            metrics, record_ids = train_step(run, batches)
            num_records += len(record_ids)
            num_tokens += sum(tokens_of[record_id] for record_id in record_ids)
            losses.append(metrics["loss"])
        seconds = time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)
        distributed.teardown(runtime)
    if not all(math.isfinite(loss) for loss in losses):
        raise AssertionError(f"training produced a non-finite loss: {losses}")
    return {"records": num_records, "tokens": num_tokens, "seconds": seconds, "final_loss": losses[-1],
            "torch_threads": train_config.num_threads or threads}


def run(config: Config) -> dict[str, Any]:
    from trainer import data, ttt
    from trainer.config import Config as TrainConfig

    work = Path(tempfile.mkdtemp(prefix="eagle-tap-bench-trainer-", dir=config.work_dir))
    try:
        inputs = prepare(work, config)
        with cf.ShardDirectory(inputs["shards"]) as shards:
            entries = list(shards.iter_index())
        tokens_of = {entry.record_id: entry.num_tokens for entry in entries}
        data_config = data.Config(shards=str(inputs["shards"]), batch_size=config.batch_size,
                                  max_length=config.max_length, seed=config.seed)
        train_config = TrainConfig(
            target=str(TINY_MODEL_DIR), draft_config=str(inputs["draft_config"]), vocab=str(inputs["vocab"]),
            out_dir=str(work / "run"), data=data_config, objective=ttt.Config(ttt_steps=config.ttt_steps),
            num_steps=config.train_steps + 1, checkpoint_every=0, progress_bar=False, device="cpu",
            num_threads=config.num_threads, seed=config.seed,
        )
        step = measure_steps(train_config, config.train_steps, tokens_of)
        expected = {"capture_layers": entries[0].capture_layers, "hidden_size": entries[0].hidden_size,
                    "model_fingerprint": entries[0].model_fingerprint}
        loaders = {}
        for num_workers in config.loader_workers:
            worker_config = data.Config(shards=str(inputs["shards"]), batch_size=config.batch_size,
                                        max_length=config.max_length, seed=config.seed, num_workers=num_workers)
            loaders[num_workers] = measure_loader(worker_config, expected, config.loader_passes, tokens_of)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    step_records_s = step["records"] / step["seconds"]
    rows = []
    for num_workers, measured in loaders.items():
        records_s = measured["timed_records"] / measured["seconds"]
        rows.append({"item": f"loader, num_workers {num_workers}", "records": measured["records"],
                     "first_batch_s": measured["first_batch_s"], "records_s": records_s,
                     "tokens_s": measured["tokens"] / measured["seconds"], "ratio_to_step": records_s / step_records_s,
                     "num_workers": num_workers})
    rows.append({"item": f"training step (TTT {config.ttt_steps} steps, AdamW)", "records": step["records"],
                 "first_batch_s": None, "records_s": step_records_s, "tokens_s": step["tokens"] / step["seconds"],
                 "ratio_to_step": 1.0, "num_workers": None})
    slowest = min(rows[:-1], key=lambda row: row["ratio_to_step"])
    summary = {"num_records_written": inputs["num_records"], "num_tokens_written": inputs["num_tokens"],
               "stored_mb": inputs["stored_bytes"] / 1e6, "step_records_s": step_records_s,
               "step_seconds": step["seconds"] / config.train_steps, "final_loss": step["final_loss"],
               "torch_threads": step["torch_threads"],
               "pipeline_over_step": {str(row["num_workers"]): row["ratio_to_step"] for row in rows[:-1]}}
    notes = [
        f"{inputs['num_records']} synthetic records of {config.min_tokens}-{config.max_tokens} tokens "
        f"({inputs['num_tokens']:,} tokens, {summary['stored_mb']:.1f} MB stored, bf16-split) shaped like the tiny "
        f"target's captures; batch size {config.batch_size}, max_length {config.max_length}, draft vocab "
        f"{config.draft_vocab_size}; loader: {config.loader_passes} epoch(s) per row, rates from the first batch on; "
        f"step: {config.train_steps} timed steps on CPU, {step['torch_threads']} torch threads",
        f"pipeline / step with the slowest loader ({slowest['item']}): **{slowest['ratio_to_step']:.1f}x** "
        f"({'the loader keeps up' if slowest['ratio_to_step'] > 1 else 'the loader is the bottleneck'})",
    ]
    return {"title": "Trainer input pipeline vs training-step consumption (tiny target)",
            "parameters": asdict(config), "columns": COLUMNS, "rows": rows, "summary": summary, "notes": notes}
