"""Collector benchmark: ingest MB/s over loopback against the raw-socket ceiling and the disk, one run.

MB/s (10**6 bytes/s) of stored frame bytes acknowledged, per number of concurrent senders, for
- the raw-socket ceiling: a plain TCP server in its own process reads each frame into one reused
  buffer (recv_into) and answers one byte; the client sends the same bytes the same way;
- the collector (`python -m collector_service collect`, its own process) with durability fsync
  (ack after the group commit's fdatasync) and none (ack after the write);
- the disk alone: one thread writing the same frame and fdatasync-ing after each, in the data
  directory's file system (what fsync-mode ingest with one frame per sync can at best reach).
For the collector rows also the collector process's CPU over the measured seconds (in cores) and the raw
state bytes it stored per second per core of it (stored MB/s x the frame's compression ratio / cores): the
figure that says how many cores a production engine's rate needs (`--collector-hidden-size 7168` for
Kimi-K2.5's width).
Senders are threads of this process, each with one keep-alive connection and a minimal HTTP/1.1
client on a plain socket (one send for request line, headers and frame header, one for the payload,
from a memoryview): the same send path as the raw ceiling. http.client costs ~0.3 ms of client CPU
per request here and httpx more; both would measure the client as much as the collector.
Every POST carries a new record id (the header is re-encoded with its checksum; the payload is
shared), so each one is stored, never answered as a duplicate.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

import capture_format as cf
from capture_format.frame_header import load_header
from eagle_tap.bench.capture import tree_cpu_s
from eagle_tap.bench.codecs import residual_like_states
from eagle_tap.testbed.collector_process import CollectorProcess

_PREFIX = struct.Struct("<8sHHIQQ")
TOKEN = "bench-token"
RECORD_ID_CHARS = 24
"""Every record id has this length, so every frame has the template's length."""
COLUMNS = [
    ["path", "path", "s"],
    ["num_senders", "senders", "d"],
    ["mb_s", "MB/s stored bytes", ",.0f"],
    ["ratio_to_raw_socket", "ratio to raw socket", ".2f"],
    ["ratio_to_disk", "ratio to disk", ".2f"],
    ["collector_cores", "collector CPU (cores)", ".2f"],
    ["raw_mb_s_per_core", "raw MB/s per collector core", ",.0f"],
]


@dataclass(kw_only=True, slots=True)
class Config:
    """Frame shape, how long each row runs and how many senders."""

    seconds: float = 4.0
    """Duration of each measurement."""
    num_tokens: int = 512
    num_layers: int = 3
    """K aux layers per frame (plus the final state)."""
    hidden_size: int = 1024
    senders: tuple[int, ...] = (1, 2)
    """Sender counts to measure (raw socket and collector rows)."""
    data_dir: str | None = None
    """Where the collector and the disk row write (default: a temp dir)."""

    @classmethod
    def quick(cls) -> Config:
        return cls(seconds=1.0, senders=(1,))


def record_id(tag: str, number: int) -> str:
    return f"{tag}-{number:0{RECORD_ID_CHARS - len(tag) - 1}d}"


def make_frame(num_tokens: int, num_layers: int, hidden_size: int, seed: int = 0) -> bytes:
    """A realistic frame: residual-like states in bf16, stored with the default codec (bf16-split)."""
    rng = np.random.default_rng(seed)
    bits = residual_like_states(num_tokens * (num_layers + 1), hidden_size, seed)
    bits = bits.reshape(num_tokens, num_layers + 1, hidden_size)  # (T, K+1, H)
    record = cf.CaptureRecord(
        record_id="t" * RECORD_ID_CHARS,
        sample_id="bench",
        model_fingerprint="bench-model@0",
        capture_layers=tuple(range(1, num_layers + 1)),
        hidden_size=hidden_size,
        dtype="bfloat16",
        token_ids=rng.integers(0, 32000, size=num_tokens, dtype=np.int32),
        loss_spans=((0, num_tokens),),
        aux=bits[:, :num_layers],
        final=bits[:, num_layers],
    )
    return cf.encode_frame(record)


