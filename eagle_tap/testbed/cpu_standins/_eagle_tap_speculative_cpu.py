"""Let SGLang 0.5.23 serve EAGLE-3 speculative decoding on a CPU without AMX, with SGLang's own CPU code.

SGLang has a CPU path for speculative decoding: the `intel_amx` attention backend
(`layers/attention/intel_amx_backend.py`, which knows the TARGET_VERIFY and DRAFT_EXTEND forward modes and
has a multi-step draft backend) on top of `sgl_kernel`'s `*_cpu` ops. Two things keep it from running here:
- `sgl_kernel` has no CPU build on PyPI: `_eagle_tap_kernels.py` implements the ops this path calls;
- on a CPU without AMX tiles SGLang resolves `--attention-backend intel_amx` to `torch_native`
  (`arg_groups/overrides.py::_attention_backend_platform_fallbacks`), whose backend handles neither
  verify nor draft-extend batches, and the draft backend maps (`speculative/draft_utils.py`) have no
  `torch_native` entry ("EAGLE is not supported in ... attention backend torch_native").

So, in a server that runs speculative decoding, the attention backend named `torch_native` is built as
SGLang's `IntelAMXAttnBackend` (its attention ops being the torch ones from `_eagle_tap_kernels.py`), and
the draft backend maps answer `torch_native` with their `intel_amx` entries. Only attention changes: the
linear and MoE layers keep their native torch paths (those follow the CPU's AMX flag, not this backend).
A server without a draft (capture servers) keeps the plain `TorchNativeAttnBackend`.

One more for the MLA draft (`models/kimi_k25_eagle3.py::Eagle3DeepseekV2ForCausalLM`): its `set_embed` and
`set_embed_and_head`, which the EAGLE-3 worker calls once to share the target's embedding and head, end in
`torch.cuda.empty_cache(); torch.cuda.synchronize()`, which raises on a CPU build of torch (the Llama draft's
twins call `current_platform`'s). On a CPU both are no-ops, so they run as no-ops for the duration of
those two calls, at start-up, before the scheduler serves anything.

Loaded from the `sgl_kernel` stand-in, so only where the real `sgl_kernel` is missing: never on a GPU machine.
"""

from __future__ import annotations

import contextlib
import functools
import types

from _eagle_tap_import_hooks import after_import

ATTENTION_REGISTRY = "sglang.srt.layers.attention.attention_registry"
DRAFT_UTILS = "sglang.srt.speculative.draft_utils"
MLA_DRAFT = "sglang.srt.models.kimi_k25_eagle3"


def _serves_a_draft(model_runner) -> bool:
    spec_algorithm = getattr(model_runner, "spec_algorithm", None)
    return spec_algorithm is not None and not spec_algorithm.is_none()


def _patch_attention_registry(registry: types.ModuleType) -> None:
    build_torch_native = registry.ATTENTION_BACKENDS["torch_native"]
    if getattr(build_torch_native, "eagle_tap_speculative_cpu", False):
        return  # already patched (registration is safe to run twice)

    @functools.wraps(build_torch_native)
    def build_torch_native_or_speculative(model_runner):
        if not _serves_a_draft(model_runner):
            return build_torch_native(model_runner)
        from sglang.srt.layers.attention.intel_amx_backend import IntelAMXAttnBackend

        return IntelAMXAttnBackend(model_runner)

    build_torch_native_or_speculative.eagle_tap_speculative_cpu = True
    registry.ATTENTION_BACKENDS["torch_native"] = build_torch_native_or_speculative


def _patch_draft_backend_factory(draft_utils: types.ModuleType) -> None:
    factory = draft_utils.DraftBackendFactory
    create_backend = factory._create_backend
    if getattr(create_backend, "eagle_tap_speculative_cpu", False):
        return

    @functools.wraps(create_backend)
    def create_backend_with_torch_native(self, backend_name, backend_map, error_template, *args, **kwargs):
        if "torch_native" not in backend_map and "intel_amx" in backend_map:
            backend_map = {**backend_map, "torch_native": backend_map["intel_amx"]}
        return create_backend(self, backend_name, backend_map, error_template, *args, **kwargs)

    create_backend_with_torch_native.eagle_tap_speculative_cpu = True
    factory._create_backend = create_backend_with_torch_native


@contextlib.contextmanager
def _cuda_cache_calls_as_no_ops():
    import torch

    saved = torch.cuda.empty_cache, torch.cuda.synchronize
    torch.cuda.empty_cache = torch.cuda.synchronize = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch.cuda.empty_cache, torch.cuda.synchronize = saved


def _patch_mla_draft(module: types.ModuleType) -> None:
    draft_class = module.Eagle3DeepseekV2ForCausalLM
    for name in ("set_embed", "set_embed_and_head"):
        method = getattr(draft_class, name)
        if getattr(method, "eagle_tap_speculative_cpu", False):
            continue

        @functools.wraps(method)
        def without_cuda_calls(self, *args, _method=method, **kwargs):
            with _cuda_cache_calls_as_no_ops():
                return _method(self, *args, **kwargs)

        without_cuda_calls.eagle_tap_speculative_cpu = True
        setattr(draft_class, name, without_cuda_calls)


def install() -> None:
    """Apply the measures when (or if already) SGLang imports the modules they change."""
    after_import(ATTENTION_REGISTRY, _patch_attention_registry)
    after_import(DRAFT_UTILS, _patch_draft_backend_factory)
    after_import(MLA_DRAFT, _patch_mla_draft)
