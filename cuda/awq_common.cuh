// awq_common.cuh -- pieces shared by the AWQ W4A16 kernels (awq_dequant.cu, awq_gemv.cu,
// awq_small.cu, awq_mma.cu, awq_wgmma.cu; gguf_wgmma.cu borrows smem_addr, as_h2, as_u32,
// lop3_and_or and kMagic).
//
// Layout (HF AWQ "gemm"): qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales fp16 [K/G, N].
// Nibble slot j (bits 4j..4j+3) of a word holds column 8c + ORDER[j], ORDER = 0 2 4 6 1 3 5 7.
// So slots (0,4) are columns (0,1), slots (1,5) columns (2,3), slots (2,6) columns (4,5) and
// slots (3,7) columns (6,7): each pair sits 16 bits apart, exactly the two lanes of a half2.
//
// Math of the kernels that form an fp16 weight (awq_dequant.cu, awq_mma.cu, awq_wgmma.cu):
//     w16 = fp16((q - z) * s)
// (awq_small.cu and awq_gemv.cu never round a weight to fp16: they read masked nibbles as fp16
// subnormals and apply s once per group to fp32 partials; awq_small's MODE 1 uses the conversion
// below for the exact q - z only.)
// LOP3 trick (the one vLLM's AWQ dequantize kernel uses; project seed 002): (word & 0x000f000f) |
// 0x64006400, read as half2, is (1024 + q0, 1024 + q1):
// 0x6400 is 1024.0 in fp16, whose ulp is exactly 1, so the nibble lands in the mantissa.
// With the mask 0x00f000f0 the nibble is 16x too large: 1024 + 16 q. One lop3.b32 does the
// and+or. Then:
//     low pair : (1024 + q) - (1024 + z)                      = q - z   (exact, one hsub2)
//     high pair: (1024 + 16 q) * (1/16) + (-(64 + z))         = q - z   (exact, one hfma2)
// where 1024 + z and -(64 + z) are precomputed once per (group, column word) from the zero word
// through the same conversion. (q - z) is a small integer, exact in fp16, so the single hmul2 by
// s rounds once, like numpy's fp16((q - z) * s): the dequantised weight is bit-identical to the
// reference. (A single hfma2 q*s - z*s would be cheaper but rounds differently.)
#pragma once
#include <cuda_fp16.h>
#include "cp_async.cuh"
#include "pdl.cuh"

