"""Tile and split choices shared by the Hopper wgmma kernels (cuda/awq_wgmma.cu, cuda/gguf_wgmma.cu).

Both walk K in shared-memory stages with one block of NWG consumer warpgroups and a TMA
producer warpgroup per tile of T tokens; the rules below were measured on the AWQ
kernel (bench/NOTES.md, session 8) and the GGUF one is built the same way. A configuration is
(NWG, T, D) -- one block an SM -- or (NWG, T, D, BPS[, BK]) with BPS blocks an SM (the AWQ
kernel's one-warpgroup configs up to M = 128, awq.WGMMA_CFGS, and the GGUF kernel's up to
M = 32, gguf.WGMMA_CFGS; `plan` splits K for them differently). Stages here are 64 rows of K;
the GGUF kernel's BK = 128 stages are counted by passing K / 2 (gguf.wgmma_schedule).
"""
from __future__ import annotations

import numpy as np

MIN_STAGES = 8   # split K no finer than 8 stages of 64 rows per block (pipeline fill and drain)


# Above M = 128 config picks T = 128 or 256 by the time `cost` predicts, in units of one 64-row
# stage of a T = 256 tile (128 x 256 outputs; T = 128 tiles are 256 x 128, as many MACs):
T128_STAGE = 1.08    # a T = 128 stage: 4096->12288 M = 512, the same schedule, 97.2 vs 90.3 us
SPLIT_STAGES = 7     # a split launch's extra time, the split-K reduce (~5 us / 0.75 us a stage)


def config(m: int, n: int | None = None, k: int | None = None, slots: int | None = None) -> tuple[int, int, int]:
    """(NWG, T, D) for M rows: T = 64 up to M = 64, 128 up to 128 (the kernels take their own
    configs below: AWQ up to M = 128, awq.WGMMA_CFGS; GGUF up to M = 32, gguf.WGMMA_CFGS); above,
    T = 128 or 256, whichever `cost` predicts faster for an
    N x K weight on a GPU holding `slots` blocks at once (T = 256 without them). T = 256, one
    64 x 256 instruction per k-step and half the dequant per MMA, is 3-15 % faster than T = 128
    on whole tiles; T = 128 wins where it leaves fewer tokens padded or SMs idle: 4096->12288
    M = 384 76.4 vs 90.4 us (144 vs 192 tiles on 132 SMs), M = 640 113.4 vs 130.6
    (bench/NOTES.md, session 17)."""
    if m <= 128:
        return (2, 64, 6) if m <= 64 else (2, 128, 5)
    wide = (2, 256, 5)
    if n is None or k is None or not slots:
        return wide
    return min((wide, (2, 128, 5)), key=lambda cfg: cost(m, n, k, slots, cfg))


