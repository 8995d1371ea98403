"""Connection-level limits uvicorn does not set by default, for the collector's HTTP server.

What must hold: a connection that has not sent complete request headers within header_timeout_s is
closed (uvicorn's h11 protocol arms no timer before the first request, so a client that opens
connections and never finishes a header would hold them forever and exhaust the file limit); a
header block over max_header_bytes is refused by h11 before it is parsed further (a multi-MiB header
would otherwise be parsed on the event loop); at most max_connections connections and requests are
served at once (uvicorn answers 503 beyond it). The body has its own limit (receive_timeout_s).
"""

from __future__ import annotations

import asyncio
import resource
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from collector_service.settings import CollectorSettings

__all__ = ["server_limits"]

_FILE_DESCRIPTORS_KEPT = 64
"""File descriptors left for shards, indexes and logs when the connection limit follows RLIMIT_NOFILE."""


def _protocol_with_header_timeout(header_timeout_s: float) -> type[H11Protocol]:
    class HeaderTimeoutProtocol(H11Protocol):
        """H11Protocol that closes a connection whose request headers do not arrive in time."""

        _header_timer: asyncio.TimerHandle | None = None

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._close_if_still_waiting)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _close_if_still_waiting(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()  # a kept-alive connection gets the same time for its next headers

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


def server_limits(settings: CollectorSettings) -> dict[str, Any]:
    """uvicorn.Config keyword arguments for the limits above."""
    max_connections = settings.max_connections
    soft_limit, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft_limit != resource.RLIM_INFINITY:
        max_connections = max(1, min(max_connections, soft_limit - _FILE_DESCRIPTORS_KEPT))
    return {
        "http": _protocol_with_header_timeout(settings.header_timeout_s),
        "h11_max_incomplete_event_size": settings.max_header_bytes,
        "limit_concurrency": max_connections,
    }
