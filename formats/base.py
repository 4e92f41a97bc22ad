"""The registry: one Format subclass per quantization format, registered on subclassing.

A Format pairs a codec (quantize / dequantize in the format's native storage, here in
formats/), the reference math of what its kernels compute (reference/), and the name of its
kernel module (quantzoo.kernels.<kernels>). Tests, bench, report and runner iterate this
registry; nothing else keeps a list of formats.
"""
from __future__ import annotations

import numpy as np

_REGISTRY: dict[str, "Format"] = {}


class Format:
    name: str = ""
    kind: str = "weight"          # "weight", "activation" (q8_1) or "baseline" (fp16)
    block_size: int = 1           # elements along K sharing one scale (GGUF block, AWQ group)
    bytes_per_block: int = 0      # storage bytes for one block of block_size elements
    kernels: str | None = None    # module under quantzoo.kernels with the CUDA entry points
    nmse_ceiling: float = 0.0     # NMSE bound of the kernel's result on the standard workload
    gguf_type: str | None = None  # gguf.GGMLQuantizationType name when a .gguf can store it

    def __init_subclass__(cls, *, name: str | None = None, **kw):
        super().__init_subclass__(**kw)
        if name is not None:
            cls.name = name
            _REGISTRY[name] = cls()

    @property
    def bits_per_weight(self) -> float:
        """Storage bits per weight element, scales/zeros/sums counted."""
        return 8.0 * self.bytes_per_block / self.block_size

    def nbytes(self, shape, **opts) -> int:
        n, k = shape
        return n * k * self.bytes_per_block // self.block_size

    # --- codec -------------------------------------------------------------------------
    def quantize(self, w, **opts):
        raise NotImplementedError

    def dequantize(self, qt) -> np.ndarray:
        raise NotImplementedError

    # --- reference: what the kernel computes, bit for bit where it can be ----------------
    def emulate(self, x: np.ndarray, qt, return_bound: bool = False):
        """y = x @ W.T as the CUDA kernels compute it (see reference/)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<format {self.name}: {self.kind}, {self.bits_per_weight:g} bits/weight>"


def names() -> list[str]:
    return list(_REGISTRY)


def get(name: str) -> Format:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown format {name!r}; known formats: {', '.join(_REGISTRY)}") from None


def weight_formats() -> list[Format]:
    return [f for f in _REGISTRY.values() if f.kind == "weight"]


def as_float_matrix(w, what: str = "w") -> np.ndarray:
    """Accept a numpy array or torch tensor (N, K) and return finite float32 numpy."""
    if hasattr(w, "detach"):
        w = w.detach().float().cpu().numpy()
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"{what}: expected a 2-D (out_features, in_features) array, got shape {w.shape}")
    w = w.astype(np.float32, copy=False)
    if not np.isfinite(w).all():
        bad = np.argwhere(~np.isfinite(w))[0]
        raise ValueError(f"{what}: non-finite value {w[tuple(bad)]} at index {tuple(int(i) for i in bad)}; "
                         "NaN/inf cannot be quantized")
    return w
