"""KuiperLLama's AWQ .bin (seed 000 §8.1): header bytes, region order, round trip, bad files."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

import helpers_models as H
from quantzoo.cli import main as cli
from quantzoo.formats import QuantizedTensor
from quantzoo.model.hf_loader import load_hf
from quantzoo.model.kuiper import HEADER_BYTES, MAGIC, load_kuiper, read_header


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("kuiper")
    out = {}
    for spec in ("qwen3-gqa-hd64-tied", "qwen3-hd128-untied"):
        path, _, _ = H.make_model_dir(spec, root)
        awq, binf = root / f"{spec}-awq", root / f"{spec}.bin"
        assert cli(["quantize", str(path), str(awq), "--format", "awq", "--quiet"]) == 0
        assert cli(["quantize", str(path), str(binf), "--format", "awq", "--quiet"]) == 0
        out[spec] = (path, awq, binf)
    return out


def test_header_bytes_follow_the_seed(files):
    spec = H.SPECS["qwen3-hd128-untied"]
    raw = files["qwen3-hd128-untied"][2].read_bytes()
    assert struct.unpack_from("<I", raw, 0)[0] == 0x616B3438 == MAGIC
    assert raw[:4] == b"84ka"                    # "ak48" as a little-endian u32
    assert struct.unpack_from("<i", raw, 4)[0] == 5
    dims = struct.unpack_from("<7i", raw, 8)
    assert dims == (spec.hidden, spec.intermediate, spec.layers, spec.heads, spec.kv_heads,
                    spec.vocab, 512)
    assert raw[0x24] == 0                        # shared_classifier: lm_head untied
    assert struct.unpack_from("<i", raw, 0x25)[0] == spec.head_dim   # unaligned, as written
    assert struct.unpack_from("<i", raw, 0x29)[0] == 128
    assert raw[0x2D:HEADER_BYTES] == bytes(HEADER_BYTES - 0x2D)
    assert read_header(files["qwen3-gqa-hd64-tied"][2])["shared_classifier"] is True


@pytest.mark.parametrize("spec", ["qwen3-gqa-hd64-tied", "qwen3-hd128-untied"])
def test_every_tensor_sits_where_the_seed_table_puts_it(files, spec):
    """The whole file walked in the seed's order (§8.1.4), written out here by hand rather than
    taken from kuiper._layout (the writer and reader share that, so a round trip cannot see an
    order both get wrong): A = every input norm, every post-attention norm, the final norm, the
    embedding; B = for wq, wk, wv, wo, w1 (gate), w2 (down), w3 (up) in turn, every layer's
    qweight, qzeros, scales; C = lm_head when untied, every q_norm, every k_norm. Each tensor's
    bytes equal the HF AWQ directory's, and the walk ends exactly at the end of the file."""
    path, awq, binf = files[spec]
    sp = H.SPECS[spec]
    L = sp.layers
    raw = binf.read_bytes()
    from safetensors.numpy import load_file

    t = load_file(str(awq / "model.safetensors"))
    order = [f"model.layers.{i}.input_layernorm.weight" for i in range(L)]
    order += [f"model.layers.{i}.post_attention_layernorm.weight" for i in range(L)]
    order += ["model.norm.weight", "model.embed_tokens.weight"]
    for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.down_proj", "mlp.up_proj"):
        for i in range(L):
            order += [f"model.layers.{i}.{module}.{f}" for f in ("qweight", "qzeros", "scales")]
    if not sp.tied:
        order.append("lm_head.weight")
    order += [f"model.layers.{i}.self_attn.q_norm.weight" for i in range(L)]
    order += [f"model.layers.{i}.self_attn.k_norm.weight" for i in range(L)]
    off = HEADER_BYTES
    for name in order:
        want = t[name]
        want = want if want.dtype == np.int32 else want.astype(np.float16)
        got = raw[off:off + want.nbytes]
        assert got == want.tobytes(), f"{name} at byte {off}"
        off += want.nbytes
    assert off == len(raw)


