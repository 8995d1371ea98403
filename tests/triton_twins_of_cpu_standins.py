"""SGLang's own Triton twins of eagle-tap's torch `sgl_kernel` CPU ops, run on CPU tensors by Triton's interpreter.

`tests/test_cpu_standin_kernels.py` runs this file as a script in a subprocess, because Triton reads
`TRITON_INTERPRET=1` once at import and the setting must not reach other tests or the SGLang servers they
start. The script reads a JSON list of cases on stdin, runs each case's twin on its arguments and prints
`{case name: {argument name: tensor}}` with the arguments the op writes in place.

What must hold:
- each case runs the twin SGLang 0.5.23 launches next to the CPU call site, with the grid and extra
  arguments that call site gives it (`TWINS` below names each);
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


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 1


def _twins() -> dict[str, tuple[Callable[..., None], tuple[str, ...]]]:
    """op name -> (twin run on keyword arguments, names of the arguments it writes)."""
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

    return {
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
        batch_size = args["accept_index"].numel() if case["op"] == "fill_accept_out_cache_loc" else next(
            args[name].shape[0] for name in ("req_pool_indices", "accept_lens", "candidates", "verified_seq_len")
            if name in args)
        if batch_size > 0:  # an empty grid launches nothing
            twin(**args)
        results[case["name"]] = {name: encode(args[name]) for name in written}
    return results


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1: the twins run on CPU tensors only under Triton's interpreter")
    json.dump(run_cases(json.load(sys.stdin)), sys.stdout)


if __name__ == "__main__":
    main()
