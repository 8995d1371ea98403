"""A POST that a hostile or broken collector cannot turn against the server it runs in.

The sender lives inside the SGLang process, so whatever the collector answers lands in serving's
memory and time. What must hold for every POST:
- it ends within `deadline_s`, whatever the peer does: every socket operation is given only the time
  left (per-operation timeouts alone let a peer that drips one byte a second hold it forever);
- at most `max_response_bytes` of the answer's body are read (and at most `MAX_HEAD_BYTES` of its
  status line and headers): a larger answer is an error, not a bigger buffer; bodies are read raw,
  never decompressed (no gzip bomb);
- redirects are never followed (a 3xx is just a status the caller treats as "not delivered").

A plain HTTP/1.1 client on one kept-alive socket, the standard library's only: the sender posts to one
collector, one request at a time, and needs nothing else of HTTP. httpcore (and its h11, pure Python)
cost the sender's thread 0.31-0.36 ms of CPU a POST to the collector, on the serving process's cores;
this costs about a third of that (docs/benchmarks.md). A connection the collector closed while it was
idle (uvicorn closes kept-alive ones after 5 s) is found before it is used; one it closes as the request
goes out is replaced once and the request sent again, which is safe: a frame sent twice is stored once
(the second answer is "duplicate").
"""

from __future__ import annotations

import dataclasses
import functools
import select
import socket
import ssl
import time
from collections.abc import Sequence
from urllib.parse import urlparse

__all__ = ["MAX_HEAD_BYTES", "BoundedPoster", "PostFailed", "PostResponse"]

MAX_HEAD_BYTES = 64 << 10
"""An answer's status line and headers, at most (the collector's are a few hundred bytes)."""
_JOINED_BODY_BYTES = 256 << 10
"""A request up to this size goes out in one send (head and frames joined); a larger one part by part."""
_MAX_INTERIM_ANSWERS = 8
"""1xx answers skipped before the real one, at most."""


class PostFailed(Exception):
    """The POST got no usable answer: connection, deadline, a malformed answer or one larger than allowed."""


class _ClosedBeforeAnswer(Exception):
    """The peer closed the connection before the first byte of an answer."""


@dataclasses.dataclass(frozen=True, slots=True)
class PostResponse:
    status: int
    body: bytes
    """At most max_response_bytes, as sent (not decoded)."""
    headers: dict[str, str]
    """Names in lower case."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Target:
    scheme: str
    host: str
    port: int
    request_target: bytes
    host_header: bytes

    @property
    def origin(self) -> tuple[str, str, int]:
        return self.scheme, self.host, self.port


@functools.lru_cache(maxsize=16)
def _target(url: str) -> _Target:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise PostFailed(f"UnsupportedProtocol: {url!r} is not an http(s) URL with a host")
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError as error:
        raise PostFailed(f"UnsupportedProtocol: {url!r}: {error}") from None
    path = (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else "")
    return _Target(parsed.scheme, parsed.hostname, port, path.encode("ascii"),
                   parsed.netloc.rsplit("@", 1)[-1].encode("ascii"))


def _too_large(status: int, max_bytes: int) -> PostFailed:
    return PostFailed(f"HTTP {status} answer is larger than {max_bytes} bytes; not read further")


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def arm(self, sock: socket.socket) -> None:
        """Gives the socket's next operation only the time left (TimeoutError when none is)."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError("the POST ran past its overall deadline")
        sock.settimeout(left)


