"""GPU tier: the runner's fused layer ops (cuda/layer_ops.cu) against the torch code they replace.

Kernel by kernel against torch run on the same GPU (llm.py's own functions, or float64 for the
attention), then a whole model with fused_ops against the same model with the torch ops: prefill
and teacher-forced decode logits (eager and CUDA-graph) agree. Fresh random data each run.
"""
from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu


def _ulp(v):
    """The fp16 unit in the last place at each value of float tensor v (subnormal spacing below 2**-14)."""
    return torch.where(v.abs() < 2**-14, torch.full_like(v, 2**-24),
                       2.0 ** (torch.floor(torch.log2(v.abs().clamp_min(2**-14))) - 10))


def _ulp_close(got, want, ulps=1, extra=0.0):
    """fp16 tensors equal within `ulps` units in the last place of the expected value (plus
    `extra`, a per-element allowance for differences the inputs carry)."""
    got, want = got.float(), want.float()
    # written so that a NaN where a number is expected (an unwritten, NaN-poisoned output)
    # counts as bad: equal values (infinities) and NaN where NaN is expected pass
    ok = ((got - want).abs() <= ulps * _ulp(want) + extra) | (got == want) | (got.isnan() & want.isnan())
    bad = ~ok
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} elements beyond {ulps} ulp; " \
                          f"worst |diff| {float((got - want).abs().max()):.3g}"


def _hf_rms(x, w, eps):   # HF's RMSNorm on fp16 (llm.rms_norm's non-fused branch)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) if w is None else w * xf.to(x.dtype)


# D -> the kernel's 16-byte chunks a thread V (layer_ops.norm_shape): 1 up to D = 8192, 2 up to
# 16384, 4 up to 32768. 16400: V = 4 on 544 threads (17 warps), chunks 2050 of 2176 slots, the last
# round partly masked; 32768: the largest D, 1024 threads each holding 4 whole chunks.
NORM_V = {8: 1, 576: 1, 1024: 1, 4096: 1, 5000: 1, 12296: 2, 16400: 4, 32768: 4, 32: 1, 2048: 1, 12288: 2,
          16416: 4}


@pytest.mark.parametrize("T,D", [(1, 4096), (7, 576), (33, 1024), (2, 8), (3, 12296), (1, 5000), (2, 16400),
                                 (1, 32768)])
@pytest.mark.parametrize("add", [True, False])
def test_add_rms_norm(rng, T, D, add):
    from quantzoo.kernels import layer_ops as lo

    assert lo.norm_shape(D)[0] == NORM_V[D]   # the add_rms_norm<ADD, V, 0> instance this case runs
    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
    h = (torch.randn(T, D, device="cuda", generator=g) * 3).half()
    h[0, : min(D, 4)] = torch.tensor([6e4, -6e4, 1e-7, 0.0], device="cuda")[: min(D, 4)].half()
    delta = (torch.randn(T, D, device="cuda", generator=g)).half() if add else None
    w = (torch.rand(D, device="cuda", generator=g) * 2).half()
    h0 = h.clone()
    out = lo.add_rms_norm(h, delta, w, 1e-6)
    assert not out.isnan().any(), "NaN outputs"   # (an unwritten chunk fails the comparison below)
    want_h = h0 + delta if add else h0
    assert torch.equal(h, want_h), "residual add is not torch's fp16 add"
    # two roundings (h*r, then w*that): an rsqrt or summation-order difference of an ulp in r
    # can flip the first, and w (up to 2) carries that flip into the second: 2 ulps
    _ulp_close(out, _hf_rms(want_h, w, 1e-6), ulps=2)


def _q8_1_ref(out, layout):
    """Q8_1 of fp16 `out` by the stand-alone quantizer (itself checked against the codec in
    test_gguf_gpu.py) in the layout's byte order."""
    from quantzoo.kernels import gguf

    return (gguf.quantize_q8_1_split(out) if layout == "split" else gguf.quantize_q8_1(out).view(-1))


