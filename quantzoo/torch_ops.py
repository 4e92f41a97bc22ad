"""quantzoo's matmuls as torch custom operators, so that torch.compile traces through them.

torch.compile cannot look inside a CuPy launch (or the numpy reference): a plain Python call
there is a graph break, and `fullgraph=True` fails on it. Registered with `torch.library`, each
matmul is one opaque node with a fake (meta) implementation that gives the output's shape and
dtype, so a model of QuantLinear layers compiles whole, and a CUDA-graph mode
(`mode="reduce-overhead"`) captures the kernels, which launch on torch's current stream and
allocate through torch only.

- `torch.ops.quantzoo.qmatmul(x, weight, mode)`: x @ W.T for a registered QuantizedTensor
  (`weight` is the int `register(qt)` returned: a QuantizedTensor is no tensor, and passing its
  storage instead would rebuild it, and re-run its checks, on every call). QuantLinear.forward
  goes through it while torch.compile traces, and calls quantzoo.ops.matmul directly otherwise
  (no dispatcher cost in eager mode).
- Inside the ops the kernels' workspaces are allocated per call (a split-K partial buffer, tile
  counters zeroed by a memset, Q8_1 activations) and launch plans are off
  (cuda_launch.fresh_workspaces): torch's CUDA graphs allocate from a pool of their own, in
  which a cached buffer would be refused. Outside a CUDA graph that costs host time and a memset
  per call; inside one, nothing.
- `torch.ops.quantzoo.awq_gemm(x, qweight, scales, qzeros, group_size)`: the vLLM-style AWQ GEMM
  on its tensors (CUDA); quantzoo.ops.awq_gemm calls it while tracing.

Inference only, as the functions they wrap: no autograd formula is registered.
"""
from __future__ import annotations

import itertools
import weakref

import torch

_WEIGHTS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)


def register(qt) -> int:
    """The key torch.ops.quantzoo.qmatmul takes for qt: the same one while qt lives (kept on qt;
    the registry holds qt weakly)."""
    key = qt.__dict__.get("_torch_op_key")
    if key is None:
        key = next(_NEXT)
        _WEIGHTS[key] = qt
        object.__setattr__(qt, "_torch_op_key", key)   # (a frozen dataclass: no field, no eq part)
    return key


def _weight(key: int):
    qt = _WEIGHTS.get(key)
    if qt is None:
        raise ValueError(f"weight={key}: no live QuantizedTensor is registered under this key "
                         "(quantzoo.torch_ops.register(qt) gives one)")
    return qt


@torch.library.custom_op("quantzoo::qmatmul", mutates_args=())
def qmatmul(x: torch.Tensor, weight: int, mode: str = "emulate") -> torch.Tensor:
    from . import ops
    from .cuda_launch import fresh_workspaces

    if not x.is_cuda:
        return ops.matmul(x, _weight(weight), mode=mode)
    with fresh_workspaces():   # (torch.compile's CUDA graphs: see cuda_launch.fresh_workspaces)
        return ops.matmul(x, _weight(weight), mode=mode)


@qmatmul.register_fake
def _(x, weight, mode="emulate"):
    n, k = _weight(weight).shape
    if x.shape[-1] != k:
        raise ValueError(f"x: last dimension is {x.shape[-1]}, the weight {(n, k)} expects K={k}")
    return x.new_empty((*x.shape[:-1], n))


@torch.library.custom_op("quantzoo::awq_gemm", mutates_args=())
def awq_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
             group_size: int) -> torch.Tensor:
    from quantzoo.cuda_launch import fresh_workspaces
    from quantzoo.kernels import awq

    with fresh_workspaces():
        return awq.gemm(x, qweight, scales, qzeros, group_size)


@awq_gemm.register_fake
def _(x, qweight, scales, qzeros, group_size):
    return x.new_empty((*x.shape[:-1], scales.shape[-1]), dtype=torch.float16)
