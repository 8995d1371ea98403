"""eagle-tap's torch stand-ins of the `sgl_kernel` CPU ops against their references, on random inputs.

What must hold, per op of `eagle_tap/testbed/cpu_standins/_eagle_tap_kernels.py`:
- the bookkeeping ops write exactly what SGLang's Triton twin next to the call site writes (run by Triton's
  interpreter in a subprocess, `tests/triton_twins_of_cpu_standins.py`), for batches of 1, several and
  none where the call site allows it, lengths of 0 and 1, slots at the end of a pool row, and the int32
  and int64 index tensors SGLang passes;
- `copy_all_layer_kv_cache_cpu` (raw buffer addresses; the interpreter follows them too, in its own
  process) copies what `copy_all_layer_kv_cache_tiled` copies, also when targets and sources overlap;
- the attention ops equal SGLang's Triton decode/extend attention kernels (same subprocess; inputs turned
  into the KV index lists and FULL_MASK rows the Triton backend builds) and per-sequence softmax attention
  (`scaled_dot_product_attention`, or a float64 definition for the tanh logit cap), with GQA, the prefix
  visible, causal, non-causal or tree-masked new tokens, decode's own KV write, and sliding windows (these
  against the per-sequence reference only: the Triton backend windows through its index lists);
- `build_draft_decode_metadata_cpu` keeps the contract of its docstring, which is the slot layout
  `assign_draft_cache_locs_contiguous` hands out;
- the stand-in `sgl_kernel` registers the attention ops under `torch.ops.sgl_kernel` and still raises
  `StandInCalledError` for any op it does not implement.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from eagle_tap.serve.sglang_server import CPU_STANDINS_DIR

sys.path.insert(0, str(Path(__file__).parent))
from triton_twins_of_cpu_standins import buffer_table, decode, encode  # noqa: E402

TWINS_SCRIPT = Path(__file__).parent / "triton_twins_of_cpu_standins.py"
PAD = -7  # fills output buffers, so a write the reference does not make shows up


def _load_kernels() -> types.ModuleType:
    """The stand-in kernels module, loaded from its file (not via `sgl_kernel`, which patches SGLang)."""
    spec = importlib.util.spec_from_file_location("_eagle_tap_kernels", CPU_STANDINS_DIR / "_eagle_tap_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kernels = _load_kernels()


# --- inputs shaped like SGLang's call sites


def _pool(gen: torch.Generator, num_rows: int, pool_len: int, num_slots: int) -> torch.Tensor:
    """A req_to_token table (int32, as SGLang's ReqToTokenPool) of distinct random KV slots."""
    return torch.randperm(num_slots, generator=gen)[: num_rows * pool_len].view(num_rows, pool_len).int()


def _rows(gen: torch.Generator, num_rows: int, batch_size: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randperm(num_rows, generator=gen)[:batch_size].to(dtype)


def _eagle_draft(gen: torch.Generator, batch_size: int, topk: int, num_steps: int,
                 num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent_list, selected_index) as EAGLE's draft builds them: `select_top_k_tokens` per step and
    `organize_draft_results` (SGLang 0.5.23 `speculative/spec_utils.py`, `eagle_utils.py`) on random scores."""
    scores = torch.rand(batch_size, topk, generator=gen).sort(dim=1, descending=True).values  # (B, topk)
    score_list = [scores[:, None, :]]  # each (B, rows, topk)
    parents_list = [torch.arange(-1, topk).expand(batch_size, -1)]  # (B, topk + 1)
    for step in range(1, num_steps):
        step_probs = torch.rand(batch_size, topk, topk, generator=gen).sort(dim=2, descending=True).values
        expanded = scores[:, :, None] * step_probs  # (B, topk, topk)
        scores, chosen = expanded.flatten(1).topk(topk, dim=1)  # (B, topk)
        score_list.append(expanded)
        parents_list.append(chosen + topk * topk * (step - 1) + topk)  # (B, topk)
    flat_scores = torch.cat(score_list, dim=1).flatten(1)  # (B, topk + (steps-1)*topk*topk)
    selected = flat_scores.topk(num_draft_tokens - 1, dim=1).indices.sort(dim=1).values  # (B, n-1)
    parent_list = (torch.cat(parents_list[:-1], dim=1) if num_steps > 1
                   else torch.empty(batch_size, 0, dtype=torch.int64))  # (B, topk+1 + (steps-2)*topk)
    return parent_list.contiguous(), selected


def _tree_buffers(batch_size: int, num_draft_tokens: int, seq_lens: torch.Tensor, mode: int) -> dict[str, Any]:
    """The buffers `eagle_utils.build_tree_kernel_efficient` hands the kernel: a True mask, -1 links."""
    mask_len = (num_draft_tokens * num_draft_tokens * batch_size if mode == 1
                else int(seq_lens.sum()) * num_draft_tokens + num_draft_tokens * num_draft_tokens * batch_size)
    return {
        "tree_mask": torch.ones(mask_len, dtype=torch.bool),
        "positions": torch.full((batch_size * num_draft_tokens,), PAD, dtype=torch.int64),
        "retrive_index": torch.full((batch_size, num_draft_tokens), -1, dtype=torch.int64),
        "retrive_next_token": torch.full((batch_size, num_draft_tokens), -1, dtype=torch.int64),
        "retrive_next_sibling": torch.full((batch_size, num_draft_tokens), -1, dtype=torch.int64),
    }


def _build_tree_args(gen: torch.Generator, batch_size: int, topk: int, num_steps: int, num_draft_tokens: int,
                     mode: int) -> dict[str, Any]:
    parent_list, selected = _eagle_draft(gen, batch_size, topk, num_steps, num_draft_tokens)
    seq_lens = torch.randint(1, 20, (batch_size,), generator=gen)  # int64, as batch.seq_lens
    buffers = _tree_buffers(batch_size, num_draft_tokens, seq_lens, mode)
    return {"parent_list": parent_list, "selected_index": selected, "verified_seq_len": seq_lens,
            "tree_mask": buffers["tree_mask"], "positions": buffers["positions"],
            "retrive_index": buffers["retrive_index"], "retrive_next_token": buffers["retrive_next_token"],
            "retrive_next_sibling": buffers["retrive_next_sibling"], "topk": topk, "depth": num_steps,
            "draft_token_num": num_draft_tokens, "tree_mask_mode": mode}


def _verify_args(gen: torch.Generator, batch_size: int, topk: int, num_steps: int, num_draft_tokens: int,
                 vocab_size: int, accept_all: bool = False) -> dict[str, Any]:
    """Inputs of `verify_tree_greedy` on a tree EAGLE's draft would build (links from the stand-in builder,
    itself compared with its twin below); a small vocabulary makes partial acceptance common."""
    tree = _build_tree_args(gen, batch_size, topk, num_steps, num_draft_tokens, mode=1)
    kernels.build_tree_kernel_efficient_cpu(*tree.values())
    candidates = torch.randint(0, vocab_size, (batch_size, num_draft_tokens), generator=gen)  # (B, n) int64
    target_predict = torch.randint(0, vocab_size, (batch_size, num_draft_tokens), generator=gen)  # (B, n)
    if accept_all:  # a chain whose every draft token is the target's choice at its parent
        target_predict[:, :-1] = candidates[:, 1:]
    return {
        "predicts": torch.full((batch_size * num_draft_tokens,), PAD, dtype=torch.int32),
        "accept_index": torch.full((batch_size, num_steps + 1), -1, dtype=torch.int32),
        "accept_token_num": torch.full((batch_size,), PAD, dtype=torch.int32),
        "candidates": candidates,
        "retrive_index": tree["retrive_index"],
        "retrive_next_token": tree["retrive_next_token"],
        "retrive_next_sibling": tree["retrive_next_sibling"],
        "target_predict": target_predict,
    }


def _pool_write_args(gen: torch.Generator, lengths: list[int], offset_dtype: torch.dtype, pool_len: int = 12,
                     num_rows: int = 6) -> dict[str, Any]:
    """start/end offsets with the given lengths; the first request ends at the end of its row when it fits."""
    batch_size = len(lengths)
    starts = [int(torch.randint(0, pool_len - length + 1, (1,), generator=gen)) for length in lengths]
    if lengths and lengths[0] > 0:
        starts[0] = pool_len - lengths[0]
    return {
        "req_pool_indices": _rows(gen, num_rows, batch_size, torch.int64),
        "req_to_token": _pool(gen, num_rows, pool_len, 10 * num_rows * pool_len),
        "start_offset": torch.tensor(starts, dtype=offset_dtype),
        "end_offset": torch.tensor([s + n for s, n in zip(starts, lengths)], dtype=offset_dtype),
    }


NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, V_HEAD_DIM = 4, 2, 8, 6


def _kv_pool(gen: torch.Generator, num_slots: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(num_slots, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
            torch.randn(num_slots, NUM_KV_HEADS, V_HEAD_DIM, generator=gen).to(dtype))


def _decode_args(gen: torch.Generator, seq_lens: list[int], logit_cap: float, sliding_window: int, write_kv: bool,
                 dtype: torch.dtype) -> dict[str, Any]:
    """`decode_attention_cpu`'s arguments as `IntelAMXAttnBackend.forward_decode` passes them."""
    batch_size, pool_len, num_rows, num_slots = len(seq_lens), 12, 6, 80
    k_cache, v_cache = _kv_pool(gen, num_slots, dtype)
    req_to_token = _pool(gen, num_rows, pool_len, num_slots)
    req_pool_indices = _rows(gen, num_rows, batch_size, torch.int64)
    loc = torch.stack([req_to_token[r, n - 1] for r, n in zip(req_pool_indices.tolist(), seq_lens)]).long()
    return {
        "query": torch.randn(batch_size, NUM_Q_HEADS, HEAD_DIM, generator=gen).to(dtype),  # (B, Hq, D)
        "k_cache": k_cache, "v_cache": v_cache, "k_scale": 1.0, "v_scale": 1.0,
        "output": torch.full((batch_size, NUM_Q_HEADS, V_HEAD_DIM), float(PAD), dtype=dtype),  # (B, Hq, Dv)
        "key": torch.randn(batch_size, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype) if write_kv else None,
        "value": torch.randn(batch_size, NUM_KV_HEADS, V_HEAD_DIM, generator=gen).to(dtype) if write_kv else None,
        "loc": loc, "attn_logits": torch.zeros(batch_size, NUM_Q_HEADS, 8, V_HEAD_DIM + 1),
        "req_to_token": req_to_token, "req_pool_indices": req_pool_indices,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int64), "sm_scale": HEAD_DIM ** -0.5, "logit_cap": logit_cap,
        "is_cross_attention": False, "sliding_window": sliding_window, "encoder_lens": None, "sinks": None,
    }


