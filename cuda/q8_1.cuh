// q8_1.cuh -- one Q8_1 block (32 activations -> 32 int8 + half2 (d, s)) quantized by one warp,
// lane j holding value j. Shared by the stand-alone quantizer (q8_1_quantize.cu) and the layer
// ops that emit their output in Q8_1 as well (layer_ops.cu), so that both write the same bytes:
//
//   amax = max |x_j|            d = amax / 127 (fp32 division)
//   q_j  = roundf(x_j / d)      (a true fp32 division; roundf takes halves away from zero;
//                                 q = 0 for the whole block when amax == 0)
//   s    = sum_j x_j            (the values, fp32)
//
// amax and s are xor-butterfly reductions (offsets 16, 8, 4, 2, 1). fp32 addition is
// commutative, so every lane ends with the same sum, in the order formats.gguf_blocks.
// butterfly_sum reproduces. d and s are rounded to half (nearest even) only when stored.
// Division, not multiplication by 127/amax: that is what the codec (and llama.cpp's CUDA
// quantize_q8_1) specifies, and with the default -prec-div=true '/' is IEEE-exact.
//
// Layouts of n_blocks blocks at out: interleaved (the codec's): block i = half2 (d, s) then its 32
// qs at out + 36 i; split (gguf_mmvq16.cu reads it with aligned 16-byte loads): qs of block i at
// out + 32 i, its half2 (d, s) at out + 32 n_blocks + 4 i.
#pragma once
#include <cuda_fp16.h>   // (no <stdint.h>: NVRTC ships no C library headers)

// Lane j's q_j; d and s in every lane. All 32 lanes must call it (full-warp shuffles).
__device__ __forceinline__ int q8_1_quantize_value(float v, float& d, float& sum) {
  float amax = fabsf(v);
  sum = v;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    sum += __shfl_xor_sync(0xffffffffu, sum, off);
  }
  d = amax / 127.0f;
  return amax == 0.0f ? 0 : int(roundf(v / d));
}

// Quantize lane's value v as element `lane` of block blk and store it in the given layout.
template <bool SPLIT>
__device__ __forceinline__ void q8_1_store(float v, unsigned char* __restrict__ out, long long blk,
                                           long long n_blocks, int lane) {
  float d, sum;
  const int q = q8_1_quantize_value(v, d, sum);
  const __half2 ds = __halves2half2(__float2half_rn(d), __float2half_rn(sum));
  if (SPLIT) {
    out[blk * 32 + lane] = (unsigned char)(signed char)q;
    if (lane == 0) *reinterpret_cast<__half2*>(out + n_blocks * 32 + blk * 4) = ds;
  } else {
    unsigned char* b = out + blk * 36;
    b[4 + lane] = (unsigned char)(signed char)q;
    if (lane == 0) *reinterpret_cast<__half2*>(b) = ds;
  }
}
