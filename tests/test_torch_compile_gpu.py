"""GPU tier: torch.compile through quantzoo's CUDA kernels (quantzoo.torch_ops). A model of
QuantLinear layers in every format, compiled whole by inductor with CUDA graphs
(mode="reduce-overhead": the kernels are captured and replayed), gives the eager kernels' bits
at every M the dispatch splits on, replay after replay; the vLLM-style awq_gemm op likewise."""
from __future__ import annotations

import pytest
import torch

from quantzoo import ops
from quantzoo.formats import get, weight_formats
from quantzoo.nn import QuantLinear

pytestmark = pytest.mark.gpu

FORMATS = sorted({f.name for f in weight_formats()} | {"fp16"})


def _mlp(fmt):
    g = torch.Generator().manual_seed(0)
    a, b = torch.nn.Linear(256, 512), torch.nn.Linear(512, 192, bias=False)
    with torch.no_grad():
        for p in (*a.parameters(), b.weight):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    opts = {"group_size": 64} if fmt == "awq" else {}
    return torch.nn.Sequential(QuantLinear.from_linear(a, fmt, **opts), torch.nn.SiLU(),
                               QuantLinear.from_linear(b, fmt, **opts)).cuda()


@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_with_cuda_graphs_equals_eager(fmt):
    m = _mlp(fmt)
    torch._dynamo.reset()
    c = torch.compile(m, mode="reduce-overhead", fullgraph=True, dynamic=False)
    with torch.no_grad():
        for rows in (1, 7, 33, 300):
            x = torch.randn(rows, 256, device="cuda", dtype=torch.float16)
            want = m(x)
            for _ in range(3):   # record, then replays of the captured graph
                got = c(x).clone()
                assert torch.equal(got, want), (fmt, rows)
            x.normal_()          # new values in the same input: the replay reads them
            assert torch.equal(c(x).clone(), m(x)), (fmt, rows)


def test_compiled_awq_gemm_equals_eager():
    n, k, g = 384, 512, 128
    qt = get("awq").quantize(torch.randn(n, k).numpy(), group_size=g).to("cuda")
    w = qt.data
    torch._dynamo.reset()
    f = torch.compile(lambda x: ops.awq_gemm(x, w["qweight"], w["scales"], w["qzeros"], g), fullgraph=True)
    for rows in (1, 16, 100):
        x = torch.randn(rows, k, device="cuda", dtype=torch.float16)
        assert torch.equal(f(x), ops.awq_gemm(x, w["qweight"], w["scales"], w["qzeros"], g)), rows
