// awq_wgmma.cu -- AWQ W4A16 matrix product for Hopper (sm_90a): the weight, dequantised in
// registers, is the register operand A of wgmma; x is operand B, read by the tensor cores
// straight from 128-byte-swizzled shared memory.
//
//   y[m, n] = fp16( sum_k x[m, k] * w16[k, n] ),   w16 = fp16((q - z) * s)   (awq_common.cuh)
//
// computed transposed, y^T = W^T x^T: wgmma's M (64 rows per instruction) runs over output
// columns n, its N over tokens m, so one instruction is 64 columns x T tokens x 16 k.
//
// Block: NWG consumer warpgroups, each owning 128 output columns (16 column words) x the block's
// T tokens, and one producer warp that streams x, qweight, scales and zeros into D shared-memory
// stages of 64 k rows (one 128-byte swizzle row of x).
//
// Why the tricks:
// * wgmma, not mma.sync: on the H100 the mma.sync kernels of this repository peak near
//   170-300 TFLOP/s; wgmma issues a 64 x T x 16 product per instruction for a whole warpgroup,
//   asynchronously, so the dequant of the next k-step runs while the tensor cores work.
// * The weight as A from registers: the fp16 weight never exists, not even in shared memory.
//   A's fragment in warp w of a warpgroup is mma.sync's m16n8k16 A fragment: thread (g, t)
//   (g = lane/4, t = lane%4) holds rows g and g + 8, k pairs (2t, 2t+1) and (2t+8, 2t+9). A row
//   index is free to mean any output column, so the 4 rows a thread holds across the 2
//   instructions of a k-step (j = 0, 1; rows g and g + 8) stand for 4 columns of ONE packed word:
//   warps w and w + 2 take the low and high half of the same 8 words. Each thread dequantises
//   its half of the words of rows 2t, 2t+1, 2t+8, 2t+9 (LOP3 + exact q - z + one hmul2:
//   bit-identical fp16 weights) and a byte permute turns column pairs into k pairs, as in
//   awq_mma.cu. No repacked weight.
// * T = 128 tokens per instruction (not 64 with all 8 columns of a word per thread): half the
//   dequant work per MMA, and the accumulators (2 x 64 fp32) still fit beside the fragments.
// * Warp specialisation: the producer warp alone computes addresses and issues cp.async; each
//   stage has a "full" and an "empty" mbarrier, so consumers never meet at a block barrier. The
//   producer waits for a stage's copies, fences them into the async proxy (wgmma reads shared
//   memory through it) and arrives on "full"; consumers arrive on "empty" once the wgmma that
//   read the stage have completed.
// * Per k-step a warpgroup dequantises step i+1 while steps i-1 and i are in the tensor cores
//   (wgmma.wait_group 1 comes after the dequant, not before it).
// * x tiles use the 128-byte swizzle (16-byte chunk ch of row r stored at chunk ch ^ (r % 8)),
//   the layout the wgmma descriptor reads without bank conflicts; cp.async places the chunks.
// * Tails: rows past M or K and words past N/8 are zero-filled by cp.async (src size 0); a zero
//   x row or column contributes 0, and stores are guarded.
//
// Compiled only for sm_90a (wgmma); for any other target the kernel body is empty and the
// host (quantzoo/kernels/awq.py) never launches it there.
#include "awq_common.cuh"

