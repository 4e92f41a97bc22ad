"""Write a model in another format: HF AWQ directory, GGUF file, or KuiperLLama AWQ .bin.

    export(src, dst, fmt, group_size=None)     # what `quantzoo quantize` runs

Source: an HF directory (fp16/bf16/fp32, or AWQ: dequantized) or a .gguf file (dequantized to
float by the runner's GGUF loader, Q/K rows back in HF order). Every weight passes through
float32 and is quantized by the registry's codec (`quantzoo.formats.get(fmt).quantize`), so
the same weights reach every format and can be compared; a weight the source already stores in
the target format (AWQ with the same group, the same GGUF type) is copied as is, not rounded
twice, so .bin <-> HF AWQ and GGUF -> GGUF conversions are lossless. The AWQ group defaults to
an AWQ source's own (else 128), so that AWQ -> AWQ is lossless unless another group is asked for.

Destinations, by the name of DST and --format:
  DST directory, awq     HF AWQ checkpoint as AutoAWQ writes it and vLLM/transformers read it:
                         decoder linears as `<module>.qweight/.qzeros/.scales`, embeddings,
                         norms and lm_head in fp16, config.json with quantization_config
                         {quant_method awq, bits 4, group_size, zero_point true, version gemm},
                         tokenizer files alongside (from a GGUF source: a tokenizer.json whose
                         post_processor adds BOS / EOS as the GGUF's add_bos/add_eos say, its
                         pad and unk tokens). Every file is written anew, never through a link.
  DST directory, fp16    a plain fp16 HF checkpoint (the baseline for comparisons).
  DST .gguf, q4_0..q8_0  GGUF written by gguf-py's GGUFWriter with llama.cpp's arch keys and
  (or fp16)              tensor names; every 2-D weight (embeddings included) in the chosen
                         type, 1-D norms in F32 as llama.cpp's converter stores them. A weight
                         whose in_features the type's block (32) does not divide is stored F16
                         instead, with one warning naming them, by llama.cpp's converter's
                         rule (its Q8_0 output; its quantize tool refuses such a tensor in
                         Q4_0..Q5_1); general.file_type still names the chosen type. llama-arch
                         Q and K rows get the converter's permutation (pairs for "normal" RoPE);
                         qwen3 is not permuted. Tokenizer metadata: copied from a GGUF source, or
                         built from tokenizer.json (an HF source's, or the one beside a .bin) the
                         way llama.cpp's converter does for BPE, with the chat templates the
                         runner's HF loader reads (chat_template.jinja over tokenizer_config.json's).
  DST .bin, awq          KuiperLLama's "ak48" AWQ file (quantzoo/model/kuiper.py).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from quantzoo.formats import get, stored_names
from quantzoo.paths import check_no_symlink_loop, check_out_dir, check_out_file

from .gguf_loader import LAYER_NAMES, TENSOR_NAMES
from .hf_loader import (CHAT_TEMPLATE_DIR, LINEARS, load_tokenizer, not_converted, parse_quantization_config,
                        to_numpy_float)

# The formats each kind of DST is written in: a .gguf holds every format of the registry with a
# ggml type (write_gguf), a directory AutoAWQ's AWQ or plain fp16 (write_hf), a .bin KuiperLLama's
# AWQ (kuiper.write_kuiper). FORMATS: the registry's stored formats one of them writes, in
# registry order (a format with no writer is not offered: every DST would refuse it).
DESTINATIONS = {"dir": ("awq", "fp16"), "gguf": tuple(n for n in stored_names() if get(n).gguf_type),
                "bin": ("awq",)}
FORMATS = tuple(n for n in stored_names() if any(n in fmts for fmts in DESTINATIONS.values()))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")
SHARD_BYTES = 4 << 30   # an HF export's safetensors shards hold at most this (or one larger tensor)
SHARD_INDEX = "model.safetensors.index.json"
HF_FILES = ("config.json", "model.safetensors", SHARD_INDEX) + TOKENIZER_FILES   # write_hf's (or removes)
DEFAULT_GROUP = 128     # the AWQ group of a source that is not AWQ itself
FALLBACK_NAMED = 4      # a GGUF export's F16 fallback warning names this many tensors
HF_ARCH = {"qwen3": ("Qwen3ForCausalLM", "qwen3"), "llama": ("LlamaForCausalLM", "llama")}


@dataclass
class Source:
    """A model read for export: config, float32 weights (HF names, HF Q/K order), origin."""
    path: Path
    config: object                                  # ModelConfig
    weights: dict                                   # name -> float32 ndarray (lazy ok)
    hf_config: dict | None = None                   # config.json of an HF source
    tokenizer: object | None = None                 # runner Tokenizer
    gguf_meta: list = field(default_factory=list)   # [(key, value, types)] tokenizer.* of a GGUF source
    # where tokenizer files are read from: the directory beside a .bin (read_source), or an HF
    # source's own (the default, for a Source made with hf_config)
    tokenizer_dir: Path | None = None
    generation_config: dict = field(default_factory=dict)
    requantized: bool = False   # (said once: a quantized source weight quantized again)

    def __post_init__(self):
        if self.tokenizer_dir is None and self.hf_config is not None:
            self.tokenizer_dir = Path(self.path)

    def tensor(self, name: str) -> np.ndarray:
        return to_numpy_float(self.weights[name])

    def quantized(self, name: str, fmt: str, **params):
        """The weight in `fmt`: the source's own storage when it already is exactly that (no
        second rounding: AWQ -> AWQ and Q8_0 -> Q8_0 are lossless), else quantized from float."""
        from quantzoo.formats import QuantizedTensor, get

        w = self.weights[name]
        if isinstance(w, QuantizedTensor) and w.format == fmt and all(
                w.params.get(k) == v for k, v in params.items()):
            return w.numpy()
        def label(f, g):   # Q4_0, awq g64
            return get(f).gguf_type or (f"{f} g{g}" if g else f)

        was = label(w.format, w.params.get("group_size")) if isinstance(w, QuantizedTensor) else \
            getattr(w, "dequantized_from", None)
        if was is not None and not self.requantized:   # (llama-quantize refuses this by default)
            self.requantized = True
            from quantzoo.formats.base import warn

            warn(f"{self.path}: tensor {name!r} is stored as {was}; it (and any other quantized tensor) is "
                 f"dequantized and quantized again to {label(fmt, params.get('group_size'))}, keeping its "
                 f"{was} rounding error besides "
                 "(llama-quantize asks for --allow-requantize)", UserWarning)
        # w itself (self.tensor(name) would read a lazy source's tensor a second time), and not
        # held while it is quantized
        x = to_numpy_float(w)
        del w
        try:
            return get(fmt).quantize(x, **params)
        except ValueError as e:   # e.g. a NaN in the checkpoint: say which tensor of which file
            raise ValueError(f"{self.path}: tensor {name!r}: {e}") from None


def read_source(src, progress: bool = True) -> Source:
    src = Path(src)
    if src.is_dir():
        from .hf_loader import load_hf

        config, weights, tok, gen = load_hf(src, progress=progress, lazy=True)
        with open(src / "config.json", encoding="utf-8") as f:
            hf_cfg = json.load(f)
        return Source(src, config, weights, hf_config=hf_cfg, tokenizer=tok, generation_config=gen)
    if not src.exists():
        raise FileNotFoundError(f"{src}: no such file or directory")
    if src.suffix.lower() == ".gguf":   # (suffixes in any case: Q.GGUF, K.Bin)
        from .gguf_loader import load_gguf, open_gguf

        reader = open_gguf(str(src))   # (once: parsing its metadata takes seconds)
        config, weights, tok = load_gguf(str(src), progress=progress, reader=reader)
        return Source(src, config, weights, tokenizer=tok, gguf_meta=_gguf_tokenizer_fields(reader))
    if src.suffix.lower() == ".bin":
        from .kuiper import load_kuiper

        config, weights, tok = load_kuiper(src)   # (tok: from a tokenizer.json beside the file)
        return Source(src, config, weights, tokenizer=tok,
                      tokenizer_dir=src.parent if tok is not None else None)
    raise ValueError(f"SRC={src}: expected an HF model directory, a .gguf file or a KuiperLLama .bin")


def _gguf_tokenizer_fields(reader) -> list:
    out = []
    for name, f in reader.fields.items():
        if name.startswith("tokenizer."):
            out.append((name, f.contents(), list(f.types)))
    return out


def awq_group_of(path) -> int | None:
    """The AWQ group size of an AWQ model (an HF AWQ directory or a .bin), else None; reads only
    config.json or the .bin header."""
    path = Path(path)
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            return None
        with open(cfg, encoding="utf-8") as f:
            quant = parse_quantization_config(json.load(f).get("quantization_config"), str(cfg))
        return quant["group_size"] if quant else None
    if path.suffix.lower() == ".bin":
        from .kuiper import read_header

        return read_header(path)["group_size"]
    return None


def linear_modules(config) -> list[str]:
    return [f"model.layers.{i}.{l}" for i in range(config.num_layers) for l in LINEARS]


def check_group_size(config, group_size: int, modules=None) -> None:
    """Every quantized linear must split into whole groups; suggest a group that works."""
    from quantzoo.formats.awq import GROUP_SIZES

    if group_size not in GROUP_SIZES:
        raise ValueError(f"--group-size {group_size} is not supported; choose one of {GROUP_SIZES}")
    shapes = config.expected_shapes()
    modules = linear_modules(config) if modules is None else modules
    bad = []
    for m in modules:
        n, k = shapes[m + ".weight"]
        if n % 8:
            raise ValueError(f"{m}: out_features={n} is not a multiple of 8; AWQ packs 8 outputs per int32")
        if k % group_size:
            bad.append((m, k))
    if bad:
        ks = {shapes[m + ".weight"][1] for m in modules}
        ok = [g for g in sorted(GROUP_SIZES, reverse=True) if all(k % g == 0 for k in ks)]
        hint = f"use --group-size {ok[0]}" if ok else f"no AWQ group size {GROUP_SIZES} divides them"
        m, k = bad[0]
        raise ValueError(f"--group-size {group_size} does not divide in_features={k} of {m} "
                         f"({len(bad)} linears affected); {hint}")


def check_dims_fit(config, path, limit: int, field: str) -> None:
    """Every dimension a file header stores as an integer field is below `limit` (the config
    holds them as positive ints already); else one error naming it and the field."""
    for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "vocab_size", "max_position", "head_dim", "context_length", "sliding_window"):
        if (getattr(config, name) or 0) >= limit:
            raise ValueError(f"{path}: {name}={getattr(config, name)} does not fit {field}")


def check_finite(w: np.ndarray, name: str) -> np.ndarray:
    """w, if every value is finite; else one error naming the tensor and the first bad index.
    For the float tensors an export writes as they are (fp16 and F32): a quantizing codec refuses
    NaN and inf itself, and no format should carry one out silently."""
    if not np.isfinite(w).all():
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(w))[0])
        raise ValueError(f"{name}: non-finite value {w[bad]} at index {bad}")
    return w


def _fp16(w: np.ndarray, name: str) -> np.ndarray:
    check_finite(w, name)
    if np.abs(w).max(initial=0) > 65504:
        raise ValueError(f"{name}: values beyond +-65504 do not fit fp16")
    return w.astype(np.float16)


# ---------------------------------------------------------------------------------------
# HF directories
# ---------------------------------------------------------------------------------------
def hf_config_dict(src: Source, dtype: str = "float16") -> dict:
    """config.json for the destination: the source's own (quantization removed), else built."""
    c = src.config
    if src.hf_config is not None:
        cfg = {k: v for k, v in src.hf_config.items() if k != "quantization_config"}
    else:
        if c.rope_freq_factors is not None:   # GGUF's rope_freqs.weight: no config.json form for it
            raise ValueError(f"{src.path}: its RoPE frequency factors (rope_freqs.weight) have no HF "
                             "config.json form (transformers rebuilds them from rope_scaling's "
                             "parameters, which a GGUF does not keep); export it to a .gguf instead")
        # a window on arch llama is Mistral's (llama.cpp converts MistralForCausalLM to llama):
        # LlamaForCausalLM with a sliding_window key would attend to the whole context in transformers
        mistral = c.arch == "llama" and c.sliding_window is not None
        arch, model_type = ("MistralForCausalLM", "mistral") if mistral else HF_ARCH[c.arch]
        cfg = {"architectures": [arch], "model_type": model_type, "vocab_size": c.vocab_size,
               "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
               "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
               "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
               "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
               "max_position_embeddings": (c.context_length or c.max_position) if mistral else c.max_position,
               "tie_word_embeddings": c.tie_word_embeddings,
               "hidden_act": "silu", "attention_bias": False,
               "bos_token_id": c.bos_token_id,
               "eos_token_id": (c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else c.eos_token_ids or None)}
        if mistral:
            cfg["sliding_window"] = c.sliding_window
        pad = gguf_token_id(src, "padding")
        if pad is not None:   # (transformers' generate pads batches with it)
            cfg["pad_token_id"] = pad
    cfg["torch_dtype"] = dtype          # AutoAWQ / transformers 4 name
    if "dtype" in cfg:
        cfg["dtype"] = dtype            # transformers 5 name
    return cfg


