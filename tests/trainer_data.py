"""Shards of capture records made from the tiny target model with HF transformers, for trainer tests.

This mirrors what the SGLang plugin captures (another test checks plugin records equal HF's within
bf16 tolerance) without a server's start-up time: `output_hidden_states=True` gives
hidden_states[i] = the input of decoder layer i (so aux[:, k] = hidden_states[capture_layers[k]])
and hidden_states[-1] = the final state after the norm. States are rounded to bf16 bit patterns,
loss spans are the assistant tokens of chat-template-rendered conversations, and records go into
sealed shards through capture_format.write_shards, as the collector writes them.

Conversations are questions about Python standard-library functions answered with the first
paragraph of their docstrings (read with `ast`, nothing imported), which is what the tiny model
was trained on. `shard_dir(...)` builds a directory once per process and caches it.
"""

from __future__ import annotations

import ast
import atexit
import functools
import json
import random
import shutil
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

import capture_format as cf
from capture_format.fingerprint import model_fingerprint
from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

STDLIB_MODULES = (
    "argparse", "base64", "bisect", "calendar", "csv", "difflib", "fnmatch", "fractions", "ftplib", "glob",
    "gzip", "heapq", "hmac", "imaplib", "inspect", "ipaddress", "json/__init__", "locale", "mailbox", "netrc",
    "ntpath", "os", "pathlib", "pickle", "platform", "plistlib", "posixpath", "pprint", "quopri", "random",
    "shlex", "shutil", "smtplib", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "timeit", "tokenize", "traceback", "uuid", "warnings", "zipfile",
)
SYSTEM_PROMPTS = (
    "You are a helpful assistant for Python programmers.",
    "You answer questions about the Python standard library. Be concise.",
)


