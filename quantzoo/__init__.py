"""quantzoo: quantized-matmul kernels (AWQ W4A16, GGUF block formats x Q8_1) with references.

    import quantzoo as qz
    qt = qz.formats.get("q4_0").quantize(w)     # w: float (out_features, in_features)
    y = qz.ops.matmul(x, qt)                    # y = x @ W.T; CPU runs the reference
"""
from . import formats, ops, reference  # noqa: F401
from .formats import QuantizedTensor
from .nn import QuantLinear

__all__ = ["formats", "ops", "reference", "QuantizedTensor", "QuantLinear", "load_model"]
__version__ = "0.1.0"


def load_model(path=None, device: str = "cpu", **kw):
    """Load a Qwen3/llama model (HF dir, .gguf file, or None = the default model)."""
    from .model import load_model as _load

    return _load(path, device=device, **kw)
