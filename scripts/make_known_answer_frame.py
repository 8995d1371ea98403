"""Writes tests/fixtures/known_answer_frame.bin: one small frame built from a fixed record.

The frame uses the raw codec so its bytes depend on this package alone, not on the zstd library's
version. tests/test_capture_format_frames.py checks that encode_frame still produces these exact
bytes and that they decode to known values: rerun this script only for an intended format change.

    python scripts/make_known_answer_frame.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPOSITORY_ROOT))

from capture_format import CaptureRecord, bfloat16_bits_from_float32, encode_frame  # noqa: E402

FIXTURE_PATH = REPOSITORY_ROOT / "tests" / "fixtures" / "known_answer_frame.bin"
KNOWN_ANSWER_CODEC = "raw"
EDGE_VALUE_BITS = np.array(
    # +0, -0, smallest subnormal, largest finite, +inf, -inf, quiet NaN with payload, negative NaN
    [0x0000, 0x8000, 0x0001, 0x7F7F, 0x7F80, 0xFF80, 0x7FC1, 0xFF81],
    dtype=np.uint16,
)


def known_answer_record() -> CaptureRecord:
    """T=5 tokens, K=3 capture layers, H=8; every value exact in bfloat16."""
    num_tokens, num_layers, hidden_size = 5, 3, 8
    token = np.arange(num_tokens, dtype=np.float32)[:, None, None]
    layer = np.arange(num_layers, dtype=np.float32)[None, :, None]
    channel = np.arange(hidden_size, dtype=np.float32)[None, None, :]
    aux = bfloat16_bits_from_float32((token + 1) * 0.5**layer * (channel - 3.5))  # (T, K, H)
    aux[0, 0] = EDGE_VALUE_BITS
    final = bfloat16_bits_from_float32(0.25 * (token[:, 0] - 2) + 0.125 * channel[:, 0])  # (T, H)
    return CaptureRecord(
        record_id="known-answer-0001",
        sample_id="sample-0001",
        model_fingerprint="tiny-llama-test@0000",
        capture_layers=(1, 3, 6),
        hidden_size=hidden_size,
        dtype="bfloat16",
        token_ids=np.array([1, 15043, 29892, 3186, 2], dtype=np.int32),
        loss_spans=((2, 5),),
        aux=aux,
        final=final,
        metadata={"source": "scripts/make_known_answer_frame.py"},
    )


def main() -> None:
    frame = encode_frame(known_answer_record(), codec=KNOWN_ANSWER_CODEC)
    FIXTURE_PATH.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE_PATH.write_bytes(frame)
    print(f"wrote {len(frame)} bytes to {FIXTURE_PATH.relative_to(REPOSITORY_ROOT)}")


if __name__ == "__main__":
    main()