def _tree_visibility(gen: torch.Generator, extend_len: int) -> torch.Tensor:
    """(n, n) a QLEN_ONLY tree mask of a random tree: token i sees itself and its ancestors."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, extend_len)]
    visible = torch.eye(extend_len, dtype=torch.bool)
    for token in range(extend_len):
        ancestor = parents[token]
        while ancestor != -1:
            visible[token, ancestor] = True
            ancestor = parents[ancestor]
    return visible


def _extend_args(gen: torch.Generator, prefix_lens: list[int], extend_lens: list[int], masking: str,
                 logit_cap: float, sliding_window: int, pass_new_kv: bool) -> dict[str, Any]:
    """`extend_attention_cpu`'s arguments as `IntelAMXAttnBackend.forward_extend` passes them, after the
    backend stored the new tokens' K/V in the buffers."""
    batch_size, pool_len, num_rows, num_slots = len(prefix_lens), 12, 6, 80
    k_buffer, v_buffer = _kv_pool(gen, num_slots, torch.float32)
    req_to_token = _pool(gen, num_rows, pool_len, num_slots)
    req_pool_indices = _rows(gen, num_rows, batch_size, torch.int64)
    num_tokens = sum(extend_lens)
    starts = [sum(extend_lens[:b]) for b in range(batch_size)]
    k_extend = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)  # (N, Hkv, D)
    v_extend = torch.randn(num_tokens, NUM_KV_HEADS, V_HEAD_DIM, generator=gen)  # (N, Hkv, Dv)
    for b, r in enumerate(req_pool_indices.tolist()):
        new_slots = req_to_token[r, prefix_lens[b]:prefix_lens[b] + extend_lens[b]].long()
        k_buffer[new_slots] = k_extend[starts[b]:starts[b] + extend_lens[b]]
        v_buffer[new_slots] = v_extend[starts[b]:starts[b] + extend_lens[b]]
    tree_mask = (torch.cat([_tree_visibility(gen, n).flatten() for n in extend_lens]) if masking == "tree"
                 else None)  # (sum n*n,) QLEN_ONLY
    return {
        "q_extend": torch.randn(num_tokens, NUM_Q_HEADS, HEAD_DIM, generator=gen),  # (N, Hq, D)
        "k_extend": k_extend if pass_new_kv else None, "v_extend": v_extend if pass_new_kv else None,
        "o_extend": torch.full((num_tokens, NUM_Q_HEADS, V_HEAD_DIM), float(PAD)),  # (N, Hq, Dv)
        "k_buffer": k_buffer, "v_buffer": v_buffer, "k_scale": 1.0, "v_scale": 1.0,
        "req_to_token": req_to_token, "req_pool_indices": req_pool_indices,
        "seq_lens": torch.tensor([p + n for p, n in zip(prefix_lens, extend_lens)]),
        "extend_seq_lens": torch.tensor(extend_lens, dtype=torch.int32),
        "extend_start_loc": torch.tensor(starts, dtype=torch.int32), "max_len_extend": max(extend_lens),
        "sm_scale": 0.3, "logit_cap": logit_cap, "is_cross_attention": False, "sliding_window": sliding_window,
        "encoder_lens": None, "sinks": None, "tree_mask": tree_mask, "is_causal": masking != "full",
    }


