"""Codec benchmark: ratio, one-thread MB/s and error of each capture codec on bfloat16 hidden states, and
what each lossy codec costs the drafts trained on it (codec_acceptance.py).

Ratio is raw bytes / stored bytes; MB/s is raw megabytes (10**6 bytes) per second, best of
`repeats` runs, one thread. The "frame" rows time encode_frame / decode_frame on records of
`frame_tokens` tokens built from the same data (a frame as the plugin sends one): codec plus
checksums, header and, for decode, the verification a reader does. Every lossless codec is checked
to round-trip bit for bit; a lossy one reports its relative RMS error (||decoded - input|| / ||input||)
and its largest error relative to its row's absmax. Data: the tiny target model's own states at its
capture layers plus the final state (what the plugin captures), Gaussian residual-like states, or
a .npy of uint16 bf16 bit patterns (e.g. real captures). Gaussian data has no outlier channels, so
real captures compress a little differently (notes/perf-baselines.md).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import capture_format as cf
from eagle_tap.bench.codec_acceptance import AcceptanceConfig, measure_acceptance

SOURCES = ("tiny-model", "gaussian")
COLUMNS = [
    ["item", "codec", "s"],
    ["ratio", "ratio", ".3f"],
    ["compress_mb_s", "compress MB/s", ",.0f"],
    ["decompress_mb_s", "decompress MB/s", ",.0f"],
    ["relative_error", "relative RMS error", ".4f"],
]
ACCEPTANCE_COLUMNS = [
    ["codec", "codec (training data)", "s"],
    ["ratio", "ratio", ".3f"],
    ["relative_error", "relative RMS error", ".4f"],
    ["step0_accuracy", "step-0 accuracy", ".3f"],
    ["step0_accuracy_std", "+- (seed std)", ".3f"],
    ["acceptance_length", "acceptance length", ".3f"],
    ["acceptance_length_std", "+- (seed std)", ".3f"],
    ["acceptance_delta", "vs lossless", "+.3f"],
    ["within_seed_noise", "within seed noise", "s"],
]


@dataclass(kw_only=True, slots=True)
class Config:
    """What data to compress and how often to time each codec."""

    source: str = "tiny-model"
    """`tiny-model` (its states, 3 capture layers + final), `gaussian`, or a .npy of uint16 bf16 bit patterns."""
    num_tokens: int = 65536
    """Tokens of the tiny model's states (source tiny-model): 4 x 128 x 2 B = 1 KiB each."""
    gaussian_mib: int = 64
    """Size of the Gaussian data (source gaussian)."""
    hidden_size: int = 4096
    """H of the Gaussian data (source gaussian)."""
    codecs: tuple[str, ...] = ("raw", "zstd:1", "zstd:3", "bf16-split", "bf16-channel", "int8-row", "e4m3-row",
                               "int8-channel")
    """Codec specs timed alone (on the whole data as one (tokens, K+1, H) tensor)."""
    frame_codecs: tuple[str, ...] = ("zstd:1", "bf16-split", "bf16-channel", "int8-row", "e4m3-row", "int8-channel")
    """Codec specs timed as whole frames."""
    frame_tokens: int = 512
    """Tokens per frame of the frame rows (a demo record is 100-500 tokens)."""
    num_aux_layers: int = 3
    """K of the record the frame rows encode."""
    repeats: int = 3
    """Each timing is the best of this many runs."""
    seed: int = 0
    acceptance: AcceptanceConfig | None = field(default_factory=AcceptanceConfig)
    """Train drafts on states decoded through each codec and compare acceptance (None: skip; minutes of CPU)."""
    work_dir: str | None = None
    """Where the acceptance part writes shards and runs (default: a temp dir, removed after)."""

    @classmethod
    def quick(cls) -> Config:
        return cls(num_tokens=16384, codecs=("raw", "zstd:1", "bf16-split", "bf16-channel", "int8-row", "e4m3-row"),
                   frame_codecs=("bf16-split", "bf16-channel", "int8-row"), repeats=2, acceptance=None)


