"""Confirmation: a served record counts only once the collector's GET /v1/records/{id} says it is stored.

The plugin ships records asynchronously (and spools them while the collector is down), so served
records are polled until stored or until their deadline. What must hold:
- a record is marked `confirmed` only on the collector's word, and then never sent again;
- a record still missing at its deadline stays `served` with the reason noted: it is reported in the
  summary, and a resumed run checks it again before deciding to re-send it;
- a failed check (collector unreachable) is not a verdict: the record is checked again next round.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

from client.endpoints import Endpoints, RequestFailed
from client.manifest import Manifest

__all__ = ["Confirmer"]


class Confirmer:
    """Polls the collector for served records; run `run()` as a task, end it with `finish()`."""

    def __init__(self, endpoints: Endpoints, manifest: Manifest, *, timeout_s: float, poll_interval_s: float = 0.5,
                 max_concurrent_checks: int = 16) -> None:
        self._endpoints = endpoints
        self._manifest = manifest
        self.timeout_s = timeout_s
        self.poll_interval_s = poll_interval_s
        self._checks = asyncio.Semaphore(max_concurrent_checks)
        self._deadlines: dict[str, float] = {}  # record id -> monotonic deadline
        self._finishing = False
        self.num_confirmed = 0
        self.num_unconfirmed = 0

    def add(self, record_id: str) -> None:
        self._deadlines[record_id] = time.monotonic() + self.timeout_s

    @property
    def num_pending(self) -> int:
        return len(self._deadlines)

    async def _stored(self, record_id: str) -> bool | str:
        """True/False, or the reason the check itself failed."""
        async with self._checks:
            try:
                return await self._endpoints.is_stored(record_id)
            except RequestFailed as err:
                return err.reason

    async def check_once(self, record_ids: Iterable[str]) -> set[str]:
        """Checks each record once; marks and returns those stored."""
        record_ids = list(record_ids)
        answers = await asyncio.gather(*(self._stored(record_id) for record_id in record_ids))
        stored = {record_id for record_id, answer in zip(record_ids, answers) if answer is True}
        if stored:
            self._manifest.mark_confirmed(stored)
            self.num_confirmed += len(stored)
        return stored

    async def _round(self) -> None:
        record_ids = list(self._deadlines)
        answers = await asyncio.gather(*(self._stored(record_id) for record_id in record_ids))
        now = time.monotonic()
        stored = []
        for record_id, answer in zip(record_ids, answers):
            if answer is True:
                stored.append(record_id)
                del self._deadlines[record_id]
            elif now >= self._deadlines[record_id]:
                detail = answer if isinstance(answer, str) else "the collector does not have it"
                self._manifest.mark_unconfirmed(
                    record_id, f"unconfirmed: not stored within {self.timeout_s:.0f} s ({detail})")
                self.num_unconfirmed += 1
                del self._deadlines[record_id]
        if stored:
            self._manifest.mark_confirmed(stored)
            self.num_confirmed += len(stored)

    async def run(self) -> None:
        """Polls until `finish()` was called and nothing is pending."""
        while True:
            if self._deadlines:
                await self._round()
            if self._finishing and not self._deadlines:
                return
            await asyncio.sleep(self.poll_interval_s)

    def finish(self) -> None:
        """Lets `run()` return once every pending record is confirmed or past its deadline."""
        self._finishing = True
