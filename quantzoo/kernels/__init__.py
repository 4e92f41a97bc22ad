"""GPU entry points per format family; each module exposes matmul(x, qt) for CUDA tensors.

Modules here import CuPy lazily (quantzoo.cuda_launch): the package works without CUDA.
"""


def checked_once(qt, check):
    """check(qt) (a weight validation that raises ValueError or returns what the launches need),
    run once per QuantizedTensor and remembered on it while its storage tensors stay the same
    objects (replacing one in qt.data re-runs the check). A matmul's weight checks cost tens
    of microseconds of Python per call, as much as a small kernel's GPU time; x is still
    checked on every call. Tensors resized or re-pointed in place (resize_, set_) are not
    noticed: do not do that to a weight in use."""
    data = getattr(qt, "data", None)
    parts = tuple(data.values()) if isinstance(data, dict) else (data,)
    memo = getattr(qt, "__dict__", {}).get("_kernels_checked")
    if (memo is not None and memo[0] is check and len(memo[1]) == len(parts)
            and all(a is b for a, b in zip(memo[1], parts))):
        return memo[2]
    result = check(qt)
    try:   # QuantizedTensor is a frozen dataclass: the memo is not one of its fields
        object.__setattr__(qt, "_kernels_checked", (check, parts, result))
    except (AttributeError, TypeError):
        pass
    return result
