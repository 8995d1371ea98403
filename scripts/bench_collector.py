"""Collector ingest throughput over loopback against a raw-socket ceiling measured in the same run.

    python scripts/bench_collector.py [--seconds 4] [--tokens 512] [--layers 3] [--hidden 1024]

Prints a Markdown table: MB/s (10^6 bytes/s) of stored frame bytes acknowledged, per number of
concurrent senders (--senders, default 1,2), for
- the raw-socket ceiling: a plain TCP server in its own process reads each frame into one reused
  buffer (recv_into) and answers one byte; the client sends the same bytes the same way;
- the collector (`python -m collector_service collect`, its own process) with durability fsync
  (ack after the group commit's fdatasync) and none (ack after the write);
- the disk alone: one thread writing the same frame and fdatasync-ing after each, in the data
  directory's file system (what fsync-mode ingest with one frame per sync can at best reach).
Senders are threads of this process, each with one keep-alive connection and a minimal HTTP/1.1
client on a plain socket (one send for request line, headers and frame header, one for the payload,
from a memoryview): the same send path as the raw ceiling. http.client cost ~0.3 ms of client CPU
per request here and httpx more; both would measure the client as much as the collector.
Every POST carries a new record id (the header is re-encoded with its checksum; the payload is
shared), so each one is stored, never answered as a duplicate.
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import xxhash

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import capture_format as cf  # noqa: E402
from capture_format.frame_header import load_header  # noqa: E402

_PREFIX = struct.Struct("<8sHHIQQ")
TOKEN = "bench-token"
RECORD_ID_CHARS = 24
"""Every record id has this length, so every frame has the template's length."""


def record_id(tag: str, number: int) -> str:
    return f"{tag}-{number:0{RECORD_ID_CHARS - len(tag) - 1}d}"


def make_frame(num_tokens: int, num_layers: int, hidden_size: int, seed: int = 0) -> bytes:
    """A realistic frame: Gaussian residual-like states in bf16, stored with bf16-split."""
    rng = np.random.default_rng(seed)
    states = rng.standard_normal((num_tokens, num_layers + 1, hidden_size), dtype=np.float32)
    bits = cf.bfloat16_bits_from_float32(states)
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

def start_collector(data_dir: Path, durability: str) -> tuple[subprocess.Popen, int]:
    process = subprocess.Popen(
        [sys.executable, "-m", "collector_service", "collect", "--data-dir", str(data_dir), "--port", "0",
         "--durability", durability, "--min-free-bytes", "0", "--log-level", "warning"],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "EAGLE_TAP_COLLECTOR_TOKEN": TOKEN},
    )
    line = process.stdout.readline()
    port = int(line.split("http://127.0.0.1:", 1)[1].split()[0])
    for _ in range(200):
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/healthz")
            if connection.getresponse().status == 200:
                connection.close()
                return process, port
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("collector did not become healthy")


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


def _timed(sender, num_senders: int, seconds: float) -> float:
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
        raise RuntimeError("a sender failed")
    return sum(results) / elapsed / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="duration of each measurement")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--data-dir", type=Path, default=None, help="where the collector writes (default: a temp dir)")
    parser.add_argument("--senders", default="1,2", help="comma-separated sender counts to measure")
    args = parser.parse_args()
    sender_counts = [int(count) for count in args.senders.split(",")]

    factory = FrameFactory(make_frame(args.tokens, args.layers, args.hidden))
    info = cf.inspect_frame(factory.head(record_id("check", 0)) + bytes(factory.payload))
    print(f"frame: T={args.tokens} K={args.layers} H={args.hidden} bf16-split, {factory.frame_nbytes / 2**20:.2f} MiB "
          f"stored ({info.raw_nbytes / info.stored_nbytes:.3f}x); {args.seconds:g} s per row; {os.cpu_count()} cores\n")

    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    raw_server = multiprocessing.get_context("fork").Process(target=_raw_server, args=(listener,), daemon=True)
    raw_server.start()
    raw_port = listener.getsockname()[1]
    rows = []
    ceilings = {}
    for num_senders in sender_counts:
        ceilings[num_senders] = run_raw(raw_port, factory, num_senders, args.seconds)
        rows.append(("raw socket ceiling", num_senders, ceilings[num_senders]))
    raw_server.kill()
    raw_server.join()

    disk_dir = Path(tempfile.mkdtemp(prefix="bench-disk-", dir=args.data_dir))
    disk_rate = run_disk(disk_dir, factory, args.seconds)
    disk_dir.rmdir()

    for durability in ("fsync", "none"):
        for num_senders in sender_counts:
            data_dir = Path(tempfile.mkdtemp(prefix="bench-collector-", dir=args.data_dir))
            process, port = start_collector(data_dir, durability)
            try:
                run_collector(port, factory, num_senders, min(1.0, args.seconds), "warmup")
                rate = run_collector(port, factory, num_senders, args.seconds, f"s{num_senders}")
            finally:
                process.terminate()
                process.wait(timeout=60)
                shutil.rmtree(data_dir)
            rows.append((f"collector, durability {durability}", num_senders, rate))

    print("| path | senders | MB/s stored bytes | ratio to raw ceiling |")
    print("|---|---|---|---|")
    for name, num_senders, rate in rows:
        print(f"| {name} | {num_senders} | {rate:,.0f} | {rate / ceilings[num_senders]:.2f} |")
    print(f"| disk: pwrite + fdatasync per frame, no network | - | {disk_rate:,.0f} | - |")


if __name__ == "__main__":
    main()
