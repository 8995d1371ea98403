"""Import-only CPU stand-in for `torchvision` (see `_eagle_tap_standin.py`): calling anything raises."""

from _eagle_tap_standin import install_stand_in

EAGLE_TAP_STAND_IN = True
# A parseable version below every real release, so version checks (transformers') take their no-package branch.
__version__ = "0.0.0"
install_stand_in(__import__(__name__))
