"""CPU tier for quantzoo/kernels/gguf.py: what runs before any launch (no GPU, no CuPy needed).

Argument checks must raise one ValueError naming the argument, so a bad call never reaches a
kernel as an illegal memory access; the dispatch thresholds and the declared kernel instances
must cover every GGUF weight format in the registry.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import quantzoo as qz
from quantzoo.formats.tensor import QuantizedTensor
from quantzoo.kernels import gguf as G

WEIGHT_FORMATS = [n for n in qz.formats.names()
                  if getattr(qz.formats.get(n), "kernels", None) == "gguf" and qz.formats.get(n).kind == "weight"]


def test_registry_formats_have_kernels():
    assert sorted(WEIGHT_FORMATS) == sorted(G.BLOCKS)
    for name in WEIGHT_FORMATS:
        assert G.BYTES[name] == qz.formats.get(name).bytes_per_block
        block = G.BLOCKS[name]
        assert f"mmq<{block}>" in G.SOURCES["gguf_mmq.cu"]
        assert f"dequant<{block}>" in G.SOURCES["gguf_dequant.cu"]
        for m in range(1, G.MMVQ_COLS + 1):  # every launch dispatch can make is compiled
            assert f"mmvq<{block}, {m}, {G.mmvq_plan(name, 'scalar', m)[0]}>" in G.SOURCES["gguf_mmvq.cu"]
            for nb in (1, G.MMVQ1_LONG_NB):
                r, u = G.mmvq_plan(name, "vec", m, nb)
                assert G.mmvq16_name(name, m, r, u=u) in G.SOURCES["gguf_mmvq16.cu"]


@pytest.mark.parametrize("fmt", sorted(G.BLOCKS))
def test_choose_path_thresholds(fmt):
    qt = qz.formats.get(fmt).quantize(np.zeros((4, 64), np.float32))
    assert [G.choose_path(m, qt) for m in (1, 8)] == ["mmvq", "mmvq"]
    top = max(G.MMVQ_COLS, G.MMVQ_MAX_M[fmt])
    assert G.choose_path(top, qt) == "mmvq"
    # a format name stands for an aligned weight; a CPU numpy tensor is never "aligned16"
    assert G.choose_path(top + 1, fmt) == ("mma" if G.MMA_MAX_M[fmt] > top else
                                           "mmq" if G.MMQ_MAX_M[fmt] > top else "dequant")
    assert G.choose_path(top + 1, qt) == ("mmq" if G.MMQ_MAX_M[fmt] > top else "dequant")
    assert G.choose_path(max(top, G.MMA_MAX_M[fmt], G.MMQ_MAX_M[fmt]) + 1, fmt) == "dequant"
    assert G.choose_path(4096, fmt) == "dequant"


def test_wgmma_dispatch(monkeypatch):
    """Where wgmma_ok holds (on Hopper): M = 9 to WGMMA_MAX_M on weights of 4096 x 4096
    and up, whatever the grid's wave fill (4096->12288 M = 512: 192 tiles, 1.45 waves); below 9
    (mmvq's range) only for Q4_0 / Q4_1 / Q8_0 from the M measured (session 54: sooner for GLU
    and for K >= 8192), never on smaller weights."""
    class Data:
        device = "cuda:0"

    def qt(n, k, fmt="q4_0"):
        return type("QT", (), {"format": fmt, "shape": (n, k), "data": Data()})()

    monkeypatch.setattr(G, "wgmma_ok", lambda q: q.format in G.WGMMA_FORMATS)
    monkeypatch.setattr(G, "_aligned16", lambda q: True)
    assert set(G.WGMMA_FORMATS) == set(G.BLOCKS)
    top = G.WGMMA_MAX_M
    # the first M that takes wgmma: with glu, for K >= 8192, for the rest. glu's never later than
    # plain's: the runner's unfused gate/up (on mmvq with glu) hands matmul_q8_1 the glu layout
    first = {"q4_0": (6, 7, 9), "q4_1": (5, 7, 9), "q5_0": (9, 9, 9), "q5_1": (9, 9, 9), "q8_0": (5, 7, 8)}
    assert all(g <= min(rest) for g, *rest in G.WGMMA_SMALL_M.values())
    for fmt in G.WGMMA_FORMATS:
        for n, k in ((4096, 4096), (6144, 4096), (12288, 4096), (4096, 12288), (24576, 4096), (2560, 9728)):
            for glu in (False, True):
                f = first[fmt][0 if glu else 1 if k >= 8192 else 2]
                assert [G.choose_path(m, qt(n, k, fmt), glu=glu) for m in range(1, 10)] == \
                    ["mmvq"] * (f - 1) + ["wgmma"] * (10 - f), (fmt, n, k, glu)
                assert [G.choose_path(m, qt(n, k, fmt), glu=glu) for m in (256, 257, top, top + 1)] == \
                    ["wgmma"] * 3 + ["dequant"], (fmt, n, k)
        for glu in (False, True):   # under 4096 x 4096
            assert [G.choose_path(m, qt(4096, 4096 - 256, fmt), glu=glu) for m in (1, 8)] == ["mmvq"] * 2
    monkeypatch.setattr(G, "wgmma_ok", lambda q: False)   # not Hopper, or a weight TMA cannot read
    assert [G.choose_path(m, qt(24576, 4096, "q8_0"), glu=True) for m in (1, 6, 8, 9)] == ["mmvq"] * 3 + ["mma"]
    monkeypatch.setattr(G, "wgmma_ok", lambda q: q.format in G.WGMMA_FORMATS)
    assert G.choose_path(64, qt(4096, 4096)) == "wgmma"
    # mid-size weights: to M = 96 once M N K > 2^27, 64-token tiles past M = 64; never under 4096 x 1024
    for n, k, first in ((1024, 4096, 33), (2048, 4096, 17), (2048, 6144, 11), (4096, 3072, 11)):
        assert [G.choose_path(m, qt(n, k)) for m in (first - 1, first, 96, 97)] == \
            ["mma", "wgmma", "wgmma", "dequant"], (n, k)
        assert {G.wgmma_config(m, n, k, 132) for m in range(65, 97)} == {(2, 64, 6)}
    assert (2, 64, 6) in G.WGMMA_CFGS and G.wgmma_config(100, 4096, 4096, 132) != (2, 64, 6)
    # up to M = 32 the one-warpgroup, 128-k configs (the narrowest T that holds M); GLU: T = 32
    assert [G.wgmma_config(m, 4096, 4096, 132) for m in (1, 16, 17, 32, 33)] == \
        [(1, 16, 3, 4, 128)] * 2 + [(1, 32, 3, 3, 128)] * 2 + [(2, 64, 6)]
    assert {G.wgmma_config(m, 24576, 4096, 132, glu=True) for m in range(1, 33)} == {(2, 32, 4, 1, 128)}
    assert G.wgmma_config(33, 24576, 4096, 132, glu=True) == (2, 64, 6)
    assert [G.choose_path(m, qt(1024, 2048)) for m in (64, 96)] == ["mma", "mma"]   # under 4096 x 1024


def test_gpu_tier_shapes_reach_their_paths():
    """The shapes tests/test_gguf_gpu.py picks to reach a code path, checked here on every CPU run
    so that a dispatch or schedule change that moves them off it shows before the next GPU run:
    test_wgmma_whole_and_split_tiles_one_launch -- whole and split tiles in one launch, the row
    tail in a split tile (plain and GLU: the blocked weight of _glu_blocked has the same
    schedule), on 132 SMs at one block an SM (T = 128 / 256 take over 113 KB of shared memory);
    test_mmvq16_long_k_pipeline_n_tails -- the U = 2 vector mmvq (Q4_0, Q8_0) with CTAs past N."""
    from quantzoo.kernels import wgmma_tiles as wt

    slots = 132
    assert all((227 * 1024) // (G.wgmma_smem_bytes(f, *c) + 1024) == 1 for f in G.WGMMA_FORMATS for c in G.WGMMA_CFGS
               if c[1] >= 128)
    for m, n, k, want in [(129, 16904, 1024, (256, 133, 132, 2, 8)), (257, 11272, 2048, (128, 135, 132, 4, 8)),
                          (300, 11272, 2048, (128, 135, 132, 4, 8))]:
        cfg = wt.config(m, n, k, slots)
        tm, tn = wt.grid(m, n, cfg)
        rows = wt.columns(cfg[0], cfg[1])
        assert (cfg[1], tm * tn) + wt.schedule(m, n, k, slots, cfg) == want, (m, n, k)
        assert n % rows and n // 2 % (rows // 2)   # a row tail in the last (split) tile, plain and GLU
        fr = rows // 2
        nb = 2 * fr * -(-(n // 2) // fr)   # _glu_blocked's rows
        assert wt.config(m, nb, k, slots) == cfg and wt.schedule(m, nb, k, slots, cfg) == want[2:]
    for fmt in G.BLOCKS:
        for n, k in ((38, 9600), (37, 9472)):
            r, u = G.mmvq_plan(fmt, "vec", 1, k // 32)
            assert u == (2 if fmt in ("q4_0", "q8_0") else 1) and n % (G.MMVQ16_WARPS * r)
            assert n * (k // 32) * G.BYTES[fmt] % G.MMVQ16_LW == 0   # mmvq16_ok's size condition
            assert G.mmvq16_name(fmt, 1, r, u=u) in G.SOURCES["gguf_mmvq16.cu"]


def test_mma_plan():
    """BM is the smallest tile holding M (<= 64); K splits fill ~2 CTAs per SM, each split a
    multiple of the 4-block step, and the splits cover all nb blocks with none empty."""
    for m, n, nb in [(9, 4096, 448), (17, 4096, 448), (64, 4096, 128), (100, 12288, 448), (256, 576, 18),
                     (1, 8, 1), (40, 200, 130)]:
        for split in (None, 1, 3, 7, 1000):
            bm, s, kc = G.mma_plan(m, n, nb, 132, split)
            assert bm == next((b for b in G.MMA_BM_CHOICES if m <= b), 64)
            assert kc % G.MMA_BK[bm] == 0 and 1 <= s <= max(1, -(-nb // G.MMA_BK[bm]))
            assert (s - 1) * kc < nb <= s * kc
            if split is None:
                assert s <= G.MMA_MAX_SPLIT and -(-n // 64) * -(-m // bm) * s <= max(264, -(-n // 64) * -(-m // bm))


def test_choose_path_rejects_other_formats():
    with pytest.raises(ValueError, match="qt"):
        G.choose_path(1, "awq")
    with pytest.raises(ValueError, match="m"):
        G.choose_path(-1, "q4_0")


def _cpu_qt(fmt="q4_0", n=8, k=64):
    qt = qz.formats.get(fmt).quantize(np.random.default_rng(0).standard_normal((n, k)).astype(np.float32))
    return QuantizedTensor(qt.format, qt.shape, torch.from_numpy(qt.data.copy()))


def test_weight_checks():
    qt = _cpu_qt()
    with pytest.raises(ValueError, match=r"qt\.data: on cpu"):
        G.check_weight(qt)
    with pytest.raises(ValueError, match=r"qt\.data"):
        G.check_weight(QuantizedTensor("q4_0", (8, 64), qt.data.numpy()))  # numpy: never moved
    with pytest.raises(ValueError, match=r"qt\.data: dtype"):
        G.check_weight(QuantizedTensor("q4_0", (8, 64), qt.data.to(torch.int8)))
    with pytest.raises(ValueError, match=r"qt\.data: shape"):
        G.check_weight(QuantizedTensor("q4_0", (8, 64), qt.data[:, :-2].contiguous()))
    with pytest.raises(ValueError, match=r"qt\.data: shape"):  # bytes of another format
        G.check_weight(QuantizedTensor("q5_0", (8, 64), qt.data))
    with pytest.raises(ValueError, match=r"qt\.data: not contiguous"):
        G.check_weight(QuantizedTensor("q4_0", (8, 64), qt.data.t().contiguous().t()))
    with pytest.raises(ValueError, match="qt: shape"):
        G.check_weight(QuantizedTensor("q4_0", (8, 48), qt.data))
    with pytest.raises(ValueError, match="qt: format"):
        G.check_weight(QuantizedTensor("awq", (8, 64), qt.data))
    for params in ({"group_size": 7}, None):   # as Format.check on the CPU: GGUF takes no params
        with pytest.raises(ValueError, match=r"qt: params .*; the GGUF block formats take none"):
            G.check_weight(QuantizedTensor("q4_0", (8, 64), qt.data, params))
    with pytest.raises(ValueError, match="qt"):
        G.dequantize(qt)
    with pytest.raises(ValueError, match="qt"):
        G.matmul(torch.zeros(2, 64, dtype=torch.float16), qt)


def test_activation_checks():
    with pytest.raises(ValueError, match="x: on cpu"):
        G.quantize_q8_1(torch.zeros(2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="x: dtype"):
        G.quantize_q8_1(torch.zeros(2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x: K=48"):
        G.quantize_q8_1(torch.zeros(2, 48, dtype=torch.float16))
    with pytest.raises(ValueError, match="x: not contiguous"):
        G.quantize_q8_1(torch.zeros(64, 2, dtype=torch.float16).t())
    with pytest.raises(ValueError, match="x: expected a torch"):
        G.quantize_q8_1(np.zeros((2, 64), np.float16))
    with pytest.raises(ValueError, match="x: needs at least one"):
        G.quantize_q8_1(torch.tensor(1.0, dtype=torch.float16))


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_negated_views_are_refused(fmt, monkeypatch):
    """A tensor with torch's negative bit (z.conj().imag, torch._neg_view) holds the negated values
    in its memory, which the kernels read and write by address: x or the weight went in with its sign
    flipped and an `out` read back as -y, without a word. Each is refused by name before a launch
    (CPU tensors; for x past the weight check, that check is stubbed to accept a CPU weight)."""
    qt = _cpu_qt(fmt)
    n, k = qt.shape
    x = torch.zeros(2, k, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"qt\.data: .*negative bit"):
        G.check_weight(QuantizedTensor(fmt, qt.shape, torch._neg_view(qt.data)))
    for quantize in (G.quantize_q8_1, G.quantize_q8_1_split):
        with pytest.raises(ValueError, match=r"x: .*negative bit"):
            quantize(torch._neg_view(x))
    neg_out = torch._neg_view(torch.zeros(2, n, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"out: .*negative bit"):
        G._check_out(neg_out, (2, n), torch.float16, x.device)
    monkeypatch.setattr(G, "check_weight", lambda q, arg="qt": (fmt, n, k))   # as a CUDA weight passes
    with pytest.raises(ValueError, match=r"x: .*negative bit"):
        G.matmul(torch._neg_view(x), qt)


def test_import_needs_no_cupy():
    """Importing the kernels (and running the CPU reference through ops.matmul and QuantLinear)
    never asks for CuPy: a fresh interpreter with an import spy first on sys.meta_path records
    every attempt, whether or not CuPy is installed. (The assert here had been
    `"cupy" not in sys.modules or sys.modules["cupy"] is not None`, true whatever is imported:
    an eager `try: import cupy` at the top of quantzoo/cuda_launch.py passed it.)"""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "tried = []\n"
        "class Spy:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'cupy':\n"
        "            tried.append(name)\n"
        "sys.meta_path.insert(0, Spy())\n"
        "import numpy as np, torch\n"
        "import quantzoo as qz\n"
        "import quantzoo.kernels.gguf, quantzoo.kernels.awq, quantzoo.kernels.fp16, quantzoo.kernels.layer_ops\n"
        "import quantzoo.kernels.persistent, quantzoo.kernels.stream, quantzoo.model\n"
        "w = np.random.default_rng(0).standard_normal((16, 128)).astype(np.float32)\n"
        "for f in ('q4_0', 'awq', 'fp16'):\n"
        "    qt = qz.formats.get(f).quantize(w)\n"
        "    assert qz.ops.matmul(np.ones((2, 128), np.float32), qt).shape == (2, 16)\n"
        "    assert qz.QuantLinear(qt)(torch.ones(2, 128)).shape == (2, 16)\n"
        "print('TRIED', tried)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "TRIED []", r.stdout
    assert set(G.SOURCES) == {"q8_1_quantize.cu", "gguf_mmvq.cu", "gguf_mmvq16.cu", "gguf_mma.cu", "gguf_mmq.cu",
                              "gguf_dequant.cu", "gguf_wgmma.cu"}


# a weight row's TMA window in a wgmma stage (ggw::Cfg::SLOT), by k a stage: the stage's blocks
# (bk / 32 of them) at any 16-byte window offset a stage can have
WGMMA_SLOT = {64: {"q4_0": 48, "q4_1": 48, "q5_0": 64, "q5_1": 48, "q8_0": 80},
              128: {"q4_0": 80, "q4_1": 80, "q5_0": 96, "q5_1": 96, "q8_0": 144}}


def _check_wgmma_launch(calls, fmt, qt, x, m, n, k, glu):
    """The recorded wgmma launch (and its reduce) of matmul(x, qt, path="wgmma", glu=glu) on 132
    SMs at one block an SM (resident_blocks stubbed): instance, grid, schedule, maps, reduce."""
    names = [c[0] for c in calls]
    nb = k // 32
    cfg = G.wgmma_config(m, n, k, 132, glu)
    nwg, t, d = cfg[:3]
    bps, bk = cfg[3:] if len(cfg) > 3 else (1, 64)
    tail = f", {'true' if glu else 'false'}, {bps}, {bk}" if (bps, bk) != (1, 64) else ", true" if glu else ""
    assert names[0] == f"gguf_wgmma<{G.BLOCKS[fmt]}, {nwg}, {t}, {d}{tail}>"
    rows = 64 * (1 if t == 256 else 2) * nwg   # a tile's weight rows (GLU: half gate, half up)
    tiles_m, tiles = -(-m // t), -(-m // t) * -(-n // rows)
    args = calls[0][3]
    assert [int(a) for a in args[4:8]] == [m, n, nb, tiles_m] and int(args[11]) == min(m, t)
    dp, splits, sps = (int(a) for a in args[8:11])
    assert calls[0][1] == (dp + (tiles - dp) * splits,) and calls[0][2] == (128 * nwg + 128,)
    stages = nb // (bk // 32)
    assert (splits - 1) * sps < stages <= splits * sps   # every split non-empty
    assert (dp == tiles) == (splits == 1) and (args[3] != 0) == (splits > 1)
    assert calls[0][4] == G.wgmma_smem_bytes(fmt, nwg, t, d, bk) <= 227 * 1024
    # by TMA: the weight as bytes [N, nb BYTES], boxes of the block's rows (GLU: a gate box and
    # an up box of half the rows) x the 16-byte window of a stage's blocks; the whole [M, K]
    # activation, boxes of T tokens (M when M < T: never past row M) x 64 k, 128-byte swizzle
    slot = WGMMA_SLOT[bk][fmt]
    swizzle = 64 if slot == 64 else 0   # Q5_0's 64-byte rows: 64-byte swizzle
    box = rows // 2 if glu else rows
    assert args[0] == ("tmap", qt.data.data_ptr(), n, nb * G.BYTES[fmt], box, slot, swizzle, "u8")
    assert args[1] == ("tmap", x.data_ptr(), m, k, min(m, t), 64, 128, "f16")
    ny = n // 2 if glu else n
    v = 4 if ny % 4 == 0 else 1   # columns a thread (y from torch: aligned)
    assert names[1:] == ([f"wgmma_reduce<{v}{', true' if glu else ''}>"] if splits > 1 else [])
    if splits > 1:   # every output of the split tiles
        assert [int(a) for a in calls[1][3][2:6]] == [m, ny, t, box]
        assert int(calls[1][3][-1]) == (tiles - dp) * t * box <= calls[1][1][0] * 256 * v


@pytest.mark.parametrize("mmvq_kernel", G.MMVQ_KERNELS)
@pytest.mark.parametrize("fmt", sorted(G.BLOCKS))
def test_launch_plumbing_dry_run(fmt, mmvq_kernel, monkeypatch):
    """Every path up to the launch on CPU tensors, kernels and launches stubbed: each kernel asked
    for must be a declared instance (CuPy compiles only SOURCES), grids and pointer offsets sane."""
    calls = []

    def fake_kernel(src, name):
        assert name in G.SOURCES[src], f"{name} not declared in SOURCES[{src!r}]"
        return name

    monkeypatch.setattr(G, "_kernel", fake_kernel)
    record = lambda k, grid, block, args, shared_mem=0: calls.append((k, grid, block, args, shared_mem))  # noqa: E731
    monkeypatch.setattr(G, "launch", record)
    monkeypatch.setattr(G, "launch_tma", record)   # the wgmma kernel (a TMA descriptor argument)
    monkeypatch.setattr(G.workspaces, "_CACHE", {})   # CPU workspaces stay out of the real cache
    monkeypatch.setattr(G, "check_weight", lambda qt, arg="qt": (qt.format, *qt.shape))
    monkeypatch.setattr(G, "mmvq16_ok", lambda qt: True)  # CPU tensors: any alignment will do here
    monkeypatch.setattr(G, "_aligned16", lambda qt: True)
    monkeypatch.setattr(G, "_sm_count", lambda device: 132)
    monkeypatch.setattr(G, "_check_act", lambda x, k, arg="x", dtypes=None: (x.numel() // x.shape[-1], x.shape[-1]))
    monkeypatch.setattr(G, "wgmma_ok", lambda qt: qt.format in G.WGMMA_FORMATS)   # no Hopper here
    monkeypatch.setattr(G, "set_max_dynamic_smem", lambda kern, nbytes: None)
    monkeypatch.setattr(G, "resident_blocks", lambda kern, smem, threads: 1)
    monkeypatch.setattr(G, "tensor_map_2d", lambda ptr, rows, cols, box_rows, box_cols, swizzle=128, dtype="f16":
                        ("tmap", ptr, rows, cols, box_rows, box_cols, swizzle, dtype))
    k = 2048
    for n, m in [(70, m) for m in (1, 5, 8, 13, 24, 100, 300)] + [(72, 13)]:   # 70: the 1-wide reduce; 72: 4-wide, and glu
        qt = _cpu_qt(fmt, n, k)
        x = torch.zeros((m, k), dtype=torch.float16)
        for path in G.PATHS:
            calls.clear()
            if path == "wgmma" and fmt not in G.WGMMA_FORMATS:
                with pytest.raises(ValueError, match="path: 'wgmma'"):
                    G.matmul(x, qt, path=path)
                continue
            y = G.matmul(x, qt, path=path, mmvq_kernel=mmvq_kernel)
            assert y.shape == (m, n)
            names = [c[0] for c in calls]
            nb = k // 32
            if path == "dequant":
                assert names == [f"dequant<{G.BLOCKS[fmt]}>"]
                assert calls[0][1][0] * 256 >= n * (k // 32) * 4
            elif path == "wgmma":   # one launch (+ the split-K reduce); T and splits as planned
                _check_wgmma_launch(calls, fmt, qt, x, m, n, k, glu=False)
                if n % 4 == 0:   # glu=True: the GLU instance, a gate box and an up box, y (M, N / 2)
                    calls.clear()
                    assert G.matmul(x, qt, path=path, glu=True).shape == (m, n // 2)
                    _check_wgmma_launch(calls, fmt, qt, x, m, n, k, glu=True)
            elif path == "mma":
                assert names[0].startswith("quantize_q8_1_split<")
                bm, split, kchunk = G.mma_plan(m, n, nb, G._sm_count(None), None)
                assert names[1] == f"mma_gemm<{G.BLOCKS[fmt]}, {bm}>"
                assert calls[1][1] == (-(-n // G.MMA_BN), -(-m // bm), split) and calls[1][2] == (G.MMA_THREADS,)
                assert int(calls[1][3][8]) == kchunk
                assert calls[1][4] == G.mma_smem_bytes(bm) and calls[1][4] <= 48 * 1024  # no opt-in
                assert names[2:] == (["mma_reduce"] if split > 1 else [])
            elif path == "mmvq" and mmvq_kernel == "vec":
                assert names[0].startswith("quantize_q8_1_split<")
                assert len(names) == 1 + -(-m // G.MMVQ_COLS)
                a0 = calls[1][3][1]  # qs pointer of the first chunk = workspace base
                for i, (name, grid, block, args, _) in enumerate(calls[1:]):
                    mc = min(G.MMVQ_COLS, m - i * G.MMVQ_COLS)
                    r, u = G.mmvq_plan(fmt, "vec", mc, nb)
                    assert name == G.mmvq16_name(fmt, mc, r, u=u)
                    assert grid == (-(-n // (r * G.MMVQ16_WARPS)),) and block == (32 * G.MMVQ16_WARPS,)
                    c0 = i * G.MMVQ_COLS
                    assert args[1] - a0 == c0 * nb * 32                   # qs of chunk rows
                    assert args[2] - a0 == m * nb * 32 + c0 * nb * 4      # (d, s) after all qs
                    assert args[3] - calls[1][3][3] == c0 * n * 2         # y offset, bytes
            else:
                assert names[0].startswith("quantize_q8_1<")
                kern = names[1:]
                if path == "mmvq":
                    assert len(kern) == -(-m // G.MMVQ_COLS)
                    for i, (name, grid, block, args, _) in enumerate(calls[1:]):
                        mc = min(G.MMVQ_COLS, m - i * G.MMVQ_COLS)
                        r = G.mmvq_plan(fmt, "scalar", mc)[0]
                        assert name == f"mmvq<{G.BLOCKS[fmt]}, {mc}, {r}>" and grid == (-(-n // r),)
                        assert args[2] - calls[1][3][2] == i * G.MMVQ_COLS * n * 2  # y offset, bytes
                else:
                    assert kern == [f"mmq<{G.BLOCKS[fmt]}>"]
                    assert calls[1][1] == (-(-n // G.MMQ_TILE), -(-m // G.MMQ_TILE))



def test_forced_mma_split_past_the_grid_z_limit(monkeypatch):
    """mma_split's K pieces are the mma kernel's gridDim.z: K = 2^25 (2^20 blocks, an 18 MiB q4_0
    row) with mma_split=70000 makes 65536 pieces of 16 blocks, past CUDA's 65535 -- refused by
    name before any launch; mma_split=65535 (evened out to fewer pieces) still goes out."""
    calls = []
    record = lambda k, grid, block, args, shared_mem=0: calls.append((k, grid))  # noqa: E731
    monkeypatch.setattr(G, "_kernel", lambda src, name: name)
    monkeypatch.setattr(G, "launch", record)
    monkeypatch.setattr(G.workspaces, "_CACHE", {})
    monkeypatch.setattr(G, "check_weight", lambda qt, arg="qt": (qt.format, *qt.shape))
    monkeypatch.setattr(G, "_aligned16", lambda qt: True)
    monkeypatch.setattr(G, "_sm_count", lambda device: 132)
    monkeypatch.setattr(G, "_check_act", lambda x, k, arg="x", dtypes=None: (x.numel() // x.shape[-1], x.shape[-1]))
    n, k, m = 1, 2**25, 16
    assert G.mma_plan(m, n, k // 32, split=70000)[1] == 65536
    qt = QuantizedTensor("q4_0", (n, k), torch.empty((n, k // 32 * 18), dtype=torch.uint8, device="meta"))
    x = torch.empty((m, k), dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match=r"mma_split: 70000 splits K=33554432 into 65536 pieces"):
        G.matmul(x, qt, path="mma", mma_split=70000)
    assert not calls
    G.matmul(x, qt, path="mma", mma_split=65535)
    assert [grid for name, grid in calls if name.startswith("mma_gemm")] == [(1, 1, G.mma_plan(m, n, k // 32, split=65535)[1])]
    assert 1 < G.mma_plan(m, n, k // 32, split=65535)[1] <= 65535
