// awq_mma.cu -- AWQ W4A16 matrix product on the tensor cores (mma.sync m16n8k16, fp16 in, fp32
// accumulate), weights dequantised in registers on their way from shared memory to the MMA.
//
//   y[m, n] = fp16( sum_k x[m, k] * w16[k, n] ),   w16 = fp16((q - z) * s)   (awq_common.cuh)
//
// Block: 4 warps, output tile (16*MT rows of x) x (64*NG columns), K walked in stages of 128 rows
// (32 per warp: the warps split K and meet in a shared-memory reduction at the end; for small M
// this keeps all 4 warps streaming weights instead of idling on a 16-row tile). K is also split
// across blocks (gridDim.z) when the tile grid alone cannot fill the SMs; the partials meet in
// an fp32 workspace, the last block of a tile sums them in order (awq_common.cuh).
//
// Why the tricks:
// * Pipeline: x, qweight, scales and zeros of a stage go to shared memory with cp.async
//   (16-byte copies; 4-byte ones for the zero words, and for qweight where N/8 % 4 != 0;
//   zero-filled past M, K, N); STAGES-1 stages (STAGES = 4, 3 at OCC >= 4) are in flight while
//   one is computed, so the weight stream overlaps the math. A stage carries one row of scales
//   and zeros per warp slice: G >= 32, so a warp's 32 rows lie in one group. x rows are padded
//   by 16 bytes so that ldmatrix.x4 (A fragments) is bank-conflict free; qweight rows are padded
//   to 8*NG+4 words, so the 4 rows 2t (t = lane%4) a warp reads in one LDS fall in distinct
//   banks.
// * No repacked weight: the MMA B fragment wants pairs of consecutive k for one column
//   (b0 = B[2t, 2t+1][g], g = lane/4) while a dequantised AWQ word gives pairs of consecutive
//   columns for one k. Each thread reads the words of rows 2t, 2t+1, 2t+8, 2t+9 of one column
//   word, dequantises them (LOP3, exact (q - z), one hmul2 by s) and a byte permute (prmt)
//   swaps the halves into k-pairs. The MMA's n index is free to mean any column, so n-tile i
//   (i = 0..7), MMA column g stands for output column 8 * (word0 + g) + i: a thread's 8 weights
//   of one word feed the same MMA column of 8 different n-tiles, and the accumulators come out
//   as 8 consecutive output columns per thread (one 16-byte store).
// * Dequantising in registers means the fp16 weight never exists in global memory.
#include "awq_common.cuh"

template <int MT, int NG, int OCC>
struct MmaCfg {
  static constexpr int THREADS = 128, WARPS = 4;
  static constexpr int BK = 128;                   // k rows per stage (32 per warp)
  static constexpr int BM = 16 * MT;
  static constexpr int WORDS = 8 * NG;             // column words per block (64*NG columns)
  static constexpr int A_LD = BK + 8;              // halves
  static constexpr int B_LD = WORDS + 4;           // words; == 4 (mod 16) when NG is even, 12 when odd
  static constexpr int A_BYTES = BM * A_LD * 2;
  static constexpr int B_BYTES = BK * B_LD * 4;
  static constexpr int S_BYTES = WARPS * WORDS * 16;
  static constexpr int Z_BYTES = WARPS * WORDS * 4;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES + S_BYTES + Z_BYTES;
  static constexpr int STAGES = OCC >= 4 ? 3 : 4;   // 4 resident blocks need a smaller pipeline
  static constexpr int SMEM = STAGE_BYTES * STAGES;
  static constexpr int RED_BYTES = (WARPS - 1) * MT * NG * 32 * 32 * 4;
  static_assert(RED_BYTES <= SMEM, "reduction buffer reuses the pipeline's shared memory");
};

// Four 8x8 b16 matrices, lanes 8i..8i+7 addressing the rows of matrix i; a[i] is this lane's part
// of matrix i. The caller has lanes 0-15 address rows 0-15 at k 0 and lanes 16-31 the same rows at
// k 8, so a[0..3] are the m16n8k16 A fragment (rows g / g + 8, k 2t.. / 2t + 8..).
__device__ __forceinline__ void ldmatrix_x4(unsigned* a, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(awq::smem_addr(p)));
}

