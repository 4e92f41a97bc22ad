"""GGUF loading: a synthetic llama model written the way llama.cpp's converter writes it (Q/K
rows permuted for adjacent-pair RoPE) must give transformers' logits on the same weights; a
qwen3 one (not permuted) too; bad files give one clear error naming the file and tensor/key.
"""
from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np
import pytest
import torch

import quantzoo as qz
from quantzoo import formats

gguf = pytest.importorskip("gguf")

DIMS = dict(vocab=160, hidden=128, inter=192, layers=2, heads=4, kv_heads=2, ctx=256)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def hf_model(arch: str, seed: int = 0, tied: bool = False):
    """A tiny random transformers model (weights scaled so logits are not all near zero)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    d = DIMS
    kw = dict(vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"],
              num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
              num_key_value_heads=d["kv_heads"], max_position_embeddings=d["ctx"],
              rms_norm_eps=1e-5, rope_theta=1e4 if arch == "llama" else 1e6,
              tie_word_embeddings=tied, initializer_range=0.08)
    if arch == "llama":
        m = LlamaForCausalLM(LlamaConfig(**kw))
    else:
        m = Qwen3ForCausalLM(Qwen3Config(head_dim=64, **kw))
    with torch.no_grad():   # norms away from 1 so a wrong norm shows
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return m.eval()


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, written out here as the independent oracle."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


HF2GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
           "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
           "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    p = hf.split(".")
    return f"blk.{p[2]}.{HF2GGUF['.'.join(p[3:-1])]}.weight"


class Typed(NamedTuple):
    """A metadata value written with this GGUF type (and array item type)."""
    value: object
    vtype: gguf.GGUFValueType
    sub_type: gguf.GGUFValueType | None = None


def set_kv(w, key: str, v) -> None:
    """Set (or, with None, remove) metadata key `key` of GGUFWriter w, typed by the Python value, or
    as given by a Typed value."""
    for kv in w.kv_data:
        kv.pop(key, None)
    if v is None:
        return
    if isinstance(v, Typed):
        w.add_key_value(key, v.value, v.vtype, v.sub_type)
    elif isinstance(v, list):
        w.add_array(key, v)
    elif isinstance(v, str):
        w.add_string(key, v)
    elif isinstance(v, bool):   # before int: a bool is one
        w.add_bool(key, v)
    elif isinstance(v, float):
        w.add_float32(key, v)
    else:
        (w.add_uint32 if v >= 0 else w.add_int32)(key, v)


def write_gguf(path, m, arch: str, fmt: str | None = None, drop=(), extra_tensors=None,
               permute: bool = True, embed_fmt: str | None = None, kv=None):
    """Write m as llama.cpp would: linears in `fmt` (None: F32), norms F32; llama Q/K permuted;
    kv: metadata keys set, or (None) removed, last.

    Returns the state dict as the file holds it, dequantized and in HF row order (the oracle)."""
    c = m.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rp = getattr(c, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rp.get("rope_theta", getattr(c, "rope_theta", 1e4))))
    if arch == "qwen3":
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    oracle = {}
    for hf, t in m.state_dict().items():
        if hf == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name = gguf_name(hf)
        a = t.detach().float().numpy()
        f = embed_fmt if hf == "model.embed_tokens.weight" else fmt
        if a.ndim == 2 and f is not None:
            qt = formats.get(f).quantize(a)
            a_deq = qt.dequantize()
            stored, raw = qt.data, getattr(gguf.GGMLQuantizationType, formats.get(f).gguf_type)
        else:
            a_deq, stored, raw = a, a, None
        oracle[hf] = torch.from_numpy(a_deq.copy())
        if arch == "llama" and permute and name.split(".")[-2] in ("attn_q", "attn_k"):
            nh = c.num_attention_heads if "attn_q" in name else c.num_key_value_heads
            stored = llama_cpp_permute(stored, nh)
        if name in drop:
            continue
        if raw is None:
            w.add_tensor(name, np.ascontiguousarray(stored))
        else:
            w.add_tensor(name, np.ascontiguousarray(stored), raw_dtype=raw)
    for name, (arr, raw) in (extra_tensors or {}).items():
        w.add_tensor(name, arr, raw_dtype=raw)
    for key, v in (kv or {}).items():
        set_kv(w, key, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return oracle


def hf_logits(m, oracle, ids):
    m.load_state_dict(oracle, strict=False)
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].float()


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("arch,fmt", [("llama", None), ("llama", "q8_0"), ("llama", "q4_1"),
                                      ("qwen3", "q5_0"), ("qwen3", None)])
def test_gguf_matches_transformers(tmp_path, arch, fmt):
    m = hf_model(arch, seed=1 if fmt else 0)
    path = tmp_path / "m.gguf"
    oracle = write_gguf(path, m, arch, fmt)
    model = qz.load_model(path, progress=False)
    assert model.tokenizer is None and model.config.arch == arch
    assert model.formats["q_proj"] == (fmt or "f32")
    ids = [int(i) for i in np.random.default_rng(5).integers(0, DIMS["vocab"], 40)]
    want = hf_logits(m, oracle, ids)
    got = model.logits(ids)
    err = rel_err(got, want)
    assert err < 1e-4, f"{arch}/{fmt}: max relative logit error {err:.2e}"
    # greedy generation agrees with transformers token for token
    with torch.no_grad():
        ref = m.generate(torch.tensor([ids[:8]]), max_new_tokens=16, do_sample=False,
                         pad_token_id=0)[0, 8:].tolist()
    assert model.generate(ids[:8], max_new_tokens=16, eos_token_ids=[]) == ref


def test_llama_without_unpermutation_is_wrong(tmp_path):
    """The negative control of the RoPE trap: a file whose Q/K rows are NOT permuted (the
    loader then scrambles them) gives logits far from transformers', so the test above can fail."""
    m = hf_model("llama", seed=2)
    path = tmp_path / "m.gguf"
    oracle = write_gguf(path, m, "llama", None, permute=False)
    ids = list(range(1, 41))
    err = rel_err(qz.load_model(path, progress=False).logits(ids), hf_logits(m, oracle, ids))
    assert err > 1e-2, f"un-permuting an unpermuted file changed nothing (error {err:.1e})"


def test_unpermute_inverts_permute_on_block_bytes():
    from quantzoo.model.gguf_loader import unpermute_qk

    rng = np.random.default_rng(0)
    w = rng.standard_normal((4 * 64, 96)).astype(np.float32)
    qt = formats.get("q4_0").quantize(w)
    back = unpermute_qk(llama_cpp_permute(qt.data, 4), 4)
    assert np.array_equal(back, qt.data)
    assert not np.array_equal(llama_cpp_permute(qt.data, 4), qt.data)


# ---- bad files ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("g") / "good.gguf"
    write_gguf(path, hf_model("llama"), "llama", "q8_0")
    return path


def test_wrong_magic(tmp_path, good_file):
    bad = tmp_path / "bad.gguf"
    data = bytearray(good_file.read_bytes())
    data[:4] = b"GGUX"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"bad\.gguf: not a GGUF file \(magic b'GGUX'"):
        qz.load_model(bad, progress=False)


