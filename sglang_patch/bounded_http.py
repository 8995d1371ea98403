"""A POST that a hostile or broken collector cannot turn against the server it runs in.

The sender lives inside the SGLang process, so whatever the collector answers lands in serving's
memory and time. What must hold for every POST:
- it ends within `deadline_s`, whatever the peer does: every socket read and write is given only the
  time left (per-operation timeouts alone let a peer that drips one byte a second hold it forever);
- at most `max_response_bytes` of the answer are read: a larger answer is an error, not a bigger buffer;
  bodies are read raw, never decompressed (no gzip bomb);
- redirects are never followed (a 3xx is just a status the caller treats as "not delivered").
Built on httpcore's public network-backend API (httpx's own transport), so the deadline reaches the
sockets.
"""

from __future__ import annotations

import dataclasses
import math
import ssl
import time
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlparse

import httpcore

__all__ = ["BoundedPoster", "PostFailed", "PostResponse"]


class PostFailed(Exception):
    """The POST got no usable answer: connection, deadline or an answer larger than allowed."""


@dataclasses.dataclass(frozen=True, slots=True)
class PostResponse:
    status: int
    body: bytes
    """At most max_response_bytes, as sent (not decoded)."""
    headers: dict[str, str]


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream, backend: _DeadlineBackend) -> None:
        self._stream = stream
        self._backend = backend

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, self._backend.time_left(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, self._backend.time_left(timeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        tls = self._stream.start_tls(ssl_context, server_hostname, self._backend.time_left(timeout))
        return _DeadlineStream(tls, self._backend)

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    """Hands every socket operation only the time left until `deadline` (time.monotonic())."""

    def __init__(self) -> None:
        self._backend = httpcore.SyncBackend()
        self.deadline = math.inf

    def time_left(self, timeout: float | None) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise httpcore.TimeoutException("the POST ran past its overall deadline")
        return left if timeout is None else min(timeout, left)

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable | None = None) -> httpcore.NetworkStream:
        stream = self._backend.connect_tcp(host, port, self.time_left(timeout), local_address, socket_options)
        return _DeadlineStream(stream, self)

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._backend.connect_unix_socket(path, self.time_left(timeout), socket_options), self)

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


class BoundedPoster:
    """One keep-alive connection to one origin; `post()` from one thread at a time."""

    def __init__(self, *, headers: dict[str, str], deadline_s: float, max_response_bytes: int) -> None:
        self._headers = [(name.encode(), value.encode()) for name, value in headers.items()]
        self._headers.append((b"Accept-Encoding", b"identity"))
        self.deadline_s = deadline_s
        self.max_response_bytes = max_response_bytes
        self._backend = _DeadlineBackend()
        self._pool = httpcore.ConnectionPool(network_backend=self._backend, max_connections=1, retries=0)

    def post(self, url: str, parts: Sequence[bytes], content_type: str) -> PostResponse:
        """POSTs the parts back to back as one body; PostFailed if no bounded answer came in time."""
        nbytes = sum(map(len, parts))
        headers = [*self._headers, (b"Host", _host_header(url)), (b"Content-Type", content_type.encode()),
                   (b"Content-Length", str(nbytes).encode())]
        timeouts = {name: self.deadline_s for name in ("connect", "read", "write", "pool")}
        self._backend.deadline = time.monotonic() + self.deadline_s
        try:
            with self._pool.stream("POST", url, headers=headers, content=iter(parts),
                                   extensions={"timeout": timeouts}) as response:
                body = bytearray()
                for chunk in response.iter_stream():
                    body += chunk
                    if len(body) > self.max_response_bytes:
                        raise PostFailed(f"HTTP {response.status} answer is larger than "
                                         f"{self.max_response_bytes} bytes; not read further")
                response_headers = {name.decode("latin-1").lower(): value.decode("latin-1")
                                    for name, value in response.headers}
                return PostResponse(status=response.status, body=bytes(body), headers=response_headers)
        except httpcore.TimeoutException as error:
            raise PostFailed(f"no complete answer within {self.deadline_s:g} s ({error})") from None
        except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol) as error:
            raise PostFailed(f"{type(error).__name__}: {error}") from None
        finally:
            self._backend.deadline = math.inf

    def close(self) -> None:
        self._pool.close()


def _host_header(url: str) -> bytes:
    parsed = urlparse(url)
    return parsed.netloc.rsplit("@", 1)[-1].encode()
