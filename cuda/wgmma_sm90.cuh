// wgmma_sm90.cuh -- the Hopper (sm_90a) warpgroup MMA pieces the wgmma kernels share
// (awq_wgmma.cu, gguf_wgmma.cu): fence / commit / wait, register "pins", the register-A
// m64nTk16 f16 -> f32 instructions, and the 128-byte-swizzle shared-memory descriptor.
// Only defined where the architecture-specific features exist (sm_90a); elsewhere the kernels
// that include this compile to empty bodies.
#pragma once
#include <cuda_fp16.h>
#include "awq_common.cuh"   // cp.async helpers

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace wg {
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// An empty asm that "writes" r: the compiler must compute r before it and may not move the
// computation below a wgmma.fence (registers defined after the fence make ptxas serialise the
// wgmma, warning C7513). Applied to each k-step's A fragments before its fence, and to the
// accumulators after the last wait (so the epilogue cannot read them earlier).
__device__ __forceinline__ void pin(unsigned& r) { asm volatile("" : "+r"(r) :: "memory"); }
__device__ __forceinline__ void pin(float& r) { asm volatile("" : "+f"(r) :: "memory"); }
template <int N>
__device__ __forceinline__ void wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }

// d[64 x T] (+)= A[64 x 16] (registers) * B[16 x T] (shared memory, descriptor), fp32 accumulate;
// accumulate = 0 overwrites d (the first k-step: the accumulators need no zeroing, which would be
// a non-wgmma definition of wgmma inputs and make ptxas serialise the wgmma, warning C7513).
template <int T> struct Wgmma;

#define QZ_ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
                   "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])

