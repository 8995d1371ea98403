"""Served benchmark: a draft trained here, inside SGLang's EAGLE-3 speculative decoding, against no draft.

One run of the demo pipeline (`eagle_tap.demo.run`) on the bundled conversations: capture from a live
CPU server, train, evaluate offline, export, then answer the held-out conversations greedily with no
draft, the trained draft and the run's untrained initialisation, one server at a time. Reported per
draft: SGLang's acceptance length (tokens per verify step) next to the offline simulation at the
same chain length, the share of verify steps accepting each draft position, decode tokens/s with the
draft / without, and how many outputs equal the no-draft ones. On this CPU the tiny target's forward
costs little next to SGLang's per-step overhead, so the speed ratio is below 1 and is reported as
measured; on a GPU server, `eagle-tap eval-served` against the real target is the benchmark to run.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

COLUMNS = [
    ["item", "draft", "s"],
    ["served", "acceptance, served", ".3f"],
    ["simulated", "acceptance, simulated", ".3f"],
    ["position_1", "draft 1 accepted", ".3f"],
    ["position_last", "last draft accepted", ".3f"],
    ["decode_tokens_s", "decode tok/s (draft)", ".1f"],
    ["baseline_tokens_s", "decode tok/s (none)", ".1f"],
    ["speed_ratio", "speed ratio", ".2f"],
    ["identical", "identical outputs", "s"],
]


@dataclass(kw_only=True, slots=True)
class Config:
    """Size of the pipeline run behind the measurement."""

    num_conversations: int | None = None
    """Bundled conversations to use (None: all 321)."""
    train_steps: int = 600
    served_steps: int = 3
    """Draft tokens per verify step."""
    served_max_new_tokens: int = 48
    work_dir: str | None = None
    """Where the run goes (default: a temp dir, removed after)."""

    @classmethod
    def quick(cls) -> Config:
        return cls(num_conversations=96, train_steps=200, served_max_new_tokens=32)


@contextlib.contextmanager
def demo_run(config: Config) -> Iterator[tuple[Path, dict[str, Any]]]:
    """(the exported draft's folder, the demo's summary) of one demo run at config's size: the draft the
    benchmarks serve. The run's folder is removed on exit."""
    from eagle_tap.demo.run import Config as DemoConfig
    from eagle_tap.demo.run import run_demo

    with tempfile.TemporaryDirectory(prefix="eagle-tap-bench-served-", dir=config.work_dir) as work:
        summary = run_demo(DemoConfig(out_dir=Path(work) / "run", num_conversations=config.num_conversations,
                                      train_steps=config.train_steps, served_steps=config.served_steps,
                                      served_max_new_tokens=config.served_max_new_tokens))
        yield Path(summary["export"]["path"]), summary


def run(config: Config) -> dict[str, Any]:
    with demo_run(config) as (_, summary):
        served = summary["served"]
    rows = []
    for name, result in served["results"].items():
        rows.append({"item": name, "served": result["acceptance_length"],
                     "simulated": result["simulated_acceptance_length"],
                     "position_1": result["acceptance_rate_by_position"][0],
                     "position_last": result["acceptance_rate_by_position"][-1],
                     "decode_tokens_s": result["decode_tokens_per_s"]["draft"],
                     "baseline_tokens_s": result["decode_tokens_per_s"]["baseline"],
                     "speed_ratio": result["decode_speed_ratio"],
                     "identical": f"{result['num_identical_outputs']}/{result['num_prompts']}"})
    trained = served["results"]["draft"]
    notes = [
        f"{served['num_prompts']} held-out conversations, greedy, up to {served['max_new_tokens']} new tokens, "
        f"chain of {served['num_steps']} drafts (top-k 1); acceptance = tokens per verify step, SGLang's own "
        "spec_verify_ct / spec_num_correct_drafts; simulated = `eagle-tap eval` at the same chain length on the "
        "held-out captures.",
        f"The draft was trained for {summary['training']['steps']} steps on "
        f"{summary['conversations']['train']} captured conversations.",
        "Speed: tokens after the first / time after the first streamed token, one request at a time. The tiny "
        "CPU target makes each forward nearly free, so the draft's extra forwards cost more than they save here.",
    ]
    return {"title": "Served: the exported draft in SGLang's EAGLE-3 speculative decoding vs no draft",
            "parameters": asdict(config), "columns": COLUMNS, "rows": rows,
            "summary": {"served_acceptance": trained["acceptance_length"],
                        "simulated_acceptance": trained["simulated_acceptance_length"],
                        "decode_speed_ratio": trained["decode_speed_ratio"]},
            "notes": notes}