DECODE_CASES = [  # name, seq_lens, logit_cap, sliding_window, write_kv, dtype
    ("gqa", [5, 9, 1], 0.0, 0, True, torch.float32),
    ("bs1-len1", [1], 0.0, 0, True, torch.float32),
    ("logit-cap", [7, 3], 2.0, 0, True, torch.float32),
    ("window", [9, 2, 6], 0.0, 4, True, torch.float32),
    ("cache-only", [6, 4], 0.0, 0, False, torch.float32),
    ("bf16", [8, 5], 0.0, 0, True, torch.bfloat16),
]


EXTEND_CASES = [  # name, prefix_lens, extend_lens, masking, logit_cap, sliding_window, pass_new_kv
    ("causal-gqa", [3, 0, 6], [4, 2, 1], "causal", 0.0, 0, True),
    ("bs1-len1", [0], [1], "causal", 0.0, 0, True),
    ("non-causal", [2, 5], [3, 2], "full", 0.0, 0, True),
    ("tree-mask", [4, 7, 1], [5, 5, 5], "tree", 0.0, 0, True),
    ("logit-cap", [5, 2], [3, 4], "causal", 3.0, 0, True),
    ("window", [6, 1], [4, 3], "causal", 0.0, 3, True),
    ("new-kv-from-cache", [3, 4], [2, 3], "causal", 0.0, 0, False),
    ("one-request-adds-nothing", [4, 2], [0, 3], "causal", 0.0, 0, True),
]


