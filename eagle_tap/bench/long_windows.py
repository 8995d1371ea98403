"""What windows cost: one draft trained on long records whole, and the same draft trained on windows of them.

    python -m eagle_tap.bench.long_windows --out <folder>

Records: long chats with the tiny target (system prompt and question-answer turns about the Python
standard library, the text it was trained on, rendered with its chat template; the loss on the answers)
of min_tokens..max_tokens tokens, captured with HF transformers the way the plugin captures them (aux =
inputs of the default capture layers, final = the last state after the norm, bf16) and written as
sealed shards. Both runs train the same draft (same seed, initialisation and data order of records) for
the same steps on about the same rows per step: whole records with max_length >= every record, or
windows of window_fraction of the longest record with batch_size / window_fraction windows per batch.
Both are evaluated on the same held-out records read whole (max_length >= every record): TTT accuracy
and simulated acceptance length. The difference is what the draft's attention loses across window
boundaries (the target's states are the same in both runs).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Config", "measure"]


@dataclass(kw_only=True, slots=True)
class Config:
    """Records, and the two runs' shared settings."""

    num_train_records: int = 24
    num_heldout_records: int = 8
    min_tokens: int = 1024
    """Each record is a chat grown turn by turn until it has at least this many tokens..."""
    max_tokens: int = 2000
    """...and cut to at most this many (the tiny target's positions end at 2048)."""
    window_fraction: int = 4
    """Windows of the windowed run: longest record / window_fraction rows."""
    batch_size: int = 2
    """Records per batch of the whole run (the windowed run takes window_fraction times as many windows)."""
    num_steps: int = 120
    ttt_steps: int = 3
    learning_rate: float = 3e-3
    draft_vocab_size: int = 512
    seed: int = 0
    num_threads: int = 1


def long_chats(count: int, seed: int) -> list[list[dict[str, str]]]:
    """count chats of 60 question-answer turns each (longer than any record needs), from stdlib modules."""
    import sysconfig

    from eagle_tap.testbed.tiny_model.build import api_entries, question_answer

    rng = random.Random(seed)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    pairs = []
    for path in sorted(stdlib.glob("*.py"))[:120]:
        _, entries = api_entries(path.name, path.read_text(encoding="utf-8", errors="replace"))
        pairs += [question_answer(entry, rng) for entry in entries]
    rng.shuffle(pairs)
    chats = []
    for index in range(count):
        turns = pairs[(60 * index) % len(pairs) :][:60]
        messages = [{"role": "system", "content": "You answer questions about the Python standard library."}]
        for question, answer in turns:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        chats.append(messages)
    return chats


