"""Writes tests/fixtures/known_answer_frame.bin and known_answer_image_frame.bin: small frames built from fixed
records, a text record (schema 1) and a record with an image in it (schema 2).

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
IMAGE_FIXTURE_PATH = REPOSITORY_ROOT / "tests" / "fixtures" / "known_answer_image_frame.bin"
MEDIA_PAD_ID = 4096
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


def known_answer_image_record() -> CaptureRecord:
    """The text record with tokens 1 and 2 an image's two placeholder positions (schema 2): its input
    embeddings there are input_embeds[e, h] = (e + 1) * 0.0625 * (h - 3.5), and no loss falls on them."""
    text = known_answer_record()
    token_ids = text.token_ids.copy()
    token_ids[1:3] = MEDIA_PAD_ID
    embed = np.arange(2, dtype=np.float32)[:, None]
    channel = np.arange(text.hidden_size, dtype=np.float32)[None, :]
    return CaptureRecord(
        record_id="known-answer-image-0001", sample_id="sample-image-0001", model_fingerprint="tiny-kimi-k25-test@0000",
        capture_layers=text.capture_layers, hidden_size=text.hidden_size, dtype=text.dtype, token_ids=token_ids,
        loss_spans=((3, 5),), aux=text.aux, final=text.final, metadata=text.metadata,
        input_embed_spans=((1, 3),), input_embeds=bfloat16_bits_from_float32((embed + 1) * 0.0625 * (channel - 3.5)))


def main() -> None:
    for path, record in ((FIXTURE_PATH, known_answer_record()), (IMAGE_FIXTURE_PATH, known_answer_image_record())):
        frame = encode_frame(record, codec=KNOWN_ANSWER_CODEC)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(frame)
        print(f"wrote {len(frame)} bytes to {path.relative_to(REPOSITORY_ROOT)}")


if __name__ == "__main__":
    main()
