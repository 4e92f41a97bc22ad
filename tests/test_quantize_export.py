"""`quantzoo quantize`: the files it writes, read back by outside readers, and its errors.

AWQ directories are unpacked here the way AutoAWQ's own dequantizer does it (shift every
nibble out, undo the [0, 4, 1, 5, 2, 6, 3, 7] order, subtract repeated zeros, scale), GGUF files
are read with gguf-py's GGUFReader and gguf.quants.dequantize (llama.cpp's own layout).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import helpers_models as H
from quantzoo.cli import main as cli
from quantzoo.formats import get

SPEC = "qwen3-hd128-untied"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("q")
    path, model, tok = H.make_model_dir(SPEC, root)
    return {"root": root, "dir": path, "orig": H.read_safetensors_dir(path), "tok": tok}


def autoawq_dequantize(qweight, qzeros, scales, group_size):
    """AutoAWQ-style unpacking in torch: int32 [K, N/8] -> float32 [K, N] (in, out)."""
    shifts = torch.arange(0, 32, 4)
    qw, qz = torch.from_numpy(qweight), torch.from_numpy(qzeros)
    iw = torch.bitwise_right_shift(qw[:, :, None], shifts[None, None, :]).reshape(qw.shape[0], -1)
    iz = torch.bitwise_right_shift(qz[:, :, None], shifts[None, None, :]).reshape(qz.shape[0], -1)
    order = torch.arange(iw.shape[-1]).reshape(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].reshape(-1)
    iw, iz = iw[:, order] & 0xF, iz[:, order] & 0xF
    s = torch.from_numpy(scales).float()
    return ((iw - iz.repeat_interleave(group_size, 0)).float() * s.repeat_interleave(group_size, 0)).numpy()


def test_awq_dir_layout_is_autoawq_and_vllm_layout(src):
    dst = src["root"] / "awq64"
    assert cli(["quantize", str(src["dir"]), str(dst), "--format", "awq", "--group-size", "64", "--quiet"]) == 0
    from safetensors.numpy import load_file

    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 64,
                                          "zero_point": True, "version": "gemm",
                                          "modules_to_not_convert": None}
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["torch_dtype"] == "float16"
    assert cfg.get("dtype", "float16") == "float16"
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dst / f).read_bytes() == (src["dir"] / f).read_bytes()
    # the weights readable as the other files are (safetensors' save_file writes 0600)
    assert (dst / "model.safetensors").stat().st_mode & 0o777 == (dst / "config.json").stat().st_mode & 0o777
    t = load_file(str(dst / "model.safetensors"))
    orig = src["orig"]
    expect_keys = set()
    for name, w in orig.items():
        if ".layers." in name and w.ndim == 2:
            m = name[:-len(".weight")]
            expect_keys |= {m + ".qweight", m + ".qzeros", m + ".scales"}
            n, k = w.shape
            qw, qz, sc = t[m + ".qweight"], t[m + ".qzeros"], t[m + ".scales"]
            assert (qw.dtype, qw.shape) == (np.int32, (k, n // 8))
            assert (qz.dtype, qz.shape) == (np.int32, (k // 64, n // 8))
            assert (sc.dtype, sc.shape) == (np.float16, (k // 64, n))
            deq = autoawq_dequantize(qw, qz, sc, 64)            # [in, out]
            np.testing.assert_array_equal(deq.T, get("awq").dequantize(get("awq").quantize(w, group_size=64)))
            s = sc.astype(np.float32).repeat(64, 0).T
            assert (np.abs(deq.T - w) <= s * 1.001).all()       # round to nearest: within a step
        else:
            expect_keys.add(name)
            assert t[name].dtype == np.float16
            np.testing.assert_array_equal(t[name], w.astype(np.float16))
    assert set(t) == expect_keys


def _fields(reader):
    return {k: f.contents() for k, f in reader.fields.items()}


@pytest.mark.parametrize("fmt", ["q4_0", "q5_1", "q8_0"])
def test_gguf_file_reads_back_with_gguf_py(src, fmt):
    import gguf

    dst = src["root"] / f"m-{fmt}.gguf"
    assert cli(["quantize", str(src["dir"]), str(dst), "--format", fmt, "--quiet"]) == 0
    r = gguf.GGUFReader(str(dst))
    f = _fields(r)
    spec = H.SPECS[SPEC]
    assert f["general.architecture"] == "qwen3"
    want = {"block_count": spec.layers, "embedding_length": spec.hidden,
            "feed_forward_length": spec.intermediate, "attention.head_count": spec.heads,
            "attention.head_count_kv": spec.kv_heads, "attention.key_length": spec.head_dim,
            "context_length": 512}
    for k, v in want.items():
        assert f[f"qwen3.{k}"] == v, k
    assert f["qwen3.rope.freq_base"] == pytest.approx(spec.rope_theta)
    assert f["qwen3.attention.layer_norm_rms_epsilon"] == pytest.approx(spec.eps)
    assert f["general.file_type"] == getattr(gguf.LlamaFileType, f"MOSTLY_{fmt.upper()}")
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "qwen2"
    tokens, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"]
    assert len(tokens) == spec.vocab == len(types)
    tok = src["tok"]
    assert tokens[tok.token_to_id("<|im_end|>")] == "<|im_end|>"
    assert types[tok.token_to_id("<|im_end|>")] == gguf.TokenType.CONTROL
    assert tokens[-1] == f"[PAD{spec.vocab - 1}]" and types[-1] == gguf.TokenType.UNUSED
    assert f["tokenizer.ggml.eos_token_id"] == tok.token_to_id("<|im_end|>")
    assert f["tokenizer.chat_template"] == H.CHATML
    assert len(f["tokenizer.ggml.merges"]) > 0
    # tensors: names, types, and values equal to the codec's (llama.cpp layout via gguf-py)
    t = {x.name: x for x in r.tensors}
    orig = src["orig"]
    qt = getattr(gguf.GGMLQuantizationType, fmt.upper())
    assert t["token_embd.weight"].tensor_type == qt and t["output.weight"].tensor_type == qt
    assert t["blk.1.attn_q_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    for hf, gg in (("model.layers.1.self_attn.q_proj.weight", "blk.1.attn_q.weight"),
                   ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight"),
                   ("lm_head.weight", "output.weight")):
        x = t[gg]
        assert x.tensor_type == qt
        got = gguf.quants.dequantize(np.asarray(x.data), x.tensor_type).reshape(orig[hf].shape)
        np.testing.assert_array_equal(got, gguf.quants.dequantize(gguf.quants.quantize(orig[hf], qt), qt))
    np.testing.assert_array_equal(np.asarray(t["output_norm.weight"].data), orig["model.norm.weight"])
    assert len(t) == len(orig)


def test_gguf_tokenizer_rebuilt_by_the_runner_matches_hf(src):
    """The runner's GGUF loader rebuilds the BPE from our metadata: same ids as tokenizer.json."""
    from quantzoo.model.gguf_loader import load_gguf
    from quantzoo.model.hf_loader import load_tokenizer

    dst = src["root"] / "tok-q8_0.gguf"
    assert cli(["quantize", str(src["dir"]), str(dst), "--format", "q8_0", "--quiet"]) == 0
    _, _, gtok = load_gguf(str(dst), progress=False)
    htok = load_tokenizer(src["dir"])
    texts = [H.PROMPT, "It's 12345 o'clock!\n\n  (really)\tTAB", "<|im_start|>user\nhi<|im_end|>",
             "naïve café — ünïcödé 日本語", ""]
    for s in texts:
        assert gtok.encode(s) == htok.encode(s), s
        assert gtok.decode(gtok.encode(s)) == s
    assert gtok.eos_token_ids[0] == htok.eos_token_ids[0]
    msgs = [{"role": "user", "content": "hi"}]
    assert gtok.apply_chat_template(msgs) == htok.apply_chat_template(msgs)


