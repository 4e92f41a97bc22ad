// awq_small.cu -- AWQ W4A16 for few rows of x (M <= 16: decode and small batches) on the tensor
// cores, weights streamed through a small per-warp shared-memory ring, no fp16 weight formed.
//
//   y[m, n] = fp16( sum_g  s[g, n] * sum_{k in g} (q[k, n] - z[g, n]) * x[m, k] )
//
// The inner sum is formed exactly per product and accumulated in fp32 over one group; the scale
// is applied once per group to that fp32 partial (acc += s * partial). No weight is ever rounded
// to fp16, so this is more accurate than fp16((q - z) * s) (awq_mma.cu); its emulation is
// reference/awq_fp16.py::emulate_group_scaled (exact math plus an fp32-order bound).
//
// Why the tricks:
// * Roles swapped: the weight is the MMA's A operand (16 "rows" = 16 output columns x 16 k) and
//   x the B operand (16 k x 8 batch rows), C = 16 columns x 8 batch rows. With M <= 8 one
//   m16n8k16 does 256 weights; with the usual roles (x as A) 15/16 of a 16-row tile would be
//   padding at M = 1, here 7/8 of the n8 side is (and it is the cheap side). M = 9..16: MB = 2.
// * k pairs before unpacking. The A fragment wants, per register, two consecutive k of ONE
//   column (a0 = A[g][2t, 2t+1]); an AWQ word holds 8 columns of one k. A thread loads the words
//   of rows 2t, 2t+1, 2t+8, 2t+9 of its column word; one byte permute of the words of rows k and
//   k+1, prmt(w0, w1, 0x5410) = [w0.b0 w0.b1 w1.b0 w1.b1], puts row k in the low half and row
//   k+1 in the high half, so each mask below yields a k-pair of one column directly:
//      r & 0x000f000f -> column 0 (slot 0), r & 0x00f000f0 -> column 2 (slot 1),
//      (r >> 8) & ... -> columns 4 and 6;  prmt(.., 0x7632) likewise gives columns 1 3 5 7.
//   2 PRMT + 2 SHF + 8 LOP per 16 weights, no shuffle after the unpack (awq_mma.cu needs 4 PRMT
//   per 8 weights to turn column pairs into k pairs).
// * No magic number, no subtraction (MODE 0): a masked nibble read as a half is a subnormal,
//   q * 2^-24 (low mask) or 16 q * 2^-24 = q * 2^-20 (high mask) -- exact, and the tensor cores
//   multiply fp16 subnormals exactly (tests/test_awq_small_gpu.py checks it). The zero point
//   leaves the inner loop: per group
//      sum_k (q - z) x_k = sum_k q x_k - z * sum_k x_k,
//   and sum_k x_k (one per batch row, shared by every column) comes from one extra MMA with an
//   all-ones A. The per-group fix-up is two fp32 FMAs per accumulator:
//      acc += s * (P - z' * Sx)   (z' = z * 2^-24 or 2^-20, from the zero word by the same masks)
//   and the power of two is taken off once at the end. 6 ALU instructions per packed word.
//   MODE 1 is the exact-subtraction variant (magic 0x64006400 + hsub2 / hfma2 -> q - z in the
//   A operand; 10 per word): kept to measure against, and as the fallback if a GPU ever flushed
//   subnormal MMA inputs.
// * Memory: each warp owns a ring of D shared-memory stages filled with cp.async.cg (16-byte
//   copies, L1 bypassed; 4-byte cp.async.ca where N/8 % 4 != 0 leaves rows unaligned): D-1
//   k-steps of 16 rows in flight per warp at no register cost, synchronised with
//   cp.async.wait_group + __syncwarp only (no block barrier in the main loop).
//   (A first version kept D k-steps of ld.global.nc in registers and ran out of registers at
//   ~32 KB in flight per SM; the rings of one block take 40-96 KB in the SMALL_CFGS
//   configurations. Measured on the H100: no faster by itself, bytes in flight were not the
//   limit -- bench/notes-awq.md.) Stage rows are padded to 8*NW+4
//   words so that one LDS of rows 2t.. / words NW g.. is conflict-free.
//   The stage also carries the step's x slice (8*MB rows x 16 k). Reading x fragments from global
//   memory one step ahead stalled every warp on an L2 round trip per step (12288->4096, M = 8:
//   21.6 us from global, 18.6 us from the stage; M = 1: 16.5 us).
// * Grid: block = WARPS warps: CW side by side along N (8*NW column words each), WARPS/CW
//   slices of the block's K range; the slices meet in shared memory (fixed order), and K is
//   split across blocks (gridDim.y) to fill the SMs; the split partials meet in an fp32
//   workspace, summed in split order by the tile's last block (awq_common.cuh): deterministic,
//   one launch, graph-replayable.
#include "awq_common.cuh"

