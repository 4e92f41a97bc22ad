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
// (A variant that staged weight and activation runs through shared memory with 16-byte cp.async
// copies was measured 1.3-5x slower -- bench/notes-gguf.md, code in git history, commit a2ba16b.)
// Each thread finishes whole blocks, so every per-block term is formed from the full 32-element
// sumi -- bit-identical to the emulation's term (llama.cpp splits a block over threads and
// scales partial sums instead). A warp's 32 threads read 32 consecutive blocks of one row: a
// contiguous 576..1088-byte run, so DRAM sees full sectors even though a thread's own loads are
// 2- or 4-byte wide.
// Reduction: xor-shuffle across the warp, then the 4 warp sums through shared memory, in warp
// order (decode_persistent.cu reproduces this order for the formats whose one-token GEMV is this
// kernel). Rows past N (the last CTA when R does not divide N) are computed on row N-1 and not
// stored. Which formats and M run this kernel and which the vector-load one (gguf_mmvq16.cu), and
// with which R: gguf.MMVQ_CHOICE (measured); a weight not aligned for the wide loads always
// runs this one.
#include "gguf_common.cuh"

constexpr int MMVQ_THREADS = 128;

template <class F, int M, int R>
__global__ void __launch_bounds__(MMVQ_THREADS)
mmvq(const uint8_t* __restrict__ W, const uint8_t* __restrict__ A, __half* __restrict__ y, int N, int nb) {
    pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
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
            const float v = warp_sum(acc[m][r]);
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