def residual_like_states(num_rows: int, hidden_size: int, seed: int) -> np.ndarray:
    """bf16 bits (num_rows, H) of Gaussian values with a log-normal scale per channel, as residual streams have."""
    rng = np.random.default_rng(seed)
    channel_scale = np.exp(rng.normal(0.0, 0.5, size=hidden_size)).astype(np.float32)  # (H,)
    values = rng.standard_normal((num_rows, hidden_size), dtype=np.float32) * channel_scale  # (rows, H)
    return cf.bfloat16_bits_from_float32(values)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No progress bars or warnings from transformers inside (e.g. about tokenizing text past 2,048 tokens,
    which the benchmarks cut into shorter pieces themselves)."""
    from transformers.utils import logging as transformers_logging

    verbosity, progress_bar = transformers_logging.get_verbosity(), transformers_logging.is_progress_bar_enabled()
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)
        if progress_bar:
            transformers_logging.enable_progress_bar()


def tiny_model_states(num_tokens: int) -> np.ndarray:
    """bf16 bits (T, K+1, H): the tiny model's states at its default capture layers plus the final state,
    computed with HF transformers over Python standard-library sources (what the plugin captures)."""
    import sysconfig

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

    ids: list[int] = []
    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
        model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.bfloat16).eval()
        for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            ids += tokenizer(source.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
            if len(ids) >= num_tokens:
                break
    if len(ids) < num_tokens:
        raise ValueError(f"the standard library gave {len(ids)} tokens; ask for at most that many")
    layers = cf.default_capture_layers(model.config.num_hidden_layers)
    chunks = []
    with torch.no_grad():
        for start in range(0, num_tokens, 1024):
            chunk = torch.tensor([ids[start : min(start + 1024, num_tokens)]])  # (1, T_chunk)
            hidden = model(chunk, output_hidden_states=True).hidden_states
            chunks.append(torch.stack([hidden[layer][0] for layer in layers] + [hidden[-1][0]], dim=1))
    states = torch.cat(chunks)  # (T, K+1, H) bf16
    return states.view(torch.int16).numpy().view(np.uint16)


def load_states(config: Config) -> tuple[np.ndarray, str]:
    """(bf16 bits (rows, H), C-contiguous; a description of the data) for config.source."""
    if config.source == "tiny-model":
        states = tiny_model_states(config.num_tokens)
        description = f"tiny model states, {states.shape[0]} tokens x ({states.shape[1] - 1} capture layers + final)"
    elif config.source == "gaussian":
        num_rows = (config.gaussian_mib << 20) // (2 * config.hidden_size)
        states = residual_like_states(num_rows, config.hidden_size, config.seed)
        description = f"Gaussian residual-like bf16 {states.shape}, per-channel log-normal scale"
    elif config.source.endswith(".npy"):
        states = np.load(config.source)
        if states.dtype != np.uint16:
            raise ValueError(f"{config.source} holds {states.dtype}; expected uint16 bfloat16 bit patterns")
        description = f"{config.source} {states.shape}"
    else:
        raise ValueError(f"unknown codec bench source {config.source!r}; accepted: {', '.join(SOURCES)}, a .npy file")
    rows = states.reshape(-1, states.shape[-1]) if states.ndim > 1 else states[None]
    return np.ascontiguousarray(rows), description


def best_seconds(function: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """(fastest wall time of `repeats` calls, the last call's result)."""
    best = float("inf")
    result = None
    for _ in range(repeats):
        started = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - started)
    return best, result


