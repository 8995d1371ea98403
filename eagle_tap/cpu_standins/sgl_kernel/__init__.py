"""Import-only CPU stand-in for `sgl_kernel` (see `_eagle_tap_standin.py`): calling anything raises."""

from _eagle_tap_standin import install_stand_in

EAGLE_TAP_STAND_IN = True
# A parseable version below every real release, so version checks (transformers') take their no-package branch.
__version__ = "0.0.0"
install_stand_in(__import__(__name__))

# CPU-only measure, not a stand-in: MLA models on torch_native attention (see _eagle_tap_mla_cpu.py).
import _eagle_tap_mla_cpu  # noqa: E402

_eagle_tap_mla_cpu.install()
