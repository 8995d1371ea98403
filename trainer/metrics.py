"""Training metrics: one JSON object per line in metrics.jsonl, and PNG plots of loss and accuracy.

Lines have `kind` "train" (step, loss, step_losses, step_accuracy, learning_rate, grad_norm, ...)
or "eval" (step, step_accuracy, step_losses, num_tokens). A resumed run first drops the lines of steps after
its checkpoint, so the file reads as one uninterrupted run.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any


def read_metrics(path: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        return []
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [line for line in lines if kind is None or line.get("kind") == kind]


class MetricsLog:
    """Appends metric lines (only on the main rank: enabled=False elsewhere)."""

    def __init__(self, path: Path, *, enabled: bool, resume_step: int | None = None) -> None:
        self.path, self.enabled = path, enabled
        if enabled and resume_step is not None and path.is_file():
            kept = [line for line in read_metrics(path) if line["step"] <= resume_step]
            path.write_text("".join(json.dumps(line) + "\n" for line in kept), encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with self.path.open("a", encoding="utf-8") as file:
                file.write(json.dumps(record) + "\n")


def write_plots(metrics_path: Path, out_dir: Path) -> bool:
    """loss.png and accuracy.png from metrics.jsonl; False (with a warning) without matplotlib or data."""
    train = read_metrics(metrics_path, "train")
    if not train:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed (pip install 'eagle-tap[trainer]'); no plots", stacklevel=2)
        return False
    steps = [line["step"] for line in train]
    num_ttt_steps = len(train[0]["step_losses"])
    evals = read_metrics(metrics_path, "eval")
    tokens_per_step = sum(line.get("num_loss_tokens", 0) for line in train) / len(train)
    records_per_step = sum(line.get("num_records", 0) for line in train) / len(train)
    counts = f"{records_per_step:,.0f} records, {tokens_per_step:,.0f} loss tokens per optimizer step"
    panels = (("loss.png", "step_losses", "cross-entropy vs the target (nats per token)", "loss"),
              ("accuracy.png", "step_accuracy", "top-1 agreement with the target (fraction of tokens)", "accuracy"))
    for name, key, ylabel, title in panels:
        num_panels = 2 if key == "step_losses" else 1
        figure, axes = plt.subplots(1, num_panels, figsize=(6 * num_panels, 4.5), squeeze=False)
        axis = axes[0, -1]
        for i in range(num_ttt_steps):
            axis.plot(steps, [line[key][i] for line in train], label=f"TTT step {i}", alpha=0.8)
        held_out = [line for line in evals if key in line]
        if held_out:  # a curve when there are several evaluations, a marked point for a single one
            eval_steps = [line["step"] for line in held_out]
            axis.plot(eval_steps, [line[key][0] for line in held_out], "ko-", label="held-out, TTT step 0")
            axis.plot(eval_steps, [sum(line[key]) / len(line[key]) for line in held_out], "ks--",
                      label=f"held-out, mean of steps ({held_out[-1]['num_tokens']:,} tokens)")
        if num_panels == 2:  # the weighted total is several times a step's loss: its own panel
            axes[0, 0].plot(steps, [line["loss"] for line in train], color="black")
            axes[0, 0].set_title("weighted total loss (sum over TTT steps)")
            axes[0, 0].set_ylabel("nats per token, weighted sum")
        for panel in axes[0]:
            panel.set_xlabel("optimizer step")
            panel.grid(True, alpha=0.3)
        axis.set_ylabel(ylabel)
        axis.set_title(f"{title} per TTT step\n{counts}", fontsize=10)
        axis.legend(fontsize=7, ncol=2)
        figure.tight_layout()
        figure.savefig(out_dir / name, dpi=100)
        plt.close(figure)
    return True
