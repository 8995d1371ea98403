"""One process or `torchrun`: the process group, this rank's device, and the collectives training uses.

Under torchrun (WORLD_SIZE > 1) the group uses gloo on CPU and nccl on GPU; each rank reads its own
share of the shards (trainer/data.py), and the objective is wrapped in DDP, which averages
gradients so every rank steps to the same weights (training checks this at the end). Each rank's
loss is normalised by the learned rows of all ranks' batches and scaled by the ranks, so that
average is the gradient one process computes over the same global batch (trainer/train.py).

Drafts too large for one device (FSDP, not wired in): the draft is one decoder layer, and its
memory is the frozen embedding and target lm_head (V x H each, bf16), the draft lm_head (D x H)
and AdamW's fp32 states of the trained weights (16 bytes per parameter). For a 7168-wide target
with 163,840 tokens and a 32K draft vocab that is about 1.1B trained parameters (~18 GB with
optimizer states) plus ~5 GB frozen: DDP fits one 80 GB GPU per rank. Past that, shard with FSDP2:
`torch.distributed.fsdp.fully_shard(objective.draft.midlayer)` then `fully_shard(objective.draft)`
before building the optimizer (mixed frozen and trained parameters in one unit are allowed in
FSDP2), keep `target_lm_head` replicated or compute target logits in vocab chunks, and save
checkpoints with `torch.distributed.checkpoint` (`get_state_dict` / `set_state_dict`) instead
of rank 0's `torch.save`, so each rank writes and reads only its shards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True, slots=True)
class Runtime:
    """Where this process runs."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def setup(device: str = "auto") -> Runtime:
    """Joins torchrun's process group when WORLD_SIZE > 1; device: auto (cuda when present), cpu or cuda."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; accepted: auto, cpu, cuda")
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for, but torch sees no CUDA device")
    torch_device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(torch_device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return Runtime(rank=rank, world_size=world_size, local_rank=local_rank, device=torch_device)


def teardown(runtime: Runtime) -> None:
    if runtime.distributed and dist.is_initialized():
        dist.destroy_process_group()


def barrier(runtime: Runtime) -> None:
    if runtime.distributed:
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor, runtime: Runtime) -> torch.Tensor:
    """The sum of tensor over ranks (in place; tensor itself when running alone)."""
    if runtime.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor
