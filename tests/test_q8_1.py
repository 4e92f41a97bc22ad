"""Q8_1 activation blocks (CUDA convention) against a straightforward per-element computation."""
import math
import warnings

import numpy as np
import pytest

from quantzoo.formats import get
from quantzoo.formats.gguf_blocks import butterfly_sum

Q81 = get("q8_1")


def c_roundf(v: float) -> int:
    """C roundf, written out: halves away from zero."""
    return int(math.copysign(math.floor(abs(v) + 0.5), v))


def straightforward(block: np.ndarray):
    """One 32-block the obvious way: fp32 amax/127, fp32 x/d, roundf, exact sum of the floats."""
    amax = max(abs(float(v)) for v in block)
    d = np.float32(amax) / np.float32(127)
    q = [0 if amax == 0 else c_roundf(float(np.float32(v) / d)) for v in block]
    return d, q, math.fsum(float(v) for v in block)


def half_ulp(v: float) -> float:
    return float(np.spacing(np.float16(abs(v)))) / 2 if v else float(np.spacing(np.float16(0)))


def near_tie_blocks(rng, n_blocks=64):
    """fp16 Q8_1 blocks whose values x have fl(x / d) at or within 3.1e-5 of a half-integer --
    where q8_1.cuh's q8_1_round falls back from x * (1 / d) to the division, and where a codec
    rounding x * (1 / d) would differ: exact ties (d a power of two) and near ones found by
    search over all fp16 values under a random amax. (test_gguf_gpu.py runs them on the GPU.)"""
    pos = np.arange(1, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)
    out = []
    while len(out) < n_blocks:
        amax = np.float32(127 * 2.0 ** rng.integers(-8, 4)) if len(out) % 4 == 0 else \
            np.float32(rng.choice(pos[(pos > 1e-3) & (pos < 1000)]))   # s = sum x stays in fp16
        d = amax / np.float32(127)
        cand = pos[pos <= amax]
        r = cand / d
        near = cand[np.abs(r - np.floor(r) - np.float32(0.5)) <= 3.1e-5]
        if near.size == 0:
            continue
        blk = rng.choice(near, 32) * rng.choice(np.float32([-1, 1]), 32)
        blk[rng.integers(32)] = amax * rng.choice([-1, 1])
        out.append(blk)
    return np.stack(out).astype(np.float16)


def test_near_ties_against_straightforward(rng):
    """x / d at and next to roundf's half-integer boundaries: the codec divides, as the
    straightforward computation does (x * (1 / d) rounds some of these to the other integer)."""
    x = near_tie_blocks(rng).astype(np.float32)
    f = Q81.unpack(Q81.quantize(x.reshape(1, -1)).data)
    for b, block in enumerate(x):
        d, q, _ = straightforward(block)
        assert f["d"][0, b] == np.float16(d)
        assert f["q"][0, b].tolist() == q, b


@pytest.mark.parametrize("scale", [1.0, 1e-3, 40.0])
def test_against_straightforward(scale, rng):
    x = (rng.standard_normal((6, 256)) * scale).astype(np.float32)
    x[2, 32:64] = 0                                            # an all-zero block
    qt = Q81.quantize(x)
    assert qt.data.shape == (6, 8 * 36)
    f = Q81.unpack(qt.data)
    for r in range(6):
        for b in range(8):
            d, q, s = straightforward(x[r, 32 * b: 32 * b + 32])
            assert f["d"][r, b] == np.float16(d)
            assert f["q"][r, b].tolist() == q
            # s is a float sum: ours is summed in fp32 in warp-butterfly order (5 levels, so
            # within 5 * 2^-24 * sum|x| of the exact sum, which matters under cancellation),
            # then rounded to half (half an ulp of the fp32 sum).
            delta = 5 * 2.0 ** -24 * float(np.abs(x[r, 32 * b: 32 * b + 32]).astype(np.float64).sum())
            assert abs(float(f["m"][r, b]) - s) <= half_ulp(abs(s) + delta) + delta, (r, b)
    # Dequantized values: q * d_half - x = q (d_half - d) + (q d - x), so within half an fp32
    # step plus 127 times the half rounding of d (large when d is subnormal in fp16).
    xq = Q81.dequantize(qt).astype(np.float64)
    d32 = (np.abs(x).reshape(6, 8, 32).max(-1) / np.float32(127)).astype(np.float64)
    dh = f["d"].astype(np.float64)
    bound = 0.5 * d32 * (1 + 2 ** -20) + 127 * np.abs(dh - d32)
    assert np.all(np.abs(xq - x).reshape(6, 8, 32) <= bound[..., None])


