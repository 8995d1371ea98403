"""Malformed and hostile POSTs: each gets its documented status and reason, nothing is written,
and the next good record is accepted. Frames are real encoded frames, mutated."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import xxhash

from capture_format.frame_header import dump_header
from test_collector_support import (
    OCTET_STREAM,
    TOKEN,
    ThreadedCollector,
    build_frame,
    disk_snapshot,
    flip_bit,
    make_frame,
    rewrite_header,
    split_frame,
    tensor_entry,
)

MAX_BODY_BYTES = 256 << 10
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[bytes], tuple[Any, dict[str, str]]]
    """good frame -> (body, headers); body is bytes, or an iterator (sent chunked)."""
    status: int
    reason: str
    detail: str
    """Must appear (case-insensitively) in the error detail: the message names the problem."""


def frame_only(mutate: Callable[[bytes], bytes]) -> Callable[[bytes], tuple[bytes, dict[str, str]]]:
    return lambda frame: (mutate(frame), {**OCTET_STREAM, **AUTH})


def header_lie(mutate: Callable[[dict[str, Any]], Any]) -> Callable[[bytes], tuple[bytes, dict[str, str]]]:
    return frame_only(lambda frame: rewrite_header(frame, mutate))


def payload_offset(frame: bytes, tensor: str) -> int:
    fields, header, _ = split_frame(frame)
    return 32 + fields[3] + tensor_entry(header, tensor)["offset"]


def set_tensor_field(tensor: str, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda header: tensor_entry(header, tensor).update({key: value})


def declared_payload(frame: bytes, payload_nbytes: int) -> bytes:
    """frame whose prefix declares payload_nbytes (with a valid checksum), the real payload following."""
    fields, _, payload = split_frame(frame)
    return build_frame(frame[32 : 32 + fields[3]], payload, payload_nbytes=payload_nbytes)


def lying_bf16_split_size(frame: bytes) -> bytes:
    """aux's bf16-split prefix claims one more high-plane byte; its stored checksum is fixed up to match."""
    fields, header, payload = split_frame(frame)
    aux = tensor_entry(header, "aux")
    assert aux["codec"] == "bf16-split"
    stored = bytearray(payload[aux["offset"] : aux["offset"] + aux["stored_nbytes"]])
    (high_nbytes,) = struct.unpack_from("<Q", stored)
    struct.pack_into("<Q", stored, 0, high_nbytes + 1)
    aux["stored_xxh3_64"] = xxhash.xxh3_64_hexdigest(bytes(stored))
    payload = payload[: aux["offset"]] + bytes(stored) + payload[aux["offset"] + aux["stored_nbytes"] :]
    return build_frame(dump_header(header), payload)


