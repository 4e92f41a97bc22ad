"""Dispatch: y = x @ W.T for a QuantizedTensor W, by device and then (in the kernel modules) by M.

CPU (numpy, or torch on CPU) runs the reference: by default the bit-faithful emulation of what
the GPU kernel computes (reference/), or with mode="dequant" a float32 matmul on the
dequantized weight. CUDA (torch fp16 on a GPU, weight moved there with qt.to("cuda")) runs the
format's kernels, quantzoo.kernels.<fmt.kernels>.matmul. While torch.compile traces, under make_fx
or FakeTensorMode, for torch.func and forward-mode AD, and on meta, the call goes through the
operator torch.ops.quantzoo.qmatmul instead (quantzoo.torch_ops: a graph node, the fake kernel,
derivatives refused by name).
"""
from __future__ import annotations

import importlib

import numpy as np

from torch import is_grad_enabled as _grad_enabled

from . import torch_ops
from .formats import QuantizedTensor, get_stored
from .formats.base import cast_warn, refuse_scalar_x, warn

MODES = ("emulate", "dequant")


def _same_device(a: str, b: str) -> bool:
    norm = lambda d: "cuda:0" if d == "cuda" else d  # noqa: E731
    return norm(a) == norm(b)


_KERNEL_MODULES: dict = {}


def kernels_for(fmt):
    """The kernel module of a format (quantzoo.kernels.<name>), or a clear error."""
    mod = _KERNEL_MODULES.get(fmt.kernels)
    if mod is None:
        if fmt.kernels is None:
            raise NotImplementedError(f"format {fmt.name!r} has no GPU kernels")
        mod = _KERNEL_MODULES[fmt.kernels] = importlib.import_module(f"quantzoo.kernels.{fmt.kernels}")
    return mod


