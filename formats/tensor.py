"""QuantizedTensor: a weight in a format's native storage, on CPU (numpy) or CUDA (torch)."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .base import is_array


def _move(arr: Any, device: str, key: str) -> Any:
    import torch

    if not is_array(arr):
        raise ValueError(f"storage entry {key} is {type(arr).__name__}, not an array")
    if device == "cpu":
        if isinstance(arr, torch.Tensor):
            return arr.detach().cpu().numpy()
        return arr
    if not isinstance(arr, torch.Tensor):
        with warnings.catch_warnings():  # a read-only (memory-mapped) array: .to() copies it,
            warnings.simplefilter("ignore", UserWarning)  # nothing ever writes through this view
            arr = torch.from_numpy(np.ascontiguousarray(arr))
    return arr.to(device).contiguous()


@dataclass(frozen=True, eq=False)   # (== and hash by identity: fields hold arrays)
class QuantizedTensor:
    """A 2-D weight (out_features, in_features) stored as its format stores it.

    `data` is a uint8 array (N, K/32*bytes) in .gguf file order for GGUF formats, a dict
    {qweight, qzeros, scales} in the HF AWQ layout for AWQ, a float16 (N, K) array for fp16.
    On CPU the storage is numpy; after `.to("cuda")` it is torch CUDA tensors, same layout.
    `params` holds the format's options (AWQ: {"group_size": G}; GGUF and fp16: none).

    Made by Format.quantize (or from stored bytes: from_bytes of a GGUF format, awq's
    from_arrays), not usually by hand: the constructor checks nothing; Format.check, which
    ops.matmul, QuantLinear and dequantize run, names what disagrees. Frozen; == and hash are by
    identity.
    """

    format: str
    shape: tuple[int, int]
    data: Any
    params: dict = field(default_factory=dict)  # format options, e.g. {"group_size": 128}

    def __post_init__(self):
        # numpy integers (gguf.GGUFReader's uint64 shapes, a group size read with numpy) become
        # ints, which the rest take: the operator's JSON layout, the fake kernel's n and k under
        # torch.compile, state_dict under torch.load(weights_only=True). Nothing else is changed:
        # Format.check names what is wrong
        if isinstance(self.shape, tuple) and any(isinstance(d, np.integer) for d in self.shape):
            object.__setattr__(self, "shape", tuple(int(d) if isinstance(d, np.integer) else d for d in self.shape))
        if isinstance(self.params, dict) and any(isinstance(v, np.integer) for v in self.params.values()):
            object.__setattr__(self, "params", {k: int(v) if isinstance(v, np.integer) else v
                                                for k, v in self.params.items()})

    @property
    def fmt(self):
        """The registry's Format of this weight (formats.get(self.format): KeyError if unknown)."""
        from . import get

        return get(self.format)

    @property
    def group_size(self) -> int | None:
        """params["group_size"] (AWQ), else None."""
        return self.params.get("group_size")

    def arrays(self) -> dict:
        """The storage as {name: array}: data itself for AWQ's dict, else {"data": data}."""
        return self.data if isinstance(self.data, dict) else {"data": self.data}

    @property
    def device(self) -> str:
        """Where the storage is: "cpu" for numpy arrays, else the torch tensors' device as str
        ("cuda:0", "meta", ...)."""
        arr = next(iter(self.arrays().values()), None)
        dev = getattr(arr, "device", None)
        return "cpu" if dev is None else str(dev)

    @property
    def nbytes(self) -> int:
        """Bytes of the storage arrays (scales, zeros and mins counted); ValueError if an entry is
        not an array."""
        total = 0
        for key, a in self.arrays().items():
            if not is_array(a):
                raise ValueError(f"{self.format} weight {self.shape}: storage entry {key} is "
                                 f"{type(a).__name__}, not an array")
            total += int(a.nbytes) if isinstance(a, np.ndarray) else a.numel() * a.element_size()
        return total

    def to(self, device) -> "QuantizedTensor":
        """A QuantizedTensor with the same format, shape and params and its storage on `device` (a
        str or torch.device): "cpu" gives numpy arrays, anything else contiguous torch tensors there
        ("cuda", "cuda:1", "meta"). Storage already there is shared, not copied; self is unchanged.
        ValueError where torch cannot place it (no CUDA build or GPU, an unknown device name) or an
        entry is not an array."""
        device = str(device)
        try:
            if isinstance(self.data, dict):
                data = {k: _move(v, device, k) for k, v in self.data.items()}
            else:
                data = _move(self.data, device, "data")
        except (AssertionError, RuntimeError, ValueError) as e:   # torch: no CUDA build / device, a bad name
            raise ValueError(f"QuantizedTensor.to({device!r}): {e}") from None
        return replace(self, data=data)

    def numpy(self) -> "QuantizedTensor":
        """self.to("cpu"): the storage as numpy arrays."""
        return self.to("cpu")

    def dequantize(self) -> np.ndarray:
        """self.fmt.dequantize(self): the float32 numpy weight (out_features, in_features), from any
        device; ValueError if the storage disagrees with shape and params (Format.check)."""
        return self.fmt.dequantize(self)

    def __repr__(self) -> str:
        # never raises, whatever a hand-built tensor holds (a repr is what one prints to debug it)
        def attempt(get):
            try:
                return get()
            except Exception:   # noqa: BLE001  (a broken storage entry: shown as '?')
                return "?"

        return (f"QuantizedTensor(format={self.format!r}, shape={self.shape!r}, "
                f"params={self.params!r}, device={attempt(lambda: self.device)!r}, "
                f"nbytes={attempt(lambda: self.nbytes)})")