def test_halves_round_away_from_zero():
    block = np.zeros(32, np.float32)
    block[0] = 127.0                          # amax 127 -> d = 1 exactly
    block[1:5] = [2.5, -2.5, 0.5, -0.5]       # numpy's round-half-even would give 2, -2, 0, -0
    f = Q81.unpack(Q81.quantize(block[None]).data)
    assert f["q"][0, 0, :5].tolist() == [127, 3, -3, 1, -1]
    assert float(f["d"][0, 0]) == 1.0


def test_butterfly_order_is_the_xor_tree():
    """The emulated order is lane i + lane i^16, then ^8, ^4, ^2, ^1 — spelled out by hand here."""
    rng = np.random.default_rng(7)
    v = (rng.standard_normal(32) * 1e4).astype(np.float32)
    cur = list(v)
    for off in (16, 8, 4, 2, 1):
        cur = [np.float32(cur[i] + cur[i ^ off]) for i in range(32)]
    assert butterfly_sum(v[None])[0] == cur[0]


def test_activation_format_is_not_a_weight():
    with pytest.raises(TypeError, match="activation"):
        Q81.emulate(np.zeros((1, 32), np.float32), Q81.quantize(np.zeros((1, 32), np.float32)))


def test_non_finite_and_underflowing_blocks():
    """The emulation's Q8_1 of x it is handed as is (NaN/inf are not refused there): a NaN block
    has d = s = NaN and q = 0, an inf block d = inf and q = 0 (as cuda/q8_1.cuh), a block of
    subnormal x, or whose amax / 127 is subnormal, d = 0 and q = 0 (the kernel's -ftz=true:
    flush_subnormals), stated outright rather than left to numpy's float-to-int cast of NaN/inf
    (undefined, and a RuntimeWarning); the smallest amax whose d is normal keeps its q."""
    x = np.linspace(-1, 1, 32 * 5, dtype=np.float32).reshape(1, 5, 32)
    x[0, 0, 3] = np.nan
    x[0, 1, 7] = np.inf
    x[0, 2] *= np.float32(2e-45)                       # subnormal x: flushed, s = 0 too
    x[0, 3] *= np.float32(1e-36)                       # normal x, d = amax / 127 subnormal: flushed
    x[0, 4] *= np.float32(127 * 2.0 ** -126)           # d = 2^-126 exactly, the smallest normal
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f = Q81.quantize_fields(x)
    assert np.isnan(f["d"][0, 0]) and np.isnan(f["m"][0, 0]) and not f["q"][0, 0].any()
    assert f["d"][0, 1] == np.inf and not f["q"][0, 1].any()
    for b in (2, 3):
        assert f["d"][0, b] == 0 and not f["q"][0, b].any()
    assert f["m"][0, 2] == 0 and f["m"][0, 3] != 0
    assert f["d"][0, 4] == np.float32(2.0 ** -126)
    assert f["q"][0, 4].tolist() == [c_roundf(float(v / f["d"][0, 4])) for v in x[0, 4]]
    assert np.abs(f["q"][0, 4]).max() == 127


TINY = np.finfo(np.float32).smallest_normal          # 2^-126: numpy's own float32 limit


def ftz(v) -> np.float32:
    """One fp32 value as an -ftz=true instruction leaves it: |v| < 2^-126 -> a zero of v's sign."""
    v = np.float32(v)
    return np.float32(math.copysign(0.0, float(v))) if abs(v) < TINY else v


