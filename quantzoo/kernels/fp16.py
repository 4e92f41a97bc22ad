"""fp16 baseline on GPU: cuBLAS through torch (what every format is measured against)."""
import torch


def matmul(x: torch.Tensor, qt) -> torch.Tensor:
    if x.dtype != torch.float16:
        raise ValueError(f"x: dtype {x.dtype}, the CUDA kernels take float16 activations")
    return torch.nn.functional.linear(x, qt.data)
