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
    """One quantization format: its codec, its reference math and the name of its kernels.

    The registry holds one instance per format (formats.get(name)). Attributes: name; kind
    ("weight", "activation" for q8_1, "baseline" for fp16); block_size (values along K sharing a
    scale: the GGUF block, AWQ's default group); bytes_per_block; bits_per_weight (scales counted);
    param_names (the options quantize takes); gguf_type (the ggml type, or None); kernels (the
    module under quantzoo.kernels); nmse_ceiling (the tests' error bound on the standard workload).

    The methods work on QuantizedTensors of the format. quantize(w) makes one from a float matrix,
    dequantize(qt) and emulate(x, qt) read it back (numpy, on the CPU, from a weight on any
    device), nbytes(shape) and storage(shape, params) say what it stores, check(qt) names what
    does not match: dequantize and emulate run it first, so they refuse (ValueError) a weight of
    another format or one whose storage disagrees with its shape and params.
    """

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
            if cls.kind not in KINDS:
                raise TypeError(f"format {name!r}: kind {cls.kind!r} is not one of {KINDS}")
            # a second entry of a name or of a GGUF type would replace the first one silently:
            # the GGUF loader maps a ggml type to one format and the CUDA kernels instantiate
            # one template per block struct (Block<gguf_type>). (The same class defined again
            # -- importlib.reload, autoreload -- replaces its entry.)
            def same(f):
                return (type(f).__module__, type(f).__qualname__) == (cls.__module__, cls.__qualname__)
            if name in _REGISTRY and not same(_REGISTRY[name]):
                raise TypeError(f"format {name!r} is registered already ({type(_REGISTRY[name]).__name__})")
            twin = next((f for f in _REGISTRY.values() if cls.gguf_type and f.gguf_type == cls.gguf_type
                         and not same(f)), None)
            if twin is not None:
                raise TypeError(f"format {name!r}: gguf_type {cls.gguf_type} is already the type of {twin.name!r} "
                                "(a ggml type names one storage layout)")
            cls.name = name
            _REGISTRY[name] = cls()

    @property
    def bits_per_weight(self) -> float:
        """Storage bits per weight element, scales/zeros/sums counted."""
        return 8.0 * self.bytes_per_block / self.block_size

    def nbytes(self, shape, **opts) -> int:
        """Storage bytes of a weight of this shape, with quantize's options: what `storage` says,
        so a shape or option quantize refuses is refused here too."""
        if not (isinstance(shape, (tuple, list)) and len(shape) == 2 and all(
                isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0 for d in shape)):
            raise ValueError(f"{self.name}.nbytes: shape {shape!r} is not (out_features, in_features) > 0")
        unknown = sorted(set(opts) - set(self.param_names))
        if unknown:
            raise TypeError(f"{self.name}.nbytes: unexpected options {unknown}")
        if "group_size" in self.param_names:
            opts.setdefault("group_size", self.block_size)   # quantize's default
        arrays = self.storage(tuple(int(d) for d in shape), opts).values()
        return sum(int(np.prod(s)) * np.dtype(dt).itemsize for s, dt in arrays)

    # --- codec -------------------------------------------------------------------------
    def quantize(self, w, **opts):
        """A QuantizedTensor of w, a real-valued numpy array or torch tensor (out_features,
        in_features) on any device, in this format's storage (numpy). opts: the format's options
        (param_names; awq: group_size). ValueError for a w that is not 2-D, is empty, complex or
        meta, holds NaN / inf, or that the format cannot store (GGUF: in_features not a multiple of
        32; awq: of group_size, or out_features not of 8; a value or scale past fp16's +-65504);
        TypeError for an option the format does not take. Warns (RuntimeWarning) where the
        format's bytes lose a weight."""
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

    def nonfinite_rows(self, qt) -> np.ndarray:
        """bool (out_features,): the rows whose stored values or scales hold a NaN or inf (a
        corrupt file: every product with such a row is NaN), after `check` (its format and
        storage). Reads the scale fields only."""
        self.check(qt)
        return self._nonfinite_rows(qt)

    def _nonfinite_rows(self, qt) -> np.ndarray:
        raise NotImplementedError

    # --- reference: what the kernel computes, bit for bit where it can be ----------------
    def emulate(self, x: np.ndarray, qt, return_bound: bool = False):
        """y = x @ W.T as the CUDA kernels compute it (see reference/), after `check` (its format and
        storage), as dequantize. x: real numbers (..., in_features), numpy or anything np.asarray
        takes (a CPU torch tensor); y: float32 numpy (..., out_features), not rounded to the fp16
        the kernels write. return_bound=True returns (y, bound): bound float64 of y's shape, a
        per-output bound on what the kernels' fp32 summation order moves y by (reference/gguf_dot.py
        and awq_fp16.py say what each covers). ValueError for a 0-d x or another last dimension;
        q8_1 (an activation format) raises TypeError."""
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


def refuse_scalar_x(x, weight_shape, fmt: str | None = None) -> None:
    """An x of no dimensions, refused as every matmul entry (ops.matmul, its fake kernel, the
    references) says it, where x.shape[-1] would be an IndexError; x: a numpy array or torch tensor."""
    if x.ndim == 0:
        n, k = weight_shape
        raise ValueError(f"x: a scalar (0-d); expected shape (..., {k}) for the {fmt + ' ' if fmt else ''}"
                         f"weight {(n, k)}")


