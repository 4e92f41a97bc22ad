// gguf_mmvq.cu -- y (M, N) = x (M, K) @ W (N, K)^T for small M (1..8): the decode-time GEMV.
//
// Inputs: W in its GGUF block bytes (N rows of nb = K/32 blocks, see gguf_common.cuh), the
// activations already quantized to Q8_1 (M rows of nb 36-byte blocks, q8_1_quantize.cu).
// For each output y[m, n]:
//   sumi_b = sum_{j<32} q_w[b, j] * q_a[m, b, j]       int32, 8 x __dp4a (4 int8 pairs each)
//   y[m, n] = sum_b term(sumi_b, d_w, m_w, d_a, s_a)     fp32; term = the format's block dot
//   written as fp16 (round to nearest).
//
// Shape of the work: at M <= 8 the weight (4.5..8.5 bits/element) is the only large operand, so
// the kernel is a stream over W and its speed is DRAM bandwidth. One CTA of 128 threads owns
// R consecutive weight rows; thread t takes blocks t, t+128, ... of each of them, unpacks each
// weight block once into registers and reuses it for all M activation rows (M and R are template
// parameters, so the M x R accumulators live in registers and every loop is unrolled). Why R > 1:
// every CTA re-reads the whole Q8_1 activation (M * K * 36/32 bytes) from L1/L2; with one row
// per CTA that is N * M * K * 1.125 bytes of L2 traffic -- at M = 8 many times the weight
// itself, and the real limit. R rows per CTA divide it by R (R is picked per M from the bench).
// Two kernels share this plan and the arithmetic: mmvq (dispatched) loads straight from global
// memory; mmvq_staged (experiment, below) stages the bytes through shared memory with 16-byte
// cp.async copies -- measured slower, see bench/notes-gguf.md.
// Each thread finishes whole blocks, so every per-block term is formed from the full 32-element
// sumi -- bit-identical to the emulation's term (llama.cpp splits a block over threads and
// scales partial sums instead). A warp's 32 threads read 32 consecutive blocks of one row: a
// contiguous 576..1088-byte run, so DRAM sees full sectors even though a thread's own loads are
// 2- or 4-byte wide.
// Reduction: xor-shuffle across the warp, then the 4 warp sums through shared memory.
// Rows past N (the last CTA when R does not divide N) are computed on row N-1 and not stored.
#include "gguf_common.cuh"

constexpr int MMVQ_THREADS = 128;

template <class F, int M, int R>
__global__ void __launch_bounds__(MMVQ_THREADS)
mmvq(const uint8_t* __restrict__ W, const uint8_t* __restrict__ A, __half* __restrict__ y, int N, int nb) {
    const int n0 = blockIdx.x * R;
    const uint8_t* wrow[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wrow[r] = W + (long long)min(n0 + r, N - 1) * nb * F::BYTES;
    float acc[M][R];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;

    for (int kb = threadIdx.x; kb < nb; kb += MMVQ_THREADS) {
        float dw[R], mw[R];
        int q[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) F::unpack(wrow[r] + (long long)kb * F::BYTES, dw[r], mw[r], q[r]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float da, sa;
            int a[8];
            load_q8_1(A + ((long long)m * nb + kb) * Q8_1_BYTES, da, sa, a);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                int sumi = 0;
#pragma unroll
                for (int i = 0; i < 8; ++i) sumi = __dp4a(q[r][i], a[i], sumi);
                acc[m][r] += F::term(sumi, dw[r], mw[r], da, sa);
            }
        }
    }

    __shared__ float partial[MMVQ_THREADS / 32][M * R];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float v = acc[m][r];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
            if (lane == 0) partial[warp][m * R + r] = v;
        }
    __syncthreads();
    if (threadIdx.x < M * R) {
        const int m = threadIdx.x / R, n = n0 + threadIdx.x % R;
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < MMVQ_THREADS / 32; ++w) s += partial[w][threadIdx.x];
        if (n < N) y[(long long)m * N + n] = __float2half_rn(s);
    }
}

