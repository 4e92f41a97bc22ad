// fp16_gemv.cu -- y (M, N) = x (M, K) @ W (N, K)^T for M = 1..4: the decode-time product of an
// unquantized fp16 weight (torch's F.linear layout, row n of W is output n), fp32 accumulation,
// y rounded to fp16 once.
//
//   y[m, n] = fp16( sum_k float(x[m, k]) * float(W[n, k]) )
//
// At M <= 4 the product is a stream over W (2 bytes per weight, read once), so the kernel is
// about keeping enough bytes in flight: one warp owns R = 2 consecutive rows, lane l reads the
// 16-byte chunks l, l + 32, ... of both, U = 4 chunks per row unrolled so 8 x 16 B per lane are
// requested before the first one is used. W is read with ld.global.nc.L1::no_allocate (it is
// touched once, keep it out of L1), x with __ldg (every warp reads all of it: L1 serves it).
// cuBLAS at M = 1 picks split-K kernels for some shapes and a separate reduction kernel; on
// the H100 its GEMVs of a Qwen3-8B layer ran at ~2.6 TB/s (bench/notes-runner.md).
// K % 8 == 0 and 16-byte aligned rows are required (the Python side checks, else cuBLAS).
// The sum over k runs per lane in chunk order, then a xor-butterfly across the warp.
#include <cuda_fp16.h>
#include "pdl.cuh"
#include "stream_load.cuh"
#include "warp_sum.cuh"

namespace fp16_gemv_detail {
__device__ __forceinline__ void to_float8(const uint4& v, float* f) {
  const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __half22float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}
}  // namespace fp16_gemv_detail

constexpr int GEMV_WARPS = 8;   // per CTA
constexpr int GEMV_R = 2;       // rows per warp
constexpr int GEMV_U = 4;       // chunks per row in flight per lane

// grid ceil(N / (GEMV_R * GEMV_WARPS)), block 32 * GEMV_WARPS
template <int M>
__global__ void __launch_bounds__(32 * GEMV_WARPS)
fp16_gemv(const __half* __restrict__ W, const __half* __restrict__ x, __half* __restrict__ y, int N, int K) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
  using namespace fp16_gemv_detail;
  constexpr int R = GEMV_R, U = GEMV_U;
  const int lane = threadIdx.x % 32;
  const int n0 = (blockIdx.x * GEMV_WARPS + threadIdx.x / 32) * R;
  if (n0 >= N) return;
  const int chunks = K / 8;
  const uint4* wr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) wr[r] = reinterpret_cast<const uint4*>(W + (long long)min(n0 + r, N - 1) * K);
  float acc[M][R];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;

  for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
    uint4 wv[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (c0 + 32 * u < chunks) wv[u][r] = load_stream(wr[r] + c0 + 32 * u);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c >= chunks) break;
      float wf[R][8];
#pragma unroll
      for (int r = 0; r < R; ++r) to_float8(wv[u][r], wf[r]);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float xf[8];
        to_float8(__ldg(reinterpret_cast<const uint4*>(x + (long long)m * K) + c), xf);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[m][r] = fmaf(xf[i], wf[r][i], acc[m][r]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float v = warp_sum(acc[m][r]);
      if (lane == 0 && n0 + r < N) y[(long long)m * N + n0 + r] = __float2half_rn(v);
    }
}
