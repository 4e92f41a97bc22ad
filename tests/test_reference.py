"""References: the kernel emulations against independent float64 math, and NMSE ceilings."""
import numpy as np
import pytest

from quantzoo import reference, workload
from quantzoo.formats import get, names, weight_formats

GGUF = [n for n in names() if get(n).kind == "weight" and get(n).gguf_type]
WEIGHTS = [f.name for f in weight_formats()]


def _gguf_pieces(x, qt):
    """float64 pieces from the codecs alone: dequantized Q8_1 x, dequantized W, block terms."""
    fmt = qt.fmt
    m, k = x.shape
    a = get("q8_1").unpack(get("q8_1").quantize(x).data)
    xq = (a["d"].astype(np.float64)[..., None] * a["q"]).reshape(m, k)
    s = a["m"].astype(np.float64)                                        # (M, nb)
    f = fmt.unpack(qt.data)
    coef = -float(fmt.offset) * f["d"].astype(np.float64)               # (N, nb)
    if f["m"] is not None:
        coef = coef + f["m"].astype(np.float64)
    return xq, s, coef


@pytest.mark.parametrize("name", GGUF)
@pytest.mark.parametrize("xscale", [1.0, 1e-3, 30.0])
def test_gguf_emulation_is_q8_1_times_dequantized_weight(name, xscale, rng):
    """emulate = sum_b [ xq_b . w_b + coef_b (s_b - sum xq_b) ]: the integer path (unsigned q,
    sumi, per-format formula) equals float64 math on dequantized values, to fp32 rounding."""
    fmt = get(name)
    m, n, k = 7, 40, 320                                  # K = 10 blocks, nothing a tile multiple
    w = rng.standard_t(4, (n, k)).astype(np.float32) * 0.02
    x = (rng.standard_normal((m, k)) * xscale).astype(np.float32)
    x[3] = 0                                              # a zero row gives exactly zero
    qt = fmt.quantize(w)
    y, bound = fmt.emulate(x, qt, return_bound=True)
    assert y.dtype == np.float32 and y.shape == (m, n)
    xq, s, coef = _gguf_pieces(x, qt)
    wd = fmt.dequantize(qt).astype(np.float64)
    nb = k // 32
    ind = xq @ wd.T + np.einsum("mb,nb->mn", s - xq.reshape(m, nb, 32).sum(-1), coef)
    assert np.all(np.abs(y - ind) <= bound + 1e-12 * np.abs(ind)), np.abs(y - ind).max()
    assert np.all(y[3] == 0)
    # and against float64 with the original activations: only Q8_1's rounding separates them.
    # With w_j = d q_j + coef (q unsigned as stored): y - exact = sum_j d q_j (xq_j - x_j)
    # + coef (s - sum_j x_j), each term bounded from the fields.
    exact = x.astype(np.float64) @ wd.T
    sum_x = x.astype(np.float64).reshape(m, nb, 32).sum(-1)
    f = fmt.unpack(qt.data)
    dq = np.abs(f["d"].astype(np.float64)[..., None] * f["q"])              # (N, nb, 32)
    q81 = np.abs(x - xq).reshape(m, 1, nb, 32) * dq.reshape(1, n, nb, 32)
    allow = q81.sum((-1, -2)) + np.einsum("mb,nb->mn", np.abs(s - sum_x), np.abs(coef)) + bound
    assert np.all(np.abs(y - exact) <= allow * (1 + 1e-6) + 1e-30)


