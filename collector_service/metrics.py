"""Prometheus metrics of one app, in a registry of its own (tests build many apps per process).

Gauges and counters are read from the store's stats when scraped, so /metrics and /v1/stats never
disagree; the group-commit histograms are observed by the writer thread (prometheus_client is
thread-safe).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["CollectorMetrics", "router"]

_PREFIX = "eagle_tap_collector"
_GAUGES = (
    ("num_records", "records", "Records stored in the data directory."),
    ("num_tokens", "tokens", "Tokens in the stored records."),
    ("raw_nbytes", "raw_bytes", "Tensor bytes of the stored records before compression."),
    ("stored_nbytes", "stored_bytes", "Tensor bytes of the stored records as stored."),
    ("frame_nbytes", "shard_bytes", "Bytes of frames in shards (payloads, prefixes and headers)."),
    ("num_sealed_shards", "sealed_shards", "Sealed shards in the data directory."),
    ("num_in_flight", "in_flight_records", "Records received and waiting for their group commit."),
)
_COUNTERS = (
    ("num_ingested", "ingested_records", "Records stored by this process."),
    ("num_ingested_nbytes", "ingested_bytes", "Frame bytes stored by this process."),
    ("num_duplicates", "duplicates", "POSTs of an already stored record id (acknowledged, not written)."),
    ("num_group_commits", "group_commits", "Group commits (one sync each when durability is fsync)."),
)


class _StatsCollector:
    def __init__(self, read_stats: Callable[[], dict[str, Any] | None]) -> None:
        self._read_stats = read_stats

    def describe(self) -> list[Metric]:
        return []  # families depend on the stats; describe nothing rather than scrape early

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats()
        if stats is None:
            return
        for key, name, help_text in _GAUGES:
            yield GaugeMetricFamily(f"{_PREFIX}_{name}", help_text, value=stats[key])
        for key, name, help_text in _COUNTERS:
            yield CounterMetricFamily(f"{_PREFIX}_{name}", help_text, value=stats[key])
        rejects = CounterMetricFamily(f"{_PREFIX}_rejects", "Refused requests by reason code.", labels=["reason"])
        for reason, count in stats["rejects"].items():
            rejects.add_metric([reason], count)
        yield rejects
        yield GaugeMetricFamily(f"{_PREFIX}_up", "1 while the writer can write, 0 after a storage failure.",
                                value=0 if stats["failed_reason"] else 1)
        parts = stats["parts"]
        yield GaugeMetricFamily(f"{_PREFIX}_part_captures_open",
                                "Captures sent in parts whose record has not closed them yet.", value=parts["open_captures"])
        for key, name, help_text in (
                ("parts_staged", "parts_kept", "Parts of captures kept until their record comes."),
                ("captures_closed", "part_captures_closed", "Captures sent in parts stored whole."),
                ("captures_expired", "part_captures_expired", "Captures whose parts were removed, never closed."),
                ("records_refused_parts_expired", "part_records_refused_expired",
                 "Records refused because their parts expired while their plugin was still sending.")):
            yield CounterMetricFamily(f"{_PREFIX}_{name}", help_text, value=parts[key])
        upload = stats.get("upload")
        if upload is not None:  # only with upload_to
            yield GaugeMetricFamily(f"{_PREFIX}_upload_pending_shards",
                                    "Sealed shards waiting here for their upload (grows while the bucket fails).",
                                    value=upload["num_pending"])
            yield CounterMetricFamily(f"{_PREFIX}_uploaded_shards", "Shards uploaded, checked and removed here.",
                                      value=upload["num_uploaded"])
            yield CounterMetricFamily(f"{_PREFIX}_uploaded_bytes", "Bytes of the shards uploaded by this process.",
                                      value=upload["num_uploaded_nbytes"])
            yield CounterMetricFamily(f"{_PREFIX}_upload_failures", "Upload attempts that failed (each is retried).",
                                      value=upload["num_failed_attempts"])


class CollectorMetrics:
    """The registry of one app: stats read at scrape time plus group-commit histograms."""

    def __init__(self, read_stats: Callable[[], dict[str, Any] | None]) -> None:
        self.registry = CollectorRegistry()
        self._commit_seconds = Histogram(
            f"{_PREFIX}_group_commit_seconds", "Time of one group commit's sync.", registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        self._commit_records = Histogram(
            f"{_PREFIX}_group_commit_records", "Records made durable by one group commit.", registry=self.registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        )
        self.registry.register(_StatsCollector(read_stats))

    def observe_commit(self, num_records: int, seconds: float) -> None:
        self._commit_records.observe(num_records)
        self._commit_seconds.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    """Prometheus text exposition of this app's registry."""
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
