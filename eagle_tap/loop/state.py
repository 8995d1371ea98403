"""What a loop's rounds, watch and evaluation read and change of it: its config, its registry, where it writes
what it says, and what it has seen. `eagle_tap.loop.run.Loop` is one; they take it as this type, so none of
them imports the loop (no circle: run -> rounds, watch, evaluation -> state)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from eagle_tap.loop.config import LoopConfig
from eagle_tap.loop.registry import Registry

__all__ = ["LoopState"]


@dataclasses.dataclass(kw_only=True)
class LoopState:
    config: LoopConfig
    registry: Registry
    say: Callable[[str], Any]
    """Writes one line of what the loop does (print, or a test's list)."""
    first_seen: dict[str, float] = dataclasses.field(default_factory=dict)
    """record id -> when this loop first saw it (the age trigger)."""
    watched: set[str] = dataclasses.field(default_factory=set)
    """Record ids a window already counted."""
    probe_prompt_cache: list | None = None
    """The probe's prompts, read once from the regression set."""
