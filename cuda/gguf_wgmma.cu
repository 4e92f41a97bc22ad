// gguf_wgmma.cu -- GGUF Q4_0 / Q5_0 / Q8_0 weights x fp16 activations for Hopper (sm_90a): the weight
// blocks, dequantised in registers, are the register operand A of wgmma; x is operand B, read by
// the tensor cores from 128-byte-swizzled shared memory. The AWQ kernel awq_wgmma.cu is the
// model; this file differs in how weights reach the A fragments.
//
//   y[m, n] = fp16( sum_k x[m, k] * w16[n, k] ),   w16 = half((q - offset) * d)
//
// the same function as the dequant path (gguf_dequant.cu + cuBLAS): weights bit-equal to
// fmt.dequantize rounded to half, fp32 accumulation -- not the Q8_1 integer path of mmvq / mma.
// Only the formats whose value is one product, (q - 8) d, (q - 16) d and q d, are served: there
// fp16 math rounds the exact product once, exactly like the fp32 product rounded to half
// (Q4_1 / Q5_1's q d + m would round twice in fp32).
//
// computed transposed, y^T = W x^T: wgmma's M (64 rows per instruction) runs over weight rows
// (output columns n), its N over tokens; one instruction is 64 rows x T tokens x 16 k.
//
// Block: NWG warpgroups, each owning 64 JN weight rows (JN = 2 instructions per k-step up to
// T = 128, 1 at T = 256), x T tokens; K walked in D shared-memory stages of 64 k = 2 GGUF blocks.
//
// Why the tricks:
// * Copies: a row's 2 blocks of a stage are 36 / 44 / 68 bytes (Q4_0 / Q5_0 / Q8_0) at a
//   4-byte-aligned offset. With row strides a multiple of 16 bytes (K % 256 == 0, checked by
//   the host) every row's stage sits at the same offset o = (stage * 2 BYTES) % 16 inside a
//   16-byte-aligned window of 48 / 64 / 80 bytes, so each thread issues 3-5 16-byte cp.async per
//   stage at addresses worked out once (chunks past the stage's bytes skipped), and readers add
//   the uniform o.
// * A fragment (mma.sync's m16n8k16 A, per warp of the warpgroup): thread (g, t) holds rows g,
//   g + 8 and k pairs (2t, 2t+1), (2t+8, 2t+9) of a 16-k step. In a Q4_0 block, k < 16 is the
//   low nibble of qs byte k and k >= 16 the high nibble of byte k - 16, so the two bytes
//   2t, 2t+1 spread 16 bits apart by one byte permute give, through one LOP3 each, the k pair of
//   step 0 (low nibbles, 1024 + q) and of step 1 (high nibbles, 1024 + 16 q): exact q - 8 by
//   one hsub2 / hfma2, then one hmul2 by d. Q5_0: the same, with the two elements' fifth bits
//   from qh or-ed onto mantissa bit 4 (bit 8 in the 16x form). Q8_0: signed bytes,
//   (b & 0xff) ^ 0x80 in the mantissa of 1024 (one LOP3: (v & 0x00ff00ff) ^ 0x64806480) is
//   1152 + b, exact b by hsub2.
// * Everything else -- the x tile by TMA into the 128-byte swizzle, cp.async weight stages with
//   one barrier each, 3 k-steps in flight, pins, split K -- as in awq_wgmma.cu. Split-K partials go to an fp32
//   workspace [split][M][N] that gguf_mma.cu's mma_reduce sums in split order.
// * Tails: weight rows past N and tokens past M are zero-filled (d = 0 and x = 0 contribute 0)
//   and not stored.
//
// Measured on the H100 (bench/NOTES.md, session 8; rotated weights, us): the fastest Q4_0 / Q8_0
// path from M = 9 to 256 on weights of 4096 x 4096 and up -- q4_0 4096->12288 M = 16 26.8 against
// 42.5 for the int8 mma path and 36.9 for cuBLAS fp16, M = 128 48.9 against 89.3 for dequant +
// cuBLAS -- and, since its x tiles come by TMA (session 13), Q4_0 to M = 512 on weights of
// 6144 x 4096 and up (4096->12288 M = 512: 110.9 against 121.0), Q8_0 there where its grid fills
// whole waves; dispatch uses it there. Above, and on 4096->1024, dequant + cuBLAS (or mma) stays
// faster. Q5_0 runs at about half that speed (its
// fifth bits cost ~5 instructions per A register) and is dispatched for M = 64..256 only.
//
// Compiled only for sm_90a; for any other target the kernel body is empty and the host
// (quantzoo/kernels/gguf.py) never launches it there.
#include "gguf_common.cuh"
#include "awq_common.cuh"   // cp.async helpers (awq::cp_async16_at, smem_addr)
#include "wgmma_sm90.cuh"