@functools.cache
def _question_answers() -> tuple[tuple[str, str], ...]:
    """(question, answer) pairs from public stdlib functions' docstrings, in a fixed shuffled order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    pairs = []
    for module in STDLIB_MODULES:
        path = stdlib / f"{module}.py"
        if not path.is_file():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        name = module.removesuffix("/__init__")
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                docstring = ast.get_docstring(node)
                if docstring:
                    answer = " ".join(docstring.split("\n\n")[0].split())[:320]
                    pairs.append((f"What does `{name}.{node.name}` do?", answer))
    random.Random(1234).shuffle(pairs)
    return tuple(pairs)


def conversations(start: int, count: int) -> list[list[dict[str, str]]]:
    """Conversations start..start+count-1: a system prompt and two question-answer turns each."""
    pairs = _question_answers()
    if 2 * (start + count) > len(pairs):
        raise ValueError(f"only {len(pairs) // 2} conversations can be made; asked for {start}..{start + count}")
    result = []
    for index in range(start, start + count):
        messages = [{"role": "system", "content": SYSTEM_PROMPTS[index % len(SYSTEM_PROMPTS)]}]
        for question, answer in pairs[2 * index : 2 * index + 2]:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        result.append(messages)
    return result


@functools.cache
def _model_and_tokenizer(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def capture_records(
    start: int, count: int, *, model_dir: Path = TINY_MODEL_DIR, max_tokens: int = 256, id_prefix: str = "rec"
) -> list[cf.CaptureRecord]:
    """Records of conversations start..start+count-1 as the plugin would capture them."""
    import torch

    model, tokenizer = _model_and_tokenizer(model_dir)
    num_layers = model.config.num_hidden_layers
    capture_layers = cf.default_capture_layers(num_layers)
    fingerprint = model_fingerprint(model_dir)
    rendered = [
        tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        for messages in conversations(start, count)
    ]
    sequences = [np.asarray(item["input_ids"][:max_tokens], dtype=np.int32) for item in rendered]
    masks = [np.asarray(item["assistant_masks"][:max_tokens], dtype=np.uint8) for item in rendered]
    # One padded forward for all: attention is causal, so padding after a sequence changes none of its states.
    # One thread: on a busy 2-core machine a second thread slows small matmuls down several times.
    longest = max(len(ids) for ids in sequences)
    padded = torch.tensor([ids.tolist() + [0] * (longest - len(ids)) for ids in sequences])  # (N, T_max)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            hidden_states = model(padded, output_hidden_states=True).hidden_states
    finally:
        torch.set_num_threads(threads)
    aux_all = torch.stack([hidden_states[layer] for layer in capture_layers], dim=2)  # (N, T_max, K, H)
    final_all = hidden_states[-1]  # (N, T_max, H), after the final norm
    records = []
    for row, (token_ids, mask) in enumerate(zip(sequences, masks)):
        num_tokens = len(token_ids)
        records.append(
            cf.CaptureRecord(
                record_id=f"{id_prefix}-{start + row:05d}",
                sample_id=f"conversation-{start + row:05d}",
                model_fingerprint=fingerprint,
                capture_layers=tuple(capture_layers),
                hidden_size=model.config.hidden_size,
                dtype="bfloat16",
                token_ids=token_ids,
                loss_spans=cf.spans_from_mask(mask),
                aux=cf.bfloat16_bits_from_float32(aux_all[row, :num_tokens].numpy()),
                final=cf.bfloat16_bits_from_float32(final_all[row, :num_tokens].numpy()),
                metadata={"source": "tests/trainer_data.py"},
            )
        )
    return records


def shuffle_final_rows(record: cf.CaptureRecord, seed: int) -> cf.CaptureRecord:
    """The record with its final states permuted over positions: targets that no input predicts."""
    permutation = np.random.default_rng([seed, int(record.record_id.rsplit("-", 1)[1])]).permutation(record.num_tokens)
    return cf.CaptureRecord(
        record_id=record.record_id,
        sample_id=record.sample_id,
        model_fingerprint=record.model_fingerprint,
        capture_layers=record.capture_layers,
        hidden_size=record.hidden_size,
        dtype=record.dtype,
        token_ids=np.array(record.token_ids),
        loss_spans=record.loss_spans,
        aux=np.array(record.aux),
        final=np.array(record.final)[permutation],
        metadata=record.metadata,
    )


@functools.cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="eagle-tap-trainer-data-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def shard_dir(start: int, count: int, *, shuffled_targets: bool = False, max_tokens: int = 256) -> Path:
    """A shard directory of conversations start..start+count-1, built once per process.

    shuffled_targets=True permutes each record's final states over positions (a control that
    keeps every input and destroys what the inputs say about the targets).
    """
    records = capture_records(start, count, max_tokens=max_tokens)
    if shuffled_targets:
        records = [shuffle_final_rows(record, seed=7) for record in records]
    directory = _root() / f"shards-{start}-{count}-{max_tokens}{'-shuffled' if shuffled_targets else ''}"
    cf.write_shards(records, directory, records_per_shard=24)
    return directory


@functools.cache
def prepared_inputs(draft_vocab_size: int = 512) -> dict[str, Path]:
    """Everything a training run needs for the tiny model, built once per process:
    target, draft_config, vocab, train_shards (conversations 0-63), heldout_shards (64-79)."""
    from trainer.draft_config import build_draft_config
    from trainer.vocab import build_vocab_mapping

    root = _root() / f"inputs-{draft_vocab_size}"
    root.mkdir(parents=True, exist_ok=True)
    train_shards, heldout_shards = shard_dir(0, 64), shard_dir(64, 16)
    draft_config = root / "draft.json"
    config = build_draft_config(TINY_MODEL_DIR, draft_vocab_size=draft_vocab_size)
    draft_config.write_text(json.dumps(config, indent=2))
    build_vocab_mapping(target_dir=TINY_MODEL_DIR, draft_vocab_size=draft_vocab_size, out_dir=root / "vocab",
                        shard_dir=train_shards)
    return {"target": TINY_MODEL_DIR, "draft_config": draft_config, "vocab": root / "vocab",
            "train_shards": train_shards, "heldout_shards": heldout_shards}