def _cases() -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    cases: list[dict[str, Any]] = []

    def add(name: str, op: str, **args: Any) -> None:
        cases.append({"name": name, "op": op, "args": args})

    for name, lengths, dtype in [("bs1", [5], torch.int64), ("bs4-int32", [3, 0, 1, 12], torch.int32),
                                 ("bs5-int64", [2, 7, 1, 1, 4], torch.int64), ("empty", [], torch.int64),
                                 ("len0", [0], torch.int32)]:
        args = _pool_write_args(gen, lengths, dtype)
        out_cache_loc = torch.randint(0, 1000, (sum(lengths),), generator=gen)  # int64, as the allocator's
        add(f"assign_req_to_token_pool-{name}", "assign_req_to_token_pool", **args, out_cache_loc=out_cache_loc,
            pool_len=12)
        # the same offsets read back: the verify window gather, and `fill_front_out_cache_loc_func`'s int32 use
        out = torch.full((sum(lengths) + 3,), PAD, dtype=torch.int64)  # longer than needed: the tail stays
        add(f"assign_extend_cache_locs-{name}", "assign_extend_cache_locs", **args, out_cache_loc=out, pool_len=12)

    for name, batch_size, topk, num_steps, dtype in [("bs1-chain", 1, 1, 3, torch.int64),
                                                     ("bs3-topk2", 3, 2, 3, torch.int64),
                                                     ("bs4-topk4-int32", 4, 4, 2, torch.int32),
                                                     ("bs2-steps1", 2, 3, 1, torch.int64),
                                                     ("empty", 0, 2, 3, torch.int64)]:
        pool_len, num_rows = 16, 5
        seq_lens = torch.randint(1, pool_len - topk * num_steps + 1, (batch_size,), generator=gen)
        if batch_size:
            seq_lens[0] = pool_len - topk * num_steps  # the draft slots end at the end of the row
        add(f"assign_draft_cache_locs_contiguous-{name}", "assign_draft_cache_locs_contiguous",
            req_pool_indices=_rows(gen, num_rows, batch_size, torch.int64),
            req_to_token=_pool(gen, num_rows, pool_len, 200), seq_lens=seq_lens.to(dtype),
            out_cache_loc=torch.full((batch_size * topk * num_steps,), PAD, dtype=torch.int64),
            pool_len=pool_len, topk=topk, num_steps=num_steps)

    for name, batch_size, stride in [("bs1", 1, 4), ("bs6", 6, 4), ("bs3-stride1", 3, 1), ("empty", 0, 4)]:
        accept_lens = torch.randint(1, stride + 1, (batch_size,), generator=gen).int()
        if batch_size > 1:
            accept_lens[:2] = torch.tensor([1, stride], dtype=torch.int32)
        add(f"fill_bonus_tokens-{name}", "fill_bonus_tokens",
            accept_tokens=torch.randint(0, 50000, (batch_size, stride), generator=gen).int(),
            accept_lens=accept_lens, bonus_tokens=torch.full((batch_size,), PAD, dtype=torch.int32),
            accept_stride=stride)

    for name, batch_size, width, num_draft_tokens in [("bs1", 1, 4, 4), ("bs5", 5, 4, 6), ("bs3-width1", 3, 1, 2)]:
        accept_index = torch.full((batch_size, width), -1, dtype=torch.int32)
        for b in range(batch_size):  # accepted nodes first, as verify leaves them, then -1
            num_accepted = int(torch.randint(1, width + 1, (1,), generator=gen))
            nodes = torch.randperm(num_draft_tokens, generator=gen)[:num_accepted].sort().values
            accept_index[b, :num_accepted] = (b * num_draft_tokens + nodes).int()
        add(f"fill_accept_out_cache_loc-{name}", "fill_accept_out_cache_loc", accept_index=accept_index,
            out_cache_loc=torch.randint(0, 1000, (batch_size * num_draft_tokens,), generator=gen),
            accept_out_cache_loc=torch.full((accept_index.numel(),), PAD, dtype=torch.int64))

    tree_shapes = [("bs1-chain", 1, 1, 3, 4), ("bs3-chain", 3, 1, 4, 5), ("bs2-topk2", 2, 2, 3, 5),
                   ("bs3-topk4", 3, 4, 3, 8), ("bs2-topk3-steps1", 2, 3, 1, 3), ("bs1-topk2-wide", 1, 2, 4, 7)]
    for name, batch_size, topk, num_steps, num_draft_tokens in tree_shapes:
        for mode_name, mode in [("qlen_only", 1), ("full_mask", 0)]:
            add(f"build_tree-{name}-{mode_name}", "build_tree_kernel_efficient",
                **_build_tree_args(gen, batch_size, topk, num_steps, num_draft_tokens, mode))
        add(f"verify_tree_greedy-{name}", "verify_tree_greedy",
            **_verify_args(gen, batch_size, topk, num_steps, num_draft_tokens, vocab_size=3))
    # A draft token whose parent fell out of the selection (its score tied the parent's: a draft probability
    # of exactly 1.0): the twin leaves it unlinked and ends its mask path at the missing parent.
    for mode_name, mode in [("qlen_only", 1), ("full_mask", 0)]:
        seq_lens = torch.tensor([5, 3])
        add(f"build_tree-orphan-{mode_name}", "build_tree_kernel_efficient",
            parent_list=torch.tensor([[-1, 0, 1], [-1, 0, 1]]), selected_index=torch.tensor([[0, 4], [1, 2]]),
            verified_seq_len=seq_lens, **_tree_buffers(2, 3, seq_lens, mode), topk=2, depth=2,
            draft_token_num=3, tree_mask_mode=mode)
    # KV copies between slots of every buffer (two layers' K/V in bf16, other slot sizes), overlapping ones too
    for pattern, (tgt, src) in {"disjoint": ([1, 4, 7], [2, 3, 8]), "swap": ([2, 5], [5, 2]),
                                "chain": ([1, 2, 3], [2, 3, 4]), "last-slot": ([9, 0], [0, 9]),
                                "empty": ([], [])}.items():
        for loc_dtype in (torch.int64, torch.int32):
            add(f"copy_all_layer_kv_cache-{pattern}-{str(loc_dtype).removeprefix('torch.')}", "copy_all_layer_kv_cache",
                buffer_0=torch.randn(10, 2, 4, generator=gen).to(torch.bfloat16),
                buffer_1=torch.randn(10, 2, 4, generator=gen).to(torch.bfloat16),
                buffer_2=torch.randn(10, 3, generator=gen),
                buffer_3=torch.randint(0, 255, (10, 5), generator=gen).to(torch.uint8),
                tgt_loc=torch.tensor(tgt, dtype=loc_dtype), src_loc=torch.tensor(src, dtype=loc_dtype))
    # attention: SGLang's Triton attention kernels, where they take the same inputs (no window: the Triton
    # backend windows through its KV index lists, which these ops do not take)
    for name, seq_lens, logit_cap, sliding_window, write_kv, dtype in DECODE_CASES:
        if sliding_window == 0 and dtype == torch.float32:
            add(f"decode_attention-{name}", "decode_attention",
                **_decode_args(gen, seq_lens, logit_cap, sliding_window, write_kv, dtype))
    for name, prefix_lens, extend_lens, masking, logit_cap, sliding_window, pass_new_kv in EXTEND_CASES:
        if sliding_window == 0:
            add(f"extend_attention-{name}", "extend_attention",
                **_extend_args(gen, prefix_lens, extend_lens, masking, logit_cap, sliding_window, pass_new_kv))
    add("verify_tree_greedy-chain-all-accepted", "verify_tree_greedy",
        **_verify_args(gen, 2, 1, 4, 5, vocab_size=50, accept_all=True))
    add("verify_tree_greedy-bs4-topk2-large-vocab", "verify_tree_greedy",
        **_verify_args(gen, 4, 2, 3, 6, vocab_size=50))
    return cases


