"""AWQ W4A16 on CUDA: dequant, two M = 1 GEMVs, small-M and tensor-core GEMMs, dequant + cuBLAS;
dispatch by M.

    y = x @ W  with  W[k, n] = fp16((q - z) * s)  from qweight int32 [K, N/8], qzeros int32
    [K/G, N/8], scales fp16 [K/G, N] (HF "gemm" layout, formats/awq.py); x fp16 [.., K].

Paths (choose_path(m, qt, glu=glu) names the one matmul takes; path= forces one, within the M it takes):
    "gemv"            cuda/awq_gemv.cu   M = 1: each lane streams its weight words into registers,
                                         the tensor cores used lane by lane, scale per group on
                                         fp32 partials (as "small"); chosen for N >= GEMV_MIN_N
    "strip"           cuda/awq_strip.cu  M = 1: the GEMV's lane arithmetic, one block per 64
                                         columns and all of K (no split K, a lean loop); chosen
                                         for STRIP_MIN_K <= K <= STRIP_MAX_K and STRIP_MIN_N <= N
                                         <= STRIP_MAX_N
    "strip-cluster"   cuda/awq_strip.cu  M = 1, Hopper: the same, each strip's K split over a
                                         thread-block cluster of CLUSTER_SIZE blocks that sum in
                                         block 0's shared memory; chosen for CLUSTER_MIN_K <= K,
                                         CLUSTER_MIN_N <= N <= CLUSTER_MAX_N and N * K <=
                                         CLUSTER_MAX_NK, but not N = 4096 with K < 4096
    "small"           cuda/awq_small.cu  M <= 16: weights as the MMA's A operand, streamed through
                                         a per-warp shared-memory ring, scale applied per group to
                                         fp32 partials (no fp16 weight); chosen for M <= 8, and
                                         M <= 16 with N * K <= SMALL_MMA_NK
    "mma"             cuda/awq_mma.cu    mma.sync m16n8k16, dequant in registers, any M; chosen
                                         up to MMA_MAX_M (MMA_MAX_M_BIG for N or K >= 8192)
    "dequant+cublas"  cuda/awq_dequant.cu into a reused fp16 [K, N] buffer, then torch.mm
    "wgmma"           cuda/awq_wgmma.cu  Hopper (sm_90a) only: wgmma with the weight dequantised
                                         in registers as operand A, every tile by TMA from a
                                         producer warpgroup, split K, any M, N % 32 == 0;
                                         chosen on Hopper for 5 <= M <= WGMMA_MAX_M on weights
                                         of WGMMA_MIN_NK (4096 x 4096) elements and up, for
                                         5 <= M <= 256 from 2048 x 4096 and for 17 <= M <= 256
                                         from 1024 x 4096, and with glu=True from M = 2 on
                                         weights of 2048 x 12288 and up, to M = 16 from 1024 x
                                         6144 (bench/NOTES.md sessions 8, 13, 15, 18, 25, 51,
                                         52, 54)
matmul(x, qt, glu=True) is the decoder MLP's silu(x @ gate) * (x @ up) for a weight whose columns
are [gate | up]: on the wgmma path in the kernel's epilogue (cuda/awq_wgmma.cu, GLU), elsewhere
the product into a workspace, then layer_ops.silu_mul (the same values either way).
The thresholds below come from bench/awq_bench.py on the H100 (bench/notes-awq.md has the
tables). Every launch goes on torch's current stream; outputs and workspaces are torch tensors
(kernels/workspaces.py: cached per stream, a capture's its own), so a matmul can be captured in
a CUDA graph. Inputs are checked here, before any launch: a bad call raises ValueError naming
the argument.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from quantzoo.cuda_launch import resident_blocks as _blocks_per_sm
from quantzoo.cuda_launch import set_max_dynamic_smem as _set_smem
from quantzoo.cuda_launch import sm_count as _sm_count
from quantzoo.cuda_launch import MAX_GRID_YZ, launch_tma, on_tensor_device, tensor_map_2d, tensor_map_halves, torch_step
from quantzoo.cuda_launch import clusters_available, wgmma_available
from quantzoo.kernels import check_out_overlap, checked_once, negated, run_planned, run_unplanned, wgmma_tiles, workspaces
from quantzoo.formats.awq import GROUP_SIZES

# ---- the kernels CuPy is asked for (tests/test_compile.py compiles the same list with nvcc)
# GEMV (cuda/awq_gemv.cu, M = 1): (NW, WARPS, D) = column words per lane, warps per block, k-steps
# of loads a lane has in flight; each also compiled with VEC = false (for N/8 % NW != 0)
GEMV_CFGS = ((2, 8, 4), (4, 4, 4))   # GEMV_DEFAULT and GEMV_TUNED's
# (MT, NG, OCC): 16*MT rows x 64*NG columns per block, OCC blocks per SM asked of the compiler
MMA_CFGS = ((1, 1, 1), (1, 2, 1), (1, 2, 4), (2, 1, 1), (2, 2, 1), (4, 1, 1))
SOURCES = {
    "awq_dequant.cu": ("awq_dequant_kernel",),
    "awq_gemv.cu": tuple("awq_gemv_kernel<{}, {}, {}, {}>".format(*c, v) for c in GEMV_CFGS
                         for v in ("true", "false")),
    "awq_mma.cu": tuple(f"awq_mma_kernel<{mt}, {ng}, {occ}>" for mt, ng, occ in MMA_CFGS),
}
# strip kernel (cuda/awq_strip.cu, M = 1): (WARPS, D) = warps per block, k-steps of loads a lane has
# in flight; D must divide the group's G / 8 steps, so group size 32 takes the D = 4 instance
STRIP_WARPS = 16
STRIP_D = (8, 4)
# ... and its cluster form (Hopper): CLUSTER_SIZE blocks of CLUSTER_WARPS warps share a strip
CLUSTER_WARPS = 4
CLUSTER_SIZE = 8


def _strip_name(d: int, cluster: bool) -> str:
    """awq_strip_kernel's instance: the one-block form <STRIP_WARPS, D> or the cluster form."""
    return (f"awq_strip_kernel<{CLUSTER_WARPS}, {d}, {CLUSTER_SIZE}>" if cluster
            else f"awq_strip_kernel<{STRIP_WARPS}, {d}>")


SOURCES["awq_strip.cu"] = tuple(_strip_name(d, cluster) for cluster in (False, True) for d in STRIP_D)
# small-M kernel (cuda/awq_small.cu): (MB, NW, WARPS, CW, MODE, D) = batch tiles of 8 rows,
# column words per thread, warps per block, warps side by side along N, 0 subnormal nibbles +
# sum(x) zero fix-up / 1 exact q - z via the magic number, stages of each warp's cp.async ring
SMALL_CFGS = ((1, 2, 8, 1, 0, 4), (1, 2, 8, 1, 0, 8), (1, 2, 4, 1, 0, 8), (1, 2, 4, 1, 0, 12),
              (1, 2, 8, 4, 0, 4), (1, 2, 8, 1, 1, 4),
              (2, 1, 4, 1, 0, 8), (2, 1, 8, 1, 0, 8), (2, 1, 4, 1, 1, 8))