def gguf_token_id(src: Source, what: str) -> int | None:
    """tokenizer.ggml.<what>_token_id of a GGUF source (padding, unknown, ...), where it is one of
    its tokenizer's ids; else None."""
    meta = {k: v for k, v, _ in src.gguf_meta}
    i = meta.get(f"tokenizer.ggml.{what}_token_id")
    n = src.tokenizer.vocab_size if src.tokenizer is not None else 0
    return i if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n else None


def special_tokens_post_processor(tok) -> dict:
    """tokenizer.json's post_processor adding BOS / EOS as the runner's Tokenizer does (add_bos,
    add_eos): a TemplateProcessing as transformers' own converters write it (single: BOS? $A EOS?;
    pair: the same again for $B, type id 1). transformers' AutoTokenizer adds special tokens by
    the post_processor alone, not by tokenizer_config.json's add_bos_token."""
    bos = tok.bos_token_id if tok.add_bos else None
    eos = tok.eos_token_ids[0] if tok.add_eos else None

    def part(seq: str, type_id: int) -> list:
        out = [{"Sequence": {"id": seq, "type_id": type_id}}]
        if bos is not None:
            out.insert(0, {"SpecialToken": {"id": tok.tok.id_to_token(bos), "type_id": type_id}})
        if eos is not None:
            out.append({"SpecialToken": {"id": tok.tok.id_to_token(eos), "type_id": type_id}})
        return out

    special = {}
    for i in (bos, eos):
        if i is not None:
            t = tok.tok.id_to_token(i)
            special[t] = {"id": t, "ids": [i], "tokens": [t]}
    return {"type": "TemplateProcessing", "single": part("A", 0), "pair": part("A", 0) + part("B", 1),
            "special_tokens": special}


