"""Plain-torch CPU implementations of the `sgl_kernel` ops that SGLang 0.5.23's EAGLE-3 path calls on a CPU.

SGLang runs speculative decoding on a CPU through `sgl_kernel`'s `*_cpu` ops (C++ in sgl-kernel's
`csrc/cpu/`), which have no build on PyPI. The import-only stand-in (`sgl_kernel/__init__.py`) exports
the functions below under their `sgl_kernel` names, so SGLang's own speculative code runs unchanged on
this project's CPU machines; anything not implemented here still raises the stand-in error.

What must hold:
- each function computes what the SGLang call site expects of its `sgl_kernel` twin: the same outputs,
  written in place into the same arguments (the docstring names the SGLang source it mirrors, whose
  Triton twin next to the call site is the reference the unit tests compare against);
- only torch and numpy, no compiled code; speed is secondary (the tiny test models only);
- these are never loaded on a GPU machine: the stand-in folder is put on `PYTHONPATH` only when the
  real `sgl_kernel` is missing.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """Copy KV slot `src_loc[i]` to slot `tgt_loc[i]` in every KV buffer (all layers, K and V).

    Mirrors `sglang/kernels/ops/kvcache/cache_move.py::copy_all_layer_kv_cache_func` (CPU branch) and its
    Triton twin `copy_all_layer_kv_cache_tiled`: `data_ptrs[b]` is the address of buffer b,
    `strides[b]` its slot size in bytes. All sources are read before any target is written, so an
    in-place permutation is safe, as in the Triton kernel's per-tile load-then-store.
    """
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64).numpy()
    src = src_loc.to(torch.int64).numpy()
    num_slots = int(max(tgt.max(), src.max())) + 1
    for address, stride_bytes in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_ubyte * (num_slots * stride_bytes)).from_address(address)
        slots = np.frombuffer(raw, dtype=np.uint8).reshape(num_slots, stride_bytes)  # (slots, bytes): a view
        slots[tgt] = slots[src]


# --- speculative decoding bookkeeping (sgl-kernel csrc/cpu/spec.cpp; Triton twins in sglang/kernels/ops/speculative/)



def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """req_to_token[req_pool_indices[b], start_offset[b]:end_offset[b]] = the next end-start entries of out_cache_loc.

    Mirrors `srt/mem_cache/allocation.py::assign_req_to_token_pool_func` (CPU branch; Triton twin
    `assign_req_to_token_pool` there).
    """
    table = req_to_token.view(-1, pool_len)
    taken = 0
    for request, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        table[request, start:end] = out_cache_loc[taken:taken + end - start].to(table.dtype)
        taken += end - start

def assign_draft_cache_locs_contiguous_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                           seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, pool_len: int,
                                           topk: int, num_steps: int) -> None:
    """out_cache_loc[b*topk*steps : (b+1)*topk*steps] = req_to_token[req_pool_indices[b], seq_lens[b] : +topk*steps].

    Mirrors `kernels/ops/speculative/cache_locs.py::assign_draft_cache_locs_contiguous` (CPU branch).
    """
    copy_len = topk * num_steps
    columns = seq_lens.to(torch.int64)[:, None] + torch.arange(copy_len)  # (B, topk*steps)
    rows = req_to_token.view(-1, pool_len)[req_pool_indices.to(torch.int64)]  # (B, pool_len)
    out_cache_loc.view(-1, copy_len)[:] = torch.gather(rows, 1, columns).to(out_cache_loc.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """Concatenate req_to_token[req_pool_indices[b], start_offset[b]:end_offset[b]] over b into out_cache_loc.

    Mirrors `kernels/ops/speculative/cache_locs.py::assign_extend_cache_locs` (CPU branch).
    """
    table = req_to_token.view(-1, pool_len)
    pieces = [table[int(request), int(start):int(end)]
              for request, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist())]
    if pieces:
        gathered = torch.cat(pieces)
        out_cache_loc[: gathered.numel()] = gathered.to(out_cache_loc.dtype)


def build_draft_decode_metadata_cpu(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                                    seq_lens: torch.Tensor, topk: int, num_steps: int, pool_len: int) -> torch.Tensor:
    """The req_to_token table of multi-step draft decode: row b*topk+k is request b's committed prefix
    followed by candidate k's draft slots (laid out at seq_len + k*num_steps by the draft cache-loc
    assignment). Only the first seq_lens[b] + num_steps entries of a row are defined.

    Mirrors `layers/attention/intel_amx_backend.py::IntelAMXMultiStepDraftBackend` (its kernel call).
    """
    num_seqs = req_pool_indices.numel()
    draft_table = torch.zeros((num_seqs * topk, pool_len), dtype=req_to_token.dtype)
    for b, (request, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        source = req_to_token[request]
        for candidate in range(topk):
            row = draft_table[b * topk + candidate]
            row[:seq_len] = source[:seq_len]
            start = seq_len + candidate * num_steps
            row[seq_len:seq_len + num_steps] = source[start:start + num_steps]
    return draft_table


def fill_bonus_tokens_cpu(accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor,
                          accept_stride: int) -> None:
    """bonus_tokens[b] = accept_tokens.flat[b*accept_stride + accept_lens[b] - 1] (the last accepted token).

    Mirrors `kernels/ops/speculative/eagle.py::fill_bonus_tokens`.
    """
    batch = torch.arange(accept_lens.numel())
    flat_index = batch * accept_stride + accept_lens.to(torch.int64) - 1
    bonus_tokens[:] = accept_tokens.reshape(-1)[flat_index].to(bonus_tokens.dtype)


def fill_accept_out_cache_loc_cpu(accept_index: torch.Tensor, out_cache_loc: torch.Tensor,
                                  accept_out_cache_loc: torch.Tensor) -> None:
    """Compact out_cache_loc at the accepted indices (accept_index != -1), in order, into accept_out_cache_loc.

    Mirrors `kernels/ops/speculative/eagle.py::fill_accept_out_cache_loc`.
    """
    accepted = accept_index.reshape(-1)
    accepted = accepted[accepted > -1].to(torch.int64)
    accept_out_cache_loc[: accepted.numel()] = out_cache_loc[accepted].to(accept_out_cache_loc.dtype)


def verify_tree_greedy_cpu(*, predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
                           candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                           retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor) -> None:
    """Greedy verification of each request's draft tree: walk from the root, at each depth take the first
    child (then its siblings) whose draft token equals the target's argmax at the last accepted node.

    Writes predicts[flat node] (the target's token at each accepted node), accept_index[b, :n+1] (flat
    indices of the accepted nodes, root first; the rest untouched) and accept_token_num[b] = n (accepted
    drafts, the bonus token excluded). Mirrors `kernels/ops/speculative/spec_tree.py::verify_tree_greedy`.
    """
    batch_size, num_draft_tokens = candidates.shape
    num_spec_steps = accept_index.shape[1]
    flat_targets = target_predict.reshape(-1).tolist()
    for b in range(batch_size):
        nodes = retrive_index[b].tolist()
        tokens = candidates[b].tolist()
        next_token = retrive_next_token[b].tolist()
        next_sibling = retrive_next_sibling[b].tolist()
        last_accepted = nodes[0]
        accept_index[b, 0] = last_accepted
        num_correct, current = 0, 0
        for _ in range(1, num_spec_steps):
            current = next_token[current]
            while current != -1:
                if tokens[current] == flat_targets[last_accepted]:
                    predicts[last_accepted] = flat_targets[last_accepted]
                    num_correct += 1
                    accept_index[b, num_correct] = nodes[current]
                    last_accepted = nodes[current]
                    break
                current = next_sibling[current]
            if current == -1:
                break
        accept_token_num[b] = num_correct
        predicts[last_accepted] = flat_targets[last_accepted]


def _selected_position(selected_row: list[int], draft_index: int, num_draft_tokens: int) -> int | None:
    """Where the draft token with flat score index `draft_index` sits among the n-1 selected ones, or None."""
    selection = selected_row[: num_draft_tokens - 1]
    return selection.index(draft_index) if draft_index in selection else None


_FULL_MASK, _QLEN_ONLY = 0, 1  # sglang.srt.speculative.eagle_utils.TreeMaskMode values this op accepts


def build_tree_kernel_efficient_cpu(parent_list: torch.Tensor, selected_index: torch.Tensor,
                                    verified_seq_len: torch.Tensor, tree_mask: torch.Tensor, positions: torch.Tensor,
                                    retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                                    retrive_next_sibling: torch.Tensor, topk: int, depth: int, draft_token_num: int,
                                    tree_mask_mode: int) -> None:
    """Build the verify tree of each request from the draft's top-k parent list.

    Writes the tree attention mask (QLEN_ONLY: [bs, n, n] among the draft tokens; FULL_MASK: each row
    also covers the committed prefix), the positions, and the retrieval links (flat index, first child,
    next sibling; the links arrive pre-filled with -1). Mirrors
    `kernels/ops/speculative/spec_tree.py::build_tree_kernel_efficient` (CPU branch); the Triton twin
    is `build_tree_kernel_triton` there.
    """
    if tree_mask_mode not in (_FULL_MASK, _QLEN_ONLY):
        raise ValueError(f"tree mask mode {tree_mask_mode} is not supported on CPU (only FULL_MASK=0, QLEN_ONLY=1)")
    n = draft_token_num
    parents, selected = parent_list.tolist(), selected_index.tolist()
    seq_lens = verified_seq_len.tolist()
    mask_offset = 0  # FULL_MASK rows are (seq_len + n) wide, requests back to back
    for b, seq_len in enumerate(seq_lens):
        offset = b * n
        positions[offset] = seq_len
        retrive_index[b, 0] = offset
        for i in range(n - 1, 0, -1):
            retrive_index[b, i] = offset + i
            parent_tb = selected[b][i - 1] // topk
            parent_position = 0  # the root
            if parent_tb > 0:
                found = _selected_position(selected[b], parents[b][parent_tb], n)
                if found is None:
                    continue  # its parent fell out of the selection: the token stays unlinked, as in the twin
                parent_position = found + 1
            first_child = int(retrive_next_token[b, parent_position])
            retrive_next_token[b, parent_position] = i
            if first_child != -1:
                retrive_next_sibling[b, i] = first_child
        row_width = n if tree_mask_mode == _QLEN_ONLY else seq_len + n
        row_base = offset * n if tree_mask_mode == _QLEN_ONLY else mask_offset
        prefix = 0 if tree_mask_mode == _QLEN_ONLY else seq_len
        for token in range(n):
            row = row_base + token * row_width + prefix
            tree_mask[row] = True  # the root
            tree_mask[row + 1: row + n] = False
            if token == 0:
                continue
            position, current = 0, token - 1
            for _ in range(depth):  # a path has at most `depth` draft tokens
                position += 1
                tree_mask[row + current + 1] = True
                parent_tb = selected[b][current] // topk
                if parent_tb == 0:
                    break
                current = _selected_position(selected[b], parents[b][parent_tb], n)
                if current is None:
                    break  # the parent fell out of the selection: the path ends here, as in the twin
            positions[offset + token] = position + seq_len
        mask_offset += n * (seq_len + n)


# --- attention (sgl-kernel csrc/cpu/decode.cpp, extend.cpp; called by layers/attention/intel_amx_backend.py)


def _unsupported(op: str, what: str) -> NotImplementedError:
    return NotImplementedError(f"eagle-tap's torch {op} does not support {what} (the tiny CPU test targets need none)")


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, sm_scale: float, logit_cap: float,
            visible: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """Attention of query (Q, Hq, D) over keys (K, Hkv, D) / values (K, Hkv, Dv) -> (Q, Hq, Dv), in query's dtype.

    visible (Q, K) bool, or causal (Q == K). Without a logit cap this is torch's scaled_dot_product_attention
    laid out as SGLang's `TorchNativeAttnBackend` calls it, so that a server with a draft computes the
    target's attention with the same rounding as one without (greedy outputs are compared token for token).
    With a logit cap (which that backend ignores) the scores are capped in fp32."""
    if logit_cap > 0:
        group = query.shape[1] // keys.shape[1]
        expanded_keys = keys.float().repeat_interleave(group, dim=1)  # (K, Hq, D)
        expanded_values = values.float().repeat_interleave(group, dim=1)  # (K, Hq, Dv)
        scores = torch.einsum("qhd,khd->hqk", query.float(), expanded_keys) * sm_scale  # (Hq, Q, K)
        scores = logit_cap * torch.tanh(scores / logit_cap)
        if causal:
            visible = torch.ones(scores.shape[1:], dtype=torch.bool).tril()
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), expanded_values)  # (Q, Hq, Dv)
        return out.to(query.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.movedim(0, 1).unsqueeze(0),  # (1, Hq, Q, D)
        keys.to(query.dtype).movedim(0, 1).unsqueeze(0),  # (1, Hkv, K, D)
        values.to(query.dtype).movedim(0, 1).unsqueeze(0),  # (1, Hkv, K, Dv)
        attn_mask=visible, is_causal=causal, scale=sm_scale, enable_gqa=query.shape[1] != keys.shape[1])
    return out.squeeze(0).movedim(0, 1)  # (Q, Hq, Dv)


def _window(visible: torch.Tensor, query_positions: torch.Tensor, sliding_window: int) -> torch.Tensor:
    """Restrict visibility to the last `sliding_window` keys up to each query's position (0: no window)."""
    if sliding_window <= 0:
        return visible
    key_positions = torch.arange(visible.shape[1])
    return visible & (key_positions[None, :] > query_positions[:, None] - sliding_window)