def _copy_all_layer_kv_cache(*, tgt_loc: torch.Tensor, src_loc: torch.Tensor, **buffers: torch.Tensor) -> None:
    """The stand-in as `copy_all_layer_kv_cache_func` calls it: addresses and slot sizes of every buffer."""
    kernels.copy_all_layer_kv_cache_cpu(*buffer_table(list(buffers.values())), tgt_loc, src_loc)


CASES = _cases()
KEYWORD_CALLS = {"verify_tree_greedy", "copy_all_layer_kv_cache"}  # called with keywords, the rest positionally
STANDINS: dict[str, Callable[..., None]] = {
    "copy_all_layer_kv_cache": _copy_all_layer_kv_cache,
    "assign_req_to_token_pool": kernels.assign_req_to_token_pool_cpu,
    "assign_draft_cache_locs_contiguous": kernels.assign_draft_cache_locs_contiguous_cpu,
    "assign_extend_cache_locs": kernels.assign_extend_cache_locs_cpu,
    "fill_bonus_tokens": kernels.fill_bonus_tokens_cpu,
    "fill_accept_out_cache_loc": kernels.fill_accept_out_cache_loc_cpu,
    "verify_tree_greedy": kernels.verify_tree_greedy_cpu,
    "build_tree_kernel_efficient": kernels.build_tree_kernel_efficient_cpu,
    "decode_attention": kernels.decode_attention_cpu,
    "extend_attention": kernels.extend_attention_cpu,
}


