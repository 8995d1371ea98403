"""The model and tokenizer fingerprints: strings that change whenever what they cover changes.

Stored in every record, so the trainer can refuse to mix captures of different targets and a vocab
mapping can refuse a tokenizer it was not made for. Format: `<architecture>:<16 hex digits>`, a
sha256 over the canonical JSON of `config.json` and the bytes of the tokenizer files present.
The tokenizer fingerprint (`tok:<16 hex digits>`) covers only what decides token ids (the tokenizer
files, not the chat template, and the vocab size): vocab mappings and token-frequency files carry it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "tokenizer.model",
                   "special_tokens_map.json")


TOKENIZER_ID_FILES = (
    "tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "merges.txt", "added_tokens.json",
    "tokenizer_config.json", "special_tokens_map.json",
)  # the files that decide which id a token gets (not the chat template)


def _read_config(model_dir: Path) -> dict:
    config_path = model_dir / "config.json"
    try:
        return json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{model_dir} is not a Hugging Face model folder: cannot read {config_path} ({error})") from None


def tokenizer_fingerprint(model_dir: str | Path) -> str:
    """`tok:<16 hex>` over the tokenizer files that decide token ids, and the (text) vocab size."""
    model_dir = Path(model_dir)
    config = _read_config(model_dir)
    digest = hashlib.sha256(str((config.get("text_config") or config)["vocab_size"]).encode())
    found = [name for name in TOKENIZER_ID_FILES if (model_dir / name).is_file()]
    if not found:
        raise ValueError(f"{model_dir} holds no tokenizer file; expected one of {', '.join(TOKENIZER_ID_FILES)}")
    for name in found:
        digest.update(b"\0" + name.encode() + b"\0" + (model_dir / name).read_bytes())
    return f"tok:{digest.hexdigest()[:16]}"


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


def model_fingerprint_or_marker(model_path: str) -> str:
    """The model fingerprint, or a marker naming why it could not be computed (a hub id, say): what the
    plugin stamps on records when the model folder is not readable here."""
    try:
        return model_fingerprint(model_path)
    except ValueError:
        return f"unfingerprinted:{Path(model_path).name or model_path}"[:256]
