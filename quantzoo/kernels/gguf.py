"""GGUF block weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) x fp16 activations on CUDA, through CuPy.

    y = matmul(x, qt)        x fp16 CUDA (..., K), qt = fmt.quantize(w).to("cuda") -> fp16 (..., N)

The weight stays in its .gguf block bytes (uint8 (N, K/32 * bytes), file order). Five paths,
picked by M (rows of x) and format -- `choose_path` -- with thresholds measured on the H100
(bench/gguf_bench.py, numbers in bench/notes-gguf.md):

  "mmvq"     M <= MMVQ_MAX_M[fmt]  (where wgmma does not take it) quantize x to Q8_1
                        (cuda/q8_1_quantize.cu), then one fused GEMV-like kernel per format,
                        M (1..8) and rows per CTA (cuda/gguf_mmvq.cu): a stream over W, DP4A;
                        M > 8 runs it on chunks of 8 activation rows.
                        Per format and M (MMVQ_CHOICE, measured) either the scalar-load kernel
                        (cuda/gguf_mmvq.cu) or the vector-load one (cuda/gguf_mmvq16.cu, Q8_1 in a
                        split layout; needs address and size of W multiples of 16 bytes).
  "mma"      M <= MMA_MAX_M[fmt]   Q8_1 (split layout) + int8 tensor-core GEMM, one m16n8k32 MMA per
                        block and tile, exact per-block terms on the fragments, split K
                        (cuda/gguf_mma.cu); needs the same 16-byte alignment, else dequant.
  "mmq"      M <= MMQ_MAX_M[fmt]   Q8_1 + shared-memory tiled DP4A GEMM (cuda/gguf_mmq.cu);
                        on the H100 it never wins (MMQ_MAX_M = 0), so only path="mmq" runs it.
  "dequant"  larger M   W -> fp16 a slice of rows at a time into one bounded, reused buffer
                        (cuda/gguf_dequant.cu), each slice multiplied by cuBLAS (torch.mm).
  "wgmma"    Hopper only, every format (wgmma_ok), WGMMA_MIN_M <= M <= WGMMA_MAX_M on
                        weights of WGMMA_MIN_NK elements and up (Q4_0 / Q4_1 / Q8_0 from
                        M = 5-8, inside mmvq's range, by GLU and K: WGMMA_SMALL_M), and to
                        WGMMA_MID_MAX_M on smaller ones (WGMMA_MID_*, M N K > 2^27): the dequant path's
                        function with the blocks unpacked in registers as wgmma's A operand, fed
                        by a TMA producer warpgroup (cuda/gguf_wgmma.cu).

mmvq, mma and mmq compute exactly what reference/gguf_dot.py emulates (per-block terms bit-equal;
only the fp32 order of the sum over blocks differs); dequant and wgmma are fp16 x fp16 with fp32
accumulation (cuBLAS; the tensor cores), on weights bit-equal to fmt.dequantize(qt) rounded to half
(wgmma's Q4_1 / Q5_1 weights: q d + m rounded once, cuda/gguf_wgmma.cu says where that differs).

matmul(x, qt, glu=True) is the decoder MLP's silu(x @ gate.T) * (x @ up.T) for a weight whose rows
are [gate; up]: on the wgmma path in the kernel's epilogue (cuda/gguf_wgmma.cu, GLU), elsewhere
the product into a workspace and layer_ops.silu_mul. The runner's prefill takes it.

matmul_q8_1(xq, qt, m, layout) takes activations already in Q8_1 (the runner's norms and SiLU
write them, q8_1_layout names the layout the mmvq of that M reads) and runs the same launches
without the quantize one. Repeated calls replay their recorded launches (kernels.run_planned).

Everything is checked in Python before a launch (ValueError naming the argument); kernels go on
torch's current stream; nothing here allocates with CuPy, and the per-stream workspaces (Q8_1
activations, the dequant buffer, split-K partials: kernels/workspaces.py) are torch tensors reused
across calls, so a call can be captured in a CUDA graph (whose workspaces come from its own pool).
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from quantzoo.cuda_launch import MAX_GRID_YZ, get_kernel, launch, launch_tma, on_tensor_device, resident_blocks
from quantzoo.cuda_launch import set_max_dynamic_smem, tensor_map_2d, torch_step, wgmma_available
from quantzoo.cuda_launch import sm_count as _sm_count
from quantzoo.formats import get, weight_formats
from quantzoo.kernels import check_out_overlap, checked_once, negated, run_planned, run_unplanned, wgmma_tiles, workspaces

QK = 32
GLU_MATMUL = True   # matmul(..., glu=True): the decoder MLP's silu(gate) * up (the runner asks)
Q8_1_BYTES = get("q8_1").bytes_per_block
# The registry's weight formats served here, each with its block struct in cuda/gguf_common.cuh.
BLOCKS = {f.name: f"Block{f.gguf_type}" for f in weight_formats() if f.kernels == "gguf"}
BYTES = {name: get(name).bytes_per_block for name in BLOCKS}
MMVQ_COLS = 8          # activation rows one mmvq launch takes (template instances 1..8)
MMVQ16_WARPS = 4       # warps per CTA of the vector-load mmvq (cuda/gguf_mmvq16.cu), R rows per warp
MMVQ_THREADS = 128
MMVQ_ROW_CHOICES = (1, 2, 4)
MMQ_TILE = 64          # the tiled GEMM's output tile is MMQ_TILE x MMQ_TILE (cuda/gguf_mmq.cu)
MMQ_THREADS = 256
# The vector-load mmvq (cuda/gguf_mmvq16.cu): weight windows read with MMVQ16_LW-byte loads
# (cuda/gguf_window.cuh's LW), L1::no_allocate on the weight stream (MMVQ16_NOALLOC), Q8_1
# activations in the split layout. It needs the weight's base address and byte size to be
# multiples of MMVQ16_LW; other weights (a view at an odd offset, N * K/32 * bytes not a multiple of 16) run the
# scalar-load mmvq (cuda/gguf_mmvq.cu).
MMVQ16_LW = 16
MMVQ16_NOALLOC = False


def _by_m(c1, c2, c4, c8):
    """A choice per M = 1..8 from the four measured M: 3 takes M = 4's, 5..7 take M = 8's."""
    return {1: c1, 2: c2, 3: c4, 4: c4, 5: c8, 6: c8, 7: c8, 8: c8}


# Which mmvq kernel ("vec" = gguf_mmvq16.cu, "scalar" = gguf_mmvq.cu) and how many weight rows
# per warp / CTA (R) each format and M take. Measured on the H100 (bench/gguf_bench.py --mmvq16,
# N=4096 K=14336, rotated, us incl. Q8_1; tables in bench/notes-gguf.md):
# * R: R = 1 re-reads the Q8_1 activations from L2 once per weight row, which at M = 8 costs
#   more than the weight itself (q4_0: 62.7 us at R=1, 39.3 at R=2, 34.2 at R=4). At M = 1, R = 2
#   is within 3 % of the best with rotated weights and much faster with reused (L2-resident)
#   ones (q4_1: 11.5 us at R=2 vs 14.0 at R=1; q5_1: 13.3 vs 18.0).
# * kernel: the vector kernel wins where the activation traffic grows: q4_0 M=8 27.3 vs 33.9,
#   q5_0 M=8 30.7 vs 34.6, q8_0 M=4 28.0 vs 34.0, q4_0 M=2 17.3 vs 18.1; elsewhere scalar won or
#   tied. M = 1 was re-measured in session 3 under the decode graph's conditions (programmatic
#   dependent launch, back to back, Qwen3-8B shapes; bench/NOTES.md): vector wins for q4_0
#   (R = 1: 7.85 vs 8.46 us at 4096 -> 6144) and q8_0 (R = 2: 12.1 vs 13.0); q4_1 / q5_0 / q5_1
#   stay scalar (ties within 0.5 us, or scalar faster at K = 4096).
# The kernel is chosen by the first chunk's M (the two kernels read different Q8_1 layouts);
# a later, shorter chunk whose own choice is the other kernel takes MMVQ_DEFAULT_ROWS.
MMVQ_CHOICE = {
    "q4_0": _by_m(("vec", 1), ("vec", 2), ("scalar", 4), ("vec", 4)),
    "q4_1": _by_m(("scalar", 2), ("scalar", 2), ("scalar", 2), ("scalar", 4)),
    "q5_0": _by_m(("scalar", 2), ("scalar", 2), ("scalar", 4), ("vec", 4)),
    "q5_1": _by_m(("scalar", 2), ("scalar", 2), ("scalar", 2), ("scalar", 4)),
    "q8_0": _by_m(("vec", 2), ("vec", 4), ("vec", 4), ("scalar", 4)),
}
MMVQ_DEFAULT_ROWS = {m: (2 if m <= 3 else 4) for m in range(1, MMVQ_COLS + 1)}
# M = 1 with the vector kernel and a long row (nb >= MMVQ1_LONG_NB blocks): rows per warp R and
# pipeline depth U (blocks per row a lane has in flight; cuda/gguf_mmvq16.cu), session 3:
# q4_0 12288 -> 4096 13.1 vs 14.0 us, q8_0 21.6 vs 23.3. U = 4 was slower everywhere
# (registers: q8_0 R = 4 U = 4 spills), U = 2 at K = 4096 no better than U = 1.
MMVQ1_LONG_NB = 256
MMVQ1_LONG = {"q4_0": (1, 2), "q8_0": (2, 2)}


def mmvq_choice(fmt: str, m: int) -> tuple[str, int]:
    """(kernel, R) measured for this format and M (1..8); an unmeasured format gets vec, default R."""
    return MMVQ_CHOICE.get(fmt, {}).get(m, ("vec", MMVQ_DEFAULT_ROWS[m]))


def mmvq_plan(fmt: str, kernel: str, m: int, nb: int = 0) -> tuple[int, int]:
    """(R, U) of one mmvq launch of `kernel` over m (1..8) activation rows and nb blocks per row."""
    if kernel == "vec" and m == 1 and nb >= MMVQ1_LONG_NB and fmt in MMVQ1_LONG:
        return MMVQ1_LONG[fmt]
    choice, r = mmvq_choice(fmt, m)
    return (r if choice == kernel else MMVQ_DEFAULT_ROWS[m]), 1


# Largest M that takes mmvq (in chunks of 8 rows, 26-40 us each): above it the int8 MMA GEMM
# wins (H100, N=4096 K=14336, rotated, 2026-11-22 round 3: q4_0 M=16 mma 41.8 us vs chunked mmvq
# ~50-64 and dequant 104; q8_0 47.0 vs ~80 / 112). Before the mma path existed this was 16/24.
MMVQ_MAX_M = {f: 8 for f in BLOCKS}
# int8 tensor-core GEMM (cuda/gguf_mma.cu): M in (MMVQ_MAX_M, MMA_MAX_M] when the weight is
# aligned for 16-byte window loads (_aligned16). Activation rows per CTA tile by M; split K so
# that about MMA_TARGET_CTAS_PER_SM CTAs per SM run (2 fit: 256 threads, __launch_bounds__(256, 2)
# caps registers at 128 -- nvcc 13 for sm_90 gives 80-124 -- and at most 40 KB shared memory).
# Measured (same bench, us, auto split): q4_0 M=16/32/64/128/256/512: 41.8/54.1/77.3/148.9/282.8/549;
# q8_0 47.0/55.2/75.5/148.9/284.2/548; dequant + cuBLAS ~104-112 at M = 16..128: the crossover
# is near M = 96. The exact per-block fp32 terms (5-6 FP32 ops per output and block) bound this
# kernel at >= ~0.3 us per activation row for this shape, so it cannot win at M >= ~400.
MMA_MAX_M = {f: 96 for f in BLOCKS}
MMA_BM_CHOICES = (16, 32, 64)
MMA_BN = 64
MMA_BK = {16: 4, 32: 4, 64: 4}  # blocks per pipeline step by BM (MmaCfg in cuda/gguf_mma.cu)
MMA_THREADS = 256
MMA_TARGET_CTAS_PER_SM = 2
MMA_MAX_SPLIT = 16
# Largest M that takes the DP4A tiled GEMM: 0 -- it never won on the H100. At M=16..64 it ran
# 345..410 us (64 CTAs: too few for 132 SMs), at M >= 256 it peaks near 52 TOP/s while cuBLAS
# fp16 on tensor cores runs 600+ TFLOP/s, so dequant + cuBLAS takes every M above MMA_MAX_M
# (above MMVQ_MAX_M for a weight not aligned for the mma path).
# It stays available as path="mmq" (and tested) for GPUs where DP4A vs fp16 MMA differ.
MMQ_MAX_M = {f: 0 for f in BLOCKS}
# Bound on the transient fp16 copy of W used by the dequant path (bytes); W is converted and
# multiplied a slice of rows at a time. q4_0 4096x14336 (117 MB as fp16): M=512 180 us with a
# 32 MB buffer, 136 us with 128 MB; M=2048 384 vs 360 us -- fewer, larger cuBLAS calls win.
DEQUANT_BUFFER_BYTES = 128 << 20
# Hopper (sm_90a) path, cuda/gguf_wgmma.cu: the dequant path's function (fp16 weights, fp32
# accumulation) with the weights unpacked in registers as wgmma's A operand; needs a
# 16-byte-aligned weight with K % 256 == 0 (wgmma_ok).
WGMMA_FORMATS = tuple(f for f in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0") if f in BLOCKS)
# (NWG, T, D[, BPS, BK]) = consumer warpgroups, tokens a block, shared-memory stages[, blocks an
# SM (default 1), k a stage (64 or 128, default 64)]: what wgmma_config picks by M. GLU needs two
# warpgroups (gate and up). Up to M = 32 stages of 128 k: a stage's weight box is ROWS rows of one
# 16-byte window each, and with 64-k stages (a row's 2 blocks, 36 bytes of Q4_0 in a 48-byte
# window) these small-M launches were bound by how many rows TMA copies, not by bytes or by the
# dequant -- the same bytes in boxes of half the rows, twice as wide, took q4_0 4096->12288 M = 16
# from 24.9 to 20.7 us, q8_0 from 31.7 to 26.1; no dequant at all only to 23.6 / 30.5
# (bench/NOTES.md, session 53). Plain launches there: one warpgroup a block, 3-4 blocks an SM
# as AWQ's (shared memory holds 3 and 2 of Q8_0's); GLU: two warpgroups, one block an SM.
WGMMA_CFGS = ((1, 16, 3, 4, 128), (1, 32, 3, 3, 128), (2, 64, 6), (2, 128, 5), (2, 256, 5))
WGMMA_GLU_CFGS = ((2, 32, 4, 1, 128), (2, 64, 6), (2, 128, 5), (2, 256, 5))
# every non-GLU instance: the GLU configs' plain twins too
_WGMMA_PLAIN = WGMMA_CFGS + tuple(c for c in WGMMA_GLU_CFGS if c not in WGMMA_CFGS)
# Dispatch on Hopper (us, rotated weights, event medians). Session 8: wgmma beats mma and dequant
# + cuBLAS from M = 9 to 256 on weights of 4096 x 4096 and up -- q4_0 4096->12288 M = 16 26.8 vs
# 42.5 (mma), M = 128 48.9 vs 89.3 (dequant) -- and loses on 4096->1024 (M = 16: 11.7 vs 9.8).
# Session 16, the kernel with a TMA producer, the last wave's tiles split and a 4-wide split-K
# reduce (bench/NOTES.md, "Session 16"; wgmma vs dequant + cuBLAS unless named):
#   on 6144 x 4096 and up, q4_0 wins to M = 2048 (4096->6144 M = 1024 89.7 vs 94.5, M = 2048
#        159.6 vs 165.1; 4096->12288 M = 1536 241.1 vs 251.0, M = 2048 313.0 vs 324.5), q8_0 to
#        1024 (4096->6144 95.9 vs 98.6; 4096->12288 M = 1536 283.8 vs 281.2, M = 2048 356.1 vs
#        331.2), q5_0 to 512 (4096->6144 M = 512 60.8 vs 64.4, M = 768 84.6 vs 80.1, M = 1024
#        105.1 vs 99.2; 4096->12288 M = 1536 324.4 vs 275.8);
#   on 4096->4096 above M = 256 it was a toss-up (M = 384 q4_0 42.7 vs 36.9, M = 512 35.3 vs
#        41.2; q5_0 M = 768 59.8 vs 55.4) until session 17 kept x boxes inside x (below);
#   Q5_0 (fifth bits unpacked per element pair) now beats mma from M = 16: 4096->12288 40.3 vs
#        47.1, 12288->4096 33.2 vs 39.2 (mma's M = 9..16 share its 16-row tile).
# Session 17, Q4_1 / Q5_1 on the same kernel (one hfma2 by d plus m in place of Q4_0's hmul2;
# bench/NOTES.md, "Session 17"; wgmma vs mma, then vs dequant + cuBLAS): the same rules hold.
#   from M = 9: q4_1 4096->12288 M = 9 28.1 vs 45.2, 12288->4096 26.3 vs 39.3; q5_1 31.0 vs
#        45.2, 30.0 vs 43.0; 4096->1024 stays with mma (q4_1 M = 16 10.0 vs 9.7);
#   q4_1 to M = 2048 as Q4_0 (4096->12288 M = 2048 306.7 vs 308.0, 12288->4096 297.3 vs 291.1,
#        4096->6144 155.0 vs 155.6), q5_1 to 512 as Q5_0 (4096->6144 M = 512 54.8 vs 61.3,
#        M = 768 77.3 vs 75.9).
#   with no x box past row M (wg::x_box_row) wgmma also wins on 4096->4096 to M = 1024: q4_0
#        M = 384 34.5 (was 43.8), M = 512 34.9, M = 1000 49.6 vs dequant 41-42 / 60; q4_1 M = 768
#        46.0 vs 50.9; at M = 1536-2048 the two tie (q4_1 86.4 vs 82.5, 103.5 vs 103.4).
# Session 31: those per-shape times are short bursts; a whole prefill is sustained, runs at the
# card's power cap (session 28), and there the dequant path's extra fp16 traffic (and, for the
# MLP, a separate SwiGLU pass) costs more than the per-shape times showed. The Qwen3-8B-shaped
# runner's prefill, wgmma to M = N vs the earlier tops (tok/s, rotated order, 4-6 rounds, every
# round the same way unless stated): q8_0 N = 1536 +6 %, 2048 +2.5 % (5 of 6); q5_0 N = 1024
# +10 %, 2048 +2 % (3 of 4); q5_1 N = 1024 +15 %, 2048 +2.5 %; at 4096 dequant + cuBLAS stays
# ahead (q8_0 -7 %, q4_0 a tie). So every format takes wgmma to 2048 (bench/NOTES.md, session 31).
WGMMA_MIN_M = 9
WGMMA_MIN_NK = 4096 * 4096   # weights of at least this many elements, from WGMMA_MIN_M to WGMMA_MAX_M
# Below WGMMA_MIN_M: mmvq's time grows with M (each weight block meets M activation blocks by
# DP4A), wgmma's does not (one 16-token tile), so from some M <= MMVQ_MAX_M wgmma is ahead on
# weights of WGMMA_MIN_NK elements and up -- soonest for a GLU gate/up (matmul(glu=True): wgmma's
# epilogue saves the product's round trip and silu_mul's launch) and on long rows (K >=
# WGMMA_SMALL_LONG_K: mmvq's Q8_1 activation reads grow with M K). WGMMA_SMALL_M[fmt] = (from
# which M for GLU, for K >= WGMMA_SMALL_LONG_K, for the rest); a format not named (Q5_0 / Q5_1,
# whose fifth bits slow wgmma: M = 8 GLU 4096->24576, matmul's mmvq 45.4 / 50.1 vs 52.5 / 50.6)
# keeps mmvq to MMVQ_MAX_M. Session 54 (bench/NOTES.md; H100, us, rotated weights, graph
# replays, alternated, min of 3), mmvq as the runner calls it (on Q8_1 written by the op
# before; matmul's own quantize launch adds ~1.8 us; GLU: product and silu_mul) vs wgmma,
# Qwen3-8B / Qwen3-4B weights:
#   GLU 4096->24576 / 2560->19456: q8_0 M = 5 48.1 / 32.4 vs 49.0 / 25.8, M = 8 61.1 / 40.3 vs
#        49.8 / 25.9; q4_1 M = 5 33.0 / 23.3 vs 33.2 / 22.3, M = 6 41.0 / 29.5 vs 33.1 / 22.3;
#        q4_0 M = 6 33.5 / 21.9 vs 32.8 / 21.2, M = 7 37.1 / 24.1 vs 32.9 / 21.3 (M = 4-5 ties);
#   down 12288->4096 / 9728->2560: q8_0 M = 7 29.4 / 17.1 vs 28.4 / 17.4, M = 8 34.3 / 18.3 vs
#        28.8 / 17.5; q4_1 M = 7 20.4 / 17.1 vs 20.7 / 14.7 (M = 6 22.7 / 12.7 vs 20.7 / 14.8);
#        q4_0 M = 7 22.4 / 17.0 vs 20.3 / 14.7 (M = 6 18.0 / 14.5 vs 20.3 / 14.6);
#   K = 4096: q8_0 M = 8 4096->4096 13.9 vs 13.2, 4096->6144 18.7 vs 17.8 (M = 7 12.6 / 16.8 vs
#        13.2 / 17.8; 4096->2560, under WGMMA_MIN_NK, 9.7 vs 11.8); q4_0 / q4_1 lose at M = 8
#        (4096->4096 9.1 / 10.8 vs 11.4 / 11.2; q4_0 4096->12288 20.1 vs 21.0).
# GLU's M = 5-6 thresholds count kernels only: where down stays on mmvq it quantizes its own input
# then (~1.8 us; Qwen3-8B q8_0 at M = 5: 48.1 vs 49.0 + 1.8), but the layer makes one host call
# fewer (silu_mul's), and short prefills here are host-bound (bench/NOTES.md, session 54: T = 5
# +5 % tok/s).
# A Qwen3-8B layer (qkv, o, gate/up, down) at M = 8, mmvq vs this rule: q8_0 128.0 vs 109.6,
# q4_1 90.8 vs 79.1, q4_0 83.2 vs 73.6.
WGMMA_SMALL_LONG_K = 8192
WGMMA_SMALL_M = {"q4_0": (6, 7, WGMMA_MIN_M), "q4_1": (5, 7, WGMMA_MIN_M), "q8_0": (5, 7, 8)}
WGMMA_MAX_M = 2048
# Session 51 (bench/NOTES.md; H100, us, rotated weights, graph replays, each path timed twice in
# opposite orders; q4_0 / q8_0 / q5_1 on 9 weights of 4096 x 1024 to 6144 x 2048): on mid-size
# weights, WGMMA_MID_MIN_NK <= N K < WGMMA_MIN_NK, wgmma also beats mma up to M = 96 once
# M N K > WGMMA_MID_MIN_MNK -- from M = 33 on 4096 x 1024, from 17 on 4096 x 2048, from 9 on
# 6144 x 2048 -- and by most where mma is slowest, M = 65..96 (64-token tiles there, the
# config M = 64 takes: wgmma_config): q4_0 M = 32 / 64 / 96, wgmma vs mma: 4096->1024 10.4 / 12.4 / 12.3 vs 10.9 /
# 14.9 / 18.9; 2048->6144 12.1 / 14.3 / 18.0 vs 19.1 / 27.1 / 43.4; q8_0 6144->2048 15.7 / 17.7 /
# 21.6 vs 18.4 / 25.2 / 40.0; q5_1 1024->4096 M = 64 / 96 14.2 / 14.3 vs 14.4 / 19.1. Below
# that product mma keeps it (q5_1 4096->1024 M = 32: 11.4 vs 12.7 wgmma); past M = 96 dequant +
# cuBLAS wins on the smaller of these weights (q4_0 1024->4096 M = 128 9.2 vs 12.2-16.4), wgmma
# on the larger (q4_0 6144->2048 M = 128 18.2 vs 26.0), left to dequant + cuBLAS.
WGMMA_MID_MIN_NK = 4096 * 1024
WGMMA_MID_MIN_MNK = 2**27
WGMMA_MID_MAX_M = 96
PATHS = ("mmvq", "mma", "mmq", "dequant", "wgmma")


def mmvq16_name(fmt: str, m: int, r: int, noalloc: bool | None = None, u: int = 1) -> str:
    noalloc = MMVQ16_NOALLOC if noalloc is None else noalloc
    tail = "" if u == 1 else f", {u}"
    return f"mmvq16<{BLOCKS[fmt]}, {m}, {r}, {'true' if noalloc else 'false'}{tail}>"


def _wgmma_name(fmt: str, cfg, glu: bool = False) -> str:
    """gguf_wgmma's instance for cfg = (NWG, T, D[, BPS, BK])."""
    nwg, t, d = cfg[:3]
    bps, bk = _wgmma_bps_bk(cfg)
    if (bps, bk) == (1, 64):
        return f"gguf_wgmma<{BLOCKS[fmt]}, {nwg}, {t}, {d}{', true' if glu else ''}>"
    return f"gguf_wgmma<{BLOCKS[fmt]}, {nwg}, {t}, {d}, {'true' if glu else 'false'}, {bps}, {bk}>"


