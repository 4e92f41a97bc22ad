"""Two GPUs (`pytest -m multi_gpu`, on a machine with two; deselected otherwise, and failing,
not skipped, where fewer are visible): the kernels run on the device their tensors are on,
whatever device is current, as torch's own ops do -- a kernel module belongs to one device's
context, and the launch stream, workspaces and compiled instances follow the current device
(cuda_launch.on_tensor_device, the runner's Model methods). Cuda:1 is used first while cuda:0
is current, so its modules are built there from scratch; its results must equal cuda:0's bit
for bit (same kernels on the same kind of GPU; the one-GPU tier proves those right)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import quantzoo as qz

pytestmark = pytest.mark.multi_gpu

FORMATS = qz.formats.stored_names()   # every format a weight is stored in


@pytest.mark.parametrize("fmt", FORMATS)
def test_matmul_runs_on_its_tensors_device(fmt, rng):
    """M = 1, 5, 40, 300 (the GEMV / small-M / tensor-core paths of each format) on cuda:1 with
    cuda:0 current: the result is on cuda:1, equal to cuda:0's, and cuda:0 stays current."""
    torch.cuda.set_device(0)
    n, k = 320, 1024
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    f = qz.formats.get(fmt)
    qt = f.quantize(w)
    q1, q0 = qt.to("cuda:1"), qt.to("cuda:0")
    for m in (1, 5, 40, 300):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float16))
        y1 = qz.ops.matmul(x.to("cuda:1"), q1)
        assert torch.cuda.current_device() == 0
        y0 = qz.ops.matmul(x.to("cuda:0"), q0)
        assert y1.device == torch.device("cuda:1") and torch.isfinite(y1).all(), (fmt, m)
        assert torch.equal(y1.cpu(), y0.cpu()), f"{fmt} M={m}: cuda:1 differs from cuda:0"
    if fmt == "awq":
        assert torch.equal(qz.ops.awq_dequantize(*(q1.data[a] for a in ("qweight", "scales", "qzeros"))).cpu(),
                           qz.ops.awq_dequantize(*(q0.data[a] for a in ("qweight", "scales", "qzeros"))).cpu())


def test_fp16_gemv_and_layer_ops_on_their_tensors_device(rng):
    """The runner's fp16 linear (its own GEMV at M <= 4) and a fused layer op on cuda:1 with
    cuda:0 current: equal to cuda:0's."""
    from quantzoo.kernels import fp16, layer_ops

    torch.cuda.set_device(0)
    w = torch.from_numpy((rng.standard_normal((256, 1024)) * 0.02).astype(np.float16))
    x = torch.from_numpy(rng.standard_normal((1, 1024)).astype(np.float16))
    y1, y0 = fp16.linear(x.to("cuda:1"), w.to("cuda:1")), fp16.linear(x.to("cuda:0"), w.to("cuda:0"))
    assert y1.device == torch.device("cuda:1") and torch.equal(y1.cpu(), y0.cpu())
    h = torch.from_numpy(rng.standard_normal((3, 1024)).astype(np.float16))
    nw = torch.from_numpy((1 + 0.1 * rng.standard_normal(1024)).astype(np.float16))
    outs = []
    for dev in ("cuda:1", "cuda:0"):
        hh = h.to(dev)
        r = layer_ops.add_rms_norm(hh, hh.clone(), nw.to(dev), 1e-6)
        outs.append([t.cpu() for t in (r if isinstance(r, tuple) else (r,))] + [hh.cpu()])
    assert torch.cuda.current_device() == 0
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_model_generates_on_its_device(tmp_path):
    """A synthetic GGUF model (q4_1 linears, q8_0 embedding: fused layer ops, a PDL decode graph)
    loaded on cuda:1 while cuda:0 is current generates what the same model on cuda:0 does, its
    logits equal, and none of its memory lands on cuda:0."""
    from test_model_gpu import write_slice_gguf

    torch.cuda.set_device(0)
    path = write_slice_gguf(tmp_path / "slice.gguf")
    before0 = torch.cuda.memory_allocated(0)
    g1 = qz.load_model(str(path), device="cuda:1", progress=False)
    ids = [(37 * i + 5) % 512 for i in range(24)]
    t1 = g1.generate(ids, max_new_tokens=16)
    l1 = g1.logits(ids)
    assert torch.cuda.current_device() == 0 and not g1.fallbacks, g1.fallbacks
    assert torch.cuda.memory_allocated(0) == before0, "the cuda:1 model allocated on cuda:0"
    g0 = qz.load_model(str(path), device="cuda:0", progress=False)
    assert g0.generate(ids, max_new_tokens=16) == t1
    assert torch.equal(g0.logits(ids), l1)