def cost(m: int, n: int, k: int, slots: int, cfg) -> float:
    """Predicted time of a launch, in T = 256 stages: the stages of the most loaded SM (whole
    waves of whole tiles, then the last wave's split tiles), plus the reduce of a split launch."""
    dp, splits, per = schedule(m, n, k, slots, cfg)
    stages = -(-k // 64)
    if splits == 1:
        t = -(-dp // slots) * stages
    else:
        t = dp // slots * stages + per + SPLIT_STAGES
    return t * (T128_STAGE if cfg[1] == 128 else 1.0)


def x_rows(m: int, t: int) -> int:
    """Rows of a launch's x box: T, or M when M < T (no box reaches past row M:
    wg::x_box_row in cuda/wgmma_sm90.cuh)."""
    return min(m, t)


def columns(nwg: int, t: int) -> int:
    """Output columns per block: 64 per wgmma instruction, 2 instructions per k-step and
    warpgroup up to T = 128, 1 at T = 256 (JN in the kernels' Cfg)."""
    return 64 * (1 if t == 256 else 2) * nwg


def grid(m: int, n: int, cfg) -> tuple[int, int]:
    """(token tiles, column tiles) of a launch with configuration cfg = (NWG, T, D[, blocks an SM])."""
    nwg, t = cfg[:2]
    return -(-m // t), -(-n // columns(nwg, t))


def parts_numel(m: int, ny: int, cfg, dp_tiles: int, splits: int, glu: bool = False) -> int:
    """fp32 elements of the split tiles' partials (wg::SplitParts in cuda/wgmma_sm90.cuh): splits
    x M rows x y's columns from the first split tile's on (tiles are numbered token tile
    fastest), twice that with glu (gate and up)."""
    nwg, t = cfg[:2]
    cols = columns(nwg, t) // (2 if glu else 1)   # y's columns a tile
    tiles_m = -(-m // t)
    if splits > 1 and dp_tiles >= tiles_m * -(-ny // cols):
        raise ValueError(f"dp_tiles={dp_tiles}: no tile left to split ({tiles_m * -(-ny // cols)} tiles)")
    first = dp_tiles // tiles_m * cols
    return splits * m * (ny - first) * (2 if glu else 1)


def reduce_launch(part_ptr: int, y_ptr: int, m: int, n: int, cfg, dp_tiles: int, splits: int, v: int,
                  glu: bool = False):
    """(grid, block, args) of the wgmma_reduce<v[, true]> launch (cuda/wgmma_sm90.cuh) after a
    split launch of either kernel: the partials at part_ptr (parts_numel's layout) of the tiles
    past dp_tiles summed into y (n columns), v columns a thread; glu: y = swiglu of the gate and
    up partials, a tile holding half its columns' worth of y."""
    nwg, t = cfg[:2]
    rows = columns(nwg, t) // (2 if glu else 1)   # y's columns per tile
    tiles_m, tiles_n = -(-m // t), -(-n // rows)
    count = (tiles_m * tiles_n - dp_tiles) * t * rows
    return ((-(-count // (256 * v)),), (256,),
            (part_ptr, y_ptr, np.int32(m), np.int32(n), np.int32(t), np.int32(rows), np.int32(tiles_m),
             np.int32(dp_tiles), np.int32(splits), np.int64(count)))


def plan(m: int, n: int, k: int, slots: int, cfg) -> int:
    """K splits for M x N outputs over K on a GPU that holds `slots` blocks at once: as many as
    fit in one wave, at least MIN_STAGES 64-row stages each. With several blocks an SM (cfg's
    4th entry, BPS) the splits that fill one wave need not be the fastest: an SM's blocks share
    its issue, so its time is about the blocks it runs x the stages each walks, and a split count
    that leaves some SMs one block more than others (or one block where two would overlap their
    latencies) loses. So: the fewest splits, of those that fit, with the least ceil(blocks / SMs)
    x stages a split, counting at least 2 blocks an SM (one block runs at about the rate of two
    sharing the SM: 12288->4096 M = 16 at (1, 16, 8, 3), 4 splits 20.1 us, 8 splits 17.1 us;
    bench/NOTES.md, session 50)."""
    tm, tn = grid(m, n, cfg)
    tiles, stages = tm * tn, -(-k // 64)
    top = max(1, min(slots // tiles, stages // MIN_STAGES))
    bps = cfg[3] if len(cfg) > 3 else 1
    if bps == 1:
        return top
    sms = slots // bps
    return min(range(1, top + 1), key=lambda s: (max(2, -(-tiles * s // sms)) * -(-stages // s), s))


def split_k(m: int, n: int, k: int, slots: int, cfg, splits: int | None = None) -> tuple[int, int]:
    """(K splits, 64-row stages per split) of a launch on a GPU that holds `slots` blocks at
    once: `plan`'s splits (or the caller's), evened out so that every split is non-empty."""
    stages = -(-k // 64)
    per = -(-stages // (splits or plan(m, n, k, slots, cfg)))
    return -(-stages // per), per


def schedule(m: int, n: int, k: int, slots: int, cfg, splits: int | None = None,
             dp_tiles: int | None = None) -> tuple[int, int, int]:
    """(whole tiles, K splits, 64-row stages per split) of a launch whose first
    `whole tiles` blocks walk all of K and whose remaining tiles are split: with no more tiles
    than slots, every tile is split as `plan` says; with more, whole waves of tiles walk all of
    K and the last, partly filled wave's tiles are split to fill it (at least MIN_STAGES stages
    a split). splits / dp_tiles force the choice (tests, sweeps)."""
    tm, tn = grid(m, n, cfg)
    tiles = tm * tn
    dp = 0
    if splits is None and tiles > slots:
        rest = tiles % slots
        splits = max(1, min(slots // rest, -(-k // 64) // MIN_STAGES)) if rest else 1
        dp = tiles - rest
    if dp_tiles is not None:
        dp = min(tiles, dp_tiles)
    s, per = split_k(m, n, k, slots, cfg, splits)
    return (tiles if s == 1 else dp), s, per


def smem_bytes(stage: int, d: int) -> int:
    """Dynamic shared memory of a kernel with d stages of `stage` bytes, each rounded up to
    1024 bytes (the 128-byte swizzle's alignment), plus 1024 of slack to align the base."""
    return d * (-(-stage // 1024) * 1024) + 1024
