"""A one-launch read of a buffer (cuda/stream_read.cu): a measured floor for an M = 1 matmul.

Any kernel that multiplies by a weight of B bytes must read them and store its output; `read`
does only that, so its time for B bytes, launched and timed like a matmul, is as fast as one
launch of an M = 1 kernel can be shown to go. `best_read_us` sweeps the launch shapes and keeps
the fastest; `quantzoo bench kernels` reports it beside every weight, and `quantzoo bench model`
decodes with every linear replaced by it (quantzoo/bench/model.py: ReadLinear).
"""
from __future__ import annotations

import numpy as np
import torch

from quantzoo.cuda_launch import get_kernel, launch, on_tensor_device, sm_count

THREADS = 512
# (blocks per SM, 16-byte loads per thread a trip, U): best_read_us times each. On the H100 the
# fastest was (2, 4) for most weight sizes of 2-200 MB, (4, 4), (4, 8) or (2, 8) for the others
# (bench/NOTES.md, session 27)
CONFIGS = ((1, 4), (1, 8), (2, 4), (2, 8), (4, 4), (4, 8))
DEFAULT = (2, 4)
MAX_BLOCKS = 1024   # grid cap (4 blocks on each of up to 256 SMs)
FOLD_WORDS = MAX_BLOCKS * THREADS // 32   # a fold buffer: one word per warp
SOURCES = {"stream_read.cu": tuple(f"stream_read<{u}>" for u in sorted({u for _, u in CONFIGS}))}


@on_tensor_device
def read(src: torch.Tensor, out: torch.Tensor | None = None, fold: torch.Tensor | None = None,
         config: tuple[int, int] = DEFAULT) -> int:
    """Read every byte of src (a contiguous CUDA tensor, 16-byte aligned, nbytes % 16 == 0) in one
    launch on torch's current stream; write zeros to out (any contiguous CUDA tensor whose
    nbytes % 16 == 0, or None). Warp w of block b stores the xor of the 32-bit words it read in
    fold[16 b + w] (an int32 CUDA tensor of at least FOLD_WORDS, or None: a scratch buffer of the
    device), so the xor of fold[:16 * blocks] is the xor of every word of src. Returns blocks,
    the grid size."""
    if not (isinstance(src, torch.Tensor) and src.is_cuda and src.is_contiguous()):
        raise ValueError("read: src must be a contiguous CUDA tensor")
    nbytes = src.numel() * src.element_size()
    if nbytes % 16 or src.data_ptr() % 16:
        raise ValueError(f"read: src must be 16-byte aligned with nbytes % 16 == 0, got {nbytes} bytes")
    if out is not None and not (isinstance(out, torch.Tensor) and out.is_cuda and out.is_contiguous()
                                and out.device == src.device and out.data_ptr() % 16 == 0
                                and (out.numel() * out.element_size()) % 16 == 0):
        raise ValueError("read: out must be a contiguous 16-byte aligned CUDA tensor on src's device, "
                         "nbytes % 16 == 0")
    if fold is None:
        fold = _scratch(src.device)
    elif not (isinstance(fold, torch.Tensor) and fold.is_cuda and fold.dtype == torch.int32
              and fold.numel() >= FOLD_WORDS and fold.is_contiguous() and fold.device == src.device):
        raise ValueError(f"read: fold must be a contiguous int32 CUDA tensor of >= {FOLD_WORDS} on src's device")
    config = tuple(config) if isinstance(config, (list, tuple)) else config
    if config not in CONFIGS:
        raise ValueError(f"read: config {config!r} is not one of {CONFIGS}")
    bps, u = config
    n16 = nbytes // 16
    blocks = max(1, min(sm_count(src.device) * bps, -(-n16 // (THREADS * u)), MAX_BLOCKS))
    n_out16 = 0 if out is None else out.numel() * out.element_size() // 16
    launch(get_kernel("stream_read.cu", f"stream_read<{u}>", SOURCES["stream_read.cu"]), (blocks,), (THREADS,),
           (src.data_ptr(), np.int64(n16), 0 if out is None else out.data_ptr(), np.int64(n_out16),
            fold.data_ptr()))
    return blocks


_SCRATCH: dict = {}


def _scratch(device) -> torch.Tensor:
    key = str(device)
    t = _SCRATCH.get(key)
    if t is None:
        t = _SCRATCH[key] = torch.zeros(FOLD_WORDS, dtype=torch.int32, device=device)
    return t


def best_read_us(nbytes: int, *, pdl: bool = False, target_s: float = 0.02, device=None) -> dict:
    """The fastest of CONFIGS reading nbytes (rounded up to 16) back to back over copies rotated
    past L2, each timed as `quantzoo bench kernels` times a matmul (bench.timing.benchmark: graph
    replays, median); pdl: inside programmatic_launches, as the runner's decode graph launches.
    Returns {"us", "config", "copies"}."""
    from quantzoo.bench import timing
    from quantzoo.cuda_launch import programmatic_launches

    nb = -(-int(nbytes) // 16) * 16
    copies = timing.rotation_copies(nb, l2_bytes=timing.l2_cache_bytes(device))
    bufs = [torch.empty(nb, dtype=torch.uint8, device=device or "cuda") for _ in range(copies)]
    best = None
    try:
        for cfg in CONFIGS:
            with programmatic_launches(pdl):
                r = timing.benchmark(lambda i: read(bufs[i], config=cfg), copies=copies, target_s=target_s)
            if best is None or r["median_us"] < best["us"]:
                best = {"us": r["median_us"], "config": list(cfg), "copies": copies}
    finally:
        del bufs
    return best
