// warp_sum.cuh -- the sum of one float over the 32 lanes of a warp, in every lane.
//
// A butterfly: lane l adds lane l ^ 16, then l ^ 8, ... l ^ 1 (__shfl_xor_sync). fp32 addition
// is commutative, so every lane ends with the bit-identical total, and the order is fixed, so a
// kernel's result does not depend on scheduling. Kernels that sum the same values with it agree
// bit for bit: that is how decode_persistent.cu reproduces the GEMVs of gguf_mmvq*.cu. (The
// emulations in reference/ do not assume this order: they bound any fp32 order.)
#pragma once

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