namespace ggw {

constexpr int BK = 64;  // k per stage: 2 GGUF blocks

template <class F, int NWG, int T, int D>
struct Cfg {
  static constexpr int THREADS = 128 * NWG;
  static constexpr int JN = T == 256 ? 1 : 2;          // wgmma instructions (64 rows) per k-step
  static constexpr int ROWS = 64 * JN * NWG;           // weight rows (output columns) per block
  static constexpr int RB = 2 * F::BYTES;              // bytes of a row per stage (36, 44, 68)
  static constexpr int CH = (RB + 12 + 15) / 16;       // 16-byte chunks of the window (3, 4, 5)
  static constexpr int SLOT = 16 * CH;                 // shared bytes per row and stage
  static constexpr int X_BYTES = T * 128;              // T tokens x 64 halves, swizzled
  static constexpr int STAGE = (X_BYTES + ROWS * SLOT + 1023) / 1024 * 1024;
  static constexpr int SMEM = D * STAGE + 1024;        // + slack to align the base to 1024
  static_assert(!F::HAS_MIN && (F::BITS == 8 || F::OFFSET == (1 << (F::BITS - 1))),
                "one-product formats only: Q4_0, Q5_0, Q8_0");
  static_assert(RB % 4 == 0, "a row's stage is 4-byte aligned");
  static_assert(T % 8 == 0 && T >= 8 && T <= 256, "wgmma N (tokens) is a multiple of 8");
};

}  // namespace ggw

// grid (ceil(M / T), ceil(N / ROWS), splits); split z walks stages [z sps, (z + 1) sps) of the
// nb / 2 stages. W: N rows of nb blocks, base 16-byte aligned, nb % 8 == 0 (row stride a multiple
// of 16 bytes), N * nb * BYTES < 2^32. part: fp32 [splits][M][N] when splits > 1, else unused.
template <class F, int NWG, int T, int D>
__global__ void __launch_bounds__(128 * NWG, 1)
gguf_wgmma(const uint8_t* __restrict__ W, const __grid_constant__ wg::TmaDesc xmap, half* __restrict__ y,
           float* __restrict__ part, int M, int N, int nb, int sps) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = ggw::Cfg<F, NWG, T, D>;
  constexpr int JN = C::JN;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const unsigned base = (awq::smem_addr(smem_raw) + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - awq::smem_addr(smem_raw));

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wq = warp & 3;
  const int g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.x * T;
  const int n0 = blockIdx.y * C::ROWS;
  const int st0 = blockIdx.z * sps;
  const int n_stages = min(nb / 2, st0 + sps) - st0;

  // Copies: x by TMA (wg::XTile; splits are whole stages); weight copy c of this thread is
  // chunk (i % CH) of the window of block row i / CH, i = tid + THREADS c (rows past N
  // zero-filled), worked out once (a stage only moves the window along the row).
  __shared__ unsigned long long xbar[D];
  wg::XTile<T, D> xt(xmap, xbar, m0, 64 * st0, tid);
  constexpr int WCH = (C::ROWS * C::CH + C::THREADS - 1) / C::THREADS;
  const unsigned row_bytes = (unsigned)nb * F::BYTES;
  unsigned w_src[WCH], w_dst[WCH];   // byte offset of the row's window start in W; in the stage
  unsigned w_ok = 0;                 // bit c: the chunk exists and its row is < N
  unsigned w_ch = 0;                 // bits 4c..4c+3: the chunk's index in the window
