"""`eagle-tap loop agent`: keeps the replicas of one host on the version the registry says, for a loop that runs
elsewhere (its `agent_replicas`).

The loop trains, gates and decides, one process per registry; a swap hands SGLang shared-memory tensor
handles, so it must run on the replica's host. On each replica host an agent, every `poll_s`:
1. reads state.json (never writes it): the promoted version, and a promotion in progress with its canary;
2. brings each of its replicas to its desired version (eagle_tap/loop/sync.py, the same swap, verification and
   rollback as the loop's own): the canary of a promotion in progress gets the new version, every other
   replica the promoted one; a version that failed verification on a replica is not tried there again
   until another one is wanted;
3. writes what each replica serves, its checksums and its last verdict to agents/<replica>/replica.json, and
   what it did to agents/<replica>/events/ (registry.py); the loop reads the canary's verdict from there.

What must hold: an agent writes only its replicas' files, under their agent.lock (one agent per replica);
an agent that cannot read the registry touches no replica (it keeps its version) and tries again next
tick; an agent killed at any point and started again finds each replica whose draft checksum is not the one
recorded and swaps the wanted version in again, so a replica ends on a version the registry records.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

from eagle_tap.loop.registry import Registry, replica_key, user_cache_dir
from eagle_tap.loop.sync import ReplicaKeeper, failed_rule

__all__ = ["Agent", "AgentConfig"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True, slots=True)
class AgentConfig:
    """The settings of one agent (`eagle-tap loop agent --config`, or flags and `--set key=value`)."""

    registry: str
    """Folder or s3:// prefix of the loop's draft registry."""
    replicas: list[str]
    """Base URLs of the SGLang replicas on this host that this agent keeps."""
    regression_shards: str | None = None
    """The loop's regression set: its first probe_records records are the probe prompts after a swap."""
    probe_records: int = 6
    """Prompts of the probe after each swap (0: checksums only); the loop's setting."""
    probe_max_new_tokens: int = 48
    """Tokens generated per probe prompt; the loop's setting (the version's simulated probe used it)."""
    probe_tolerance: float = 0.2
    """After a swap the probe's served acceptance must reach (1 - this) x the version's simulated served walk."""
    poll_s: float = 5.0
    """Seconds between ticks."""
    lease_s: float = 120.0
    """An object-store registry: how long a killed agent's lock on its replicas holds before another may take
    them (a folder registry's flock is released by the kernel at once)."""
    cache_dir: str | None = None
    """Local folder for versions fetched from an object-store registry (default: the user cache, one folder
    per agent)."""

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("an agent keeps at least one replica: pass --replica URL")


class Agent(ReplicaKeeper):
    """One agent (module docstring): `with Agent(config) as agent: agent.run()`."""

    def __init__(self, config: AgentConfig, *, log_line=print) -> None:
        self.config = config
        self.say = log_line
        self.probe_prompt_cache: list | None = None
        # Its own cache folder (used for an object-store registry only): agents on one host never write one file.
        cache = config.cache_dir or user_cache_dir() / "agents" / replica_key(config.replicas[0])
        # One Registry per replica, each holding that replica's agent.lock (a Registry holds one lock).
        self.registries = {url: Registry(config.registry, cache_dir=cache, create=False) for url in config.replicas}
        self.registry = self.registries[config.replicas[0]]

    def __enter__(self) -> Agent:
        taken = []
        try:
            for url, registry in self.registries.items():
                registry.lock(lease_s=self.config.lease_s, name=registry.agent_lock_name(url))
                taken.append(registry)
        except BaseException:
            for registry in taken:
                registry.unlock()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        for registry in self.registries.values():
            registry.unlock()

    # ----------------------------------------------------------------------------------- ReplicaKeeper hooks
    def kept_replicas(self) -> list[str]:
        return list(self.config.replicas)

    def replica_record(self, state: dict[str, Any], url: str) -> dict[str, Any]:
        record = self.registries[url].agent_replica(url) or {}
        return {key: value for key, value in record.items() if key not in ("url", "at")}

    def set_replica(self, url: str, **fields: Any) -> None:
        self.registries[url].write_agent_replica(url, {**self.replica_record({}, url), **fields})

    def store_verified(self, url: str, record: dict[str, Any], version: str, weights_key: str) -> None:
        self.registries[url].write_agent_replica(url, record)

    def note(self, kind: str, url: str, **details: Any) -> None:
        self.registries[url].agent_event(url, kind, **details)
        if kind == "swap_refused":  # nothing was touched: the verdict tells the loop, and it is not tried again
            self.set_replica(url, failed_version=details["version"], why=details.get("why"),
                             verdict={"version": details["version"], "ok": False, "refused": True,
                                      "why": details.get("why")})

    def desired_version(self, state: dict[str, Any], url: str) -> str | None:
        """The canary of a promotion in progress: its new version; any other replica: the promoted one (unless it
        failed verification there, sync.failed_rule)."""
        record = self.replica_record(state, url)
        pending = state.get("pending") or {}
        if pending.get("canary") == url and pending.get("to"):
            return failed_rule(record, pending["to"])
        return failed_rule(record, state["promoted"])

    # ------------------------------------------------------------------------------------------------ ticks
    def tick(self) -> dict[str, Any]:
        """Renew the locks, then bring every replica up to date ({url: what happened})."""
        for registry in self.registries.values():
            registry.renew()
        return self.bring_up_to_date()

    def run(self, *, stop: threading.Event | None = None, max_ticks: int | None = None) -> None:
        stop = stop or threading.Event()
        ticks = 0
        while not stop.is_set() and (max_ticks is None or ticks < max_ticks):
            try:
                for url, outcome in self.tick().items():
                    log.info("%s: %s", url, outcome)
            except Exception as error:  # noqa: BLE001 (the registry unreachable, a replica gone: try again next tick)
                log.exception("agent tick failed")
                self.say(f"tick failed: {type(error).__name__}: {error}"[:2000])
            ticks += 1
            stop.wait(self.config.poll_s)