namespace awqw {

constexpr int BK = 64;  // k rows per stage

template <int NWG, int T, int D>
struct Cfg {
  static constexpr int CONSUMERS = 128 * NWG;
  static constexpr int THREADS = CONSUMERS + 128;         // + the producer warpgroup
  static constexpr int WORDS = 16 * NWG;                  // column words per block
  static constexpr int W_LD = WORDS + 4;                  // == 4 (mod 16): rows 2t in distinct banks
  static constexpr int X_BYTES = T * 128;                 // T tokens x 64 halves, swizzled
  static constexpr int W_BYTES = BK * W_LD * 4;
  static constexpr int S_BYTES = 2 * WORDS * 16;          // up to 2 groups per stage (G = 32)
  static constexpr int Z_BYTES = 2 * WORDS * 4;
  static constexpr int STAGE = (X_BYTES + W_BYTES + S_BYTES + Z_BYTES + 1023) / 1024 * 1024;
  static constexpr int SMEM = D * STAGE + 1024;           // + slack to align the base to 1024
  static_assert(T % 16 == 0 && T >= 16 && T <= 128, "tokens: a multiple of 16 (producer rows), wgmma N");
  static_assert(NWG == 2, "setmaxnreg budget: 128 x 40 + 256 x 232 registers");
  static_assert(D >= 3, "the producer signals a stage two stages behind its newest");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// An empty asm that "writes" r: the compiler must compute r before it and may not move the
// computation below a wgmma.fence (registers defined after the fence make ptxas serialise the
// wgmma, warning C7513). Applied to the A fragments and the accumulators around each k-step.
__device__ __forceinline__ void pin(unsigned& r) { asm volatile("" : "+r"(r) :: "memory"); }
__device__ __forceinline__ void pin(float& r) { asm volatile("" : "+f"(r) :: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }

// d[64 x T] (+)= A[64 x 16] (registers) * B[16 x T] (shared memory, descriptor), fp32 accumulate;
// accumulate = 0 overwrites d (the first k-step: the accumulators need no zeroing, which would be
// a non-wgmma definition of wgmma inputs and make ptxas serialise the wgmma, warning C7513).
template <int T> struct Wgmma;

#define QZ_ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
                   "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])

template <> struct Wgmma<32> {
  __device__ __forceinline__ static void run(float* d, const unsigned* a, unsigned long long desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n"
        "}\n"
        : QZ_ACC8(0), QZ_ACC8(8)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
  }
};

template <> struct Wgmma<64> {
  __device__ __forceinline__ static void run(float* d, const unsigned* a, unsigned long long desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n"
        "}\n"
        : QZ_ACC8(0), QZ_ACC8(8), QZ_ACC8(16), QZ_ACC8(24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
  }
};
template <> struct Wgmma<128> {
  __device__ __forceinline__ static void run(float* d, const unsigned* a, unsigned long long desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n"
        "}\n"
        : QZ_ACC8(0), QZ_ACC8(8), QZ_ACC8(16), QZ_ACC8(24), QZ_ACC8(32), QZ_ACC8(40), QZ_ACC8(48), QZ_ACC8(56)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
  }
};
#undef QZ_ACC8

// Shared-memory matrix descriptor of a K-major operand in the 128-byte swizzle: start address
// (16-byte units), leading offset 1 (unused by this layout), stride 1024 bytes between 8-row
// groups, layout type 1 = 128B swizzle. The tile base must be 1024-byte aligned.
__device__ __forceinline__ unsigned long long desc_sw128(unsigned saddr) {
  return (unsigned long long)((saddr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}


// ---- mbarriers (shared-memory 64-bit barriers with a phase bit)
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
// arrive only where cond holds, without a branch (a branch between a warpgroup's wgmma makes
// ptxas serialise them, warning C7513)
__device__ __forceinline__ void mbar_arrive_if(unsigned bar, bool cond) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %1, 0;\n"
      "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n"
      "}\n" :: "r"(bar), "r"((int)cond) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" :: "r"(bar), "r"(parity) : "memory");
}
#endif

}  // namespace awqw

// grid (ceil(M / T), ceil(N/8 / WORDS)): token tiles vary fastest, so the blocks that read the
// same weights run together and share L2. Block 128 * NWG + 128 threads, dynamic shared memory
// awqw::Cfg<NWG, T, D>::SMEM bytes. K % 32 == 0 (K % G == 0, G >= 32).
template <int NWG, int T, int D>
__global__ void __launch_bounds__(128 * NWG + 128, 1)
awq_wgmma_kernel(const half* __restrict__ x, const unsigned* __restrict__ qweight,
                 const unsigned* __restrict__ qzeros, const half* __restrict__ scales,
                 half* __restrict__ y, int M, int K, int N, int G) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = awqw::Cfg<NWG, T, D>;
  constexpr int BK = awqw::BK;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long bars[2 * D];   // full[0..D), empty[D..2D)
  const unsigned base = (awq::smem_addr(smem_raw) + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - awq::smem_addr(smem_raw));
  const unsigned full0 = awq::smem_addr(bars), empty0 = full0 + 8 * D;

  const int n8 = N / 8;
  const int tid = threadIdx.x;
  // warp index through a shuffle: ptxas then knows it is warp-uniform, and the role branch below
  // does not make it serialise the consumers' wgmma (warning C7520)
  const int lane = tid & 31, warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
  const int wg = warp >> 2;
  const int m0 = blockIdx.x * T;
  const int col0 = blockIdx.y * C::WORDS;
  const int n_stages = (K + BK - 1) / BK;

  if (tid == 0) {
    for (int i = 0; i < D; ++i) {
      awqw::mbar_init(full0 + 8 * i, 128);             // every producer thread
      awqw::mbar_init(empty0 + 8 * i, C::CONSUMERS);   // every consumer thread
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // Registers: the block starts with 384 x 168; the producer warpgroup gives most of its share
  // to the consumers (setmaxnreg), whose 2 x 64 accumulators and pipelined fragments need more.
  if (wg == NWG) {
    // ---------------- producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    const int ptid = tid - C::CONSUMERS;
    const int groups_per_stage = G < BK ? BK / G : 1;
    const bool vec16 = (n8 % 4) == 0;
    // x: thread copies chunk ptid % 8 of rows ptid / 8 + 16 i
    const int xr = ptid >> 3, xc = ptid & 7;
    const half* xsrc = x + (size_t)(m0 + xr) * K + 8 * xc;
    auto load_stage = [&](int st) {
      const int k0 = st * BK;
      unsigned char* S0 = smem + (st % D) * C::STAGE;
      const unsigned xs = awq::smem_addr(S0);
      const bool kok = k0 + 8 * xc < K;
#pragma unroll 1   // the producer runs on 40 registers: no unrolled address arithmetic
      for (int i = 0; i < T / 16; ++i) {
        const int r = xr + 16 * i;
        const bool ok = kok && (m0 + r < M);
        awq::cp_async16_at(xs + r * 128 + ((xc ^ (r & 7)) << 4), ok ? xsrc + (size_t)16 * i * K + k0 : x, ok);
      }
      awq::load_words<BK, C::WORDS, 128>(reinterpret_cast<unsigned*>(S0 + C::X_BYTES), C::W_LD, qweight, n8,
                                         k0, K, col0, n8, vec16, ptid);
      half* S = reinterpret_cast<half*>(S0 + C::X_BYTES + C::W_BYTES);
      unsigned* Z = reinterpret_cast<unsigned*>(S0 + C::X_BYTES + C::W_BYTES + C::S_BYTES);
      for (int i = ptid; i < groups_per_stage * C::WORDS; i += 128) {
        const int gi = i / C::WORDS, cw = i % C::WORDS;
        const int kg = k0 + gi * G;
        const bool ok = (kg < K) && (col0 + cw < n8);
        const int grp = kg / G;
        awq::cp_async16(S + 8 * i, ok ? scales + (size_t)grp * N + 8 * (col0 + cw) : scales, ok);
        awq::cp_async4(Z + i, ok ? qzeros + (size_t)grp * n8 + col0 + cw : qzeros, ok);
      }
    };
    // stage st is signalled once stage st + LAG has been issued (its copies had that long to land)
    constexpr int LAG = D - 2;
    auto signal = [&](int st) {
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   // cp.async data -> async proxy
      awqw::mbar_arrive(full0 + 8 * (st % D));
    };
    for (int st = 0; st < n_stages; ++st) {
      if (st >= D) awqw::mbar_wait(empty0 + 8 * (st % D), ((st / D) - 1) & 1);
      load_stage(st);
      awq::cp_async_commit();
      if (st >= LAG) {
        awq::cp_async_wait<LAG>();
        signal(st - LAG);
      }
    }
    awq::cp_async_wait<0>();
    for (int st = n_stages > LAG ? n_stages - LAG : 0; st < n_stages; ++st) signal(st);
  } else {
  // ---------------- consumer warpgroups
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int wq = warp & 3;
  const int g = lane >> 2, t = lane & 3;
  // this thread's column word within the block, and which half of it: columns 4h .. 4h + 3
  const int c = 16 * wg + 8 * (wq & 1) + g;
  const int h = wq >> 1;
  const int sh = 8 * h;   // the high half's nibbles sit 8 bits higher (awq_common.cuh)

  float acc[2][T / 2];   // written first by the k-step 0 wgmma (accumulate = 0)
  constexpr int INFLIGHT = 1;   // k-steps (wgmma groups) left in flight while the next is dequantised

  for (int st = 0; st < n_stages; ++st) {
    const int buf = st % D;
    awqw::mbar_wait(full0 + 8 * buf, (st / D) & 1);
    unsigned char* S0 = smem + buf * C::STAGE;
    const unsigned long long desc = awqw::desc_sw128(awq::smem_addr(S0));
    const unsigned* Wc = reinterpret_cast<const unsigned*>(S0 + C::X_BYTES) + c;
    const half* S = reinterpret_cast<const half*>(S0 + C::X_BYTES + C::W_BYTES);
    const unsigned* Z = reinterpret_cast<const unsigned*>(S0 + C::X_BYTES + C::W_BYTES + C::S_BYTES);
    // the stage's 16 weight words of this thread (rows 16 kk + 2t + {0, 1, 8, 9}), and both
    // groups' scales and zeros, read at once: one shared-memory latency per stage, not per k-step
    unsigned wv[BK / 16][4];
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      const unsigned* Wr = Wc + (16 * kk + 2 * t) * C::W_LD;
      wv[kk][0] = Wr[0]; wv[kk][1] = Wr[C::W_LD]; wv[kk][2] = Wr[8 * C::W_LD]; wv[kk][3] = Wr[9 * C::W_LD];
    }
    const int g2 = G == 32;   // a stage spans 2 groups only when G == 32
    const uint4 sv0 = *reinterpret_cast<const uint4*>(S + 8 * c);
    const uint4 sv1 = *reinterpret_cast<const uint4*>(S + 8 * (g2 * C::WORDS + c));
    const unsigned zw0 = Z[c], zw1 = Z[g2 * C::WORDS + c];
    half2 s[4];
    awq::Zeros z;
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      if (kk == 0 || kk == 2) {   // no branch on G: it would split the warpgroup's wgmma path
        const uint4 sv = kk == 0 ? sv0 : sv1;
        s[0] = awq::as_h2(h ? sv.z : sv.x);
        s[1] = awq::as_h2(h ? sv.w : sv.y);
        z = awq::make_zeros(kk == 0 ? zw0 : zw1);
        if (h) { z.lo[0] = z.lo[1]; z.hi[0] = z.hi[1]; }   // the high half's terms into slot 0
      }
      awqw::wg_wait<INFLIGHT>();   // at most INFLIGHT + 1 k-steps in the tensor cores after the issue below
      half2 d0[2], d1[2], d2[2], d3[2];
      awq::dequant4(wv[kk][0] >> sh, z, s, d0);
      awq::dequant4(wv[kk][1] >> sh, z, s, d1);
      awq::dequant4(wv[kk][2] >> sh, z, s, d2);
      awq::dequant4(wv[kk][3] >> sh, z, s, d3);
      unsigned a[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        // instruction j: row g = column 4h + 2j, row g + 8 = column 4h + 2j + 1
        a[j][0] = __byte_perm(awq::as_u32(d0[j]), awq::as_u32(d1[j]), 0x5410);   // row g,   k 2t..
        a[j][1] = __byte_perm(awq::as_u32(d0[j]), awq::as_u32(d1[j]), 0x7632);   // row g+8, k 2t..
        a[j][2] = __byte_perm(awq::as_u32(d2[j]), awq::as_u32(d3[j]), 0x5410);   // row g,   k 2t+8..
        a[j][3] = __byte_perm(awq::as_u32(d2[j]), awq::as_u32(d3[j]), 0x7632);   // row g+8, k 2t+8..
      }
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) awqw::pin(a[j][e]);
      // at step INFLIGHT of stage st, step 3 of stage st - 1 is done: its buffer is free (the
      // words read into wv above are in registers already)
      if (kk == INFLIGHT) awqw::mbar_arrive_if(empty0 + 8 * ((st + D - 1) % D), st > 0);
      awqw::wg_fence();
#pragma unroll
      for (int j = 0; j < 2; ++j)   // desc + 2: 32 bytes further along k per k16
        awqw::Wgmma<T>::run(acc[j], a[j], desc + 2 * kk, st > 0 || kk > 0);
      awqw::wg_commit();
    }
  }
  awqw::wg_wait<0>();
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int i = 0; i < T / 2; ++i) awqw::pin(acc[j][i]);

  // acc[j][4i + 2r + e]: column 8c + 4h + 2j + r, token m0 + 8i + 2t + e
  const int cg = col0 + c;
  if (cg < n8) {
#pragma unroll
    for (int i = 0; i < T / 8; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int m = m0 + 8 * i + 2 * t + e;
        if (m < M) {
          const half2 p0 = __floats2half2_rn(acc[0][4 * i + e], acc[0][4 * i + 2 + e]);
          const half2 p1 = __floats2half2_rn(acc[1][4 * i + e], acc[1][4 * i + 2 + e]);
          *reinterpret_cast<uint2*>(y + (size_t)m * N + 8 * cg + 4 * h) = make_uint2(awq::as_u32(p0), awq::as_u32(p1));
        }
      }
  }
  }   // consumer warpgroups
#endif
}
