"""Dataset readers: JSONL, Parquet or a local Hugging Face `datasets` folder -> `Conversation`s.

What must hold:
- every row read yields exactly one item: a `Conversation` or a `BadRow` naming the source, the
  1-based line (JSONL) or row (Parquet, datasets) number and what is wrong; a bad row never raises;
- accepted row shapes: OpenAI `{"messages": [{"role", "content"}, ...]}`, ShareGPT
  `{"conversations": [{"from", "value"}, ...]}` (a top-level `"system"` string is prepended), and
  `{"prompt": str, "response"|"completion": str}`; content is a string or a list of text parts and, in
  user and system messages, OpenAI `image_url` parts (a data URL, an http(s) URL, or a local file, read
  here, relative to the data file's folder): such a message's content holds `IMAGE_MARK` where each
  image was and its `images` the images as data URLs (or the URL), in order;
- a conversation's `key` is a digest of its normalized messages, so it does not depend on where the
  row is in the file: a resumed run finds the same key for the same conversation.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["IMAGE_MARK", "BadRow", "Conversation", "count_rows", "data_format", "messages_from_row",
           "read_conversations"]

IMAGE_MARK = "<eagle-tap:image>"
"""Where an image part was in a message's text; the chat tokenizer puts the target's placeholder there."""
MAX_IMAGE_NBYTES = 20 << 20
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp",
               ".gif": "image/gif", ".bmp": "image/bmp"}

ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant", "chatgpt": "assistant", "bot": "assistant",
}
"""Roles and ShareGPT `from` values accepted, and the chat-template role each one becomes."""


class BadRowError(ValueError):
    """A row whose shape is not one of the accepted conversation shapes."""


@dataclasses.dataclass(frozen=True, slots=True)
class Conversation:
    """One dataset row as chat messages, with where it came from."""

    messages: tuple[dict[str, str], ...]
    """`{"role": ..., "content": ...}` dicts (assistant messages may carry `reasoning_content`)."""
    source: str
    """File or folder name the row was read from."""
    line: int
    """1-based line (JSONL) or row (Parquet, datasets) number."""
    key: str
    """Digest of the normalized messages: the sample's stable identity across runs."""


@dataclasses.dataclass(frozen=True, slots=True)
class BadRow:
    """A row that was skipped, and why."""

    source: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: bad row: {self.reason}"


def _image_url(part: Mapping, where: str, base_dir: Path | None) -> str:
    """The image of an `image_url` part as a URL SGLang loads: a data URL (a local file is read into one)."""
    entry = part.get("image_url")
    url = entry.get("url") if isinstance(entry, Mapping) else entry
    if not isinstance(url, str) or not url:
        raise BadRowError(f"{where}: an image_url part needs {{\"image_url\": {{\"url\": ...}}}}, got "
                          f"{str(part)[:60]!r}")
    if url.startswith(("data:image/", "http://", "https://")):
        return url
    path = Path(url.removeprefix("file://"))
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    kind = IMAGE_TYPES.get(path.suffix.lower())
    if kind is None:
        raise BadRowError(f"{where}: image {url[:80]!r} is not a data URL, an http(s) URL or an image file "
                          f"({', '.join(IMAGE_TYPES)})")
    try:
        size = path.stat().st_size
        if size > MAX_IMAGE_NBYTES:
            raise BadRowError(f"{where}: image {url[:80]!r} is {size} bytes; at most {MAX_IMAGE_NBYTES} are sent")
        data = path.read_bytes()
    except OSError as err:
        raise BadRowError(f"{where}: cannot read image {url[:80]!r}: {err.strerror or err}") from None
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def _content(content: object, where: str, base_dir: Path | None, images_allowed: bool) -> tuple[str, list[str]]:
    """(text with IMAGE_MARK at each image, the images' URLs in order)."""
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(content, list):  # OpenAI content parts
        texts, images = [], []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text" and isinstance(part.get("text"), str):
                if IMAGE_MARK in part["text"]:
                    raise BadRowError(f"{where}: the text holds {IMAGE_MARK!r}, which marks images here")
                texts.append(part["text"])
            elif kind == "image_url" and images_allowed:
                images.append(_image_url(part, where, base_dir))
                texts.append(IMAGE_MARK)
            else:
                accepted = "text and image_url" if images_allowed else "text"
                raise BadRowError(f"{where}: only {accepted} content parts are supported here, got {str(part)[:60]!r}")
        return "".join(texts), images
    raise BadRowError(f"{where}: content must be a string or a list of content parts, got {type(content).__name__}")


def _message(entry: object, index: int, role_key: str, content_key: str,
             base_dir: Path | None = None) -> dict[str, Any]:
    where = f"message {index}"
    if not isinstance(entry, Mapping):
        raise BadRowError(f"{where} must be an object, got {type(entry).__name__}")
    if role_key not in entry or content_key not in entry:
        raise BadRowError(f"{where} needs {role_key!r} and {content_key!r}, has {sorted(entry)}")
    raw_role = entry[role_key]
    role = ROLE_ALIASES.get(raw_role.lower()) if isinstance(raw_role, str) else None
    if role is None:
        raise BadRowError(f"{where}: unknown role {raw_role!r}; accepted: {', '.join(ROLE_ALIASES)}")
    text, images = _content(entry[content_key], where, base_dir, images_allowed=role != "assistant")
    message: dict[str, Any] = {"role": role, "content": text}
    if images:
        message["images"] = images
    reasoning = entry.get("reasoning_content")
    if role == "assistant" and isinstance(reasoning, str) and reasoning:
        message["reasoning_content"] = reasoning
    return message