#pragma unroll
  for (int c = 0; c < WCH; ++c) {
    const int i = tid + C::THREADS * c;
    const int r = i / C::CH, ch = i % C::CH;
    w_ok |= (i < C::ROWS * C::CH && n0 + r < N) << c;
    w_ch |= unsigned(ch) << (4 * c);
    w_src[c] = (unsigned)min(n0 + r, N - 1) * row_bytes + 16 * ch;
    w_dst[c] = C::X_BYTES + r * C::SLOT + 16 * ch;
  }
  auto load_stage = [&](int st, int buf) {
    const int s = st0 + st;
    const bool live = st < n_stages;   // past the split: zero-fill a free buffer, no branch
    const unsigned S0 = base + buf * C::STAGE;
    xt.copy_next(S0, buf, live);
    const unsigned win = (unsigned)(s * C::RB) & ~15u;   // the 16-byte window holding the stage
    // chunks past the stage's last byte are not copied: a window may reach past the row, and
    // for the last row past the tensor (Q5_0: 44 bytes at offset 4 in a 64-byte window)
    const unsigned n_ch = ((unsigned)(s * C::RB) - win + C::RB + 15) / 16;
#pragma unroll
    for (int c = 0; c < WCH; ++c) {
      const bool ok = live && ((w_ok >> c) & 1) && ((w_ch >> (4 * c)) & 15u) < n_ch;
      if (tid + C::THREADS * c < C::ROWS * C::CH)
        awq::cp_async16_at(S0 + w_dst[c], ok ? W + w_src[c] + win : W, ok);
    }
  };

  float acc[JN][T / 2];   // written first by the k-step 0 wgmma (accumulate = 0)

  wg::fill_pipeline<D>(load_stage);
  // this thread's weight rows in the block: instruction j, r8 = 0 / 1 -> row rr(j) + 8 r8
  auto rr = [&](int j) { return 64 * JN * wg + 64 * j + 16 * wq + g; };
  for (int st = 0; st < n_stages; ++st) {
    wg::enter_stage<D>(st, load_stage, xt);

    const unsigned char* S0 = smem + (st % D) * C::STAGE;
    const unsigned long long desc = wg::desc_sw128(awq::smem_addr(S0));
    const int o = ((st0 + st) * C::RB) & 15;   // the stage's offset in each row's window
    // per row (j, r8) and block b of the stage: d broadcast, and the 16-bit words the k pairs
    // come from -- Q4_0: bytes 2t, 2t+1 and 2t+8, 2t+9 of qs (both k-steps of the block);
    // Q8_0: bytes 16 h + 2t.. and 16 h + 2t + 8.. for k-step half h; Q5_0 as Q4_0 plus its
    // 32 fifth bits qh (bit k: element k).
    constexpr int NQ = F::BITS == 8 ? 4 : 2;
    unsigned qv[JN][2][2][NQ];
    unsigned qh[JN][2][F::BITS == 5 ? 2 : 1];
    half2 dd[JN][2][2];
#pragma unroll
    for (int j = 0; j < JN; ++j)
#pragma unroll
      for (int r8 = 0; r8 < 2; ++r8) {
        const unsigned char* row = S0 + C::X_BYTES + (rr(j) + 8 * r8) * C::SLOT + o;
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          const unsigned char* blk = row + b * F::BYTES;
          const unsigned short dh = *reinterpret_cast<const unsigned short*>(blk);
          dd[j][r8][b] = awq::as_h2(unsigned(dh) * 0x10001u);
          const unsigned char* qs = blk + (F::BITS == 5 ? 6 : 2);
#pragma unroll
          for (int q = 0; q < NQ; ++q)   // 2-byte loads: qs sits at an even, not 4-byte, offset
            qv[j][r8][b][q] = *reinterpret_cast<const unsigned short*>(qs + 16 * (q >> 1) + 8 * (q & 1) + 2 * t);
          if constexpr (F::BITS == 5) {
            const unsigned short* h = reinterpret_cast<const unsigned short*>(blk + 2);
            qh[j][r8][b] = unsigned(h[0]) | (unsigned(h[1]) << 16);
          }
        }
      }
