"""fp16: the unquantized baseline every format is compared with (cuBLAS on GPU)."""
from __future__ import annotations

import numpy as np

from .base import Format, as_float_matrix, cast_warn
from .tensor import QuantizedTensor


class FP16(Format, name="fp16"):
    kind = "baseline"
    block_size, bytes_per_block = 1, 2
    kernels = "fp16"
    nmse_ceiling = 1e-6
    gguf_type = "F16"

    def quantize(self, w, **opts) -> QuantizedTensor:
        """w (N, K), a numpy array or torch tensor, rounded to a float16 (N, K) array. No options.
        ValueError for a value past +-65504 and what formats.as_float_matrix refuses (not 2-D,
        empty, NaN / inf, complex, meta); TypeError for any option. Warns (RuntimeWarning) for a
        row too small for fp16's normal range."""
        if opts:
            raise TypeError(f"fp16.quantize: unexpected options {sorted(opts)}")
        w = as_float_matrix(w)
        if np.abs(w).max(initial=0) > 65504:
            raise ValueError("fp16.quantize: values beyond +-65504 overflow fp16")
        # (overflow was refused just above: only the underflow of tiny rows is left to say)
        w16 = cast_warn(w, np.float16, "", what="w", underflow="fp16 keeps them so (scale the weight up)")
        return QuantizedTensor("fp16", tuple(w.shape), w16)

    def storage(self, shape, params: dict) -> dict:
        return {"data": (tuple(shape), np.float16)}

    def _nonfinite_rows(self, qt) -> np.ndarray:
        return ~np.isfinite(np.asarray(qt.numpy().data)).all(axis=1)

    def _dequantize(self, qt) -> np.ndarray:
        return qt.numpy().data.astype(np.float32)

    def emulate(self, x, qt, return_bound=False):
        from quantzoo.reference import awq_fp16

        return awq_fp16.fp16_matmul(x, self.dequantize(qt), return_bound=return_bound, what="fp16's kernels")
