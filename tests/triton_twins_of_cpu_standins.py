"""SGLang's own Triton twins of eagle-tap's torch `sgl_kernel` CPU ops, run on CPU tensors by Triton's interpreter.

`tests/test_cpu_standin_kernels.py` runs this file as a script in a subprocess, because Triton reads
`TRITON_INTERPRET=1` once at import and the setting must not reach other tests or the SGLang servers they
start. The script reads a JSON list of cases on stdin, runs each case's twin on its arguments and prints
`{case name: {argument name: tensor}}` with the arguments the op writes in place.

What must hold:
- each case runs the twin SGLang 0.5.23 launches next to the CPU call site, with the grid and extra
  arguments that call site gives it (`_twins` below names each); the attention twins get the stand-in's
  arguments turned into what the Triton attention backend passes (KV index lists, FULL_MASK tree rows,
  the new token's K/V stored first);
- a grid of zero programs launches nothing, as on a GPU (the interpreter would reject an empty grid);
- importing this module (for the tensor codec) imports neither triton nor sglang.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

_DTYPES = {str(dtype).removeprefix("torch."): dtype
           for dtype in (torch.bool, torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.uint8)}


def encode(tensor: torch.Tensor) -> dict[str, Any]:
    """A tensor as JSON: its dtype name, shape and flat values (float tensors travel as float32)."""
    values = tensor.float() if tensor.is_floating_point() else tensor
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "data": values.reshape(-1).tolist()}


def decode(encoded: dict[str, Any]) -> torch.Tensor:
    """The tensor `encode` wrote."""
    dtype = _DTYPES[encoded["dtype"]]
    return torch.tensor(encoded["data"], dtype=dtype).reshape(encoded["shape"])


def buffer_table(buffers: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(data_ptrs, strides): each KV buffer's address and slot size in bytes, as the KV pool hands them to
    `copy_all_layer_kv_cache_func`."""
    return (torch.tensor([buffer.data_ptr() for buffer in buffers], dtype=torch.int64),
            torch.tensor([buffer[0].nbytes for buffer in buffers], dtype=torch.int64))


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 1


