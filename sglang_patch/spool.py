"""A bounded on-disk queue of encoded frames, for while the collector is unreachable.

Files are named `<sequence>.frame` with a zero-padded sequence number, written to a temp name and
renamed, so a crash never leaves a half frame under a real name; `oldest()` returns them in the order
they were spooled. Frames already in the spool when the process starts (a previous run's) are kept
and sent first.
"""

from __future__ import annotations

from pathlib import Path

from capture_format.files import write_file_atomically


class Spool:
    """Frames waiting to be re-sent, oldest first, at most `max_bytes` in all."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        directory.mkdir(parents=True, exist_ok=True)
        for leftover in directory.glob(".*.tmp"):
            leftover.unlink(missing_ok=True)
        self._paths = sorted(directory.glob("*.frame"))
        self.num_bytes = sum(path.stat().st_size for path in self._paths)
        self._next_sequence = int(self._paths[-1].stem) + 1 if self._paths else 0

    def __len__(self) -> int:
        return len(self._paths)

    def put(self, frame: bytes) -> bool:
        """Append a frame; False (nothing written) when it would exceed the bound."""
        if self.num_bytes + len(frame) > self.max_bytes:
            return False
        path = self.directory / f"{self._next_sequence:016d}.frame"
        write_file_atomically(path, frame, durable=False)  # a crash may lose a spooled frame, never half of one
        self._next_sequence += 1
        self._paths.append(path)
        self.num_bytes += len(frame)
        return True

    def oldest(self) -> tuple[Path, bytes] | None:
        if not self._paths:
            return None
        path = self._paths[0]
        return path, path.read_bytes()

    def remove_oldest(self) -> None:
        path = self._paths.pop(0)
        self.num_bytes -= path.stat().st_size
        path.unlink()