@pytest.mark.parametrize("name", GGUF)
def test_gguf_emulation_in_chunks_equals_one_pass(name, rng):
    """emulate_matmul walks N in chunks of rows to bound its memory (the GPU tier's Qwen3 shapes,
    and the CPU runner's emulate mode on an lm_head, take several); chunks of 7 rows (N = 40: five
    whole and a tail of 5) give the same y and bound, bit for bit, as one chunk."""
    from quantzoo.reference.gguf_dot import emulate_matmul

    fmt = get(name)
    m, n, k = 3, 40, 128
    qt = fmt.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.02)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y1, b1 = emulate_matmul(x, qt, return_bound=True)
    y7, b7 = emulate_matmul(x, qt, return_bound=True, chunk_elems=7 * m * (k // 32))
    assert np.array_equal(y1, y7) and np.array_equal(b1, b7)


@pytest.mark.parametrize("name", ["awq", "fp16"])
def test_fp16_emulation_against_float64(name, rng):
    fmt = get(name)
    m, n, k = 5, 24, 384
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32) * 3
    qt = fmt.quantize(w, group_size=64) if name == "awq" else fmt.quantize(w)
    y, bound = fmt.emulate(x, qt, return_bound=True)
    x16 = x.astype(np.float16).astype(np.float64)
    wd = fmt.dequantize(qt).astype(np.float64)            # exact (q - z) * s in fp32
    ref = x16 @ wd.T
    # the kernel rounds each weight to fp16 (half an ulp, 2^-11 relative) and sums in fp32
    allow = bound + (np.abs(x16) @ np.abs(wd).T) * 2.0 ** -11
    assert np.all(np.abs(y - ref) <= allow)
    assert reference.nmse(y, ref) < 1e-6


@pytest.mark.parametrize("name", WEIGHTS)
def test_nmse_under_ceiling(name, rng):
    """Standard workload (W ~ N(0, 0.02^2) 1024x4096, x ~ N(0,1), M=64), fresh seed each run."""
    fmt = get(name)
    std = dict(workload.STANDARD, seed=int(rng.integers(2**31)))
    x, w, y_exact = workload.gaussian(**std)
    y = fmt.emulate(x, fmt.quantize(w))
    err = reference.nmse(y, y_exact)
    print(f"{name}: NMSE {100 * err:.4f} % (ceiling {100 * fmt.nmse_ceiling:.2f} %)")
    assert 0 < err < fmt.nmse_ceiling
    # the emulated kernel is never better than its weights alone (Q8_1 only adds error)
    assert err >= 0.98 * reference.nmse(reference.matmul_exact(x, fmt.quantize(w)), y_exact)


def test_nmse_detects_a_broken_codec(rng):
    """Guard against a test that cannot fail: a one-nibble shift in Q4_0 blows the ceiling."""
    fmt = get("q4_0")
    x, w, y_exact = workload.gaussian(m=16, k=1024, n=256, seed=int(rng.integers(2**31)))
    qt = fmt.quantize(w)
    blk = qt.data.reshape(256, -1, 18).copy()
    blk[..., 2:] = (blk[..., 2:] << 1) | (blk[..., 2:] >> 7)             # corrupt the nibbles
    broken = fmt.from_bytes(blk.reshape(256, -1), (256, 1024))
    assert reference.nmse(fmt.emulate(x, broken), y_exact) > 10 * fmt.nmse_ceiling


@pytest.mark.parametrize("name", ["awq", "fp16"])
def test_fp16_emulation_rounds_x_and_w_to_fp16(name, rng):
    """The fp16 kernels take fp16 x and an fp16 weight (AWQ: w16 = fp16((q - z) * s)) and form
    exact products: the emulation is float64 x16 @ w16.T, computed here from numpy's own fp16
    casts. An x or a weight left in float32 is off by up to 2^-11 relative, which the looser
    check above allows."""
    fmt = get(name)
    m, n, k = 4, 32, 256
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32) * 3
    qt = fmt.quantize(w, group_size=64) if name == "awq" else fmt.quantize(w)
    x16 = x.astype(np.float16).astype(np.float64)
    w16 = fmt.dequantize(qt).astype(np.float16).astype(np.float64)
    ref = (x16 @ w16.T).astype(np.float32)
    y = fmt.emulate(x, qt)
    # equal up to the float64 summation order (2^-40 relative, far below fp16's 2^-11)
    assert np.all(np.abs(y.astype(np.float64) - ref) <= 2.0 ** -40 * (np.abs(x16) @ np.abs(w16).T)
                  + np.spacing(np.abs(ref)))
    assert not np.array_equal(x, x16.astype(np.float32))        # x itself was not fp16 already
    if name == "awq":
        assert not np.array_equal(fmt.dequantize(qt), w16.astype(np.float32))   # nor the weight


@pytest.mark.parametrize("name", GGUF)
def test_gguf_bound_covers_fp32_orders_and_sees_fp16_scale_products(name, rng):
    """The bound the GPU tier checks kernels against, from the codec fields here:
    - it is (n_blocks + 4) * 2^-24 * sum_b (|d_w| (|d_a sumi| + offset |s_a|) + |m_w s_a|);
    - it covers the fp32 block terms summed in fp32 forwards and backwards (constant weight
      blocks in half the rows: Q4_0/Q5_0 store q = 0 there, so sumi = 0 and the offset * s_a
      piece is the whole term);
    - it is tight enough to flag scale products formed in fp16 (llama.cpp's d_w * d_a and
      m_w * s_a; ours are fp32, DESIGN.md §3) in most outputs of the ordinary rows."""
    fmt = get(name)
    m, n, k = 6, 48, 512
    nb = k // 32
    w = rng.standard_t(4, (n, k)).astype(np.float32) * 0.02
    w[::2] = np.repeat(rng.standard_normal((n // 2, nb, 1)).astype(np.float32) * 0.02, 32, axis=2).reshape(n // 2, k)
    x = (rng.standard_normal((m, k)) + 0.3).astype(np.float32)     # s_a away from 0
    qt = fmt.quantize(w)
    y, bound = fmt.emulate(x, qt, return_bound=True)
    a = get("q8_1").unpack(get("q8_1").quantize(x).data)
    f = fmt.unpack(qt.data)
    sumi = np.einsum("mbj,nbj->mnb", a["q"].astype(np.int64), f["q"].astype(np.int64))
    da, sa = (a[key].astype(np.float32)[:, None, :] for key in ("d", "m"))
    dw = f["d"].astype(np.float32)[None]
    mw = (f["m"].astype(np.float32) if f["m"] is not None else np.zeros_like(f["d"], np.float32))[None]
    off = float(getattr(fmt, "offset", 0))
    pieces = (np.abs(dw.astype(np.float64)) * (np.abs(da.astype(np.float64) * sumi) + off * np.abs(sa))
              + np.abs(mw.astype(np.float64) * sa)).sum(-1)
    assert np.allclose(bound, (nb + 4) * 2.0 ** -24 * pieces, rtol=1e-6, atol=0)
    term = fmt.block_dot(sumi.astype(np.float32), dw, mw, da, sa).astype(np.float32)   # (M, N, nb)
    for order in (slice(None), slice(None, None, -1)):
        acc = np.zeros((m, n), np.float32)
        for b in range(nb)[order]:
            acc = acc + term[..., b]                                    # fp32 adds, one order
        assert np.all(np.abs(acc.astype(np.float64) - y) <= bound)
    if fmt.has_min or off:
        h = lambda v: v.astype(np.float16).astype(np.float64)           # noqa: E731
        dd = h(dw.astype(np.float64) * da)
        if fmt.has_min:
            t16 = dd * sumi + h(mw.astype(np.float64) * sa)
        else:
            t16 = dd * sumi - off * dw.astype(np.float64) * sa
        y16 = t16.sum(-1)
        assert (np.abs(y16 - y) > bound)[:, 1::2].mean() > 0.5     # the rows of ordinary weights