class _Answer:
    """Reads one answer off the socket, within the deadline and the size bounds."""

    def __init__(self, sock: socket.socket, deadline: _Deadline, max_body_bytes: int) -> None:
        self._sock = sock
        self._deadline = deadline
        self._max_body_bytes = max_body_bytes
        self._buffer = bytearray()
        self.received_any = False

    @property
    def pending(self) -> bool:
        return bool(self._buffer)

    def _fill(self) -> bool:
        """Reads more into the buffer; False at the end of the stream."""
        self._deadline.arm(self._sock)
        data = self._sock.recv(65536)
        if data:
            self.received_any = True
            self._buffer += data
        return bool(data)

    def head(self) -> tuple[bytes, int, dict[str, str]]:
        """(HTTP version, status, headers) of the next answer."""
        while (end := self._buffer.find(b"\r\n\r\n")) < 0:
            if len(self._buffer) > MAX_HEAD_BYTES:
                raise PostFailed(f"the answer's status line and headers are larger than {MAX_HEAD_BYTES} bytes")
            if not self._fill():
                if not self.received_any:
                    raise _ClosedBeforeAnswer
                raise PostFailed("the collector closed the connection inside an answer's headers")
        if end > MAX_HEAD_BYTES:
            raise PostFailed(f"the answer's status line and headers are larger than {MAX_HEAD_BYTES} bytes")
        lines = bytes(self._buffer[:end]).split(b"\r\n")
        del self._buffer[: end + 4]
        version, _, rest = lines[0].partition(b" ")
        status = rest[:3]
        if not version.startswith(b"HTTP/1.") or len(status) != 3 or not status.isdigit():
            raise PostFailed(f"malformed status line {lines[0][:100]!r}")
        headers = {}
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip():
                raise PostFailed(f"malformed header line {line[:100]!r}")
            headers[name.decode("latin-1").lower()] = value.strip().decode("latin-1")
        return version, int(status), headers

    def exactly(self, nbytes: int) -> bytes:
        while len(self._buffer) < nbytes:
            if not self._fill():
                raise PostFailed(f"the collector closed the connection {len(self._buffer)} bytes into a body "
                                 f"of {nbytes}")
        data = bytes(self._buffer[:nbytes])
        del self._buffer[:nbytes]
        return data

    def line(self, max_bytes: int) -> bytes:
        while (end := self._buffer.find(b"\r\n")) < 0:
            if len(self._buffer) > max_bytes or not self._fill():
                raise PostFailed("malformed chunked answer (a line too long or cut off)")
        data = bytes(self._buffer[:end])
        del self._buffer[: end + 2]
        return data

    def chunked(self, status: int) -> bytes:
        body = bytearray()
        while True:
            size_text = self.line(1024).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise PostFailed(f"malformed chunk size {size_text[:40]!r}") from None
            if size == 0:
                break
            if len(body) + size > self._max_body_bytes:
                raise _too_large(status, self._max_body_bytes)
            body += self.exactly(size)
            if self.exactly(2) != b"\r\n":
                raise PostFailed("malformed chunked answer (no CRLF after a chunk)")
        for _ in range(64):  # trailer fields, then the empty line
            if not self.line(MAX_HEAD_BYTES):
                return bytes(body)
        raise PostFailed("malformed chunked answer (too many trailer lines)")

    def to_close(self, status: int) -> bytes:
        while self._fill():
            if len(self._buffer) > self._max_body_bytes:
                raise _too_large(status, self._max_body_bytes)
        return bytes(self._buffer)


