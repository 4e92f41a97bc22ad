// awq_gemv.cu -- AWQ W4A16 GEMV / small-M product with CUDA-core fp32 FMAs (decode, M <= 8).
//
//   y[m, n] = fp16( sum_k x[m, k] * w16[k, n] ),   w16 = fp16((q - z) * s)   (awq_common.cuh)
//
// Products x * w16 of two fp16 numbers are exact in fp32; they are summed in fp32. Nothing but
// the packed weight crosses global memory: the unpack, (q - z) * s and the FMAs happen in
// registers.
//
// Why it is shaped like this:
// * A 16-byte load of qweight covers 32 columns of one row. A thread that consumed it directly
//   would need 32 * M fp32 accumulators (256 at M = 8). Instead each block streams a tile of
//   32 rows x 32 column words through shared memory with 16-byte cp.async copies (coalesced,
//   asynchronous, several stages in flight), and each lane then owns ONE column word (8 columns)
//   and reads it row after row: 8 * M accumulators.
// * 32 rows per stage divide every group size (32/64/128), so a stage has one scale/zero row:
//   the zero terms and scales are converted once per stage, not per weight.
// * Memory-bound at M = 1: the work is spread over ~4 blocks per SM by splitting K across blocks
//   (gridDim.y); the partial sums meet in an fp32 workspace and the last block of each column
//   tile adds them in split order (deterministic; awq_common.cuh).
// * 4 warps split the 32 rows of a stage (2 consecutive rows per step, so x is read as half2);
//   a shared-memory reduction over the warps ends the block.
// Measured on the H100 (bench/notes-awq.md): slower than the tensor-core kernel (awq_mma.cu) at
// every M, even M = 1 (4096->12288: 20.8 vs 19.3 us): the exact dequant plus half->float
// conversion and 8*M fp32 FMAs cost ~31 instructions per packed word against ~19 for
// dequant + prmt + mma, and the kernel is issue-bound, not memory-bound. Dispatch does not pick
// it on the H100; it stays as the readable CUDA-core reference (path="gemv").
#include "awq_common.cuh"

namespace gemv {
constexpr int THREADS = 128;
constexpr int WARPS = THREADS / 32;
constexpr int WORDS = 32;    // column words per block (256 output columns); lane = column word
constexpr int ROWS = 32;     // k rows per stage
constexpr int STAGES = 4;

template <int M>
struct Pipe {
  unsigned q[STAGES][ROWS][WORDS];
  half s[STAGES][WORDS * 8];
  unsigned z[STAGES][WORDS];
  half x[STAGES][M][ROWS];
};
template <int M>
struct Red {
  float v[WARPS - 1][M * 8][32];
};
template <int M>
union Smem {
  Pipe<M> pipe;
  Red<M> red;
};
}  // namespace gemv

// grid (ceil(N/8 / 32), splits); rows_per_split is a multiple of 32.
template <int M>
__global__ void __launch_bounds__(gemv::THREADS)
awq_gemv_kernel(const half* __restrict__ x, const unsigned* __restrict__ qweight,
                const unsigned* __restrict__ qzeros, const half* __restrict__ scales,
                half* __restrict__ y, float* __restrict__ ws, unsigned* __restrict__ counters,
                int K, int N, int G, int rows_per_split) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
  using namespace gemv;
  __shared__ __align__(16) Smem<M> sm;
  __shared__ int last_flag;
  const int n8 = N / 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int col0 = blockIdx.x * WORDS;
  const int splits = gridDim.y;
  const int k_begin = blockIdx.y * rows_per_split;
  const int k_end = min(K, k_begin + rows_per_split);
  const int n_stages = k_begin < k_end ? (k_end - k_begin) / ROWS : 0;
  const bool vec16 = (n8 % 4) == 0;

  auto load_stage = [&](int st, int buf) {
    const int k0 = k_begin + st * ROWS;
    awq::load_words<ROWS, WORDS, THREADS>(&sm.pipe.q[buf][0][0], WORDS, qweight, n8, k0, k_end,
                                          col0, n8, vec16);
    const int g = k0 / G;
    for (int i = threadIdx.x; i < WORDS + WORDS + M * (ROWS / 8); i += THREADS) {
      if (i < WORDS) {                       // scales: 8 halves (16 B) per column word
        bool ok = col0 + i < n8;
        const half* src = ok ? scales + (size_t)g * N + 8 * (col0 + i) : scales;
        awq::cp_async16(&sm.pipe.s[buf][8 * i], src, ok);
      } else if (i < 2 * WORDS) {            // zero words
        int c = i - WORDS;
        bool ok = col0 + c < n8;
        awq::cp_async4(&sm.pipe.z[buf][c], ok ? qzeros + (size_t)g * n8 + col0 + c : qzeros, ok);
      } else {                               // x[m, k0 .. k0+32): 4 chunks of 8 halves per row
        int j = i - 2 * WORDS, m = j / (ROWS / 8), c = (j % (ROWS / 8)) * 8;
        awq::cp_async16(&sm.pipe.x[buf][m][c], x + (size_t)m * K + k0 + c, true);
      }
    }
  };

  float acc[M][8];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[m][i] = 0.f;

