"""Ingest refuses what no reader accepts: frames whose headers and stored bytes are consistent but whose
decoded content is not (wrong decoded checksum, a negative token id, a zstd stream that decodes past its
declared size), and frames that would decode to far more than they weigh. Through the real service."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import xxhash
import zstandard

from capture_format import encode_frame
from capture_format.frame_header import dump_header
from test_collector_support import (
    ThreadedCollector,
    build_frame,
    disk_snapshot,
    make_frame,
    make_record,
    split_frame,
    tensor_entry,
)


def _replace_stored(frame: bytes, tensor: str, stored: bytes, *, raw: bytes | None = None) -> bytes:
    """frame with tensor's stored bytes replaced and every size and checksum in the header made to match."""
    _, header, payload = split_frame(frame)
    entry = tensor_entry(header, tensor)
    start, end = entry["offset"], entry["offset"] + entry["stored_nbytes"]
    delta = len(stored) - entry["stored_nbytes"]
    entry["stored_nbytes"] = len(stored)
    entry["stored_xxh3_64"] = xxhash.xxh3_64_hexdigest(stored)
    if raw is not None:
        entry["raw_xxh3_64"] = xxhash.xxh3_64_hexdigest(raw)
    for other in header["tensors"]:
        if other["offset"] > entry["offset"]:
            other["offset"] += delta
    return build_frame(dump_header(header), payload[:start] + stored + payload[end:])


def wrong_decoded_checksum(frame: bytes) -> bytes:
    _, header, payload = split_frame(frame)
    tensor_entry(header, "final")["raw_xxh3_64"] = "0" * 16
    return build_frame(dump_header(header), payload)


def negative_token_id(frame: bytes) -> bytes:
    _, header, payload = split_frame(frame)
    entry = tensor_entry(header, "token_ids")
    ids = np.frombuffer(payload[entry["offset"] : entry["offset"] + entry["stored_nbytes"]], dtype=np.int32).copy()
    ids[3] = -7
    return _replace_stored(frame, "token_ids", ids.tobytes(), raw=ids.tobytes())


def zstd_past_its_size(frame: bytes) -> bytes:
    """final's zstd frame is followed by a second one: the declared content size fits, the stream does not."""
    _, header, payload = split_frame(frame)
    entry = tensor_entry(header, "final")
    stored = payload[entry["offset"] : entry["offset"] + entry["stored_nbytes"]]
    return _replace_stored(frame, "final", stored + zstandard.ZstdCompressor().compress(bytes(4096)))


CASES: list[tuple[str, Callable[[], bytes], int, str, str]] = [
    ("decoded checksum is wrong", lambda: wrong_decoded_checksum(make_frame("v-1")), 400, "checksum_mismatch",
     "decoded"),
    ("negative token id", lambda: negative_token_id(make_frame("v-2")), 422, "invalid_record", "non-negative"),
    ("zstd decodes past its size", lambda: zstd_past_its_size(encode_frame(make_record("v-3"), codec="zstd:1")), 400,
     "malformed_frame", "final"),
]


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory):
    with ThreadedCollector(data_dir=tmp_path_factory.mktemp("decode-check"), max_body_bytes=64 << 20) as running:
        yield running


@pytest.mark.parametrize("name,build,status,reason,detail", CASES, ids=[case[0] for case in CASES])
def test_a_frame_no_reader_accepts_is_refused(collector: ThreadedCollector, name: str, build, status: int,
                                               reason: str, detail: str) -> None:
    disk_before = disk_snapshot(collector.settings.data_dir)
    response = collector.post(build())
    assert response.status_code == status, response.text
    assert response.json()["error"] == reason and detail in response.json()["detail"], response.text
    assert disk_snapshot(collector.settings.data_dir) == disk_before
    good = collector.post(make_frame(f"good-after-{name.replace(' ', '-')}"))
    assert good.status_code == 201, good.text


def test_a_small_post_that_decodes_to_a_huge_record_is_refused_before_decoding(collector: ThreadedCollector) -> None:
    zeros = make_record("zeros", num_tokens=4096, hidden_size=256)
    zeros = type(zeros)(**{**{field: getattr(zeros, field) for field in zeros.__dataclass_fields__},
                           "aux": np.zeros_like(zeros.aux), "final": np.zeros_like(zeros.final)})
    frame = encode_frame(zeros, codec="zstd:1")
    decoded_nbytes = zeros.aux.nbytes + zeros.final.nbytes + zeros.token_ids.nbytes
    assert decoded_nbytes > 64 * len(frame)  # ~10 MB of zeros in a few KB
    response = collector.post(frame)
    assert response.status_code == 413, response.text
    assert response.json()["error"] == "expands_too_much" and "max_expansion_ratio" in response.json()["detail"]