namespace awq_small {

__device__ __forceinline__ unsigned and_mask(unsigned a, unsigned m) { return a & m; }

// The 16 A registers (4 MMA tiles) of one column word from its 4 rows 2t, 2t+1, 2t+8, 2t+9.
// Tile i covers columns (ca[i], cb[i]) = (0,1) (4,5) (2,3) (6,7): rows g and g+8 of the MMA.
// MODE 0: subnormal nibbles (tiles 0,1 in units of 2^-24, tiles 2,3 in 2^-20).
// MODE 1: exact q - z via the magic number (zl: 1024 + z, zh: -(64 + z), per column, both lanes).
template <int MODE>
__device__ __forceinline__ void unpack_a(const unsigned* w, unsigned (&a)[4][4], const half2* zl,
                                         const half2* zh) {
  const unsigned p0 = __byte_perm(w[0], w[1], 0x5410), p1 = __byte_perm(w[0], w[1], 0x7632);
  const unsigned p2 = __byte_perm(w[2], w[3], 0x5410), p3 = __byte_perm(w[2], w[3], 0x7632);
  const unsigned src[4][4] = {{p0, p1, p2, p3}, {p0 >> 8, p1 >> 8, p2 >> 8, p3 >> 8},
                              {p0, p1, p2, p3}, {p0 >> 8, p1 >> 8, p2 >> 8, p3 >> 8}};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      if (MODE == 0) {
        a[i][r] = and_mask(src[i][r], i < 2 ? awq::kLowMask : awq::kHighMask);
      } else {
        // column of register r: rows g (r = 0, 2) -> ca[i], rows g+8 (r = 1, 3) -> cb[i]
        const int col = (r & 1) ? (i == 0 ? 1 : i == 1 ? 5 : i == 2 ? 3 : 7)
                                : (i == 0 ? 0 : i == 1 ? 4 : i == 2 ? 2 : 6);
        if (i < 2) {
          a[i][r] = awq::as_u32(__hsub2(awq::as_h2(awq::lop3_and_or(src[i][r], awq::kLowMask, awq::kMagic)),
                                        zl[col]));
        } else {
          a[i][r] = awq::as_u32(__hfma2(awq::as_h2(awq::lop3_and_or(src[i][r], awq::kHighMask, awq::kMagic)),
                                        awq::as_h2(0x2c002c00u), zh[col]));
        }
      }
    }
  }
}

}  // namespace awq_small

// Shared memory ring of one warp: D stages of 16 rows x RS words (8*NW words used; padded so
// that the LDS of rows 2t (t = 0..3) x words NW g.. fall in distinct banks).
template <int MB, int NW, int D>
struct SmallRing {
  static constexpr int RS = 8 * NW + 4;
  static constexpr int X_OFF = 16 * RS;                 // then x: 8*MB rows x 16 halves (8 words)
  static constexpr int STAGE_WORDS = 16 * RS + 64 * MB;
  static constexpr int WARP_BYTES = D * STAGE_WORDS * 4;
};