namespace awq {

// (a & b) | c in one instruction: LUT 0xEA = (0xF0 & 0xCC) | 0xAA.
__device__ __forceinline__ unsigned lop3_and_or(unsigned a, unsigned b, unsigned c) {
  unsigned r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

__device__ __forceinline__ half2 as_h2(unsigned u) { return *reinterpret_cast<half2*>(&u); }
__device__ __forceinline__ unsigned as_u32(half2 h) { return *reinterpret_cast<unsigned*>(&h); }

constexpr unsigned kLowMask = 0x000f000fu;
constexpr unsigned kHighMask = 0x00f000f0u;
constexpr unsigned kMagic = 0x64006400u;  // half2(1024, 1024)

// Per (group, column word): the zero terms that turn the magic numbers into q - z.
struct Zeros {
  half2 lo[2];   // 1024 + z for pairs (0,1) and (4,5)
  half2 hi[2];   // -(64 + z) for pairs (2,3) and (6,7)
};

__device__ __forceinline__ Zeros make_zeros(unsigned zw) {
  const half2 one16 = as_h2(0x2c002c00u);   // 1/16 in both lanes (a bare 0x2c00 zeroes the high lane)
  const half2 neg64 = as_h2(0xd400d400u);   // -64 in both lanes
  Zeros z;
  unsigned zs = zw >> 8;
  z.lo[0] = as_h2(lop3_and_or(zw, kLowMask, kMagic));
  z.lo[1] = as_h2(lop3_and_or(zs, kLowMask, kMagic));
  // high lanes: (1024 + 16 z)/16 - 64 = z, then -(z + 64) = -z - 64 (exact small integers)
  half2 z1 = __hfma2(as_h2(lop3_and_or(zw, kHighMask, kMagic)), one16, neg64);
  half2 z3 = __hfma2(as_h2(lop3_and_or(zs, kHighMask, kMagic)), one16, neg64);
  z.hi[0] = __hsub2(neg64, z1);
  z.hi[1] = __hsub2(neg64, z3);
  return z;
}

// Half H of a qweight word (H = 0: columns 0..3; H = 1: columns 4..7, whose nibbles sit 8 bits
// higher) -> 2 half2 (q - z) * s, column pairs (4H, 4H+1) and (4H+2, 4H+3). s[2H], s[2H+1] hold
// the scales of those pairs.
template <int H>
__device__ __forceinline__ void dequant4(unsigned w, const Zeros& z, const half2* s, half2* out) {
  const half2 one16 = as_h2(0x2c002c00u);
  if (H) w >>= 8;
  half2 d0 = __hsub2(as_h2(lop3_and_or(w, kLowMask, kMagic)), z.lo[H]);
  half2 d1 = __hfma2(as_h2(lop3_and_or(w, kHighMask, kMagic)), one16, z.hi[H]);
  out[0] = __hmul2_rn(d0, s[2 * H]);
  out[1] = __hmul2_rn(d1, s[2 * H + 1]);
}

// One qweight word -> 4 half2 (q - z) * s, pairs of columns (0,1) (2,3) (4,5) (6,7).
// s[p] holds the scales of the same column pair.
__device__ __forceinline__ void dequant8(unsigned w, const Zeros& z, const half2* s, half2* out) {
  dequant4<0>(w, z, s, out);
  dequant4<1>(w, z, s, out + 2);
}

// c += A * B on the tensor cores: m16n8k16, fp16 inputs, fp32 accumulators (row-major A
// fragment a[4], column-major B fragment b0, b1; PTX ISA "mma.m16n8k16").
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The M = 1 GEMVs' diagonal MMA (awq_gemv.cu, awq_strip.cu) leaves a lane the sums of one column
// word's 8 columns: column 4h + e in part[h][e], e < 2 in units of 2^-24 (the low mask's
// subnormal nibbles), e >= 2 in units of 2^-20 (the high mask's). A group's fix-up, with z' taken
// from the zero word by the same masks (so in the same units) and sx the group's sum of x:
//   acc += s * (part - z' * sx)
// su: the word's 8 fp16 scales as 4 half2; zu: its zero word under the masks (gemv_zero_halves).
__device__ __forceinline__ void gemv_zero_halves(unsigned z, unsigned (&zu)[4]) {
  const unsigned zs = z >> 8;
  zu[0] = z & kLowMask; zu[1] = z & kHighMask; zu[2] = zs & kLowMask; zu[3] = zs & kHighMask;
}
__device__ __forceinline__ void gemv_group_fixup(float (&acc)[2][4], const float (&part)[2][4], float sx,
                                                 const unsigned (&su)[4], const unsigned (&zu)[4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 s2 = __half22float2(as_h2(su[2 * h + e / 2]));
      const float2 z2 = __half22float2(as_h2(zu[2 * h + e / 2]));
      const float sf = (e & 1) ? s2.y : s2.x, zf = (e & 1) ? z2.y : z2.x;
      acc[h][e] = fmaf(sf, fmaf(-zf, sx, part[h][e]), acc[h][e]);
    }
}
// ... and at the end the word's 8 column sums v[4h + e], units off, summed over the four lanes t
// that hold the word (their rows 2t, 2t + 1 of every step): every lane of the warp must call it.
__device__ __forceinline__ void gemv_column_sums(const float (&acc)[2][4], float (&v)[8]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float a = acc[h][e] * (e < 2 ? 16777216.f : 1048576.f);
      a += __shfl_xor_sync(0xffffffffu, a, 1);
      a += __shfl_xor_sync(0xffffffffu, a, 2);
      v[4 * h + e] = a;
    }
}
// ... then the block's warps meet: o = the 8 column sums at red[w][col ..], summed over the
// warps w in fixed order (deterministic: the same bits every launch).
template <int WARPS, int W>
__device__ __forceinline__ void gemv_sum_warps(float (&o)[8], const float (&red)[WARPS][W], int col) {
#pragma unroll
  for (int c = 0; c < 8; ++c) o[c] = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w)
#pragma unroll
    for (int c = 0; c < 8; ++c) o[c] += red[w][col + c];
}