class FrameFactory:
    """Frames equal to a template but for their record id, built in microseconds.

    `head(record_id)` is prefix + header of the frame with that id (RECORD_ID_CHARS long, so the
    frame keeps its length); `payload` is shared by all of them and sent from a memoryview.
    """

    def __init__(self, template: bytes) -> None:
        header_nbytes = _PREFIX.unpack_from(template)[3]
        header = bytes(template[32 : 32 + header_nbytes])
        template_id = load_header(memoryview(header))["record_id"].encode()
        assert header.count(template_id) == 1 and len(template_id) == RECORD_ID_CHARS
        self._id_offset = header.index(template_id)
        self._header = header
        self.payload = memoryview(template)[32 + header_nbytes :]
        self.frame_nbytes = len(template)

    def head(self, new_record_id: str) -> bytes:
        encoded = new_record_id.encode()
        assert len(encoded) == RECORD_ID_CHARS, new_record_id
        header = self._header[: self._id_offset] + encoded + self._header[self._id_offset + RECORD_ID_CHARS :]
        fields = (cf.FRAME_MAGIC, cf.FRAME_FORMAT_VERSION, 0, len(header), self.payload.nbytes)
        checksum = xxhash.xxh3_64_intdigest(_PREFIX.pack(*fields, 0)[:24] + header)
        return _PREFIX.pack(*fields, checksum) + header


