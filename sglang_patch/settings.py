"""The plugin's settings, read from `EAGLE_TAP_*` environment variables (pydantic-settings).

Capture is enabled exactly when `EAGLE_TAP_COLLECTOR_URL` is set. A bad value never raises into
SGLang: `load_settings()` logs what is wrong and returns None, and the plugin stays dormant.
"""

from __future__ import annotations

import logging
from pathlib import Path
from urllib.parse import urlparse

from pydantic import AliasChoices, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from typing import Annotated

from capture_format import get_codec

logger = logging.getLogger("eagle_tap.plugin")
MIN_PREFIX_BLOCK_TOKENS = 16


class CaptureSettings(BaseSettings):
    """Everything the capture plugin can be told; every field has an `EAGLE_TAP_<NAME>` variable."""

    # hide_input_in_errors: an invalid setting is logged, and the input of a setting may be the token.
    model_config = SettingsConfigDict(env_prefix="EAGLE_TAP_", extra="ignore", populate_by_name=True,
                                      hide_input_in_errors=True)

    collector_url: str | None = None
    """Base URL of the collector (e.g. http://127.0.0.1:8700); capture is off while unset."""
    token: SecretStr | None = Field(default=None,
                                    validation_alias=AliasChoices("EAGLE_TAP_COLLECTOR_TOKEN", "EAGLE_TAP_TOKEN"))
    """Bearer token the collector expects, if it has one: the collector's own variable (the older name too).
    Printable ASCII without spaces (it goes in a header line)."""
    capture_layers: Annotated[list[int] | None, NoDecode] = None
    """Decoder layers whose input is captured, e.g. `3,31,59`; default `[3, L//2 + 1, L - 2]`."""
    codec: str | None = None
    """Codec of the aux and final states in each frame: raw, zstd:N, bf16-split, bf16-channel, or a lossy one
    (int8-row, e4m3-row, int8-channel: see docs/benchmarks.md for what each costs); unset picks
    bf16-split for bf16 serving, zstd:1 for fp16 and fp32."""
    spool_dir: Path = Field(default=Path("~/.local/state/eagle-tap/spool"), validate_default=True)
    """Where frames wait while the collector is unreachable; re-sent in order when it is back. Must be
    private to the server's user (0700, checked at start): never a shared directory such as /tmp itself."""
    spool_max_bytes: int = Field(default=8 << 30, ge=0)
    """Bound of the spool; frames that would exceed it are dropped and counted."""
    inflight_max_bytes: int = Field(default=512 << 20, ge=1)
    """Bound of copied-but-not-yet-sent raw bytes held in memory (on CPU with the forward outputs a record's
    unjoined rows keep alive by reference: `CapturedSequence.inflight_nbytes`); past it records are dropped and
    counted.
    A capture larger than a part is sent in parts as it is computed, so no record is too large for it."""
    part_max_tokens: int = Field(default=8192, ge=1)
    """A capture holding more rows than a part is sent in parts of at most this many tokens' states as they
    are computed (`capture_format.parts`): the plugin holds one part per capture, whatever its length."""
    part_max_bytes: int = Field(default=64 << 20, ge=1)
    """...and of at most this many raw bytes (57,344 per token at Kimi-K2's width: 1,170 tokens); at most
    half of inflight_max_bytes is used, so a part always fits in flight."""
    sample_rate: float = Field(default=1.0, ge=0.0, le=1.0)
    """Fraction of tagged requests captured, chosen by a hash of the record id (deterministic)."""
    live_sample_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    """Fraction of untagged generate requests captured in one pass (prompt and answer), chosen by a hash of
    the request id; 0 turns live capture off. Stores the token ids of users' requests: see docs/capture.md."""
    prefix_block_tokens: int = Field(default=0, ge=0, le=1 << 16)
    """Shared prefixes stored once: captured prompts are cut into content-addressed blocks of this many
    tokens (at least 16; 64 suits system prompts), stored once and referred to by every record that
    starts with them, and a captured request keeps the radix cache's hits on its reused blocks. 0: every
    record holds all its rows and a captured request computes its whole prompt (its own cache namespace)."""
    partial_ttl_s: float = Field(default=600.0, gt=0)
    """A chunked capture whose next chunk has not come within this time is dropped (e.g. an abort)."""
    send_timeout_s: float = Field(default=30.0, gt=0)
    """Overall deadline of one POST to the collector, answer included, whatever the collector does."""
    batch_max_bytes: int = Field(default=32 << 20, ge=1)
    """Raw bytes of captures coalesced into one POST (a single larger capture goes alone)."""
    # A replica serving an EAGLE-3 draft finishes short records a few at a time: spec-capture at 100%, sender /
    # collector 15.1 / 15.3 us of CPU per captured token at 0.25 s, 11.9 / 11.4 at 1 s (23 us for the sender at
    # 50 ms). At an engine's rate a POST fills up (batch_max_bytes) long before; what the wait costs is that much
    # more time before a record is durable, and that much more of it lost if the server dies meanwhile.
    batch_max_age_s: float = Field(default=1.0, ge=0)
    """How long the sender waits for more captures to fill a POST, from the oldest one queued (a POST costs the
    sender about 1 ms of CPU and the collector 1.5, whatever it carries)."""
    sender_nice: int = Field(default=10, ge=0, le=19)
    """How much lower the sender's threads' and the copy thread's CPU priority is than the server's (Linux nice,
    per thread), so copying, compressing and sending yield the CPU to serving when cores are short; 0 leaves it
    as it is."""
    sender_threads: int = Field(default=0, ge=0, le=64)
    """Threads that compress and frame captures (zstd and numpy release the GIL), each at sender_nice; frames
    still leave in capture order. 0 sizes it from the width and the cores: enough for 10,000 captured tokens/s
    at about 200 MB/s of raw states a thread, at most a quarter of the cores (3 for Kimi-K2's width on 12+
    cores, 1 for a narrow model); 1 encodes on the sending thread itself."""
    host_buffer_bytes: int = Field(default=2 << 30, ge=1)
    """On CUDA: pinned host memory for device copies in flight; past it captures are dropped and counted."""
    stats_path: Path | None = None
    """JSON file the counters are written to about once a second while they change, in place; default
    `<spool_dir>/dp<rank>/stats.json`. A read that met a rewrite has `snapshot` != `snapshot_end` (or does not
    parse): read it again, as `sglang_patch.stats.read_stats_file` does. `"quiet": true`: the sender is idle and
    nothing changed since; the file is rewritten at the next change."""

    @field_validator("collector_url")
    @classmethod
    def _check_url(cls, url: str | None) -> str | None:
        if url is None or url == "":
            return None
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"must be an http(s) URL with a host, like http://127.0.0.1:8700; got {url!r}")
        return url.rstrip("/")

    @field_validator("token")
    @classmethod
    def _check_token(cls, token: SecretStr | None) -> SecretStr | None:
        value = token.get_secret_value() if token is not None else ""
        if not all(" " < character <= "~" for character in value):
            raise ValueError("must be printable ASCII without spaces: it is sent as 'Authorization: Bearer <token>'")
        return token

    @field_validator("prefix_block_tokens")
    @classmethod
    def _check_block_tokens(cls, tokens: int) -> int:
        if 0 < tokens < MIN_PREFIX_BLOCK_TOKENS:
            raise ValueError(f"must be 0 (off) or at least {MIN_PREFIX_BLOCK_TOKENS} tokens (a block is a record of "
                             f"its own; 64 suits system prompts); got {tokens}")
        return tokens

    @field_validator("spool_dir")
    @classmethod
    def _expand_home(cls, path: Path) -> Path:
        return path.expanduser()  # the default is per user (under ~), unlike a shared /tmp

    @field_validator("capture_layers", mode="before")
    @classmethod
    def _parse_layers(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip().strip("[]")
            if not text:
                return None
            try:
                return [int(part) for part in text.replace(",", " ").split()]
            except ValueError:
                raise ValueError(f"must be decoder-layer indices like '3,31,59'; got {value!r}") from None
        return value

    @field_validator("codec")
    @classmethod
    def _check_codec(cls, codec: str | None) -> str | None:
        if codec == "":
            return None
        if codec is not None:
            get_codec(codec)  # raises UnknownCodecError naming the available codecs
        return codec

    @property
    def enabled(self) -> bool:
        return self.collector_url is not None


def load_settings() -> CaptureSettings | None:
    """The settings from the environment, or None (with one error log line) when they are invalid."""
    try:
        return CaptureSettings()
    except (ValidationError, ValueError) as error:
        logger.error("eagle-tap capture disabled: invalid EAGLE_TAP_* settings: %s", error)
        return None
