"""Ordinary serving traffic sent while the demo captures, to show that serving goes on.

`ServingTraffic` runs a few threads that each send OpenAI-style chat requests to the server's
`/v1/chat/completions`, one after another, until `stop()`. They carry no capture tag, so the plugin
must leave them alone; every answer, failure and latency is counted. `stop()` returns the counts.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import httpx

__all__ = ["ServingTraffic"]


class ServingTraffic:
    """Untagged chat requests in `concurrency` threads, from `start()` until `stop()`."""

    def __init__(self, server_url: str, questions: list[str], *, concurrency: int = 2, max_tokens: int = 32,
                 timeout_s: float = 60.0, temperature: float = 0.0, pause_s: float = 0.0) -> None:
        if not questions:
            raise ValueError("serving traffic needs at least one question")
        self._url = f"{server_url}/v1/chat/completions"
        self._questions = questions
        self._max_tokens = max_tokens
        self._temperature = temperature
        self._pause_s = pause_s
        self._timeout_s = timeout_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._latencies_s: list[float] = []
        self._num_completion_tokens = 0
        self._failures: dict[str, int] = {}
        self._threads = [threading.Thread(target=self._loop, args=(number,), name=f"demo-traffic-{number}", daemon=True)
                         for number in range(concurrency)]
        self._started_s = 0.0
        self._wall_s = 0.0

    def start(self) -> ServingTraffic:
        self._started_s = time.monotonic()
        for thread in self._threads:
            thread.start()
        return self

    def _loop(self, number: int) -> None:
        with httpx.Client(timeout=self._timeout_s) as client:
            index = number
            while not self._stop.is_set():
                question = self._questions[index % len(self._questions)]
                index += len(self._threads)
                payload = {"model": "default", "messages": [{"role": "user", "content": question}],
                           "max_tokens": self._max_tokens, "temperature": self._temperature}
                started_s = time.monotonic()
                try:
                    response = client.post(self._url, json=payload)
                    response.raise_for_status()
                    body = response.json()
                    if not body["choices"][0]["message"]["content"] and not body["usage"]["completion_tokens"]:
                        raise ValueError("empty answer")
                except (httpx.HTTPError, ValueError, KeyError, IndexError) as error:
                    self._count_failure(f"{type(error).__name__}: {str(error)[:120]}")
                    self._stop.wait(0.5)  # do not spin against a server that is not answering
                    continue
                with self._lock:
                    self._latencies_s.append(time.monotonic() - started_s)
                    self._num_completion_tokens += int(body["usage"]["completion_tokens"])
                if self._pause_s:
                    self._stop.wait(self._pause_s)  # a client's think time between requests

    def _count_failure(self, reason: str) -> None:
        with self._lock:
            self._failures[reason] = self._failures.get(reason, 0) + 1

    def stop(self) -> dict[str, Any]:
        """Stops sending (waits for the requests in flight) and returns what was answered and failed."""
        self._stop.set()
        for thread in self._threads:
            if thread.ident is not None:  # started
                thread.join(timeout=self._timeout_s + 5)
        self._wall_s = time.monotonic() - self._started_s
        return self.result()

    def result(self) -> dict[str, Any]:
        with self._lock:
            latencies_ms = sorted(1000 * value for value in self._latencies_s)
            failures = dict(self._failures)
            num_tokens = self._num_completion_tokens
        percentiles: dict[str, float | None] = {"p50": None, "p95": None, "max": None}
        if latencies_ms:
            p95 = (statistics.quantiles(latencies_ms, n=20, method="inclusive")[18] if len(latencies_ms) > 1
                   else latencies_ms[0])  # quantiles needs two points
            percentiles = {"p50": round(statistics.median(latencies_ms), 1), "p95": round(p95, 1),
                           "max": round(latencies_ms[-1], 1)}
        return {"num_answered": len(latencies_ms), "num_failed": sum(failures.values()), "failures": failures,
                "num_completion_tokens": num_tokens, "latency_ms": percentiles, "wall_s": round(self._wall_s, 1),
                "concurrency": len(self._threads)}
