"""What the GGUF kernels compute: Q8_1 activations, int32 block dots, fp32 scale math.

For activations x (M, K) and a weight in a block format (N, K):
  1. x -> Q8_1 per 32-block: q_a int8, d_a and s_a (half), exactly as the CUDA quantize_q8_1
     kernel makes them (formats.gguf_blocks.Q8_1: fp32 division, roundf, butterfly sum).
  2. per (m, n, block): sumi = sum_j q_w[j] * q_a[j], exact in int32 (DP4A). Q4/Q5 weights
     enter unsigned (0..15 / 0..31); their offset goes through s_a in the formula.
  3. per block, in fp32, the format's block_dot (Q4_0: d_w * (d_a * sumi - 8 * s_a), ...).
  4. y[m, n] = sum over blocks of those terms, accumulated in fp32 by the kernel.

Steps 1-3 are bit-exact here. Step 4's order differs between kernels (warp shuffles, split K),
so this sums in float64 and returns, when asked, a per-output bound on any fp32 summation
order: |y_kernel - y| <= (n_blocks + 4) * 2^-24 * sum_b |term pieces|, the pieces being the
magnitudes that enter each term (|d_w| * (|d_a * sumi| + |offset * s_a|) + |m_w * s_a|).

sumi is computed as a float32 matrix product: |sum| <= 32 * 128 * 127 < 2^24 (Q8_0), so every
partial sum is an exact integer in float32 and BLAS gives the int32 result.
"""
from __future__ import annotations

import numpy as np

EPS32 = 2.0 ** -24


def quantize_activations(x: np.ndarray) -> dict:
    """x float (M, K) -> Q8_1 fields {d: f16 (M, nb), m: s f16 (M, nb), q: int (M, nb, 32)}."""
    from quantzoo.formats import get

    q81 = get("q8_1")
    x = np.asarray(x, dtype=np.float32)
    m, k = x.shape
    if k % 32:
        raise ValueError(f"activations: K={k} is not a multiple of 32")
    f = q81.quantize_fields(x.reshape(m, k // 32, 32))
    with np.errstate(over="ignore"):
        return {"d": f["d"].astype(np.float16), "m": f["m"].astype(np.float16), "q": f["q"]}


def _say_lost_scales(x, d16, name: str) -> None:
    """Warn, naming the first, where a Q8_1 block's scale d = max|x| / 127 is too small for fp16:
    stored rounded to fp16's subnormals (or 0) while q was fitted to the fp32 d, the block's
    values come back off by up to 127 |d16 - d|, said where that passes formats.base.LOSS of the
    row's largest |x| (more than 8-bit rounding of the row costs; a tiny block in an ordinary row
    loses nothing that shows). The kernels make these bytes as llama.cpp does, silently: where d
    rounds to 0, Q4_0 / Q5_0 keep only their offset term -8 d_w s_a (-16 for Q5_0), far worse
    than a zero result."""
    from quantzoo.formats.base import LOSS, warn

    m, k = x.shape
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(x.reshape(m, k // 32, 32)).max(axis=-1) / np.float32(127)
        off = 127 * np.abs(d16.astype(np.float32) - d)               # the block's largest error
        row = 127 * d.max(axis=1, keepdims=True)                     # the row's largest |x|
        lost = np.isfinite(off) & np.isfinite(row) & (d > 0) & (off > LOSS * row)
    if lost.any():
        r, b = (int(i) for i in np.argwhere(lost)[0])
        warn(f"x: row {r}, block {b}: the activations' Q8_1 scale max|x|/127 = {float(d[r, b]):.3g} is "
             f"stored in fp16 as {float(d16[r, b]):.3g} (fp16 is normal from 6.1e-05), moving the block's values by "
             f"up to {float(off[r, b] / row[r, 0]):.1%} of the row's largest |x| ({int(lost.sum())} of {lost.size} "
             f"blocks over {LOSS:.2%}); {name}'s kernels, as llama.cpp's, and this emulation compute with it, "
             "losing more of the result where an offset term cancels (mode='dequant' does not); scale x up")


def emulate_matmul(x, qt, return_bound: bool = False, chunk_elems: int = 1 << 24):
    from quantzoo.formats.base import cast_warn, refuse_scalar_x, warn

    fmt = qt.fmt
    fmt.check(qt)
    x = cast_warn(x, np.float32, f"{fmt.name}'s Q8_1 quantizer takes fp16 or fp32 x, so this emulation "
                  "gives inf/NaN there")
    n, k = qt.shape
    refuse_scalar_x(x, qt.shape, fmt.name)
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features, the weight expects K={k}")
    a = quantize_activations(x)
    # d and s are half in the Q8_1 block: a block with amax > 127 * 65504, or (for the formats
    # whose block_dot uses s) |sum x| > 65504, gives inf/NaN here as in the kernel. Say so.
    over = ~np.isfinite(a["d"])
    if fmt.has_min or getattr(fmt, "offset", 0):
        over |= ~np.isfinite(a["m"])
    over &= np.isfinite(x).reshape(over.shape + (32,)).all(axis=-1)   # not NaN/inf already in x
    if over.any():
        r, b = (int(i) for i in np.argwhere(over)[0])
        warn(f"x: row {r}, block {b}: the Q8_1 scale or block sum of the activations overflows "
             f"fp16 (|sum x| or max|x|/127 > 65504); {fmt.name}'s kernels, and this emulation, "
             "give inf/NaN there (mode='dequant' does not)")
    _say_lost_scales(x, a["d"], fmt.name)
    w = fmt.unpack(qt.numpy().data)
    nb = k // 32
    qa = np.ascontiguousarray(a["q"].astype(np.float32).transpose(1, 0, 2))   # (nb, M, 32)
    da, sa = a["d"].astype(np.float32), a["m"].astype(np.float32)             # (M, nb)
    dw = w["d"].astype(np.float32)                                             # (N, nb)
    mw = w["m"].astype(np.float32) if w["m"] is not None else np.zeros_like(dw)
    qw = w["q"].astype(np.float32)                                             # (N, nb, 32)
    off = np.float32(getattr(fmt, "offset", 0))

    mrows = x.shape[0]
    y = np.empty((mrows, n), dtype=np.float64)
    bound = np.empty((mrows, n), dtype=np.float64) if return_bound else None
    step = max(1, chunk_elems // max(1, mrows * nb))
    for c0 in range(0, n, step):
        c1 = min(n, c0 + step)
        qwc = np.ascontiguousarray(qw[c0:c1].transpose(1, 2, 0))               # (nb, 32, n')
        sumi = np.matmul(qa, qwc).transpose(1, 2, 0)                           # (M, n', nb)
        dwc, mwc = dw[None, c0:c1], mw[None, c0:c1]
        dac, sac = da[:, None, :], sa[:, None, :]
        with np.errstate(over="ignore", invalid="ignore"):
            term = fmt.block_dot(sumi, dwc, mwc, dac, sac).astype(np.float32)
            y[:, c0:c1] = term.sum(axis=-1, dtype=np.float64)   # (inf - inf: NaN, said above)
        if return_bound:
            pieces = np.abs(dwc) * (np.abs(dac * sumi) + off * np.abs(sac)) + np.abs(mwc * sac)
            bound[:, c0:c1] = (nb + 4) * EPS32 * pieces.sum(axis=-1, dtype=np.float64)
    y32 = y.astype(np.float32).reshape(*lead, n)
    if return_bound:
        return y32, bound.reshape(*lead, n)
    return y32
