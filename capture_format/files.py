"""Writing a file so that a reader (or a crash) sees either the old content or the new, never a mix.

What must hold: the data goes to a temporary file `.NAME.PID.tmp` in the same folder and is renamed
over the target, so a reader sees the old file or the whole new one; with durable=True (the default)
the file is fsynced before the rename and the folder after it, so the new file also survives a crash.
A failed write leaves no temp file behind.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_file_atomically"]


def write_file_atomically(path: Path | str, data: bytes | str, *, durable: bool = True) -> None:
    """Replaces path with data (str is written as UTF-8): temp file, fsync, rename, directory fsync.
    durable=False skips both fsyncs (a status file rewritten often, where only atomicity matters)."""
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    temp_path = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temp_path, "wb") as file:
            file.write(payload)
            if durable:
                file.flush()
                os.fsync(file.fileno())
        os.replace(temp_path, path)
    except BaseException:
        temp_path.unlink(missing_ok=True)
        raise
    if durable:
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