def _stand_in_subprocess_env(**extra: str) -> dict[str, str]:
    """The environment an SGLang server gets here (`server_environment`), plus `extra`."""
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CPU_STANDINS_DIR), env.get("PYTHONPATH")]))
    return env


def _run_stand_in(case: dict[str, Any]) -> dict[str, Any]:
    """The case's arguments (copies) after its stand-in ran on them, called as SGLang's call site calls it."""
    args = {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in case["args"].items()}
    if case["op"] in KEYWORD_CALLS:
        STANDINS[case["op"]](**args)
    else:
        STANDINS[case["op"]](*args.values())  # positionally, in the call site's order
    return args


@pytest.fixture(scope="module")
def triton_results() -> dict[str, dict[str, Any]]:
    """Every case run once through its Triton twin, in one interpreter subprocess."""
    encoded = [{**case, "args": {name: encode(value) if isinstance(value, torch.Tensor) else value
                                 for name, value in case["args"].items()}} for case in CASES]
    done = subprocess.run([sys.executable, str(TWINS_SCRIPT)], input=json.dumps(encoded), capture_output=True,
                          text=True, timeout=300, env=_stand_in_subprocess_env(TRITON_INTERPRET="1"))
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_matches_triton_twin(case: dict[str, Any], triton_results: dict[str, dict[str, Any]]) -> None:
    args = _run_stand_in(case)
    expected = triton_results[case["name"]]
    for name, written in expected.items():
        assert args[name].dtype == case["args"][name].dtype, f"{name} changed dtype"
        tolerance = 1e-5 if args[name].is_floating_point() else 0  # attention outputs: fp32 rounding only
        torch.testing.assert_close(args[name], decode(written), rtol=tolerance, atol=tolerance,
                                   msg=lambda m: f"{name}: {m}")


def test_the_cases_are_not_vacuous() -> None:
    """Every op has cases, and every case but the empty ones makes the stand-in write something."""
    assert {case["op"] for case in CASES} == set(STANDINS)
    for case in CASES:
        args = _run_stand_in(case)
        writes = any(not torch.equal(value, args[name]) for name, value in case["args"].items()
                     if isinstance(value, torch.Tensor))
        assert writes == ("empty" not in case["name"] and "len0" not in case["name"]), case["name"]


