"""Start a real collector (`python -m collector_service collect`) as a child process on loopback.

Used by the tests, the capture benchmark and the demo. `CollectorProcess(...)` returns once `/healthz`
answers; `stop()` terminates it (SIGTERM, so it seals its open shard) and waits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from eagle_tap.serve.sglang_server import free_port


class CollectorProcess:
    """A real collector (`python -m collector_service collect`) on a loopback port, stopped with `stop()`."""

    def __init__(self, data_dir: Path, port: int | None = None, extra_args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, log_path: Path | None = None) -> None:
        self.data_dir = data_dir
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        data_dir.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path or data_dir.parent / f"collector-{self.port}.log"  # appended to
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "collector_service", "collect", "--shards", str(data_dir),
             "--host", "127.0.0.1", "--port", str(self.port), *extra_args],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"collector exited with {self.process.returncode}: see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=5):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"collector did not answer /healthz within {timeout_s:.0f} s: see {self.log_path}")

    def stats(self, token: str | None = None) -> dict:
        """The collector's `/v1/stats`: records, tokens and bytes stored, rejects, durability."""
        import json

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        request = urllib.request.Request(f"{self.url}/v1/stats", headers=headers)
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def has_record(self, record_id: str) -> bool:
        """Whether the collector holds record_id (`GET /v1/records/{id}`: 200, or 404)."""
        try:
            with urllib.request.urlopen(f"{self.url}/v1/records/{record_id}", timeout=30):
                return True
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return False
            raise

    def stop(self) -> None:
        """Terminate the collector (it seals its open shard on SIGTERM) and wait, killing it after 30 s; safe to call
        twice."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:  # a collector that cannot seal in 30 s is killed; start-up recovers
                self.process.kill()
                self.process.wait()
        if not self._log.closed:
            self._log.close()
