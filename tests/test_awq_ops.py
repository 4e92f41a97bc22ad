"""AWQ CUDA entry points, the parts that run without a GPU: input validation happens in Python
before any launch (a clear ValueError naming the argument), dispatch names, kernel declarations."""
import re

import numpy as np
import pytest
import torch

from quantzoo import ops
from quantzoo.formats import get
from quantzoo.kernels import awq, workspaces


def tensors(k=576, n=576, g=64):
    qt = get("awq").quantize((np.random.default_rng(0).standard_normal((n, k)) * 0.02).astype(np.float32),
                             group_size=g)
    d = qt.to("cpu").data
    t = {key: torch.from_numpy(np.ascontiguousarray(v)) for key, v in d.items()}
    return qt, t["qweight"], t["scales"], t["qzeros"]


def test_group_size_and_shape_errors():
    _, qw, sc, qz = tensors()
    x = torch.zeros(2, 576, dtype=torch.float16)
    with pytest.raises(ValueError, match="group_size"):          # K = 9*64 with g128
        awq.gemm(x, qw, sc, qz, 128)
    with pytest.raises(ValueError, match="group_size: 48"):
        awq.gemm(x, qw, sc, qz, 48)
    # a g64 weight (9 groups over K = 576) called with 32: the group size is named, not qzeros
    with pytest.raises(ValueError, match="group_size: 32 disagrees with scales' 9 groups over qweight's K=576"):
        awq.gemm(x, qw, sc, qz, 32)
    with pytest.raises(ValueError, match="awq: group_size=32 disagrees with scales' 9 group rows"):
        get("awq").from_arrays(qw.numpy(), qz.numpy(), sc.numpy(), group_size=32)
    with pytest.raises(ValueError, match="qzeros: shape"):
        awq.gemm(x, qw, sc, qz[:3], 64)
    with pytest.raises(ValueError, match="scales: shape"):
        awq.gemm(x, qw, sc[:, :-8], qz, 64)
    with pytest.raises(ValueError, match="scales: dtype"):
        awq.gemm(x, qw, sc.float(), qz, 64)
    with pytest.raises(ValueError, match="qweight: dtype"):
        awq.gemm(x, qw.to(torch.int64), sc, qz, 64)
    with pytest.raises(ValueError, match="qweight: must be 2-D"):
        awq.gemm(x, qw.view(-1), sc, qz, 64)
    with pytest.raises(ValueError, match="qweight: must be contiguous"):
        awq.gemm(x, qw.T.contiguous().T, sc, qz, 64)
    with pytest.raises(ValueError, match="scales: 7 groups"):
        awq.check_weights(qw, sc[:7], qz[:7])
    # an int, said with its repr: "64" was refused as "64 is not supported", 64.0 passed (64.0 == 64)
    for bad in ("64", 64.0, True):
        with pytest.raises(ValueError, match=re.escape(f"group_size: {bad!r} is not supported; choose an int, "
                                                       "one of (32, 64, 128)")):
            ops.awq_gemm(x, qw, sc, qz, bad)
    with pytest.raises(ValueError, match="qweight: on cpu"):   # a numpy integer is an int: past the check
        ops.awq_gemm(x, qw, sc, qz, np.int64(64))


def test_cpu_tensors_are_refused():
    _, qw, sc, qz = tensors()
    x = torch.zeros(2, 576, dtype=torch.float16)
    with pytest.raises(ValueError, match="qweight: on cpu, expected a CUDA tensor"):
        awq.gemm(x, qw, sc, qz, 64)
    with pytest.raises(ValueError, match="qweight: on cpu"):
        ops.awq_gemm(x, qw, sc, qz, 64)
    with pytest.raises(ValueError, match="qweight: on cpu"):
        ops.awq_dequantize(qw, sc, qz)


def test_negated_views_are_refused(monkeypatch):
    """A tensor with torch's negative bit (z.conj().imag, torch._neg_view) holds the negated values
    in its memory, which the kernels read and write by address: x or a weight tensor went in with
    its sign flipped and an `out` read back as -y, without a word. Each is refused by name before a
    launch (CPU tensors; for x and out, the weight check is stubbed to accept CPU tensors)."""
    qt, qw, sc, qz = tensors()
    k = n = 576
    for name in ("qweight", "scales", "qzeros"):
        t = {"qweight": qw, "scales": sc, "qzeros": qz}
        t[name] = torch._neg_view(t[name])
        with pytest.raises(ValueError, match=f"{name}: .*negative bit"):
            awq.gemm(torch.zeros(2, k, dtype=torch.float16), t["qweight"], t["scales"], t["qzeros"], 64)
    monkeypatch.setattr(awq, "_unpack_qt", lambda q: (qw, sc, qz, k, n, 64))   # as CUDA tensors pass
    x = torch.zeros(2, k, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"x: .*negative bit"):
        awq.matmul(torch._neg_view(x), qt)
    with pytest.raises(ValueError, match=r"out: .*negative bit"):
        awq.matmul(x, qt, out=torch._neg_view(torch.zeros(2, n, dtype=torch.float16)))


def test_qt_checks():
    qt, *_ = tensors()
    with pytest.raises(ValueError, match="qt: format 'q4_0'"):
        awq.matmul(torch.zeros(1, 576, dtype=torch.float16), get("q4_0").quantize(np.zeros((8, 576), np.float32)))
    with pytest.raises(ValueError, match=r"qt: its arrays are ndarray on the CPU; move the weight with qt.to\(.cuda.\)"):
        awq.matmul(torch.zeros(1, 576, dtype=torch.float16), qt)


