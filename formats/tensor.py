"""QuantizedTensor: a weight in a format's native storage, on CPU (numpy) or CUDA (torch)."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np


def _move(arr: Any, device: str) -> Any:
    import torch

    if device == "cpu":
        if isinstance(arr, torch.Tensor):
            return arr.detach().cpu().numpy()
        return arr
    if not isinstance(arr, torch.Tensor):
        with warnings.catch_warnings():  # a read-only (memory-mapped) array: .to() copies it,
            warnings.simplefilter("ignore", UserWarning)  # nothing ever writes through this view
            arr = torch.from_numpy(np.ascontiguousarray(arr))
    return arr.to(device).contiguous()


@dataclass(frozen=True)
class QuantizedTensor:
    """A 2-D weight (out_features, in_features) stored as its format stores it.

    `data` is a uint8 array (N, K/32*bytes) in .gguf file order for GGUF formats, a dict
    {qweight, qzeros, scales} in the HF AWQ layout for AWQ, a float16 (N, K) array for fp16.
    On CPU the storage is numpy; after `.to("cuda")` it is torch CUDA tensors, same layout.
    """

    format: str
    shape: tuple[int, int]
    data: Any
    params: dict = field(default_factory=dict)  # format options, e.g. {"group_size": 128}

    @property
    def fmt(self):
        from . import get

        return get(self.format)

    @property
    def group_size(self) -> int | None:
        return self.params.get("group_size")

    def arrays(self) -> dict:
        return self.data if isinstance(self.data, dict) else {"data": self.data}

    @property
    def device(self) -> str:
        arr = next(iter(self.arrays().values()))
        dev = getattr(arr, "device", None)
        return "cpu" if dev is None else str(dev)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) if hasattr(a, "nbytes") else a.numel() * a.element_size()
                   for a in self.arrays().values())

    def to(self, device) -> "QuantizedTensor":
        device = str(device)
        try:
            if isinstance(self.data, dict):
                data = {k: _move(v, device) for k, v in self.data.items()}
            else:
                data = _move(self.data, device)
        except (AssertionError, RuntimeError) as e:   # torch: no CUDA build / device, a bad name
            raise ValueError(f"QuantizedTensor.to({device!r}): {e}") from None
        return replace(self, data=data)

    def numpy(self) -> "QuantizedTensor":
        return self.to("cpu")

    def dequantize(self) -> np.ndarray:
        return self.fmt.dequantize(self)

    def __repr__(self) -> str:
        return (f"QuantizedTensor(format={self.format!r}, shape={self.shape}, "
                f"params={self.params}, device={self.device!r}, nbytes={self.nbytes})")
