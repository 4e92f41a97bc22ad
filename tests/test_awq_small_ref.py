"""CPU: the AWQ emulations (reference.awq_fp16) and the bounds the GPU tier holds the kernels to."""
from __future__ import annotations

import numpy as np
import pytest

from quantzoo.formats.awq import pack_int4
from quantzoo.formats import get
from quantzoo.reference import awq_fp16

FMT = get("awq")


def rand_x(rng, m, k, scale=1.0):
    return (rng.standard_normal((m, k)) * scale).astype(np.float16)


def test_emulation_is_the_dequantized_product():
    """emulate_group_scaled is x16 @ dequantize(qt).T in float64 (the weight (q - z) * s is exact
    in fp32), and its bound covers the error of a plain fp32 evaluation."""
    rng = np.random.default_rng()
    w = (rng.standard_normal((64, 256)) * 0.02).astype(np.float32)
    qt = FMT.quantize(w, group_size=32)
    x16 = rand_x(rng, 3, 256)
    y, b = awq_fp16.emulate_group_scaled(x16, qt, return_bound=True)
    y64 = x16.astype(np.float64) @ FMT.dequantize(qt).astype(np.float64).T
    assert np.abs(y - y64).max() <= np.abs(y64).max() * 2.0 ** -23
    y32 = x16.astype(np.float32) @ FMT.dequantize(qt).T
    assert (np.abs(y32 - y64) <= b).all()


def test_bound_is_tight_enough_to_see_a_wrong_group_scale():
    """A kernel that used the neighbouring group's scales would fail the check."""
    rng = np.random.default_rng()
    w = (rng.standard_normal((128, 1024)) * 0.02).astype(np.float32)
    qt = FMT.quantize(w, group_size=128)
    x16 = rand_x(rng, 2, 1024)
    y, b = awq_fp16.emulate_group_scaled(x16, qt, return_bound=True)
    bad = qt.numpy()
    s = bad.data["scales"].copy()
    s[[0, 1]] = s[[1, 0]]
    wrong = type(qt)("awq", qt.shape, dict(bad.data, scales=s), {"group_size": 128})
    y_bad = awq_fp16.emulate_group_scaled(x16, wrong)
    assert (np.abs(y_bad - y) > b).mean() > 0.5


def _awq_from_fields(q, z, s, g):
    """An AWQ tensor from integer fields q [K, N], z [K/G, N] (0..15) and fp16 scales [K/G, N]."""
    return FMT.from_arrays(pack_int4(q), pack_int4(z), np.asarray(s, np.float16), group_size=g)


