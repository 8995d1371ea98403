"""The EAGLE-3 draft model in plain PyTorch: the math of SGLang's `LlamaForCausalLMEagle3`.

One draft step, as SGLang's draft forward computes it (one decoder layer, `midlayer`):

    h      = fc(aux)                                   first step; later steps take the previous out
    x      = cat(input_layernorm(embed(ids)), hidden_norm(h))        (embedding first, then hidden)
    r      = o_proj(attention(x)) + h
    out    = mlp(post_attention_layernorm(r)) + r      pre-norm: the hidden state of the next step
    logits = lm_head(norm(out))                        over the draft vocab

Parameter names are the ones `LlamaForCausalLMEagle3.load_weights` reads (`midlayer` is its legacy
name for `layers.0`; q/k/v and gate/up are stacked at load): fc, midlayer.{hidden_norm,
input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj},
norm, lm_head, embed_tokens (frozen, the target's), and the buffers d2t (read as hot token ids)
and t2d (skipped by SGLang).

Two layouts of that layer, as the draft config's `architectures` names them (trainer/draft_config.py):
- "llama", `LlamaForCausalLMEagle3`: grouped-query attention (q/k/v/o_proj), rope in the half-split layout;
- "mla", `Eagle3DeepseekV2ForCausalLM` (SGLang's models/kimi_k25_eagle3.py): DeepSeek-V2 multi-latent
  attention (`MLAttention`: q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
  o_proj; SGLang fuses the two a-projections at load), rope on the rope part in the interleaved layout, the
  softmax scale of DeepSeek's yarn. The draft's KV cache holds one latent per token (kv_lora_rank +
  qk_rope_head_dim wide) instead of per-head keys and values.
Both take the EAGLE3.1 options SGLang reads: `fc_norm` (an RMSNorm on each captured state before fc) and
`norm_output` (the next step gets norm(out), not out).

Attention takes a list of earlier test-time-training steps' keys and values (`cache`): the first
entry is attended causally (within each record), the later ones only at the query's own row (the
draft's chain of guesses at that position). With an empty cache this is plain causal attention.
Under sequence parallelism (trainer/sequence_parallel.py) a rank holds a block of positions: its
queries attend to the first step's keys of every rank (`gather_keys`), its chain keys stay its own.

Memory is linear in the window (`attend`): the first step's keys go through a fused attention kernel
(flash / memory-efficient, no (S, T) scores kept), and a later step's chain keys, one per earlier step
at the query's own row, are merged with it through the kernel's own log-sum-exp, so the result is the
softmax over all T + J keys at once (trainer/attention.py, whose backward is the kernel's own too).
Where that kernel does not run (fp64), `chunked_attend` computes the log-sum-exp over query chunks
whose scores are recomputed in the backward (`first_step_logsumexp`): same result, far more work.
The dense form both equal (one softmax over materialised scores) is `trainer/dense_reference.py`, the
tests' and the benchmark's reference.

Shape legend: B rows, S positions, H hidden, K capture layers, N query heads, G key/value heads,
E head dim, J cached steps, V target vocab, D draft vocab, T key positions (S, or every sequence-parallel
rank's).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer import attention
from trainer.draft_config import draft_layout

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
MLA_ROPE_TYPES = ("default", "yarn")
"""SGLang's MLA layer runs any rope scaling as DeepSeek's yarn; the others would be served as something else."""
LAYOUTS = ("llama", "mla")
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
"""The MLA layout's shape keys of the draft config (all positive)."""