def _wgmma_bps_bk(cfg) -> tuple[int, int]:
    """(blocks an SM, k a stage) of a wgmma config (NWG, T, D[, BPS, BK])."""
    return (cfg[3], cfg[4]) if len(cfg) > 3 else (1, 64)


SOURCES = {
    "q8_1_quantize.cu": ("quantize_q8_1<__half>", "quantize_q8_1<float>",
                         "quantize_q8_1_split<__half>", "quantize_q8_1_split<float>"),
    "gguf_mmvq.cu": tuple(f"mmvq<{b}, {m}, {r}>" for b in BLOCKS.values() for m in range(1, MMVQ_COLS + 1)
                          for r in MMVQ_ROW_CHOICES),
    "gguf_mmvq16.cu": tuple(mmvq16_name(f, m, r) for f in BLOCKS for m in range(1, MMVQ_COLS + 1)
                            for r in MMVQ_ROW_CHOICES)
                      + tuple(mmvq16_name(f, 1, r, u=u) for f, (r, u) in MMVQ1_LONG.items()),
    "gguf_mma.cu": tuple(f"mma_gemm<{b}, {bm}>" for b in BLOCKS.values() for bm in MMA_BM_CHOICES)
                   + ("mma_reduce",),
    "gguf_mmq.cu": tuple(f"mmq<{b}>" for b in BLOCKS.values()),
    "gguf_dequant.cu": tuple(f"dequant<{b}>" for b in BLOCKS.values()),
    "gguf_wgmma.cu": tuple(_wgmma_name(f, c) for f in WGMMA_FORMATS for c in _WGMMA_PLAIN)
                     + tuple(_wgmma_name(f, c, True) for f in WGMMA_FORMATS for c in WGMMA_GLU_CFGS)
                     + tuple(f"wgmma_reduce<{v}{glu}>" for v in (1, 4) for glu in ("", ", true")),
}
ARCH_SPECIFIC = {"gguf_wgmma.cu"}   # compiled for sm_90a, not sm_90


