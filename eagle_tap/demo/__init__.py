"""The conversations `make demo` fires at the tiny target model.

`CONVERSATIONS_PATH` is a committed JSONL file, one `{"id", "kind", "messages"}` row a line: the data
itself is the source (edit it directly; tests/test_demo_conversations.py checks every row).
Importing this package must stay cheap: no torch, no transformers.
"""

from pathlib import Path

CONVERSATIONS_PATH: Path = Path(__file__).resolve().parent / "conversations.jsonl"
"""Conversations in OpenAI messages form, readable by `eagle-tap fire --data`."""

__all__ = ["CONVERSATIONS_PATH"]