def cast_warn(x, dtype, consequence: str, underflow: str | None = None, what: str = "x") -> np.ndarray:
    """np.asarray(x).astype(dtype) with a RuntimeWarning naming the first element of x (called
    `what`) that is finite but past dtype's range (the cast makes it inf), by row and column as (M, K);
    `consequence` ends the message. NaN and inf already in x are not reported: they propagate.
    With `underflow` (the message's end there), also a warning naming the first row of x whose
    values the cast moves by more than LOSS of the row's largest |x|: rows too small for dtype's
    normal range (fp16: below 6.1e-05 the spacing is a fixed 6e-08, and nothing below 3e-08
    survives), where a normal value moves by at most half an ulp (fp16: 2^-11 of it)."""
    x = np.asarray(x)
    with np.errstate(over="ignore"):
        y = x.astype(dtype, copy=False)
    if y is x or y.dtype.kind != "f" or not x.size:
        return y
    k = x.shape[-1] if x.ndim else 1
    if np.isinf(y).any():
        over = np.isinf(y) & np.isfinite(x)
        if over.any():
            r, c = divmod(int(np.flatnonzero(over)[0]), k)
            v = float(x.reshape(-1)[r * k + c])
            warn(f"{what}: row {r}, column {c}: {v:.6g} overflows {np.dtype(dtype).name} "
                 f"(|{what}| > {float(np.finfo(dtype).max):.6g}); {consequence}")
    if underflow is not None:
        x2, y2 = x.reshape(-1, k), y.reshape(-1, k)
        with np.errstate(invalid="ignore", over="ignore"):
            amax = np.abs(x2).max(axis=1)
            moved = np.abs(y2.astype(x2.dtype) - x2).max(axis=1)
        lost = np.isfinite(amax) & np.isfinite(moved) & (moved > LOSS * amax)
        if lost.any():
            r = int(np.flatnonzero(lost)[0])
            warn(f"{what}: row {r}: its largest |{what}| is {float(amax[r]):.3g}, below {np.dtype(dtype).name}'s normal "
                 f"range ({float(np.finfo(dtype).tiny):.3g}), so the cast moves its values by up to "
                 f"{float(moved[r] / amax[r]):.1%} of that ({int(lost.sum())} of {x2.shape[0]} rows lose over "
                 f"{LOSS:.2%}); {underflow}")
    return y


# what the fp16 fields and casts may lose before it is said: more than 8-bit quantization's own
# rounding (half a step of max|x| / 127 is 0.39 % of max|x|)
LOSS = 2.0 ** -8


KINDS = ("weight", "activation", "baseline")   # names()' order: weight formats first


def names() -> list[str]:
    """Registered names by kind (KINDS), each kind in registration order: a format module
    imported after fp16 is still listed with the weight formats."""
    return sorted(_REGISTRY, key=lambda n: KINDS.index(_REGISTRY[n].kind))


def stored_names() -> list[str]:
    """names() of the formats a weight is stored in: every one but the activation format."""
    return [n for n in names() if _REGISTRY[n].kind != "activation"]


def get(name: str) -> Format:
    """The registered Format named `name` ("q4_0", ...); KeyError listing the known names for an
    unknown name or one that is not a str."""
    if not isinstance(name, str):
        raise KeyError(f"format name: expected a str such as 'q4_0', got {type(name).__name__}; "
                       f"known formats: {', '.join(names())}")
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown format {name!r}; known formats: {', '.join(names())}") from None


def get_stored(name: str, what: str) -> Format:
    """get(name) of a format that stores weights (a weight format or the fp16 baseline, not an
    activation format); `what` names the argument in the error (a KeyError for an unknown name,
    listing the formats that store weights)."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise KeyError(f"{what}: unknown format {name!r}; formats that store weights: {', '.join(stored_names())}")
    f = get(name)
    if f.kind == "activation":
        raise ValueError(f"{what}: {name!r} is an activation format, not a weight format")
    return f


def weight_formats() -> list[Format]:
    """The Formats of kind "weight" (quantized weight formats: not q8_1, not the fp16 baseline),
    in names() order."""
    return [_REGISTRY[n] for n in names() if _REGISTRY[n].kind == "weight"]


def as_float_matrix(w, what: str = "w") -> np.ndarray:
    """Accept a numpy array or torch tensor (N, K) and return finite float32 numpy. ValueError,
    naming `what`, for one that is not 2-D or real, is empty, meta or sparse, holds NaN / inf, or
    holds a float64 value past float32's range."""
    if hasattr(w, "detach"):
        import torch

        if w.is_complex():
            raise ValueError(f"{what}: complex values cannot be quantized")
        if w.device.type == "meta":
            raise ValueError(f"{what}: a meta tensor holds no values to quantize")
        if w.layout != torch.strided:
            raise ValueError(f"{what}: a {w.layout} tensor; pass a dense one (w.to_dense())")
        w = w.detach().cpu().resolve_neg()   # (z.conj().imag: a lazily negated view, which .numpy() refuses)
        w = (w if w.dtype == torch.float64 else w.float()).numpy()   # (float64: range-checked below)
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
