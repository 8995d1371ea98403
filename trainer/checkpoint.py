"""Checkpoints: everything a resumed run needs to continue as if never stopped.

    out_dir/checkpoints/step-00000300/
        state.pt          step, draft weights (not the frozen embedding), optimizer, scheduler,
                          data position (batches consumed per rank), world size, config
        rng-rank0.pt      each rank's RNG states (python, numpy, torch CPU and CUDA)

What must hold: a checkpoint directory appears complete or not at all (written as `.tmp`, then
renamed by rank 0 after every rank wrote its part); the newest `keep` checkpoints are kept; files
hold only tensors and plain values and load with `weights_only=True` (no pickle of arbitrary objects,
so resuming from a folder someone else wrote cannot run code).
"""

from __future__ import annotations

import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.distributed import Runtime, barrier

_NAME = re.compile(r"step-(\d{8})")


def checkpoint_dirs(out_dir: Path) -> list[Path]:
    """Complete checkpoints in out_dir, oldest first."""
    root = out_dir / "checkpoints"
    found = [path for path in root.iterdir() if _NAME.fullmatch(path.name)] if root.is_dir() else []
    return sorted(found)


def rng_state() -> dict[str, Any]:
    """Every RNG state as tensors and plain values (numpy's key array as a list), loadable with weights_only."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (name, keys.tolist(), position, has_gauss, cached_gaussian),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir: Path, state: dict[str, Any], runtime: Runtime, keep: int) -> Path:
    """Writes state (from rank 0) and each rank's RNG states; every rank must call it."""
    final = out_dir / "checkpoints" / f"step-{state['step']:08d}"
    staging = final.with_name(final.name + ".tmp")
    if runtime.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier(runtime)
    torch.save(rng_state(), staging / f"rng-rank{runtime.rank}.pt")
    if runtime.is_main:
        torch.save(state, staging / "state.pt")
    barrier(runtime)
    if runtime.is_main:
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        for old in checkpoint_dirs(out_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    barrier(runtime)
    return final


def load_checkpoint(path: Path, runtime: Runtime) -> dict[str, Any]:
    """state.pt of checkpoint path; restores this rank's RNG states when its file is there."""
    state = _load_safely(path / "state.pt")
    rng_path = path / f"rng-rank{runtime.rank}.pt"
    if rng_path.is_file():
        set_rng_state(_load_safely(rng_path))
    return state


def _load_safely(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"{path} is missing: {path.parent} is not a complete checkpoint") from None
    except pickle.UnpicklingError:
        raise ValueError(f"{path} holds more than tensors and plain values (torch.load with weights_only=True "
                         "refused it); a checkpoint of eagle-tap train never does: not resuming from it") from None
