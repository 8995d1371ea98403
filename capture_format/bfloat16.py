"""bfloat16 as numpy sees it: uint16 bit patterns.

numpy has no bfloat16 dtype, so records carry bf16 tensors as `np.uint16` arrays holding the raw
bit patterns (sign, 8 exponent bits, 7 mantissa bits: the top half of a float32). torch reads them
back without a copy: `torch.from_numpy(bits).view(torch.bfloat16)`.
"""

from __future__ import annotations

import numpy as np

__all__ = ["bfloat16_bits_from_float32", "float32_from_bfloat16_bits"]

_QUIET_NAN_BIT = np.uint32(0x0040)


def bfloat16_bits_from_float32(values: np.ndarray) -> np.ndarray:
    """Rounds float32 values to bfloat16 (nearest, ties to even) and returns their uint16 bits.

    This is the rounding torch applies in `tensor.to(torch.bfloat16)`. NaNs stay NaN (made quiet,
    sign and top payload bits kept): rounding their bits would carry into the sign.
    """
    bits_32 = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    lowest_kept_bit = (bits_32 >> 16) & 1
    rounded = (bits_32 + (np.uint32(0x7FFF) + lowest_kept_bit)) >> 16
    nan_bits = (bits_32 >> 16) | _QUIET_NAN_BIT
    return np.where(np.isnan(values), nan_bits, rounded).astype(np.uint16)


def float32_from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    """Widens uint16 bfloat16 bit patterns to float32 exactly (every bf16 value is a float32)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
