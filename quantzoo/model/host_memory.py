"""Whether a model fits in host memory before the CPU runner places it there.

On the CPU the runner computes in float32: matmul_mode "cached" dequantizes every quantized
linear once and keeps it (4 bytes a weight: the 7.6e9 linear weights of a 4.7 GB Qwen3-8B Q4_0
file become 28 GiB), and fp16 / bf16 tensors are copied to float32. Past the memory there is,
the kernel's OOM killer ends the process mid-load with no message; `check_cpu_placement`
refuses first, in one line, naming the sizes and the modes that need less.
"""
from __future__ import annotations

import numpy as np

from ..formats import QuantizedTensor


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def available_bytes() -> int | None:
    """Bytes the process can still allocate: /proc/meminfo's MemAvailable, capped by a cgroup v2
    memory limit (a container's); None where neither is readable (not Linux)."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                found.append(int(limit) - int(f.read()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def cpu_placement_bytes(tensors, matmul_mode: str) -> int:
    """Bytes that placing `tensors` -- (weight, looked_up) pairs, looked_up for the embedding
    table's lookup, False for a linear (a tied lm_head is the table again) -- on the CPU
    allocates: a float32 copy of every float tensor not float32 already, and of a quantized one
    that a linear keeps dequantized ("cached" mode) or an AWQ table (a block-format table is
    looked up row by row, packed)."""
    total = 0
    for w, looked_up in tensors:
        if isinstance(w, QuantizedTensor):
            copied = isinstance(w.data, dict) if looked_up else matmul_mode == "cached"
        else:
            copied = str(getattr(w, "dtype", "float32")).rsplit(".", 1)[-1] != "float32"
        total += 4 * int(np.prod(w.shape)) if copied else 0
    return total


def check_cpu_placement(tensors, matmul_mode: str) -> None:
    """MemoryError, in one line, where placing `tensors` (cpu_placement_bytes' pairs) on the CPU
    needs more memory than is available."""
    need = cpu_placement_bytes(tensors, matmul_mode)
    avail = available_bytes()
    if avail is None or need <= avail:
        return
    hint = ("matmul_mode='dequant' (CLI --matmul-mode dequant: each linear dequantized per call, "
            "slower) or a GPU" if matmul_mode == "cached" else "a GPU")
    raise MemoryError(f"the model takes {_size(need)} of float32 on the CPU (matmul_mode={matmul_mode!r}), "
                      f"{_size(max(avail, 0))} of memory is available; use {hint}")
