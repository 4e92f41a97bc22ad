"""GPU tier: the runner's fp16 GEMV (cuda/fp16_gemv.cu) against float64, and its dispatch."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("N,K", [(1, 8), (7, 576), (4096, 4096), (6144, 4096), (4096, 12288), (30001, 1032)])
def test_gemv_vs_float64(rng, M, N, K):
    from quantzoo.kernels import fp16

    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.05).half()
    x = torch.randn(M, K, device="cuda", generator=g).half()
    w[0, : min(K, 3)] = torch.tensor([1e4, 0.0, 1e-7], device="cuda")[: min(K, 3)].half()
    x[:, -1] = 0
    y = fp16.gemv(x, w)
    ref = x.double() @ w.double().t()
    # fp32 sums of K exact products (fp16 x fp16 is exact in fp32): |err| <= K u32 sum|x w|,
    # then one fp16 rounding of the result (half an ulp, 2^-11 relative)
    absprod = x.double().abs() @ w.double().abs().t()
    bound = K * 2.0**-24 * absprod + 2.0**-11 * ref.abs() + 2.0**-25
    err = (y.double() - ref).abs()
    assert torch.isfinite(y).all()
    assert (err <= bound).all(), f"worst excess {float((err - bound).max()):.3g}"
    assert_typical_error_is_fp32s(y[:, 1:], ref[:, 1:], "fp16 gemv")   # (row 0 holds the 1e4 weight)


def assert_typical_error_is_fp32s(y, ref, what):
    """The worst-case bound above grows with K; at K = 4096 it still holds for a kernel that sums
    in fp16, which errs on only ~20 % of outputs past it (a numpy emulation, K = 576 / 4096 /
    12288: 74 / 20 / 1 %). The typical error tells them apart: NMSE against float64 is ~4-5e-8
    with fp32 sums (the fp16 rounding of y) and 1.6e-5 to 2.5e-4 with fp16 sums. Held to 4e-7,
    plus the rounding of fp16 subnormals."""
    if y.numel() == 0:
        return
    e2 = float(((y.double() - ref) ** 2).sum())
    r2 = float((ref ** 2).sum())
    assert e2 <= 4e-7 * r2 + y.numel() * 2.0 ** -50, f"{what}: NMSE {e2 / max(r2, 1e-300):.3g} > 4e-7"


def test_linear_dispatch_and_graph(rng):
    from quantzoo.kernels import fp16

    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
    w = (torch.randn(512, 256, device="cuda", generator=g) * 0.05).half()
    x1 = torch.randn(1, 256, device="cuda", generator=g).half()
    x9 = torch.randn(9, 256, device="cuda", generator=g).half()
    assert fp16.gemv_ok(x1, w) and not fp16.gemv_ok(x9, w)
    assert not fp16.gemv_ok(x1[:, :255], w[:, :255].contiguous())     # K % 8 != 0: cuBLAS
    torch.testing.assert_close(fp16.linear(x9, w), torch.nn.functional.linear(x9, w))
    torch.testing.assert_close(fp16.linear(x1, w), torch.nn.functional.linear(x1, w), rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="gemv"):
        fp16.gemv(x9, w)
    # a lazily negated view holds -x in memory: cuBLAS (F.linear) honours the bit, the GEMV would not
    for a, b in ((torch._neg_view(x1), w), (x1, torch._neg_view(w))):
        assert not fp16.gemv_ok(a, b)
        torch.testing.assert_close(fp16.linear(a, b), -torch.nn.functional.linear(x1, w))
        with pytest.raises(ValueError, match="negative bit"):
            fp16.gemv(a, b)
    # captured in a CUDA graph, replayed on new input
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fp16.gemv(x1, w)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp16.gemv(x1, w)
    x1.copy_(torch.randn(1, 256, device="cuda", generator=g).half())
    graph.replay()
    torch.testing.assert_close(out, torch.nn.functional.linear(x1, w), rtol=2e-3, atol=2e-3)