def _write_new(path: Path, text: str) -> None:
    """Write `path` as a new file (a temp file beside it, renamed over it): a DST file that is a
    hard link or symlink to the source's (DST made by `cp -al SRC DST` or `cp -as`) is replaced,
    never written through -- which had rewritten the source's own config.json."""
    tmp = path.with_name(path.name + ".part")
    tmp.unlink(missing_ok=True)
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_tokenizer_files(src: Source, dst: Path) -> None:
    for name in TOKENIZER_FILES:   # an earlier export's files must not outlive this one's
        (dst / name).unlink(missing_ok=True)
    if (dst / CHAT_TEMPLATE_DIR).is_symlink():   # (a link, as rmtree refuses it, to the source's own)
        (dst / CHAT_TEMPLATE_DIR).unlink()
    shutil.rmtree(dst / CHAT_TEMPLATE_DIR, ignore_errors=True)
    if src.hf_config is not None:
        for name in TOKENIZER_FILES:
            if (src.path / name).exists():
                shutil.copyfile(src.path / name, dst / name)
        if (src.path / CHAT_TEMPLATE_DIR).is_dir():   # transformers' named templates, NAME.jinja each
            shutil.copytree(src.path / CHAT_TEMPLATE_DIR, dst / CHAT_TEMPLATE_DIR)
        return
    tok = src.tokenizer
    if tok is None:
        return
    text = tok.tok.to_str()
    if tok.tok.encode("a", add_special_tokens=True).ids != tok.encode("a"):   # (a GGUF's has no post_processor)
        text = json.dumps({**json.loads(text), "post_processor": special_tokens_post_processor(tok)},
                          ensure_ascii=False)
    (dst / "tokenizer.json").write_text(text, encoding="utf-8")
    tc = {"bos_token": tok.bos_token or None, "eos_token": tok.eos_token or None,
          "add_bos_token": bool(tok.add_bos),
          "add_eos_token": bool(tok.add_eos), "clean_up_tokenization_spaces": False}
    for key, what in (("pad_token", "padding"), ("unk_token", "unknown")):   # as HF -> GGUF writes them
        i = gguf_token_id(src, what)
        if i is not None:
            tc[key] = tok.tok.id_to_token(i)
    if set(tok.chat_templates) - {"default"}:   # named templates: transformers' list form
        tc["chat_template"] = [{"name": n, "template": t} for n, t in tok.chat_templates.items()]
    elif tok.chat_template:
        tc["chat_template"] = tok.chat_template
    (dst / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False), encoding="utf-8")
    gen = {"eos_token_id": tok.eos_token_ids or None, "bos_token_id": tok.bos_token_id}
    (dst / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")


def write_hf(src: Source, dst: Path, fmt: str = "awq", group_size: int = 128, progress=True) -> Path:
    """HF directory: AWQ (AutoAWQ's layout) or plain fp16."""
    from safetensors.numpy import save_file
    from tqdm import tqdm

    dst = Path(dst)
    c = src.config
    # an AWQ source's modules_to_not_convert stay fp16 here too (AutoAWQ's substring rule)
    quant = parse_quantization_config((src.hf_config or {}).get("quantization_config"))
    skip = quant["modules_to_not_convert"] if quant else []
    quantized = [m for m in linear_modules(c) if not not_converted(m, skip)] if fmt == "awq" else []
    if fmt == "awq":
        check_group_size(c, group_size, quantized)
    cfg = hf_config_dict(src)   # (before any writing: it refuses what config.json cannot say)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "model.safetensors").unlink(missing_ok=True)   # an earlier export's (export refuses other weights)
    # Shards of at most SHARD_BYTES, each written by save_file as it fills (model-0000i-of-0000n
    # .safetensors + an index, as transformers shards; one file is plain model.safetensors): the
    # output is never held whole, at most one shard of it.
    shards, tensors, size = [], {}, 0

    def flush():
        nonlocal tensors, size
        if tensors:
            part = dst / f"shard-{len(shards)}.part"
            part.unlink(missing_ok=True)   # (save_file would write through a link of that name)
            save_file(tensors, str(part), metadata={"format": "pt"})
            shards.append((part, list(tensors), size))
            tensors, size = {}, 0

    names = list(c.expected_shapes())
    try:
        for name in tqdm(names, desc=f"writing {dst.name}", unit="tensor", disable=not progress, leave=False):
            module = name[: -len(".weight")]
            if module in quantized:
                qt = src.quantized(name, "awq", group_size=group_size)
                made = {f"{module}.{key}": np.ascontiguousarray(qt.data[key])
                        for key in ("qweight", "qzeros", "scales")}
            else:
                made = {name: _fp16(src.tensor(name), name)}
            nbytes = sum(a.nbytes for a in made.values())
            if tensors and size + nbytes > SHARD_BYTES:
                flush()
            tensors.update(made)
            size += nbytes
        flush()
    except BaseException:   # no half-written export left behind
        for part, _, _ in shards:
            part.unlink(missing_ok=True)
        # and the part save_file was writing when it failed (a full disk: up to SHARD_BYTES)
        (dst / f"shard-{len(shards)}.part").unlink(missing_ok=True)
        raise
    umask = os.umask(0)
    os.umask(umask)
    for part, _, _ in shards:   # (save_file writes 0600; the other files of DST get the umask's mode)
        try:
            os.chmod(part, 0o666 & ~umask)
        except OSError:   # (a file system without modes: the weights are written all the same)
            pass
    if len(shards) == 1:
        shards[0][0].replace(dst / "model.safetensors")
    else:
        weight_map = {}
        for i, (part, keys, _) in enumerate(shards, 1):
            final = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            part.replace(dst / final)
            weight_map.update(dict.fromkeys(keys, final))
        index = {"metadata": {"total_size": sum(n for _, _, n in shards)}, "weight_map": weight_map}
        _write_new(dst / SHARD_INDEX, json.dumps(index, indent=2))
    if fmt == "awq":
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                      "zero_point": True, "version": "gemm",
                                      "modules_to_not_convert": skip or None}
    _write_tokenizer_files(src, dst)
    _write_new(dst / "config.json", json.dumps(cfg, indent=2))
    return dst


