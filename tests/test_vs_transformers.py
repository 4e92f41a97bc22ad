"""The runner against HF transformers, on small synthetic models exported to every format.

Oracle: transformers' own Qwen3ForCausalLM / LlamaForCausalLM (fp32, CPU) holding the weights
the exported file is meant to hold, computed here *independently of the file*: each linear is
quantized by the registry's codec from the original checkpoint and dequantized
(`fmt.dequantize(fmt.quantize(w))`, GGUF codecs being byte-identical to gguf-py, tested
elsewhere), fp16 where the file stores fp16. The runner, in contrast, reads the file
`quantzoo quantize` wrote (through its own loaders, permutation undone for llama GGUF). A wrong
byte, a wrong Q/K row order, a wrong norm or RoPE shows as a logit mismatch.

Bound: max |logits_runner - logits_hf| / max |logits_hf| < 1e-4 (fp32 CPU; what we reach is
printed: 5e-7 to 1e-6 with torch 2.13 on the CPU, whether transformers gets the weights from the
codec or through its own GGUF reader), and
greedy decoding (runner: KV cache, one token per step;
transformers: full recompute each step, no cache) agrees token for token for 32 tokens.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import helpers_models as H
from quantzoo.cli import main as cli
from quantzoo.formats import get, weight_formats

REL_BOUND = 1e-4
N_GEN = 32
GGUF_FORMATS = tuple(f.name for f in weight_formats() if f.kernels == "gguf")   # the registry's block formats


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """spec name -> (hf dir, transformers model, original fp32 weights as saved)."""
    root = tmp_path_factory.mktemp("models")
    cache = {}

    def get_model(name, dtype="float32"):
        key = (name, dtype)
        if key not in cache:
            path, model, tok = H.make_model_dir(name, root, dtype=dtype)
            cache[key] = (path, model, H.read_safetensors_dir(path))
        return cache[key]
    get_model.root = root
    return get_model


def expected_weights(orig: dict, fmt: str, group_size: int = 128) -> dict:
    """What a file in `fmt` holds, as float32, derived from the original weights (not the file)."""
    out = {}
    for name, w in orig.items():
        is_decoder_linear = w.ndim == 2 and ".layers." in name
        if fmt == "awq":      # HF AWQ / KuiperLLama: decoder linears AWQ, the rest fp16
            if is_decoder_linear:
                awq = get("awq")
                out[name] = awq.dequantize(awq.quantize(w, group_size=group_size))
            else:
                out[name] = w.astype(np.float16).astype(np.float32)
        elif fmt == "fp16":
            out[name] = w.astype(np.float16).astype(np.float32) if w.ndim == 2 else w
        elif fmt == "orig":
            out[name] = w
        else:                 # GGUF: every 2-D weight in fmt (F16 where K is not whole blocks), norms F32
            out[name] = gguf_stored(w, fmt) if w.ndim == 2 else w
    return out


def gguf_stored(w: np.ndarray, fmt: str) -> np.ndarray:
    """A 2-D weight as a GGUF in `fmt` holds it, as float32: the codec's round trip, or fp16's
    where its in_features is not a multiple of the block size (llama.cpp's converter falls back
    to F16 for such a tensor, and so does quantzoo quantize)."""
    f = get(fmt)
    if fmt == "fp16" or w.shape[1] % f.block_size:
        return w.astype(np.float16).astype(np.float32)
    return f.dequantize(f.quantize(w))


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy decoding with a full forward per step (no KV cache): the simplest oracle."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(ids):]


def hf_logits(hf_model, weights, ids):
    H.load_into_transformers(hf_model, weights)
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def compare(runner_path, hf_model, weights, ids, label, other=None):
    """Runner on the file vs transformers on `weights`. `other`: weights the file must NOT
    match (e.g. the unquantized originals), checked first so the comparison can fail."""
    from quantzoo.model import load_model

    if other is not None:
        alt = hf_logits(hf_model, other, ids)
        ref = hf_logits(hf_model, weights, ids)
        sep = float((alt - ref).abs().max() / ref.abs().max())
        assert sep > 30 * REL_BOUND, f"{label}: the reference does not discriminate ({sep:.2e})"
    H.load_into_transformers(hf_model, weights)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    m = load_model(runner_path, device="cpu", progress=False)
    got = m.logits(ids)
    assert got.shape == ref.shape
    rel = float((got - ref).abs().max() / ref.abs().max())
    print(f"{label}: max rel logit error {rel:.2e} (bound {REL_BOUND:g})")
    assert rel < REL_BOUND, f"{label}: relative logit error {rel:.3e} >= {REL_BOUND}"
    want = hf_greedy(hf_model, ids, N_GEN)
    new = m.generate(ids, max_new_tokens=N_GEN, temperature=0.0, eos_token_ids=[])
    assert new == want, f"{label}: greedy tokens differ at step " \
                        f"{next(i for i, (a, b) in enumerate(zip(new, want)) if a != b)}"
    return m, rel


def prompt_ids(path):
    from quantzoo.model.hf_loader import load_tokenizer

    return load_tokenizer(path).encode(H.PROMPT)


@pytest.mark.parametrize("spec", list(H.SPECS))
def test_unquantized_matches_transformers(built, spec):
    path, model, orig = built(spec)
    compare(path, model, expected_weights(orig, "orig"), prompt_ids(path), f"{spec} fp32")


def test_unquantized_fp16_dir_matches_transformers(built):
    path, model, orig = built("qwen3-hd128-untied", "float16")   # orig: the fp16 values read back
    compare(path, model, expected_weights(orig, "orig"), prompt_ids(path), "fp16 dir")


@pytest.mark.parametrize("spec,group_size", [("qwen3-gqa-hd64-tied", 128), ("qwen3-hd128-untied", 128),
                                             ("qwen3-g64-only", 64), ("llama-gqa", 128),
                                             ("qwen3-gqa-hd64-tied", 32), ("llama3-rope", 128),
                                             ("mistral-window", 128)])
def test_awq_dir_matches_transformers(built, spec, group_size):
    path, model, orig = built(spec)
    dst = built.root / f"{spec}-awq-g{group_size}"
    assert cli(["quantize", str(path), str(dst), "--format", "awq", "--group-size", str(group_size),
                "--quiet"]) == 0
    m, _ = compare(dst, model, expected_weights(orig, "awq", group_size), prompt_ids(path),
                   f"{spec} awq g{group_size}", other=orig)
    assert m.formats  # the runner reports what it used
    assert any("awq" in str(v) for v in m.formats.values()), m.formats


# every GGUF type on one qwen3 and the llama model; the other two shapes in q4_0 and q8_0
GGUF_CASES = [(s, f) for s in ("qwen3-gqa-hd64-tied", "llama-gqa") for f in GGUF_FORMATS + ("fp16",)] + \
             [(s, f) for s in ("qwen3-hd128-untied", "qwen3-g64-only", "llama3-rope", "mistral-window")
              for f in ("q4_0", "q8_0")]


@pytest.mark.parametrize("spec,fmt", GGUF_CASES)
def test_gguf_matches_transformers(built, spec, fmt):
    """llama-gqa is the RoPE trap: its attn_q/attn_k rows are stored permuted for llama.cpp."""
    path, model, orig = built(spec)
    dst = built.root / f"{spec}-{fmt}.gguf"
    assert cli(["quantize", str(path), str(dst), "--format", fmt, "--quiet"]) == 0
    compare(dst, model, expected_weights(orig, fmt), prompt_ids(path), f"{spec} {fmt} gguf",
            other=None if fmt in ("fp16", "q8_0") else orig)
    if H.SPECS[spec].arch == "llama":
        check_llama_permutation(dst, orig, fmt, H.SPECS[spec])


def check_llama_permutation(gguf_path, orig, fmt, spec):
    """Read attn_q/attn_k with gguf-py (the outside oracle) and check llama.cpp's row order:
    within each head, HF rows r and r + head_dim/2 sit at 2r and 2r + 1."""
    import gguf

    r = gguf.GGUFReader(str(gguf_path))
    t = {x.name: x for x in r.tensors}
    for hf, gg, heads in (("self_attn.q_proj", "attn_q", spec.heads), ("self_attn.k_proj", "attn_k", spec.kv_heads)):
        x = t[f"blk.0.{gg}.weight"]
        stored = gguf.quants.dequantize(np.asarray(x.data), x.tensor_type).reshape(-1, spec.hidden)
        w = gguf_stored(orig[f"model.layers.0.{hf}.weight"], fmt)
        d = spec.head_dim
        want = w.reshape(heads, 2, d // 2, -1).transpose(0, 2, 1, 3).reshape(w.shape)
        np.testing.assert_array_equal(stored, want)
        assert not np.array_equal(stored, w)


# llama.cpp's F16 fallback: weights whose in_features 32 does not divide (qwen3-ffn200: ffn_down;
# llama-hidden80: embeddings, lm_head, q/k/v, gate/up), the others in the format
FALLBACK = {"qwen3-ffn200": {"down_proj"},
            "llama-hidden80": {"embed_tokens", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head"}}


@pytest.mark.parametrize("spec,fmt", [(s, f) for s in FALLBACK for f in ("q4_0", "q8_0")])
def test_gguf_f16_fallback_matches_transformers(built, spec, fmt):
    """A GGUF export of a model with some in_features not whole 32-value blocks: those weights
    are F16 in the file, the others fmt; the runner on the file against transformers on the same
    weights derived from the checkpoint (F16 for those, the codec's round trip for the others),
    and its formats report shows each tensor type as stored."""
    path, model, orig = built(spec)
    dst = built.root / f"{spec}-{fmt}.gguf"
    with pytest.warns(UserWarning, match="stored as F16"):
        assert cli(["quantize", str(path), str(dst), "--format", fmt, "--quiet"]) == 0
    m, _ = compare(dst, model, expected_weights(orig, fmt), prompt_ids(path), f"{spec} {fmt} gguf (F16 fallback)",
                   other=None if fmt == "q8_0" else orig)
    kinds = {k: v for k, v in m.formats.items() if k != "norms"}
    assert kinds == {k: ("f16" if k in FALLBACK[spec] else fmt) for k in kinds}, m.formats
    if H.SPECS[spec].arch == "llama":   # F16 Q/K rows permuted as the quantized ones are
        check_llama_permutation(dst, orig, fmt, H.SPECS[spec])


def test_kuiper_bin_matches_transformers(built):
    spec = "qwen3-hd128-untied"
    path, model, orig = built(spec)
    dst = path / "model-awq.bin"   # beside tokenizer.json: the loader picks it up
    assert cli(["quantize", str(path), str(dst), "--format", "awq", "--quiet"]) == 0
    # the .bin header has no rope_theta: KuiperLLama (and we) assume Qwen3's 1e6, as the spec has
    assert H.SPECS[spec].rope_theta == 1e6
    compare(dst, model, expected_weights(orig, "awq", 128), prompt_ids(path), f"{spec} kuiper .bin",
            other=orig)
    dst.unlink()


def test_requantize_from_gguf_source(built):
    """GGUF q8_0 -> dequantized -> AWQ dir and q4_0 GGUF: the same weights reach every format."""
    spec = "llama-gqa"
    path, model, orig = built(spec)
    q8 = built.root / f"{spec}-src-q8_0.gguf"
    assert cli(["quantize", str(path), str(q8), "--format", "q8_0", "--quiet"]) == 0
    w8 = expected_weights(orig, "q8_0")
    awq_dir = built.root / f"{spec}-from-gguf-awq"
    assert cli(["quantize", str(q8), str(awq_dir), "--format", "awq", "--quiet"]) == 0
    compare(awq_dir, model, expected_weights(w8, "awq"), prompt_ids(path), "q8_0 gguf -> awq")
    q4 = built.root / f"{spec}-from-gguf-q4_0.gguf"
    assert cli(["quantize", str(q8), str(q4), "--format", "q4_0", "--quiet"]) == 0
    compare(q4, model, expected_weights(w8, "q4_0"), prompt_ids(path), "q8_0 gguf -> q4_0 gguf")


@pytest.mark.parametrize("spec,fmt", [("llama-gqa", "q4_0"), ("llama-gqa", "q5_1"),
                                      ("qwen3-gqa-hd64-tied", "q4_1"), ("qwen3-hd128-untied", "q8_0"),
                                      ("llama-hidden80", "q4_0"), ("qwen3-ffn200", "q8_0")])   # (+ F16 fallback)
def test_gguf_read_by_transformers_own_gguf_reader(built, spec, fmt):
    """A second, outside reader of our GGUF files: transformers' GGUF integration (gguf-py
    dequantization, its own llama Q/K un-permutation, its own metadata mapping). The weights it
    reads, in transformers' model, must give the runner's logits and greedy tokens."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path, model, orig = built(spec)
    dst = built.root / f"{spec}-{fmt}-tf.gguf"
    assert cli(["quantize", str(path), str(dst), "--format", fmt, "--quiet"]) == 0
    r = load_gguf_checkpoint(str(dst), return_tensors=True, model_to_load=model)
    s = H.SPECS[spec]
    c = r["config"]
    assert (c["model_type"], c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
            c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]) == \
           (s.arch, s.hidden, s.heads, s.kv_heads, s.intermediate, s.layers, s.vocab)
    assert c["rope_theta"] == pytest.approx(s.rope_theta) and c["rms_norm_eps"] == pytest.approx(s.eps)
    assert r["tokenizer"]["pre_tokenizer_type"] == "qwen2"
    weights = {k: torch.as_tensor(v).float().numpy() for k, v in r["tensors"].items()}
    assert set(weights) == set(orig)
    # transformers dequantizes through gguf-py in its own float path: allow float rounding only
    compare(dst, model, weights, prompt_ids(path), f"{spec} {fmt} via transformers' GGUF reader",
            other=orig)


