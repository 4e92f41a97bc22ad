// cp_async.cuh -- cp.async (sm_80+): global -> shared memory without a register round trip, in
// 16- or 4-byte pieces, committed in groups and waited for by count. Used by the AWQ kernels'
// stage rings (awq_common.cuh) and the decode attention's per-warp ring (layer_ops.cuh).
// src_bytes = 0 writes zeros, which is how the AWQ kernels pad tails (rows past K or the split,
// columns past N). The commit and wait carry no memory clobber: a reader of the landed data
// meets the writers at a barrier (__syncwarp / __syncthreads) after the wait, which orders it.
#pragma once

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// cp_async16_at takes the destination as a shared-state-space address (smem_addr), for loops that
// keep one base address and add byte offsets instead of converting a pointer per copy.
__device__ __forceinline__ void cp_async16_at(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  cp_async16_at(smem_addr(dst), src, valid);
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
               :: "r"(smem_addr(dst)), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }
