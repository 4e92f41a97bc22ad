"""CPU: how cuda_launch turns kernel arguments into the bytes cuLaunchKernelEx copies (the PDL
launches and every launch that passes a TMA descriptor go this way)."""
import ctypes

import numpy as np
import pytest

from quantzoo.cuda_launch import TensorMap, _ctype_arg


@pytest.mark.parametrize("value,raw", [
    (np.int32(-5), (-5).to_bytes(4, "little", signed=True)),
    (np.int64(1 << 40), (1 << 40).to_bytes(8, "little")),
    (np.uint32(7), (7).to_bytes(4, "little")),
    (np.float32(1.5), np.float32(1.5).tobytes()),
    (0x7F00_1234_5678, (0x7F00_1234_5678).to_bytes(8, "little")),   # a device pointer: 8 bytes
])
def test_scalars_and_pointers(value, raw):
    for _ in range(2):   # the second call takes the per-type cache
        assert bytes(_ctype_arg(ctypes, value)) == raw


def test_tensor_map_passes_its_128_bytes():
    raw = (ctypes.c_uint64 * 16)(*range(16))
    assert _ctype_arg(ctypes, TensorMap(raw)) is raw


@pytest.mark.parametrize("bad", [True, np.bool_(False), 1.5, "x", None])
def test_bad_arguments_raise(bad):
    with pytest.raises(TypeError, match="kernel argument"):
        _ctype_arg(ctypes, bad)
