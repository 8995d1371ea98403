"""The EAGLE-3 objective: the test-time-training (TTT) unroll of the draft over one batch.

Step 0 reads, at every row r, the target's states (fc(aux[r])) and the embedding of the next token,
and predicts the token after (trainer/data.py has the alignment). Step i > 0 continues each row
from the draft's OWN output of step i-1, as serving does after i guesses: it reads the row r + i's
input token at position pos[r] + i and is scored on row r + i's target. Attention sees step 0's keys
causally within the record (at serving: the KV cache of what the target verified) and the row's own
keys of steps 1..i (the draft's chain of guesses); SpecForge's unroll after its fix of the mask
shift (sgl-project/SpecForge#244).

Loss of step i: cross-entropy against the target distribution softmax(lm_head(final)) restricted
to the draft vocab, averaged over the rows that are loss-masked, inside the record after the
shift and whose target argmax is in the draft vocab; the total is sum_i step_weight**i * loss_i.
Accuracy of step i: the share of loss-masked rows where the draft's argmax is the target's argmax;
a target argmax outside the draft vocab counts as a miss, since the draft could never propose it.

Memory: the target distribution (rows, D) fp32 is computed once per batch and each step reads a view of
it (no shifted copy per step); the cross-entropy runs over chunks of rows in its forward and its backward
(`soft_cross_entropy`), so no (rows, D) fp32 log-softmax is kept per step: only the step's logits.

Shape legend: B rows, S positions, H hidden, K capture layers, V target vocab, D draft vocab, J steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.model import Eagle3Draft, attention_bias, causal_mask


@dataclass(kw_only=True, slots=True)
class Config:
    """The unroll and its loss."""

    ttt_steps: int = 7
    """Draft steps unrolled per batch (J); step 0 reads the target's states."""
    step_weight: float = 0.8
    """Loss weight of step i is step_weight ** i."""
    target_chunk_rows: int = 4096
    """Rows per chunk when computing target logits over the full vocab (bounds (rows, V) memory)."""
    loss_chunk_rows: int = 1024
    """Rows per chunk of the cross-entropy's forward and backward (bounds its (rows, D) fp32 temporaries)."""
    checkpoint_steps: bool = False
    """Activation checkpointing of TTT steps 1..J-1: each keeps only its inputs, logits and keys/values, and is
    recomputed in the backward (about a third more compute), for the longest windows."""


