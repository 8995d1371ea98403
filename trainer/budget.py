"""What one training rank holds whatever the window: the draft's weights, their gradients, AdamW's state and
the frozen target tensors, counted from the objective itself (so a `meta`-device objective of any size,
e.g. Kimi-K2.5's draft, is counted without allocating it).

What must hold: trained tensors are the draft's parameters that require grad, kept in fp32 (the master
weights; bf16 autocast computes in bf16 from them), one fp32 gradient each and two fp32 AdamW moments;
frozen tensors (the target embedding and the target lm_head the soft targets come from) are counted in
the dtype they are held in. DDP adds its gradient buckets, about one more gradient copy (`ddp_bucket_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    num_trained: int
    """Trained parameters."""
    num_frozen: int
    """Elements of the frozen target tensors."""
    trained_bytes: int
    frozen_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    """AdamW's two moments, fp32."""

    @property
    def ddp_bucket_bytes(self) -> int:
        return self.gradient_bytes

    @property
    def fixed_bytes(self) -> int:
        """Everything but activations, on one process (no DDP buckets)."""
        return self.trained_bytes + self.frozen_bytes + self.gradient_bytes + self.optimizer_bytes

    def summary(self) -> str:
        return (f"trained {self.num_trained:,} parameters ({self.trained_bytes / GIB:.2f} GiB), frozen "
                f"{self.num_frozen:,} ({self.frozen_bytes / GIB:.2f} GiB), gradients {self.gradient_bytes / GIB:.2f} "
                f"GiB, AdamW state {self.optimizer_bytes / GIB:.2f} GiB: {self.fixed_bytes / GIB:.2f} GiB before "
                f"activations (+{self.ddp_bucket_bytes / GIB:.2f} GiB of DDP buckets under torchrun)")


def memory_budget(objective: nn.Module) -> MemoryBudget:
    """The budget of an Eagle3Objective (its draft's parameters and its frozen buffers and embedding)."""
    trained = [p for p in objective.draft.parameters() if p.requires_grad]
    frozen = [p for p in objective.draft.parameters() if not p.requires_grad] + [objective.target_lm_head]
    num_trained = sum(p.numel() for p in trained)
    fp32 = torch.finfo(torch.float32).bits // 8
    return MemoryBudget(
        num_trained=num_trained, num_frozen=sum(t.numel() for t in frozen),
        trained_bytes=sum(p.numel() * p.element_size() for p in trained),
        frozen_bytes=sum(t.numel() * t.element_size() for t in frozen),
        gradient_bytes=sum(p.numel() * p.element_size() for p in trained), optimizer_bytes=2 * fp32 * num_trained)
