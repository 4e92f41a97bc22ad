"""The public API as DESIGN.md §2 and README's "Python API" write it: every name imported and
called exactly as written there (keyword names, defaults, return types, shapes, dtypes, errors)."""
import inspect

import numpy as np
import pytest
import torch

import quantzoo as qz

GGUF_BYTES = {"q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q8_0": 34}
CEILINGS = {"q4_0": 0.0089, "q4_1": 0.0092, "q5_0": 0.0045, "q5_1": 0.0048, "q8_0": 0.0002, "awq": 0.012}
STORED = ["awq", *GGUF_BYTES, "fp16"]


def test_registry_names_get_kind_bits():
    documented = ["awq", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q8_1", "fp16"]
    # in this order; a format registered later is listed among those of its kind, not refused here
    assert [n for n in qz.formats.names() if n in documented] == documented
    with pytest.raises(KeyError, match="known formats: awq, q4_0, .*q8_1, fp16"):
        qz.formats.get("q4_2")
    kinds = {n: qz.formats.get(n).kind for n in documented}
    assert kinds == {**{n: "weight" for n in ["awq", *GGUF_BYTES]}, "q8_1": "activation", "fp16": "baseline"}
    assert qz.formats.get("q4_0").bits_per_weight == 4.5
    assert qz.formats.get("awq").bits_per_weight == 4 + 20 / 128        # "4.125+": scales and zeros
    assert {n: qz.formats.get(n).nmse_ceiling for n in CEILINGS} == CEILINGS


@pytest.mark.parametrize("name", STORED)
def test_quantize_storage_dequantize(name, rng):
    fmt = qz.formats.get(name)
    n, k = 64, 256
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    qt = fmt.quantize(w)
    assert isinstance(qt, qz.QuantizedTensor) and qt.format == name and qt.shape == (n, k)
    if name in GGUF_BYTES:
        assert qt.data.dtype == np.uint8 and qt.data.shape == (n, k // 32 * GGUF_BYTES[name])
    elif name == "awq":
        d = qt.data
        assert (d["qweight"].dtype, d["qweight"].shape) == (np.int32, (k, n // 8))
        assert (d["qzeros"].dtype, d["qzeros"].shape) == (np.int32, (k // 128, n // 8))
        assert (d["scales"].dtype, d["scales"].shape) == (np.float16, (k // 128, n))
        g64 = fmt.quantize(w, group_size=64)                              # options are keywords
        assert g64.params == {"group_size": 64} and g64.data["scales"].shape == (k // 64, n)
    wd = fmt.dequantize(qt)
    assert wd.dtype == np.float32 and wd.shape == (n, k)
    assert np.abs(wd - w).max() < 0.02                                     # a quantization of w
    lin = torch.nn.Linear(k, n)                                            # torch Linear orientation
    assert fmt.quantize(lin.weight).shape == (n, k)


@pytest.mark.parametrize("name", STORED)
def test_ops_matmul_numpy_and_torch(name, rng):
    fmt = qz.formats.get(name)
    qt = fmt.quantize((rng.standard_normal((48, 128)) * 0.02).astype(np.float32))
    x = rng.standard_normal((5, 128)).astype(np.float32)
    y = qz.ops.matmul(x, qt)                                               # numpy in, numpy out
    assert isinstance(y, np.ndarray) and y.shape == (5, 48)
    ref = x.astype(np.float64) @ fmt.dequantize(qt).T.astype(np.float64)   # y = x @ W.T
    # the default mode emulates the kernels: GGUF formats quantize x to Q8_1, which moves y from
    # x @ W.T by 1.2 % (median) to 2.2 % (max of 200 draws) at K = 128 for Q4/Q5 (their block
    # term multiplies Q8_1's rounding by q in 0..15 or 0..31), 0.5 % for Q8_0; AWQ and fp16 0.03 %
    assert np.linalg.norm(y - ref) <= 0.04 * np.linalg.norm(ref)
    yt = qz.ops.matmul(torch.from_numpy(x), qt)                            # torch in, torch out
    assert isinstance(yt, torch.Tensor) and yt.dtype == torch.float32 and torch.equal(yt, torch.from_numpy(y))
    layer = qz.QuantLinear(qt)
    assert isinstance(layer, torch.nn.Module) and torch.equal(layer(torch.from_numpy(x)), yt)


@pytest.mark.parametrize("mode", ["emulate", "dequant"])
def test_ops_matmul_refuses_an_activation_format_weight(mode):
    """q8_1 stores activations: ops.matmul owes the ValueError naming `qt` that QuantLinear and
    the CUDA path give (it raised TypeError from emulate, and mode='dequant' returned a product)."""
    q81 = qz.formats.get("q8_1").quantize(np.ones((8, 64), np.float32))
    with pytest.raises(ValueError, match="qt: 'q8_1' is an activation format"):
        qz.ops.matmul(np.ones((2, 64), np.float32), q81, mode=mode)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only error of qt.to('cuda')")
def test_to_cuda_without_a_gpu_is_a_value_error():
    qt = qz.formats.get("q4_0").quantize(np.ones((8, 32), np.float32))
    with pytest.raises(ValueError, match=r"QuantizedTensor.to\('cuda'\)"):
        qt.to("cuda")


def test_documented_entry_points_exist():
    from quantzoo.kernels import gguf, run_planned

    assert callable(run_planned) and callable(gguf.matmul_q8_1)
    assert list(inspect.signature(qz.ops.awq_gemm).parameters) == ["x", "qweight", "scales", "qzeros", "group_size"]
    assert list(inspect.signature(qz.ops.awq_dequantize).parameters) == ["qweight", "scales", "qzeros"]
    sig = inspect.signature(qz.load_model).parameters
    assert sig["path"].default is None and sig["device"].default == "cpu"
    from quantzoo.model import Model

    gen = inspect.signature(Model.generate).parameters
    assert gen["max_new_tokens"].default == 48 and gen["temperature"].default == 0.0


def test_readme_python_api_snippet():
    fmt = qz.formats.get("q4_0")
    w = np.random.randn(1024, 4096).astype(np.float32) * 0.02
    qt = fmt.quantize(w)
    y = qz.ops.matmul(np.random.randn(8, 4096).astype(np.float32), qt)
    layer = qz.QuantLinear(qt)
    assert y.shape == (8, 1024) and layer.in_features == 4096 and layer.out_features == 1024


def test_runner_api_on_the_default_model(default_model_file, one_torch_thread):
    m = qz.load_model(path=None, device="cpu")
    ids = m.tokenizer.encode("The capital of France is")
    assert isinstance(ids, list) and ids and all(type(i) is int for i in ids)
    assert m.tokenizer.decode(ids) == "The capital of France is"
    logits = m.logits(ids)
    assert tuple(logits.shape) == (len(ids), 49152) and logits.dtype == torch.float32
    new = m.generate(ids, max_new_tokens=16, temperature=0.0)
    assert isinstance(new, list) and len(new) == 16 and all(type(i) is int for i in new)
    assert new[0] == int(logits[-1].argmax())                             # greedy at 0
    assert isinstance(m.tokenizer.decode(new), str) and "Paris" in m.tokenizer.decode(new)
    assert sorted(m.tokenizer.eos_token_ids) == [0, 2, 4]
    chat = m.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert chat[-1] not in m.tokenizer.eos_token_ids


def test_public_names_have_their_own_docstrings():
    """help() on what a user reaches says what it computes: QuantLinear, its constructor and its
    forward showed torch.nn.Module's texts ("Base class for all neural network modules."), and
    formats.get, Format.quantize, QuantizedTensor's methods, Model.generate and others had none."""
    from quantzoo.model import Model, build_model
    from quantzoo.model.generate import Generation
    from quantzoo.model.tokenizer import Tokenizer

    objs = {"load_model": qz.load_model, "build_model": build_model, "Generation": Generation}
    members = {
        qz.QuantLinear: ["__init__", "from_linear", "forward", "qt", "get_extra_state", "set_extra_state"],
        qz.QuantizedTensor: ["fmt", "group_size", "arrays", "device", "nbytes", "to", "numpy", "dequantize"],
        Model: ["generate", "logits", "cached_prefix", "prefill", "decode_step", "setup_cache",
                "weight_bytes", "kv_cache_bytes", "use_persistent"],
        Tokenizer: ["encode", "decode", "encode_chat", "apply_chat_template", "id_to_token", "vocab_size",
                    "chat_template"],
    }
    for cls, attrs in members.items():
        objs[cls.__name__] = cls
        objs.update({f"{cls.__name__}.{a}": getattr(cls, a) for a in attrs})
    for mod, attrs in ((qz.ops, ["matmul", "awq_gemm", "awq_dequantize", "release_workspaces"]),
                       (qz.formats, ["get", "names", "stored_names", "get_stored", "weight_formats",
                                     "as_float_matrix", "Format"]),
                       (qz.reference, ["dequantize", "emulate", "matmul_exact", "nmse"])):
        objs.update({f"{mod.__name__}.{a}": getattr(mod, a) for a in attrs})
    for name in qz.formats.names():
        fmt = type(qz.formats.get(name))
        objs.update({f"{name}.{a}": getattr(fmt, a) for a in
                     ["quantize", "dequantize", "emulate", "check", "storage", "nbytes", "nonfinite_rows"]})
    torch_docs = {inspect.getdoc(torch.nn.Module), inspect.getdoc(torch.nn.Module.__init__),
                  inspect.getdoc(torch.nn.Module.forward), inspect.getdoc(torch.nn.Module.set_extra_state),
                  inspect.getdoc(object.__init__)}
    missing = sorted(n for n, o in objs.items() if not inspect.getdoc(o) or inspect.getdoc(o) in torch_docs)
    assert not missing, missing