def _kernel(source: str, name: str):
    return get_kernel(source, name, SOURCES[source], arch_specific=source in ARCH_SPECIFIC)


# ---- validation ---------------------------------------------------------------------------
def check_weight(qt, arg: str = "qt"):
    """The weight must be a GGUF block format on CUDA, storage exactly (N, K/32 * bytes) uint8."""
    fmt_name = getattr(qt, "format", None)
    if fmt_name not in BLOCKS:
        raise ValueError(f"{arg}: format {fmt_name!r} has no GGUF kernel here; one of {sorted(BLOCKS)}")
    shape = getattr(qt, "shape", None)
    if not (isinstance(shape, tuple) and len(shape) == 2):
        raise ValueError(f"{arg}: shape {shape!r} is not (out_features, in_features)")
    params = getattr(qt, "params", None)
    if not isinstance(params, dict) or params:   # as Format.check says on the CPU
        raise ValueError(f"{arg}: params {params!r}; the GGUF block formats take none")
    n, k = (int(s) for s in shape)
    if n <= 0 or k <= 0 or k % QK:
        raise ValueError(f"{arg}: shape {shape}: K={k} must be a positive multiple of {QK} (and N={n} > 0)")
    # N < 2^31 is the exact bound: every kernel's weight rows per block (mmvq R, mmvq16 4 R, mma
    # and mmq 64, wgmma 64..256) are a power of two, so a last block's int rows end at 2^31 - 1 at
    # most; byte and element offsets are formed in 64 bits, block indices along a row in an int
    if n >= 2**31 or k >= 2**31:
        raise ValueError(f"{arg}: shape {shape} too large for 32-bit row indices")
    data = qt.data
    if not isinstance(data, torch.Tensor):
        raise ValueError(f"{arg}.data: a {type(data).__name__}; move the weight with qt.to('cuda')")
    if data.dtype != torch.uint8:
        raise ValueError(f"{arg}.data: dtype {data.dtype}, GGUF blocks are uint8")
    want = (n, k // QK * BYTES[fmt_name])
    if tuple(data.shape) != want:
        raise ValueError(f"{arg}.data: shape {tuple(data.shape)}, a {fmt_name} ({n}, {k}) weight is {want} bytes")
    if not data.is_contiguous():
        raise ValueError(f"{arg}.data: not contiguous")
    if data.is_neg():
        raise ValueError(negated(f"{arg}.data"))
    if not data.is_cuda:
        raise ValueError(f"{arg}.data: on {data.device}; move the weight with qt.to('cuda')")
    if data.data_ptr() % 4:
        raise ValueError(f"{arg}.data: address not 4-byte aligned")
    return fmt_name, n, k


def _check_act(x, k_expect, arg="x", dtypes=None):
    dtypes = dtypes or (torch.float16,)
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{arg}: expected a torch CUDA tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise ValueError(f"{arg}: dtype {x.dtype}, expected one of {[str(d) for d in dtypes]}")
    if x.dim() < 1:
        raise ValueError(f"{arg}: needs at least one dimension (..., K)")
    k = x.shape[-1]
    if k_expect is not None and k != k_expect:
        raise ValueError(f"{arg}: last dimension {k}, the weight expects K={k_expect}")
    if k == 0 or k % QK:
        raise ValueError(f"{arg}: K={k} must be a positive multiple of {QK}")
    if not x.is_contiguous():
        raise ValueError(f"{arg}: not contiguous (call .contiguous() first)")
    if x.is_neg():
        raise ValueError(negated(arg))
    if not x.is_cuda:
        raise ValueError(f"{arg}: on {x.device}, the GGUF kernels need CUDA tensors")
    return x.numel() // k, k


def _check_out(out, shape, dtype, device, arg="out", align=2):
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"{arg}: expected a torch tensor")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{arg}: shape {tuple(out.shape)}, expected {tuple(shape)}")
    if out.dtype != dtype:
        raise ValueError(f"{arg}: dtype {out.dtype}, expected {dtype}")
    if out.device != device:
        raise ValueError(f"{arg}: on {out.device}, expected {device}")
    if not out.is_contiguous():
        raise ValueError(f"{arg}: not contiguous")
    if out.is_neg():
        raise ValueError(negated(arg, written=arg == "out"))
    if out.data_ptr() % align:
        raise ValueError(f"{arg}: address not {align}-byte aligned")


