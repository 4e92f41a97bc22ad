// awq_strip.cu -- AWQ W4A16 at M = 1 without a split-K pass: one block (CL = 1), or one cluster
// of CL blocks (Hopper), per 64 output columns (8 column words, a 32-byte strip of every weight
// row), all of K in the block or cluster.
//
//   y[n] = fp16( sum_g  s[g, n] * sum_{k in g} (q[k, n] - z[g, n]) * x[k] )
//
// The same function and arithmetic as awq_gemv.cu with one column word per lane (exact products
// on the tensor cores, fp32 sums per group, the zero taken out as z * sum_k x_k, the scale once
// per group; reference/awq_fp16.py::emulate_group_scaled and its fp32-order bound).
//
// Why it exists. AWQ's [K, N/8] layout gives a 4096-column weight only 32-64 column tiles of
// 64-128 B rows, so awq_small and awq_gemv split K across blocks to fill the SMs, and each split
// tile ends in a fence / ticket / read-back tail. A block that owns a 32-byte strip of every row
// needs no split: 64 blocks for N = 4096, and a read of the qweight in that pattern (64 SMs, 16
// warps each) ran at 85-88 % of the fastest plain read of the same bytes (bench/NOTES.md, session
// 48). With half the SMs busy, though, the loop must spend few instructions per byte: awq_small's
// and awq_gemv's loops without a split were issue-bound there (Nsight Compute: 122 and 57
// instructions per warp step) and ran at half the read's rate. So:
// * Lane (g, t) keeps column word 8 b + g and, in k-step s, rows 8 s + 2t and 8 s + 2t + 1 --
//   awq_gemv.cu's diagonal use of mma.m16n8k16 (its header explains it): the 8 lanes of equal t
//   read the strip's 32 bytes of one row, two 4-byte loads a lane a step.
// * Each warp owns a run of whole groups, and a ring of D steps divides a group (D | G / 8), so
//   the group's fix-up runs after its rounds instead of a test in every step; the ring's reloads
//   are unconditional in every round but the warp's last, which is a second, reload-free copy of
//   the round (a load under a per-step condition made ptxas wait for it: awq_gemv.cu). A step is
//   ~24 instructions in the SASS of <16, 8> (nvcc 13, sm_90: 197 a reload round of 8 steps):
//   3 loads, 2 byte permutes, 2 shifts, 8 masks, 3 MMAs, 2 address steps, the rest register
//   copies and the round's selector set-up; the fix-up ~64 a group. The loads still wait more
//   than the ring suggests: ptxas puts 18 of a round's 24 reloads (10 of 12 at D = 4) in
//   temporaries copied into the ring at the round's end, and the next group's scale and zero
//   words, loaded under `grp + 1 < g1`, are copied into sv / zv ~40 instructions later, at the
//   fix-up's end: each copy waits for its load. (Requesting the next group's words at the group's
//   start instead, unconditionally, ran 1-3 % slower, and reloading each slot after its step's
//   MMAs, which removes the copies, 0.4-2.6 % slower: bench/NOTES.md session 48, sections 7, 8.)
// * The warps meet in shared memory in fixed order; one launch, no workspace, graph-replayable.
// * Clusters (CL > 1, sm_90's thread-block clusters): with few strips (N <= 4096: 64 blocks or
//   fewer) half the SMs or more sit idle and each warp walks many groups. CL blocks of a cluster
//   share one strip, each warp a 1 / (CL * WARPS) run of its groups, and every warp stores its 8
//   column sums straight into block 0's shared memory (mapa + st.shared::cluster, distributed
//   shared memory); one cluster barrier (release / acquire) later block 0 sums them in fixed
//   order. The split costs no workspace, no fence / ticket and no second launch. Each block
//   arrives on the cluster barrier at its start and waits on it before its remote stores, so no
//   block writes into block 0 before block 0 runs (the CUDA guide's rule for distributed shared
//   memory) at no cost: by then every block has long started. Measured (H100, PDL, us; the
//   dispatch before -> <4, 8, 8>, bench/NOTES.md session 49): 4096->1024 5.25 -> 4.25, 4096->4096
//   (strip) 7.47 -> 7.05, 2048->2048 5.16 -> 4.26, 1024->1024 5.11 -> 3.47, 8192->2048 9.16 -> 7.61;
//   it loses past ~8192 x 4096 (12288->4096 15.2 vs 14.5) and with more strips (4096->6144 10.7
//   vs 9.5), where one block a strip or a split-K pass keeps the SMs busy already.
// * Tails: K is a multiple of the group size. Lanes whose column word lies past N/8 (the last
//   block when N/8 % 8 != 0) read the last word instead and store nothing. A warp without groups
//   (K / G < CL * WARPS) adds zeros.
//
// Measured on the H100 under PDL (bench/NOTES.md session 48; awq.py's STRIP_* comment has the
// sweep), CL = 1, us, against awq_small: 4096->4096 7.58 vs 8.69, 4096->6144 9.40 vs 10.08,
// 5120->5120 11.20 vs 13.91; the runner's AWQ decode 358 -> 365 tok/s with Qwen3-8B's qkv and
// o_proj on it. With few blocks (4096->2048), many steps a warp (12288->4096: 96 k-steps, 18.2 vs
// 14.7) or a second wave of blocks (4096->12288) it loses: dispatch (awq.STRIP_* and CLUSTER_*)
// takes each form only where it won.
#include "awq_common.cuh"