def _check_args(qt, mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: choose one of {MODES}")
    if not isinstance(qt, QuantizedTensor):
        raise ValueError(f"qt: expected a QuantizedTensor (formats.get(name).quantize(w)), "
                         f"got {type(qt).__name__}")


def matmul(x, qt, *, mode: str = "emulate"):
    """y = x @ W.T for the weight qt (N, K); x (..., K) torch or numpy; same kind of array out.

    CPU (numpy, anything np.asarray takes, or a CPU torch tensor; qt's storage on the CPU): the
    numpy reference, computed in float32; mode="emulate" (default) is what the format's GPU kernels
    compute (Format.emulate: GGUF formats quantize x to Q8_1), mode="dequant" x @ dequantize(qt).T.
    numpy x of any real dtype gives float32 numpy (..., N); a torch x (float16, bfloat16, float32
    or float64) gives a torch tensor of x's dtype. Warns (RuntimeWarning) where a value is lost
    as the GPU would lose it (README, "Python API").
    CUDA (x and qt.to("cuda") on one GPU): the format's kernels; x must be a contiguous float16
    tensor, y is float16 (..., N); mode is not used there.

    ValueError for an unknown mode, a qt that is not a QuantizedTensor or stores activations
    (q8_1), storage that disagrees with qt's shape (Format.check), an x that is 0-d, complex, of
    an integer torch dtype, sparse, of another last dimension or on another device than qt, and an
    x or weight that requires grad under grad mode (no backward); KeyError for a qt whose format
    name is not registered. Under torch.compile, make_fx, FakeTensorMode, torch.func and on meta
    the call goes through torch.ops.quantzoo.qmatmul."""
    if hasattr(x, "detach") and torch_ops.via_operator(x):
        # torch.compile tracing, make_fx / FakeTensorMode, torch.func, forward AD: through the
        # operator (an opaque node, its fake kernel, its refusals) before anything reads x's data
        _check_args(qt, mode)
        return torch_ops.qmatmul(x, qt, mode)
    return _matmul(x, qt, mode)


def _matmul(x, qt, mode: str):
    """matmul's direct dispatch (the operator's kernel calls it: no second routing)."""
    _check_args(qt, mode)
    # what the operator's Autograd kernel refuses, eagerly; grad mode first, one C call: under
    # inference_mode / no_grad (the runner's hot path) nothing else is looked at
    if _grad_enabled() and hasattr(x, "detach"):
        torch_ops.refuse_grad(x, "quantzoo.ops.matmul", qt.arrays().values())
    if getattr(x, "is_cuda", False):
        # The runner's hot path (~150 calls per forward, a 512-token prefill is partly bound
        # by their Python time): the kernel module checks x and the weight itself (shapes,
        # dtypes, devices), so nothing is checked twice here.
        return kernels_for(qt.fmt).matmul(x, qt)
    is_torch = hasattr(x, "detach")
    if is_torch:
        import torch

        if x.layout != torch.strided:
            raise ValueError(f"x: a {x.layout} tensor; expected a dense one (x.to_dense())")
        torch_ops.check_dtype(x)
    else:
        x = np.asarray(x)
        if x.dtype.kind not in "biuf":
            raise ValueError(f"x: dtype {x.dtype}; expected an array of real numbers")
    get_stored(qt.format, "qt")   # q8_1 stores activations: a ValueError, as QuantLinear and CUDA give
    qt.fmt.check(qt)
    n, k = qt.shape
    refuse_scalar_x(x, qt.shape, qt.format)
    shape = tuple(x.shape)
    if shape[-1] != k:
        raise ValueError(f"x: last dimension is {shape[-1]}, the {qt.format} weight {qt.shape} expects K={k}")
    xdev = str(x.device) if is_torch else "cpu"
    if not _same_device(xdev, qt.device):
        raise ValueError(f"x is on {xdev} but the {qt.format} weight is on {qt.device}; "
                         "move one with qt.to(device) or x.to(device)")
    if xdev == "meta":   # the operator's fake kernel: the result's shape and dtype, on meta
        return torch_ops.qmatmul(x, qt, mode)
    if xdev != "cpu":   # a non-CUDA torch device with the weight there too
        return kernels_for(qt.fmt).matmul(x, qt)
    # The CPU computes in float32 at most (the kernels take fp16 x; GGUF's Q8_1 quantizer fp32 too): a finite x past
    # float32's range (float64 in) becomes inf, said by row and column as GGUF's Q8_1 overflow is
    if is_torch:
        x64 = x.element_size() > 4   # float64; float16/bfloat16 always fit in float32
        xd = x.detach().resolve_neg()   # (z.conj().imag: a lazily negated view, which .numpy() refuses)
        xn = xd.numpy() if x64 else xd.float().numpy()
    else:
        xn = x
    xn = cast_warn(xn, np.float32, "the CPU reference computes in float32 (the GPU kernels take fp16 x, "
                   "GGUF's Q8_1 quantizer fp32 too), so the result there is inf/NaN")
    if mode == "emulate":
        y = qt.fmt.emulate(xn, qt)
    else:
        w = qt.fmt.dequantize(qt)
        with np.errstate(invalid="ignore", over="ignore"):   # inf x (said above, or given): inf/NaN y
            y = (xn.reshape(-1, k) @ w.T).reshape(*shape[:-1], n)
    if is_torch:
        out = torch.from_numpy(np.ascontiguousarray(y)).to(x.dtype)
        if x.dtype == torch.float16:   # as the kernels' fp16 output: said here
            over = torch.isinf(out) & torch.from_numpy(np.isfinite(y))
            if over.any():
                r, c = divmod(int(over.reshape(-1).nonzero()[0]), n)
                warn(f"y: row {r}, column {c}: {float(y.reshape(-1)[r * n + c]):.6g} overflows "
                     f"{str(x.dtype).replace('torch.', '')} (x's dtype, which the result takes, as on the GPU), "
                     "so it is inf there")
        return out
    return y


def release_workspaces():
    """Free the GPU kernels' cached scratch buffers (dequant slabs, split-K partials and counters,
    Q8_1 activations: quantzoo.kernels.workspaces). They are reused across eager calls and only
    ever grown, so they outlive the model that needed them. Safe at any time: the next call
    allocates anew, launch plans into the freed buffers are dropped, and captured CUDA graphs
    never use them (a capture's workspaces are its own)."""
    from quantzoo.kernels import workspaces

    workspaces.release()


def awq_gemm(x, qweight, scales, qzeros, group_size):
    """vLLM-style AWQ GEMM: fp16 x [.., K] @ W -> fp16 [.., N], W from HF-layout AWQ tensors
    (qweight int32 [K, N/8], scales fp16 [K/G, N], qzeros int32 [K/G, N/8]) on CUDA.

    CUDA only: every tensor on one GPU, x contiguous float16; group_size 32, 64 or 128, agreeing
    with scales' rows. ValueError naming the argument for anything else (a CPU tensor included)."""
    import torch

    # as matmul: through the operator while torch.compile traces (one opaque node), under make_fx
    # or FakeTensorMode (the node, the fake kernel), torch.func and forward AD (its refusals)
    if isinstance(x, torch.Tensor) and torch_ops.via_operator(x):
        return torch.ops.quantzoo.awq_gemm(x, qweight, scales, qzeros, group_size)
    from quantzoo.kernels import awq

    return awq.gemm(x, qweight, scales, qzeros, group_size)


def awq_dequantize(qweight, scales, qzeros):
    """fp16 [K, N] = (q - z) * s on CUDA from HF-layout AWQ tensors (group size from the shapes):
    the [in, out] transpose of formats.get("awq").dequantize, rounded to fp16. CUDA only (ValueError
    for a CPU tensor, a shape or dtype other than awq_gemm's)."""
    from quantzoo.kernels import awq

    return awq.awq_dequantize(qweight, scales, qzeros)
