"""The draft's attention at a TTT step after the first, through the fused kernel's own log-sum-exp.

A query attends to the first step's keys k0 (T of them, where the additive bias allows) and to its own row's keys
of the later steps (the chain, J of them): one softmax over T + J keys. What must hold:
- forward: out0, lse0 = the fused kernel over (q, k0, v0, bias), no (S, T) scores kept or recomputed; the chain's
  scores c (B, N, S, J) merged with it in fp32, as ring attention merges blocks:
  lse = logaddexp(lse0, logsumexp_j c_j), out = exp(lse0 - lse) out0 + sum_j exp(c_j - lse) v_j;
- backward: the kernel's own backward, called with the merged out and lse. Its P = exp(s - lse) and its
  D = rowsum(dO * out) are then those of the whole softmax, so the dq, dk0, dv0 it returns are the first block's
  share of the merged gradient. The chain's share uses the same P and D: dc_j = p_j (dO . v_j - D),
  dq += scale sum_j dc_j k_j, dk_j = scale dc_j q, dv_j = p_j dO;
- a row the bias allows no key of k0 (none in training: `causal_mask` always allows the query's own position)
  takes lse0 = -inf and out0 = 0, whatever the kernel returns there (the CPU kernel returns lse 0), so it
  attends to its chain only.

Kernels (`supports` says where; trainer.model.attend takes its chunked form elsewhere, e.g. fp64, which the
CUDA kernel lacks):
- CUDA: the memory-efficient kernel, `aten::_scaled_dot_product_efficient_attention(query, key, value,
  attn_bias, compute_log_sumexp, dropout_p, is_causal, *, scale) -> (output, log_sumexp, philox_seed,
  philox_offset)` (log_sumexp may be padded past S to a multiple of 32) and its `_backward(grad_out, query, key,
  value, attn_bias, out, logsumexp, philox_seed, philox_offset, dropout_p, grad_input_mask, is_causal, *, scale)`;
- CPU: the flash kernel, `aten::_scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p,
  is_causal, *, attn_mask, scale) -> (output, logsumexp)` and its `_backward(grad_out, query, key, value, out,
  logsumexp, dropout_p, is_causal, *, attn_mask, scale)`. It needs one head width for q, k and v: a narrower
  side is padded with zeros (zero query/key columns add nothing to a score, zero value columns are dropped).

Shape legend as in trainer/model.py; Ev: value head width (E, or MLA's v_head_dim).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What both kernels take (CPU's also takes fp64, CUDA's does not: one rule for both)."""


def supports(q: torch.Tensor) -> bool:
    """Whether `chain_attention` runs for queries like q."""
    return q.device.type in ("cuda", "cpu") and q.dtype in FUSED_DTYPES


