"""Connection limits of the real collector process: stalled headers are closed, huge headers refused fast."""

from __future__ import annotations

import socket
import time
import urllib.request
from pathlib import Path

from eagle_tap.testbed.collector_process import CollectorProcess


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


def test_healthz_reports_a_folder_that_stopped_taking_writes() -> None:
    """The collector runs as `nobody` (root writes anywhere) on a folder that turns read-only after start."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    import httpx

    from eagle_tap.serve.sglang_server import free_port
    from test_collector_support import make_frame

    as_root = os.geteuid() == 0
    assert not as_root or shutil.which("setpriv"), "as root this test needs setpriv (util-linux)"
    top = Path(tempfile.mkdtemp(prefix="eagle-tap-healthz-"))
    top.chmod(0o755)
    data_dir = top / "captures"
    data_dir.mkdir()
    if as_root:
        os.chown(data_dir, 65534, 65534)
    port = free_port()
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if as_root else []
    process = subprocess.Popen([*prefix, sys.executable, "-m", "collector_service", "collect", "--shards",
                                str(data_dir), "--port", str(port), "--log-level", "warning"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and process.poll() is None, "the collector did not start"
                time.sleep(0.2)
        data_dir.chmod(0o555)
        headers = {"Content-Type": "application/octet-stream"}
        refused = httpx.post(f"{url}/v1/records", content=make_frame("read-only-1"), headers=headers, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"] == "storage_failed", refused.text
        health = httpx.get(f"{url}/healthz", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "failing", health.text
        assert "Permission denied" in health.json()["detail"]

        data_dir.chmod(0o755)
        stored = httpx.post(f"{url}/v1/records", content=make_frame("writable-again"), headers=headers, timeout=30)
        assert stored.status_code == 201, stored.text
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=60)
        data_dir.chmod(0o755)
        shutil.rmtree(top, ignore_errors=True)
