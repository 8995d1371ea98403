"""The draft registry of `eagle-tap loop`: every draft version, how it was made, and what each replica serves.

Layout, in a folder or under an `s3://` prefix:

    loop.lock              who runs the loop on this registry (one loop per registry)
    state.json             the one mutable document: the promoted version, each version's state, each
                           replica's version and SGLang checksum, a promotion in progress
    v0001/ v0002/ ...      a version: the exported draft (config.json, model.safetensors, README.md ...)
        version.json       written last: parent, sha256 and size of every file, how it was made, its eval
    events/000001.json ... one object per decision, in order (registered, gate, swap, rollback, ...)
    rounds/r0001.json      the records a round trained on, held out and replayed
    agents/<replica>/      one per replica kept by an agent (`eagle-tap loop agent`), written only by it:
        agent.lock         the agent that keeps this replica (one per replica)
        replica.json       what the replica serves, its checksums, the last verdict (the agent's state.json)
        events/000001.json what the agent did to it, in order

What must hold:
- a version exists only once its version.json is stored, and that is written after every one of its
  files: a folder without it (the loop was killed while writing) is never read as a version, and is
  removed by the next loop that takes the lock;
- a version's files are checked against the sha256 in its version.json whenever they are used: a file
  damaged in the registry is refused, never sent to a replica;
- state.json is replaced whole (a local file by rename, an object by one PUT), so a reader sees the
  old or the new state, never a mix; every change of state is also an event;
- one loop per registry: a local registry is locked with flock (released by the kernel when the loop
  dies, however it dies); an object-store registry holds a lease object renewed by the running loop and
  taken over once it is older than its lease time. An agent locks its replica's agent.lock the same way;
  the loop and the agents share nothing but these files, each written by one process only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from capture_format.files import write_file_atomically
from capture_format.object_store import is_remote, parse_location
from trainer.run_folder import sha256_file

VERSION_FILE = "version.json"
STATE_FILE = "state.json"
LOCK_FILE = "loop.lock"
VERSION_NAME = re.compile(r"v(\d{4,})")
STATES = ("candidate", "promoting", "promoted", "superseded", "rejected", "rolled_back", "abandoned")
"""A version's states: made and under the gate; passed it, being swapped in; served; replaced by a newer
promoted one; refused by the gate (or by a check before any replica was touched); failed verification on the
first replica and put back; left behind by a loop that stopped before deciding."""

DRAFT_FILES = ("config.json", "model.safetensors")
"""Files a version must hold (an export's README.md and eval.json are kept when present)."""


class RegistryError(ValueError):
    """The registry cannot do what was asked; the message says why."""


class RegistryLocked(RegistryError):
    """Another loop holds this registry."""


def version_name(number: int) -> str:
    return f"v{number:04d}"


def user_cache_dir() -> Path:
    """Where versions fetched from an object-store registry are kept on this host ($EAGLE_TAP_CACHE_DIR, or
    ~/.cache/eagle-tap)."""
    return Path(os.environ.get("EAGLE_TAP_CACHE_DIR", Path.home() / ".cache" / "eagle-tap"))


def replica_key(url: str) -> str:
    """The folder name of a replica under agents/: its URL with every run of other characters than letters and
    digits made one `_` (http://10.0.0.5:30000 -> http_10_0_0_5_30000)."""
    return re.sub(r"[^A-Za-z0-9]+", "_", url).strip("_")


class _Store:
    """Named blobs under a folder or an object-store prefix: read, write whole, list, delete."""

    def __init__(self, root: str | Path, *, create: bool) -> None:
        self.url = str(root)
        self.remote = is_remote(str(root))
        if self.remote:
            from capture_format.object_store import s3_filesystem

            self.location = parse_location(str(root))
            self.fs = s3_filesystem()
        else:
            self.root = Path(root)
            if create:
                self.root.mkdir(parents=True, exist_ok=True)
            elif not self.root.is_dir():
                raise RegistryError(f"{root} is not a registry folder (no such folder)")

    def _path(self, name: str) -> str:
        return self.location.path(name) if self.remote else str(self.root / name)

    def read(self, name: str) -> bytes | None:
        try:
            if self.remote:
                return self.fs.cat_file(self._path(name))
            return (self.root / name).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes) -> None:
        """Whole or not at all: a local file is written beside and renamed (after fsync); an object is one PUT."""
        if self.remote:
            self.fs.pipe_file(self._path(name), data)
            return
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomically(path, data)

    def put_file(self, local: Path, name: str) -> None:
        if self.remote:
            self.fs.put_file(str(local), self._path(name))
            return
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, path)
        with open(path, "rb+") as file:
            os.fsync(file.fileno())

    def get_file(self, name: str, local: Path) -> None:
        if self.remote:
            self.fs.get_file(self._path(name), str(local))
        else:
            shutil.copyfile(self.root / name, local)

    def names(self, folder: str = "") -> list[str]:
        """Names directly under folder (files and sub-folders), sorted."""
        if self.remote:
            try:
                listing = self.fs.ls(self._path(folder), detail=False, refresh=True)
            except FileNotFoundError:
                return []
            return sorted(item.rstrip("/").rsplit("/", 1)[-1] for item in listing)
        path = self.root / folder
        return sorted(child.name for child in path.iterdir()) if path.is_dir() else []

    def remove_folder(self, folder: str) -> None:
        if self.remote:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self._path(folder), recursive=True)
        else:
            shutil.rmtree(self.root / folder, ignore_errors=True)


