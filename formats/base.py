"""The registry: one Format subclass per quantization format, registered on subclassing.

A Format pairs a codec (quantize / dequantize in the format's native storage, here in
formats/), the reference math of what its kernels compute (reference/), and the name of its
kernel module (quantzoo.kernels.<kernels>). Tests, bench, report and runner iterate this
registry; nothing else keeps a list of formats.
"""
from __future__ import annotations

import sys
import warnings

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
    param_names: tuple = ()       # the keys a weight's params may hold (AWQ: group_size)

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
        """float32 (out_features, in_features) of qt, after `check` (its format and storage)."""
        self.check(qt)
        return self._dequantize(qt)

    def _dequantize(self, qt) -> np.ndarray:
        raise NotImplementedError

    def storage(self, shape, params: dict) -> dict:
        """{array name: (shape, numpy dtype)} of a weight of this shape in this format's storage
        (the array name "data" for a single array)."""
        raise NotImplementedError

    def check(self, qt) -> None:
        """A clear error when qt's storage does not match its shape and params (a hand-built
        QuantizedTensor, say): every array's shape and dtype as `storage` says."""
        if getattr(qt, "format", None) != self.name:
            raise ValueError(f"{self.name} weight: got a {getattr(qt, 'format', type(qt).__name__)!r} weight")
        shape = getattr(qt, "shape", None)
        if not (isinstance(shape, tuple) and len(shape) == 2
                and all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0 for d in shape)):
            raise ValueError(f"{self.name} weight: shape {shape!r} is not (out_features, in_features) > 0")
        params = getattr(qt, "params", None)
        if not isinstance(params, dict):
            raise ValueError(f"{self.name} weight {shape}: params is a {type(params).__name__}, expected a dict")
        unknown = sorted(map(repr, set(params) - set(self.param_names)))
        if unknown:
            takes = f"takes only {list(self.param_names)}" if self.param_names else "takes none"
            raise ValueError(f"{self.name} weight {shape}: unknown params {', '.join(unknown)} "
                             f"({self.name} {takes})")
        want = self.storage(shape, params)
        have = qt.arrays()
        if sorted(map(str, have)) != sorted(want):
            raise ValueError(f"{self.name} weight: storage arrays {sorted(map(str, have))}, expected {sorted(want)}")
        for key, (wshape, wdtype) in want.items():
            a = have[key]
            expect = f"{np.dtype(wdtype).name}{list(wshape)}"
            if not is_array(a):   # None, a list, ...: no shape or dtype to compare
                raise ValueError(f"{self.name} weight {shape}: {key} is {type(a).__name__}, expected {expect}")
            got = (tuple(a.shape), str(a.dtype).replace("torch.", ""))
            if got != (tuple(wshape), np.dtype(wdtype).name):
                raise ValueError(f"{self.name} weight {shape}: {key} is {got[1]}{list(got[0])}, "
                                 f"expected {expect}")

    # --- reference: what the kernel computes, bit for bit where it can be ----------------
    def emulate(self, x: np.ndarray, qt, return_bound: bool = False):
        """y = x @ W.T as the CUDA kernels compute it (see reference/)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<format {self.name}: {self.kind}, {self.bits_per_weight:g} bits/weight>"


def is_array(a) -> bool:
    """A numpy array or a torch tensor: what a QuantizedTensor's storage holds."""
    if isinstance(a, np.ndarray):
        return True
    torch = sys.modules.get("torch")   # (a torch tensor exists only if torch was imported)
    return torch is not None and isinstance(a, torch.Tensor)


def warn(message: str, category=RuntimeWarning) -> None:
    """warnings.warn attributed to the first caller outside quantzoo (the user's line)."""
    level, frame = 2, sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").split(".")[0] == "quantzoo":
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def cast_warn(x, dtype, consequence: str) -> np.ndarray:
    """np.asarray(x).astype(dtype) with a RuntimeWarning naming the first element of x that is
    finite but past dtype's range (the cast makes it inf), by row and column of x as (M, K);
    `consequence` ends the message. NaN and inf already in x are not reported: they propagate."""
    x = np.asarray(x)
    with np.errstate(over="ignore"):
        y = x.astype(dtype, copy=False)
    if y is not x and y.dtype.kind == "f" and np.isinf(y).any():
        over = np.isinf(y) & np.isfinite(x)
        if over.any():
            k = x.shape[-1] if x.ndim else 1
            r, c = divmod(int(np.flatnonzero(over)[0]), k)
            v = float(x.reshape(-1)[r * k + c])
            warn(f"x: row {r}, column {c}: {v:.6g} overflows {np.dtype(dtype).name} "
                 f"(|x| > {float(np.finfo(dtype).max):.6g}); {consequence}")
    return y


def names() -> list[str]:
    return list(_REGISTRY)


def get(name: str) -> Format:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown format {name!r}; known formats: {', '.join(_REGISTRY)}") from None


def get_stored(name: str, what: str) -> Format:
    """get(name) of a format that stores weights (a weight format or the fp16 baseline, not an
    activation format); `what` names the argument in the error."""
    f = get(name)
    if f.kind == "activation":
        raise ValueError(f"{what}: {name!r} is an activation format, not a weight format")
    return f


def weight_formats() -> list[Format]:
    return [f for f in _REGISTRY.values() if f.kind == "weight"]


def as_float_matrix(w, what: str = "w") -> np.ndarray:
    """Accept a numpy array or torch tensor (N, K) and return finite float32 numpy."""
    if hasattr(w, "detach"):
        if w.is_complex():
            raise ValueError(f"{what}: complex values cannot be quantized")
        w = w.detach().float().cpu().numpy()
    w = np.asarray(w)
    if w.dtype.kind not in "biuf":
        raise ValueError(f"{what}: dtype {w.dtype} is not a real number type")
    if w.ndim != 2:
        raise ValueError(f"{what}: expected a 2-D (out_features, in_features) array, got shape {w.shape}")
    if 0 in w.shape:
        raise ValueError(f"{what}: empty shape {w.shape}")
    if w.dtype.kind == "f" and w.dtype.itemsize > 4 and (np.abs(w) > np.finfo(np.float32).max).any():
        raise ValueError(f"{what}: values beyond the float32 range ({float(np.abs(w).max()):.4g})")
    w = w.astype(np.float32, copy=False)
    if not np.isfinite(w).all():
        bad = np.argwhere(~np.isfinite(w))[0]
        raise ValueError(f"{what}: non-finite value {w[tuple(bad)]} at index {tuple(int(i) for i in bad)}; "
                         "NaN/inf cannot be quantized")
    return w