def test_bound_covers_the_zero_point_term_of_an_absorbing_fp32_order():
    """The z * sum |x| term of the bound is needed: in a group whose q are 0 (w = -z * s), a large
    +x / -x pair around many small x makes a legal fp32 order (sequential inside the group, then
    * s, as cuda/awq_small.cu does per group) absorb every small product; the error is then 100 %
    of y, while sum_k q_k |x_k| sees only the one column whose q is not 0."""
    rng = np.random.default_rng()
    g = k = 128
    n = 8
    q = np.zeros((k, n), np.uint8)
    q[rng.integers(1, g - 1), :] = 15                  # one q != 0 per column, among the small x
    z = np.full((k // g, n), 15, np.uint8)
    s = np.full((k // g, n), 1 / 15, np.float16)
    qt = _awq_from_fields(q, z, s, g)
    x = np.full((1, k), 2.0 ** -12, np.float16) * rng.choice([1, 3], (1, k)).astype(np.float16)
    x[0, 0], x[0, g - 1] = 60000, -60000
    y, b = awq_fp16.emulate_group_scaled(x, qt, return_bound=True)
    w, _, _, _ = awq_fp16.group_scaled_terms(qt)
    x32 = x.astype(np.float32)[0]
    acc = np.zeros(n, np.float32)
    for gi in range(k // g):                           # fp32, in the kernel's per-group order
        part = np.zeros(n, np.float32)
        for kk in range(gi * g, (gi + 1) * g):
            part = part + (q[kk].astype(np.float32) - z[gi].astype(np.float32)) * x32[kk]
        acc = acc + part * s[gi].astype(np.float32)
    err = np.abs(acc.astype(np.float64) - y[0])
    assert err.min() > 0.5 * np.abs(y).max()           # the order really loses the small terms
    assert np.all(err <= b[0])
    x_abs = np.abs(x.astype(np.float64))
    _, qs, zs, _ = awq_fp16.group_scaled_terms(qt)
    without_z = awq_fp16.EPS_TC * (g + k // g + awq_fp16.EXTRA_TERMS) * (x_abs @ qs) + np.abs(y) * 2.0 ** -11
    assert np.all(err > without_z[0])                  # and the bound needs its z term to cover it


@pytest.mark.parametrize("which", ["group_scaled", "fp16_weight"])
def test_bound_rejects_a_one_ulp_output(which):
    """The output term is half an fp16 ulp (2^-11 |y|), not a whole one: where the fp32 sums are
    exact and y = 1 is an fp16 number, an output one ulp off (1 + 2^-10, a kernel rounding y the
    wrong way or truncating a y just below) falls outside the bound of both emulations."""
    rng = np.random.default_rng()
    g = k = 32
    n = 8
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    j = int(rng.integers(k))
    q[j] = 8
    qt = _awq_from_fields(q, np.zeros((1, n), np.uint8), np.full((1, n), 2.0 ** -4, np.float16), g)
    x = np.zeros((1, k), np.float16)
    x[0, j] = 2                                        # y = 2 * 8 * 2^-4 = 1 exactly, every column
    emulate = awq_fp16.emulate_group_scaled if which == "group_scaled" else awq_fp16.emulate_matmul
    y, b = emulate(x, qt, return_bound=True)
    assert np.all(y == 1.0)
    assert np.all(b < 2.0 ** -10)
    assert np.all(b >= 2.0 ** -11)                     # round-to-nearest's half ulp still passes


@pytest.mark.parametrize("name", ["awq", "fp16"])
def test_fp16_weight_bound_is_the_formula_and_sees_fp16_accumulation(name):
    """The bound of emulate_matmul / fp16_matmul (the AWQ mma, wgmma and dequant paths, the fp16
    GEMV) is K * 2^-24 * (|x16| @ |w16|.T) + 2^-11 |y|, written out here from numpy's own fp16
    casts; it covers a sequential fp32 accumulation rounded to fp16, and it is tight enough to
    flag a kernel that accumulates in fp16 in most outputs at K = 384 (measured: 72-78 % at
    K = 256..512; the bound's K term is then ~0.45 of it). A K term 64x too large (the output
    term left alone) passed every CPU test before; it lets fp16 accumulation through almost
    everywhere."""
    rng = np.random.default_rng()
    m, n, k = 4, 64, 384
    fmt = get(name)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    qt = fmt.quantize(w, group_size=64) if name == "awq" else fmt.quantize(w)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y, b = fmt.emulate(x, qt, return_bound=True)
    x16 = x.astype(np.float16)
    w16 = fmt.dequantize(qt).astype(np.float16)
    x64, w64 = x16.astype(np.float64), w16.astype(np.float64)
    y64 = x64 @ w64.T
    assert np.array_equal(y, y64.astype(np.float32))
    assert np.allclose(b, k * 2.0 ** -24 * (np.abs(x64) @ np.abs(w64).T) + 2.0 ** -11 * np.abs(y64), rtol=1e-12, atol=0)
    prod = x16.astype(np.float32)[:, None, :] * w16.astype(np.float32)[None]   # exact products
    acc32 = np.zeros((m, n), np.float32)
    acc16 = np.zeros((m, n), np.float16)
    for j in range(k):                                  # one legal fp32 order, and an fp16 one
        acc32 = acc32 + prod[..., j]
        acc16 = (acc16.astype(np.float32) + prod[..., j]).astype(np.float16)
    assert np.all(np.abs(acc32.astype(np.float16).astype(np.float64) - y64) <= b)
    assert (np.abs(acc16.astype(np.float64) - y64) > b).mean() > 0.5
