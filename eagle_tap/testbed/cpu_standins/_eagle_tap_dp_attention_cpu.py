"""CPU only: let SGLang 0.5.23 serve with data-parallel attention (`--tp N --dp N --enable-dp-attention`), also
with expert parallelism (`--ep N`), the way DeepSeek-V3 / Kimi-K2.x are served.

With attention DP each DP group runs attention on its own requests; around the MLP/MoE the groups' tokens
are gathered over the TP group and scattered back, so every rank joins every forward (an idle group runs an
IDLE batch). Three gaps stop this on a CPU without AMX; each is closed by adjusting one SGLang object after
its module is imported (`_eagle_tap_import_hooks.after_import`), never by editing SGLang's files.

1. Padding a DP batch. What SGLang does: `ForwardBatch.prepare_mlp_sync_batch` pads each batch to the width
   agreed across DP groups (`_pad_inputs_to_size`) and fills the padded requests' `seq_lens` with the
   attention backend's `get_cpu_graph_seq_len_fill_value()` on a CPU (`get_cuda_graph_seq_len_fill_value()`
   elsewhere). Why it fails: only the AMX backends define that method, so the first forward of a server on
   `torch_native` raises `AttributeError: 'TorchNativeAttnBackend' object has no attribute
   'get_cpu_graph_seq_len_fill_value'`. The adjustment: `TorchNativeAttnBackend` gets the method, answering 1,
   the value of SGLang's other CPU backends (`IntelAMXAttnBackend`, the hybrid linear one). Why it is right:
   `torch_native` attends request by request over `seq_lens[i]` keys read through `req_pool_indices[i]`
   (padded with 0); a length of 1 makes a padding request a one-key attention over a valid slot (0 would
   be an empty softmax), and its rows are sliced off after the forward (`post_forward_mlp_sync_batch`).

2. The reduce-scatter back to each DP group with EP. What SGLang does: with `--ep` equal to the DP size
   (attention TP 1, no all-to-all backend), the MoE output is returned to each group's tokens with
   `GroupCoordinator.reduce_scatterv` (`layers/moe/utils.should_use_dp_reduce_scatterv`). Why it fails:
   that method only has a NCCL implementation (`pynccl_comm.reduce_scatter`); on a CPU the communicator is
   unavailable and the call dies with `AttributeError: 'PyNcclCommunicator' object has no attribute
   'device'`. The adjustment: where the group has no usable NCCL communicator, `reduce_scatterv` runs
   SGLang's own `_deterministic_reduce_scatterv` (the path `SGLANG_ENABLE_DETERMINISTIC_INFERENCE` selects):
   an all-reduce over the group (gloo on a CPU, as every other collective here) and this rank's slice of
   `sizes`. Why it is right: a reduce-scatter is by definition the sum over ranks followed by taking one's
   own rows; SGLang uses exactly this form when it wants a rank-independent reduction order.

3. MoE slots of other EP ranks. What SGLang does: with EP, `StandardDispatcher.dispatch` maps each token's
   top-k expert ids to this rank's local ids and marks experts held by other ranks (and, when enabled, DP
   padding rows) with -1, "the drop sentinel both the triton and deep_gemm runners honor". Why it fails:
   the CPU path without AMX (`UnquantizedFusedMoEMethod.forward_cpu` -> `fused_moe_native.moe_forward_native`)
   does not honor it: `cnts.scatter_(1, topk_ids, 1)` raises `RuntimeError: index -1 is out of bounds for
   dimension 1`. The adjustment: `moe_forward_native` is wrapped so that a batch with -1 slots is computed
   as one (token, slot) pair per kept slot, each routed top-1 to its expert with its weight, and the pairs'
   outputs summed back per token (fp32 accumulation, like the original's weighted sum); a batch without -1
   goes to the original unchanged. Why it is right: a dropped slot contributes nothing on this rank (its
   expert's rank adds it, and the reduce-scatter/all-reduce after the MoE sums the ranks), which is what
   the GPU runners do; the pairs keep each kept slot's expert and weight, and SGLang's own function does
   the expert math. (Replacing -1 by expert 0 with weight 0 would not do: the function counts experts per
   token with `scatter_`, which loses duplicates within a row.)

What cannot run on a CPU: the all-to-all MoE backends (`--moe-a2a-backend deepep|mooncake|nixl|mori|pplx|
flashinfer|...`) are CUDA/ROCm/NPU libraries with no CPU build (`deepep`: `ImportError: DeepEP is not
available` from `layers/moe/token_dispatcher/deepep.py`).

Loaded from the `sgl_kernel` stand-in (CPU machines only), and only under `SGLANG_USE_CPU_ENGINE=1`; safe to
install twice. A server with one rank never reaches any of the three adjusted paths.
"""

