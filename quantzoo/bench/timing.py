"""Timing helpers shared by `quantzoo bench kernels` and `quantzoo bench model`.

How a GPU time is taken here (DESIGN.md §6, "Benchmarks are not tests"):

- CUDA events around the timed region, never the host clock: launches are asynchronous.
- Warm-up excluded: the first calls compile kernels (CuPy/NVRTC), create cuBLAS handles and
  fill the allocator; they are run and thrown away before anything is timed.
- Many launches per measurement, captured in a CUDA graph and replayed: an eager CuPy launch
  from Python costs ~16 us on the H100, more than a 4-bit GEMV over a 4096x4096 weight takes
  (~3 us), so eager timing would measure Python. Replaying a graph of back-to-back launches
  measures the GPU. If a callable cannot be captured we fall back to eager launches and say so
  (`timing: "eager"` in the record).
- Weights rotated across copies: the H100 has a 50 MB L2, so a 9 MB weight reused every call is
  served from L2 and "beats" DRAM bandwidth. Each launch in a graph reads the next of enough
  copies that together they exceed a few times the L2 (`rotation_copies`).
- The median of many replays (per launch), with the 10th/90th percentiles kept to show spread.
- Ceilings measured in the same run, on the same card: device-to-device copy bandwidth
  (bytes read + bytes written, as DESIGN.md's 2.99 TB/s) and cuBLAS fp16 TFLOP/s on a large
  square product. Every speed in the bench is quoted against these two numbers.
"""
from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import statistics
import subprocess
from typing import Callable

# H100 SXM: rotation_copies' default, and l2_cache_bytes' where the device does not say
DEFAULT_L2_BYTES = 50 * 1024 * 1024


# --------------------------------------------------------------------------------------------
# statistics


def summarize(samples_s: list[float]) -> dict:
    """Median and 10th/90th percentiles, in microseconds, of per-launch times in seconds."""
    if not samples_s:
        raise ValueError("samples_s: no samples to summarize")
    xs = sorted(samples_s)

    def pct(p):
        if len(xs) == 1:
            return xs[0]
        pos = p * (len(xs) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"median_us": 1e6 * statistics.median(xs), "p10_us": 1e6 * pct(0.1),
            "p90_us": 1e6 * pct(0.9), "samples": len(xs)}


def rotation_copies(nbytes: int, *, l2_bytes: int | None = None, factor: float = 4.0,
                    max_copies: int = 4096) -> int:
    """How many copies of an `nbytes` buffer to cycle through so L2 cannot serve them.

    Enough that the copies together exceed `factor` x L2 (each copy is evicted before it comes
    round again under LRU-like replacement), at least 2, at most `max_copies`. The cap binds only
    below factor x L2 / max_copies bytes (51 KB on the H100): a cap of 128 let the weights of a
    SmolLM2-sized `--shape` (576 -> 192 q4_0, 62 KB: 8 MB in 128 copies) sit in the 50 MB L2.
    """
    if nbytes <= 0:
        raise ValueError(f"nbytes={nbytes}: must be positive")
    l2 = l2_bytes or DEFAULT_L2_BYTES
    return int(min(max_copies, max(2, math.ceil(factor * l2 / nbytes))))


def l2_cache_bytes(device=None) -> int:
    import torch

    props = torch.cuda.get_device_properties(device or torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)


# --------------------------------------------------------------------------------------------
# timing


def time_eager(fn: Callable[[int], object], *, inner: int, reps: int, warmup: int = 2) -> list[float]:
    """Per-launch seconds of `fn(i)` for i in 0..inner-1, launched eagerly; one sample per batch."""
    import torch

    for _ in range(warmup):
        for i in range(inner):
            fn(i)
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(inner):
            fn(i)
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e-3 / inner)
    return out


