"""Connection limits of the real collector process: stalled headers are closed, huge headers refused fast; an idle
collector does not wake, its answers still carry the date, and a stop still stops it at once."""

from __future__ import annotations

import email.utils
import signal
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from collector_service import quiet_server
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


def _voluntary_switches(pid: int) -> int:
    """Times the process's main thread went to sleep (each wake-up of an idle event loop is one)."""
    for line in Path(f"/proc/{pid}/task/{pid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in /proc")


def _answer_date(url: str) -> float:
    with urllib.request.urlopen(f"{url}/healthz", timeout=5) as response:
        assert response.status == 200
        return email.utils.parsedate_to_datetime(response.headers["Date"]).timestamp()


def test_an_idle_collector_does_not_wake_and_its_answers_carry_the_date(tmp_path: Path) -> None:
    collector = CollectorProcess(tmp_path / "data")
    try:
        first = _answer_date(collector.url)
        assert abs(first - time.time()) < 5
        time.sleep(0.5)
        before = _voluntary_switches(collector.process.pid)
        time.sleep(3.0)
        woken = _voluntary_switches(collector.process.pid) - before
        assert woken <= 1, f"the idle event loop woke {woken} times in 3 s (ticking once a second: 3; uvicorn: 30)"
        assert _answer_date(collector.url) >= first + 3, "the Date header is the answer's, not the last tick's"
    finally:
        collector.stop()
    assert collector.process.returncode == -signal.SIGTERM  # uvicorn re-raises the signal once it has shut down


@pytest.mark.parametrize("stop", ["signal", "should_exit"])
def test_a_stop_wakes_the_quiet_server_at_once(stop: str) -> None:
    """handle_exit (uvicorn's signal handler) and should_exit set on another thread wake the loop, which
    otherwise sleeps: the server stops at once."""
    import asyncio
    import threading

    import uvicorn

    async def app(scope, receive, send) -> None:
        assert scope["type"] == "lifespan"
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})

    listener = socket.create_server(("127.0.0.1", 0))
    server = quiet_server.QuietServer(uvicorn.Config(app, lifespan="on", log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[listener])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    time.sleep(0.2)  # into the tick's wait
    started = time.monotonic()
    if stop == "signal":
        server.handle_exit(signal.SIGTERM, None)
    else:
        server.should_exit = True
    thread.join(20)
    assert not thread.is_alive() and time.monotonic() - started < 15, "the server slept through its stop"


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