# --- build_draft_decode_metadata_cpu: no twin, its docstring's contract


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("batch_size,topk,num_steps", [(1, 1, 3), (3, 2, 3), (2, 4, 2), (0, 2, 2)])
def test_build_draft_decode_metadata(batch_size: int, topk: int, num_steps: int, index_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    pool_len, num_rows = 14, 5
    req_to_token = _pool(gen, num_rows, pool_len, 100)
    req_pool_indices = _rows(gen, num_rows, batch_size, index_dtype)
    seq_lens = torch.randint(1, pool_len - topk * num_steps + 1, (batch_size,), generator=gen)
    if batch_size:
        seq_lens[0] = pool_len - topk * num_steps  # the last candidate's slots end the row
    if batch_size > 1:
        seq_lens[1] = 1
    table = kernels.build_draft_decode_metadata_cpu(req_to_token, req_pool_indices, seq_lens.to(index_dtype), topk,
                                                    num_steps, pool_len)
    assert table.shape == (batch_size * topk, pool_len) and table.dtype == req_to_token.dtype

    # The draft slots the draft's cache-loc assignment gave each (request, candidate, step).
    draft_slots = torch.empty(batch_size * topk * num_steps, dtype=torch.int64)
    kernels.assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, draft_slots, pool_len,
                                                   topk, num_steps)
    draft_slots = draft_slots.view(batch_size, topk, num_steps)
    for b, (request, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        for candidate in range(topk):
            row = table[b * topk + candidate]
            assert torch.equal(row[:seq_len], req_to_token[request, :seq_len])  # the committed prefix
            assert torch.equal(row[seq_len:seq_len + num_steps].long(), draft_slots[b, candidate])


# --- attention: per-sequence reference


def _reference_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                         sm_scale: float, logit_cap: float) -> torch.Tensor:
    """query (Q, Hq, D), keys (K, Hkv, D), values (K, Hkv, Dv), visible (Q, K) -> (Q, Hq, Dv), in float32."""
    if logit_cap <= 0:  # torch's own attention, GQA by its enable_gqa
        out = F.scaled_dot_product_attention(query.float().transpose(0, 1), keys.float().transpose(0, 1),
                                             values.float().transpose(0, 1), attn_mask=visible, scale=sm_scale,
                                             enable_gqa=True)  # (Hq, Q, Dv)
        return out.transpose(0, 1)
    group = query.shape[1] // keys.shape[1]
    keys64 = keys.double().repeat_interleave(group, dim=1)  # (K, Hq, D)
    values64 = values.double().repeat_interleave(group, dim=1)  # (K, Hq, Dv)
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys64) * sm_scale  # (Hq, Q, K)
    scores = logit_cap * torch.tanh(scores / logit_cap)
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, values64).float()  # (Q, Hq, Dv)


def _causal_mask(query_positions: list[int], num_keys: int, sliding_window: int) -> torch.Tensor:
    """(Q, K) causal: key j at or before the query, and among its last `sliding_window` positions when that
    is > 0 (SGLang passes its window + 1: the query and `window` keys before it)."""
    keys = torch.arange(num_keys)[None, :]
    queries = torch.tensor(query_positions, dtype=torch.int64)[:, None]
    visible = keys <= queries
    return visible & (keys > queries - sliding_window) if sliding_window > 0 else visible