// grid (ceil(M / (16*MT)), ceil(N/8 / (8*NG)), splits); rows_per_split a multiple of 32. The
// row tiles vary fastest, so the blocks that read the same weights run together and share L2.
// Dynamic shared memory: MmaCfg<MT, NG, OCC>::SMEM bytes. OCC = blocks per SM to fit (registers
// capped by __launch_bounds__; OCC >= 4 also shortens the pipeline to 3 stages to fit the smem).
template <int MT, int NG, int OCC>
__global__ void __launch_bounds__(128, OCC)
awq_mma_kernel(const half* __restrict__ x, const unsigned* __restrict__ qweight,
               const unsigned* __restrict__ qzeros, const half* __restrict__ scales,
               half* __restrict__ y, float* __restrict__ ws, unsigned* __restrict__ counters,
               int M, int K, int N, int G, int rows_per_split) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
  using C = MmaCfg<MT, NG, OCC>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int last_flag;
  const int n8 = N / 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int col0 = blockIdx.y * C::WORDS;
  const int m0 = blockIdx.x * C::BM;
  const int splits = gridDim.z;
  const int k_begin = blockIdx.z * rows_per_split;
  const int k_end = min(K, k_begin + rows_per_split);
  const int n_stages = k_begin < k_end ? (k_end - k_begin + C::BK - 1) / C::BK : 0;
  const bool vec16 = (n8 % 4) == 0;

  auto stage_a = [&](int b) { return reinterpret_cast<half*>(smem + b * C::STAGE_BYTES); };
  auto stage_b = [&](int b) { return reinterpret_cast<unsigned*>(smem + b * C::STAGE_BYTES + C::A_BYTES); };
  auto stage_s = [&](int b) { return reinterpret_cast<half*>(smem + b * C::STAGE_BYTES + C::A_BYTES + C::B_BYTES); };
  auto stage_z = [&](int b) {
    return reinterpret_cast<unsigned*>(smem + b * C::STAGE_BYTES + C::A_BYTES + C::B_BYTES + C::S_BYTES);
  };

  auto load_stage = [&](int st, int buf) {
    const int k0 = k_begin + st * C::BK;
    half* A = stage_a(buf);
    for (int i = threadIdx.x; i < C::BM * (C::BK / 8); i += C::THREADS) {
      int r = i / (C::BK / 8), c = (i % (C::BK / 8)) * 8;
      bool ok = (m0 + r < M) && (k0 + c < k_end);
      awq::cp_async16(A + r * C::A_LD + c, ok ? x + (size_t)(m0 + r) * K + k0 + c : x, ok);
    }
    awq::load_words<C::BK, C::WORDS, C::THREADS>(stage_b(buf), C::B_LD, qweight, n8, k0, k_end, col0,
                                                 n8, vec16);
    half* S = stage_s(buf);
    unsigned* Z = stage_z(buf);
    for (int i = threadIdx.x; i < 2 * C::WARPS * C::WORDS; i += C::THREADS) {
      int j = i % (C::WARPS * C::WORDS), w = j / C::WORDS, c = j % C::WORDS;
      int kw = k0 + 32 * w;                  // the warp slice's group
      bool ok = (kw < k_end) && (col0 + c < n8);
      int grp = kw / G;
      if (i < C::WARPS * C::WORDS)
        awq::cp_async16(S + 8 * j, ok ? scales + (size_t)grp * N + 8 * (col0 + c) : scales, ok);
      else
        awq::cp_async4(Z + j, ok ? qzeros + (size_t)grp * n8 + col0 + c : qzeros, ok);
    }
  };

  float acc[MT][NG][8][4];
#pragma unroll
  for (int a = 0; a < MT; ++a)
#pragma unroll
    for (int b = 0; b < NG; ++b)
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[a][b][i][e] = 0.f;

