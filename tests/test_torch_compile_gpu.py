"""GPU tier: torch.compile through quantzoo's CUDA kernels (quantzoo.torch_ops). Two QuantLinear
layers in every format, compiled whole by inductor with CUDA graphs (mode="reduce-overhead": the
kernels are captured and replayed), give the eager kernels' bits at each M the dispatch splits
on, replay after replay and for new input values, and in the default mode (no CUDA graphs); the
vLLM-style awq_gemm op likewise. Between linears, inductor fuses a bias add and SiLU in fp32
and rounds once (eager rounds to fp16 after each): a model with them returns its hidden
activations too, which are held to that one-rounding computation done eagerly within a derived
bound, and the second linear's compiled output must be the eager kernel's bits on them."""
from __future__ import annotations

import pytest
import torch

from quantzoo import ops
from quantzoo.formats import get, weight_formats
from quantzoo.nn import QuantLinear

pytestmark = pytest.mark.gpu

FORMATS = sorted({f.name for f in weight_formats()} | {"fp16"})


def _layers(fmt, bias):
    g = torch.Generator().manual_seed(0)
    a, b = torch.nn.Linear(256, 512, bias=bias), torch.nn.Linear(512, 192, bias=False)
    with torch.no_grad():
        for p in (*a.parameters(), b.weight):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    opts = {"group_size": 64} if fmt == "awq" else {}
    return QuantLinear.from_linear(a, fmt, **opts).cuda(), QuantLinear.from_linear(b, fmt, **opts).cuda()


def _cloned(out):
    """A compiled call's output (a tensor or a tuple of them) copied out of the CUDA graph's
    buffers, which the next replay overwrites."""
    return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()


def _check(model, compare, mode="reduce-overhead", reference=None):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    c = torch.compile(model, mode=mode, fullgraph=True, dynamic=False)
    reference = reference or model
    with torch.no_grad():
        for rows in (1, 7, 33, 300):
            x = torch.randn(rows, 256, device="cuda", dtype=torch.float16)
            want = reference(x)
            for _ in range(3):   # warm-up, record, then replays of the captured graph
                compare(_cloned(c(x)), want, rows)
            x.normal_()          # new values in the same input: the replay reads them
            compare(_cloned(c(x)), reference(x), rows)
    # the CUDA graphs were made, not skipped (inductor would fall back to plain launches silently)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@pytest.mark.parametrize("mode", ["reduce-overhead", "default"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_equals_eager(fmt, mode):
    """reduce-overhead: CUDA graphs (the ops run on their stream with per-call workspaces);
    default: no graphs, the ops on the default stream with the cached workspaces and plans."""
    def exact(got, want, rows):
        assert not got.isnan().any() and torch.equal(got, want), (fmt, rows)

    _check(torch.nn.Sequential(*_layers(fmt, bias=False)), exact, mode)


@pytest.mark.parametrize("fmt", ["awq", "q4_0", "q8_0"])
def test_op_on_a_side_stream_equals_the_default_stream(fmt):
    from quantzoo import torch_ops

    a, _ = _layers(fmt, bias=False)
    st, lay = torch_ops.register(a.qt), torch_ops.layout(a.qt)
    s = torch.cuda.Stream()
    for rows in (1, 33, 300):
        x = torch.randn(rows, 256, device="cuda", dtype=torch.float16)
        want = torch.ops.quantzoo.qmatmul(x, st, fmt, 512, 256, lay, "emulate")
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            got = torch.ops.quantzoo.qmatmul(x, st, fmt, 512, 256, lay, "emulate")
        torch.cuda.current_stream().wait_stream(s)
        assert torch.equal(got, want), (fmt, rows)


class _MLP(torch.nn.Module):
    """a, SiLU, b; the hidden activations (the second linear's input) are returned too."""

    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x):
        h = torch.nn.functional.silu(self.a(x))
        return h, self.b(h)


def _fp16_ulp(v):
    """fp16's spacing at each value of float tensor v (subnormal spacing, 2^-24, below 2^-14)."""
    return torch.where(v.abs() < 2**-14, torch.full_like(v, 2**-24),
                       2.0 ** (torch.floor(torch.log2(v.abs().clamp_min(2**-14))) - 10))