#pragma unroll
    for (int kk = 0; kk < ggw::BK / 16; ++kk) {
      const int b = kk >> 1, hf = kk & 1;   // block of the stage, and which 16 of its 32 k
      unsigned a[JN][4];
#pragma unroll
      for (int j = 0; j < JN; ++j)
#pragma unroll
        for (int r8 = 0; r8 < 2; ++r8)
#pragma unroll
          for (int p = 0; p < 2; ++p) {   // p: k pair 2t.. or 2t + 8..
            half2 v;
            if constexpr (F::BITS == 4) {
              const unsigned sp = __byte_perm(qv[j][r8][b][p], 0u, 0x4140);   // [b0, 0, b1, 0]
              if (hf == 0)
                v = __hsub2(awq::as_h2(awq::lop3_and_or(sp, 0x000f000fu, awq::kMagic)), awq::as_h2(0x64086408u));
              else
                v = __hfma2(awq::as_h2(awq::lop3_and_or(sp, 0x00f000f0u, awq::kMagic)), awq::as_h2(0x2c002c00u),
                            awq::as_h2(0xd480d480u));   // (1024 + 16 q) / 16 - 72 = q - 8
            } else if constexpr (F::BITS == 5) {
              // the fifth bits of elements k, k + 1 (k = 16 hf + 8 p + 2t) land on mantissa bit 4 of
              // each lane (bit 8 in the 16x high-nibble form): 1024 + q, or 1024 + 16 q, q < 32
              const unsigned sp = __byte_perm(qv[j][r8][b][p], 0u, 0x4140);
              const unsigned hb = qh[j][r8][b] >> (16 * hf + 8 * p + 2 * t);
              const unsigned hi = ((hb & 1u) << 4) | ((hb & 2u) << 19);   // bits 4 and 20
              if (hf == 0)
                v = __hsub2(awq::as_h2(awq::lop3_and_or(sp, 0x000f000fu, awq::kMagic) | hi), awq::as_h2(0x64106410u));
              else
                v = __hfma2(awq::as_h2(awq::lop3_and_or(sp, 0x00f000f0u, awq::kMagic) | (hi << 4)),
                            awq::as_h2(0x2c002c00u), awq::as_h2(0xd500d500u));   // (1024 + 16 q) / 16 - 80
            } else {
              const unsigned sp = __byte_perm(qv[j][r8][b][2 * hf + p], 0u, 0x4140);
              unsigned u;
              asm("lop3.b32 %0, %1, %2, %3, 0x6A;\n" : "=r"(u) : "r"(sp), "r"(0x00ff00ffu), "r"(0x64806480u));
              v = __hsub2(awq::as_h2(u), awq::as_h2(0x64806480u));   // (1152 + b) - 1152 = b
            }
            a[j][r8 + 2 * p] = awq::as_u32(__hmul2_rn(v, dd[j][r8][b]));
          }
      wg::k_step<T, JN>(acc, a, desc + 2 * kk, st > 0 || kk > 0);   // desc + 2: 32 bytes along k per k16
    }
  }
  wg::drain<T, JN>(acc);
  awq::cp_async_wait<0>();

  // acc[j][4i + 2 r8 + e]: weight row n0 + rr(j) + 8 r8, token m0 + 8i + 2t + e
  const bool split = gridDim.z > 1;
#pragma unroll
  for (int j = 0; j < JN; ++j)
#pragma unroll
    for (int r8 = 0; r8 < 2; ++r8) {
      const int n = n0 + rr(j) + 8 * r8;
      if (n >= N) continue;
#pragma unroll
      for (int i = 0; i < T / 8; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int m = m0 + 8 * i + 2 * t + e;
          if (m >= M) continue;
          const float v = acc[j][4 * i + 2 * r8 + e];
          if (split) part[((size_t)blockIdx.z * M + m) * N + n] = v;
          else y[(size_t)m * N + n] = __float2half_rn(v);
        }
    }
#endif
}