SOURCES["awq_small.cu"] = tuple("awq_small_kernel<{}, {}, {}, {}, {}, {}>".format(*c) for c in SMALL_CFGS)
# Hopper kernel (cuda/awq_wgmma.cu, sm_90a only): (NWG, T, D[, BPS]) = warpgroups (128 columns
# each), tokens per block, shared-memory stages[, blocks an SM, default 1]: what wgmma_config
# picks by M. Up to M = 128 the narrowest T that holds M, with ONE warpgroup a block and as many
# blocks an SM as registers and shared memory allow: at small M a block's K walk is a serial
# chain (wait, shared loads, dequant, wgmma group, wait) and a warpgroup issues about half its
# cycles, so more, narrower blocks an SM (12-16 consumer warps instead of 8) stream faster.
# H100, us, rotated weights, plain launches, two warpgroups and 1 block an SM before (session
# 50, bench/NOTES.md): M = 16 4096->12288 19.6 -> 16.9, 4096->24576 30.5 -> 25.5, 4096->4096
# 10.8 -> 10.1, 12288->4096 17.4 -> 17.6; M = 32 21.2 -> 18.6, 31.8 -> 28.1; M = 64 25.7 -> 24.8,
# 4096->1024 11.5 -> 9.9; M = 128 34.8 -> 33.9, 4096->4096 19.5 -> 18.7. GLU needs two
# warpgroups (gate and up); there 2 blocks an SM at M <= 16 (4096->24576 30.8 -> 29.9), the
# one-block forms above. (Also swept, slower or tied: (2, 16, 8 / 10, 2), (1, 16, 8 / 10, 3),
# (1, 16, 14, 2), (2, 32, 6, 2); the sweeps of sessions 8-28 ran (2, 128, 4/6), (1, 128, 6),
# (2, 32, 6) and (2, 256, 4) at 1 block an SM.)
WGMMA_CFGS = ((1, 16, 6, 4), (1, 32, 8, 3), (1, 64, 6, 2), (1, 128, 5, 2), (2, 128, 5), (2, 256, 5))
WGMMA_GLU_CFGS = ((2, 16, 10, 2), (2, 32, 12), (2, 64, 6), (2, 128, 5), (2, 256, 5))
# every non-GLU instance: the GLU configs' plain twins too (test_wgmma_glu_epilogue compares the
# fused epilogue with them, tile for tile)
_WGMMA_PLAIN = WGMMA_CFGS + tuple(c for c in WGMMA_GLU_CFGS if c not in WGMMA_CFGS)


def _wgmma_name(cfg, glu=False) -> str:
    """awq_wgmma_kernel's instance for cfg = (NWG, T, D[, BPS]) (BPS: blocks an SM, default 1)."""
    nwg, t, d, *bps = cfg
    tail = f", {'true' if glu else 'false'}, {bps[0]}" if bps and bps[0] != 1 else ", true" if glu else ""
    return f"awq_wgmma_kernel<{nwg}, {t}, {d}{tail}>"


SOURCES["awq_wgmma.cu"] = (tuple(_wgmma_name(c) for c in _WGMMA_PLAIN)
                           + tuple(_wgmma_name(c, True) for c in WGMMA_GLU_CFGS)
                           # split K's sum past 2 splits (cuda/wgmma_sm90.cuh)
                           + ("wgmma_reduce<4>", "wgmma_reduce<4, true>"))
ARCH_SPECIFIC = {"awq_wgmma.cu"}   # compiled for sm_90a, not sm_90

