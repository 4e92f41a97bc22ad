"""fp16 weights on GPU.

matmul(x, qt) is the baseline every format is measured against: cuBLAS through torch
(F.linear), unchanged. linear(x, w) is what the runner uses for its fp16 weights: the same
cuBLAS call, except at decode-sized M (<= GEMV_MAX_M rows) where our own streaming GEMV
(cuda/fp16_gemv.cu) reads the weight faster than cuBLAS's split-K GEMVs (bench/notes-runner.md).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from quantzoo.cuda_launch import get_kernel, launch, on_tensor_device

GEMV_MAX_M = 4
GEMV_ROWS_PER_CTA = 16     # GEMV_WARPS (8) x GEMV_R (2) in cuda/fp16_gemv.cu
SOURCES = {"fp16_gemv.cu": tuple(f"fp16_gemv<{m}>" for m in range(1, GEMV_MAX_M + 1))}


def matmul(x: torch.Tensor, qt) -> torch.Tensor:
    w = qt.data
    if not isinstance(w, torch.Tensor) or w.device != x.device:
        raise ValueError(f"x is on {x.device} but the fp16 weight is on {qt.device}; "
                         "move one with qt.to(device) or x.to(device)")
    if x.dtype != torch.float16:
        raise ValueError(f"x: dtype {x.dtype}, the CUDA kernels take float16 activations")
    if x.dim() < 1 or x.shape[-1] != w.shape[-1]:
        raise ValueError(f"x: shape {tuple(x.shape)}, the fp16 weight {tuple(w.shape)} expects K={w.shape[-1]}")
    return torch.nn.functional.linear(x, w)


def gemv_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether gemv serves this call (else cuBLAS): fp16 operands on one CUDA device, M <= GEMV_MAX_M,
    K % 8 == 0, N and K below 2^31 (the kernel's ints), contiguous 16-byte aligned rows, neither a
    lazily negated view (the kernel reads memory by address; cuBLAS through F.linear honours the
    negative bit, kernels.negated)."""
    return (x.is_cuda and w.is_cuda and x.device == w.device
            and x.dtype == torch.float16 and w.dtype == torch.float16
            and w.dim() == 2 and x.shape[-1] == w.shape[1] and w.shape[1] % 8 == 0
            and w.shape[0] < 2**31 and w.shape[1] < 2**31
            and 0 < x.numel() // w.shape[1] <= GEMV_MAX_M and x.is_contiguous() and w.is_contiguous()
            and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0 and not x.is_neg() and not w.is_neg())


@on_tensor_device
def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (..., K) fp16 with at most GEMV_MAX_M rows, w (N, K) fp16 -> (..., N), fp32 accumulation."""
    if not gemv_ok(x, w):
        raise ValueError(f"gemv: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}: needs fp16 "
                         f"contiguous CUDA tensors without the negative bit, K % 8 == 0, N and K below 2^31, "
                         f"16-byte alignment, <= {GEMV_MAX_M} rows")
    return _launch_gemv(x, w)


def _launch_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    m = x.numel() // k
    y = torch.empty((*x.shape[:-1], n), dtype=torch.float16, device=x.device)
    launch(get_kernel("fp16_gemv.cu", f"fp16_gemv<{m}>", SOURCES["fp16_gemv.cu"]),
           (math.ceil(n / GEMV_ROWS_PER_CTA),), (256,),
           (w.data_ptr(), x.data_ptr(), y.data_ptr(), np.int32(n), np.int32(k)))
    return y


@on_tensor_device
def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) for the runner: gemv at decode-sized M, cuBLAS otherwise; on x's device
    whatever device is current (F.linear follows its tensors itself; the gemv launch follows the
    current device, which on_tensor_device makes x's)."""
    return _launch_gemv(x, w) if gemv_ok(x, w) else torch.nn.functional.linear(x, w)
