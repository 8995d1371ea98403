"""`QuietServer`: uvicorn's server, its housekeeping woken once a second instead of ten times.

Why: uvicorn's `Server.main_loop` sleeps 0.1 s between ticks (a tick refreshes the Date header once a
second and checks whether to exit). Each wake-up costs the event loop's thread CPU whatever it finds:
an idle collector spent about 1.3 ms of CPU a second on them here (0.2 ms with one wake a second), on the
cores the capturing servers share. A collector beside a replica sampling 10% of its traffic is idle most
of the time, and that CPU was most of what it spent per captured token.

What must hold: the Date header is refreshed at every tick (once a second, as before); a signal that
stops the server (SIGINT, SIGTERM, through uvicorn's own handler) wakes the loop at once, so shutting
down is not delayed by the longer sleep; `should_exit` set any other way is seen within a second.
"""

from __future__ import annotations

import asyncio
from types import FrameType

import uvicorn

__all__ = ["TICK_S", "QuietServer"]

TICK_S = 1.0
"""Seconds between two ticks of the idle server (uvicorn: 0.1)."""


class QuietServer(uvicorn.Server):
    """uvicorn.Server ticking every TICK_S; see the module docstring."""

    _loop: asyncio.AbstractEventLoop | None = None
    _woken: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._loop, self._woken = asyncio.get_running_loop(), asyncio.Event()
        should_exit = await self.on_tick(0)
        while not should_exit:
            try:
                await asyncio.wait_for(self._woken.wait(), TICK_S)
            except TimeoutError:
                pass
            # uvicorn refreshes the Date header at a tick whose counter is a multiple of 10: every tick here.
            should_exit = await self.on_tick(0)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        # A signal handler runs on the loop's (main) thread between two bytecodes, possibly inside the loop's
        # own code: call_soon_threadsafe only appends to a deque and writes to the loop's wake-up pipe.
        if self._loop is not None and self._woken is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._woken.set)
