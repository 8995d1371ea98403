"""The HTTP calls of a run, on one `httpx.AsyncClient` with explicit limits, timeouts and retries.

What must hold:
- connection errors, timeouts, 429 and 5xx are retried with exponential backoff and jitter, up to
  `max_attempts`; any other 4xx is not retried (the request itself is wrong);
- a call that gives up raises `RequestFailed` whose `reason` reads `kind: detail`, with kind one of
  `connection`, `http_5xx`, `http_4xx`, `bad_response` (the manifest groups failures by kind);
- re-sending a capture request is safe: the collector stores a record id once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

import httpx

__all__ = ["Endpoints", "HttpConfig", "RequestFailed", "check_url"]

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


class RequestFailed(Exception):
    """A call that failed for good; `reason` is `kind: detail`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass(kw_only=True, slots=True)
class HttpConfig:
    """Limits, timeouts and retries of the run's HTTP client."""

    max_connections: int = 64
    """Connections the client may open in total (server and collector)."""
    connect_timeout_s: float = 10.0
    """Time to open a connection."""
    request_timeout_s: float = 600.0
    """Time to wait for a response (a long generation may take minutes)."""
    max_attempts: int = 5
    """Tries of one call before it fails (1 = no retry)."""
    backoff_base_s: float = 0.5
    """First backoff; doubled each retry, with +-50% jitter."""
    backoff_max_s: float = 30.0
    """Longest backoff."""


def check_url(flag: str, url: str) -> None:
    """ValueError unless url is an absolute http(s) URL with a host (e.g. `127.0.0.1:30000` is not)."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as err:
        raise ValueError(f"{flag} {url!r} is not a URL ({err}); e.g. http://127.0.0.1:30000") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{flag} {url!r} is not an http(s) URL with a host; e.g. http://127.0.0.1:30000")


def _http_reason(response: httpx.Response) -> str:
    kind = "http_5xx" if response.status_code >= 500 else "http_4xx"
    return f"{kind}: HTTP {response.status_code} {response.request.url.path}: {response.text[:300]}"


class Endpoints:
    """The SGLang server's /generate and the collector's /v1/records/{id}, with retries."""

    def __init__(self, server_url: str, collector_url: str, config: HttpConfig, *, collector_token: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.server_url = server_url.rstrip("/")
        self.collector_url = collector_url.rstrip("/")
        self.config = config
        self._collector_headers = {"Authorization": f"Bearer {collector_token}"} if collector_token else {}
        self.client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=config.max_connections,
                                max_keepalive_connections=config.max_connections),
            timeout=httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s),
            transport=transport,
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    def _backoff_s(self, attempt: int) -> float:
        delay = min(self.config.backoff_max_s, self.config.backoff_base_s * 2 ** attempt)
        return delay * random.uniform(0.5, 1.5)

    async def _call(self, method: str, url: str, *, accept_404: bool = False, **kwargs: Any) -> httpx.Response:
        reason = "connection: no attempt made"
        for attempt in range(self.config.max_attempts):
            if attempt:
                await asyncio.sleep(self._backoff_s(attempt - 1))
            try:
                response = await self.client.request(method, url, **kwargs)
            except httpx.TransportError as err:  # connect errors, timeouts, broken connections
                reason = f"connection: {type(err).__name__} {url}: {err}"
                continue
            if response.is_success or (accept_404 and response.status_code == 404):
                return response
            reason = _http_reason(response)
            if response.status_code not in RETRY_STATUS:
                break
        raise RequestFailed(reason)

    async def check_reachable(self) -> None:
        """One try each at the server's /get_model_info and the collector's /healthz, before anything is sent;
        ValueError names the one that does not answer (a down server would otherwise fail every sample)."""
        checks = (("the SGLang server", "--server", f"{self.server_url}/get_model_info", {}),
                  ("the collector", "--collector", f"{self.collector_url}/healthz", {}))
        for what, flag, url, headers in checks:
            try:
                response = await self.client.get(url, headers=headers, timeout=self.config.connect_timeout_s)
            except httpx.TransportError as err:
                raise ValueError(f"{what} at {url} does not answer ({type(err).__name__}: {err or 'no detail'}): "
                                 f"start it or fix {flag}") from None
            if not response.is_success:
                raise ValueError(f"{what} at {url} answered HTTP {response.status_code}: {response.text[:200]}")

    async def generate(self, payload: dict[str, Any]) -> dict[str, Any]:
        """POST /generate; the parsed answer, which always has `output_ids` and `meta_info`."""
        response = await self._call("POST", f"{self.server_url}/generate", json=payload)
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or "output_ids" not in body or "meta_info" not in body:
            raise RequestFailed(f"bad_response: /generate answered {response.text[:300]!r}")
        return body

    async def model_info(self) -> dict[str, Any]:
        """GET /get_model_info (model and tokenizer paths as the server sees them)."""
        return (await self._call("GET", f"{self.server_url}/get_model_info")).json()

    async def is_stored(self, record_id: str) -> bool:
        """True when the collector's GET /v1/records/{id} says the record is stored (404: not yet)."""
        response = await self._call("GET", f"{self.collector_url}/v1/records/{record_id}", accept_404=True,
                                    headers=self._collector_headers)
        return response.status_code == 200 and bool(response.json().get("stored"))
