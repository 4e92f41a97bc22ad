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
// one weight row; thread t takes blocks t, t+128, ... and unpacks each block once into registers,
// then reuses it for all M activation rows (M is a template parameter, so the M accumulators
// live in registers and the activation loop is unrolled). Each thread finishes whole blocks,
// so every per-block term is formed from the full 32-element sumi -- bit-identical to the
// emulation's term (llama.cpp splits a block over threads and scales partial sums instead).
// A warp's 32 threads read 32 consecutive blocks of one row: a contiguous 576..1088-byte run,
// so DRAM sees full sectors even though a thread's own loads are 2- or 4-byte wide. The
// activations (M * K * 36/32 bytes) are re-read by every CTA and stay in L1/L2.
// Reduction: xor-shuffle across the warp, then the 4 warp sums through shared memory.
#include "gguf_common.cuh"

constexpr int MMVQ_THREADS = 128;

template <class F, int M>
__global__ void __launch_bounds__(MMVQ_THREADS)
mmvq(const uint8_t* __restrict__ W, const uint8_t* __restrict__ A, __half* __restrict__ y, int N, int nb) {
    const int n = blockIdx.x;
    const uint8_t* wrow = W + (long long)n * nb * F::BYTES;
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;

    for (int kb = threadIdx.x; kb < nb; kb += MMVQ_THREADS) {
        float dw, mw;
        int q[8];
        F::unpack(wrow + (long long)kb * F::BYTES, dw, mw, q);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float da, sa;
            int a[8];
            load_q8_1(A + ((long long)m * nb + kb) * Q8_1_BYTES, da, sa, a);
            int sumi = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) sumi = __dp4a(q[i], a[i], sumi);
            acc[m] += F::term(sumi, dw, mw, da, sa);
        }
    }

    __shared__ float partial[MMVQ_THREADS / 32][M];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], off);
        if (lane == 0) partial[warp][m] = acc[m];
    }
    __syncthreads();
    if (threadIdx.x < M) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < MMVQ_THREADS / 32; ++w) s += partial[w][threadIdx.x];
        y[(long long)threadIdx.x * N + n] = __float2half_rn(s);
    }
}
