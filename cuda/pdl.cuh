// pdl.cuh -- programmatic dependent launch (PDL): what lets back-to-back kernels overlap.
//
// A decode step is a chain of ~470 short kernels, each depending on the one before. Launched
// plainly, kernel i+1 starts only after kernel i has drained: its launch and the scheduling of
// its blocks sit in the gap, and kernel i's last partial wave leaves SMs idle.
//
// With PDL (quantzoo/cuda_launch.py launches with the programmatic-stream-serialization
// attribute inside `programmatic_launches()`; in a CUDA graph capture this becomes a
// programmatic edge) kernel i+1 may be launched while kernel i still runs, as soon as every
// block of kernel i has called grid_release() or exited. Each kernel here starts with
// grid_sync() (one exception: decode_persistent.cu calls grid_wait() only, so that nothing
// launches beside its cooperative grid until every CTA has exited):
//   grid_wait()     blocks until every prerequisite grid has completed and its memory writes
//                   are visible (griddepcontrol.wait);
//   grid_release()  allows the next kernel to launch (griddepcontrol.launch_dependents).
// Both instructions are no-ops for a kernel launched without the attribute, so every kernel of
// this repository runs them and any launch may use PDL. What keeps a chain correct: nothing
// touches memory before grid_wait(), and a block waits before it can return early, so a grid
// that completes implies its predecessor completed (and, transitively, the whole chain).
// grid_release() comes after the wait, so at most one grid waits ahead of the running one.
// Measured (H100, Qwen3-8B q4_0 decode graph): plain launches 372-378 tok/s, PDL releasing only at
// block exit 383, releasing at the start (this) 409.
//
// (An L2 prefetch of each GEMV block's weight slice before grid_wait(), with
// cp.async.bulk.prefetch.L2, was measured and removed: it slowed the GGUF GEMVs by 3-25 % and
// the q4_0 decode by 2 %, bench/NOTES.md, session 3.)
//
// sm_90 instructions; on older GPUs (the CI compiles sm_80 / sm_89 too) these are empty.
#pragma once

namespace pdl {

__device__ __forceinline__ void grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The start of every kernel: wait for the predecessor, then let the successor launch.
__device__ __forceinline__ void grid_sync() {
  grid_wait();
  grid_release();
}

}  // namespace pdl
