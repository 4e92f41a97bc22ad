"""QuantLinear: a torch.nn.Module computing x @ W.T (+ bias) through quantzoo.ops."""
from __future__ import annotations

import torch

from . import ops
from .formats import QuantizedTensor, get


class QuantLinear(torch.nn.Module):
    def __init__(self, qt: QuantizedTensor, bias: torch.Tensor | None = None, mode: str = "emulate"):
        super().__init__()
        if not isinstance(qt, QuantizedTensor):
            raise ValueError(f"qt: expected a QuantizedTensor, got {type(qt).__name__}")
        if mode not in ops.MODES:
            raise ValueError(f"mode={mode!r}: choose one of {ops.MODES}")
        self.qt = qt
        self.mode = mode
        self.out_features, self.in_features = qt.shape
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (self.out_features,)):
            raise ValueError(f"bias: expected a torch tensor of shape ({self.out_features},), got "
                             f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, fmt: str, **opts) -> "QuantLinear":
        qt = get(fmt).quantize(linear.weight.detach().float().cpu().numpy(), **opts)
        ql = cls(qt, linear.bias)
        return ql.to(linear.weight.device)

    def _apply(self, fn, *args, **kw):
        dev = fn(torch.empty(0)).device  # where .to()/.cuda()/.cpu() sends tensors
        if not ops._same_device(str(dev), self.qt.device):
            self.qt = self.qt.to(str(dev))
        return super()._apply(fn, *args, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.matmul(x, self.qt, mode=self.mode)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.qt.format}, params={self.qt.params}")
