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
- On a stream other than the default one, the ops allocate the kernels' workspaces per call (a
  split-K partial buffer, tile counters zeroed by a memset, Q8_1 activations) and leave launch
  plans off (cuda_launch.fresh_workspaces): torch.compile's CUDA graphs warm up and record on a
  stream of their own, allocating from a pool of their own, in which a cached buffer would be
  refused ("tensor(s) in the cudagraph pool not tracked as outputs"). Captured, that costs
  nothing; run eagerly on a side stream it costs host time and a memset per call.
- `torch.ops.quantzoo.awq_gemm(x, qweight, scales, qzeros, group_size)`: the vLLM-style AWQ GEMM
  on its tensors (CUDA); quantzoo.ops.awq_gemm calls it while tracing.

Inference only, as the functions they wrap: no autograd formula is registered.

Compile the model (or a stack of layers) as one: each QuantLinear's key is a constant of the
traced graph, so compiling identical blocks one by one (`block.compile()` per layer) traces each
block anew, and past torch._dynamo's recompile limit (8) the rest run eagerly, with torch's
warning.
"""
from __future__ import annotations

import itertools
import weakref

import torch

_WEIGHTS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_KEYS: dict = {}   # id(qt) -> its key, while qt lives (a copy of qt is another object, another key)
_NEXT = itertools.count(1)


def register(qt) -> int:
    """The key torch.ops.quantzoo.qmatmul takes for qt: the same one while qt lives (the registry
    holds qt weakly)."""
    key = _KEYS.get(id(qt))
    if key is None:
        key = next(_NEXT)
        _WEIGHTS[key] = qt
        _KEYS[id(qt)] = key
        weakref.finalize(qt, _KEYS.pop, id(qt), None)
    return key


def _on_cuda_graph_stream(x, call):
    """call(), with the kernels' workspaces per call and launch plans off where torch.compile's
    CUDA graphs may be warming up or recording: on any stream but the device's default one (they
    run on a stream of their own, allocating from their pool). On the default stream (eager
    torch, and compiled code without CUDA graphs) the cached workspaces and plans stay on."""
    if not x.is_cuda or torch._C._cuda_getCurrentRawStream(x.device.index) == 0:   # (0: the default)
        return call()
    from .cuda_launch import fresh_workspaces

    with fresh_workspaces():
        return call()


def _weight(key: int):
    qt = _WEIGHTS.get(key)
    if qt is None:
        raise ValueError(f"weight={key}: no live QuantizedTensor is registered under this key "
                         "(quantzoo.torch_ops.register(qt) gives one)")
    return qt


def _qmatmul(x: torch.Tensor, weight: int, mode: str = "emulate") -> torch.Tensor:
    from . import ops

    qt = _weight(weight)
    return _on_cuda_graph_stream(x, lambda: ops.matmul(x, qt, mode=mode))


def _qmatmul_fake(x, weight, mode="emulate"):
    n, k = _weight(weight).shape
    if x.shape[-1] != k:
        raise ValueError(f"x: last dimension is {x.shape[-1]}, the weight {(n, k)} expects K={k}")
    return x.new_empty((*x.shape[:-1], n))


def _awq_gemm(x, qweight, scales, qzeros, group_size=None):
    from quantzoo.kernels import awq

    return _on_cuda_graph_stream(x, lambda: awq.gemm(x, qweight, scales, qzeros, group_size))


def _awq_gemm_fake(x, qweight, scales, qzeros, group_size=None):
    return x.new_empty((*x.shape[:-1], scales.shape[-1]), dtype=torch.float16)


# Defined on the dispatcher directly (torch.library.Library): torch.library.custom_op's Python
# layers cost ~25 us more per call on this project's CPU host (46 against 19 over the call
# itself). The one kernel for every backend (CompositeExplicitAutograd) is quantzoo's own
# dispatch by device; with autograd on, an x that requires grad is refused by name there
# (ops.matmul), as in eager mode.
_LIB = torch.library.Library("quantzoo", "DEF")
_LIB.define("qmatmul(Tensor x, int weight, str mode='emulate') -> Tensor")
_LIB.impl("qmatmul", _qmatmul, "CompositeExplicitAutograd")
torch.library.register_fake("quantzoo::qmatmul", _qmatmul_fake, lib=_LIB)
_LIB.define("awq_gemm(Tensor x, Tensor qweight, Tensor scales, Tensor qzeros, int? group_size=None) -> Tensor")
_LIB.impl("awq_gemm", _awq_gemm, "CompositeExplicitAutograd")
torch.library.register_fake("quantzoo::awq_gemm", _awq_gemm_fake, lib=_LIB)
