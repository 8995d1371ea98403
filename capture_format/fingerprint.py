"""The model fingerprint: one string that changes whenever the target's config or tokenizer changes.

Stored in every record, so the trainer can refuse to mix captures of different targets and a vocab
mapping can refuse a tokenizer it was not made for. Format: `<architecture>:<16 hex digits>`, a
sha256 over the canonical JSON of `config.json` and the bytes of the tokenizer files present.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "tokenizer.model",
                   "special_tokens_map.json")


def model_fingerprint(model_dir: str | Path) -> str:
    """Fingerprint of the HF model folder `model_dir` (must hold config.json)."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot fingerprint {model_dir}: {config_path} is missing or not JSON ({error})") from None
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    for name in TOKENIZER_FILES:
        path = model_dir / name
        if path.is_file():
            digest.update(b"\0" + name.encode() + b"\0" + path.read_bytes())
    architecture = (config.get("architectures") or ["unknown"])[0]
    return f"{architecture}:{digest.hexdigest()[:16]}"
