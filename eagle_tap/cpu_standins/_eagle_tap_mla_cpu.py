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

How. Registering a `torch_native` handler that always answers the absorbed method, through the
registry's own `register` (no SGLang file is edited). The registry module is imported lazily inside
SGLang's scheduler process, so this module installs a meta-path hook that registers the handler right
after that module is executed (or at once, if it already was).

Where it runs. It lives beside the `sgl_kernel` stand-in, whose package imports it; that folder is put on
`PYTHONPATH` only by eagle-tap's CPU launcher (`eagle_tap.sglang_server`, `device="cpu"`, no real
`sgl_kernel`). It additionally does nothing unless `SGLANG_USE_CPU_ENGINE=1`, so a GPU machine, which has
the real `sgl_kernel` and its own MLA backends, never loads or applies it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

HANDLER_MODULE = "sglang.srt.models.deepseek_common.attention_backend_handler"
BACKEND_NAME = "torch_native"


def _absorbed_mla_method(attn, forward_batch):
    """The `torch_native` handler: always SGLang's absorbed MLA method (or its CPU-fused twin)."""
    handler_module = sys.modules[HANDLER_MODULE]
    return handler_module._dispatch_mla_subtype(attn, forward_batch)


def _register(handler_module) -> None:
    handler_module.AttentionBackendRegistry.register(BACKEND_NAME, _absorbed_mla_method)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds HANDLER_MODULE with the normal finders, then registers the handler once it is executed."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != HANDLER_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _register(module)


def install() -> None:
    """Apply the measure in this process (CPU engine only); safe to call more than once."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        return
    if HANDLER_MODULE in sys.modules:
        _register(sys.modules[HANDLER_MODULE])
    elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
