"""GPU tier: programmatic dependent launch (cuda/pdl.cuh, cuda_launch.programmatic_launches).

With PDL a kernel may be launched while its predecessor still runs; each kernel must wait
(griddepcontrol.wait) before touching memory the chain shares. A kernel that forgot would race,
and a race shows as results that differ from plain launches. Every kernel here is deterministic
(fixed summation orders, split-K partials merged in a fixed order), so a chain of dependent
launches captured with PDL must reproduce plain eager launches bit for bit, replay after replay.
"""
from __future__ import annotations

import pytest
import torch

from quantzoo import ops
from quantzoo.bench.model import random_weight
from quantzoo.cuda_launch import programmatic_launches
from quantzoo.formats import weight_formats
from quantzoo.kernels import fp16 as fp16_kernels
from quantzoo.kernels import layer_ops

pytestmark = pytest.mark.gpu

FORMATS = sorted({f.name for f in weight_formats()} | {"fp16"})


def _chain(h0, h, ws, norm_w, steps):
    """h <- h0; then `steps` times: x = rms_norm(h += delta); delta = x @ W.T (W alternating)."""
    h.copy_(h0)
    delta = None
    for i in range(steps):
        x = layer_ops.add_rms_norm(h, delta, norm_w, 1e-6)
        w = ws[i % len(ws)]
        delta = fp16_kernels.linear(x, w) if isinstance(w, torch.Tensor) else ops.matmul(x, w)
    return layer_ops.add_rms_norm(h, delta, norm_w, 1e-6)


def _pdl_equals_plain(run, h, what):
    """run() -> the chain's output, h its running state: plain eager launches are the reference;
    a PDL graph of run() replayed three times over NaN-poisoned out and h, and eager PDL launches
    (the ctypes path, planned replays), must give the same bits."""
    ref = run().clone()
    ref_h = h.clone()
    assert torch.isfinite(ref).all() and torch.isfinite(ref_h).all(), what
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()                                          # warm-up: workspaces, compiles
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s), programmatic_launches():
        out = run()
    for _ in range(3):
        out.fill_(float("nan"))
        h.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref), f"{what}: PDL graph differs from plain launches"
        assert torch.equal(h, ref_h), what
    with programmatic_launches():
        out_e = run()
    torch.cuda.synchronize()
    assert torch.equal(out_e, ref), f"{what}: eager PDL launches differ"


@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_pdl_graph_equals_plain_launches(fmt, M, rng):
    seed = int(rng.integers(2**31))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    D = 1024   # square weights so the chain can continue; several CTAs per kernel
    ws = [random_weight(fmt, D, D, "cuda", gen, std=0.03) for _ in range(2)]
    if fmt == "fp16":
        ws = [w.data for w in ws]
    h0 = torch.randn(M, D, device="cuda", generator=gen).half()
    norm_w = (1 + 0.1 * torch.randn(D, device="cuda", generator=gen)).half()
    h = torch.empty_like(h0)
    _pdl_equals_plain(lambda: _chain(h0, h, ws, norm_w, 6), h, f"{fmt} M={M} (seed {seed})")


@pytest.mark.parametrize("D", [4096, 5120])
def test_pdl_awq_strip_chain(D, rng):
    """The AWQ strip kernel (cuda/awq_strip.cu) in a PDL chain, as the runner's decode sends
    Qwen3-8B's o_proj: at D = 4096 and 5120, M = 1 dispatch sends both weights to its one-block
    form (choose_path from the shapes alone); on the weights' device, D = 4096 takes its cluster
    form where the GPU has thread-block clusters (the square chain above, D = 1024, does too)."""
    from quantzoo.kernels import awq

    seed = int(rng.integers(2**31))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ws = [random_weight("awq", D, D, "cuda", gen, std=0.01) for _ in range(2)]
    on_device = "strip-cluster" if D == 4096 and awq.clusters_available(torch.device("cuda")) else "strip"
    assert awq.choose_path(1, awq._Shape(D, D)) == "strip" and awq.choose_path(1, ws[0]) == on_device
    h0 = torch.randn(1, D, device="cuda", generator=gen).half()
    norm_w = (1 + 0.1 * torch.randn(D, device="cuda", generator=gen)).half()
    h = torch.empty_like(h0)
    _pdl_equals_plain(lambda: _chain(h0, h, ws, norm_w, 6), h, f"awq strip D={D} (seed {seed})")


