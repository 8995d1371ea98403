"""`QuietServer`: uvicorn's server without housekeeping wake-ups while it is idle.

Why: uvicorn's `Server.main_loop` wakes every 0.1 s (a tick refreshes the Date header once a second and
checks whether to exit). Each wake-up costs the event loop's thread CPU whatever it finds: 0.1-0.2 ms on
an earlier machine, 0.3-1.2 ms on a later one (where an idle collector ticking once a second spent 1.3-2.2 ms
of CPU a second), on the cores the capturing servers share. A collector beside a replica sampling a little of
its traffic is idle most of the time, and should cost nothing then. So nothing ticks:
- the Date header is put on each response as it starts (`DatedResponses`; formatted at most once a second),
  instead of being refreshed by the tick (uvicorn's own is turned off);
- setting `should_exit` (uvicorn's signal handler does, for SIGINT and SIGTERM; so may a caller on any
  thread) wakes the loop at once;
- only where something must be looked at periodically (`limit_max_requests`, `callback_notify`) does the
  loop tick, every TICK_S.

What must hold: every response the app sends carries a current Date header (uvicorn's own error answers,
such as a 503 past `limit_concurrency`, carry none: RFC 9110 makes it optional on 5xx); a stop asked for any
way is acted on at once.
"""

from __future__ import annotations

import asyncio
import time
from email.utils import formatdate
from typing import Any

import uvicorn

__all__ = ["TICK_S", "DatedResponses", "QuietServer"]

TICK_S = 1.0
"""Seconds between two ticks where the server must tick (uvicorn: 0.1)."""


class DatedResponses:
    """ASGI middleware: a Date header (RFC 9110) on every HTTP response the app starts; other scopes pass as
    they are."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._second = -1
        self._date = b""

    def _now(self) -> bytes:
        second = int(time.time())
        if second != self._second:
            self._second, self._date = second, formatdate(second, usegmt=True).encode()
        return self._date

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def dated(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [(b"date", self._now()), *message.get("headers", ())]}
            await send(message)

        return await self.app(scope, receive, dated)


class QuietServer(uvicorn.Server):
    """uvicorn.Server that sleeps while idle; see the module docstring."""

    _loop: asyncio.AbstractEventLoop | None = None
    _woken: asyncio.Event | None = None
    _should_exit = False

    @property
    def should_exit(self) -> bool:  # type: ignore[override]
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        # From uvicorn's signal handler too, which runs on the loop's (main) thread between two bytecodes,
        # possibly inside the loop's own code: call_soon_threadsafe only appends to a deque and writes to the
        # loop's wake-up pipe.
        if value and self._loop is not None and self._woken is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._woken.set)

    async def startup(self, sockets: list | None = None) -> None:
        if self.config.date_header:
            self.config.loaded_app = DatedResponses(self.config.loaded_app)
            self.config.date_header = False  # the tick no longer refreshes one
        await super().startup(sockets=sockets)

    async def main_loop(self) -> None:
        self._loop, self._woken = asyncio.get_running_loop(), asyncio.Event()
        must_tick = self.limit_max_requests is not None or self.config.callback_notify is not None
        should_exit = await self.on_tick(0)
        while not should_exit:
            try:
                await asyncio.wait_for(self._woken.wait(), TICK_S if must_tick else None)
            except TimeoutError:
                pass
            should_exit = await self.on_tick(0)
