"""quantzoo.formats: the format registry.

    names()         registered format names, weight formats first
    get(name)       the Format instance (KeyError listing the known names otherwise)
    stored_names()  the names a weight is stored in (all but the activation format)
    get_stored(name, what)  the same for a format that stores weights (naming `what`: a KeyError for
                            an unknown name, a ValueError for an activation format)
    weight_formats()  the Format instances of kind "weight" (not q8_1, not fp16)
    as_float_matrix(w)  a numpy array or torch tensor (N, K) as finite float32 numpy (quantize's
                        input check: ValueError otherwise)
    Format          the class of the registry's entries (quantize, dequantize, emulate, ...)
    QuantizedTensor  a weight in a format's storage (format, shape, data, params; .to(device))

Each module below registers its classes on import (gguf-py style, `class X(Format, name=...)`).
"""
from .base import Format, as_float_matrix, get, get_stored, names, stored_names, weight_formats
from .tensor import QuantizedTensor
from . import awq, gguf_blocks, fp16  # noqa: F401  (registration)

__all__ = ["Format", "QuantizedTensor", "get", "get_stored", "names", "stored_names", "weight_formats",
           "as_float_matrix"]