# ---------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------
# llama.cpp's tensor names, the inverse of the loader's table (one mapping for both directions)
GGUF_NAMES = {hf: g for g, hf in TENSOR_NAMES.items()}
GGUF_LAYER_NAMES = {hf: g for g, hf in LAYER_NAMES.items()}


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    parts = hf_name.split(".")   # model.layers.{i}.<module...>.weight
    i, module = parts[2], ".".join(parts[3:-1])
    return f"blk.{i}.{GGUF_LAYER_NAMES[module]}.weight"


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter reorders each head's rows from rotate-half (HF) order to
    interleaved pairs: row r of the first half and row r of the second half become rows 2r,
    2r+1. llama.cpp's "normal" RoPE then rotates adjacent pairs, which is the same rotation."""
    n = w.shape[0]
    return w.reshape(n_head, 2, n // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def detect_pre_tokenizer(tokenizer_json: Path) -> str:
    """Which llama.cpp `tokenizer.ggml.pre` name splits text as this tokenizer.json does.

    llama.cpp's converter hashes the token ids of a probe text; we compare the pre-tokenizer's
    own splits of a probe text with each split the runner knows, which needs no table of
    hashes and cannot silently pick a near miss.
    """
    from tokenizers import Tokenizer as HFTok

    from .tokenizer import PRE_TOKENIZERS

    tok = HFTok.from_file(str(tokenizer_json))
    probe = ("Hello, world! It's 12345 o'clock (really)\n\n  indented\tTAB I'M fine"
             " ÄÖÜ ñ 3.14 ...!! don't \r\n end")
    if tok.pre_tokenizer is None:
        raise ValueError(f"{tokenizer_json}: no pre_tokenizer; only byte-level BPE tokenizers export to GGUF")
    mine = [s for s, _ in tok.pre_tokenizer.pre_tokenize_str(probe)]
    for name in ("qwen2", "llama-bpe", "smollm", "gpt-2"):
        make, _ = PRE_TOKENIZERS[name]
        if [s for s, _ in make().pre_tokenize_str(probe)] == mine:
            return name
    raise ValueError(f"{tokenizer_json}: its pre-tokenizer matches none of the splits the runner knows "
                     f"({', '.join(PRE_TOKENIZERS)}); cannot set tokenizer.ggml.pre")


def add_hf_tokenizer(writer, src: Source) -> None:
    """tokenizer.ggml.* from an HF tokenizer.json, as llama.cpp's converter does: a byte-level BPE
    as 'gpt2' (tokens, merges, the pre-tokenizer's name), a SentencePiece-style one (byte
    fallback, spaces as U+2581: Llama 1/2, Mistral v0.1) as 'llama' (tokens, scores, types)."""
    import gguf

    tj = src.tokenizer_dir / "tokenizer.json"
    if not tj.exists():
        return
    data = json.loads(tj.read_text(encoding="utf-8"))
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(f"{tj}: tokenizer model {model.get('type')!r}; only BPE exports to GGUF")
    space_prefix = sentencepiece_style(data, tj)   # None: byte-level
    vocab = dict(model["vocab"])
    added = {t["content"]: t for t in data.get("added_tokens", [])}
    for t in added.values():
        vocab[t["content"]] = t["id"]
    n_vocab = src.config.vocab_size
    if max(vocab.values()) >= n_vocab:
        raise ValueError(f"{tj}: token id {max(vocab.values())} >= the model's vocab_size {n_vocab}")
    rev = {i: t for t, i in vocab.items()}
    unk = model.get("unk_token")   # transformers 5 leaves it to tokenizer_config.json
    tc = src.tokenizer_dir / "tokenizer_config.json"
    if unk is None and tc.exists():
        unk = json.loads(tc.read_text(encoding="utf-8")).get("unk_token")
        unk = unk.get("content") if isinstance(unk, dict) else unk
    T = gguf.TokenType
    tokens, types = [], []
    for i in range(n_vocab):
        t = rev.get(i, f"[PAD{i}]")
        tokens.append(t)
        if i not in rev:
            types.append(T.UNUSED)
        elif space_prefix is not None and t == unk:
            types.append(T.UNKNOWN)
        elif t in added:
            types.append(T.CONTROL if added[t].get("special") else T.USER_DEFINED)
        elif space_prefix is not None and re.fullmatch(r"<0x[0-9A-F]{2}>", t):
            types.append(T.BYTE)
        else:
            types.append(T.NORMAL)
    if space_prefix is None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(detect_pre_tokenizer(tj))
    else:
        writer.add_tokenizer_model("llama")
        writer.add_token_scores(_spm_scores(model, tj, tokens, types))
        writer.add_add_space_prefix(space_prefix)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # merges (byte-level only), special ids (bos/eos/pad/unk from tokenizer_config + config),
    # add_bos (the chat templates: below)
    try:
        special = gguf.SpecialVocab(src.tokenizer_dir, load_merges=space_prefix is None, n_vocab=n_vocab)
    except ValueError as e:   # gguf-py's own words, e.g. "invalid value for special token type eos: -1"
        raise ValueError(f"{src.tokenizer_dir}: its config / tokenizer files do not convert to GGUF ({e})") from None
    if space_prefix is None and not special.merges:   # gguf-py would only log it
        raise ValueError(f"{tj}: a byte-level BPE without merges; llama.cpp cannot load a 'gpt2' "
                         "GGUF tokenizer without tokenizer.ggml.merges")
    # the chat templates: those the runner's loader reads for this directory, not SpecialVocab's
    # (it takes tokenizer_config.json's chat_template over chat_template.jinja, where transformers
    # and load_tokenizer let the file win); where the loader finds none, SpecialVocab's own (it
    # also reads a processor's chat_template.json, as llama.cpp's converter does)
    templates = (src.tokenizer or load_tokenizer(src.tokenizer_dir)).chat_templates
    if templates:
        special.chat_template = None
    special.add_to_gguf(writer, quiet=True)
    add_chat_templates(writer, templates)


def add_chat_templates(writer, templates: dict) -> None:
    """A Tokenizer's chat_templates as llama.cpp keeps them: the default in tokenizer.chat_template,
    each named one in tokenizer.chat_template.NAME, listed in tokenizer.chat_templates (what the
    GGUF loader reads back: the names as they are, in the loader's order)."""
    import gguf

    named = [n for n in templates if n != "default"]
    if named:
        writer.add_array(gguf.Keys.Tokenizer.CHAT_TEMPLATES, named)
        for n in named:
            writer.add_string(gguf.Keys.Tokenizer.CHAT_TEMPLATE_N.format(name=n), templates[n])
    if "default" in templates:
        writer.add_chat_template(templates["default"])


def sentencepiece_style(data: dict, tj: Path) -> bool | None:
    """For a byte-fallback BPE tokenizer.json that writes spaces as U+2581 and splits nothing
    before the BPE (transformers' conversion of a SentencePiece model): whether it puts a U+2581
    in front. None for any other BPE (byte-level); an error for a byte-fallback BPE that splits."""
    if not data.get("model", {}).get("byte_fallback"):
        return None

    def parts(node):   # a component, or the members of a Sequence
        if not node:
            return []
        if node.get("type") != "Sequence":
            return [node]
        return [x for n in node.get("normalizers") or node.get("pretokenizers") or [] for x in parts(n)]

    norm, pre = parts(data.get("normalizer")), parts(data.get("pre_tokenizer"))
    prepend = [x for x in norm if x.get("type") == "Prepend" and x.get("prepend") == "\u2581"]
    replace = [x for x in norm if x.get("type") == "Replace" and x.get("pattern", {}).get("String") == " "
               and x.get("content") == "\u2581"]
    # Metaspace: tokenizers reads a missing "split" (files from before the key) as true
    meta = [x for x in pre if x.get("type") == "Metaspace" and x.get("replacement") == "\u2581"
            and x.get("split", True) is False]
    if len(prepend) + len(replace) != len(norm) or len(meta) != len(pre) or not (replace or meta):
        raise ValueError(f"{tj}: a byte-fallback BPE that does not prepare text as SentencePiece does "
                         "(spaces as U+2581, nothing else normalized, no split before the BPE); GGUF's "
                         "'llama' tokenizer cannot carry it")
    return bool(prepend) or any(m.get("prepend_scheme", "always") != "never" for m in meta)


def _spm_scores(model: dict, tj: Path, tokens: list, types: list) -> list:
    """SentencePiece scores for a tokenizer.json that lost them, from its merges. GGUF's 'llama'
    tokenizer joins the adjacent pair whose joined token scores highest; a token that scores minus
    the rank of its first merge makes the joins happen in the merges' order. (llama.cpp's own
    converter writes -1000 for every token of such a file and leaves the order to ties.) That is
    the same tokenizer only if the merges are every split of a token into two tokens, as a
    SentencePiece conversion lists them, each token's together; otherwise this refuses."""
    from .tokenizer import NORMAL, sentencepiece_merges

    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]
    first = {}
    for r, (a, b) in enumerate(merges):
        first.setdefault(a + b, r)
    scores = [float(-first.get(t, len(merges) + i)) if ty == NORMAL else 0.0
              for i, (t, ty) in enumerate(zip(tokens, types))]
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    normal = [NORMAL if t == NORMAL else 0 for t in types]
    every_split = set(sentencepiece_merges(tokens, vocab, scores, normal))
    listed = {m for m in merges if (i := vocab.get(m[0] + m[1])) is not None and normal[i]}
    if every_split != listed:
        extra = sorted(every_split - listed) or sorted(listed - every_split)
        raise ValueError(f"{tj}: its merges are not every split of a token into two tokens (e.g. "
                         f"{' '.join(extra[0])!r}), so GGUF's SentencePiece-style tokenizer would split text "
                         "differently")
    ranks = [first[a + b] for a, b in merges]
    late = next((r for r, (x, y) in enumerate(zip(ranks, ranks[1:])) if y < x), None)
    if late is not None:   # a token's splits apart, another token's between them: no score orders both
        a, b = merges[late + 1]
        raise ValueError(f"{tj}: merge {late + 1} ({a} {b}) comes after merges of other tokens that follow "
                         f"{a + b!r}'s first one; a score per token cannot order such merges")
    return scores


