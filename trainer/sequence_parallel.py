"""Sequence parallelism: the ranks of a group split each window's positions, for windows too long for one device.

`train` with `sequence_parallel = N` under torchrun with N processes (DDP off: the N ranks are one
data-parallel replica). What must hold:
- every rank reads the same batches (the whole window: ids, masks and states are small next to the
  draft's activations), pads the rows to a multiple of N (`pad_batch`), and computes only its block:
  rank p of N the positions [p S/N, (p+1) S/N) of every row (`Blocks.rows`);
- the draft's attention is the only exchange in the forward: a query attends causally to the first
  TTT step's keys and values of every position, so those are all-gathered over the group (`gather`;
  its backward sums each rank's gradient of the gathered keys and hands each rank its block's: a
  reduce-scatter, done as all-reduce and slice on gloo, which has no reduce-scatter). The later
  steps' keys are the query's own row, local;
- the unroll's step i at row r reads row r + i's input token, target and mask: for the last i rows of
  a block that row is the next rank's. It is data, not activation, so each rank reads it from the
  batch it holds (ttt.Eagle3Objective.unroll reads rows [first, end + J - 1)); the draft's hidden
  state stays at row r and never crosses a boundary;
- each step's loss is normalised by the number of learned rows of the whole batch (all-reduced), so
  the ranks' losses sum to the single-process loss, and their gradients, summed over the group
  (`all_reduce_gradients`, instead of DDP's average), are the single-process gradient: every rank
  steps to the same weights.

Shape legend: B rows, N heads, S positions of the whole row, n = S / ranks of a block, E head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

PAD_VALUES = {"aux": 0, "final": 0, "input_ids": 0, "label_ids": -1, "loss_mask": False, "start_mask": False,
              "position_ids": 0, "doc_ids": -1}
"""What pads each (B, S, ...) tensor of a batch (trainer/data.collate pads alike)."""


class _GatherPositions(torch.autograd.Function):
    """All-gather of (B, N, n, E) blocks along positions; backward: the sum over ranks of the gradient, sliced."""

    @staticmethod
    def forward(ctx: Any, block: torch.Tensor, blocks: Blocks) -> torch.Tensor:
        ctx.blocks = blocks
        parts = [torch.empty_like(block) for _ in range(blocks.size)]  # size x (B, N, n, E)
        dist.all_gather(parts, block.contiguous(), group=blocks.group)
        return torch.cat(parts, dim=2)  # (B, N, S, E)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        blocks = ctx.blocks
        n = grad.shape[2] // blocks.size
        if dist.get_backend(blocks.group) == "nccl":
            parts = list(grad.contiguous().split(n, dim=2))  # size x (B, N, n, E)
            out = torch.empty_like(parts[0])  # (B, N, n, E)
            dist.reduce_scatter(out, [part.contiguous() for part in parts], group=blocks.group)
            return out, None
        summed = grad.contiguous().clone()  # (B, N, S, E)
        dist.all_reduce(summed, group=blocks.group)
        return summed[:, :, blocks.rank * n : (blocks.rank + 1) * n].contiguous(), None  # (B, N, n, E)


@dataclass(frozen=True, slots=True)
class Blocks:
    """This rank's block of positions in a sequence-parallel group, and the exchanges the objective makes."""

    rank: int
    """Rank in the group: which block of positions it computes."""
    size: int
    """Ranks in the group."""
    group: Any = None
    """The process group (None: the default group, every rank of torchrun)."""

    def rows(self, num_positions: int) -> tuple[int, int]:
        """(first, end) of this rank's positions of rows of num_positions (a multiple of size: pad_batch)."""
        if num_positions % self.size:
            raise ValueError(f"rows of {num_positions} positions do not split into {self.size} equal blocks; "
                             "pad the batch with sequence_parallel.pad_batch")
        n = num_positions // self.size
        return self.rank * n, (self.rank + 1) * n

    def gather(self, block: torch.Tensor) -> torch.Tensor:
        """(B, N, n, E) -> (B, N, S, E): every rank's block in rank order, differentiable."""
        return _GatherPositions.apply(block, self)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the group of a tensor that takes no gradient (a new tensor)."""
        summed = tensor.detach().clone()
        dist.all_reduce(summed, group=self.group)
        return summed


def pad_batch(batch: dict[str, Any], size: int) -> dict[str, Any]:
    """batch with its rows padded to a multiple of size positions (pad rows belong to no record)."""
    S = batch["input_ids"].shape[1]
    missing = -S % size
    if not missing:
        return batch
    padded = dict(batch)
    for name, fill in PAD_VALUES.items():
        tensor = batch[name]  # (B, S, ...)
        tail = torch.full((tensor.shape[0], missing, *tensor.shape[2:]), fill, dtype=tensor.dtype,
                          device=tensor.device)  # (B, missing, ...)
        padded[name] = torch.cat([tensor, tail], dim=1)  # (B, S + missing, ...)
    return padded


def all_reduce_gradients(module: torch.nn.Module, blocks: Blocks) -> None:
    """Sums every trained parameter's gradient over the group, in place (one flat all-reduce)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([grad.reshape(-1) for grad in grads])  # (sum of sizes,)
    dist.all_reduce(flat, group=blocks.group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
