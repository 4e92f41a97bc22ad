// awq_tile.cu -- AWQ W4A16 GEMM for mid-size M (tens to hundreds of rows of x): each k-stage of
// the weight tile is dequantised ONCE into shared memory as fp16, and all 8 warps of the block
// then run a plain ldmatrix + mma.sync m16n8k16 loop over it (fp16 in, fp32 accumulate).
//
//   y[m, n] = fp16( sum_k x[m, k] * w16[k, n] ),   w16 = fp16((q - z) * s)   (awq_common.cuh)
//
// The same function as awq_mma.cu and dequant + cuBLAS (reference.awq_fp16.emulate), in another
// order of fp32 sums.
//
// Why this shape (against awq_mma.cu, which dequantises in each warp's registers):
// * Dequantise once per block, not once per warp. Block tile BM rows x 128 columns, warps 2 x 4
//   (each BM/2 rows x 32 columns). In awq_mma.cu every warp unpacks the B fragments it
//   multiplies, so at M >= 32 the ALU work per weight grows with the warps that share it and the
//   LOP3 / hfma2 / prmt chain sits between the weight load and every MMA; 4 warps per block then
//   leave the tensor cores idle (~170 TFLOP/s at best, bench/notes-awq.md). Here a stage of
//   64 k x 128 columns (1024 words) is unpacked by the 256 threads (4 words each, one 16-byte
//   store per word) and read back through ldmatrix by every warp that needs it.
// * No byte permutes: the fp16 tile is stored [k][n] (n contiguous, as a dequantised word comes
//   out), and ldmatrix.trans hands each thread the k-pairs of one column the MMA B fragment
//   wants -- the transposition happens in the load, not in ALU instructions.
// * Overlap: two fp16 tiles. While the warps multiply stage s out of tile s % 2, the same warps
//   unpack stage s + 1 into the other tile (independent instructions, so the scheduler
//   interleaves the ALU work with the MMAs), and cp.async keeps STAGES - 2 more raw stages
//   (x rows and packed words) in flight. One __syncthreads per stage.
// * Conflict-free shared memory: x rows padded to 72 halves (144 B) and fp16 tile rows to 136
//   halves (272 B): the 8 row addresses of an ldmatrix 8x8 matrix fall in 8 distinct 16-byte
//   bank groups. The packed rows are 16 words with no padding: a warp's 32 word loads are two
//   whole rows, 128 contiguous bytes.
// * Tails: x rows past M, k rows past the split and words past N are zero-filled by cp.async;
//   their fp16 weights are written as zeros (never read from scales / zeros out of range).
// * Split-K across blocks (gridDim.z) when the tiles alone cannot fill the SMs, through the fp32
//   workspace and the deterministic last-block sum of awq_common.cuh.
#include "awq_common.cuh"

