"""The typed settings of a training run (`eagle-tap train --config`), apart from the training loop, so that
everything that builds, checks or records a run's settings (warm starts, the loop's rounds, the demo, the
benchmarks) imports the type without importing the loop.

What must hold: every setting of a run is a field here or of the parts' configs it holds (data, objective);
`trainer.config_io` reads them from TOML/JSON plus dotted overrides and writes them back, and the settings
table (`python -m eagle_tap.settings_table`) is generated from these docstrings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.data import Config as DataConfig
from trainer.ttt import Config as ObjectiveConfig

__all__ = ["Config", "DataConfig", "ObjectiveConfig", "OptimizerConfig"]


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """AdamW with linear warmup and cosine decay (transformers' cosine schedule with a floor)."""

    learning_rate: float = 1e-4
    """Peak learning rate, reached after warmup_steps."""
    min_learning_rate_ratio: float = 0.1
    """The cosine ends at learning_rate * this, on the last of num_steps."""
    warmup_steps: int = 100
    """Steps of linear warmup to learning_rate (step k of them runs at k/warmup_steps of it)."""
    weight_decay: float = 0.0
    """Applied to matrices only, never to norms."""
    betas: tuple[float, ...] = (0.9, 0.95)
    """AdamW's (beta1, beta2)."""
    grad_clip_norm: float = 0.5
    """Clip the global gradient norm to this (0: no clipping)."""


@dataclass(kw_only=True, slots=True)
class Config:
    """Every setting of a training run."""

    target: str
    """Hugging Face folder of the target: config, tokenizer, embed_tokens and lm_head weights."""
    draft_config: str
    """The draft's config.json (`eagle-tap draft-config`)."""
    vocab: str
    """Vocab mapping directory (`eagle-tap vocab`)."""
    out_dir: str
    """Where checkpoints, metrics, plots and the final weights go."""
    data: DataConfig
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    num_steps: int = 1000
    """Optimizer steps of the whole run (the schedule spans them)."""
    stop_after_steps: int | None = None
    """Stop this invocation after so many steps (a job's time slot); --resume continues."""
    grad_accumulation_steps: int = 1
    """Batches per optimizer step (gradients summed, averaged over them)."""
    init_lm_head_from_target: bool = True
    """Start lm_head from the target's lm_head rows of the draft vocab (else random)."""
    checkpoint_every: int = 500
    """Steps between checkpoints (0: only at the end)."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept; older ones are deleted."""
    log_every: int = 10
    """Steps between lines of metrics.jsonl (the last step is always logged)."""
    eval_shards: str | None = None
    """Held-out shard directory: per-step accuracy every eval_every steps and at the end."""
    eval_every: int = 0
    """Steps between held-out evaluations during training (0: about ten times over the run, and at the end)."""
    eval_max_batches: int = 100
    """Held-out batches read per evaluation, at most."""
    seed: int = 0
    """Seeds the draft's initialisation (the data order has its own seed in data.seed)."""
    device: str = "auto"
    """auto (cuda when present), cpu or cuda."""
    bf16_autocast: bool = True
    """bf16 autocast on GPU: activations bf16, trained weights and AdamW fp32 (the master weights), the frozen
    target embedding and lm_head bf16 (on GPU whether or not this is set); CPU always runs fp32."""
    num_threads: int | None = None
    """torch CPU threads per process (None: torch's default)."""
    progress_bar: bool = True
    """Show a tqdm bar on the main rank."""
    log_record_ids: bool = False
    """Write the ids of the records each rank trained on to out_dir/record_ids.rank<r>.txt."""
    init_from: str | None = None
    """Warm start: a training run's out_dir (its final weights) or an exported draft folder whose trainable
    weights start this run (optimizer and schedule start fresh); it must fit the draft config, capture layers,
    target and vocab mapping. Not read on --resume (the checkpoint already holds weights that started from it)."""
    sequence_parallel: int = 1
    """Ranks that split each window's positions between them (trainer/sequence_parallel.py), for windows too long
    for one device: run torchrun with exactly this many processes; they form one replica (no DDP) and read the
    same batches. 1: off."""
    init_from_sha256: str | None = None
    """sha256 of init_from's model.safetensors: the run writes the one it read into out_dir/config.json; set
    beforehand, a source whose file differs is refused."""
