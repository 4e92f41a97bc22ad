"""QuantLinear: a torch.nn.Module computing x @ W.T (+ bias) through quantzoo.ops. Inference
only: the quantized weight has no gradient, and neither does x through it (refused, not cut)."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from . import ops, torch_ops
from .formats import QuantizedTensor, get, get_stored


def _check_weight(qt, what: str) -> None:
    """The constructor's (and load_state_dict's) checks of the weight, ops.matmul's errors:
    a QuantizedTensor of a stored format (not the q8_1 activation format) whose shape, params
    and storage agree (Format.check)."""
    if not isinstance(qt, QuantizedTensor):
        raise ValueError(f"{what}: expected a QuantizedTensor, got {type(qt).__name__}")
    get_stored(qt.format, what).check(qt)   # (an unknown format: the registry's KeyError)


class QuantLinear(torch.nn.Module):
    """A linear layer on a quantized weight: forward(x) = x @ W.T (+ bias) through quantzoo.ops.matmul.

    qt: the weight, a QuantizedTensor (out_features, in_features) of a stored format (formats.get(name)
    .quantize(w)), on the CPU or CUDA; bias: None or a floating-point torch tensor (out_features,),
    copied to the weight's device; mode: "emulate" (default) or "dequant", what the CPU computes
    (ops.matmul's mode; CUDA runs the format's kernels either way). Sets in_features, out_features.

    The weight is no Parameter (parameters() holds only the bias, which requires no grad): it is
    in state_dict as extra state, moves with .to() / .cuda() / .cpu(), and is kept as it is by
    .half() / .to(dtype). Inference only: an x that requires grad is refused, not detached.

    Raises ValueError for a qt that is not a QuantizedTensor, a q8_1 (activation) weight, storage
    that disagrees with its shape and params (Format.check), a bias of another shape or a non-float
    bias, and an unknown mode; KeyError for a weight of an unknown format name.
    """

    def __init__(self, qt: QuantizedTensor, bias: torch.Tensor | None = None, mode: str = "emulate"):
        """Wrap the QuantizedTensor qt (see the class docstring for bias, mode and the errors)."""
        super().__init__()
        if mode not in ops.MODES:
            raise ValueError(f"mode={mode!r}: choose one of {ops.MODES}")
        self.qt = qt   # (the setter checks it)
        self.mode = mode
        self.out_features, self.in_features = qt.shape
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (self.out_features,)):
            raise ValueError(f"bias: expected a torch tensor of shape ({self.out_features},), got "
                             f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
        if bias is not None and (bias.device.type == "meta" or not bias.is_floating_point()):
            raise ValueError(f"bias: a {bias.dtype} tensor on {bias.device}; expected floating-point values")
        # on the weight's device (forward adds it to y there; .to() moves both from then on)
        self.bias = None if bias is None else torch.nn.Parameter(
            bias.detach().to(qt.device, copy=True), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, fmt: str, **opts) -> "QuantLinear":
        """A QuantLinear of linear's weight quantized to format `fmt` (a name: formats.get(fmt)
        .quantize(linear.weight, **opts), e.g. group_size=64 for awq), with linear's bias, on
        linear's device. The quantizer's errors and warnings are quantize's (KeyError for an
        unknown name, ValueError for a shape the format cannot store, TypeError for an option it
        does not take); ValueError for a `linear` that is not a torch.nn.Linear."""
        if not isinstance(linear, torch.nn.Linear):
            raise ValueError(f"from_linear: expected a torch.nn.Linear, got {type(linear).__name__}")
        qt = get(fmt).quantize(linear.weight, **opts)   # (a torch tensor: as_float_matrix reads it)
        ql = cls(qt, linear.bias)
        return ql.to(linear.weight.device)

    @property
    def qt(self) -> QuantizedTensor:
        """The quantized weight. Assigning one checks it as the constructor does and refuses
        another shape (ValueError: make a new QuantLinear for it)."""
        return self._qt

    @qt.setter
    def qt(self, qt: QuantizedTensor) -> None:
        _check_weight(qt, "qt")
        if "_qt" in self.__dict__ and qt.shape != (self.out_features, self.in_features):
            # (in/out_features, the bias and a compiled graph's shapes follow the first weight)
            raise ValueError(f"qt: weight shape {qt.shape}, this module is {(self.out_features, self.in_features)} "
                             "(out_features, in_features); make a new QuantLinear for another shape")
        self._qt = qt
        self._op_storage = torch_ops.register(qt)   # the operator's inputs while torch.compile traces
        self._op_layout = torch_ops.layout(qt)

    def __getstate__(self):
        state = super().__getstate__()   # (the operator's views of the storage: rebuilt on load)
        return {k: v for k, v in state.items() if k != "_op_storage"}

    def __setstate__(self, state):
        # copy.deepcopy and pickle: the copied weight is another object, registered in turn
        # (a module pickled before `qt` became a property holds it as "qt")
        super().__setstate__(state)
        self.qt = self.__dict__.pop("qt") if "qt" in self.__dict__ else self._qt

    def _apply(self, fn, *args, **kw):
        # where .to()/.cuda()/.cpu() sends a tensor on the weight's device (one made on the default
        # device moved a CUDA weight to the CPU under .half() / .to(dtype), which move nothing)
        dev = fn(torch.empty(0, device=self.qt.device)).device
        if not ops._same_device(str(dev), self.qt.device):
            if self.qt.device == "meta":
                # to_empty(device=...): fn makes the arrays' uninitialized storage there, as for
                # parameters (.to() from meta: fn raises torch's own "Cannot copy out of meta tensor")
                arrays = {k: fn(v) for k, v in self.qt.arrays().items()}
                if dev.type == "cpu":
                    arrays = {k: v.numpy() for k, v in arrays.items()}
                self.qt = dataclasses.replace(
                    self.qt, data=arrays if isinstance(self.qt.data, dict) else arrays["data"])
            else:
                self.qt = self.qt.to(str(dev))
        return super()._apply(fn, *args, **kw)

    def get_extra_state(self) -> dict:
        """The quantized weight in state_dict (it is no Parameter): format, shape, params and its
        storage arrays as CPU tensors, so torch.save and load_state_dict carry it."""
        if self.qt.device == "meta":   # meta tensors, as a meta module's parameters are in its state_dict
            q, arrays = self.qt, {k: v.detach() for k, v in self.qt.arrays().items()}
        else:
            q = self.qt.numpy()
            arrays = {k: torch.from_numpy(np.array(v)) for k, v in q.arrays().items()}
        return {"format": q.format, "shape": tuple(q.shape), "params": dict(q.params), "arrays": arrays}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kw):
        # load_state_dict(assign=True): the weight takes the state's device, as assigned parameters
        # do (a module made on meta and loaded so had its weight moved to meta: the bytes lost)
        self._assign = bool(local_metadata.get("assign_to_params_buffers", False))
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kw)
        finally:
            del self._assign

    def set_extra_state(self, state: dict) -> None:
        """Take the weight from a state get_extra_state wrote (load_state_dict calls it): checked as
        the constructor checks a weight, on this module's device (with load_state_dict(...,
        assign=True) on the state's). ValueError for a state that is no such weight, or holds one of
        another shape."""
        try:
            # (a meta module's state: meta tensors, no values; taken as they are, as nn.Linear's are)
            meta = any(v.is_meta for v in state["arrays"].values())
            # (.cpu(): torch.load's map_location may have put them on a GPU)
            # (copies, as nn.Linear's load copies: the module must not share the caller's tensors)
            arrays = {k: v.detach() if meta else np.array(v.detach().cpu().numpy()) for k, v in state["arrays"].items()}
            qt = QuantizedTensor(state["format"], tuple(state["shape"]),
                                 arrays["data"] if list(arrays) == ["data"] else arrays, dict(state["params"]))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"QuantLinear state: not a quantized weight this module saved ({e})") from None
        try:   # what the constructor refuses is refused here too (q8_1: at load, not at forward)
            _check_weight(qt, "QuantLinear state")
        except KeyError as e:   # (its message names "QuantLinear state")
            raise ValueError(e.args[0]) from None
        if qt.shape != (self.out_features, self.in_features):
            raise ValueError(f"QuantLinear state: weight shape {qt.shape}, this module is "
                             f"{(self.out_features, self.in_features)}")
        assigned = getattr(self, "_assign", False)
        if meta and not assigned and self.qt.device != "meta":
            raise ValueError(f"QuantLinear state: its arrays are on meta (no values); this module's weight is on "
                             f"{self.qt.device}: load it with load_state_dict(sd, assign=True) to make the weight meta")
        self.qt = qt.to(str(next(iter(state["arrays"].values())).device) if assigned else self.qt.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y = x @ W.T (+ bias): x a torch tensor (..., in_features) on the weight's device ->
        (..., out_features). On the CPU x may be float16, bfloat16, float32 or float64 and y takes
        x's dtype; on CUDA x must be float16 (contiguous) and y is float16. ValueError for an x that
        is not a torch tensor, has another last dimension, dtype or device, or requires grad under
        grad mode (there is no backward)."""
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"x: expected a torch tensor, got {type(x).__name__}")
        if torch_ops.via_operator(x):   # as ops.matmul routes: torch.compile tracing (one opaque
            # node in the graph), make_fx / FakeTensorMode (the node, the fake kernel), torch.func
            # and forward AD (refused by name)
            if x.requires_grad and torch.is_grad_enabled():
                raise ValueError("x requires grad, but QuantLinear has no backward; run it under "
                                 "torch.no_grad() or pass x.detach()")
            y = torch.ops.quantzoo.qmatmul(x, self._op_storage, self._qt.format, self.out_features,
                                           self.in_features, self._op_layout, self.mode)
        else:   # (ops._matmul: via_operator is answered; it refuses an x that requires grad)
            y = ops._matmul(x, self.qt, self.mode)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.qt.format}, params={self.qt.params}")
