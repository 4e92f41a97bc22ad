"""The standard Gaussian workload every format's error is quoted on.

Weights ~ N(0, 0.02^2) (out=N, in=K), activations ~ N(0, 1), seeded; y_exact in float64 with
the unquantized weights. NMSE = ||y - y_exact||^2 / ||y_exact||^2.
"""
from __future__ import annotations

import numpy as np

from . import reference

STANDARD = {"m": 64, "k": 4096, "n": 1024, "sigma": 0.02, "seed": 0}


def gaussian(m=64, k=4096, n=1024, sigma=0.02, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * sigma).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    return x, w, reference.matmul_exact(x, w)


def format_errors(fmt, x, w, y_exact) -> dict:
    """NMSE of the dequantized weight alone and of the kernel's function (emulated)."""
    qt = fmt.quantize(w)
    return {
        "nmse_weights": reference.nmse(reference.matmul_exact(x, qt), y_exact),
        "nmse_kernel": reference.nmse(fmt.emulate(x, qt), y_exact),
        "bytes": qt.nbytes,
    }