def _timed(sender: Callable[[list[int], float], None], num_senders: int, seconds: float) -> float:
    """MB/s of the bytes `num_senders` threads running sender(results, deadline) report."""
    results: list[int] = []
    started = time.perf_counter()
    deadline = started + seconds
    threads = [threading.Thread(target=sender, args=(results, deadline)) for _ in range(num_senders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if len(results) != num_senders:
        raise RuntimeError("a sender failed (its traceback is above)")
    return sum(results) / elapsed / 1e6


# Raw-socket ceiling -------------------------------------------------------------------------------

def _raw_server(listener: socket.socket) -> None:
    def serve(conn: socket.socket) -> None:
        buffer = bytearray(64 << 20)
        view = memoryview(buffer)
        length = bytearray(8)
        with conn:
            while True:
                if conn.recv_into(length, 8, socket.MSG_WAITALL) < 8:
                    return
                (nbytes,) = struct.unpack("<Q", length)
                received = 0
                while received < nbytes:
                    count = conn.recv_into(view[received:nbytes])
                    if count == 0:
                        return
                    received += count
                conn.sendall(b"k")

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def run_raw(port: int, factory: FrameFactory, num_senders: int, seconds: float) -> float:
    def sender(results: list[int], deadline: float) -> None:
        sent = 0
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            head = factory.head(record_id("raw", 0))
            while time.perf_counter() < deadline:
                conn.sendall(struct.pack("<Q", factory.frame_nbytes) + head)
                conn.sendall(factory.payload)
                if conn.recv(1) != b"k":
                    raise RuntimeError("raw server went away")
                sent += factory.frame_nbytes
        results.append(sent)

    return _timed(sender, num_senders, seconds)


# Collector ----------------------------------------------------------------------------------------

def _read_response(conn: socket.socket, pending: bytearray) -> tuple[int, bytes]:
    """Reads one HTTP/1.1 response with a Content-Length body; returns (status, body)."""
    while b"\r\n\r\n" not in pending:
        chunk = conn.recv(65536)
        if not chunk:
            raise RuntimeError("collector closed the connection")
        pending += chunk
    head, _, rest = bytes(pending).partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length = next(int(line.split(b":", 1)[1]) for line in lines[1:] if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        chunk = conn.recv(65536)
        if not chunk:
            raise RuntimeError("collector closed the connection")
        rest += chunk
    pending[:] = rest[length:]
    return status, rest[:length]


def run_collector(port: int, factory: FrameFactory, num_senders: int, seconds: float, tag: str) -> float:
    """Senders POST frames over keep-alive connections with a minimal HTTP/1.1 client on a plain
    socket: the same send path as the raw ceiling, so the ratio measures the collector, not the client."""
    counter = iter(range(10**9))
    lock = threading.Lock()
    request_head = (
        f"POST /v1/records HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/octet-stream\r\n"
        f"Authorization: Bearer {TOKEN}\r\nContent-Length: {factory.frame_nbytes}\r\n\r\n"
    ).encode()

    def sender(results: list[int], deadline: float) -> None:
        sent = 0
        pending = bytearray()
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while time.perf_counter() < deadline:
                with lock:
                    number = next(counter)
                conn.sendall(request_head + factory.head(record_id(tag, number)))
                conn.sendall(factory.payload)
                status, body = _read_response(conn, pending)
                if status != 201:
                    raise RuntimeError(f"collector answered {status}: {body[:300]!r}")
                sent += factory.frame_nbytes
        results.append(sent)

    return _timed(sender, num_senders, seconds)


def run_disk(data_dir: Path, factory: FrameFactory, seconds: float) -> float:
    """What the disk gives one writer that syncs every frame: the fsync rows' bound with 1 frame per sync."""
    path = data_dir / "disk-ceiling.bin"
    frame = factory.head(record_id("disk", 0)) + bytes(factory.payload)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written, started = 0, time.perf_counter()
        while time.perf_counter() < started + seconds:
            written += os.pwrite(fd, frame, written)
            os.fdatasync(fd)
        return written / (time.perf_counter() - started) / 1e6
    finally:
        os.close(fd)
        path.unlink()


def run(config: Config) -> dict[str, Any]:
    factory = FrameFactory(make_frame(config.num_tokens, config.num_layers, config.hidden_size))
    info = cf.inspect_frame(factory.head(record_id("check", 0)) + bytes(factory.payload))
    work = Path(tempfile.mkdtemp(prefix="eagle-tap-bench-collector-", dir=config.data_dir))
    token_file = work / "token"
    token_file.write_text(TOKEN)
    rows: list[dict[str, Any]] = []
    try:
        listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        # spawn, not fork: this process may hold torch's or tokenizers' threads by now.
        raw_server = multiprocessing.get_context("spawn").Process(target=_raw_server, args=(listener,), daemon=True)
        raw_server.start()
        try:
            for num_senders in config.senders:
                rate = run_raw(listener.getsockname()[1], factory, num_senders, config.seconds)
                rows.append({"path": "raw socket ceiling", "num_senders": num_senders, "mb_s": rate})
        finally:
            raw_server.kill()
            raw_server.join()
            listener.close()
        disk_rate = run_disk(work, factory, config.seconds)
        for durability in ("fsync", "none"):
            for num_senders in config.senders:
                data_dir = work / f"collector-{durability}-{num_senders}" / "data"
                collector = CollectorProcess(data_dir, extra_args=(
                    "--durability", durability, "--min-free-bytes", "0", "--log-level", "warning",
                    "--token-file", str(token_file)))
                try:
                    run_collector(collector.port, factory, num_senders, min(1.0, config.seconds), "warmup")
                    cpu_s, started = tree_cpu_s(collector.process.pid), time.perf_counter()
                    rate = run_collector(collector.port, factory, num_senders, config.seconds, f"s{num_senders}")
                    cores = (tree_cpu_s(collector.process.pid) - cpu_s) / (time.perf_counter() - started)
                finally:
                    collector.stop()
                    shutil.rmtree(data_dir.parent)
                rows.append({"path": f"collector, durability {durability}", "num_senders": num_senders, "mb_s": rate,
                             "collector_cores": cores,
                             "raw_mb_s_per_core": rate * info.raw_nbytes / info.stored_nbytes / cores if cores else None})
        rows.append({"path": "disk: pwrite + fdatasync per frame, no network", "num_senders": None, "mb_s": disk_rate})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ceilings = {row["num_senders"]: row["mb_s"] for row in rows if row["path"] == "raw socket ceiling"}
    for row in rows:
        row["ratio_to_raw_socket"] = row["mb_s"] / ceilings[row["num_senders"]] if row["num_senders"] else None
        row["ratio_to_disk"] = row["mb_s"] / disk_rate if row["path"].startswith("collector") else None
    fsync_rows = [row for row in rows if row["path"] == "collector, durability fsync"]
    best_fsync = max(fsync_rows, key=lambda row: row["mb_s"])
    summary = {"frame_mib": factory.frame_nbytes / 2**20, "frame_ratio": info.raw_nbytes / info.stored_nbytes,
               "collector_fsync_best_mb_s": best_fsync["mb_s"], "disk_mb_s": disk_rate,
               "collector_fsync_best_ratio_to_disk": best_fsync["ratio_to_disk"],
               "collector_fsync_best_ratio_to_raw_socket": best_fsync["ratio_to_raw_socket"],
               "collector_fsync_raw_mb_s_per_core": max(row["raw_mb_s_per_core"] or 0 for row in fsync_rows)}
    notes = [
        f"frame: T={config.num_tokens} K={config.num_layers} H={config.hidden_size} bf16-split, "
        f"{summary['frame_mib']:.2f} MiB stored ({summary['frame_ratio']:.3f}x); {config.seconds:g} s per row; "
        f"senders are threads of the bench process, on the same {os.cpu_count()} cores as the collector",
        f"best collector ingest with fsync: {best_fsync['mb_s']:,.0f} MB/s = "
        f"**{best_fsync['ratio_to_disk']:.2f}x** the disk alone, {best_fsync['ratio_to_raw_socket']:.2f}x "
        "the raw-socket ceiling",
        f"the collector with fsync stores up to {summary['collector_fsync_raw_mb_s_per_core']:,.0f} MB/s of raw states "
        "per core of its own process (its CPU over the measured seconds; the senders' CPU is this process's)",
    ]
    return {"title": "Collector ingest over loopback vs the disk alone vs the raw-socket ceiling",
            "parameters": asdict(config), "columns": COLUMNS, "rows": rows, "summary": summary, "notes": notes}
