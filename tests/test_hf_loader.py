"""HF directory loading: AWQ and unquantized checkpoints, sharding, and the clear errors."""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

import helpers_models as H
import quantzoo as qz
from quantzoo.cli import main as cli
from quantzoo.formats import QuantizedTensor
from quantzoo.model.hf_loader import load_hf, parse_quantization_config

SPEC = "qwen3-gqa-hd64-tied"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    path, model, tok = H.make_model_dir(SPEC, root)
    awq = root / "awq"
    assert cli(["quantize", str(path), str(awq), "--format", "awq", "--quiet"]) == 0
    sharded = H.save_hf_dir(model, tok, root / "sharded", max_shard_size="200KB")
    bf16 = H.save_hf_dir(model, tok, root / "bf16", dtype="bfloat16")
    return {"root": root, "fp32": path, "awq": awq, "sharded": sharded, "bf16": bf16, "model": model}


def copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    qc = cfg.setdefault("quantization_config", {})
    for k, v in changes.items():
        if v is None:
            qc.pop(k, None)
        else:
            qc[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_awq_dir_loads_as_awq_quantized_tensors(dirs):
    config, w, tok, gen = load_hf(dirs["awq"], progress=False)
    q = w["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, QuantizedTensor) and q.format == "awq" and q.group_size == 128
    assert q.shape == (config.num_heads * config.head_dim, config.hidden_size)
    assert isinstance(w["model.embed_tokens.weight"], torch.Tensor)
    assert w["model.embed_tokens.weight"].dtype == torch.float16
    assert "lm_head.weight" not in w and config.tie_word_embeddings
    assert config.arch == "qwen3" and config.qk_norm and config.rope_theta == 1e6
    assert config.eos_token_ids == [tok.tok.token_to_id("<|im_end|>")]
    assert tok.decode(tok.encode(H.PROMPT)) == H.PROMPT
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_sharded_and_bf16_dirs_load_the_same_weights(dirs):
    _, a, _, _ = load_hf(dirs["fp32"], progress=False)
    files = sorted(p.name for p in dirs["sharded"].glob("*.safetensors"))
    assert len(files) > 2 and (dirs["sharded"] / "model.safetensors.index.json").exists()
    _, b, _, _ = load_hf(dirs["sharded"], progress=False)
    _, c, _, _ = load_hf(dirs["bf16"], progress=False)
    assert a.keys() == b.keys() == c.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
        assert c[k].dtype == torch.bfloat16
        assert torch.equal(a[k].to(torch.bfloat16), c[k]), k


@pytest.mark.parametrize("key,value,needle", [
    ("bits", 8, "quantization_config.bits=8"),
    ("quant_method", "gptq", "quantization_config.quant_method='gptq'"),
    ("version", "gemv", "quantization_config.version='gemv'"),
    ("version", "exllama", "quantization_config.version='exllama'"),
    ("zero_point", False, "quantization_config.zero_point=False"),
    ("format", "gemv_fast", "version='gemm' and format='gemv_fast' disagree"),
    ("group_size", 96, "quantization_config.group_size=96"),
    ("modules_to_not_convert", "lm_head", "modules_to_not_convert must be a list"),
])
def test_unsupported_quantization_config_is_a_clear_error(dirs, tmp_path, key, value, needle):
    bad = copy_with_config(dirs["awq"], tmp_path / "bad", **{key: value})
    with pytest.raises(ValueError) as e:
        load_hf(bad, progress=False)
    assert needle in str(e.value) and "config.json" in str(e.value)


def test_quantization_config_extra_keys_are_ignored():
    qc = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "GEMM",
          "modules_to_not_convert": None, "do_fuse": False, "fuse_max_seq_len": 512, "backend": "autoawq"}
    assert parse_quantization_config(qc) == {"group_size": 64, "modules_to_not_convert": []}


def test_modules_to_not_convert_is_honoured(dirs, tmp_path):
    """A checkpoint whose layer-1 MLP stayed fp16 (as AutoAWQ writes it for skipped modules)."""
    from safetensors.numpy import load_file, save_file

    d = copy_with_config(dirs["awq"], tmp_path / "skip", modules_to_not_convert=["layers.1.mlp"])
    t = load_file(str(d / "model.safetensors"))
    orig = H.read_safetensors_dir(dirs["fp32"])
    for proj in ("gate_proj", "up_proj", "down_proj"):
        m = f"model.layers.1.mlp.{proj}"
        for s in ("qweight", "qzeros", "scales"):
            del t[f"{m}.{s}"]
        t[f"{m}.weight"] = orig[f"{m}.weight"].astype(np.float16)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    _, w, _, _ = load_hf(d, progress=False)
    kept = w["model.layers.1.mlp.up_proj.weight"]
    assert isinstance(kept, torch.Tensor) and kept.dtype == torch.float16
    np.testing.assert_array_equal(kept.numpy(), orig["model.layers.1.mlp.up_proj.weight"].astype(np.float16))
    assert isinstance(w["model.layers.0.mlp.up_proj.weight"], QuantizedTensor)
    # without the config entry the same files are missing the AWQ tensors: a clear error
    copy_with_config(d, tmp_path / "noskip", modules_to_not_convert=None)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.\w+_proj\.qweight"):
        load_hf(tmp_path / "noskip", progress=False)


def _edited_copy(src, dst, shard, edit):
    """A copy of checkpoint dir src at dst whose safetensors file `shard` went through edit(dict)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    t = load_file(str(dst / shard))
    edit(t)
    save_file(t, str(dst / shard), metadata={"format": "pt"})
    return dst


def test_shard_missing_a_tensor_names_the_file_and_tensor(dirs, tmp_path):
    index = json.loads((dirs["sharded"] / "model.safetensors.index.json").read_text())
    name = "model.layers.1.self_attn.k_norm.weight"
    shard = index["weight_map"][name]
    d = _edited_copy(dirs["sharded"], tmp_path / "sharded", shard, lambda t: t.pop(name))
    with pytest.raises(ValueError) as e:
        load_hf(d, progress=False)
    assert shard in str(e.value) and name in str(e.value)


def test_unsharded_missing_tensor_and_bad_shape(dirs, tmp_path):
    st = "model.safetensors"
    d = _edited_copy(dirs["awq"], tmp_path / "one", st, lambda t: t.pop("model.layers.0.self_attn.o_proj.scales"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj\.scales.*model\.safetensors"):
        load_hf(d, progress=False)

    def shorten_norm(t):
        t["model.norm.weight"] = t["model.norm.weight"][:-1].copy()

    d2 = _edited_copy(dirs["fp32"], tmp_path / "shape", st, shorten_norm)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape \[255\].*\[256\]"):
        load_hf(d2, progress=False)

    def widen_scales(t):
        t["model.layers.0.mlp.up_proj.scales"] = t["model.layers.0.mlp.up_proj.scales"].astype(np.float32)

    d3 = _edited_copy(dirs["awq"], tmp_path / "dtype", st, widen_scales)
    with pytest.raises(ValueError, match=r"up_proj\.scales is float32\[2, 384\], expected float16\[2, 384\]"):
        load_hf(d3, progress=False)


@pytest.mark.parametrize("change,needle", [
    ({"architectures": ["GemmaForCausalLM"]}, "architectures=['GemmaForCausalLM']"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"mlp_bias": "false"}, 'mlp_bias="false" is not supported'),   # (any true value; it had said "true")
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope_type='yarn'"),
    # transformers 4's spelling names the key the file has; a rope_scaling that is no object
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.type='linear' is not supported"),
    ({"rope_scaling": "llama3"}, "rope_scaling='llama3' must be an object"),
    ({"hidden_size": 0}, "hidden_size=0"),
    ({"num_key_value_heads": "2"}, "num_key_value_heads='2' must be a positive integer"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps=-1.0 must be a positive number"),
    ({"rope_theta": "x"}, "rope_theta='x' must be a positive number"),
    ({"head_dim": 63}, "head_dim=63: RoPE needs an even head_dim"),
    ({"vocab_size": None}, "missing key 'vocab_size'"),
    ({"num_hidden_layers": 0}, "num_hidden_layers=0 must be a positive integer"),
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0, "layer_types": None},
     "sliding-window attention"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding-window attention"),
    # found by fuzzing: a TypeError ('int' object is not iterable); a corrupt layer count that
    # walked every layer's shapes (10**9 hung; 10**5 here ends, at an unrelated missing tensor);
    # a string tie flag that bool() made true (the checkpoint's lm_head silently dropped)
    ({"architectures": 3}, "architectures=3 is not supported"),
    ({"num_hidden_layers": 10**5, "layer_types": None}, "num_hidden_layers=100000, but the checkpoint holds only"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false' must be true or false"),
    # transformers refuses these; they had loaded (the window silently dropped for the second)
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for num_hidden_layers=2"),
    ({"layer_types": "full_attention"}, "layer_types='full_attention' must be a list"),
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": "0", "layer_types": None},
     "max_window_layers='0' must be an integer"),
    # RoPE over part of each head (Phi, StableLM) had been ignored: every head rotated whole
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}},
     "rope_parameters.partial_rotary_factor=0.25 is not supported"),
    # a corrupt head size: the RoPE check had built an array of head_dim / 2 values before any
    # tensor's shape was compared (2**31: minutes and 17 GB; 2**40: a MemoryError naming no file)
    ({"head_dim": 2**40}, "q_proj.weight' has shape [256, 256], config.json implies [4398046511104, 256]"),
    # ... and Llama 3's RoPE factors, a Python loop over head_dim / 2, ran before that comparison
    # (2**27: ~40 s, then the shape message; 2**40 never ended)
    ({"head_dim": 2**27, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
     "head_dim=134217728 gives q_proj num_attention_heads x head_dim = "),
    # had said "head_dim=0: must be a positive integer", a key the file does not have
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "head_dim": None, "num_attention_heads": 512,
      "num_key_value_heads": 512},
     "num_attention_heads=512 is more than hidden_size=256: without head_dim"),
])
def test_bad_model_config_is_a_clear_error(dirs, tmp_path, change, needle):
    d = tmp_path / "cfg"
    shutil.copytree(dirs["fp32"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        load_hf(d, progress=False)
    assert needle in str(e.value) and str(e.value).count("config.json") == 1, str(e.value)


@pytest.mark.parametrize("spec", ["qwen3-hd128-untied", "qwen3-gqa-hd64-tied"])
def test_a_missing_head_dim_takes_transformers_default(tmp_path, spec):
    """Without head_dim in config.json transformers' Qwen3Config takes 128 (not hidden / heads,
    as Llama's does): a 128-wide-head model loaded only where the key was present, and a 64-wide
    one loaded here that transformers refuses. Now the same default: the first loads, the
    second's q_proj shape names the mismatch."""
    from transformers import AutoConfig

    path, _, _ = H.make_model_dir(spec, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg.pop("head_dim") == H.SPECS[spec].head_dim
    (path / "config.json").write_text(json.dumps(cfg))
    assert AutoConfig.from_pretrained(path).head_dim == 128
    if H.SPECS[spec].head_dim == 128:
        assert load_hf(path, progress=False)[0].head_dim == 128
    else:
        with pytest.raises(ValueError, match=r"q_proj\.weight' has shape \[256, 256\], config\.json implies \[512, 256\]"):
            load_hf(path, progress=False)


@pytest.mark.parametrize("spec,change", [
    ("mistral-window", {"max_position_embeddings": 8192}),
    ("qwen3-gqa-hd64-tied", {"use_sliding_window": True, "max_window_layers": 0, "layer_types": None}),
])
def test_an_absent_sliding_window_takes_transformers_default(tmp_path, spec, change):
    """Without sliding_window in config.json transformers' MistralConfig and Qwen3Config take
    4096 (null is no window). Found by fuzzing configs: both had read an absent key as null, so
    a Mistral model attended to all of its 8192 positions where transformers slides over 4096
    (logits off by 1e-2 of their range past position 4096), and a Qwen3 model whose sliding
    layers transformers runs loaded as full attention."""
    from transformers import AutoConfig

    path, _, _ = H.make_model_dir(spec, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("sliding_window")
    cfg.update(change)
    (path / "config.json").write_text(json.dumps(cfg))
    assert AutoConfig.from_pretrained(path).sliding_window == 4096
    if H.SPECS[spec].hf_class == "Mistral":
        assert load_hf(path, progress=False)[0].max_position == 4096
    else:
        with pytest.raises(ValueError, match="sliding-window attention"):
            load_hf(path, progress=False)


def test_an_absent_sliding_window_is_no_window_for_llama(tmp_path):
    """LlamaConfig has no sliding_window (transformers' Llama never slides): a Llama config.json
    with use_sliding_window and no window key loads with full attention, as it did before the
    Qwen3 / Mistral default of 4096 was applied to every class (it was refused as sliding)."""
    from transformers import AutoConfig

    path, _, _ = H.make_model_dir("llama-gqa", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    assert "sliding_window" not in cfg
    cfg.update(use_sliding_window=True, max_window_layers=0)
    (path / "config.json").write_text(json.dumps(cfg))
    assert getattr(AutoConfig.from_pretrained(path), "sliding_window", None) is None
    assert load_hf(path, progress=False)[0].max_position == cfg["max_position_embeddings"]


@pytest.mark.parametrize("spec", ["llama-gqa", "mistral-window"])
def test_use_sliding_window_is_qwen3s_flag(tmp_path, spec):
    """use_sliding_window / max_window_layers are Qwen2 / Qwen3 config keys: transformers' Llama
    attention never slides and Mistral's always slides over sliding_window, whatever the flag.
    A Llama or Mistral config.json with the flag and a window had been refused as sliding; it
    loads as transformers runs it (transformers on the edited directory is the oracle)."""
    from transformers import AutoModelForCausalLM

    path, _, _ = H.make_model_dir(spec, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    window = cfg.get("sliding_window")
    cfg.update(use_sliding_window=True, max_window_layers=0, sliding_window=window or 16)
    (path / "config.json").write_text(json.dumps(cfg))
    c = load_hf(path, progress=False)[0]
    assert c.max_position == (window if window else cfg["max_position_embeddings"])
    ids = list(range(3, 3 + min(40, c.max_position)))   # past the window of 16 given to Llama
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0]
    got = qz.load_model(path, progress=False).logits(ids)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4


@pytest.mark.parametrize("spec,change", [
    ("llama-gqa", {"layer_types": ["sliding_attention"] * 2, "sliding_window": 16}),
    ("llama-gqa", {"layer_types": ["sliding_attention", "full_attention"]}),
    ("mistral-window", {"layer_types": ["full_attention", "sliding_attention"]}),
], ids=["llama-window", "llama-no-window", "mistral"])
def test_layer_types_are_read_for_qwen3_only(tmp_path, spec, change):
    """transformers' LlamaModel never reads layer_types: one causal mask serves every layer, so a
    Llama config listing sliding layers runs as full attention, past its window too. A Mistral
    one loads as Ministral (AutoConfig's rule), whose listed layers slide: the runner's context
    ends at the window as for any Mistral. Both had been refused as sliding. transformers on the
    edited directory is the oracle (use_cache=False: its cache, not its attention, reads
    layer_types, and fails on the Llama one without a window). An entry transformers does not
    know is refused, as transformers refuses it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path, _, _ = H.make_model_dir(spec, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(change)
    (path / "config.json").write_text(json.dumps(cfg))
    c = load_hf(path, progress=False)[0]
    window = cfg["sliding_window"] if H.SPECS[spec].hf_class == "Mistral" else None
    assert c.max_position == (window or cfg["max_position_embeddings"])
    ids = list(range(3, 3 + min(40, c.max_position)))   # past the window of 16 given to Llama
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0]
    got = qz.load_model(path, progress=False).logits(ids)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4
    cfg["layer_types"] = ["bogus_attention", "full_attention"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="The `layer_types` entries must be in"):   # (huggingface_hub's error)
        AutoConfig.from_pretrained(path)
    with pytest.raises(ValueError, match=r"config\.json: layer_types entry 'bogus_attention' is not supported"):
        load_hf(path, progress=False)


@pytest.mark.parametrize("spec", ["llama-gqa", "mistral-window"])
def test_max_window_layers_is_not_checked_for_llama_or_mistral(tmp_path, spec):
    """transformers' LlamaConfig / MistralConfig neither read nor check max_window_layers (a
    Qwen3 key): a value Qwen3Config would refuse loads (it had been refused as not an integer)."""
    from transformers import AutoConfig

    path, _, _ = H.make_model_dir(spec, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(use_sliding_window=True, max_window_layers="0")
    (path / "config.json").write_text(json.dumps(cfg))
    AutoConfig.from_pretrained(path)   # (the oracle: transformers takes it)
    c = load_hf(path, progress=False)[0]
    assert c.max_position == (cfg.get("sliding_window") or cfg["max_position_embeddings"])


@pytest.mark.parametrize("spec,drop", [
    (H.Spec("mistral-kv8", arch="llama", hf_class="Mistral", hidden=128, heads=16, kv_heads=8, head_dim=16,
            intermediate=128, layers=1, rope_theta=1e4, eps=1e-5), "num_key_value_heads"),
    (H.SPECS["qwen3-gqa-hd64-tied"], "max_position_embeddings"),
    (H.SPECS["llama-gqa"], "max_position_embeddings"),
    # (v0.2 on: sliding_window null, so the context is 131072; with a window it would be the window
    # however the context's default read)
    (H.Spec("mistral-nowindow", arch="llama", hf_class="Mistral", hidden=128, heads=4, kv_heads=1, head_dim=32,
            intermediate=128, layers=1, rope_theta=1e4, eps=1e-5, extra={"sliding_window": None}),
     "max_position_embeddings"),
    # Llama 3 RoPE's pre-training context falls back to it too (had been refused as missing)
    (H.SPECS["llama3-rope"], "max_position_embeddings"),
], ids=["mistral-kv-heads", "qwen3-context", "llama-context", "mistral-context", "llama3-rope-context"])
def test_absent_keys_take_transformers_class_defaults(tmp_path, spec, drop):
    """Found by fuzzing configs: a key config.json leaves out is the default of transformers'
    config class, not one value for all three. An absent num_key_value_heads is 8 for Mistral
    (32 for Qwen3; Llama's, and a null one, num_attention_heads): a 16-head, 8-KV-head Mistral
    checkpoint that transformers loads had been refused, its k_proj's shape against 16 KV heads.
    An absent max_position_embeddings (the context) is 32768 for Qwen3, 2048 for Llama and
    131072 for Mistral, not 4096 for every one. transformers' own reading of the edited
    directory is the oracle for the logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model, tok = H.build_hf_model(spec)
    path = H.save_hf_dir(model, tok, tmp_path / spec.name)
    cfg = json.loads((path / "config.json").read_text())
    del cfg[drop]
    if "rope_parameters" in spec.extra:
        del cfg["rope_parameters"]["original_max_position_embeddings"]
    (path / "config.json").write_text(json.dumps(cfg))
    want = AutoConfig.from_pretrained(path)
    c = load_hf(path, progress=False)[0]
    assert c.num_kv_heads == want.num_key_value_heads
    assert c.max_position == min(want.max_position_embeddings, getattr(want, "sliding_window", None) or 1 << 62)
    ids = list(range(3, 70))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0]
    got = qz.load_model(path, progress=False).logits(ids)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4


@pytest.mark.parametrize("spec,change,cls", [
    # architectures absent: transformers goes by model_type (it had been refused)
    ("mistral-window", {"architectures": None}, "MistralForCausalLM"),
    ("llama-gqa", {"architectures": []}, "LlamaForCausalLM"),
    # model_type absent: transformers' AutoConfig refuses the directory; the class architectures
    # names (what its own from_pretrained and llama.cpp's converter go by) loads as before
    ("mistral-window", {"model_type": None}, "MistralForCausalLM"),
], ids=["no-architectures-mistral", "no-architectures-llama", "no-model_type"])
def test_the_model_class_is_model_types_as_in_transformers(tmp_path, spec, change, cls):
    """transformers' AutoConfig / AutoModelForCausalLM pick the class by config.json's
    model_type and never read architectures; the loader read architectures only, so a directory
    without it, which transformers loads, was refused. The class decides defaults and attention
    (Mistral's window caps the context): the oracle is transformers' class on the same directory."""
    import transformers
    from transformers import AutoModelForCausalLM

    path, _, _ = H.make_model_dir(spec, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    for k, v in change.items():
        cfg.pop(k) if v is None else cfg.update({k: v})
    (path / "config.json").write_text(json.dumps(cfg))
    if "model_type" in cfg:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        with pytest.raises(ValueError, match="Should have a `model_type` key"):
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        hf = getattr(transformers, cls).from_pretrained(path, dtype=torch.float32)
    assert type(hf).__name__ == cls
    c = load_hf(path, progress=False)[0]
    assert c.max_position == min(hf.config.max_position_embeddings, getattr(hf.config, "sliding_window", None) or 1 << 62)
    ids = list(range(3, 3 + min(60, c.max_position)))
    with torch.no_grad():
        ref = hf.eval()(torch.tensor([ids])).logits[0]
    got = qz.load_model(path, progress=False).logits(ids)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4


@pytest.mark.parametrize("spec,change,hf_loads,needle", [
    # transformers runs LlamaForCausalLM (full attention, the window ignored), a tool reading
    # architectures Mistral's window: had loaded as Mistral, by architectures
    ("mistral-window", {"model_type": "llama"}, "LlamaForCausalLM",
     "model_type='llama' and architectures=['MistralForCausalLM'] name different models"),
    # ... and here MistralForCausalLM with its default window of 4096 (had loaded as Llama)
    ("llama-gqa", {"model_type": "mistral"}, "MistralForCausalLM",
     "model_type='mistral' and architectures=['LlamaForCausalLM'] name different models"),
    # a model_type transformers does not know (custom code, a fork): had loaded as Llama
    ("llama-gqa", {"model_type": "my_llama"}, "does not recognize this architecture",
     "model_type='my_llama' is not supported (architectures=['LlamaForCausalLM'])"),
    ("llama-gqa", {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, "Qwen2ForCausalLM",
     "model_type='qwen2' is not supported (architectures=['Qwen2ForCausalLM']); expected one of"),
    ("llama-gqa", {"model_type": None, "architectures": None}, "Should have a `model_type` key",
     "architectures=None is not supported; expected one of ['LlamaForCausalLM', 'MistralForCausalLM', "
     "'Qwen3ForCausalLM'] (and there is no model_type)"),
], ids=["mistral-as-llama", "llama-as-mistral", "unknown", "qwen2", "neither"])
def test_model_type_and_architectures_must_name_one_model(tmp_path, spec, change, hf_loads, needle):
    """config.json's model_type (what transformers loads) and architectures (what llama.cpp's
    converter and the class's own from_pretrained load) naming different models, or a
    model_type the runner does not know, is one clear error naming both fields: which model the
    file means cannot be told, and the two compute different things past a window. hf_loads:
    the class transformers' AutoModelForCausalLM makes of the directory, or its error."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path, _, _ = H.make_model_dir(spec, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    for k, v in change.items():
        cfg.pop(k) if v is None else cfg.update({k: v})
    (path / "config.json").write_text(json.dumps(cfg))
    if hf_loads.endswith("ForCausalLM"):   # (from_pretrained picks the class the same way)
        assert type(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))).__name__ == hf_loads
    else:
        with pytest.raises(ValueError, match=re.escape(hf_loads)):
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with pytest.raises(ValueError) as e:
        load_hf(path, progress=False)
    assert needle in str(e.value) and str(e.value).count("config.json") == 1, str(e.value)


def test_an_absent_num_key_value_heads_is_named_with_its_default(tmp_path):
    """Qwen3's absent num_key_value_heads is 32: with 4 heads the error says where 32 comes from
    (the file has no such key)."""
    path, _, _ = H.make_model_dir("qwen3-gqa-hd64-tied", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["num_key_value_heads"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not a multiple of num_key_value_heads=32 "
                                         r"\(absent: transformers' Qwen3ForCausalLM default\)"):
        load_hf(path, progress=False)

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("shards", ["none", "unreadable"])
@pytest.mark.parametrize("change,needle", [
    ({"vocab_size": None}, "missing key 'vocab_size'"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings='no' must be true or false"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config.quant_method='gptq' is not supported"),
    ({"rope_scaling": {**LLAMA3, "high_freq_factor": 1.0}}, "high_freq_factor=1.0 must exceed low_freq_factor=1.0"),
])
def test_config_errors_come_before_the_checkpoints_with_llama3_rope(dirs, tmp_path, shards, change, needle):
    """With Llama 3 RoPE the head size is checked against the checkpoint's largest dimension,
    which opens the safetensors files: that had happened in the middle of parse_config, so a
    config.json error found after it (a missing vocab_size, a bad quantization_config, ...) was
    reported as the directory's missing or unreadable *.safetensors instead."""
    d = tmp_path / "cfg"
    shutil.copytree(dirs["fp32"], d)
    for f in d.glob("*.safetensors"):
        if shards == "none":
            f.unlink()
        else:
            f.write_bytes(b"junk")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update({"rope_scaling": LLAMA3, **change})
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=re.escape(needle)):
        load_hf(d, progress=False)



def test_not_a_model_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(tmp_path, progress=False)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hf(tmp_path, progress=False)


def _copy_and(src, dst, edit):
    shutil.copytree(src, dst)
    edit(dst)
    return dst


@pytest.mark.parametrize("edit,needle", [
    (lambda d: (d / "config.json").write_text("[1, 2]"), "config.json must hold a JSON object, not a list"),
    (lambda d: (d / "generation_config.json").write_text("null"), "must hold a JSON object, not a NoneType"),
    (lambda d: (d / "generation_config.json").write_text('{"eos_token_id": "<|im_end|>"}'),
     "generation_config.json: eos_token_id='<|im_end|>' is not a token id"),
    (lambda d: (d / "tokenizer.json").write_text('{"model": '), "tokenizer.json: not a tokenizer the"),
    (lambda d: (d / "tokenizer_config.json").write_text('{"chat_template": []}'),
     "chat_template is a list without {name, template} entries"),
    (lambda d: (d / "tokenizer_config.json").write_text('{"eos_token": 5}'), "eos_token=5 must be a token string"),
    # found by fuzzing: RecursionError; Python's bare ValueError about a 5000-digit integer
    # (no file named); a post_processor naming a token the vocabulary lacks made `tokenizers`
    # panic (pyo3's PanicException, a BaseException even the CLI did not catch)
    (lambda d: (d / "config.json").write_text("[" * 100000 + "]" * 100000),
     "config.json: config.json is not valid JSON (RecursionError"),
    (lambda d: (d / "generation_config.json").write_text('{"max_length": ' + "1" * 5000 + "}"),
     "generation_config.json: generation_config.json is not valid JSON (ValueError: Exceeds the limit"),
    (lambda d: (d / "tokenizer.json").write_text(json.dumps({
        **json.loads((d / "tokenizer.json").read_text()),
        "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}],
                           "pair": [], "special_tokens": {}}})),
     "tokenizer.json: the tokenizer fails to encode with its special tokens"),
    # a raw UnicodeDecodeError; a bad special_tokens_map.json value blamed on tokenizer_config.json
    (lambda d: (d / "chat_template.jinja").write_bytes(b"\xff{{ x }}"), "chat_template.jinja: not UTF-8 text"),
    # a directory of that name: a bare "[Errno 21] Is a directory"
    (lambda d: (d / "chat_template.jinja").mkdir(), "chat_template.jinja: cannot be read as a chat template (Is a directory)"),
    # a named template file is named, not chat_template.jinja; an entry of the list without a
    # name is the list's error (transformers: a KeyError 'name'), not a KeyError
    (lambda d: ((d / "additional_chat_templates").mkdir(), (d / "additional_chat_templates" / "bad.jinja")
                .write_bytes(b"\xff{{ x }}")), "additional_chat_templates/bad.jinja: not UTF-8 text"),
    (lambda d: (d / "tokenizer_config.json").write_text('{"chat_template": [{"template": "x"}]}'),
     "chat_template is a list without {name, template} entries"),
    (lambda d: (d / "special_tokens_map.json").write_text('{"bos_token": 5}'),
     "special_tokens_map.json: bos_token=5 must be a token string"),
    # bool("false") and bool([False]) are True: the EOS / BOS had been added to every prompt
    (lambda d: (d / "tokenizer_config.json").write_text('{"add_eos_token": "false"}'),
     "tokenizer_config.json: add_eos_token='false' must be a boolean, not str"),
    (lambda d: (d / "tokenizer_config.json").write_text('{"add_bos_token": [false]}'),
     "tokenizer_config.json: add_bos_token=[False] must be a boolean, not list"),
    # a BOS / EOS asked for that the vocabulary lacks had been left out of every prompt without a word
    (lambda d: (d / "tokenizer_config.json").write_text('{"add_bos_token": true, "bos_token": "<s>"}'),
     "tokenizer_config.json: add_bos_token is true, but bos_token='<s>' is not in tokenizer.json's vocabulary"),
    (lambda d: (d / "tokenizer_config.json").write_text('{"add_eos_token": true, "eos_token": {"content": "</s>"}}'),
     "tokenizer_config.json: add_eos_token is true, but eos_token='</s>' is not in tokenizer.json's vocabulary"),
])
def test_bad_side_files_are_clear_errors(dirs, tmp_path, edit, needle):
    """config / generation config / tokenizer files of the wrong shape, and a tokenizer larger
    than the embedding (which would crash the first lookup): one line naming the file."""
    d = _copy_and(dirs["fp32"], tmp_path / "m", edit)
    with pytest.raises(ValueError) as e:
        load_hf(d, progress=False)
    assert needle in str(e.value), str(e.value)


def test_add_bos_token_without_a_bos_token_warns(dirs, tmp_path):
    """add_bos_token true and no bos_token: transformers' Llama tokenizer refuses it, its Qwen2 one
    adds nothing; the runner adds nothing too, and says so (it had said nothing)."""
    d = _copy_and(dirs["fp32"], tmp_path / "m",
                  lambda d: (d / "tokenizer_config.json").write_text('{"add_bos_token": true, "bos_token": null}'))
    with pytest.warns(UserWarning, match="tokenizer_config.json: add_bos_token is true, but no bos_token is "
                                         "given: none is added"):
        _, _, tok, _ = load_hf(d, progress=False)
    assert not tok.add_bos


def test_tokenizer_larger_than_the_embedding_warns(dirs, tmp_path):
    """Such HF checkpoints exist (an added <pad> past the embedding) and load, with a warning;
    an id past the embedding fed to the model is then a clear error, not an index crash; and an
    eos id past the vocabulary is ignored with a warning (as llama.cpp does)."""
    def edit(d):
        H.build_tokenizer(400).save(str(d / "tokenizer.json"))
        (d / "generation_config.json").write_text('{"eos_token_id": [5000, 7]}')

    d = _copy_and(dirs["fp32"], tmp_path / "m", edit)
    with pytest.warns(UserWarning) as w:
        m = qz.load_model(d, progress=False)
    said = " | ".join(str(x.message) for x in w)
    assert "the tokenizer has 400 tokens, the embedding only 320 rows" in said, said
    assert "eos_token_id=5000 is not one of the 320 token ids: ignored" in said, said
    assert 7 in m.config.eos_token_ids and 5000 not in m.config.eos_token_ids
    with pytest.raises(ValueError, match=r"token id 399 is not a row of the 320-row embedding"):
        m.logits([1, 399])


@pytest.mark.parametrize("bad", ["far", "shared"])
def test_a_tokenizer_id_past_the_embedding_or_shared_is_said(dirs, tmp_path, bad):
    """Found by fuzzing: `tokenizers` loads a tokenizer.json whose vocabulary gives a token an id
    far past the rest (its token count, which the check above compares, stays the same) or the id
    of another token; both loaded without a word (a prompt holding the token then encoded to an id
    the embedding lacks, or to the other token's)."""
    vocab = json.loads((dirs["fp32"] / "tokenizer.json").read_text())["model"]["vocab"]
    first, fifth = min(vocab, key=vocab.get), next(t for t, i in vocab.items() if i == 5)

    def edit(d):
        tj = json.loads((d / "tokenizer.json").read_text())
        tj["model"]["vocab"][first] = 1000 if bad == "far" else 5
        (d / "tokenizer.json").write_text(json.dumps(tj))

    d = _copy_and(dirs["fp32"], tmp_path / "m", edit)
    want = (f"{d}: the tokenizer's token {first!r} has id 1000, the embedding only 320 rows" if bad == "far" else
            f"{d / 'tokenizer.json'}: tokens {min(first, fifth)!r} and {max(first, fifth)!r} share id 5")
    with pytest.warns(UserWarning, match=re.escape(want)):
        load_hf(d, progress=False)


def test_an_awq_checkpoint_without_its_quantization_config_is_named(dirs, tmp_path):
    """Found by fuzzing: an AWQ directory whose config.json lost quantization_config was refused
    as missing the float q_proj.weight, not for the config it lacks."""
    d = _copy_and(dirs["awq"], tmp_path / "m", lambda d: (d / "config.json").write_text(json.dumps(
        {k: v for k, v in json.loads((d / "config.json").read_text()).items() if k != "quantization_config"})))
    with pytest.raises(ValueError) as e:
        load_hf(d, progress=False)
    assert str(e.value) == (f"{d / 'config.json'}: no quantization_config, but model.safetensors holds "
                            "'model.layers.0.self_attn.q_proj.qweight', an AWQ checkpoint's, where "
                            "'model.layers.0.self_attn.q_proj.weight' is expected")


@pytest.mark.parametrize("key", ["bos_token_id", "eos_token_id"])
def test_a_bad_generation_config_id_names_that_file(dirs, tmp_path, key):
    """Found by fuzzing: a bad bos_token_id of generation_config.json (config.json having none) was
    blamed on config.json, and a bad eos_token_id named the file without its directory."""
    def edit(d):
        for name, change in (("config.json", lambda c: c.pop(key, None)),
                             ("generation_config.json", lambda c: c.__setitem__(key, "x"))):
            c = json.loads((d / name).read_text())
            change(c)
            (d / name).write_text(json.dumps(c))

    d = _copy_and(dirs["fp32"], tmp_path / "m", edit)
    with pytest.raises(ValueError) as e:
        load_hf(d, progress=False)
    assert str(e.value) == f"{d / 'generation_config.json'}: {key}='x' is not a token id"


def test_bias_tensors_are_refused(dirs, tmp_path):
    """The runner's linears have no bias: a checkpoint with one must not load (silently wrong)."""
    name = "model.layers.0.self_attn.q_proj.bias"
    d = _edited_copy(dirs["fp32"], tmp_path / "b", "model.safetensors",
                     lambda t: t.update({name: np.zeros(256, np.float32)}))
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensor '{name}': the runner's linears have no biases"):
        load_hf(d, progress=False)


def test_sliding_window_settings_that_change_nothing_load(dirs, tmp_path):
    """Qwen3 configs name a window that no layer uses (use_sliding_window false, or every layer
    below max_window_layers, or layer_types all full): they load."""
    for i, change in enumerate([{"use_sliding_window": False, "sliding_window": 4096, "layer_types": None},
                                {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 99,
                                 "layer_types": None},
                                {"layer_types": ["full_attention"] * 2}]):
        d = tmp_path / f"ok{i}"
        shutil.copytree(dirs["fp32"], d)
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(change)
        (d / "config.json").write_text(json.dumps(cfg))
        load_hf(d, progress=False)


def test_tensors_the_config_does_not_use_are_refused(dirs, tmp_path):
    """A checkpoint tensor the config does not describe would be dropped without a word: a layer
    past num_hidden_layers, q/k norms under a llama label. RoPE's inv_freq buffers and a tied
    model's stored lm_head are what transformers ignores too: they load."""
    d = tmp_path / "fewer"
    shutil.copytree(dirs["fp32"], d)
    cfg = json.loads((d / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": n - 1, "layer_types": None}))
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensor 'model\.layers\.{n - 1}\..*not part of "
                                         rf"the qwen3 model config\.json describes \({n - 1} layers\)"):
        load_hf(d, progress=False)
    d = tmp_path / "llama"
    shutil.copytree(dirs["fp32"], d)
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.\d+\.self_attn\.[qk]_norm\.weight'"):
        load_hf(d, progress=False)
    assert cfg["tie_word_embeddings"]
    ok = _edited_copy(dirs["fp32"], tmp_path / "ok", "model.safetensors", lambda t: t.update({
        "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(32, np.float32),
        "lm_head.weight": t["model.embed_tokens.weight"]}))
    _, w, _, _ = load_hf(ok, progress=False)
    assert "lm_head.weight" not in w and not any("inv_freq" in k for k in w)


def test_quantizing_a_nan_weight_names_file_and_tensor(dirs, tmp_path, capsys):
    name = "model.layers.0.self_attn.q_proj.weight"

    def nan(t):
        t[name][0, 0] = np.nan

    d = _edited_copy(dirs["fp32"], tmp_path / "nan", "model.safetensors", nan)
    assert cli(["quantize", str(d), str(tmp_path / "x.gguf"), "--format", "q8_0", "--quiet"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"nan/model.safetensors: tensor '{name}': row 0 holds NaN or inf (1 rows do); "
                        "the file is corrupt"), err
    assert err.count("\n") == 0, err


@pytest.mark.parametrize("src,name", [("fp32", "model.layers.0.self_attn.q_proj.weight"),
                                      ("bf16", "model.embed_tokens.weight"),
                                      ("awq", "model.layers.0.mlp.down_proj.scales")])
def test_loading_a_nan_or_inf_weight_names_file_and_tensor(dirs, tmp_path, src, name):
    """A NaN in q_proj hid at prefill (torch's CPU attention made NaN scores 0) and gave token 0
    forever at decode; a NaN embedding row mattered once its token came up. Refused at load."""
    from safetensors.torch import load_file, save_file   # (numpy has no bfloat16)

    shard = "model.safetensors"
    for bad in (np.nan, np.inf):
        d = tmp_path / f"{src}-{bad}"
        shutil.copytree(dirs[src], d)
        t = load_file(str(d / shard))
        t[name][2, 1] = bad
        save_file(t, str(d / shard), metadata={"format": "pt"})
        row = 1 if src == "awq" else 2   # (AWQ scales are [K/G, N]: column 1 is the weight's row 1)
        with pytest.raises(ValueError, match=rf"{shard}: tensor '{re.escape(name)}': row {row} holds NaN or inf "
                                             rf"(in its scales )?\(1 rows do\); the file is corrupt"):
            qz.load_model(d, progress=False)


def test_broken_chat_template_is_a_clear_error(dirs, tmp_path):
    from quantzoo.model.hf_loader import load_tokenizer

    d = _copy_and(dirs["fp32"], tmp_path / "t", lambda d: (d / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": "{% for m in messages %}{{ m }"})))
    tok = load_tokenizer(d)
    with pytest.raises(ValueError, match=r"the model's chat template \(line 1\): TemplateSyntaxError"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("template,needle", [
    ("{{ 1/0 }}", "ZeroDivisionError: division by zero"),
    ("{% for i in range(10**9) %}x{% endfor %}", "OverflowError: Range too big"),
])
def test_chat_template_runtime_errors_are_clear(dirs, tmp_path, template, needle):
    """Found by fuzzing: errors of the template's own Python operations are no TemplateError and
    passed through raw (a traceback from `quantzoo run model --chat`)."""
    from quantzoo.model.hf_loader import load_tokenizer

    d = _copy_and(dirs["fp32"], tmp_path / "t", lambda d: (d / "chat_template.jinja").write_text(template))
    with pytest.raises(ValueError, match=rf"the model's chat template fails: {needle}"):
        load_tokenizer(d).encode_chat([{"role": "user", "content": "hi"}])


def test_quantization_config_format_key_and_transformers_parses_ours(dirs):
    """transformers 5 writes the packing as "format"; and its AwqConfig reads what we write."""
    from transformers import AwqConfig

    base = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}
    assert parse_quantization_config({**base, "format": "gemm"})["group_size"] == 128
    with pytest.raises(ValueError, match="quantization_config.format='gemv'"):
        parse_quantization_config({**base, "format": "gemv"})
    ours = json.loads((dirs["awq"] / "config.json").read_text())["quantization_config"]
    q = AwqConfig.from_dict(dict(ours))
    assert (q.bits, q.group_size, q.zero_point, str(q.format).lower()) == (4, 128, True, "gemm")


def test_generation_config_eos_ids_are_merged(dirs, tmp_path):
    d = tmp_path / "gen"
    shutil.copytree(dirs["fp32"], d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [299, 297], "do_sample": False}))
    config, _, tok, gen = load_hf(d, progress=False)
    assert gen["eos_token_id"] == [299, 297]
    assert config.eos_token_ids == [299, 297] and tok.eos_token_ids == [299, 297]


def test_truncated_or_corrupt_safetensors(dirs, tmp_path):
    d = tmp_path / "trunc"
    shutil.copytree(dirs["awq"], d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        load_hf(d, progress=False)
    f.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        load_hf(d, progress=False)
    d2 = tmp_path / "index"
    shutil.copytree(dirs["sharded"], d2)
    shard = sorted(d2.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"names shard {shard.name}, which does not exist"):
        load_hf(d2, progress=False)


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path):
    """transformers: "If independent chat template file(s) exist, they take priority over template
    entries in the tokenizer config". The loader had it the other way round."""
    from transformers import AutoTokenizer

    from quantzoo.model.hf_loader import load_tokenizer

    H.build_tokenizer(300).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast",
         "chat_template": "OLD {{ messages[0]['content'] }}"}))
    (tmp_path / "chat_template.jinja").write_text("NEW {{ messages[0]['content'] }}")
    msgs = [{"role": "user", "content": "hi"}]
    want = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(msgs, tokenize=False)
    assert want == "NEW hi"
    assert load_tokenizer(tmp_path).apply_chat_template(msgs) == want


def test_special_tokens_map_json_gives_bos_and_eos(tmp_path):
    """A tokenizer_config.json without bos/eos (nor added_tokens_decoder), the tokens in
    special_tokens_map.json: transformers takes them from there. The loader read only the config,
    so the template's bos_token/eos_token rendered as "" (no BOS at all) and no eos id was known."""
    from transformers import AutoTokenizer

    from quantzoo.model.hf_loader import load_tokenizer

    H.build_tokenizer(300).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast",
         "chat_template": "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}"}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "lstrip": False,
                                                     "normalized": False, "rstrip": False, "single_word": False}}))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    tok = load_tokenizer(tmp_path)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == hf.apply_chat_template(msgs, tokenize=False) == "<|im_start|>hi<|im_end|>"
    assert (tok.bos_token_id, tok.eos_token_ids) == (hf.bos_token_id, [hf.eos_token_id])


