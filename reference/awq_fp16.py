"""What the AWQ (and fp16) kernels compute: fp16 weights, fp16 activations, fp32 accumulation.

AWQ dequant in the kernel: the LOP3 trick yields q and z as exact halves (1024 + nibble, minus
1024), (q - z) is an exact small integer in half, and one half multiply by s rounds once:
    w16 = fp16((q - z) * s)
which is exactly fp16(dequantize(qt)), since (q - z) * s is exact in fp32. The dequant kernel
must match w16 bit for bit. The matmul kernels multiply fp16 x by w16 (products exact in fp32)
and accumulate in fp32, then round y to fp16. The emulation sums in float64 and bounds any fp32
summation order by K * 2^-24 * sum_k |x_k w_k|, plus half an fp16 ulp of y for the output
rounding (y is fp16 on the GPU).

The small-M kernel (cuda/awq_small.cu, path "small") and the M = 1 GEMV (cuda/awq_gemv.cu, path
"gemv") are the exception: they form no fp16 weight and apply s per group to fp32 partials;
emulate_group_scaled below is their function and bound.
"""
from __future__ import annotations

import numpy as np

EPS32 = 2.0 ** -24


def dequantize_fp16(qt) -> np.ndarray:
    """The fp16 weight (N, K) the AWQ kernels compute from (q, z, s)."""
    return qt.fmt.dequantize(qt).astype(np.float16)


def to_fp16(x, what: str = "the fp16 kernels") -> np.ndarray:
    """x (M, K) rounded to fp16, as the kernels take it (x.half()): a finite x past +-65504
    becomes inf there, and so here, with a RuntimeWarning naming its row and column (the
    kernels, and this emulation, then give inf/NaN: inf * 0 and inf - inf in the sums); a row
    too small for fp16's normal range is rounded to its subnormals or 0 there, and so here, with
    a RuntimeWarning naming it (formats.base.cast_warn)."""
    from quantzoo.formats.base import cast_warn

    return cast_warn(x, np.float16, f"{what} take fp16 activations, so they (on x.half()) and this "
                     "emulation give inf/NaN there (mode='dequant' does not)",
                     underflow=f"{what} take fp16 activations, so they (on x.half()) and this emulation "
                     "lose that much of the row (mode='dequant' does not); scale x up")


def _check_rank(x, shape) -> None:
    from quantzoo.formats.base import refuse_scalar_x

    refuse_scalar_x(x, shape)


def fp16_matmul(x, w16, return_bound: bool = False, what: str = "the fp16 kernels"):
    """y = fp16(x) @ w16.T with exact products, summed in float64; w16 (N, K)."""
    x = np.asarray(x)
    _check_rank(x, np.shape(w16))
    lead = x.shape[:-1]
    x16 = to_fp16(x.reshape(-1, x.shape[-1]), what).astype(np.float64)
    w = np.asarray(w16, dtype=np.float16).astype(np.float64)
    if x16.shape[1] != w.shape[1]:
        raise ValueError(f"x has {x16.shape[1]} features, the weight expects K={w.shape[1]}")
    with np.errstate(invalid="ignore", over="ignore"):   # inf x (said above, or given): inf/NaN y
        y = x16 @ w.T
        out = y.astype(np.float32).reshape(*lead, w.shape[0])
        if not return_bound:
            return out
        k = w.shape[1]
        bound = k * EPS32 * (np.abs(x16) @ np.abs(w).T) + np.abs(y) * 2.0 ** -11
    return out, bound.reshape(*lead, w.shape[0])


def emulate_matmul(x, qt, return_bound: bool = False):
    return fp16_matmul(x, dequantize_fp16(qt), return_bound=return_bound, what=f"{qt.format}'s kernels")


# ---- the small-M kernel (cuda/awq_small.cu) and the GEMV (cuda/awq_gemv.cu): no fp16 weight,
# the scale applied per group
#
#   y = fp16( sum_g s_g * sum_{k in g} (q_k - z_g) * x_k )
#
# Every product (q - z) * x is exact and each group's partial is summed in fp32 (tensor cores),
# the zero either subtracted exactly in fp16 or taken out as z * sum_k x_k (one more fp32
# partial), then multiplied by s in fp32 and accumulated over groups, warps and K splits. The
# exact value of that expression is x16 @ ((q - z) * s) with the weight NOT rounded to fp16
# ((q - z) * s is exact in float64). Bound on any fp32 order, allowing tensor-core truncation
# (one ulp, 2^-23, per addition):
#     |y - y_exact| <= 2^-23 * (G + K/G + 80) * T  +  2^-11 |y_exact|
#     T = sum_g |s_g| * (sum_{k in g} q_k |x_k| + z_g * sum_{k in g} |x_k|)
# (G additions inside a group, the z * sum x and scale steps, K/G groups, <= 80 warp and split
# partials; T bounds every intermediate, both for q - z formed exactly and for q x - z sum x.)
EPS_TC = 2.0 ** -23
EXTRA_TERMS = 80


def group_scaled_terms(qt):
    """(W float64 (K, N) = (q - z) * s exact, Q|s| float64 (K, N), z|s| float64 (K/G, N), G)."""
    qt.fmt.check(qt)
    f = qt.fmt.fields(qt)
    g = qt.group_size
    q = f["q"].astype(np.float64)
    z = f["z"].astype(np.float64)
    s = f["s"].astype(np.float64)
    s_k = np.repeat(s, g, axis=0)
    w = (q - np.repeat(z, g, axis=0)) * s_k
    return w, q * np.abs(s_k), z * np.abs(s), g


def group_scaled_bound(x_abs, qs, zs, g, y_exact):
    """The bound above from |x| (M, K) float64 and the terms of group_scaled_terms."""
    m, k = x_abs.shape
    xg = x_abs.reshape(m, k // g, g).sum(axis=2)
    t = x_abs @ qs + xg @ zs
    return EPS_TC * (g + k // g + EXTRA_TERMS) * t + np.abs(y_exact) * 2.0 ** -11


def emulate_group_scaled(x, qt, return_bound: bool = False):
    """What cuda/awq_small.cu and cuda/awq_gemv.cu compute: y = x16 @ ((q - z) * s), fp32 result
    (before fp16)."""
    x = np.asarray(x)
    _check_rank(x, qt.shape)
    lead = x.shape[:-1]
    x16 = to_fp16(x.reshape(-1, x.shape[-1]), f"{qt.format}'s kernels").astype(np.float64)
    w, qs, zs, g = group_scaled_terms(qt)
    if x16.shape[1] != w.shape[0]:
        raise ValueError(f"x has {x16.shape[1]} features, the weight expects K={w.shape[0]}")
    with np.errstate(invalid="ignore", over="ignore"):   # inf x (said above, or given): inf/NaN y
        y = x16 @ w
        out = y.astype(np.float32).reshape(*lead, w.shape[1])
        if not return_bound:
            return out
        bound = group_scaled_bound(np.abs(x16), qs, zs, g, y)
    return out, bound.reshape(*lead, w.shape[1])
