"""GPU tier for the GGUF kernels (quantzoo/kernels/gguf.py, cuda/gguf_*.cu, cuda/q8_1_quantize.cu).

Oracles:
* quantize_q8_1 vs the numpy Q8_1 codec (formats.get("q8_1").quantize): the bytes must be
  identical -- qs, d *and* s: the kernel sums s in the xor-butterfly order that
  formats.gguf_blocks.butterfly_sum reproduces, so no half-ulp allowance is taken.
* mmvq / mmq vs the integer-domain emulation fmt.emulate(x, qt, return_bound=True): each
  per-block term is bit-equal, only the fp32 order of the sum over blocks differs, so
  |y_gpu - y_emul| <= bound (any fp32 order) + float32 rounding of y_emul + the fp16 rounding of
  the kernel's output (half an ulp: 2^-11 relative, 2^-25 absolute in subnormals).
* dequant path (W -> fp16 + cuBLAS) and wgmma path (Hopper; the weights formed in registers):
  the product vs float64 on fmt.dequantize rounded to half within 2^-10 * sum |x||w| (cuBLAS may
  keep split-K partials in fp16; wgmma sums in fp32, well inside it) + fp16 output rounding.
  The weights themselves, read back bit for bit through x = I (test_fp16_paths_weights_bit_exact):
  dequant's are fmt.dequantize (float32) rounded to half; wgmma's the correctly rounded half of
  the exact value -- the same except for Q4_1 / Q5_1 blocks whose float32 sum q d + m rounds.
* wgmma, tightly: vs float64 on its own fp16 weights (_wgmma_w16, the exact value rounded once to
  half, as the kernel forms them) within the fp32-summation bound K 2^-24 sum |x||w| plus the fp16
  output rounding (_check_fp32_sum) -- the bound the AWQ wgmma kernel meets on the same
  instructions (tests/test_awq_gpu.py), 2^14 / K times tighter than 2^-10 sum |x||w|.
* every path vs float64 with the unquantized weights: NMSE under fmt.nmse_ceiling (seed 004).
Outputs are NaN-poisoned before each launch; data are fresh random draws per run.
"""
from __future__ import annotations

import numpy as np
import pytest

import quantzoo as qz

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
from quantzoo.kernels import gguf as G  # noqa: E402  (imports CuPy lazily, at the first launch)
from test_q8_1 import near_tie_blocks  # noqa: E402

FORMATS = list(G.BLOCKS)  # every registry weight format whose kernels live in kernels/gguf.py
MS = [1, 2, 3, 5, 8, 9, 17, 64, 100, 512, 2048]
RNG = np.random.default_rng()  # fresh data every run; failures print the shapes
DEV = "cuda"


def _weight(fmt, n, k, rng, scale=0.02):
    w = (rng.standard_normal((n, k)) * scale).astype(np.float32)
    return w, qz.formats.get(fmt).quantize(w)


def _wgmma_weight(fmt, n, k, rng):
    """(w, the quantized weight on the CPU, the same on DEV) for a wgmma test (_weight's draws);
    the test is skipped where the wgmma path does not run (off Hopper)."""
    w, qt_cpu = _weight(fmt, n, k, rng)
    qt = qt_cpu.to(DEV)
    if not G.wgmma_ok(qt):
        pytest.skip("the wgmma path runs on Hopper (compute capability 9.0) only")
    return w, qt_cpu, qt


def _poisoned(shape, dtype=torch.float16, fill=float("nan")):
    return torch.full(shape, fill, dtype=dtype, device=DEV)


def _nmse(y, ref):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(((y - ref) ** 2).sum() / (ref ** 2).sum())


def _check_emulated(y, x16, qt_cpu, what):
    """y (fp16 from the GPU) against the emulation and its fp32-order bound."""
    ye, bound = qt_cpu.fmt.emulate(x16.astype(np.float32), qt_cpu, return_bound=True)
    ye = ye.astype(np.float64)
    yg = y.astype(np.float64)
    assert np.isfinite(yg).all(), f"{what}: non-finite outputs (unwritten NaN poison?)"
    tol = bound * (1 + 2.0 ** -11) + np.abs(ye) * (2.0 ** -11 + 2.0 ** -23) + 2.0 ** -24
    err = np.abs(yg - ye)
    bad = err > tol
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} outputs off the emulation; worst "
                           f"err {err.max():.3e} vs tol {tol.ravel()[np.argmax(err)]:.3e}")
    return ye


def _run(x_t, qt, path, fill=float("nan")):
    """matmul on `path` into an output first filled with `fill` (NaN: an unwritten element shows)."""
    m, n = x_t.shape[0], qt.shape[0]
    out = _poisoned((m, n), fill=fill)
    y = G.matmul(x_t, qt, out=out, path=path)
    assert y.data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    return y.float().cpu().numpy()


def _paths(m, qt=None):
    """mmvq runs M > 8 in chunks of 8; mma needs a 16-byte-aligned weight (qt on CUDA); wgmma a
    Hopper GPU and a weight with K % 256 == 0 (G.wgmma_ok)."""
    return ((["mmvq"] if m <= 128 else []) + (["mma"] if qt is not None and G._aligned16(qt) else [])
            + ["mmq", "dequant"] + (["wgmma"] if qt is not None and G.wgmma_ok(qt) else []))


FP16_PATHS = ("dequant", "wgmma")   # fp16 weights x fp16 x, not the Q8_1 integer function


def _check_fp16(y, x16, w16, what):
    """y against float64 on the half-rounded weights w16 (float64 (N, K))."""
    xd = x16.astype(np.float64)
    ref = xd @ w16.T
    tol = 2.0 ** -10 * (np.abs(xd) @ np.abs(w16).T) + np.abs(ref) * 2.0 ** -11 + 2.0 ** -24
    assert np.isfinite(y).all(), f"{what}: non-finite outputs (unwritten NaN poison?)"
    err = np.abs(y - ref)
    assert (err <= tol).all(), f"{what}: worst err {err.max():.3e}"


def _check_all_paths(fmt, w, qt_cpu, ms, rng, x_scale=1.0):
    """Every path for every M; NMSE pooled per path over the Ms (small N x M alone is too noisy
    an estimate to hold against a ceiling 20 % above the expected value)."""
    n, k = qt_cpu.shape
    qt = qt_cpu.to(DEV)
    w16 = qt_cpu.fmt.dequantize(qt_cpu).astype(np.float16).astype(np.float64)
    pooled = {}
    for m in ms:
        x16 = (rng.standard_normal((m, k)) * x_scale).astype(np.float16)
        x_t = torch.from_numpy(x16).to(DEV)
        exact = x16.astype(np.float64) @ w.astype(np.float64).T
        for path in _paths(m, qt):
            what = f"{fmt} {path} M={m} N={n} K={k}"
            y = _run(x_t, qt, path)
            if path in FP16_PATHS:
                _check_fp16(y, x16, w16, what)
            else:
                _check_emulated(y, x16, qt_cpu, what)
            num, den, cnt = pooled.get(path, (0.0, 0.0, 0))
            pooled[path] = (num + float(((y - exact) ** 2).sum()), den + float((exact ** 2).sum()), cnt + y.size)
    for path, (num, den, cnt) in pooled.items():
        if cnt >= 2048:
            nm = num / den
            assert nm < qt_cpu.fmt.nmse_ceiling, f"{fmt} {path} N={n} K={k}: NMSE {nm:.4%} >= {qt_cpu.fmt.nmse_ceiling:.2%}"


