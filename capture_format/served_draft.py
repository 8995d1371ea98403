"""The `served_draft` metadata of records captured on a replica that serves an EAGLE-3 draft: reading and pooling it.

The plugin writes it (`sglang_patch/speculative.py: served_draft_metadata`); `eagle-tap shards stats` and
`eagle-tap eval` read it through this module. In a record's metadata:

    "served_draft": {"draft": "06e9c25b75670e1631a4739f7222389b",  # digest of the draft's config and weights
                     "algorithm": "EAGLE3", "num_steps": 3, "topk": 1, "num_draft_tokens": 4,
                     "verify_steps": 6, "accepted_drafts": 2,
                     "accepted_at_position": [2, 0, 0],  # steps that accepted more than j drafts, j = 0..
                     "accepted_per_step": "001001"}      # one base-36 digit per verify step (absent when long)

A record without the key was captured without a draft; a prefill-only record has 0 verify steps.

Acceptance as SGLang counts it: a verify step emits its accepted drafts plus the target's own token, so
pooled over the steps of many records, acceptance length = (accepted drafts + verify steps) / verify steps,
and the acceptance of draft position j (1-based) = steps that accepted at least j drafts / verify steps
(with top-k 1: the share of steps whose j-th draft token was right).

What must hold: records pool only with records of the same draft served the same way (digest, algorithm,
steps, top-k), so one row never blends two settings; metadata that breaks the layout above raises
InvalidRecordError naming the field, never a KeyError or a wrong number.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from capture_format.errors import InvalidRecordError, describe

__all__ = ["METADATA_KEY", "STEP_DIGITS", "ServedDraft", "ServedDraftTally", "decode_steps", "pool_served_drafts",
           "tally_header", "tally_rows"]

METADATA_KEY = "served_draft"
"""Record metadata key of the serving draft's signal."""
STEP_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
"""`accepted_per_step` writes the accepted drafts of each verify step as one of these digits."""
DRAFT_LABEL_DIGITS = 12
"""Hex digits of the draft digest a printed row shows."""


def decode_steps(text: str) -> list[int]:
    """The accepted drafts of each verify step from `accepted_per_step` ("3102" -> [3, 1, 0, 2])."""
    if not isinstance(text, str):
        raise InvalidRecordError(f"served_draft accepted_per_step must be a string of base-36 digits; "
                                 f"got {describe(text)}")
    try:
        return [STEP_DIGITS.index(digit) for digit in text]
    except ValueError:
        bad = sorted(set(text) - set(STEP_DIGITS))
        raise InvalidRecordError(f"served_draft accepted_per_step holds {describe(''.join(bad))}; "
                                 f"its digits are {STEP_DIGITS}") from None


def _count(served: Mapping[str, Any], name: str) -> int:
    value = served.get(name)
    if type(value) is not int or value < 0:
        raise InvalidRecordError(f"served_draft {name} must be a non-negative int; got {describe(value)}")
    return value


def _setting(served: Mapping[str, Any], name: str) -> int | None:
    value = served.get(name)
    if value is not None and (type(value) is not int or value < 1):
        raise InvalidRecordError(f"served_draft {name} must be a positive int or null; got {describe(value)}")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class ServedDraft:
    """One record's `served_draft` metadata, checked."""

    draft: str
    """The draft's identity: hex digest of its config and the weights the server held."""
    algorithm: str
    num_steps: int | None
    """Draft steps per verify (`--speculative-num-steps`)."""
    topk: int | None
    """Branching of the draft tree (`--speculative-eagle-topk`); 1 is a chain."""
    verify_steps: int
    accepted_drafts: int
    """Draft tokens accepted over all verify steps."""
    accepted_at_position: tuple[int, ...]
    """[j]: verify steps that accepted more than j drafts."""
    accepted_per_step: tuple[int, ...] | None
    """Accepted drafts of each verify step, or None where the record lists none (a very long one)."""

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> ServedDraft | None:
        """The served draft of a record's metadata, or None for a record captured without a draft."""
        served = metadata.get(METADATA_KEY)
        if served is None:
            return None
        if not isinstance(served, Mapping):
            raise InvalidRecordError(f"metadata {METADATA_KEY!r} must be an object; got {describe(served)}")
        for name in ("draft", "algorithm"):
            if not isinstance(served.get(name), str) or not served[name]:
                raise InvalidRecordError(f"served_draft {name} must be a non-empty string; "
                                         f"got {describe(served.get(name))}")
        positions = served.get("accepted_at_position")
        if not isinstance(positions, list) or not all(type(count) is int and count >= 0 for count in positions):
            raise InvalidRecordError(f"served_draft accepted_at_position must be a list of non-negative ints; "
                                     f"got {describe(positions)}")
        per_step = served.get("accepted_per_step")
        result = cls(draft=served["draft"], algorithm=served["algorithm"], num_steps=_setting(served, "num_steps"),
                     topk=_setting(served, "topk"), verify_steps=_count(served, "verify_steps"),
                     accepted_drafts=_count(served, "accepted_drafts"), accepted_at_position=tuple(positions),
                     accepted_per_step=None if per_step is None else tuple(decode_steps(per_step)))
        result._check_counts()
        return result

    def _check_counts(self) -> None:
        # Steps that accepted more than j drafts never grow with j; summed over j they are the accepted drafts.
        counts = (self.verify_steps, *self.accepted_at_position)
        if any(later > earlier for earlier, later in zip(counts, counts[1:])) or \
                sum(self.accepted_at_position) != self.accepted_drafts:
            raise InvalidRecordError(f"served_draft of {self.verify_steps} verify steps and {self.accepted_drafts} "
                                     f"accepted drafts cannot have accepted_at_position "
                                     f"{list(self.accepted_at_position)}")
        steps = self.accepted_per_step
        if steps is not None and (len(steps) != self.verify_steps or sum(steps) != self.accepted_drafts):
            raise InvalidRecordError(f"served_draft accepted_per_step lists {len(steps)} steps accepting "
                                     f"{sum(steps)} drafts; the record says {self.verify_steps} and "
                                     f"{self.accepted_drafts}")

    @property
    def setting(self) -> tuple[str, str, int | None, int | None]:
        """What records must share to pool: the draft and how it was served."""
        return self.draft, self.algorithm, self.num_steps, self.topk


