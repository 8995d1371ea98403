"""What a run shows: a progress bar (samples, tokens/s, ETA) on stderr and the final summary table.

The bar is tqdm on stderr, shown on a terminal or when forced (`--progress on`), never mixed with
stdout, where the summary goes. Messages about single rows go above the bar, capped so that a
dataset full of broken rows does not flood the terminal (all of them are in the manifest).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

from capture_format.tables import text_table

__all__ = ["Progress", "RunStats", "format_summary"]

MAX_ROW_MESSAGES = 20


@dataclasses.dataclass(kw_only=True, slots=True)
class RunStats:
    """What this invocation did (the manifest holds the totals over every run of the RUN_DIR)."""

    num_rows_read: int = 0
    num_bad_rows: int = 0
    num_duplicate_rows: int = 0
    num_samples_skipped: int = 0
    """Samples whose every record was already confirmed: nothing sent."""
    num_rechecked_confirmed: int = 0
    """Records left sent/served by an earlier run that the collector turned out to have."""
    num_generate_requests: int = 0
    """Regeneration requests sent to /generate."""
    num_capture_requests: int = 0
    """Capture requests sent to /generate (each one carries a capture tag)."""
    num_sample_failures: int = 0
    interrupted: bool = False
    wall_s: float = 0.0


class Progress:
    """tqdm bar over samples with tokens/s in its postfix; `note()` prints a message above it."""

    def __init__(self, total: int | None, mode: str) -> None:
        from tqdm import tqdm

        enabled = mode == "on" or (mode == "auto" and sys.stderr.isatty())
        self._tqdm = tqdm
        self._bar = tqdm(total=total, unit="sample", file=sys.stderr, disable=not enabled, dynamic_ncols=True,
                         smoothing=0.05)
        self._start_s = time.monotonic()
        self._num_tokens = 0
        self._num_notes = 0

    def advance(self, num_tokens: int = 0) -> None:
        self._num_tokens += num_tokens
        rate = self._num_tokens / max(time.monotonic() - self._start_s, 1e-6)
        self._bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)
        self._bar.update(1)

    def note(self, message: str) -> None:
        self._num_notes += 1
        if self._num_notes <= MAX_ROW_MESSAGES:
            self._tqdm.write(message, file=sys.stderr)
        elif self._num_notes == MAX_ROW_MESSAGES + 1:
            self._tqdm.write("(more messages like these are in the manifest)", file=sys.stderr)

    def close(self) -> None:
        self._bar.close()


def format_summary(totals: dict[str, Any], stats: RunStats) -> str:
    """The summary table printed at the end of a run."""
    states = totals["records_by_state"]
    rows = [
        ("samples", f"{totals['num_samples']:,} ({totals['num_records']:,} records)"),
        ("tokens", f"{totals['num_tokens']:,} served, {totals['num_loss_tokens']:,} loss-masked"),
        ("confirmed", f"{states['confirmed']:,}"),
        ("served, unconfirmed", f"{states['served']:,} (checked again on resume)"),
        ("in flight at stop", f"{states['sent']:,} (checked again on resume)"),
        ("failed", f"{states['failed']:,}"),
    ]
    rows += [(f"  {reason}", f"{count:,}") for reason, count in totals["failed_by_reason"].items()]
    rows += [
        ("bad rows", f"{totals['num_bad_rows']:,}"),
        ("this run", f"{stats.num_capture_requests:,} capture + {stats.num_generate_requests:,} generate requests, "
                     f"{stats.num_samples_skipped:,} samples already confirmed"),
        ("wall time", f"{stats.wall_s:.1f} s" + (" (interrupted)" if stats.interrupted else "")),
    ]
    return text_table(rows, align="<<")
