"""A collector cannot hurt the server the plugin runs in: each hostile answer here comes from a real
HTTP server on loopback, and the plugin reads a bounded answer, within its deadline, follows no
redirect, and keeps (spools) every frame it could not deliver."""

from __future__ import annotations

import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator

import pytest
import torch

from capture_format.tag import CaptureTag
from sglang_patch.capture import CapturedSequence
from sglang_patch.delivery import MAX_RESPONSE_BYTES, CollectorClient
from sglang_patch.device_copy import HostRows
from sglang_patch.sender import ModelIdentity, Sender
from sglang_patch.settings import CaptureSettings
from sglang_patch.spool import Spool
from sglang_patch.stats import CaptureStats
from test_collector_support import make_frame

HUGE_NBYTES = 512 << 20


class HostileCollector:
    """Reads each request whole, then answers with `behaviour`; counts requests."""

    def __init__(self, behaviour: str, redirect_to: str = "") -> None:
        self.behaviour = behaviour
        self.redirect_to = redirect_to
        self.num_requests = 0
        self._chunk = b"x" * (1 << 20)  # made here: tracemalloc counts every thread's allocations, the server's too
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(connection,), daemon=True).start()

    def _handle(self, connection: socket.socket) -> None:
        with connection:
            try:
                head = b""
                while b"\r\n\r\n" not in head:
                    head += connection.recv(65536)
                head, _, body = head.partition(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                while len(body) < length:
                    body += connection.recv(65536)
                self.num_requests += 1
                self._answer(connection)
            except OSError:
                return  # the client hung up: what a bounded client does

    def _answer(self, connection: socket.socket) -> None:
        if self.behaviour in ("huge_201", "huge_500"):
            status = b"201 Created" if self.behaviour == "huge_201" else b"500 Internal Server Error"
            connection.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Length: %d\r\n\r\n" % HUGE_NBYTES)
            for _ in range(HUGE_NBYTES // len(self._chunk)):
                connection.sendall(self._chunk)
        elif self.behaviour == "redirect":
            connection.sendall(b"HTTP/1.1 307 Temporary Redirect\r\nLocation: " + self.redirect_to.encode()
                               + b"/v1/batches\r\nContent-Length: 0\r\n\r\n")
        elif self.behaviour == "drip":
            for byte in b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n{}":
                if self._stop.is_set():
                    return
                connection.sendall(bytes([byte]))
                time.sleep(0.5)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()


@pytest.fixture
def hostile() -> Iterator:
    servers = []

    def start(behaviour: str, **kwargs: str) -> HostileCollector:
        servers.append(HostileCollector(behaviour, **kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.mark.parametrize("behaviour", ["huge_201", "huge_500"])
def test_a_huge_answer_is_not_read_and_the_frames_are_kept(hostile, behaviour: str) -> None:
    collector = hostile(behaviour)
    client = CollectorClient(collector.url, token=None, deadline_s=20)
    client.deliver([make_frame("warm-up")])  # imports and connection set-up are not what is measured
    tracemalloc.start()
    try:
        verdicts = client.deliver([make_frame("a"), make_frame("b")])
        _, peak_nbytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        client.close()
    assert [verdict.outcome for verdict in verdicts] == ["retry", "retry"]
    assert "larger than" in verdicts[0].why
    assert peak_nbytes < 8 * MAX_RESPONSE_BYTES, f"read {peak_nbytes} bytes of a {HUGE_NBYTES}-byte answer"


def test_a_redirect_is_not_followed(hostile) -> None:
    target = hostile("huge_201")
    collector = hostile("redirect", redirect_to=target.url)
    client = CollectorClient(collector.url, token=None, deadline_s=10)
    verdicts = client.deliver([make_frame("a")])
    client.close()
    assert verdicts[0].outcome == "retry" and "redirect" in verdicts[0].why
    assert collector.num_requests == 1 and target.num_requests == 0


def test_an_answer_that_drips_ends_at_the_deadline(hostile) -> None:
    collector = hostile("drip")
    client = CollectorClient(collector.url, token=None, deadline_s=1.5)
    started = time.monotonic()
    verdicts = client.deliver([make_frame("a")])
    elapsed_s = time.monotonic() - started
    client.close()
    assert verdicts[0].outcome == "retry" and "within 1.5 s" in verdicts[0].why
    assert elapsed_s < 4, f"a dripping answer held the POST for {elapsed_s:.1f} s (deadline 1.5 s)"


def captured(record_id: str, num_tokens: int = 6, hidden_size: int = 16, num_layers: int = 2) -> CapturedSequence:
    aux = torch.randn(num_tokens, num_layers * hidden_size).to(torch.bfloat16)  # (T, K*H)
    final = torch.randn(num_tokens, hidden_size).to(torch.bfloat16)  # (T, H)
    tag = CaptureTag(record_id=record_id, sample_id=record_id, loss_spans=((0, num_tokens),))
    return CapturedSequence(tag=tag, token_ids=list(range(num_tokens)), chunks=[HostRows(aux=aux, final=final)],
                            loss_spans=tag.loss_spans, num_states=num_tokens, metadata={})


@pytest.mark.parametrize("behaviour", ["redirect", "drip", "huge_201"])
def test_the_sender_spools_what_a_hostile_collector_did_not_take(hostile, tmp_path, behaviour: str) -> None:
    collector = hostile(behaviour, redirect_to="http://127.0.0.1:9")
    settings = CaptureSettings(collector_url=collector.url, spool_dir=tmp_path / "spool", send_timeout_s=1.0,
                               batch_max_age_s=0.0)
    stats = CaptureStats()
    spool = Spool(settings.spool_dir / "dp0", settings.spool_max_bytes)
    sender = Sender(settings=settings, model=ModelIdentity(capture_layers=(1, 3), hidden_size=16,
                                                           model_fingerprint="test", state_dtype="bfloat16",
                                                           codec="bf16-split"),
                    stats=stats, spool=spool, stats_path=tmp_path / "stats.json")
    try:
        for index in range(3):
            sender.submit(captured(f"{behaviour}-{index}"))
        deadline = time.monotonic() + 20
        while stats.snapshot().get("spooled", 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        sender.close(timeout_s=5)
    snapshot = stats.snapshot()
    assert snapshot.get("spooled") == 3 and snapshot["dropped"] == {}, snapshot
    assert len(spool) == 3 and snapshot.get("sent", 0) == 0