@dataclasses.dataclass(frozen=True, slots=True)
class Version:
    """One stored version: its name and its version.json."""

    name: str
    info: dict[str, Any]

    @property
    def parent(self) -> str | None:
        return self.info.get("parent")


class Registry:
    """A registry opened by one loop (lock()) or by a reader (loop status: no lock)."""

    def __init__(self, root: str | Path, *, cache_dir: str | Path | None = None, create: bool = True) -> None:
        self.url = str(root)
        self.store = _Store(root, create=create)
        default_cache = Path(self.url) / ".local" if not self.store.remote else user_cache_dir() / "registry"
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache
        self._lock_file: Any = None
        self._lock_name = LOCK_FILE

    # ----------------------------------------------------------------------------------------------- lock
    def lock(self, *, lease_s: float = 120.0, name: str = LOCK_FILE) -> None:
        """Take the registry for this process; RegistryLocked names who holds it. name: the lock taken (an agent
        takes its replica's `agents/<replica>/agent.lock`, which lets it write that replica's files only)."""
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "at": time.time()}
        self._lock_name = name
        what = "another loop" if name == LOCK_FILE else "another agent"
        if not self.store.remote:
            import fcntl

            (self.store.root / name).parent.mkdir(parents=True, exist_ok=True)
            self._lock_file = open(self.store.root / name, "a+")  # noqa: SIM115 (held until unlock)
            try:
                fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._lock_file.seek(0)
                holder = self._lock_file.read().strip()
                self._lock_file.close()
                self._lock_file = None
                raise RegistryLocked(f"{what} runs on {self.url}/{name} ({holder or 'owner unknown'})") from None
            self._lock_file.seek(0)
            self._lock_file.truncate()
            self._lock_file.write(json.dumps(owner) + "\n")
            self._lock_file.flush()
        else:
            held = self.store.read(name)
            if held:
                holder = json.loads(held)
                if time.time() - float(holder.get("at", 0)) < float(holder.get("lease_s", lease_s)):
                    raise RegistryLocked(f"{what} runs on {self.url}/{name} ({holder}); its lease ends "
                                         f"{float(holder['at']) + float(holder.get('lease_s', lease_s)) - time.time():.0f} s "
                                         "after its last renewal")
            owner["lease_s"] = lease_s
            owner["token"] = os.urandom(8).hex()
            self.store.write(name, json.dumps(owner).encode())
            if json.loads(self.store.read(name) or b"{}").get("token") != owner["token"]:
                raise RegistryLocked(f"{what} took {self.url}/{name} at the same moment")
            self._lock_file = owner
        if name == LOCK_FILE:
            self.remove_partial_versions()

    def renew(self) -> None:
        """Keep an object-store lease alive (a local flock needs nothing); call at least every lease/2."""
        if self.store.remote and isinstance(self._lock_file, dict):
            held = json.loads(self.store.read(self._lock_name) or b"{}")
            if held.get("token") != self._lock_file["token"]:
                raise RegistryLocked(f"the lease on {self.url}/{self._lock_name} was taken over by {held}")
            self._lock_file["at"] = time.time()
            self.store.write(self._lock_name, json.dumps(self._lock_file).encode())

    def unlock(self) -> None:
        if self._lock_file is None:
            return
        if self.store.remote:
            held = json.loads(self.store.read(self._lock_name) or b"{}")
            if held.get("token") == self._lock_file["token"]:
                with contextlib.suppress(Exception):
                    self.store.fs.rm(self.store._path(self._lock_name))
        else:
            self._lock_file.close()
        self._lock_file = None

    def __enter__(self) -> Registry:
        self.lock()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.unlock()

    def _require_lock(self, name: str = LOCK_FILE) -> None:
        if self._lock_file is None or self._lock_name != name:
            raise RegistryError(f"{self.url} is open for reading only; take the lock ({name}) to change it")

    # --------------------------------------------------------------------------------------------- versions
    def version_names(self) -> list[str]:
        """Stored versions (with their version.json), oldest first."""
        names = [name for name in self.store.names() if VERSION_NAME.fullmatch(name)]
        return [name for name in names if VERSION_FILE in self.store.names(name)]

    def remove_partial_versions(self) -> list[str]:
        """Delete version folders without version.json (a loop stopped while writing one); their names."""
        self._require_lock()
        partial = [name for name in self.store.names()
                   if VERSION_NAME.fullmatch(name) and VERSION_FILE not in self.store.names(name)]
        for name in partial:
            self.store.remove_folder(name)
            self.event("removed_partial_version", version=name,
                       why="a version folder without version.json: the loop stopped while writing it")
        return partial

    def version(self, name: str) -> Version:
        data = self.store.read(f"{name}/{VERSION_FILE}")
        if data is None:
            raise RegistryError(f"{self.url} has no version {name}")
        return Version(name, json.loads(data))

    def add_version(self, draft_dir: str | Path, *, parent: str | None, made: dict[str, Any],
                    evaluation: dict[str, Any] | None = None, state: str = "candidate") -> Version:
        """Store an exported draft folder as the next version (files first, version.json last) in `state`."""
        self._require_lock()
        draft_dir = Path(draft_dir)
        missing = [name for name in DRAFT_FILES if not (draft_dir / name).is_file()]
        if missing:
            raise RegistryError(f"{draft_dir} is not an exported draft: it lacks {', '.join(missing)}")
        numbers = [int(VERSION_NAME.fullmatch(name).group(1)) for name in self.store.names()
                   if VERSION_NAME.fullmatch(name)]
        name = version_name(max(numbers, default=0) + 1)
        files = {}
        for path in sorted(draft_dir.iterdir()):
            if path.is_file() and not path.name.startswith("."):
                files[path.name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
                self.store.put_file(path, f"{name}/{path.name}")
        info = {"version": name, "parent": parent, "created_at": time.time(), "files": files, "made": made,
                "eval": evaluation or {}}
        self.store.write(f"{name}/{VERSION_FILE}", json.dumps(info, indent=2).encode())
        self.update_state(lambda state_doc: state_doc["versions"].__setitem__(
            name, {"state": state, "at": time.time(), "why": "registered"}))
        self.event("registered", version=name, parent=parent, state=state)
        return Version(name, info)

    def set_version_info(self, name: str, **fields: Any) -> Version:
        """Add fields to a version's version.json (its eval, the probe figures): never its files."""
        self._require_lock()
        info = {**self.version(name).info, **fields}
        self.store.write(f"{name}/{VERSION_FILE}", json.dumps(info, indent=2).encode())
        return Version(name, info)

    def local_copy(self, name: str) -> Path:
        """A local folder with the version's files, each checked against its sha256 (RegistryError if one
        differs: a damaged version is never handed out)."""
        version = self.version(name)
        folder = self.cache_dir / name if self.store.remote else self.store.root / name
        folder.mkdir(parents=True, exist_ok=True)
        for file_name, expected in version.info["files"].items():
            path = folder / file_name
            if self.store.remote and (not path.exists() or path.stat().st_size != expected["bytes"]):
                self.store.get_file(f"{name}/{file_name}", path)
            if not path.is_file():
                raise RegistryError(f"{name}/{file_name} is missing from {self.url}")
            digest = sha256_file(path)
            if digest != expected["sha256"]:
                if self.store.remote:
                    path.unlink()
                raise RegistryError(f"{name}/{file_name} in {self.url} is damaged: sha256 {digest[:16]}..., "
                                    f"its version.json says {expected['sha256'][:16]}...")
        return folder

    # ------------------------------------------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        data = self.store.read(STATE_FILE)
        state = json.loads(data) if data else {}
        state.setdefault("schema", 1)
        state.setdefault("promoted", None)
        state.setdefault("versions", {})
        state.setdefault("replicas", {})
        state.setdefault("pending", None)
        return state

    def update_state(self, change) -> dict[str, Any]:
        """Read state.json, apply change(state) in place, write it back whole; returns the new state."""
        self._require_lock()
        state = self.state()
        change(state)
        state["updated_at"] = time.time()
        self.store.write(STATE_FILE, json.dumps(state, indent=2).encode())
        return state

    def set_version_state(self, name: str, new_state: str, why: str, **details: Any) -> None:
        if new_state not in STATES:
            raise RegistryError(f"unknown version state {new_state!r}; one of {', '.join(STATES)}")

        def change(state: dict[str, Any]) -> None:
            state["versions"][name] = {"state": new_state, "at": time.time(), "why": why, **details}
            if new_state == "promoted":
                previous = state["promoted"]
                if previous and previous != name:
                    state["versions"][previous] = {**state["versions"].get(previous, {}), "state": "superseded",
                                                   "at": time.time(), "why": f"{name} promoted"}
                state["promoted"] = name

        self.update_state(change)
        self.event(new_state, version=name, why=why, **details)

    # ----------------------------------------------------------------------------------------------- events
    def event(self, kind: str, **details: Any) -> dict[str, Any]:
        """Write one decision down, numbered after the last one in events/ (only the lock holder writes)."""
        self._require_lock()
        return self._append_event("events", {"kind": kind, **details})

    def events(self, *, since: int = 0) -> Iterator[dict[str, Any]]:
        return self._read_events("events", since)

    def _append_event(self, folder: str, fields: dict[str, Any]) -> dict[str, Any]:
        """The next numbered event in folder (one writer per folder: the loop's events/, an agent's own)."""
        numbers = [int(name.split(".")[0]) for name in self.store.names(folder) if name.endswith(".json")]
        record = {"event": max(numbers, default=0) + 1, "at": time.time(), **fields}
        self.store.write(f"{folder}/{record['event']:06d}.json", json.dumps(record, default=str).encode())
        return record

    def _read_events(self, folder: str, since: int) -> Iterator[dict[str, Any]]:
        for name in self.store.names(folder):
            if name.endswith(".json") and int(name.split(".")[0]) > since:
                data = self.store.read(f"{folder}/{name}")
                if data:
                    yield json.loads(data)

    # ----------------------------------------------------------------------------------------------- agents
    def agent_replicas(self) -> dict[str, dict[str, Any]]:
        """url -> replica.json of every replica an agent keeps (read by the loop and `loop status`, no lock)."""
        out = {}
        for key in self.store.names("agents"):
            data = self.store.read(f"agents/{key}/replica.json")
            if data:
                record = json.loads(data)
                out[record["url"]] = record
        return out

    def agent_replica(self, url: str) -> dict[str, Any] | None:
        data = self.store.read(f"agents/{replica_key(url)}/replica.json")
        return json.loads(data) if data else None

    def agent_lock_name(self, url: str) -> str:
        return f"agents/{replica_key(url)}/agent.lock"

    def write_agent_replica(self, url: str, record: dict[str, Any]) -> None:
        """Replace url's replica.json whole (only the agent holding url's agent.lock)."""
        self._require_lock(self.agent_lock_name(url))
        self.store.write(f"agents/{replica_key(url)}/replica.json",
                         json.dumps({**record, "url": url, "at": time.time()}, indent=2, default=str).encode())

    def agent_event(self, url: str, kind: str, **details: Any) -> dict[str, Any]:
        """What an agent did to url, numbered in agents/<replica>/events/ (only that agent writes there)."""
        self._require_lock(self.agent_lock_name(url))
        return self._append_event(f"agents/{replica_key(url)}/events", {"kind": kind, "replica": url, **details})

    def agent_events(self, url: str, *, since: int = 0) -> Iterator[dict[str, Any]]:
        return self._read_events(f"agents/{replica_key(url)}/events", since)

    # ----------------------------------------------------------------------------------------------- rounds
    def round_names(self) -> list[str]:
        return [name[: -len(".json")] for name in self.store.names("rounds") if name.endswith(".json")]

    def write_round(self, name: str, info: dict[str, Any]) -> None:
        self._require_lock()
        self.store.write(f"rounds/{name}.json", json.dumps(info, indent=2, default=str).encode())

    def read_round(self, name: str) -> dict[str, Any]:
        data = self.store.read(f"rounds/{name}.json")
        if data is None:
            raise RegistryError(f"{self.url} has no round {name}")
        return json.loads(data)

    def counted_rounds(self) -> list[dict[str, Any]]:
        """The round files whose records count as used, oldest first: all but those of a version abandoned by a
        stopped loop (a round file with decision "promote" is written before the promotion starts, so a loop
        killed in between leaves its version a candidate; abandoned, its records are new again)."""
        abandoned = {name for name, entry in self.state()["versions"].items() if entry.get("state") == "abandoned"}
        infos = [self.read_round(name) for name in self.round_names()]
        return [info for info in infos if info.get("version") not in abandoned]

    def used_record_ids(self, rounds: list[dict[str, Any]] | None = None) -> set[str]:
        """Every record a finished round trained on or held out: the records that are no longer new. rounds: what
        counted_rounds() returned, when the caller has it already."""
        used: set[str] = set()
        for info in self.counted_rounds() if rounds is None else rounds:
            used.update(info.get("new_record_ids", ()))
            used.update(info.get("heldout_record_ids", ()))
        return used
