"""The registry: names, lookup errors, kinds, sizes — checked against the stored bytes."""
import re
import warnings

import numpy as np
import pytest
import torch

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


def test_a_second_entry_of_a_name_or_gguf_type_is_refused():
    """A format registered under a taken name, or with a taken gguf_type (a Q4_0 variant under
    a new name), replaced the first silently: the GGUF loader then read every Q4_0 tensor as the
    variant and the CUDA kernels instantiated the Q4_0 templates twice. Both are refused, and
    the registry is left as it was."""
    from quantzoo.formats.gguf_blocks import GGUFBlockFormat

    before = names()
    with pytest.raises(TypeError, match="format 'q4_0' is registered already"):
        type("Again", (GGUFBlockFormat,), {"bits": 4, "offset": 8, "bytes_per_block": 18}, name="q4_0")
    with pytest.raises(TypeError, match="format 'q4_0_twin': gguf_type Q4_0 is already the type of 'q4_0'"):
        type("Twin", (GGUFBlockFormat,), {"bits": 4, "offset": 8, "bytes_per_block": 18, "gguf_type": "Q4_0"},
             name="q4_0_twin")
    with pytest.raises(TypeError, match=r"format 'w3': kind 'weights' is not one of \('weight', "):
        type("W3", (GGUFBlockFormat,), {"kind": "weights"}, name="w3")
    assert names() == before and type(get("q4_0")).__name__ == "Q4_0"


def test_a_module_defining_its_format_again_replaces_the_entry(monkeypatch):
    """importlib.reload (an autoreload in a notebook) defines a module's format classes again:
    the same module and class name replace their entry (name and GGUF type alike), where
    another class is refused. (A throwaway module's class, so that the real ones stay.)"""
    from quantzoo.formats import base
    from quantzoo.formats.gguf_blocks import GGUFBlockFormat

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    body = {"__module__": "probe_module", "bits": 4, "offset": 8, "bytes_per_block": 18, "gguf_type": "Q4_0_PROBE"}
    first = type("Probe", (GGUFBlockFormat,), dict(body), name="probe")
    again = type("Probe", (GGUFBlockFormat,), dict(body), name="probe")   # the module reloaded
    assert type(get("probe")) is again is not first
    with pytest.raises(TypeError, match="gguf_type Q4_0_PROBE is already the type of 'probe'"):
        type("Other", (GGUFBlockFormat,), dict(body), name="probe2")


def test_names_list_weight_formats_first_whatever_the_import_order(monkeypatch):
    """names() (and with it `quantzoo formats`, the report, the bench) lists the weight formats,
    then the activation format, then the baseline, each in registration order: a weight format
    registered after fp16 (a module imported later) is not listed after the baseline."""
    from quantzoo.formats import base

    kinds = [get(n).kind for n in names()]
    assert kinds == sorted(kinds, key=base.KINDS.index)
    late = type("Late", (base.Format,), {"name": "late"})()
    monkeypatch.setitem(base._REGISTRY, "late", late)   # registered last
    assert names()[:len(qz.formats.weight_formats())] == [f.name for f in qz.formats.weight_formats()]
    assert names().index("late") < names().index("q8_1") < names().index("fp16")
    assert qz.formats.weight_formats()[-1] is late


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
    """fmt.dequantize(qt) and fmt.nonfinite_rows(qt) of another format's weight: one clear error,
    not garbage (fp16 read a q8_0 weight's 272 bytes a row as 136 halves) or a reshape error
    (nonfinite_rows' was numpy's)."""
    w = rng.standard_normal((64, 256)).astype(np.float32)
    for other in STORED:
        if other != name:
            qt = get(other).quantize(w)
            for read in (get(name).dequantize, get(name).nonfinite_rows):
                with pytest.raises(ValueError, match=rf"^{name} weight: got a '{other}' weight$"):
                    read(qt)
    assert not get(name).nonfinite_rows(get(name).quantize(w)).any()


@pytest.mark.parametrize("name", STORED)
def test_emulate_refuses_another_formats_weight(name, rng):
    """fmt.emulate(x, qt) of another format's weight: dequantize's error, not another kernel's
    arithmetic (awq's emulate ran fp16 math on a q4_0 weight, which its kernels quantize x to Q8_1
    for; q4_0's ran q8_0's emulation, a result said to be q4_0's)."""
    w = rng.standard_normal((64, 256)).astype(np.float32)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    for other in STORED:
        if other != name:
            qt = get(other).quantize(w)
            with pytest.raises(ValueError, match=rf"^{name} weight: got a '{other}' weight$"):
                get(name).emulate(x, qt)


@pytest.mark.parametrize("name", STORED)
def test_emulate_names_an_x_of_the_wrong_shape(name, rng):
    """A 0-d x: ops.matmul's ValueError (emulate raised an IndexError from x.shape[-1])."""
    qt = get(name).quantize(rng.standard_normal((16, 128)).astype(np.float32))
    for x in (np.float32(1.0), np.zeros(())):
        with pytest.raises(ValueError, match=r"^x: a scalar \(0-d\); expected shape \(\.\.\., 128\)"):
            get(name).emulate(x, qt)
    with pytest.raises(ValueError, match="x has 96 features, the weight expects K=128"):
        get(name).emulate(np.zeros((2, 96), np.float32), qt)
    assert get(name).emulate(np.zeros(128, np.float32), qt).shape == (16,)


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
        with pytest.raises(ValueError, match=rf"awq: group_size={g!r} is not supported"):
            get("awq").nbytes((16, 128), group_size=g)