def test_mistral_sliding_window_is_the_context(built):
    """MistralForCausalLM loads as llama; its sliding window (v0.1: 4096) becomes the model's
    context, inside which sliding and full attention agree (the cases above), and a sequence
    past it is refused by name rather than attended to in full."""
    from quantzoo.model import load_model

    path, model, orig = built("mistral-window")
    assert model.config.sliding_window == 80 and model.config.max_position_embeddings == 512
    m = load_model(path, device="cpu", progress=False)
    assert m.config.arch == "llama" and m.config.max_position == 80
    assert (m.config.sliding_window, m.config.context_length) == (80, 512)
    with pytest.raises(ValueError, match=r"exceeds the model's max_seq 80"):
        m.generate(list(range(1, 60)), max_new_tokens=30)


def test_mistral_gguf_keeps_context_and_window(built):
    """A Mistral GGUF says what the model is: llama.context_length is max_position_embeddings,
    as llama.cpp's converter writes it (it had been the window, 80), and the window goes in
    gguf-py's llama.attention.sliding_window (llama.cpp's llama arch does not read it), from
    which the runner's context ends at the window again. HF dir -> GGUF -> runner against
    transformers on the original directory: the same logits up to the window, refused past it
    (where transformers slides); GGUF -> HF dir writes a MistralForCausalLM config that
    transformers runs as the original, past the window too (it had become a Llama of 80)."""
    import json

    import gguf
    from transformers import AutoModelForCausalLM

    from quantzoo.model import load_model

    path, model, orig = built("mistral-window")
    w16 = expected_weights(orig, "fp16")
    dst = built.root / "mistral-window-fp16.gguf"
    assert cli(["quantize", str(path), str(dst), "--format", "fp16", "--quiet"]) == 0
    r = gguf.GGUFReader(str(dst))
    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["llama.context_length"].contents() == 512
    assert r.fields["llama.attention.sliding_window"].contents() == 80
    m = load_model(dst, device="cpu", progress=False)
    assert (m.config.max_position, m.config.sliding_window, m.config.context_length) == (80, 80, 512)
    inside, past = list(range(3, 83)), list(range(3, 123))
    ref = hf_logits(model, w16, inside)
    rel = float((m.logits(inside) - ref).abs().max() / ref.abs().max())
    assert rel < REL_BOUND, rel
    with pytest.raises(ValueError, match=r"120 ids exceed the model's max_seq 80"):
        m.logits(past)
    hf_dir = built.root / "mistral-window-from-gguf"
    assert cli(["quantize", str(dst), str(hf_dir), "--format", "fp16", "--quiet"]) == 0
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert (cfg["architectures"], cfg["model_type"], cfg["sliding_window"], cfg["max_position_embeddings"]) == \
           (["MistralForCausalLM"], "mistral", 80, 512)
    with torch.no_grad():
        again = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(torch.tensor([past])).logits[0]
    # the original's Mistral holding the new directory's weights (its norms are fp16 now): past the
    # window both slide, where a Llama would attend to all
    ref = hf_logits(model, H.read_safetensors_dir(hf_dir), past)
    assert float((again - ref).abs().max() / ref.abs().max()) < REL_BOUND
    assert load_model(hf_dir, device="cpu", progress=False).config.max_position == 80
