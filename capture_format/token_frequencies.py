"""The token-frequency file: how often each target token id is a loss-masked (trained-on) token.

Written by the client (`eagle-tap fire`, RUN_DIR/token_frequencies.json) and by `eagle-tap vocab`
(next to its mapping); read by `eagle-tap vocab --frequencies` and by `eagle-tap eval` (the unigram
baseline). One definition here so both sides agree:

```json
{"format": "eagle-tap-token-frequencies", "version": 1, "vocab_size": 4096,
 "tokenizer_fingerprint": "tok:1f0c...", "num_records": 12, "num_tokens": 873,
 "counts": {"1": 12, "20": 31}}
```

What must hold: a file counted with one tokenizer is refused for another (its tokenizer fingerprint,
or its vocab size where the writer knew no fingerprint); every id lies in 0..vocab_size-1 and every
count is an int >= 0. A plain JSON object {token_id: count} is read too (nothing to cross-check).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from capture_format.files import write_file_atomically

__all__ = ["FORMAT_NAME", "FREQUENCIES_NAME", "read_token_frequencies", "write_token_frequencies"]

FREQUENCIES_NAME = "token_frequencies.json"
FORMAT_NAME = "eagle-tap-token-frequencies"


def write_token_frequencies(path: Path | str, counts: Mapping[int, int], *, vocab_size: int,
                            num_records: int | None, tokenizer_fingerprint: str | None) -> Path:
    """Writes the file atomically; counts maps token id -> count (zeros are left out)."""
    payload = {"format": FORMAT_NAME, "version": 1, "vocab_size": vocab_size,
               "tokenizer_fingerprint": tokenizer_fingerprint, "num_records": num_records,
               "num_tokens": int(sum(counts.values())),
               "counts": {str(token): int(count) for token, count in sorted(counts.items()) if count}}
    write_file_atomically(path, json.dumps(payload, indent=1) + "\n")
    return Path(path)


def read_token_frequencies(path: Path | str, *, vocab_size: int | None = None,
                           tokenizer_fingerprint: str | None = None) -> dict[int, int]:
    """token id -> count; ValueError if the file is not one, or was counted for another tokenizer."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read the frequency file {path}: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object {{token_id: count}}; got {type(data).__name__}")
    if "format" in data:
        if data["format"] != FORMAT_NAME:
            raise ValueError(f"{path} is not a token frequency file (format {data['format']!r}, want {FORMAT_NAME!r})")
        counted_with = data.get("tokenizer_fingerprint")
        if tokenizer_fingerprint and counted_with and counted_with != tokenizer_fingerprint:
            raise ValueError(f"{path} was counted with tokenizer {counted_with}; the target's is "
                             f"{tokenizer_fingerprint}. Count tokens with the target's tokenizer")
        if vocab_size is not None and not counted_with and data.get("vocab_size", vocab_size) != vocab_size:
            raise ValueError(f"{path} counts a vocab of {data['vocab_size']}; the target's is {vocab_size}")
        data = data["counts"]
    counts: dict[int, int] = {}
    for key, count in data.items():
        try:
            token_id = int(key)
        except ValueError:
            raise ValueError(f"{path}: key {key!r} is not a token id") from None
        in_range = token_id >= 0 and (vocab_size is None or token_id < vocab_size)
        if not in_range or not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"{path}: entry {key!r}: {count!r} needs an id in 0..{(vocab_size or 0) - 1} "
                             "and a count >= 0")
        counts[token_id] = counts.get(token_id, 0) + count
    return counts
