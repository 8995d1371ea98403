"""The settings of one loop (`eagle-tap loop --config`), apart from the loop, so that its rounds, watch and
evaluation (and the settings table) read the type without importing the loop that calls them."""

from __future__ import annotations

import dataclasses

__all__ = ["LoopConfig"]


@dataclasses.dataclass(kw_only=True, slots=True)
class LoopConfig:
    """Every setting of one loop (a TOML/JSON file plus dotted overrides, as `eagle-tap train` reads its own)."""

    registry: str
    """Folder or s3:// prefix of the draft registry."""
    shards: str
    """The shard set the collectors write (a folder or an s3:// prefix): where new records come from."""
    replicas: list[str] = dataclasses.field(default_factory=list)
    """Base URLs of the SGLang replicas serving the draft (on this host: see docs/loop.md)."""
    agent_replicas: list[str] = dataclasses.field(default_factory=list)
    """Base URLs of replicas kept by agents on their own hosts (`eagle-tap loop agent`) instead of by this
    loop (then `replicas` stays empty): the loop names the canary in state.json, waits for its agent's
    verdict, and promotes; the other agents follow the promoted version (docs/loop.md)."""
    canary_wait_s: float = 600.0
    """How long a promotion through agents waits for the canary's verdict before the tick goes on (the
    promotion stays pending; the next tick waits again)."""
    target: str
    """Hugging Face folder of the target the replicas serve."""
    draft_config: str
    """The draft config the first version was trained with (`eagle-tap draft-config`)."""
    vocab: str
    """The vocab mapping every version shares (`eagle-tap vocab`); a new mapping needs a restart."""
    work_dir: str
    """Local folder for each round's training run, export and evaluations."""
    regression_shards: str | None = None
    """A fixed shard set captured greedily: every candidate must not lose on it beyond regression_tolerance;
    its first probe_records records are the probe set."""
    num_steps: int = 3
    """Draft tokens per verify step the replicas serve with (the simulated chain compared with them)."""
    min_new_records: int = 64
    """A round starts once this many records arrived that no round used ..."""
    max_age_s: float | None = None
    """... or once the oldest of them waited this long (unset: count only), given more than min_heldout_records."""
    heldout_fraction: float = 0.25
    """The newest share of the new records is held out to judge the candidate, never trained on."""
    min_heldout_records: int = 4
    """Held out at least this many records, whatever the share."""
    replay_ratio: float = 1.0
    """Older records (from earlier rounds) per new record in the training mix."""
    train_steps: int = 200
    """Optimizer steps of each round's warm-started training."""
    batch_size: int = 8
    """Records per training batch (and per evaluation batch)."""
    max_length: int = 512
    """Positions per window in training and evaluation (a longer record is read as consecutive windows)."""
    learning_rate: float = 1e-3
    """Peak learning rate of a round (a warm start wants less than a first training)."""
    warmup_steps: int = 10
    """Linear warmup steps of a round."""
    ttt_steps: int = 7
    """Test-time-training unroll length while training."""
    gate_margin: float = 0.05
    """The candidate's served walk on the held-out new records must beat the promoted version's by this
    (tokens per verify step) ..."""
    regression_tolerance: float = 0.05
    """... and may fall below it on the regression set by at most this."""
    min_coverage: float = 0.8
    """Share of the new records' loss tokens the draft vocabulary must cover; below it the loop reports that
    a new mapping (a retrain and a restart) is needed, and trains no candidate."""
    probe_records: int = 6
    """Prompts of the probe after each swap: the first records of regression_shards (0: checksums only)."""
    probe_max_new_tokens: int = 48
    """Tokens generated per probe prompt (the served walk is simulated over as many)."""
    probe_tolerance: float = 0.2
    """After a swap the probe's served acceptance must reach (1 - this) x the version's simulated served walk."""
    train_num_threads: int | None = None
    """torch CPU threads of a round's training (None: torch's default); on a CPU shared with serving replicas, 1
    keeps training from fighting them for cores."""
    train_processes: int = 1
    """Processes a round's training runs on (torch DDP: each reads batch_size / train_processes records of every
    global batch, so the version equals a one-process round's within float tolerance). 1 with no train_launcher:
    in the loop's own process."""
    train_launcher: str | None = None
    """The command that starts a round's training, followed by `-m eagle_tap.cli train --config FILE` (FILE in
    work_dir): {python} is this interpreter, {processes} train_processes. None: `{python} -m torch.distributed.run
    --standalone --nproc-per-node {processes}` when train_processes > 1. To train on a GPU node, e.g. `ssh gpu-node
    torchrun --nproc-per-node {processes}`, with work_dir, the shards and the registry's inputs at the same paths
    there; the loop's host then only evaluates and decides."""
    poll_s: float = 10.0
    """Seconds between ticks of `eagle-tap loop run`."""
    seed: int = 0
    """Seeds the replay draw, the data order and the draft's initialisation."""

    def __post_init__(self) -> None:
        if self.replicas and self.agent_replicas:
            raise ValueError("a loop keeps its replicas itself (replicas) or through agents (agent_replicas), "
                             "not both: list each replica once, under the process that swaps it")
        if self.train_processes < 1 or self.batch_size % self.train_processes:
            raise ValueError(f"train_processes={self.train_processes} must be at least 1 and divide batch_size="
                             f"{self.batch_size}: each process reads batch_size / train_processes records of every "
                             "global batch")
