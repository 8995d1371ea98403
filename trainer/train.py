"""`eagle-tap train`: EAGLE-3 draft training off capture shards, in one process or under torchrun.

What must hold:
- every setting is in one typed Config (a TOML/JSON file plus dotted overrides), written to
  out_dir/config.json; the target, draft config, vocab mapping and every record must agree
  (vocab sizes, tokenizer, capture layers, hidden size, target fingerprint) or training refuses;
- on CPU, a run stopped after a checkpoint and continued with `--resume` logs exactly the losses
  of an uninterrupted run: checkpoints hold weights, optimizer, scheduler, data position and RNG,
  and the data order depends only on (seed, epoch, batch number);
- under torchrun each rank reads its own records and DDP keeps weights equal; every rank writes a
  digest of its final weights (final/weights-digest.rank<r>.json) so this can be checked. A step of N
  ranks equals (within float rounding) the step of one process with N times the batch size: the ranks
  together read that process's rows (trainer/data.py), each normalises its loss by the learned rows of
  all ranks' batches, and metrics log the sum of the ranks' losses, the loss of the global batch;
- a warm start (`init_from`: a run folder or an exported draft) starts the trainable weights from the
  source's, exactly (as stored: an export's bf16 values), with a fresh optimizer and schedule; a source
  whose draft shape, capture layers, target or vocab mapping differs from the run's is refused before
  anything is written. out_dir/config.json records the source's path and the sha256 of its weights file
  (init_from_sha256). A resumed run continues from its checkpoint and keeps the source it recorded.

out_dir: config.json, metrics.jsonl, loss.png, accuracy.png, checkpoints/, final/ (model.safetensors
with SGLang's parameter names, the draft config.json, weight digests), record_ids.rank<r>.txt
(with log_record_ids).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import capture_format as cf
from trainer import data, distributed, sequence_parallel, ttt
from trainer.budget import memory_budget
from trainer.checkpoint import checkpoint_dirs, load_checkpoint, save_checkpoint
from trainer.config import Config
from trainer.config_io import config_from_dict, config_to_dict
from trainer.data import Config as DataConfig
from trainer.metrics import MetricsLog, write_plots
from trainer.model import Config as ModelConfig
from trainer.model import Eagle3Draft, trainable_state_dict
from trainer.warm_start import check_init_from, load_init_from, recorded_init_from

log = logging.getLogger(__name__)


def build_objective(
    config: Config, runtime: distributed.Runtime
) -> tuple[ttt.Eagle3Objective, dict[str, Any], str]:
    """The draft (target embedding, vocab mapping loaded) inside its objective; the draft config; fingerprint."""
    from capture_format.fingerprint import model_fingerprint
    from trainer.draft_config import load_draft_config
    from trainer.target_weights import load_embedding_and_lm_head
    from trainer.vocab import load_vocab_mapping, read_model_config

    draft_json = load_draft_config(config.draft_config)
    model_config = ModelConfig.from_draft_config(draft_json)
    target = read_model_config(config.target)
    fingerprint = model_fingerprint(config.target)
    if draft_json["eagle_tap"]["target_model_fingerprint"] != fingerprint:
        made_for = draft_json["eagle_tap"]["target_model_fingerprint"]
        raise ValueError(f"{config.draft_config} was made for target {made_for}; {config.target} is {fingerprint}. "
                         f"Rerun eagle-tap draft-config --target {config.target}")
    if (model_config.vocab_size, model_config.target_hidden_size) != (target["vocab_size"], target["hidden_size"]):
        raise ValueError(f"{config.draft_config} does not fit the target's vocab size and hidden size")
    mapping = load_vocab_mapping(config.vocab, config.target)
    if mapping.d2t.size != model_config.draft_vocab_size:
        raise ValueError(f"the vocab mapping has {mapping.d2t.size} draft tokens; {config.draft_config} says "
                         f"draft_vocab_size {model_config.draft_vocab_size}. Make them agree")
    embedding, lm_head = load_embedding_and_lm_head(config.target, bool(target.get("tie_word_embeddings", False)))
    # The frozen target tensors: fp32 on CPU (exact tests), bf16 on GPU, where no fp32 copy of either is made.
    frozen_dtype = torch.float32 if runtime.device.type == "cpu" else torch.bfloat16
    torch.manual_seed(config.seed)
    draft = Eagle3Draft(model_config, frozen_dtype=frozen_dtype)
    draft_ids = torch.from_numpy(mapping.draft_token_ids)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(embedding)
        draft.d2t.copy_(torch.from_numpy(mapping.d2t))
        draft.t2d.copy_(torch.from_numpy(mapping.t2d))
        if config.init_lm_head_from_target:
            draft.lm_head.weight.copy_(lm_head[draft_ids].float())
    objective = ttt.Eagle3Objective(draft, lm_head.to(frozen_dtype), config.objective).to(runtime.device)
    budget = memory_budget(objective)
    if runtime.is_main:
        log.info("memory per rank: %s", budget.summary())
    return objective, draft_json, fingerprint


def initial_objective(run_config: dict[str, Any]) -> ttt.Eagle3Objective:
    """The objective a run starts from (its seed, target weights and vocab mapping, no step taken), on the CPU."""
    runtime = distributed.Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    objective, _, _ = build_objective(config_from_dict(Config, run_config), runtime)
    return objective


def build_optimizer(
    draft: Eagle3Draft, config: Config
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (no weight decay on norms) and its learning-rate schedule: linear warmup, then cosine to the floor."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    trained = [(name, p) for name, p in draft.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for _, p in trained if p.ndim >= 2], "weight_decay": config.optimizer.weight_decay},
        {"params": [p for _, p in trained if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=config.optimizer.learning_rate, betas=tuple(config.optimizer.betas))
    # transformers' schedule is 0 at its step 0; counting from 1 (last_epoch=0, which needs initial_lr) makes the
    # k-th optimizer step run at its value at k: step 1 at learning_rate / warmup_steps, the last one at the floor.
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=config.optimizer.warmup_steps, num_training_steps=config.num_steps,
        min_lr_rate=config.optimizer.min_learning_rate_ratio, last_epoch=0)
    return optimizer, scheduler


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {key: value.to(device, non_blocking=True) if torch.is_tensor(value) else value
            for key, value in batch.items()}


def weight_digests(draft: Eagle3Draft) -> dict[str, str]:
    """sha256 of every tensor of the draft's state dict: equal digests, equal weights."""
    return {name: hashlib.sha256(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, tensor in draft.state_dict().items()}


@dataclass(kw_only=True, slots=True)
class Run:
    """A training run's live objects, built by start_run."""

    config: Config
    runtime: distributed.Runtime
    objective: ttt.Eagle3Objective
    module: torch.nn.Module
    """objective, wrapped in DDP under torchrun."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    draft_json: dict[str, Any]
    expected: dict[str, Any]
    """What every record must match: capture_layers, hidden_size, model_fingerprint."""
    start_step: int
    next_batch: int
    """Batches this rank has consumed: the data position."""
    blocks: sequence_parallel.Blocks | None = None
    """This rank's block of positions under sequence parallelism; None: each rank trains whole windows."""

    @property
    def draft(self) -> Eagle3Draft:
        return self.objective.draft

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.config.bf16_autocast and self.runtime.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()


def start_run(config: Config, runtime: distributed.Runtime, resume: str | bool) -> Run:
    """Builds the objective and optimizer, restores a checkpoint when resuming, else starts from init_from if set."""
    out_dir = Path(config.out_dir)
    random.seed(config.seed)
    np.random.seed(config.seed)
    objective, draft_json, fingerprint = build_objective(config, runtime)
    if config.init_from is not None and not resume:
        with torch.no_grad():
            load_init_from(objective.draft, check_init_from(config))
    optimizer, scheduler = build_optimizer(objective.draft, config)
    start_step = next_batch = 0
    if resume:
        found = checkpoint_dirs(out_dir)
        if not found and not isinstance(resume, str):
            raise ValueError(f"--resume: no checkpoint in {out_dir / 'checkpoints'}")
        state = load_checkpoint(Path(resume) if isinstance(resume, str) else found[-1], runtime)
        if state["world_size"] != runtime.world_size:
            raise ValueError(f"the checkpoint was written by {state['world_size']} ranks; resume with as many")
        objective.draft.load_state_dict({**state["model"], "embed_tokens.weight": objective.draft.embed_tokens.weight})
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_step, next_batch = state["step"], state["data"]["next_batch"]
    elif checkpoint_dirs(out_dir):
        raise ValueError(f"{out_dir} already holds checkpoints: pass --resume to continue, or pick another out_dir")
    module: torch.nn.Module = objective
    blocks = None
    if config.sequence_parallel > 1:
        if runtime.world_size != config.sequence_parallel:
            raise ValueError(f"sequence_parallel {config.sequence_parallel} needs exactly that many ranks (torchrun "
                             f"--nproc-per-node {config.sequence_parallel}); this run has {runtime.world_size}")
        blocks = sequence_parallel.Blocks(rank=runtime.rank, size=runtime.world_size)
    elif config.sequence_parallel < 1:
        raise ValueError(f"sequence_parallel must be 1 (off) or a number of ranks >= 2; got {config.sequence_parallel}")
    elif runtime.distributed:
        device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        module = torch.nn.parallel.DistributedDataParallel(objective, device_ids=device_ids, broadcast_buffers=False)
    expected = {"capture_layers": draft_json["eagle_tap"]["capture_layers"],
                "hidden_size": objective.draft.config.target_hidden_size, "model_fingerprint": fingerprint}
    return Run(config=config, runtime=runtime, objective=objective, module=module, optimizer=optimizer,
               scheduler=scheduler, draft_json=draft_json, expected=expected, start_step=start_step,
               next_batch=next_batch, blocks=blocks)


def train_step(run: Run, batches: Iterator[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """One optimizer step over grad_accumulation_steps batches; its metrics (summed over ranks) and record ids."""
    config, runtime = run.config, run.runtime
    accumulation, num_steps = config.grad_accumulation_steps, config.objective.ttt_steps
    run.optimizer.zero_grad(set_to_none=True)
    sums = torch.zeros(2 + 3 * num_steps, device=runtime.device)  # loss, windows, step losses, correct, total
    record_ids: list[str] = []
    data_parallel = run.blocks is None and runtime.distributed
    sum_over_ranks = functools.partial(distributed.all_reduce_sum, runtime=runtime) if data_parallel else None
    for micro in range(accumulation):
        batch = to_device(next(batches), runtime.device)
        skip_sync = data_parallel and micro < accumulation - 1  # DDP syncs the last
        with run.module.no_sync() if skip_sync else contextlib.nullcontext(), run.autocast():
            # Either way out["loss"] is this rank's share: the ranks' shares sum to the loss of their batches as one.
            if run.blocks is None:
                out = run.module(batch, sum_over_ranks=sum_over_ranks)
            else:
                out = run.module(sequence_parallel.pad_batch(batch, run.blocks.size), run.blocks)
            # DDP averages the ranks' gradients: times the ranks, the average is the sum, one process's gradient.
            loss = out["loss"] * runtime.world_size if data_parallel else out["loss"]
            (loss / accumulation).backward()
        run.next_batch += 1
        record_ids += batch["record_ids"]
        sums += torch.cat([(out["loss"].detach() / accumulation).view(1),  # (1,)
                           torch.tensor([float(len(batch["record_ids"]))], device=runtime.device),  # (1,)
                           out["step_losses"] / accumulation, out["correct"], out["total"]])  # (J,) each
    if run.blocks is not None:  # the sum of the ranks' gradients is the whole windows' gradient
        sequence_parallel.all_reduce_gradients(run.draft, run.blocks)
    clip = config.optimizer.grad_clip_norm
    grad_norm = torch.nn.utils.clip_grad_norm_(run.draft.parameters(), clip if clip > 0 else float("inf"))
    learning_rate = run.scheduler.get_last_lr()[0]
    run.optimizer.step()
    run.scheduler.step()
    sums = distributed.all_reduce_sum(sums, runtime).cpu()  # the ranks' shares of the loss sum to the loss
    records = sums[1] / (runtime.world_size if run.blocks is not None else 1)  # sequence parallel: every rank read them
    correct, total = sums[2 + num_steps : 2 + 2 * num_steps], sums[2 + 2 * num_steps :]
    metrics = {"loss": sums[0].item(), "step_losses": sums[2 : 2 + num_steps].tolist(),
               "step_accuracy": (correct / total.clamp(min=1)).tolist(), "num_loss_tokens": int(total[0]),
               "num_records": int(records), "learning_rate": learning_rate, "grad_norm": float(grad_norm),
               "epoch": batch["epoch"]}
    return metrics, record_ids


@torch.no_grad()
def evaluate(run: Run, shards: str) -> dict[str, Any]:
    """Per-TTT-step accuracy over (up to eval_max_batches batches of) a held-out shard directory."""
    config, runtime = run.config, run.runtime
    eval_data = DataConfig(shards=shards, batch_size=config.data.batch_size, max_length=config.data.max_length,
                           packing=config.data.packing, shuffle=False, cache_dir=config.data.cache_dir,
                           cache_max_bytes=config.data.cache_max_bytes)
    dataset = data.ShardDataset(eval_data, rank=runtime.rank, world_size=runtime.world_size, num_epochs=1,
                                equal_per_rank=False, window_overlap=config.objective.ttt_steps - 1, **run.expected)
    num_steps = config.objective.ttt_steps
    sums = torch.zeros(3 * num_steps, device=runtime.device)  # correct, total, loss * total
    for number, batch in enumerate(data.make_loader(dataset)):
        if number >= config.eval_max_batches:
            break
        with run.autocast():
            out = run.objective(to_device(batch, runtime.device))
        sums += torch.cat([out["correct"], out["total"], out["step_losses"].float() * out["total"]])  # (3J,)
    sums = distributed.all_reduce_sum(sums, runtime).cpu()
    correct, total, loss_sums = sums[:num_steps], sums[num_steps : 2 * num_steps], sums[2 * num_steps :]
    return {"step_accuracy": (correct / total.clamp(min=1)).tolist(),
            "step_losses": (loss_sums / total.clamp(min=1)).tolist(), "num_tokens": int(total[0])}


def report_data_codecs(shards: str) -> dict[str, dict[str, Any]]:
    """The codecs of the training records (lossy ones with the error their encoders measured), logged and returned."""
    from capture_format.shard_codecs import codec_summary, format_codec_summary

    if cf.is_remote(shards):  # the codecs live in frame headers: read only as records are (not all up front)
        log.info("training data codecs of %s: not listed for an object store", shards)
        return {}
    with cf.ShardDirectory(shards, skip_damaged=True) as directory:
        tallies, problems = codec_summary(directory)
    for (spec, tally), line in zip(sorted(tallies.items()), format_codec_summary(tallies)):
        log.log(logging.WARNING if tally.lossy else logging.INFO, "training data codec %s", line)
    for problem in problems:
        log.error("training data: %s", problem)
    return {spec: {"num_records": len(tally.record_ids), "ratio": tally.ratio, "lossy": tally.lossy,
                   "relative_rms_error": tally.error.relative_rms_error if tally.error else 0.0}
            for spec, tally in tallies.items()}


def train(config: Config, resume: str | bool = False) -> dict[str, Any]:
    """Runs a training run, or continues one (resume=True: the newest checkpoint; a path: that checkpoint).
    Returns its summary: the last step, whether the run finished, first_logged and last_logged (the first and
    the last train line this invocation wrote to metrics.jsonl) and their losses (first_loss, last_loss), the
    data codecs, the warm start, and the final held-out evaluation."""
    from tqdm import tqdm

    from trainer.run_folder import keep_inputs

    # A wrong folder, record selection or warm-start source fails before anything is written.
    training_records = data.require_records(config.data)
    if config.eval_shards is not None:
        data.require_records(config.eval_shards)
    config = recorded_init_from(config, resume)
    data_codecs = report_data_codecs(config.data.shards)
    runtime = distributed.setup(config.device)
    try:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        out_dir = Path(config.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        run = start_run(config, runtime, resume)
        if runtime.is_main:
            (out_dir / "config.json").write_text(json.dumps(config_to_dict(config), indent=2) + "\n")
            keep_inputs(out_dir, draft_config=config.draft_config, vocab=config.vocab,
                        training_records=training_records)
        data_rank, data_ranks = (0, 1) if run.blocks is not None else (runtime.rank, runtime.world_size)
        dataset = data.ShardDataset(config.data, rank=data_rank, world_size=data_ranks, start_batch=run.next_batch,
                                    window_overlap=config.objective.ttt_steps - 1, **run.expected)
        batches = iter(data.make_loader(dataset, pin_memory=runtime.device.type == "cuda"))
        metrics = MetricsLog(out_dir / "metrics.jsonl", enabled=runtime.is_main,
                             resume_step=run.start_step if resume else None)
        record_log = (out_dir / f"record_ids.rank{runtime.rank}.txt").open("a") if config.log_record_ids else None
        last_step = config.num_steps
        if config.stop_after_steps is not None:
            last_step = min(last_step, run.start_step + config.stop_after_steps)
        progress = tqdm(total=config.num_steps, initial=run.start_step, desc="train", unit="step", dynamic_ncols=True,
                        disable=not (config.progress_bar and runtime.is_main))
        eval_every = config.eval_every or max(1, config.num_steps // 10)
        started = time.monotonic()
        num_loss_tokens = 0
        saved_step = run.start_step if resume else -1
        logged: list[dict[str, Any]] = []  # the first and the last train line this invocation logged
        for step in range(run.start_step + 1, last_step + 1):
            line, record_ids = train_step(run, batches)
            progress.update(1)
            num_loss_tokens += line["num_loss_tokens"]
            # the mean of the per-step losses reads like one cross-entropy; the weighted sum over steps does not
            progress.set_postfix({"loss/step": f"{sum(line['step_losses']) / len(line['step_losses']):.3f}",
                                  "acc0": f"{line['step_accuracy'][0]:.3f}",
                                  "loss tokens/s": f"{num_loss_tokens / max(time.monotonic() - started, 1e-9):,.0f}"})
            if record_log is not None:
                record_log.write("".join(f"{step}\t{record_id}\n" for record_id in record_ids))
            if step % config.log_every == 0 or step == last_step:
                elapsed_s = round(time.monotonic() - started, 3)
                logged[1 if logged else 0:] = [{"kind": "train", "step": step, **line, "elapsed_s": elapsed_s}]
                metrics.write(logged[-1])
            if config.eval_shards and step % eval_every == 0 and step != config.num_steps:  # the end has its own
                metrics.write({"kind": "eval", "step": step, **evaluate(run, config.eval_shards)})
            if config.checkpoint_every and step % config.checkpoint_every == 0:
                save(run, step)
                saved_step = step
        progress.close()
        if record_log is not None:
            record_log.close()
        final_step = max(run.start_step, last_step)
        if saved_step != final_step:
            save(run, final_step)
        summary: dict[str, Any] = {"step": final_step, "finished": final_step >= config.num_steps,
                                   "first_loss": logged[0]["loss"] if logged else None,
                                   "last_loss": logged[-1]["loss"] if logged else None,
                                   "first_logged": logged[0] if logged else None,
                                   "last_logged": logged[-1] if logged else None,
                                   "data_codecs": data_codecs}
        if config.init_from is not None:
            summary["init_from"] = {"path": config.init_from, "sha256": config.init_from_sha256}
        if summary["finished"]:
            if config.eval_shards:
                summary["eval"] = evaluate(run, config.eval_shards)
                metrics.write({"kind": "eval", "step": final_step, **summary["eval"]})
            write_final(out_dir / "final", run)
        if runtime.is_main:
            write_plots(out_dir / "metrics.jsonl", out_dir)
        return summary
    finally:
        distributed.teardown(runtime)


def save(run: Run, step: int) -> None:
    state = {"step": step, "model": trainable_state_dict(run.draft), "optimizer": run.optimizer.state_dict(),
             "scheduler": run.scheduler.state_dict(), "data": {"next_batch": run.next_batch},
             "world_size": run.runtime.world_size, "config": config_to_dict(run.config)}
    out_dir = Path(run.config.out_dir)
    save_checkpoint(out_dir, state, run.runtime, run.config.keep_checkpoints)
    if run.runtime.is_main:
        write_plots(out_dir / "metrics.jsonl", out_dir)


def write_final(final_dir: Path, run: Run) -> None:
    """The trained draft (SGLang's parameter names, no frozen embedding), its config, and this rank's digest."""
    from safetensors.torch import save_file

    final_dir.mkdir(parents=True, exist_ok=True)
    if run.runtime.is_main:
        tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in trainable_state_dict(run.draft).items()}
        save_file(tensors, final_dir / "model.safetensors")
        (final_dir / "config.json").write_text(json.dumps(run.draft_json, indent=2) + "\n")
    digest_path = final_dir / f"weights-digest.rank{run.runtime.rank}.json"
    digest_path.write_text(json.dumps(weight_digests(run.draft), indent=1, sort_keys=True) + "\n")
