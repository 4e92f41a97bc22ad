// wgmma_sm90.cuh -- the Hopper (sm_90a) warpgroup MMA pieces the wgmma kernels share
// (awq_wgmma.cu, gguf_wgmma.cu), both built as a TMA producer warpgroup feeding consumer
// warpgroups. The product they issue, computed transposed (weight rows as wgmma's M):
//
//   d[64 x T] (+)= A[64 x 16] (registers: dequantised weight) * B[16 x T] (shared memory: x)
//
// Here: fence / commit / wait, register "pins", setmaxnreg, the register-A m64nTk16 f16 -> f32
// instructions issued a stage at a time (stage_step), the 128-byte-swizzle shared-memory
// descriptor, TMA copies onto mbarriers (tma_2d, tma_3d), the stage ring's mbarriers, the block
// schedule (BlockWork, work), split tiles' parts summed in the kernel (hand_over, meet), the x
// box rule (x_box_row), the GGUF kernel's GLU store (glu_store), and split K's partials
// (SplitParts) and their reduce launch (wgmma_reduce).
// The wgmma pieces are only defined where the architecture-specific features exist (sm_90a);
// elsewhere the kernels that include this compile to empty bodies. TmaDesc, SplitParts, Regs
// (setmaxnreg's split, used as template arguments) and wgmma_reduce are plain CUDA, defined for
// every target.
#pragma once
#include <cuda_fp16.h>
#include "mbarrier.cuh"
#include "pdl.cuh"
#include "swiglu.cuh"

namespace wg {
// The driver's CUtensorMap (128 bytes, 64-byte aligned): a TMA descriptor encoded on the host
// by cuTensorMapEncodeTiled (quantzoo/cuda_launch.py, TensorMap) and passed by value as a
// __grid_constant__ kernel parameter. Declared for every target so that the kernels' signatures
// compile everywhere.
struct alignas(64) TmaDesc { unsigned long long v[16]; };

// Where the split tiles' partials for wgmma_reduce go: part [splits][M][pitch] fp32, the
// columns [first, ny) of y's ny -- tiles are numbered token tile fastest, so the split tiles
// dp_tiles .. are the column tiles from dp_tiles / tiles_m on, of `cols` columns each (GLU: y's
// columns a tile; the gate partials, then at + w the up partials: pitch 2 w). Whole rows of
// those columns keep [splits][M][N]'s spread of addresses: contiguous [T][cols] slots, one per
// split tile, made the GGUF launches 20-40 % slower (the slots a power of two apart;
// bench/NOTES.md, session 35), and [splits][M][N] itself was 1.7 GB at a 1408-token lm_head.
struct SplitParts {
  int first, w, pitch;
  __device__ __forceinline__ SplitParts(int ny, int cols, int dp_tiles, int tiles_m, bool glu)
      : first(dp_tiles / tiles_m * cols), w(ny - first), pitch(glu ? 2 * w : w) {}
  __device__ __forceinline__ size_t at(int split, int M, int m, int n, bool up = false) const {
    return ((size_t)split * M + m) * pitch + (up ? w : 0) + (n - first);
  }
};

// setmaxnreg's split of a block's registers, for both kernels: the producer warpgroup keeps few,
// the NWG consumer warpgroups take the rest of what BPS blocks an SM leave a block (65536 / BPS
// registers; the entry allocation is the launch bound's, a multiple of 8 per thread). At BPS = 1:
// 40 and 232 a thread.
template <int NWG, int BPS>
struct Regs {
  static constexpr int THREADS = 128 * NWG + 128;
  static constexpr int ENTRY = 65536 / BPS / THREADS / 8 * 8;
  static constexpr int PRODUCER = BPS == 1 ? 40 : 32;
  static constexpr int CONSUMER_FIT = (ENTRY * THREADS - 128 * PRODUCER) / (128 * NWG) / 8 * 8;
  static constexpr int CONSUMER = CONSUMER_FIT > 232 ? 232 : CONSUMER_FIT;
};
}  // namespace wg

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
// Move registers between warpgroups (all threads of a warpgroup execute it): a producer that
// only issues copies gives its registers up (INC = false) so that the consumers' wgmma
// accumulators and A fragments fit (INC = true; waits until the registers are free).
template <bool INC, int N>
__device__ __forceinline__ void set_max_regs() {
  if constexpr (INC) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N));
  else asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N));
}
template <int N>
__device__ __forceinline__ void wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }

