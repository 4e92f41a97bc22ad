"""Load a Hugging Face model directory: AWQ ("gemm") checkpoints or plain fp16/bf16/fp32 ones.

    load_hf(path) -> (ModelConfig, weights, Tokenizer | None, generation_config: dict)

What is read, in order, and checked before any tensor is used:
  config.json               model_type qwen3 / llama / mistral and architectures Qwen3ForCausalLM /
                            LlamaForCausalLM / MistralForCausalLM, naming the same class where
                            both are given (a sliding window caps the context), the dims, and
                            `quantization_config` (DESIGN.md §3: quant_method awq, bits 4,
                            version gemm, zero_point true; group_size; extra keys ignored;
                            `modules_to_not_convert` honoured).
  *.safetensors             through the `safetensors` package (memory-mapped); sharded
                            checkpoints through model.safetensors.index.json. Every expected
                            tensor is located, its shape and dtype compared with the config.
  tokenizer.json            through the runner's Tokenizer (the `tokenizers` package), with
                            tokenizer_config.json (special tokens, chat template).
  generation_config.json    when present: its eos and bos ids (its sampling settings are not
                            applied: generation is greedy unless a temperature is given).

Weights come back under their HF names (see quantzoo/model/config.py): AWQ linears as
QuantizedTensor("awq") built by the registry from qweight/qzeros/scales; everything else as
torch tensors in the dtype the file stores (fp16/bf16/fp32), the model casts them.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

# Mistral is Llama's architecture (llama.cpp converts it to arch "llama" too) but for v0.1's
# sliding window, which parse_config turns into a context limit.
ARCHS = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama"}
# config.json's model_type -> its class: transformers' Auto classes go by model_type (architectures
# is not read), llama.cpp's converter by architectures; model_class holds the two to one model
MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
AWQ_SUFFIXES = ("qweight", "qzeros", "scales")
# transformers' Qwen3Config and MistralConfig take this window where config.json has no
# sliding_window key (null there is no window); LlamaConfig has none (Llama never slides)
DEFAULT_SLIDING_WINDOW = 4096
# and these where it has no such key (an absent num_key_value_heads is Llama's, and a null
# one every class's, num_attention_heads)
CLASS_DEFAULTS = {"Qwen3ForCausalLM": {"num_key_value_heads": 32, "max_position_embeddings": 32768,
                                       "sliding_window": DEFAULT_SLIDING_WINDOW},
                  "LlamaForCausalLM": {"max_position_embeddings": 2048},
                  "MistralForCausalLM": {"num_key_value_heads": 8, "max_position_embeddings": 131072,
                                         "sliding_window": DEFAULT_SLIDING_WINDOW}}


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ValueError(f"{path}: {what} is not a file")
    try:
        with open(path, encoding="utf-8") as f:
            v = json.load(f)
    except (ValueError, RecursionError) as e:   # JSONDecodeError, UnicodeDecodeError, an integer
        # literal past Python's 4300-digit limit (a bare ValueError), nesting deeper than the stack
        raise ValueError(f"{path}: {what} is not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(v, dict):
        raise ValueError(f"{path}: {what} must hold a JSON object, not a {type(v).__name__}")
    return v


# ---------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------
def parse_quantization_config(qc: dict | None, where: str = "config.json") -> dict | None:
    """Validate an HF `quantization_config`; returns {group_size, modules_to_not_convert}.

    Only what our AWQ kernels compute is accepted; anything else is one clear error naming
    the field. Keys we do not use are ignored.
    """
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"{where}: quantization_config must be an object, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    if method != "awq":
        raise ValueError(f"{where}: quantization_config.quant_method={qc.get('quant_method')!r} is not "
                         "supported; only 'awq' checkpoints (or unquantized ones) load")
    want = {"bits": 4, "version": "gemm", "zero_point": True}
    # AutoAWQ writes "w_bit"/"q_group_size" in quant_config.json; HF configs use bits/group_size.
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{where}: quantization_config.bits={bits!r} is not supported; "
                         "the AWQ kernels are 4-bit (bits: 4)")
    # "version" (AutoAWQ, vLLM); transformers >= 5 also writes the same value as "format"
    vkey = "version" if "version" in qc else "format" if "format" in qc else None
    if "version" in qc and "format" in qc and str(qc["version"]).lower() != str(qc["format"]).lower():
        raise ValueError(f"{where}: quantization_config.version={qc['version']!r} and "
                         f"format={qc['format']!r} disagree")
    version = str(qc.get(vkey, "gemm") if vkey else "gemm").lower()
    if version != want["version"]:
        raise ValueError(f"{where}: quantization_config.{vkey}={qc.get(vkey)!r} is not supported; "
                         "only the 'gemm' packing (the layout of HF AWQ checkpoints) loads")
    zp = qc.get("zero_point", True)
    if zp is not True:
        raise ValueError(f"{where}: quantization_config.zero_point={zp!r} is not supported; "
                         "the AWQ format here has zero points (zero_point: true)")
    g = qc.get("group_size", qc.get("q_group_size"))
    from quantzoo.formats.awq import GROUP_SIZES

    if g not in GROUP_SIZES:
        raise ValueError(f"{where}: quantization_config.group_size={g!r} is not supported; "
                         f"choose one of {GROUP_SIZES}")
    skip = qc.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise ValueError(f"{where}: quantization_config.modules_to_not_convert must be a list of "
                         f"module names or null, got {skip!r}")
    return {"group_size": int(g), "modules_to_not_convert": list(skip)}


def _rope(cfg: dict, head_dim: int, where: str, context: int | None = None) -> tuple[float, object]:
    """(rope_theta, rope_freq_factors) from config.json: plain RoPE (None), or rope_type "llama3"
    (Llama 3.1+) as config.llama3_rope_factors -- a callable that computes them, its parameters
    checked here (the factors are a Python loop over head_dim / 2 frequencies: parse_config
    calls it once the head size is checked against the checkpoint). transformers 4 writes the
    scaling as `rope_scaling` beside `rope_theta`, transformers 5 both inside `rope_parameters`.

    Read as transformers 5 reads them (PreTrainedConfig.convert_rope_params_to_dict,
    standardize_rope_params): a non-empty `rope_scaling` replaces `rope_parameters`; the block's
    own rope_theta wins over the top-level one; llama3's original_max_position_embeddings is the
    top-level key where there is one, else the block's, else max_position_embeddings (context:
    its value where config.json has no such key, the config class's default)."""
    from .config import llama3_rope_factors, positive

    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    block = cfg.get(key) or {}
    if not isinstance(block, dict):
        raise ValueError(f"{where}: {key}={block!r} must be an object")
    top, inner = cfg.get("rope_theta"), block.get("rope_theta")
    top = 10000.0 if top is None else positive(top, float, f"{where}: rope_theta")
    theta = top if inner is None else positive(inner, float, f"{where}: {key}.rope_theta")
    for name, prf in (("partial_rotary_factor", cfg.get("partial_rotary_factor")),
                      (f"{key}.partial_rotary_factor", block.get("partial_rotary_factor"))):
        if prf is not None and prf != 1:   # (transformers' Llama / Qwen3 fail on one; it was ignored)
            raise ValueError(f"{where}: {name}={prf!r} is not supported (RoPE over the whole head only)")
    tkey = "rope_type" if "rope_type" in block else "type"   # (transformers 4 also wrote "type")
    rtype = block.get(tkey, "default")
    if rtype in (None, "default"):
        return theta, None
    if rtype != "llama3":
        raise ValueError(f"{where}: {key}.{tkey}={rtype!r} is not supported "
                         "(plain RoPE, rope_type 'default', or 'llama3')")
    p, ctx = {}, "original_max_position_embeddings"
    for k, kind in (("factor", float), ("low_freq_factor", float), ("high_freq_factor", float), (ctx, int)):
        found = [(f"{key}.{k}", block.get(k))]
        if k == ctx:   # the pre-training context as transformers finds it: a top-level key first
            found = [(k, cfg.get(k))] + found + [("max_position_embeddings",
                                                  cfg.get("max_position_embeddings", context))]
        name, v = next(((n, x) for n, x in found if x is not None), (f"{key}.{k}", None))
        if v is None:
            raise ValueError(f"{where}: {name} is missing (rope_type 'llama3' needs it)")
        p[k] = positive(v, kind, f"{where}: {name}")

    def factors(hd=head_dim):
        try:
            return llama3_rope_factors(theta, hd, p["factor"], p["low_freq_factor"],
                                       p["high_freq_factor"], p["original_max_position_embeddings"])
        except ValueError as e:
            raise ValueError(f"{where}: {key}.{e}") from None

    factors(0)   # its own checks of the parameters now (head_dim 0: no frequency to compute)
    return theta, factors