def _kv_index_lists(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, starts: torch.Tensor,
                    ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(indptr (B+1,), indices): the KV slots req_to_token[r, start:end] per request, as the Triton backend
    lists them."""
    slots = [req_to_token[r, s:e] for r, s, e in zip(req_pool_indices.tolist(), starts.tolist(), ends.tolist())]
    lengths = torch.tensor([len(row) for row in slots], dtype=torch.int64)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    return indptr, torch.cat(slots).long() if slots else torch.empty(0, dtype=torch.int64)


def _twins() -> dict[str, tuple[Callable[..., None], tuple[str, ...]]]:
    """op name -> (twin run on keyword arguments, names of the arguments it writes)."""
    from sglang.kernels.ops.attention import decode_attention as triton_decode
    from sglang.kernels.ops.attention import extend_attention as triton_extend
    from sglang.kernels.ops.kvcache import cache_move
    from sglang.kernels.ops.speculative import cache_locs, eagle, spec_tree
    from sglang.srt.mem_cache import allocation

    def offset_range_launch(kernel) -> Callable[..., None]:
        """Both start/end-offset kernels: one program per request, the batch's power of 2 for the prefix sum."""
        def launch(*, req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
            batch_size = req_pool_indices.numel()
            kernel[(batch_size,)](req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len,
                                  _next_power_of_2(batch_size))
        return launch

    def assign_draft_cache_locs_contiguous(*, req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len,
                                           topk, num_steps):
        cache_locs.assign_draft_cache_locs_contiguous[(seq_lens.numel(),)](
            req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_steps)

    def fill_bonus_tokens(*, accept_tokens, accept_lens, bonus_tokens, accept_stride):
        eagle.fill_bonus_tokens[(accept_lens.numel(),)](accept_tokens, accept_lens, bonus_tokens, accept_stride)

    def fill_accept_out_cache_loc(*, accept_index, out_cache_loc, accept_out_cache_loc):
        size = accept_index.numel()
        eagle.fill_accept_out_cache_loc[(size,)](accept_index, out_cache_loc, accept_out_cache_loc,
                                                 _next_power_of_2(size))

    def verify_tree_greedy(*, predicts, accept_index, accept_token_num, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, target_predict):
        spec_tree.verify_tree_greedy_triton(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                            retrive_next_token, retrive_next_sibling, target_predict)

    def build_tree_kernel_efficient(*, parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                    retrive_index, retrive_next_token, retrive_next_sibling, topk, depth,
                                    draft_token_num, tree_mask_mode):
        spec_tree.sgl_build_tree_kernel_triton(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                               retrive_index, retrive_next_token, retrive_next_sibling, topk,
                                               depth, draft_token_num, spec_tree.TreeMaskMode(tree_mask_mode))

    def copy_all_layer_kv_cache(*, tgt_loc, src_loc, **buffers):
        data_ptrs, strides = buffer_table(list(buffers.values()))
        bytes_per_tile = 64
        num_tiles = -(-int(strides.max()) // bytes_per_tile)
        cache_move.copy_all_layer_kv_cache_tiled[(len(buffers), num_tiles)](
            data_ptrs, strides, tgt_loc, src_loc, tgt_loc.numel(), _next_power_of_2(tgt_loc.numel()),
            BYTES_PER_TILE=bytes_per_tile)

    def decode_attention(*, query, k_cache, v_cache, k_scale, v_scale, output, key, value, loc, req_to_token,
                         req_pool_indices, seq_lens, sm_scale, logit_cap, **_):
        if key is not None:  # the Triton backend stores the new token's K/V before its kernel runs
            k_cache[loc], v_cache[loc] = key, value
        kv_indptr, kv_indices = _kv_index_lists(req_to_token, req_pool_indices, torch.zeros_like(seq_lens), seq_lens)
        batch_size, num_heads, max_kv_splits = query.shape[0], query.shape[1], 8
        triton_decode.decode_attention_fwd(
            query, k_cache, v_cache, output, kv_indptr, kv_indices,
            torch.empty(batch_size, num_heads, max_kv_splits, v_cache.shape[-1]),
            torch.empty(batch_size, num_heads, max_kv_splits),
            torch.full((batch_size,), max_kv_splits, dtype=torch.int32), max_kv_splits, sm_scale, k_scale, v_scale,
            logit_cap=logit_cap)

    def extend_attention(*, q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, k_scale, v_scale,
                         req_to_token, req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc, max_len_extend,
                         sm_scale, logit_cap, tree_mask, is_causal, **_):
        prefix_lens = seq_lens - extend_seq_lens
        kv_indptr, kv_indices = _kv_index_lists(req_to_token, req_pool_indices, torch.zeros_like(seq_lens),
                                                prefix_lens)
        new_indptr, new_slots = _kv_index_lists(req_to_token, req_pool_indices, prefix_lens, seq_lens)
        if k_extend is None:  # the CPU op reads them from the buffers; the Triton kernel takes them as tensors
            k_extend, v_extend = k_buffer[new_slots], v_buffer[new_slots]
        custom_mask = mask_indptr = None
        if tree_mask is not None:  # QLEN_ONLY blocks -> the FULL_MASK rows the Triton kernel reads
            rows, offset = [], 0
            for prefix_len, extend_len in zip(prefix_lens.tolist(), extend_seq_lens.tolist()):
                block = tree_mask[offset:offset + extend_len * extend_len].view(extend_len, extend_len)
                rows.append(torch.cat([torch.ones(extend_len, prefix_len, dtype=torch.bool), block], 1).flatten())
                offset += extend_len * extend_len
            custom_mask = torch.cat(rows)
            mask_indptr = torch.cat([torch.zeros(1, dtype=torch.int64),
                                     torch.cumsum(extend_seq_lens.long() * seq_lens.long(), 0)])
        triton_extend.extend_attention_fwd(
            q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, new_indptr, kv_indptr, kv_indices,
            custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale, sm_scale=sm_scale,
            logit_cap=logit_cap)

    return {
        "copy_all_layer_kv_cache": (copy_all_layer_kv_cache, ("buffer_0", "buffer_1", "buffer_2", "buffer_3")),
        "decode_attention": (decode_attention, ("output", "k_cache", "v_cache")),
        "extend_attention": (extend_attention, ("o_extend",)),
        "assign_req_to_token_pool": (offset_range_launch(allocation.assign_req_to_token_pool), ("req_to_token",)),
        "assign_draft_cache_locs_contiguous": (assign_draft_cache_locs_contiguous, ("out_cache_loc",)),
        "assign_extend_cache_locs": (offset_range_launch(cache_locs.assign_extend_cache_locs), ("out_cache_loc",)),
        "fill_bonus_tokens": (fill_bonus_tokens, ("bonus_tokens",)),
        "fill_accept_out_cache_loc": (fill_accept_out_cache_loc, ("accept_out_cache_loc",)),
        "verify_tree_greedy": (verify_tree_greedy, ("predicts", "accept_index", "accept_token_num")),
        "build_tree_kernel_efficient": (build_tree_kernel_efficient, (
            "tree_mask", "positions", "retrive_index", "retrive_next_token", "retrive_next_sibling")),
    }


def run_cases(cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each case {"name", "op", "args"} -> the written arguments after its twin ran."""
    twins = _twins()
    results = {}
    for case in cases:
        twin, written = twins[case["op"]]
        args = {name: decode(value) if isinstance(value, dict) else value for name, value in case["args"].items()}
        grid_size = next(args[name].numel() for name in ("req_pool_indices", "accept_lens", "candidates",
                                                         "verified_seq_len", "accept_index", "tgt_loc") if name in args)
        if grid_size > 0:  # an empty grid launches nothing
            twin(**args)
        results[case["name"]] = {name: encode(args[name]) for name in written}
    return results


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1: the twins run on CPU tensors only under Triton's interpreter")
    json.dump(run_cases(json.load(sys.stdin)), sys.stdout)


if __name__ == "__main__":
    main()