// grid (ceil(N/8 / (8*NW*CW)), splits); block 32*WARPS threads = CW warps side by side along N
// (each 8*NW column words; the block then reads CW x 32 NW contiguous bytes of a row at once
// instead of 32 NW -- SMALL_CFGS has one CW = 4 entry, for sweeps: dispatch's configs all take
// CW = 1) x WARPS/CW slices of the block's K range; dynamic shared memory
// max(WARPS * SmallRing::WARP_BYTES, WARPS * M * 64*NW * 4). rows_per_split: a multiple of 16.
// MB = 1 (M <= 8) or 2 (M <= 16). D: stages of the per-warp cp.async ring (D-1 k-steps of 16
// rows in flight per warp while one is computed).
template <int MB, int NW, int WARPS, int CW, int MODE, int D>
__global__ void __launch_bounds__(32 * WARPS)
awq_small_kernel(const half* __restrict__ x, const unsigned* __restrict__ qweight,
                 const unsigned* __restrict__ qzeros, const half* __restrict__ scales,
                 half* __restrict__ y, float* __restrict__ ws, unsigned* __restrict__ counters,
                 int M, int K, int N, int G, int rows_per_split) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
  using namespace awq_small;
  using R = SmallRing<MB, NW, D>;
  constexpr int TW = 8 * NW;          // column words per warp tile
  constexpr int TC = 8 * TW;          // columns per warp tile
  constexpr int KS = WARPS / CW;      // k slices per block (CW warps side by side along N)
  constexpr int BW = CW * TW;         // column words per block tile
  constexpr int BC = 8 * BW;          // columns per block tile
  static_assert(WARPS % CW == 0, "CW must divide WARPS");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* red = reinterpret_cast<float*>(smem_raw);   // [KS][M][BC], after the main loop
  __shared__ int last_flag;
  const int n8 = N / 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wn = warp % CW, wk = warp / CW;     // column slot and k slice of this warp
  const int blk_w0 = blockIdx.x * BW;
  const int tile_w0 = blk_w0 + wn * TW;
  const int cw0 = tile_w0 + NW * g;   // this thread's first column word
  const bool vec = (n8 % 4) == 0;     // 16-byte copies need 16-byte row strides
  bool cw_ok[NW];
#pragma unroll
  for (int j = 0; j < NW; ++j) cw_ok[j] = cw0 + j < n8;
  const int splits = gridDim.y;
  const int2 range = awq::slice_steps<16>(K, rows_per_split, wk, KS);
  const int s0 = range.x, s1 = range.y;   // this warp's k-steps [s0, s1)
  const int steps_per_group = G / 16;

  // ---- per-warp cp.async ring: stage of step s = 16 rows from row 16 s, words tile_w0..+TW,
  // in slot (s - s0) % D. Steps are issued in order into slots 0, 1, .., D-1, 0, .. and read in
  // the same order, and what a lane copies moves by 16 rows per step, so the loop only advances
  // running addresses: per chunk a global pointer (+16 rows) and a shared address (+1 stage,
  // wrapping). They are loop-carried on purpose. Offsets worked out once before the loop were
  // rematerialised by ptxas from threadIdx on every trip (S2R + ~60 integer instructions per
  // k-step in the SASS, about 40 % of the loop); a value the loop updates cannot be.
  unsigned* ring = reinterpret_cast<unsigned*>(smem_raw + warp * R::WARP_BYTES);
  const unsigned ring_sa = awq::smem_addr(ring);
  constexpr unsigned SB = 4u * R::STAGE_WORDS;   // bytes per stage
  constexpr int VCH = (16 * 2 * NW) / 32;        // 16-byte weight chunks per lane and step
  static_assert((16 * 2 * NW) % 32 == 0, "16 rows x 2*NW chunks must split evenly over the lanes");
  const size_t step_words = (size_t)16 * n8;
  // A zero-filled chunk (columns past N, x rows past M) copies 0 bytes; its source still walks
  // a valid row (the row's last 16 bytes, x row 0) so every pointer advances unconditionally.
  // (Only the vec path reads v_src, where n8 % 4 == 0; the max keeps the pointer inside the row
  // when N < 32 too, which forming it out of range would not be.)
  const unsigned* v_src[VCH];   // next step's source of chunk j
  unsigned v_at[VCH];           // its shared address in the next write slot
  bool v_ok[VCH];               // the chunk's columns exist (else zero-filled)
