"""Codec benchmark: ratio and one-thread MB/s of each capture codec on bfloat16 hidden states.

Ratio is raw bytes / stored bytes; MB/s is raw megabytes (10**6 bytes) per second, best of
`repeats` runs, one thread. The "frame" rows time encode_frame / decode_frame on one record built
from the same data: codec plus checksums, header and, for decode, the verification a reader does.
Every codec is checked to round-trip bit for bit. Data: the tiny target model's own states at its
capture layers plus the final state (what the plugin captures), Gaussian residual-like states, or
a .npy of uint16 bf16 bit patterns (e.g. real captures). Gaussian data has no outlier channels, so
real captures compress a little differently (notes/perf-baselines.md).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

import capture_format as cf

SOURCES = ("tiny-model", "gaussian")
COLUMNS = [
    ["item", "codec", "s"],
    ["ratio", "ratio", ".3f"],
    ["compress_mb_s", "compress MB/s", ",.0f"],
    ["decompress_mb_s", "decompress MB/s", ",.0f"],
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
    codecs: tuple[str, ...] = ("raw", "zstd:1", "zstd:3", "bf16-split")
    """Codec specs timed alone."""
    frame_codecs: tuple[str, ...] = ("bf16-split", "zstd:1")
    """Codec specs timed as whole frames."""
    num_aux_layers: int = 3
    """K of the record the frame rows encode."""
    repeats: int = 3
    """Each timing is the best of this many runs."""
    seed: int = 0

    @classmethod
    def quick(cls) -> Config:
        return cls(num_tokens=16384, codecs=("raw", "zstd:1", "bf16-split"), frame_codecs=("bf16-split",), repeats=2)


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

    from eagle_tap.tiny_model import TINY_MODEL_DIR

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


def record_from_states(states: np.ndarray, num_aux_layers: int) -> cf.CaptureRecord:
    """One record holding states (rows, H): the first K/(K+1) as aux (T, K, H), the rest as final (T, H)."""
    hidden_size = states.shape[-1]
    flat = states.reshape(-1)
    num_tokens = flat.size // ((num_aux_layers + 1) * hidden_size)
    aux_size = num_tokens * num_aux_layers * hidden_size
    return cf.CaptureRecord(
        record_id="bench",
        sample_id="bench",
        model_fingerprint="bench",
        capture_layers=tuple(range(num_aux_layers)),
        hidden_size=hidden_size,
        dtype="bfloat16",
        token_ids=np.zeros(num_tokens, dtype=np.int32),
        loss_spans=((0, num_tokens),),
        aux=flat[:aux_size].reshape(num_tokens, num_aux_layers, hidden_size),
        final=flat[aux_size : aux_size + num_tokens * hidden_size].reshape(num_tokens, hidden_size),
    )


def run(config: Config) -> dict[str, Any]:
    states, description = load_states(config)
    raw_nbytes = states.nbytes
    default = cf.DEFAULT_CODECS["bfloat16"]
    rows = []
    for spec in config.codecs:
        codec = cf.get_codec(spec)
        encode_s, stored = best_seconds(lambda: codec.encode(states, 2), config.repeats)
        decode_s, decoded = best_seconds(lambda: codec.decode(stored, raw_nbytes), config.repeats)
        if bytes(decoded) != states.tobytes():
            raise AssertionError(f"codec {spec} did not round-trip")
        rows.append({
            "item": f"{spec} (default)" if spec == default else spec,
            "codec": spec,
            "ratio": raw_nbytes / len(stored),
            "compress_mb_s": raw_nbytes / encode_s / 1e6,
            # raw decodes to a view of the stored bytes: there is no work to time.
            "decompress_mb_s": None if spec == "raw" else raw_nbytes / decode_s / 1e6,
        })
    record = record_from_states(states, config.num_aux_layers)
    for spec in config.frame_codecs:
        encode_s, frame = best_seconds(lambda: cf.encode_frame(record, spec), config.repeats)
        decode_s, _ = best_seconds(lambda: cf.decode_frame(frame), config.repeats)
        rows.append({
            "item": f"frame, {spec} (checksums, verify)",
            "codec": spec,
            "ratio": record.raw_nbytes / len(frame),
            "compress_mb_s": record.raw_nbytes / encode_s / 1e6,
            "decompress_mb_s": record.raw_nbytes / decode_s / 1e6,
        })
    by_codec = {row["codec"]: row for row in rows if not row["item"].startswith("frame")}
    summary = {"raw_mb": raw_nbytes / 1e6, "default_codec": default}
    notes = [f"data: {description}, {raw_nbytes / 1e6:.1f} MB; best of {config.repeats}, one thread; "
             "raw decodes without a copy (no MB/s)"]
    if default in by_codec and "zstd:1" in by_codec:
        summary["default_ratio_over_zstd1"] = by_codec[default]["ratio"] / by_codec["zstd:1"]["ratio"]
        notes.append(f"{default} stores {summary['default_ratio_over_zstd1']:.3f}x less than zstd:1 "
                     f"({by_codec[default]['ratio']:.3f} vs {by_codec['zstd:1']['ratio']:.3f})")
    return {"title": "Codecs: ratio and one-thread MB/s of raw input", "parameters": asdict(config),
            "columns": COLUMNS, "rows": rows, "summary": summary, "notes": notes}