@dataclass(kw_only=True, slots=True)
class Config:
    """Shapes of the draft, read from the draft config (`eagle-tap draft-config`)."""

    hidden_size: int
    """H: width of the draft's decoder layer."""
    target_hidden_size: int
    """Width of each captured target state."""
    num_aux_hidden_states: int
    """K: capture layers concatenated into fc's input."""
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    """V: the target's vocabulary (embedding rows)."""
    draft_vocab_size: int
    """D: lm_head rows."""
    max_position_embeddings: int
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    """As transformers writes them: rope_type, rope_theta and the type's own fields."""
    layout: str = "llama"
    """One of LAYOUTS (module docstring)."""
    q_lora_rank: int = 0
    """mla: width of the query's low-rank projection."""
    kv_lora_rank: int = 0
    """mla: C, width of the latent the keys' nope part and the values come from."""
    qk_nope_head_dim: int = 0
    """mla: the part of a head's query and key without rope."""
    qk_rope_head_dim: int = 0
    """mla: the part with rope (one key part shared by all heads)."""
    v_head_dim: int = 0
    """mla: a head's value width."""
    fc_norm: bool = False
    """An RMSNorm on each captured state before fc (EAGLE3.1)."""
    norm_output: bool = False
    """The next step's hidden is norm(out) instead of out (EAGLE3.1)."""

    @property
    def rotary_dim(self) -> int:
        """E of the rope: the whole head (llama), the rope part (mla)."""
        return self.qk_rope_head_dim if self.layout == "mla" else self.head_dim

    @classmethod
    def from_draft_config(cls, draft: dict[str, Any]) -> Config:
        layout = draft_layout(draft)
        if draft.get("hidden_act", "silu") != "silu" or draft.get("num_hidden_layers", 1) != 1:
            raise ValueError("the draft must be one decoder layer with hidden_act silu")
        heads = draft["num_attention_heads"]
        mla = {}
        if layout == "mla":
            missing = [key for key in MLA_KEYS if not draft.get(key)]
            if missing:
                raise ValueError(f"an MLA draft config needs {', '.join(missing)} (positive integers; SGLang's "
                                 "Eagle3DeepseekV2ForCausalLM refuses a draft without q_lora_rank)")
            mla = {key: int(draft[key]) for key in MLA_KEYS}
            rope_type = draft["rope_parameters"].get("rope_type", "default")
            if rope_type not in MLA_ROPE_TYPES:
                raise ValueError(f"rope_type {rope_type!r} is not supported by the MLA layout; accepted: "
                                 f"{', '.join(MLA_ROPE_TYPES)}")
        return cls(
            layout=layout, fc_norm=bool(draft.get("fc_norm", False)), norm_output=bool(draft.get("norm_output", False)),
            **mla,
            hidden_size=draft["hidden_size"],
            target_hidden_size=draft.get("target_hidden_size", draft["hidden_size"]),
            num_aux_hidden_states=draft["num_aux_hidden_states"],
            num_attention_heads=heads,
            num_key_value_heads=draft.get("num_key_value_heads", heads),
            head_dim=draft.get("head_dim") or draft["hidden_size"] // heads,
            intermediate_size=draft["intermediate_size"],
            rms_norm_eps=draft["rms_norm_eps"],
            vocab_size=draft["vocab_size"],
            draft_vocab_size=draft["draft_vocab_size"],
            max_position_embeddings=draft["max_position_embeddings"],
            rope_parameters=dict(draft["rope_parameters"]),
        )


def rope_frequencies(config: Config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (E/2,) and the cos/sin scale of the draft's rope, as transformers computes them."""
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; accepted: {', '.join(STATIC_ROPE_TYPES)}")
    dim = config.rotary_dim
    if rope_type == "default":
        exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim  # (E/2,)
        return 1.0 / config.rope_parameters["rope_theta"] ** exponents, 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = LlamaConfig(
        hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads, head_dim=dim,
        max_position_embeddings=config.max_position_embeddings, rope_parameters=dict(config.rope_parameters),
    )
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
    return inv_freq.float(), float(scale)


def mla_softmax_scale(config: Config) -> float:
    """DeepSeek-V2's attention scale: 1/sqrt(qk head dim), times mscale squared under yarn (SGLang's
    `compute_mla_mscale_scaling`: mscale = 0.1 * mscale_all_dim * ln(factor) + 1 for a factor above 1)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = config.rope_parameters
    if rope.get("rope_type", "default") == "default" or not rope.get("apply_yarn_scaling", True):
        return scale
    factor, mscale_all_dim = float(rope.get("factor", 1.0)), float(rope.get("mscale_all_dim") or 0.0)
    mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
    return scale * mscale * mscale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, S, E) rotated by cos/sin (B, 1, S, E), half-split (neox) layout as Llama."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (B, heads, S, E)
    return x * cos + rotated * sin


def deinterleaved(x: torch.Tensor) -> torch.Tensor:
    """x (..., E) with rope pairs side by side (x0 x1, x2 x3, ...: DeepSeek's layout) reordered into the half-split
    layout apply_rope rotates (x0 x2 ... x1 x3 ...). Queries and keys are reordered alike: their products hold."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)  # (..., E)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., size)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        width = 2 * config.hidden_size  # input: cat(embedding, hidden)
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, cache: list,
        gather_keys: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)  # (B, N, S, E)
        k = self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, G, S, E)
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, G, S, E)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        repeat = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)  # (B, N, S, E) each
        if not cache and gather_keys is not None:  # sequence parallel: the first step's keys of every rank
            k, v = gather_keys(k), gather_keys(v)  # (B, N, T, E) each, T = all positions
        cache.append((k, v))
        out = attend(q, cache, mask, 1.0 / math.sqrt(self.head_dim))  # (B, N, S, E)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))  # (B, S, H)