@pytest.mark.parametrize("spec", ["qwen3-gqa-hd64-tied", "qwen3-hd128-untied"])
def test_roundtrip_equals_the_hf_awq_dir(files, spec):
    path, awq, binf = files[spec]
    c1, w1, _, _ = load_hf(awq, progress=False)
    c2, w2, tok = load_kuiper(binf)
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "tie_word_embeddings", "rope_theta", "rms_norm_eps"):
        assert getattr(c1, k) == getattr(c2, k), k
    assert w1.keys() == w2.keys()
    for k in w1:
        a, b = w1[k], w2[k]
        if isinstance(a, QuantizedTensor):
            assert isinstance(b, QuantizedTensor) and a.params == b.params and a.shape == b.shape
            for f in ("qweight", "qzeros", "scales"):
                np.testing.assert_array_equal(a.data[f], b.data[f])
        else:
            assert torch.equal(a, b), k
    # and .bin -> HF AWQ dir -> .bin again is byte-identical (requantizing AWQ values is exact)
    again_dir, again_bin = binf.with_suffix(".dir"), binf.with_name(binf.stem + "-again.bin")
    assert cli(["quantize", str(binf), str(again_dir), "--format", "awq", "--quiet"]) == 0
    assert cli(["quantize", str(again_dir), str(again_bin), "--format", "awq", "--quiet"]) == 0
    assert again_bin.read_bytes() == binf.read_bytes()


def test_tokenizer_beside_the_file_is_loaded(files, tmp_path):
    path, _, binf = files["qwen3-gqa-hd64-tied"]
    dst = path / "m.bin"
    dst.write_bytes(binf.read_bytes())
    config, _, tok = load_kuiper(dst)
    assert tok is not None and tok.decode(tok.encode(H.PROMPT)) == H.PROMPT
    assert config.eos_token_ids == tok.eos_token_ids
    dst.unlink()


def test_bad_files(files, tmp_path):
    raw = files["qwen3-gqa-hd64-tied"][2].read_bytes()
    cases = {
        "magic.bin": (b"\x00" * 4 + raw[4:], "magic 0x00000000 is not KuiperLLama's AWQ 0x616b3438"),
        "version.bin": (raw[:4] + struct.pack("<i", 4) + raw[8:], "header version 4"),
        "trunc.bin": (raw[:-10], "truncated"),
        "tail.bin": (raw + b"\0", "trailing bytes"),
        "short.bin": (raw[:100], "shorter than the 256-byte"),
        "group.bin": (raw[:0x29] + struct.pack("<i", 96) + raw[0x2D:], "group_size=96"),
    }
    for name, (data, needle) in cases.items():
        p = tmp_path / name
        p.write_bytes(data)
        with pytest.raises(ValueError) as e:
            load_kuiper(p)
        assert needle in str(e.value) and name in str(e.value), (name, str(e.value))


def test_a_corrupt_layer_count_fails_at_once(tmp_path):
    """n_layers = 2^31 - 1 in the header of a small file: the size check is worked out in closed
    form (it had walked every layer's shapes first and hung)."""
    hdr = struct.pack("<Ii7iBii", MAGIC, 5, 64, 128, 2**31 - 1, 4, 2, 160, 256, 1, 64, 32)
    p = tmp_path / "layers.bin"
    p.write_bytes(hdr + bytes(HEADER_BYTES - len(hdr)) + bytes(1000))
    with pytest.raises(ValueError, match="layers=2147483647.*truncated"):
        load_kuiper(p)


