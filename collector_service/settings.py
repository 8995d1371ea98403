"""Settings of the collector, read from arguments or `EAGLE_TAP_COLLECTOR_*` environment variables.

What must hold: every limit is checked when the settings are built (a bad value fails at start-up,
not on the first request), and the service refuses to listen beyond loopback without a token.
"""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from capture_format.object_store import parse_location
from capture_format.parts import SENDER_MAX_BACKOFF_S
from capture_format.shard_index import check_collector_id

__all__ = ["CollectorSettings", "DurabilityMode", "is_loopback_host"]

DurabilityMode = Literal["fsync", "none"]
log = logging.getLogger(__name__)


def is_loopback_host(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class CollectorSettings(BaseSettings):
    """Where shards go, who may write, and when shards are synced and sealed."""

    model_config = SettingsConfigDict(
        env_prefix="EAGLE_TAP_COLLECTOR_", extra="forbid", frozen=True, use_attribute_docstrings=True
    )

    data_dir: Path
    """Directory of the shards and their indexes; created if missing."""
    host: str = "127.0.0.1"
    """Address to listen on (the CLI's `collect` reads it; the app itself does not bind)."""
    port: int = Field(default=8470, ge=0, le=65535)
    """TCP port to listen on; 0 picks a free one (the CLI prints it)."""
    token: SecretStr | None = None
    """Bearer token required on /v1/*; None leaves /v1/* open (allowed on loopback only)."""
    durability: DurabilityMode = "fsync"
    """`fsync`: acknowledge after fdatasync (group commit); `none`: after the write (benchmarks only)."""
    max_body_bytes: int = Field(default=1 << 30, ge=64)
    """Largest frame accepted in one POST; larger bodies get 413 before they are read."""
    seal_after_bytes: int = Field(default=1 << 30, ge=1)
    """Seal the open shard once it holds at least this many bytes."""
    seal_after_s: float = Field(default=600.0, gt=0)
    """Seal the open shard this many seconds after its first record, even if it is small."""
    min_free_bytes: int = Field(default=1 << 30, ge=0)
    """Refuse ingest with 507 when a frame would leave less than this free on the data disk."""
    part_timeout_s: float = Field(default=1800.0, gt=0)
    """Parts of a capture sent in parts are removed (and counted) once none of its parts came for this long
    and its closing record has not: an aborted request, a killed server. Longer than the plugin's
    EAGLE_TAP_PARTIAL_TTL_S, so a slow generation is never cut, and well above the plugin's longest wait
    between re-sends (10 s; a warning below 20 s). After a restart it runs from the collector's start."""
    max_group_commit_bytes: int = Field(default=256 << 20, ge=1)
    """Bytes appended before one fdatasync covers them (bounds ack latency under heavy load)."""
    max_inflight_bytes: int = Field(default=4 << 30, ge=64)
    """Frames being received or waiting for their commit, at most; beyond it POSTs get 503 (retry later)."""
    max_expansion_ratio: float = Field(default=64.0, ge=1)
    """A record may decode to at most this many times its frame's bytes (413 above): a small POST that
    decodes to gigabytes of zeros is refused from its header, before anything is decoded."""
    max_concurrent_decodes: int = Field(default=2, ge=1)
    """Frames decoded at once while checking them (each decodes in a thread, off the event loop)."""
    receive_timeout_s: float = Field(default=300.0, gt=0)
    """Longest time to receive one body; a slower (or stalled) sender gets 408 and its buffer is freed."""
    header_timeout_s: float = Field(default=10.0, gt=0)
    """A connection that has not sent complete request headers this long after it opened (or after its
    last response) is closed."""
    max_header_bytes: int = Field(default=64 << 10, ge=1024)
    """Largest request line plus headers; beyond it the request is refused before it is parsed."""
    max_connections: int = Field(default=1024, ge=1)
    """Connections and requests served at once (503 beyond); lowered to fit the process's file limit."""
    buffer_pool_bytes: int = Field(default=256 << 20, ge=0)
    """Receive buffers kept for reuse (large fresh allocations dominate receive cost)."""
    malloc_retained_bytes: int = Field(default=512 << 20, ge=0)
    """Freed heap the serving process keeps mapped for reuse (glibc; 0 leaves malloc as it is).

    See malloc_tuning.py: recycling the HTTP stack's per-read buffers made receive 3-4x faster here."""
    seal_on_shutdown: bool = True
    """Seal the open shard on a clean shutdown (a crash leaves it to start-up recovery)."""
    upload_to: str | None = None
    """s3://bucket/prefix to upload sealed shards to; each is checked there, then removed here.

    Endpoint and credentials: EAGLE_TAP_S3_ENDPOINT_URL and the AWS_* variables (docs/settings.md)."""
    keep_local: bool = False
    """With upload_to: keep each shard in data_dir after its upload checked out."""
    collector_id: str | None = None
    """Id in this collector's object names (shard-<id>-NNNNNN.etap); unset: the one in data_dir/collector-id.

    Unique among the collectors of one prefix; a new data_dir without one gets a random id."""
    upload_retry_initial_s: float = Field(default=1.0, gt=0)
    """First wait before retrying a failed upload; it doubles per failure of that shard."""
    upload_retry_max_s: float = Field(default=300.0, gt=0)
    """Longest wait between retries of a failed upload (the shard stays local meanwhile)."""
    upload_drain_s: float = Field(default=30.0, ge=0)
    """On shutdown, go on uploading sealed shards this long; the rest is uploaded at the next start."""

    @field_validator("upload_to", "collector_id", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if value == "" else value  # `VAR=` in a compose file or an env file means "not set"

    @model_validator(mode="after")
    def _check_token_beyond_loopback(self) -> CollectorSettings:
        if self.token is None and not is_loopback_host(self.host):
            raise ValueError(
                f"host {self.host!r} is not loopback and no token is set: set --token or "
                "EAGLE_TAP_COLLECTOR_TOKEN, or listen on 127.0.0.1"
            )
        if self.max_inflight_bytes < self.max_body_bytes:
            raise ValueError(
                f"max_inflight_bytes={self.max_inflight_bytes} is below max_body_bytes={self.max_body_bytes}: "
                "no frame of the largest accepted size could ever be received"
            )
        if self.token is not None and not self.token.get_secret_value():
            raise ValueError("token is empty: give a non-empty token, or none (loopback only)")
        if self.upload_to is not None:
            parse_location(self.upload_to)
        if self.collector_id is not None:
            check_collector_id(self.collector_id)
        if self.part_timeout_s < 2 * SENDER_MAX_BACKOFF_S:
            log.warning("part_timeout_s=%g is below twice the plugin's longest wait between re-sends (%g s): "
                        "parts of a capture may expire while its plugin is still re-sending them",
                        self.part_timeout_s, SENDER_MAX_BACKOFF_S)
        return self
