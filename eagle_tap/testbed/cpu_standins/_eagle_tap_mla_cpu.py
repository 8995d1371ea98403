"""CPU only: make SGLang's `torch_native` attention run MLA models (DeepSeek-V2/V3, Kimi-K2.x) through the
absorbed MLA method, for every forward.

Why. SGLang 0.5.23 picks an attention *method* per forward for MLA models through
`models/deepseek_common/attention_backend_handler.AttentionBackendRegistry`, keyed by the attention
backend's name. It has no entry for `torch_native`, so it falls back to the `triton` entry, which
chooses the non-absorbed MHA method (K and V decompressed per head, 48 = nope + rope wide here) for a
fresh prefill. `TorchNativeAttnBackend` however always reads K from the latent KV pool (80 = kv_lora_rank
+ rope wide), so the first fresh prefill fails in `torch.baddbmm`/`sdpa` with
`Expected size for first two dimensions of batch2 tensor to be: [4, 48] but got: [4, 80]`. The absorbed
method (`AttnForwardMethod.MLA`: queries projected into the latent space, attention over the latent
pool) is the one SGLang already uses with `torch_native` for decode and for prefills with a cached
prefix; using it for fresh prefills too computes the same attention (the absorption is algebra, not
an approximation) and matches HF transformers' DeepseekV3 within fp32 rounding (tests/test_capture_parity.py).

The same holds for the name `intel_amx`: a server with an EAGLE-3 draft builds its attention as
`IntelAMXAttnBackend` (`_eagle_tap_speculative_cpu.py`), and SGLang stamps the draft's own backends
(`speculative/draft_utils.py`) with the `intel_amx` entry's name, so an MLA draft layer
(`Eagle3DeepseekV2ForCausalLM`) asks the registry under that name, finds no entry, and took the MHA method
into a latent pool 80 wide: `The expanded size of the tensor (80) must match the existing size (48)`.
Both names get the absorbed method.

How. Registering a handler for each name that always answers the absorbed method, through the
registry's own `register` (no SGLang file is edited). The registry module is imported lazily inside
SGLang's scheduler process, so the handler is registered right after that module is executed (or at
once, if it already was), through `_eagle_tap_import_hooks.after_import`.

Where it runs. It lives beside the `sgl_kernel` stand-in, whose package imports it; that folder is put on
`PYTHONPATH` only by eagle-tap's CPU launcher (`eagle_tap.serve.sglang_server`, `device="cpu"`, no real
`sgl_kernel`). It additionally does nothing unless `SGLANG_USE_CPU_ENGINE=1`, so a GPU machine, which has
the real `sgl_kernel` and its own MLA backends, never loads or applies it.
"""

from __future__ import annotations

import os
import sys

from _eagle_tap_import_hooks import after_import

HANDLER_MODULE = "sglang.srt.models.deepseek_common.attention_backend_handler"
BACKEND_NAMES = ("torch_native", "intel_amx")


def _absorbed_mla_method(attn, forward_batch):
    """The handler: always SGLang's absorbed MLA method (or its CPU-fused twin)."""
    handler_module = sys.modules[HANDLER_MODULE]
    return handler_module._dispatch_mla_subtype(attn, forward_batch)


def _register(handler_module) -> None:
    for name in BACKEND_NAMES:
        handler_module.AttentionBackendRegistry.register(name, _absorbed_mla_method)


def install() -> None:
    """Apply the measure in this process (CPU engine only); safe to call more than once."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        after_import(HANDLER_MODULE, _register)
