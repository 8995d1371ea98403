"""The conversations `make demo` fires at the tiny target model.

`CONVERSATIONS_PATH` is a committed JSONL file, one `{"id", "kind", "messages"}` row a line, written by
`python scripts/write_demo_conversations.py` (edit the content there and rerun it, never the file).
Importing this package must stay cheap: no torch, no transformers.
"""

from pathlib import Path

CONVERSATIONS_PATH: Path = Path(__file__).resolve().parent / "conversations.jsonl"
"""Conversations in OpenAI messages form, readable by `eagle-tap fire --data`."""

__all__ = ["CONVERSATIONS_PATH"]
