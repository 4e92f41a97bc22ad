"""Llama 3 RoPE scaling (HF rope_type "llama3"; GGUF rope_freqs.weight). The end-to-end checks
against transformers run in test_vs_transformers.py (spec "llama3-rope": HF dir, AWQ dir, GGUF
files); here: the divisors against transformers' own frequencies, both config.json spellings, a
GGUF written as llama.cpp's converter writes it, and the inputs that cannot work."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import helpers_models as H
import quantzoo as qz
from quantzoo.model.config import llama3_rope_factors

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEC = H.SPECS["llama3-rope"]
ROPE = SPEC.extra["rope_parameters"]


def test_divisors_give_transformers_frequencies():
    """transformers' llama3 inv_freq (the outside oracle) = plain frequencies / our divisors, and
    the spec exercises every branch: kept (1), blended (between), divided (factor)."""
    model, _ = H.build_hf_model(SPEC)
    hf_inv = model.model.rotary_emb.inv_freq.double().numpy()
    d = SPEC.head_dim
    plain = 1.0 / ROPE["rope_theta"] ** (np.arange(0, d, 2) / d)
    f = np.array(llama3_rope_factors(ROPE["rope_theta"], d, ROPE["factor"], ROPE["low_freq_factor"],
                                     ROPE["high_freq_factor"], ROPE["original_max_position_embeddings"]))
    np.testing.assert_allclose(plain / f, hf_inv, rtol=1e-6)
    assert (f == 1).sum() == 4 and (f == ROPE["factor"]).sum() == 23 and ((f > 1) & (f < 8)).sum() == 5


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    path, model, _ = H.make_model_dir("llama3-rope", tmp_path_factory.mktemp("l3"))
    return path, model


def logits_rel(path, model, ids):
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()
    got = qz.load_model(path, progress=False).logits(ids)
    return float((got - ref).abs().max() / ref.abs().max())


def test_transformers_4_spelling_loads_the_same(llama3_dir, tmp_path):
    """transformers 4 wrote `rope_scaling` beside a top-level `rope_theta` (as Meta's Llama 3.1+
    checkpoints on the Hub have it); transformers 5 writes `rope_parameters`."""
    import shutil

    path, model = llama3_dir
    ids = list(range(3, 120))
    assert logits_rel(path, model, ids) < 1e-4
    old = tmp_path / "tf4"
    shutil.copytree(path, old)
    cfg = json.loads((old / "config.json").read_text())
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp.pop("rope_theta")
    cfg["rope_scaling"] = rp
    (old / "config.json").write_text(json.dumps(cfg))
    assert logits_rel(old, model, ids) < 1e-4
    # the negative control: the same weights with plain RoPE are far off
    cfg["rope_scaling"] = {"rope_type": "default"}
    (old / "config.json").write_text(json.dumps(cfg))
    assert logits_rel(old, model, ids) > 1e-2


def test_gguf_with_rope_freqs_as_llama_cpp_writes_it(tmp_path):
    """A llama GGUF written outside our exporter (tests/test_model_gguf.py's writer) with
    rope_freqs.weight computed by llama.cpp's converter rule, written out here independently:
    kept 1, divided `factor`, blended 1 / ((1 - s) / factor + s)."""
    from test_model_gguf import hf_logits, hf_model, rel_err, write_gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    base = hf_model("llama", seed=6)   # DIMS: hidden 128, 4 heads -> head_dim 32
    d = base.config.hidden_size // base.config.num_attention_heads
    kw = {k: v for k, v in base.config.to_dict().items() if k in LlamaConfig().to_dict()}
    kw["rope_parameters"] = dict(ROPE)
    m = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    m.load_state_dict(base.state_dict(), strict=False)
    c, f, lo, hi = (ROPE[k] for k in ("original_max_position_embeddings", "factor", "low_freq_factor",
                                      "high_freq_factor"))
    ff = []
    for i in range(0, d, 2):
        wl = 2 * math.pi / (1.0 / ROPE["rope_theta"] ** (i / d))
        if wl < c / hi:
            ff.append(1.0)
        elif wl > c / lo:
            ff.append(f)
        else:
            s = (c / wl - lo) / (hi - lo)
            ff.append(1.0 / ((1 - s) / f + s))
    path = tmp_path / "l3.gguf"
    oracle = write_gguf(path, m, "llama", "q8_0",
                        extra_tensors={"rope_freqs.weight": (np.array(ff, np.float32), gguf.GGMLQuantizationType.F32)})
    model = qz.load_model(path, progress=False)
    np.testing.assert_allclose(model.config.rope_freq_factors, ff, rtol=1e-6)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 160, 100)]
    assert rel_err(model.logits(ids), hf_logits(m, oracle, ids)) < 1e-4


@pytest.mark.parametrize("arr,needle", [
    (np.ones(8, np.float32), r" is F32\[8\]; expected F32\[16\]"),
    (np.array([1.0] * 15 + [0.0], np.float32), r": rope_freq_factors\[15\]=0\.0 must be a positive number"),
    (np.array([1.0] * 3 + [np.nan] * 13, np.float32), r": rope_freq_factors\[3\]=nan must be a positive number"),
])
def test_bad_rope_freqs_are_named(tmp_path, arr, needle):
    from test_model_gguf import hf_model, write_gguf

    path = tmp_path / "bad.gguf"
    write_gguf(path, hf_model("llama"), "llama", "q8_0",
               extra_tensors={"rope_freqs.weight": (arr, gguf.GGMLQuantizationType.F32)})
    with pytest.raises(ValueError, match=r"bad\.gguf: tensor 'rope_freqs\.weight'" + needle):
        qz.load_model(path, progress=False)


def test_rope_freqs_in_a_qwen3_gguf_is_refused(tmp_path):
    from test_model_gguf import hf_model, write_gguf

    path = tmp_path / "q3.gguf"
    write_gguf(path, hf_model("qwen3"), "qwen3", "q8_0",
               extra_tensors={"rope_freqs.weight": (np.ones(32, np.float32), gguf.GGMLQuantizationType.F32)})
    with pytest.raises(ValueError, match=r"unexpected tensor 'rope_freqs\.weight' for a qwen3 model"):
        qz.load_model(path, progress=False)


@pytest.mark.parametrize("edit,needle", [
    ({"factor": None}, r"rope_parameters\.factor is missing"),
    ({"high_freq_factor": 1.0}, r"rope_parameters\.high_freq_factor=1\.0 must exceed low_freq_factor=1\.0"),
    ({"original_max_position_embeddings": 0}, r"rope_parameters\.original_max_position_embeddings=0 must be a positive"),
    ({"rope_type": "longrope"}, r"rope_parameters\.rope_type='longrope' is not supported"),
])
def test_bad_llama3_parameters_are_named(llama3_dir, tmp_path, edit, needle):
    import shutil

    path, _ = llama3_dir
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["rope_parameters"].update(edit)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json: " + needle):
        qz.load_model(bad, progress=False)


def test_exports_that_cannot_carry_the_scaling_are_refused_up_front(llama3_dir, tmp_path):
    """A GGUF with rope_freqs -> HF directory (config.json has no per-frequency form); a Qwen3 HF
    model with llama3 scaling -> GGUF (llama.cpp reads rope_freqs for llama only) and -> KuiperLLama
    .bin (no header field). Nothing is written."""
    from quantzoo.cli import main
    from quantzoo.model.export import export

    path, _ = llama3_dir
    g = tmp_path / "l3.gguf"
    assert main(["quantize", str(path), str(g), "--format", "q8_0", "--quiet"]) == 0
    with pytest.raises(ValueError, match="rope_freqs.weight\\) have no HF config.json form"):
        export(g, tmp_path / "awq", "awq", progress=False)
    assert not (tmp_path / "awq").exists()
    q3, _, _ = H.make_model_dir("qwen3-gqa-hd64-tied", tmp_path)
    cfg = json.loads((q3 / "config.json").read_text())
    cfg["rope_parameters"] = dict(ROPE, rope_theta=1e6)
    (q3 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Llama 3 RoPE scaling on a qwen3 model has no GGUF form"):
        export(q3, tmp_path / "q3.gguf", "q8_0", progress=False)
    with pytest.raises(ValueError, match="no field in a KuiperLLama .bin header"):
        export(q3, tmp_path / "q3.bin", "awq", progress=False)
    assert not list(tmp_path.glob("q3.*"))


L3_OLD = {k: v for k, v in ROPE.items() if k != "rope_theta"}   # transformers 4's rope_scaling block


@pytest.mark.parametrize("keys", [
    # a non-empty rope_scaling replaces rope_parameters, either way round
    {"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_scaling": L3_OLD},
    {"rope_parameters": dict(ROPE), "rope_scaling": {"rope_type": "default"}},
    {"rope_theta": 1e4, "rope_scaling": dict(L3_OLD, type="llama3", rope_type=None)},
    # the block's own rope_theta wins over the top-level one
    {"rope_theta": 1e4, "rope_parameters": dict(ROPE, rope_theta=5e5)},
    {"rope_scaling": dict(ROPE, rope_theta=5e5)},
    {"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
    # original_max_position_embeddings: a top-level one, else the block's, else max_position_embeddings
    {"rope_theta": 1e4, "rope_scaling": dict(L3_OLD, original_max_position_embeddings=None),
     "original_max_position_embeddings": 32},
    {"rope_theta": 1e4, "rope_scaling": L3_OLD, "original_max_position_embeddings": 32},
    {"rope_parameters": dict(ROPE, original_max_position_embeddings=None)},
])
def test_config_keys_read_as_transformers_reads_them(keys):
    """config.json's RoPE keys in the combinations transformers 5 resolves (rope_scaling over
    rope_parameters, the block's rope_theta over the top-level one, the llama3 context falling
    back): the frequencies equal transformers' own inv_freq (the oracle) for each."""
    import copy
    import warnings

    from quantzoo.model.hf_loader import parse_config
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 256,
           "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-5}
    for k, v in keys.items():   # (None: the key absent)
        cfg[k] = {a: b for a, b in v.items() if b is not None} if isinstance(v, dict) else v
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = LlamaRotaryEmbedding(LlamaConfig.from_dict(copy.deepcopy(cfg))).inv_freq.double().numpy()
    c, _ = parse_config(copy.deepcopy(cfg))
    d = c.head_dim
    got = 1.0 / c.rope_theta ** (np.arange(0, d, 2) / d) / np.array(c.rope_freq_factors or [1.0] * (d // 2))
    np.testing.assert_allclose(got, want, rtol=1e-6)