def test_gguf_source_carries_tokenizer_metadata_over(src):
    import gguf

    a = src["root"] / "carry-q8_0.gguf"
    b = src["root"] / "carry-q4_1.gguf"
    assert cli(["quantize", str(src["dir"]), str(a), "--format", "q8_0", "--quiet"]) == 0
    assert cli(["quantize", str(a), str(b), "--format", "q4_1", "--quiet"]) == 0
    fa, fb = _fields(gguf.GGUFReader(str(a))), _fields(gguf.GGUFReader(str(b)))
    tok_keys = sorted(k for k in fa if k.startswith("tokenizer."))
    assert tok_keys and tok_keys == sorted(k for k in fb if k.startswith("tokenizer."))
    for k in tok_keys:
        assert fa[k] == fb[k], k
    assert fb["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_1
    # and a GGUF source to an HF AWQ dir gets a working tokenizer.json
    d = src["root"] / "from-gguf-awq"
    assert cli(["quantize", str(a), str(d), "--format", "awq", "--quiet"]) == 0
    from quantzoo.model.hf_loader import load_hf, load_tokenizer

    cfg, _, tok, _ = load_hf(d, progress=False)
    assert tok.encode(H.PROMPT) == load_tokenizer(src["dir"]).encode(H.PROMPT)
    assert cfg.eos_token_ids[0] == src["tok"].token_to_id("<|im_end|>")  # + llama.cpp's other EOG ids


def test_group_size_error_suggests_64(tmp_path, capsys):
    path, _, _ = H.make_model_dir("qwen3-g64-only", tmp_path)
    assert cli(["quantize", str(path), str(tmp_path / "out"), "--format", "awq", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--group-size 128 does not divide in_features=192" in err and "use --group-size 64" in err
    assert not (tmp_path / "out").exists()
    assert cli(["quantize", str(tmp_path / "absent"), str(tmp_path / "out"), "--format", "awq", "--group-size",
                "48"]) == 2   # (refused before SRC is read)
    assert "--group-size 48 is not supported; choose one of (32, 64, 128)" in capsys.readouterr().err


@pytest.mark.parametrize("dst,fmt,needle", [
    ("x.gguf", "awq", "a .gguf file cannot hold AWQ weights"),
    ("xdir", "q4_0", "give DST a .gguf name"),
    ("x.bin", "q8_0", "a KuiperLLama .bin holds AWQ weights only"),
])
def test_format_destination_mismatch(src, capsys, dst, fmt, needle):
    assert cli(["quantize", str(src["dir"]), str(src["root"] / dst), "--format", fmt, "--quiet"]) == 2
    assert needle in capsys.readouterr().err


def test_formats_offered_are_the_ones_a_dst_writes(tmp_path, capsys):
    """--format offers the registry's stored formats that some DST is written in: every one with a
    ggml type as .gguf, AWQ and fp16 as a directory, AWQ as a .bin. A registry format none of
    them writes (numpy reference only, no ggml type) was offered too, and then every DST refused
    it with an error that named another (\"llama.cpp formats are written as GGUF\")."""
    from quantzoo.formats import base, names
    from quantzoo.model.export import DESTINATIONS, FORMATS

    stored = [n for n in names() if get(n).kind != "activation"]
    assert set(DESTINATIONS["gguf"]) == {n for n in stored if get(n).gguf_type}
    assert list(FORMATS) == [n for n in stored if any(n in d for d in DESTINATIONS.values())]
    plain = type("Plain", (base.Format,), {"name": "plain"})()   # a format no DST writes
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(base._REGISTRY, "plain", plain)
        for dst in ("o.gguf", "odir", "o.bin"):
            with pytest.raises(SystemExit):   # argparse: not one of the choices
                cli(["quantize", str(tmp_path / "absent"), str(tmp_path / dst), "--format", "plain"])
            assert "invalid choice: 'plain'" in capsys.readouterr().err
            from quantzoo.model.export import export

            with pytest.raises(ValueError, match="--format plain: no DST is written in it"):
                export(tmp_path / "absent", tmp_path / dst, "plain")
    assert not list(tmp_path.iterdir())


def test_missing_source(src, capsys):
    assert cli(["quantize", str(src["root"] / "nope"), str(src["root"] / "o.gguf"), "--format", "q4_0"]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def llama_cpp_converter_bytes(ours, orig: dict, spec, dst) -> bytes:
    """The GGUF llama.cpp's converter (convert_hf_to_gguf.py, prepare_tensors) writes with gguf-py
    for `orig` in the type of `ours`' general.file_type: each 2-D tensor through
    gguf.quants.quantize, and where that raises QuantError (in_features not whole blocks) F16
    instead; 1-D tensors F32; llama's Q/K rows permuted (LlamaModel.permute). Metadata and tensor
    order are taken from `ours` (what is checked here is the tensors' types and bytes, and the layout
    gguf-py gives them)."""
    import gguf

    from quantzoo.model.gguf_loader import gguf_to_hf_name

    r = gguf.GGUFReader(str(ours))
    ftype = gguf.LlamaFileType(r.fields["general.file_type"].contents())
    qtype = gguf.GGMLQuantizationType[ftype.name[len("MOSTLY_"):]]
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        types = list(f.types)
        w.add_key_value(name, f.contents(), types[0], sub_type=types[-1] if len(types) > 1 else None)
    for t in r.tensors:
        hf = gguf_to_hf_name(t.name)
        data = orig[hf]
        if spec.arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            n_head = spec.heads if "q_proj" in hf else spec.kv_heads
            data = data.reshape(n_head, 2, data.shape[0] // n_head // 2, -1).swapaxes(1, 2).reshape(data.shape)
        dtype = gguf.GGMLQuantizationType.F32 if data.ndim == 1 else qtype
        try:
            q = gguf.quants.quantize(data, dtype)
        except gguf.QuantError:
            dtype = gguf.GGMLQuantizationType.F16
            q = gguf.quants.quantize(data, dtype)
        w.add_tensor(t.name, q, raw_dtype=dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst.read_bytes()


@pytest.mark.parametrize("spec", ["qwen3-hd128-untied", "llama-gqa"])
def test_gguf_of_whole_blocks_is_unchanged(tmp_path, spec):
    """Every in_features a multiple of 32: no F16 fallback and no warning; the file is byte for
    byte what llama.cpp's converter writes through gguf-py (every 2-D weight in the type)."""
    import warnings

    import gguf

    path, _, _ = H.make_model_dir(spec, tmp_path)
    orig = H.read_safetensors_dir(path)
    dst = tmp_path / "m.gguf"
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert cli(["quantize", str(path), str(dst), "--format", "q4_0", "--quiet"]) == 0
    assert not [str(x.message) for x in rec if "F16" in str(x.message)]
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(dst)).tensors if len(t.shape) == 2}
    assert types == {"Q4_0"}
    assert dst.read_bytes() == llama_cpp_converter_bytes(dst, orig, H.SPECS[spec], tmp_path / "ref.gguf")


# the weights whose in_features 32 does not divide: qwen3-ffn200's ffn_down (200); llama-hidden80's
# embeddings, lm_head, q/k/v and gate/up (80), while its o_proj (128) and ffn_down (256) fit
F16_FALLBACK = {"qwen3-ffn200": {"ffn_down"},
                "llama-hidden80": {"token_embd", "output", "attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"}}


@pytest.mark.parametrize("spec", list(F16_FALLBACK))
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_gguf_stores_weights_of_partial_blocks_as_f16(tmp_path, spec, fmt):
    """A weight whose in_features is not whole 32-value blocks is written F16, as llama.cpp's
    converter falls back (the file equals the one its rule writes through gguf-py), the others in
    fmt and general.file_type MOSTLY_<fmt>; one warning counts and names them; the runner's loader
    reads the F16 tensors as fp16, and a GGUF -> GGUF conversion to the same type keeps every byte."""
    import gguf

    from quantzoo.model.gguf_loader import load_gguf

    path, _, _ = H.make_model_dir(spec, tmp_path)
    orig = H.read_safetensors_dir(path)
    dst = tmp_path / f"m-{fmt}.gguf"
    with pytest.warns(UserWarning) as rec:
        assert cli(["quantize", str(path), str(dst), "--format", fmt, "--quiet"]) == 0
    said = [str(x.message) for x in rec if "F16" in str(x.message)]
    r = gguf.GGUFReader(str(dst))
    assert r.fields["general.file_type"].contents() == getattr(gguf.LlamaFileType, f"MOSTLY_{fmt.upper()}")
    k_of = {t.name: int(t.shape[0]) for t in r.tensors}   # in_features (GGUF lists it first)
    f16 = [t.name for t in r.tensors if t.name.split(".")[-2] in F16_FALLBACK[spec]]
    assert f16 and all(k_of[n] % 32 for n in f16)
    for t in r.tensors:
        want = "F32" if len(t.shape) == 1 else "F16" if t.name in f16 else fmt.upper()
        assert t.tensor_type.name == want, t.name
    n2d = sum(len(t.shape) == 2 for t in r.tensors)
    named = ", ".join(f"{n} (in_features={k_of[n]})" for n in f16[:4])
    more = f", and {len(f16) - 4} more" if len(f16) > 4 else ""
    assert said == [f"{dst}: {len(f16)} of {n2d} weights are stored as F16, not {fmt.upper()}: their in_features "
                    f"is not a multiple of 32, the {fmt.upper()} block size (llama.cpp's converter falls back to "
                    f"F16 so for Q8_0): {named}{more}; general.file_type stays MOSTLY_{fmt.upper()}"], said
    assert dst.read_bytes() == llama_cpp_converter_bytes(dst, orig, H.SPECS[spec], tmp_path / "ref.gguf")
    _, w, _ = load_gguf(str(dst), progress=False)
    from quantzoo.model.export import gguf_name

    for hf, x in w.items():
        if gguf_name(hf) in f16:
            assert isinstance(x, torch.Tensor) and x.dtype == torch.float16, hf
    # GGUF -> GGUF in the same type: quantized blocks copied, F16 tensors through float32 and back
    again = tmp_path / "again.gguf"
    with pytest.warns(UserWarning, match="stored as F16"):
        assert cli(["quantize", str(dst), str(again), "--format", fmt, "--quiet"]) == 0
    ta = {t.name: t for t in r.tensors}
    tb = {t.name: t for t in gguf.GGUFReader(str(again)).tensors}
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].tensor_type == tb[k].tensor_type
        np.testing.assert_array_equal(np.asarray(ta[k].data), np.asarray(tb[k].data), err_msg=k)


def test_f16_fallback_refusing_a_value_says_why_it_is_f16(src, tmp_path, capsys):
    """An fp16 fallback tensor past +-65504 is refused as an fp16 export's is, saying why it is F16."""
    from quantzoo.model.config import ModelConfig
    from quantzoo.model.export import Source, write_gguf

    c = ModelConfig(arch="qwen3", vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=24, rms_norm_eps=1e-6, rope_theta=1e6,
                    max_position=64, tie_word_embeddings=True, qk_norm=True)
    rng = np.random.default_rng(0)
    weights = {n: rng.standard_normal(s).astype(np.float32) for n, s in c.expected_shapes().items()}
    weights["model.embed_tokens.weight"][3, 5] = 1e5
    with pytest.warns(UserWarning, match="stored as F16"), pytest.raises(
            ValueError, match=r"model\.embed_tokens\.weight: values beyond \+-65504 do not fit fp16 \(stored as F16: "
                              r"in_features=48 is not a multiple of 32, the Q4_0 block size\)"):
        write_gguf(Source(tmp_path, c, weights), tmp_path / "bad.gguf", "q4_0", progress=False)
    assert not list(tmp_path.glob("bad.gguf*"))


def test_llama_permutation_roundtrip():
    from quantzoo.model.export import llama_permute
    from quantzoo.model.gguf_loader import unpermute_qk   # the loader undoes the exporter's order

    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)   # 4 heads of head_dim 8
    p = llama_permute(w, 4)
    # head 0: HF rows 0..3 (first half) and 4..7 (second half) interleave as 0,4,1,5,2,6,3,7
    np.testing.assert_array_equal(p[:8, 0], w[[0, 4, 1, 5, 2, 6, 3, 7], 0])
    np.testing.assert_array_equal(unpermute_qk(p, 4), w)


@pytest.mark.parametrize("spec", ["llama-gqa", "qwen3-hd128-untied"])
def test_gguf_to_same_type_is_lossless(tmp_path, spec):
    """q5_0 -> q5_0 copies blocks (no second rounding); llama Q/K rows are unpermuted on load and
    permuted again on write, so every tensor's bytes come back identical."""
    import gguf

    path, _, _ = H.make_model_dir(spec, tmp_path)
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    assert cli(["quantize", str(path), str(a), "--format", "q5_0", "--quiet"]) == 0
    assert cli(["quantize", str(a), str(b), "--format", "q5_0", "--quiet"]) == 0
    ta = {t.name: t for t in gguf.GGUFReader(str(a)).tensors}
    tb = {t.name: t for t in gguf.GGUFReader(str(b)).tensors}
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].tensor_type == tb[k].tensor_type
        np.testing.assert_array_equal(np.asarray(ta[k].data), np.asarray(tb[k].data), err_msg=k)


@pytest.mark.parametrize("name", ["qwen2", "llama-bpe", "smollm", "gpt-2"])
def test_pre_tokenizer_detection(tmp_path, name):
    """tokenizer.ggml.pre is chosen by splitting a probe text: each split the runner knows maps
    back to its own name; an unknown split is an error, not a silent default."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from quantzoo.model.export import detect_pre_tokenizer
    from quantzoo.model.tokenizer import PRE_TOKENIZERS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = PRE_TOKENIZERS[name][0]()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert detect_pre_tokenizer(tmp_path / "tokenizer.json") == name
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="matches none of the splits"):
        detect_pre_tokenizer(tmp_path / "tokenizer.json")


def test_dst_with_another_checkpoint_is_refused(src, capsys):
    d = src["root"] / "stale"
    d.mkdir()
    (d / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert cli(["quantize", str(src["dir"]), str(d), "--format", "awq", "--quiet"]) == 2
    assert "already holds other checkpoint files" in capsys.readouterr().err


def test_awq_source_modules_to_not_convert_stay_fp16(src):
    """An AWQ checkpoint whose config leaves down_proj unconverted: the re-export keeps those
    weights fp16, bit for bit, and carries the list over (it had quantized them and written
    None)."""
    from safetensors.numpy import load_file, save_file

    base = src["root"] / "mtnc-base"
    assert cli(["quantize", str(src["dir"]), str(base), "--format", "awq", "--group-size", "64", "--quiet"]) == 0
    t = load_file(str(base / "model.safetensors"))
    down = sorted(k[: -len(".qweight")] for k in t if k.endswith("mlp.down_proj.qweight"))
    for m in down:
        for key in ("qweight", "qzeros", "scales"):
            del t[f"{m}.{key}"]
        t[m + ".weight"] = src["orig"][m + ".weight"].astype(np.float16)
    save_file(t, str(base / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((base / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["down_proj"]
    (base / "config.json").write_text(json.dumps(cfg))
    out = src["root"] / "mtnc-out"
    assert cli(["quantize", str(base), str(out), "--format", "awq", "--group-size", "64", "--quiet"]) == 0
    t2 = load_file(str(out / "model.safetensors"))
    for m in down:
        assert m + ".qweight" not in t2
        np.testing.assert_array_equal(t2[m + ".weight"], t[m + ".weight"])
    assert any(k.endswith("mlp.up_proj.qweight") for k in t2)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["modules_to_not_convert"] == ["down_proj"]


def test_reused_destination_keeps_no_earlier_tokenizer_files(src, tmp_path):
    """A second export into the same directory from a source without a chat template or
    generation config must not leave the first export's ones behind."""
    out = tmp_path / "out"
    assert cli(["quantize", str(src["dir"]), str(out), "--format", "awq", "--group-size", "64", "--quiet"]) == 0
    (out / "chat_template.jinja").write_text("STALE")
    (out / "additional_chat_templates").mkdir()
    (out / "additional_chat_templates" / "stale.jinja").write_text("STALE")
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in src["dir"].iterdir():
        if f.name not in ("generation_config.json", "chat_template.jinja"):
            (bare / f.name).write_bytes(f.read_bytes())
    assert cli(["quantize", str(bare), str(out), "--format", "awq", "--group-size", "64", "--quiet"]) == 0
    assert not (out / "chat_template.jinja").exists() and not (out / "generation_config.json").exists()
    assert not (out / "additional_chat_templates").exists()
    assert (out / "tokenizer.json").read_bytes() == (src["dir"] / "tokenizer.json").read_bytes()


def test_gguf_name_keeps_a_dotted_directory_name(src, tmp_path):
    import gguf

    dotted = tmp_path / "Model-0.6B"
    dotted.mkdir()
    for f in src["dir"].iterdir():
        (dotted / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "m.gguf"
    assert cli(["quantize", str(dotted), str(out), "--format", "q8_0", "--quiet"]) == 0
    assert _fields(gguf.GGUFReader(str(out)))["general.name"] == "Model-0.6B"


@pytest.mark.parametrize("dst,fmt,value", [("o", "awq", np.nan), ("o.gguf", "q8_0", np.nan),
                                           ("o.gguf", "fp16", -np.inf), ("o.bin", "awq", np.inf)])
def test_non_finite_fp16_tensor_is_named(src, tmp_path, capsys, dst, fmt, value):
    """A NaN or inf in a weight stored as float (a norm: fp16 in an HF dir or .bin, F32 in a
    GGUF) is refused with the file's and tensor's names (by the loader: a corrupt source), as one
    in a quantized weight is, by every format (a GGUF export had written it) and no output is
    left."""
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "nan"
    bad.mkdir()
    for f in src["dir"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    shard = next(bad.glob("*.safetensors"))
    t = load_file(str(shard))
    name = next(k for k in sorted(t) if k.endswith("input_layernorm.weight"))
    t[name] = t[name].copy()
    t[name][3] = value
    save_file(t, str(shard), metadata={"format": "pt"})
    group = ["--group-size", "64"] if fmt == "awq" else []
    assert cli(["quantize", str(bad), str(tmp_path / dst), "--format", fmt, *group, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{shard.name}: tensor '{name}': row 3 holds NaN or inf (1 rows do); the file is corrupt" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan"] + (["o"] if dst == "o" else [])


def _many_tensor_checkpoint(path):
    """An fp16 qwen3 HF dir of many similar-sized tensors (no tokenizer), written directly."""
    from safetensors.numpy import save_file

    from quantzoo.model.hf_loader import parse_config

    cfg = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 1024, "hidden_size": 256,
           "intermediate_size": 768, "num_hidden_layers": 8, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": False, "eos_token_id": 1}
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    shapes = parse_config(cfg)[0].expected_shapes()
    save_file({n: (rng.standard_normal(s) * (0.05 if len(s) == 2 else 1.0) + (len(s) == 1)).astype(np.float16)
               for n, s in shapes.items()}, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("fmt", ["q8_0", "fp16"])
def test_export_streams_tensor_by_tensor(tmp_path, monkeypatch, fmt):
    """A GGUF export writes each tensor as it is made, not holding the whole output
    (GGUFWriter.add_tensor) nor quantizing a whole matrix at once: numpy's traced peak stays far
    below the output size (a Qwen3-8B otherwise needs source + output + ~30 bytes/weight of
    lm_head in RAM). (An HF directory's output is still one save_file dict: not streamed yet.)"""
    import tracemalloc

    import quantzoo.formats.gguf_blocks as gb
    from quantzoo.model.export import export

    monkeypatch.setattr(gb, "QUANTIZE_CHUNK", 1 << 14, raising=False)   # rows at a time, as for a big model
    src = _many_tensor_checkpoint(tmp_path / "src")
    export(src, tmp_path / "warm.gguf", fmt, progress=False)   # imports outside the traced run
    tracemalloc.start()
    try:
        out = export(src, tmp_path / "m.gguf", fmt, progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    size = out.stat().st_size
    assert peak < size / 3, (peak, size)
    assert not list(tmp_path.rglob("*.part"))


@pytest.mark.parametrize("fmt", ["awq", "fp16"])
def test_hf_export_shards_as_transformers_reads_them(src, tmp_path, monkeypatch, fmt):
    """An HF export larger than SHARD_BYTES is written shard by shard (model-0000i-of-0000n and an
    index, as transformers writes them), never held whole: transformers' own loader reads the
    fp16 one back equal to the one-file export, and the runner's logits are the same for both."""
    import quantzoo as qz
    from quantzoo.model import export as E

    one = E.export(src["dir"], tmp_path / "one", fmt, group_size=32, progress=False)
    monkeypatch.setattr(E, "SHARD_BYTES", 20_000)
    many = E.export(src["dir"], tmp_path / "many", fmt, group_size=32, progress=False)
    files = sorted(f.name for f in many.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (many / "model.safetensors").exists() and not list(many.glob("*.part"))
    index = json.loads((many / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    t1, t2 = H.read_safetensors_dir(one), H.read_safetensors_dir(many)
    assert t1.keys() == t2.keys() and all(np.array_equal(t1[k], t2[k]) for k in t1)
    ids = [1, 5, 9, 3]
    a, b = qz.load_model(str(one)).logits(ids), qz.load_model(str(many)).logits(ids)
    assert torch.equal(a, b)
    if fmt == "fp16":
        from transformers import AutoModelForCausalLM

        m1 = AutoModelForCausalLM.from_pretrained(one, torch_dtype=torch.float32)
        m2 = AutoModelForCausalLM.from_pretrained(many, torch_dtype=torch.float32)
        for (n1, p1), (n2, p2) in zip(m1.state_dict().items(), m2.state_dict().items()):
            assert n1 == n2 and torch.equal(p1, p2), n1


def test_hf_export_failing_mid_shard_leaves_no_part(src, tmp_path, monkeypatch):
    """A shard whose save_file fails part-way (a full disk) is removed with the finished ones:
    the failed export leaves no shard-*.part behind (it could be gigabytes on a full disk)."""
    import safetensors.numpy as sn

    from quantzoo.model import export as E

    monkeypatch.setattr(E, "SHARD_BYTES", 20_000)
    real, calls = sn.save_file, []

    def failing(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 3:
            with open(filename, "wb") as f:
                f.write(b"partial")
            raise OSError(28, "No space left on device")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(sn, "save_file", failing)
    with pytest.raises(OSError, match="No space"):
        E.export(src["dir"], tmp_path / "out", "fp16", progress=False)
    assert len(calls) == 3
    assert not list((tmp_path / "out").glob("*.part")), sorted(p.name for p in (tmp_path / "out").iterdir())


@pytest.mark.parametrize("fmt,dst", [("q4_0", "m.gguf"), ("awq", "awq")])
def test_export_reads_each_source_tensor_once(src, tmp_path, monkeypatch, fmt, dst):
    """The lazy HF source is read once per tensor: Source.quantized quantizes the tensor it has
    looked up instead of looking it up (reading it from the checkpoint) a second time."""
    import collections

    from quantzoo.model import export as E
    from quantzoo.model import hf_loader as L

    reads, get = collections.Counter(), L._Shards.get

    def counting(self, name):
        reads[name] += 1
        return get(self, name)

    monkeypatch.setattr(L._Shards, "get", counting)
    E.export(src["dir"], tmp_path / dst, fmt, group_size=32, progress=False)
    assert reads and max(reads.values()) == 1, {k: v for k, v in reads.items() if v > 1}


def test_suffixes_pick_the_kind_in_any_case(src, tmp_path):
    """UP.GGUF and o.Bin are a GGUF and a KuiperLLama file like up.gguf and o.bin: UP.GGUF was
    refused ("give DST a .gguf name"), o.Bin written as an HF directory, and the runner refused
    both by name."""
    from quantzoo.model import load_model
    from quantzoo.model.export import awq_group_of

    g, b = tmp_path / "UP.GGUF", tmp_path / "o.Bin"
    assert cli(["quantize", str(src["dir"]), str(g), "--format", "q8_0", "--quiet"]) == 0
    assert cli(["quantize", str(src["dir"]), str(b), "--format", "awq", "--group-size", "64", "--quiet"]) == 0
    assert g.is_file() and b.is_file() and awq_group_of(b) == 64
    for p in (g, b):
        assert load_model(p, progress=False).logits([1, 2, 3]).shape[0] == 3
    assert cli(["quantize", str(b), str(tmp_path / "again.GGUF"), "--format", "q8_0", "--quiet"]) == 0   # a .Bin SRC


@pytest.mark.parametrize("edit,needle", [
    # gguf-py's SpecialVocab raised this unnamed
    (("config.json", lambda c: {**c, "eos_token_id": -1}),
     "its config / tokenizer files do not convert to GGUF (invalid value for special token type eos: -1)"),
    # gguf-py only logged it and wrote a file llama.cpp refuses ("cannot find tokenizer merges")
    (("tokenizer.json", lambda t: {**t, "model": {**t["model"], "merges": []}}),
     "tokenizer.json: a byte-level BPE without merges; llama.cpp cannot load"),
])
def test_tokenizer_gguf_cannot_carry_is_refused_by_name(src, tmp_path, capsys, edit, needle):
    import shutil

    d = tmp_path / "src"
    shutil.copytree(src["dir"], d)
    name, change = edit
    (d / name).write_text(json.dumps(change(json.loads((d / name).read_text()))))
    assert cli(["quantize", str(d), str(tmp_path / "out.gguf"), "--format", "q8_0", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert needle in err and str(d) in err and err.count("\n") == 1, err
    assert not (tmp_path / "out.gguf").exists()


def _copy_with_tokenizer(src_dir, d, tj_edit=None, tc_edit=None):
    """A copy of an HF dir with its tokenizer.json / tokenizer_config.json edited."""
    import shutil

    shutil.copytree(src_dir, d)
    for name, edit in (("tokenizer.json", tj_edit), ("tokenizer_config.json", tc_edit)):
        if edit is not None:
            data = json.loads((d / name).read_text())
            edit(data)
            (d / name).write_text(json.dumps(data))
    return d


@pytest.mark.parametrize("add_eos", [False, True])
def test_gguf_to_hf_tokenizer_adds_bos_and_eos_as_the_gguf_says(src, tmp_path, add_eos):
    """A GGUF whose tokenizer adds BOS (tokenizer.ggml.add_bos_token, and add_eos_token) exported
    to an HF dir: transformers' AutoTokenizer on it adds them as the runner does on the GGUF and
    as transformers does on the original HF dir (Llama 3's TemplateProcessing here). The written
    tokenizer.json had no post_processor, and AutoTokenizer then added neither."""
    import gguf
    from transformers import AutoTokenizer

    from quantzoo.model.gguf_loader import load_gguf

    bos, eos = "<|endoftext|>", "<|im_end|>"

    def post_processor(tj):
        ids = {t["content"]: t["id"] for t in tj["added_tokens"]}

        def part(seq, type_id):
            return ([{"SpecialToken": {"id": bos, "type_id": type_id}},
                     {"Sequence": {"id": seq, "type_id": type_id}}]
                    + [{"SpecialToken": {"id": eos, "type_id": type_id}}] * add_eos)

        special = {t: {"id": t, "ids": [ids[t]], "tokens": [t]} for t in (bos, eos)}
        tj["post_processor"] = {"type": "TemplateProcessing", "single": part("A", 0),
                                "pair": part("A", 0) + part("B", 1), "special_tokens": special}

    def config(tc):
        tc["bos_token"] = bos
        del tc["add_bos_token"]   # (the post_processor says it)

    hf = _copy_with_tokenizer(src["dir"], tmp_path / "hf", post_processor, config)
    g, out = tmp_path / "m.gguf", tmp_path / "out"
    assert cli(["quantize", str(hf), str(g), "--format", "q8_0", "--quiet"]) == 0
    f = _fields(gguf.GGUFReader(str(g)))
    assert f["tokenizer.ggml.add_bos_token"] is True and f.get("tokenizer.ggml.add_eos_token", False) is add_eos
    assert cli(["quantize", str(g), str(out), "--format", "fp16", "--quiet"]) == 0
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert (tc["add_bos_token"], tc["add_eos_token"]) == (True, add_eos)
    gtok = load_gguf(str(g), progress=False)[2]
    want, theirs = AutoTokenizer.from_pretrained(hf), AutoTokenizer.from_pretrained(out)
    ids = gtok.encode(H.PROMPT)
    assert ids[0] == gtok.bos_token_id and (ids[-1] == gtok.eos_token_ids[0]) is add_eos
    for text in (H.PROMPT, "", "<|im_start|>user\nhi<|im_end|>"):
        assert theirs(text)["input_ids"] == gtok.encode(text) == want(text)["input_ids"], text
        assert theirs(text, "x")["input_ids"] == want(text, "x")["input_ids"], text


def test_gguf_to_hf_keeps_pad_and_unk_tokens(src, tmp_path):
    """tokenizer.ggml.padding_token_id / unknown_token_id of a GGUF reach the HF dir it is
    exported to (tokenizer_config.json's pad_token / unk_token, config.json's pad_token_id), so
    transformers sees the pad and unk tokens of the original HF dir; an id that is none of the
    tokenizer's is left out. Only BOS and EOS had been carried over."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    def tokens(tj):
        n = len(tj["model"]["vocab"]) + len(tj["added_tokens"])
        tj["added_tokens"] += [{"id": n + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                                "normalized": False, "special": True} for i, t in enumerate(("<pad>", "<unk>"))]

    def config(tc):
        tc.update(pad_token="<pad>", unk_token="<unk>")

    hf = _copy_with_tokenizer(src["dir"], tmp_path / "hf", tokens, config)
    g, out = tmp_path / "m.gguf", tmp_path / "out"
    assert cli(["quantize", str(hf), str(g), "--format", "q8_0", "--quiet"]) == 0
    assert cli(["quantize", str(g), str(out), "--format", "fp16", "--quiet"]) == 0
    want, theirs = AutoTokenizer.from_pretrained(hf), AutoTokenizer.from_pretrained(out)
    assert (theirs.pad_token, theirs.pad_token_id, theirs.unk_token, theirs.unk_token_id) == \
        (want.pad_token, want.pad_token_id, want.unk_token, want.unk_token_id) == \
        ("<pad>", want.convert_tokens_to_ids("<pad>"), "<unk>", want.convert_tokens_to_ids("<unk>"))
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == want.pad_token_id
    from quantzoo.model.export import gguf_token_id

    tok = SimpleNamespace(vocab_size=10)
    for i, ok in ((9, True), (10, False), (-1, False), (True, False), ("3", False)):
        s = SimpleNamespace(gguf_meta=[("tokenizer.ggml.padding_token_id", i, [])], tokenizer=tok)
        assert gguf_token_id(s, "padding") == (i if ok else None), i


def test_hf_to_gguf_carries_the_chat_templates_the_loader_reads(src, tmp_path):
    """An HF dir with a chat_template in tokenizer_config.json and another in chat_template.jinja
    (and a named one in additional_chat_templates/): the GGUF carries the templates that
    transformers and the runner's HF loader use -- the files' -- in llama.cpp's keys. gguf-py's
    SpecialVocab had written tokenizer_config.json's and dropped the named one."""
    import gguf
    from transformers import AutoTokenizer

    from quantzoo.model.gguf_loader import load_gguf
    from quantzoo.model.hf_loader import load_tokenizer

    hf = _copy_with_tokenizer(src["dir"], tmp_path / "hf")
    default = "FILE:{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (hf / "chat_template.jinja").write_text(default)
    (hf / "additional_chat_templates").mkdir()
    (hf / "additional_chat_templates" / "tool_use.jinja").write_text("<tool>{{ messages[0]['content'] }}")
    assert json.loads((hf / "tokenizer_config.json").read_text())["chat_template"] == H.CHATML
    g = tmp_path / "m.gguf"
    assert cli(["quantize", str(hf), str(g), "--format", "q8_0", "--quiet"]) == 0
    f = _fields(gguf.GGUFReader(str(g)))
    assert f["tokenizer.chat_template"] == default and f["tokenizer.chat_templates"] == ["tool_use"]
    assert f["tokenizer.chat_template.tool_use"] == "<tool>{{ messages[0]['content'] }}"
    gtok = load_gguf(str(g), progress=False)[2]
    assert gtok.chat_templates == load_tokenizer(hf).chat_templates
    theirs, msgs = AutoTokenizer.from_pretrained(hf), [{"role": "user", "content": "hi"}]
    assert gtok.apply_chat_template(msgs) == theirs.apply_chat_template(msgs, tokenize=False) == "FILE:hi"
    assert gtok.apply_chat_template(msgs, template="tool_use") == \
        theirs.apply_chat_template(msgs, chat_template="tool_use", tokenize=False) == "<tool>hi"


@pytest.mark.parametrize("link", ["hard", "sym", "sym-entries"])
def test_hf_export_into_a_linked_copy_leaves_the_source_alone(src, tmp_path, link):
    """DST a copy of SRC made of hard links (`cp -al SRC DST`) or symlinks (`cp -as`, or `ln -s
    SRC/* DST/`, its folder too): every file the export writes replaces DST's link, never writes
    through it. config.json was written in place, so the source's own config.json became the AWQ
    one and the source no longer loaded."""
    import os
    import shutil

    from quantzoo.model.hf_loader import load_hf

    hf = _copy_with_tokenizer(src["dir"], tmp_path / "hf")
    (hf / "additional_chat_templates").mkdir()
    (hf / "additional_chat_templates" / "tool_use.jinja").write_text("<tool>")
    before = {p: p.read_bytes() for p in hf.rglob("*") if p.is_file()}
    out = tmp_path / "out"
    if link != "sym-entries":
        shutil.copytree(hf, out, copy_function=os.link if link == "hard" else os.symlink)
    else:
        out.mkdir()
        for p in hf.iterdir():
            (out / p.name).symlink_to(p)
    assert cli(["quantize", str(hf), str(out), "--format", "awq", "--group-size", "64", "--quiet"]) == 0
    assert {p: p.read_bytes() for p in hf.rglob("*") if p.is_file()} == before
    assert "quantization_config" in json.loads((out / "config.json").read_text())
    for p in out.rglob("*"):
        assert not p.is_symlink() and (p.is_dir() or p.stat().st_nlink == 1), p
    load_hf(hf, progress=False)


def test_dst_is_checked_as_given(src, tmp_path, monkeypatch, capsys):
    """DST's checks see the path as given: "" (pathlib's ".", which wrote the model into the
    current directory), "keep.gguf/" (pathlib drops the "/": an existing keep.gguf was replaced)
    and a DST directory whose config.json is a directory (a bare '[Errno 21]' after every weight
    was written) are each refused in one line before anything is written."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    keep, half = tmp_path / "keep.gguf", tmp_path / "half"
    keep.write_bytes(b"precious")
    (half / "config.json").mkdir(parents=True)
    for dst, fmt, needle in (("", "fp16", "DST: an empty path"),
                             (f"{keep}/", "q8_0", f"DST={keep}/: is a directory; give the file to write"),
                             (str(half), "fp16", f"DST={half}: {half}/config.json is a directory, where the "
                                                 "config.json file goes")):
        assert cli(["quantize", str(src["dir"]), dst, "--format", fmt, "--quiet"]) == 2, dst
        err = capsys.readouterr().err.strip()
        assert err.endswith(needle) and "\n" not in err, (dst, err)
    assert list(cwd.iterdir()) == [] and keep.read_bytes() == b"precious"
    assert [p.name for p in half.rglob("*")] == ["config.json"]


@pytest.mark.parametrize("name,fmt", [("o.gguf", "q8_0"), ("o.bin", "awq")])
def test_a_dst_that_cannot_be_created_is_named(src, capsys, name, fmt):
    """/proc takes no new file, though os.access says a root user may write there: the write of
    DST's temporary (DST.part) failed, and the error named only that file, which the user never
    gave. (As another user the up-front check refuses /proc by DST's name already.)"""
    dst = f"/proc/{name}"
    assert cli(["quantize", str(src["dir"]), dst, "--format", fmt, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"DST={dst}" in err and "\n" not in err, err


def test_hf_to_gguf_keeps_a_processor_chat_template(src, tmp_path):
    """A directory whose only chat template is a processor's chat_template.json (which the runner's
    HF loader and transformers' AutoTokenizer do not read): the GGUF carries it, as gguf-py's
    SpecialVocab and llama.cpp's converter take it. (Writing the loader's templates had dropped it.)"""
    import gguf

    hf = _copy_with_tokenizer(src["dir"], tmp_path / "hf", tc_edit=lambda tc: tc.pop("chat_template"))
    (hf / "chat_template.json").write_text(json.dumps({"chat_template": "JSON:{{ messages[0]['content'] }}"}))
    g = tmp_path / "m.gguf"
    assert cli(["quantize", str(hf), str(g), "--format", "q8_0", "--quiet"]) == 0
    f = _fields(gguf.GGUFReader(str(g)))
    assert f["tokenizer.chat_template"] == "JSON:{{ messages[0]['content'] }}" and "tokenizer.chat_templates" not in f
