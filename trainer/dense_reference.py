"""The objective's math in its dense form: the reference the fused forms in training must equal.

- `dense_attend`: one softmax over the materialised scores of each query against the first TTT step's
  keys (B, N, S, T, masked) and its own row's keys of the later steps (B, N, S, J): memory quadratic in
  the window (`trainer.model.attend` keeps none of it);
- `dense_soft_cross_entropy`: the cross-entropy through a whole (B, n, D) fp32 log-softmax kept for the
  backward (`trainer.ttt.soft_cross_entropy` works in chunks and keeps only the logits).

`dense_objective()` makes every objective in its block use both. Used by the tests and by
`eagle-tap bench --only trainer-scale`; training never runs it.

Shape legend as in trainer/model.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from trainer.model import masked


def dense_attend(q: torch.Tensor, cache: list, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Same arguments and result as trainer.model.attend: q (B, N, S, E) -> (B, N, S, E)."""
    k0, v0 = cache[0]  # (B, N, T, E): T = S, or every rank's positions
    T = k0.shape[2]
    scores = (q @ k0.transpose(-1, -2)) * scale  # (B, N, S, T): the first step's keys, causal per record
    scores = masked(scores, mask)
    if len(cache) > 1:
        k_chain = torch.stack([k_j for k_j, _ in cache[1:]], dim=3)  # (B, N, S, J, E)
        v_chain = torch.stack([v_j for _, v_j in cache[1:]], dim=3)  # (B, N, S, J, E)
        chain_scores = (q.unsqueeze(3) * k_chain).sum(-1) * scale  # (B, N, S, J): own row of later steps
        scores = torch.cat([scores, chain_scores], dim=-1)  # (B, N, S, T + J)
    probs = scores.to(torch.promote_types(q.dtype, torch.float32)).softmax(dim=-1).to(q.dtype)  # (B, N, S, T [+ J])
    out = probs[..., :T] @ v0  # (B, N, S, E)
    if len(cache) > 1:
        out = out + (probs[..., T:].unsqueeze(-1) * v_chain).sum(3)  # (B, N, S, E)
    return out


def dense_soft_cross_entropy(logits: torch.Tensor, target_p: torch.Tensor, weights: torch.Tensor,
                             chunk_rows: int) -> torch.Tensor:
    """Same arguments and result as trainer.ttt.soft_cross_entropy (chunk_rows unused)."""
    log_q = F.log_softmax(logits.float(), dim=-1)  # (B, n, D)
    return (-(target_p * log_q).sum(-1) * weights).sum()


@contextlib.contextmanager
def dense_objective() -> Iterator[None]:
    """Inside the block, the draft's attention and the objective's loss take their dense forms."""
    from trainer import model, ttt

    fused = model.attend, ttt.soft_cross_entropy
    model.attend, ttt.soft_cross_entropy = dense_attend, dense_soft_cross_entropy
    try:
        yield
    finally:
        model.attend, ttt.soft_cross_entropy = fused