class _SoftCrossEntropy(torch.autograd.Function):
    """sum over rows of weight * (-sum_d p_d log_softmax(logits)_d), in chunks of rows; saves only its inputs."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target_p: torch.Tensor, weights: torch.Tensor,
                chunk_rows: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for rows in _row_chunks(logits.shape, chunk_rows):
            z = logits[rows].float()  # (c, D)
            p = target_p[rows]  # (c, D)
            cross_entropy = z.logsumexp(-1) * p.sum(-1) - (p * z).sum(-1)  # (c,)
            total += (cross_entropy * weights[rows]).sum()
        ctx.save_for_backward(logits, target_p, weights)
        ctx.chunk_rows = chunk_rows
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, target_p, weights = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)  # (B, n, D)
        for rows in _row_chunks(logits.shape, ctx.chunk_rows):
            p = target_p[rows]  # (c, D)
            z_grad = logits[rows].float().softmax(-1) * p.sum(-1, keepdim=True) - p  # (c, D)
            grad_logits[rows] = (z_grad * (weights[rows] * grad).unsqueeze(-1)).to(logits.dtype)
        return grad_logits, None, None, None


def _row_chunks(shape: torch.Size, chunk_rows: int) -> Iterator[tuple[int, slice]]:
    """Index (b, rows) of each chunk of a (B, n, ...) tensor: chunk_rows rows of one batch row at a time."""
    for b in range(shape[0]):
        for start in range(0, shape[1], chunk_rows):
            yield b, slice(start, start + chunk_rows)


def soft_cross_entropy(logits: torch.Tensor, target_p: torch.Tensor, weights: torch.Tensor,
                       chunk_rows: int) -> torch.Tensor:
    """sum_(b,r) weights[b, r] * CE(target_p[b, r], softmax(logits[b, r])): logits (B, n, D) in any float dtype,
    target_p (B, n, D) fp32 (a view is fine: nothing is copied), weights (B, n) fp32. A scalar, fp32."""
    return _SoftCrossEntropy.apply(logits, target_p, weights, chunk_rows)


def shift_rows(x: torch.Tensor, steps: int, fill: float | int | bool) -> torch.Tensor:
    """x (B, S, ...) moved `steps` rows up: row r holds row r + steps, rows past the end hold fill."""
    if steps == 0:
        return x
    tail = torch.full_like(x[:, :steps], fill)  # (B, steps, ...)
    return torch.cat([x[:, steps:], tail], dim=1)  # (B, S, ...)


def same_record_after(doc_ids: torch.Tensor, steps: int) -> torch.Tensor:
    """(B, S) bool: row r + steps exists and belongs to the same record as row r (doc_ids (B, S), -1 on padding).

    The one statement of the rule every shifted target and count uses: -2 fills the rows past the end,
    so they never match a record (or padding's -1)."""
    return shift_rows(doc_ids, steps, -2) == doc_ids


def scored_rows(loss_mask: torch.Tensor, doc_ids: torch.Tensor, step: int) -> torch.Tensor:
    """(B, S) bool: start rows r whose step-`step` target, row r + step, is scored: that row is loss-masked (so,
    in a window, also the window's own: trainer/data.py) and of the same record. loss_mask, doc_ids (B, S)."""
    return shift_rows(loss_mask & (doc_ids >= 0), step, False) & same_record_after(doc_ids, step)


class Eagle3Objective(nn.Module):
    """The draft plus the frozen target lm_head; forward(batch) returns the loss and per-step counts."""

    def __init__(self, draft: Eagle3Draft, target_lm_head: torch.Tensor, config: Config) -> None:
        super().__init__()
        self.draft = draft
        self.config = config
        self.register_buffer("target_lm_head", target_lm_head, persistent=False)  # (V, H)

    @torch.no_grad()
    def target_distribution(self, final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """final (B, S, H) -> p (B, S, D) over the draft vocab, in_vocab (B, S): target argmax is in it."""
        draft_ids = torch.arange(self.draft.d2t.numel(), device=final.device) + self.draft.d2t  # (D,)
        flat = final.reshape(-1, final.shape[-1])  # (B*S, H)
        probs, in_vocab = [], []
        head = self.target_lm_head  # (V, H): fp32 on CPU, bf16 on GPU (fp32 accumulation)
        with torch.autocast(final.device.type, enabled=False):
            for chunk in flat.split(self.config.target_chunk_rows):
                logits = (chunk.to(head.dtype) @ head.T).float()  # (rows, V)
                in_vocab.append(self.draft.t2d[logits.argmax(-1)])  # (rows,)
                probs.append(logits[:, draft_ids].softmax(-1))  # (rows, D)
        return torch.cat(probs).view(*final.shape[:2], -1), torch.cat(in_vocab).view(final.shape[:2])

    def unroll(self, batch: dict[str, Any], blocks: Any = None) -> Iterator[dict[str, torch.Tensor]]:
        """Per TTT step: logits (B, n, D), target_p (B, n, D), counted (B, n): rows scored for accuracy,
        learned (B, n): counted rows whose target argmax is in the draft vocab (rows the loss uses).

        n = S rows, or under sequence parallelism (blocks: a sequence_parallel.Blocks) this rank's block of the
        batch, which every rank holds whole: the later steps' shifted rows past the block are read from it."""
        S = batch["input_ids"].shape[1]
        first, end = (0, S) if blocks is None else blocks.rows(S)
        reach = min(end + self.config.ttt_steps - 1, S)  # the farthest row a step reads
        n = end - first
        doc_ids = batch["doc_ids"][:, first:reach]  # (B, n + reach)
        input_ids, loss_mask = batch["input_ids"][:, first:reach], batch["loss_mask"][:, first:reach]  # (B, n+)
        # Padded to n + J - 1 rows (zeros, out of vocab: rows past the batch are never scored) so every step's
        # shifted target is a view of the one tensor.
        target_p, in_vocab = self.target_distribution(batch["final"][:, first:reach])  # (B, n+, D), (B, n+)
        padding = n + self.config.ttt_steps - 1 - target_p.shape[1]
        target_p, in_vocab = F.pad(target_p, (0, 0, 0, padding)), F.pad(in_vocab, (0, padding))  # (B, n+J-1, ...)
        hidden = self.draft.project(batch["aux"][:, first:end])  # (B, n, H)
        # One additive mask in the attention's dtype (bf16 under autocast) that every step's attention shares.
        mask = attention_bias(causal_mask(batch["doc_ids"], first, end), hidden.dtype)  # (B, 1, n, S)
        position_ids = batch["position_ids"][:, first:end]  # (B, n)
        # Image positions (trainer/data.py): the target's input embeddings, shifted with the ids.
        images = "input_embed_mask" in batch
        embeds = batch["input_embeds"][:, first:reach] if images else None  # (B, n+, H)
        embed_mask = batch["input_embed_mask"][:, first:reach] if images else None  # (B, n+)
        gather_keys = None if blocks is None else blocks.gather
        cache: list = []
        for step in range(self.config.ttt_steps):
            counted = scored_rows(loss_mask, doc_ids, step)[:, :n]  # (B, n)
            step_ids = shift_rows(input_ids, step, 0)[:, :n]  # (B, n)
            step_embeds = shift_rows(embeds, step, 0)[:, :n] if images else None  # (B, n, H)
            step_mask = shift_rows(embed_mask, step, False)[:, :n] if images else None  # (B, n)
            if step > 0 and self.config.checkpoint_steps and torch.is_grad_enabled():
                # Step 0 is never checkpointed: under sequence parallelism it gathers keys (a collective).
                hidden, logits, *key_value = checkpoint(self._step_from, hidden, step_ids, position_ids + step, mask,
                                                        step_embeds, step_mask, *(x for pair in cache for x in pair),
                                                        use_reentrant=False)
                cache.append(tuple(key_value))
            else:
                hidden, logits = self.draft(hidden, step_ids, position_ids + step, mask, cache, gather_keys,
                                            step_embeds, step_mask)  # (B, n, H), (B, n, D)
            yield {"logits": logits, "target_p": target_p[:, step : step + n], "counted": counted,
                   "learned": counted & in_vocab[:, step : step + n]}

    def _step_from(self, hidden: torch.Tensor, step_ids: torch.Tensor, position_ids: torch.Tensor,
                   mask: torch.Tensor, step_embeds: torch.Tensor | None, step_mask: torch.Tensor | None,
                   *cached: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One draft step after the earlier steps' keys and values `cached` (k0, v0, k1, v1, ...): its out, logits,
        and its own key and value. A pure function of its inputs, so a checkpoint can run it again."""
        cache = [(cached[i], cached[i + 1]) for i in range(0, len(cached), 2)]
        out, logits = self.draft(hidden, step_ids, position_ids, mask, cache, None, step_embeds,
                                 step_mask)  # (B, n, H), (B, n, D)
        return out, logits, *cache[-1]

    def forward(
        self, batch: dict[str, Any], blocks: Any = None,
        sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The weighted loss (scalar) and, per step (J,): step_losses, correct and total (accuracy counts).

        Under sequence parallelism (blocks) each is this rank's share: summed over the ranks they make the
        whole batch's (each step's loss is normalised by every rank's count of learned rows). Under data
        parallelism (sum_over_ranks: sums a tensor over the ranks, each holding its own rows of the global
        batch) the same holds for the loss and step_losses: summed over the ranks they are the loss of all
        their rows taken as one batch, as one process computes it."""
        numerators, learned_counts, correct, total = [], [], [], []
        for out in self.unroll(batch, blocks):
            learned = out["learned"]  # (B, n)
            numerators.append(soft_cross_entropy(out["logits"], out["target_p"], learned.float(),
                                                 self.config.loss_chunk_rows))
            learned_counts.append(learned.sum())
            correct.append(((out["logits"].argmax(-1) == out["target_p"].argmax(-1)) & learned).sum())
            total.append(out["counted"].sum())
        counts = torch.stack(learned_counts).float()  # (J,)
        if blocks is not None:
            counts = blocks.all_reduce(counts)
        elif sum_over_ranks is not None:
            counts = sum_over_ranks(counts)
        step_losses = torch.stack(numerators) / counts.clamp(min=1)  # (J,)
        weights = self.config.step_weight ** torch.arange(len(step_losses), device=step_losses.device)  # (J,)
        return {
            "loss": (weights * step_losses).sum(),
            "step_losses": step_losses.detach(),  # (J,)
            "correct": torch.stack(correct).float(),  # (J,)
            "total": torch.stack(total).float(),  # (J,)
        }
