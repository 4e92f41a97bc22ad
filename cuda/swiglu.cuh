// swiglu.cuh -- the decoder MLP's SwiGLU product, defined once for every kernel that computes it
// (layer_ops.cu's silu_mul and silu_mul_q8_1, the wgmma kernels' fused gate/up epilogue and their
// split-K reduce wgmma_reduce<V, true>, decode_persistent.cu's gate/up phase), so that a fused and
// an unfused MLP give the same bits:
//
//   out = fp16( fp16(silu(g)) * u ),   silu(g) = g / (1 + e^-g) in fp32,
//
// g and u being fp16 values (the gate and up projections as stored), i.e. torch's
// F.silu(g) * u on fp16 tensors, rounded where torch rounds. Returns the product before its
// final rounding; callers round it to half (one value, or two with __floats2half2_rn).
//
// The division: an approximate reciprocal r of d = 1 + e^-g, q = g r, and one correction
// q + (g - d q) r by FMA, instead of the IEEE `/`. Rounded to fp16, as silu(g) always is here, it
// is bit-equal to fp16(g / d) for every one of the 65536 fp16 values g (infinities, NaN and
// signed zeros by the selects at the end; e^-g's argument capped at 80, where g / d rounds to
// -0 either way). Checked exhaustively against torch on the H100
// (tests/test_layer_ops_gpu.py::test_swiglu_every_fp16_gate). Why: `/` carries a branch to
// its slow path, and those branches serialised the 64-128 outputs a thread computes in the
// wgmma GLU epilogue, where no other block hides them (bench/NOTES.md, session 24).
#pragma once
#include <cuda_fp16.h>

__device__ __forceinline__ float swiglu(float g, float u) {
  const float d = 1.0f + expf(-fmaxf(g, -80.0f));
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  const float q = g * r;
  float s = fmaf(fmaf(-d, q, g), r, q);
  s = q == 0.0f ? q : s;                                               // +-0 keeps g's sign
  s = fabsf(g) <= 65504.0f ? s : (g > 0.0f ? g : __int_as_float(0x7fffffff));   // +inf; -inf, NaN: NaN
  return __half2float(__float2half_rn(s)) * u;
}
