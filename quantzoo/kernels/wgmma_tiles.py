"""Tile and split choices shared by the Hopper wgmma kernels (cuda/awq_wgmma.cu, cuda/gguf_wgmma.cu).

Both walk K in 64-row shared-memory stages with one block of 2 warpgroups per tile of T tokens;
the rules below were measured on the AWQ kernel (bench/NOTES.md, session 8) and the GGUF one
is built the same way.
"""
from __future__ import annotations

MIN_STAGES = 8   # split K no finer than 8 stages of 64 rows per block (pipeline fill and drain)
# resident blocks per SM by T, for dispatch (which compiles nothing): 256 threads at ptxas's
# 112-136 / 146-161 / 214-230 / 179-201 registers (CUDA 13, sm_90a; Q5_0 at T = 32 fits only one
# block); launches ask the compiled kernel.
BLOCKS_PER_SM = {32: 2, 64: 1, 128: 1, 256: 1}


def config(m: int) -> tuple[int, int, int]:
    """(NWG, T, D) for M rows: the narrowest token tile that holds M up to 128, else 256 (T = 32 /
    64 / 128 each fastest in its range; T = 256, one 64 x 256 instruction per k-step and half
    the dequant per MMA, 3-15 % faster than T = 128 from M = 256 up, slower at M = 128)."""
    return ((2, 32, 6) if m <= 32 else (2, 64, 6) if m <= 64 else (2, 128, 5) if m <= 128
            else (2, 256, 5))


def splits(tiles: int, stages: int, slots: int) -> tuple[int, float]:
    """(K splits, wave fill) for `tiles` output tiles over `stages` 64-row stages on a GPU that
    holds `slots` blocks at once: as many splits as fit in one wave (at least MIN_STAGES stages
    each), and the fraction of the last wave's slots the grid fills (1.0 = whole waves)."""
    s = max(1, min(slots // tiles, stages // MIN_STAGES))
    blocks = tiles * s
    return s, blocks / (-(-blocks // slots) * slots)
