"""Object-store benchmark: trainer input from an S3 bucket (cache cold, then warm) vs local disk vs training steps.

The bucket is moto's S3 server (eagle_tap.testbed.s3_server), a child process on loopback speaking the real S3
HTTP API; the shards are trainer_pipeline's synthetic records of the tiny target, uploaded by the
collector's own Uploader (put, read back and checked, index last), which is timed too. Each loader row
reads one epoch through trainer/data.py's ShardDataset and make_loader as `eagle-tap train` builds them
(every record fetched with its own ranged GET, the next batch fetched while this one is used, every
checksum verified); "cache cold" starts from an empty record cache, "cache warm" reads the same epoch
again through the cache it filled. Rates count from the first batch on; first_batch_s (listing the
prefix, loading indexes, starting workers) is reported apart. The training step is trainer_pipeline's
measurement (real optimizer steps on CPU), and every ratio is against it: the goal is object store,
cache cold, >= 5x what training consumes.

On this machine the S3 server shares the cores with the loader and the training step: a remote store
adds latency instead, which the prefetch of the next batch hides as long as a batch arrives in less
time than a step takes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle_tap.bench import trainer_pipeline

COLUMNS = [
    ["item", "what", "s"],
    ["records", "records", "d"],
    ["first_batch_s", "first batch (s)", ".2f"],
    ["records_s", "records/s", ",.1f"],
    ["tokens_s", "tokens/s", ",.0f"],
    ["mb_s", "MB/s (stored bytes)", ",.1f"],
    ["ratio_to_step", "ratio to training step", ".2f"],
]
BUCKET = "eagle-tap-bench"


@dataclass(kw_only=True, slots=True)
class Config:
    """The synthetic capture and step measurement of trainer_pipeline, and the loaders to time."""

    data: trainer_pipeline.Config = field(default_factory=lambda: trainer_pipeline.Config(loader_passes=1))
    """Records, batch size, max_length, training steps, loader_workers (trainer_pipeline's; one epoch per row)."""

    @classmethod
    def quick(cls) -> Config:
        return cls(data=trainer_pipeline.Config(num_records=64, max_tokens=256, max_length=256, loader_passes=1,
                                                train_steps=2, loader_workers=(0,)))


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _upload(shards: Path, url: str) -> dict[str, Any]:
    """Uploads every shard of shards with the collector's Uploader (keeping the local copies); times it."""
    from capture_format.object_store import parse_location
    from collector_service.uploader import Uploader

    uploader = Uploader(shards, parse_location(url), "bench", keep_local=True, retry_initial_s=0.5, retry_max_s=2.0)
    started = time.perf_counter()
    uploader.start()
    uploader.stop(drain_s=600)
    uploader.join()
    seconds = time.perf_counter() - started
    if uploader.stats()["num_pending"] or uploader.stats()["refused"]:
        raise AssertionError(f"the upload did not finish: {uploader.stats()}")
    return {"nbytes": uploader.num_uploaded_nbytes, "num_shards": uploader.num_uploaded, "seconds": seconds}


def run(config: Config) -> dict[str, Any]:
    from eagle_tap.testbed.s3_server import S3Server
    from trainer import data, ttt
    from trainer.config import Config as TrainConfig

    import capture_format as cf
    from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

    measured = config.data
    work = Path(tempfile.mkdtemp(prefix="eagle-tap-bench-objstore-", dir=measured.work_dir))
    server = S3Server(log_path=work / "moto.log")
    try:
        inputs = trainer_pipeline.prepare(work, measured)
        with cf.ShardDirectory(inputs["shards"]) as shards:
            entries = list(shards.iter_index())
        tokens_of = {entry.record_id: entry.num_tokens for entry in entries}
        stored_of = {entry.record_id: entry.length for entry in entries}
        expected = {"capture_layers": entries[0].capture_layers, "hidden_size": entries[0].hidden_size,
                    "model_fingerprint": entries[0].model_fingerprint}
        url = f"s3://{BUCKET}/captures"
        with server, _environment(server.environment()):
            server.create_bucket(BUCKET)
            upload = _upload(inputs["shards"], url)
            train_config = TrainConfig(
                target=str(TINY_MODEL_DIR), draft_config=str(inputs["draft_config"]), vocab=str(inputs["vocab"]),
                out_dir=str(work / "run"), objective=ttt.Config(ttt_steps=measured.ttt_steps),
                data=data.Config(shards=str(inputs["shards"]), batch_size=measured.batch_size,
                                 max_length=measured.max_length, seed=measured.seed),
                num_steps=measured.train_steps + 1, checkpoint_every=0, progress_bar=False, device="cpu",
                num_threads=measured.num_threads, seed=measured.seed,
            )
            step = trainer_pipeline.measure_steps(train_config, measured.train_steps, tokens_of)
            loaders = []
            for num_workers in measured.loader_workers:
                cache = work / f"cache-{num_workers}"
                for what, shards_at in (("local disk", str(inputs["shards"])), ("object store, cache cold", url),
                                        ("object store, cache warm", url)):
                    loader_config = data.Config(shards=shards_at, batch_size=measured.batch_size,
                                                max_length=measured.max_length, seed=measured.seed,
                                                num_workers=num_workers, cache_dir=str(cache))
                    result = trainer_pipeline.measure_loader(loader_config, expected, 1, tokens_of)
                    loaders.append((f"{what}, num_workers {num_workers}", num_workers, result))
                shutil.rmtree(cache, ignore_errors=True)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    step_records_s = step["records"] / step["seconds"]
    mean_stored = sum(stored_of.values()) / len(stored_of)
    rows = [{"item": "collector upload (put, read back, check; index last)", "records": len(entries),
             "first_batch_s": None, "records_s": len(entries) / upload["seconds"], "tokens_s": None,
             "mb_s": upload["nbytes"] / upload["seconds"] / 1e6, "ratio_to_step": None, "num_workers": None}]
    for item, num_workers, result in loaders:
        records_s = result["timed_records"] / result["seconds"]
        rows.append({"item": item, "records": result["records"], "first_batch_s": result["first_batch_s"],
                     "records_s": records_s, "tokens_s": result["tokens"] / result["seconds"],
                     "mb_s": records_s * mean_stored / 1e6, "ratio_to_step": records_s / step_records_s,
                     "num_workers": num_workers})
    rows.append({"item": f"training step (TTT {measured.ttt_steps} steps, AdamW)", "records": step["records"],
                 "first_batch_s": None, "records_s": step_records_s, "tokens_s": step["tokens"] / step["seconds"],
                 "mb_s": step_records_s * mean_stored / 1e6, "ratio_to_step": 1.0, "num_workers": None})
    cold = [row for row in rows if "cache cold" in row["item"]]
    slowest_cold = min(cold, key=lambda row: row["ratio_to_step"])
    summary = {"step_records_s": step_records_s, "upload_mb_s": rows[0]["mb_s"],
               "object_store_cold_over_step": {str(row["num_workers"]): row["ratio_to_step"] for row in cold},
               "local_over_step": {str(row["num_workers"]): row["ratio_to_step"] for row in rows
                                   if row["item"].startswith("local disk")},
               "goal_met": slowest_cold["ratio_to_step"] >= 5.0}
    notes = [
        f"{len(entries)} synthetic records of {measured.min_tokens}-{measured.max_tokens} tokens "
        f"({sum(tokens_of.values()):,} tokens, {sum(stored_of.values()) / 1e6:.1f} MB stored) in "
        f"{upload['num_shards']} shards, on moto's S3 server (a child process on loopback, sharing this machine's "
        f"cores); batch size {measured.batch_size}, max_length {measured.max_length}; one epoch per loader row, "
        f"rates from the first batch on; step: {measured.train_steps} timed steps on CPU, "
        f"{step['torch_threads']} torch threads",
        f"object store with the cache cold / training step, slowest loader ({slowest_cold['item']}): "
        f"**{slowest_cold['ratio_to_step']:.1f}x** (goal >= 5x: {'met' if summary['goal_met'] else 'NOT met'})",
    ]
    return {"title": "Trainer input from an object store vs local disk vs training-step consumption (tiny target)",
            "parameters": asdict(config), "columns": COLUMNS, "rows": rows, "summary": summary, "notes": notes}
