"""The registry: names, lookup errors, kinds, sizes — checked against the stored bytes."""
import re

import numpy as np
import pytest

import quantzoo as qz
from quantzoo.formats import get, names

STORED = [n for n in names() if get(n).kind != "activation"]


def test_names_and_kinds():
    assert {"awq", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q8_1", "fp16"} <= set(names())
    assert get("q8_1").kind == "activation"
    assert get("fp16").kind == "baseline"
    assert {f.name for f in qz.formats.weight_formats()} == {
        n for n in names() if get(n).kind == "weight"}


def test_unknown_name_lists_the_known():
    with pytest.raises(KeyError) as e:
        get("q3_k")
    msg = str(e.value)
    assert "q3_k" in msg and all(n in msg for n in names())


@pytest.mark.parametrize("name", STORED)
def test_bits_per_weight_is_what_storage_takes(name, rng):
    """bits_per_weight (metadata counted) equals 8 * stored bytes / elements at default options."""
    fmt = get(name)
    n, k = 64, 512
    qt = fmt.quantize(rng.standard_normal((n, k)).astype(np.float32))
    assert qt.shape == (n, k) and qt.format == name
    assert qt.nbytes == fmt.nbytes((n, k))
    assert fmt.bits_per_weight == pytest.approx(8 * qt.nbytes / (n * k))
    w = fmt.dequantize(qt)
    assert w.dtype == np.float32 and w.shape == (n, k)


def test_known_bit_widths():
    """Independent figures: llama.cpp's block sizes and AWQ g128 with fp16 scales + 4-bit zeros."""
    expect = {"q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0, "q8_0": 8.5, "q8_1": 9.0,
              "awq": 4 + 20 / 128, "fp16": 16.0}
    for name, bits in expect.items():
        assert get(name).bits_per_weight == pytest.approx(bits), name


@pytest.mark.parametrize("name", STORED)
def test_quantize_rejects_non_finite(name):
    w = np.zeros((8, 128), np.float32)
    for bad in (np.nan, np.inf, -np.inf):
        w[3, 70] = bad
        with pytest.raises(ValueError, match="non-finite"):
            get(name).quantize(w)


@pytest.mark.parametrize("name", STORED)
def test_quantize_rejects_bad_rank(name):
    with pytest.raises(ValueError, match="2-D"):
        get(name).quantize(np.zeros(128, np.float32))


@pytest.mark.parametrize("name", STORED)
def test_quantize_rejects_empty_and_non_real(name):
    for w, needle in ((np.zeros((0, 128), np.float32), r"empty shape \(0, 128\)"),
                      (np.zeros((8, 0), np.float32), r"empty shape \(8, 0\)"),
                      (np.zeros((8, 128), np.complex64), "complex64 is not a real number type"),
                      (np.full((8, 128), 1e300), "beyond the float32 range")):
        with pytest.raises(ValueError, match=needle):
            get(name).quantize(w)


@pytest.mark.parametrize("name", STORED)
def test_storage_that_disagrees_with_the_shape_is_refused(name, rng):
    """A hand-built QuantizedTensor whose arrays do not match its shape: one clear error from
    matmul and dequantize (before, a GGUF weight silently used its first rows)."""
    from quantzoo.formats import QuantizedTensor

    qt = get(name).quantize((rng.standard_normal((16, 256)) * 0.02).astype(np.float32))
    for shape in ((8, 256), (16, 512)):
        bad = QuantizedTensor(qt.format, shape, qt.data, qt.params)
        needle = re.escape(f"{name} weight {shape}: ") + ".* expected"
        with pytest.raises(ValueError, match=needle):
            qz.ops.matmul(np.ones((1, shape[1]), np.float32), bad)
        with pytest.raises(ValueError, match=needle):
            bad.dequantize()
    arrays = qt.arrays()
    key = next(iter(arrays))
    wrong = {**arrays, key: arrays[key].astype(np.float64)}
    bad = QuantizedTensor(qt.format, qt.shape, wrong if isinstance(qt.data, dict) else wrong[key], qt.params)
    with pytest.raises(ValueError, match=f"{key} is float64"):
        bad.dequantize()


def test_awq_rejects_what_fp16_cannot_hold():
    """A dequantized AWQ weight past fp16's range would be inf in the kernels' fp16 arithmetic;
    and a group size must be one of the integers the kernels take."""
    w = np.zeros((8, 128), np.float32)
    w[:, 0], w[:, 1] = 1e5, -1.0
    with pytest.raises(ValueError, match="beyond fp16's"):
        get("awq").quantize(w)
    with pytest.raises(ValueError, match="group_size=128.0 is not supported"):
        get("awq").quantize(np.zeros((8, 128), np.float32), group_size=128.0)
    assert get("awq").quantize(np.zeros((8, 128), np.float32), group_size=np.int64(64)).params == {"group_size": 64}


@pytest.mark.parametrize("name", STORED)
def test_dequantize_refuses_another_formats_weight(name, rng):
    """fmt.dequantize(qt) of another format's weight: one clear error, not garbage (fp16 read a
    q8_0 weight's 272 bytes a row as 136 halves) or a reshape error."""
    w = rng.standard_normal((64, 256)).astype(np.float32)
    for other in STORED:
        if other != name:
            qt = get(other).quantize(w)
            with pytest.raises(ValueError, match=rf"^{name} weight: got a '{other}' weight$"):
                get(name).dequantize(qt)


@pytest.mark.parametrize("name", STORED)
def test_to_cpu_round_trip_keeps_storage(name, rng):
    fmt = get(name)
    qt = fmt.quantize(rng.standard_normal((16, 256)).astype(np.float32))
    back = qt.to("cpu")
    assert back.device == "cpu"
    for key, arr in qt.arrays().items():
        assert np.array_equal(arr, back.arrays()[key])


@pytest.mark.parametrize("name", STORED)
def test_storage_entry_that_is_not_an_array_is_refused(name, rng):
    """A storage entry replaced by None or a list: one clear ValueError naming the entry and what
    it should be, from dequantize, matmul, QuantLinear and .to() (an AttributeError from the
    shape check before); repr never raises."""
    from dataclasses import replace

    qt = get(name).quantize((rng.standard_normal((16, 128)) * 0.02).astype(np.float32))
    x = np.ones((1, 128), np.float32)
    for key, arr in qt.arrays().items():
        expect = f"{arr.dtype.name}{list(arr.shape)}"
        for junk in (None, arr.tolist(), "bytes"):
            data = {**qt.data, key: junk} if isinstance(qt.data, dict) else junk
            bad = replace(qt, data=data)
            needle = re.escape(f"{name} weight (16, 128): {key} is {type(junk).__name__}, expected {expect}")
            for call in (bad.dequantize, lambda: qz.ops.matmul(x, bad), lambda: qz.QuantLinear(bad),
                         lambda: qz.reference.emulate(x, bad)):
                with pytest.raises(ValueError, match=f"^{needle}$"):
                    call()
            with pytest.raises(ValueError, match=re.escape(f"storage entry {key} is {type(junk).__name__}, not an array")):
                bad.to("cpu")
            assert repr(bad).startswith(f"QuantizedTensor(format='{name}', shape=(16, 128)") and "nbytes=?" in repr(bad)
    assert "nbytes=?" not in repr(qt)
    assert repr(replace(qt, data={}))   # no arrays at all: still a repr


@pytest.mark.parametrize("name", STORED)
def test_params_the_format_does_not_take_are_refused(name, rng):
    """params are checked as the storage is: a GGUF or fp16 weight takes none (a {"group_size": 7}
    was accepted and ignored), AWQ only group_size; and params must be a dict."""
    from dataclasses import replace

    qt = get(name).quantize((rng.standard_normal((16, 128)) * 0.02).astype(np.float32))
    takes = "takes only ['group_size']" if name == "awq" else "takes none"
    for junk in ({"group_sizes": 128}, {"bits": 4}) + (() if name == "awq" else ({"group_size": 7},)):
        bad = replace(qt, params={**qt.params, **junk})
        needle = re.escape(f"{name} weight (16, 128): unknown params {next(iter(junk))!r} ({name} {takes})")
        with pytest.raises(ValueError, match=needle):
            bad.dequantize()
        with pytest.raises(ValueError, match=needle):
            qz.ops.matmul(np.ones((1, 128), np.float32), bad)
    with pytest.raises(ValueError, match=re.escape(f"{name} weight (16, 128): params is a NoneType, expected a dict")):
        replace(qt, params=None).dequantize()


def test_awq_nbytes_checks_its_group_size():
    assert get("awq").nbytes((16, 128), group_size=64) == get("awq").quantize(
        np.zeros((16, 128), np.float32), group_size=64).nbytes
    for g in (0, 7, 128.0):
        with pytest.raises(ValueError, match=rf"awq\.nbytes: group_size={g!r} is not supported"):
            get("awq").nbytes((16, 128), group_size=g)
