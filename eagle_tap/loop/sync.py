"""Keeping replicas on the version the registry says: the part of the loop that an agent on each replica host
runs too (`eagle-tap loop agent`, eagle_tap/loop/agent.py).

`ReplicaKeeper.bring_up_to_date` brings each replica this process keeps to its desired version: a replica
whose draft checksum is not the one recorded for that version (met for the first time, restarted, swapped by
hand, or caught mid-swap by a stopped process) gets the version swapped in and verified, and on failure the
version it served before swapped back; a replica that does not answer is recorded down and caught up once it
answers again. Before its first look at a replica, a process ends any weight-update session and pause that
a predecessor killed mid-swap left on it (`replicas.release`). The target's checksum is taken on the swap
that first meets a replica, or meets it again after a restart or after it was down (a draft swap cannot
change the target, and SGLang hashes the whole target on its scheduler thread for that figure).

Where it is written differs, and the subclasses say: the loop (eagle_tap.loop.run.Loop) records its replicas in
state.json and its events in events/; an agent records its replicas in agents/<replica>/ (registry.py), which
only it writes. Both read the versions, their checksums per dtype/TP (`checksums` in state.json) and their
probes from the registry.
"""

from __future__ import annotations

import time
from typing import Any

from eagle_tap.loop import evaluation
from eagle_tap.loop import replicas as rep
from eagle_tap.loop.registry import Registry, RegistryError
from eagle_tap.serve.swap import swap_draft

__all__ = ["ReplicaKeeper", "recorded_checksum"]


def recorded_checksum(state: dict[str, Any], version: str, weights_key: str) -> str | None:
    """SGLang's draft checksum of version on a replica of weights_key (dtype/TP), once a verified swap recorded it."""
    return (state.get("checksums", {}).get(version) or {}).get(weights_key)


def failed_rule(record: dict[str, Any], wanted: str | None) -> str | None:
    """wanted, unless it failed verification on this replica: then what the replica kept (None: the weights it
    was started with, which the registry does not hold) until another version is wanted."""
    if wanted is not None and record.get("failed_version") == wanted:
        return record.get("version")
    return wanted