// The k-steps [x, y) of ROWS rows each that k slice `slice` of `slices` walks: the block's split
// (rows [blockIdx.y * rows_per_split, + rows_per_split) of K) cut into runs of whole steps that
// differ by at most one step, in order (awq_small.cu, awq_gemv.cu). An empty run has x == y.
template <int ROWS>
__device__ __forceinline__ int2 slice_steps(int K, int rows_per_split, int slice, int slices) {
  const int kb = blockIdx.y * rows_per_split;
  const int steps = max(0, (min(K, kb + rows_per_split) - kb) / ROWS);
  return make_int2(kb / ROWS + steps * slice / slices, kb / ROWS + steps * (slice + 1) / slices);
}

// ---- cp.async (cp_async.cuh), named awq::... by the AWQ kernels; shared-state-space loads
using ::cp_async16;
using ::cp_async16_at;
using ::cp_async4;
using ::cp_async_commit;
using ::cp_async_wait;
using ::smem_addr;
// Loads from a shared-state-space address (smem_addr + byte offset), for loops that carry their
// fragment addresses from one trip to the next.
__device__ __forceinline__ unsigned lds32(unsigned a) {
  unsigned v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(a));
  return v;
}
__device__ __forceinline__ uint2 lds64(unsigned a) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(a));
  return v;
}

// Copy a [rows x words] tile of 32-bit words (row stride src_ld words, first word col0 of a
// row of n_words) into shared memory with row stride dst_ld. Rows >= row_end and words >=
// n_words are zero-filled. vec16: every row start is 16-byte aligned (n_words % 4 == 0), so
// 16-byte copies are used; otherwise 4-byte ones.
template <int ROWS, int WORDS, int NTHREADS>
__device__ __forceinline__ void load_words(unsigned* dst, int dst_ld, const unsigned* src, int src_ld,
                                           int row0, int row_end, int col0, int n_words, bool vec16) {
  if (vec16) {
    constexpr int CH = WORDS / 4;
    for (int i = threadIdx.x; i < ROWS * CH; i += NTHREADS) {
      int r = i / CH, c = (i % CH) * 4;
      bool ok = (row0 + r < row_end) && (col0 + c < n_words);
      const unsigned* g = ok ? src + (size_t)(row0 + r) * src_ld + col0 + c : src;
      cp_async16(dst + r * dst_ld + c, g, ok);
    }
  } else {
    for (int i = threadIdx.x; i < ROWS * WORDS; i += NTHREADS) {
      int r = i / WORDS, c = i % WORDS;
      bool ok = (row0 + r < row_end) && (col0 + c < n_words);
      const unsigned* g = ok ? src + (size_t)(row0 + r) * src_ld + col0 + c : src;
      cp_async4(dst + r * dst_ld + c, g, ok);
    }
  }
}

// ---- split-K across blocks, deterministic: every block of a tile writes its fp32 partial to
// ws[split][row][col]; the last block to arrive (a self-resetting atomicInc on the tile's
// counter) sums the partials in split order and writes fp16. One launch, no memset, and the
// counters return to 0, so the launch can be replayed in a CUDA graph.
__device__ __forceinline__ void store8_half(half* y, const float* v) {
  half2 h[4];
#pragma unroll
  for (int p = 0; p < 4; ++p) h[p] = __floats2half2_rn(v[2 * p], v[2 * p + 1]);
  *reinterpret_cast<uint4*>(y) = *reinterpret_cast<uint4*>(h);
}
__device__ __forceinline__ void store8_float(float* w, const float* v) {
  reinterpret_cast<float4*>(w)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(w)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void sum8_partials(float* v, const float* ws, size_t split_stride, int splits) {
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = 0.f;
#pragma unroll 4
  for (int s = 0; s < splits; ++s) {
    const float4* p = reinterpret_cast<const float4*>(ws + s * split_stride);
    float4 a = __ldcg(p), b = __ldcg(p + 1);   // L2: partials of other blocks, never stale L1
    v[0] += a.x; v[1] += a.y; v[2] += a.z; v[3] += a.w;
    v[4] += b.x; v[5] += b.y; v[6] += b.z; v[7] += b.w;
  }
}

// After a block has stored its partials: is it the last of the tile's `splits` blocks?
// Call with all threads; returns the same answer in every caller.
__device__ __forceinline__ bool last_block_of_tile(unsigned* counter, int splits, int* flag_smem) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned old = atomicInc(counter, (unsigned)(splits - 1));   // wraps to 0 after the last
    *flag_smem = (old == (unsigned)(splits - 1));
  }
  __syncthreads();
  bool last = *flag_smem != 0;
  if (last) __threadfence();
  return last;
}

}  // namespace awq
