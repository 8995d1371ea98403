"""`eagle-tap loop`: captured traffic in, a better served draft out, round after round, every decision written down.

One tick of the loop (`Loop.tick`):
1. replicas: each listed replica is brought to the version the registry says it must serve (the promoted
   one, or the one it was left on after a failed verification there): a replica whose draft checksum is
   not the one recorded for that version (restarted, swapped by hand, or caught mid-swap by a stopped
   loop) gets the version swapped in and verified; a replica that does not answer is reported down and
   caught up on the first tick it answers again;
2. round (eagle_tap.loop.rounds): once enough new records are in the shard set (a count, or an age), the
   newest are held out, a candidate is warm-started from the promoted version and trained on a replay mix,
   candidate and promoted version are evaluated on the held-out records and on the regression set, and the
   gate decides; a candidate that passes is promoted (below), one that fails is rejected;
3. watch: the served acceptance of the records that arrived since the last tick (SGLang's own counts in
   their `served_draft` metadata), one window per tick, next to the registry's events.

Promotion: the first replica that answers is the canary: swap, verify (checksums, probe), and on failure
swap it back and mark the candidate rolled back, touching no other replica. Past the canary, a replica that
fails verification is swapped back alone and keeps the previous version (recorded, and reported by
`loop status`), while the others serve the new one.

What must hold, whenever the loop is killed and started again: the registry holds whole versions only
(registry.py); a promotion in progress (state.json `pending`) is taken up again from the canary; a version
left as a candidate is marked abandoned (its round's records are new again); and step 1 finds every replica
whose weights are not what the registry records and swaps the recorded version back in, so no replica
stays on a version the registry does not record.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from eagle_tap.loop import evaluation, rounds, watch
from eagle_tap.loop import replicas as rep
from eagle_tap.loop.config import LoopConfig
from eagle_tap.loop.registry import Registry, RegistryError
from eagle_tap.loop.state import LoopState
from eagle_tap.loop.sync import ReplicaKeeper

__all__ = ["Loop", "LoopConfig"]

log = logging.getLogger(__name__)


class Loop(LoopState, ReplicaKeeper):
    """One loop on one registry (holds its lock while open): its state (rounds and watch read and change it) and
    what it does to replicas."""

    def __init__(self, config: LoopConfig, *, log_line=print) -> None:
        super().__init__(config=config, registry=Registry(config.registry), say=log_line)

    def __enter__(self) -> Loop:
        self.registry.lock()
        self.recover()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.registry.unlock()

    # ------------------------------------------------------------------------------------------ start-up
    def init(self, draft_dir: str | Path, *, trained_on: list[str] = ()) -> str:
        """Register the draft the replicas were started with as the first version, promoted. trained_on: ids of
        the shard set's records it was trained on (round r0000: not new to the first round, replayed by later ones)."""
        if self.registry.version_names():
            raise RegistryError(f"{self.registry.url} already holds versions; `loop init` starts an empty one")
        version = self.registry.add_version(draft_dir, parent=None, made={"how": "registered by `eagle-tap loop init`",
                                                                          "source": str(draft_dir),
                                                                          "trained_on_records": len(trained_on)})
        if trained_on:
            self.registry.write_round("r0000", {"round": "r0000", "version": version.name, "decision": "registered",
                                                "new_record_ids": list(trained_on), "heldout_record_ids": [],
                                                "replay_record_ids": []})
        self.registry.set_version_info(version.name, probe=self.simulate_probe(self.registry.local_copy(version.name)))
        self.registry.set_version_state(version.name, "promoted", "the draft the replicas were started with")
        return version.name

    def recover(self) -> None:
        """After a stop at any point: candidates without a decision are abandoned; a promotion is taken up again."""
        pending = self.pending_promotion()
        state = self.registry.state()
        for name in self.registry.version_names():
            entry = state["versions"].get(name)
            if name != pending and (entry is None or entry["state"] == "candidate"):
                self.registry.set_version_state(name, "abandoned", "the loop stopped before its gate decided")
        if pending:
            self.say(f"taking up the promotion of {pending} that a stopped loop left unfinished")
            self.promote(pending)

    def pending_promotion(self) -> str | None:
        """The version a promotion in progress puts in; a pending entry whose decision was already written (the
        loop stopped between the two writes) is cleared."""
        state = self.registry.state()
        pending = state.get("pending")
        if not pending:
            return None
        if (state["versions"].get(pending["to"]) or {}).get("state") in ("candidate", "promoting"):
            return pending["to"]
        self.registry.update_state(lambda doc: doc.__setitem__("pending", None))
        return None

    # ---------------------------------------------------------------------------------------------- tick
    def tick(self) -> dict[str, Any]:
        """One pass: replicas, round, watch (module docstring). Returns what it did."""
        self.registry.renew()
        report: dict[str, Any] = {"replicas": self.bring_up_to_date()}

        pending = self.pending_promotion()
        if pending:  # a promotion that found no replica answering: try again before any new round
            report["promotion"] = self.promote(pending)
            if self.registry.state().get("pending"):
                report["window"] = watch.record_window(self)
                return report
        report["round"] = rounds.maybe_run_round(self)
        if report["round"] and report["round"].get("decision") == "promote":
            report["promotion"] = self.promote(report["round"]["version"])
        report["window"] = watch.record_window(self)
        return report

    def run(self, *, stop: threading.Event | None = None, max_ticks: int | None = None) -> None:
        stop = stop or threading.Event()
        ticks = 0
        while not stop.is_set() and (max_ticks is None or ticks < max_ticks):
            try:
                self.tick()
            except (OSError, ValueError, RuntimeError) as error:  # written down; the next tick tries again
                log.exception("tick failed")
                self.registry.event("tick_failed", why=f"{type(error).__name__}: {error}"[:2000])
                self.say(f"tick failed: {type(error).__name__}: {error}")
            ticks += 1
            stop.wait(self.config.poll_s)

    # ---------------------------------------------------------------------------------------- replicas
    # ReplicaKeeper's hooks (eagle_tap/loop/sync.py): the loop keeps `replicas` itself, recorded in state.json.
    def kept_replicas(self) -> list[str]:
        return list(self.config.replicas)

    def replica_record(self, state: dict[str, Any], url: str) -> dict[str, Any]:
        return state["replicas"].get(url) or {}

    def set_replica(self, url: str, **fields: Any) -> None:
        def change(state: dict[str, Any]) -> None:
            state["replicas"][url] = {**state["replicas"].get(url, {}), **fields, "at": time.time()}

        self.registry.update_state(change)

    def store_verified(self, url: str, record: dict[str, Any], version: str, weights_key: str) -> None:
        def change(doc: dict[str, Any]) -> None:
            doc["replicas"][url] = {**record, "at": time.time()}
            doc.setdefault("checksums", {}).setdefault(version, {})[weights_key] = record["draft_checksum"]

        self.registry.update_state(change)

    def note(self, kind: str, url: str, **details: Any) -> None:
        self.registry.event(kind, replica=url, **details)

    def promote(self, version: str) -> dict[str, Any]:
        """Canary first, then the rest (module docstring)."""
        if self.config.agent_replicas:
            return self.promote_through_agents(version)
        state = self.registry.state()
        previous = state["pending"]["from"] if state.get("pending") else state["promoted"]

        def start(doc: dict[str, Any]) -> None:
            doc["pending"] = {"to": version, "from": previous, "at": time.time()}

        self.registry.update_state(start)
        self.registry.set_version_state(version, "promoting", "passed the gate")
        outcomes: dict[str, Any] = {}
        canary_done = False
        for url in self.config.replicas:
            record = self.registry.state()["replicas"].get(url) or {}
            if not rep.is_up(url):
                outcomes[url] = {"result": "down"}
                if not record.get("down"):
                    self.note("replica_down", url, version=record.get("version"))
                    self.set_replica(url, down=True, target_checksum=None)  # it may come back another process
                continue
            outcome = self.swap_and_verify(url, version, previous=record.get("version") or previous,
                                           why="promotion" + ("" if canary_done else " (canary)"))
            outcomes[url] = outcome
            if not canary_done and outcome["result"] == "refused":  # no replica was touched: STATES' "rejected"
                why = f"refused before the canary {url} was touched: {outcome.get('why')}"
                self._finish_promotion(version, "rejected", why)
                return {"version": version, "state": "rejected", "why": why, "replicas": outcomes}
            if not canary_done and outcome["result"] != f"serves {version}":
                why = f"verification failed on the canary {url}: {outcome.get('why')}"
                self._finish_promotion(version, "rolled_back", why)
                return {"version": version, "state": "rolled_back", "why": why, "replicas": outcomes}
            canary_done = canary_done or outcome["result"] == f"serves {version}"
        if not canary_done:  # no replica answered: keep it pending, the next start or tick takes it up
            return {"version": version, "state": "promoting", "why": "no replica answered", "replicas": outcomes}
        self._finish_promotion(version, "promoted", "verified on the canary")
        return {"version": version, "state": "promoted", "replicas": outcomes}

    def promote_through_agents(self, version: str) -> dict[str, Any]:
        """Canary first across hosts: the first agent replica that its agent reports up is named the canary in
        state.json's `pending`; its agent swaps and verifies it (eagle_tap/loop/agent.py) and writes its verdict
        in agents/<replica>/replica.json. Verified: the version is promoted, and every other agent brings its
        replicas to it. Failed (the agent put the previous version back) or refused: the version is marked
        rolled back or rejected, and no other agent was ever asked for it. No verdict within canary_wait_s (or
        no canary up): the promotion stays pending, and the next tick waits again."""
        state = self.registry.state()
        pending = state.get("pending") or {}
        previous = pending.get("from") if pending.get("to") == version else state["promoted"]
        agents = self.registry.agent_replicas()
        canary = pending.get("canary") if pending.get("to") == version else None
        if canary is None or (agents.get(canary) or {}).get("down"):
            canary = next((url for url in self.config.agent_replicas
                           if url in agents and not agents[url].get("down")), None)
        if canary is None:
            self.registry.update_state(lambda doc: doc.__setitem__(
                "pending", {"to": version, "from": previous, "at": time.time(), "canary": None}))
            self.registry.set_version_state(version, "promoting", "passed the gate; no agent reports a replica up")
            return {"version": version, "state": "promoting", "why": "no agent reports a replica up", "replicas": {}}
        if pending.get("to") != version or pending.get("canary") != canary:
            self.registry.update_state(lambda doc: doc.__setitem__(
                "pending", {"to": version, "from": previous, "at": time.time(), "canary": canary}))
            self.registry.event("canary", version=version, replica=canary)
        if (state["versions"].get(version) or {}).get("state") != "promoting":
            self.registry.set_version_state(version, "promoting", f"passed the gate; canary {canary}")
        self.say(f"{version}: waiting for the canary {canary}'s agent")
        deadline = renewed = time.monotonic()
        deadline += self.config.canary_wait_s
        while True:
            record = self.registry.agent_replica(canary) or {}
            verdict = record.get("verdict") or {}
            if verdict.get("version") == version and verdict.get("ok") and record.get("version") == version:
                def accept(doc: dict[str, Any]) -> None:
                    doc.setdefault("checksums", {}).setdefault(version, {})[record["weights_key"]] = \
                        record["draft_checksum"]

                self.registry.update_state(accept)
                self._finish_promotion(version, "promoted", f"verified on the canary {canary} by its agent")
                return {"version": version, "state": "promoted", "canary": canary, "replicas": {canary: record}}
            if verdict.get("version") == version and not verdict.get("ok"):
                refused = bool(verdict.get("refused"))
                why = (f"{'refused before' if refused else 'verification failed on'} the canary {canary}: "
                       f"{verdict.get('why')}")
                self._finish_promotion(version, "rejected" if refused else "rolled_back", why)
                return {"version": version, "state": "rejected" if refused else "rolled_back", "why": why,
                        "canary": canary, "replicas": {canary: record}}
            if time.monotonic() > deadline:
                return {"version": version, "state": "promoting", "canary": canary,
                        "why": f"no verdict from the canary {canary}'s agent within {self.config.canary_wait_s:g} s"}
            if time.monotonic() - renewed > 10.0:  # the lease (120 s) wants a renewal well inside it, not each poll
                self.registry.renew()
                renewed = time.monotonic()
            time.sleep(min(1.0, max(0.05, self.config.poll_s)))

    def _finish_promotion(self, version: str, new_state: str, why: str) -> None:
        self.registry.set_version_state(version, new_state, why)
        self.registry.update_state(lambda doc: doc.__setitem__("pending", None))

    # ---------------------------------------------------------------------------------------------- probe
    def simulate_probe(self, draft_dir: Path) -> dict[str, Any] | None:
        return evaluation.simulate_probe(self, draft_dir)
