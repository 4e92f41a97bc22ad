"""quantzoo: quantized-matmul kernels (AWQ W4A16, GGUF block formats x Q8_1) with references.

    import quantzoo as qz
    qt = qz.formats.get("q4_0").quantize(w)     # w: float (out_features, in_features)
    y = qz.ops.matmul(x, qt)                    # y = x @ W.T; CPU runs the reference
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
    """Load a Qwen3/llama model (HF dir, .gguf file, or None = the default model)."""
    from .model import load_model as _load

    return _load(path, device=device, **kw)
