"""The group-scaled AWQ kernels on the GPU (`pytest -m gpu`): the small-M kernel
(cuda/awq_small.cu, path "small") and the M = 1 GEMV (cuda/awq_gemv.cu, path "gemv").

Oracle: reference.awq_fp16.emulate_group_scaled -- y = x16 @ ((q - z) * s) exactly (the weight
is never rounded to fp16), within the fp32-order bound stated there. Every compiled
configuration of both kernels (small: both zero-point modes, 1 or 2 column words per thread, 4 or
8 warps, pipeline depths; gemv: 2 or 4 column words per lane, load depths, with and without
vector loads) on tail shapes; forced split counts (1, a few, one k-step per warp); Qwen3-8B shapes
against float64 (NMSE); tiny (subnormal x), huge and zero magnitudes; NaN-poisoned outputs.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

from quantzoo.formats import get  # noqa: E402

# case_seed (autouse): a fresh seed per case for weight() and case_rng(), printed; replay with QUANTZOO_SEED
from test_awq_gpu import assert_nmse, case_rng, case_seed, check, emulate_small_gpu, rand_x, weight  # noqa: E402,F401

FMT = get("awq")
MS = (1, 2, 3, 7, 8, 9, 16)


def awq_mod():
    from quantzoo.kernels import awq

    return awq


def run_scaled(x16, qtc, cfg=None, splits=None, path="small"):
    awq = awq_mod()
    x = torch.from_numpy(x16).cuda()
    m, k = x16.shape
    n = qtc.shape[0]
    y = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    d = qtc.data
    launch = awq._gemv if path == "gemv" else awq._small
    launch(x, d["qweight"], d["scales"], d["qzeros"], y, m, k, n, qtc.group_size, cfg=cfg,
           splits=splits)
    torch.cuda.synchronize()
    return y


def cfgs_for(m):
    """(path, config) of every compiled configuration of both kernels that takes M rows."""
    awq = awq_mod()
    small = [("small", c) for c in awq.SMALL_CFGS if m <= 8 * c[0]]
    return small + ([("gemv", c) for c in awq.GEMV_CFGS] if m == 1 else [])


@pytest.mark.parametrize("g", [32, 64])
@pytest.mark.parametrize("m", MS)
def test_every_config_tail_shape(m, g):
    """N = 72*8 (72 column words: a partial last tile for the 16- and 64-word block tiles),
    K = 9*64."""
    rng = case_rng()
    k, n = 9 * 64, 72 * 8
    _, qt, qtc, w16 = weight(k, n, g, seed=m)
    x16 = rand_x(rng, m, k)
    for path, cfg in cfgs_for(m):
        check(run_scaled(x16, qtc, cfg, path=path), x16, qt, w16, f"{path} {cfg}")


@pytest.mark.parametrize("m", [1, 5, 12])
@pytest.mark.parametrize("k,n,g", [(64, 72, 32), (128, 8, 64), (32, 136, 32), (128, 200, 128),
                                   (96, 8 * 17, 32)], ids=lambda v: str(v))
def test_every_config_small_shapes(m, k, n, g):
    """N/8 odd (4-byte loads), N = 8, K = one group, fewer k-steps than warps."""
    rng = case_rng()
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    qt = FMT.quantize(w, group_size=g)
    qtc = qt.to("cuda")
    x16 = rand_x(rng, m, k)
    for path, cfg in cfgs_for(m):
        check(run_scaled(x16, qtc, cfg, path=path), x16, qt, None, f"{path} {cfg}")


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("m", [1, 9])
def test_forced_splits(m, splits):
    """The split-K workspace path for any split count (64 at K = 4096: 4 k-steps per block, so
    0 to 2 per warp)."""
    rng = case_rng()
    k, n = 4096, 1024
    _, qt, qtc, w16 = weight(k, n, 64)
    x16 = rand_x(rng, m, k)
    for path, cfg in cfgs_for(m):
        check(run_scaled(x16, qtc, cfg, splits, path), x16, qt, w16, f"{path} {cfg} S={splits}")


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("k,n", [(4096, 4096), (4096, 1024), (4096, 12288), (12288, 4096)],
                         ids=lambda v: str(v))
def test_qwen_shapes_vs_float64(k, n, m):
    """Dispatch configs on the Qwen3-8B shapes, g128: emulation bound and NMSE (assert_nmse)."""
    rng = case_rng()
    w, qt, qtc, w16 = weight(k, n, 128)
    x16 = rand_x(rng, m, k)
    exact = torch.as_tensor(x16).cuda().double() @ torch.as_tensor(w).cuda().double().T
    for path in ("small", "gemv") if m == 1 else ("small",):
        y = run_scaled(x16, qtc, path=path)
        assert_nmse(y, check(y, x16, qt, w16, path), exact, path)


def test_gemv_dispatched_on_wide_weight():
    """M = 1 on a wide weight (the runner's fused gate/up, 4096 -> 24576, g128) goes to the GEMV
    with its tuned config and K splits: emulation bound and NMSE (assert_nmse)."""
    awq = awq_mod()
    rng = case_rng()
    k, n = 4096, 24576
    w, qt, qtc, w16 = weight(k, n, 128)
    assert awq.choose_path(1, qtc) == "gemv" and (k, n) in awq.GEMV_TUNED
    x16 = rand_x(rng, 1, k)
    y = torch.full((1, n), float("nan"), dtype=torch.float16, device="cuda")
    awq.matmul(torch.from_numpy(x16).cuda(), qtc, out=y)
    exact = torch.as_tensor(x16).cuda().double() @ torch.as_tensor(w).cuda().double().T
    assert_nmse(y, check(y, x16, qt, w16, "gemv"), exact, "gemv")


def test_magnitudes_and_zeros_every_config():
    """Subnormal fp16 x, tiny and huge weights, x = 0 (y must be exactly 0), constant groups."""
    rng = case_rng()
    k, n, g = 256, 136, 64
    for scale_x, scale_w in ((1e-6, 0.02), (3e2, 1.0), (1e3, 1.0), (1e-3, 1e-4), (0.0, 0.02)):
        w = (rng.standard_normal((n, k)) * scale_w).astype(np.float32)
        w[:8] = 0.5                      # constant groups: s at its clamp, q = z
        with pytest.warns(RuntimeWarning, match="zero point .* clipped"):   # (they do not straddle 0)
            qt = FMT.quantize(w, group_size=g)
        qtc = qt.to("cuda")
        for m in (1, 7, 16):
            x16 = rand_x(rng, m, k, scale_x)
            for path, cfg in cfgs_for(m):
                y = run_scaled(x16, qtc, cfg, path=path)
                check(y, x16, qt, None, f"{path} {cfg} x*{scale_x} w*{scale_w}")
                if scale_x == 0.0:
                    assert (y == 0).all()


def test_more_accurate_than_fp16_weights():
    """No fp16 weight rounding: against float64 of the same quantized weight the small kernel's
    error is below the fp16-weight kernel's (mma) on a 4096 -> 1024 g128 product."""
    awq = awq_mod()
    rng = case_rng()
    _, qt, qtc, w16 = weight(4096, 1024, 128)
    x16 = rand_x(rng, 8, 4096)
    x = torch.from_numpy(x16).cuda()
    exact, _ = emulate_small_gpu(x16, qt)
    err = {}
    for path in ("small", "mma"):
        y = awq.matmul(x, qtc, path=path).double()
        err[path] = ((y - exact) ** 2).sum().item()
    assert err["small"] < err["mma"], err