// ---------------------------------------------------------------------------------------------
// mmvq_staged (EXPERIMENT, not dispatched: slower on the H200, see bench/notes-gguf.md): the same
// arithmetic, but the bytes reach the threads through shared memory.
//
// Idea: in mmvq a warp's load instruction gathers 2..4 bytes per lane at a 18..36-byte
// stride, so one instruction spans 5..9 cache lines and the L1 spends that many wavefronts on
// it: per 32 blocks of one row about 9 x 5 wavefronts for the weight and 9 x 9 for every Q8_1
// activation row. That L1 work, not DRAM, capped M = 1 near 2 TB/s. Here a stage of SB = 128
// consecutive blocks of each of the R weight rows (and, when it fits, of the M activation rows)
// is copied with cp.async in aligned 16-byte chunks -- 4 wavefronts per 512 bytes, coalesced,
// and issued all at once, so a CTA has its whole stage (4.6..17 KB) in flight. Blocks are only
// 2-byte aligned, so the chunks are the 16-byte-aligned ones covering the byte run; byte g of
// the run lands at offset (g mod 16) + (g - run start) of the stage buffer, i.e. the buffer
// keeps the global alignment mod 16 and F::unpack reads it exactly as it read global memory.
// Chunks that stick out of the tensor (only at its first and last byte, when those are not
// 16-byte aligned) are copied in 2-byte pieces, so nothing outside [W, W + N*nb*BYTES) is read.
// Two stages (when they fit in 46 KB of static shared memory) overlap the next stage's copy with
// this stage's DP4A work; the CTA's other warps and the SM's other CTAs overlap the rest.
// Thread t then decodes block t of the stage from shared memory, exactly as mmvq does
// (whole blocks per thread, same per-block term, same reduction).
// Measured: 1.3-5x slower than mmvq. The activation run is copied with cp.async.cg, which skips
// L1, so every CTA fetches the whole Q8_1 activation from L2 (mmvq's plain loads hit L1, shared
// by the SM's 8-16 CTAs); time grew with the number of CTAs (R = 1: 4096 CTAs, 65 us).
namespace mmvq_detail {
typedef unsigned long long addr_t;

__device__ __forceinline__ void cp_async16(void* smem_dst, const void* src) {
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N_>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N_) : "memory"); }

// Copy the byte run [g, g + len) of the tensor [lo, hi) to dst (16-byte aligned shared memory):
// 16-byte chunk c of the aligned cover goes to dst + 16c, so byte g lands at dst + (g & 15).
__device__ __forceinline__ void stage_run(uint8_t* dst, const uint8_t* g, int len, const uint8_t* lo,
                                          const uint8_t* hi) {
    const addr_t a0 = reinterpret_cast<addr_t>(g) & ~addr_t(15);
    const addr_t a1 = (reinterpret_cast<addr_t>(g) + addr_t(len) + 15) & ~addr_t(15);
    const int chunks = int((a1 - a0) >> 4);
    for (int c = threadIdx.x; c < chunks; c += MMVQ_THREADS) {
        const uint8_t* src = reinterpret_cast<const uint8_t*>(a0 + 16 * addr_t(c));
        if (src >= lo && src + 16 <= hi) {
            cp_async16(dst + 16 * c, src);
        } else {  // the tensor's unaligned first / last chunk: only its own (2-byte aligned) bytes
#pragma unroll
            for (int j = 0; j < 16; j += 2)
                if (src + j >= lo && src + j + 2 <= hi)
                    *reinterpret_cast<uint16_t*>(dst + 16 * c + j) = *reinterpret_cast<const uint16_t*>(src + j);
        }
    }
}
}  // namespace mmvq_detail

template <class F, int M, int R>
struct MMVQStaging {
    static constexpr int SB = MMVQ_THREADS;                       // blocks per row per stage
    static constexpr int WROW = (SB * F::BYTES + 31) / 16 * 16;   // + up to 15 bytes of shift
    static constexpr int AROW = (SB * Q8_1_BYTES + 31) / 16 * 16;
    static constexpr int LIMIT = 46 * 1024;
    static constexpr bool STAGE_A = R * WROW + M * AROW <= LIMIT;  // else A is read from global
    static constexpr int STAGE = R * WROW + (STAGE_A ? M * AROW : 0);
    static constexpr int STAGES = 2 * STAGE <= LIMIT ? 2 : 1;
};