def ftz_tree(block) -> np.float32:
    """The xor-shuffle warp sum written out, every input and every partial sum flushed."""
    cur = [ftz(v) for v in block]
    for off in (16, 8, 4, 2, 1):
        cur = [ftz(np.float32(cur[i] + cur[i ^ off])) for i in range(32)]
    return cur[0]


def test_flush_subnormals_is_float32s_normal_limit_and_keeps_the_sign():
    """The largest subnormal (np.nextafter below numpy's smallest_normal) and 0.75 * 2^-126 are
    flushed, the smallest normal is not; a flushed negative is -0 (CUDA's FTZ keeps the sign, and
    a block of negative subnormals then stores s = -0: fp16 bits 0x8000)."""
    from quantzoo.formats.gguf_blocks import flush_subnormals

    sub = np.nextafter(TINY, np.float32(0))
    v = np.array([TINY, -TINY, sub, -sub, 0.75 * TINY, -0.75 * TINY, 2e-45, -2e-45, 1.0, -0.0, np.inf], np.float32)
    got = flush_subnormals(v)
    assert got.dtype == np.float32
    assert np.array_equal(got, [TINY, -TINY, 0, 0, 0, 0, 0, 0, 1.0, 0, np.inf])
    assert np.array_equal(np.signbit(got), np.signbit(v))
    assert np.isnan(flush_subnormals(np.float32(np.nan)))
    f = Q81.quantize_fields(np.full((1, 1, 32), -0.5 * TINY, np.float32))
    assert f["m"][0, 0] == 0 and np.signbit(f["m"][0, 0])
    assert np.signbit(Q81.unpack(Q81.quantize(np.full((1, 32), -0.5 * TINY, np.float32)).data)["m"][0, 0])


def test_butterfly_sum_flushes_inputs_and_partial_sums():
    """Two subnormal inputs whose sum would be normal give 0 (the inputs are flushed first); a
    partial sum that cancels into the subnormal range is flushed before the next level."""
    a = np.zeros((3, 32), np.float32)
    a[0, 0] = a[0, 16] = 0.75 * TINY                 # unflushed: 1.5 * 2^-126, a normal sum
    a[1, 0], a[1, 16] = 1.5 * TINY, -1.25 * TINY      # lane 0 + lane 16 = 0.25 * 2^-126
    a[2] = -0.5 * TINY                                # all negative subnormals: -0
    got = butterfly_sum(a)
    for r in range(3):
        assert got[r] == ftz_tree(a[r]) == 0 and np.signbit(got[r]) == np.signbit(ftz_tree(a[r])), r
    assert np.float32(a[0, 0] + a[0, 16]) >= TINY     # the sums flushing avoids
    assert np.signbit(got[2])


def test_q8_1_sum_is_the_butterfly_and_inputs_are_flushed(rng):
    """s is the warp-order fp32 sum, not numpy's (pairwise) one: bit for bit with the written-out
    tree, which differs from np.sum under cancellation; and a subnormal x in a block with a
    normal d is flushed before x / d (its q is 0, not roundf(0.75) = 1)."""
    x = (rng.standard_normal((64, 32)) * 1e4).astype(np.float32)
    x -= x.mean(axis=1, keepdims=True)                # cancellation: the order shows
    f = Q81.quantize_fields(x[None])
    tree = np.array([ftz_tree(b) for b in x], np.float32)
    assert np.array_equal(f["m"][0], tree)
    assert (x.sum(axis=1, dtype=np.float32) != tree).any()      # the check is not vacuous
    assert np.array_equal(Q81.unpack(Q81.quantize(x.reshape(2, 1024)).data)["m"].reshape(-1),
                          tree.astype(np.float16))
    b = np.zeros((1, 1, 32), np.float32)
    b[0, 0, 0] = 127 * TINY                           # d = 2^-126, normal
    b[0, 0, 1] = 0.75 * TINY                          # subnormal: flushed -> q = 0
    b[0, 0, 2] = TINY                                 # normal: q = 1
    f = Q81.quantize_fields(b)
    assert f["d"][0, 0] == TINY
    assert f["q"][0, 0, :3].tolist() == [127, 0, 1]