@pytest.mark.parametrize("fmt", ["awq", "q4_0", "q8_0"])
def test_compiled_mlp_with_fused_pointwise_ops(fmt):
    a, b = _layers(fmt, bias=True)

    def one_rounding(x):
        # what inductor computes between the linears: bias add and SiLU in fp32, one fp16 rounding
        h = ops.matmul(x, a.qt).float() + a.bias.float()
        return torch.nn.functional.silu(h).half()

    bias = a.bias.detach().float().abs()

    def close(got, want, rows):
        h, y = got
        # The second linear under compile gives the eager kernel's bits on its input (as in
        # test_compiled_equals_eager), whatever inductor's SiLU made of it.
        assert not y.isnan().any() and torch.equal(y, b(h)), (fmt, rows)
        # That input against the one-rounding computation: both are one fp16 rounding of fp32
        # SiLU values of the same fp32 sum y16 + bias, which differ by a few fp32 ulps at most
        # (inductor's exp and division against torch's; 2^-13 of an fp16 ulp each), so they are
        # equal or adjacent fp16 values: within one fp16 ulp of want. The 2^-10 |bias| term would
        # cover a bias rounded to fp16 first (half an fp16 ulp of it, times SiLU' <= 1.1).
        # (The bound was on the whole output, NMSE < 1e-5 against the one-rounding reference:
        # GGUF's Q8_1 step turns one such adjacent value into a changed int8 code or block scale.
        # On the CPU emulation, q4_0 at one row, one fp16 ulp moved in one of the 512 inputs of
        # the second linear gave NMSE over 1e-5 in 1 % of 3,000 draws, up to 7.3e-5; with the
        # SiLU 1 to 4 fp32 ulps off on every element, 1 to 2 one-row draws of 3,000 failed.)
        tol = _fp16_ulp(want.float()) + 2.0 ** -10 * bias
        err = (h.float() - want.float()).abs()
        bad = ~(err <= tol)   # a NaN counts as bad
        assert not bad.any(), (fmt, rows, int(bad.sum()), float((err / tol).max()))

    _check(_MLP(a, b), close, reference=one_rounding)


@pytest.mark.parametrize("mode", ["reduce-overhead", "default"])
def test_compiled_awq_gemm_equals_eager(mode):
    from torch._dynamo.utils import counters

    n, k, g = 384, 512, 128
    qt = get("awq").quantize(torch.randn(n, k).numpy(), group_size=g).to("cuda")
    w = qt.data
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(lambda x, gs: ops.awq_gemm(x, w["qweight"], w["scales"], w["qzeros"], gs), mode=mode,
                      fullgraph=True, dynamic=False)
    for rows in (1, 16, 100):
        x = torch.randn(rows, k, device="cuda", dtype=torch.float16)
        want = ops.awq_gemm(x, w["qweight"], w["scales"], w["qzeros"], g)
        for gs in (g, None):   # None: the group size from the shapes, as eagerly
            for _ in range(3):
                assert torch.equal(f(x, gs).clone(), want), (rows, gs)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def test_vmap_over_x_equals_the_batched_call():
    """torch.func.vmap through the CUDA kernels (QuantLinear and the awq_gemm op): the batch of x is
    moved to the front and computed in one call, so each row equals the call on the whole stack."""
    a, _ = _layers("q4_0", bias=False)
    qt = get("awq").quantize(torch.randn(384, 512).numpy(), group_size=64).to("cuda")
    w = qt.data
    with torch.no_grad():
        for rows in (1, 33):
            x = torch.randn(4, rows, 256, device="cuda", dtype=torch.float16)
            assert torch.equal(torch.func.vmap(a, in_dims=1)(x.transpose(0, 1)), a(x)), rows
            x = torch.randn(4, rows, 512, device="cuda", dtype=torch.float16)
            want = ops.awq_gemm(x, w["qweight"], w["scales"], w["qzeros"], 64)
            got = torch.func.vmap(lambda t: ops.awq_gemm(t, w["qweight"], w["scales"], w["qzeros"], 64))(x)
            assert torch.equal(got, want), rows