def test_unsupported_version(tmp_path, good_file):
    """A version gguf-py does not read is named as such (not 'truncated or corrupt')."""
    data = bytearray(good_file.read_bytes())
    data[4:8] = (4).to_bytes(4, "little")
    bad = tmp_path / "v4.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"v4\.gguf: GGUF version 4 is not supported \(gguf-py reads versions 2, 3\)$"):
        qz.load_model(bad, progress=False)


def test_big_endian_is_named(tmp_path):
    """gguf-py reads a big-endian file (its writer makes one on request); the loader does not, and
    says so (its checks had read the byte-swapped lengths as corrupt ones)."""
    path = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"be\.gguf: a big-endian GGUF \(version 3\); only little-endian"):
        qz.load_model(path, progress=False)


@pytest.mark.parametrize("frac", [0.9, 0.5])
def test_truncated_tensor_data(tmp_path, good_file, frac):
    data = good_file.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:int(len(data) * frac)])
    with pytest.raises(ValueError, match=r"cut\.gguf: tensor '[a-z_.0-9]+': its data .* runs past "
                                         r"the end of the file .*truncated"):
        qz.load_model(bad, progress=False)


def test_truncated_header(tmp_path, good_file):
    """Cut anywhere in the header (metadata, tokenizer arrays, tensor infos): one line naming the
    file that says it may be truncated (a cut inside a metadata array used to pass numpy's own
    message about a short view through alone)."""
    from gguf import GGUFReader

    raw = good_file.read_bytes()
    end = GGUFReader(str(good_file)).data_offset
    for cut in sorted({300, *range(24, end, max(1, end // 23))}):
        bad = tmp_path / "head.gguf"
        bad.write_bytes(raw[:cut])
        with pytest.raises(ValueError, match=r"head\.gguf: .*truncated") as e:
            qz.load_model(bad, progress=False)
        assert "\n" not in str(e.value), (cut, str(e.value))


def test_missing_tensor(tmp_path):
    path = tmp_path / "miss.gguf"
    write_gguf(path, hf_model("llama"), "llama", "q8_0", drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"miss\.gguf: tensor 'blk\.1\.ffn_up\.weight' is missing"):
        qz.load_model(path, progress=False)


def kquant_model():
    """A tiny llama whose in_features are multiples of 256 (a K-quant super-block)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=256,
                                        num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=64,
                                        rms_norm_eps=1e-5)).eval()


def kquant_bytes(rng, rows: int, cols: int, tname: str, d: float = 3e-4):
    """Random blocks of ggml type tname with their fp16 super-block scales set to d (Q6_K: d
    is the last 2 of 210 bytes; Q4_K: d and dmin are the first 4 of 144): (rows, bytes) uint8."""
    t = gguf.GGMLQuantizationType[tname]
    size = gguf.GGML_QUANT_SIZES[t][1]
    b = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    at = {"Q6_K": [size - 2], "Q4_K": [0, 2]}[tname]
    for o in at:
        b[..., o:o + 2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    return b.reshape(rows, -1)


def test_llama_cpp_types_without_a_kernel_load_dequantized(tmp_path):
    """llama-quantize stores output.weight as Q6_K in Q4_0 ... Q5_1 files, and K-quant files are
    common: such tensors load dequantized by gguf-py (the outside oracle for GGUF codecs), with a
    warning, and the logits equal transformers' on those dequantized weights. attn_q is a
    permuted llama Q/K tensor, so the dense unpermutation is checked too."""
    m = kquant_model()
    rng = np.random.default_rng(1)
    T = gguf.GGMLQuantizationType
    heads = m.config.num_attention_heads
    raw = {"output.weight": ("lm_head.weight", kquant_bytes(rng, 64, 256, "Q6_K"), T.Q6_K),
           "blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj.weight",
                                   kquant_bytes(rng, 256, 256, "Q4_K"), T.Q4_K),
           "blk.0.ffn_gate.weight": ("model.layers.0.mlp.gate_proj.weight",
                                     kquant_bytes(rng, 256, 256, "Q4_K"), T.Q4_K)}
    path = tmp_path / "kq.gguf"
    extra = {n: (llama_cpp_permute(b, heads) if "attn_q" in n else b, t) for n, (_, b, t) in raw.items()}
    oracle = write_gguf(path, m, "llama", "q8_0", drop=tuple(raw), extra_tensors=extra)
    for _, (hf, b, t) in raw.items():
        oracle[hf] = torch.from_numpy(gguf.quants.dequantize(b, t).reshape(b.shape[0], -1).copy())
    with pytest.warns(UserWarning, match=r"kq\.gguf: no quantzoo kernel for Q6_K: output\.weight; "
                                         r"Q4_K: 2 tensors: dequantized to float at load"):
        model = qz.load_model(path, progress=False)
    assert model.formats["lm_head"] == "f32 (dequantized from Q6_K)"
    assert model.formats["q_proj"] == model.formats["gate_proj"] == "f32 (dequantized from Q4_K)"
    assert model.formats["k_proj"] == "q8_0"
    ids = [int(i) for i in rng.integers(0, 64, 24)]
    want = hf_logits(m, oracle, ids)
    err = rel_err(model.logits(ids), want)
    assert err < 1e-4, f"max relative logit error {err:.2e}"


def test_quantize_cli_requantizes_a_dequantized_tensor(tmp_path):
    """`quantzoo quantize` from such a file: the warning is one line naming file, type and
    tensor (not a Python location), and the Q6_K output.weight reaches DST as Q8_0 of its
    dequantized values (compared with our codec on gguf-py's dequantization). Quantizing a
    quantized weight again is said once (llama-quantize refuses it without --allow-requantize)."""
    import subprocess
    import sys

    m = kquant_model()
    b = kquant_bytes(np.random.default_rng(3), 64, 256, "Q6_K")
    src, dst = tmp_path / "q6.gguf", tmp_path / "out.gguf"
    write_gguf(src, m, "llama", "q4_0", drop=("output.weight",),
               extra_tensors={"output.weight": (b, gguf.GGMLQuantizationType.Q6_K)})
    out = subprocess.run([sys.executable, "-m", "quantzoo.cli", "quantize", str(src), str(dst),
                          "--format", "q8_0", "--quiet"], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if "warning" in ln.lower()]
    assert lines[0] == (f"quantzoo quantize: warning: {src}: no quantzoo kernel for Q6_K: output.weight: "
                        "dequantized to float at load (gguf-py), run as dense linears (cuBLAS on CUDA, "
                        "fp16 there)") and len(lines) == 2, out.stderr
    assert re.fullmatch(rf"quantzoo quantize: warning: {re.escape(str(src))}: tensor '\S+' is stored as (Q4_0|Q6_K); it "
                        r"\(and any other quantized tensor\) is dequantized and quantized again to Q8_0, keeping its "
                        r"\S+ rounding error besides \(llama-quantize asks for --allow-requantize\)", lines[1]), lines
    from quantzoo.model.gguf_loader import load_gguf

    _, w, _ = load_gguf(dst, progress=False)
    want = formats.get("q8_0").quantize(gguf.quants.dequantize(b, gguf.GGMLQuantizationType.Q6_K)
                                        .reshape(64, 256))
    assert w["lm_head.weight"].format == "q8_0"
    assert np.array_equal(np.asarray(w["lm_head.weight"].data), want.data)


def test_types_without_a_kernel_or_a_dequantizer_are_refused(tmp_path):
    """Q8_K (llama.cpp's activation type for K-quant dot products) has no gguf-py dequantizer: one
    error naming the tensor and its type."""
    m = kquant_model()
    kq = np.random.default_rng(0).integers(0, 255, (256, 292), dtype=np.uint8)  # (256, 256) Q8_K
    path = tmp_path / "k8.gguf"
    write_gguf(path, m, "llama", None, drop=("blk.0.ffn_gate.weight",),
               extra_tensors={"blk.0.ffn_gate.weight": (kq, gguf.GGMLQuantizationType.Q8_K)})
    with pytest.raises(ValueError, match=r"k8\.gguf: tensor 'blk\.0\.ffn_gate\.weight' has type "
                                         r"Q8_K, which is not supported yet"):
        qz.load_model(path, progress=False)


def test_a_dequantized_tensor_with_an_inf_scale_is_refused(tmp_path):
    m = kquant_model()
    b = kquant_bytes(np.random.default_rng(2), 64, 256, "Q6_K")
    b[5, -2:] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    path = tmp_path / "inf.gguf"
    write_gguf(path, m, "llama", None, drop=("output.weight",),
               extra_tensors={"output.weight": (b, gguf.GGMLQuantizationType.Q6_K)})
    with pytest.warns(UserWarning), pytest.raises(
            ValueError, match=r"inf\.gguf: tensor 'output\.weight': row 5 holds NaN or inf \(1 rows do\); the file "
                              "is corrupt"):
        qz.load_model(path, progress=False)


CORRUPT = [(f.name, field, bad) for f in formats.weight_formats() if f.gguf_type
           for field in (("d", "m") if f.has_min else ("d",)) for bad in (np.nan, -np.inf)]


@pytest.mark.parametrize("fmt,field,bad", CORRUPT)
def test_a_nan_or_inf_scale_or_value_is_refused(tmp_path, fmt, field, bad):
    """A NaN / inf block field (d, or Q4_1 / Q5_1's m) loaded without a word, and generation
    printed garbage (token 0 forever from a NaN argmax); so did a NaN float tensor. Refused at
    load, naming the file, the tensor and the row (each tensor's scales are read once)."""
    m = hf_model("qwen3")
    f = formats.get(fmt)
    b = np.array(f.quantize(m.model.layers[0].self_attn.v_proj.weight.detach().numpy()).data)
    at = f.bytes_per_block + (2 if field == "m" else 0)   # row 5, block 1
    b[5, at:at + 2] = np.frombuffer(np.float16(bad).tobytes(), np.uint8)
    path = tmp_path / "bad.gguf"
    write_gguf(path, m, "qwen3", fmt, drop=("blk.0.attn_v.weight",), extra_tensors={
        "blk.0.attn_v.weight": (b, getattr(gguf.GGMLQuantizationType, f.gguf_type))})
    with pytest.raises(ValueError, match=r"bad\.gguf: tensor 'blk\.0\.attn_v\.weight': row 5 holds NaN or inf in "
                                         r"its scales \(1 rows do\); the file is corrupt"):
        qz.load_model(path, progress=False)
    with torch.no_grad():
        m.model.norm.weight[3] = bad
    write_gguf(path, m, "qwen3", fmt)
    with pytest.raises(ValueError, match=r"bad\.gguf: tensor 'output_norm\.weight': row 3 holds NaN or inf \(1 "):
        qz.load_model(path, progress=False)


def test_wrong_arch_and_shape(tmp_path):
    m = hf_model("llama")
    path = tmp_path / "arch.gguf"
    write_gguf(path, m, "gpt2")
    with pytest.raises(ValueError, match=r"arch\.gguf: general\.architecture='gpt2' is not supported"):
        qz.load_model(path, progress=False)
    # a qwen3 header over llama tensors: the q/k norms are missing
    path = tmp_path / "noqk.gguf"
    write_gguf(path, m, "qwen3")
    with pytest.raises(ValueError, match=r"noqk\.gguf: tensor 'blk\.0\.attn_q_norm\.weight' is missing"):
        qz.load_model(path, progress=False)


# a byte-level BPE over the 160 ids of the tiny models: one token a name, a few merges
TOK_KV = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
          "tokenizer.ggml.tokens": [f"t{i}" for i in range(158)] + ["t", "tt"],
          "tokenizer.ggml.merges": ["t t"], "tokenizer.ggml.bos_token_id": 1,
          "tokenizer.ggml.eos_token_id": 2}


@pytest.mark.parametrize("kv,needle", [
    ({"llama.attention.head_count": 0}, "'llama.attention.head_count'=0 must be a positive integer"),
    ({"llama.block_count": "two"}, "'llama.block_count'='two' must be a positive integer"),
    ({"llama.attention.layer_norm_rms_epsilon": -1.0},
     "'llama.attention.layer_norm_rms_epsilon'=-1.0 must be a positive number"),
    ({"llama.rope.freq_base": 0.0}, "'llama.rope.freq_base'=0.0 must be a positive number"),
    # a base whose RoPE frequencies are inf in float32 had loaded, then NaN logits blamed the weights
    ({"llama.rope.freq_base": 1e-45}, "e-45 (the RoPE base) is outside float32's normal range"),
    ({"llama.rope.freq_base": 2e-38, "llama.context_length": 1 << 20},
     "(the RoPE base): with head_dim 32 its frequencies theta^(-2i/head_dim) (1 to 2.2e+35) leave "
     "float32's range over 1048576 positions"),
    ({"llama.attention.head_count_kv": [2, 4]}, "'llama.attention.head_count_kv' varies per layer"),
    ({"llama.attention.head_count_kv": 3}, "num_heads=4 is not a multiple of num_kv_heads=3"),
    ({"llama.context_length": None}, "'llama.context_length' is missing"),
    ({**TOK_KV, "tokenizer.ggml.tokens": list(range(160))}, "tokenizer.ggml.tokens must be an array of str"),
    ({**TOK_KV, "tokenizer.ggml.merges": ["t zzz"]}, "tokenizer.ggml.tokens / merges do not make a BPE"),
    ({**TOK_KV, "tokenizer.ggml.bos_token_id": 100000, "tokenizer.ggml.add_bos_token": True},
     "tokenizer.ggml.add_bos_token asks for a BOS token, but tokenizer.ggml.bos_token_id=100000 is none"),
    ({"tokenizer.ggml.eos_token_id": "x"}, "tokenizer.ggml.eos_token_id='x' is not a token id"),
    # ids the runner does not use had loaded whatever they held (llama.cpp refuses the file)
    ({**TOK_KV, "tokenizer.ggml.padding_token_id": "x"}, "tokenizer.ggml.padding_token_id='x' is not a token id"),
    ({**TOK_KV, "tokenizer.ggml.unknown_token_id": 1.5}, "tokenizer.ggml.unknown_token_id=1.5 is not a token id"),
    ({**TOK_KV, "tokenizer.chat_template": 5}, "tokenizer.chat_template must be a string"),
    # an array where a name is due had raised TypeError: unhashable type: 'list'
    ({**TOK_KV, "tokenizer.ggml.pre": [1, 2]}, "tokenizer.ggml.pre=[1, 2] is not supported"),
    # a STRING "false" / an array [false] had read as true; one string at two ids had loaded
    ({**TOK_KV, "tokenizer.ggml.add_bos_token": "false"}, "tokenizer.ggml.add_bos_token='false' must be a boolean"),
    ({**TOK_KV, "tokenizer.ggml.add_eos_token": [False]}, "tokenizer.ggml.add_eos_token=[False] must be a boolean"),
    ({**TOK_KV, "tokenizer.ggml.tokens": [f"t{i}" for i in range(5)] + ["tt"] + [f"t{i}" for i in range(6, 158)]
      + ["t", "tt"]}, "tokenizer.ggml.tokens holds 'tt' twice, as ids 5 and 159"),
    # llama.cpp reads float keys as F32 only: a one-bit flip of the type (F32 6 -> U32 4) read eps's
    # bits as 897,988,541 and generated one token forever; a bool factor read as 1
    ({"llama.attention.layer_norm_rms_epsilon": Typed(1, gguf.GGUFValueType.UINT32)},
     "'llama.attention.layer_norm_rms_epsilon'=1 is not a float (llama.cpp reads it as F32 only)"),
    ({"llama.rope.freq_base": Typed(10000, gguf.GGUFValueType.UINT32)}, "'llama.rope.freq_base'=10000 is not a float"),
    ({"llama.rope.scaling.factor": True}, "'llama.rope.scaling.factor'=True is not a float"),
    # token types llama.cpp reads as int32 whatever the array holds; a type no token has
    ({**TOK_KV, "tokenizer.ggml.token_type": Typed([1] * 160, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT8)},
     "'tokenizer.ggml.token_type' is ARRAY of UINT8, expected ARRAY of INT32"),
    ({**TOK_KV, "tokenizer.ggml.scores": Typed([0.0] * 160, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT64)},
     "'tokenizer.ggml.scores' is ARRAY of FLOAT64, expected ARRAY of FLOAT32"),
    ({**TOK_KV, "tokenizer.ggml.token_type": Typed([1] * 5 + [99] + [1] * 154, gguf.GGUFValueType.ARRAY,
                                                    gguf.GGUFValueType.INT32)},
     "tokenizer.ggml.token_type[5] = 99 (token 't5') is no llama.cpp token type (0..6)"),
    # a corrupt head size: the RoPE check had built an array of head_dim / 2 values before any
    # tensor's shape was compared (2**31: minutes and 17 GB; 2**40: a MemoryError naming no key)
    ({"llama.attention.key_length": Typed(2**40, gguf.GGUFValueType.UINT64)},
     "tensor 'blk.0.attn_q.weight' has shape (128, 128), the config (llama, hidden 128, heads 4/2x1099511627776)"),
    ({"llama.embedding_length": Typed(2**40, gguf.GGUFValueType.UINT64)},
     "tensor 'token_embd.weight' has shape (160, 128), the config (llama, hidden 1099511627776"),
    # had said "head_dim=0: must be a positive integer", a key the file does not have
    ({"llama.attention.head_count": 256, "llama.attention.head_count_kv": 256},
     "llama.attention.head_count=256 is more than llama.embedding_length=128: without llama.attention.key_length"),
    # had said "(unknown name)" of a name the loader knows
    ({"llama.block_count": 1}, "unexpected tensor 'blk.1.attn_q.weight' for a llama model (its layer is past "
     "llama.block_count=1)"),
    # found by fuzzing: a vocabulary without tokenizer.ggml.model had been dropped without a word (a model
    # with no tokenizer); an absent tokenizer.ggml.pre was called 'default', and the head sizes that
    # differ were not shown (key_length absent: hidden / heads = 32)
    ({**TOK_KV, "tokenizer.ggml.model": None},
     "metadata key 'tokenizer.ggml.model' is missing, but the file has tokenizer.ggml.tokens"),
    ({**TOK_KV, "tokenizer.ggml.pre": None},
     "metadata key 'tokenizer.ggml.pre' is missing; llama.cpp then splits as 'default', which is not supported"),
    ({"llama.attention.value_length": 64},
     "llama.attention.value_length=64 != key_length=32 (absent: embedding_length / head_count) is not supported"),
])
def test_bad_metadata_names_the_key(tmp_path, kv, needle):
    """Metadata of the wrong type or value: one error naming the file and the key, never a raw
    int()/ZeroDivisionError/tokenizers message."""
    path = tmp_path / "meta.gguf"
    write_gguf(path, hf_model("llama"), "llama", kv=kv)
    with pytest.raises(ValueError) as e:
        qz.load_model(path, progress=False)
    msg = str(e.value)
    assert msg.startswith(str(path)) and msg.count(str(path)) == 1 and needle in msg, msg


@pytest.mark.parametrize("name,why", [
    ("blk.7.attn_q.weight", "its layer is past llama.block_count=2"),
    ("blk.01.attn_q.weight", "unknown name"),        # had said "a name of another architecture"
    ("blk.\u00b2.attn_q.weight", "unknown name"),    # (isdigit, but int() refuses it): had been a raw int() error
    ("blk.\u0661.attn_q.weight", "unknown name"),    # an Arabic-Indic 1: "a name of another architecture"
])
def test_a_tensor_of_no_layer_is_named(tmp_path, name, why):
    """A tensor whose layer index is past block_count is called that; one whose index is no plain
    decimal (as llama.cpp writes blk.<i>) names no layer at all: an unknown name, one error
    naming the file."""
    path = tmp_path / "names.gguf"
    write_gguf(path, hf_model("llama"), "llama", extra_tensors={name: (np.zeros(4, np.float32), None)})
    with pytest.raises(ValueError) as e:
        qz.load_model(path, progress=False)
    assert str(e.value) == f"{path}: unexpected tensor {name!r} for a llama model ({why})", str(e.value)


@pytest.mark.parametrize("kv,needle", [
    # llama.cpp: no rope.scaling.type means linear, the factor from either key
    ({"llama.rope.scaling.factor": 4.0}, "llama.rope.scaling.factor=4.0 asks for linear RoPE scaling"),
    ({"llama.rope.scale_linear": 4.0}, "llama.rope.scale_linear=4.0 asks for linear RoPE scaling"),
    ({"llama.rope.scaling.type": "yarn"}, "llama.rope.scaling.type='yarn' is not supported yet"),
    ({"llama.block_count": 2**31}, "llama.block_count=2147483648, but the file holds only"),
])
def test_rope_scaling_and_layer_count_are_refused(tmp_path, kv, needle):
    """A RoPE scaling factor had loaded without a word (wrong logits: llama.cpp scales the
    frequencies); a corrupt layer count had hung the loader building its shape table."""
    path = tmp_path / "r.gguf"
    write_gguf(path, hf_model("llama"), "llama", kv=kv)
    with pytest.raises(ValueError, match=needle):
        qz.load_model(path, progress=False)


@pytest.mark.parametrize("kv", [{"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0},
                                {"llama.rope.scaling.type": "linear"}, {"llama.rope.scaling.factor": 1.0}])
def test_rope_scaling_that_scales_nothing_loads(tmp_path, kv):
    path = tmp_path / "r.gguf"
    write_gguf(path, hf_model("llama"), "llama", kv=kv)
    qz.load_model(path, progress=False)


def test_merge_of_a_space_token(tmp_path):
    """llama.cpp splits a merge at the first space after position 0: a first token may be " "."""
    kv = {**TOK_KV, "tokenizer.ggml.tokens": [f"t{i}" for i in range(157)] + [" ", "a", " a"],
          "tokenizer.ggml.merges": ["  a"]}
    path = tmp_path / "sp.gguf"
    write_gguf(path, hf_model("llama"), "llama", kv=kv)
    assert qz.load_model(path, progress=False).tokenizer.tok.get_vocab()[" a"] == 159


def test_good_tokenizer_metadata_loads(tmp_path):
    """The control for the cases above: the same tokenizer keys, valid, load and encode. A
    special id past the vocabulary is ignored with a warning, as llama.cpp does."""
    path = tmp_path / "tok.gguf"
    write_gguf(path, hf_model("llama"), "llama", kv={**TOK_KV, "tokenizer.ggml.eot_token_id": 5000})
    with pytest.warns(UserWarning, match="tokenizer.ggml.eot_token_id=5000 is not one of the 160 token ids: ignored"):
        m = qz.load_model(path, progress=False)
    assert m.tokenizer.encode("t") == [158] and m.config.bos_token_id == 1 and m.config.eos_token_ids == [2]


def test_bad_tensor_layout(tmp_path, good_file):
    """A 1-D token_embd, and a tensor whose data offset breaks the file's alignment or overlaps
    another tensor's data: clear errors (llama.cpp refuses such files too)."""
    path = tmp_path / "flat.gguf"
    embd = np.zeros(DIMS["vocab"] * DIMS["hidden"], np.float32)
    write_gguf(path, hf_model("llama"), "llama", drop=("token_embd.weight",),
               extra_tensors={"token_embd.weight": (embd, gguf.GGMLQuantizationType.F32)})
    with pytest.raises(ValueError, match=r"flat\.gguf: tensor 'token_embd\.weight' has dims \[20480\]"):
        qz.load_model(path, progress=False)
    r = gguf.GGUFReader(str(good_file))
    offs = {t.name: t.field.parts[-1] for t in r.tensors}         # each tensor's u64 data offset
    at = {n: p.ctypes.data - r.data.ctypes.data for n, p in offs.items()}
    first, second = sorted(offs, key=lambda n: int(offs[n][0]))[:2]
    del r, offs
    for what, name, value, needle in (("shift", first, None, "is not a multiple of the file's alignment"),
                                      ("overlap", second, 0, "overlaps tensor")):
        data = bytearray(good_file.read_bytes())
        old = int(np.frombuffer(bytes(data[at[name]:at[name] + 8]), np.uint64)[0])
        data[at[name]:at[name] + 8] = np.uint64(old + 3 if value is None else value).tobytes()
        bad = tmp_path / f"{what}.gguf"
        bad.write_bytes(bytes(data))
        with pytest.raises(ValueError, match=rf"{what}\.gguf: tensor .*{needle}"):
            qz.load_model(bad, progress=False)


def _patch_tensor_info(good_file, tmp_path, name_of, part, value, out):
    """A copy of good_file with one tensor-info field (part -2: type, -1: offset) set to value;
    name_of(reader) picks the tensor."""
    r = gguf.GGUFReader(str(good_file))
    t = {t.name: t for t in r.tensors}[name_of(r)]
    p = t.field.parts[part]
    at, dtype = p.ctypes.data - r.data.ctypes.data, p.dtype
    del r, t, p
    data = bytearray(good_file.read_bytes())
    data[at:at + dtype.itemsize] = np.array([value], dtype).tobytes()
    bad = tmp_path / out
    bad.write_bytes(bytes(data))
    return bad


def test_corrupt_tensor_type_or_offset_is_refused(tmp_path, good_file):
    """A tensor's type number corrupted to a smaller block type (Q8_0 -> Q4_0), or its offset
    set to 2^64 - 32 (which wrapped around to 32 bytes before the data in uint64 arithmetic):
    both had loaded, the weight read from the wrong bytes. llama.cpp (ggml's gguf.cpp) wants
    every offset to be the padded sum of the sizes before it; so do we."""
    def first_q8(r):
        q8 = sorted((int(t.field.parts[-1][0]), t.name) for t in r.tensors if t.tensor_type.name == "Q8_0")
        return q8[0][1]

    bad = _patch_tensor_info(good_file, tmp_path, first_q8, -2, int(gguf.GGMLQuantizationType.Q4_0), "type.gguf")
    with pytest.raises(ValueError, match=r"type\.gguf: tensor '[a-z_.0-9]+': data offset \d+, but tensor "
                                         r"'[a-z_.0-9]+' before it \(Q4_0\[128, \d+\]\) ends at \d+") as e:
        qz.load_model(bad, progress=False)
    assert "\n" not in str(e.value)
    first = lambda r: min(r.tensors, key=lambda t: int(t.field.parts[-1][0])).name   # noqa: E731
    bad = _patch_tensor_info(good_file, tmp_path, first, -1, 2**64 - 32, "wrap.gguf")
    with pytest.raises(ValueError, match=r"wrap\.gguf: tensor '[a-z_.0-9]+': its data .* runs past the end"):
        qz.load_model(bad, progress=False)


def test_corrupt_tensor_info_names_the_tensor(tmp_path, good_file):
    """Found by fuzzing: a tensor's name length, dimension count or type corrupted was refused by
    gguf-py's parser in words naming no tensor (numpy's about views, the length of a "key" read
    from the bytes after the bad count, "Quantized tensor row size (128) is not a multiple of Q4_K
    block size (256)"): each is named by its tensor now (a name that swallowed the bytes after it
    cut short), a count past ggml's 4 dimensions at once."""
    r = gguf.GGUFReader(str(good_file))
    t = {t.name: t for t in r.tensors}["blk.0.attn_q.weight"]
    name_len_at, n_dims_at, type_at = (t.field.parts[i].ctypes.data - r.data.ctypes.data for i in (0, 2, -2))
    del r, t
    _refused_with(good_file, tmp_path, [
        ("namelen", name_len_at, np.uint64(len("blk.0.attn_q.weight") + 200).tobytes(),
         "the info of tensor 'blk.0.attn_q.weight\\x02\\x00\\x00\\x00"),
        ("ndims9", n_dims_at, np.uint32(9).tobytes(),
         "tensor 'blk.0.attn_q.weight': 9 dimensions (GGUF tensors have at most 4)"),
        ("ndims1", n_dims_at, np.uint32(1).tobytes(), "the name of the tensor after 'blk.0.attn_q.weight' is "),
        ("q4k", type_at, np.uint32(gguf.GGMLQuantizationType.Q4_K).tobytes(),
         "tensor 'blk.0.attn_q.weight': its rows of 128 values are not whole Q4_K blocks of 256")])


def test_optional_keys_take_llama_cpp_defaults():
    """Keys llama.cpp treats as optional (llama-model.cpp / llama-hparams): head_count_kv =
    head_count (no GQA), key_length = embedding_length / head_count, rope.freq_base = 10000."""
    from quantzoo.model.gguf_loader import config_from_metadata

    meta = {"general.architecture": "llama", "llama.embedding_length": 256, "llama.feed_forward_length": 512,
            "llama.block_count": 2, "llama.attention.head_count": 8, "llama.context_length": 128,
            "llama.attention.layer_norm_rms_epsilon": 1e-5}
    c = config_from_metadata(meta, "x.gguf", vocab_size=100, tied=True)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rope_theta) == (8, 8, 32, 10000.0)
    assert (c.rms_norm_eps, c.hidden_size, c.intermediate_size, c.max_position) == (1e-5, 256, 512, 128)
    meta.update({"llama.attention.head_count_kv": 2, "llama.attention.key_length": 64,
                 "llama.attention.value_length": 64, "llama.rope.freq_base": 5e5})
    c = config_from_metadata(meta, "x.gguf", vocab_size=100, tied=True)
    assert (c.num_kv_heads, c.head_dim, c.rope_theta) == (2, 64, 5e5)


def test_not_a_model_path(tmp_path):
    p = tmp_path / "weights.txt"
    p.write_text("x")
    with pytest.raises(ValueError, match="not a model this runner reads"):
        qz.load_model(p)
    with pytest.raises(FileNotFoundError):
        qz.load_model(tmp_path / "nope.gguf")


def test_generate_sampling_and_stop(tmp_path):
    """Sampling with a seed is reproducible; top_k=1 equals greedy; stop strings cut the text."""
    from quantzoo.model.generate import generate, sample

    lg = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert sample(lg) == 1
    g = torch.Generator().manual_seed(0)
    draws = {sample(lg, 1.0, top_k=2, generator=g) for _ in range(200)}
    assert draws == {1, 3}                                   # top-k keeps exactly two
    g = torch.Generator().manual_seed(0)
    # softmax: p1 = 0.479, p3 = 0.433, p2 = 0.065, p0 = 0.024
    assert {sample(lg, 1.0, top_p=0.45, generator=g) for _ in range(200)} == {1}
    assert {sample(lg, 1.0, top_p=0.9, generator=g) for _ in range(300)} == {1, 3}
    assert {sample(lg, 1.0, top_p=0.95, generator=g) for _ in range(400)} == {1, 2, 3}
    with pytest.raises(ValueError, match="top_p"):
        sample(lg, 1.0, top_p=0.0)

    path = tmp_path / "m.gguf"
    write_gguf(path, hf_model("llama", seed=3), "llama", "q8_0")
    model = qz.load_model(path, progress=False)
    ids = [3, 4, 5, 6]
    a = model.generate(ids, max_new_tokens=12, temperature=0.9, seed=7, eos_token_ids=[])
    b = model.generate(ids, max_new_tokens=12, temperature=0.9, seed=7, eos_token_ids=[])
    assert a == b and len(a) == 12
    greedy = model.generate(ids, max_new_tokens=12, eos_token_ids=[])
    assert model.generate(ids, max_new_tokens=12, temperature=1.5, top_k=1, seed=1,
                          eos_token_ids=[]) == greedy
    r = generate(model, ids, max_new_tokens=12, eos_token_ids=[greedy[3]])
    assert r.stop_reason == "eos" and r.tokens == greedy[:4]


@pytest.mark.parametrize("logits,kw,want", [
    # temperature: softmax(logits / T), above 1 as below
    ([0.0, 1.0, 2.0, 3.0], dict(temperature=2.0), None),
    ([0.0, 1.0, 2.0, 3.0], dict(temperature=0.5), None),
    # top-k 2 at T = 1: the two largest, renormalised
    ([0.0, 1.0, 2.0, 3.0], dict(temperature=1.0, top_k=2), {2: 1 / (1 + np.e), 3: np.e / (1 + np.e)}),
    # top-p 0.5 over p = (.3, .3, .2, .2): the first two reach it, each drawn half the time
    (np.log([0.3, 0.3, 0.2, 0.2]).tolist(), dict(temperature=1.0, top_p=0.5), {0: 0.5, 1: 0.5}),
])
def test_sampling_frequencies_follow_the_distribution(logits, kw, want):
    """Seeded draws (fixed seed: deterministic) against float64 probabilities computed here:
    the temperature divides the logits, top-k / top-p renormalise over the tokens they keep.
    4000 draws: one standard error is <= 0.008, the tolerance 0.035."""
    from quantzoo.model.generate import sample

    lg = np.asarray(logits, dtype=np.float64)
    if want is None:
        p = np.exp(lg / kw["temperature"] - (lg / kw["temperature"]).max())
        want = dict(enumerate(p / p.sum()))
    g = torch.Generator().manual_seed(1234)
    n = 4000
    draws = np.bincount([sample(torch.tensor(logits, dtype=torch.float32), generator=g, **kw)
                         for _ in range(n)], minlength=len(logits)) / n
    for tok in range(len(logits)):
        assert abs(draws[tok] - want.get(tok, 0.0)) < 0.035, (tok, draws, want)


@pytest.mark.parametrize("kw", [dict(temperature=1.0, min_p=0.1), dict(temperature=0.6, min_p=0.3),
                                dict(temperature=1.3, top_k=20, top_p=0.9, min_p=0.25),
                                dict(temperature=1.0, top_p=0.95, min_p=0.3), dict(temperature=0.8, min_p=1.0)])
def test_filters_keep_what_transformers_warpers_keep(kw):
    """temperature, top-k, top-p and min-p against transformers' own logits warpers, applied in
    its order (the outside oracle): a token they remove is never drawn, and 4000 seeded draws
    over 48 random logits (ties at the top for min-p 1) follow their renormalised probabilities
    (tolerance 0.035, one standard error <= 0.008)."""
    from transformers.generation import logits_process as lp

    from quantzoo.model.generate import sample

    rng = np.random.default_rng()
    warpers = [lp.TemperatureLogitsWarper(kw["temperature"])]
    if kw.get("top_k"):
        warpers.append(lp.TopKLogitsWarper(kw["top_k"]))
    if kw.get("top_p", 1.0) < 1:
        warpers.append(lp.TopPLogitsWarper(kw["top_p"]))
    for _ in range(100):   # logits where min-p cuts some of what the other filters kept
        lg = (rng.standard_normal(48) * 2).astype(np.float32)
        lg[rng.integers(0, 48, 3)] = lg.max()
        scores = torch.from_numpy(lg)[None].clone()
        for w in warpers:
            scores = w(None, scores)
        before = int(torch.isfinite(scores).sum())
        scores = lp.MinPLogitsWarper(kw["min_p"])(None, scores)
        if int(torch.isfinite(scores).sum()) < before:
            break
    else:
        pytest.fail(f"no logits drawn where min-p cuts anything: {kw}")
    want = torch.softmax(scores[0].double(), dim=-1).numpy()
    g = torch.Generator().manual_seed(int(rng.integers(0, 2**31)))
    n = 4000
    draws = np.bincount([sample(torch.from_numpy(lg), generator=g, **kw) for _ in range(n)], minlength=48) / n
    assert not draws[want == 0].any(), (np.flatnonzero(draws * (want == 0)), kw)
    assert np.abs(draws - want).max() < 0.035, (draws, want)
    if kw["min_p"] == 1.0:
        assert set(np.flatnonzero(draws)) == set(np.flatnonzero(lg == lg.max()))


@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.9), (4.0, 0.999), (1.0, 0.3), (1e-30, 0.5)])
def test_top_p_draws_equal_a_scan_of_the_whole_vocabulary(temperature, top_p):
    """sample() copies only a prefix of the sorted probabilities to the host (growing it while
    its mass is short of top_p); the draw must be the one a scan of the whole sorted vocabulary
    gives (numpy here: stable sort, float64 running sums, the tokens whose preceding mass is below
    top_p, inverse CDF with the same uniform). Logits with ties, -inf and a wide spread; at
    temperature 4 the set spans thousands of tokens."""
    from quantzoo.model.generate import sample

    rng = np.random.default_rng()
    V = 49152
    lg = (rng.standard_normal(V) * 3).astype(np.float32)
    lg[rng.integers(0, V, 500)] = lg.max()                    # ties at the top
    lg[rng.integers(0, V, 5000)] = -np.inf
    seed = int(rng.integers(0, 2**31))
    got = sample(torch.from_numpy(lg), temperature, top_p=top_p, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed)
    t = torch.from_numpy(lg).float()
    p = torch.softmax((t - t.max()) / max(temperature, np.finfo(np.float32).tiny), dim=-1).numpy()
    order = np.argsort(-p, kind="stable")
    ps = p[order].astype(np.float64)
    cdf = np.cumsum(ps)
    keep = max(1, min(int((ps > 0).sum()), int((cdf - ps < top_p).sum())))
    u = float(torch.rand((), generator=g, dtype=torch.float64))
    j = min(int(np.searchsorted(cdf[:keep], u * cdf[keep - 1], side="right")), keep - 1)
    assert got == int(order[j]), (temperature, top_p, keep)
    if temperature == 4.0:
        assert keep > 1024   # the prefix had to grow


def test_emulate_mode_tracks_the_dequant_path(tmp_path):
    """matmul_mode="emulate" runs the GPU kernels' arithmetic (Q8_1 activations) through
    quantzoo.ops on CPU: close to the float32 path (Q8_1 rounding only), not equal to it."""
    m = hf_model("llama", seed=4)
    path = tmp_path / "m.gguf"
    write_gguf(path, m, "llama", "q4_0")
    ids = list(range(3, 30))
    a = qz.load_model(path, progress=False).logits(ids)
    b = qz.load_model(path, progress=False, matmul_mode="emulate").logits(ids)
    nmse = float(((a - b) ** 2).sum() / (a ** 2).sum())
    assert 0 < nmse < 1e-2, nmse   # measured 2.2e-3 (2 layers, q4_0 weights, Q8_1 activations)


@pytest.mark.parametrize("fmt", ["awq", "q4_0", "q8_0", "fp16"])
def test_fused_projections_equal_separate(fmt):
    """On CUDA q/k/v and gate/up run as one fused linear each; the fusion (row / AWQ column
    concatenation of the stored weights) must not change the result: checked here on CPU."""
    from quantzoo.bench.model import make_config, synthetic_weights
    from quantzoo.model import build_model

    cfg = make_config(2, tiny=True)
    w = synthetic_weights(fmt, cfg, "cpu")
    m1 = build_model(cfg, w, fuse=False)
    m2 = build_model(cfg, w, fuse=True)
    assert m1.layers[0].qkv is None
    assert m2.layers[0].qkv is not None and m2.layers[0].gate_up is not None
    assert m2.formats == m1.formats and m2.weight_bytes() == m1.weight_bytes()
    ids = [5, 17, 300, 2, 999, 41]
    torch.testing.assert_close(m1.logits(ids), m2.logits(ids), rtol=1e-5, atol=1e-5)
    assert m1.generate(ids, 6, eos_token_ids=[]) == m2.generate(ids, 6, eos_token_ids=[])


def test_kv_cache_is_sized_on_demand_and_bounded(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, hf_model("llama", seed=6), "llama", "q8_0")
    m = qz.load_model(path, progress=False, max_seq=200)
    m.generate([1, 2, 3], max_new_tokens=5, eos_token_ids=[])
    assert m.k_cache.shape[3] == 200          # min(max_seq, round_up(8, 256))
    with pytest.raises(ValueError, match="exceeds the model's max_seq 200"):
        m.generate(list(range(1, 150)), max_new_tokens=60)
    m2 = qz.load_model(path, progress=False)
    m2.prefill(list(range(1, 40)))
    assert m2.k_cache.shape[3] == DIMS["ctx"]   # 256 = the file's context length


def test_dequantizing_past_the_memory_available_is_refused(tmp_path, monkeypatch):
    """A K-quant file grows ~7x as float32: past the memory available, one MemoryError naming the
    sizes before any tensor is dequantized (the OOM killer would end the load with no message)."""
    from quantzoo.model import host_memory

    m = kquant_model()
    b = kquant_bytes(np.random.default_rng(5), 64, 256, "Q6_K")
    path = tmp_path / "big.gguf"
    write_gguf(path, m, "llama", None, drop=("output.weight",),
               extra_tensors={"output.weight": (b, gguf.GGMLQuantizationType.Q6_K)})
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 32 * 1024)   # 64 x 256 x 4 = 64 KiB
    with pytest.warns(UserWarning), pytest.raises(
            MemoryError, match=r"big\.gguf: its Q6_K tensors take 0\.1 MiB dequantized to float32 at "
                               r"load; 0\.0 MiB of memory is available"):
        qz.load_model(path, progress=False)


def test_memory_refusal_counts_the_dequantizers_working_copy(tmp_path, monkeypatch):
    """gguf-py's dequantize holds about one more float32 copy of the tensor it works on (its
    peak, measured here with tracemalloc, is ~2x the result): memory for the results alone but
    not for that peak is refused too, where before the load went on into the OOM killer."""
    import tracemalloc

    from quantzoo.model import host_memory

    b = kquant_bytes(np.random.default_rng(5), 64, 256, "Q6_K")
    tracemalloc.start()
    gguf.quants.dequantize(b, gguf.GGMLQuantizationType.Q6_K)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak > 1.9 * 64 * 256 * 4
    path = tmp_path / "peak.gguf"
    write_gguf(path, kquant_model(), "llama", None, drop=("output.weight",),
               extra_tensors={"output.weight": (b, gguf.GGMLQuantizationType.Q6_K)})
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 3 * 64 * 256 * 2)   # 1.5x: the result fits, the peak not
    with pytest.warns(UserWarning), pytest.raises(MemoryError, match=r"peak\.gguf: its Q6_K tensors take"):
        qz.load_model(path, progress=False)


def test_a_corrupt_array_count_or_value_type_names_the_key(tmp_path):
    """gguf-py reads an array item by item, and past the end of the file its reads come back empty
    without moving on: a count of 2**40 looped until the OOM killer. Refused at once, by key; a
    value type no GGUF has is named by its key too (it said only "cannot parse the header")."""
    good = tmp_path / "good.gguf"
    write_gguf(good, hf_model("llama"), "llama", kv=TOK_KV)
    r = gguf.GGUFReader(str(good))
    parts = r.fields["tokenizer.ggml.merges"].parts
    count_at = parts[4].ctypes.data - r.data.ctypes.data      # [key len, key, type, item type, count, ...]
    type_at = r.fields["llama.block_count"].parts[2].ctypes.data - r.data.ctypes.data
    del r, parts
    _refused_with(good, tmp_path, [
        ("count", count_at, np.uint64(2**40).tobytes(),
         "metadata key 'tokenizer.ggml.merges': an array of 1099511627776 items of type 8 runs past the end"),
        ("type", type_at, np.uint32(99).tobytes(),
         "metadata key 'llama.block_count' (or the one before it): cannot parse its value")])


def _refused_with(good, tmp_path, cases):
    """Each (name, byte offset, bytes, message start): `good` with those bytes written at that
    offset (past its end: appended) is refused with one short line that starts so, naming it."""
    for what, pos, value, needle in cases:
        data = bytearray(good.read_bytes())
        data[pos:pos + len(value)] = value
        bad = tmp_path / f"{what}.gguf"
        bad.write_bytes(bytes(data))
        with pytest.raises(ValueError) as e:
            qz.load_model(bad, progress=False)
        assert str(e.value).startswith(f"{bad}: {needle}"), str(e.value)
        assert len(str(e.value)) < 300 and "\n" not in str(e.value)


def test_counts_lengths_and_a_shrunk_last_tensor_are_refused(tmp_path, monkeypatch):
    """Corruptions a fuzzer found passing: a token_type count that fits in the file but not the
    vocabulary (gguf-py then parsed it item by item for minutes, growing gigabytes), any metadata
    array past MAX_ARRAY_ITEMS (lowered here), a key length of 90 MB (it went into the message
    whole), and the last tensor's type shrunk F32 -> F16 or bytes appended to the file (the bytes
    left over were ignored: a one-bit flip made the real model talk nonsense)."""
    from quantzoo.model import gguf_loader

    good = tmp_path / "good.gguf"
    write_gguf(good, hf_model("llama"), "llama",
               kv={**TOK_KV, "tokenizer.ggml.token_type": [1] * len(TOK_KV["tokenizer.ggml.tokens"])})
    r = gguf.GGUFReader(str(good))
    base = r.data.ctypes.data

    def at(arr):   # an array's byte offset in the file (gguf-py's parts are views of its memmap)
        return arr.ctypes.data - base

    ntok = int(r.fields["tokenizer.ggml.tokens"].parts[4][0])
    last = r.tensors[-1]
    cases = [("count", at(r.fields["tokenizer.ggml.token_type"].parts[4]), np.uint64(ntok + 1).tobytes(),
              f"metadata key 'tokenizer.ggml.token_type' has {ntok + 1} entries, tokenizer.ggml.tokens {ntok}"),
             ("keylen", at(r.fields["general.architecture"].parts[0]), np.uint64(90_000_000).tobytes(),
              "the metadata key (or tensor name) at byte "),
             ("append", len(r.data), b"\0", "1 byte(s) follow the last tensor's data")]
    if last.tensor_type == gguf.GGMLQuantizationType.F32:
        cases.append(("shrunk", at(last.field.parts[4]), np.uint32(gguf.GGMLQuantizationType.F16).tobytes(),
                      f"{last.n_elements * 2} byte(s) follow the last tensor's data (tensor {last.name!r}, F16"))
    assert len(cases) == 4, "the last tensor is expected in F32 (a norm)"
    del r, last
    _refused_with(good, tmp_path, cases)
    monkeypatch.setattr(gguf_loader, "MAX_ARRAY_ITEMS", ntok - 1)
    with pytest.raises(ValueError, match=r"metadata key 'tokenizer.ggml.tokens': an array of \d+ items, more than"):
        qz.load_model(good, progress=False)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_sliding_window_key_caps_a_llama_context_only(tmp_path, arch):
    """{arch}.attention.sliding_window (quantzoo's Mistral export writes it for llama) ends the
    runner's context at the window for llama; qwen3 GGUFs never carry it (llama.cpp's qwen3 reads
    none), and one that does keeps its context."""
    path = tmp_path / f"{arch}.gguf"
    m = hf_model(arch)
    write_gguf(path, m, arch, kv={f"{arch}.attention.sliding_window": 16})
    c = qz.load_model(path, progress=False).config
    ctx = m.config.max_position_embeddings
    want = (16, 16, ctx) if arch == "llama" else (ctx, None, None)
    assert (c.max_position, c.sliding_window, c.context_length) == want


def test_a_long_tensor_name_is_cut_in_every_message(tmp_path):
    """A key or tensor name in a message is cut to 80 characters as repr writes it (NULs grow
    fourfold), but only where the name was read (_get_str): the tensor checks after it (type,
    offset, span: _build_tensors) and the loader's unexpected tensor named it whole, a name of
    300 NULs making a message of ~1,300 characters on one line."""
    name = "\x00" * 300
    shown = repr("\x00" * 19 + "...")   # (19 x 4 + 3 characters: 79, 81 with the quotes)
    good = tmp_path / "good.gguf"
    write_gguf(good, hf_model("llama"), "llama", extra_tensors={name: (np.zeros(32, np.float32), None)})
    r = gguf.GGUFReader(str(good))
    t = {t.name: t for t in r.tensors}[name]
    type_at, offset_at = (t.field.parts[i].ctypes.data - r.data.ctypes.data for i in (-2, -1))
    del r, t
    with pytest.raises(ValueError) as e:
        qz.load_model(good, progress=False)
    assert str(e.value) == f"{good}: unexpected tensor {shown} for a llama model (unknown name)"
    _refused_with(good, tmp_path, [
        ("type99", type_at, np.uint32(99).tobytes(), f"tensor {shown}: unknown ggml type number 99"),
        ("offset8", offset_at, np.uint64(8).tobytes(), f"tensor {shown}: data offset 8 is not a multiple")])