#pragma unroll
  for (int st = 0; st < C::STAGES - 1; ++st) {
    if (st < n_stages) load_stage(st, st);
    awq::cp_async_commit();
  }
  for (int st = 0; st < n_stages; ++st) {
    awq::cp_async_wait<C::STAGES - 2>();
    __syncthreads();
    if (st + C::STAGES - 1 < n_stages) load_stage(st + C::STAGES - 1, (st + C::STAGES - 1) % C::STAGES);
    awq::cp_async_commit();

    const int buf = st % C::STAGES;
    if (k_begin + st * C::BK + 32 * warp >= k_end) continue;   // this warp's slice is past K
    const half* A = stage_a(buf);
    const unsigned* B = stage_b(buf) + 32 * warp * C::B_LD;
    const half* S = stage_s(buf) + warp * C::WORDS * 8;
    const unsigned* Z = stage_z(buf) + warp * C::WORDS;
    half2 s[NG][4];
    awq::Zeros z[NG];
#pragma unroll
    for (int j = 0; j < NG; ++j) {
      const uint4 sv = *reinterpret_cast<const uint4*>(S + 8 * (g + 8 * j));
      s[j][0] = awq::as_h2(sv.x); s[j][1] = awq::as_h2(sv.y);
      s[j][2] = awq::as_h2(sv.z); s[j][3] = awq::as_h2(sv.w);
      z[j] = awq::make_zeros(Z[g + 8 * j]);
    }
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      unsigned a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldmatrix_x4(a[mt], A + (16 * mt + (lane & 15)) * C::A_LD + 32 * warp + 16 * kk + (lane >> 4) * 8);
#pragma unroll
      for (int j = 0; j < NG; ++j) {
        const unsigned* Bw = B + (16 * kk + 2 * t) * C::B_LD + g + 8 * j;
        half2 d0[4], d1[4], d2[4], d3[4];
        awq::dequant8(Bw[0], z[j], s[j], d0);
        awq::dequant8(Bw[C::B_LD], z[j], s[j], d1);
        awq::dequant8(Bw[8 * C::B_LD], z[j], s[j], d2);
        awq::dequant8(Bw[9 * C::B_LD], z[j], s[j], d3);
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          // k-pairs (row 2t, 2t+1) and (2t+8, 2t+9) of columns 2p (low halves) and 2p+1 (high)
          const unsigned lo0 = __byte_perm(awq::as_u32(d0[p]), awq::as_u32(d1[p]), 0x5410);
          const unsigned lo1 = __byte_perm(awq::as_u32(d2[p]), awq::as_u32(d3[p]), 0x5410);
          const unsigned hi0 = __byte_perm(awq::as_u32(d0[p]), awq::as_u32(d1[p]), 0x7632);
          const unsigned hi1 = __byte_perm(awq::as_u32(d2[p]), awq::as_u32(d3[p]), 0x7632);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            awq::mma16816(acc[mt][j][2 * p], a[mt], lo0, lo1);
            awq::mma16816(acc[mt][j][2 * p + 1], a[mt], hi0, hi1);
          }
        }
      }
    }
  }
  awq::cp_async_wait<0>();
  __syncthreads();

  // reduce the 4 warps' K slices in a fixed order; warp 0 finishes the tile
  float* red = reinterpret_cast<float*>(smem);
  constexpr int NV = MT * NG * 32;
  if (warp > 0) {
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
      for (int b = 0; b < NG; ++b)
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            red[((warp - 1) * NV + ((a * NG + b) * 8 + i) * 4 + e) * 32 + lane] = acc[a][b][i][e];
  }
  __syncthreads();
  const size_t tile = blockIdx.x + (size_t)gridDim.x * blockIdx.y;
  if (warp == 0) {
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
      for (int b = 0; b < NG; ++b)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float v[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            v[i] = acc[a][b][i][e];
#pragma unroll
            for (int w = 0; w < C::WARPS - 1; ++w) v[i] += red[(w * NV + ((a * NG + b) * 8 + i) * 4 + e) * 32 + lane];
          }
          const int row = m0 + 16 * a + g + 8 * (e >> 1);
          const int cw = col0 + 8 * b + 2 * t + (e & 1);
          if (row < M && cw < n8) {
            if (splits == 1) awq::store8_half(y + (size_t)row * N + 8 * cw, v);
            else awq::store8_float(ws + ((size_t)blockIdx.z * M + row) * N + 8 * cw, v);
          }
        }
  }
  if (splits == 1) return;
  if (!awq::last_block_of_tile(counters + tile, splits, &last_flag)) return;
  // the last block: sum the partials of its tile in split order (all 128 threads)
  for (int i = threadIdx.x; i < C::BM * C::WORDS; i += C::THREADS) {
    const int row = m0 + i / C::WORDS, cw = col0 + i % C::WORDS;
    if (row < M && cw < n8) {
      float v[8];
      awq::sum8_partials(v, ws + (size_t)row * N + 8 * cw, (size_t)M * N, splits);
      awq::store8_half(y + (size_t)row * N + 8 * cw, v);
    }
  }
}