namespace awq_tile {

constexpr int BN = 128, WORDS = 16, BK = 64, THREADS = 256;
constexpr int X_LD = BK + 8;      // halves
constexpr int W_LD = BN + 8;      // halves
constexpr int RED_LD = BN + 4;    // floats

template <int BM, int STAGES>
struct Cfg {
  static constexpr int MT = BM / 32;                  // m16 tiles per warp (warps 2 x 4)
  static constexpr int X_BYTES = BM * X_LD * 2;
  static constexpr int R_BYTES = BK * WORDS * 4;
  static constexpr int STAGE_BYTES = X_BYTES + R_BYTES;
  static constexpr int W_BYTES = BK * W_LD * 2;
  static constexpr int SMEM = STAGES * STAGE_BYTES + 2 * W_BYTES;
  static_assert(BM % 32 == 0 && BM <= 128, "BM: 32, 64, 96 or 128");
  static_assert(BM * RED_LD * 4 <= SMEM, "the epilogue reuses the pipeline's shared memory");
};

__device__ __forceinline__ void ldmatrix_x4(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace awq_tile

// grid (ceil(M / BM), ceil(N/8 / 16), splits), 256 threads; rows_per_split a multiple of 64;
// G a power of two >= 32. Dynamic shared memory Cfg<BM, STAGES>::SMEM. Row tiles vary fastest,
// so the blocks that unpack the same packed words run together and find them in L2.
template <int BM, int STAGES>
__global__ void __launch_bounds__(awq_tile::THREADS, 2)
awq_tile_kernel(const half* __restrict__ x, const unsigned* __restrict__ qweight,
                const unsigned* __restrict__ qzeros, const half* __restrict__ scales,
                half* __restrict__ y, float* __restrict__ ws, unsigned* __restrict__ counters,
                int M, int K, int N, int G, int rows_per_split) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
  using namespace awq_tile;
  using C = Cfg<BM, STAGES>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int last_flag;
  const int n8 = N / 8;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp >> 2, wn = warp & 3;          // warp grid 2 (rows) x 4 (columns)
  const int m0 = blockIdx.x * BM;
  const int col0 = blockIdx.y * WORDS;              // first column word of the block
  const int splits = gridDim.z;
  const int k_begin = blockIdx.z * rows_per_split;
  const int k_end = min(K, k_begin + rows_per_split);
  const int n_stages = k_begin < k_end ? (k_end - k_begin + BK - 1) / BK : 0;
  const int gshift = __ffs(G) - 1;
  const unsigned smem0 = awq::smem_addr(smem);
  const unsigned w_tiles = smem0 + STAGES * C::STAGE_BYTES;   // the two fp16 tiles

  // ---- copy plan, worked out once (a stage only moves the sources by 64 k and picks a slot):
  // x: chunk j of this thread = row (tid / 8) + 32 j, halves 8 (tid % 8) .. +7 of the stage's 64 k
  constexpr int XC = BM / 32;
  const int xc = 8 * (tid & 7);
  const half* x_src[XC];
  bool x_ok[XC];
#pragma unroll
  for (int j = 0; j < XC; ++j) {
    const int r = (tid >> 3) + 32 * j;
    x_ok[j] = m0 + r < M;
    x_src[j] = x_ok[j] ? x + (size_t)(m0 + r) * K + xc : x;
  }
  const unsigned x_dst = 2u * ((tid >> 3) * X_LD + xc);
  // packed words (N/8 % 4 == 0): row tid / 4, words 4 (tid % 4) .. +3 -- one 16-byte copy each
  const bool vec16 = (n8 % 4) == 0;
  const int pr = tid >> 2, pc = 4 * (tid & 3);
  const bool p_ok = col0 + pc < n8;
  const unsigned* p_src = qweight + (size_t)pr * n8 + col0 + pc;
  const unsigned p_dst = C::X_BYTES + 4u * (pr * WORDS + pc);

  auto load_stage = [&](int st) {
    if (st < n_stages) {
      const int slot = st % STAGES, k0 = k_begin + st * BK;
      const unsigned base = smem0 + slot * C::STAGE_BYTES;
      const bool k_ok = k0 + xc < k_end;
#pragma unroll
      for (int j = 0; j < XC; ++j)
        awq::cp_async16_at(base + x_dst + 2u * 32 * X_LD * j, x_ok[j] && k_ok ? x_src[j] + k0 : x, x_ok[j] && k_ok);
      if (vec16) {
        const bool ok = p_ok && k0 + pr < k_end;
        awq::cp_async16_at(base + p_dst, ok ? p_src + (size_t)k0 * n8 : qweight, ok);
      } else {   // rows not 16-byte aligned: single words
        awq::load_words<BK, WORDS, THREADS>(reinterpret_cast<unsigned*>(smem + slot * C::STAGE_BYTES + C::X_BYTES),
                                            WORDS, qweight, n8, k0, k_end, col0, n8, false);
      }
    }
    awq::cp_async_commit();   // one group per stage, empty past the range: the count stays fixed
  };

  // ---- unpack plan: thread (row r0 = tid / 16, word c = tid % 16) unpacks rows r0 + 16 j,
  // j = 0..3. With k_begin a multiple of 64, rows r0 and r0 + 16 share a group, and so do
  // r0 + 32 and r0 + 48 (all four when G >= 64).
  const int c = tid & 15, r0 = tid >> 4, cw = col0 + c;
  const bool c_ok = cw < n8;
  const unsigned* z_src = qzeros + cw;
  const uint4* s_src = reinterpret_cast<const uint4*>(scales + 8 * cw);
  const unsigned w_dst = 2u * (r0 * W_LD + 8 * c);
  auto unpack_stage = [&](int st) {
    const unsigned* R = reinterpret_cast<const unsigned*>(smem + (st % STAGES) * C::STAGE_BYTES + C::X_BYTES);
    const int k0 = k_begin + st * BK;
    const unsigned W = w_tiles + (st & 1) * C::W_BYTES + w_dst;
    awq::Zeros z;
    half2 s[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int kh = k0 + r0 + 32 * h;
      if ((h == 0 || gshift == 5) && kh < k_end && c_ok) {
        const int grp = kh >> gshift;
        z = awq::make_zeros(__ldg(z_src + (size_t)grp * n8));
        const uint4 sv = __ldg(s_src + (size_t)grp * n8);
        s[0] = awq::as_h2(sv.x); s[1] = awq::as_h2(sv.y); s[2] = awq::as_h2(sv.z); s[3] = awq::as_h2(sv.w);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int r = r0 + 32 * h + 16 * j;
        uint4 o = make_uint4(0u, 0u, 0u, 0u);
        if (k0 + r < k_end && c_ok) {
          half2 d[4];
          awq::dequant8(R[r * WORDS + c], z, s, d);
          o = make_uint4(awq::as_u32(d[0]), awq::as_u32(d[1]), awq::as_u32(d[2]), awq::as_u32(d[3]));
        }
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n"
                     :: "r"(W + 2u * (32 * h + 16 * j) * W_LD), "r"(o.x), "r"(o.y), "r"(o.z), "r"(o.w));
      }
    }
  };

