"""Benchmarks the capture codecs on bfloat16 hidden states, one thread, and prints a Markdown table.

    python scripts/bench_codecs.py                       # 64 MiB of Gaussian residual-like states
    python scripts/bench_codecs.py --states states.npy   # uint16 bf16 bit patterns, e.g. real captures
    python scripts/bench_codecs.py --tiny-model-tokens 65536   # states of the bundled tiny target model

Ratio is raw bytes / stored bytes; MB/s is raw megabytes (10**6 bytes) per second, best of
--repeats runs. The "frame" rows time encode_frame / decode_frame on a record built from the same
data (K=3 aux layers plus final): codec plus checksums, header and, for decode, the verification a
reader does. Gaussian data has no outlier channels: real captures compress a little differently.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from capture_format import (  # noqa: E402
    CaptureRecord,
    bfloat16_bits_from_float32,
    decode_frame,
    encode_frame,
    get_codec,
)

CODEC_SPECS = ("raw", "zstd:1", "zstd:3", "bf16-split")
NUM_AUX_LAYERS = 3


def residual_like_states(num_bytes: int, hidden_size: int, seed: int) -> np.ndarray:
    """bf16 bits [T, H] of Gaussian values with a log-normal scale per channel, as residual streams have."""
    rng = np.random.default_rng(seed)
    num_tokens = num_bytes // (2 * hidden_size)
    channel_scale = np.exp(rng.normal(0.0, 0.5, size=hidden_size)).astype(np.float32)
    values = rng.standard_normal((num_tokens, hidden_size), dtype=np.float32) * channel_scale
    return bfloat16_bits_from_float32(values)


def tiny_model_states(num_tokens: int) -> np.ndarray:
    """bf16 bits [T, 4, H]: the tiny model's states at its default capture layers plus the final state,
    computed with HF transformers over Python standard-library sources (what the plugin captures)."""
    import sysconfig

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from capture_format import default_capture_layers
    from eagle_tap.tiny_model import TINY_MODEL_DIR

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.bfloat16).eval()
    layers = default_capture_layers(model.config.num_hidden_layers)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for source in sorted(stdlib.glob("*.py")):
        ids += tokenizer(source.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        if len(ids) >= num_tokens:
            break
    chunks = []
    with torch.no_grad():
        for start in range(0, num_tokens, 1024):
            hidden = model(torch.tensor([ids[start:start + 1024]]), output_hidden_states=True).hidden_states
            chunks.append(torch.stack([hidden[layer][0] for layer in layers] + [hidden[-1][0]], dim=1))
    states = torch.cat(chunks)  # (T, 4, H) bf16
    return states.view(torch.int16).numpy().view(np.uint16)


def best_seconds(function: Callable[[], object], repeats: int) -> tuple[float, object]:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - start)
    return best, result


def record_from_states(states: np.ndarray) -> CaptureRecord:
    hidden_size = states.shape[-1]
    flat = states.reshape(-1)
    num_tokens = flat.size // ((NUM_AUX_LAYERS + 1) * hidden_size)
    aux_size = num_tokens * NUM_AUX_LAYERS * hidden_size
    return CaptureRecord(
        record_id="bench",
        sample_id="bench",
        model_fingerprint="bench",
        capture_layers=tuple(range(NUM_AUX_LAYERS)),
        hidden_size=hidden_size,
        dtype="bfloat16",
        token_ids=np.zeros(num_tokens, dtype=np.int32),
        loss_spans=((0, num_tokens),),
        aux=flat[:aux_size].reshape(num_tokens, NUM_AUX_LAYERS, hidden_size),
        final=flat[aux_size : aux_size + num_tokens * hidden_size].reshape(num_tokens, hidden_size),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--states", type=Path, help="a .npy of uint16 bfloat16 bit patterns (any shape, last dim = H)")
    parser.add_argument("--tiny-model-tokens", type=int, help="use this many tokens of the tiny model's states")
    parser.add_argument("--mib", type=int, default=64, help="size of generated data when --states is not given")
    parser.add_argument("--hidden-size", type=int, default=4096, help="H of generated data")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    if args.tiny_model_tokens:
        states = tiny_model_states(args.tiny_model_tokens)
        source = f"tiny model states (3 capture layers + final), {states.shape}"
        states = np.ascontiguousarray(states.reshape(-1, states.shape[-1]))
    elif args.states is not None:
        states = np.load(args.states)
        if states.dtype != np.uint16:
            parser.error(f"{args.states} holds {states.dtype}; expected uint16 bfloat16 bit patterns")
        states = np.ascontiguousarray(states.reshape(-1, states.shape[-1]) if states.ndim > 1 else states[None])
        source = f"{args.states} {states.shape}"
    else:
        states = residual_like_states(args.mib << 20, args.hidden_size, args.seed)
        source = f"Gaussian residual-like bf16, {states.shape}, per-channel log-normal scale"
    raw_nbytes = states.nbytes
    print(f"data: {source}, {raw_nbytes / 1e6:.1f} MB; best of {args.repeats}, one thread\n")
    print("| codec | ratio | compress MB/s | decompress MB/s |")
    print("|---|---|---|---|")
    for spec in CODEC_SPECS:
        codec = get_codec(spec)
        encode_s, stored = best_seconds(lambda: codec.encode(states, 2), args.repeats)
        decode_s, decoded = best_seconds(lambda: codec.decode(stored, raw_nbytes), args.repeats)
        assert bytes(decoded) == states.tobytes(), f"{spec} did not round-trip"
        # raw decodes to a view of the stored bytes: there is no work to time.
        decode_rate = "no copy" if spec == "raw" else f"{raw_nbytes / decode_s / 1e6:.0f}"
        print(f"| {spec} | {raw_nbytes / len(stored):.3f} | {raw_nbytes / encode_s / 1e6:.0f} | {decode_rate} |")
    record = record_from_states(states)
    for spec in ("bf16-split", "zstd:1"):
        encode_s, frame = best_seconds(lambda: encode_frame(record, spec), args.repeats)
        decode_s, _ = best_seconds(lambda: decode_frame(frame), args.repeats)
        ratio = record.raw_nbytes / len(frame)
        print(
            f"| frame, {spec} (checksums, verify) | {ratio:.3f} | {record.raw_nbytes / encode_s / 1e6:.0f} "
            f"| {record.raw_nbytes / decode_s / 1e6:.0f} |"
        )


if __name__ == "__main__":
    main()