#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < n_stages) load_stage(st, st);
    awq::cp_async_commit();
  }
  for (int st = 0; st < n_stages; ++st) {
    awq::cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (st + STAGES - 1 < n_stages) load_stage(st + STAGES - 1, (st + STAGES - 1) % STAGES);
    awq::cp_async_commit();

    const int buf = st % STAGES;
    const awq::Zeros z = awq::make_zeros(sm.pipe.z[buf][lane]);
    const uint4 sv = *reinterpret_cast<const uint4*>(&sm.pipe.s[buf][8 * lane]);
    const half2 s[4] = {awq::as_h2(sv.x), awq::as_h2(sv.y), awq::as_h2(sv.z), awq::as_h2(sv.w)};
#pragma unroll
    for (int i = 0; i < ROWS / (2 * WARPS); ++i) {
      const int r = 2 * WARPS * i + 2 * warp;          // rows r, r+1 of the stage
      half2 w0[4], w1[4];
      awq::dequant8(sm.pipe.q[buf][r][lane], z, s, w0);
      awq::dequant8(sm.pipe.q[buf][r + 1][lane], z, s, w1);
      float f0[8], f1[8];
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        float2 a = __half22float2(w0[p]), b = __half22float2(w1[p]);
        f0[2 * p] = a.x; f0[2 * p + 1] = a.y; f1[2 * p] = b.x; f1[2 * p + 1] = b.y;
      }
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float2 xv = __half22float2(*reinterpret_cast<const half2*>(&sm.pipe.x[buf][m][r]));
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[m][c] = fmaf(xv.y, f1[c], fmaf(xv.x, f0[c], acc[m][c]));
      }
    }
  }
  awq::cp_async_wait<0>();
  __syncthreads();

  // reduce the 4 warps (fixed order), warp 0 finishes
  if (warp > 0) {
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int c = 0; c < 8; ++c) sm.red.v[warp - 1][m * 8 + c][lane] = acc[m][c];
  }
  __syncthreads();
  const int cw = col0 + lane;
  if (warp == 0) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
      for (int c = 0; c < 8; ++c)
#pragma unroll
        for (int w = 0; w < WARPS - 1; ++w) acc[m][c] += sm.red.v[w][m * 8 + c][lane];
      if (cw < n8) {
        if (splits == 1) awq::store8_half(y + (size_t)m * N + 8 * cw, acc[m]);
        else awq::store8_float(ws + ((size_t)blockIdx.y * M + m) * N + 8 * cw, acc[m]);
      }
    }
  }
  if (splits == 1) return;
  if (!awq::last_block_of_tile(counters + blockIdx.x, splits, &last_flag)) return;
  if (warp == 0 && cw < n8) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float v[8];
      awq::sum8_partials(v, ws + (size_t)m * N + 8 * cw, (size_t)M * N, splits);
      awq::store8_half(y + (size_t)m * N + 8 * cw, v);
    }
  }
}