template <class F, int M, int R>
__global__ void __launch_bounds__(MMVQ_THREADS)
mmvq_staged(const uint8_t* __restrict__ W, const uint8_t* __restrict__ A, __half* __restrict__ y, int N, int nb) {
    using P = MMVQStaging<F, M, R>;
    constexpr int SB = P::SB;
    __shared__ __align__(16) uint8_t smem[P::STAGES][P::STAGE];
    const int n0 = blockIdx.x * R;
    const long long row_bytes = (long long)nb * F::BYTES;
    const uint8_t* w_end = W + (long long)N * row_bytes;
    const uint8_t* a_end = A + (long long)M * nb * Q8_1_BYTES;
    const uint8_t* wrow[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wrow[r] = W + (long long)min(n0 + r, N - 1) * row_bytes;

    const int stages = (nb + SB - 1) / SB;
    auto issue = [&](int s) {
        uint8_t* buf = smem[s % P::STAGES];
        const int kb0 = s * SB, cnt = min(SB, nb - kb0);
#pragma unroll
        for (int r = 0; r < R; ++r)
            mmvq_detail::stage_run(buf + r * P::WROW, wrow[r] + (long long)kb0 * F::BYTES, cnt * F::BYTES, W, w_end);
        if constexpr (P::STAGE_A) {
#pragma unroll
            for (int m = 0; m < M; ++m)
                mmvq_detail::stage_run(buf + R * P::WROW + m * P::AROW, A + ((long long)m * nb + kb0) * Q8_1_BYTES,
                                       cnt * Q8_1_BYTES, A, a_end);
        }
        mmvq_detail::cp_async_commit();
    };

    float acc[M][R];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;

    issue(0);
    for (int s = 0; s < stages; ++s) {
        if constexpr (P::STAGES == 2) {  // copy stage s + 1 while stage s is computed
            if (s + 1 < stages) {
                issue(s + 1);
                mmvq_detail::cp_async_wait<1>();
            } else {
                mmvq_detail::cp_async_wait<0>();
            }
        } else {  // one buffer: refill it after the previous stage's trailing barrier
            if (s > 0) issue(s);
            mmvq_detail::cp_async_wait<0>();
        }
        __syncthreads();
        const uint8_t* buf = smem[s % P::STAGES];
        const int kb = s * SB + threadIdx.x;
        if (kb < nb) {
            float dw[R], mw[R];
            int q[R][8];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int shift = int(reinterpret_cast<mmvq_detail::addr_t>(wrow[r]) & 15);
                F::unpack(buf + r * P::WROW + shift + threadIdx.x * F::BYTES, dw[r], mw[r], q[r]);
            }
#pragma unroll
            for (int m = 0; m < M; ++m) {
                float da, sa;
                int a[8];
                if constexpr (P::STAGE_A) {
                    const int shift = int(reinterpret_cast<mmvq_detail::addr_t>(A + (long long)m * nb * Q8_1_BYTES) & 15);
                    load_q8_1(buf + R * P::WROW + m * P::AROW + shift + threadIdx.x * Q8_1_BYTES, da, sa, a);
                } else {
                    load_q8_1(A + ((long long)m * nb + kb) * Q8_1_BYTES, da, sa, a);
                }
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    int sumi = 0;
#pragma unroll
                    for (int i = 0; i < 8; ++i) sumi = __dp4a(q[r][i], a[i], sumi);
                    acc[m][r] += F::term(sumi, dw[r], mw[r], da, sa);
                }
            }
        }
        __syncthreads();  // the buffer of stage s is refilled by issue(s + STAGES)
    }

    __shared__ float partial[MMVQ_THREADS / 32][M * R];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float v = acc[m][r];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
            if (lane == 0) partial[warp][m * R + r] = v;
        }
    __syncthreads();
    if (threadIdx.x < M * R) {
        const int m = threadIdx.x / R, n = n0 + threadIdx.x % R;
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < MMVQ_THREADS / 32; ++w) s += partial[w][threadIdx.x];
        if (n < N) y[(long long)m * N + n] = __float2half_rn(s);
    }
}