@dataclass(kw_only=True, slots=True)
class ServedDraftTally:
    """The served acceptance of one draft and setting, pooled over records."""

    draft: str
    algorithm: str
    num_steps: int | None
    topk: int | None
    num_records: int = 0
    verify_steps: int = 0
    accepted_drafts: int = 0
    accepted_at_position: list[int] = field(default_factory=list)
    """[j]: verify steps that accepted more than j drafts, summed (a shorter list counts 0 past its end)."""

    def add(self, served: ServedDraft) -> None:
        assert served.setting == (self.draft, self.algorithm, self.num_steps, self.topk), "pooled across settings"
        self.num_records += 1
        self.verify_steps += served.verify_steps
        self.accepted_drafts += served.accepted_drafts
        missing = len(served.accepted_at_position) - len(self.accepted_at_position)
        self.accepted_at_position += [0] * max(missing, 0)
        for position, count in enumerate(served.accepted_at_position):
            self.accepted_at_position[position] += count

    @property
    def acceptance_length(self) -> float | None:
        """Tokens per verify step, pooled: (accepted drafts + verify steps) / verify steps; None without steps."""
        if not self.verify_steps:
            return None
        return (self.accepted_drafts + self.verify_steps) / self.verify_steps

    @property
    def position_acceptance(self) -> list[float]:
        """[j - 1]: share of verify steps that accepted at least j drafts (draft position j, 1-based)."""
        return [count / self.verify_steps for count in self.accepted_at_position] if self.verify_steps else []

    def to_json(self) -> dict[str, Any]:
        """The counts (what `from_json` reads back) and the shares computed from them."""
        return {"draft": self.draft, "algorithm": self.algorithm, "num_steps": self.num_steps, "topk": self.topk,
                "num_records": self.num_records, "verify_steps": self.verify_steps,
                "accepted_drafts": self.accepted_drafts, "accepted_at_position": list(self.accepted_at_position),
                "acceptance_length": self.acceptance_length, "position_acceptance": self.position_acceptance}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ServedDraftTally:
        return cls(draft=data["draft"], algorithm=data["algorithm"], num_steps=data["num_steps"], topk=data["topk"],
                   num_records=data["num_records"], verify_steps=data["verify_steps"],
                   accepted_drafts=data["accepted_drafts"], accepted_at_position=list(data["accepted_at_position"]))


def pool_served_drafts(records: Iterable[ServedDraft | None]) -> tuple[list[ServedDraftTally], int]:
    """(one tally per draft and setting in order of first appearance, records captured without a draft (None))."""
    tallies: dict[tuple[str, str, int | None, int | None], ServedDraftTally] = {}
    num_without = 0
    for served in records:
        if served is None:
            num_without += 1
            continue
        tally = tallies.get(served.setting)
        if tally is None:
            tally = tallies[served.setting] = ServedDraftTally(draft=served.draft, algorithm=served.algorithm,
                                                               num_steps=served.num_steps, topk=served.topk)
        tally.add(served)
    return list(tallies.values()), num_without


def tally_header(tallies: Iterable[ServedDraftTally], first: str = "draft") -> list[str]:
    """Column names of `tally_rows`: one acceptance column per draft position any tally reached."""
    num_positions = max((len(tally.accepted_at_position) for tally in tallies), default=0)
    return [first, "algorithm", "steps/top-k", "records", "verify steps", "acceptance length",
            *(f"position {position}" for position in range(1, num_positions + 1))]


def tally_rows(tallies: Iterable[ServedDraftTally], label: str = "") -> list[list[str]]:
    """One row per tally, cells as text for capture_format.tables; the draft shown by its first 12 hex digits
    after label. A tally without verify steps (prefill-only records) shows "-" for acceptance."""
    tallies = list(tallies)
    num_positions = max((len(tally.accepted_at_position) for tally in tallies), default=0)
    rows = []
    for tally in tallies:
        setting = f"{'-' if tally.num_steps is None else tally.num_steps}/{'-' if tally.topk is None else tally.topk}"
        length = "-" if tally.acceptance_length is None else f"{tally.acceptance_length:.3f}"
        positions = [f"{share:.3f}" for share in tally.position_acceptance]
        rows.append([f"{label}{tally.draft[:DRAFT_LABEL_DIGITS]}", tally.algorithm, setting, f"{tally.num_records:,}",
                     f"{tally.verify_steps:,}", length, *positions, *["-"] * (num_positions - len(positions))])
    return rows
