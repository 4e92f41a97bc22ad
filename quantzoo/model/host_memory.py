"""Whether a model fits in host memory before the CPU runner places it there.

On the CPU the runner computes in float32: matmul_mode "cached" dequantizes every quantized
linear once and keeps it (4 bytes a weight: the 7.6e9 linear weights of a 4.7 GB Qwen3-8B Q4_0
file become 28 GiB), and fp16 / bf16 tensors are copied to float32. Past the memory there is,
the kernel's OOM killer ends the process mid-load with no message; `check_cpu_placement`
refuses first, in one line, naming the sizes and the mode that needs less. The KV cache (sized
on demand by the prompt) is not counted.
"""
from __future__ import annotations

import os

import numpy as np

from ..formats import QuantizedTensor

# A codec's dequantize peaks at ~2.6x its float32 output (numpy temporaries; measured with
# tracemalloc: q4_0 / q8_0 2.55, q4_1 2.59, awq 2.26): at load ("cached") or at every call
# ("dequant") the largest weight's dequantization needs that much beside what is held.
DEQUANT_PEAK = 2.6


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _stat(path: str, key: str) -> int | None:
    """The number after `key` in a file of "key value" lines, or None (no file, no such key)."""
    for line in (_read(path) or "").splitlines():
        fields = line.split()   # "inactive_file 123" (memory.stat), "MemAvailable:  123 kB" (meminfo)
        if len(fields) >= 2 and fields[0] == key:
            return int(fields[1])
    return None


def cgroup_headroom(root: str = "/") -> int | None:
    """Bytes the process's memory cgroups (v1 or v2, each level up to the root) still allow:
    the smallest limit - (usage - inactive file pages, which the kernel reclaims first; a GGUF
    just read through mmap sits there), or None where no level sets a limit."""
    best = None
    for line in (_read(os.path.join(root, "proc/self/cgroup")) or "").splitlines():
        hid, ctrls, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and ctrls == "":   # v2
            base, lim, use, inactive = "sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"
        elif "memory" in ctrls.split(","):   # v1
            base, lim, use, inactive = "sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes", \
                "total_inactive_file"
        else:
            continue
        parts = [p for p in path.strip().split("/") if p]
        for depth in range(len(parts), -1, -1):
            d = os.path.join(root, base, *parts[:depth])
            limit, usage = _read(os.path.join(d, lim)), _read(os.path.join(d, use))
            try:
                limit, usage = int(limit), int(usage)
            except (TypeError, ValueError):   # "max", or no such level (namespaced)
                continue
            if limit >= 2**60:   # v1's "no limit"
                continue
            head = limit - max(0, usage - (_stat(os.path.join(d, "memory.stat"), inactive) or 0))
            best = head if best is None else min(best, head)
    return best


def available_bytes() -> int | None:
    """Bytes the process can still allocate: /proc/meminfo's MemAvailable, capped by its memory
    cgroups' headroom; None where neither is readable (not Linux: the check is then skipped)."""
    kib = _stat("/proc/meminfo", "MemAvailable:")
    found = [b for b in (None if kib is None else 1024 * kib, cgroup_headroom()) if b is not None]
    return min(found) if found else None


def cpu_placement_bytes(tensors, matmul_mode: str) -> tuple[int, int]:
    """(held, transient) bytes of placing `tensors` on the CPU: (weight, role) pairs, role
    "lookup" for the embedding table, "linear" for a linear (a tied lm_head is the table again),
    "fused" for the parts of a fused linear (Layer's fuse=True: concatenated first, a new copy).
    held: a float32 copy of every float tensor not float32 already (and of every fused float),
    of every quantized weight a linear keeps dequantized ("cached"), of an AWQ table (a block
    table is looked up row by row, packed), and the packed bytes of a fused quantized weight kept
    packed; transient: the largest dequantization's peak beside them (DEQUANT_PEAK)."""
    held = largest = 0
    for w, role in tensors:
        f32 = 4 * int(np.prod(w.shape))
        if isinstance(w, QuantizedTensor):
            if role == "lookup" and not isinstance(w.data, dict):   # a block table: rows read packed
                continue
            largest = max(largest, f32)
            if role == "lookup" or matmul_mode == "cached":
                held += f32
            elif role == "fused":   # the concatenation, kept packed (dequantized per call)
                held += w.nbytes
        elif role == "fused" or str(getattr(w, "dtype", "float32")).rsplit(".", 1)[-1] != "float32":
            held += f32
    transient = int((DEQUANT_PEAK - 1) * largest) if matmul_mode == "cached" else int(DEQUANT_PEAK * largest)
    return held, transient


def free_bytes(device) -> int | None:
    """Bytes a new tensor may still take on `device`: a GPU's free memory plus what torch's caching
    allocator holds unused there; the host's available memory (available_bytes); None elsewhere."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        held = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + held
    return available_bytes() if device.type == "cpu" else None


def check_cache_fits(nbytes: int, positions: int, device) -> None:
    """MemoryError, in one line, where a KV cache of nbytes (for `positions` tokens) would not fit
    in the memory left on `device` (the CPU's available memory; a GPU's free memory plus what
    torch's allocator holds unused) instead of the allocator's traceback, or the OOM killer."""
    avail = free_bytes(device)
    if avail is not None and nbytes > avail:
        raise MemoryError(f"a KV cache for {positions} positions takes {_size(nbytes)}; {_size(max(avail, 0))} "
                          f"of memory is available on {device} (ask for fewer tokens: a shorter prompt or "
                          "max_new_tokens, CLI --max-new-tokens)")


def check_cpu_placement(tensors, matmul_mode: str) -> None:
    """MemoryError, in one line, where placing `tensors` (cpu_placement_bytes' pairs) on the CPU
    needs more memory than is available."""
    held, transient = cpu_placement_bytes(tensors, matmul_mode)
    avail = available_bytes()
    if avail is None or held + transient <= avail:
        return
    hint = ("matmul_mode='dequant' (CLI --matmul-mode dequant: each linear dequantized per call, "
            "slower) or a GPU" if matmul_mode == "cached" and transient else "a GPU")
    raise MemoryError(f"the model takes {_size(held)} of float32 on the CPU (matmul_mode={matmul_mode!r}) "
                      f"and {_size(transient)} more while dequantizing its largest weight; "
                      f"{_size(max(avail, 0))} of memory is available; use {hint}")
