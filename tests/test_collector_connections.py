"""Connection limits of the real collector process: stalled headers are closed, huge headers refused fast."""

from __future__ import annotations

import socket
import time
import urllib.request
from pathlib import Path

from eagle_tap.collector_process import CollectorProcess


def _connect(port: int) -> socket.socket:
    connection = socket.create_connection(("127.0.0.1", port), timeout=10)
    connection.sendall(b"POST /v1/records HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # headers never finish
    return connection


def test_stalled_headers_are_closed_and_big_headers_refused(tmp_path: Path) -> None:
    collector = CollectorProcess(tmp_path / "data", env={"EAGLE_TAP_COLLECTOR_HEADER_TIMEOUT_S": "1",
                                                         "EAGLE_TAP_COLLECTOR_MAX_HEADER_BYTES": "16384"})
    try:
        stalled = [_connect(collector.port) for _ in range(20)]
        time.sleep(2.5)
        for connection in stalled:  # the server closed each one: recv sees the end of the stream
            connection.settimeout(5)
            assert connection.recv(100) == b""
            connection.close()

        with socket.create_connection(("127.0.0.1", collector.port), timeout=10) as big:
            started = time.monotonic()
            try:
                big.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
            except OSError:  # the server may answer and close before the whole header is sent
                pass
            answer = big.recv(200)
            assert answer.startswith(b"HTTP/1.1 400"), answer
            assert time.monotonic() - started < 2.0

        with urllib.request.urlopen(f"{collector.url}/healthz", timeout=5) as response:
            assert response.status == 200  # everyone else is still served
    finally:
        collector.stop()