#pragma unroll
  for (int j = 0; j < VCH; ++j) {
    const int c = lane + 32 * j, r = c / (2 * NW), q4 = 4 * (c % (2 * NW));
    v_ok[j] = tile_w0 + q4 < n8;
    v_src[j] = qweight + (size_t)(16 * s0 + r) * n8 + (v_ok[j] ? tile_w0 + q4 : max(n8 - 4, 0));
    v_at[j] = ring_sa + 4u * (r * R::RS + q4);
  }
  // x rows 0..8*MB-1 of the step's 16 k (lanes < 16*MB, two 16-byte halves a row); rows >= M
  // zero-filled
  const bool x_lane = lane < 16 * MB, x_ok = x_lane && (lane >> 1) < M;
  const half* x_src = x + (size_t)(x_ok ? lane >> 1 : 0) * K + 8 * (lane & 1) + 16 * s0;
  unsigned x_at = ring_sa + 4u * (R::X_OFF + 8 * (lane >> 1) + 4 * (lane & 1));
  int issue_s = s0, issue_slot = 0;   // next step to issue and its slot
  auto issue_step = [&]() {
    if (issue_s < s1) {
      if (x_lane) awq::cp_async16_at(x_at, x_src, x_ok);
      if (vec) {
#pragma unroll
        for (int j = 0; j < VCH; ++j) awq::cp_async16_at(v_at[j], v_src[j], v_ok[j]);
      } else {   // N/8 % 4 != 0: rows are not 16-byte aligned, copy single words
        const unsigned* src = qweight + (size_t)(16 * issue_s) * n8 + tile_w0;
        unsigned* dp = ring + issue_slot * R::STAGE_WORDS;
#pragma unroll
        for (int c = lane; c < 16 * TW; c += 32) {
          const int r = c / TW, q = c % TW;
          const bool ok = tile_w0 + q < n8;
          awq::cp_async4(dp + r * R::RS + q, ok ? src + (size_t)r * n8 + q : qweight, ok);
        }
      }
    }
    awq::cp_async_commit();   // one group per step, empty past the range: the count stays fixed
    const bool wrap = ++issue_slot == D;
    if (wrap) issue_slot = 0;
    const unsigned dsa = wrap ? 0u - (D - 1) * SB : SB;
    ++issue_s;
    x_at += dsa;
    x_src += 16;
#pragma unroll
    for (int j = 0; j < VCH; ++j) {
      v_at[j] += dsa;
      v_src[j] += step_words;
    }
  };

  float acc[NW][4][MB][4];
  float part[NW][4][MB][4];
  float sx[MB][4];
#pragma unroll
  for (int j = 0; j < NW; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][i][mb][e] = part[j][i][mb][e] = 0.f;
#pragma unroll
  for (int mb = 0; mb < MB; ++mb)
