"""The capture tag: what a client puts in a request's `sampling_params.custom_params` to have it captured.

```json
{"custom_params": {"eagle_tap": {"record_id": "run7:s42", "sample_id": "s42",
                                 "spans": [[12, 30], [41, 55]], "meta": {"source": "demo"}}}}
```

The SGLang plugin captures a tagged request, and refuses (counts, never raises into the server) a tag
whose fields break the record rules. Spans are half-open token ranges of the loss mask (assistant
tokens) over the full sequence sent as `input_ids`; the plugin checks them against the real sequence
length when the record is complete.

`"mode"` says which forward passes the record is made of:
- `"prefill"` (the default): the prompt's rows only; the record is the prompt, emitted when its
  prefill ends (the answer, if any was generated, is not part of it);
- `"generate"`: the prompt's rows and one row per decode step, emitted when the request finishes.
  The record is prompt + generated tokens; the generated tokens are added to the loss spans, and the
  last one has no state (no forward ran on it: `records.py`).

A request (tagged or not) opts out of live sampling (`EAGLE_TAP_LIVE_SAMPLE_RATE`) with
`{"custom_params": {"eagle_tap": {"opt_out": true}}}`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from capture_format.errors import InvalidRecordError
from capture_format.prefix_blocks import BLOCK_RECORD_PREFIX
from capture_format.records import MAX_TOKENS, check_loss_spans, check_metadata, check_record_id, check_sample_id

TAG_KEY = "eagle_tap"
CAPTURE_MODES = ("prefill", "generate")
_FIELDS = frozenset({"record_id", "sample_id", "spans", "meta", "mode"})


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
    mode: str = "prefill"
    """"prefill": the prompt's rows, emitted after its prefill; "generate": prompt and decode rows, emitted
    when the request finishes, with the generated tokens added to the loss spans."""

    def __post_init__(self) -> None:
        if self.mode not in CAPTURE_MODES:
            raise InvalidTagError(f"capture mode must be one of {', '.join(CAPTURE_MODES)}; got {self.mode!r}")
        check_record_id(self.record_id)
        if self.record_id.startswith(BLOCK_RECORD_PREFIX):
            raise InvalidTagError(f"record_id {self.record_id!r}: ids starting with {BLOCK_RECORD_PREFIX!r} name "
                                  "shared-prefix blocks; choose another id")
        check_sample_id(self.sample_id)
        # Bounded by the longest record here; the plugin checks them against the real length at emit time.
        object.__setattr__(self, "loss_spans", check_loss_spans(self.loss_spans, MAX_TOKENS))
        object.__setattr__(self, "metadata", check_metadata(self.metadata))

    def to_custom_params(self) -> dict[str, Any]:
        """The `custom_params` dict to send with the request."""
        body = {
            "record_id": self.record_id,
            "sample_id": self.sample_id,
            "spans": [list(span) for span in self.loss_spans],
            "meta": self.metadata,
        }
        if self.mode != "prefill":
            body["mode"] = self.mode
        return {TAG_KEY: body}

    @classmethod
    def from_custom_params(cls, custom_params: object) -> "CaptureTag | None":
        """The tag in a request's `custom_params`, None when the request is not tagged."""
        if not isinstance(custom_params, Mapping) or TAG_KEY not in custom_params:
            return None
        body = custom_params[TAG_KEY]
        if not isinstance(body, Mapping):
            raise InvalidTagError(f"custom_params[{TAG_KEY!r}] must be an object, got {type(body).__name__}")
        if set(body) == {"opt_out"}:
            return None  # not a capture request: only a live-sampling opt-out (see `opted_out`)
        unknown = sorted(set(body) - _FIELDS)
        if unknown:
            raise InvalidTagError(f"unknown capture tag fields {unknown}; accepted: {', '.join(sorted(_FIELDS))}"
                                  " (or opt_out alone)")
        try:
            return cls(
                record_id=body["record_id"],
                sample_id=body.get("sample_id", body["record_id"]),
                loss_spans=body.get("spans", ()),
                metadata=body.get("meta") or {},
                mode=body.get("mode", "prefill"),
            )
        except KeyError as missing:
            raise InvalidTagError(f"capture tag is missing {missing}") from None



def opted_out(custom_params: object) -> bool:
    """True when a request's `custom_params` ask never to be captured by live sampling."""
    if not isinstance(custom_params, Mapping):
        return False
    body = custom_params.get(TAG_KEY)
    return isinstance(body, Mapping) and body.get("opt_out") is True
