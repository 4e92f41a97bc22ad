"""quantzoo's matmuls as torch operators, so that torch.compile traces through them.

torch.compile cannot look inside a CuPy launch (or the numpy reference): a plain Python call
there is a graph break, and `fullgraph=True` fails on it. Defined as operators with fake (meta)
implementations that give the output's shape and dtype, each matmul is one opaque node, so a
model of QuantLinear layers compiles whole, and a CUDA-graph mode (`mode="reduce-overhead"`)
captures the kernels, which launch on torch's current stream and allocate through torch only.

- `torch.ops.quantzoo.qmatmul(x, storage, format, n, k, layout, mode)`: x @ W.T for the weight W
  whose storage tensors (`storage(qt)`; on the CPU, torch views of its numpy arrays) and layout
  (`layout(qt)`: array names, params) are given. The tensors are the operator's inputs, marked
  as static addresses (CUDA graphs read them in place, no copy per replay), so identical layers
  trace to one graph: compiling the blocks of a model one by one ("regional compilation") traces
  once, not per block, and a weight loaded into a compiled model is the one read. The operator finds W itself (its checks and launch
  plans are kept on it) by the addresses of that storage, in a registry that holds W weakly
  (`register(qt)`; QuantLinear registers its weight), and builds a QuantizedTensor from the
  tensors where none is registered. QuantLinear.forward goes through the operator while
  torch.compile traces and calls quantzoo.ops.matmul directly otherwise (no dispatcher cost in
  eager mode).
- `torch.ops.quantzoo.awq_gemm(x, qweight, scales, qzeros, group_size)`: the vLLM-style AWQ GEMM
  on its tensors (CUDA); quantzoo.ops.awq_gemm calls it while tracing.
- On a stream other than the default one, the operators allocate the kernels' workspaces per
  call (a split-K partial buffer, tile counters zeroed by a memset, Q8_1 activations) and leave
  launch plans off (cuda_launch.fresh_workspaces): torch.compile's CUDA graphs warm up and record
  on a stream of their own, allocating from a pool of their own, in which a cached buffer would
  be refused ("tensor(s) in the cudagraph pool not tracked as outputs"). Captured, that costs
  nothing; run eagerly on a side stream it costs host time and a memset per call.

Inference only, as the functions they wrap: no autograd formula is registered.
"""
from __future__ import annotations

import json
import warnings
import weakref

import numpy as np
import torch

# storage address -> weak references to the QuantizedTensors registered with that storage, and
# each one's layout (several may share it: qt and a dataclasses.replace copy of it)
_WEIGHTS: dict = {}


def storage(qt) -> tuple:
    """qt's storage arrays as torch tensors: views of numpy arrays on the CPU (a copy only where
    an array runs backwards, which torch cannot view), the arrays themselves on CUDA."""
    out = []
    for a in qt.arrays().values():
        if isinstance(a, np.ndarray):
            if any(st < 0 for st in a.strides):
                a = np.ascontiguousarray(a)
            with warnings.catch_warnings():   # a read-only (memory-mapped) array: never written through
                warnings.simplefilter("ignore", UserWarning)
                a = torch.from_numpy(a)
        out.append(a)
    return tuple(out)


def _address(tensors) -> tuple:
    # where the bytes are and how they are read: two weights may start at one address with one
    # shape (rows 0::2 and :n of a fused weight; an fp16 W and W.T)
    return tuple((t.device, t.data_ptr(), t.dtype, t.shape, t.stride()) for t in tensors)


def layout(qt) -> str:
    """What, besides its storage tensors, makes qt: the names of its arrays and its params (JSON;
    a constant that identical layers share)."""
    names = list(qt.data) if isinstance(qt.data, dict) else []
    return json.dumps({"names": names, "params": qt.params}, sort_keys=True)


def register(qt) -> tuple:
    """Make qt findable by torch.ops.quantzoo.qmatmul from its storage tensors; returns them,
    marked as inputs of a fixed address (torch._dynamo.mark_static_address: torch.compile's CUDA
    graphs would otherwise copy every weight into a buffer of their own at each replay; on CUDA
    the marked tensors are qt's own arrays). The registry holds qt weakly: the caller keeps it
    (QuantLinear does)."""
    tensors = storage(qt)
    for t in tensors:
        torch._dynamo.mark_static_address(t, guard=False)   # (unguarded: no recompile per layer)
    key = _address(tensors)
    live = [(r, lay) for r, lay in _WEIGHTS.get(key, ()) if r() is not None and r() is not qt]
    _WEIGHTS[key] = live + [(weakref.ref(qt, lambda _, key=key: _prune(key)), layout(qt))]
    return tensors


def _prune(key) -> None:
    """A registered weight was freed: drop it (and the key, once none is left)."""
    live = [(r, lay) for r, lay in _WEIGHTS.get(key, ()) if r() is not None]
    if live:
        _WEIGHTS[key] = live
    else:
        _WEIGHTS.pop(key, None)


def _weight(tensors, fmt: str, n: int, k: int, lay: str):
    """The registered QuantizedTensor these tensors are the storage of (its checks and launch
    plans are kept on it), else one built from them: the operator is a function of its inputs
    (torch's own checks call it on copies of them)."""
    from .formats import QuantizedTensor

    for ref, qt_lay in _WEIGHTS.get(_address(tensors), ()):
        qt = ref()
        if qt is not None and qt_lay == lay and qt.format == fmt and qt.shape == (n, k):
            return qt
    try:
        d = json.loads(lay)
        arrays = [t.detach().numpy() if t.device.type == "cpu" else t.detach() for t in tensors]
        if not d["names"] and len(arrays) != 1:
            raise ValueError(f"{len(arrays)} tensors for a weight of one array")
        data = dict(zip(d["names"], arrays, strict=True)) if d["names"] else arrays[0]
        qt = QuantizedTensor(fmt, (n, k), data, dict(d["params"]))
        qt.fmt.check(qt)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"storage: not the storage of a {fmt} weight ({n}, {k}) with layout {lay}: {e}") from None
    return qt


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


def _qmatmul(x, storage, format, n, k, layout, mode="emulate"):
    from . import ops

    qt = _weight(storage, format, n, k, layout)
    return _on_cuda_graph_stream(x, lambda: ops.matmul(x, qt, mode=mode))


def _qmatmul_fake(x, storage, format, n, k, layout, mode="emulate"):
    if x.shape[-1] != k:
        raise ValueError(f"x: last dimension is {x.shape[-1]}, the {format} weight {(n, k)} expects K={k}")
    if any(t.device != x.device for t in storage):
        raise ValueError(f"x is on {x.device} but the {format} weight's storage on "
                         f"{next(t.device for t in storage if t.device != x.device)}")
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
_LIB.define("qmatmul(Tensor x, Tensor[] storage, str format, int n, int k, str layout, "
            "str mode='emulate') -> Tensor")
_LIB.impl("qmatmul", _qmatmul, "CompositeExplicitAutograd")
torch.library.register_fake("quantzoo::qmatmul", _qmatmul_fake, lib=_LIB)
_LIB.define("awq_gemm(Tensor x, Tensor qweight, Tensor scales, Tensor qzeros, int? group_size=None) -> Tensor")
_LIB.impl("awq_gemm", _awq_gemm, "CompositeExplicitAutograd")
torch.library.register_fake("quantzoo::awq_gemm", _awq_gemm_fake, lib=_LIB)
