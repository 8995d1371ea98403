"""CPU stand-in for `sgl_kernel` (see `_eagle_tap_standin.py`).

The ops SGLang's EAGLE-3 speculative decoding calls on a CPU are implemented in plain torch
(`_eagle_tap_kernels.py`) and the attention backend SGLang uses for it on a CPU is made available
on CPUs without AMX (`_eagle_tap_speculative_cpu.py`); calling anything else raises `StandInCalledError`.
Beside it, two CPU-only measures that are not stand-ins: MLA models on torch_native attention
(`_eagle_tap_mla_cpu.py`) and data-parallel attention / expert parallelism (`_eagle_tap_dp_attention_cpu.py`).
"""

import _eagle_tap_dp_attention_cpu
import _eagle_tap_mla_cpu
import _eagle_tap_speculative_cpu
from _eagle_tap_kernels import (  # noqa: F401  (re-exported under their sgl_kernel names)
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    build_draft_decode_metadata_cpu,
    build_tree_kernel_efficient_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    register_torch_ops,
    verify_tree_greedy_cpu,
)
from _eagle_tap_standin import install_stand_in

EAGLE_TAP_STAND_IN = True
# A parseable version below every real release, so version checks (transformers') take their no-package branch.
__version__ = "0.0.0"
register_torch_ops()
_eagle_tap_speculative_cpu.install()
_eagle_tap_mla_cpu.install()
_eagle_tap_dp_attention_cpu.install()
install_stand_in(__import__(__name__))