def model_class(cfg: dict, where: str = "config.json") -> str:
    """The model class config.json names: its model_type's, which transformers' AutoConfig and
    AutoModelForCausalLM load (architectures unread); where model_type is absent, the first
    supported class in architectures (what llama.cpp's converter and the class's own
    from_pretrained go by). Where both are given they must name the same class: a file whose
    model_type says Llama and architectures Mistral runs full attention in transformers and
    sliding in a tool reading architectures, so it is refused rather than one guessed."""
    archs, mtype = cfg.get("architectures"), cfg.get("model_type")
    listed = next((a for a in archs if isinstance(a, str) and a in ARCHS), None) if isinstance(archs, list) else None
    if (archs is not None and not isinstance(archs, list)) or (mtype is None and listed is None):
        raise ValueError(f"{where}: architectures={archs!r} is not supported; expected one of "
                         f"{sorted(ARCHS)}" + ("" if mtype is not None else " (and there is no model_type)"))
    if mtype is None:
        return listed
    typed = MODEL_TYPES.get(mtype) if isinstance(mtype, str) else None
    if typed is None:   # (transformers refuses a model_type it does not know, whatever architectures says)
        raise ValueError(f"{where}: model_type={mtype!r} is not supported (architectures={archs!r}); "
                         f"expected one of {sorted(MODEL_TYPES)}")
    if archs and typed not in archs:
        raise ValueError(f"{where}: model_type={mtype!r} and architectures={archs!r} name different models "
                         f"(transformers loads model_type's, {typed}; llama.cpp's converter architectures'); "
                         "make them agree")
    return typed


