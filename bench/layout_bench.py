"""Does the weight's memory layout alone set the streaming rate of a decode GEMV? Run on the GPU:

    python bench/layout_bench.py [--k 4096] [--n 12288]

The AWQ kernels stream qweight ([K, N/8] int32) at ~2.1 TB/s marginal while the GGUF MMVQ
streams its rows (contiguous along K) at ~2.6-2.9 (bench/NOTES.md). This times read-only kernels
that walk a K x N/2-byte matrix exactly as cuda/awq_small.cu's warps do -- each warp a k-slice,
one R-row x C-chunk (16 B) tile per step, R * C = 64 chunks = 1 KB a step, 8 warps a block --
once over the strided [K, N/2] layout and once over a tiled layout where each warp's tiles are
consecutive 1 KB pieces. Nothing else differs (loads in flight, grid, work per warp), so the
difference is the layout's. The result is an XOR of the words, written per thread.
Weights rotate over copies that exceed the L2; CUDA-event median over a graph of launches.
"""
from __future__ import annotations

import argparse

import torch

SRC = r"""
template <int R, int C, bool TILED, int U>
__global__ void __launch_bounds__(256) stream(const uint4* __restrict__ w, unsigned* __restrict__ out,
                                              int pitch, int steps_total, int spw) {
  // block (column tile ct, split sp); warp = k-slice; step s of column tile ct:
  //   strided: rows R*s .. R*s+R-1, chunks C*ct .. C*ct+C-1 of a row of `pitch` chunks
  //   tiled:   64 consecutive chunks at (ct * steps_total + s) * 64
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int ct = blockIdx.x;
  const int s0 = (blockIdx.y * 8 + warp) * spw;
  unsigned acc = 0;
  for (int s = s0; s < s0 + spw && s < steps_total; s += U) {
    uint4 v[U][2];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c = lane + 32 * j;                 // chunk of the 64 in this step's tile
        const int st = min(s + u, steps_total - 1);
        size_t off = TILED ? ((size_t)ct * steps_total + st) * 64 + c
                           : (size_t)(R * st + c / C) * pitch + C * ct + c % C;
        v[u][j] = __ldg(w + off);
      }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < 2; ++j) acc ^= v[u][j].x ^ v[u][j].y ^ v[u][j].z ^ v[u][j].w;
  }
  out[(blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x] = acc;
}
"""
# (name, R, C, tiled): R rows x C chunks of 16 bytes per warp step (1 KB)
PATTERNS = (("awq_small today: 16 rows x 64 B", 16, 4, False),
            ("8 rows x 128 B", 8, 8, False),
            ("4 rows x 256 B", 4, 16, False),
            ("1 row x 1 KB", 1, 64, False),
            ("tiled: 1 KB contiguous", 16, 4, True))


def main(argv=None) -> int:
    import numpy as np
    from tabulate import tabulate

    from quantzoo import cuda_launch, ops
    from quantzoo.bench import timing
    from quantzoo.bench.model import random_weight

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=12288)
    ap.add_argument("--spw", type=int, default=12, help="k-steps per warp (awq_small: 12 at 12288->4096)")
    ap.add_argument("--u", type=int, default=4, help="steps in flight per warp")
    a = ap.parse_args(argv)
    k, n = a.k, a.n
    nbytes = k * n // 2
    pitch = n // 32                         # 16-byte chunks per row
    copies = timing.rotation_copies(nbytes)
    bufs = [torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda") for _ in range(copies)]
    bw = timing.copy_bandwidth()["copy_tbps"]
    names = [f"stream<{r}, {c}, {'true' if t else 'false'}, {a.u}>" for _, r, c, t in PATTERNS]
    mod = cuda_launch.import_cupy().RawModule(code=SRC, options=("-std=c++17",), name_expressions=names)
    rows = []
    for (label, r, c, tiled), name in zip(PATTERNS, names):
        kern = mod.get_function(name)
        steps_total = k // r if not tiled else k // 16
        col_tiles = pitch // c if not tiled else pitch // 4
        splits = -(-steps_total // (8 * a.spw))
        out = torch.empty(col_tiles * splits * 256, dtype=torch.int32, device="cuda")

        def call(i, kern=kern, steps_total=steps_total, col_tiles=col_tiles, splits=splits, out=out):
            cuda_launch.launch(kern, (col_tiles, splits), (256,),
                               (bufs[i].data_ptr(), out.data_ptr(), np.int32(pitch), np.int32(steps_total),
                                np.int32(a.spw)))
        res = timing.benchmark(call, copies=copies)
        us = res["median_us"]
        rows.append([label, col_tiles * splits, f"{us:.2f}", f"{nbytes / us / 1e6:.2f}",
                     f"{100 * nbytes / us / 1e6 / bw:.0f}%"])
        print(rows[-1], flush=True)
    for fmt in ("awq", "q4_0"):   # the real M = 1 kernels on the same shape, same timing
        gen = torch.Generator(device="cuda").manual_seed(0)
        w0 = random_weight(fmt, n, k, "cuda", gen)
        cp = timing.rotation_copies(w0.nbytes)
        ws = [w0] + [random_weight(fmt, n, k, "cuda", gen) for _ in range(cp - 1)]
        x = torch.randn(1, k, device="cuda").half()
        res = timing.benchmark(lambda i: ops.matmul(x, ws[i]), copies=cp)
        us = res["median_us"]
        rows.append([f"real {fmt} M=1 (ops.matmul)", "-", f"{us:.2f}", f"{w0.nbytes / us / 1e6:.2f}",
                     f"{100 * w0.nbytes / us / 1e6 / bw:.0f}%"])
        print(rows[-1], flush=True)
        del ws
    print(tabulate(rows, headers=["pattern", "blocks", "us", "TB/s", "% copy"], tablefmt="github",
                   disable_numparse=True))
    print(f"K={k} N={n}: {nbytes / 1e6:.1f} MB, copy {bw:.2f} TB/s, {a.spw} steps/warp, U={a.u}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
