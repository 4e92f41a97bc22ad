"""The Qwen3 / llama runner: config, loaders, forward, generate.

    m = load_model(path=None, device="cpu")   # HF dir, .gguf, KuiperLLama .bin, None = default
    ids = m.tokenizer.encode("text"); m.logits(ids); m.generate(ids, max_new_tokens=48)
"""
from __future__ import annotations

import os

from .config import ModelConfig
from .llm import Model, build_model

__all__ = ["ModelConfig", "Model", "build_model", "load_model"]


def load_model(path=None, device: str = "cpu", **opts) -> Model:
    """Load a model: None = the default real model (SmolLM2-135M-Instruct Q4_1 GGUF), an HF
    directory (AWQ or fp16/bf16/fp32), a .gguf file, or a KuiperLLama AWQ .bin file.

    opts go to build_model (max_seq, matmul_mode, cuda_graph, dtype, fuse, fused_ops, pdl,
    persistent), checked before the load; `progress` (default True) shows tqdm bars while loading.
    """
    from .llm import check_device, check_dtype, check_options

    check_options(**opts)   # (before the load: minutes for a large model)
    check_dtype(opts.get("dtype"), check_device(device))
    progress = opts.pop("progress", True)
    if path is None:
        from .default_model import default_model_path

        path = default_model_path(quiet=not progress)   # (run model --quiet: no fetching line)
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path: {path!r} is not a path (a .gguf file, an HF model directory or a KuiperLLama .bin)")
    path = os.fspath(path)
    if not path:
        raise ValueError("path: empty (a .gguf file, an HF model directory or a KuiperLLama .bin)")
    from quantzoo.paths import check_no_symlink_loop

    check_no_symlink_loop(path, path)   # (os.path.exists below would call it missing)
    if os.path.isdir(path):
        from .hf_loader import load_hf

        config, weights, tokenizer, _gen_cfg = load_hf(path, progress=progress)
    elif not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or directory")
    elif path.lower().endswith(".gguf"):   # (suffixes in any case: Q.GGUF, K.Bin)
        from .gguf_loader import load_gguf

        config, weights, tokenizer = load_gguf(path, progress=progress)
    elif path.lower().endswith(".bin"):
        from .kuiper import load_kuiper

        out = load_kuiper(path)
        config, weights, tokenizer = out[0], out[1], (out[2] if len(out) > 2 else None)
    else:
        raise ValueError(f"{path}: not a model this runner reads (an HF directory, a .gguf file "
                         "or a KuiperLLama .bin)")
    return build_model(config, weights, tokenizer, device=device, progress=progress, **opts)