class BoundedPoster:
    """One kept-alive connection to one origin; `post()` from one thread at a time."""

    def __init__(self, *, headers: dict[str, str], deadline_s: float, max_response_bytes: int) -> None:
        for name, value in headers.items():
            if any(character in f"{name}{value}" for character in "\r\n\0"):
                raise ValueError(f"header {name!r}: a line break or NUL in a header would end it early")
        self._headers = b"".join(f"{name}: {value}\r\n".encode("latin-1") for name, value in headers.items())
        self._headers += b"Accept-Encoding: identity\r\n"
        self.deadline_s = deadline_s
        self.max_response_bytes = max_response_bytes
        self._socket: socket.socket | None = None
        self._origin: tuple[str, str, int] | None = None
        self._ssl_context: ssl.SSLContext | None = None

    def post(self, url: str, parts: Sequence[bytes], content_type: str) -> PostResponse:
        """POSTs the parts back to back as one body; PostFailed if no bounded answer came in time."""
        target = _target(url)
        deadline = _Deadline(self.deadline_s)
        try:
            reused = self._socket is not None and self._origin == target.origin and self._still_open()
            if not reused:
                self._connect(target, deadline)
            try:
                return self._exchange(target, parts, content_type, deadline)
            except _ClosedBeforeAnswer:
                if not reused:
                    raise PostFailed("the collector closed the connection without answering") from None
            # It closed the kept-alive connection as the request went out: once more on a new one.
            self._connect(target, deadline)
            try:
                return self._exchange(target, parts, content_type, deadline)
            except _ClosedBeforeAnswer:
                raise PostFailed("the collector closed the connection without answering") from None
        except PostFailed:
            self.close()
            raise
        except TimeoutError as error:
            self.close()
            raise PostFailed(f"no complete answer within {self.deadline_s:g} s ({error or 'timed out'})") from None
        except OSError as error:  # connection refused or reset, TLS errors (ssl.SSLError is an OSError)
            self.close()
            raise PostFailed(f"{type(error).__name__}: {error}") from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._socket is not None:
            try:
                self._socket.close()
            finally:
                self._socket, self._origin = None, None

    def _still_open(self) -> bool:
        """Whether the idle connection can carry a request: readable while idle means the peer closed it (or sent
        what nobody asked for). poll, not select: a serving process may hold more than 1,024 descriptors."""
        poller = select.poll()
        poller.register(self._socket, select.POLLIN)
        if poller.poll(0):
            self.close()
            return False
        return True

    def _connect(self, target: _Target, deadline: _Deadline) -> None:
        self.close()
        left = deadline.at - time.monotonic()
        if left <= 0:
            raise TimeoutError("the POST ran past its overall deadline")
        sock = socket.create_connection((target.host, target.port), timeout=left)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a request's last bytes go at once
            if target.scheme == "https":
                deadline.arm(sock)
                sock = self._tls().wrap_socket(sock, server_hostname=target.host)
        except BaseException:
            sock.close()
            raise
        self._socket, self._origin = sock, target.origin

    def _tls(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            try:  # the CA bundle the httpx stack verified collectors against before
                import certifi

                self._ssl_context = ssl.create_default_context(cafile=certifi.where())
            except ImportError:
                self._ssl_context = ssl.create_default_context()
        return self._ssl_context

    def _exchange(self, target: _Target, parts: Sequence[bytes], content_type: str,
                  deadline: _Deadline) -> PostResponse:
        sock = self._socket
        nbytes = sum(map(len, parts))
        head = (b"POST %s HTTP/1.1\r\nHost: %s\r\n%sContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
                % (target.request_target, target.host_header, self._headers, content_type.encode("latin-1"), nbytes))
        answer = _Answer(sock, deadline, self.max_response_bytes)
        try:
            if nbytes <= _JOINED_BODY_BYTES:
                deadline.arm(sock)
                sock.sendall(b"".join([head, *parts]))
            else:
                for data in (head, *parts):
                    deadline.arm(sock)
                    sock.sendall(data)  # since Python 3.5 the timeout bounds the whole sendall
        except (BrokenPipeError, ConnectionResetError):
            raise _ClosedBeforeAnswer from None
        try:
            version, status, headers = answer.head()
            for _ in range(_MAX_INTERIM_ANSWERS):
                if not 100 <= status < 200 or status == 101:
                    break
                version, status, headers = answer.head()  # e.g. 100 Continue: the answer follows
        except ConnectionResetError:
            if answer.received_any:
                raise
            raise _ClosedBeforeAnswer from None
        if 100 <= status < 200:
            raise PostFailed(f"HTTP {status}: no final answer")
        keep = headers.get("connection", "").lower()
        reusable = "close" not in keep and (version != b"HTTP/1.0" or "keep-alive" in keep)
        if status in (204, 304):
            body = b""
        elif "transfer-encoding" in headers:
            if headers["transfer-encoding"].lower().rsplit(",", 1)[-1].strip() == "chunked":
                body = answer.chunked(status)
            else:
                body, reusable = answer.to_close(status), False
        elif "content-length" in headers:
            length = headers["content-length"].strip()
            if not length.isdigit():
                raise PostFailed(f"malformed Content-Length {length[:40]!r}")
            if int(length) > self.max_response_bytes:
                raise _too_large(status, self.max_response_bytes)
            body = answer.exactly(int(length))
        else:
            body, reusable = answer.to_close(status), False
        if not reusable or answer.pending:  # bytes past the answer: the connection's state is unknown
            self.close()
        return PostResponse(status=status, body=body, headers=headers)