class MLAttention(nn.Module):
    """DeepSeek-V2 multi-latent attention over x = cat(embedding, hidden), as SGLang's `Eagle3MLADecoderLayer`
    runs it. Computed in the decompressed form (per-head keys and values from the latent); the absorbed form
    SGLang serves (queries into the latent space, attention over the latent) is the same product reordered."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.latent_dim = config.kv_lora_rank
        width = 2 * config.hidden_size  # input: cat(embedding, hidden)
        self.q_a_proj = nn.Linear(width, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * (self.nope_dim + self.rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(width, self.latent_dim + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.latent_dim, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.latent_dim, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, config.hidden_size, bias=False)
        self.scale = mla_softmax_scale(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, cache: list,
        gather_keys: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        B, S, _ = x.shape
        N = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, S, N, -1).transpose(1, 2)  # (B, N, S, Dn+Dr)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.latent_dim, self.rope_dim], dim=-1)  # (B, S, C|Dr)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, S, N, -1).transpose(1, 2)  # (B, N, S, Dn+Dv)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q_rope = apply_rope(deinterleaved(q_rope), cos, sin)  # (B, N, S, Dr)
        k_rope = apply_rope(deinterleaved(k_rope.unsqueeze(1)), cos, sin).expand(B, N, S, self.rope_dim)
        q, k = torch.cat([q_nope, q_rope], dim=-1), torch.cat([k_nope, k_rope], dim=-1)  # (B, N, S, Dn+Dr) each
        if not cache and gather_keys is not None:  # sequence parallel: the first step's keys of every rank
            k, v = gather_keys(k), gather_keys(v)  # (B, N, T, Dn+Dr), (B, N, T, Dv)
        cache.append((k, v))
        out = attend(q, cache, mask, self.scale)  # (B, N, S, Dv)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))  # (B, S, H)


SCORE_CHUNK_BYTES = 64 << 20
"""fp32 scores held at once while `first_step_logsumexp` runs, in its forward or its backward."""


def attend(q: torch.Tensor, cache: list, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, N, S, E) against the first step's keys cache[0] (B, N, T, E each), where mask (B, 1, S, T) allows,
    and the later steps' keys cache[1:] (B, N, S, E each) at the query's own row: one softmax over T + J keys.
    mask: bool, or an `attention_bias` in q's dtype (what the unroll passes: SDPA keeps its mask for the
    backward, and a bool one is converted to a new float tensor at every call). Values may be narrower than
    queries and keys (MLA: Ev), and so is the result. With a chain, `attention.chain_attention` where its kernels
    run (`attention.supports`), else `chunked_attend`."""
    k0, v0 = cache[0]
    if len(cache) == 1:
        return F.scaled_dot_product_attention(q, k0, v0, attn_mask=mask, scale=scale)  # (B, N, S, Ev)
    if not attention.supports(q):
        return chunked_attend(q, cache, mask, scale)
    bias = attention_bias(mask, q.dtype) if mask.dtype == torch.bool else mask.to(q.dtype)  # (B, 1, S, T)
    k_chain = torch.stack([k_j for k_j, _ in cache[1:]], dim=3)  # (B, N, S, J, E)
    v_chain = torch.stack([v_j for _, v_j in cache[1:]], dim=3)  # (B, N, S, J, Ev)
    return attention.chain_attention(q, k0, v0, bias, k_chain, v_chain, scale)  # (B, N, S, Ev)


