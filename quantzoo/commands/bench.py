"""`quantzoo bench kernels` (every weight format x Qwen3-8B shapes x M, vs cuBLAS fp16) and
`quantzoo bench model` (the runner on a Qwen3-8B-shaped model; quantzoo.bench.model)."""
from __future__ import annotations

import importlib


_MODEL_IMPORT_ERROR = None


def _model_module():
    """quantzoo.bench.model, or None when the runner's bench is absent or fails to import (the
    rest of the CLI must keep working either way; `bench model` then says why)."""
    global _MODEL_IMPORT_ERROR
    try:
        return importlib.import_module("quantzoo.bench.model")
    except ModuleNotFoundError as e:
        if e.name == "quantzoo.bench.model":
            _MODEL_IMPORT_ERROR = "quantzoo/bench/model.py (the runner's bench) has not landed yet"
        else:
            _MODEL_IMPORT_ERROR = f"importing quantzoo.bench.model failed: {e}"
    except Exception as e:  # noqa: BLE001
        _MODEL_IMPORT_ERROR = f"importing quantzoo.bench.model failed: {type(e).__name__}: {e}"
    return None


def register(sub) -> None:
    p = sub.add_parser("bench", help="GPU benchmarks: kernels (per format and shape) and model")
    bsub = p.add_subparsers(dest="bench_command", required=True, metavar="WHAT")

    from quantzoo.bench import kernels

    pk = bsub.add_parser("kernels", help="every weight format's matmul vs cuBLAS fp16, copy "
                                         "bandwidth and cuBLAS TFLOP/s measured in the same run")
    kernels.add_arguments(pk)
    pk.set_defaults(func=kernels.run)

    pm = bsub.add_parser("model", help="the runner on a Qwen3-8B-shaped model: prefill/decode tok/s")
    mod = _model_module()
    if mod is not None and hasattr(mod, "add_arguments"):
        mod.add_arguments(pm)
        pm.set_defaults(func=mod.run)
    else:
        pm.add_argument("rest", nargs="*", help="(unavailable)")
        pm.set_defaults(func=_model_missing)


def _model_missing(args) -> int:
    raise NotImplementedError("`quantzoo bench model` is not available in this checkout: "
                              + (_MODEL_IMPORT_ERROR or "quantzoo.bench.model has no add_arguments/run"))
