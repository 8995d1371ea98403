"""A bounded on-disk queue of encoded frames, for while the collector is unreachable.

Files are named `<sequence>.frame` with a zero-padded sequence number, written to a temp name and
renamed, so a crash never leaves a half frame under a real name; `oldest()` returns them in the order
they were spooled. Frames already in the spool when the process starts (a previous run's) are kept
and sent first.

What must hold: spooled frames hold hidden states and what is sent from here is trusted, so
the directory is private: it is created 0700, and at start it must be a real directory (not a
symlink) owned by this process's user with no group or other access, else `SpoolDirectoryError`
(capture stays off; serving goes on). Files are created exclusively, 0600, never through a symlink.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["Spool", "SpoolDirectoryError", "check_private_directory"]

_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class SpoolDirectoryError(ValueError):
    """The spool directory is not private to this user: another local user could read or inject frames."""


def check_private_directory(directory: Path) -> None:
    """Creates directory (0700) if missing; SpoolDirectoryError unless it is this user's, private, not a link."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(directory)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise SpoolDirectoryError(f"spool directory {directory} is a symlink or not a directory; "
                                  "set EAGLE_TAP_SPOOL_DIR to a private directory of this user")
    if info.st_uid != os.geteuid():
        raise SpoolDirectoryError(f"spool directory {directory} belongs to uid {info.st_uid}, not to this "
                                  f"process's uid {os.geteuid()}; set EAGLE_TAP_SPOOL_DIR to a directory of its own")
    if info.st_mode & 0o077:
        raise SpoolDirectoryError(f"spool directory {directory} has mode {stat.S_IMODE(info.st_mode):04o}; "
                                  f"it must be private: chmod 700 {directory}")


class Spool:
    """Frames waiting to be re-sent, oldest first, at most `max_bytes` in all."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        check_private_directory(directory)
        for leftover in directory.glob(".*.tmp"):
            leftover.unlink(missing_ok=True)
        self._paths = sorted(directory.glob("*.frame"))
        self._sizes = {path: os.lstat(path).st_size for path in self._paths}
        self.num_bytes = sum(self._sizes.values())
        self._next_sequence = int(self._paths[-1].stem) + 1 if self._paths else 0

    def __len__(self) -> int:
        return len(self._paths)

    def put(self, frame: bytes) -> bool:
        """Append a frame; False (nothing written) when it would exceed the bound."""
        if self.num_bytes + len(frame) > self.max_bytes:
            return False
        path = self.directory / f"{self._next_sequence:016d}.frame"
        temp = self.directory / f".{path.name}.tmp"
        descriptor = os.open(temp, _CREATE_FLAGS, 0o600)
        with open(descriptor, "wb") as file:
            file.write(frame)
        os.replace(temp, path)
        self._next_sequence += 1
        self._paths.append(path)
        self._sizes[path] = len(frame)
        self.num_bytes += len(frame)
        return True

    def oldest(self, max_bytes: int) -> list[tuple[Path, bytes]]:
        """The oldest frames, at least one and then as many as fit in max_bytes, oldest first."""
        entries: list[tuple[Path, bytes]] = []
        total = 0
        for path in self._paths:
            if entries and total + self._sizes[path] > max_bytes:
                break
            with open(os.open(path, _READ_FLAGS), "rb") as file:
                entries.append((path, file.read()))
            total += self._sizes[path]
        return entries

    def remove(self, path: Path) -> None:
        self._paths.remove(path)
        self.num_bytes -= self._sizes.pop(path)
        path.unlink()