def test_ambiguous_or_escaping_shards_are_refused(dirs, tmp_path):
    """Found by fuzzing. Without an index, a tensor stored in two files took the first file's
    copy without a word; an index may not name files outside the model directory."""
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "two"
    shutil.copytree(dirs["fp32"], d)
    w = load_file(d / "model.safetensors")
    save_file({"model.norm.weight": w["model.norm.weight"] * 2}, d / "zz-extra.safetensors")
    with pytest.raises(ValueError, match=r"tensor 'model\.norm\.weight' is in both model\.safetensors and "
                                         r"zz-extra\.safetensors \(and no model\.safetensors\.index\.json"):
        load_hf(d, progress=False)
    for target in (str(dirs["fp32"] / "model.safetensors"), "../fp32/model.safetensors"):
        d = tmp_path / "esc"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(dirs["sharded"], d)
        idx = json.loads((d / "model.safetensors.index.json").read_text())
        idx["weight_map"]["model.norm.weight"] = target
        (d / "model.safetensors.index.json").write_text(json.dumps(idx))
        with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: weight_map\['model\.norm\.weight'\]="
                                             r".* is not a file name in"):
            load_hf(d, progress=False)


def test_awq_shape_error_names_the_config(dirs, tmp_path):
    """A config.json whose dims do not fit AWQ: the message named the module but no file."""
    d = tmp_path / "awqdim"
    shutil.copytree(dirs["awq"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"awqdim/config\.json: model\.layers\.0\.mlp\.gate_proj: shape "
                                         r"\(out=100, in=256\) does not fit AWQ group_size=128"):
        load_hf(d, progress=False)


def test_extra_chat_template_variables_reach_the_template_as_in_transformers(tmp_path):
    """apply_chat_template(**variables) as transformers' apply_chat_template(**kwargs): Qwen3's
    templates read `enable_thinking` (an empty think block when it is false). The template here is
    written for the test in that style; transformers renders the same text with and without the
    variable, and the two texts differ. A variable the renderer sets itself is refused."""
    from transformers import AutoTokenizer

    from quantzoo.model.hf_loader import load_tokenizer

    H.build_tokenizer(300).save(str(tmp_path / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                "{% endif %}{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template}))
    hf, tok = AutoTokenizer.from_pretrained(str(tmp_path)), load_tokenizer(tmp_path)
    msgs = [{"role": "user", "content": "hi"}]
    plain = tok.apply_chat_template(msgs)
    off = tok.apply_chat_template(msgs, enable_thinking=False)
    assert plain == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert off == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off == plain + "<think>\n\n</think>\n\n"
    assert tok.encode_chat(msgs, enable_thinking=False) == tok.encode(off, add_bos=False, add_eos=False)
    with pytest.raises(ValueError, match=r"chat template variables: \['bos_token'\] are set by the renderer"):
        tok.apply_chat_template(msgs, bos_token="<s>")


def test_swish_is_silu(dirs, tmp_path):
    """hidden_act "swish" is SiLU in transformers (ACT2FN): it had been refused as unsupported.
    transformers reading the edited directory is the oracle for the logits."""
    from transformers import AutoModelForCausalLM

    d = tmp_path / "swish"
    shutil.copytree(dirs["fp32"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_act"] = "swish"
    (d / "config.json").write_text(json.dumps(cfg))
    ids = list(range(3, 40))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0]
    got = qz.load_model(d, progress=False).logits(ids)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4