@pytest.mark.parametrize("name,seq_lens,logit_cap,sliding_window,write_kv,dtype", DECODE_CASES)
def test_decode_attention(name: str, seq_lens: list[int], logit_cap: float, sliding_window: int, write_kv: bool,
                          dtype: torch.dtype) -> None:
    args = _decode_args(torch.Generator().manual_seed(3), seq_lens, logit_cap, sliding_window, write_kv, dtype)
    expected_k, expected_v = args["k_cache"].clone(), args["v_cache"].clone()
    if write_kv:  # the kernel stores the new token's K/V at loc first
        expected_k[args["loc"]], expected_v[args["loc"]] = args["key"], args["value"]
    expected = torch.stack([
        _reference_attention(args["query"][b:b + 1], expected_k[slots], expected_v[slots],
                             _causal_mask([n - 1], n, sliding_window), args["sm_scale"], logit_cap)[0]
        for b, (r, n) in enumerate(zip(args["req_pool_indices"].tolist(), seq_lens))
        for slots in [args["req_to_token"][r, :n].long()]])  # (B, Hq, Dv)
    kernels.decode_attention_cpu(*args.values())
    assert torch.equal(args["k_cache"], expected_k) and torch.equal(args["v_cache"], expected_v)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(args["output"].float(), expected.to(dtype).float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("name,prefix_lens,extend_lens,masking,logit_cap,sliding_window,pass_new_kv", EXTEND_CASES)
def test_extend_attention(name: str, prefix_lens: list[int], extend_lens: list[int], masking: str, logit_cap: float,
                          sliding_window: int, pass_new_kv: bool) -> None:
    args = _extend_args(torch.Generator().manual_seed(4), prefix_lens, extend_lens, masking, logit_cap,
                        sliding_window, pass_new_kv)
    expected = torch.full_like(args["o_extend"], float(PAD))
    tree_offset = 0
    for b, r in enumerate(args["req_pool_indices"].tolist()):
        prefix_len, extend_len = prefix_lens[b], extend_lens[b]
        seq_len, start = prefix_len + extend_len, int(args["extend_start_loc"][b])
        visible = _causal_mask(list(range(prefix_len, seq_len)), seq_len, sliding_window)  # (Q, K)
        if masking == "full":
            visible[:, prefix_len:] = True
        elif masking == "tree":
            visible[:, prefix_len:] = args["tree_mask"][tree_offset:tree_offset + extend_len ** 2].view(extend_len, -1)
            tree_offset += extend_len ** 2
        slots = args["req_to_token"][r, :seq_len].long()
        expected[start:start + extend_len] = _reference_attention(
            args["q_extend"][start:start + extend_len], args["k_buffer"][slots], args["v_buffer"][slots], visible,
            args["sm_scale"], logit_cap)
    kernels.extend_attention_cpu(*args.values())
    torch.testing.assert_close(args["o_extend"], expected, rtol=1e-5, atol=1e-5)


# --- the stand-in sgl_kernel package: torch.ops registration and what stays unimplemented

_REGISTRATION_CHECK = """
import json, torch, sgl_kernel, _eagle_tap_kernels
from _eagle_tap_standin import StandInCalledError
gen = torch.Generator().manual_seed(5)
k_cache, v_cache = torch.randn(8, 1, 4, generator=gen), torch.randn(8, 1, 4, generator=gen)
query, q3 = torch.randn(1, 2, 4, generator=gen), torch.randn(3, 2, 4, generator=gen)
table, rows, lens = torch.arange(8, dtype=torch.int32).view(1, 8), torch.zeros(1, dtype=torch.int64), torch.tensor([3])
outputs = {}
for via, module in (("op", torch.ops.sgl_kernel), ("function", _eagle_tap_kernels)):
    out, o3 = torch.zeros(1, 2, 4), torch.zeros(3, 2, 4)
    module.decode_attention_cpu(query, k_cache, v_cache, 1.0, 1.0, out, None, None, torch.tensor([2]),
                                torch.zeros(1, 2, 8, 5), table, rows, lens, 0.5, 0.0, False, 0, None, None)
    module.extend_attention_cpu(q3, None, None, o3, k_cache, v_cache, 1.0, 1.0, table, rows, lens,
                                torch.tensor([3], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), 3, 0.5,
                                0.0, False, 0, None, None, None, True)
    outputs[via] = {"decode": out.tolist(), "extend": o3.tolist()}
try:
    sgl_kernel.fused_add_rmsnorm_cpu(query, query, query, 1e-6)
    outputs["missing"] = "returned"
except StandInCalledError as error:
    outputs["missing"] = "StandInCalledError: " + str(error)
print(json.dumps(outputs))
"""


def test_stand_in_package_registers_attention_ops_and_refuses_the_rest() -> None:
    done = subprocess.run([sys.executable, "-c", _REGISTRATION_CHECK], capture_output=True, text=True, timeout=120,
                          env=_stand_in_subprocess_env())
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["op"] == report["function"]  # torch.ops.sgl_kernel.* is the stand-in function
    assert report["missing"].startswith("StandInCalledError: sgl_kernel.fused_add_rmsnorm_cpu was called")
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = torch.randn(8, 1, 4, generator=gen), torch.randn(8, 1, 4, generator=gen)
    query, q3 = torch.randn(1, 2, 4, generator=gen), torch.randn(3, 2, 4, generator=gen)
    expected_decode = _reference_attention(query, k_cache[:3], v_cache[:3], torch.ones(1, 3, dtype=torch.bool),
                                           0.5, 0.0)
    expected_extend = _reference_attention(q3, k_cache[:3], v_cache[:3],
                                           torch.ones(3, 3, dtype=torch.bool).tril(), 0.5, 0.0)
    torch.testing.assert_close(torch.tensor(report["op"]["decode"]), expected_decode, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(report["op"]["extend"]), expected_extend, rtol=1e-5, atol=1e-5)


def test_unsupported_inputs_raise_a_clear_error() -> None:
    """Sinks, cross attention and bit-packed tree masks are refused, not computed wrongly."""
    query, cache = torch.zeros(1, 2, 4), torch.zeros(4, 1, 4)
    table, rows, lens = torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, dtype=torch.int64), torch.tensor([1])
    with pytest.raises(NotImplementedError, match="decode_attention_cpu does not support .*attention sinks"):
        kernels.decode_attention_cpu(query, cache, cache, 1.0, 1.0, torch.zeros(1, 2, 4), None, None,
                                     torch.tensor([0]), torch.zeros(1), table, rows, lens, 0.5, 0.0, False, 0, None,
                                     torch.zeros(2))
    with pytest.raises(NotImplementedError, match="extend_attention_cpu does not support cross attention"):
        kernels.extend_attention_cpu(query, None, None, torch.zeros(1, 2, 4), cache, cache, 1.0, 1.0, table, rows,
                                     lens, torch.tensor([1]), torch.tensor([0]), 1, 0.5, 0.0, True, 0, None, None,
                                     None, False)
    tree = _build_tree_args(torch.Generator().manual_seed(6), 1, 2, 2, 3, mode=1)
    with pytest.raises(ValueError, match="tree mask mode 2 is not supported on CPU"):
        kernels.build_tree_kernel_efficient_cpu(*{**tree, "tree_mask_mode": 2}.values())