# ---- dispatch thresholds, measured on the H100 (bench/awq_bench.py; tables in bench/notes-awq.md)
# GEMV (cuda/awq_gemv.cu) vs the small-M kernel at M = 1, timed as the decode graph runs them (PDL,
# back to back, rotated weights; session 12, bench/NOTES.md), us: 4096->24576 25.2 vs 29.4;
# 4096->12288 14.6 vs 14.6; 12288->4096 15.0 vs 14.6; 4096->6144 9.8 vs 9.9; 4096->4096 7.7 vs
# 7.4; 4096->1024 5.7 vs 5.3. It wins where N is wide (many column tiles, no split K needed), so
# M = 1 with N >= GEMV_MIN_N takes it.
# mma -> dequant+cublas crossover (bench runs 3 and 4): 4096->4096 and 4096->1024 at M ~ 96 (tie:
# 29.3 vs 28.7 us, 13.9 vs 13.6 us), 4096->12288 at ~128 (90.0 vs 92.2 us), 12288->4096 between
# 128 and 192 (80.0 vs 93.7; 125.1 vs 115.9 us).
# wgmma with split K vs the best other path (session 8, bench/NOTES.md; us, H100, final kernel):
# it wins from M = 32 to 256 on the big weights -- 4096->12288 M = 32 25.5 vs 30.0 (mma), M = 128
# 48.5 vs 91.0, M = 256 62.9 vs 94.5 (dequant + cuBLAS); 12288->4096 M = 128 49.3 vs 78.5;
# 4096->24576 M = 128 68.7 vs 152 -- ties on some at M = 32, loses at M = 16 (mma 21.8 vs 24.0)
# and on 4096->4096 / 4096->1024 (too few tiles to hide its per-stage latency: 4096->1024
# M = 128 18.9 vs 13.4).
# Since its x tiles come by TMA (bench/NOTES.md session 13, us) it also wins at M = 257..512
# on every weight of 6144 x 4096 and up, whole waves or not: M = 512 4096->6144 52.9 vs 61.2
# (dequant + cuBLAS), 4096->12288 109.7 vs 122.0, 12288->4096 109.3 vs 122.5, 4096->24576 190.2 vs
# 246.0; it loses on 4096->4096 (47.6 vs 41.7). With the last wave's tiles split
# (wgmma_tiles.schedule, session 13) it also wins or ties to M = 1024 on weights of
# 12288 x 4096 and up: M = 768 4096->12288 149.6 vs 155.9, 12288->4096 159.2 vs 159.6, 4096->24576
# 296.8 vs 342.0; M = 1024 196.9 vs 206.9, 184.2 vs 191.8, 384.1 vs 426.4 -- but not on 4096->6144
# (M = 768: 89.4 vs 78.8), nor at M = 1536 (4096->12288 321.6 vs 273.0).
# Small M (bench/NOTES.md session 18, us, rotated weights, graph-timed): with a 16-token tile
# and 16 stages, (2, 16, 16), its time is nearly flat over M = 1..16 -- 4096->12288 19.1-19.4,
# 12288->4096 16.7-17.5, 4096->4096 10.0-10.3, 4096->6144 11.5-11.7, 4096->24576 29.7-30.6 -- and
# it beats dispatch's small-M / mma kernels from M = 8 on weights of 4096 x 4096 and up
# (M = 16: 22.2 -> 19.4, 22.8 -> 17.5, 13.6 -> 10.3, 15.6 -> 11.7, 37.2 -> 30.6; M = 8: 18.3 ->
# 16.9 on 12288->4096, 36.4 -> 30.2 on 4096->24576, a tie on 4096->12288 18.8 vs 19.1), but not
# at 4096->1024 (M = 16: 7.0 vs 8.1). At M = 17..32 (2, 32, 12) beats (2, 32, 6) by 2-6 % and
# mma on the smaller weights too: 4096->4096 M = 32 15.9 -> 10.8, 4096->1024 11.3 -> 9.6.
# Session 50 (WGMMA_CFGS' one-warpgroup configs, 2-4 blocks an SM): the thresholds stand --
# 4096->1024 M = 16 small 7.0-7.1 vs wgmma 8.1; at M = 2-4 small still wins on 4096->12288 (15.6
# vs 17.1) and 12288->4096 (15.7 vs 18.0) but not on 4096->24576 (M = 4 31.0 vs 26.0), a
# per-shape rule not made.
# Session 52 (bench/NOTES.md; forced paths, us, rotated weights, graph replays, each timed four
# times in alternating order, min), after wg::meet took wgmma_reduce's launch off T = 16: the
# small kernel's time climbs with M and wgmma's stays flat, so wgmma wins from M = 5 on weights
# from 4096 x 2048 (WGMMA_LOW_MIN_NK) -- small vs wgmma at M = 5 / 8: 4096->12288 17.1 / 18.4 vs
# 15.5 / 15.7; 12288->4096 16.5 / 18.2 vs 16.7 / 16.9 (a 1 % loss at 5, wins from 6); 4096->4096
# 11.4 / 13.4 vs 9.7 / 9.6; 4096->2048 8.1 / 9.3 vs 8.0 / 8.0; 2048->6144 10.9 / 13.0 vs 8.9 /
# 8.9; 6144->2048 11.1 / 13.3 vs 9.9 / 9.9; GLU 4096->24576 36.4 / 38.7 vs 30.0 / 30.2; at M = 9 /
# 16 (those weights under 4096 x 4096 went to small there too): 2048->6144 12.4 / 14.1 vs 8.7 /
# 8.7, 4096->2048 8.3 / 9.4 vs 7.8 / 7.9, 2048->4096 8.1 / 9.2 vs 7.5 / 7.5, 4096->2560 11.1 /
# 13.2 vs 9.2 / 9.3. Under 4096 x 2048 small mostly stays ahead (4096->1024 M = 16 7.0 vs 7.8,
# 2048->2048 M = 9 6.6 vs 7.0), though GLU 1024->6144 (6.3M elements) would gain from M = 8
# (M = 16 12.1 vs 9.2; taken since session 54: WGMMA_GLU_*). Below M = 5
# small wins on some (12288->4096 M = 4 16.0 vs 16.9, 4096->2048 7.7 vs 8.0), wgmma on others
# (GLU 4096->24576 M = 2 32.0 vs 29.8, 4096->4096 M = 4 10.8 vs 9.6): no one rule by N K (GLU:
# WGMMA_GLU_MIN_M, session 54).
# Session 25 (bench/awq_bench.py --paths all, rotated weights, us; after the split-K hand-over of
# session 23 and the whole-sector stores of session 25): wgmma now beats every other path on
# 4096->4096 from M = 32 to 1024 -- M = 64 13.9 vs 20.4 (mma), M = 128 19.2 vs 30.7 (dequant +
# cuBLAS), M = 512 35.4 vs 41.1, M = 1024 54.1 vs 62.3 -- and loses from 1536 (94.3 vs 85.4);
# 4096->6144 to 1024 (M = 768 72.7 vs 77.1, M = 1024 90.3 vs 93.2), loses at 1536 (140.2 vs 126.4);
# 4096->1024 to M = 64 (48: 11.5 vs 12.2 mma, 64: 11.7 vs 12.6), not from 96 (14.0 vs 13.3 mma,
# M = 128 14.7 vs 13.7 dequant + cuBLAS). At M = 2048 it ties dequant + cuBLAS on 12288 x 4096
# (360.5 vs 377.7, 353.0 vs 354.4) and loses on the rest. Session 31: in a whole prefill, which
# runs at the card's power cap (session 28), wgmma wins to 2048 after all, its fused SwiGLU
# included -- the Qwen3-8B-shaped runner's prefill with wgmma to M = 1536 / 2048 vs to 1024: +9 % /
# +6 % tok/s (6 rounds each, rotated order, every round the same way); at 4096 dequant + cuBLAS
# stays ahead (-3 %). gguf.py has the same finding.
WGMMA_MIN_M = 5         # on Hopper, WGMMA_MIN_M <= M <= WGMMA_MAX_M on weights of
WGMMA_MAX_M = 2048
WGMMA_MIN_NK = 4096 * 4096         # at least this many elements,
WGMMA_LOW_MIN_NK = 4096 * 2048     # for M <= 16 on weights of at least this many,
WGMMA_MID_MAX_M = 256              # and for 17 <= M <= WGMMA_MID_MAX_M on weights of
WGMMA_MID_MIN_NK = 4096 * 1024     # at least this many
# GLU (matmul(glu=True): wgmma's epilogue, where small writes the [M, N] product and silu_mul
# reads it back) from M = WGMMA_GLU_MIN_M on weights of WGMMA_GLU_MIN_NK and up, and to M = 16
# from WGMMA_GLU_LOW_MIN_NK. Session 54 (bench/NOTES.md; H100, us, rotated weights, graph
# replays, alternated, min of 3), wgmma vs small, K->N as [gate | up], M = 2 / 4 / 8:
# 2048->12288 12.6 / 12.6 / 12.5 vs 16.1 / 17.8 / 21.7; 2560->19456 19.5 / 19.4 / 19.6 vs 24.0 /
# 26.7 / 32.4; 4096->24576 29.7 / 29.7 / 29.7 vs 31.7 / 33.3 / 38.2; 1024->6144 9.0 / 8.9 / 8.8
# vs 8.1 / 8.8 / 10.1 -- ahead there from M = 5 (8.9 vs 9.2; M = 16 9.1 vs 12.1). Only where the
# epilogue runs (N % 64 == 0; else wgmma too writes the product for silu_mul). Plain weights
# keep WGMMA_MIN_M: at M = 2 / 4 small wins on 12288->4096 (15.0 / 15.9 vs 16.7 / 16.7), wgmma
# on 4096->4096 at M = 3-4 (M = 4 9.5 vs 10.6) -- no rule by N K alone.
WGMMA_GLU_MIN_M = 2
WGMMA_GLU_MIN_NK = 2048 * 12288
WGMMA_GLU_LOW_MIN_NK = 1024 * 6144
# Session 51 (bench/NOTES.md; H100, us, rotated weights, graph replays, each candidate timed twice
# in opposite orders): on those mid-size weights (WGMMA_MID_MIN_NK <= N K < WGMMA_MIN_NK) wgmma
# with 64-token tiles (WGMMA_CFGS' T = 64 config, several token tiles a launch past M = 64) beats mma and
# dequant + cuBLAS from M = 65 to 256 -- K->N at M = 80 / 128 / 192 / 256: 4096->1024 9.9 / 10.1
# / 11.6 / 12.7 vs 12.4 / 13.3 / 13.8 / 14.4; 4096->2560 13.3 / 13.9 / 16.8 / 20.0 vs 22.0 /
# 18.9 / 21.7 / 21.0; 6144->2048 14.4 / 15.1 / 19.1 / 22.5 vs 23.3 / 23.7 / 26.1 / 28.7;
# 2048->6144 15.3 / 15.2 / 20.9 / 21.1 vs 30.3 / 19.4 / 27.2 / 24.8; 1024->4096 10.1 / 10.1 /
# 10.8 / 11.4 vs 11.9 / 10.4 / 11.0 / 11.1 -- losing only at M = 256 on the two smallest weights
# (1024->4096 above, 2048->2048 12.9 vs 12.2). (1, 128, 5, 2) was up to 20 % slower there
# (4096->1024 M = 128 12.1), 2-4 % faster on a few (2048->6144 M = 80 14.7). Past
# 256 dequant + cuBLAS wins on the smaller of them (2048->4096 M = 320 18.4 vs 21.0). GLU, the
# same weights as [gate | up] (the T = 64 GLU config): 1024->6144 14.4 / 13.9 / 14.6 / 14.6 vs
# dispatch's mma or dequant + cuBLAS and silu_mul 24.5 / 14.5 / 18.3 / 18.1; 2560->4096 14.4 /
# 15.0 / 20.6 / 21.4 vs 23.4 / 21.5 / 23.4 / 23.6.
# Split tiles past 2 splits at token tiles T <= WGMMA_MEET_MAX_T: their parts summed in the kernel
# by the last to finish (wg::meet), not by a wgmma_reduce launch. Session 52 (H100, us, rotated
# weights, graph replays, each timed three times in alternating order, min; bench/NOTES.md), meet
# vs reduce at T = 16, K->N at M = 4 / 8 / 16: 4096->12288 15.4 / 15.5 / 15.5 vs 16.0 / 16.1 /
# 16.1; 12288->4096 16.6 / 16.6 / 16.7 vs 16.9 / 16.9 / 17.1; 4096->4096 9.4 / 9.7 / 9.7 vs 9.7 /
# 9.7 / 9.9; 2048->6144 M = 16 8.7 vs 9.3; GLU 4096->8704 M = 4 / 16 14.8 / 15.0 vs 15.7 / 15.7;
# 6144->2048 M = 16 9.9 vs 9.8. At T = 32 it loses where a tile has many splits (6144->2048
# M = 32 11.5 vs 10.5, 4096->4096 11.1 vs 10.8: the last block reads every split's T x 128
# floats alone), and at T = 64 by 10-30 % (4096->1024 M = 128 11.2 vs 9.9).
WGMMA_MEET_MAX_T = 16
WGMMA_N_MULTIPLE = 32   # wgmma's weight tiles come by TMA, which needs 16-byte rows: N/8 words % 4 == 0
GEMV_MIN_N = 16384      # M = 1 and N >= this: gemv
# M = 1 on a weight of STRIP_MIN_K <= K <= STRIP_MAX_K rows and STRIP_MIN_N <= N <= STRIP_MAX_N
# columns: strip (K from 1024, the smallest measured: below, few warps of a block have groups).
# H100, us under PDL, rotated weights, graph replays (bench/NOTES.md session 48), strip vs
# awq_small, K->N: 1024->4096 4.12 vs 5.21, 2048->4096 4.76 vs 5.75, 3072->3072 6.88 vs 7.50,
# 4096->3072 7.20 vs 7.82, 4096->4096 7.58 vs 8.69, 4096->6144 9.40 vs 10.08, 4096->8192 10.49 vs
# 12.11, 5120->5120 11.20 vs 13.91; it loses with too few blocks for the steps (4096->2048: 32
# blocks, 6.79 vs 6.01), too many steps a warp (8192->4096 12.99 vs 12.14; 12288->4096 18.8 vs
# 15.4) and past one wave of blocks (one 512-thread block per SM: 4096->12288 has 192, 17.46 vs
# 14.90). (2048->2048 won too, 4.26 vs 5.13, outside this rule.) In the runner's decode graph,
# Qwen3-8B's qkv and o_proj on it: AWQ decode 359 -> 365.5 tok/s.
STRIP_MIN_K = 1024
STRIP_MAX_K = 5120
STRIP_MIN_N = 3072
STRIP_MAX_N = 8192
# M = 1 on Hopper, CLUSTER_MIN_K <= K, CLUSTER_MIN_N <= N <= CLUSTER_MAX_N, N * K <= CLUSTER_MAX_NK,
# not N = 4096 with K < 4096: strip-cluster (<4, D, 8>: 8 blocks of 4 warps a strip). H100, us under
# PDL, rotated weights (bench/NOTES.md session 49), dispatch before -> it, K->N: 1024->1024 5.11 ->
# 3.47 (small), 1024->2048 5.16 -> 3.79, 2048->1024 5.03 -> 3.65, 2048->2048 5.16 -> 4.26, 4096->512
# 5.25 -> 3.65, 4096->1024 5.31 -> 4.26, 4096->2048 5.99 -> 5.21, 3072->3072 7.12 -> 5.91 (strip),
# 4096->3072 7.29 -> 6.43, 4096->4096 7.76 -> 7.18, 6144->4096 10.56 -> 9.45 (small), 8192->1024 6.57 ->
# 6.22, 8192->2048 9.16 -> 7.61, 8192->4096 12.27 -> 11.24, 12288->1024 8.92 -> 8.48, 12288->2048
# 11.65 -> 10.85; it loses at 1024->4096 (strip 4.33 vs 4.48) and 2048->4096 (5.04 vs 5.25), where
# 32 warps a strip share 8-16 groups, past 8192 x 4096 (12288->4096 small 14.52 vs 15.33) and
# with more strips (4096->6144 strip 9.52 vs 10.71, 5120->5120 11.43 vs 13.75, 4096->8192 10.52
# vs 12.70). (The strip figures here are its instance as an explicit 1 x 1 x 1 cluster, 2-3 %
# slower than the plain kernel dispatch runs since: 4096->4096 strip 7.46 vs strip-cluster 7.04,
# 4096->6144 strip 9.28, 2048->4096 4.81.)
CLUSTER_MIN_K = 1024
CLUSTER_MIN_N = 512
CLUSTER_MAX_N = 4096
CLUSTER_MAX_NK = 8192 * 4096
GEMV_DEFAULT = (2, 8, 4)
GEMV_MIN_STEPS = 8      # gemv_plan: fewest k-steps (8 rows) per warp
# (K, N) -> ((NW, WARPS, D), K splits). The runner's fused gate/up: (4, 4, 4) with 4 splits, picked
# in the decode graph itself (bench/NOTES.md session 27: 36-layer Qwen3-8B shape,
# four alternations, with o_proj's 8 splits below: 352.1 tok/s against 349.4 with session 12's
# (2, 8, 4) and one split, which had won timed alone).
GEMV_TUNED = {(4096, 24576): ((4, 4, 4), 4)}
MMA_MAX_M = 96          # M <= this and not small: mma; above: dequant + cuBLAS ...
MMA_MAX_M_BIG = 128     # ... except for N >= 8192 or K >= 8192 (more weight bytes per FLOP)
MMA_SMALL = (1, 2, 1)   # M <= 16, N >= 2048
# small-M kernel vs mma and wgmma (H100, us, plain launches; session 9, after awq_small's
# loop-carried addresses, bench/NOTES.md): small wins at M <= 8 on the Qwen3-8B shapes
# (4096->12288 M = 8: 17.9 vs mma 20.3 / wgmma 20.0; 12288->4096: 18.0 vs 21.0 / 20.1; a tie only
# at 4096->24576 M = 8, 35.5 vs mma 34.7), and at 8 < M <= 16 only for the small weights
# (4096->1024 M = 16: 7.2 vs 10.8; 4096->12288 M = 16: 31.0 vs mma 22.6). On Hopper choose_path
# asks wgmma first, which since session 18 takes M = 8 on weights of WGMMA_MIN_NK and up, and
# since session 52 M = 5 on weights from WGMMA_LOW_MIN_NK (the comment at WGMMA_MIN_M); with
# glu from M = 2 (session 54, WGMMA_GLU_*).
SMALL_MAX_M = 16        # M <= 8, and M <= this with ...
SMALL_MMA_NK = 1 << 24  # ... N * K <= this: the small-M kernel (awq_small.cu); else mma
SMALL_M1 = (1, 2, 8, 1, 0, 4)   # config for M <= 8 on untuned shapes ...
SMALL_M2 = (2, 1, 4, 1, 0, 8)   # ... and for 8 < M <= 16
SMALL_BLOCKS_PER_SM = 2  # small_plan: target blocks per SM
SMALL_MIN_STEPS = 4      # small_plan: fewest k-steps (16 rows) per warp
# Rows of x a call takes: M is an int kernel parameter. Every element offset is formed in 64 bits
# ((size_t) row * N for y and the split-K partials, (size_t) row * K for x, x by TMA on Hopper), so
# M * N and M * K may pass 2^31: the limit was M * max(K, N) < 2^31, which refused a quantized
# lm_head (N = 151936) past 14134 rows -- Model.logits over a 16k-token text.
MAX_M = 2**31 - 1
# (K, N, MB) -> (config, K splits): the fastest measured per Qwen3-8B shape (bench run 10,
# bench/notes-awq.md; MB = 2 also serves M <= 8 where it won)
SMALL_TUNED = {
    # M = 1 on the shapes the runner's decode graph runs (fused q/k/v 4096->6144, o 4096->4096,
    # fused gate/up 4096->24576, down 12288->4096) and 4096->12288: the best of a config x split
    # sweep timed as that graph runs them, back to back with programmatic dependent launch
    # (sessions 3 and 4, re-swept in session 9 after the loop-carried copy addresses, bench/NOTES.md):
    # 9.9 / 7.1 / 27.8 / 14.4 / 14.5 us. Under PDL one split (no split-K epilogue) wins on the wide
    # shapes (session 4: 4096->12288 17.1 us vs 20.6 for session 2's plain-launch pick, (1, 2, 4, 1,
    # 0, 8) with 4 splits).
    (4096, 6144, 1): ((1, 2, 8, 1, 0, 4), 2),
    # o_proj: 8 splits in the decode graph (session 27: 349.4 tok/s against 344.8 with 4 splits,
    # four alternations; timed alone, back to back, 4 splits had been the fastest)
    (4096, 4096, 1): ((1, 2, 8, 1, 0, 4), 8),
    (4096, 24576, 1): ((1, 2, 8, 1, 0, 4), 1),   # (dispatch now takes gemv there: GEMV_MIN_N)
    (4096, 1024, 1): ((2, 1, 4, 1, 0, 8), 8),
    (4096, 12288, 1): ((1, 2, 8, 1, 0, 4), 1),
    (12288, 4096, 1): ((1, 2, 8, 1, 0, 4), 4),
    (4096, 4096, 2): ((2, 1, 4, 1, 0, 8), 4),
    (4096, 1024, 2): ((2, 1, 4, 1, 0, 8), 8),
    (4096, 12288, 2): ((2, 1, 4, 1, 0, 8), 2),
    (12288, 4096, 2): ((2, 1, 4, 1, 0, 8), 4),
}
SLAB_BYTES = 0          # dequant+cublas: fp16 slab size (0 = whole weight); see slab_columns