@pytest.mark.parametrize("name", STORED)
def test_nbytes_refuses_what_quantize_refuses(name):
    """nbytes answered for shapes and options quantize refuses (K = 100 for a 32-block format,
    an AWQ option for Q4_0); now it is what `storage` says, with its errors."""
    fmt = get(name)
    for shape in ((0, 64), (8, 64, 1), (8, -64), (8.0, 64), "8x64"):
        with pytest.raises(ValueError, match=re.escape(f"{name}.nbytes: shape {shape!r} is not")):
            fmt.nbytes(shape)
    with pytest.raises(TypeError, match=re.escape(f"{name}.nbytes: unexpected options ['bits']")):
        fmt.nbytes((8, 128), bits=4)
    if fmt.block_size > 1:
        with pytest.raises(ValueError, match="not a multiple of"):
            fmt.nbytes((8, 128 + 16))
        with pytest.raises(ValueError, match="not a multiple of"):
            fmt.quantize(np.zeros((8, 128 + 16), np.float32))
    assert fmt.nbytes((8, 128)) == fmt.quantize(np.zeros((8, 128), np.float32)).nbytes


def test_a_format_name_that_is_not_a_string():
    with pytest.raises(KeyError, match="format name: expected a str such as 'q4_0', got list; known formats: awq"):
        get(["q4_0"])


@pytest.mark.parametrize("name", STORED)
def test_quantized_tensors_compare_by_identity(name):
    """== and hash went field by field into numpy (an ambiguous truth value, an unhashable
    array); now by identity, as torch tensors' identity-based use (sets, dict keys) expects."""
    qt = get(name).quantize(np.ones((8, 128), np.float32))
    same = get(name).quantize(np.ones((8, 128), np.float32))
    assert qt == qt and qt != same and qt in [qt] and same not in [qt]
    assert len({qt, same, qt}) == 2


@pytest.mark.parametrize("name", STORED)
def test_torch_weights_without_values_are_refused(name):
    fmt = get(name)
    with pytest.raises(ValueError, match="w: a meta tensor holds no values to quantize"):
        fmt.quantize(torch.zeros(8, 128, device="meta"))
    with pytest.raises(ValueError, match=re.escape("w: a torch.sparse_coo tensor; pass a dense one (w.to_dense())")):
        fmt.quantize(torch.zeros(8, 128).to_sparse())
    with pytest.raises(ValueError, match="w: values beyond the float32 range"):   # was "non-finite value inf"
        fmt.quantize(torch.full((8, 128), 1e39, dtype=torch.float64))
    with pytest.raises(ValueError, match="meta tensor holds no values"):
        qz.QuantLinear.from_linear(torch.nn.Linear(128, 8, device="meta"), name)


@pytest.mark.parametrize("name", STORED)
def test_a_lazily_negated_weight_is_read_by_its_values(name, rng):
    """z.conj().imag is a float tensor with the negative bit set, which nn.Linear takes; quantize
    (and QuantLinear.from_linear) refused it with torch's RuntimeError from .numpy(). Now it is read
    as the values it holds, as ops.matmul reads such an x."""
    z = torch.from_numpy(rng.standard_normal((16, 128)) + 1j * rng.standard_normal((16, 128)))
    for dtype in (torch.complex64, torch.complex128):   # (float32 and float64 views)
        w = z.to(dtype).conj().imag
        assert w.is_neg()
        want = get(name).quantize(w.resolve_neg())
        for k, a in get(name).quantize(w).arrays().items():
            assert np.array_equal(a, want.arrays()[k]), k


def test_weights_too_small_for_awq_and_fp16_are_said(rng):
    """The GGUF formats said where a block's fp16 d underflows; AWQ's scale floor (a group's range
    is taken as at least 1e-5, AutoAWQ's clamp) and fp16's subnormals lost tiny weights silently."""
    w = (rng.standard_normal((16, 256)) * 0.02).astype(np.float32)
    tiny = w.copy()
    tiny[3] *= 1e-6   # row 3 (AWQ: column 3): |w| ~ 2e-8
    for fmt, said_re in (("awq", r"awq\.quantize: group 0 \(in_features 0\.\.127\), column 3: its weights "
                                 r"\(max \|w\| \S+\) span less than AutoAWQ's floor on a group's range \(1e-5: "
                                 r"s = 1e-5 / 15\), so they dequantize off by up to \S+; 2 of 32 \(group, column\) "
                                 r"pairs are off by over half their largest \|w\|"),
                         ("fp16", r"w: row 3: its largest \|w\| is \S+, below float16's normal range \(6.1e-05\), "
                                  r"so the cast moves its values by up to \S+% of that \(1 of 16 rows lose over "
                                  r"0.39%\); fp16 keeps them so")):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            qt = get(fmt).quantize(tiny)
        assert len(said) == 1 and re.match(said_re, str(said[0].message)), [str(m.message) for m in said]
        assert np.abs(get(fmt).dequantize(qt)[3] - tiny[3]).max() > 0.1 * np.abs(tiny[3]).max()   # a real loss
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # ordinary weights: nothing said
            get(fmt).quantize(w)
