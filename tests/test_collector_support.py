"""Helpers for the collector tests: small frames, header surgery, and real collectors on loopback.

No tests here; the test_collector_* modules import it (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import xxhash

from capture_format import CaptureRecord, encode_frame
from capture_format.frame_header import dump_header

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKEN = "test-token-0123456789"
OCTET_STREAM = {"Content-Type": "application/octet-stream"}
_PREFIX = struct.Struct("<8sHHIQQ")


def make_record(record_id: str, *, num_tokens: int = 8, hidden_size: int = 32, layers: tuple[int, ...] = (1, 3),
                seed: int | None = None) -> CaptureRecord:
    """A small bf16 record with random states (uint16 bit patterns)."""
    rng = np.random.default_rng(seed if seed is not None else zlib.crc32(record_id.encode()))
    return CaptureRecord(
        record_id=record_id,
        sample_id="sample-1",
        model_fingerprint="tiny-test@0",
        capture_layers=layers,
        hidden_size=hidden_size,
        dtype="bfloat16",
        token_ids=rng.integers(0, 1000, size=num_tokens, dtype=np.int32),
        loss_spans=((1, num_tokens),),
        aux=rng.integers(0, 1 << 16, size=(num_tokens, len(layers), hidden_size), dtype=np.uint16),
        final=rng.integers(0, 1 << 16, size=(num_tokens, hidden_size), dtype=np.uint16),
    )


def make_frame(record_id: str, **kwargs: Any) -> bytes:
    return encode_frame(make_record(record_id, **kwargs))


def split_frame(frame: bytes) -> tuple[tuple, dict[str, Any], bytes]:
    """(prefix fields, header dict, payload bytes) of a frame."""
    fields = _PREFIX.unpack_from(frame)
    header_nbytes = fields[3]
    header = json.loads(frame[32 : 32 + header_nbytes])
    return fields, header, frame[32 + header_nbytes :]


def build_frame(header_bytes: bytes, payload: bytes, *, payload_nbytes: int | None = None, magic: bytes = b"ETAPFRAM",
                version: int = 1, flags: int = 0) -> bytes:
    """A frame from raw header bytes and payload, with a header checksum that matches (as the writer computes it)."""
    fields = (magic, version, flags, len(header_bytes), len(payload) if payload_nbytes is None else payload_nbytes)
    checksum = xxhash.xxh3_64_intdigest(_PREFIX.pack(*fields, 0)[:24] + header_bytes)
    return _PREFIX.pack(*fields, checksum) + header_bytes + payload


def rewrite_header(frame: bytes, mutate: Callable[[dict[str, Any]], Any]) -> bytes:
    """frame with its header changed by mutate(header) and a valid header checksum: a lie the checksum cannot catch."""
    _, header, payload = split_frame(frame)
    mutate(header)
    return build_frame(dump_header(header), payload)


def flip_bit(data: bytes, offset: int, bit: int = 0) -> bytes:
    changed = bytearray(data)
    changed[offset] ^= 1 << bit
    return bytes(changed)


def tensor_entry(header: dict[str, Any], name: str) -> dict[str, Any]:
    return next(entry for entry in header["tensors"] if entry["name"] == name)


def disk_snapshot(directory: Path) -> dict[str, int]:
    """File name -> size of everything in directory: equal snapshots mean nothing was written."""
    return {entry.name: entry.stat().st_size for entry in os.scandir(directory)}


class ThreadedCollector:
    """create_app(settings) served by uvicorn in a thread of this process, on a free loopback port."""

    def __init__(self, **settings: Any) -> None:
        import uvicorn

        from collector_service.app import create_app
        from collector_service.settings import CollectorSettings

        self.settings = CollectorSettings(**{"min_free_bytes": 0, "token": TOKEN, **settings})
        self.app = create_app(self.settings)
        listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [listener]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("collector did not start")
            time.sleep(0.01)
        self.client = client_for(self.url)

    @property
    def store(self):
        return self.app.state.store

    def stats(self) -> dict[str, Any]:
        return self.client.get("/v1/stats").raise_for_status().json()

    def post(self, body: bytes, **kwargs: Any) -> httpx.Response:
        return self.client.post("/v1/records", content=body, headers={**OCTET_STREAM, **kwargs.pop("headers", {})},
                                **kwargs)

    def stop(self) -> None:
        self.client.close()
        self.server.should_exit = True
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "collector did not stop"

    def __enter__(self) -> ThreadedCollector:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def client_for(url: str, token: str | None = TOKEN) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=url, headers=headers, timeout=30)


class CollectorProcess:
    """`python -m collector_service collect` in a subprocess (for SIGKILL); stop() or kill() it."""

    def __init__(self, data_dir: Path, *extra_args: str, log_path: Path | None = None) -> None:
        self.log_path = log_path or data_dir.with_name(data_dir.name + ".log")
        command = [sys.executable, "-m", "collector_service", "collect", "--data-dir", str(data_dir), "--port", "0",
                   "--min-free-bytes", "0", "--log-level", "warning", *extra_args]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "EAGLE_TAP_COLLECTOR_TOKEN": TOKEN}
        with open(self.log_path, "a") as log:  # a file, not a pipe: nothing can block on a full pipe
            self.process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=log,
                                            text=True)
        line = self.process.stdout.readline()
        if "listening on" not in line:
            self.process.kill()
            self.process.wait(timeout=30)
            raise RuntimeError(f"collector failed to start: {line!r} {self.log_path.read_text()[-2000:]}")
        self.url = line.split("listening on ", 1)[1].split()[0]
        self.client = client_for(self.url)
        deadline = time.monotonic() + 30
        while True:
            try:
                if self.client.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.kill()
                raise RuntimeError("collector did not become healthy")
            time.sleep(0.05)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)
        self.client.close()

    def stop(self) -> int:
        self.process.terminate()
        code = self.process.wait(timeout=60)
        self.client.close()
        return code
