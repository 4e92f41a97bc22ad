// q8_1.cuh -- one Q8_1 block (32 activations -> 32 int8 + half2 (d, s)) quantized by one warp,
// lane j holding value j. Shared by the stand-alone quantizer (q8_1_quantize.cu) and the layer
// ops that emit their output in Q8_1 as well (layer_ops.cu, and decode_persistent.cu's phases),
// so that all of them write the same bytes:
//
//   amax = max |x_j|            d = amax / 127 (fp32 division); a NaN x_j makes amax, d and
//                               s NaN (q8_1_max; fmaxf alone would drop it, and Q8_0's dot, which
//                               never reads s, would give a finite y -- llama.cpp's behaviour --
//                               where the emulation, the fp16 paths and the README give NaN)
//   q_j  = roundf(x_j / d)      (a true fp32 division -- q8_1_round takes it only near a tie
//                                 or where fp32 1 / d overflows;
//                                 roundf takes halves away from zero; q = 0 for the whole
//                                 block when d == 0 (amax == 0, or fp32 x whose amax / 127 is
//                                 below 2^-126: -ftz=true, which CuPy always passes, flushes
//                                 fp32 subnormal inputs and results -- x_j, d, the partial
//                                 sums -- to zero); q_j = 0 where x_j / d is NaN: a NaN
//                                 block, or an inf x_j)
//   s    = sum_j x_j            (the values, fp32)
//
// amax and s are xor-butterfly reductions (offsets 16, 8, 4, 2, 1). fp32 addition is
// commutative, so every lane ends with the same sum, in the order formats.gguf_blocks.
// butterfly_sum reproduces. d and s are rounded to half (nearest even) only when stored.
// Division, not multiplication by 127/amax: that is what the codec (and llama.cpp's CUDA
// quantize_q8_1) specifies, and with the default -prec-div=true '/' is IEEE-exact.
//
// Layouts of n_blocks blocks at out: interleaved (the codec's): block i = half2 (d, s) then its 32
// qs at out + 36 i; split (gguf_mmvq16.cu, gguf_mma.cu and decode_persistent.cu read it with
// aligned 16-byte loads): qs of block i at out + 32 i, its half2 (d, s) at out + 32 n_blocks + 4 i.
#pragma once
#include <cuda_fp16.h>   // (no <stdint.h>: NVRTC ships no C library headers)

// roundf(v / d) for |v| <= 127 d (d = amax / 127 > 0), with the division only where it can
// matter: r = v * (1 / d) is within 2 ulps of v / d (|r - fl(v / d)| < 1.9e-5 for |r| <= 128),
// and roundf changes only at k + 1/2, so where r is farther than 3.1e-5 from one, roundf(r) is
// roundf(fl(v / d)) -- bit-identical to the division. A fused layer op quantizing 8 values a
// lane on one SM spent most of its extra time in the 8 IEEE divisions (each, in the SASS, 8
// inline instructions -- MUFU.RCP, 5 FFMA, FCHK, a branch -- and a 74-instruction slow path).
// CuPy compiles every kernel with -ftz=true (it appends the flag to any options), so a d below
// 2^-126 is already 0 (q8_1_quantize_value's d == 0 case) and 1 / d <= 2^126 is finite. Built
// without FTZ, a d below 2^-128 makes 1 / d inf and r inf or NaN: those (|r| > 128 or NaN, never
// otherwise) take the division too. fp16 x never gets near either.
__device__ __forceinline__ int q8_1_round(float v, float d, float inv_d) {
  float r = v * inv_d;
  const float a = fabsf(r);
  if (!(a <= 128.0f) || fabsf(a - truncf(a) - 0.5f) <= 3.1e-5f) r = v / d;   // the true quotient
  return int(roundf(r));
}