# mma kernel shared memory (must match MmaCfg in awq_mma.cu)
def _mma_smem(mt: int, ng: int, occ: int = 1) -> int:
    a = 16 * mt * (128 + 8) * 2
    b = 128 * (8 * ng + 4) * 4
    s = 4 * 8 * ng * 16
    z = 4 * 8 * ng * 4
    return (3 if occ >= 4 else 4) * (a + b + s + z)


# ------------------------------------------------------------------ validation
def _check_tensor(name, t, dtype, shape, device=None, structure=True, place=True):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch tensor, got {type(t).__name__}")
    if structure:
        if t.dtype != dtype:
            raise ValueError(f"{name}: dtype {t.dtype}, expected {dtype}")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")
        if t.is_neg():
            raise ValueError(negated(name, written=name == "out"))
        if t.numel() and t.data_ptr() % 16:
            raise ValueError(f"{name}: data pointer must be 16-byte aligned")
    if place:
        if t.device.type != "cuda":
            raise ValueError(f"{name}: on {t.device}, expected a CUDA tensor")
        if device is not None and t.device != device:
            raise ValueError(f"{name}: on {t.device}, but the other operands are on {device}")


def check_weights(qweight, scales, qzeros, group_size=None):
    """Validate the three AWQ tensors; returns (K, N, G)."""
    for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name}: must be 2-D, got shape {tuple(t.shape)}")
    k, n8 = qweight.shape
    n = 8 * n8
    if group_size is None:
        if scales.shape[0] == 0 or k % scales.shape[0]:
            raise ValueError(f"scales: {scales.shape[0]} groups do not divide K={k}")
        group_size = k // scales.shape[0]
    # an int (numpy's too), as formats.awq.check_shape asks: "32" and 32.0 had passed or been refused
    # as "32 is not supported" (32.0 == 32), and the operator's schema refuses both
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size not in GROUP_SIZES:
        raise ValueError(f"group_size: {group_size!r} is not supported; choose an int, one of {GROUP_SIZES}")
    group_size = int(group_size)
    if scales.shape[0] * group_size != k:
        raise ValueError(f"group_size: {group_size} disagrees with scales' {scales.shape[0]} groups "
                         f"over qweight's K={k} rows")
    if k == 0 or n8 == 0:
        raise ValueError(f"qweight: empty shape {tuple(qweight.shape)}")
    if k >= 2**31 or n >= 2**31:   # (the kernels take K and N as int; numpy's int32 would overflow)
        raise ValueError(f"qweight: shape {tuple(qweight.shape)} is K={k} x N={n}, too large for the kernels' "
                         "32-bit K and N")
    if k % group_size:
        raise ValueError(f"qweight: K={k} is not a multiple of group_size={group_size}")
    dev = qweight.device
    want = (("qweight", qweight, torch.int32, (k, n8)),
            ("qzeros", qzeros, torch.int32, (k // group_size, n8)),
            ("scales", scales, torch.float16, (k // group_size, n)))
    for name, t, dtype, shape in want:          # shapes and dtypes first, then devices
        _check_tensor(name, t, dtype, shape, place=False)
    for name, t, dtype, shape in want:
        _check_tensor(name, t, dtype, shape, dev, structure=False)
    return k, n, group_size


def _check_x(x, k, dev, fake=False):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch tensor, got {type(x).__name__}")
    if x.dtype != torch.float16:
        raise ValueError(f"x: dtype {x.dtype}, the AWQ kernels take float16 activations")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x: shape {tuple(x.shape)}, the last dimension must be K={k}")
    if x.device != dev:
        raise ValueError(f"x: on {x.device}, but the weight is on {dev}")
    if fake:   # (the fake kernel's checks: strides and data pointers are the kernel's)
        return
    if not x.is_contiguous():
        raise ValueError("x: must be contiguous")
    if x.is_neg():
        raise ValueError(negated("x"))
    if x.numel() and x.data_ptr() % 16:
        raise ValueError("x: data pointer must be 16-byte aligned")


def _unpack_qt(qt):
    if qt.format != "awq":
        raise ValueError(f"qt: format {qt.format!r}, expected 'awq'")
    if not isinstance(qt.data, dict):
        raise ValueError("qt: data must be the dict {qweight, qzeros, scales}")
    takes = qt.fmt.param_names   # the registry's rule, as Format.check applies it on the CPU
    if not isinstance(qt.params, dict) or set(qt.params) - set(takes):
        raise ValueError(f"qt: params {qt.params!r}; awq takes only {list(takes)}")
    d = qt.data
    if qt.shape[0] % 8:
        raise ValueError(f"qt: N={qt.shape[0]} out_features must be a multiple of 8 (8 nibbles per int32)")
    qw = d.get("qweight")
    if qw is not None and not isinstance(qw, torch.Tensor):
        raise ValueError(f"qt: its arrays are {type(qw).__name__} on the CPU; move the weight with qt.to('cuda')")
    if getattr(qw, "ndim", 0) == 2 and (8 * qw.shape[1], qw.shape[0]) != tuple(qt.shape):
        raise ValueError(f"qt: shape {qt.shape} disagrees with qweight {tuple(qw.shape)} "
                         f"(K={qw.shape[0]}, N={8 * qw.shape[1]})")
    k, n, g = check_weights(qw, d.get("scales"), d.get("qzeros"), qt.group_size)
    return d["qweight"], d["scales"], d["qzeros"], k, n, g


# ------------------------------------------------------------------ launch plumbing
def _kernel(source, name):
    from quantzoo.cuda_launch import get_kernel

    return get_kernel(source, name, SOURCES[source], arch_specific=source in ARCH_SPECIFIC)



def _launch(kern, grid, block, args, smem=0):
    from quantzoo.cuda_launch import launch

    launch(kern, grid, block, args, shared_mem=smem)


def _splits(tiles: int, k: int, unit: int, slots: int, min_rows: int = 0) -> tuple[int, int]:
    """Split K into S chunks (multiples of `unit` rows, at least min_rows) for `tiles` output
    tiles on `slots` resident blocks: the S with the least modelled time, waves * (rows per
    split + a fixed cost of 64 rows per block for prologue and epilogue), waves =
    ceil(tiles*S/slots); the smallest such S on ties. Returns (S, rows per split)."""
    units = -(-k // unit)
    max_s = max(1, units // max(1, -(-min_rows // unit)))
    best, best_s = None, 1
    for s in range(1, max_s + 1):
        per_units = -(-units // s)
        s_eff = -(-units // per_units)
        cost = -(-tiles * s_eff // slots) * (per_units + 64 // unit)
        if best is None or cost < best:
            best, best_s = cost, s_eff
    per = -(-units // best_s) * unit
    return -(-k // per), per


def _split_rows(k: int, splits: int, rows: int) -> np.int32:
    """rows (a K split's rows, the kernels' int rows_per_split) for `splits` splits of K, checked:
    a kernel forms the end of its split, its first row plus rows, as an int too, and for a last
    split ending past 2^31 - 1 that sum wrapped negative (K within splits x 8..64 rows of 2^31,
    as K = 2^31 - 32 on the small-M kernel at M = 1 on 132 SMs): the mma kernel's last split ran
    no stage, its rows missing from y without a word, and in the gemv and small-M kernels
    (awq::slice_steps) min(K, kb + rows) - kb wrapped back to rows, a walk past K's last row."""
    if splits * rows > 2**31 - 1:
        raise ValueError(f"qweight: K={k} rows in {splits} splits of {rows} end at row {splits * rows}, past the "
                         "kernels' 32-bit rows (path='dequant+cublas' splits no K, nor 'strip' or 'strip-cluster' "
                         "at M = 1)")
    return np.int32(rows)


# ------------------------------------------------------------------ public entry points
def choose_path(m: int, qt=None, dev=None, glu: bool = False) -> str:
    """The path matmul takes for M rows of x and weight qt on device dev (default: qt's device;
    thresholds measured on the H100); glu: for matmul(glu=True), which wgmma takes sooner."""
    n, k = qt.shape if qt is not None else (4096, 4096)
    if dev is None and qt is not None and isinstance(getattr(qt, "data", None), dict):
        qw = qt.data.get("qweight")
        dev = qw.device if isinstance(qw, torch.Tensor) else None
    min_nk = WGMMA_LOW_MIN_NK if m <= 16 else WGMMA_MID_MIN_NK if m <= WGMMA_MID_MAX_M else WGMMA_MIN_NK
    min_m = WGMMA_MIN_M
    if glu and n % 64 == 0:   # where wgmma's GLU epilogue runs (gate and up halves of whole 32-column tiles)
        min_m = WGMMA_GLU_MIN_M if n * k >= WGMMA_GLU_MIN_NK else WGMMA_MIN_M
        min_nk = min(min_nk, WGMMA_GLU_LOW_MIN_NK) if m <= 16 else min_nk
    if (min_m <= m <= WGMMA_MAX_M and n % WGMMA_N_MULTIPLE == 0 and dev is not None and dev.type == "cuda"
            and wgmma_available(dev)
            and n * k >= min_nk):
        return "wgmma"
    if m == 1 and n >= GEMV_MIN_N:
        return "gemv"
    if (m == 1 and CLUSTER_MIN_K <= k and CLUSTER_MIN_N <= n <= CLUSTER_MAX_N and n * k <= CLUSTER_MAX_NK
            and not (k < 4096 <= n) and dev is not None and dev.type == "cuda" and clusters_available(dev)):
        return "strip-cluster"
    if m == 1 and STRIP_MIN_K <= k <= STRIP_MAX_K and STRIP_MIN_N <= n <= STRIP_MAX_N:
        return "strip"
    if m <= 8 or (m <= SMALL_MAX_M and n * k <= SMALL_MMA_NK):
        return "small"
    limit = MMA_MAX_M_BIG if (n >= 8192 or k >= 8192) else MMA_MAX_M
    return "mma" if m <= limit and _mma_tiles_n(m, n) <= MAX_GRID_YZ else "dequant+cublas"


@on_tensor_device
def dequantize_into(qweight, scales, qzeros, out, k, n, g, c0=0, nw=None):
    """Column words [c0, c0 + nw) of the fp16 weight into out (fp16 [K, 8 * nw], contiguous)."""
    nw = n // 8 if nw is None else nw
    kern = _kernel("awq_dequant.cu", "awq_dequant_kernel")
    total = k * nw
    threads = 256
    blocks = min(-(-total // threads), _sm_count(qweight.device) * 16)
    _launch(kern, (blocks,), (threads,),
            (qweight.data_ptr(), qzeros.data_ptr(), scales.data_ptr(), out.data_ptr(),
             np.int32(k), np.int32(n), np.int32(g), np.int32(c0), np.int32(nw)))
    return out


@on_tensor_device
def awq_dequantize(qweight, scales, qzeros, group_size=None):
    """fp16 [K, N] = (q - z) * s, bit-identical to the numpy reference (transposed)."""
    k, n, g = check_weights(qweight, scales, qzeros, group_size)
    out = torch.empty((k, n), dtype=torch.float16, device=qweight.device)
    return dequantize_into(qweight, scales, qzeros, out, k, n, g)


@on_tensor_device
def dequantize(qt) -> torch.Tensor:
    """fp16 [K, N] from a CUDA AWQ QuantizedTensor."""
    qweight, scales, qzeros, k, n, g = _unpack_qt(qt)
    out = torch.empty((k, n), dtype=torch.float16, device=qweight.device)
    return dequantize_into(qweight, scales, qzeros, out, k, n, g)


def gemv_config(n: int, k: int) -> tuple[tuple[int, int, int], int | None]:
    """((NW, WARPS, D), splits or None = gemv_plan's) of the GEMV for this shape."""
    return GEMV_TUNED.get((k, n), (GEMV_DEFAULT, None))


def gemv_plan(tiles: int, k: int, warps: int, slots: int) -> int:
    """K splits for `tiles` column tiles on `slots` resident blocks: one full wave, but every
    warp keeps >= GEMV_MIN_STEPS k-steps (8 rows each)."""
    s = max(1, slots // max(1, tiles))
    return max(1, min(s, k // (8 * warps * GEMV_MIN_STEPS)))


def _gemv(x2, qweight, scales, qzeros, y, m, k, n, g, cfg=None, splits=None):
    if m != 1:
        raise ValueError(f"path: 'gemv' takes M = 1, got M={m}")
    dev = x2.device
    tuned_cfg, tuned_splits = gemv_config(n, k)
    nw, warps, d = cfg or tuned_cfg
    if cfg is None and splits is None:
        splits = tuned_splits
    vec = (n // 8) % nw == 0
    name = "awq_gemv_kernel<{}, {}, {}, {}>".format(nw, warps, d, "true" if vec else "false")
    kern = _kernel("awq_gemv.cu", name)
    tiles = -(-(n // 8) // (8 * nw))
    if splits is None:
        splits = gemv_plan(tiles, k, warps, _blocks_per_sm(kern, 0) * _sm_count(dev))
    per = 8 * -(-(k // 8) // max(1, splits))
    splits = -(-k // per)
    rows = _split_rows(k, splits, per)
    ws = workspaces.scratch("partials", splits * n if splits > 1 else 1, torch.float32, dev)
    ctr = workspaces.counters(tiles, dev)
    _launch(kern, (tiles, splits), (32 * warps,),
            (x2.data_ptr(), qweight.data_ptr(), qzeros.data_ptr(), scales.data_ptr(), y.data_ptr(),
             ws.data_ptr(), ctr.data_ptr(), np.int32(k), np.int32(n), np.int32(g), rows))


def _strip(x2, qweight, scales, qzeros, y, m, k, n, g, cluster=False):
    """One block (or, with cluster, one thread-block cluster of CLUSTER_SIZE) per 8 column words."""
    path = "strip-cluster" if cluster else "strip"
    if m != 1:
        raise ValueError(f"path: '{path}' takes M = 1, got M={m}")
    if cluster and not clusters_available(x2.device):
        raise ValueError(f"path: 'strip-cluster' needs thread-block clusters (compute capability 9.0 or newer), "
                         f"which {x2.device} lacks")
    d = next(d for d in STRIP_D if (g // 8) % d == 0)
    warps, cl = (CLUSTER_WARPS, CLUSTER_SIZE) if cluster else (STRIP_WARPS, 1)
    kern = _kernel("awq_strip.cu", _strip_name(d, cluster))
    _launch(kern, (cl * -(-(n // 8) // 8),), (32 * warps,),
            (x2.data_ptr(), qweight.data_ptr(), qzeros.data_ptr(), scales.data_ptr(), y.data_ptr(),
             np.int32(k), np.int32(n), np.int32(g)))


def _strip_cluster(*args):
    _strip(*args, cluster=True)


def mma_config(m: int, n: int) -> tuple[int, int, int]:
    """(MT, NG, OCC) for the mma kernel, the fastest measured on the H100 per M range
    (bench/notes-awq.md): wide 16-row tiles while M <= 16, taller ones above. OCC = 4 (3 stages,
    128 registers) measured no faster than OCC = 1 (4096->12288 M = 1: 20.4 vs 19.2 us)."""
    if m <= 16:
        return MMA_SMALL if n >= 2048 else (1, 1, 1)
    if m <= 32:
        return (2, 1, 1) if n >= 8192 else (2, 2, 1) if n >= 2048 else (4, 1, 1)
    if m <= 64:
        return (2, 1, 1) if n >= 8192 or n < 2048 else (4, 1, 1)
    if m <= 96:
        return (2, 1, 1)
    return (4, 1, 1)


def _mma_tiles_n(m: int, n: int, cfg=None) -> int:
    """Column tiles of the mma kernel (its gridDim.y) for M rows and N columns."""
    ng = (cfg or mma_config(m, n))[1]
    return -(-(n // 8) // (8 * ng))


def _mma(x2, qweight, scales, qzeros, y, m, k, n, g, cfg=None):
    dev = x2.device
    mt, ng, occ = cfg or mma_config(m, n)
    tiles_n = _mma_tiles_n(m, n, (mt, ng, occ))
    if tiles_n > MAX_GRID_YZ:   # choose_path sends such a weight to dequant+cublas
        raise ValueError(f"path: 'mma' at M={m} cuts N={n} into {tiles_n} column tiles of {64 * ng}, past CUDA's "
                         f"gridDim.y limit of {MAX_GRID_YZ}; 'dequant+cublas' takes this weight")
    tiles_m = -(-m // (16 * mt))
    smem = _mma_smem(mt, ng, occ)
    name = f"awq_mma_kernel<{mt}, {ng}, {occ}>"
    kern = _kernel("awq_mma.cu", name)
    _set_smem(kern, smem)
    slots = _blocks_per_sm(kern, smem) * _sm_count(dev)
    splits, per = _splits(tiles_n * tiles_m, k, 32, slots, min_rows=128)
    rows = _split_rows(k, splits, per)
    ws = workspaces.scratch("partials", splits * m * n if splits > 1 else 1, torch.float32, dev)
    ctr = workspaces.counters(tiles_n * tiles_m, dev)
    _launch(kern, (tiles_m, tiles_n, splits), (128,),
            (x2.data_ptr(), qweight.data_ptr(), qzeros.data_ptr(), scales.data_ptr(), y.data_ptr(),
             ws.data_ptr(), ctr.data_ptr(), np.int32(m), np.int32(k), np.int32(n), np.int32(g),
             rows), smem)


def slab_columns(k, n, slab_bytes=None):
    """Columns per dequant slab: the fp16 slab K x cols stays under slab_bytes (a multiple of 256
    columns), so it is still in L2 when cuBLAS reads it; 0 bytes = the whole weight at once."""
    slab_bytes = SLAB_BYTES if slab_bytes is None else slab_bytes
    if slab_bytes <= 0:
        return n
    cols = max(256, (slab_bytes // (2 * k)) // 256 * 256)
    return min(n, cols)


def _dequant_cublas(x2, qweight, scales, qzeros, y, m, k, n, g, slab_bytes=None):
    cols = slab_columns(k, n, slab_bytes)
    buf = workspaces.scratch("dequant", k * cols, torch.float16, x2.device)
    for c in range(0, n, cols):
        nc = min(cols, n - c)
        w = buf[: k * nc].view(k, nc)
        dequantize_into(qweight, scales, qzeros, w, k, n, g, c // 8, nc // 8)
        torch_step(functools.partial(_slab_mm, w, m, k, n, c), x2, y)


def _slab_mm(w, m, k, n, c, x, y):
    """Columns [c, c + w's) of y (M x N) = x (M x K) @ w by cuBLAS, accumulating in fp32 like the
    other paths (cuBLAS's fp16 split-K reductions forbidden for the call)."""
    flags = torch.backends.cuda.matmul
    prev = flags.allow_fp16_reduced_precision_reduction
    flags.allow_fp16_reduced_precision_reduction = False
    try:
        if w.shape[1] == n:
            torch.mm(x.view(m, k), w, out=y.view(m, n))
        else:
            y.view(m, n)[:, c:c + w.shape[1]] = torch.mm(x.view(m, k), w)
    finally:
        flags.allow_fp16_reduced_precision_reduction = prev


class _Shape:
    def __init__(self, n, k):
        self.shape = (n, k)


def small_config(m: int, n: int, k: int = 4096) -> tuple:
    """(MB, NW, WARPS, CW, MODE, D) of the small-M kernel: the tuned entry for this shape, else
    SMALL_M1 (M <= 8) / SMALL_M2 (M <= 16)."""
    mb = 1 if m <= 8 else 2
    tuned = SMALL_TUNED.get((k, n, mb))
    if tuned is not None:
        return tuned[0]
    return SMALL_M1 if mb == 1 else SMALL_M2


def small_plan(tiles: int, k: int, kslices: int, sms: int) -> tuple[int, int]:
    """Split K into S chunks (multiples of 16 rows) for `tiles` column tiles: about
    SMALL_BLOCKS_PER_SM blocks per SM (the sweeps in bench/notes-awq.md: one 8-warp block per
    SM leaves the weight stream latency-bound, two fill it; more only add split-K partials),
    but every warp (K is cut into `kslices` per block) keeps >= SMALL_MIN_STEPS k-steps.
    Returns (S, rows per split)."""
    steps = max(1, k // 16)
    s = max(1, round(SMALL_BLOCKS_PER_SM * sms / max(1, tiles)))
    s = max(1, min(s, steps // (kslices * SMALL_MIN_STEPS)))
    per = -(-steps // s)
    return -(-steps // per), 16 * per


def _small_smem(m: int, mb: int, nw: int, warps: int, d: int) -> int:
    """Dynamic shared memory of awq_small_kernel (SmallRing in awq_small.cu): the per-warp
    cp.async rings, reused after the main loop for the warps' [M][64*NW] fp32 partials."""
    ring = warps * d * (16 * (8 * nw + 4) + 64 * mb) * 4
    return max(ring, warps * m * 64 * nw * 4)


def _small(x2, qweight, scales, qzeros, y, m, k, n, g, cfg=None, splits=None):
    dev = x2.device
    mb, nw, warps, cw, mode, d = cfg or small_config(m, n, k)
    if m > 8 * mb:
        raise ValueError(f"path: the small-M kernel with MB={mb} takes M <= {8 * mb}, got M={m}")
    tiles = -(-(n // 8) // (8 * nw * cw))
    name = "awq_small_kernel<{}, {}, {}, {}, {}, {}>".format(mb, nw, warps, cw, mode, d)
    kern = _kernel("awq_small.cu", name)
    smem = _small_smem(m, mb, nw, warps, d)
    # the largest this kernel ever asks for (M = 8 * MB), so one attribute serves every M
    _set_smem(kern, _small_smem(8 * mb, mb, nw, warps, d))
    tuned = SMALL_TUNED.get((k, n, mb))
    if splits is None and tuned is not None and tuned[0] == (mb, nw, warps, cw, mode, d):
        splits = tuned[1]
    if splits is None:
        splits, per = small_plan(tiles, k, warps // cw, _sm_count(dev))
    else:
        steps = k // 16
        per = 16 * -(-steps // splits)
        splits = -(-k // per)
    rows = _split_rows(k, splits, per)
    ws = workspaces.scratch("partials", splits * m * n if splits > 1 else 1, torch.float32, dev)
    ctr = workspaces.counters(tiles, dev)
    _launch(kern, (tiles, splits), (32 * warps,),
            (x2.data_ptr(), qweight.data_ptr(), qzeros.data_ptr(), scales.data_ptr(), y.data_ptr(),
             ws.data_ptr(), ctr.data_ptr(), np.int32(m), np.int32(k), np.int32(n), np.int32(g),
             rows), smem)


def _wgmma_smem(nwg: int, t: int, d: int) -> int:
    """Dynamic shared memory of awq_wgmma_kernel (awqw::Cfg in awq_wgmma.cu)."""
    words = wgmma_tiles.columns(nwg, t) // 8
    return wgmma_tiles.smem_bytes(t * 128 + 64 * words * 4 + 2 * words * 16 + 2 * words * 4, d)


def wgmma_config(m: int, n: int | None = None, k: int | None = None, slots: int | None = None,
                 glu: bool = False):
    """(NWG, T, D[, BPS]) of the AWQ wgmma kernel for M rows: up to M = 128 the narrowest token
    tile that holds M (WGMMA_CFGS, or WGMMA_GLU_CFGS with glu: the comment above them says why),
    and on an N x K weight under WGMMA_MIN_NK 64-token tiles from M = 65 to WGMMA_MID_MAX_M (the
    comment at WGMMA_MID_MAX_M); above, the rule both wgmma kernels share (wgmma_tiles.config)."""
    mid = n is not None and k is not None and n * k < WGMMA_MIN_NK
    if m <= 128 or (mid and m <= WGMMA_MID_MAX_M):
        t = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 or mid else 128
        return next(c for c in (WGMMA_GLU_CFGS if glu else WGMMA_CFGS) if c[1] == t)
    return wgmma_tiles.config(m, n, k, slots)


def _wgmma(x2, qweight, scales, qzeros, y, m, k, n, g, cfg=None, splits=None, dp_tiles=None, glu=False):
    """y = x2 @ W; glu: y (M, N/2) = swiglu of W's column halves [gate | up] in the kernel's
    epilogue (each block computes a gate tile and the matching up tile), N % 64 == 0."""
    dev = x2.device
    if not wgmma_available(dev):
        raise ValueError(f"path: 'wgmma' needs a compute capability 9.0 GPU (Hopper), "
                         f"{torch.cuda.get_device_name(dev)} is {torch.cuda.get_device_capability(dev)}")
    if n % WGMMA_N_MULTIPLE:
        raise ValueError(f"path: 'wgmma' needs N % {WGMMA_N_MULTIPLE} == 0 (its weight rows come by TMA, "
                         f"16 bytes at a time), got N={n}")
    if glu and n % (2 * WGMMA_N_MULTIPLE):
        raise ValueError(f"path: 'wgmma' with glu needs N % {2 * WGMMA_N_MULTIPLE} == 0 (each half's rows "
                         f"come by TMA, 16 bytes at a time), got N={n}")
    cfg = tuple(cfg or wgmma_config(m, n, k, _sm_count(dev), glu))
    if cfg not in (WGMMA_GLU_CFGS if glu else _WGMMA_PLAIN):
        raise ValueError(f"cfg: {cfg} has no {'GLU ' if glu else ''}instance; one of "
                         f"{WGMMA_GLU_CFGS if glu else _WGMMA_PLAIN}")
    nwg, t, d = cfg[:3]
    kern = _kernel("awq_wgmma.cu", _wgmma_name(cfg, glu))
    smem = _wgmma_smem(nwg, t, d)
    _set_smem(kern, smem)
    tiles_m, tiles_n = wgmma_tiles.grid(m, n, cfg)
    tiles = tiles_m * tiles_n
    threads = 128 * nwg + 128   # the consumer warpgroups and the producer warpgroup
    slots = _blocks_per_sm(kern, smem, threads) * _sm_count(dev)
    dp, splits, per = wgmma_tiles.schedule(m, n, k, slots, cfg, splits, dp_tiles)
    # per: 64-row stages a split; one split's blocks walk all of K and never read it
    rows = _split_rows(k, splits, 64 * per if splits > 1 else k)
    # Split K's partials: at 2 splits the tile's halves meet in the kernel (tile counters; the
    # first hands its partial, T x columns floats in fragment order, to the second: wg::hand_over);
    # past 2 at T <= WGMMA_MEET_MAX_T the last part to finish sums them all (wg::meet), at larger
    # T a wgmma_reduce launch does (session 17, us, in-kernel sum vs reduce launch, two runs each:
    # M = 64 4096->12288 29.3 -> 26.9, 12288->4096 29.8 -> 25.0, 4096->6144 20.5 -> 17.1;
    # 4096->6144 M = 1536 (5 splits) 141 -> 131). At small M that launch is 15-30 % of the
    # product (session 51: 4096->12288 M = 16 16.8 us, 14.2 without it); wg::meet wins back a
    # third of it at T = 16 (the comment at WGMMA_MEET_MAX_T).
    reduce = splits > 2 and t > WGMMA_MEET_MAX_T
    words = wgmma_tiles.columns(nwg, t) // 8
    if splits == 1:
        parts = 1
    elif reduce:   # the split tiles' columns (wg::SplitParts)
        parts = wgmma_tiles.parts_numel(m, n // 2 if glu else n, cfg, dp, splits, glu)
    else:   # a T x columns slot a split of each split tile (wg::meet); one (wg::hand_over: the first half's)
        parts = (tiles - dp) * t * 8 * words * (1 if splits == 2 else splits)
    ws = workspaces.scratch("partials", parts, torch.float32, dev)
    ctr = None if reduce else workspaces.counters(tiles, dev)
    gps = 2 if g == 32 else 1   # groups a 64-row stage spans
    xr = wgmma_tiles.x_rows(m, t)
    # GLU: a stage's weight words come as a gate box and an up box of half the columns; its
    # scales and zeros as one box of half gate, half up columns (tensor_map_halves)
    smap = tensor_map_halves if glu else tensor_map_2d
    wbox = words // 2 if glu else words
    launch_tma(kern, (dp + (tiles - dp) * splits,), (threads,),
               (tensor_map_2d(x2.data_ptr(), m, k, xr, 64),   # T tokens (M when M < T) x 64 k, 128-byte swizzle
                tensor_map_2d(qweight.data_ptr(), k, n // 8, 64, wbox, 4 * wbox, "u32"),
                smap(scales.data_ptr(), k // g, n, gps, 8 * words, 0),
                smap(qzeros.data_ptr(), k // g, n // 8, gps, words, 0, "u32"),
                y.data_ptr(), ws.data_ptr(), 0 if ctr is None else ctr.data_ptr(), np.int32(m), np.int32(k),
                np.int32(n), np.int32(g), np.int32(tiles_m), np.int32(dp), np.int32(splits), rows,
                np.int32(xr)), smem)
    if reduce:   # the split tiles' partials, summed in split order, 4 columns a thread (N % 32 == 0)
        _launch(_kernel("awq_wgmma.cu", f"wgmma_reduce<4{', true' if glu else ''}>"),
                *wgmma_tiles.reduce_launch(ws.data_ptr(), y.data_ptr(), m, n // 2 if glu else n, cfg, dp,
                                           splits, 4, glu))


_PATHS = {"gemv": _gemv, "strip": _strip, "strip-cluster": _strip_cluster, "mma": _mma,
          "dequant+cublas": _dequant_cublas, "small": _small, "wgmma": _wgmma}
PATHS = tuple(_PATHS)   # every name matmul's path= takes


@on_tensor_device
def gemm(x, qweight, scales, qzeros, group_size=None, *, out=None, path=None):
    """y = x @ W for HF-layout AWQ tensors; x fp16 [.., K] -> fp16 [.., N]."""
    k, n, g = check_weights(qweight, scales, qzeros, group_size)
    return _gemm(x, qweight, scales, qzeros, k, n, g, out, path)


def _gemm(x, qweight, scales, qzeros, k, n, g, out, path, qt=None, glu=False):
    """gemm on weights check_weights has accepted (k, n, g are what it returned); with qt (the
    checked_once weight) and no forced path, through its launch plans (run_planned); glu as
    matmul's."""
    _check_x(x, k, qweight.device)
    lead = tuple(x.shape[:-1])
    m = math.prod(lead)
    if glu and n % 16:
        raise ValueError(f"glu: the weight's {n} columns are not [gate | up] halves of whole int32 words")
    ny = n // 2 if glu else n
    if out is None:
        out = torch.empty(lead + (ny,), dtype=torch.float16, device=x.device)
    else:
        _check_tensor("out", out, torch.float16, lead + (ny,), x.device)
        check_out_overlap(x, out)
    if path is not None and path not in _PATHS:
        raise ValueError(f"path: {path!r}, choose one of {PATHS}")
    if m == 0:
        return out
    if m > MAX_M:
        raise ValueError(f"x: M={m} rows; the kernels take at most {MAX_M} (their row count is a 32-bit int)")
    if path == "small" and m > SMALL_MAX_M:
        raise ValueError(f"path: 'small' takes M <= {SMALL_MAX_M}, got M={m}")
    if path is None and qt is not None:
        run_planned(qt, ("glu", m) if glu else m, x, out, lambda: _queue(
            choose_path(m, _Shape(n, k), x.device, glu), x.view(m, k), qweight, scales, qzeros, out.view(m, ny), m, k,
            n, g, glu))
        return out
    run_unplanned(lambda: _queue(path or choose_path(m, _Shape(n, k), x.device, glu), x.view(m, k), qweight, scales,
                                 qzeros, out.view(m, ny), m, k, n, g, glu))
    return out


def _queue(path, x2, qweight, scales, qzeros, y, m, k, n, g, glu) -> None:
    """The launches of one call on checked arguments (M >= 1). glu: on the wgmma path the kernel's
    GLU epilogue (N % 64 == 0), elsewhere the product into a workspace, then layer_ops.silu_mul.
    Not fused into the M = 1 GEMV on purpose: built three ways (sessions 28 and 56, each bit-equal),
    every one cost the PDL decode graph 4-6 % (AWQ 366 -> 350 tok/s): the GEMV fills every SM, and
    the small silu_mul between it and down_proj is what lets down_proj launch early."""
    if not glu:
        _PATHS[path](x2, qweight, scales, qzeros, y, m, k, n, g)
    elif path == "wgmma" and n % (2 * WGMMA_N_MULTIPLE) == 0:
        _wgmma(x2, qweight, scales, qzeros, y, m, k, n, g, glu=True)
    else:
        from quantzoo.kernels import layer_ops

        gu = workspaces.scratch("glu", m * n, torch.float16, x2.device).view(m, n)
        _PATHS[path](x2, qweight, scales, qzeros, gu, m, k, n, g)
        layer_ops.silu_mul(gu, out=y)


GLU_MATMUL = True   # matmul(..., glu=True): the decoder MLP's silu(gate) * up (the runner asks)


@on_tensor_device
def matmul(x, qt, *, out=None, path=None, glu=False):
    """x fp16 CUDA [.., K] -> fp16 [.., N] through the path chosen by M (choose_path); without a
    forced path, repeated calls replay the launches recorded for that M (kernels.run_planned).

    glu=True: W's columns are [gate | up] (N % 16 == 0), and y [.., N/2] = silu(x @ gate) *
    (x @ up), the decoder MLP's SwiGLU with layer_ops.silu_mul's roundings (cuda/swiglu.cuh) --
    in the wgmma path's epilogue where N % 64 == 0 (no [M, N] product in memory, no second
    launch), else the product into a workspace, then layer_ops.silu_mul."""
    qweight, scales, qzeros, k, n, g = checked_once(qt, _unpack_qt)
    return _gemm(x, qweight, scales, qzeros, k, n, g, out, path, qt, glu)
