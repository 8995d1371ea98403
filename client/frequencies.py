"""Token frequencies over loss-masked tokens, saved in RUN_DIR for the vocab-mapping step.

The counts accumulate in the manifest as records are served (each record once, see manifest.py);
this module writes them out as `token_frequencies.json`, atomically (temp file, fsync, rename):

```json
{"format": "eagle-tap-token-frequencies", "version": 1, "vocab_size": 4096,
 "num_records": 12, "num_tokens": 873, "counts": {"1": 12, "20": 31, ...}}
```

`counts` maps a target token id (as a string) to how often it is a loss-masked token, i.e. a token
inside a span [start, end) of the unshifted sequence: exactly the tokens the draft is trained to predict.
The vocab-mapping step may use this file or recount from the shards.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["FREQUENCIES_NAME", "read_frequencies", "write_frequencies"]

FREQUENCIES_NAME = "token_frequencies.json"
FORMAT_NAME = "eagle-tap-token-frequencies"


def write_json_atomically(path: Path, payload: object) -> None:
    temp_path = path.with_name(f".{path.name}.tmp")
    with open(temp_path, "w", encoding="utf-8") as file:
        json.dump(payload, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temp_path, path)


def write_frequencies(run_dir: Path, counts: Mapping[int, int], *, vocab_size: int, num_records: int) -> Path:
    """Writes `token_frequencies.json` in `run_dir` and returns its path."""
    path = run_dir / FREQUENCIES_NAME
    write_json_atomically(path, {
        "format": FORMAT_NAME,
        "version": 1,
        "vocab_size": vocab_size,
        "num_records": num_records,
        "num_tokens": sum(counts.values()),
        "counts": {str(token): count for token, count in sorted(counts.items())},
    })
    return path


def read_frequencies(path: Path) -> dict[int, int]:
    """token id -> count, from a file written by `write_frequencies`."""
    payload = json.loads(Path(path).read_text())
    if payload.get("format") != FORMAT_NAME:
        raise ValueError(f"{path} is not a token frequency file "
                         f"(format {payload.get('format')!r}, want {FORMAT_NAME!r})")
    return {int(token): count for token, count in payload["counts"].items()}
