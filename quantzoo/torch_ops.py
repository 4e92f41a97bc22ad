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
  tensors where none is registered. QuantLinear.forward and quantzoo.ops.matmul go through the
  operator where `via_operator(x)` says so (torch.compile tracing, make_fx / FakeTensorMode,
  torch.func, forward-mode AD) and compute directly otherwise (no dispatcher cost in eager mode).
- `torch.ops.quantzoo.awq_gemm(x, qweight, scales, qzeros, group_size)`: the vLLM-style AWQ GEMM
  on its tensors (CUDA); quantzoo.ops.awq_gemm calls it where `via_operator(x)` says so.
- On a stream other than the default one, the operators allocate the kernels' workspaces per
  call (a split-K partial buffer, tile counters zeroed by a memset, Q8_1 activations) and leave
  launch plans off (cuda_launch.fresh_workspaces): torch.compile's CUDA graphs warm up and record
  on a stream of their own, allocating from a pool of their own, in which a cached buffer would
  be refused ("tensor(s) in the cudagraph pool not tracked as outputs"). Captured, that costs
  nothing; run eagerly on a side stream it costs host time and a memset per call.

Inference only, as the functions they wrap: their Autograd kernel refuses, by name, an x that
requires grad or carries a forward-mode tangent (torch.func.grad and jvp included), where
torch's fallback gave zero or missing derivatives without a word. vmap maps over x (its batch
dimension moved to the front: one call); a weight mapped too is refused by name.
"""
from __future__ import annotations

import json
import warnings
import weakref

import numpy as np
import torch
from torch.autograd import forward_ad

from .formats.base import refuse_scalar_x

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
    return _layout(tuple(qt.data) if isinstance(qt.data, dict) else (), qt.params)


def _layout(names: tuple, params: dict) -> str:
    return json.dumps({"names": list(names), "params": params}, sort_keys=True)


# torch.compile cannot trace json: Dynamo runs _layout while tracing and makes its result a
# constant of the graph, guarded on the arguments (what torch._dynamo.assume_constant_result
# sets; importing torch._dynamo for it would add ~2 s to `import quantzoo`)
_layout._dynamo_marked_constant = True


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
    live = [e for e in _WEIGHTS.get(key, ()) if e[0]() is not None and e[0]() is not qt]
    # the entry holds the tensors (not qt): the key is their address, which must not be freed and
    # reused by another weight while qt lives -- a copy (an array running backwards) had no
    # other owner when the caller dropped what register returned
    _WEIGHTS[key] = live + [(weakref.ref(qt, lambda _, key=key: _prune(key)), layout(qt), tensors)]
    return tensors


def _prune(key) -> None:
    """A registered weight was freed: drop it (and the key, once none is left)."""
    live = [e for e in _WEIGHTS.get(key, ()) if e[0]() is not None]
    if live:
        _WEIGHTS[key] = live
    else:
        _WEIGHTS.pop(key, None)


def _weight(tensors, fmt: str, n: int, k: int, lay: str):
    """The registered QuantizedTensor these tensors are the storage of (its checks and launch
    plans are kept on it), else one built from them: the operator is a function of its inputs
    (torch's own checks call it on copies of them)."""
    from .formats import QuantizedTensor

    for ref, qt_lay, _ in _WEIGHTS.get(_address(tensors), ()):
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


_is_compiling = torch.compiler.is_compiling
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_modes = torch._C._len_torch_dispatch_stack   # (Python dispatch modes, FakeTensorMode's included)


def via_operator(x) -> bool:
    """Whether the torch tensor x must reach the weight through the operator instead of
    ops.matmul's direct dispatch (x.numpy() into the reference, or the CUDA kernels on x's
    memory): while torch.compile traces (one opaque node); under a Python dispatch mode (make_fx
    recorded the numpy result as a constant of its graph; FakeTensorMode got .numpy()'s error:
    the node and the fake kernel instead); an x that torch.func wraps (vmap's batching rule; the
    Autograd kernel's refusals); an x with a forward-mode tangent
    (refused there, where the result came back without one). is_compiling first: while
    tracing, nothing else is read. Cost where all are false: 0.41 us a call (best of 15 on the
    2-core CPU box that runs the CPU tests, torch 2.13), 0.61 us on the lent H100's host, where
    an ops.matmul q4_0 M = 1 call took 36.3 us of host time with it and 36.4 without (bench/NOTES.md
    session 42)."""
    return _is_compiling() or _modes() > 0 or _is_wrapped(x) or _has_tangent(x)


def _has_tangent(x) -> bool:
    """x carries a forward-mode AD tangent (inside a forward_ad.dual_level, torch.func.jvp)."""
    return forward_ad._current_level >= 0 and forward_ad.unpack_dual(x).tangent is not None


def qmatmul(x, qt, mode: str = "emulate"):
    """torch.ops.quantzoo.qmatmul(x, ...) on the weight qt, ops.matmul's route where via_operator(x).
    Tracing with torch.compile, qt's numpy arrays become the graph's inputs through
    torch.from_numpy (views, as `storage` makes); a weight that is not registered (QuantLinear
    registers its own) is rebuilt from them and checked at each call, and on CUDA its storage is
    not marked static (torch_ops.register(qt) before compiling does both). An array that runs
    backwards (a[::-1]) or views a memory map (the GGUF loader's weights) cannot be traced (Dynamo
    does not convert it: "Expected np.nditer base"): QuantLinear, which builds its storage
    eagerly, takes both."""
    n, k = qt.shape
    if _is_compiling():   # (storage's strides test and warning filter are not traceable)
        st = tuple(torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in qt.arrays().values())
    else:
        st = storage(qt)
    return torch.ops.quantzoo.qmatmul(x, st, qt.format, n, k, layout(qt), mode)


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
    # (ops._matmul: the direct dispatch; ops.matmul's via_operator would route back here)
    return _on_cuda_graph_stream(x, lambda: ops._matmul(x, qt, mode))


def check_dtype(x) -> None:
    """The x dtypes ops.matmul computes in, the result taking x's (an integer or float8 y would
    truncate or saturate it): eagerly and in the fake kernel (which had given an int result)."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"x: dtype {x.dtype}; expected float16, bfloat16, float32 or float64 "
                         "(the result takes x's dtype)")


def _qmatmul_fake(x, storage, format, n, k, layout, mode="emulate"):
    check_dtype(x)
    refuse_scalar_x(x, (n, k), format)   # (as ops.matmul says it eagerly)
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
    # awq.gemm's checks of x by its shape and dtype (the result had been shaped from scales alone:
    # an x of another K, a 0-d or an fp32 x got one); the weights' are the kernel's (their shapes,
    # and the group size they imply, are symbols under torch.compile's dynamic shapes)
    from quantzoo.kernels import awq

    awq._check_x(x, qweight.shape[0], qweight.device, fake=True)
    return x.new_empty((*x.shape[:-1], scales.shape[-1]), dtype=torch.float16)


def refuse_grad(x, name: str, weights=()) -> None:
    """Under grad mode (the caller's to ask): an x or a weight tensor that requires grad, refused by
    name (the result would be silently detached / the weight's gradient silently none). weights may
    hold numpy arrays (ops.matmul's CPU storage), which never do."""
    if x.requires_grad:
        raise ValueError(f"x requires grad, but {name} has no backward (the result would be silently "
                         "detached); run it under torch.no_grad() or pass x.detach()")
    if any(getattr(t, "requires_grad", False) for t in weights):
        raise ValueError(f"a weight tensor requires grad, but {name} has no backward (it would get no "
                         "gradient); run it under torch.no_grad() or pass the weights detached")


def _refuse_derivatives(x, name: str, weights=()) -> None:
    """The operators' Autograd kernel: what they cannot differentiate is refused by name."""
    if torch.is_grad_enabled():
        refuse_grad(x, name, weights)
    if _has_tangent(x):
        raise ValueError(f"x carries a forward-mode tangent (torch.autograd.forward_ad, torch.func.jvp), but {name} "
                         "has no derivative (the result would have none); pass the primal alone")


def _direct(x, tensors) -> bool:
    """Whether dispatching below autograd would reach the CPU/CUDA kernel with these very
    tensors: no Python dispatch mode, plain tensors (no subclass such as FakeTensor, none that
    torch.func wraps), x not on meta (the fake kernel). Then the Autograd kernel calls the kernel
    itself: the redispatch cost ~7 us a call on the 2-core CPU box, this test ~0.5."""
    return (_modes() == 0 and type(x) is torch.Tensor and not x.is_meta and not _is_wrapped(x)
            and all(type(t) is torch.Tensor for t in tensors))


def _qmatmul_autograd(x, storage, *args):
    _refuse_derivatives(x, "quantzoo.ops.matmul", storage)
    if _direct(x, storage):
        return _qmatmul(x, storage, *args)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.quantzoo.qmatmul.default(x, storage, *args)


def _awq_gemm_autograd(x, qweight, scales, qzeros, *args):
    _refuse_derivatives(x, "quantzoo.ops.awq_gemm", (qweight, scales, qzeros))
    if _direct(x, (qweight, scales, qzeros)):
        return _awq_gemm(x, qweight, scales, qzeros, *args)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.quantzoo.awq_gemm.default(x, qweight, scales, qzeros, *args)


# Defined on the dispatcher directly (torch.library.Library): torch.library.custom_op's Python
# layers cost ~25 us more per call on this project's CPU host (46 against 19 over the call
# itself). The one kernel for every backend (CompositeExplicitAutograd) is quantzoo's own
# dispatch by device. The Autograd kernel refuses derivatives by name (torch's fallback for an
# operator without one warned once and gave func.grad a zero gradient, func.jvp and forward_ad a
# zero or no tangent): a call of the operator went from 4.5 to ~6 us (best of 15; noisy) on the
# 2-core CPU box, the redispatch below autograd skipped where it changes nothing (_direct).
_LIB = torch.library.Library("quantzoo", "DEF")
_LIB.define("qmatmul(Tensor x, Tensor[] storage, str format, int n, int k, str layout, "
            "str mode='emulate') -> Tensor")
_LIB.impl("qmatmul", _qmatmul, "CompositeExplicitAutograd")
_LIB.impl("qmatmul", _qmatmul_autograd, "Autograd")
torch.library.register_fake("quantzoo::qmatmul", _qmatmul_fake, lib=_LIB)
_LIB.define("awq_gemm(Tensor x, Tensor qweight, Tensor scales, Tensor qzeros, int? group_size=None) -> Tensor")
_LIB.impl("awq_gemm", _awq_gemm, "CompositeExplicitAutograd")
_LIB.impl("awq_gemm", _awq_gemm_autograd, "Autograd")
torch.library.register_fake("quantzoo::awq_gemm", _awq_gemm_fake, lib=_LIB)


def _batched_x(name: str, in_dims, x, weight_dims, expected: str) -> torch.Tensor:
    """vmap over x alone: the batch dimension moved to the front, where the matmuls take any
    leading dimensions of x already (a weight per batch entry would be another weight per entry).
    An entry that is a scalar is refused as the call on it is (the batch would be read as K)."""
    if any(d is not None for d in weight_dims):
        raise ValueError(f"vmap over {name}'s weight tensors: not supported (one weight for the batch; "
                         "map over x only)")
    if in_dims is not None and x.dim() == 1:
        raise ValueError(f"x: a scalar (0-d) in each vmap entry; expected shape {expected}")
    return x if in_dims is None else x.movedim(in_dims, 0)


def _qmatmul_vmap(info, in_dims, x, storage, format, n, k, *args):
    xb = _batched_x("quantzoo.ops.matmul", in_dims[0], x, in_dims[1],
                    f"(..., {k}) for the {format} weight {(n, k)}")
    return torch.ops.quantzoo.qmatmul(xb, storage, format, n, k, *args), (None if in_dims[0] is None else 0)


def _awq_gemm_vmap(info, in_dims, x, qweight, scales, qzeros, *args):
    xb = _batched_x("quantzoo.ops.awq_gemm", in_dims[0], x, in_dims[1:4], "(..., K), K the rows of qweight")
    return torch.ops.quantzoo.awq_gemm(xb, qweight, scales, qzeros, *args), (None if in_dims[0] is None else 0)


torch.library.register_vmap("quantzoo::qmatmul", _qmatmul_vmap, lib=_LIB)
torch.library.register_vmap("quantzoo::awq_gemm", _awq_gemm_vmap, lib=_LIB)