  // ---- fragment addresses (shared state space), per stage / tile only an offset is added
  const unsigned a_addr = smem0 + 2u * ((wm * (BM / 2) + (lane & 15)) * X_LD + (lane >> 4) * 8);
  const int lj = lane >> 3;
  const unsigned b_addr = w_tiles + 2u * ((8 * (lj & 1) + (lane & 7)) * W_LD + 32 * wn + 8 * (lj >> 1));

  float acc[C::MT][4][4];
#pragma unroll
  for (int i = 0; i < C::MT; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) load_stage(st);
  if (n_stages > 0) {
    awq::cp_async_wait<STAGES - 2>();   // stage 0 has landed (this thread's copies) ...
    __syncthreads();                    // ... and everyone's
    unpack_stage(0);
  }
  for (int st = 0; st < n_stages; ++st) {
    // stage st + 1 landed; tile st % 2 complete; every warp is done with stage st - 1 (its x and
    // packed slot and fp16 tile (st + 1) % 2 may be overwritten)
    awq::cp_async_wait<STAGES - 3>();
    __syncthreads();
    load_stage(st + STAGES - 1);

    const unsigned A = a_addr + (st % STAGES) * C::STAGE_BYTES;
    const unsigned B = b_addr + (st & 1) * C::W_BYTES;
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      unsigned a[C::MT][4];
#pragma unroll
      for (int i = 0; i < C::MT; ++i) ldmatrix_x4(a[i], A + 2u * (16 * i * X_LD + 16 * kk));
      unsigned b[4][2];
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        // matrices (k 0-7, cols 16p..+7), (k 8-15, same), (k 0-7, cols 16p+8..), (k 8-15, same)
        unsigned r[4];
        ldmatrix_x4_trans(r, B + 2u * (16 * kk * W_LD + 16 * p));
        b[2 * p][0] = r[0]; b[2 * p][1] = r[1];
        b[2 * p + 1][0] = r[2]; b[2 * p + 1][1] = r[3];
      }
#pragma unroll
      for (int i = 0; i < C::MT; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma16816(acc[i][j], a[i], b[j][0], b[j][1]);
    }
    if (st + 1 < n_stages) unpack_stage(st + 1);
  }
  awq::cp_async_wait<0>();
  __syncthreads();   // the pipeline is dead: its shared memory becomes the [BM][RED_LD] fp32 tile

  float* red = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < C::MT; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = wm * (BM / 2) + 16 * i + g + 8 * h;
        const int col = 32 * wn + 8 * j + 2 * t;
        *reinterpret_cast<float2*>(red + row * RED_LD + col) = make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
      }
  __syncthreads();
  for (int task = tid; task < BM * WORDS; task += THREADS) {
    const int rl = task / WORDS, w = task % WORDS, row = m0 + rl, cwt = col0 + w;
    if (row >= M || cwt >= n8) continue;
    const float* v = red + rl * RED_LD + 8 * w;
    if (splits == 1) awq::store8_half(y + (size_t)row * N + 8 * cwt, v);
    else awq::store8_float(ws + ((size_t)blockIdx.z * M + row) * N + 8 * cwt, v);
  }
  if (splits == 1) return;
  const size_t tile = blockIdx.x + (size_t)gridDim.x * blockIdx.y;
  if (!awq::last_block_of_tile(counters + tile, splits, &last_flag)) return;
  for (int task = tid; task < BM * WORDS; task += THREADS) {
    const int row = m0 + task / WORDS, cwt = col0 + task % WORDS;
    if (row >= M || cwt >= n8) continue;
    float v[8];
    awq::sum8_partials(v, ws + (size_t)row * N + 8 * cwt, (size_t)M * N, splits);
    awq::store8_half(y + (size_t)row * N + 8 * cwt, v);
  }
}