def test_dims_come_from_the_header_not_the_seed_example(tmp_path):
    """A Qwen3-8B header (intermediate 12288, not the seed example's 14336) on a short file:
    the size check reports what the header implies, read from the file."""
    hdr = struct.pack("<Ii7iBii", MAGIC, 5, 4096, 12288, 36, 32, 8, 151936, 40960, 0, 128, 128)
    p = tmp_path / "qwen3-8b.bin"
    p.write_bytes(hdr + bytes(HEADER_BYTES - len(hdr)) + bytes(1000))
    with pytest.raises(ValueError, match="hidden_dim=12288.*truncated") as e:
        load_kuiper(p)
    # region sizes by hand: A norms+embedding fp16, B 7 AWQ linears x 36, C lm_head + q/k norms
    h, f, L, v, g = 4096, 12288, 36, 151936, 128
    awq = lambda n, k: k * n // 2 + (k // g) * (n // 2) + (k // g) * n * 2   # noqa: E731
    per_layer = awq(4096, h) + 2 * awq(1024, h) + awq(h, 4096) + 2 * awq(f, h) + awq(h, f)
    want = HEADER_BYTES + 2 * (2 * L * h + h + v * h) + L * per_layer + 2 * (v * h + 2 * L * 128)
    assert f"implies {want}" in str(e.value)


def test_llama_source_is_refused(tmp_path, capsys):
    path, _, _ = H.make_model_dir("llama-gqa", tmp_path)
    assert cli(["quantize", str(path), str(tmp_path / "l.bin"), "--format", "awq", "--quiet"]) == 2
    assert "Qwen3 format" in capsys.readouterr().err


def test_header_dims_must_fit_awq_and_the_tokenizer(files, tmp_path):
    """Header dims whose linears do not split into AWQ groups: a clear error, checked before any
    tensor; a tokenizer.json beside the file with more tokens than the embedding rows: a warning
    (HF checkpoints like that exist; Model.forward refuses the extra ids)."""
    hdr = struct.pack("<Ii7iBii", MAGIC, 5, 96, 256, 1, 3, 1, 64, 128, 0, 32, 128)
    p = tmp_path / "dims.bin"
    p.write_bytes(hdr + bytes(HEADER_BYTES - len(hdr)))
    with pytest.raises(ValueError, match=r"dims\.bin: header: model\.layers\.0\.self_attn\.q_proj\.weight: "
                                         r"in_features K=96 is not a multiple of group_size=128"):
        load_kuiper(p)
    d = tmp_path / "tok"
    d.mkdir()
    (d / "m.bin").write_bytes(files["qwen3-gqa-hd64-tied"][2].read_bytes())
    H.build_tokenizer(400).save(str(d / "tokenizer.json"))
    with pytest.warns(UserWarning, match=r"m\.bin: the tokenizer has 400 tokens, the embedding only 320 rows"):
        load_kuiper(d / "m.bin")