def frame_records(states: np.ndarray, config: Config) -> list[cf.CaptureRecord]:
    """Records of config.frame_tokens tokens each from states (rows, H) read as (T, K+1, H): aux = the first K
    states of each token, final = its last (the tiny model's source holds them in this order)."""
    num_states = config.num_aux_layers + 1
    by_token = states[: states.shape[0] // num_states * num_states].reshape(-1, num_states, states.shape[-1])
    records = []
    for number, start in enumerate(range(0, by_token.shape[0] - config.frame_tokens + 1, config.frame_tokens)):
        tokens = by_token[start : start + config.frame_tokens]  # (T, K+1, H)
        records.append(cf.CaptureRecord(
            record_id=f"bench-{number}", sample_id="bench", model_fingerprint="bench",
            capture_layers=tuple(range(config.num_aux_layers)), hidden_size=states.shape[-1], dtype="bfloat16",
            token_ids=np.zeros(config.frame_tokens, dtype=np.int32), loss_spans=((0, config.frame_tokens),),
            aux=np.ascontiguousarray(tokens[:, :-1]), final=np.ascontiguousarray(tokens[:, -1])))
    return records


def errors(states: np.ndarray, decoded: np.ndarray) -> tuple[float, float]:
    """(relative RMS error, largest error / its row's absmax) of decoded against states (bf16 bits, rows x H)."""
    original = cf.float32_from_bfloat16_bits(states).reshape(states.shape)
    approx = cf.float32_from_bfloat16_bits(decoded).reshape(states.shape)
    error = approx - original
    relative = float(np.sqrt((error.astype(np.float64) ** 2).sum() / (original.astype(np.float64) ** 2).sum()))
    row_absmax = np.abs(original).max(axis=1, keepdims=True)
    worst = float((np.abs(error) / np.where(row_absmax > 0, row_absmax, 1)).max())
    return relative, worst


def run(config: Config) -> dict[str, Any]:
    states, description = load_states(config)
    raw_nbytes = states.nbytes
    default = cf.DEFAULT_CODECS["bfloat16"]
    layout = cf.TensorLayout("bfloat16", (states.shape[0] // (config.num_aux_layers + 1), config.num_aux_layers + 1,
                                          states.shape[-1]))
    tensor = states[: layout.num_tokens * (config.num_aux_layers + 1)]
    rows = []
    for spec in config.codecs:
        codec = cf.get_codec(spec)
        encode_s, stored = best_seconds(lambda: codec.encode(tensor, layout), config.repeats)
        decode_s, decoded = best_seconds(lambda: codec.decode(stored, layout), config.repeats)
        decoded_bits = np.frombuffer(decoded, dtype=np.uint16).reshape(tensor.shape)
        relative_error = worst_error = None
        if codec.lossy:
            relative_error, worst_error = errors(tensor, decoded_bits)
        elif bytes(decoded) != tensor.tobytes():
            raise AssertionError(f"codec {spec} did not round-trip")
        rows.append({
            "item": f"{spec} (default)" if spec == default else spec,
            "codec": spec,
            "lossy": codec.lossy,
            "ratio": tensor.nbytes / len(stored),
            "compress_mb_s": tensor.nbytes / encode_s / 1e6,
            # raw decodes to a view of the stored bytes: there is no work to time.
            "decompress_mb_s": None if spec == "raw" else tensor.nbytes / decode_s / 1e6,
            "relative_error": relative_error if codec.lossy else 0.0,
            "worst_error_of_row_absmax": worst_error,
        })
    records = frame_records(states, config)
    records_raw_nbytes = sum(record.raw_nbytes for record in records)
    for spec in config.frame_codecs:
        encode_s, frames = best_seconds(lambda: [cf.encode_frame(record, spec) for record in records], config.repeats)
        decode_s, _ = best_seconds(lambda: [cf.decode_frame(frame) for frame in frames], config.repeats)
        rows.append({
            "item": f"frames of {config.frame_tokens} tokens, {spec} (checksums, verify)",
            "codec": spec,
            "lossy": cf.get_codec(spec).lossy,
            "ratio": records_raw_nbytes / sum(map(len, frames)),
            "compress_mb_s": records_raw_nbytes / encode_s / 1e6,
            "decompress_mb_s": records_raw_nbytes / decode_s / 1e6,
            "relative_error": None,  # the tensor rows above measure it
            "encode_us_per_token": encode_s / sum(record.num_tokens for record in records) * 1e6,
        })
    by_codec = {row["codec"]: row for row in rows if not row["item"].startswith("frames")}
    summary: dict[str, Any] = {"raw_mb": raw_nbytes / 1e6, "default_codec": default}
    notes = [f"data: {description}, {raw_nbytes / 1e6:.1f} MB; best of {config.repeats}, one thread; "
             "raw decodes without a copy (no MB/s); lossless codecs are checked bit for bit (error 0)"]
    if default in by_codec and "zstd:1" in by_codec:
        summary["default_ratio_over_zstd1"] = by_codec[default]["ratio"] / by_codec["zstd:1"]["ratio"]
        notes.append(f"{default} stores {summary['default_ratio_over_zstd1']:.3f}x less than zstd:1 "
                     f"({by_codec[default]['ratio']:.3f} vs {by_codec['zstd:1']['ratio']:.3f})")
    for row in rows:
        if row.get("worst_error_of_row_absmax") is not None:
            notes.append(f"{row['codec']}: largest error {row['worst_error_of_row_absmax']:.4f} of its row's absmax")
    frame_rows = {row["codec"]: row for row in rows if row["item"].startswith("frames")}
    if "bf16-split" in frame_rows:
        for spec, row in frame_rows.items():
            if spec != "bf16-split":
                notes.append(f"frames, {spec} vs bf16-split: ratio x{row['ratio'] / frame_rows['bf16-split']['ratio']:.3f}, "
                             f"encode CPU per token x{row['encode_us_per_token'] / frame_rows['bf16-split']['encode_us_per_token']:.2f}")
    result = {"title": "Codecs: ratio, one-thread MB/s of raw input, error; acceptance of drafts trained on each codec",
              "parameters": asdict(config), "columns": COLUMNS, "rows": rows, "summary": summary, "notes": notes}
    if config.acceptance is not None:
        result["tables"], acceptance_notes = _acceptance(config)
        notes += acceptance_notes
    else:
        notes.append("acceptance of drafts trained on each codec: skipped (--quick)")
    return result


def _acceptance(config: Config) -> tuple[list[dict[str, Any]], list[str]]:
    acceptance = config.acceptance
    work = Path(config.work_dir) if config.work_dir else Path(tempfile.mkdtemp(prefix="eagle-tap-codec-acceptance-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        measured = measure_acceptance(acceptance, work, log=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        if not config.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    rows = [{**row, "within_seed_noise": "baseline" if number == 0 else ("yes" if row["within_seed_noise"] else "NO")}
            for number, row in enumerate(measured["rows"])]
    table = {"title": f"Acceptance of drafts trained on states decoded through each codec ({len(acceptance.seeds)} "
                      f"seeds x {acceptance.train_steps} steps each; held-out shards lossless; k = "
                      f"{acceptance.chain_length})",
             "columns": ACCEPTANCE_COLUMNS, "rows": rows, "runs": measured["runs"]}
    notes = [f"acceptance: drafts trained on {measured['train_shards']} re-encoded with each codec, evaluated on "
             f"{measured['heldout_shards']}; seeds {list(acceptance.seeds)} (init and data order); training and "
             f"evaluation took {measured['training_wall_s']:.0f} s",
             "within seed noise: |mean acceptance length - lossless mean| <= the larger seed standard deviation"]
    return [table], notes