def messages_from_row(row: object, base_dir: Path | None = None) -> list[dict[str, Any]]:
    """The row's messages in chat-template form (image files relative to base_dir); raises `BadRowError`
    saying what is wrong."""
    if not isinstance(row, Mapping):
        raise BadRowError(f"a row must be a JSON object, got {type(row).__name__}")
    if "messages" in row:
        entries, role_key, content_key = row["messages"], "role", "content"
    elif "conversations" in row:
        entries = row["conversations"]
        first = entries[0] if isinstance(entries, list) and entries else None
        use_from = isinstance(first, Mapping) and "from" in first
        role_key, content_key = ("from", "value") if use_from else ("role", "content")
    elif "prompt" in row:
        answer = row.get("response", row.get("completion"))
        entries = [{"role": "user", "content": row["prompt"]}]
        if answer is not None:
            entries.append({"role": "assistant", "content": answer})
        role_key, content_key = "role", "content"
    else:
        raise BadRowError(f"no conversation: expected 'messages', 'conversations' or 'prompt', found {sorted(row)[:8]}")
    if not isinstance(entries, list) or not entries:
        raise BadRowError("the conversation must be a non-empty list of messages")
    messages = [_message(entry, index, role_key, content_key, base_dir) for index, entry in enumerate(entries)]
    first_turn = next((message["role"] for message in messages if message["role"] != "system"), None)
    if first_turn == "assistant":
        raise BadRowError("the conversation starts with an assistant message; it must start with a user message")
    system = row.get("system")
    if isinstance(system, str) and system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return messages


def conversation_key(messages: list[dict[str, str]]) -> str:
    """24 hex digits of a digest of the canonical JSON of `messages`."""
    canonical = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=12).hexdigest()


def _item(row: object, source: str, line: int, base_dir: Path | None = None) -> Conversation | BadRow:
    try:
        messages = messages_from_row(row, base_dir)
    except BadRowError as err:
        return BadRow(source, line, str(err))
    return Conversation(tuple(messages), source, line, conversation_key(messages))


def _read_jsonl(path: Path) -> Iterator[Conversation | BadRow]:
    with open(path, "rb") as file:
        for line_number, raw in enumerate(file, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                # json's own "line 1" would name the line inside this one row: give only the column
                where = f" at column {err.colno}" if isinstance(err, json.JSONDecodeError) else ""
                reason = err.msg if isinstance(err, json.JSONDecodeError) else str(err)
                yield BadRow(path.name, line_number, f"not valid JSON{where}: {reason}")
                continue
            yield _item(row, path.name, line_number, path.parent)


def _read_parquet(path: Path) -> Iterator[Conversation | BadRow]:
    import pyarrow.parquet as pq

    row_number = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            row_number += 1
            yield _item(row, path.name, row_number, path.parent)


def _load_hf_folder(path: Path, split: str | None) -> Any:
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split is None and len(loaded) == 1:
            split = next(iter(loaded))
        if split not in loaded:
            raise ValueError(f"{path} holds splits {sorted(loaded)}; choose one with --data-split")
        return loaded[split]
    return loaded


def _read_hf_folder(path: Path, split: str | None) -> Iterator[Conversation | BadRow]:
    for row_number, row in enumerate(_load_hf_folder(path, split), start=1):
        yield _item(row, path.name, row_number, path)


JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


def data_format(path: Path) -> str:
    """`jsonl`, `parquet` or `datasets` (a save_to_disk folder); ValueError saying what is accepted otherwise."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"no data at {path}")
    if path.is_dir():
        return "datasets"
    if path.suffix == ".parquet":
        return "parquet"
    if path.suffix in JSONL_SUFFIXES:
        return "jsonl"
    raise ValueError(f"unknown data format {path.name!r}; accepted: {', '.join(JSONL_SUFFIXES)} (one JSON object "
                     "a line), .parquet, or a datasets save_to_disk folder")


def read_conversations(path: Path, *, split: str | None = None) -> Iterator[Conversation | BadRow]:
    """Rows of `path` (JSON lines, Parquet, or a `save_to_disk` folder), in file order."""
    path = Path(path)
    kind = data_format(path)
    if kind == "datasets":
        return _read_hf_folder(path, split)
    if kind == "parquet":
        return _read_parquet(path)
    return _read_jsonl(path)


def count_rows(path: Path, *, split: str | None = None) -> int:
    """How many rows `read_conversations` will yield (for the progress bar); cheap for every format."""
    path = Path(path)
    kind = data_format(path)
    if kind == "datasets":
        return len(_load_hf_folder(path, split))
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    with open(path, "rb") as file:
        return sum(1 for raw in file if raw.strip())
