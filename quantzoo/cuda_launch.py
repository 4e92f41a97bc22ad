"""Compile cuda/ sources with CuPy (NVRTC) once per process and launch on torch's stream.

Kernels take raw device pointers (torch's data_ptr(), passed as Python ints: CuPy hands an
8-byte integer to an 8-byte pointer parameter) and np.int32 scalars. Nothing here allocates:
outputs come from torch, so a launch can be captured in a CUDA graph.
"""
from __future__ import annotations

from functools import lru_cache
from importlib.resources import files


def source_dir():
    return files("quantzoo.cuda")


def read_source(name: str) -> str:
    return (source_dir() / name).read_text()


@lru_cache(maxsize=None)
def _module(source: str, name_expressions: tuple, options: tuple, arch: str):
    import cupy

    opts = ("-std=c++17", f"--gpu-architecture={arch}", f"-I{source_dir()}") + options
    return cupy.RawModule(code=read_source(source), options=opts, name_expressions=name_expressions)


def get_kernel(source: str, name: str, name_expressions: tuple = (), options: tuple = ()):
    """The compiled kernel `name` (a name expression for templates) from cuda/<source>."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    mod = _module(source, tuple(name_expressions) or (name,), tuple(options), f"sm_{major}{minor}")
    return mod.get_function(name)


@lru_cache(maxsize=64)
def _cupy_stream(ptr: int):
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    return from_external(ptr) if from_external else cupy.cuda.ExternalStream(ptr)


def launch(kernel, grid, block, args, shared_mem: int = 0) -> None:
    """Launch on torch's current stream (so graph capture and stream semantics hold)."""
    import torch

    with _cupy_stream(torch.cuda.current_stream().cuda_stream):
        kernel(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem)
