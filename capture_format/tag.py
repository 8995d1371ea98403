"""The capture tag: what a client puts in a request's `sampling_params.custom_params` to have it captured.

```json
{"custom_params": {"eagle_tap": {"record_id": "run7:s42", "sample_id": "s42",
                                 "spans": [[12, 30], [41, 55]], "meta": {"source": "demo"}}}}
```

The SGLang plugin captures a request if and only if this key is present, and refuses (counts, never
raises into the server) a tag whose fields break the record rules. Spans are half-open token ranges of
the loss mask (assistant tokens) over the full sequence sent as `input_ids`; the plugin checks them
against the real sequence length when the record is complete.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from capture_format.errors import InvalidRecordError
from capture_format.records import MAX_TOKENS, check_loss_spans, check_metadata, check_record_id, check_sample_id

TAG_KEY = "eagle_tap"


class InvalidTagError(InvalidRecordError):
    """A capture tag that is not shaped as documented in `capture_format.tag`."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CaptureTag:
    """The capture request's identity and loss mask, carried in `custom_params[TAG_KEY]`."""

    record_id: str
    """Unique id of the record this request produces; the collector de-duplicates by it."""
    sample_id: str
    """Id of the dataset sample the sequence came from (several records may share it)."""
    loss_spans: tuple[tuple[int, int], ...]
    """Half-open [start, end) token ranges that are trained on (assistant tokens)."""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Free JSON metadata stored with the record."""

    def __post_init__(self) -> None:
        check_record_id(self.record_id)
        check_sample_id(self.sample_id)
        # Bounded by the longest record here; the plugin checks them against the real length at emit time.
        object.__setattr__(self, "loss_spans", check_loss_spans(self.loss_spans, MAX_TOKENS))
        object.__setattr__(self, "metadata", check_metadata(self.metadata))

    def to_custom_params(self) -> dict[str, Any]:
        """The `custom_params` dict to send with the request."""
        return {TAG_KEY: {
            "record_id": self.record_id,
            "sample_id": self.sample_id,
            "spans": [list(span) for span in self.loss_spans],
            "meta": self.metadata,
        }}

    @classmethod
    def from_custom_params(cls, custom_params: object) -> "CaptureTag | None":
        """The tag in a request's `custom_params`, None when the request is not tagged."""
        if not isinstance(custom_params, Mapping) or TAG_KEY not in custom_params:
            return None
        body = custom_params[TAG_KEY]
        if not isinstance(body, Mapping):
            raise InvalidTagError(f"custom_params[{TAG_KEY!r}] must be an object, got {type(body).__name__}")
        unknown = sorted(set(body) - {"record_id", "sample_id", "spans", "meta"})
        if unknown:
            raise InvalidTagError(f"unknown capture tag fields {unknown}; accepted: record_id, sample_id, spans, meta")
        try:
            return cls(
                record_id=body["record_id"],
                sample_id=body.get("sample_id", body["record_id"]),
                loss_spans=body.get("spans", ()),
                metadata=body.get("meta") or {},
            )
        except KeyError as missing:
            raise InvalidTagError(f"capture tag is missing {missing}") from None

