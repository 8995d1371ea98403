"""The run manifest: one SQLite file in RUN_DIR with every record's state, the bad rows and token counts.

States of a record (one capture request; one per sample, or one per assistant turn):
  sent       the capture request is (or was, when a run stopped) in flight
  served     the server answered it; the collector has not confirmed it yet
  confirmed  the collector's GET /v1/records/{id} said stored: never sent again
  failed     given up, with a reason `kind: detail` (the summary groups by kind)

What must hold:
- every transition is one committed transaction (WAL journal), so a run killed at any point leaves a
  manifest that a re-run resumes from: `confirmed` is never re-sent, `sent`/`served` are re-checked with
  the collector before anything is re-sent, everything else is processed again;
- a record's loss-token counts are added to `token_counts` in the same transaction that first marks it
  served, so the counts include each record once, however often it is re-sent;
- the run's identity (run id, data, mode) is written once; a re-run with a different identity is refused.
"""

from __future__ import annotations

import collections
import sqlite3
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["MANIFEST_NAME", "Manifest", "RunMismatchError"]

MANIFEST_NAME = "manifest.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS run (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    record_id TEXT PRIMARY KEY,
    sample_key TEXT NOT NULL,
    line INTEGER NOT NULL,
    state TEXT NOT NULL,
    reason TEXT,
    num_tokens INTEGER NOT NULL DEFAULT 0,
    num_loss_tokens INTEGER NOT NULL DEFAULT 0,
    num_sends INTEGER NOT NULL DEFAULT 0,
    counted INTEGER NOT NULL DEFAULT 0,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS bad_rows (line INTEGER PRIMARY KEY, source TEXT NOT NULL, reason TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS token_counts (token_id INTEGER PRIMARY KEY, count INTEGER NOT NULL);
"""

STATES = ("sent", "served", "confirmed", "failed")


class RunMismatchError(ValueError):
    """RUN_DIR holds a run of a different command."""


class Manifest:
    """Open (or create) the manifest of the run in `run_dir`. One instance per process; not thread-safe."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / MANIFEST_NAME
        self._db = sqlite3.connect(self.path, isolation_level=None)  # explicit transactions below
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    # --- the run's identity ---------------------------------------------------------------------
    def bind_run(self, identity: Mapping[str, str]) -> dict[str, str]:
        """Stores `identity` on first use; on a resume, checks it matches and returns the stored one."""
        stored = dict(self._db.execute("SELECT key, value FROM run").fetchall())
        if not stored:
            with self._transaction():
                self._db.executemany("INSERT INTO run VALUES (?, ?)", sorted(identity.items()))
            return dict(identity)
        for key, value in identity.items():
            if key != "run_id" and stored.get(key) != value:
                raise RunMismatchError(
                    f"{self.path.parent} holds a run with {key}={stored.get(key)!r}, this command has {value!r}; "
                    "re-run the same command to resume, or choose another --out")
        return stored

    # --- states -------------------------------------------------------------------------------
    def states(self) -> dict[str, str]:
        """record id -> state, for every record this run has seen."""
        return dict(self._db.execute("SELECT record_id, state FROM records").fetchall())

    def records(self) -> list[dict]:
        cursor = self._db.execute("SELECT * FROM records ORDER BY line, record_id")
        names = [column[0] for column in cursor.description]
        return [dict(zip(names, row)) for row in cursor.fetchall()]

    def in_states(self, *states: str) -> list[str]:
        marks = ",".join("?" * len(states))
        return [row[0] for row in self._db.execute(f"SELECT record_id FROM records WHERE state IN ({marks})", states)]

    def mark_sent(self, record_id: str, *, sample_key: str, line: int, num_tokens: int, num_loss_tokens: int) -> None:
        with self._transaction():
            self._db.execute(
                "INSERT INTO records (record_id, sample_key, line, state, num_tokens, num_loss_tokens, num_sends,"
                " updated_at) VALUES (?, ?, ?, 'sent', ?, ?, 1, ?) ON CONFLICT(record_id) DO UPDATE SET"
                " state='sent', reason=NULL, num_tokens=excluded.num_tokens,"
                " num_loss_tokens=excluded.num_loss_tokens, num_sends=num_sends+1, updated_at=excluded.updated_at",
                (record_id, sample_key, line, num_tokens, num_loss_tokens, time.time()))

    def mark_served(self, record_id: str, loss_token_ids: Iterable[int], *, num_tokens: int | None = None,
                    num_loss_tokens: int | None = None) -> None:
        """Served; the first time, its loss tokens are counted in the same transaction. A record captured
        while it was generated learns its sizes only now (num_tokens, num_loss_tokens)."""
        with self._transaction():
            if num_tokens is not None:
                self._db.execute("UPDATE records SET num_tokens=?, num_loss_tokens=? WHERE record_id=?",
                                 (num_tokens, num_loss_tokens, record_id))
            (counted,) = self._db.execute("SELECT counted FROM records WHERE record_id=?", (record_id,)).fetchone()
            if not counted:
                self._db.executemany(
                    "INSERT INTO token_counts VALUES (?, ?)"
                    " ON CONFLICT(token_id) DO UPDATE SET count=count+excluded.count",
                    collections.Counter(loss_token_ids).items())
            self._db.execute(
                "UPDATE records SET state='served', reason=NULL, counted=1, updated_at=? WHERE record_id=?",
                (time.time(), record_id))

    def mark_unconfirmed(self, record_id: str, reason: str) -> None:
        """Still `served`, with a note of why it is not confirmed (re-checked on resume)."""
        with self._transaction():
            self._db.execute("UPDATE records SET reason=?, updated_at=? WHERE record_id=? AND state='served'",
                             (reason, time.time(), record_id))

    def mark_confirmed(self, record_ids: Iterable[str]) -> None:
        with self._transaction():
            self._db.executemany("UPDATE records SET state='confirmed', reason=NULL, updated_at=? WHERE record_id=?",
                                 [(time.time(), record_id) for record_id in record_ids])

    def mark_failed(self, record_id: str, *, sample_key: str, line: int, reason: str) -> None:
        with self._transaction():
            self._db.execute(
                "INSERT INTO records (record_id, sample_key, line, state, reason, updated_at)"
                " VALUES (?, ?, ?, 'failed', ?, ?) ON CONFLICT(record_id) DO UPDATE SET state='failed',"
                " reason=excluded.reason, updated_at=excluded.updated_at",
                (record_id, sample_key, line, reason, time.time()))

    def add_bad_row(self, line: int, source: str, reason: str) -> None:
        with self._transaction():
            self._db.execute("INSERT OR REPLACE INTO bad_rows VALUES (?, ?, ?)", (line, source, reason))

    # --- what the summary and the frequency file read ------------------------------------------
    def bad_rows(self) -> list[tuple[int, str, str]]:
        return self._db.execute("SELECT line, source, reason FROM bad_rows ORDER BY line").fetchall()

    def token_counts(self) -> dict[int, int]:
        return dict(self._db.execute("SELECT token_id, count FROM token_counts ORDER BY token_id").fetchall())

    def totals(self) -> dict[str, object]:
        """Counts over all runs of this RUN_DIR: records by state, samples, tokens, failures by reason kind."""
        by_state = dict(self._db.execute("SELECT state, COUNT(*) FROM records GROUP BY state").fetchall())
        (num_samples,) = self._db.execute("SELECT COUNT(DISTINCT sample_key) FROM records").fetchone()
        num_tokens, num_loss_tokens = self._db.execute(
            "SELECT COALESCE(SUM(num_tokens), 0), COALESCE(SUM(num_loss_tokens), 0) FROM records"
            " WHERE state IN ('served', 'confirmed')").fetchone()
        failed = collections.Counter(
            (reason or "unknown").split(":", 1)[0]
            for (reason,) in self._db.execute("SELECT reason FROM records WHERE state='failed'"))
        return {
            "num_samples": num_samples,
            "num_records": sum(by_state.values()),
            "records_by_state": {state: by_state.get(state, 0) for state in STATES},
            "num_tokens": num_tokens,
            "num_loss_tokens": num_loss_tokens,
            "failed_by_reason": dict(sorted(failed.items())),
            "num_bad_rows": self._db.execute("SELECT COUNT(*) FROM bad_rows").fetchone()[0],
            "num_counted_records": self._db.execute("SELECT COUNT(*) FROM records WHERE counted=1").fetchone()[0],
        }

    def _transaction(self) -> "_Transaction":
        return _Transaction(self._db)


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")
