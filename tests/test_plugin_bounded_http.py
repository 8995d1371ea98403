"""The sender's HTTP client (`sglang_patch.bounded_http`) against a scripted server on loopback: the ways an
HTTP/1.1 answer may be framed, connections the server closes, and answers it must not read
(test_plugin_hostile_collector has the hostile ones through the sender)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from sglang_patch.bounded_http import MAX_HEAD_BYTES, BoundedPoster, PostFailed

Answer = Callable[[socket.socket, bytes], bool]
"""Given the connection and the request's body, answers it; False closes the connection after."""


class ScriptedServer:
    """Answers the n-th request (over all connections) with answers[n]; records the bodies and counts
    connections."""

    def __init__(self, answers: list[Answer]) -> None:
        self.answers = answers
        self.bodies: list[bytes] = []
        self.num_connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}/v1/batches"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            self.num_connections += 1
            threading.Thread(target=self._handle, args=(connection,), daemon=True).start()

    def _handle(self, connection: socket.socket) -> None:
        with connection:
            pending = b""
            while True:
                while b"\r\n\r\n" not in pending:
                    data = connection.recv(65536)
                    if not data:
                        return
                    pending += data
                head, _, pending = pending.partition(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                while len(pending) < length:
                    pending += connection.recv(65536)
                body, pending = pending[:length], pending[length:]
                self.bodies.append(body)
                if not self.answers[len(self.bodies) - 1](connection, body):
                    return

    def close(self) -> None:
        self._listener.close()


def sends(data: bytes, keep: bool = True) -> Answer:
    def answer(connection: socket.socket, body: bytes) -> bool:
        connection.sendall(data)
        return keep
    return answer


def hangs_up(connection: socket.socket, body: bytes) -> bool:
    return False


OK_JSON = b'{"results": []}'
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(OK_JSON), OK_JSON)


@pytest.fixture
def scripted() -> Iterator[Callable[[list[Answer]], ScriptedServer]]:
    servers: list[ScriptedServer] = []

    def start(answers: list[Answer]) -> ScriptedServer:
        servers.append(ScriptedServer(answers))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def poster(max_response_bytes: int = 1 << 16, deadline_s: float = 10.0) -> BoundedPoster:
    return BoundedPoster(headers={"Authorization": "Bearer t"}, deadline_s=deadline_s,
                         max_response_bytes=max_response_bytes)


def test_the_parts_go_as_one_body_and_the_connection_is_kept(scripted) -> None:
    server = scripted([sends(OK), sends(OK)])
    client = poster()
    large = bytes(range(256)) * 2048  # 512 KiB: sent part by part
    first = client.post(server.url, [b"abc", b"def"], "application/x-eagle-tap-frames")
    second = client.post(server.url, [large, b"tail"], "application/x-eagle-tap-frames")
    client.close()
    assert (first.status, first.body, first.headers["content-type"]) == (200, OK_JSON, "application/json")
    assert second.body == OK_JSON
    assert server.bodies == [b"abcdef", large + b"tail"]
    assert server.num_connections == 1


@pytest.mark.parametrize("answer, keeps", [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;x=y\r\nhello\r\n6\r\n world\r\n0\r\nTrailer: 1\r\n\r\n",
     True),
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello world", True),
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 11\r\n\r\nhello world", False),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 11\r\n\r\nhello world", False),
])
def test_each_framing_of_an_answer_is_read(scripted, answer: bytes, keeps: bool) -> None:
    server = scripted([sends(answer, keep=keeps), sends(OK)])
    client = poster()
    assert client.post(server.url, [b"x"], "application/x-eagle-tap-frames").body == b"hello world"
    assert client.post(server.url, [b"y"], "application/x-eagle-tap-frames").body == OK_JSON
    client.close()
    assert server.num_connections == (1 if keeps else 2)


def test_an_answer_ended_by_closing_is_read_to_the_close(scripted) -> None:
    server = scripted([sends(b"HTTP/1.1 200 OK\r\n\r\nhello world", keep=False), sends(OK)])
    client = poster()
    assert client.post(server.url, [b"x"], "application/x-eagle-tap-frames").body == b"hello world"
    assert client.post(server.url, [b"y"], "application/x-eagle-tap-frames").status == 200
    client.close()
    assert server.num_connections == 2


def test_a_connection_closed_while_idle_or_as_the_request_goes_out_is_replaced(scripted) -> None:
    """Closed on receiving the next request, no answer: sent once more on a new connection (a frame sent twice is
    stored once). Closed after an answer (what uvicorn does to an idle kept-alive one): a new one. Closed without
    an answer on a new connection too: that fails."""
    server = scripted([sends(OK), hangs_up, sends(OK, keep=False), sends(OK), hangs_up, hangs_up])
    client = poster()
    assert client.post(server.url, [b"1"], "application/x-eagle-tap-frames").status == 200
    assert client.post(server.url, [b"2"], "application/x-eagle-tap-frames").status == 200
    assert server.bodies == [b"1", b"2", b"2"] and server.num_connections == 2
    time.sleep(0.05)  # the close reaches the client while its connection is idle
    assert client.post(server.url, [b"3"], "application/x-eagle-tap-frames").status == 200
    assert server.bodies[3:] == [b"3"] and server.num_connections == 3
    with pytest.raises(PostFailed, match="closed the connection without answering"):
        client.post(server.url, [b"4"], "application/x-eagle-tap-frames")
    client.close()
    assert server.bodies[4:] == [b"4", b"4"]


@pytest.mark.parametrize("answer, why", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 70000\r\n\r\n", "larger than 65536 bytes; not read"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10000\r\n" + b"x" * 65536 + b"\r\n1\r\nx\r\n0\r\n\r\n",
     "larger than 65536 bytes; not read"),
    (b"HTTP/1.1 200 OK\r\nX-Pad: " + b"x" * (MAX_HEAD_BYTES + 1024), "headers are larger than"),
    (b"HTTP/1.1 2xx OK\r\n\r\n", "malformed status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "malformed Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed chunk size"),
])
def test_an_answer_too_large_or_malformed_fails_the_post(scripted, answer: bytes, why: str) -> None:
    server = scripted([sends(answer), sends(OK)])
    client = poster()
    with pytest.raises(PostFailed, match=why):
        client.post(server.url, [b"x"], "application/x-eagle-tap-frames")
    assert client.post(server.url, [b"y"], "application/x-eagle-tap-frames").status == 200  # on a new connection
    client.close()
    assert server.num_connections == 2


def test_nothing_listening_and_bad_headers_are_refused() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
    with pytest.raises(PostFailed, match="ConnectionRefusedError"):
        poster().post(f"http://127.0.0.1:{port}/v1/batches", [b"x"], "application/x-eagle-tap-frames")
    with pytest.raises(PostFailed, match="UnsupportedProtocol"):
        poster().post("ftp://127.0.0.1/v1/batches", [b"x"], "application/x-eagle-tap-frames")
    with pytest.raises(ValueError, match="line break"):
        BoundedPoster(headers={"Authorization": "Bearer t\r\nX-Evil: 1"}, deadline_s=1, max_response_bytes=1)