def _mlp_chain(h0, h, gate_up, down, norm_w, steps):
    """h <- h0; then `steps` times the runner's decode MLP (model/llm.py): x = rms_norm(h +=
    delta); delta = down(silu(x @ gate.T) * (x @ up.T)), the SwiGLU by matmul(glu=True)."""
    from quantzoo.kernels import awq

    h.copy_(h0)
    delta = None
    for _ in range(steps):
        x = layer_ops.add_rms_norm(h, delta, norm_w, 1e-6)
        delta = ops.matmul(awq.matmul(x, gate_up, glu=True), down)
    return layer_ops.add_rms_norm(h, delta, norm_w, 1e-6)


@pytest.mark.parametrize("D,F", [(1024, 8192), (4096, 12288)], ids=str)
def test_pdl_awq_gemv_decode_mlp(D, F, rng, monkeypatch):
    """The AWQ GEMV (cuda/awq_gemv.cu) in a PDL chain. The square chain above never reaches it:
    M = 1 takes the GEMV only where N >= GEMV_MIN_N (16384). Here the runner's decode MLP at
    M = 1: gate/up has 2F >= 16384 columns, so dispatch sends it to the GEMV (into the GLU
    workspace, then silu_mul), and down to awq_small; both asserted from the shapes alone
    (choose_path, no device needed at M = 1), and the GEMV seen called. On a GPU with
    thread-block clusters D = 1024's down runs strip-cluster instead. (1024, 8192):
    the default (2, 8, 4) GEMV with gemv_plan's K splits; (4096, 12288), Qwen3-8B's: the tuned
    (4, 4, 4) with 4 splits (GEMV_TUNED), the runner's own decode launch."""
    from quantzoo.kernels import awq

    seed = int(rng.integers(2**31))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = random_weight("awq", 2 * F, D, "cuda", gen, std=0.01)
    down = random_weight("awq", D, F, "cuda", gen, std=0.01)
    assert awq.choose_path(1, awq._Shape(2 * F, D)) == "gemv" == awq.choose_path(1, gate_up)
    assert awq.choose_path(1, awq._Shape(D, F)) == "small"
    assert awq.choose_path(1, down) == ("strip-cluster" if D == 1024 and awq.clusters_available(torch.device("cuda"))
                                        else "small")
    gemv_calls = []
    real_gemv = awq._PATHS["gemv"]

    def counted_gemv(*args, **kwargs):
        gemv_calls.append(args[5:8])   # (m, k, n): _PATHS' (x2, qweight, scales, qzeros, y, m, k, n, g)
        return real_gemv(*args, **kwargs)

    monkeypatch.setitem(awq._PATHS, "gemv", counted_gemv)
    h0 = torch.randn(1, D, device="cuda", generator=gen).half()
    norm_w = (1 + 0.1 * torch.randn(D, device="cuda", generator=gen)).half()
    h = torch.empty_like(h0)
    _pdl_equals_plain(lambda: _mlp_chain(h0, h, gate_up, down, norm_w, 6), h, f"awq D={D} F={F} (seed {seed})")
    assert gemv_calls and gemv_calls[0] == (1, D, 2 * F), f"the GEMV was not called: {gemv_calls}"


def test_programmatic_launches_nests_and_restores():
    from quantzoo import cuda_launch

    assert cuda_launch.pdl_enabled() is False
    with programmatic_launches():
        assert cuda_launch.pdl_enabled() is True
        with programmatic_launches(False):
            assert cuda_launch.pdl_enabled() is False
        assert cuda_launch.pdl_enabled() is True
    assert cuda_launch.pdl_enabled() is False
