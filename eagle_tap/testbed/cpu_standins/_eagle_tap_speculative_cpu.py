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

Loaded from the `sgl_kernel` stand-in, so only where the real `sgl_kernel` is missing: never on a GPU machine.
"""

from __future__ import annotations

import functools
import types

from _eagle_tap_import_hooks import after_import

ATTENTION_REGISTRY = "sglang.srt.layers.attention.attention_registry"
DRAFT_UTILS = "sglang.srt.speculative.draft_utils"


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


def install() -> None:
    """Apply both measures when (or if already) SGLang imports the modules they change."""
    after_import(ATTENTION_REGISTRY, _patch_attention_registry)
    after_import(DRAFT_UTILS, _patch_draft_backend_factory)
