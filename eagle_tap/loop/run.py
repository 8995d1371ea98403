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
from eagle_tap.serve.swap import swap_draft

__all__ = ["Loop", "LoopConfig", "recorded_checksum"]

log = logging.getLogger(__name__)


def recorded_checksum(state: dict[str, Any], version: str, weights_key: str) -> str | None:
    """SGLang's draft checksum of version on a replica of weights_key (dtype/TP), once a verified swap recorded it."""
    return (state.get("checksums", {}).get(version) or {}).get(weights_key)


class Loop(LoopState):
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
    def desired_version(self, state: dict[str, Any], url: str) -> str | None:
        """The promoted version; for a replica where it failed verification, what that replica kept (None: the
        weights it was started with, which the registry does not hold) until a newer version is promoted."""
        record = state["replicas"].get(url) or {}
        if record.get("failed_version") and record["failed_version"] == state["promoted"]:
            return record.get("version")
        return state["promoted"]

    def bring_up_to_date(self) -> dict[str, Any]:
        """Step 1 of a tick for every replica: {url: what happened}."""
        out = {}
        for url in self.config.replicas:
            state = self.registry.state()
            record = state["replicas"].get(url) or {}
            desired = self.desired_version(state, url)
            if desired is None:
                out[url] = (f"keeps the weights it started with: {state['promoted']} failed verification there"
                            if state["promoted"] else "no promoted version")
                continue
            if not rep.is_up(url):
                if not record.get("down"):
                    self.registry.event("replica_down", replica=url, version=record.get("version"))
                    self._set_replica(url, down=True, target_checksum=None)  # it may come back another process
                out[url] = "down"
                continue
            try:
                checksum = rep.draft_checksum(url)
            except rep.ReplicaDown:
                out[url] = "down"
                continue
            if record.get("down"):
                self.registry.event("replica_back", replica=url)
                self._set_replica(url, down=False)
            if record.get("version") == desired and record.get("draft_checksum") == checksum:
                out[url] = f"serves {desired}"
                continue
            why = ("first contact" if not record else "its draft checksum is not the one recorded for "
                   f"{record.get('version')} (restarted, or swapped outside the loop)" if record.get("version") == desired
                   else f"it serves {record.get('version')}, the registry promoted {desired}")
            self.say(f"{url}: bringing it to {desired}: {why}")
            # Met for the first time or restarted (its draft is not the one recorded): the swap checks the target
            # too; otherwise as swap_and_verify decides (a draft swap cannot change the target, so a replica whose
            # target checksum the registry holds skips that stall of its scheduler).
            restarted = not record or record.get("version") == desired
            outcome = self.swap_and_verify(url, desired, previous=record.get("version"), why=why,
                                           check_target=True if restarted else None)
            out[url] = outcome["result"]
        return out

    def _set_replica(self, url: str, **fields: Any) -> None:
        def change(state: dict[str, Any]) -> None:
            state["replicas"][url] = {**state["replicas"].get(url, {}), **fields, "at": time.time()}

        self.registry.update_state(change)

    def swap_and_verify(self, url: str, version: str, *, previous: str | None, why: str,
                        check_target: bool | None = None) -> dict[str, Any]:
        """Swap version into url, verify, and swap previous back on failure; records everything. check_target:
        take the target's checksum around the swap (None: when the registry holds none for url yet, or holds
        it as down), recorded as the replica's `target_checksum`."""
        state = self.registry.state()
        if check_target is None:
            record = state["replicas"].get(url) or {}
            check_target = not record.get("target_checksum") or bool(record.get("down"))
        info = self.registry.version(version).info
        try:
            version_dir = self.registry.local_copy(version)
            reference = self.registry.local_copy(previous) if previous else version_dir
            replica, _ = rep.prepare_swap(url, version_dir, reference_dir=reference)
        except rep.ReplicaDown as error:
            self.registry.event("replica_down", replica=url, version=version, why=str(error))
            self._set_replica(url, down=True)
            return {"result": "down", "why": str(error)}
        except (ValueError, RegistryError) as error:  # refused before the replica was touched
            self.registry.event("swap_refused", replica=url, version=version, why=str(error))
            return {"result": "refused", "why": str(error)}
        started = time.perf_counter()
        try:
            result = swap_draft(url, version_dir, serving_dir=None, check_target=check_target,  # prepare_swap checked
                                num_ranks=replica.tp_size)
        except (RuntimeError, OSError, ValueError) as error:  # touched: SGLang refused, or the replica went away
            why = f"the swap failed: {type(error).__name__}: {error}"[:2000]
            self.registry.event("swap_failed", replica=url, version=version, why=why)
            try:
                back = self.roll_back(url, previous, failed=version, why=why)
            except (RuntimeError, OSError, ValueError) as again:  # the next tick compares its checksum again
                self._set_replica(url, down=True)
                back = {"result": f"could not roll back: {type(again).__name__}: {again}"[:500]}
            return {"result": "rolled back", "why": why, "rollback": back}
        wall_s = time.perf_counter() - started
        known = recorded_checksum(state, version, replica.weights_key)
        probe = info.get("probe") or {}
        verification = rep.verify(url, result, known_checksum=known, probe_prompts=self.probe_prompts(),
                                  probe_max_new_tokens=self.config.probe_max_new_tokens,
                                  simulated=probe.get("served_walk"), tolerance=self.config.probe_tolerance)
        swap_figures = {"paused_s": result.paused_s, "wall_s": wall_s, "num_tensors": result.num_tensors,
                        "draft_checksum": result.draft_checksum_after, "target_checked": result.target_checked,
                        "probe": verification.probe}
        recorded_target = (state["replicas"].get(url) or {}).get("target_checksum")
        if result.target_checked and recorded_target and recorded_target != result.target_checksum_before:
            self.registry.event("target_changed", replica=url, recorded=recorded_target,
                                now=result.target_checksum_before)
        if verification.ok:
            def change(doc: dict[str, Any]) -> None:
                kept = (doc["replicas"].get(url) or {}).get("target_checksum")
                doc["replicas"][url] = {"version": version, "draft_checksum": result.draft_checksum_after,
                                        "target_checksum": result.target_checksum_after or kept,
                                        "weights_key": replica.weights_key, "at": time.time(), "down": False}
                doc.setdefault("checksums", {}).setdefault(version, {})[replica.weights_key] = \
                    result.draft_checksum_after

            self.registry.update_state(change)
            self.registry.event("swapped", replica=url, version=version, previous=previous, why=why,
                                verification=verification.why, **swap_figures)
            return {"result": f"serves {version}", **swap_figures}
        self.registry.event("verification_failed", replica=url, version=version, why=verification.why, **swap_figures)
        back = self.roll_back(url, previous, failed=version, why=verification.why)
        return {"result": "rolled back", "why": verification.why, "rollback": back, **swap_figures}

    def roll_back(self, url: str, previous: str | None, *, failed: str, why: str) -> dict[str, Any]:
        """Put previous back into url (checked against its recorded checksum there)."""
        if previous is None:
            self._set_replica(url, version=None, failed_version=failed, why=why)
            return {"result": "no previous version to return to"}
        state = self.registry.state()
        version_dir = self.registry.local_copy(previous)
        replica, result, wall_s = rep.swap_in(url, version_dir, reference_dir=version_dir)
        expected = recorded_checksum(state, previous, replica.weights_key)
        restored = expected is None or result.draft_checksum_after == expected
        self._set_replica(url, version=previous, draft_checksum=result.draft_checksum_after,
                          weights_key=replica.weights_key, failed_version=failed, why=why)
        self.registry.event("rolled_back_replica", replica=url, version=previous, failed_version=failed,
                            restored_checksum=restored, paused_s=result.paused_s, wall_s=wall_s)
        return {"result": f"serves {previous}", "restored_checksum": restored, "paused_s": result.paused_s}

    def promote(self, version: str) -> dict[str, Any]:
        """Canary first, then the rest (module docstring)."""
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
                    self.registry.event("replica_down", replica=url, version=record.get("version"))
                    self._set_replica(url, down=True, target_checksum=None)  # it may come back another process
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

    def _finish_promotion(self, version: str, new_state: str, why: str) -> None:
        self.registry.set_version_state(version, new_state, why)
        self.registry.update_state(lambda doc: doc.__setitem__("pending", None))

    # ---------------------------------------------------------------------------------------------- probe
    def probe_prompts(self):
        return evaluation.probe_prompts(self)

    def simulate_probe(self, draft_dir: Path) -> dict[str, Any] | None:
        return evaluation.simulate_probe(self, draft_dir)