# ---- public entry points ----------------------------------------------------------------------
@on_tensor_device
def quantize_q8_1(x, out=None):
    """x fp16/fp32 CUDA (..., K), contiguous, K % 32 == 0 -> uint8 (M, K/32*36) Q8_1 blocks."""
    m, k = _check_act(x, None, "x", (torch.float16, torch.float32))
    shape = (m, k // QK * Q8_1_BYTES)
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8, device=x.device)
    else:
        _check_out(out, shape, torch.uint8, x.device, align=4)
        check_out_overlap(x, out)
    _launch_quantize(x, out, m * (k // QK))
    return out


@on_tensor_device
def quantize_q8_1_split(x, out=None):
    """Like quantize_q8_1, in the split layout the vector-load mmvq reads: a flat uint8 buffer of
    n = M*K/32 blocks, qs of block i at bytes [32 i, 32 i + 32), half2 (d, s) of block i at
    32 n + 4 i (cuda/q8_1_quantize.cu). Same bytes as quantize_q8_1's, placed differently."""
    m, k = _check_act(x, None, "x", (torch.float16, torch.float32))
    nbytes = m * (k // QK) * Q8_1_BYTES
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    else:
        _check_out(out, (nbytes,), torch.uint8, x.device, align=16)
        check_out_overlap(x, out)
    _launch_quantize(x, out, m * (k // QK), split=True)
    return out


def _launch_quantize(x, out, n_blocks: int, split: bool = False):
    if n_blocks == 0:
        return
    kname = "quantize_q8_1_split" if split else "quantize_q8_1"
    name = f"{kname}<__half>" if x.dtype == torch.float16 else f"{kname}<float>"
    per_cta = 8  # warps (= blocks) per 256-thread CTA
    launch(_kernel("q8_1_quantize.cu", name), ((n_blocks + per_cta - 1) // per_cta,), (32 * per_cta,),
           (x.data_ptr(), out.data_ptr(), np.int64(n_blocks)))


@on_tensor_device
def dequantize(qt, out=None):
    """qt (GGUF block format on CUDA) -> fp16 (N, K), equal to fmt.dequantize(qt) rounded to half."""
    fmt, n, k = check_weight(qt)
    if out is None:
        out = torch.empty((n, k), dtype=torch.float16, device=qt.data.device)
    else:
        _check_out(out, (n, k), torch.float16, qt.data.device, align=16)
    _launch_dequant(fmt, qt.data, out, 0, n, k // QK)
    return out


def _launch_dequant(fmt, w, out, row0: int, rows: int, nb: int):
    total = rows * nb * 4  # four threads per block, 8 halves each
    launch(_kernel("gguf_dequant.cu", f"dequant<{BLOCKS[fmt]}>"), ((total + 255) // 256,), (256,),
           (w.data_ptr(), out.data_ptr(), np.int64(row0), np.int32(rows), np.int32(nb)))


def choose_path(m: int, qt, x=None, glu: bool = False) -> str:
    """Which kernel path matmul takes for M activation rows and this weight's format (and, given
    x, its address: the wgmma path reads x by TMA, which takes 16-byte aligned addresses only);
    glu: for matmul(glu=True), which wgmma takes from a smaller M (WGMMA_SMALL_M)."""
    fmt = qt if isinstance(qt, str) else getattr(qt, "format", None)
    if fmt not in BLOCKS:
        raise ValueError(f"qt: format {fmt!r} has no GGUF kernel here; one of {sorted(BLOCKS)}")
    m = int(m)
    if m < 0:
        raise ValueError(f"m: {m} rows")
    glu_m, long_m, short_m = WGMMA_SMALL_M.get(fmt, (WGMMA_MIN_M,) * 3)
    if (fmt in WGMMA_FORMATS and m >= min(glu_m, long_m, short_m) and not isinstance(qt, str) and wgmma_ok(qt)
            and (x is None or x.data_ptr() % 16 == 0)):
        n, k = qt.shape
        if m < WGMMA_MIN_M:
            if n * k >= WGMMA_MIN_NK and m >= (glu_m if glu else long_m if k >= WGMMA_SMALL_LONG_K else short_m):
                return "wgmma"
        elif m <= WGMMA_MAX_M and n * k >= WGMMA_MIN_NK:
            return "wgmma"
        elif m <= WGMMA_MID_MAX_M and n * k >= WGMMA_MID_MIN_NK and m * n * k > WGMMA_MID_MIN_MNK:
            return "wgmma"
    if m <= MMVQ_MAX_M[fmt]:
        return "mmvq"
    aligned = isinstance(qt, str) or _aligned16(qt)
    if m <= MMA_MAX_M[fmt] and aligned:
        return "mma"
    if m <= MMQ_MAX_M[fmt]:
        return "mmq"
    return "dequant"


def wgmma_ok(qt) -> bool:
    """Whether the wgmma path can read this (checked, CUDA) weight: a weight whose base is 16-byte
    aligned and whose rows are whole 256-element stage windows (K % 256 == 0),
    rows under 2 GiB (TMA's byte coordinate along a row is a 32-bit int), on a Hopper GPU."""
    data = getattr(qt, "data", None)
    return (getattr(qt, "format", None) in WGMMA_FORMATS and hasattr(data, "data_ptr")
            and data.device.type == "cuda" and qt.shape[1] % 256 == 0 and data.data_ptr() % 16 == 0
            and qt.shape[1] // 32 * BYTES[qt.format] < 2**31 and wgmma_available(data.device))


def wgmma_config(m: int, n: int, k: int, slots: int, glu: bool = False) -> tuple:
    """(NWG, T, D[, BPS, BK]) of the wgmma kernel for M rows of an N x K weight on a GPU of
    `slots` SMs: up to M = 32 the narrowest token tile that holds M (WGMMA_CFGS), with glu the
    32-token config (WGMMA_GLU_CFGS; at M = 16 it beat 16-token GLU configs for q4_0 by 10 % and
    lost 5 % for q8_0: bench/NOTES.md, session 53); above, the rule both
    wgmma kernels share (wgmma_tiles.config), except that on a weight under WGMMA_MIN_NK
    M = 65..WGMMA_MID_MAX_M keep the 64-token tile of M = 64."""
    if m <= 32:
        cfgs = WGMMA_GLU_CFGS if glu else WGMMA_CFGS
        return next(c for c in cfgs if c[1] >= m)
    mid = 64 < m <= WGMMA_MID_MAX_M and n * k < WGMMA_MIN_NK
    return wgmma_tiles.config(64 if mid else m, n, k, slots)


def wgmma_smem_bytes(fmt: str, nwg: int, t: int, d: int, bk: int = 64) -> int:
    """ggw::Cfg<F, NWG, T, D, GLU, BK>::SMEM in cuda/gguf_wgmma.cu (stages of bk k)."""
    rows = wgmma_tiles.columns(nwg, t)   # weight rows = output columns
    return wgmma_tiles.smem_bytes(bk // 64 * t * 128 + rows * _wgmma_slot(fmt, bk), d)


def _wgmma_slot(fmt: str, bk: int = 64) -> int:
    """Bytes of a weight row in a stage of the wgmma kernel (ggw::Cfg::SLOT): the 16-byte window
    that holds its bk / 32 blocks (rb bytes) at any offset a stage can have in it, a multiple of
    gcd(rb, 16) (a TMA box starts on a 16-byte boundary)."""
    rb = bk // 32 * BYTES[fmt]
    return -(-(rb + 16 - math.gcd(rb, 16)) // 16) * 16


def _launch_wgmma(fmt, x2, w, y2, m, n, nb, glu: bool = False, cfg=None, splits=None, dp_tiles=None):
    """y2 = x2 @ W.T, or with glu y2 (M, N/2) = swiglu of its halves [gate | up] (the kernel's
    GLU epilogue: each block computes a gate tile and the matching up tile). cfg, splits and
    dp_tiles force wgmma_config's and wgmma_tiles.schedule's choices (tests, sweeps)."""
    cfg = tuple(cfg or wgmma_config(m, n, 32 * nb, _sm_count(y2.device), glu))
    if cfg not in (WGMMA_GLU_CFGS if glu else _WGMMA_PLAIN):
        raise ValueError(f"cfg: {cfg} has no {'GLU ' if glu else ''}instance; one of "
                         f"{WGMMA_GLU_CFGS if glu else _WGMMA_PLAIN}")
    nwg, t, d = cfg[:3]
    bk = _wgmma_bps_bk(cfg)[1]
    kern = _kernel("gguf_wgmma.cu", _wgmma_name(fmt, cfg, glu))
    smem = wgmma_smem_bytes(fmt, nwg, t, d, bk)
    set_max_dynamic_smem(kern, smem)
    tiles_m, tiles_n = wgmma_tiles.grid(m, n, cfg)
    tiles = tiles_m * tiles_n
    threads = 128 * nwg + 128   # the consumer warpgroups and the producer warpgroup
    dp, splits, sps = wgmma_schedule(m, n, nb, resident_blocks(kern, smem, threads) * _sm_count(y2.device), cfg,
                                     splits, dp_tiles)
    part = None   # held until both launches are queued (a fresh tensor during graph capture)
    if splits > 1:   # the split tiles' partials: their columns only (wg::SplitParts)
        part = workspaces.scratch("partials", wgmma_tiles.parts_numel(m, y2.shape[1], cfg, dp, splits, glu), torch.float32,
                                  y2.device)
    # the weight as bytes [N, nb BYTES], a stage's box ROWS rows x SLOT bytes; x tiles of T
    # tokens (M when M < T) x 64 k in the 128-byte swizzle
    slot = _wgmma_slot(fmt, bk)   # 64-byte rows (Q5_0) in the 64-byte swizzle (ggw::Cfg::SWIZZLE)
    box_rows = wgmma_tiles.columns(nwg, t) // (2 if glu else 1)   # GLU: a gate box and an up box
    wmap = tensor_map_2d(w.data_ptr(), n, nb * BYTES[fmt], box_rows, slot, 64 if slot == 64 else 0, "u8")
    xr = wgmma_tiles.x_rows(m, t)
    xmap = tensor_map_2d(x2.data_ptr(), m, 32 * nb, xr, 64)
    launch_tma(kern, (dp + (tiles - dp) * splits,), (threads,),
               (wmap, xmap, y2.data_ptr(), 0 if part is None else part.data_ptr(), np.int32(m), np.int32(n),
                np.int32(nb), np.int32(tiles_m), np.int32(dp), np.int32(splits), np.int32(sps), np.int32(xr)),
               shared_mem=smem)
    if splits > 1:   # the split tiles' partials, summed in split order
        ny = y2.shape[1]
        v = 4 if ny % 4 == 0 and y2.data_ptr() % 8 == 0 else 1   # columns a thread
        launch(_kernel("gguf_wgmma.cu", f"wgmma_reduce<{v}{', true' if glu else ''}>"),
               *wgmma_tiles.reduce_launch(part.data_ptr(), y2.data_ptr(), m, ny, cfg, dp, splits, v, glu))


def wgmma_schedule(m: int, n: int, nb: int, slots: int, cfg, splits=None, dp_tiles=None) -> tuple[int, int, int]:
    """(whole tiles, K splits, stages a split) of a wgmma launch of cfg over nb blocks of K on a
    GPU that holds `slots` of its blocks at once: wgmma_tiles.schedule, which counts 64-k
    stages, over K / (BK / 64) of them (a BK-k stage is one of its stages). Its split plan
    divides `slots` by the config's BPS even where shared memory holds fewer blocks an SM (Q8_0:
    3 of (1, 16, 3, 4, 128), 2 of (1, 32, 3, 3, 128)), so it plans for fewer SMs than there are
    and splits less. Planned for the blocks really held instead, q8_0 ran 1-4 % slower on two
    of three shapes (4096->12288 M = 16: 4 splits 29.4 vs 2 splits 28.2 us; 12288->4096 M = 16
    29.8 vs 29.5; 4096->6144 M = 32 19.6 vs 20.1; bench/NOTES.md, session 53): kept as it is.
    At BK = 128 MIN_STAGES' 8 stages a split are 1024 k (512 at BK = 64)."""
    return wgmma_tiles.schedule(m, n, 32 * nb * 64 // _wgmma_bps_bk(cfg)[1], slots, cfg, splits, dp_tiles)


def mmvq16_ok(qt) -> bool:
    """Whether the vector-load mmvq can read this (checked) weight: base and size multiples of LW."""
    return qt.data.data_ptr() % MMVQ16_LW == 0 and qt.data.numel() % MMVQ16_LW == 0


def _aligned16(qt) -> bool:
    """The mma path's 16-byte window loads need base address and byte size multiples of 16."""
    data = getattr(qt, "data", None)
    try:
        return data.data_ptr() % 16 == 0 and data.numel() % 16 == 0
    except AttributeError:
        return False


def mma_smem_bytes(bm: int) -> int:
    """sizeof(MmaSmem<BM, BK>) in cuda/gguf_mma.cu: two buffers of BK steps of 64 weight rows
    (32 B words + 8 B scales) and BM activation rows (32 B + 8 B)."""
    return 2 * MMA_BK[bm] * (MMA_BN * 40 + bm * 40)


def mma_plan(m: int, n: int, nb: int, sms: int = 132, split: int | None = None):
    """(BM, split, blocks per split) for the mma path: the smallest BM tile that holds M (up to
    64), then split K until about MMA_TARGET_CTAS_PER_SM CTAs per SM exist."""
    bm = next((b for b in MMA_BM_CHOICES if m <= b), MMA_BM_CHOICES[-1])
    bk = MMA_BK[bm]
    tiles = -(-n // MMA_BN) * -(-m // bm)
    if split is None:
        split = max(1, min(MMA_MAX_SPLIT, MMA_TARGET_CTAS_PER_SM * sms // tiles, nb // (2 * bk) or 1))
    split = max(1, min(int(split), -(-nb // bk)))
    kchunk = -(-(-(-nb // split)) // bk) * bk  # blocks per split, a multiple of the step
    split = -(-nb // kchunk)
    return bm, split, kchunk


MMVQ_KERNELS = ("vec", "scalar")


@on_tensor_device
def matmul(x, qt, out=None, path: str | None = None, mmvq_rows: int | None = None,
           mmvq_kernel: str | None = None, mma_split: int | None = None, glu: bool = False):
    """y = x @ W.T: x fp16 CUDA (..., K) contiguous, qt on the same device -> fp16 (..., N).

    glu=True: W's rows are [gate; up] (N % 4 == 0), and y (..., N/2) = silu(x @ gate.T) * (x @
    up.T), the decoder MLP's SwiGLU with layer_ops.silu_mul's roundings (cuda/swiglu.cuh) -- in
    the wgmma path's epilogue (no (..., N) product in memory, no second launch); the other paths
    compute x @ W.T into a workspace and run layer_ops.silu_mul on it.

    `out` (optional, fp16 contiguous (..., N)) receives the result; `path` forces one of PATHS,
    otherwise choose_path decides; `mmvq_rows` (1, 2, 4) overrides the rows per CTA / warp (for
    the bench); `mmvq_kernel` forces "vec" (cuda/gguf_mmvq16.cu; ValueError if the weight is not
    aligned for it) or "scalar" (cuda/gguf_mmvq.cu); by default MMVQ_CHOICE decides (vec only
    when mmvq16_ok(qt)).
    `mma_split` forces the number of K splits of the mma path (tests and bench).
    """
    fmt, n, k = checked_once(qt, check_weight)
    m, _ = _check_act(x, k, "x")
    if x.device != qt.data.device:
        raise ValueError(f"x is on {x.device} but the {fmt} weight is on {qt.data.device}")
    lead = tuple(x.shape[:-1])
    if glu and n % 4:
        raise ValueError(f"glu: the {fmt} weight's {n} rows are not [gate; up] halves of an even size")
    ny = n // 2 if glu else n
    if out is None:
        out = torch.empty(lead + (ny,), dtype=torch.float16, device=x.device)
    else:
        _check_out(out, lead + (ny,), torch.float16, x.device, align=4 if glu else 2)   # glu: half2 stores
        check_out_overlap(x, out)
    if m >= 2**31 // 2:
        raise ValueError(f"x: {m} rows is too many")
    if path is None and mmvq_rows is None and mmvq_kernel is None and mma_split is None:
        if m:
            run_planned(qt, ("glu", m) if glu else m, x, out,
                        lambda: _queue(fmt, x, qt, out, m, n, k, choose_path(m, qt, x, glu), _vec_default(fmt, m, qt),
                                       None, None, glu))
        return out
    if path is None:
        path = choose_path(m, qt, x, glu)
    elif path not in PATHS:
        raise ValueError(f"path: {path!r}, one of {PATHS}")
    if mmvq_rows is not None and (isinstance(mmvq_rows, bool) or mmvq_rows not in MMVQ_ROW_CHOICES):
        raise ValueError(f"mmvq_rows: {mmvq_rows!r}, one of {MMVQ_ROW_CHOICES}")
    if mmvq_kernel is not None and mmvq_kernel not in MMVQ_KERNELS:
        raise ValueError(f"mmvq_kernel: {mmvq_kernel!r}, one of {MMVQ_KERNELS}")
    vec = _vec_default(fmt, m, qt) if mmvq_kernel is None else mmvq_kernel == "vec"
    if mma_split is not None and (not isinstance(mma_split, int) or mma_split < 1):
        raise ValueError(f"mma_split: {mma_split!r}, a positive int")
    if path == "mma" and mma_split is not None:   # (its pieces are the mma kernel's gridDim.z)
        pieces = mma_plan(m, n, k // QK, split=mma_split)[1]
        if pieces > MAX_GRID_YZ:
            raise ValueError(f"mma_split: {mma_split} splits K={k} into {pieces} pieces, past CUDA's "
                             f"gridDim.z limit of {MAX_GRID_YZ}")
    if path == "wgmma" and not wgmma_ok(qt):
        raise ValueError(f"path: 'wgmma' takes a weight on a Hopper GPU (compute capability "
                         f"9.0), 16-byte aligned, with K % 256 == 0; got {fmt} K={k} on {qt.data.device}")
    if path == "wgmma" and x.data_ptr() % 16:
        raise ValueError(f"x: the 'wgmma' path reads x by TMA, which needs a 16-byte aligned address "
                         f"(x's address % 16 = {x.data_ptr() % 16})")
    if path == "mma" and not _aligned16(qt):
        raise ValueError("path: 'mma' needs qt.data's address and size to be multiples of 16 bytes "
                         f"(address % 16 = {qt.data.data_ptr() % 16}, size {qt.data.numel()})")
    if vec and mmvq_kernel == "vec" and not mmvq16_ok(qt):
        raise ValueError(f"mmvq_kernel: 'vec' needs qt.data's address and size to be multiples of "
                         f"{MMVQ16_LW} bytes (address % {MMVQ16_LW} = {qt.data.data_ptr() % MMVQ16_LW}, "
                         f"size {qt.data.numel()})")
    if m:
        run_unplanned(lambda: _queue(fmt, x, qt, out, m, n, k, path, vec, mmvq_rows, mma_split, glu))
    return out


def _vec_default(fmt, m, qt) -> bool:
    """The measured mmvq kernel choice for this format and M (first chunk): vec only if aligned."""
    return mmvq_choice(fmt, max(1, min(MMVQ_COLS, m)))[0] == "vec" and mmvq16_ok(qt)


def _queue(fmt, x, qt, out, m, n, k, path, vec, mmvq_rows, mma_split, glu=False) -> None:
    """Launch matmul's kernels on checked arguments (M >= 1); cuBLAS calls go through
    cuda_launch.torch_step, so that kernels.run_planned can record them."""
    nb = k // QK
    if glu and path == "wgmma":
        _launch_wgmma(fmt, x.view(m, k), qt.data, out.view(m, n // 2), m, n, nb, glu=True)
        return
    if glu:   # the product into a workspace, then silu_mul
        from quantzoo.kernels import layer_ops

        gu = workspaces.scratch("glu", m * n, torch.float16, x.device).view(m, n)
        _queue(fmt, x, qt, gu, m, n, k, path, vec, mmvq_rows, mma_split)
        layer_ops.silu_mul(gu, out=out.view(m, n // 2))
        return
    y2 = out.view(m, n)
    if path == "dequant":
        _dequant_matmul(fmt, x.view(m, k), qt.data, y2, n, k)
        return
    if path == "wgmma":
        _launch_wgmma(fmt, x.view(m, k), qt.data, y2, m, n, nb)
        return
    xq = workspaces.scratch("q8_1", m * nb * Q8_1_BYTES, torch.uint8, x.device)
    w = qt.data
    if path == "mma":
        _launch_quantize(x, xq, m * nb, split=True)
        _launch_mma(fmt, w, xq, y2, m, n, nb, mma_split)
        return
    if path == "mmvq":
        _launch_quantize(x, xq, m * nb, split=vec)
        _launch_mmvq_rows(fmt, w, xq, y2, m, n, nb, vec, mmvq_rows)
        return
    grid = ((n + MMQ_TILE - 1) // MMQ_TILE, (m + MMQ_TILE - 1) // MMQ_TILE)   # mmq
    if grid[1] > MAX_GRID_YZ:
        raise ValueError(f"x: {m} rows is too many for the mmq path")
    _launch_quantize(x, xq, m * nb)
    launch(_kernel("gguf_mmq.cu", f"mmq<{BLOCKS[fmt]}>"), grid, (MMQ_THREADS,),
           (w.data_ptr(), xq.data_ptr(), y2.data_ptr(), np.int32(m), np.int32(n), np.int32(nb)))


def _launch_mmvq_rows(fmt, w, xq, y2, m, n, nb, vec: bool, mmvq_rows=None):
    """The mmvq launches of M rows whose Q8_1 is in xq (split layout for vec, else interleaved),
    in chunks of up to MMVQ_COLS rows."""
    for c0 in range(0, m, MMVQ_COLS):
        mc = min(MMVQ_COLS, m - c0)
        if vec:
            r, u = (mmvq_rows, 1) if mmvq_rows else mmvq_plan(fmt, "vec", mc, nb)
            launch_mmvq16(fmt, w, xq.data_ptr() + c0 * nb * 32, xq.data_ptr() + m * nb * 32 + c0 * nb * 4,
                          y2.data_ptr() + c0 * n * 2, n, nb, mc, r, u=u)
        else:
            r = mmvq_rows or mmvq_plan(fmt, "scalar", mc)[0]
            launch_mmvq(fmt, w, xq.data_ptr() + c0 * nb * Q8_1_BYTES, y2.data_ptr() + c0 * n * 2, n, nb, mc, r)


def q8_1_layout(qt, m: int, glu: bool = False) -> str | None:
    """The Q8_1 layout in which matmul_q8_1 takes M rows of x for this (CUDA, GGUF) weight:
    "split" (the vector-load mmvq) or "interleaved" (the scalar one), as matmul would quantize
    them itself; None where matmul runs no mmvq (choose_path(m, qt) is another path: M outside
    1..MMVQ_MAX_M, or where wgmma takes over below it) or the weight is not a GGUF block format
    on CUDA. glu: the same for matmul(x, qt, glu=True), whose mmvq is matmul_q8_1 and silu_mul
    (wgmma takes it from a smaller M). The runner asks it to have its layer ops emit Q8_1 directly."""
    fmt = getattr(qt, "format", None)
    if (fmt not in BLOCKS or m < 1 or not getattr(qt.data, "is_cuda", False)
            or choose_path(m, qt, glu=glu) != "mmvq"):   # (mmvq only to MMVQ_MAX_M)
        return None
    return "split" if _vec_default(fmt, m, qt) else "interleaved"


@on_tensor_device
def matmul_q8_1(xq, qt, m: int, layout: str, out=None):
    """y = x @ W.T from x already quantized to Q8_1: xq uint8 CUDA, M * K/32 blocks of 36 bytes in
    `layout`, which must be q8_1_layout(qt, m); fp16 (M, N) out. The same kernels and result as
    matmul(x, qt) on the x those blocks came from, without its quantize launch."""
    fmt, n, k = checked_once(qt, check_weight)
    want = q8_1_layout(qt, m) if isinstance(m, int) and not isinstance(m, bool) else None
    if want is None:
        raise ValueError(f"m: {m!r}; matmul_q8_1 takes the M this {fmt} weight's matmul runs on the mmvq path "
                         f"(1 <= M <= {MMVQ_MAX_M[fmt]}, and below {n} x {k}'s wgmma threshold: choose_path)")
    if layout != want:
        raise ValueError(f"layout: {layout!r}, this {fmt} weight's mmvq at M={m} reads {want!r}")
    nb = k // QK
    _check_out(xq, (m * nb * Q8_1_BYTES,), torch.uint8, qt.data.device, arg="xq", align=16)
    if out is None:
        out = torch.empty((m, n), dtype=torch.float16, device=xq.device)
    else:
        _check_out(out, (m, n), torch.float16, xq.device)
        check_out_overlap(xq, out)
    run_planned(qt, ("q8_1", m), xq, out,
                lambda: _launch_mmvq_rows(fmt, qt.data, xq, out, m, n, nb, layout == "split"))
    return out


def _launch_mma(fmt, w, xq, y2, m, n, nb, split=None):
    bm, split, kchunk = mma_plan(m, n, nb, _sm_count(y2.device), split)
    grid = (-(-n // MMA_BN), -(-m // bm), split)
    if grid[1] > MAX_GRID_YZ:
        raise ValueError(f"x: {m} rows is too many for the mma path")
    part = None   # held until both launches are queued (a fresh tensor during graph capture)
    if split > 1:
        part = workspaces.scratch("partials", split * m * n, torch.float32, y2.device)
    kern = _kernel("gguf_mma.cu", f"mma_gemm<{BLOCKS[fmt]}, {bm}>")
    smem = mma_smem_bytes(bm)   # <= 40 KB: no opt-in above the default 48 KB needed
    launch(kern, grid, (MMA_THREADS,),
           (w.data_ptr(), xq.data_ptr(), xq.data_ptr() + m * nb * 32, y2.data_ptr(),
            0 if part is None else part.data_ptr(), np.int32(m), np.int32(n), np.int32(nb),
            np.int32(kchunk)), shared_mem=smem)
    if split > 1:
        total = m * n
        launch(_kernel("gguf_mma.cu", "mma_reduce"), (-(-total // 256),), (256,),
               (part.data_ptr(), y2.data_ptr(), np.int64(total), np.int32(split)))


def launch_mmvq16(fmt, w, aqs_ptr: int, ads_ptr: int, y_ptr: int, n: int, nb: int, m: int, r: int,
                  noalloc: bool | None = None, name_expressions=None, u: int | None = None):
    """One vector-load mmvq launch (no checks: matmul validated everything). The bench passes
    noalloc / u / name_expressions to time variants that SOURCES does not list."""
    name = mmvq16_name(fmt, m, r, noalloc, u)
    if name_expressions:
        kern = get_kernel("gguf_mmvq16.cu", name, tuple(name_expressions))
    else:
        kern = _kernel("gguf_mmvq16.cu", name)
    rows_per_cta = MMVQ16_WARPS * r
    launch(kern, ((n + rows_per_cta - 1) // rows_per_cta,), (32 * MMVQ16_WARPS,),
           (w.data_ptr(), aqs_ptr, ads_ptr, y_ptr, np.int32(n), np.int32(nb)))


def launch_mmvq(fmt, w, a_ptr: int, y_ptr: int, n: int, nb: int, m: int, r: int):
    """One scalar-load mmvq launch (cuda/gguf_mmvq.cu) over Q8_1 activations at a_ptr; no checks."""
    launch(_kernel("gguf_mmvq.cu", f"mmvq<{BLOCKS[fmt]}, {m}, {r}>"), ((n + r - 1) // r,), (MMVQ_THREADS,),
           (w.data_ptr(), a_ptr, y_ptr, np.int32(n), np.int32(nb)))


def _dequant_matmul(fmt, x2, w, y2, n, k, buffer_bytes: int | None = None):
    """y2 = x2 @ dequant(W).T, W converted a slice of rows at a time into one reused buffer."""
    budget = DEQUANT_BUFFER_BYTES if buffer_bytes is None else buffer_bytes
    rows = max(1, min(n, budget // (2 * k)))
    if rows < n and rows > 64:
        rows -= rows % 64  # keep cuBLAS's N tiles whole
    buf = workspaces.scratch("dequant", rows * k, torch.float16, x2.device)
    m = x2.shape[0]
    for r0 in range(0, n, rows):
        r = min(rows, n - r0)
        wb = buf[: r * k].view(r, k)
        _launch_dequant(fmt, w, wb, r0, r, k // QK)
        torch_step(functools.partial(_slab_mm, wb, m, n, k, r0), x2, y2)


def _slab_mm(wb, m, n, k, r0, x, y):
    """Columns [r0, r0 + rows of wb) of y (M x N) = x (M x K) @ wb.T by cuBLAS."""
    if wb.shape[0] == n:
        torch.mm(x.view(m, k), wb.t(), out=y.view(m, n))
    else:
        torch.mm(x.view(m, k), wb.t(), out=y.view(m, n)[:, r0:r0 + wb.shape[0]])