// Thread-block clusters (the header's "Clusters") are sm_90's: older GPUs compile the attribute
// away, and CL > 1 is never launched there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define QZ_CLUSTER_X(n)
#else
#define QZ_CLUSTER_X(n) __cluster_dims__(n, 1, 1)
#endif

namespace strip {
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_sync() {   // release my writes, acquire the others'
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// v[0..7] into block 0's copy of the shared array at `local` (16-byte aligned)
__device__ __forceinline__ void store8_block0(float* local, const float* v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, 0;" : "=r"(r) : "r"(awq::smem_addr(local)));
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(r), "f"(v[0]), "f"(v[1]), "f"(v[2]),
               "f"(v[3]) : "memory");
  asm volatile("st.shared::cluster.v4.f32 [%0+16], {%1, %2, %3, %4};" ::"r"(r), "f"(v[4]), "f"(v[5]),
               "f"(v[6]), "f"(v[7]) : "memory");
#else
  __trap();   // CL > 1 is never launched before sm_90
#endif
}

// Both forms' body (the kernels below): grid (CL * ceil(N/8 / 8)); block 32*WARPS threads;
// D | G / 8; clusters of CL blocks along x
template <int WARPS, int D, int CL>
__device__ __forceinline__ void body(const half* __restrict__ x, const unsigned* __restrict__ qweight,
                                     const unsigned* __restrict__ qzeros, const half* __restrict__ scales,
                                     half* __restrict__ y, int K, int N, int G) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
  if (CL > 1) strip::cluster_arrive_relaxed();   // "I have started": waited for before block 0 is written
  __shared__ __align__(16) float red[CL * WARPS][64];
  const int n8 = N / 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int rank = CL > 1 ? (int)(blockIdx.x % CL) : 0;   // == %cluster_ctarank for a 1-D grid
  const int sb = CL > 1 ? (int)(blockIdx.x / CL) : (int)blockIdx.x;
  const int cw = min(sb * 8 + g, n8 - 1);
  const int spg = G / 8;   // k-steps per group, a multiple of D
  const int ngroups = K / G;
  const int gw = rank * WARPS + warp;   // the warp's place among the cluster's CL * WARPS
  const int g0 = (int)((long long)ngroups * gw / (CL * WARPS));
  const int g1 = (int)((long long)ngroups * (gw + 1) / (CL * WARPS));
  // B fragment selectors (awq_gemv.cu): x[r0], x[r1] onto this lane's own output columns
  const unsigned sel0 = g == 2 * t ? 0x4410u : g == 2 * t + 1 ? 0x1044u : 0x4444u;
  const unsigned sel1 = g == 2 * t ? 0x4432u : g == 2 * t + 1 ? 0x3244u : 0x4444u;
  const unsigned ones[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
  float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  if (g0 < g1) {
    const size_t step_words = (size_t)8 * n8;
    const unsigned* p0 = qweight + (size_t)g0 * G * n8 + (size_t)(2 * t) * n8 + cw;   // row r0
    const unsigned* p1 = p0 + n8;                                                       // row r1
    const unsigned* xp = reinterpret_cast<const unsigned*>(x) + (size_t)g0 * G / 2 + t;   // (x[r0], x[r1])
    const int total = (g1 - g0) * spg;
    unsigned w0[D], w1[D], xr[D];
#pragma unroll
    for (int d = 0; d < D; ++d) {   // D <= total: a warp holds at least one group
      w0[d] = __ldg(p0); w1[d] = __ldg(p1); xr[d] = __ldg(xp);
      p0 += step_words; p1 += step_words; xp += 4;
    }
    uint4 sv = __ldg(reinterpret_cast<const uint4*>(scales + (size_t)g0 * N + 8 * cw));
    unsigned zv = __ldg(qzeros + (size_t)g0 * n8 + cw);
    // one step on ring slot d: sum x on the all-ones MMA, both column halves of the lane's word
    auto step = [&](float (&part)[2][4], float (&sx)[4], unsigned a0, unsigned a1, unsigned xw) {
      const unsigned b0 = __byte_perm(xw, 0u, sel0), b1 = __byte_perm(xw, 0u, sel1);
      awq::mma16816(sx, ones, b0, b1);
      const unsigned u0 = a0 >> 8, u1 = a1 >> 8;
      const unsigned lo[4] = {a0 & awq::kLowMask, a0 & awq::kHighMask, a1 & awq::kLowMask,
                              a1 & awq::kHighMask};
      const unsigned hi[4] = {u0 & awq::kLowMask, u0 & awq::kHighMask, u1 & awq::kLowMask,
                              u1 & awq::kHighMask};
      awq::mma16816(part[0], lo, b0, b1);
      awq::mma16816(part[1], hi, b0, b1);
    };
    int done = 0;
    for (int grp = g0; grp < g1; ++grp) {
      float part[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      float sx[4] = {0.f, 0.f, 0.f, 0.f};
      for (int r = 0; r < spg; r += D, done += D) {
        if (done + D < total) {   // not the warp's last round: reload every slot
#pragma unroll
          for (int d = 0; d < D; ++d) {
            const unsigned a0 = w0[d], a1 = w1[d], xw = xr[d];
            w0[d] = __ldg(p0); w1[d] = __ldg(p1); xr[d] = __ldg(xp);
            p0 += step_words; p1 += step_words; xp += 4;
            step(part, sx, a0, a1, xw);
          }
        } else {
#pragma unroll
          for (int d = 0; d < D; ++d) step(part, sx, w0[d], w1[d], xr[d]);
        }
      }
      // the group's fix-up, the next group's scale and zero words requested first
      const unsigned su[4] = {sv.x, sv.y, sv.z, sv.w};
      unsigned zu[4];
      awq::gemv_zero_halves(zv, zu);
      if (grp + 1 < g1) {
        sv = __ldg(reinterpret_cast<const uint4*>(scales + (size_t)(grp + 1) * N + 8 * cw));
        zv = __ldg(qzeros + (size_t)(grp + 1) * n8 + cw);
      }
      awq::gemv_group_fixup(acc, part, sx[0], su, zu);
    }
  }
  // units off, the four lanes t of a column word meet, then the warps in fixed order
  float v[8];
  awq::gemv_column_sums(acc, v);
  if (CL > 1) {
    strip::cluster_wait();   // every block of the cluster has started: block 0's array exists
    if (t == 0) strip::store8_block0(&red[gw][8 * g], v);
    strip::cluster_sync();
    if (rank != 0) return;
  } else {
    if (t == 0) {
#pragma unroll
      for (int c = 0; c < 8; ++c) red[warp][8 * g + c] = v[c];
    }
    __syncthreads();
  }
  if (threadIdx.x < 8) {
    const int cwo = sb * 8 + threadIdx.x;
    if (cwo < n8) {
      float o[8];
      awq::gemv_sum_warps(o, red, 8 * threadIdx.x);
      awq::store8_half(y + 8 * cwo, o);
    }
  }
}
}  // namespace strip

// The one-block form: a plain kernel. (One template with __cluster_dims__(CL, 1, 1) would make it
// an explicit-cluster kernel of 1 x 1 x 1 blocks on sm_90 -- .explicitcluster /
// .reqnctapercluster 1, 1, 1 in its PTX, a cluster launch -- so the two forms are overloads.)
template <int WARPS, int D>
__global__ void __launch_bounds__(32 * WARPS)
awq_strip_kernel(const half* __restrict__ x, const unsigned* __restrict__ qweight,
                 const unsigned* __restrict__ qzeros, const half* __restrict__ scales,
                 half* __restrict__ y, int K, int N, int G) {
  strip::body<WARPS, D, 1>(x, qweight, qzeros, scales, y, K, N, G);
}

// The cluster form (sm_90): CL > 1 blocks a strip, grouped by the kernel's own cluster dims
template <int WARPS, int D, int CL>
__global__ void __launch_bounds__(32 * WARPS) QZ_CLUSTER_X(CL)
awq_strip_kernel(const half* __restrict__ x, const unsigned* __restrict__ qweight,
                 const unsigned* __restrict__ qzeros, const half* __restrict__ scales,
                 half* __restrict__ y, int K, int N, int G) {
  static_assert(CL > 1, "CL = 1 is the one-block form, awq_strip_kernel<WARPS, D>");
  strip::body<WARPS, D, CL>(x, qweight, qzeros, scales, y, K, N, G);
}