def add_gguf_tokenizer(writer, src: Source) -> None:
    import gguf

    for key, value, types in src.gguf_meta:
        sub = types[-1] if types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, types[0], sub_type=sub)


def write_gguf(src: Source, dst: Path, fmt: str, progress=True) -> Path:
    import gguf

    c = src.config
    qfmt = get(fmt)
    qtype = getattr(gguf.GGMLQuantizationType, qfmt.gguf_type)
    file_type = f"MOSTLY_{qfmt.gguf_type}"
    shapes = c.expected_shapes()
    if c.rope_freq_factors is not None and c.arch != "llama":
        raise ValueError(f"{src.path}: Llama 3 RoPE scaling on a {c.arch} model has no GGUF form "
                         "(llama.cpp reads rope_freqs.weight for llama only)")
    # a 2-D weight whose in_features the type's block does not divide is stored F16 instead, by
    # llama.cpp's converter's rule (gguf.quants.quantize raises QuantError there, and it falls back
    # to F16 for that tensor; the converter writes Q8_0 among these types, and llama-quantize
    # refuses such a tensor in Q4_0..Q5_1); general.file_type still names the requested ("mostly") type
    f16 = f16_fallback(shapes, qfmt)
    # the fields GGUF stores as u32 / f32 (llama.cpp reads them so): a value they cannot hold is
    # refused here, naming it, rather than by gguf-py's struct.pack or as an f32 rounded to 0 / inf
    check_dims_fit(c, src.path, 2**32, "GGUF's u32 field")
    # (rope_theta: ModelConfig.check_rope already holds it to float32's normal range)
    with np.errstate(over="ignore"):
        eps32 = np.float32(c.rms_norm_eps)
    if not (np.isfinite(eps32) and eps32 > 0):
        raise ValueError(f"{src.path}: rms_norm_eps={c.rms_norm_eps} is not a positive float32 "
                         "(GGUF stores it as F32)")
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".part")
    w = gguf.GGUFWriter(str(tmp), c.arch)
    w.add_name(src.path.stem if src.path.is_file() else src.path.name)
    w.add_context_length(c.context_length or c.max_position)   # (llama.cpp's converter: max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(float(c.rope_theta))
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    if c.sliding_window is not None:   # (gguf-py's key; llama.cpp's converter writes none for Mistral,
        w.add_sliding_window(c.sliding_window)   # and its llama arch reads none: it attends to all)
    if c.arch == "llama":
        w.add_rope_dimension_count(c.head_dim)
        w.add_vocab_size(c.vocab_size)
    w.add_file_type(getattr(gguf.LlamaFileType, file_type))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if src.gguf_meta:
        add_gguf_tokenizer(w, src)
    elif src.tokenizer_dir is not None:   # an HF source, or a .bin with tokenizer files beside it
        add_hf_tokenizer(w, src)

    # Streamed: every tensor's info first (shapes are known from the config), then header, kv and
    # tensor infos, then each tensor as it is quantized (GGUFWriter.write_tensor_data), so at most
    # one tensor is held; the bytes are those add_tensor + write_tensors_to_file would write.
    if c.rope_freq_factors is not None:   # first, as llama.cpp's converter writes it
        w.add_tensor_info("rope_freqs.weight", (c.head_dim // 2,), np.dtype(np.float32), 2 * c.head_dim)
    for name, shape in shapes.items():
        if len(shape) == 1:
            w.add_tensor_info(gguf_name(name), shape, np.dtype(np.float32), 4 * shape[0])
        elif fmt == "fp16" or name in f16:
            w.add_tensor_info(gguf_name(name), shape, np.dtype(np.float16), 2 * shape[0] * shape[1])
        else:
            bshape, bdtype = qfmt.storage(shape, {})["data"]
            nbytes = int(np.prod(bshape)) * np.dtype(bdtype).itemsize
            w.add_tensor_info(gguf_name(name), bshape, np.dtype(bdtype), nbytes, raw_dtype=qtype)
    if f16:   # said before the tensors are written: a comparison must not be silently mixed-format
        from quantzoo.formats.base import warn

        named = [f"{gguf_name(n)} (in_features={shapes[n][1]})" for n in list(f16)[:FALLBACK_NAMED]]
        more = f", and {len(f16) - FALLBACK_NAMED} more" if len(f16) > FALLBACK_NAMED else ""
        warn(f"{dst}: {len(f16)} of {sum(len(s) == 2 for s in shapes.values())} weights are stored as F16, "
             f"not {qfmt.gguf_type}: their in_features is not a multiple of {qfmt.block_size}, the "
             f"{qfmt.gguf_type} block size (llama.cpp's converter falls back to F16 so for Q8_0): "
             f"{', '.join(named)}{more}; general.file_type stays {file_type}", UserWarning)
    try:
        _write_gguf_tensors(w, src, shapes, fmt, dst, progress, f16)
        w.close()
        tmp.replace(dst)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return dst


def f16_fallback(shapes: dict, qfmt) -> dict:
    """{HF name: shape} of the 2-D weights a GGUF in `qfmt` stores as F16: those whose in_features
    (the last dimension, along which a row splits into blocks) its block size does not divide."""
    return {n: s for n, s in shapes.items() if len(s) == 2 and s[1] % qfmt.block_size}


def _write_gguf_tensors(w, src: Source, shapes: dict, fmt: str, dst: Path, progress: bool,
                        f16=()) -> None:
    from tqdm import tqdm

    c = src.config
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    if c.rope_freq_factors is not None:
        w.write_tensor_data(np.asarray(c.rope_freq_factors, dtype=np.float32))
    for name in tqdm(list(shapes), desc=f"writing {dst.name}", unit="tensor", disable=not progress, leave=False):
        heads = None
        if c.arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            heads = c.num_heads
        elif c.arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            heads = c.num_kv_heads
        if len(shapes[name]) == 1:
            w.write_tensor_data(np.ascontiguousarray(check_finite(src.tensor(name), name), dtype=np.float32))
        elif fmt == "fp16" or name in f16:
            t = src.tensor(name)
            try:
                w.write_tensor_data(_fp16(t if heads is None else llama_permute(t, heads), name))
            except ValueError as e:   # (a fallback's refusal says why the tensor is F16 at all)
                if fmt == "fp16":
                    raise
                raise ValueError(f"{e} (stored as F16: in_features={shapes[name][1]} is not a multiple "
                                 f"of {get(fmt).block_size}, the {get(fmt).gguf_type} block size)") from None
        else:
            # block formats quantize each row on its own: permuting rows commutes with quantizing
            data = np.asarray(src.quantized(name, fmt).data)
            if heads is not None:
                data = llama_permute(data, heads)
            w.write_tensor_data(np.ascontiguousarray(data))


# ---------------------------------------------------------------------------------------
def export(src, dst, fmt: str, group_size: int | None = None, progress: bool = True) -> Path:
    """Read SRC (HF dir, .gguf or .bin) and write DST in `fmt`; returns the written path.
    group_size (AWQ): None = an AWQ source's own group (its weights are then copied, not
    re-quantized from their dequantized values: that moved a g64 model's logits by ~1), else 128."""
    if fmt not in FORMATS:
        if fmt in stored_names():   # a registry format with no writer
            raise ValueError(f"--format {fmt}: no DST is written in it (a .gguf holds the formats with a "
                             f"ggml type); choose one of {FORMATS}")
        raise ValueError(f"--format {fmt!r}: choose one of {FORMATS}")
    # DST as given for the path checks: Path() makes "" the current directory and drops the "/"
    # of "x.gguf/" (which then replaced an existing file x.gguf)
    given = os.fspath(dst)
    if not given:
        raise ValueError("DST: an empty path")
    dst = Path(dst)
    check_no_symlink_loop(src, f"SRC={src}")   # (before resolve(), which raises RuntimeError on one)
    check_no_symlink_loop(dst, f"DST={dst}")
    if Path(src).resolve() == dst.resolve():
        raise ValueError(f"DST={dst} is the source itself; write somewhere else")
    kind = {".gguf": "gguf", ".bin": "bin"}.get(dst.suffix.lower(), "dir")   # (UP.GGUF, o.Bin too)
    if kind == "gguf" and fmt not in DESTINATIONS["gguf"]:
        raise ValueError(f"--format {fmt}: a .gguf file cannot hold {fmt.upper()} weights; give DST as a directory "
                         "(HF AWQ checkpoint) or a .bin file (KuiperLLama)")
    if kind == "dir" and fmt not in DESTINATIONS["dir"]:
        raise ValueError(f"--format {fmt}: llama.cpp formats are written as GGUF; give DST a .gguf name")
    if kind == "bin" and fmt not in DESTINATIONS["bin"]:
        raise ValueError(f"--format {fmt}: a KuiperLLama .bin holds AWQ weights only (--format awq)")
    if kind == "dir" and dst.exists() and not dst.is_dir():
        raise ValueError(f"DST={dst} exists and is not a directory")
    if kind != "dir" and dst.is_dir():
        raise ValueError(f"DST={dst} is a directory; a .{kind} DST names the file to write")
    if kind == "dir" and dst.is_dir():
        stale = [f.name for f in dst.iterdir()
                 if f.name.endswith(".safetensors") and f.name != "model.safetensors"
                 or f.name == "model.safetensors.index.json"]
        if stale:
            raise ValueError(f"DST={dst} already holds other checkpoint files ({', '.join(sorted(stale)[:3])}"
                             f"{', ...' if len(stale) > 3 else ''}); write to an empty directory")
    # where DST goes must take it (its folders are made as needed): checked before the source is read
    if kind == "dir":   # (a directory where one of its files goes had failed after all the weights)
        check_out_dir(given, f"DST={given}", files=HF_FILES)
    else:   # (a .gguf or .bin is written beside DST and renamed over it)
        check_out_file(given, f"DST={given}", make_parent=True, replaced=True)
    src_m = read_source(src, progress=progress)
    if group_size is None:   # (after read_source: a bad source's own error comes first)
        group_size = awq_group_of(src) or DEFAULT_GROUP
    try:
        if kind == "gguf":
            return write_gguf(src_m, dst, fmt, progress=progress)
        if kind == "bin":
            from .kuiper import write_kuiper

            return write_kuiper(src_m, dst, group_size=group_size, progress=progress)
        return write_hf(src_m, dst, fmt, group_size=group_size, progress=progress)
    except OSError as e:   # the writers' temporaries (X.part): a failure names DST, which the user gave
        f = Path(os.fspath(e.filename)) if isinstance(e.filename, (str, os.PathLike)) else None
        if f is None or f.suffix != ".part" or f.parent not in (dst.parent, dst):   # (not a source's)
            raise
        raise OSError(e.errno, f"DST={given}: cannot be written ({e.strerror}; while writing its "
                               f"temporary {e.filename})") from None