#pragma unroll
    for (int e = 0; e < 4; ++e) sx[mb][e] = 0.f;

  // per-group scale and zero words of this thread's columns (loaded for the group of step s)
  uint4 sv[NW];
  unsigned zv[NW];
  auto load_group = [&](int s) {
    const int grp = (16 * s) / G;
#pragma unroll
    for (int j = 0; j < NW; ++j) {
      const bool ok = cw_ok[j] && s < s1;
      sv[j] = ok ? __ldg(reinterpret_cast<const uint4*>(scales + (size_t)grp * N + 8 * (cw0 + j)))
                 : make_uint4(0u, 0u, 0u, 0u);
      zv[j] = ok ? __ldg(qzeros + (size_t)grp * n8 + cw0 + j) : 0u;
    }
  };

  // MODE 1: (1024 + z) and -(64 + z) per column, both lanes
  half2 zl[NW][8], zh[NW][8];
  auto make_mode1_zeros = [&]() {
    if (MODE == 1) {
#pragma unroll
      for (int j = 0; j < NW; ++j) {
        const awq::Zeros zz = awq::make_zeros(zv[j]);
        // zz.lo[0] = (1024+z0, 1024+z1), zz.lo[1] = (z4, z5); zz.hi[0] = -(64+z2, 64+z3), hi[1]: z6, z7
        zl[j][0] = __low2half2(zz.lo[0]); zl[j][1] = __high2half2(zz.lo[0]);
        zl[j][4] = __low2half2(zz.lo[1]); zl[j][5] = __high2half2(zz.lo[1]);
        zh[j][2] = __low2half2(zz.hi[0]); zh[j][3] = __high2half2(zz.hi[0]);
        zh[j][6] = __low2half2(zz.hi[1]); zh[j][7] = __high2half2(zz.hi[1]);
        zl[j][2] = zl[j][3] = zl[j][6] = zl[j][7] = zl[j][0];
        zh[j][0] = zh[j][1] = zh[j][4] = zh[j][5] = zh[j][2];
      }
    }
  };

  // acc += s * (part - z' * sx), then clear the group's partials
  auto flush_group = [&]() {
#pragma unroll
    for (int j = 0; j < NW; ++j) {
      float sf[8], zf[8];
      const unsigned su[4] = {sv[j].x, sv[j].y, sv[j].z, sv[j].w};
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const float2 f = __half22float2(awq::as_h2(su[p]));
        sf[2 * p] = f.x; sf[2 * p + 1] = f.y;
      }
      if (MODE == 0) {
        const unsigned zs = zv[j] >> 8;
        const float2 z01 = __half22float2(awq::as_h2(zv[j] & awq::kLowMask));
        const float2 z23 = __half22float2(awq::as_h2(zv[j] & awq::kHighMask));
        const float2 z45 = __half22float2(awq::as_h2(zs & awq::kLowMask));
        const float2 z67 = __half22float2(awq::as_h2(zs & awq::kHighMask));
        zf[0] = z01.x; zf[1] = z01.y; zf[2] = z23.x; zf[3] = z23.y;
        zf[4] = z45.x; zf[5] = z45.y; zf[6] = z67.x; zf[7] = z67.y;
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int ca = i == 0 ? 0 : i == 1 ? 4 : i == 2 ? 2 : 6;
        const int cb = ca + 1;
#pragma unroll
        for (int mb = 0; mb < MB; ++mb)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = e < 2 ? ca : cb;
            float v = part[j][i][mb][e];
            if (MODE == 0) v = fmaf(-zf[c], sx[mb][e & 1], v);
            acc[j][i][mb][e] = fmaf(sf[c], v, acc[j][i][mb][e]);
            part[j][i][mb][e] = 0.f;
          }
      }
    }
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
      for (int e = 0; e < 4; ++e) sx[mb][e] = 0.f;
  };

  const unsigned ones[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
  // this lane's fragment addresses in the read slot (loop-carried like the copy state):
  // words of rows 2t (+1, +8, +9) x column words NW g.., and x[row g][k 2t, 2t+1]
  unsigned rd_w = ring_sa + 4u * (2 * t * R::RS + NW * g);
  unsigned rd_x = ring_sa + 4u * (R::X_OFF + 8 * g + t);
  if (s0 < s1) {
    load_group(s0);
    make_mode1_zeros();
#pragma unroll
    for (int d = 0; d < D - 1; ++d) issue_step();
    int left_in_group = steps_per_group - (s0 % steps_per_group);
    int read_slot = 0;
    for (int st = s0; st < s1; ++st) {
      awq::cp_async_wait<D - 2>();   // this lane's copies of step st have landed ...
      __syncwarp();                  // ... and every lane's; the slot of step st - 1 is free again
      issue_step();                  // step st + D - 1 into that slot
      unsigned xb[MB][2];   // B fragments: x[row 8 mb + g][k 2t, 2t+1] and [k 2t+8, 2t+9]
#pragma unroll
      for (int mb = 0; mb < MB; ++mb) {
        xb[mb][0] = awq::lds32(rd_x + 4u * 64 * mb);
        xb[mb][1] = awq::lds32(rd_x + 4u * (64 * mb + 4));
      }
      unsigned wv[NW][4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const unsigned a = rd_w + 4u * ((r & 1) + 8 * (r >> 1)) * R::RS;
        if (NW == 2) {
          const uint2 v = awq::lds64(a);
          wv[0][r] = v.x;
          wv[NW - 1][r] = v.y;
        } else {
          wv[0][r] = awq::lds32(a);
        }
      }
      if (MODE == 0) {
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) awq::mma16816(sx[mb], ones, xb[mb][0], xb[mb][1]);
      }
#pragma unroll
      for (int j = 0; j < NW; ++j) {
        unsigned a[4][4];
        unpack_a<MODE>(wv[j], a, zl[j], zh[j]);
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int mb = 0; mb < MB; ++mb) awq::mma16816(part[j][i][mb], a[i], xb[mb][0], xb[mb][1]);
      }
      const bool wrap = ++read_slot == D;
      if (wrap) read_slot = 0;
      const unsigned dsa = wrap ? 0u - (D - 1) * SB : SB;
      rd_w += dsa;
      rd_x += dsa;
      if (--left_in_group == 0 || st + 1 == s1) {   // group ends (or the warp's range does)
        flush_group();
        left_in_group = steps_per_group;
        if (st + 1 < s1) {
          load_group(st + 1);
          make_mode1_zeros();
        }
      }
    }
  }
  awq::cp_async_wait<0>();
  __syncthreads();   // the rings are dead: their shared memory becomes the reduction buffer

  // ---- the warps of the block meet in shared memory: red[k slice wk][b][column in the block tile]
  const float unit[4] = {MODE == 0 ? 16777216.f : 1.f, MODE == 0 ? 16777216.f : 1.f,
                         MODE == 0 ? 1048576.f : 1.f, MODE == 0 ? 1048576.f : 1.f};
