"""A draft folder next to its target: SGLang's flags to serve it with.

What must hold: a draft whose hidden size, target vocab, aux layer ids or tokenizer disagree with the
target is refused with one line naming the disagreement, before any process starts (SGLang itself
would start and then serve garbage, or fail on the first request): the launcher runs
`trainer.draft_fit.check_draft_fits(draft, target_dir=...)`, the one draft-fit check. The chain settings are
SGLang's: `--speculative-num-steps k --speculative-eagle-topk 1 --speculative-num-draft-tokens k + 1`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from trainer.draft_fit import DraftMismatchError

__all__ = ["DraftMismatchError", "SpeculativeConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SpeculativeConfig:
    """EAGLE-3 chain drafting (top-k 1) with one draft folder."""

    draft_dir: Path
    """The folder `eagle-tap export` wrote (config.json + model.safetensors)."""
    num_steps: int = 3
    """Draft tokens proposed per verify step (SGLang's --speculative-num-steps)."""

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"the number of draft steps must be at least 1; got {self.num_steps}")

    def server_args(self) -> tuple[str, ...]:
        """SGLang's flags for this chain: each verify step checks the last accepted token plus the drafts."""
        return ("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(self.draft_dir),
                "--speculative-num-steps", str(self.num_steps), "--speculative-eagle-topk", "1",
                "--speculative-num-draft-tokens", str(self.num_steps + 1))