def _cached(buffer: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows `slots` of a KV buffer, scaled back where the buffer holds scaled (fp8) values."""
    rows = buffer[slots]
    return rows if scale == 1.0 else rows.float() * scale


def decode_attention_cpu(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float,
                         v_scale: float, output: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                         loc: torch.Tensor, attn_logits: torch.Tensor, req_to_token: torch.Tensor,
                         req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float, logit_cap: float,
                         is_cross_attention: bool, sliding_window: int, encoder_lens: torch.Tensor | None,
                         sinks: torch.Tensor | None) -> None:
    """One query token per sequence over its whole KV (req_to_token[req, :seq_len]).

    When `key`/`value` are given they are first written to the cache at `loc` (the kernel stores the new
    token's KV itself). `output` (B, Hq, Dv) is written in place; `attn_logits` is the C++ kernel's
    scratch space and is not used. Mirrors the call in `IntelAMXAttnBackend.forward_decode`.
    """
    if is_cross_attention or encoder_lens is not None or sinks is not None:
        raise _unsupported("decode_attention_cpu", "cross attention, encoder lengths or attention sinks")
    if key is not None and value is not None:
        k_cache[loc] = key.to(k_cache.dtype)
        v_cache[loc] = value.to(v_cache.dtype)
    for b, (request, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        slots = req_to_token[request, :seq_len].to(torch.int64)
        visible = None
        if sliding_window > 0:
            visible = _window(torch.ones((1, seq_len), dtype=torch.bool), torch.tensor([seq_len - 1]), sliding_window)
        output[b] = _attend(query[b:b + 1], _cached(k_cache, slots, k_scale), _cached(v_cache, slots, v_scale),
                            sm_scale=sm_scale, logit_cap=logit_cap, visible=visible)[0].to(output.dtype)


def extend_attention_cpu(q_extend: torch.Tensor, k_extend: torch.Tensor | None, v_extend: torch.Tensor | None,
                         o_extend: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, k_scale: float,
                         v_scale: float, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         seq_lens: torch.Tensor, extend_seq_lens: torch.Tensor, extend_start_loc: torch.Tensor,
                         max_len_extend: int, sm_scale: float, logit_cap: float, is_cross_attention: bool,
                         sliding_window: int, encoder_lens: torch.Tensor | None, sinks: torch.Tensor | None,
                         tree_mask: torch.Tensor | None, is_causal: bool) -> None:
    """Each sequence's new tokens (rows extend_start_loc[b] : +extend_seq_lens[b]) over its cached prefix
    (req_to_token[req, :seq_len - extend_len], from the buffers) and its own new tokens (k/v_extend;
    from the buffers at req_to_token[req, prefix:seq_len] when they are None).

    The prefix is visible to every new token; among the new tokens visibility is causal, or given by
    `tree_mask` in QLEN_ONLY layout ([bs, n, n] flattened: row i, column j says whether draft token i
    sees draft token j), or full when not causal. `o_extend` (N, Hq, Dv) is written in place.
    As in `TorchNativeAttnBackend`, each sequence's queries sit at their positions in a full-length
    query block, so causal attention is one call. Mirrors the call in `IntelAMXAttnBackend.forward_extend`.
    """
    if is_cross_attention or encoder_lens is not None or sinks is not None:
        raise _unsupported("extend_attention_cpu", "cross attention, encoder lengths or attention sinks")
    mask_offset = 0
    for request, seq_len, extend_len, start in zip(
            req_pool_indices.tolist(), seq_lens.tolist(), extend_seq_lens.tolist(), extend_start_loc.tolist()):
        prefix_len = seq_len - extend_len
        slots = req_to_token[request, :seq_len].to(torch.int64)
        keys, values = _cached(k_buffer, slots, k_scale), _cached(v_buffer, slots, v_scale)  # (K, Hkv, D|Dv)
        if k_extend is not None and v_extend is not None:
            keys = keys.clone()
            values = values.clone()
            keys[prefix_len:] = k_extend[start:start + extend_len].to(keys.dtype)
            values[prefix_len:] = v_extend[start:start + extend_len].to(values.dtype)
        queries = q_extend.new_zeros((seq_len, *q_extend.shape[1:]))  # (K, Hq, D): rows before prefix_len unused
        queries[prefix_len:] = q_extend[start:start + extend_len]
        visible, causal = None, is_causal
        if tree_mask is not None or sliding_window > 0:
            visible = torch.ones((seq_len, seq_len), dtype=torch.bool).tril()  # (Q, K) over the full block
            if tree_mask is not None:
                block = tree_mask[mask_offset: mask_offset + extend_len * extend_len].view(extend_len, extend_len)
                visible[prefix_len:, prefix_len:] = block
                mask_offset += extend_len * extend_len
            elif not is_causal:
                visible[prefix_len:, prefix_len:] = True
            visible = _window(visible, torch.arange(seq_len), sliding_window)
            causal = False
        out = _attend(queries, keys, values, sm_scale=sm_scale, logit_cap=logit_cap, visible=visible, causal=causal)
        o_extend[start:start + extend_len] = out[prefix_len:].to(o_extend.dtype)


# Schemas for torch.ops.sgl_kernel.*, positional as `IntelAMXAttnBackend` calls them (SGLang 0.5.23).
_ATTENTION_SCHEMAS = {
    "decode_attention_cpu": (
        "decode_attention_cpu(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, float k_scale, float v_scale, "
        "Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc, Tensor attn_logits, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross_attention, "
        "int sliding_window, Tensor? encoder_lens, Tensor? sinks) -> ()"),
    "extend_attention_cpu": (
        "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, "
        "Tensor k_buffer, Tensor v_buffer, float k_scale, float v_scale, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, "
        "int max_len_extend, float sm_scale, float logit_cap, bool is_cross_attention, int sliding_window, "
        "Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask, bool is_causal) -> ()"),
}
_library: torch.library.Library | None = None


def register_torch_ops() -> None:
    """Make `torch.ops.sgl_kernel.decode_attention_cpu` / `extend_attention_cpu` the functions above (once)."""
    global _library
    if _library is not None or hasattr(torch.ops.sgl_kernel, "decode_attention_cpu"):
        return
    _library = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name, schema in _ATTENTION_SCHEMAS.items():
        _library.define(schema)
        _library.impl(name, globals()[name], "CPU")