from __future__ import annotations

import functools
import os
import types

from _eagle_tap_import_hooks import after_import

TORCH_NATIVE_BACKEND = "sglang.srt.layers.attention.torch_native_backend"
PARALLEL_STATE = "sglang.srt.distributed.parallel_state"
FUSED_MOE_NATIVE = "sglang.srt.layers.moe.fused_moe_native"


def _patch_torch_native_backend(module: types.ModuleType) -> None:
    """1. The padding fill value of SGLang's other CPU backends."""
    backend = module.TorchNativeAttnBackend
    if "get_cpu_graph_seq_len_fill_value" in vars(backend):
        return

    def get_cpu_graph_seq_len_fill_value(self) -> int:
        return 1

    backend.get_cpu_graph_seq_len_fill_value = get_cpu_graph_seq_len_fill_value


def _patch_group_coordinator(module: types.ModuleType) -> None:
    """2. `reduce_scatterv` as all-reduce + own slice where the group has no NCCL communicator."""
    coordinator = module.GroupCoordinator
    reduce_scatterv = coordinator.reduce_scatterv
    if getattr(reduce_scatterv, "eagle_tap_dp_attention_cpu", False):
        return

    @functools.wraps(reduce_scatterv)
    def reduce_scatterv_without_nccl(self, input_, output=None, sizes=None):
        if self.pynccl_comm is None or not self.pynccl_comm.available:
            return self._deterministic_reduce_scatterv(input_, output, sizes)
        return reduce_scatterv(self, input_, output, sizes)

    reduce_scatterv_without_nccl.eagle_tap_dp_attention_cpu = True
    coordinator.reduce_scatterv = reduce_scatterv_without_nccl


def _patch_moe_forward_native(module: types.ModuleType) -> None:
    """3. The native MoE honours the -1 drop sentinel of expert parallelism."""
    moe_forward_native = module.moe_forward_native
    if getattr(moe_forward_native, "eagle_tap_dp_attention_cpu", False):
        return

    @functools.wraps(moe_forward_native)
    def moe_forward_native_skipping_dropped_slots(layer, x, topk_output, moe_runner_config):
        import torch

        topk_weights, topk_ids, _ = topk_output  # (T, K) each; id -1: another EP rank's expert, or a padding row
        kept = topk_ids >= 0
        if bool(kept.all()):
            return moe_forward_native(layer, x, topk_output, moe_runner_config)
        token_index, slot = kept.nonzero(as_tuple=True)  # (P,) each: the (token, slot) pairs this rank computes
        pairs = topk_output._replace(topk_ids=topk_ids[token_index, slot, None],  # (P, 1)
                                     topk_weights=topk_weights[token_index, slot, None])  # (P, 1)
        out = torch.zeros(x.shape[0], x.shape[-1], dtype=torch.float32, device=x.device)  # (T, H)
        if token_index.numel():
            weighted = moe_forward_native(layer, x[token_index], pairs, moe_runner_config)  # (P, H), weight applied
            out.index_add_(0, token_index, weighted.float())
        return out.to(x.dtype)

    moe_forward_native_skipping_dropped_slots.eagle_tap_dp_attention_cpu = True
    module.moe_forward_native = moe_forward_native_skipping_dropped_slots


def install() -> None:
    """Apply the three adjustments when (or if already) SGLang imports the modules they change (CPU engine only)."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        after_import(TORCH_NATIVE_BACKEND, _patch_torch_native_backend)
        after_import(PARALLEL_STATE, _patch_group_coordinator)
        after_import(FUSED_MOE_NATIVE, _patch_moe_forward_native)
