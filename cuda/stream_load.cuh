// stream_load.cuh -- a 16-byte global load for bytes a kernel reads exactly once (a weight
// streamed by a GEMV): ld.global.nc (the read-only path) with L1::no_allocate, so the stream
// does not evict what L1 holds for reuse, such as the activations every warp re-reads. Used by
// fp16_gemv.cu and stream_read.cu (gguf_window.cuh has its own copy of the load, NOALLOC).
#pragma once

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
