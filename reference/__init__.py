"""Reference math in numpy: what each format's numbers are, and what each kernel computes.

    dequantize(qt)            float32 (N, K) weight
    matmul_exact(x, w)        float64 x @ w.T (w unquantized, or dequantized)
    emulate(x, qt)            the kernel's function, bit-faithful up to fp32 summation order
                              (gguf_dot: Q8_1 activations + int32 block dots; awq_fp16: fp16
                              dequant arithmetic + fp32 accumulation)
    nmse(y, y_ref)            ||y - y_ref||^2 / ||y_ref||^2
"""
from __future__ import annotations

import numpy as np

from . import awq_fp16, gguf_dot  # noqa: F401


def dequantize(qt) -> np.ndarray:
    """qt.fmt.dequantize(qt): the float32 numpy weight (N, K) of a QuantizedTensor on any device."""
    return qt.fmt.dequantize(qt)


def matmul_exact(x, w) -> np.ndarray:
    """float64 y = x @ w.T; w is a float array (N, K) or a QuantizedTensor (dequantized)."""
    if hasattr(w, "fmt"):
        w = dequantize(w)
    return np.asarray(x, dtype=np.float64) @ np.asarray(w, dtype=np.float64).T


def emulate(x, qt, return_bound: bool = False):
    """qt.fmt.emulate(np.asarray(x), qt): float32 numpy y (..., N) as the kernels compute it, and
    with return_bound=True (y, bound) (Format.emulate says what bound covers and what is refused)."""
    return qt.fmt.emulate(np.asarray(x), qt, return_bound=return_bound)


def nmse(y, y_ref) -> float:
    """||y - y_ref||^2 / ||y_ref||^2 in float64 over every element (arrays of one shape, or ones that
    broadcast); a zero y_ref divides by 1e-300 instead of 0."""
    y = np.asarray(y, dtype=np.float64)
    y_ref = np.asarray(y_ref, dtype=np.float64)
    return float(((y - y_ref) ** 2).sum() / max((y_ref ** 2).sum(), 1e-300))
