"""CPU: the emulation of the small-M AWQ kernel (reference.awq_fp16.emulate_group_scaled)."""
from __future__ import annotations

import numpy as np

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