def capture(chats: list[list[dict[str, str]]], config: Config, id_prefix: str) -> list:
    """One capture record per chat, cut to a length in [min_tokens, max_tokens] at a turn's end when it can be."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import capture_format as cf
    from capture_format.fingerprint import model_fingerprint
    from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    layers = cf.default_capture_layers(model.config.num_hidden_layers)
    rng = np.random.default_rng(config.seed)
    records = []
    for index, messages in enumerate(chats):
        rendered = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True)
        length = int(rng.integers(config.min_tokens, config.max_tokens + 1))
        ids = np.asarray(rendered["input_ids"][:length], dtype=np.int32)  # (T,)
        mask = np.asarray(rendered["assistant_masks"][:length], dtype=np.uint8)  # (T,)
        with torch.no_grad():
            hidden = model(torch.from_numpy(ids.astype(np.int64))[None], output_hidden_states=True).hidden_states
        aux = torch.stack([hidden[layer][0] for layer in layers], dim=1)  # (T, K, H)
        records.append(cf.CaptureRecord(
            record_id=f"{id_prefix}-{index:04d}", sample_id=f"{id_prefix}-{index:04d}",
            model_fingerprint=model_fingerprint(TINY_MODEL_DIR), capture_layers=tuple(layers),
            hidden_size=model.config.hidden_size, dtype="bfloat16", token_ids=ids,
            loss_spans=cf.spans_from_mask(mask), aux=cf.bfloat16_bits_from_float32(aux.numpy()),
            final=cf.bfloat16_bits_from_float32(hidden[-1][0].numpy())))  # final (T, H)
    return records


def train_run(work: Path, name: str, config: Config, *, max_length: int, batch_size: int) -> dict[str, Any]:
    from trainer.config import Config as TrainConfig
    from trainer.config import DataConfig, ObjectiveConfig, OptimizerConfig
    from trainer.metrics import read_metrics
    from trainer.train import train

    from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

    started = time.perf_counter()
    train(TrainConfig(
        target=str(TINY_MODEL_DIR), draft_config=str(work / "draft-config.json"), vocab=str(work / "vocab"),
        out_dir=str(work / "runs" / name), seed=config.seed, num_threads=config.num_threads,
        data=DataConfig(shards=str(work / "train"), batch_size=batch_size, max_length=max_length, seed=config.seed),
        objective=ObjectiveConfig(ttt_steps=config.ttt_steps),
        optimizer=OptimizerConfig(learning_rate=config.learning_rate, warmup_steps=max(1, config.num_steps // 10)),
        num_steps=config.num_steps, log_every=1, checkpoint_every=0, progress_bar=False))
    lines = read_metrics(work / "runs" / name / "metrics.jsonl", "train")
    last = lines[-10:]  # the mean of the last ten steps: one step's loss is noisy
    return {"max_length": max_length, "batch_size": batch_size, "train_s": round(time.perf_counter() - started, 1),
            "final_loss": float(np.mean([line["loss"] for line in last])),
            "final_step0_accuracy": float(np.mean([line["step_accuracy"][0] for line in last]))}


def measure(config: Config, work: Path, log=print) -> dict[str, Any]:
    """Captures the records, trains both runs, evaluates both on the held-out records read whole."""
    import torch

    import capture_format as cf
    from trainer.draft_config import build_draft_config
    from trainer.evaluate import evaluate
    from trainer.vocab import build_vocab_mapping

    from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

    torch.set_num_threads(config.num_threads)
    work.mkdir(parents=True, exist_ok=True)
    log(f"capturing {config.num_train_records} + {config.num_heldout_records} long records ...")
    chats = long_chats(config.num_train_records + config.num_heldout_records, config.seed)
    train_records = capture(chats[: config.num_train_records], config, "long-train")
    heldout_records = capture(chats[config.num_train_records :], config, "long-heldout")
    cf.write_shards(train_records, work / "train", records_per_shard=8)
    cf.write_shards(heldout_records, work / "heldout", records_per_shard=8)
    mapping, _ = build_vocab_mapping(target_dir=TINY_MODEL_DIR, draft_vocab_size=config.draft_vocab_size,
                                     out_dir=work / "vocab", shard_dir=work / "train", if_fewer="shrink")
    (work / "draft-config.json").write_text(json.dumps(
        build_draft_config(TINY_MODEL_DIR, draft_vocab_size=int(mapping.d2t.size)), indent=2) + "\n")
    longest = max(record.num_tokens for record in train_records + heldout_records)
    window = (longest - 1) // config.window_fraction
    runs = {}
    for name, max_length, batch_size in (("whole", longest, config.batch_size),
                                         ("windows", window, config.batch_size * config.window_fraction)):
        log(f"training {name}: max_length {max_length}, batch size {batch_size}, {config.num_steps} steps ...")
        runs[name] = train_run(work, name, config, max_length=max_length, batch_size=batch_size)
        result = evaluate(work / "runs" / name, work / "heldout", batch_size=1, max_length=longest,
                          steps=config.ttt_steps)
        draft = result["drafts"]["draft"]
        runs[name].update(heldout_step_accuracy=draft["step_accuracy"], acceptance_length=draft["acceptance_length"],
                          served_walk=draft["served_walk_acceptance_length"],
                          untrained_acceptance_length=result["drafts"]["untrained"]["acceptance_length"])
    tokens = [record.num_tokens for record in train_records]
    return {"config": asdict(config), "train_tokens": {"min": min(tokens), "max": max(tokens), "sum": sum(tokens)},
            "window_rows": window, "runs": runs}


def format_result(result: dict[str, Any]) -> str:
    k = result["config"]["ttt_steps"]
    lines = [f"records {result['train_tokens']['min']}-{result['train_tokens']['max']} tokens "
             f"({result['train_tokens']['sum']:,} in all), windows of {result['window_rows']} rows",
             f"{'run':8} {'max_length':>10} {'batch':>5} {'final loss':>10} {'acc0 (held out)':>15} "
             f"{'acceptance k=' + str(k):>16} {'served walk k=' + str(k):>16} {'train s':>8}"]
    for name, run in result["runs"].items():
        lines.append(f"{name:8} {run['max_length']:>10} {run['batch_size']:>5} {run['final_loss']:>10.3f} "
                     f"{run['heldout_step_accuracy'][0]:>15.3f} {run['acceptance_length'][-1]:>16.3f} "
                     f"{run['served_walk'][-1]:>16.3f} {run['train_s']:>8.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for the records, runs and result.json")
    parser.add_argument("--steps", type=int, default=Config.num_steps, help="optimizer steps of each run")
    args = parser.parse_args(argv)
    config = Config(num_steps=args.steps)
    result = measure(config, Path(args.out), log=lambda line: print(line, file=sys.stderr, flush=True))
    (Path(args.out) / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(format_result(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