def test_n_not_multiple_of_8():
    qt, qw, sc, qz = tensors()
    bad = type(qt)("awq", (572, 576), {"qweight": qw, "qzeros": qz, "scales": sc}, {"group_size": 64})
    with pytest.raises(ValueError, match="N=572 out_features must be a multiple of 8"):
        awq.matmul(torch.zeros(1, 576, dtype=torch.float16), bad)
    with pytest.raises(ValueError, match="qt: shape"):
        awq.matmul(torch.zeros(1, 576, dtype=torch.float16),
                   type(qt)("awq", (568, 576), {"qweight": qw, "qzeros": qz, "scales": sc}, {"group_size": 64}))


def test_group_size_inferred_from_scales():
    _, qw, sc, qz = tensors(k=256, n=64, g=32)
    with pytest.raises(ValueError, match="on cpu"):   # shapes pass (G = 256/8 = 32), then device
        awq.check_weights(qw, sc, qz)


def test_choose_path_and_sources():
    names = {awq.choose_path(m) for m in (1, 2, 8, 9, 16, 100, 256, 1000, 4096)}
    assert names <= {"gemv", "strip", "small", "mma", "dequant+cublas"}
    assert awq.choose_path(1) == "strip" and awq.choose_path(2) == "small"   # 4096 x 4096
    strip = set(awq.SOURCES["awq_strip.cu"])
    for g in (32, 64, 128):   # an instance whose ring depth divides the group's k-steps, each form
        assert any((g // 8) % d == 0 and f"awq_strip_kernel<{awq.STRIP_WARPS}, {d}>" in strip for d in awq.STRIP_D)
        assert any((g // 8) % d == 0 and f"awq_strip_kernel<{awq.CLUSTER_WARPS}, {d}, {awq.CLUSTER_SIZE}>" in strip
                   for d in awq.STRIP_D)
    small = set(awq.SOURCES["awq_small.cu"])
    for m in range(1, awq.SMALL_MAX_M + 1):
        cfg = awq.small_config(m, 4096)
        assert m <= 8 * cfg[0] and "awq_small_kernel<{}, {}, {}, {}, {}, {}>".format(*cfg) in small
    assert awq.choose_path(10**6) == "dequant+cublas"
    assert awq.GEMV_DEFAULT in awq.GEMV_CFGS
    assert all(cfg in awq.GEMV_CFGS for cfg, _ in awq.GEMV_TUNED.values())
    decl = set(awq.SOURCES["awq_mma.cu"])
    for m in (1, 8, 16, 17, 32, 33, 1000):
        for n in (8, 1024, 12288):
            mt, ng, occ = awq.mma_config(m, n)
            assert f"awq_mma_kernel<{mt}, {ng}, {occ}>" in decl


def test_split_plan():
    for tiles in (1, 4, 16, 96, 600):
        for k in (32, 576, 4096, 12288):
            for min_rows in (0, 128):
                s, per = awq._splits(tiles, k, 32, 528, min_rows)
                assert per % 32 == 0 and s * per >= k and (s - 1) * per < k
                assert per >= min(min_rows, -(-k // 32) * 32)
    assert awq._splits(192, 4096, 32, 264)[0] == 4      # 768 blocks in 3 waves of 264 beat 1 wave of 192
    assert awq._splits(16, 4096, 32, 528, 128)[0] == 32


def test_small_split_plan():
    """small_plan: rows per split a multiple of 16 covering K once, every warp >= SMALL_MIN_STEPS
    k-steps unless K itself is shorter; the tuned table names compiled configs only."""
    for tiles in (1, 5, 32, 96, 192):
        for k in (32, 576, 4096, 12288):
            for ks in (1, 2, 4, 8):
                s, per = awq.small_plan(tiles, k, ks, 132)
                assert per % 16 == 0 and s * per >= k and (s - 1) * per < k, (tiles, k, ks, s, per)
                assert s == 1 or per // 16 >= ks * awq.SMALL_MIN_STEPS
    assert awq.small_plan(32, 12288, 8, 132)[0] == 8      # two 8-warp blocks per SM
    decl = set(awq.SOURCES["awq_small.cu"])
    for (k, n, mb), (cfg, splits) in awq.SMALL_TUNED.items():
        assert cfg[0] == mb or (mb == 1 and cfg[0] == 2)
        assert "awq_small_kernel<{}, {}, {}, {}, {}, {}>".format(*cfg) in decl and splits >= 1


def test_small_dispatch_thresholds():
    """Where the bench put them: small up to M = 8 everywhere (but gemv at M = 1 for N >= 16384),
    to 16 for weights up to 4096 x 4096; mma beyond (without a Hopper device: no wgmma)."""
    shape = lambda n, k: type("S", (), {"shape": (n, k)})()  # noqa: E731
    assert [awq.choose_path(m, shape(12288, 4096)) for m in (1, 4, 5, 8, 9)] == ["small"] * 4 + ["mma"]
    assert [awq.choose_path(m, shape(24576, 4096)) for m in (1, 8, 9, 16)] == ["gemv", "small"] + ["mma"] * 2
    assert [awq.choose_path(m, shape(1024, 4096)) for m in (1, 8, 16, 17)] == ["small"] * 3 + ["mma"]


def test_strip_dispatch_thresholds():
    """M = 1 takes the strip kernel on the weights it won on (1024 <= K <= 5120, 3072 <= N <= 8192: the
    Qwen3-8B qkv and o_proj among them), not on 12288 -> 4096 (down), 8192 -> 4096, 4096 -> 2048,
    4096 -> 12288, nor where the GEMV takes wide weights; M = 2 stays on awq_small."""
    shape = lambda n, k: type("S", (), {"shape": (n, k)})()  # noqa: E731
    for n, k in ((4096, 4096), (6144, 4096), (8192, 4096), (3072, 4096), (5120, 5120), (4096, 1024)):
        assert awq.choose_path(1, shape(n, k)) == "strip" and awq.choose_path(2, shape(n, k)) == "small"
    for n, k in ((4096, 12288), (4096, 8192), (12288, 4096), (2048, 4096), (1024, 4096), (4096, 512)):
        assert awq.choose_path(1, shape(n, k)) == "small", (n, k)
    assert awq.choose_path(1, shape(24576, 4096)) == "gemv"


def test_strip_cluster_dispatch_thresholds(monkeypatch):
    """On a device with thread-block clusters, M = 1 takes strip-cluster on the weights it won on
    (1024 <= K, 512 <= N <= 4096, N * K <= 8192 x 4096, not N = 4096 with K < 4096): Qwen3-8B's
    o_proj and k / v, the small Qwen3 models' o_proj and down; the strip rule keeps 1024 -> 4096,
    2048 -> 4096 and N past 4096 (the fused qkv), awq_small 12288 -> 4096 (down). Without clusters,
    or with no device, nothing changes; M = 2 stays on awq_small."""
    shape = lambda n, k: type("S", (), {"shape": (n, k)})()  # noqa: E731
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(awq, "clusters_available", lambda dev: True)
    monkeypatch.setattr(awq, "wgmma_available", lambda dev: True)
    won = ((4096, 4096), (1024, 4096), (2048, 4096), (1024, 1024), (2048, 1024), (1024, 2048), (512, 4096),
           (3072, 4096), (3072, 3072), (4096, 6144), (4096, 8192), (1024, 8192), (2048, 8192), (1024, 12288),
           (2048, 12288), (1024, 3072), (2048, 6144))
    for n, k in won:
        assert awq.choose_path(1, shape(n, k), cuda) == "strip-cluster", (n, k)
        assert awq.choose_path(1, shape(n, k)) != "strip-cluster" and awq.choose_path(2, shape(n, k), cuda) == "small"
    for n, k in ((4096, 1024), (4096, 2048), (6144, 4096), (5120, 5120), (8192, 4096)):
        assert awq.choose_path(1, shape(n, k), cuda) == "strip", (n, k)
    for n, k in ((4096, 12288), (256, 4096), (1024, 512), (4096, 16384)):
        assert awq.choose_path(1, shape(n, k), cuda) == "small", (n, k)
    monkeypatch.setattr(awq, "clusters_available", lambda dev: False)
    assert awq.choose_path(1, shape(4096, 4096), cuda) == "strip"
    assert awq.choose_path(1, shape(1024, 1024), cuda) == "small"


def test_strip_launch_dry_run(monkeypatch):
    """What _strip launches (meta tensors; launches recorded): for every group size, a compiled
    awq_strip_kernel<STRIP_WARPS, D> whose ring depth D divides the group's G / 8 k-steps (the
    kernel's loop needs it: D = 8 at G = 32 would run one 8-step round over a 4-step group and
    load past the warp's last step), D = 8 where it divides (the measured instance); one
    32 * STRIP_WARPS-thread block per 8 column words, the last one's lanes clamped where N / 8 %
    8 != 0; K, N, G as int32. K = 2^31 - G, refused by name on the split-K paths
    (test_split_k_rows_past_2_31_dry_run), is taken: no split, so no split end to overflow, and
    every offset in the kernel is formed in 64 bits. M = 2 is refused before any launch. The
    cluster form (path 'strip-cluster'): awq_strip_kernel<CLUSTER_WARPS, D, CLUSTER_SIZE>,
    CLUSTER_SIZE blocks per 8 column words (the kernel's __cluster_dims__ groups them), and
    refused by name, before any launch, on a device without clusters."""
    calls = []
    monkeypatch.setattr(awq, "_kernel", lambda src, name: (src, name))
    monkeypatch.setattr(awq, "_launch", lambda kern, grid, block, args, smem=0: calls.append((kern, grid, block, args)))
    monkeypatch.setattr(awq, "clusters_available", lambda dev: True)
    meta = dict(device="meta")
    forms = (("strip", awq.STRIP_WARPS, 1), ("strip-cluster", awq.CLUSTER_WARPS, awq.CLUSTER_SIZE))
    for path, warps_want, cl in forms:
        for g in (32, 64, 128):
            for k, n in ((g, 8), (9 * g, 72), (18 * g, 8 * 43), (4096, 4096), (2**31 - g, 32)):
                qw = torch.empty((k, n // 8), dtype=torch.int32, **meta)
                sc = torch.empty((k // g, n), dtype=torch.float16, **meta)
                qz = torch.empty((k // g, n // 8), dtype=torch.int32, **meta)
                calls.clear()
                y = awq._gemm(torch.empty((1, k), dtype=torch.float16, **meta), qw, sc, qz, k, n, g, None, path)
                assert y.shape == (1, n) and len(calls) == 1, (g, k, n, calls)
                (src, name), grid, block, args = calls[0]
                assert src == "awq_strip.cu" and name in awq.SOURCES[src], name
                warps, d, cl_got = re.fullmatch(r"awq_strip_kernel<(\d+), (\d+)(?:, (\d+))?>", name).groups()
                assert int(warps) == warps_want and int(d) in awq.STRIP_D and int(cl_got or 1) == cl, (path, name)
                assert (g // 8) % int(d) == 0 and int(d) == (8 if g >= 64 else 4), (g, name)
                assert grid == (cl * -(-n // 64),) and block == (32 * warps_want,), (n, grid, block)
                assert [type(a) for a in args[5:]] == [np.int32] * 3 and [int(a) for a in args[5:]] == [k, n, g]
            calls.clear()
            with pytest.raises(ValueError, match=f"path: '{path}' takes M = 1, got M=2"):
                awq._gemm(torch.empty((2, 4096), dtype=torch.float16, **meta),
                          torch.empty((4096, 512), dtype=torch.int32, **meta),
                          torch.empty((4096 // g, 4096), dtype=torch.float16, **meta),
                          torch.empty((4096 // g, 512), dtype=torch.int32, **meta), 4096, 4096, g, None, path)
            assert not calls
    monkeypatch.setattr(awq, "clusters_available", lambda dev: False)
    with pytest.raises(ValueError, match=r"^path: 'strip-cluster' needs thread-block clusters \(compute capability "
                                         r"9\.0 or newer\), which meta lacks$"):
        awq._gemm(torch.empty((1, 4096), dtype=torch.float16, **meta),
                  torch.empty((4096, 512), dtype=torch.int32, **meta),
                  torch.empty((32, 4096), dtype=torch.float16, **meta),
                  torch.empty((32, 512), dtype=torch.int32, **meta), 4096, 4096, 128, None, "strip-cluster")
    assert not calls


def test_wgmma_dispatch_on_hopper_only(monkeypatch):
    """wgmma takes 5 <= M <= WGMMA_MAX_M (2048) on weights of at least 4096 x 4096, 5 <= M <= 256
    from 2048 x 4096 and 17 <= M <= 256 from 1024 x 4096 (64-token tiles past M = 64 there), with
    glu from M = 2 on 2048 x 12288 and up and from M = 5 on 1024 x 6144, with N % 32 == 0, and
    only where the device is a Hopper GPU; elsewhere (or with no device) the rules above stand."""
    shape = lambda n, k: type("S", (), {"shape": (n, k)})()  # noqa: E731
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(awq, "wgmma_available", lambda dev: True)
    monkeypatch.setattr(awq, "_sm_count", lambda dev: 132)
    top = awq.WGMMA_MAX_M
    assert top == 2048
    assert [awq.choose_path(m, shape(12288, 4096), cuda) for m in (4, 5, 16, 17, 256, 257, 512, 1025, top, top + 1)] \
        == ["small"] + ["wgmma"] * 8 + ["dequant+cublas"]
    assert [awq.choose_path(m, shape(4096, 4096), cuda) for m in (4, 5, 16, 32, 33, 512, 1024, top, top + 1)] == \
        ["small"] + ["wgmma"] * 7 + ["dequant+cublas"]
    assert [awq.choose_path(m, shape(2048, 4096), cuda) for m in (4, 5, 16, 17, 256, 257)] == \
        ["small"] + ["wgmma"] * 4 + ["dequant+cublas"]
    assert [awq.choose_path(m, shape(2016, 4096), cuda) for m in (5, 16, 17)] == ["small"] * 2 + ["wgmma"]
    assert [awq.choose_path(m, shape(1024, 4096), cuda) for m in (8, 16, 17, 64, 65, 128, 256, 257)] == \
        ["small"] * 2 + ["wgmma"] * 5 + ["dequant+cublas"]
    assert [awq.choose_path(m, shape(2048, 1024), cuda) for m in (17, 96, 97)] == ["mma"] * 2 + ["dequant+cublas"]
    assert [awq.choose_path(top, shape(n, k), cuda) for n, k in ((24576, 4096), (4096, 12288), (6144, 4096))] \
        == ["wgmma"] * 3
    assert awq.choose_path(128, shape(1024, 2048), cuda) == "dequant+cublas"   # too small a weight
    # glu=True: from M = 2 on 2048 x 12288 and up, to M = 16 from 1024 x 6144 (session 54)
    for n, k in ((24576, 4096), (19456, 2560), (12288, 2048)):
        assert [awq.choose_path(m, shape(n, k), cuda, glu=True) for m in (2, 4, 16, 17)] == ["wgmma"] * 4, (n, k)
        assert awq.choose_path(1, shape(n, k), cuda, glu=True) == awq.choose_path(1, shape(n, k), cuda) != "wgmma"
    assert [awq.choose_path(m, shape(12288, 2048), cuda) for m in (2, 4, 5)] == ["small"] * 2 + ["wgmma"]
    assert [awq.choose_path(m, shape(6144, 1024), cuda, glu=True) for m in (4, 5, 16, 17, 96)] == \
        ["small"] + ["wgmma"] * 4
    assert [awq.choose_path(m, shape(6144, 1024), cuda) for m in (5, 16, 17)] == ["small"] * 2 + ["wgmma"]
    assert awq.choose_path(8, shape(6112, 1024), cuda, glu=True) == "small"   # under 1024 x 6144
    assert awq.choose_path(2, shape(24544, 4096), cuda, glu=True) == "small"  # N % 64 != 0: no GLU epilogue
    assert awq.choose_path(128, shape(12296, 4096), cuda) == "mma"             # N % 32 != 0: no TMA rows
    assert awq.choose_path(128, shape(12288, 4096)) == "mma"                   # no device given
    assert awq.choose_path(128, shape(12288, 4096), torch.device("cpu")) == "mma"
    monkeypatch.setattr(awq, "wgmma_available", lambda dev: False)
    assert awq.choose_path(128, shape(12288, 4096), cuda) == "mma"
    assert [awq.wgmma_config(m)[1] for m in (1, 16, 17, 32, 33, 64, 65, 128, 129, 512)] == \
        [16, 16, 32, 32, 64, 64, 128, 128, 256, 256]
    assert {awq.wgmma_config(m) for m in (1, 8, 16, 17, 32, 33, 512)} <= set(awq.WGMMA_CFGS)
    # every config dispatch can pick has its instance, plain and GLU (matmul(glu=True), which
    # needs two warpgroups: gate and up)
    assert {awq.wgmma_config(m, 24576, 4096, 132) for m in range(1, top + 1)} <= set(awq.WGMMA_CFGS)
    glu = {awq.wgmma_config(m, 24576, 4096, 132, glu=True) for m in range(1, top + 1)}
    assert glu <= set(awq.WGMMA_GLU_CFGS) and all(c[0] == 2 for c in glu)
    assert [awq.wgmma_config(m, glu=True)[1] for m in (16, 17, 64, 65, 129)] == [16, 32, 64, 128, 256]
    # mid-size weights (under WGMMA_MIN_NK) past M = 64: 64-token tiles, one instance each way
    for n, k in ((1024, 4096), (2560, 4096), (6144, 2048)):
        assert {awq.wgmma_config(m, n, k, 132) for m in range(65, awq.WGMMA_MID_MAX_M + 1)} == {(1, 64, 6, 2)}
        assert {awq.wgmma_config(m, n, k, 132, glu=True) for m in (65, 256)} == {(2, 64, 6)}
        assert awq.wgmma_config(awq.WGMMA_MID_MAX_M + 1, n, k, 132)[1] != 64
    assert (1, 64, 6, 2) not in {awq.wgmma_config(m, 4096, 4096, 132) for m in range(65, 257)}
    assert (1, 64, 6, 2) in awq.WGMMA_CFGS and (2, 64, 6) in awq.WGMMA_GLU_CFGS


def test_gpu_tier_reaches_its_kernels(monkeypatch):
    """The dispatch facts GPU tests rely on to reach a kernel, pinned on the CPU (a Hopper
    device faked) so that a threshold change shows here first: test_awq_gpu's mma test runs
    1024 -> 2048 at M = 20 as dispatch's mma (2, 2, 1) (M = 17-32, 2048 <= N < 8192; too small a
    weight for wgmma); its GLU test's 2048 -> 8704 at M = 20 is dispatch's wgmma with the
    (2, 32, 12) GLU instance; test_pdl_gpu's decode MLP at M = 1 sends gate/up (2F >= 16384
    columns) to the GEMV and down to awq_small."""
    shape = lambda n, k: type("S", (), {"shape": (n, k)})()  # noqa: E731
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(awq, "wgmma_available", lambda dev: True)
    assert {awq.mma_config(m, n) for m in range(17, 33) for n in range(2048, 8192, 8)} \
        == {(2, 2, 1)}
    assert awq.choose_path(20, shape(2048, 1024), cuda) == "mma" == awq.choose_path(20, shape(2048, 1024))
    assert awq.choose_path(20, shape(8704, 2048), cuda) == "wgmma"
    assert awq.wgmma_config(20, 8704, 2048, 132, glu=True) == (2, 32, 12) in awq.WGMMA_GLU_CFGS
    monkeypatch.setattr(awq, "clusters_available", lambda dev: False)
    for d, f in ((1024, 8192), (4096, 12288)):
        assert awq.choose_path(1, shape(2 * f, d), cuda) == "gemv" == awq.choose_path(1, shape(2 * f, d))
        assert awq.choose_path(1, shape(d, f), cuda) == "small"
    monkeypatch.setattr(awq, "clusters_available", lambda dev: True)
    assert awq.choose_path(1, shape(1024, 1024), cuda) == "strip-cluster"   # test_pdl_gpu's square chain
    assert awq.choose_path(1, shape(1024, 8192), cuda) == "strip-cluster"   # ... and its D = 1024 MLP's down
    assert awq.choose_path(1, shape(4096, 4096), cuda) == "strip-cluster"   # its strip chains
    assert awq.choose_path(1, shape(5120, 5120), cuda) == "strip"
    assert awq.gemv_config(24576, 4096) == ((4, 4, 4), 4)


def test_wgmma_token_tile_choice():
    """Above M = 128 wgmma_tiles.config takes T = 128 or 256 by its cost model; on the H100
    (132 SMs) it must pick the faster of the two measured (GGUF q4_0, us, bench/NOTES.md session
    17) wherever they were more than 5 % apart. T = 256 at M not a multiple of 256 was timed on x
    padded to the next multiple: the work of a tile shifted back to end at row M."""
    from quantzoo.kernels import wgmma_tiles as wt

    measured = {   # (K, N, M): (T = 256, T = 128)
        (4096, 12288, 288): (90.5, 71.5), (4096, 12288, 384): (90.4, 76.4), (4096, 12288, 512): (90.3, 97.2),
        (4096, 12288, 640): (130.6, 113.4), (4096, 12288, 768): (129.0, 137.1),
        (12288, 4096, 448): (77.9, 101.6), (12288, 4096, 512): (79.9, 94.2), (12288, 4096, 640): (122.6, 134.3),
        (4096, 4096, 512): (35.3, 39.9), (4096, 4096, 640): (45.7, 49.9), (4096, 6144, 288): (47.1, 50.2),
        (4096, 6144, 640): (70.9, 55.6), (4096, 6144, 768): (71.4, 74.7),
    }
    for (k, n, m), (t256, t128) in measured.items():
        if abs(t256 - t128) > 0.05 * min(t256, t128):
            assert wt.config(m, n, k, 132)[1] == (256 if t256 < t128 else 128), (k, n, m)
    assert wt.config(100, 12288, 4096, 132)[1] == 128 and wt.config(300)[1] == 256   # no shape: 256
    assert [wt.x_rows(m, 256) for m in (1, 200, 256, 300)] == [1, 200, 256, 256]


def test_wgmma_schedule():
    """wgmma_tiles.schedule: with no more tiles than slots every tile is split to fill a wave;
    with more, whole waves walk all of K and only the last wave's tiles are split (at least
    MIN_STAGES stages each), every split non-empty; forced splits / whole tiles are honoured."""
    from quantzoo.kernels import wgmma_tiles as wt

    slots = 132
    for m in (17, 64, 200, 384, 512, 768, 1024, 2048):
        for n, k in ((12288, 4096), (4096, 12288), (24576, 4096), (6144, 4096), (1096, 608)):
            cfg = wt.config(m)
            tm, tn = wt.grid(m, n, cfg)
            tiles, stages = tm * tn, -(-k // 64)
            dp, s, per = wt.schedule(m, n, k, slots, cfg)
            assert 0 <= dp <= tiles and (s - 1) * per < stages <= s * per   # every split non-empty
            if s == 1:
                assert dp == tiles
            elif tiles > slots:
                assert dp == tiles - tiles % slots and per >= min(stages, wt.MIN_STAGES)
                assert (tiles - dp) * s <= slots                               # the tail fits its wave
            else:
                assert dp == 0 and tiles * s <= slots
    cfg = wt.config(512)
    assert wt.schedule(512, 12288, 4096, slots, cfg) == (132, 2, 32)   # 192 tiles: 60 split in two
    assert wt.schedule(512, 24576, 4096, slots, cfg) == (384, 1, 64)   # 384 tiles: 3 whole waves
    assert wt.schedule(512, 12288, 4096, slots, cfg, splits=3, dp_tiles=5) == (5, 3, 22)


def test_wgmma_plan_several_blocks_an_sm():
    """With BPS blocks an SM (a config's 4th entry) plan picks the fewest splits, of those that
    fit one wave, with the least max(2, ceil(blocks / SMs)) x stages a split: 4096->12288 at M = 16
    (96 tiles of 128 columns, 64 stages) 4 splits, 3 blocks on most SMs (2 splits: 2 blocks x 32
    stages; 3: 3 x 22; 5: 4 x 13); 12288->4096 (32 tiles, 192 stages) 8 splits, 2 x 24 (12 and
    16, 3 x 16 and 4 x 12, are no better; 4, one block an SM, counts as 2 x 48), where the old
    rule's 12 splits ran slower (18.0 vs 17.1 us at (1, 16, 8, 3)). One block an SM (3 entries,
    e.g. the GGUF kernel's from M = 33) keeps the old rule: as many splits as fit one wave."""
    from quantzoo.kernels import wgmma_tiles as wt

    sms = 132
    assert wt.schedule(16, 12288, 4096, 4 * sms, (1, 16, 6, 4)) == (0, 4, 16)
    assert wt.schedule(16, 4096, 12288, 4 * sms, (1, 16, 6, 4)) == (0, 8, 24)
    assert wt.schedule(16, 24576, 4096, 4 * sms, (1, 16, 6, 4)) == (0, 2, 32)
    assert wt.schedule(16, 4096, 12288, sms, (2, 16, 16)) == (0, 8, 24)       # 16 tiles: 132 // 16
    assert wt.plan(16, 4096, 12288, 3 * sms, (2, 16, 16)) == 24                # 1 block an SM: fill the wave
    for n, k in ((12288, 4096), (4096, 12288), (24576, 4096), (6144, 4096), (1024, 4096), (224, 608)):
        for cfg in ((1, 16, 6, 4), (1, 32, 8, 3), (1, 64, 6, 2), (1, 128, 5, 2), (2, 16, 10, 2)):
            m = cfg[1]
            tm, tn = wt.grid(m, n, cfg)
            top = max(1, min(cfg[3] * sms // (tm * tn), -(-k // 64) // wt.MIN_STAGES))
            assert 1 <= wt.plan(m, n, k, cfg[3] * sms, cfg) <= top


def test_split_parts_workspace():
    """The split tiles' partials (wg::SplitParts, both wgmma kernels) cover M rows of the columns
    from the first split tile's column tile on, not all N: a 1408-token lm_head (151936 x 4096,
    its last wave's 66 tiles split two ways) needs 15.9 MB where [splits][M][N] took 1.71 GB;
    with glu, y's columns of the gate half and of the up half (the same count of floats)."""
    from quantzoo.kernels import wgmma_tiles as wt

    m, n, k = 1408, 151936, 4096
    cfg = wt.config(m, n, k, 132)
    dp, splits, _ = wt.schedule(m, n, k, 132, cfg)
    tiles_m, tiles_n = wt.grid(m, n, cfg)
    assert (cfg[1], tiles_m * tiles_n - dp, splits) == (128, 66, 2)
    cols = wt.columns(*cfg[:2])
    assert wt.parts_numel(m, n, cfg, dp, splits) == splits * m * (n - dp // tiles_m * cols) == 3_964_928
    assert wt.parts_numel(m, n // 2, cfg, dp, splits, glu=True) == wt.parts_numel(m, n, cfg, dp, splits)
    assert wt.parts_numel(m, n, cfg, 0, splits) == splits * m * n   # every tile split: every column
    with pytest.raises(ValueError, match="dp_tiles=6534: no tile left to split"):
        wt.parts_numel(m, n, cfg, tiles_m * tiles_n, splits)


def test_rows_past_2_31_outputs_dry_run(monkeypatch):
    """M * N past 2^31 (a quantized lm_head, N = 151936, over 14136 tokens: Model.logits of a 16k
    text) is taken by every path that serves that M -- the kernels form element offsets in 64
    bits; only M itself is an int parameter -- and M = 2^31 is refused before any launch. Meta
    tensors (no memory) with the kernels, launches and device queries stubbed."""
    calls = []
    monkeypatch.setattr(workspaces, "_CACHE", {})   # the meta workspaces stay out of the real cache
    monkeypatch.setattr(awq, "_kernel", lambda src, name: name)
    monkeypatch.setattr(awq, "_launch", lambda kern, grid, block, args, smem=0: calls.append((kern, grid, args)))
    monkeypatch.setattr(awq, "launch_tma", lambda kern, grid, block, args, smem=0: calls.append((kern, grid, args)))
    monkeypatch.setattr(awq, "tensor_map_2d", lambda *a: ("tmap",) + a)
    monkeypatch.setattr(awq, "tensor_map_halves", lambda *a: ("tmap",) + a)
    monkeypatch.setattr(awq, "_set_smem", lambda kern, nbytes: None)
    monkeypatch.setattr(awq, "_blocks_per_sm", lambda kern, smem, threads=128: 1)
    monkeypatch.setattr(awq, "_sm_count", lambda dev: 132)
    monkeypatch.setattr(awq, "wgmma_available", lambda dev: True)
    k, n, g = 4096, 151936, 128
    m = 2**31 // n + 2   # row m - 1 holds elements past 2^31
    meta = dict(device="meta")
    qw = torch.empty((k, n // 8), dtype=torch.int32, **meta)
    sc = torch.empty((k // g, n), dtype=torch.float16, **meta)
    qz = torch.empty((k // g, n // 8), dtype=torch.int32, **meta)
    x = torch.empty((m, k), dtype=torch.float16, **meta)
    assert m * n > 2**31
    for path in (None, "mma", "wgmma", "dequant+cublas"):
        calls.clear()
        y = awq._gemm(x, qw, sc, qz, k, n, g, None, path)
        assert y.shape == (m, n) and calls, path
        for kern, grid, args in calls:
            assert all(0 < d < 2**31 for d in grid) and all(d <= 65535 for d in grid[1:]), (path, kern, grid)
            assert all(not isinstance(a, np.int32) or a >= 0 for a in args), (path, kern)
        if path == "mma":
            assert int(calls[0][2][7]) == m and int(calls[0][2][9]) == n
    # M itself must fit the kernels' int: refused with the argument named, before a launch
    xw = torch.empty((2**31, 32), dtype=torch.float16, **meta)
    qw32 = torch.empty((32, 8), dtype=torch.int32, **meta)
    calls.clear()
    with pytest.raises(ValueError, match=r"x: M=2147483648 rows; the kernels take at most 2147483647"):
        awq._gemm(xw, qw32, torch.empty((1, 64), dtype=torch.float16, **meta),
                  torch.empty((1, 8), dtype=torch.int32, **meta), 32, 64, 32, None, "mma")
    assert not calls
    # ... and M = 2^31 - 1, the largest int, is taken
    y = awq._gemm(xw[1:], qw32, torch.empty((1, 64), dtype=torch.float16, **meta),
                  torch.empty((1, 8), dtype=torch.int32, **meta), 32, 64, 32, None, "mma")
    assert y.shape == (2**31 - 1, 64) and int(calls[0][2][7]) == 2**31 - 1


def test_mma_column_tiles_past_the_grid_y_limit(monkeypatch):
    """N = 2^22 (K = 32: a 64 MiB qweight) at M = 17..128 is 65536 column tiles of the mma kernel,
    its gridDim.y, past CUDA's 65535: dispatch takes dequant+cublas, a forced 'mma' is refused
    by name before any launch."""
    calls = []
    monkeypatch.setattr(workspaces, "_CACHE", {})
    monkeypatch.setattr(awq, "_kernel", lambda src, name: name)
    monkeypatch.setattr(awq, "_launch", lambda kern, grid, block, args, smem=0: calls.append((kern, grid)))
    monkeypatch.setattr(awq, "torch_step", lambda fn, x, y: None)
    monkeypatch.setattr(awq, "_set_smem", lambda kern, nbytes: None)
    monkeypatch.setattr(awq, "_blocks_per_sm", lambda kern, smem, threads=128: 1)
    monkeypatch.setattr(awq, "_sm_count", lambda dev: 132)
    monkeypatch.setattr(awq, "wgmma_available", lambda dev: False)
    k, g, meta = 32, 32, dict(device="meta")
    for n in (2**22, 2**22 + 8):
        qw = torch.empty((k, n // 8), dtype=torch.int32, **meta)
        sc = torch.empty((k // g, n), dtype=torch.float16, **meta)
        qz = torch.empty((k // g, n // 8), dtype=torch.int32, **meta)
        for m in (17, 64, 128):
            assert awq.choose_path(m, awq._Shape(n, k)) == "dequant+cublas"
            x = torch.empty((m, k), dtype=torch.float16, **meta)
            calls.clear()
            awq._gemm(x, qw, sc, qz, k, n, g, None, None)
            assert calls and all(d <= 65535 for _, grid in calls for d in grid[1:]), calls
            calls.clear()
            with pytest.raises(ValueError, match=r"path: 'mma' at M=\d+ cuts N=\d+ into 6553[67] column tiles"):
                awq._gemm(x, qw, sc, qz, k, n, g, None, "mma")
            assert not calls
    assert awq.choose_path(17, awq._Shape(2**22 - 64, k)) == "mma"   # 65535 tiles still fit


def test_split_k_rows_past_2_31_dry_run(monkeypatch):
    """A split's last row is its first plus rows_per_split, an int in every split-K kernel: K =
    2^31 - 32 (an 8 GiB qweight of N = 32) cut into 132 or 264 splits ends past 2^31 - 1: the
    sum wrapped, and the mma kernel's last split dropped its rows without a word, the gemv and
    small-M kernels' walked past K's last row (awq._split_rows says how). Refused by name before
    any launch;
    dequant+cublas, which splits no K, takes the weight, and K = 2^31 - 2^20 goes out on every
    path with each split ending inside the int. Meta tensors, launches recorded."""
    calls = []
    monkeypatch.setattr(workspaces, "_CACHE", {})
    monkeypatch.setattr(awq, "_kernel", lambda src, name: name)
    monkeypatch.setattr(awq, "_launch", lambda kern, grid, block, args, smem=0: calls.append((kern, grid, args)))
    monkeypatch.setattr(awq, "launch_tma", lambda kern, grid, block, args, smem=0: calls.append((kern, grid, args)))
    monkeypatch.setattr(awq, "tensor_map_2d", lambda *a: ("tmap",) + a)
    monkeypatch.setattr(awq, "torch_step", lambda fn, x, y: None)
    monkeypatch.setattr(awq, "_set_smem", lambda kern, nbytes: None)
    monkeypatch.setattr(awq, "_blocks_per_sm", lambda kern, smem, threads=128: 1)
    monkeypatch.setattr(awq, "_sm_count", lambda dev: 132)
    monkeypatch.setattr(awq, "wgmma_available", lambda dev: True)
    def one_wave(tiles, k, unit, slots, min_rows=0):
        """mma's split plan as _splits makes it for one tile, a wave of `slots` splits, without
        its search over every split count to K / 128 (2^24 of them here, ~10 s a call)."""
        per = unit * -(-(-(-k // unit)) // slots)
        return -(-k // per), per

    assert one_wave(1, 2**20, 32, 132, 128) == awq._splits(1, 2**20, 32, 132, 128)
    monkeypatch.setattr(awq, "_splits", one_wave)
    n, g, meta = 32, 32, dict(device="meta")
    runs = (("gemv", 1), ("small", 1), ("mma", 17), ("wgmma", 64), ("dequant+cublas", 1))
    for k in (2**31 - 32, 2**31 - 2**20):
        qw = torch.empty((k, n // 8), dtype=torch.int32, **meta)
        sc = torch.empty((k // g, n), dtype=torch.float16, **meta)
        qz = torch.empty((k // g, n // 8), dtype=torch.int32, **meta)
        for path, m in runs:
            calls.clear()
            x = torch.empty((m, k), dtype=torch.float16, **meta)
            if k == 2**31 - 32 and path != "dequant+cublas":
                with pytest.raises(ValueError, match=rf"^qweight: K={k} rows in \d+ splits of \d+ end at row \d+, "
                                                     r"past the kernels' 32-bit rows \(path='dequant\+cublas' "
                                                     r"splits no K, nor 'strip' or 'strip-cluster' at M = 1\)$"):
                    awq._gemm(x, qw, sc, qz, k, n, g, None, path)
                assert not calls, path
                continue
            assert awq._gemm(x, qw, sc, qz, k, n, g, None, path).shape == (m, n)
            kern, grid, args = calls[0]
            if path != "dequant+cublas":   # rows_per_split: the last argument (wgmma's: before x_rows)
                splits, rows = (int(args[-3]), int(args[-2])) if path == "wgmma" else (grid[-1], int(args[-1]))
                assert splits > 1 and (splits - 1) * rows < k <= splits * rows <= 2**31 - 1, (path, splits, rows)


@pytest.mark.parametrize("k,n8", [(2**31, 1), (32, 2**28)])
def test_weights_past_32_bit_k_or_n_are_refused(k, n8):
    """K or N of 2^31 (meta tensors: no memory) is refused by name, not left to np.int32's
    OverflowError at the launch."""
    meta = {"device": "meta"}
    g = 32
    qw = torch.empty((k, n8), dtype=torch.int32, **meta)
    with pytest.raises(ValueError, match=r"qweight: shape .* too large for the kernels' 32-bit K and N"):
        awq.check_weights(qw, torch.empty((k // g, 8 * n8), dtype=torch.float16, **meta),
                          torch.empty((k // g, n8), dtype=torch.int32, **meta), g)