def drop_key(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda header: header.pop(key)


CASES = [
    Case("empty body", lambda f: (b"", {**OCTET_STREAM, **AUTH}), 400, "empty_body", "empty"),
    Case("missing token", lambda f: (f, dict(OCTET_STREAM)), 401, "unauthorized", "missing Authorization"),
    Case("wrong token", lambda f: (f, {**OCTET_STREAM, "Authorization": "Bearer nope"}), 401, "unauthorized",
         "wrong bearer token"),
    Case("basic auth instead of bearer", lambda f: (f, {**OCTET_STREAM, "Authorization": f"Basic {TOKEN}"}), 401,
         "unauthorized", "Bearer <token>"),
    Case("JSON content type", lambda f: (f, {"Content-Type": "application/json", **AUTH}), 415,
         "unsupported_media_type", "application/json"),
    Case("no content type", lambda f: (f, dict(AUTH)), 415, "unsupported_media_type", "missing"),
    Case("body over max_body_bytes", lambda f: (f + bytes(MAX_BODY_BYTES), {**OCTET_STREAM, **AUTH}), 413,
         "body_too_large", "max_body_bytes"),
    Case("prefix declares a payload over the limit", frame_only(lambda f: declared_payload(f, 64 << 20)), 413,
         "body_too_large", "frame prefix declares"),
    Case("truncated frame", frame_only(lambda f: f[:-10]), 400, "length_mismatch", "frame prefix declares"),
    Case("shorter than the prefix", frame_only(lambda f: f[:20]), 400, "malformed_frame", "32-byte prefix"),
    Case("trailing bytes", frame_only(lambda f: f + b"extra"), 400, "length_mismatch", "frame prefix declares"),
    Case("chunked body runs past the frame", lambda f: (iter([f, b"extra"]), {**OCTET_STREAM, **AUTH}), 400,
         "length_mismatch", "runs past"),
    Case("chunked body ends early", lambda f: (iter([f[: len(f) // 2]]), {**OCTET_STREAM, **AUTH}), 400,
         "length_mismatch", "ended after"),
    Case("not a frame", frame_only(lambda f: b"GIF89a" + f[6:]), 400, "malformed_frame", "magic"),
    Case("pickle instead of a frame", frame_only(lambda f: b"\x80\x04\x95" + bytes(100)), 400, "malformed_frame",
         "magic"),
    Case("unknown format version", frame_only(lambda f: f[:8] + struct.pack("<H", 2) + f[10:]), 400,
         "malformed_frame", "format_version"),
    Case("unknown flags", frame_only(lambda f: f[:10] + struct.pack("<H", 4) + f[12:]), 400, "malformed_frame",
         "flags"),
    Case("flipped bit in the header length", frame_only(lambda f: flip_bit(f, 12, 3)), 400, "length_mismatch",
         "frame prefix declares"),
    Case("flipped bit in the header checksum", frame_only(lambda f: flip_bit(f, 24)), 400, "checksum_mismatch",
         "header checksum"),
    Case("flipped bit in the header", frame_only(lambda f: flip_bit(f, 40, 1)), 400, "checksum_mismatch",
         "header checksum"),
    Case("flipped bit in token ids", frame_only(lambda f: flip_bit(f, payload_offset(f, "token_ids") + 1)), 400,
         "checksum_mismatch", "token_ids"),
    Case("flipped bit in aux", frame_only(lambda f: flip_bit(f, payload_offset(f, "aux") + 100, 5)), 400,
         "checksum_mismatch", "aux"),
    Case("flipped bit in the last byte", frame_only(lambda f: flip_bit(f, len(f) - 1, 7)), 400,
         "checksum_mismatch", "final"),
    Case("header is not JSON", frame_only(lambda f: build_frame(b"{not json", split_frame(f)[2])), 400,
         "malformed_frame", "not valid UTF-8 JSON"),
    Case("header is a JSON list", frame_only(lambda f: build_frame(b"[1, 2]", split_frame(f)[2])), 400,
         "malformed_frame", "JSON object"),
    Case("missing header field", header_lie(drop_key("sample_id")), 400, "malformed_frame", "missing fields"),
    Case("unexpected header field", header_lie(lambda h: h.update(pickle="cos\nsystem")), 400, "malformed_frame",
         "unexpected fields"),
    Case("lying raw_nbytes", header_lie(set_tensor_field("aux", "raw_nbytes", 1 << 40)), 400, "malformed_frame",
         "raw_nbytes"),
    Case("lying stored_nbytes", header_lie(set_tensor_field("final", "stored_nbytes", 7)), 400,
         "malformed_frame", "payload"),
    Case("shape inconsistent with the record", header_lie(set_tensor_field("aux", "shape", [8, 3, 32])), 400,
         "malformed_frame", "shape"),
    Case("negative dimension", header_lie(set_tensor_field("token_ids", "shape", [-8])), 422, "invalid_record",
         "-8"),
    Case("huge hidden size", header_lie(lambda h: h.update(hidden_size=1 << 40)), 422, "invalid_record",
         "hidden_size"),
    Case("dtype int8", header_lie(lambda h: h.update(dtype="int8")), 422, "invalid_record", "int8"),
    Case("tensor dtype disagrees", header_lie(set_tensor_field("aux", "dtype", "float32")), 400,
         "malformed_frame", "dtype"),
    Case("unknown codec", header_lie(set_tensor_field("aux", "codec", "zstdd")), 422, "unknown_codec", "zstdd"),
    Case("codec declares a lying size", frame_only(lying_bf16_split_size), 400, "malformed_frame", "bf16-split"),
    Case("unknown schema version", header_lie(lambda h: h.update(schema_version=3)), 422, "invalid_record",
         "schema_version"),
    Case("path-like record id", header_lie(lambda h: h.update(record_id="../../etc/passwd")), 422,
         "invalid_record", "record_id"),
    Case("record id with a slash", header_lie(lambda h: h.update(record_id="runs/evil")), 422, "invalid_record",
         "record_id"),
    Case("300-character record id", header_lie(lambda h: h.update(record_id="a" * 300)), 422, "invalid_record",
         "record_id"),
    Case("record id with a NUL byte", header_lie(lambda h: h.update(record_id="ok\x00id")), 422, "invalid_record",
         "record_id"),
    Case("overlapping loss spans", header_lie(lambda h: h.update(loss_spans=[[1, 5], [3, 8]])), 422,
         "invalid_record", "overlap"),
    Case("metadata over 64 KiB", header_lie(lambda h: h.update(metadata={"blob": "x" * (70 << 10)})), 422,
         "invalid_record", "metadata"),
]


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory):
    with ThreadedCollector(data_dir=tmp_path_factory.mktemp("hostile"), max_body_bytes=MAX_BODY_BYTES) as running:
        yield running


def test_table_is_large_enough() -> None:
    assert len(CASES) >= 30
    assert len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_hostile_request_is_refused_and_nothing_is_written(collector: ThreadedCollector, case: Case) -> None:
    index = CASES.index(case)
    body, headers = case.build(make_frame(f"victim-{index:03d}"))
    data_dir = collector.settings.data_dir
    stats_before, disk_before = collector.stats(), disk_snapshot(data_dir)

    with httpx.Client(base_url=collector.url, timeout=30) as client:  # no default token: the case decides
        response = client.post("/v1/records", content=body, headers=headers)

    assert response.status_code == case.status, response.text
    error = response.json()
    assert error["error"] == case.reason
    assert case.detail.lower() in error["detail"].lower(), error["detail"]
    stats_after = collector.stats()
    assert disk_snapshot(data_dir) == disk_before
    assert stats_after["num_records"] == stats_before["num_records"]
    assert stats_after["rejects"].get(case.reason, 0) == stats_before["rejects"].get(case.reason, 0) + 1
    assert collector.client.get(f"/v1/records/victim-{index:03d}").status_code == 404

    good = collector.post(make_frame(f"good-after-{index:03d}"))
    assert good.status_code == 201, good.text


def raw_post(url: str, head: bytes, body: bytes) -> tuple[int, bytes]:
    """Sends exactly head + body on a fresh connection and returns the first response's status and body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(head + body)
        received = b""
        while b"\r\n\r\n" not in received:
            received += conn.recv(65536)
        status_line, _, rest = received.partition(b"\r\n")
        headers, _, content = rest.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in headers.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        while len(content) < length:
            content += conn.recv(65536)
        return int(status_line.split()[1]), content[:length]


def test_content_length_shorter_than_the_frame(collector: ThreadedCollector) -> None:
    frame = make_frame("short-content-length")
    disk_before = disk_snapshot(collector.settings.data_dir)
    head = (f"POST /v1/records HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(frame) - 10}\r\n\r\n").encode()
    status, content = raw_post(collector.url, head, frame)
    assert status == 400 and b"length_mismatch" in content and b"Content-Length" in content
    assert disk_snapshot(collector.settings.data_dir) == disk_before
    assert collector.post(make_frame("after-short-content-length")).status_code == 201


def test_content_length_over_the_limit_is_refused_before_the_body(collector: ThreadedCollector) -> None:
    head = (f"POST /v1/records HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            f"Authorization: Bearer {TOKEN}\r\nContent-Length: {1 << 40}\r\n\r\n").encode()
    status, content = raw_post(collector.url, head, b"")  # no body sent at all: the answer must not wait for it
    assert status == 413 and b"max_body_bytes" in content


def test_unsafe_id_in_a_lookup_is_refused(collector: ThreadedCollector) -> None:
    response = collector.client.get("/v1/records/bad..id")
    assert response.status_code == 400 and response.json()["error"] == "invalid_record_id"
    assert collector.client.get("/v1/records/..%2F..%2Fetc%2Fpasswd").status_code in (400, 404)


def test_reads_need_the_token_too(collector: ThreadedCollector) -> None:
    with httpx.Client(base_url=collector.url) as anonymous:
        assert anonymous.get("/v1/stats").status_code == 401
        assert anonymous.get("/v1/records/good-after-000").status_code == 401
        assert anonymous.get("/healthz").status_code == 200
        assert anonymous.get("/metrics").status_code == 200


def test_stalled_sender_holds_bounded_memory_and_times_out(tmp_path) -> None:
    frame = make_frame("stalled", num_tokens=64, hidden_size=256)
    settings = {"max_body_bytes": len(frame) + 1024, "max_inflight_bytes": len(frame) * 3 // 2,
                "receive_timeout_s": 2.0}
    with ThreadedCollector(data_dir=tmp_path, **settings) as collector:
        head = (f"POST /v1/records HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(frame)}\r\n\r\n").encode()
        host, port = collector.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as stalled:
            stalled.sendall(head + frame[:1000])  # prefix and a bit: its buffer is taken, then nothing more
            deadline = time.monotonic() + 10
            while collector.store.buffer_pool.lent_bytes == 0:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            busy = collector.post(make_frame("while-stalled", num_tokens=64, hidden_size=256))
            assert busy.status_code == 503 and busy.json()["error"] == "overloaded"
            assert "max_inflight_bytes" in busy.json()["detail"]
            answer = stalled.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408") and b"receive_timeout" in answer
        assert collector.post(make_frame("while-stalled", num_tokens=64, hidden_size=256)).status_code == 201
        assert collector.stats()["num_records"] == 1 and list(disk_snapshot(tmp_path)) == ["shard-000001.etap.open"]