def _edited_copy(src, dst, **changes):
    """A copy of an HF dir with config.json keys changed (rope_theta: in rope_parameters too)."""
    import json
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        cfg[k] = v
        if k == "rope_theta" and isinstance(cfg.get("rope_parameters"), dict):
            cfg["rope_parameters"]["rope_theta"] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("dst,fmt,key,value,needle", [
    ("m.bin", "awq", "rope_theta", 1e4,
     "rope_theta=10000, but a KuiperLLama .bin implies 1e+06 (its header cannot carry rope_theta)"),
    ("m.bin", "awq", "rms_norm_eps", 1e-5,
     "rms_norm_eps=1e-05, but a KuiperLLama .bin implies 1e-06 (its header cannot carry rms_norm_eps)"),
    ("m.bin", "awq", "max_position_embeddings", 2**31,
     "max_position=2147483648 does not fit the .bin header's int32 field"),
    ("m.gguf", "q8_0", "max_position_embeddings", 2**32, "max_position=4294967296 does not fit GGUF's u32 field"),
    # (the runner computes RoPE in float32: such a source is refused as it loads)
    ("m.gguf", "q8_0", "rope_theta", 1e300, "rope_theta=1e+300 (the RoPE base) is outside float32's normal range"),
    ("m.gguf", "q8_0", "rms_norm_eps", 1e-50, "rms_norm_eps=1e-50 is not a positive float32 (GGUF stores it as F32)"),
])
def test_values_the_file_cannot_carry_are_refused(files, tmp_path, capsys, dst, fmt, key, value, needle):
    """The .bin header has no rope_theta / rms_norm_eps field and a reader assumes Qwen3's: a model
    with others is refused (it had been written and came back with 1e6 / 1e-6 and other logits). A
    dimension past the header's int32 fields, or a GGUF's u32 / f32 ones, is refused too (it was a
    struct.error traceback; an eps of 1e-50 was written as an F32 0 the file's reader refused)."""
    src = _edited_copy(files["qwen3-hd128-untied"][0], tmp_path / "src", **{key: value})
    dst = tmp_path / dst
    assert cli(["quantize", str(src), str(dst), "--format", fmt, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert needle in err and str(src) in err and len(err.strip().splitlines()) == 1, err
    assert not dst.exists() and not list(tmp_path.glob("*.part"))


def test_gguf_source_with_qwen3_values_exports_to_bin(files, tmp_path):
    """A GGUF stores rms_norm_eps as F32 (1e-6 -> 9.9999997e-07): still Qwen3's, not refused."""
    import gguf

    path = files["qwen3-gqa-hd64-tied"][0]
    g, b = tmp_path / "m.gguf", tmp_path / "m.bin"
    assert cli(["quantize", str(path), str(g), "--format", "q8_0", "--quiet"]) == 0
    eps = gguf.GGUFReader(str(g)).fields["qwen3.attention.layer_norm_rms_epsilon"].contents()
    assert eps != 1e-6 and eps == pytest.approx(1e-6)
    assert cli(["quantize", str(g), str(b), "--format", "awq", "--quiet"]) == 0
    assert load_kuiper(b)[0].rms_norm_eps == 1e-6


def test_a_failed_export_leaves_an_existing_dst_as_it_was(files, tmp_path, capsys):
    """A .bin is written beside DST and renamed over it: an export failing part-way (a NaN in the
    last k_norm) leaves the earlier DST byte for byte and no partial file (DST had been opened
    "wb" at once: destroyed, a partial file left)."""
    from safetensors.numpy import load_file, save_file

    path, _, binf = files["qwen3-gqa-hd64-tied"]
    bad = _edited_copy(path, tmp_path / "nan")
    shard = next(bad.glob("*.safetensors"))
    t = load_file(str(shard))
    name = f"model.layers.{H.SPECS['qwen3-gqa-hd64-tied'].layers - 1}.self_attn.k_norm.weight"
    t[name] = t[name].copy()
    t[name][0] = np.nan
    save_file(t, str(shard), metadata={"format": "pt"})
    dst = tmp_path / "good.bin"
    dst.write_bytes(binf.read_bytes())
    assert cli(["quantize", str(bad), str(dst), "--format", "awq", "--quiet"]) == 2
    assert name in capsys.readouterr().err
    assert dst.read_bytes() == binf.read_bytes()
    assert cli(["quantize", str(bad), str(tmp_path / "new.bin"), "--format", "awq", "--quiet"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.bin", "nan"]


def test_src_and_dst_hard_links_to_one_file(files, tmp_path):
    """SRC and DST two names of one .bin: the export reads the source's memory map while it
    writes, so DST must not truncate that file (it had: a Bus error, a 0-byte source)."""
    import os

    binf = files["qwen3-gqa-hd64-tied"][2]
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(binf.read_bytes())
    os.link(a, b)
    assert cli(["quantize", str(a), str(b), "--format", "awq", "--quiet"]) == 0
    assert a.read_bytes() == binf.read_bytes() == b.read_bytes()
    assert not list(tmp_path.glob("*.part"))


def test_tokenizer_beside_the_file_goes_into_a_gguf(files, tmp_path):
    """A .bin with tokenizer files beside it, converted to GGUF: the GGUF carries the tokenizer
    (it had been left out: only an HF source's was written), the same one an HF dir gets."""
    import shutil

    import gguf

    from quantzoo.model.gguf_loader import load_gguf
    from quantzoo.model.hf_loader import load_tokenizer

    path, _, binf = files["qwen3-gqa-hd64-tied"]
    d = tmp_path / "kuiper"
    d.mkdir()
    shutil.copy(binf, d / "m.bin")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / f, d / f)
    out = tmp_path / "m.gguf"
    assert cli(["quantize", str(d / "m.bin"), str(out), "--format", "q8_0", "--quiet"]) == 0
    fields = gguf.GGUFReader(str(out)).fields
    assert fields["tokenizer.ggml.pre"].contents() == "qwen2"
    _, _, gtok = load_gguf(str(out), progress=False)
    htok = load_tokenizer(path)
    assert gtok is not None and gtok.encode(H.PROMPT) == htok.encode(H.PROMPT)
    assert gtok.eos_token_ids[0] == htok.eos_token_ids[0]
    msgs = [{"role": "user", "content": "hi"}]
    assert gtok.apply_chat_template(msgs) == htok.apply_chat_template(msgs)
    # and a .bin alone still converts, without a tokenizer
    assert cli(["quantize", str(binf), str(tmp_path / "bare.gguf"), "--format", "q8_0", "--quiet"]) == 0
    assert load_gguf(str(tmp_path / "bare.gguf"), progress=False)[2] is None


def test_awq_to_awq_keeps_the_source_group_unless_asked(files, tmp_path, capsys):
    """An AWQ source of group 64 (HF dir or .bin) to AWQ without --group-size: group 64, the
    source's weights copied bit for bit (it had re-quantized them at 128 from their dequantized
    values, moving the logits by ~1); an explicit --group-size is still honoured."""
    from safetensors.numpy import load_file

    path = files["qwen3-gqa-hd64-tied"][0]
    a64, b, again = tmp_path / "a64", tmp_path / "m.bin", tmp_path / "again"
    assert cli(["quantize", str(path), str(a64), "--format", "awq", "--group-size", "64", "--quiet"]) == 0
    capsys.readouterr()
    assert cli(["quantize", str(a64), str(b), "--format", "awq", "--quiet"]) == 0
    assert "group 64" in capsys.readouterr().out
    assert read_header(b)["group_size"] == 64
    src_t = load_file(str(a64 / "model.safetensors"))
    _, w, _ = load_kuiper(b)
    for k, t in src_t.items():
        if k.endswith(".qweight"):
            m = k[: -len(".qweight")]
            for f in ("qweight", "qzeros", "scales"):
                np.testing.assert_array_equal(w[m + ".weight"].data[f], src_t[f"{m}.{f}"])
        elif k.endswith(".weight"):
            np.testing.assert_array_equal(w[k].numpy(), t)
    # .bin -> HF AWQ dir: group 64 again, the same tensors as the first HF export
    assert cli(["quantize", str(b), str(again), "--format", "awq", "--quiet"]) == 0
    assert json.loads((again / "config.json").read_text())["quantization_config"]["group_size"] == 64
    t2 = load_file(str(again / "model.safetensors"))
    assert t2.keys() == src_t.keys() and all(np.array_equal(t2[k], src_t[k]) for k in src_t)
    # explicit groups win; a non-AWQ source (and a GGUF) defaults to 128
    assert cli(["quantize", str(a64), str(tmp_path / "g128.bin"), "--format", "awq", "--group-size", "128",
                "--quiet"]) == 0
    assert read_header(tmp_path / "g128.bin")["group_size"] == 128
    assert cli(["quantize", str(path), str(tmp_path / "fp.bin"), "--format", "awq", "--quiet"]) == 0
    assert read_header(tmp_path / "fp.bin")["group_size"] == 128


def test_a_header_whose_sizes_wrap_int64_is_refused(tmp_path):
    """heads = kv_heads = 2^30, head_dim 2^22, hidden 2^20: every attention tensor's element
    count is a multiple of 2^64, so int64 products (np.prod) made them 0 bytes and a (sparse)
    file of the remaining size passed the size check, failing later in a numpy reshape that named
    neither the file nor the field. Now the implausible width is named, from the header."""
    h, f, heads, hd, g = 2**20, 32, 2**30, 2**22, 32
    hdr = struct.pack("<Ii7iBii", MAGIC, 5, h, f, 1, heads, heads, 1, 8, 1, hd, g)
    # the size the int64 products implied (the attention linears' terms wrapped to 0)
    awq = lambda n, k: 4 * k * (n // 8) + 4 * (k // g) * (n // 8) + 2 * (k // g) * n   # noqa: E731
    wrapped = 2 * (3 * h + h) + 2 * awq(f, h) + awq(h, f) + 2 * 2 * hd
    for n, k in ((heads * hd, h), (heads * hd, h), (heads * hd, h), (h, heads * hd)):
        for count in (k * (n // 8), (k // g) * (n // 8), (k // g) * n):
            assert count % 2**64 == 0
    p = tmp_path / "wrap.bin"
    with open(p, "wb") as fh:
        fh.write(hdr + bytes(HEADER_BYTES - len(hdr)))
        fh.truncate(HEADER_BYTES + wrapped)   # sparse: no disk used
    with pytest.raises(ValueError, match=r"wrap\.bin: header: n_heads\*head_dim = 1073741824\*4194304 = "
                                         r"4503599627370496 is past 2147483647"):
        load_kuiper(p)
    # one that only the size check catches: its Python-int size, not a wrapped one
    hdr = struct.pack("<Ii7iBii", MAGIC, 5, 2**30, 2**30, 2**30, 2**10, 2**10, 2**30, 8, 1, 2**20, 128)
    p.write_bytes(hdr + bytes(HEADER_BYTES - len(hdr)))
    with pytest.raises(ValueError, match=r"wrap\.bin: 256 bytes, but the header .* implies (\d{25,}): truncated"):
        load_kuiper(p)


@pytest.mark.parametrize("value", [2, 255])
def test_shared_classifier_is_0_or_1(files, tmp_path, value):
    raw = files["qwen3-gqa-hd64-tied"][2].read_bytes()
    p = tmp_path / "shared.bin"
    p.write_bytes(raw[:0x24] + bytes([value]) + raw[0x25:])
    with pytest.raises(ValueError, match=rf"shared\.bin: header shared_classifier={value}; must be 0 "):
        load_kuiper(p)


def test_a_nan_or_inf_weight_or_scale_is_refused(files, tmp_path):
    """A corrupt scale or fp16 weight loaded silently and generated garbage; refused by name."""
    from quantzoo.model.kuiper import _layout

    src = files["qwen3-gqa-hd64-tied"][2]
    cfg, _, _ = load_kuiper(src)
    group = read_header(src)["group_size"]
    offsets, off = {}, HEADER_BYTES
    for name, shape, dtype in _layout(cfg, group):
        offsets[name] = (off, shape)
        off += int(np.prod(shape)) * np.dtype(dtype).itemsize
    for name, row, needle in (("model.layers.0.self_attn.o_proj.scales", 5, "in its scales "),
                              ("model.embed_tokens.weight", 4, "")):
        at, shape = offsets[name]
        raw = bytearray(src.read_bytes())
        i = at + 2 * (row if name.endswith(".scales") else row * shape[1])   # scales [K/G, N]: column = row
        raw[i:i + 2] = np.float16(np.nan).tobytes()
        bad = tmp_path / "bad.bin"
        bad.write_bytes(bytes(raw))
        with pytest.raises(ValueError, match=rf"bad\.bin: tensor '{name}': row {row} holds NaN or inf {needle}"):
            load_kuiper(bad)
