"""Accuracy of each format on a real model: next-token distributions vs the fp16 version.

The default model (SmolLM2-135M-Instruct, stored as Q4_1 linears + a Q8_0 tied embedding) is
read with its weights dequantized and rounded to fp16: that fp16 model is the reference. Each
format then stores that same fp16 model as `quantzoo quantize` would (quantzoo.model.export):

- a GGUF-storable format (q4_0 ... q8_0): every 2-D weight, the tied embedding included, in the
  format; norms in float;
- AWQ: the decoder linears in AWQ with the largest group size dividing every in_features (64
  for SmolLM2, whose hidden size 576 is not a multiple of 128); embedding and norms in fp16.

The runner then computes teacher-forced next-token logits over the shipped English text
(quantzoo/data/english.txt) for the reference and every format, on CPU in float32 with the
dequantized weights (the runner's CPU "cached" mode, i.e. weight error only: the GGUF kernels'
Q8_1 activation rounding is not in these numbers; the kernel NMSE column has it). Per format:

    top-1 agreement   fraction of positions where argmax logits equal the reference's
    mean KL           mean over positions of KL(p_ref || p_fmt), in nats
    perplexity        exp(mean NLL of the text's actual next tokens) under that model
"""
from __future__ import annotations

import time
from importlib.resources import files

import numpy as np

TEXT_RESOURCE = "english.txt"


def english_text() -> str:
    return (files("quantzoo") / "data" / TEXT_RESOURCE).read_text(encoding="utf-8")


def read_float_model(path=None):
    """(config, {name: float32 ndarray}, tokenizer) with every weight dequantized to float."""
    if path is None:
        from quantzoo.model.default_model import default_model_path

        path = default_model_path()
    try:
        from quantzoo.model.export import read_source
    except ImportError:
        read_source = None
    if read_source is not None:
        src = read_source(path, progress=False)
        names = list(src.config.expected_shapes())
        return src.config, {n: src.tensor(n) for n in names}, src.tokenizer
    from quantzoo.model.gguf_loader import load_gguf

    from quantzoo.formats import QuantizedTensor

    config, weights, tok = load_gguf(str(path), progress=False)
    out = {}
    for n in config.expected_shapes():
        w = weights[n]
        if isinstance(w, QuantizedTensor):
            out[n] = w.dequantize().astype(np.float32)
        elif hasattr(w, "detach"):
            out[n] = w.detach().float().numpy()
        else:
            out[n] = np.asarray(w, dtype=np.float32)
    return config, out, tok


def round_fp16(weights: dict) -> dict:
    """The fp16 reference: every tensor rounded to fp16 (and held as float32)."""
    return {n: w.astype(np.float16).astype(np.float32) for n, w in weights.items()}


def awq_group_size(config) -> int:
    from quantzoo.formats.awq import GROUP_SIZES

    ks = {s[1] for n, s in config.expected_shapes().items() if len(s) == 2 and "layers." in n}
    for g in sorted(GROUP_SIZES, reverse=True):
        if all(k % g == 0 for k in ks):
            return g
    raise ValueError(f"no AWQ group size {GROUP_SIZES} divides every in_features {sorted(ks)}")


def convert(weights: dict, config, fmt_name: str) -> tuple[dict, dict]:
    """Store `weights` in `fmt_name` as the export would and read them back (float32).

    Returns (weights, info); info says what went into which format."""
    from quantzoo import formats
    from quantzoo.model.export import f16_fallback

    fmt = formats.get(fmt_name)
    whole_file = fmt.gguf_type is not None  # GGUF: every 2-D weight in the format
    opts = {"group_size": awq_group_size(config)} if fmt_name == "awq" else {}
    # the GGUF export's F16 fallback (in_features not whole blocks): kept as they are
    f16 = f16_fallback({n: w.shape for n, w in weights.items()}, fmt) if whole_file else {}
    out = {}
    for n, w in weights.items():
        is_linear = w.ndim == 2 and "layers." in n
        if n in f16:
            out[n] = w
        elif w.ndim == 2 and (is_linear or whole_file):
            qt = fmt.quantize(w, **opts)
            out[n] = fmt.dequantize(qt).astype(np.float32, copy=False)
        else:
            out[n] = w  # already fp16-rounded: embeddings of AWQ, norms
    lin_f16 = sum("layers." in n for n in f16)
    info = {"linears": fmt_name + (f" g{opts['group_size']}" if opts else "")
            + (f" ({lin_f16} F16: in_features not whole blocks)" if lin_f16 else ""),
            "embedding": "fp16" if not whole_file or any("layers." not in n for n in f16) else fmt_name}
    return out, info


def _logits(config, weights: dict, tokenizer, ids: list[int]):
    import torch

    from quantzoo.model import build_model

    tw = {n: torch.from_numpy(w) for n, w in weights.items()}
    model = build_model(config, tw, tokenizer, device="cpu", max_seq=len(ids))
    return torch.log_softmax(model.logits(ids).double(), dim=-1)


def compare(ref_logp, logp, ids) -> dict:
    """top-1 agreement, mean KL(ref || this) and perplexity from log-probabilities (T, V)."""
    import torch

    p_ref = ref_logp.exp()
    kl = (p_ref * (ref_logp - logp)).sum(-1)
    top1 = (ref_logp.argmax(-1) == logp.argmax(-1)).double().mean()
    nxt = torch.as_tensor(ids[1:])
    nll = -logp[:-1].gather(1, nxt[:, None]).mean() if len(ids) > 1 else torch.tensor(float("nan"))
    return {"top1": float(top1), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "ppl": float(nll.exp())}


def accuracy(formats_list=None, *, path=None, text: str | None = None, max_tokens: int = 512,
             log=None) -> dict:
    """Run the comparison; returns {model, tokens, text_chars, reference, rows: [...]}."""
    from quantzoo import formats

    t0 = time.time()
    names = formats_list or [f.name for f in formats.weight_formats()]
    config, w, tok = read_float_model(path)
    if tok is None:
        raise ValueError(f"{path or 'the default model'}: the model has no tokenizer; the accuracy section needs one")
    text = english_text() if text is None else text
    ids = tok.encode(text)[:min(max_tokens, config.max_position)]   # (no more than the model's context)
    if len(ids) < 2:
        raise ValueError(f"text: {len(ids)} tokens; need at least 2")
    ref_w = round_fp16(w)
    del w
    ref = _logits(config, ref_w, tok, ids)
    ref_stats = compare(ref, ref, ids)
    rows = []
    for name in names:
        t1 = time.time()
        qw, info = convert(ref_w, config, name)
        logp = _logits(config, qw, tok, ids)
        del qw
        row = {"format": name, **info, **compare(ref, logp, ids), "seconds": time.time() - t1}
        rows.append(row)
        if log:
            log(f"  accuracy {name}: top-1 {row['top1']:.3f}, mean KL {row['kl_mean']:.4f}")
    return {"model": str(path or "default (SmolLM2-135M-Instruct Q4_1 GGUF)"),
            "arch": config.arch, "layers": config.num_layers, "hidden": config.hidden_size,
            "tokens": len(ids), "text_chars": len(text), "reference": {"format": "fp16", **ref_stats},
            "mode": "CPU float32 on dequantized weights (weight error only)",
            "rows": rows, "seconds": time.time() - t0}
