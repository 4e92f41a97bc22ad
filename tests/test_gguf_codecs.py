"""GGUF block codecs against the outside oracle gguf-py: identical bytes, identical floats."""
import re
import warnings

import gguf
import numpy as np
import pytest

from quantzoo.formats import get, names

GGUF = [n for n in names() if get(n).gguf_type and get(n).kind == "weight"]


def _exact_halves(n, k):
    """Blocks whose scaled values x / d land exactly on k + 0.5 (the scale d a power of two):
    llama.cpp rounds those away from zero (Q8_0's roundf) or up (Q4_1/Q5_1's (int)(v + 0.5)),
    where numpy's np.round would go to the even neighbour. One block kind per format family."""
    h = np.arange(32, dtype=np.float32) + np.float32(0.5)
    kinds = [
        np.concatenate([[127.0], h[:31] - 15.0]),          # Q8_0: amax 127 -> d = 1; -14.5..15.5
        np.concatenate([[0.0, 15.0], h[:15], h[:15]]),     # Q4_1: min 0, max 15 -> d = 1
        np.concatenate([[0.0, 31.0], h[:30]]),             # Q5_1: min 0, max 31 -> d = 1
        np.concatenate([[-8.0], h[:16] - 8.0, h[:15] - 8.0]),   # Q4_0: vmax -8 -> d = 1
        np.concatenate([[-16.0], h[:31] - 16.0]),          # Q5_0: vmax -16 -> d = 1
    ]
    nb = k // 32
    w = np.stack([np.concatenate([kinds[(r + b) % len(kinds)] for b in range(nb)]) for r in range(n)])
    return (w * np.float32(2.0) ** (np.arange(n) - n // 2)[:, None]).astype(np.float32)   # exact scaling


def _cases(rng):
    n, k = 12, 256
    t = rng.standard_t(3, (n, k)).astype(np.float32)
    huge = rng.uniform(-1, 1, (n, k)).astype(np.float32)
    huge *= np.float32(6e4) / np.abs(huge).max()             # largest magnitude exactly 6e4
    mixed = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    mixed[:, :32] = 0                                        # an all-zero block per row
    mixed[:, 32:64] = 1.5                                    # a constant block per row
    mixed[:, 64:96] = -0.25
    return {
        "exact_halves": _exact_halves(n, k),
        "gaussian": (rng.standard_normal((n, k)) * 0.02).astype(np.float32),
        "student_t3": t,
        "zeros": np.zeros((n, k), np.float32),
        "mixed_zero_constant": mixed,
        "tiny_1e-8": (rng.standard_normal((n, k)) * 1e-8).astype(np.float32),
        # a subnormal fp32 scale: 1/d is inf, and gguf-py (llama.cpp's float-to-int casts) stores
        # q = 0 where a clip had stored the top level
        "subnormal_scale_1e-40": (rng.standard_normal((n, k)) * 1e-40).astype(np.float32),
        "huge_6e4": huge,
    }


@pytest.mark.parametrize("name", GGUF)
def test_bytes_and_floats_equal_gguf_py(name, rng):
    fmt = get(name)
    qtype = gguf.GGMLQuantizationType[fmt.gguf_type]
    for case, w in _cases(rng).items():
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            ours = fmt.quantize(w)
        said = [str(m.message) for m in said]
        if case in ("tiny_1e-8", "subnormal_scale_1e-40"):   # d underflows fp16: said, same bytes
            assert len(said) == 1 and "underflows fp16" in said[0], (case, said)
        else:
            assert not said, (case, said)
        theirs = gguf.quants.quantize(w, qtype)
        assert ours.data.dtype == np.uint8 and ours.data.shape == theirs.shape, case
        assert np.array_equal(ours.data, theirs), f"{name}/{case}: bytes differ from gguf-py"
        a = fmt.dequantize(ours)
        b = gguf.quants.dequantize(theirs, qtype)
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{name}/{case}: floats differ"


@pytest.mark.parametrize("name", GGUF)
def test_dequantize_arbitrary_file_bytes(name, rng):
    """Decode random (finite-scale) block bytes as a .gguf file might hold them, vs gguf-py."""
    fmt = get(name)
    qtype = gguf.GGMLQuantizationType[fmt.gguf_type]
    nb = 8
    raw = rng.integers(0, 256, (5, nb * fmt.bytes_per_block), dtype=np.uint8)
    blk = raw.reshape(5, nb, fmt.bytes_per_block)
    halves = 2 if fmt.has_min else 1
    blk[..., : 2 * halves] = rng.standard_normal((5, nb, halves)).astype(np.float16).view(np.uint8)
    qt = fmt.from_bytes(raw, (5, nb * 32))
    a = fmt.dequantize(qt)
    b = gguf.quants.dequantize(raw, qtype)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    f = fmt.unpack(raw)                                # and the field codec is lossless
    assert np.array_equal(fmt.pack(f["d"], f["q"], f["m"]), raw)


@pytest.mark.parametrize("name", GGUF)
def test_field_ranges(name, rng):
    fmt = get(name)
    f = fmt.unpack(fmt.quantize(rng.standard_t(3, (4, 512)).astype(np.float32)).data)
    lo, hi = (-127, 127) if fmt.bits == 8 else (0, (1 << fmt.bits) - 1)
    assert f["q"].min() >= lo and f["q"].max() <= hi
    assert f["q"].shape == (4, 16, 32) and f["d"].shape == (4, 16)


@pytest.mark.parametrize("name", GGUF)
def test_errors_name_the_problem(name):
    fmt = get(name)
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        fmt.quantize(np.zeros((4, 48), np.float32))
    with pytest.raises(ValueError, match="bytes given"):
        fmt.from_bytes(np.zeros(10, np.uint8), (4, 64))
    with pytest.raises(ValueError, match="overflows fp16"):
        w = np.zeros((2, 64), np.float32)
        w[1, 40], w[1, 41] = 3e38, -3e38
        fmt.quantize(w)


@pytest.mark.parametrize("name", GGUF)
def test_scale_underflow_is_said(name, rng):
    """A block whose fp16 d underflows (llama.cpp's bytes, kept) loses its weights: Q8_0 at
    sigma 1e-6 stores d = 0 (all zeros), Q4_1/Q5_1 at 1e-7 err by over 100 %. A warning names
    the first row and block and counts the blocks; it never fires on ordinary weights, a constant
    or all-zero block (d = 0, nothing lost), or a near-constant one (d = 0, its tiny spread lost)."""
    fmt = get(name)
    w = (rng.standard_normal((16, 256)) * 0.02).astype(np.float32)
    w[5] = (rng.standard_normal(256) * 1e-8).astype(np.float32)
    w[9, 64:96] = (rng.standard_normal(32) * 1e-8).astype(np.float32)
    with pytest.warns(RuntimeWarning) as said:
        qt = fmt.quantize(w)
    assert len(said) == 1
    assert re.match(rf"{name}\.quantize: row 5, block 0: field d=\S+ underflows fp16 \(stored as \S+\), so the "
                    r"block's weights \(max \|w\| \S+\) dequantize off by up to \S+; 9 of 128 blocks are off by "
                    r"over half their largest \|w\| \(llama\.cpp writes these same bytes", str(said[0].message))
    assert np.array_equal(qt.data, gguf.quants.quantize(w, gguf.GGMLQuantizationType[fmt.gguf_type]))
    blocks = np.abs(fmt.dequantize(qt) - w).reshape(16, 8, 32).max(axis=-1)
    assert (blocks[5] > np.abs(w[5]).reshape(8, 32).max(axis=-1) / 2).all()   # what was said
    for sigma, lost in ((1e-6, name == "q8_0"), (1e-7, name in ("q4_1", "q5_1"))):   # the audit's cases
        w = (rng.standard_normal((8, 256)) * sigma).astype(np.float32)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            fmt.quantize(w)
        if lost:
            assert any("underflows fp16" in str(m.message) for m in said), (sigma, name)
    ordinary = {"gaussian": rng.standard_normal((16, 256)) * 0.02, "small": rng.standard_normal((16, 256)) * 1e-3,
                "student_t": rng.standard_t(3, (16, 256)), "zeros": np.zeros((16, 256)),
                "constant": np.full((16, 256), 1.5), "near_constant": 1.5 + rng.standard_normal((16, 256)) * 1e-9,
                "linear_init": rng.uniform(-1, 1, (16, 256)) / 16}
    for case, w in ordinary.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fmt.quantize(w.astype(np.float32))


@pytest.mark.parametrize("name", GGUF)
def test_from_bytes_refuses_what_it_would_misread(name):
    """A shape that is not two positive integers (16.7 was truncated to 16) and 2-D bytes whose
    rows are not the tensor's rows (a (16, 72) array read as a (32, 64) tensor) are refused."""
    fmt = get(name)
    n, k = 16, 128
    row = k // 32 * fmt.bytes_per_block
    data = np.zeros((n, row), np.uint8)
    assert fmt.from_bytes(data, (n, k)).shape == (n, k)
    assert fmt.from_bytes(data.reshape(-1), [np.int64(n), k]).data.shape == (n, row)   # flat bytes, any ints
    for shape in ((16.7, 128), (16.0, 128), (True, 128), (16, 128, 1), (16, -128), 16, None):
        with pytest.raises(ValueError, match=r"shape .* is not \(out_features, in_features\), two positive integers"):
            fmt.from_bytes(data, shape)
    with pytest.raises(ValueError, match=re.escape(f"block bytes of shape {(n, row)}; a (32, 64) tensor is "
                                                   f"{(32, 2 * fmt.bytes_per_block)}")):
        fmt.from_bytes(data, (32, 64))