# ---- Q8_1 activation quantization ------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("m,k", [(1, 32), (3, 576), (17, 4096), (2, 12288)])
def test_quantize_q8_1_bit_equal(dtype, m, k):
    x = RNG.standard_normal((m, k)).astype(np.float32)
    x[0, :32] = 0.0                                   # an all-zero block: d = 0, q = 0
    if k >= 128:
        x[-1, 32:64] *= 300.0                          # large block (s stays in half range)
        x[-1, 64:96] *= 1e-4                           # tiny block (d subnormal or flushed in half)
        x[-1, 96:128] = np.round(x[-1, 96:128] * 4) / 4  # many exact halves after scaling
    x = x.astype(dtype)
    xt = torch.from_numpy(x).to(DEV)
    out = torch.full((m, k // 32 * 36), 0xAB, dtype=torch.uint8, device=DEV)
    got = G.quantize_q8_1(xt, out=out).cpu().numpy()
    want = qz.formats.get("q8_1").quantize(x.astype(np.float32)).data
    assert got.shape == want.shape
    diff = np.argwhere(got != want)
    assert diff.size == 0, f"first differing (row, byte): {diff[:5].tolist()}"


@pytest.mark.parametrize("amax", [127 * 2.0 ** -126, 1e-36, 3e-37, 1e-38, 1e-40, 1e-44])
def test_quantize_q8_1_fp32_tiny_blocks(amax):
    """fp32 blocks of tiny amax: d = 2^-126, the smallest normal (q as usual); d = amax / 127
    subnormal (1e-36, 3e-37); x itself subnormal (1e-38, 1e-40, 1e-44). CuPy compiles with
    -ftz=true, so the kernel flushes fp32 subnormals -- x, d, the partial sums of s -- to zero and
    gives d = 0, q = 0; the codec models that (gguf_blocks.flush_subnormals). Before, its
    amax == 0 test missed a d flushed to 0, and roundf(x * inf) saturated to a wrong byte."""
    rng = np.random.default_rng()
    x = rng.uniform(-1, 1, (2, 32 * 8)).astype(np.float32)
    x[:, ::32] = 1.0                                   # amax exactly at the block's first element
    x = (x * np.float32(amax)).astype(np.float32)
    x[1, 32:64] = 0.0
    want = qz.formats.get("q8_1").quantize(x).data
    for split in (False, True):
        fn = G.quantize_q8_1_split if split else G.quantize_q8_1
        n = x.size // 32
        # most of these blocks are all zero bytes: a poisoned output shows a block left unwritten
        shape = (n * 36,) if split else (x.shape[0], x.shape[1] // 32 * 36)
        got = fn(torch.from_numpy(x).to(DEV), out=_poisoned(shape, torch.uint8, 0xAB)).cpu().numpy()
        if split:
            got = np.concatenate([got[32 * n:].reshape(n, 4), got[: 32 * n].reshape(n, 32)], axis=1)
        g, w = got.reshape(-1, 36), want.reshape(-1, 36)
        bad = np.argwhere(g != w)
        assert bad.size == 0, (f"split={split}: (block, byte) {bad[:4].tolist()}; x {x.reshape(-1, 32)[bad[0][0]][:4]} "
                               f"kernel {g[bad[0][0]][4:12].view(np.int8)} codec {w[bad[0][0]][4:12].view(np.int8)}")


def test_quantize_q8_1_near_ties():
    """Values at and next to roundf's half-integer boundaries: the kernels' reciprocal shortcut
    (q8_1.cuh) gives the codec's bytes, in both layouts."""
    x = near_tie_blocks(RNG).reshape(1, -1)
    want = qz.formats.get("q8_1").quantize(x.astype(np.float32)).data
    n = x.size // 32
    got = G.quantize_q8_1(torch.from_numpy(x).to(DEV), out=_poisoned((1, n * 36), torch.uint8, 0xAB)).cpu().numpy()
    assert np.array_equal(got, want)
    split = G.quantize_q8_1_split(torch.from_numpy(x).to(DEV), out=_poisoned((n * 36,), torch.uint8, 0xAB))
    split = split.cpu().numpy()
    assert np.array_equal(split[: 32 * n].reshape(n, 32), want.reshape(n, 36)[:, 4:])


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("m,k", [(1, 32), (3, 576), (5, 4096)])
def test_quantize_q8_1_split_layout(dtype, m, k):
    """The split workspace (qs of block i at 32 i, half2 (d, s) at 32 n + 4 i) holds exactly the
    codec's bytes, rearranged."""
    x = RNG.standard_normal((m, k)).astype(np.float32)
    x[0, :32] = 0.0
    x = x.astype(dtype)
    n = m * k // 32
    out = torch.full((n * 36,), 0xAB, dtype=torch.uint8, device=DEV)
    got = G.quantize_q8_1_split(torch.from_numpy(x).to(DEV), out=out).cpu().numpy()
    want = qz.formats.get("q8_1").quantize(x.astype(np.float32)).data.reshape(n, 36)
    assert np.array_equal(got[: 32 * n].reshape(n, 32), want[:, 4:])
    assert np.array_equal(got[32 * n:].reshape(n, 4), want[:, :4])


def _q8_1_bytes_equal(got, want):
    """Q8_1 rows equal byte for byte, except that a NaN d or s need only be NaN on both sides
    (CUDA's __float2half_rn(NaN) is 0x7fff, numpy's 0x7e00)."""
    g, w = got.reshape(-1, 36), want.reshape(-1, 36)
    gh, wh = g[:, :4].copy().view(np.float16), w[:, :4].copy().view(np.float16)
    same_h = (gh.view(np.uint16) == wh.view(np.uint16)) | (np.isnan(gh) & np.isnan(wh))
    return bool(np.array_equal(g[:, 4:], w[:, 4:]) and same_h.all())


def test_quantize_q8_1_non_finite_blocks():
    """Blocks with a NaN (d, s NaN, q 0: fmaxf used to drop the NaN and keep a finite d, so Q8_0's
    integer paths, which never read s, gave a finite y), an inf, +inf and -inf: the codec's bytes,
    in both layouts (fp16 x; fp32 blocks of tiny amax: test_quantize_q8_1_fp32_tiny_blocks)."""
    x = RNG.standard_normal((2, 32 * 9)).astype(np.float32)
    x[0, 3] = np.nan                                   # NaN among normal values
    x[0, 32:64] = 0.0
    x[0, 40] = np.nan                                  # NaN among zeros (amax 0 without it)
    x[0, 70] = np.inf
    x[0, 100], x[0, 101] = np.inf, -np.inf
    x = x.astype(np.float16)
    with np.errstate(all="ignore"):
        want = qz.formats.get("q8_1").quantize_fields(x.astype(np.float32).reshape(2, 9, 32))
        f = qz.formats.get("q8_1")
        want = f.pack(want["d"].astype(np.float16), want["q"], want["m"].astype(np.float16))
    got = G.quantize_q8_1(torch.from_numpy(x).to(DEV)).cpu().numpy()
    assert _q8_1_bytes_equal(got, want), "Q8_1 bytes differ from the codec's"
    n = x.size // 32
    split = G.quantize_q8_1_split(torch.from_numpy(x).to(DEV)).cpu().numpy()
    inter = np.concatenate([split[32 * n:].reshape(n, 4), split[: 32 * n].reshape(n, 32)], axis=1)
    assert _q8_1_bytes_equal(inter, want), "split layout differs from the codec's"


@pytest.mark.parametrize("fmt", FORMATS)
def test_nan_activation_gives_nan_on_every_path(fmt):
    """A NaN in x makes its row NaN on every path (README: NaN and inf propagate), as the
    emulation says; the other rows are untouched. Q8_0's integer paths used to return finite
    numbers (the NaN was dropped from the Q8_1 scale and Q8_0 does not read the block sum)."""
    w, qt_cpu = _weight(fmt, 96, 256, RNG)
    qt = qt_cpu.to(DEV)
    x16 = RNG.standard_normal((3, 256)).astype(np.float16)
    x16[0, 5] = np.nan
    x16[1, 64:96] = 0
    x16[1, 70] = np.nan                                # a NaN in an otherwise all-zero block
    with np.errstate(all="ignore"):
        ye = qt_cpu.fmt.emulate(x16.astype(np.float32), qt_cpu)
    assert np.isnan(ye[:2]).all() and np.isfinite(ye[2]).all()
    for m in (1, 3):
        for path in _paths(m, qt):
            # the output starts finite here (NaN is the value expected), so an unwritten row shows
            y = _run(torch.from_numpy(x16[:m].copy()).to(DEV), qt, path, fill=1234.0)
            assert np.isnan(y[: min(m, 2)]).all(), f"{fmt} {path} M={m}: a NaN in x gave finite outputs"
            if m == 3:
                assert np.isfinite(y[2]).all(), f"{fmt} {path}: a finite row gave non-finite outputs"


# ---- dequantize kernel -----------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_bit_equal(fmt):
    w, qt = _weight(fmt, 193, 576, RNG)
    out = _poisoned((193, 576))
    got = G.dequantize(qt.to(DEV), out=out).cpu().numpy()
    want = qt.fmt.dequantize(qt).astype(np.float16)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


# ---- matmul: every path vs the emulation, float64 and the seed-004 NMSE ceilings ----------------
QWEN3_8B = [(4096, 4096, [1, 2, 3, 5, 8, 9, 17, 64, 100]),   # q_proj / o_proj
            (12288, 4096, [1, 8, 17]),                        # gate / up
            (4096, 12288, [1, 5, 64]),                        # down
            (1024, 4096, [3, 9, 40, 96])]                     # k / v (wgmma from M = 33, 64-token tiles past 64)
ODD = [(576, 576, MS), (192, 576, MS), (1536, 576, [1, 8, 9, 100, 512]),
       (576, 1536, [2, 17, 2048]), (100, 96, [1, 7, 65, 130])]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k,ms", QWEN3_8B + ODD, ids=lambda v: str(v) if not isinstance(v, list) else "")
def test_matmul_paths(fmt, n, k, ms):
    rng = np.random.default_rng(RNG.integers(1 << 32))
    w, qt = _weight(fmt, n, k, rng)
    _check_all_paths(fmt, w, qt, ms, rng)


@pytest.mark.parametrize("fmt", FORMATS)
def test_matmul_magnitudes(fmt):
    """Zero, tiny and large blocks in x and W; the tolerance is still the emulation's bound (the
    fp16 paths: the float64 bound on the half-rounded weights)."""
    rng = np.random.default_rng(RNG.integers(1 << 32))
    n, k = 130, 512   # K % 256 == 0: the wgmma path runs here too (on Hopper)
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    w[3] = 0.0
    w[5, :32] *= 1e3
    w[7, 32:64] *= 1e-3
    qt_cpu = qz.formats.get(fmt).quantize(w)
    qt = qt_cpu.to(DEV)
    w16 = qt_cpu.fmt.dequantize(qt_cpu).astype(np.float16).astype(np.float64)
    for m in (1, 6, 40):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[0, :64] = 0.0
        x[-1, 64:96] *= 400.0
        x[-1, 96:128] *= 1e-3
        x16 = x.astype(np.float16)
        x_t = torch.from_numpy(x16).to(DEV)
        for path in _paths(m, qt):
            what = f"{fmt} {path} M={m} magnitudes"
            if path in FP16_PATHS:
                _check_fp16(_run(x_t, qt, path), x16, w16, what)
            else:
                _check_emulated(_run(x_t, qt, path), x16, qt_cpu, what)


def _check_mmvq_rows(fmt, kernel, shapes):
    """mmvq_kernel=`kernel` at every rows-per-CTA/warp instance, every M of one launch (1..8) and
    chunked (11, 19), on weights of `shapes`; NaN-poisoned outputs against the emulation."""
    rng = np.random.default_rng(RNG.integers(1 << 32))
    for n, k in shapes:
        _, qt_cpu = _weight(fmt, n, k, rng)
        qt = qt_cpu.to(DEV)
        if kernel == "vec":
            assert G.mmvq16_ok(qt)
        for m in list(range(1, G.MMVQ_COLS + 1)) + [11, 19]:
            x16 = rng.standard_normal((m, k)).astype(np.float16)
            x_t = torch.from_numpy(x16).to(DEV)
            for rows in G.MMVQ_ROW_CHOICES:
                out = _poisoned((m, n))
                G.matmul(x_t, qt, out=out, path="mmvq", mmvq_rows=rows, mmvq_kernel=kernel)
                _check_emulated(out.float().cpu().numpy(), x16, qt_cpu, f"{fmt} mmvq {kernel} R={rows} M={m} N={n} K={k}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_mmvq16_rows_per_warp_tails(fmt):
    """The vector-load mmvq, every rows-per-warp instance: N not a multiple of the rows per CTA,
    rows that start off a 16-byte boundary (K/32 * bytes not a multiple of 16: the window offset
    then differs row to row), nb < 32 and nb = 130 (a partial last pass), every M of one launch
    and chunked; NaN-poisoned outputs against the emulation."""
    _check_mmvq_rows(fmt, "vec", [(67, 256), (72, 96), (1, 512), (136, 4160), (24, 576)])


@pytest.mark.parametrize("fmt", FORMATS)
def test_mma_tiles_splits_tails(fmt):
    """The int8 tensor-core GEMM: every BM tile (16 / 32 / 64 by M), forced K splits 1..7 (the
    fp32 partials then summed by mma_reduce), N not a multiple of the 64-row tile, M not a
    multiple of BM, nb not a multiple of the 4-block step nor of the split; rows off 16-byte
    boundaries (K = 96, 4160); NaN-poisoned outputs against the emulation."""
    rng = np.random.default_rng(RNG.integers(1 << 32))
    for n, k, ms in [(200, 4160, (9, 16, 17, 40, 64, 100)), (72, 96, (1, 33, 65)), (8, 512, (130,))]:
        _, qt_cpu = _weight(fmt, n, k, rng)
        qt = qt_cpu.to(DEV)
        assert G._aligned16(qt)
        for m in ms:
            x16 = rng.standard_normal((m, k)).astype(np.float16)
            x_t = torch.from_numpy(x16).to(DEV)
            for split in (None, 1, 3, 7):
                out = _poisoned((m, n))
                G.matmul(x_t, qt, out=out, path="mma", mma_split=split)
                _check_emulated(out.float().cpu().numpy(), x16, qt_cpu, f"{fmt} mma split={split} M={m} N={n} K={k}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_mmvq_rows_per_cta_tails(fmt):
    """The scalar-load mmvq, every rows-per-CTA instance, N not a multiple of it, every M of one
    launch (1..8) and chunked."""
    _check_mmvq_rows(fmt, "scalar", [(67, 96), (1, 32), (130, 352)])


def test_dequant_path_in_slices(monkeypatch):
    """A small transient buffer forces W through several row slices, each multiplied into a
    column block of y; sliced and whole results must both stay within the fp16 cuBLAS bound
    (not bit-equal: cuBLAS may pick other kernels for other N)."""
    rng = np.random.default_rng(RNG.integers(1 << 32))
    w, qt_cpu = _weight("q4_1", 1000, 576, rng)
    qt = qt_cpu.to(DEV)
    x16 = rng.standard_normal((70, 576)).astype(np.float16)
    x_t = torch.from_numpy(x16).to(DEV)
    whole = G.matmul(x_t, qt, path="dequant").float().cpu().numpy()
    monkeypatch.setattr(G, "DEQUANT_BUFFER_BYTES", 300 * 576 * 2)  # 300 rows -> slices 256, ..., tail
    sliced = _run(x_t, qt, "dequant")
    w16 = qt_cpu.fmt.dequantize(qt_cpu).astype(np.float16).astype(np.float64)
    ref = x16.astype(np.float64) @ w16.T
    tol = 2.0 ** -10 * (np.abs(x16.astype(np.float64)) @ np.abs(w16).T) + np.abs(ref) * 2.0 ** -11 + 2.0 ** -24
    assert (np.abs(sliced - ref) <= tol).all() and (np.abs(whole - ref) <= tol).all()


def test_matmul_leading_dims_and_default_dispatch():
    rng = np.random.default_rng(RNG.integers(1 << 32))
    w, qt_cpu = _weight("q4_0", 256, 512, rng)
    qt = qt_cpu.to(DEV)
    for lead in [(1,), (2, 3), (4, 1, 5), (3, 40), (700,)]:
        x16 = rng.standard_normal(lead + (512,)).astype(np.float16)
        y = qz.ops.matmul(torch.from_numpy(x16).to(DEV), qt)
        assert y.shape == lead + (256,) and y.dtype == torch.float16
        m = int(np.prod(lead))
        y2 = y.float().cpu().numpy().reshape(m, 256)
        if G.choose_path(m, qt) == "dequant":
            assert _nmse(y2, x16.reshape(m, -1).astype(np.float64) @ w.T.astype(np.float64)) < 0.0089
        else:
            _check_emulated(y2, x16.reshape(m, -1), qt_cpu, f"lead {lead}")


# ---- a real tensor read back from a .gguf file -------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_matmul_gguf_file_tensor(fmt, tmp_path):
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(RNG.integers(1 << 32))
    n, k = 1536, 576
    w, qt = _weight(fmt, n, k, rng)
    path = tmp_path / "t.gguf"
    wr = gguf.GGUFWriter(str(path), "llama")
    wr.add_tensor("blk.0.ffn_up.weight", qt.data, raw_dtype=gguf.GGMLQuantizationType[qt.fmt.gguf_type])
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    t = gguf.GGUFReader(str(path)).tensors[0]
    assert t.tensor_type == gguf.GGMLQuantizationType[qt.fmt.gguf_type]
    qf = qt.fmt.from_bytes(np.array(t.data), (n, k))
    assert np.array_equal(qf.data, qt.data)
    _check_all_paths(fmt, w, qf, [1, 8, 33, 600], rng)


# ---- the fp16-weight paths' weights, bit for bit ------------------------------------------------
def _extreme_fields(fmt, n, nb, rng):
    """Fields with d and m over fp16's whole range of exponents (subnormals, zeros, signs) up to
    2^9, so that |q d + m| stays finite in fp16, and every q."""
    def halves(shape):
        v = rng.choice([-1.0, 1.0], shape) * 2.0 ** rng.uniform(-25, 9, shape)
        v[rng.random(shape) < 0.05] = 0.0
        return v.astype(np.float16)
    d = halves((n, nb))
    m = halves((n, nb)) if fmt.has_min else None
    lo, hi = (-127, 127) if fmt.bits == 8 else (0, (1 << fmt.bits) - 1)
    return d, m, rng.integers(lo, hi + 1, (n, nb, 32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp16_paths_weights_bit_exact(fmt):
    """x = the identity reads each fp16-weight path's weights back exactly (one product by 1, the
    rest exact zeros; fp32 sums; the fp16 output of an fp16 value): dequant's are the float32
    fmt.dequantize rounded to half, wgmma's (Hopper) the correctly rounded half of the exact
    value q d + m or (q - offset) d (float64 holds it exactly). Q4_1 / Q5_1 with |q d| and |m|
    far apart are where the two differ (the float32 sum rounds first); everywhere else they agree.
    N = 200: a row tile's tail; K = 512: all 8 stages' offsets in their 16-byte windows (64-k
    stages: M = 512, 64), all 4 of the 128-k stages' (M = 32, 16: every k by 32-row slices)."""
    rng = np.random.default_rng(RNG.integers(1 << 32))
    f = qz.formats.get(fmt)
    n, k = 200, 512
    d, m, q = _extreme_fields(f, n, k // 32, rng)
    qt_cpu = qz.formats.QuantizedTensor(fmt, (n, k), f.pack(d, q, m))
    fields = f.unpack(qt_cpu.data)
    assert np.array_equal(fields["q"], q), "pack / unpack round trip"
    d64 = fields["d"].astype(np.float64)[..., None]
    exact = (d64 * q + fields["m"].astype(np.float64)[..., None] if f.has_min
             else d64 * (q - f.offset)).reshape(n, k)
    want = {"dequant": f.dequantize(qt_cpu).astype(np.float16), "wgmma": exact.astype(np.float16)}
    qt = qt_cpu.to(DEV)
    eye = torch.eye(k, dtype=torch.float16, device=DEV)
    for path in (["dequant"] + (["wgmma"] if G.wgmma_ok(qt) else [])):
        # M = 512 (T = 256), 64 (T = 64), and every k in 128-k stages: 32-row slices (T = 32) and
        # two of 16 (T = 16)
        slices = [slice(0, k), slice(128, 192), slice(16, 32), slice(k - 16, k)]
        for rows in slices + [slice(r, r + 32) for r in range(0, k, 32)]:
            got = _run(eye[rows].contiguous(), qt, path).T
            diff = got != want[path][:, rows].astype(np.float32)
            assert not diff.any(), (f"{fmt} {path}: {diff.sum()} weights differ, first at "
                                    f"{tuple(int(i) for i in np.argwhere(diff)[0])}")
    if f.has_min:   # how often the two paths' weights differ: only where float32's sum rounded
        print(f"{fmt}: {(want['dequant'] != want['wgmma']).mean():.2%} of these weights differ between paths")
    else:
        assert np.array_equal(want["dequant"], want["wgmma"])


# ---- the Hopper wgmma path: tails, split K, graph replay -------------------------------------------
@pytest.mark.parametrize("fmt", G.WGMMA_FORMATS)
def test_wgmma_tails_splits_graph(fmt):
    """M and N tails of every token tile (T = 16 .. 256), K split (from M = 33 into 5-8 parts,
    uneven: 44 stages in 5; below, in 128-k stages, 2-8) and summed by wgmma_reduce (1-wide at
    N = 202, 4-wide else), more tiles than an H100 holds at once (8704 rows at M = 130 / 300: 136
    tiles, 132 walking all of K and the last 4 split), a second call equal to the first (the
    split sum's order is fixed), and a graph replay equal to the eager call."""
    rng = np.random.default_rng(RNG.integers(1 << 32))
    for n, k in ((202, 4096), (8704, 2048), (72, 2816)):   # N % 4 != 0: the 1-wide reduce
        w, qt_cpu, qt = _wgmma_weight(fmt, n, k, rng)
        w16 = qt_cpu.fmt.dequantize(qt_cpu).astype(np.float16).astype(np.float64)
        for m in (1, 7, 20, 33, 65, 130, 300):
            x16 = rng.standard_normal((m, k)).astype(np.float16)
            y = _run(torch.from_numpy(x16).to(DEV), qt, "wgmma")
            _check_fp16(y, x16, w16, f"{fmt} wgmma {n}x{k} M={m}")
            assert np.array_equal(y, _run(torch.from_numpy(x16).to(DEV), qt, "wgmma")), "a second call differs"
    m = 96
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float16)).to(DEV)
    y = torch.empty((m, n), dtype=torch.float16, device=DEV)
    G.matmul(x, qt, out=y, path="wgmma")   # warm-up: compile, size the workspace
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        G.matmul(x, qt, out=y, path="wgmma")
    x.copy_(torch.from_numpy(rng.standard_normal((m, k)).astype(np.float16)))
    y.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, G.matmul(x, qt, path="wgmma")), "graph replay differs from an eager call"


# ---- glu=True: silu(x @ gate.T) * (x @ up.T), fused into the wgmma epilogue -----------------------
def _glu_blocked(qt_cpu, fr):
    """qt's rows [gate; up] rearranged into blocks of fr gate rows then the fr matching up rows
    (each padded with zero rows, which dequantise to 0): an unfused wgmma launch on it, whose
    tiles hold 2 fr rows, puts every gate row and its up row in the same tile, warpgroup and
    place as the GLU launch on qt does, with the same tile schedule -- so its products are the
    GLU launch's own, bit for bit, split K included."""
    n, k = qt_cpu.shape
    f, data = n // 2, np.asarray(qt_cpu.data)
    tiles = -(-f // fr)
    out = np.zeros((2 * fr * tiles, data.shape[1]), np.uint8)
    for i in range(tiles):
        rows = min(fr, f - i * fr)
        out[2 * i * fr: 2 * i * fr + rows] = data[i * fr: i * fr + rows]
        out[(2 * i + 1) * fr: (2 * i + 1) * fr + rows] = data[f + i * fr: f + i * fr + rows]
    return qz.formats.QuantizedTensor(qt_cpu.format, (out.shape[0], k), out, qt_cpu.params)


def _glu_products(yb, f, fr):
    """[gate | up] (M, 2F) from the products yb (M, rows of _glu_blocked(qt, fr)) of a launch on
    the blocked weight."""
    yb = yb.view(yb.shape[0], -1, 2, fr)
    m = yb.shape[0]
    return torch.cat([yb[:, :, 0].reshape(m, -1)[:, :f], yb[:, :, 1].reshape(m, -1)[:, :f]], 1).contiguous()


def _assert_glu_equals(y, gu, what):
    """The GLU launch's y is silu_mul of the products gu, bit for bit, every element written."""
    from quantzoo.kernels import layer_ops

    want = layer_ops.silu_mul(gu)
    torch.cuda.synchronize()
    assert torch.isfinite(y).all(), f"{what}: unwritten outputs"
    assert torch.equal(y, want), (f"{what}: GLU differs from silu_mul of the products, worst "
                                  f"{float((y.float() - want.float()).abs().max()):.3g}")


@pytest.mark.parametrize("fmt", G.WGMMA_FORMATS)
def test_wgmma_glu_epilogue(fmt, monkeypatch):
    """matmul(glu=True) on the wgmma path equals layer_ops.silu_mul of the gate and up products,
    bit for bit, those products taken from an unfused wgmma launch on the same rows in the same
    tile places (_glu_blocked). Shapes: F = 100, 102 and 36 (gate tiles that run past F, reading
    up rows that are not stored), K split (5-8 ways from M = 33, uneven: 44 stages in 5; the split
    tiles' GLU in wgmma_reduce: 4-wide where F % 4 == 0, i.e. F = 100, 36, 4352; 1-wide,
    wgmma_reduce<1, true>, only at F = 102; the launches asked for are recorded to prove it), more
    tiles than an H100 holds (F = 4352 at M = 130 / 300), every token tile width. The unfused
    launch is the GLU config's plain twin, forced to the GLU launch's schedule."""
    from quantzoo.cuda_launch import sm_count
    from quantzoo.kernels import layer_ops, wgmma_tiles

    names = []
    real_kernel = G._kernel

    def spy(source, name):
        names.append(name)
        return real_kernel(source, name)

    monkeypatch.setattr(G, "_kernel", spy)
    launches = _spy_wgmma(monkeypatch, lambda grid, a: (int(a[8]), int(a[9])))   # (whole tiles, splits)
    reduces = set()
    rng = np.random.default_rng(RNG.integers(1 << 32))
    for n, k in ((200, 4096), (204, 4096), (8704, 2048), (72, 2816)):
        _, qt_cpu, qt = _wgmma_weight(fmt, n, k, rng)
        f = n // 2
        for m in (1, 7, 20, 33, 130, 300):
            cfg = G.wgmma_config(m, n, k, sm_count(torch.device(DEV)), glu=True)
            fr = wgmma_tiles.columns(cfg[0], cfg[1]) // 2
            blocked = _glu_blocked(qt_cpu, fr).to(DEV)
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float16)).to(DEV)
            y = _poisoned((m, f))
            names.clear()
            launches.clear()
            G.matmul(x, qt, out=y, path="wgmma", glu=True)
            red = [s for s in names if s.startswith("wgmma_reduce")]
            assert red in ([], [f"wgmma_reduce<{4 if f % 4 == 0 else 1}, true>"]), (n, k, m, names)
            reduces.update(red)
            # the plain twin of the GLU config on the blocked rows, with the GLU launch's schedule
            dp, splits = launches[0]
            yb = torch.empty((m, blocked.shape[0]), dtype=torch.float16, device=DEV)
            G._launch_wgmma(fmt, x, blocked.data, yb, m, blocked.shape[0], k // 32, cfg=cfg, splits=splits, dp_tiles=dp)
            assert launches[1] == launches[0], "the unfused launch took another schedule"
            _assert_glu_equals(y, _glu_products(yb, f, fr), f"{fmt} {n}x{k} M={m}")
    # F = 102 splits K at every M here (a few tiles; 8 ways from M = 33, 64 stages, checked on the
    # CPU with 1 or 2 blocks an SM on 114 or 132 SMs; 4 ways below, 32 stages of 128 k): its
    # outputs came through the 1-wide GLU reduce
    assert reduces == {"wgmma_reduce<1, true>", "wgmma_reduce<4, true>"}, reduces
    # the other paths (M = 3: mmvq, 40: mma, 130: dequant + cuBLAS, whose torch step writes the
    # workspace) run the product into a workspace, then silu_mul; the default dispatch replays its
    # recorded launches (the second call) and is graph-capturable
    for m in (3, 40, 130):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float16)).to(DEV)
        want = layer_ops.silu_mul(G.matmul(x, qt))
        for _ in range(2):
            assert torch.equal(G.matmul(x, qt, glu=True), want), f"{fmt} M={m} ({G.choose_path(m, qt)})"
    y = _poisoned((m, f))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        G.matmul(x, qt, out=y, glu=True)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, want), "graph replay of the GLU matmul differs from an eager call"
    with pytest.raises(ValueError, match="glu"):
        G.matmul(x, qz.formats.get(fmt).quantize(np.zeros((6, k), np.float32)).to(DEV), glu=True)


# ---- wgmma against its own fp16 weights, in the fp32 bound; whole and split tiles in one launch ----
def _spy_wgmma(monkeypatch, pick) -> list:
    """Patch G.launch_tma (the wgmma kernel's launch) to keep pick(grid, args) of each launch in the
    returned list, then launch it. args: (weight map, x map, y, partials, M, N, nb, tiles_m, whole
    tiles, splits, stages a split, x rows), as _launch_wgmma passes them."""
    seen, real = [], G.launch_tma

    def spy(kern, grid, block, args, shared_mem=0):
        seen.append(pick(grid, args))
        return real(kern, grid, block, args, shared_mem)

    monkeypatch.setattr(G, "launch_tma", spy)
    return seen


def _wgmma_w16(qt_cpu):
    """The wgmma kernel's own fp16 weights as float64 (N, K), by numpy from the block fields: the
    exact value (q - offset) d, or q d + m for Q4_1 / Q5_1 (float64 holds it exactly), rounded
    once to half (numpy rounds float64 -> float16 directly, to nearest even). That is the
    kernel's arithmetic (cuda/gguf_wgmma.cu, read for this): q - offset is formed exactly in fp16
    (the 1024 + q magic and one hsub2 / hfma2 by powers of two), then one __hmul2_rn by d (Q4_0 /
    Q5_0 / Q8_0) or one __hfma2 by d plus m (Q4_1 / Q5_1) -- one fp16 rounding of the exact
    value, no fp32 step. For Q4_0 / Q5_0 / Q8_0 it equals fmt.dequantize (float32, exact there:
    8 + 11 significant bits) rounded to half; for Q4_1 / Q5_1 the two can differ where the float32
    q d + m rounds (test_fp16_paths_weights_bit_exact reads these weights back bit for bit)."""
    f = qt_cpu.fmt
    n, k = qt_cpu.shape
    fields = f.unpack(qt_cpu.data)
    d = fields["d"].astype(np.float64)[..., None]
    q = fields["q"].astype(np.float64)
    exact = d * q + fields["m"].astype(np.float64)[..., None] if f.has_min else d * (q - f.offset)
    w16 = exact.reshape(n, k).astype(np.float16)
    if not f.has_min:
        assert np.array_equal(w16, f.dequantize(qt_cpu).astype(np.float16)), f"{f.name}: float32 (q - offset) d inexact?"
    return w16.astype(np.float64)


def _check_fp32_sum(y, x16, w16, what):
    """y (fp16; numpy or CUDA) against ref = x16 @ w16.T in float64 (w16: the kernel's own fp16
    weights, float64 CUDA (N, K)) within the bound the AWQ wgmma test holds that kernel to on the
    same wgmma instructions (tests/test_awq_gpu.py, emulate_gpu / check):
        |y - ref| <= K 2^-24 sum_k |x_k w_k| (1 + 2^-11) + 2^-11 |ref| + 2^-25.
    fp16 x fp16 products are exact in fp32 (11 + 11 significant bits); a sum of K of them in fp32,
    in any order -- the tensor cores' k-steps, split-K partials and wgmma_reduce's sum over the
    splits -- errs by at most (K - 1) 2^-24 sum |x w| (to first order; K 2^-24 covers the rest);
    rounding that fp32 value to fp16 adds half its ulp: 2^-11 of it (the (1 + 2^-11) factor and
    2^-11 |ref|), or 2^-25 among subnormals. _check_fp16's 2^-10 sum |x w| (room for cuBLAS's
    fp16 partials) is 2^14 / K times looser: 4x at K = 4096, 32x at K = 512. The tensor cores add
    several aligned products at once with truncation rather than one at a time rounded to nearest
    (more error per add, but fewer adds than K - 1); the AWQ kernel meets this bound on the same
    instructions, and random data sit far inside it (the worst ratio is in the failure message)."""
    x = torch.from_numpy(np.ascontiguousarray(x16)).to(DEV).double()
    yt = torch.as_tensor(y).to(DEV).double()
    ref = x @ w16.T
    tol = x.shape[1] * 2.0 ** -24 * (x.abs() @ w16.abs().T) * (1 + 2.0 ** -11) + ref.abs() * 2.0 ** -11 + 2.0 ** -25
    assert yt.shape == ref.shape, f"{what}: shape {tuple(yt.shape)}"
    assert torch.isfinite(yt).all(), f"{what}: non-finite outputs (unwritten NaN poison?)"
    ratio = ((yt - ref).abs() / tol).max().item()
    assert ratio <= 1.0, f"{what}: |y - x @ w16.T| reaches {ratio:.3g} x the fp32 bound"
    # the worst-case bound misses fp16 sums at large K; their NMSE does not (test_fp16_gemv_gpu.py)
    e2, r2 = float(((yt - ref) ** 2).sum()), float((ref ** 2).sum())
    assert e2 <= 4e-7 * r2 + yt.numel() * 2.0 ** -50, f"{what}: NMSE {e2 / max(r2, 1e-300):.3g} > 4e-7"
    return ratio


@pytest.mark.parametrize("fmt", G.WGMMA_FORMATS)
def test_wgmma_128k_forced_schedules(fmt, monkeypatch):
    """The 128-k stage configs (M <= 32) under schedules dispatch never makes on these shapes,
    forced: K = 2816 (22 stages) split 3 ways (8, 8, 6 stages) and 5 ways (5, 5, 5, 5, 2), with no
    whole tiles and with 3 whole tiles beside the split ones in one launch; N = 1000 (8 tiles of
    128 rows, the last a row tail). Plain configs against float64 on the kernel's own weights in
    the fp32-summation bound; GLU (F = 500) equal, bit for bit, to silu_mul of its plain twin's
    products on the blocked rows under the same forced schedule. The launches' own (whole
    tiles, splits, stages a split) are read back."""
    from quantzoo.kernels import wgmma_tiles

    launches = _spy_wgmma(monkeypatch, lambda grid, a: tuple(int(v) for v in a[8:11]))
    rng = np.random.default_rng(RNG.integers(1 << 32))
    n, k = 1000, 2816
    _, qt_cpu, qt = _wgmma_weight(fmt, n, k, rng)
    w16 = torch.from_numpy(_wgmma_w16(qt_cpu)).to(DEV)
    f = n // 2
    cfgs = [(c, False) for c in G.WGMMA_CFGS if G._wgmma_bps_bk(c)[1] == 128]
    cfgs += [(c, True) for c in G.WGMMA_GLU_CFGS if G._wgmma_bps_bk(c)[1] == 128]
    assert len(cfgs) == 3, cfgs
    for cfg, glu in cfgs:
        rows = wgmma_tiles.columns(cfg[0], cfg[1])
        blocked = _glu_blocked(qt_cpu, rows // 2).to(DEV) if glu else None
        for m in (3, cfg[1]):
            x16 = (rng.standard_normal((m, k)) * 2.0 ** rng.uniform(-4, 4, (m, 1))).astype(np.float16)
            x = torch.from_numpy(x16).to(DEV)
            for splits, dp in ((3, 0), (5, 0), (3, 3), (5, 3)):
                what = f"{fmt} {cfg} glu={glu} {n}x{k} M={m} splits={splits} whole tiles={dp}"
                y = _poisoned((m, f if glu else n))
                launches.clear()
                G._launch_wgmma(fmt, x, qt.data, y, m, n, k // 32, glu=glu, cfg=cfg, splits=splits, dp_tiles=dp)
                per = -(-(k // 128) // splits)
                assert launches == [(dp, splits, per)], (what, launches)
                if not glu:
                    _check_fp32_sum(y, x16, w16, what)
                    continue
                nb = blocked.shape[0]
                yb = torch.empty((m, nb), dtype=torch.float16, device=DEV)
                G._launch_wgmma(fmt, x, blocked.data, yb, m, nb, k // 32, cfg=cfg, splits=splits, dp_tiles=dp)
                assert launches[1] == launches[0], what
                _assert_glu_equals(y, _glu_products(yb, f, rows // 2), what)


@pytest.mark.parametrize("fmt", G.WGMMA_FORMATS)
def test_wgmma_fp32_accumulation_bound(fmt, monkeypatch):
    """The wgmma path against float64 on its own fp16 weights (_wgmma_w16) in the fp32-summation
    bound (_check_fp32_sum), 4-32x tighter than the cuBLAS-style bound the other wgmma tests
    take: every token tile (M = 1, 7: T = 16 and 20: T = 32, both in 128-k stages; 33: 64; 65,
    100: 128; 130, 200: 256; 300: 128 or 256), all tiles split (202 x 4096 -- the 1-wide
    reduce --, 8704 x 2048 while M <= 128, 72 x 2816 unevenly), whole-K tiles only (8704 x 2048
    above M = 128, 1000 x 512: K = 512, 32x tighter), M and N tails; x rows scaled 2^-6 .. 2^4.
    The schedules are read from the launches; both kinds must have run."""
    from quantzoo.cuda_launch import sm_count

    launches = _spy_wgmma(monkeypatch, lambda grid, a: (int(a[8]), int(a[9])))   # (whole tiles, splits), as launched
    rng = np.random.default_rng(RNG.integers(1 << 32))
    sms = sm_count(torch.device(DEV))
    schedules = set()
    for n, k in ((202, 4096), (8704, 2048), (72, 2816), (1000, 512)):
        _, qt_cpu, qt = _wgmma_weight(fmt, n, k, rng)
        w16 = torch.from_numpy(_wgmma_w16(qt_cpu)).to(DEV)
        worst = 0.0
        for m in (1, 7, 20, 33, 65, 100, 130, 200, 300):
            cfg = G.wgmma_config(m, n, k, sms)
            scale = 2.0 ** rng.uniform(-6, 4, (m, 1))
            x16 = (rng.standard_normal((m, k)) * scale).astype(np.float16)
            launches.clear()
            y = _run(torch.from_numpy(x16).to(DEV), qt, "wgmma")
            dp, splits = launches[0]
            schedules.add((dp > 0, splits > 1))
            worst = max(worst, _check_fp32_sum(y, x16, w16, f"{fmt} wgmma {n}x{k} M={m} T={cfg[1]} "
                                                             f"whole tiles={dp} splits={splits}"))
        print(f"{fmt} {n}x{k}: worst |y - ref| / fp32 bound {worst:.3g}")
    assert {(False, True), (True, False)} <= schedules   # split-only and whole-only launches ran


@pytest.mark.parametrize("fmt", G.WGMMA_FORMATS)
def test_wgmma_whole_and_split_tiles_one_launch(fmt, monkeypatch):
    """Whole tiles and split tiles in one launch, plain and GLU, the split tiles holding the row
    tail (the shapes of test_wgmma_tails_splits_graph / _glu_epilogue get no such launch):
    (N, K) = (16904, 1024) at M = 129: T = 256, 133 tiles of 128 rows on 132 SMs -- 132 walk all
    of K, the last (8 rows of N; 4 of F = 8452 gate rows with glu) is split two ways, 8 of the 16
    stages each, and summed by wgmma_reduce<4>; prefill's gate/up launch takes this schedule from
    M = 129 up. (11272, 2048) at M = 257 and 300: T = 128, 3 token tiles (the last shifted back to
    end at M) x 45 row tiles = 135: 132 whole, the last 3 split four ways. The schedule is read
    from the launch itself (launch_tma's arguments), not recomputed. The plain product is held
    to the fp32 bound on the kernel's own weights (_check_fp32_sum), and a second call is equal;
    glu=True equals silu_mul of the products of an unfused launch on the same rows in the same
    tile places (_glu_blocked, the same schedule), those products held to the same bound. The
    split tiles' partials keep to a workspace of splits x M x the split tiles' columns: the
    second plain call and the GLU call get one of exactly that size, a sentinel guard after it
    untouched."""
    from quantzoo.cuda_launch import current_stream_ptr, sm_count, workspaces_changed
    from quantzoo.kernels import wgmma_tiles, workspaces

    # (grid, (M, N, nb, tiles_m, dp_tiles, splits, sps)) of each wgmma launch
    seen = _spy_wgmma(monkeypatch, lambda grid, a: (tuple(grid), tuple(int(v) for v in a[4:11])))
    rng = np.random.default_rng(RNG.integers(1 << 32))
    sms = sm_count(torch.device(DEV))
    for n, k, ms in ((16904, 1024, (129,)), (11272, 2048, (257, 300))):
        _, qt_cpu, qt = _wgmma_weight(fmt, n, k, rng)
        w16 = torch.from_numpy(_wgmma_w16(qt_cpu)).to(DEV)
        f = n // 2
        for m in ms:
            cfg = G.wgmma_config(m, n, k, sms)
            rows = wgmma_tiles.columns(cfg[0], cfg[1])
            tiles_m, tiles_n = wgmma_tiles.grid(m, n, cfg)
            tiles = tiles_m * tiles_n
            what = f"{fmt} wgmma {n}x{k} M={m} T={cfg[1]}"
            x16 = rng.standard_normal((m, k)).astype(np.float16)
            x = torch.from_numpy(x16).to(DEV)
            seen.clear()
            y = _run(x, qt, "wgmma")
            (grid, (_, _, _, tm, dp, splits, sps)), = seen
            assert tm == tiles_m and 0 < dp < tiles and splits > 1, f"{what}: schedule {dp, splits, sps}, {tiles} tiles"
            assert grid == (dp + (tiles - dp) * splits,) and (splits - 1) * sps < k // 64 <= splits * sps
            assert n % rows and f % (rows // 2), "the last (split) tile holds a row tail, plain and GLU"
            if sms == 132:   # H100 SXM / H200: the counts the docstring names
                assert (tiles, dp, splits) == ((133, 132, 2) if n == 16904 else (135, 132, 4))
            _check_fp32_sum(y, x16, w16, f"{what} whole tiles={dp} splits={splits}")
            # the partials' workspace: exactly the M x (the split tiles' columns) of each split
            # (wg::SplitParts; the GLU call below needs the same), a sentinel guard after it
            # untouched by this call and the GLU call
            need = splits * m * (n - dp // tiles_m * rows) * 4
            assert need < splits * m * n * 4 // 10
            key = ("partials", str(x.device), current_stream_ptr())   # workspaces._CACHE: bytes
            assert workspaces._CACHE[key].numel() >= need
            guard = torch.full((need + 16384,), 0xA5, dtype=torch.uint8, device=DEV)
            workspaces._CACHE[key] = guard[:need]
            workspaces_changed()   # as workspaces.scratch does on a new buffer
            assert np.array_equal(y, _run(x, qt, "wgmma")), f"{what}: a second call differs"
            # glu=True: the GLU launch and the unfused one on the blocked rows, one schedule
            fr = rows // 2
            blocked = _glu_blocked(qt_cpu, fr).to(DEV)
            seen.clear()
            yg = _poisoned((m, f))
            G.matmul(x, qt, out=yg, path="wgmma", glu=True)
            assert workspaces._CACHE[key].data_ptr() == guard.data_ptr(), "the guarded workspace was not used"
            assert bool((guard[need:] == 0xA5).all()), f"{what}: partials written past the workspace"
            yb = G.matmul(x, blocked, path="wgmma")
            assert len(seen) == 2 and seen[0][0] == seen[1][0] == grid \
                and seen[0][1][3:] == seen[1][1][3:] == (tm, dp, splits, sps), f"{what} glu: schedules {seen}"
            gu = _glu_products(yb, f, fr)
            _check_fp32_sum(gu, x16, w16, f"{what} blocked [gate | up] products")
            _assert_glu_equals(yg, gu, f"{what} glu")


# ---- CUDA graph capture -------------------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 8, 24, 40, 300])
def test_graph_capture_replays(m):
    rng = np.random.default_rng(RNG.integers(1 << 32))
    _, qt_cpu = _weight("q5_1", 1000, 1024, rng)
    qt = qt_cpu.to(DEV)
    x = torch.from_numpy(rng.standard_normal((m, 1024)).astype(np.float16)).to(DEV)
    y = torch.empty((m, 1000), dtype=torch.float16, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        G.matmul(x, qt, out=y)  # warm-up (compile) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        G.matmul(x, qt, out=y)
    for _ in range(2):
        x.copy_(torch.from_numpy(rng.standard_normal((m, 1024)).astype(np.float16)))
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        want = G.matmul(x, qt)
        assert torch.equal(y, want), f"M={m}: graph replay differs from an eager call"


# ---- input checks on real CUDA tensors ------------------------------------------------------------
def test_bad_inputs_raise_value_error():
    _, qt_cpu = _weight("q8_0", 64, 128, RNG)
    qt = qt_cpu.to(DEV)
    x = torch.zeros((2, 128), dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match="x"):
        G.matmul(x[:, :96], qt)
    with pytest.raises(ValueError, match="x"):
        G.matmul(x.float(), qt)
    with pytest.raises(ValueError, match="x"):
        G.matmul(torch.zeros((128, 2), dtype=torch.float16, device=DEV).t(), qt)
    with pytest.raises(ValueError, match="out"):
        G.matmul(x, qt, out=torch.empty((2, 63), dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError, match="path"):
        G.matmul(x, qt, path="fast")
    with pytest.raises(ValueError, match="mmvq_rows"):
        G.matmul(x, qt, mmvq_rows=3)
    with pytest.raises(ValueError, match="x"):
        G.quantize_q8_1(torch.zeros((2, 48), dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError, match="data"):
        G.matmul(x, type(qt)(qt.format, qt.shape, qt.data[:, :-1].contiguous()))
    with pytest.raises(ValueError, match="mmvq_kernel"):
        G.matmul(x, qt, mmvq_kernel="fast")
    big = torch.zeros(qt.data.numel() + 16, dtype=torch.uint8, device=DEV)
    odd = type(qt)(qt.format, qt.shape, big[4:4 + qt.data.numel()].view(qt.data.shape))
    with pytest.raises(ValueError, match="mmvq_kernel"):  # the vector kernel needs 16-byte alignment
        G.matmul(x, odd, path="mmvq", mmvq_kernel="vec")
    with pytest.raises(ValueError, match="x"):
        G.quantize_q8_1_split(torch.zeros((2, 48), dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError, match="path"):  # the mma path needs the same alignment
        G.matmul(x, odd, path="mma")
    with pytest.raises(ValueError, match="mma_split"):
        G.matmul(x, qt, path="mma", mma_split=0)
    assert G.choose_path(40, odd) != "mma"
    torch.cuda.synchronize()


def test_x_off_16_bytes_and_out_aliasing_x():
    """x contiguous fp16 at a 2-byte offset (a legal input: mmvq, mma and dequant read it): the
    dispatch took the wgmma path for it, whose TMA descriptor needs a 16-byte aligned x, and the
    call died in cuTensorMapEncodeTiled (RuntimeError, CUDA_ERROR_INVALID_VALUE). Now the dispatch
    passes over wgmma for such an x, and forcing wgmma names x. An out that aliases x (or
    quantize_q8_1's out overlapping its x) is refused on every path, not only on a planned call
    (a forced path wrote garbage: max |error| 7.6 at M = 2048 on wgmma, 9.2 at M = 4096 on dequant)."""
    rng = np.random.default_rng(RNG.integers(1 << 32))
    n = k = 4096
    _, qt_cpu = _weight("q4_0", n, k, rng)
    qt = qt_cpu.to(DEV)
    m = 16
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float16)).to(DEV)
    xo = torch.empty(m * k + 1, dtype=torch.float16, device=DEV)[1:].view(m, k)
    xo.copy_(x)
    assert xo.is_contiguous() and xo.data_ptr() % 16 == 2
    path = G.choose_path(m, qt, xo)
    assert path != "wgmma"
    if G.wgmma_ok(qt):
        assert G.choose_path(m, qt) == "wgmma"
        with pytest.raises(ValueError, match="x: the 'wgmma' path"):
            G.matmul(xo, qt, path="wgmma")
    want = G.matmul(x, qt, path=path)
    assert torch.equal(G.matmul(xo, qt), want)
    assert torch.equal(qz.ops.matmul(xo, qt), want)
    paths = [p for p in G.PATHS if p != "wgmma" or G.wgmma_ok(qt)]
    for p in paths:
        xc = x.clone()
        with pytest.raises(ValueError, match="out: overlaps x"):
            G.matmul(xc, qt, out=xc, path=p)
    raw = torch.empty(m * k * 2, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="out: overlaps x"):
        G.quantize_q8_1(raw.view(torch.float16).view(m, k), out=raw[: m * k // 32 * 36].view(m, -1))
    torch.cuda.synchronize()


# ---- mmvq: long K, unaligned weight addresses ------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_mmvq_long_k_and_unaligned_weight(fmt):
    """mmvq, every rows-per-CTA instance: K with fewer blocks than threads (nb < 128), several
    passes with a tail (nb = 300, 130; at M = 1 the vector kernel's pipeline depth U = 2 where
    MMVQ1_LONG applies), and the weight bytes placed at a 0/4/8/12/16/32-byte offset
    inside a larger buffer (a view, as a weight sliced out of a file buffer can be): the scalar-load
    kernel always, the vector-load one too where the view is 16-byte aligned (mmvq16_ok)."""
    rng = np.random.default_rng(RNG.integers(1 << 32))
    for n, k, pad in [(5, 96, 4), (37, 9600, 8), (130, 4160, 12), (3, 4096 + 32, 0), (40, 4160, 16), (8, 9600, 32)]:
        _, qt_cpu = _weight(fmt, n, k, rng)
        qt0 = qt_cpu.to(DEV)
        nbytes = qt0.data.numel()
        big = torch.zeros(nbytes + 32, dtype=torch.uint8, device=DEV)
        big[pad:pad + nbytes].copy_(qt0.data.reshape(-1))
        qt = type(qt0)(qt0.format, qt0.shape, big[pad:pad + nbytes].view(qt0.data.shape))
        assert qt.data.data_ptr() % 16 == pad % 16
        for m in (1, 2, 5, 8, 13):
            x16 = rng.standard_normal((m, k)).astype(np.float16)
            x_t = torch.from_numpy(x16).to(DEV)
            kernels = ("scalar", "vec") if G.mmvq16_ok(qt) else ("scalar",)
            for rows in G.MMVQ_ROW_CHOICES + (None,):   # None: the dispatch's rows (and depth U)
                for kern in kernels:
                    out = _poisoned((m, n))
                    G.matmul(x_t, qt, out=out, path="mmvq", mmvq_rows=rows, mmvq_kernel=kern)
                    _check_emulated(out.float().cpu().numpy(), x16, qt_cpu,
                                    f"{fmt} mmvq {kern} R={rows} M={m} N={n} K={k} offset {pad}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_mmvq16_long_k_pipeline_n_tails(fmt, monkeypatch):
    """The vector-load mmvq at M = 1 on long rows (nb >= MMVQ1_LONG_NB = 256) with N tails: there
    Q4_0 (R = 1) and Q8_0 (R = 2) take the pipeline depth U = 2 (MMVQ1_LONG; the only U = 2
    instances compiled -- the other formats' vector kernel runs U = 1 there, tested the same way).
    N = 38, K = 9600 (nb = 300 = 4 x 64 + 44: the ring's second slot live for 12 lanes in the last
    pass): 38 rows in CTAs of 4 (R = 1) or 8 (R = 2) leave whole warps past N (they return);
    N = 37, K = 9472 (nb = 296): at R = 2 the last live warp's second row is past N (computed on
    row N - 1, not stored). Both weights' sizes are multiples of 16 bytes (mmvq16_ok) in every
    format. M = 1 forced and by the default dispatch (the planned launch; Q4_0 / Q8_0 pick vec
    there), and M = 9 forced to vec: a chunk of 8 then a 1-row chunk at U = 2, its Q8_1 and y
    offsets past the first chunk's. The U of each launch is read from the launch itself."""
    launched = []   # (m, R, U) of each vector-load launch
    real = G.launch_mmvq16

    def spy(*args, **kwargs):
        launched.append((args[7], args[8], kwargs.get("u")))
        return real(*args, **kwargs)

    monkeypatch.setattr(G, "launch_mmvq16", spy)
    rng = np.random.default_rng(RNG.integers(1 << 32))
    r1, u1 = G.mmvq_plan(fmt, "vec", 1, G.MMVQ1_LONG_NB)
    assert u1 == (2 if fmt in G.MMVQ1_LONG else 1)
    for n, k in ((38, 9600), (37, 9472)):
        nb = k // 32
        assert nb >= G.MMVQ1_LONG_NB and G.mmvq_plan(fmt, "vec", 1, nb) == (r1, u1)
        assert n % (G.MMVQ16_WARPS * r1), "the last CTA has warps past N"
        _, qt_cpu = _weight(fmt, n, k, rng)
        qt = qt_cpu.to(DEV)
        assert G.mmvq16_ok(qt)
        for m in (1, 9):
            x16 = rng.standard_normal((m, k)).astype(np.float16)
            x_t = torch.from_numpy(x16).to(DEV)
            what = f"{fmt} mmvq vec M={m} N={n} K={k} (R, U) = {(r1, u1)} at the 1-row launch"
            launched.clear()
            out = _poisoned((m, n))
            G.matmul(x_t, qt, out=out, path="mmvq", mmvq_kernel="vec")
            assert launched[-1] == (1, r1, u1) and len(launched) == -(-m // G.MMVQ_COLS), f"{what}: {launched}"
            y = out.float().cpu().numpy()
            _check_emulated(y, x16, qt_cpu, what)
            if m == 1:   # the default dispatch (a planned launch), the same kernel where it picks vec
                yd = G.matmul(x_t, qt)
                torch.cuda.synchronize()
                if G.mmvq_choice(fmt, 1)[0] == "vec":
                    assert np.array_equal(yd.float().cpu().numpy(), y), f"{what}: default dispatch differs"
                else:
                    _check_emulated(yd.float().cpu().numpy(), x16, qt_cpu, f"{what}, default (scalar)")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_matmul_q8_1_equals_matmul(fmt, m):
    """matmul_q8_1 on x's Q8_1 blocks (in the layout q8_1_layout names) is matmul(x) bit for bit:
    the same mmvq launches without the quantize launch. Bad layouts, M and buffers are refused."""
    n, k = 1000, 2048
    _, qt = _weight(fmt, n, k, RNG)
    qt = qt.to(DEV)
    x = torch.from_numpy((RNG.standard_normal((m, k)) * 2).astype(np.float16)).to(DEV)
    layout = G.q8_1_layout(qt, m)
    assert layout == ("split" if G.mmvq_choice(fmt, m)[0] == "vec" and G.mmvq16_ok(qt) else "interleaved")
    xq = G.quantize_q8_1_split(x) if layout == "split" else G.quantize_q8_1(x).view(-1)
    y = G.matmul_q8_1(xq, qt, m, layout)
    assert torch.equal(y, G.matmul(x, qt))
    assert torch.equal(G.matmul_q8_1(xq, qt, m, layout), y)          # the planned replay
    other = "interleaved" if layout == "split" else "split"
    with pytest.raises(ValueError, match="layout"):
        G.matmul_q8_1(xq, qt, m, other)
    with pytest.raises(ValueError, match="xq: shape"):
        G.matmul_q8_1(xq[:-36], qt, m, layout)
    with pytest.raises(ValueError, match="m: 9"):
        G.matmul_q8_1(xq, qt, 9, layout)
    assert G.q8_1_layout(qt, 9) is None and G.q8_1_layout(qt.to("cpu"), 1) is None


@pytest.mark.parametrize("fmt", FORMATS)
def test_wgmma_below_mmvq_max_m(fmt):
    """A weight of 4096 x 12288 elements (K >= WGMMA_SMALL_LONG_K), M = 1..8, plain and glu: dispatch
    takes mmvq, or (on Hopper) wgmma from the M session 54 measured (WGMMA_SMALL_M: Q8_0 plain
    from 7, GLU from 5). matmul's default launch is the chosen path's bit for bit; where that is
    wgmma, q8_1_layout is None (the runner hands the linear fp16) and matmul_q8_1 refuses the M;
    the plain result is x16 @ half(W) to fp16's rounding, and mmvq's on the same x (Q8_1-rounded
    activations) is near it."""
    rng = np.random.default_rng(RNG.integers(1 << 32))
    n, k = 4096, 12288
    _, q = _weight(fmt, 256, k, rng)   # 256 random rows, repeated: the dispatch sees N x K
    qt = qz.formats.QuantizedTensor(fmt, (n, k), np.tile(q.data, (n // 256, 1))).to(DEV)
    w16 = q.dequantize().astype(np.float16).astype(np.float64)
    small = G.WGMMA_SMALL_M.get(fmt, (9, 9, 9)) if G.wgmma_ok(qt) else (9, 9, 9)
    for glu in (False, True):
        paths = []
        for m in range(1, 9):
            x16 = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-8, 8, (m, 1)))).astype(np.float16)
            x = torch.from_numpy(x16).to(DEV)
            path = G.choose_path(m, qt, x, glu)
            paths.append(path)
            y = G.matmul(x, qt, glu=glu)
            assert torch.equal(y, G.matmul(x, qt, path=path, glu=glu)), f"{fmt} M={m} glu={glu} ({path})"
            assert (G.q8_1_layout(qt, m, glu) is None) == (path != "mmvq"), (fmt, m, glu, path)
            if path != "wgmma" or glu:
                continue
            with pytest.raises(ValueError, match=f"m: {m}; matmul_q8_1 takes"):
                G.matmul_q8_1(torch.zeros(m * k // 32 * 36, dtype=torch.uint8, device=DEV), qt, m, "split")
            ref = np.tile(x16.astype(np.float64) @ w16.T, (1, n // 256))
            yw = y.float().cpu().numpy()
            assert _nmse(yw, ref) < 1e-6, f"{fmt} M={m}: wgmma nmse {_nmse(yw, ref):.2e}"
            ym = G.matmul(x, qt, path="mmvq").float().cpu().numpy()
            assert _nmse(ym, ref) < 1e-3, f"{fmt} M={m}: mmvq nmse {_nmse(ym, ref):.2e}"
        first = small[0 if glu else 1]
        assert paths == ["mmvq"] * (first - 1) + ["wgmma"] * (9 - first), (glu, paths)
    torch.cuda.synchronize()


def test_quant_linear_state_dict_on_cuda(tmp_path):
    """A CUDA QuantLinear's state_dict saved and loaded with map_location='cuda' (its arrays then
    arrive as CUDA tensors) into another CUDA module: the same outputs."""
    w = (RNG.standard_normal((96, 256)) * 0.02).astype(np.float32)
    a = qz.QuantLinear(qz.formats.get("q4_1").quantize(w)).to(DEV)
    torch.save(a.state_dict(), tmp_path / "ql.pt")
    b = qz.QuantLinear(qz.formats.get("q4_1").quantize(np.zeros_like(w))).to(DEV)
    b.load_state_dict(torch.load(tmp_path / "ql.pt", map_location=DEV))
    x = torch.randn(5, 256, device=DEV, dtype=torch.float16)
    assert b.qt.device.startswith("cuda") and torch.equal(a(x), b(x))


def test_quant_linear_half_keeps_its_cuda_weight():
    """A CUDA QuantLinear (with a float32 bias) made fp16 by .half(): its weight stays on the GPU
    (it went back to the CPU, and the forward then refused the module's own CUDA input)."""
    w = (RNG.standard_normal((96, 256)) * 0.02).astype(np.float32)
    ql = qz.QuantLinear(qz.formats.get("q4_0").quantize(w), torch.zeros(96)).to(DEV).half()
    x = torch.randn(5, 256, device=DEV, dtype=torch.float16)
    assert ql.qt.device.startswith("cuda") and ql.bias.dtype == torch.float16
    assert torch.equal(ql(x), G.matmul(x, ql.qt))