class ReplicaKeeper:
    """Bring-up, swap, verification and rollback of the replicas one process keeps (module docstring). A
    subclass has `registry`, `config` (probe settings), `say`, `probe_prompt_cache`, and the hooks below."""

    registry: Registry

    # ------------------------------------------------------------------------------------------------ hooks
    def kept_replicas(self) -> list[str]:
        raise NotImplementedError

    def replica_record(self, state: dict[str, Any], url: str) -> dict[str, Any]:
        """What this process recorded of url ({} when nothing)."""
        raise NotImplementedError

    def set_replica(self, url: str, **fields: Any) -> None:
        """Change some fields of url's record."""
        raise NotImplementedError

    def store_verified(self, url: str, record: dict[str, Any], version: str, weights_key: str) -> None:
        """url serves version, verified: replace its record by record."""
        raise NotImplementedError

    def note(self, kind: str, url: str, **details: Any) -> None:
        """Write one event about url down."""
        raise NotImplementedError

    def desired_version(self, state: dict[str, Any], url: str) -> str | None:
        """The version url must serve (None: keep the weights it was started with)."""
        return failed_rule(self.replica_record(state, url), state["promoted"])

    # ---------------------------------------------------------------------------------------------- bring-up
    def bring_up_to_date(self) -> dict[str, Any]:
        """Every kept replica to its desired version: {url: what happened}."""
        out = {}
        released = self.__dict__.setdefault("_released", set())
        for url in self.kept_replicas():
            # Once per process, before anything else asks the replica: a keeper killed mid-swap (this one's
            # previous run) may have left it paused, where even /health waits.
            if url not in released and rep.release(url):
                released.add(url)
            state = self.registry.state()
            record = self.replica_record(state, url)
            desired = self.desired_version(state, url)
            if desired is None:
                out[url] = (f"keeps the weights it started with: {state['promoted']} failed verification there"
                            if state["promoted"] else "no promoted version")
                continue
            if not rep.is_up(url):
                if not record.get("down"):
                    self.note("replica_down", url, version=record.get("version"))
                    self.set_replica(url, down=True, target_checksum=None)  # it may come back another process
                out[url] = "down"
                continue
            try:
                checksum = rep.draft_checksum(url)
            except rep.ReplicaDown:
                out[url] = "down"
                continue
            if record.get("down"):
                self.note("replica_back", url)
                self.set_replica(url, down=False)
            if record.get("version") == desired and record.get("draft_checksum") == checksum:
                out[url] = f"serves {desired}"
                continue
            why = ("first contact" if not record else "its draft checksum is not the one recorded for "
                   f"{record.get('version')} (restarted, or swapped outside the loop)" if record.get("version") == desired
                   else f"it serves {record.get('version')}, the registry wants {desired}")
            self.say(f"{url}: bringing it to {desired}: {why}")
            # Met for the first time or restarted (its draft is not the one recorded): the swap checks the target
            # too; otherwise as swap_and_verify decides (a draft swap cannot change the target, so a replica whose
            # target checksum is recorded skips that stall of its scheduler).
            restarted = not record or record.get("version") == desired
            outcome = self.swap_and_verify(url, desired, previous=record.get("version"), why=why,
                                           check_target=True if restarted else None)
            out[url] = outcome["result"]
        return out

    # --------------------------------------------------------------------------------------------- swap
    def swap_and_verify(self, url: str, version: str, *, previous: str | None, why: str,
                        check_target: bool | None = None) -> dict[str, Any]:
        """Swap version into url, verify, and swap previous back on failure; records everything. check_target:
        take the target's checksum around the swap (None: when none is recorded for url yet, or it was down),
        recorded as the replica's `target_checksum`."""
        state = self.registry.state()
        record = self.replica_record(state, url)
        if check_target is None:
            check_target = not record.get("target_checksum") or bool(record.get("down"))
        info = self.registry.version(version).info
        try:
            version_dir = self.registry.local_copy(version)
            reference = self.registry.local_copy(previous) if previous else version_dir
            replica, _ = rep.prepare_swap(url, version_dir, reference_dir=reference)
        except rep.ReplicaDown as error:
            self.note("replica_down", url, version=version, why=str(error))
            self.set_replica(url, down=True)
            return {"result": "down", "why": str(error)}
        except (ValueError, RegistryError) as error:  # refused before the replica was touched
            self.note("swap_refused", url, version=version, why=str(error))
            return {"result": "refused", "why": str(error)}
        started = time.perf_counter()
        try:
            result = swap_draft(url, version_dir, serving_dir=None, check_target=check_target,  # prepare_swap checked
                                num_ranks=replica.tp_size)
        except (RuntimeError, OSError, ValueError) as error:  # touched: SGLang refused, or the replica went away
            why = f"the swap failed: {type(error).__name__}: {error}"[:2000]
            self.note("swap_failed", url, version=version, why=why)
            try:
                back = self.roll_back(url, previous, failed=version, why=why)
            except (RuntimeError, OSError, ValueError) as again:  # the next bring-up compares its checksum again
                self.set_replica(url, down=True)
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
        recorded_target = record.get("target_checksum")
        if result.target_checked and recorded_target and recorded_target != result.target_checksum_before:
            self.note("target_changed", url, recorded=recorded_target, now=result.target_checksum_before)
        if verification.ok:
            self.store_verified(url, {"version": version, "draft_checksum": result.draft_checksum_after,
                                      "target_checksum": result.target_checksum_after or recorded_target,
                                      "weights_key": replica.weights_key, "down": False,
                                      "verdict": {"version": version, "ok": True, "why": verification.why}},
                                version, replica.weights_key)
            self.note("swapped", url, version=version, previous=previous, why=why, verification=verification.why,
                      **swap_figures)
            return {"result": f"serves {version}", **swap_figures}
        self.note("verification_failed", url, version=version, why=verification.why, **swap_figures)
        back = self.roll_back(url, previous, failed=version, why=verification.why)
        return {"result": "rolled back", "why": verification.why, "rollback": back, **swap_figures}

    def roll_back(self, url: str, previous: str | None, *, failed: str, why: str) -> dict[str, Any]:
        """Put previous back into url (checked against its recorded checksum there)."""
        verdict = {"version": failed, "ok": False, "why": why}
        if previous is None:
            self.set_replica(url, version=None, failed_version=failed, why=why, verdict=verdict)
            return {"result": "no previous version to return to"}
        state = self.registry.state()
        version_dir = self.registry.local_copy(previous)
        replica, result, wall_s = rep.swap_in(url, version_dir, reference_dir=version_dir)
        expected = recorded_checksum(state, previous, replica.weights_key)
        restored = expected is None or result.draft_checksum_after == expected
        self.set_replica(url, version=previous, draft_checksum=result.draft_checksum_after,
                         weights_key=replica.weights_key, failed_version=failed, why=why, verdict=verdict)
        self.note("rolled_back_replica", url, version=previous, failed_version=failed, restored_checksum=restored,
                  paused_s=result.paused_s, wall_s=wall_s)
        return {"result": f"serves {previous}", "restored_checksum": restored, "paused_s": result.paused_s}

    # ---------------------------------------------------------------------------------------------- probe
    def probe_prompts(self):
        return evaluation.probe_prompts(self)
