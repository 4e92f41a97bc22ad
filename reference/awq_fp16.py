"""What the AWQ (and fp16) kernels compute: fp16 weights, fp16 activations, fp32 accumulation.

AWQ dequant in the kernel: the LOP3 trick yields q and z as exact halves (1024 + nibble, minus
1024), (q - z) is an exact small integer in half, and one half multiply by s rounds once:
    w16 = fp16((q - z) * s)
which is exactly fp16(dequantize(qt)), since (q - z) * s is exact in fp32. The dequant kernel
must match w16 bit for bit. The matmul kernels multiply fp16 x by w16 (products exact in fp32)
and accumulate in fp32, then round y to fp16. The emulation sums in float64 and bounds any fp32
summation order by K * 2^-24 * sum_k |x_k w_k|, plus half an fp16 ulp of y for the output
rounding (y is fp16 on the GPU).
"""
from __future__ import annotations

import numpy as np

EPS32 = 2.0 ** -24


def dequantize_fp16(qt) -> np.ndarray:
    """The fp16 weight (N, K) the AWQ kernels compute from (q, z, s)."""
    return qt.fmt.dequantize(qt).astype(np.float16)


def fp16_matmul(x, w16, return_bound: bool = False):
    """y = fp16(x) @ w16.T with exact products, summed in float64; w16 (N, K)."""
    x = np.asarray(x)
    lead = x.shape[:-1]
    x16 = x.reshape(-1, x.shape[-1]).astype(np.float16).astype(np.float64)
    w = np.asarray(w16, dtype=np.float16).astype(np.float64)
    if x16.shape[1] != w.shape[1]:
        raise ValueError(f"x has {x16.shape[1]} features, the weight expects K={w.shape[1]}")
    y = x16 @ w.T
    out = y.astype(np.float32).reshape(*lead, w.shape[0])
    if not return_bound:
        return out
    k = w.shape[1]
    bound = k * EPS32 * (np.abs(x16) @ np.abs(w).T) + np.abs(y) * 2.0 ** -11
    return out, bound.reshape(*lead, w.shape[0])


def emulate_matmul(x, qt, return_bound: bool = False):
    return fp16_matmul(x, dequantize_fp16(qt), return_bound=return_bound)