def chunked_attend(q: torch.Tensor, cache: list, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """`attend`'s result with the first step's log-sum-exp recomputed over query chunks (`first_step_logsumexp`):
    for what the fused kernels do not take (fp64), and to time against them (scripts/gpu_check_trainer.py)."""
    k0, v0 = cache[0]
    out0 = F.scaled_dot_product_attention(q, k0, v0, attn_mask=mask, scale=scale)  # (B, N, S, E)
    if len(cache) == 1:
        return out0
    k_chain = torch.stack([k_j for k_j, _ in cache[1:]], dim=3)  # (B, N, S, J, E)
    v_chain = torch.stack([v_j for _, v_j in cache[1:]], dim=3)  # (B, N, S, J, E)
    accumulate = torch.promote_types(q.dtype, torch.float32)  # fp32 for bf16 and fp32 (fp64 stays fp64)
    chain_scores = ((q.unsqueeze(3) * k_chain).sum(-1) * scale).to(accumulate)  # (B, N, S, J)
    lse0 = first_step_logsumexp(q, k0, mask, scale)  # (B, N, S)
    lse = torch.logaddexp(lse0, chain_scores.logsumexp(-1))  # (B, N, S): over all T + J keys
    weight0 = (lse0 - lse).exp().unsqueeze(-1).to(q.dtype)  # (B, N, S, 1): the first step's share
    chain_probs = (chain_scores - lse.unsqueeze(-1)).exp().to(q.dtype)  # (B, N, S, J)
    return weight0 * out0 + (chain_probs.unsqueeze(-1) * v_chain).sum(3)  # (B, N, S, E)


def first_step_logsumexp(q: torch.Tensor, k0: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, N, S), fp32 or wider: log sum_t exp(q.k0_t * scale) over the keys mask allows, over chunks of queries whose
    scores (B, N, chunk, T) are recomputed in the backward rather than kept (at most SCORE_CHUNK_BYTES each)."""
    B, N, S, _ = q.shape
    T = k0.shape[2]
    chunk = max(1, SCORE_CHUNK_BYTES // (4 * B * N * T))
    return torch.cat([checkpoint(_masked_logsumexp, q[:, :, start : start + chunk], k0,
                                 mask[:, :, start : start + chunk], scale, use_reentrant=False)
                      for start in range(0, S, chunk)], dim=2)  # (B, N, S)


def _masked_logsumexp(q: torch.Tensor, k0: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    scores = (q @ k0.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32)) * scale  # (B, N, s, T)
    return masked(scores, mask).logsumexp(-1)  # (B, N, s)


def masked(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """scores (B, N, S, T) with -inf where mask (B, 1, S, T; bool, or an additive `attention_bias`) forbids."""
    return scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """mask (B, 1, S, T) bool as the additive form SDPA takes: 0 where allowed, -inf elsewhere, in dtype. Its rows
    are laid 16 elements apart (a view of a (B, 1, S, T rounded up to 16) tensor), as CUDA's memory-efficient
    kernel needs: a bias not so aligned would be padded into a new copy at every call."""
    B, _, S, T = mask.shape
    padded = torch.zeros(B, 1, S, -(-T // 16) * 16, dtype=dtype, device=mask.device)  # (B, 1, S, T16)
    return padded[..., :T].masked_fill_(~mask, float("-inf"))  # (B, 1, S, T)


class MLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, S, H)


class DecoderLayer(nn.Module):
    """SGLang's EAGLE-3 input layer: attention over cat(norm(embedding), norm(hidden))."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config) if config.layout == "mla" else Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, embeds, hidden, cos, sin, mask, cache, gather_keys=None) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (B, S, 2H)
        residual = self.self_attn(x, cos, sin, mask, cache, gather_keys) + hidden  # (B, S, H)
        return self.mlp(self.post_attention_layernorm(residual)) + residual  # (B, S, H), pre-norm


class Eagle3Draft(nn.Module):
    def __init__(self, config: Config, frozen_dtype: torch.dtype = torch.float32) -> None:
        """frozen_dtype: of the target's embedding (V, H), bf16 on GPU: never trained, read a row at a time."""
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=frozen_dtype)
        self.embed_tokens.weight.requires_grad_(False)  # the target's (trainer/target_weights.py)
        self.fc = nn.Linear(config.num_aux_hidden_states * config.target_hidden_size, config.hidden_size, bias=False)
        self.fc_norm = (nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps)
                                      for _ in range(config.num_aux_hidden_states)) if config.fc_norm else None)
        self.midlayer = DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        inv_freq, self.rope_scale = rope_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (E/2,)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """aux (B, S, K*Ht), the captured states side by side, as the first step's hidden (B, S, H): fc, after an
        RMSNorm on each state where the config sets fc_norm (as SGLang does inside its forward)."""
        aux = aux.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1))],
                            dim=-1)  # (B, S, K*Ht)
        return self.fc(aux)  # (B, S, H)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids.unsqueeze(-1).float() * self.inv_freq  # (B, S, E/2)
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # (B, 1, S, E)
        return (angles.cos() * self.rope_scale).to(dtype), (angles.sin() * self.rope_scale).to(dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        cache: list | None = None,
        gather_keys: Callable[[torch.Tensor], torch.Tensor] | None = None,
        input_embeds: torch.Tensor | None = None,
        input_embed_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step. hidden (B, S, H): project(aux) at the first step, the previous `out` after;
        mask (B, 1, S, T) bool: the first step's keys each query may see (T = S, or with gather_keys, which
        gathers the first step's keys of every sequence-parallel rank, all T positions). Returns out (B, S, H)
        for the next step (pre-norm; norm(out) with norm_output) and logits (B, S, D). (SGLang applies fc inside
        its forward whenever the incoming width differs from H, which is every first step with K >= 2.) Where
        input_embed_mask (B, S) is set, the input is input_embeds (B, S, H), the target's own input embedding at
        an image position, not the embedding of its id (SGLang's mm_input_embeds; trainer/data.py)."""
        embeds = self.embed_tokens(input_ids)  # (B, S, H)
        if input_embed_mask is not None:
            if input_embeds.shape[-1] != embeds.shape[-1]:
                raise ValueError(f"records with images hold the target's input embeddings, {input_embeds.shape[-1]} "
                                 f"wide; this draft's embeddings are {embeds.shape[-1]} wide: a draft for images "
                                 "must be as wide as its target (hidden_size == target_hidden_size), as SGLang "
                                 "serves it")
            embeds = torch.where(input_embed_mask.unsqueeze(-1), input_embeds.to(embeds.dtype), embeds)  # (B, S, H)
        embeds = embeds.to(hidden.dtype)
        cos, sin = self.rope(position_ids, hidden.dtype)  # (B, 1, S, E) each
        out = self.midlayer(embeds, hidden, cos, sin, mask, [] if cache is None else cache, gather_keys)  # (B, S, H)
        normed = self.norm(out)  # (B, S, H)
        return normed if self.config.norm_output else out, self.lm_head(normed)  # (B, S, H), (B, S, D)


def causal_mask(doc_ids: torch.Tensor, first: int = 0, end: int | None = None) -> torch.Tensor:
    """(B, 1, end - first, S) bool: query s of rows first..end-1 sees key t <= s of the same record; always
    itself (pads stay finite). doc_ids (B, S); the default is every row, (B, 1, S, S)."""
    S = doc_ids.shape[1]
    end = S if end is None else end
    queries = torch.arange(first, end, device=doc_ids.device)  # (n,)
    keys = torch.arange(S, device=doc_ids.device)  # (S,)
    same = doc_ids[:, first:end].unsqueeze(2) == doc_ids.unsqueeze(1)  # (B, n, S)
    causal = keys.unsqueeze(0) <= queries.unsqueeze(1)  # (n, S)
    return ((same & causal) | (keys.unsqueeze(0) == queries.unsqueeze(1))).unsqueeze(1)


def trainable_state_dict(model: Eagle3Draft) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps: every trained parameter and the vocab buffers; not the frozen embedding."""
    return {name: value for name, value in model.state_dict().items() if name != "embed_tokens.weight"}