@pytest.mark.parametrize("T,D", [(1, 4096), (3, 576), (1, 12288), (2, 32), (8, 2048), (2, 16416)])
@pytest.mark.parametrize("layout", ["split", "interleaved"])
def test_add_rms_norm_q8_1(rng, T, D, layout):
    """With a Q8_1 buffer: the same fp16 output and residual, and in the buffer exactly the bytes
    the stand-alone quantizer makes of that output (zeros, fp16 extremes and tiny values included).
    D = 16416 (513 Q8_1 blocks a row, 2052 chunks): V = 4 on 544 threads, whose last round holds
    420 real chunks (105 blocks) and 124 masked ones (31 absent blocks that must not be stored:
    their indices are the next row's first blocks)."""
    from quantzoo.kernels import layer_ops as lo

    assert lo.norm_shape(D)[0] == NORM_V[D]
    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
    h = (torch.randn(T, D, device="cuda", generator=g) * 3).half()
    h[0, :32] = 0                                            # an all-zero Q8_1 block (d = 0, q = 0)
    h[-1, :4] = torch.tensor([6e4, -6e4, 1e-7, 0.0], device="cuda").half()
    delta = torch.randn(T, D, device="cuda", generator=g).half()
    delta[0, :32] = 0
    w = (torch.rand(D, device="cuda", generator=g) * 2).half()
    h2 = h.clone()
    q8 = torch.full((T * D // 32 * 36,), 0xAB, dtype=torch.uint8, device="cuda")
    out = lo.add_rms_norm(h, delta, w, 1e-6, q8, layout)
    assert torch.equal(out, lo.add_rms_norm(h2, delta, w, 1e-6)) and torch.equal(h, h2)
    assert torch.equal(q8, _q8_1_ref(out, layout))


@pytest.mark.parametrize("T,F", [(1, 12288), (3, 1536), (1, 32)])
@pytest.mark.parametrize("layout", ["split", "interleaved"])
def test_silu_mul_q8_1(rng, T, F, layout):
    from quantzoo.kernels import layer_ops as lo

    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
    gu = (torch.randn(T, 2 * F, device="cuda", generator=g) * 4).half()
    gu[0, :4] = torch.tensor([-6e4, 6e4, 0.0, -20.0]).half()
    gu[-1, F - 32:F] = 0                                     # silu(0) * up = 0: an all-zero block
    q8 = torch.full((T * F // 32 * 36,), 0xAB, dtype=torch.uint8, device="cuda")
    out = lo.silu_mul(gu, q8, layout)
    assert torch.equal(out, lo.silu_mul(gu))
    assert torch.equal(q8, _q8_1_ref(out, layout))


def test_repeated_ops_equal_checked_ops(rng, monkeypatch):
    """layer_ops.Repeated (the runner's calls: checked once a shape, then a packed launch aimed
    at each call's tensors) writes what the checked ops write, bit for bit: outputs, the
    residual updated in place, Q8_1 bytes, cache rows. Every shape runs three times on fresh
    tensors (the checked op, then the packed launch twice), and more shapes than LIMIT go
    through, so that dropped shapes are packed again."""
    from quantzoo.kernels import layer_ops as lo
    from quantzoo.model.config import ModelConfig
    from quantzoo.model.llm import rope_tables

    monkeypatch.setattr(lo.Repeated, "LIMIT", 5)
    rep, packed_calls = lo.Repeated(), []
    real = lo.Repeated._launch
    monkeypatch.setattr(lo.Repeated, "_launch", staticmethod(lambda pl, p: (packed_calls.append(1), real(pl, p))))
    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).half()

    def q8_pair(n):   # an output buffer for each side, poisoned alike
        return [torch.full((n // 32 * 36,), 0xAB, dtype=torch.uint8, device="cuda") for _ in range(2)]

    expected = 0   # calls that must take the packed launch: a shape's second and third
    for T, D, F in ((1, 4096, 12288), (5, 576, 1536), (40, 2048, 64), (3, 12296, 32)):
        for layout in (None, "split", "interleaved"):
            for rep_i in range(3):
                expected += 3 if rep_i and (layout is None or D % 32 == 0) else 1 if rep_i else 0
                h, delta, w = rand(T, D, scale=3.0), rand(T, D), (torch.rand(D, device="cuda", generator=g) * 2).half()
                h2 = h.clone()
                for d in (delta, None):
                    if layout is None:
                        out, want = rep.add_rms_norm(h, d, w, 1e-6), lo.add_rms_norm(h2, d, w, 1e-6)
                    elif D % 32 == 0:
                        q8, q8w = q8_pair(T * D)
                        out = rep.add_rms_norm(h, d, w, 1e-6, q8, layout)
                        want = lo.add_rms_norm(h2, d, w, 1e-6, q8w, layout)
                        assert torch.equal(q8, q8w)
                    else:   # (Q8_1 takes rows of whole 32-value blocks)
                        continue
                    assert torch.equal(out, want) and torch.equal(h, h2), (T, D, layout, d is None)
                gu = rand(T, 2 * F, scale=4.0)
                if layout is None:
                    assert torch.equal(rep.silu_mul(gu), lo.silu_mul(gu))
                else:
                    q8, q8w = q8_pair(T * F)
                    assert torch.equal(rep.silu_mul(gu, q8, layout), lo.silu_mul(gu, q8w, layout))
                    assert torch.equal(q8, q8w)
    for T, H, KV, hd, norm in ((1, 32, 8, 128, True), (5, 9, 3, 64, False), (17, 6, 2, 64, True)):
        S = 300
        cfg = ModelConfig(arch="qwen3", vocab_size=8, hidden_size=64, intermediate_size=64, num_layers=1,
                          num_heads=H, num_kv_heads=KV, head_dim=hd, rms_norm_eps=1e-6,
                          rope_theta=1e6, max_position=4096, tie_word_embeddings=True, qk_norm=norm)
        cos, sin = rope_tables(cfg, S, "cuda", torch.float16)
        for rep_i in range(3):
            expected += rep_i > 0
            qkv = rand(T, (H + 2 * KV) * hd, scale=2.0)
            pos = torch.randperm(S, device="cuda", generator=g)[:T]
            w = (torch.rand(H + KV, hd, device="cuda", generator=g) + 0.5).half() if norm else None
            caches = [rand(KV, S, hd) for _ in range(2)]
            want_caches = [c.clone() for c in caches]
            q = rep.qk_rope_store(qkv, w, cos, sin, pos, *caches, H, KV, 1e-6)
            want = lo.qk_rope_store(qkv, w, cos, sin, pos, *want_caches, H, KV, 1e-6)
            assert torch.equal(q, want) and all(map(torch.equal, caches, want_caches)), (T, H, KV, hd)
    assert len(rep._packed) <= 5
    assert len(packed_calls) == expected


def test_q8_1_output_bad_arguments():
    from quantzoo.kernels import layer_ops as lo

    h = torch.zeros(2, 40, device="cuda", dtype=torch.float16)
    w = torch.ones(40, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="not whole 32-value Q8_1 blocks"):
        lo.add_rms_norm(h, None, w, 1e-6, torch.zeros(90, dtype=torch.uint8, device="cuda"))
    h, w = h[:, :32].contiguous(), w[:32].contiguous()
    with pytest.raises(ValueError, match="q8_1: shape"):
        lo.add_rms_norm(h, None, w, 1e-6, torch.zeros(36, dtype=torch.uint8, device="cuda"))
    with pytest.raises(ValueError, match="layout"):
        lo.add_rms_norm(h, None, w, 1e-6, torch.zeros(72, dtype=torch.uint8, device="cuda"), "rows")
    with pytest.raises(ValueError, match="q8_1: dtype"):
        lo.silu_mul(torch.zeros(1, 64, device="cuda", dtype=torch.float16), torch.zeros(36, device="cuda"))


@pytest.mark.parametrize("T,H,KV,hd,norm", [(1, 32, 8, 128, True), (5, 9, 3, 64, False),
                                            (3, 4, 4, 128, False), (17, 6, 2, 64, True)])
def test_qk_rope_store(rng, T, H, KV, hd, norm):
    from quantzoo.kernels import layer_ops as lo
    from quantzoo.model.config import ModelConfig
    from quantzoo.model.llm import apply_rope, rope_tables

    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
    S = 300
    cfg = ModelConfig(arch="qwen3", vocab_size=8, hidden_size=64, intermediate_size=64, num_layers=1,
                      num_heads=H, num_kv_heads=KV, head_dim=hd, rms_norm_eps=1e-6,
                      rope_theta=1e6, max_position=4096, tie_word_embeddings=True, qk_norm=norm)
    cos, sin = rope_tables(cfg, S, "cuda", torch.float16)
    qkv = (torch.randn(T, (H + 2 * KV) * hd, device="cuda", generator=g) * 2).half()
    pos = torch.randperm(S, device="cuda", generator=g)[:T]
    w = (torch.rand(H + KV, hd, device="cuda", generator=g) + 0.5).half() if norm else None
    kc = torch.full((KV, S, hd), float("nan"), device="cuda", dtype=torch.float16)
    vc = kc.clone()
    q = lo.qk_rope_store(qkv, w, cos, sin, pos, kc, vc, H, KV, 1e-6)
    # the torch path of llm.Model._forward (fused qkv): norm over q and k heads, then RoPE
    qk = qkv[:, :(H + KV) * hd].view(1, T, H + KV, hd)
    if norm:
        qk = _hf_rms(qk, None, 1e-6) * w
    # HF's form x*cos + rotate_half(x)*sin: two rounded products, then the sum
    c, s = cos[pos][:, None], sin[pos][:, None]
    p1, p2 = qk * c, torch.roll(qk, hd // 2, -1) * s
    rot = p1 + p2
    assert torch.allclose(rot.float(), apply_rope(qk, c, s).float(), atol=0.02, rtol=2e-3)
    # With the norm, the kernel's rsqrtf and sum order may put a normed element 1 ulp from
    # torch's; through the two products that is up to ulp(x)|c| + ulp(x')|s| plus one product
    # ulp each, which where the products cancel is many ulps of the result.
    extra = 0.0
    if norm:
        qr = torch.roll(qk, hd // 2, -1).float()
        extra = (_ulp(qk.float()) * c.float().abs() + _ulp(qr) * s.float().abs()
                 + _ulp(p1.float()) + _ulp(p2.float()))[0]
    _ulp_close(q, rot[0, :, :H], ulps=1, extra=extra[:, :H] if norm else 0.0)
    _ulp_close(kc[:, pos].transpose(0, 1), rot[0, :, H:], ulps=1, extra=extra[:, H:] if norm else 0.0)
    assert torch.equal(vc[:, pos].transpose(0, 1), qkv[:, (H + KV) * hd:].view(T, KV, hd))
    untouched = torch.ones(S, dtype=torch.bool, device="cuda")
    untouched[pos] = False
    assert torch.isnan(kc[:, untouched]).all() and torch.isnan(vc[:, untouched]).all()


@pytest.mark.parametrize("T,F", [(1, 12288), (9, 1536), (4, 2), (64, 12288)])
def test_silu_mul(rng, T, F, monkeypatch):
    """(64, 12288): 393,216 pairs, more than the launcher's grid cap of 132 x 8 blocks of 256
    threads (270,336): the kernel's grid-stride loop takes a second round (the other shapes fit
    one round). The launch's grid is recorded to prove which."""
    from quantzoo.kernels import layer_ops as lo

    grids = []
    real_launch = lo.launch

    def spy(kernel, grid, block, args, *a, **kw):
        grids.append((grid[0], block[0]))
        return real_launch(kernel, grid, block, args, *a, **kw)

    monkeypatch.setattr(lo, "launch", spy)
    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
    gu = (torch.randn(T, 2 * F, device="cuda", generator=g) * 4).half()
    gu[0, :4] = torch.tensor([-6e4, 6e4, 0.0, -20.0]).half()
    out = lo.silu_mul(gu, out=torch.full((T, F), float("nan"), dtype=torch.float16, device="cuda"))
    (blocks, threads), = grids
    assert (T * F // 2 > blocks * threads) == ((T, F) == (64, 12288)), (T, F, blocks, threads)
    want = torch.nn.functional.silu(gu[:, :F]) * gu[:, F:]
    _ulp_close(out, want, ulps=1)


def test_swiglu_every_fp16_gate():
    """swiglu.cuh's branch-free division, rounded to fp16 as silu(g) always is, equals
    fp16(g / (1 + e^-g)) in fp32 with torch's IEEE division and exp -- for all 65536 fp16 gates
    (signed zeros, subnormals, the largest magnitudes, infinities; every NaN gives a NaN). With
    up = 1 the product adds no rounding, so silu_mul's output is fp16(silu(g)) itself."""
    from quantzoo.kernels import layer_ops as lo

    g = torch.arange(-2**15, 2**15, dtype=torch.int32, device="cuda").to(torch.int16).view(torch.float16)
    gu = torch.cat([g, torch.ones_like(g)])[None].contiguous()
    out = lo.silu_mul(gu)[0]
    g32 = g.float()
    want = (g32 / (1 + torch.exp(-g32))).half()
    nan = torch.isnan(want)
    assert torch.isnan(out[nan]).all(), "a NaN gate gave a number"
    bad = (out.view(torch.int16) != want.view(torch.int16)) & ~nan
    assert not bad.any(), (f"{int(bad.sum())} gates differ, e.g. g = {g[bad][:4].tolist()}: "
                           f"{out[bad][:4].tolist()} vs {want[bad][:4].tolist()}")


def _attn_runs(p: int, n_split: int) -> tuple[int, int]:
    """(runs, rows a run) that attn_decode cuts cache rows 0..p into (AttnRuns, cuda/layer_ops.cuh)."""
    npos = p + 1
    n = 1 if npos <= 128 else min(n_split, -(-npos // 64))
    chunk = (-(-npos // n) + 15) // 16 * 16
    return -(-npos // chunk), chunk


def _check_attn(out, q, kc, vc, p: int, n_split: int, what: str) -> float:
    """attn_decode's output (1, H*hd) against float64 softmax(q k^T / sqrt(hd)) v over rows 0..p
    of the fp16 cache (the inputs exact in float64), within a bound derived from the kernel's
    arithmetic (cuda/layer_ops.cuh: attn_run, attn_merge), to first order in u = 2^-24.
    S = max over positions of sum_d |q_d k_d| log2(e)/sqrt(hd) (the scores' scale, base 2);
    A = sum_p a_p |v_p| (>= |out|: the scale of every fp32 sum of the output); g = groups of 4
    rows a warp takes in a run (rows a run / 16); n = runs.
      * Scores: fp32(log2(e)/sqrt(hd)), q times it (2 roundings), the products (1), a lane's
        E-term sum and 5 butterfly levels (<= 8): |error| <= 11 u S. Softmax is shift-invariant:
        a weight depends on its score minus the running max (both off by <= 11 u S; the
        difference rounded, <= 2 u S) and on the max's own steps through the group corrections
        and the warp / run merge factors (their arguments' roundings total <= 6 u S): a
        weight's relative error <= ln2 (30 u S) + exp2f's 2 ulp, and the output's (numerator
        and denominator both) <= 2 ln2 30 u S A + 4 u A < 48 u S A.
      * Sums: each group rescales acc and l (1 rounding, a correction factor within 2 ulp) and
        adds 4 rows (4 fma), the 4 warps merge (a factor, 4 terms), the n runs merge (a factor
        each, n sequential fma), one division: <= (7 g + n + 10) u relative for each of
        numerator and denominator, <= (14 g + 2 n + 20) u A on the output.
      * The fp16 output: half an ulp of the value (correctly rounded).
    Bound: ulp(want) / 2 + u A (48 S + 16 g + 4 n + 32), the constants rounded up. At hd 128
    and 4608 rows, S ~ 40: ~2500 u A ~ 1.5e-4 A, with the half ulp 3e-5 .. 1.2e-4 at |out|
    0.05 .. 0.5: about 10x tighter than the 2e-3 this test had. (Real errors are far below
    it: a float32 emulation of these steps on the CPU stayed within 1.5 % of the fp32 term over
    these tests' shapes and positions.) Returns the worst error / bound."""
    H, hd = q.shape[1], q.shape[2]
    G = H // kc.shape[0]
    n, chunk = _attn_runs(p, n_split)
    k = kc[:, : p + 1].double().repeat_interleave(G, 0)     # (H, p+1, hd)
    v = vc[:, : p + 1].double().repeat_interleave(G, 0)
    qd = q[0].double()[:, None]                               # (H, 1, hd)
    att = torch.softmax((qd @ k.transpose(1, 2)) / math.sqrt(hd), -1)   # (H, 1, p+1)
    want = (att @ v)[:, 0]
    mag = (att @ v.abs())[:, 0]                               # A, per output element
    s = (qd.abs() @ k.abs().transpose(1, 2))[:, 0].amax(-1, keepdim=True) * (math.log2(math.e) / math.sqrt(hd))
    tol = 0.5 * _ulp(want) + 2.0**-24 * mag * (48 * s + 16 * (chunk // 16) + 4 * n + 32)
    err = (out.view(H, hd).double() - want).abs()
    bad = ~(err <= tol)   # NaN (an unwritten output) counts as bad
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} outputs beyond the bound, worst "
                           f"|err| {float(err.max()):.3g}, worst err/bound {float((err / tol).max()):.3g}")
    return float((err / tol).max())


# G = H / KV query heads per KV head: 1, 2, 3, 4, 5, 7, 8, each its own attn_decode<E, G, RING>
# instance (2, 5 and 7 are real models' groups: Qwen3-0.6B 16 / 8, Qwen3-14B 40 / 8, Qwen2.5-7B
# 28 / 4). At G = 5 and 7 attn_merge's 4 warps take the heads' (max, sum) in a full and a partial
# round, and a thread's OUTS = ceil(G E / 4) outputs run past G * hd at hd 64 (G = 5: 384 slots
# for 320 outputs, G = 7: 512 for 448).
@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("H,KV", [(32, 8), (9, 3), (4, 4), (16, 2), (10, 2), (14, 2), (16, 8)])
@pytest.mark.parametrize("S", [256, 4608])
def test_attn_decode(rng, hd, H, KV, S):
    from quantzoo.kernels import layer_ops as lo

    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
    kc = torch.randn(KV, S, hd, device="cuda", generator=g).half()
    vc = torch.randn(KV, S, hd, device="cuda", generator=g).half()
    work = lo.DecodeWork(H, KV, hd, S, "cuda")
    assert _attn_runs(127, work.n_split)[0] == 1 and _attn_runs(128, work.n_split)[0] == 3
    worst = 0.0
    for p in sorted({0, 1, 15, 16, 63, 127, 128, 200, S // 2 + 3, S - 1}):   # 127: one run, 128: three
        q = (torch.randn(1, H, hd, device="cuda", generator=g) * 3).half()
        pos = torch.tensor([p], device="cuda")
        out = lo.attn_decode(q, kc, vc, pos, work)
        worst = max(worst, _check_attn(out, q, kc, vc, p, work.n_split,
                                       f"pos {p} ({_attn_runs(p, work.n_split)[0]} runs, n_split {work.n_split})"))
    print(f"\nG {H // KV} hd {hd} S {S}: worst error / bound {worst:.3g}")


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("H,KV", [(8, 1), (32, 8)])
def test_attn_decode_many_runs(rng, hd, H, KV):
    """A 20000-row cache: up to 256 runs for one KV head (its merge's lanes take 8 runs each) or
    33 (the cap of about two CTAs per SM on 132 SMs with 8 KV heads)."""
    from quantzoo.kernels import layer_ops as lo

    S = 20000
    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
    kc = torch.randn(KV, S, hd, device="cuda", generator=g).half()
    vc = torch.randn(KV, S, hd, device="cuda", generator=g).half()
    work = lo.DecodeWork(H, KV, hd, S, "cuda")
    for p in (2047, 16383, S - 1):
        q = (torch.randn(1, H, hd, device="cuda", generator=g) * 3).half()
        out = lo.attn_decode(q, kc, vc, torch.tensor([p], device="cuda"), work)
        _check_attn(out, q, kc, vc, p, work.n_split, f"pos {p}, n_split {work.n_split}")
    assert int(work.count.sum()) == 0   # every KV head's ticket counter reset for the next call


def test_bad_inputs():
    from quantzoo.kernels import layer_ops as lo

    h = torch.zeros(2, 8, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="w: shape"):
        lo.add_rms_norm(h, None, torch.ones(4, device="cuda", dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="multiple of 8"):
        lo.add_rms_norm(h[:, :6].contiguous(), None, torch.ones(6, device="cuda", dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="delta: dtype"):
        lo.add_rms_norm(h, h.float(), torch.ones(8, device="cuda", dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="gu: not contiguous"):
        lo.silu_mul(torch.zeros(4, 8, device="cuda", dtype=torch.float16).t())
    cache = torch.zeros(2 * 16 * 64 + 4, device="cuda", dtype=torch.float16)[4:].view(2, 16, 64)   # 8 bytes in
    work = lo.DecodeWork(4, 2, 64, 16, "cuda")
    with pytest.raises(ValueError, match="k_cache: its data must start at a 16-byte boundary"):
        lo.attn_decode(torch.zeros(1, 4, 64, device="cuda", dtype=torch.float16), cache, cache.clone(),
                       torch.zeros(1, dtype=torch.int64, device="cuda"), work)
    kc = torch.zeros(2, 16, 96, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="head_dim 96"):
        lo.qk_rope_store(torch.zeros(1, 6 * 96, device="cuda", dtype=torch.float16), None, kc[0], kc[0],
                         torch.zeros(1, dtype=torch.int64, device="cuda"), kc, kc, 2, 2, 1e-6)


def test_zero_rows_and_unaligned_inputs():
    """T = 0 rows: CuPy launches a grid of 0 blocks as 1 block, and add_rms_norm's block read row
    0 of an empty h (a null pointer): an illegal memory access that killed the CUDA context. Now
    the ops return their empty outputs. Inputs off the kernels' load width (add_rms_norm's h,
    delta, w: 16 bytes; silu_mul's gu and out: 4; attn_decode's q: 8 at head_dim 128) are refused
    by name: they were a 'misaligned address' fault, also fatal to the context."""
    from quantzoo.kernels import layer_ops as lo

    f16 = dict(device="cuda", dtype=torch.float16)
    w = torch.ones(64, **f16)
    empty = torch.empty(0, 64, **f16)
    assert lo.add_rms_norm(empty, None, w, 1e-6).shape == (0, 64)
    assert lo.add_rms_norm(empty, torch.empty(0, 64, **f16), w, 1e-6).shape == (0, 64)
    assert lo.silu_mul(empty).shape == (0, 32)
    assert lo.silu_mul(empty, torch.empty(0, device="cuda", dtype=torch.uint8)).shape == (0, 32)
    kc = torch.zeros(2, 16, 64, **f16)
    q = lo.qk_rope_store(torch.empty(0, 6 * 64, **f16), None, kc[0], kc[0],
                         torch.empty(0, dtype=torch.int64, device="cuda"), kc, kc.clone(), 2, 2, 1e-6)
    assert q.shape == (0, 2, 64)
    torch.cuda.synchronize()

    def odd(t):   # the same values one element (2 bytes) past an aligned address
        o = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
        return o.copy_(t)

    h = torch.randn(4, 64, **f16)
    with pytest.raises(ValueError, match="h: its data must start at a 16-byte boundary"):
        lo.add_rms_norm(odd(h), None, w, 1e-6)
    with pytest.raises(ValueError, match="delta: its data must start"):
        lo.add_rms_norm(h, odd(h), w, 1e-6)
    with pytest.raises(ValueError, match="w: its data must start"):
        lo.add_rms_norm(h, None, odd(w), 1e-6)
    with pytest.raises(ValueError, match="gu: its data must start at a 4-byte boundary"):
        lo.silu_mul(odd(h))
    with pytest.raises(ValueError, match="out: its data must start"):
        lo.silu_mul(h, out=odd(torch.empty(4, 32, **f16)))
    assert torch.equal(lo.silu_mul(odd(h), torch.empty(4 * 32 // 32 * 36, device="cuda", dtype=torch.uint8)),
                       lo.silu_mul(h))   # the Q8_1 variant reads element by element: any address
    kc = torch.randn(2, 16, 128, **f16)
    work = lo.DecodeWork(4, 2, 128, 16, "cuda")
    pos = torch.zeros(1, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="q: its data must start at a 8-byte boundary"):
        lo.attn_decode(odd(torch.randn(1, 4, 128, **f16)), kc, kc.clone(), pos, work)
    with pytest.raises(ValueError, match="k_cache: shape"):
        lo.attn_decode(torch.randn(1, 4, 128, **f16), kc[0], kc[0].clone(), pos, work)
    torch.cuda.synchronize()


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q5_1"])   # split and interleaved Q8_1 at M = 1
def test_model_q8_1_fusion_is_bit_identical(fmt):
    """A GGUF model's norms and SiLU writing Q8_1 for its linears (Model.q8_1_fusion) give the
    same logits, bit for bit, as the linears quantizing their fp16 inputs: prefill of 5 tokens
    (M = 5 mmvq), eager and graph decode."""
    from quantzoo.bench.model import synthetic_weights
    from quantzoo.model import build_model
    from quantzoo.model.config import ModelConfig

    cfg = ModelConfig(arch="qwen3", vocab_size=1000, hidden_size=512, intermediate_size=1536,
                      num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
                      rope_theta=1e6, max_position=4096, tie_word_embeddings=False, qk_norm=True)
    m = build_model(cfg, synthetic_weights(fmt, cfg, "cuda", seed=7), None, device="cuda")
    assert m.fused_ops and m.layers[0].qkv.q8_1_layout(1) in ("split", "interleaved")
    ids = [(53 * i + 5) % 1000 for i in range(12)]
    runs = {}
    for fusion in (True, False):
        m.q8_1_fusion = fusion
        for graph in (False, True):
            m.use_graph, m._graph = graph, None
            m.setup_cache(256)
            out = [m.prefill(ids[:5])]
            out += [m.decode_step(t, 5 + i) for i, t in enumerate(ids[5:])]
            runs[fusion, graph] = torch.stack(out)
    for graph in (False, True):
        assert torch.equal(runs[True, graph], runs[False, graph]), f"graph={graph}"


def test_model_glu_wgmma_beside_q8_1_down(monkeypatch):
    """A gate/up weight that takes wgmma below M = 9 while down still takes mmvq (WGMMA_SMALL_M:
    on a Qwen3-8B or 4B, Q8_0 gate/up from M = 5, down not until 7) keeps its GLU epilogue, and
    down quantizes its own input: made here on a small model with the size threshold lowered.
    The 5-token prefill calls matmul(glu=True) on wgmma once a layer, and its logits (and the
    decode's) are bit-identical with and without Q8_1 fusion."""
    from quantzoo import kernels
    from quantzoo.bench.model import synthetic_weights
    from quantzoo.kernels import gguf as G
    from quantzoo.model import build_model
    from quantzoo.model.config import ModelConfig

    cfg = ModelConfig(arch="qwen3", vocab_size=1000, hidden_size=512, intermediate_size=1536,
                      num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
                      rope_theta=1e6, max_position=4096, tie_word_embeddings=False, qk_norm=True)
    m = build_model(cfg, synthetic_weights("q8_0", cfg, "cuda", seed=3), None, device="cuda")
    lay = m.layers[0]
    monkeypatch.setattr(G, "WGMMA_MIN_NK", lay.gate_up.qt.shape[0] * lay.gate_up.qt.shape[1])   # down's is under it
    monkeypatch.setattr(G, "WGMMA_SMALL_M", {"q8_0": (5, 7, 8)})
    if not G.wgmma_ok(lay.gate_up.qt):
        pytest.skip("wgmma needs a Hopper GPU")
    assert lay.gate_up.q8_1_layout(5, glu=True) is None and lay.down.q8_1_layout(5) is not None
    assert lay.gate_up.q8_1_layout(4, glu=True) is not None
    glu_calls = []
    matmul = G.matmul

    def spy(x, qt, *a, **kw):
        glu_calls.append(bool(kw.get("glu")) and G.choose_path(x.shape[0], qt, x, glu=True) == "wgmma")
        return matmul(x, qt, *a, **kw)

    monkeypatch.setattr(G, "matmul", spy)
    monkeypatch.setattr(kernels, "PLANS", False)   # (the runner's replays would pass the spy by: kernels.replay)
    ids = [(41 * i + 7) % 1000 for i in range(9)]
    runs = {}
    for fusion in (True, False):
        m.q8_1_fusion = fusion
        m.use_graph, m._graph = False, None
        m.setup_cache(256)
        glu_calls.clear()
        out = [m.prefill(ids[:5])]
        assert glu_calls.count(True) == cfg.num_layers, (fusion, glu_calls)
        out += [m.decode_step(t, 5 + i) for i, t in enumerate(ids[5:])]
        runs[fusion] = torch.stack(out)
    assert torch.equal(runs[True], runs[False])


def test_model_dense_gate_up_feeds_q8_1_down(monkeypatch):
    """A dense (fp16) gate/up beside a GGUF down on mmvq -- a GGUF file's F16 fallback --: silu_mul
    writes down's input in Q8_1 (down.from_q8_1 once a layer in a decode step), not an fp16
    product that down would quantize again; only a GGUF gate/up on the wgmma path takes the
    fused GLU there (test_model_glu_wgmma_beside_q8_1_down)."""
    from quantzoo import kernels
    from quantzoo.bench.model import random_weight, synthetic_weights
    from quantzoo.kernels import gguf as G
    from quantzoo.model import build_model
    from quantzoo.model.config import ModelConfig

    cfg = ModelConfig(arch="qwen3", vocab_size=1000, hidden_size=512, intermediate_size=1536,
                      num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
                      rope_theta=1e6, max_position=4096, tie_word_embeddings=False, qk_norm=True)
    w = synthetic_weights("q8_0", cfg, "cuda", seed=4)
    gen = torch.Generator(device="cuda").manual_seed(5)
    for i in range(cfg.num_layers):
        for name in ("gate_proj", "up_proj"):
            w[f"model.layers.{i}.mlp.{name}.weight"] = random_weight("fp16", cfg.intermediate_size, cfg.hidden_size,
                                                                     "cuda", gen)
    m = build_model(cfg, w, None, device="cuda")
    lay = m.layers[0]
    assert lay.down.q8_1_layout(1) is not None and not lay.gate_up.gguf_fp16_input(1, glu=True)
    calls = []
    real = G.matmul_q8_1

    def spy(xq, qt, *a, **kw):
        calls.append(qt)
        return real(xq, qt, *a, **kw)

    monkeypatch.setattr(G, "matmul_q8_1", spy)
    monkeypatch.setattr(kernels, "PLANS", False)   # (the runner's replays would pass the spy by: kernels.replay)
    ids = [(31 * i + 9) % 1000 for i in range(6)]
    m.use_graph = False
    m.setup_cache(64)
    m.prefill(ids[:5])
    calls.clear()
    m.decode_step(ids[5], 5)
    assert [any(qt is la.down.qt for qt in calls) for la in m.layers] == [True] * cfg.num_layers, calls


@pytest.mark.parametrize("fmt", ["fp16", "q4_0", "awq"])
def test_model_fused_equals_torch_ops(fmt):
    """A small Qwen3 (hd 128, 4 query heads per KV head, random norm weights) in `fmt`: fused
    layer ops vs the torch ops on the same weights, prefill and teacher-forced decode (eager and
    graph). The two differ by rsqrt and reduction order (an ulp here and there), which Q8_1
    activation rounding (q4_0) can turn into a changed int8 code; the bounds below say how much."""
    from quantzoo.bench.model import synthetic_weights
    from quantzoo.model import build_model
    from quantzoo.model.config import ModelConfig

    cfg = ModelConfig(arch="qwen3", vocab_size=1000, hidden_size=512, intermediate_size=1536,
                      num_layers=3, num_heads=8, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6,
                      rope_theta=1e6, max_position=4096, tie_word_embeddings=False, qk_norm=True)
    w = synthetic_weights(fmt, cfg, "cuda", seed=5)
    gen = torch.Generator(device="cuda").manual_seed(6)
    for name in list(w):
        if name.endswith("norm.weight"):
            w[name] = (torch.rand(w[name].shape, device="cuda", generator=gen) + 0.5).half()
    fused = build_model(cfg, w, None, device="cuda", fused_ops=True)
    plain = build_model(cfg, w, None, device="cuda", fused_ops=False)
    assert fused.fused_ops and not plain.fused_ops
    ids = [(37 * i + 11) % 1000 for i in range(40)]
    a, b = fused.logits(ids), plain.logits(ids)
    scale = float(b.abs().max())
    # fp16/awq measured <= 0.8 % of the largest logit on the H100, q4_0 up to 1.6 %: its Q8_1
    # activation quantization turns a 1-ulp fp16 difference into a changed int8 code. A wrong
    # cache row, position or head gives differences of the order of the logits themselves.
    assert float((a - b).abs().max()) < 3e-2 * scale
    for graph in (False, True):
        for m in (fused, plain):
            m.use_graph = graph
            m._graph = None
            m.setup_cache(512)
            m.prefill(ids[:9])
        steps, agree = [], 0
        for i, t in enumerate(ids[9:25]):
            lf, lp = fused.decode_step(t, 9 + i).float(), plain.decode_step(t, 9 + i).float()
            steps.append(float((lf - lp).abs().max()))
            top2 = torch.topk(lp, 2).values
            if float(top2[0] - top2[1]) > 0.05 * scale:
                assert int(lf.argmax()) == int(lp.argmax())
                agree += 1
        assert max(steps) < 3e-2 * scale, (graph, steps)
        print(f"\n{fmt} graph={graph}: max |diff| per step {max(steps):.3g} of {scale:.3g}, {agree} decisive steps")
        assert agree >= 2, "too few decisive steps to compare the argmax"
        if graph:
            assert fused._graph is not None


@pytest.mark.parametrize("fmt", ["q4_0", "q5_0", "awq"])
def test_model_glu_fusion_is_bit_identical(fmt, monkeypatch):
    """A model's prefill with silu(gate) * up in the gate/up matmul (Linear.glu ->
    kernels.gguf / kernels.awq matmul(glu=True)) gives the same logits, bit for bit, as the
    product followed by layer_ops.silu_mul. The wgmma path is forced onto this small model
    (its weight-size floors set to 0) so that the fused epilogue runs; the gate/up launch
    (K = 512) does not split K, so both orders of work sum every output the same way."""
    from quantzoo.bench.model import synthetic_weights
    from quantzoo.kernels import awq, gguf
    from quantzoo.model import build_model
    from quantzoo.model.config import ModelConfig

    cfg = ModelConfig(arch="qwen3", vocab_size=1000, hidden_size=512, intermediate_size=1536,
                      num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
                      rope_theta=1e6, max_position=4096, tie_word_embeddings=False, qk_norm=True)
    m = build_model(cfg, synthetic_weights(fmt, cfg, "cuda", seed=3), None, device="cuda")
    mod = awq if fmt == "awq" else gguf
    for name in ("WGMMA_MIN_NK", "WGMMA_MID_MIN_NK", "WGMMA_LOW_MIN_NK"):   # every weight size
        if hasattr(mod, name):
            monkeypatch.setattr(mod, name, 0)
    gu = m.layers[0].gate_up.qt
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma path runs on Hopper (compute capability 9.0) only")
    assert mod.choose_path(40, gu) == "wgmma"
    ids = [(29 * i + 3) % 1000 for i in range(40)]
    fused = m.logits(ids)
    monkeypatch.setattr(mod, "GLU_MATMUL", False)
    assert torch.equal(fused, m.logits(ids))


@pytest.mark.parametrize("fmt", ["fp16", "q4_0", "q8_0", "awq"])
def test_model_repeated_prefill_is_bit_identical(fmt, monkeypatch):
    """Once a length's plans stand, the runner's pass over it replays every kernel linear's
    recorded launches (kernels.replay) and launches its layer ops packed (layer_ops.Repeated),
    checking nothing; its logits (every position) equal, bit for bit, the first pass's and those
    of a pass whose every call goes through the checked, dispatched ops (plans off, the public
    layer ops). T = 5 (mmvq from Q8_1 for GGUF), 40 and 300; replays and packed launches are
    counted, so that the equality is not vacuous."""
    from quantzoo import kernels
    from quantzoo.bench.model import synthetic_weights
    from quantzoo.kernels import layer_ops as lo
    from quantzoo.model import build_model
    from quantzoo.model.config import ModelConfig

    class Checked:   # the public ops, as the runner called them before layer_ops.Repeated
        add_rms_norm, qk_rope_store, silu_mul = (staticmethod(lo.add_rms_norm), staticmethod(lo.qk_rope_store),
                                                 staticmethod(lo.silu_mul))

    cfg = ModelConfig(arch="qwen3", vocab_size=1000, hidden_size=512, intermediate_size=1536,
                      num_layers=3, num_heads=8, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
                      rope_theta=1e6, max_position=4096, tie_word_embeddings=False, qk_norm=True)
    m = build_model(cfg, synthetic_weights(fmt, cfg, "cuda", seed=11), None, device="cuda")
    assert m.fused_ops
    hits = {"replay": 0, "packed": 0}
    real_replay, real_launch = kernels.replay, lo.Repeated._launch

    def replay(*a):
        ok = real_replay(*a)
        hits["replay"] += ok
        return ok

    def packed(pl, p):
        hits["packed"] += 1
        real_launch(pl, p)

    monkeypatch.setattr(kernels, "replay", replay)
    monkeypatch.setattr(lo.Repeated, "_launch", staticmethod(packed))
    gen = torch.Generator().manual_seed(12)
    repeated = m._repeated
    kernel_linears = sum(ln.qt is not None and ln.mode == "emulate" for ln in m._all_linears())
    assert kernel_linears == (0 if fmt == "fp16" else 4 * cfg.num_layers + (fmt != "awq"))   # (AWQ: an fp16 lm_head)
    for T in (5, 40, 300):
        ids = torch.randint(0, 1000, (T,), generator=gen).tolist()
        first = m.logits(ids)
        # a workspace grown in a length's first pass drops the plans recorded before it, which
        # the second records again (model.generate's warm_up prefills until nothing grows)
        m.logits(ids)
        hits.update(replay=0, packed=0)
        again = m.logits(ids)
        # every layer's 2 norms and RoPE, and the final norm (SiLU too where not in the matmul)
        assert hits["packed"] >= 3 * cfg.num_layers + 1, (T, hits)
        assert hits["replay"] == kernel_linears, (T, hits)   # each once a pass
        monkeypatch.setattr(kernels, "PLANS", False)
        m._repeated = Checked()
        hits.update(replay=0, packed=0)
        checked = m.logits(ids)
        assert hits == {"replay": 0, "packed": 0}
        m._repeated = repeated
        monkeypatch.setattr(kernels, "PLANS", True)
        assert torch.equal(first, again) and torch.equal(again, checked), (T, fmt)
