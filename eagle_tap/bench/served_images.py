"""Served images benchmark: drafts trained on text and image records of the tiny Kimi-K2.5, served on both kinds.

`eagle_tap.bench.draft_layouts` with images: `KimiK25ForConditionalGeneration` (its MoonViT tower and projector
run on SGLang's CPU path), half the conversations sending an image with the user turn. Reported per layout
and kind of request: simulated acceptance on the held-out records, SGLang's served acceptance on the same
conversations, their ratio, identical outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle_tap.bench import draft_layouts


@dataclass(kw_only=True, slots=True)
class Config(draft_layouts.Config):
    arch: str = "kimi_k25"
    images: bool = True

    @classmethod
    def quick(cls) -> Config:
        return cls(num_conversations=40, max_new_tokens=32, train_steps=60, served_max_new_tokens=16,
                   train_temperature=0.0)


def run(config: Config) -> dict[str, Any]:
    result = draft_layouts.run(config)
    result["title"] = "Served images: Llama and MLA drafts of the tiny Kimi-K2.5 on image and text requests"
    return result
