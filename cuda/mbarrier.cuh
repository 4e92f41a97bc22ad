// mbarrier.cuh -- the shared-memory mbarriers (8 bytes each, sm_90) that pace a producer's async
// copies (TMA, cp.async.bulk) against their consumers: a phase completes when its expected
// arrivals and transaction bytes are in; a thread waits for a phase by its parity (k & 1 for
// phase k), which tells phase k from k - 1 only -- the caller must know the barrier is not two
// phases away (wgmma_sm90.cuh's stage ring, decode_persistent.cu's weight ring).
// bar is the shared-memory address (__cvta_generic_to_shared) of the barrier.
#pragma once

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
namespace sm90 {
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count = 1) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar, unsigned n = 1) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(n) : "memory");
}
// One arrival that also announces `bytes` of transactions still to land on this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile("{\n.reg .pred done;\nWAIT:\n"
               "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
               "@!done bra WAIT;\n}\n" :: "r"(bar), "r"(parity) : "memory");
}
}  // namespace sm90
#endif