#pragma unroll
  for (int j = 0; j < NW; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int ca = i == 0 ? 0 : i == 1 ? 4 : i == 2 ? 2 : 6;
#pragma unroll
      for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int b = 8 * mb + 2 * t + (e & 1);
          const int col = 8 * (NW * g + j) + ca + (e >> 1);
          if (b < M) red[((size_t)wk * M + b) * BC + wn * TC + col] = acc[j][i][mb][e] * unit[i];
        }
    }
  __syncthreads();
  const int tasks = M * BW;   // (row, column word) pairs of the block tile, 8 columns each
  for (int task = threadIdx.x; task < tasks; task += 32 * WARPS) {
    const int b = task / BW, cwl = task % BW, cw = blk_w0 + cwl;
    if (cw >= n8) continue;
    float v[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) v[c] = 0.f;
#pragma unroll
    for (int w = 0; w < KS; ++w) {
      const float4* p = reinterpret_cast<const float4*>(red + ((size_t)w * M + b) * BC + 8 * cwl);
      const float4 u0 = p[0], u1 = p[1];
      v[0] += u0.x; v[1] += u0.y; v[2] += u0.z; v[3] += u0.w;
      v[4] += u1.x; v[5] += u1.y; v[6] += u1.z; v[7] += u1.w;
    }
    if (splits == 1) awq::store8_half(y + (size_t)b * N + 8 * cw, v);
    else awq::store8_float(ws + ((size_t)blockIdx.y * M + b) * N + 8 * cw, v);
  }
  if (splits == 1) return;
  if (!awq::last_block_of_tile(counters + blockIdx.x, splits, &last_flag)) return;
  for (int task = threadIdx.x; task < tasks; task += 32 * WARPS) {
    const int b = task / BW, cw = blk_w0 + task % BW;
    if (cw >= n8) continue;
    float v[8];
    awq::sum8_partials(v, ws + (size_t)b * N + 8 * cw, (size_t)M * N, splits);
    awq::store8_half(y + (size_t)b * N + 8 * cw, v);
  }
}