// max(a, b) for the amax reductions, NaN if either is NaN (fmaxf returns the other one): PTX's
// max.NaN (sm_80 and up), one instruction like fmaxf's.
__device__ __forceinline__ float q8_1_max(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// Lane j's q_j; d and s in every lane. All 32 lanes must call it (full-warp shuffles).
__device__ __forceinline__ int q8_1_quantize_value(float v, float& d, float& sum) {
  float amax = fabsf(v);
  sum = v;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    amax = q8_1_max(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    sum += __shfl_xor_sync(0xffffffffu, sum, off);
  }
  d = amax / 127.0f;
  return d == 0.0f ? 0 : q8_1_round(v, d, 1.0f / d);   // d = 0: amax = 0, or fp32 amax / 127 < 2^-126
}

// Where block blk of n_blocks keeps its 32 qs bytes and its half2 (d, s), in either layout.
template <bool SPLIT>
__device__ __forceinline__ unsigned char* q8_1_qs(unsigned char* out, long long blk) {
  return SPLIT ? out + blk * 32 : out + blk * 36 + 4;
}
template <bool SPLIT>
__device__ __forceinline__ __half2* q8_1_ds(unsigned char* out, long long blk, long long n_blocks) {
  return reinterpret_cast<__half2*>(SPLIT ? out + n_blocks * 32 + blk * 4 : out + blk * 36);
}

// Quantize lane's value v as element `lane` of block blk and store it in the given layout.
template <bool SPLIT>
__device__ __forceinline__ void q8_1_store(float v, unsigned char* __restrict__ out, long long blk,
                                           long long n_blocks, int lane) {
  float d, sum;
  const int q = q8_1_quantize_value(v, d, sum);
  q8_1_qs<SPLIT>(out, blk)[lane] = (unsigned char)(signed char)q;
  if (lane == 0) *q8_1_ds<SPLIT>(out, blk, n_blocks) = __halves2half2(__float2half_rn(d), __float2half_rn(sum));
}

// The same block from the 4 lanes 4q..4q+3 of a group, lane t = lane & 3 holding elements
// 8t..8t+7 as 8 fp16 values (a 16-byte chunk): the same bytes as q8_1_store's, with no trip
// through memory. The sum keeps the butterfly's tree: its first two levels (elements 16 and 8
// apart) are across lanes t ^ 2 and t ^ 1, the last three (4, 2, 1 apart) inside the lane. All
// 32 lanes must call it; ok = false lanes (a group is whole or absent) compute but store nothing.
template <bool SPLIT>
__device__ __forceinline__ void q8_1_store8(uint4 chunk, bool ok, unsigned char* __restrict__ out,
                                            long long blk, long long n_blocks, int t) {
  float v[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(reinterpret_cast<const __half2*>(&chunk)[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
  float amax = 0.0f, a[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = q8_1_max(amax, fabsf(v[i]));
  amax = q8_1_max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = q8_1_max(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
#pragma unroll
  for (int i = 0; i < 8; ++i) a[i] = v[i] + __shfl_xor_sync(0xffffffffu, v[i], 2);   // 16 apart
#pragma unroll
  for (int i = 0; i < 8; ++i) a[i] += __shfl_xor_sync(0xffffffffu, a[i], 1);         // 8 apart
  const float b0 = a[0] + a[4], b1 = a[1] + a[5], b2 = a[2] + a[6], b3 = a[3] + a[7];  // 4 apart
  const float sum = (b0 + b2) + (b1 + b3);                                             // 2, then 1
  const float d = amax / 127.0f, inv_d = 1.0f / d;
  unsigned w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int q = d == 0.0f ? 0 : q8_1_round(v[i], d, inv_d);
    w[i / 4] |= unsigned((unsigned char)(signed char)q) << (8 * (i % 4));
  }
  if (!ok) return;
  unsigned char* qs = q8_1_qs<SPLIT>(out, blk) + 8 * t;
  if (SPLIT) {   // 8-byte aligned; the interleaved blocks' qs only 4-byte
    *reinterpret_cast<uint2*>(qs) = make_uint2(w[0], w[1]);
  } else {
    reinterpret_cast<unsigned*>(qs)[0] = w[0];
    reinterpret_cast<unsigned*>(qs)[1] = w[1];
  }
  if (t == 0) *q8_1_ds<SPLIT>(out, blk, n_blocks) = __halves2half2(__float2half_rn(d), __float2half_rn(sum));
}