def capture_graph(fn: Callable[[int], object], inner: int):
    """A CUDA graph of fn(0), fn(1), ..., fn(inner-1) back to back (outputs dropped)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on a side stream, as torch's graph docs ask
        for i in range(min(inner, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):   # (torch's default capture stream may be another GPU's)
        for i in range(inner):
            fn(i)
    torch.cuda.synchronize()
    return g


def time_graph(graph, *, inner: int, reps: int, warmup: int = 2) -> list[float]:
    """Per-launch seconds: each replay of a graph of `inner` launches, divided by `inner`."""
    import torch

    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e-3 / inner)
    return out


def estimate_seconds(fn: Callable[[int], object], n: int = 3) -> float:
    """A rough per-call time (eager, after one warm-up call) used to size the real timing."""
    import torch

    fn(0)
    torch.cuda.synchronize()
    return max(time_eager(fn, inner=n, reps=1, warmup=0)[0], 1e-7)


def benchmark(fn: Callable[[int], object], *, copies: int = 1, target_s: float = 0.05,
              min_inner: int = 8, max_inner: int = 256, min_reps: int = 5, max_reps: int = 50,
              use_graph: bool = True) -> dict:
    """Time fn(i) (i = which rotated copy to use, i % copies) and return summarize() + how.

    The graph holds `inner` launches: at least one pass over every copy and at least
    `min_inner`; `reps` replays are timed so the timed part takes about `target_s`.
    """
    import torch

    est = estimate_seconds(lambda i: fn(i % copies))
    inner = max(min_inner, copies)
    inner = min(max(inner, math.ceil(2e-4 / est)), max(max_inner, copies))  # >= ~0.2 ms a replay
    reps = int(min(max_reps, max(min_reps, target_s / (est * inner))))
    how = "graph"
    samples = None
    if use_graph:
        try:
            g = capture_graph(lambda i: fn(i % copies), inner)
            samples = time_graph(g, inner=inner, reps=reps)
            del g
        except Exception as e:  # noqa: BLE001 - fall back, but say why
            torch.cuda.synchronize()
            how = f"eager (graph capture failed: {type(e).__name__}: {str(e)[:120]})"
    else:
        how = "eager"
    if samples is None:
        samples = time_eager(lambda i: fn(i % copies), inner=inner, reps=reps)
    rec = summarize(samples)
    rec.update(timing=how, inner=inner, reps=reps, copies=copies)
    return rec


# --------------------------------------------------------------------------------------------
# ceilings


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 20, warmup_s: float = 0.1) -> dict:
    """Device-to-device copy of `nbytes` (torch copy_), bytes read + written per second.

    Eager copies with events around each one, after `warmup_s` seconds of the same copy (clocks
    settle). Deliberately not inside a CUDA graph: a captured memcpy node of >= 1 GiB ran at 2.71
    TB/s on an H200 where the eager copy (and an elementwise kernel, captured or not) ran at 4.2
    (bench/notes-gguf.md, "copy bandwidth")."""
    import time

    import torch

    n = nbytes // 2
    src = torch.randn(n, device="cuda", dtype=torch.float32).to(torch.float16)
    dst = torch.empty_like(src)
    t_end = time.perf_counter() + warmup_s
    while time.perf_counter() < t_end:
        dst.copy_(src)
        torch.cuda.synchronize()
    samples = time_eager(lambda i: dst.copy_(src), inner=1, reps=reps, warmup=3)
    t = statistics.median(samples)
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    torch.cuda.empty_cache()
    return {"copy_tbps": moved / t / 1e12, "copy_bytes": moved, "copy_median_us": t * 1e6,
            "copy_reps": reps}


def cublas_fp16(size: int = 8192, reps: int = 20) -> dict:
    """cuBLAS fp16 (fp32 accumulate) size^3 matrix product through torch.mm, TFLOP/s."""
    import torch

    a = torch.randn(size, size, device="cuda", dtype=torch.float16)
    b = torch.randn(size, size, device="cuda", dtype=torch.float16)
    c = torch.empty(size, size, device="cuda", dtype=torch.float16)
    samples = time_eager(lambda i: torch.mm(a, b, out=c), inner=1, reps=reps, warmup=3)
    t = statistics.median(samples)
    del a, b, c
    torch.cuda.empty_cache()
    return {"cublas_fp16_tflops": 2 * size ** 3 / t / 1e12, "cublas_size": size,
            "cublas_median_us": t * 1e6, "cublas_reps": reps}


def ceilings(copy_bytes: int = 1 << 30, gemm_size: int = 8192, reps: int = 20) -> dict:
    out = copy_bandwidth(copy_bytes, reps)
    out.update(cublas_fp16(gemm_size, reps))
    return out


# --------------------------------------------------------------------------------------------
# machine info


def git_commit(cwd: str | None = None) -> str | None:
    """HEAD of the checkout quantzoo runs from (+ '-dirty' when tracked files differ)."""
    cwd = cwd or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _nvidia_smi() -> dict:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,"
                            "clocks.max.sm,power.limit", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return {}
    if r.returncode != 0 or not r.stdout.strip():
        return {}
    f = [s.strip() for s in r.stdout.strip().splitlines()[0].split(",")]
    keys = ["gpu_name_smi", "driver", "sm_clock", "mem_clock", "max_sm_clock", "power_limit"]
    return dict(zip(keys, f))


def machine_info() -> dict:
    """GPU name, driver, library versions, git commit, time: what a bench result was made on."""
    import numpy
    import torch

    import quantzoo

    info = {
        "time_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": platform.node(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "torch": torch.__version__,
        "quantzoo": quantzoo.__version__,
        "git_commit": git_commit(),
        "cuda_available": bool(torch.cuda.is_available()),
    }
    try:
        from quantzoo.cuda_launch import import_cupy  # past the repo's own cuda/ folder

        info["cupy"] = import_cupy().__version__
    except Exception as e:  # noqa: BLE001 - CuPy is optional; say why it is missing
        info["cupy"] = None
        info["cupy_error"] = f"{type(e).__name__}: {e}"[:200]
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(gpu=p.name, compute_capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                    gpu_memory_gib=round(p.total_memory / 2 ** 30, 1), l2_bytes=l2_cache_bytes(),
                    torch_cuda=torch.version.cuda)
        info.update(_nvidia_smi())
        info.pop("gpu_name_smi", None)
    else:
        info.update(gpu=None, cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count())
    return info
