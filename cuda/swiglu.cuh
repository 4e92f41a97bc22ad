// swiglu.cuh -- the decoder MLP's SwiGLU product, defined once for every kernel that computes it
// (layer_ops.cu's silu_mul and silu_mul_q8_1, the wgmma kernels' fused gate/up epilogue), so that
// a fused and an unfused MLP give the same bits:
//
//   out = fp16( fp16(silu(g)) * u ),   silu(g) = g / (1 + e^-g) in fp32,
//
// g and u being fp16 values (the gate and up projections as stored), i.e. torch's
// F.silu(g) * u on fp16 tensors, rounded where torch rounds. Returns the product before its
// final rounding; callers round it to half (one value, or two with __floats2half2_rn).
#pragma once
#include <cuda_fp16.h>

__device__ __forceinline__ float swiglu(float g, float u) {
  return __half2float(__float2half_rn(g / (1.0f + expf(-g)))) * u;
}