template <> struct Wgmma<32> {
  __device__ __forceinline__ static void run(float* d, const unsigned* a, unsigned long long desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n"
        "}\n"
        : QZ_ACC8(0), QZ_ACC8(8)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
  }
};
template <> struct Wgmma<64> {
  __device__ __forceinline__ static void run(float* d, const unsigned* a, unsigned long long desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n"
        "}\n"
        : QZ_ACC8(0), QZ_ACC8(8), QZ_ACC8(16), QZ_ACC8(24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
  }
};
template <> struct Wgmma<128> {
  __device__ __forceinline__ static void run(float* d, const unsigned* a, unsigned long long desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n"
        "}\n"
        : QZ_ACC8(0), QZ_ACC8(8), QZ_ACC8(16), QZ_ACC8(24), QZ_ACC8(32), QZ_ACC8(40), QZ_ACC8(48), QZ_ACC8(56)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
  }
};
template <> struct Wgmma<256> {
  __device__ __forceinline__ static void run(float* d, const unsigned* a, unsigned long long desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "{%128, %129, %130, %131}, %132, p, 1, 1, 0;\n"
        "}\n"
        : QZ_ACC8(0), QZ_ACC8(8), QZ_ACC8(16), QZ_ACC8(24), QZ_ACC8(32), QZ_ACC8(40), QZ_ACC8(48), QZ_ACC8(56),
          QZ_ACC8(64), QZ_ACC8(72), QZ_ACC8(80), QZ_ACC8(88), QZ_ACC8(96), QZ_ACC8(104), QZ_ACC8(112), QZ_ACC8(120)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
  }
};
#undef QZ_ACC8

// Shared-memory matrix descriptor of a K-major operand in the 128-byte swizzle: start address
// (16-byte units), leading offset 1 (unused by this layout), stride 1024 bytes between 8-row
// groups, layout type 1 = 128B swizzle. The tile base must be 1024-byte aligned.
__device__ __forceinline__ unsigned long long desc_sw128(unsigned saddr) {
  return (unsigned long long)((saddr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

// The stage pipeline both kernels run: D shared-memory buffers, each stage one cp.async group,
// loads D - 2 stages ahead. A warpgroup keeps at most 3 k-steps in flight (k_step below), so
// every wgmma of stage s - 2 is done when it reaches the barrier of stage s, whose buffer is
// then refilled. load(st, buf) issues the copies of stage st into buffer buf.
template <int D, class Load>
__device__ __forceinline__ void fill_pipeline(Load& load) {
  static_assert(D >= 3, "loads run D - 2 stages ahead");
#pragma unroll
  for (int st = 0; st < D - 2; ++st) {
    load(st, st);
    awq::cp_async_commit();
  }
}
// Wait for stage st (this thread's copies, then every thread's), make it visible to wgmma, and
// start stage st + D - 2.
template <int D, class Load>
__device__ __forceinline__ void enter_stage(int st, Load& load) {
  awq::cp_async_wait<D - 3>();
  // cp.async wrote through the generic proxy; wgmma reads through the async proxy
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  load(st + D - 2, (st + D - 2) % D);
  awq::cp_async_commit();
}

// One k-step of JN instructions (64 rows each, register A), as both kernels issue it: the A
// fragments are pinned before the fence (computed after it, ptxas serialises the wgmma: C7513);
// at most 2 earlier k-steps stay in flight, so 3 are after this one (a stage's buffer is free
// again 2 stages later: the kernels load D - 2 stages ahead).
template <int T, int JN>
__device__ __forceinline__ void k_step(float (&acc)[JN][T / 2], unsigned (&a)[JN][4],
                                       unsigned long long desc, int accumulate) {
#pragma unroll
  for (int j = 0; j < JN; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) pin(a[j][e]);
  wait<2>();
  fence();
#pragma unroll
  for (int j = 0; j < JN; ++j) Wgmma<T>::run(acc[j], a[j], desc, accumulate);
  commit();
}

// After the last k-step: every wgmma done, and the accumulators pinned so that the epilogue
// cannot read them earlier.
template <int T, int JN>
__device__ __forceinline__ void drain(float (&acc)[JN][T / 2]) {
  wait<0>();
#pragma unroll
  for (int j = 0; j < JN; ++j)
#pragma unroll
    for (int i = 0; i < T / 2; ++i) pin(acc[j][i]);
}

// The x tile of a 64-k stage, B of the descriptor above: T tokens x 64 halves, 128 bytes a row,
// 16-byte chunk c of row r at byte r * 128 + ((c ^ (r % 8)) << 4). Thread tid copies chunk
// tid % 8 of rows tid / 8 + STEP i; rows past M and k past the block's range are zero-filled.
// Stages are copied in k order, so the source pointer is carried from one copy to the next
// (+64 halves): ptxas rematerialises a pointer worked out once from threadIdx on every trip of
// the loop (bench/NOTES.md, session 9), a value the loop updates it cannot.
template <int T, int THREADS>
struct XTile {
  static constexpr int STEP = THREADS / 8, CH = T * 8 / THREADS;
  static_assert(T * 8 % THREADS == 0 && STEP % 8 == 0, "x chunks split evenly over the threads");
  const half* src;   // chunk 0 of the next stage copied
  unsigned dst;      // its byte offset in a stage
  unsigned rows;     // bit i: row tid / 8 + STEP i is < M
  __device__ __forceinline__ XTile(const half* x, int M, int K, int m0, int k0, int tid) {
    const int xr = tid >> 3, xc = tid & 7;
    src = x + (size_t)min(m0 + xr, M - 1) * K + k0 + 8 * xc;
    dst = xr * 128 + ((xc ^ (xr & 7)) << 4);
    rows = 0;
#pragma unroll
    for (int i = 0; i < CH; ++i) rows |= (m0 + xr + STEP * i < M) << i;
  }
  // copy the next stage into the stage at shared address S0 (k_ok: this thread's 8 k lie
  // inside the block's K range), then advance
  __device__ __forceinline__ void copy_next(unsigned S0, bool k_ok, const half* x, int K) {
#pragma unroll
    for (int i = 0; i < CH; ++i) {
      const bool ok = k_ok && ((rows >> i) & 1);
      awq::cp_async16_at(S0 + dst + STEP * 128 * i, ok ? src + (size_t)STEP * K * i : x, ok);
    }
    src += 64;
  }
};
}  // namespace wg
#endif