def chain_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, bias: torch.Tensor, k_chain: torch.Tensor,
                    v_chain: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, N, S, E) against k0, v0 (B, N, T, E|Ev) where bias (B, 1, S, T; additive, q's dtype) allows and against
    k_chain, v_chain (B, N, S, J, E|Ev) at its own row: (B, N, S, Ev), one softmax over T + J keys."""
    return _ChainAttention.apply(q, k0, v0, bias, k_chain, v_chain, scale)


def _first_block(q, k0, v0, bias, scale) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """out0 (B, N, S, Ev) in q's dtype, the kernel's lse0 (B, N, >= S) fp32, and what its backward needs again."""
    if q.is_cuda:
        B, N, S, _ = q.shape
        out0, lse0, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k0, v0, bias.expand(B, N, S, k0.shape[2]), True, 0.0, False, scale=scale)
        return out0, lse0, (seed, offset)
    q, k0, v0 = _same_width(q, k0, v0)
    out0, lse0 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k0, v0, 0.0, False, attn_mask=bias,
                                                                            scale=scale)
    return out0, lse0, ()


def _first_block_backward(grad_out, q, k0, v0, bias, out, lse, rng, scale) -> tuple[torch.Tensor, ...]:
    """dq, dk0, dv0 of the first block's share, for the merged out (B, N, S, Ev) and lse (the kernel's shape)."""
    if q.is_cuda:
        B, N, S, _ = q.shape
        dq, dk0, dv0, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k0, v0, bias.expand(B, N, S, k0.shape[2]), out, lse, *rng, 0.0, [True, True, True, False],
            False, scale=scale)
        return dq, dk0, dv0
    E, Ev = q.shape[-1], v0.shape[-1]
    q, k0, v0, grad_out, out = _same_width(q, k0, v0, grad_out, out)
    dq, dk0, dv0 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k0, v0, out, lse, 0.0, False, attn_mask=bias, scale=scale)
    return dq[..., :E], dk0[..., :E], dv0[..., :Ev]


def _kernel_layout(x: torch.Tensor) -> torch.Tensor:
    """x (B, N, S, Ev) laid out as the kernels' own outputs are, (B, S, N, Ev) in memory, for their backward."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _same_width(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors (..., width) with zero columns appended up to the widest one's width (the CPU kernel's need)."""
    width = max(t.shape[-1] for t in tensors)
    return [t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in tensors]


class _ChainAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q, k0, v0, bias, k_chain, v_chain, scale: float) -> torch.Tensor:
        wide = torch.promote_types(q.dtype, torch.float32)  # of the merge: fp32 (fp64 for fp64 inputs)
        with torch.autocast(q.device.type, enabled=False):  # dtypes are chosen here, not by an outer autocast
            S, Ev = q.shape[2], v0.shape[-1]
            out0, lse_kernel, rng = _first_block(q, k0, v0, bias, scale)
            out0 = out0[..., :Ev]  # (B, N, S, Ev): the CPU kernel's width may be padded
            no_key = torch.isneginf(bias).all(-1)  # (B, 1, S): rows that may see no key of k0
            lse0 = lse_kernel[..., :S].masked_fill(no_key, float("-inf"))  # (B, N, S), wide
            # Products and sums, not one-row GEMMs batched over B*N*S: with those (and out, grad_out not in
            # `_kernel_layout`) the first H200 run failed with an illegal memory access; this form ran.
            chain_scores = (q.unsqueeze(3) * k_chain).sum(-1).to(wide) * scale  # (B, N, S, J)
            lse = torch.logaddexp(lse0, chain_scores.logsumexp(-1))  # (B, N, S): over all T + J keys
            chain_probs = (chain_scores - lse.unsqueeze(-1)).exp()  # (B, N, S, J)
            chain_out = (chain_probs.to(q.dtype).unsqueeze(-1) * v_chain).sum(3)  # (B, N, S, Ev)
            out0 = out0.to(wide).masked_fill(no_key.unsqueeze(-1), 0.0)  # (B, N, S, Ev)
            out = _kernel_layout(((lse0 - lse).exp().unsqueeze(-1) * out0 + chain_out.to(wide)).to(q.dtype))
            lse_kernel = lse_kernel.clone()
            lse_kernel[..., :S] = lse  # the backward kernel reads the merged lse in its own layout
        ctx.scale = scale
        ctx.save_for_backward(q, k0, v0, bias, k_chain, v_chain, out, lse_kernel, chain_probs, *rng)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k0, v0, bias, k_chain, v_chain, out, lse, chain_probs, *rng = ctx.saved_tensors
        scale, wide = ctx.scale, torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            grad_out = _kernel_layout(grad_out.to(q.dtype))  # (B, N, S, Ev)
            dq, dk0, dv0 = _first_block_backward(grad_out, q, k0, v0, bias, out, lse, rng, scale)
            delta = (grad_out.to(wide) * out.to(wide)).sum(-1, keepdim=True)  # (B, N, S, 1): D = rowsum(dO * out)
            grad_dot_v = (v_chain * grad_out.unsqueeze(3)).sum(-1).to(wide)  # (B, N, S, J)
            grad_scores = chain_probs * (grad_dot_v - delta)  # (B, N, S, J), wide
            # In q's dtype from here (sums accumulate wide): no wide (B, N, S, J, E) copies.
            grad_scores, chain_probs = (scale * grad_scores).to(q.dtype), chain_probs.to(q.dtype)  # (B, N, S, J)
            dq = (dq.to(wide) + (grad_scores.unsqueeze(-1) * k_chain).sum(3).to(wide)).to(q.dtype)  # (B, N, S, E)
            dk_chain = grad_scores.unsqueeze(-1) * q.unsqueeze(3)  # (B, N, S, J, E)
            dv_chain = chain_probs.unsqueeze(-1) * grad_out.unsqueeze(3)  # (B, N, S, J, Ev)
        return dq, dk0, dv0, None, dk_chain, dv_chain, None