// d[64 x T] (+)= A[64 x 16] (registers) * B[16 x T] (shared memory, descriptor), fp32 accumulate;
// accumulate = 0 overwrites d (the first k-step: the accumulators need no zeroing, which would be
// a non-wgmma definition of wgmma inputs and make ptxas serialise the wgmma, warning C7513).
// The operands after the descriptor: scale-d p (0: d = A B), imm-scale-a 1 and imm-scale-b 1 (no
// negation), imm-trans-b 0 (B K-major, as desc_sw128 describes it).
template <int T> struct Wgmma;

#define QZ_ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
                   "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])

template <> struct Wgmma<16> {
  __device__ __forceinline__ static void run(float* d, const unsigned* a, unsigned long long desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n"
        "}\n"
        : QZ_ACC8(0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
  }
};
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

// A whole stage of KS k-steps (JN instructions each, k-step kk at desc + 2 kk: 32 bytes along k
// per k16) as one wgmma group, waited for before returning. accumulate = 0 overwrites d with the
// first k-step.
// Why wait at once: a group left in flight buys nothing here. Session 19 issued each stage as two
// half-stage groups from two register sets that alternate, dequantising one half while the
// other's group ran (wait<1>; a set rewritten, and the stage's buffer freed, only after the wait
// that retires the group reading it; ptxas kept the sets apart, SASS checked). It passed the
// AWQ and GGUF GPU tests; AWQ ran 3-23 % slower, GGUF within 5 % (bench/NOTES.md, session 19).
// Session 15's garbage with a group in flight was most likely a buffer freed before that wait
// (its x tile is read by the running group); that was not re-run. What sets the pace is the
// consumer warps' own dequant and register-A issue, not their waiting (ncu, session 19): while
// one warpgroup waits, the other dequantises.
template <int T, int JN, int KS>
__device__ __forceinline__ void stage_step(float (&acc)[JN][T / 2], unsigned (&a)[KS][JN][4],
                                           unsigned long long desc, int accumulate) {
#pragma unroll
  for (int kk = 0; kk < KS; ++kk)
#pragma unroll
    for (int j = 0; j < JN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) pin(a[kk][j][e]);
  fence();
#pragma unroll
  for (int kk = 0; kk < KS; ++kk)
#pragma unroll
    for (int j = 0; j < JN; ++j) Wgmma<T>::run(acc[j], a[kk][j], desc + 2 * kk, accumulate || kk > 0);
  commit();
  wait<0>();
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

// mbarriers for the TMA copies (mbarrier.cuh): one arrival per phase (the thread that issues the
// copy, announcing its bytes), completed when the bytes have landed.
using sm90::mbar_arrive;
using sm90::mbar_arrive_expect_tx;
using sm90::mbar_init;
using sm90::mbar_wait;

// The stage ring's mbarriers of both kernels, D of each kind: full[b] (one arrival, the
// producer's, plus the bytes of its copies) and empty[b] (one arrival per consumer warp); empty
// buffer b's barrier is full0 + 8 (D + b). Thread 0 initialises them, then the block meets; call
// with every thread. Returns full0, the shared address of full[0].
template <int D>
__device__ __forceinline__ unsigned init_stage_bars(unsigned long long (&bars)[2 * D], unsigned consumer_warps) {
  const unsigned full0 = static_cast<unsigned>(__cvta_generic_to_shared(bars));
  if (threadIdx.x == 0) {
#pragma unroll
    for (int b = 0; b < D; ++b) {
      mbar_init(full0 + 8 * b, 1);
      mbar_init(full0 + 8 * (D + b), consumer_warps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  return full0;
}

// A block's work under wgmma_tiles.schedule (both kernels): blocks below dp_tiles take tile
// b = blockIdx.x over all of K; block dp_tiles + j takes split j % splits of tile dp_tiles + j / splits.
struct BlockWork {
  bool whole;    // this block's tile walks all of K
  int tile, split, n_split;
  __device__ __forceinline__ BlockWork(int dp_tiles, int splits, int b = blockIdx.x)
      : whole(b < dp_tiles),
        tile(whole ? b : dp_tiles + (b - dp_tiles) / splits),
        split(whole ? 0 : (b - dp_tiles) % splits),
        n_split(whole ? 1 : splits) {}
};

// The consumer warpgroups' own barrier (threads 0 .. threads - 1, named barrier 1): the producer
// warpgroup, past its copies or gone, takes no part.
__device__ __forceinline__ void consumers_sync(int threads) {
  asm volatile("bar.sync 1, %0;\n" :: "r"(threads) : "memory");
}

// Split K in the AWQ kernel (the GGUF kernel sends every split launch to wgmma_reduce): when the
// host gives tile counters, a tile's halves meet in the kernel at 2 splits (handoff, hand_over),
// and past 2 its parts do in BlockWork's own order, a tile's parts side by side (meet); with
// counters null the partials go to a workspace for wgmma_reduce. With handoff
// the blocks run in the order [first halves | whole tiles | second halves]: with more tiles than
// SMs the first wave is the R first halves and whole tiles, so the first halves end early and
// hand their partials over long before the second halves (the second wave, after the whole
// tiles) end; a second half adds the partial to its registers and stores y like a whole tile.
// In the order of BlockWork both halves ran together and met at the end, the last to arrive
// storing its own partial, waiting on a fence and reading both back: ~10 us of a 92 us launch
// (AWQ 4096->12288 M = 512; bench/NOTES.md, session 23).
__device__ __forceinline__ bool handoff(const unsigned* counters, int splits) { return counters && splits == 2; }
__device__ __forceinline__ BlockWork work(int b, int dp_tiles, int splits, const unsigned* counters) {
  BlockWork w(dp_tiles, splits, b);
  if (handoff(counters, splits)) {
    const int r = ((int)gridDim.x - dp_tiles) / 2;   // R: the split tiles
    w.whole = b >= r && b < r + dp_tiles;
    w.tile = w.whole ? b - r : dp_tiles + (b < r ? b : b - r - dp_tiles);
    w.split = w.whole ? 0 : b >= r;
    w.n_split = w.whole ? 1 : 2;
  }
  return w;
}
// blockIdx.x and threadIdx.x read anew (volatile): what an epilogue derives from them is
// recomputed there rather than held in registers through the K loop (ptxas, at its 168-register
// cap, then recomputed the fragment offsets every stage instead; a version that kept them spilled).
__device__ __forceinline__ int block_index() {
  int b;
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(b));
  return b;
}
__device__ __forceinline__ int thread_index() {
  int b;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(b));
  return b;
}
// A split tile's partial in a slot of ws (hand_over and meet below): this thread's accumulators
// at part + f THREADS, f = j T / 8 + v for float4 v of instruction j, so that a warp's float4
// stores and loads are 512 contiguous bytes (fragment order). take_partial sets acc to the slot's
// values (ADD = false) or adds them to it.
template <int T, int JN, int THREADS>
__device__ __forceinline__ void store_partial(const float (&acc)[JN][T / 2], float4* part) {
#pragma unroll
  for (int j = 0; j < JN; ++j)
#pragma unroll
    for (int v = 0; v < T / 8; ++v)
      __stcg(part + (j * T / 8 + v) * THREADS, make_float4(acc[j][4 * v], acc[j][4 * v + 1], acc[j][4 * v + 2], acc[j][4 * v + 3]));
}
template <int T, int JN, int THREADS, bool ADD>
__device__ __forceinline__ void take_partial(float (&acc)[JN][T / 2], const float4* part) {
#pragma unroll
  for (int j = 0; j < JN; ++j)
#pragma unroll
    for (int v = 0; v < T / 8; ++v) {
      const float4 q = __ldcg(part + (j * T / 8 + v) * THREADS);
      float* a = &acc[j][4 * v];
      if constexpr (ADD) {
        a[0] += q.x; a[1] += q.y; a[2] += q.z; a[3] += q.w;
      } else {
        a[0] = q.x; a[1] = q.y; a[2] = q.z; a[3] = q.w;
      }
    }
}

// The hand-over of a split tile's halves (handoff, 2 splits), called by the consumer threads
// (0 .. THREADS - 1, named barrier 1) after the K loop. Each half counts itself on arrival; the
// first stores its accumulators to its tile's slot of ws (T x 64 JN x NWG floats a split tile) in
// fragment order -- a warp's float4 stores are 512 contiguous bytes -- fences and counts again,
// and returns false: its block is done. The second waits for the count of 3 (its partner is past
// its K loop: no deadlock), zeroes the counter for the next launch, adds the partial to acc and
// returns true: acc holds the tile's sum (a + b == b + a: the same whichever half came first).
template <int T, int JN, int THREADS>
__device__ __forceinline__ bool hand_over(float (&acc)[JN][T / 2], float* ws, unsigned* counters, int tile,
                                          int dp_tiles, int tid) {
  __shared__ int arrived;
  if (tid == 0) arrived = atomicAdd(counters + tile, 1);
  consumers_sync(THREADS);
  float4* part = reinterpret_cast<float4*>(ws + (size_t)(tile - dp_tiles) * THREADS * (JN * T / 2)) + tid;
  if (arrived == 0) {
    store_partial<T, JN, THREADS>(acc, part);
    __threadfence();
    consumers_sync(THREADS);
    if (tid == 0) atomicAdd(counters + tile, 1);   // 3 once both have arrived and this partial is out
    return false;
  }
  if (tid == 0) {
    while (atomicAdd(counters + tile, 0) != 3) __nanosleep(64);
    counters[tile] = 0;
    __threadfence();
  }
  consumers_sync(THREADS);
  take_partial<T, JN, THREADS, true>(acc, part);
  return true;
}

// The meeting of a split tile's S > 2 parts (awq_wgmma.cu, where the host gives tile counters
// past 2 splits: T = 16, awq.WGMMA_MEET_MAX_T), called by the consumer threads after the K loop
// with the block's split and the tile's splits S. Every part stores its accumulators to its
// split's slot of ws (T x 64 JN x NWG floats in fragment order, S slots a split tile); after the
// consumers' barrier one thread fences (cumulative: every consumer's stores are ordered before
// what follows) and counts the part: the one that reads S - 1 is the last, and every other
// part's slot is out. It zeroes the counter for the next launch and sums the slots in split order
// -- wgmma_reduce's order, so the same bits whichever part came last -- loading B splits' slots
// at a time (16 float4s in flight a thread: a rolled loop waits one L2 round trip a split), and
// returns true with the tile's sum in acc; the others return false. No part waits: the last reads
// only what has already been counted. (Session 51's version counted arrivals first, as hand_over
// does; all but the last stored afterwards and the last spun on a second count. With one
// counter for both a late arrival could read a count past S - 1 and take the last's path too,
// and the two "last" parts waited for ever; with the counts apart it ran, no faster than
// wgmma_reduce. bench/NOTES.md, sessions 51 and 52.)
template <int T, int JN, int THREADS>
__device__ __forceinline__ bool meet(float (&acc)[JN][T / 2], float* ws, unsigned* counters, int tile,
                                     int dp_tiles, int split, int splits, int tid) {
  constexpr int NF = JN * T / 8;                  // a thread's float4s
  constexpr int SLOT = THREADS * NF;              // float4s a slot
  constexpr int B = NF >= 16 ? 1 : 16 / NF;       // splits loaded at a time
  float4* slots = reinterpret_cast<float4*>(ws) + (size_t)(tile - dp_tiles) * splits * SLOT + tid;
  store_partial<T, JN, THREADS>(acc, slots + (size_t)split * SLOT);
  consumers_sync(THREADS);
  __shared__ unsigned last;
  if (tid == 0) {
    __threadfence();   // after the barrier: cumulative, it orders every consumer's stores before the count
    last = atomicAdd(counters + tile, 1u) == (unsigned)(splits - 1);
    if (last) {
      counters[tile] = 0;
      __threadfence();
    }
  }
  consumers_sync(THREADS);
  if (!last) return false;
  take_partial<T, JN, THREADS, false>(acc, slots);
  auto at = [&](int f) -> float& { return acc[f / (T / 8)][4 * (f % (T / 8))]; };
  int z = 1;
  for (; z + B <= splits; z += B) {
    float4 q[B][NF];
#pragma unroll
    for (int u = 0; u < B; ++u)
#pragma unroll
      for (int f = 0; f < NF; ++f) q[u][f] = __ldcg(slots + (size_t)(z + u) * SLOT + f * THREADS);
#pragma unroll
    for (int u = 0; u < B; ++u)
#pragma unroll
      for (int f = 0; f < NF; ++f) {
        float* a = &at(f);
        a[0] += q[u][f].x; a[1] += q[u][f].y; a[2] += q[u][f].z; a[3] += q[u][f].w;
      }
  }
  for (; z < splits; ++z) take_partial<T, JN, THREADS, true>(acc, slots + (size_t)z * SLOT);
  return true;
}

// The first token row of a tile's x box (both kernels; x_rows = the box's rows, T, or M when
// M < T): the tile's own first row m_tile, except that the last tile of M >= T rows starts at
// M - T instead, so that no box reaches past row M. TMA fills rows past the tensor with zeros
// slowly: a tile with 224 of its 256 rows past M made a launch 30 % slower than the same work
// on a padded x (bench/NOTES.md, session 17). A shifted tile computes the rows before m_tile
// again and stores only its own, [m_tile, min(m_tile + T, M)).
__device__ __forceinline__ int x_box_row(int m_tile, int M, int x_rows) { return min(m_tile, M - x_rows); }
// ... and that tile's m_tile again, for its epilogue, from m0 and the launch's constants (only the
// last token tile's box can start before its m_tile, and that box ends at row M), so that the
// K loop keeps one row number live, not two (two cost the AWQ kernel 3-6 %, session 17).
__device__ __forceinline__ int first_stored_row(int m0, int M, int x_rows, int tiles_m, int T) {
  return m0 == M - x_rows ? (tiles_m - 1) * T : m0;
}

// One TMA copy: the box of `map` at coordinates (c0 innermost, c1) into shared address dst,
// its bytes announced to mbarrier bar when they land. Box elements outside the tensor read as 0.
__device__ __forceinline__ void tma_2d(unsigned dst, const TmaDesc* map, int c0, int c1, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
// ... of a 3-D map: coordinates (c0 innermost, c1, c2); the box lands dense, innermost first.
__device__ __forceinline__ void tma_3d(unsigned dst, const TmaDesc* map, int c0, int c1, int c2, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
      :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
__device__ __forceinline__ void prefetch_map(const TmaDesc* map) {
  asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

// The GGUF kernel's GLU epilogue, second half (GLU: a block computes FR gate rows and the FR
// matching up rows of the fused weight; the AWQ kernel splits its outputs between twin threads
// instead, awq_wgmma.cu says why): the block's gate and up tiles, fp16 [T][FR + 8] each
// (token-major, rows padded by 8 halves so that the consumer warps' stores of their fragments
// into them do not conflict), gate at `tiles` and up right after it, written and met at a
// barrier by the caller's `threads` consumer threads, become
//   y[m0 + tm][n0 + f] = swiglu(gate, up)   (swiglu.cuh)
// for the block's stored tokens [m_tile, M) and columns below ny (even, as are n0 and f; y
// 4-byte aligned). Consecutive threads take consecutive column pairs (coalesced half2 stores),
// in a rolled loop: unrolled like the main epilogue, 64-128 outputs a thread made the kernel's
// code ~200 KB, and the launch 36-50 us slower than the product alone (H100, q4_0
// 4096->24576 M = 128 / 512, bench/NOTES.md, session 21).
template <int T, int FR>
__device__ __forceinline__ void glu_store(const half* tiles, half* y, int m0, int m_tile, int M, int n0, int ny,
                                          int threads) {
  constexpr int P = FR + 8;
#pragma unroll 2
  for (int q = threadIdx.x; q < T * FR / 2; q += threads) {
    const int tm = q / (FR / 2), f = 2 * (q % (FR / 2));
    const int m = m0 + tm, n = n0 + f;
    if (m < m_tile || m >= M || n >= ny) continue;
    const float2 g = __half22float2(*reinterpret_cast<const half2*>(tiles + tm * P + f));
    const float2 u = __half22float2(*reinterpret_cast<const half2*>(tiles + (T + tm) * P + f));
    *reinterpret_cast<half2*>(y + (size_t)m * ny + n) = __floats2half2_rn(swiglu(g.x, u.x), swiglu(g.y, u.y));
  }
}

}  // namespace wg
#endif

// ---- split K's reduce (plain CUDA: every target) ----
// Partials p[V i .. V i + V) (V = 4: one 16-byte load; else V = 1), through L2.
template <int V>
struct Part { float v[V]; };
template <int V>
__device__ __forceinline__ Part<V> load_part(const float* p, size_t i) {
  Part<V> r;
  if constexpr (V == 4) {
    const float4 q = __ldcg(reinterpret_cast<const float4*>(p) + i);
    r.v[0] = q.x; r.v[1] = q.y; r.v[2] = q.z; r.v[3] = q.w;
  } else {
    r.v[0] = __ldcg(p + i);
  }
  return r;
}
// The partials of V consecutive elements, summed in split order. The loads go out four splits at
// a time (a rolled loop waited for each partial before asking for the next: one L2 round trip a
// split, most of the launch at small M -- bench/NOTES.md, session 51).
template <int V>
__device__ __forceinline__ void sum_splits(float (&s)[V], const float* __restrict__ part, size_t o, size_t stride,
                                           int splits) {
  const float* p = part + o;
  const size_t st = stride / V;   // stride is a multiple of V floats
  Part<V> a = load_part<V>(p, 0);
  int z = 1;
  for (; z + 4 <= splits; z += 4) {
    Part<V> q[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) q[u] = load_part<V>(p, (z + u) * st);
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int e = 0; e < V; ++e) a.v[e] += q[u].v[e];
  }
  for (; z < splits; ++z) {
    const Part<V> q = load_part<V>(p, z * st);
#pragma unroll
    for (int e = 0; e < V; ++e) a.v[e] += q.v[e];
  }
#pragma unroll
  for (int e = 0; e < V; ++e) s[e] = a.v[e];
}

// wgmma_reduce, a launch of its own after either kernel: y = the sum of the split tiles'
// partials in split order, one thread V consecutive columns
// (V = 4 when N % 4 == 0 and y is 8-byte aligned: 16-byte partial loads; else 1): the elements
// of tiles dp_tiles .. tiles - 1 (count = their number x T rows x `rows` columns), numbered tile
// by tile, token-major inside a tile. Partials: wg::SplitParts [splits][M][pitch] fp32, each
// split tile's rows [m_tile, min(m_tile + T, M)) written by its blocks. GLU (the kernels' fused
// gate/up epilogue): y [M, N] = swiglu(gate, up) (swiglu.cuh) of the gate and up partials, each
// sum rounded to fp16 first as y would hold it; `rows` counts y's columns per tile. Why a
// launch of its own over the whole GPU:
// summed inside the kernel by each tile's last block, the few blocks doing it made GGUF's split
// launches 2x slower with scalar loads (4096->4096 Q4_0 M = 64: 16.4 -> 36.9 us, session 16) and
// 5-12 % slower with coalesced fragment-order partials (session 17, bench/NOTES.md). The AWQ
// kernel uses it past 2 splits at T > 16; at 2 its halves meet in the kernel (hand_over), and
// past 2 at T = 16 its parts do (meet; awq_wgmma.cu says why).
template <int V, bool GLU = false>
__global__ void wgmma_reduce(const float* __restrict__ part, half* __restrict__ y, int M, int N, int T, int rows,
                             int tiles_m, int dp_tiles, int splits, long long count) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
  const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * V;
  if (i >= count) return;
  const int per = T * rows;
  const int tile = dp_tiles + (int)(i / per), r = (int)(i % per);
  const int m = (tile % tiles_m) * T + r / rows, n = (tile / tiles_m) * rows + r % rows;
  if (m >= M || n >= N) return;   // V = 4: N % 4 == 0, so n + 3 < N too
  const wg::SplitParts parts(N, rows, dp_tiles, tiles_m, GLU);
  const size_t o = parts.at(0, M, m, n), stride = (size_t)M * parts.pitch;
  float v[V];
  sum_splits<V>(v, part, o, stride, splits);
  if constexpr (GLU) {
    float u[V];
    sum_splits<V>(u, part, o + parts.w, stride, splits);
#pragma unroll
    for (int e = 0; e < V; ++e)
      v[e] = swiglu(__half2float(__float2half_rn(v[e])), __half2float(__float2half_rn(u[e])));
  }
  half* yo = y + (size_t)m * N + n;
  if constexpr (V == 4) {
    const half2 lo = __floats2half2_rn(v[0], v[1]), hi = __floats2half2_rn(v[2], v[3]);
    *reinterpret_cast<uint2*>(yo) = make_uint2(*reinterpret_cast<const unsigned*>(&lo),
                                               *reinterpret_cast<const unsigned*>(&hi));
  } else {
    yo[0] = __float2half_rn(v[0]);
  }
}