def parse_config(cfg: dict, generation_config: dict | None = None, where: str = "config.json",
                 largest_dim=None, gen_where: str = "generation_config.json"):
    """config.json dict -> (ModelConfig, quantization dict | None). where, gen_where: the two
    files, for messages.

    largest_dim: a callable giving the checkpoint's largest tensor dimension (load_hf passes
    one). q_proj's num_attention_heads x head_dim rows show up as a dimension of its weight
    (or, packed 8 to an int32, of its qweight), so a corrupt head_dim past 8 x that is refused
    by name before anything loops over head_dim -- Llama 3's RoPE factors do, and the tensor
    shapes are only compared after this function. It is asked last, after every check of
    config.json itself: it opens the checkpoint, whose errors come after config.json's."""
    from .config import ModelConfig, positive, special_token_id

    cls = model_class(cfg, where)
    arch = ARCHS[cls]
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):   # (any true value: transformers builds the biases; "false" had been shown as true)
            raise ValueError(f"{where}: {key}={json.dumps(cfg[key])} is not supported (the runner has no biases)")
    # sliding layers as transformers' Qwen2/Qwen3 configs derive them: layer_types when given, else
    # every layer from max_window_layers (default 28) on, when use_sliding_window and a window are
    # set (Qwen3 only. LlamaModel builds one causal mask for every layer and reads neither the flag
    # nor layer_types. Mistral's layers slide over sliding_window -- with layer_types, which makes
    # AutoConfig load it as Ministral, those listed do -- and the runner's context ends at the
    # window, inside which sliding and full attention agree)
    layer_types = cfg.get("layer_types")
    if layer_types is not None and not isinstance(layer_types, list):
        raise ValueError(f"{where}: layer_types={layer_types!r} must be a list")
    qwen3 = cls == "Qwen3ForCausalLM"   # (Llama / Mistral configs ignore both keys: neither is checked)
    # Llama / Mistral: the two entries this runner reads; transformers also knows others (e.g.
    # chunked_attention, which its Llama runs as full attention): refused here, not guessed
    if not qwen3:
        bad = next((t for t in layer_types or [] if t not in ("full_attention", "sliding_attention")), None)
        if bad is not None:
            raise ValueError(f"{where}: layer_types entry {bad!r} is not supported (a {cls} config "
                             "lists 'full_attention' / 'sliding_attention', which its attention does not read)")
    first_sliding = 28 if not qwen3 or cfg.get("max_window_layers") is None else cfg.get("max_window_layers")
    if not (isinstance(first_sliding, int) and not isinstance(first_sliding, bool)):
        raise ValueError(f"{where}: max_window_layers={first_sliding!r} must be an integer")
    sliding = qwen3 and (any(t != "full_attention" for t in layer_types) if layer_types is not None else
                         bool(cfg.get("use_sliding_window"))
                         and cfg.get("sliding_window", CLASS_DEFAULTS[cls].get("sliding_window")) is not None
                         and first_sliding < (cfg.get("num_hidden_layers") or 1))
    if sliding:
        raise ValueError(f"{where}: sliding-window attention (use_sliding_window / layer_types) is not "
                         "supported (every layer attends to the whole context here)")
    # Mistral: every layer attends to the last sliding_window positions (v0.1: 4096; null from
    # v0.2 on). Within the window that is the whole context, so the runner's context ends there
    # (ModelConfig cuts max_position to it, keeping max_position_embeddings as context_length).
    window = cfg.get("sliding_window", DEFAULT_SLIDING_WINDOW) if cls == "MistralForCausalLM" else None
    if window is not None:
        window = positive(window, int, f"{where}: sliding_window")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):   # (transformers' ACT2FN: swish is SiLU)
        raise ValueError(f"{where}: hidden_act={cfg.get('hidden_act')!r} is not supported (SwiGLU with silu only)")

    def need(key, default=KeyError, kind=int):
        """cfg[key] (or the default when it is absent or null) as a positive int or number."""
        v = cfg.get(key)
        if v is None:
            if default is KeyError:
                raise ValueError(f"{where}: missing key {key!r}")
            return default
        return positive(v, kind, f"{where}: {key}")

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    absent_kv = CLASS_DEFAULTS[cls].get("num_key_value_heads") if "num_key_value_heads" not in cfg else None
    kv = need("num_key_value_heads", absent_kv or heads)
    if heads % kv:
        raise ValueError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}"
                         + (f" (absent: transformers' {cls} default)" if absent_kv else ""))
    # absent: transformers' default, Qwen3Config's 128, the others' hidden_size / heads
    if cfg.get("head_dim") is None and arch != "qwen3" and heads > hidden:   # (had said "head_dim=0")
        raise ValueError(f"{where}: num_attention_heads={heads} is more than hidden_size={hidden}: without "
                         "head_dim the head size, their quotient, is 0")
    head_dim = need("head_dim", 128 if arch == "qwen3" else hidden // heads)

    def q_rows_ok():
        biggest = largest_dim() if largest_dim is not None else None
        if biggest is not None and heads * head_dim > 8 * biggest:
            raise ValueError(f"{where}: head_dim={head_dim} gives q_proj num_attention_heads x head_dim = "
                             f"{heads * head_dim} rows, more than any tensor of the checkpoint has "
                             f"(the largest dimension is {biggest})")

    context = CLASS_DEFAULTS[cls]["max_position_embeddings"]
    theta, rope_factors = _rope(cfg, head_dim, where, context)
    dims = dict(vocab_size=need("vocab_size"), intermediate_size=need("intermediate_size"),
                num_layers=need("num_hidden_layers"), head_dim=head_dim,
                rms_norm_eps=need("rms_norm_eps", 1e-6, float), rope_theta=theta,
                max_position=need("max_position_embeddings", context))
    if layer_types is not None and len(layer_types) != dims["num_layers"]:   # (transformers refuses it too)
        raise ValueError(f"{where}: layer_types has {len(layer_types)} entries for num_hidden_layers="
                         f"{dims['num_layers']}")
    tie = cfg.get("tie_word_embeddings", False)
    if tie is not None and not isinstance(tie, bool):   # bool("false") is True: a silently tied lm_head
        raise ValueError(f"{where}: tie_word_embeddings={tie!r} must be true or false")
    gen = generation_config or {}
    eos_src = gen_where if "eos_token_id" in gen else where
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = [i for i in (eos if isinstance(eos, list) else [] if eos is None else [eos])
               if special_token_id(i, dims["vocab_size"], f"{eos_src}: eos_token_id") is not None]
    # (a bad bos_token_id of generation_config.json had been blamed on config.json)
    bos_src = where if "bos_token_id" in cfg else gen_where
    bos = special_token_id(cfg.get("bos_token_id", gen.get("bos_token_id")), dims["vocab_size"],
                           f"{bos_src}: bos_token_id")
    try:
        config = ModelConfig(arch=arch, hidden_size=hidden, num_heads=heads, num_kv_heads=kv,
                             tie_word_embeddings=bool(tie), sliding_window=window,
                             qk_norm=(arch == "qwen3"), bos_token_id=bos, eos_token_ids=eos_ids, **dims)
    except ValueError as e:   # e.g. an odd head_dim
        raise ValueError(f"{where}: {e}") from None
    quant = parse_quantization_config(cfg.get("quantization_config"), where)
    if rope_factors is not None:   # last: q_rows_ok may open the checkpoint (see the docstring)
        q_rows_ok()
        factors = rope_factors()
        try:
            config = dataclasses.replace(config, rope_freq_factors=factors)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return config, quant


def expected_tensors(config) -> dict[str, tuple]:
    """HF tensor name -> logical shape, every tensor the runner needs (linears in (out, in))."""
    return config.expected_shapes()


def is_linear(name: str) -> bool:
    return name == "lm_head.weight" or any(name.endswith(l + ".weight") for l in LINEARS)


def not_converted(module: str, skip: list[str]) -> bool:
    """AutoAWQ's rule: a module is left unquantized when any listed name is a substring of it."""
    return any(s in module for s in skip)


# ---------------------------------------------------------------------------------------
# safetensors
# ---------------------------------------------------------------------------------------
class _Shards:
    """name -> (file, safe_open handle), over one file, many, or an index's weight_map."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        index = path / "model.safetensors.index.json"
        self.where: dict[str, Path] = {}
        self.handles = {}
        if index.exists():
            wm = _read_json(index, "the shard index").get("weight_map")
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise ValueError(f"{index}: no 'weight_map' object of tensor name -> shard file name")
            if not wm:
                raise ValueError(f"{index}: weight_map is empty (it names no tensor)")
            for name, f in wm.items():   # a shard is a file of this directory (no '/x' or '../x')
                if Path(f).name != f or f in ("", ".", ".."):
                    raise ValueError(f"{index}: weight_map[{name!r}]={f!r} is not a file name in {path}")
            files = sorted({path / f for f in wm.values()})
            for f in files:
                if not f.exists():
                    raise FileNotFoundError(f"{index} names shard {f.name}, which does not exist in {path}")
            self.where = {k: path / v for k, v in wm.items()}
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{path}: no *.safetensors files (and no model.safetensors.index.json)")
        self.files = files
        for f in files:
            try:
                self.handles[f] = safe_open(str(f), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own SafetensorError
                raise ValueError(f"{f}: not a readable safetensors file ({e})") from None
        self.present = {f: set(h.keys()) for f, h in self.handles.items()}
        if not self.where:
            for f, keys in self.present.items():
                for k in sorted(keys):
                    if k in self.where:   # no index to say which copy is meant: refuse to guess
                        raise ValueError(f"{path}: tensor {k!r} is in both {self.where[k].name} and {f.name} "
                                         "(and no model.safetensors.index.json says which to use)")
                    self.where[k] = f

    def has(self, name: str) -> bool:
        return name in self.where

    def file_of(self, name: str) -> Path:
        return self.where[name]

    def meta(self, name: str):
        """(shape, dtype name) without reading the data."""
        f = self.where[name]
        if name not in self.present[f]:
            raise ValueError(f"{f}: tensor {name!r} is missing from this shard "
                             "(model.safetensors.index.json maps it here)")
        sl = self.handles[f].get_slice(name)
        dtype = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "I32": "int32",
                 "F64": "float64", "I64": "int64", "U8": "uint8", "I8": "int8"}.get(sl.get_dtype(), sl.get_dtype())
        return tuple(sl.get_shape()), dtype

    def get(self, name: str):
        return self.handles[self.where[name]].get_tensor(name)

    def missing(self, name: str) -> ValueError:
        files = ", ".join(f.name for f in self.files)
        return ValueError(f"{self.path}: tensor {name!r} is in none of the checkpoint files ({files})")


# ---------------------------------------------------------------------------------------
# the loader
# ---------------------------------------------------------------------------------------
CHAT_TEMPLATE_DIR = "additional_chat_templates"   # transformers' named templates, NAME.jinja each


def load_tokenizer(path: Path):
    """tokenizer.json + tokenizer_config.json (+ special_tokens_map.json, chat_template.jinja,
    additional_chat_templates/*.jinja) -> Tokenizer, or None."""
    tj = path / "tokenizer.json"
    if not tj.exists():
        return None
    from .tokenizer import Tokenizer

    tc = _read_json(path / "tokenizer_config.json", "tokenizer_config.json") \
        if (path / "tokenizer_config.json").exists() else {}
    stm = path / "special_tokens_map.json"
    if "added_tokens_decoder" not in tc and stm.exists():
        # as transformers does for a tokenizer_config.json without added_tokens_decoder (older
        # saves): the special tokens of special_tokens_map.json, over the config's own
        for key, v in _read_json(stm, "special_tokens_map.json").items():
            if key in ("bos_token", "eos_token") and v is not None:
                if not isinstance(v.get("content") if isinstance(v, dict) else v, str):
                    raise ValueError(f"{stm}: {key}={v!r} must be a token string (or {{'content': str}})")
                tc[key] = v
    # as in transformers: template files win over tokenizer_config.json's entry -- the default in
    # chat_template.jinja, named ones in additional_chat_templates/NAME.jinja (how
    # save_pretrained writes several templates)
    files = {}
    jinja = path / "chat_template.jinja"
    if jinja.exists():
        files["default"] = jinja
    extra = path / CHAT_TEMPLATE_DIR
    if extra.is_dir():
        files.update((f.name.removesuffix(".jinja"), f) for f in sorted(extra.glob("*.jinja")))
    texts = {}
    for name, f in files.items():
        try:
            texts[name] = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{f}: not UTF-8 text ({e})") from None
        except OSError as e:   # a directory of that name, no permission, ...
            raise ValueError(f"{f}: cannot be read as a chat template ({e.strerror or e})") from None
    if texts:
        tc["chat_template"] = [{"name": n, "template": t} for n, t in texts.items()]
    return Tokenizer.from_tokenizer_json(str(tj), tc)


class LazyWeights(Mapping):
    """name -> weight, read from the (memory-mapped) checkpoint each time it is asked for and not
    kept: a consumer that converts or quantizes tensor by tensor never holds the whole source."""

    def __init__(self, readers: dict):
        self._readers = readers

    def __getitem__(self, name):
        return self._readers[name]()

    def __contains__(self, name):   # Mapping's default would read the tensor
        return name in self._readers

    def __iter__(self):
        return iter(self._readers)

    def __len__(self):
        return len(self._readers)


def load_hf(path, progress: bool = True, lazy: bool = False):
    """HF directory -> (ModelConfig, weights, Tokenizer | None, generation_config dict).

    lazy=True: weights is a LazyWeights mapping that reads each tensor when it is looked up
    (everything is still validated here, before any tensor is read)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a directory (an HF model directory has config.json)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: no config.json")
    cfg = _read_json(cfg_file, "config.json")
    gen_file = path / "generation_config.json"
    gen = _read_json(gen_file, "generation_config.json") if gen_file.exists() else {}
    shards = None

    def largest_dim():   # opened here only when parse_config asks (its own errors come first)
        nonlocal shards
        shards = shards or _Shards(path)
        return max((d for h in shards.handles.values() for k in h.keys()
                    for d in h.get_slice(k).get_shape()), default=0)

    config, quant = parse_config(cfg, gen, where=str(cfg_file), largest_dim=largest_dim, gen_where=str(gen_file))
    shards = shards or _Shards(path)
    if config.num_layers > len(shards.where):   # before anything loops over the layers (a corrupt count)
        raise ValueError(f"{cfg_file}: num_hidden_layers={config.num_layers}, but the checkpoint holds "
                         f"only {len(shards.where)} tensors")
    bias = next((k for k in shards.where if k.endswith(".bias")), None)
    if bias is not None:   # dropping it would give wrong answers without a word
        raise ValueError(f"{shards.file_of(bias)}: tensor {bias!r}: the runner's linears have no biases")

    # Plan every tensor (name, kind, expected shapes) and check shapes/dtypes before reading.
    plan = []  # (name, "awq" | "float", meta)
    for name, shape in expected_tensors(config).items():
        module = name[: -len(".weight")]
        awq_names = [f"{module}.{s}" for s in AWQ_SUFFIXES]
        quantized = (quant is not None and is_linear(name) and name != "lm_head.weight"
                     and not not_converted(module, quant["modules_to_not_convert"]))
        if quant is not None and is_linear(name) and shards.has(awq_names[0]):
            quantized = True  # e.g. a quantized lm_head: take what the checkpoint has
        if quantized:
            for a in awq_names:
                if not shards.has(a):
                    raise shards.missing(a)
            _check_awq(shards, module, shape, quant["group_size"], cfg_file)
            plan.append((name, "awq", awq_names))
        else:
            if not shards.has(name):
                if quant is None and shards.has(awq_names[0]):   # (had been called a missing weight)
                    raise ValueError(f"{cfg_file}: no quantization_config, but {shards.file_of(awq_names[0]).name} "
                                     f"holds {awq_names[0]!r}, an AWQ checkpoint's, where {name!r} is expected")
                raise shards.missing(name)
            got, dtype = shards.meta(name)
            if got != shape:
                raise ValueError(f"{shards.file_of(name)}: tensor {name!r} has shape {list(got)}, "
                                 f"config.json implies {list(shape)}")
            if dtype not in FLOAT_DTYPES:
                raise ValueError(f"{shards.file_of(name)}: tensor {name!r} has dtype {dtype}; "
                                 f"expected one of {FLOAT_DTYPES}")
            plan.append((name, "float", None))

    used = {n for name, kind, extra in plan for n in (extra if kind == "awq" else [name])}
    extra = [k for k in shards.where if k not in used and not _unused_ok(k, config)]
    if extra:   # e.g. layers past num_hidden_layers, or q/k norms of a qwen3 checkpoint labelled llama
        raise ValueError(f"{shards.file_of(extra[0])}: tensor {extra[0]!r} (and {len(extra) - 1} more) is not "
                         f"part of the {config.arch} model config.json describes ({config.num_layers} layers); "
                         "the runner would drop it silently")

    from quantzoo.formats import get

    from .config import check_finite

    awq = get("awq")
    def reader(name, kind, extra):
        if kind == "awq":   # (a corrupt scale is named by the scales tensor's file)
            return lambda: check_finite(awq.from_arrays(*(shards.get(a).numpy() for a in extra), quant["group_size"]),
                                        shards.file_of(extra[2]), extra[2])
        return lambda: check_finite(shards.get(name), shards.file_of(name), name)

    readers = {name: reader(name, kind, extra) for name, kind, extra in plan}
    if lazy:
        weights = LazyWeights(readers)
    else:
        from tqdm import tqdm

        weights = {name: read() for name, read in tqdm(readers.items(), desc=f"loading {path.name}",
                                                       unit="tensor", disable=not progress, leave=False)}
    tok = load_tokenizer(path)
    if tok is not None:
        # stop on every end id the checkpoint declares: tokenizer_config's eos_token and
        # generation_config's / config's eos_token_id (Qwen3 lists <|im_end|> and <|endoftext|>)
        for i in config.eos_token_ids:
            if i not in tok.eos_token_ids:
                tok.eos_token_ids.append(i)
        config.eos_token_ids = list(tok.eos_token_ids)
        if config.bos_token_id is None:
            config.bos_token_id = tok.bos_token_id
    config.check_tokenizer(tok, str(path), strict=False)
    return config, weights, tok, gen


def _unused_ok(name: str, config) -> bool:
    """Checkpoint tensors the model does not need and transformers ignores too: RoPE's inv_freq
    buffers (older checkpoints) and a tied model's stored lm_head."""
    return name.endswith(".rotary_emb.inv_freq") or (config.tie_word_embeddings and name.startswith("lm_head."))


def _check_awq(shards: _Shards, module: str, shape, group_size: int, cfg_file="config.json") -> None:
    n, k = shape
    want = {"qweight": ((k, n // 8), "int32"), "qzeros": ((k // group_size, n // 8), "int32"),
            "scales": ((k // group_size, n), "float16")}
    if n % 8 or k % group_size:
        raise ValueError(f"{cfg_file}: {module}: shape (out={n}, in={k}) does not fit AWQ group_size={group_size} "
                         "(in % group_size and out % 8 must be 0)")
    for s, (shp, dt) in want.items():
        got, dtype = shards.meta(f"{module}.{s}")
        if got != shp or dtype != dt:
            raise ValueError(f"{shards.file_of(module + '.' + s)}: tensor {module}.{s} is "
                             f"{dtype}{list(got)}, expected {dt}{list(shp)} for out={n}, in={k}, "
                             f"group_size={group_size}")


def to_numpy_float(t) -> np.ndarray:
    """A float tensor (any float dtype, torch or numpy) or QuantizedTensor -> float32 numpy."""
    from quantzoo.formats import QuantizedTensor

    if isinstance(t, QuantizedTensor):
        return t.dequantize().astype(np.float32, copy=False)
    if hasattr(t, "detach"):
        return t.detach().float().cpu().numpy()
    return np.asarray(t, dtype=np.float32)


__all__ = ["load_hf", "parse_config", "parse_quantization_config", "expected_tensors",
           "load_tokenizer", "to_numpy_float", "model_class", "ARCHS", "MODEL_TYPES", "LINEARS"]

