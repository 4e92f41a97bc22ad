// gguf_mmq.cu -- y (M, N) = x (M, K) @ W (N, K)^T for mid-size M: a shared-memory tiled DP4A GEMM.
//
// Same math as gguf_mmvq.cu (per block b: sumi = 8 x __dp4a, term = the format's block dot in
// fp32, y = fp32 sum over blocks, fp16 out), but at M > 8 each weight block is used by many
// activation rows, so we tile: a CTA computes a 64 (M) x 64 (N) output tile and walks K in
// steps of BK = 4 blocks (128 elements).
//
// Per step every one of the 256 threads loads exactly one weight block and one Q8_1 block
// (64 rows x 4 blocks each), unpacks the weight block to eight int8 words once
// (gguf_common.cuh: nibble masks, Q5 bit spread) and stores words and fp32 scales in shared
// memory. Then thread (ty, tx) of the 16 x 16 grid computes a 4 x 4 register tile of outputs,
// rows m = ty + 16 i, n = tx + 16 j (strided so that a warp's reads of one word hit different
// rows and so that output stores are 16 consecutive halves). Each (m, n, block) takes 8 DP4A
// plus the scale math; per block a thread reads 4 weight and 4 activation rows of 32 bytes as
// 128-bit shared loads. Rows are padded to 48 bytes: 8 consecutive rows then cover all 32
// banks once, so the quarter-warp phases of a 128-bit load are conflict free.
//
// Tails: rows past M or N load zeros and are never stored; a last step with fewer than BK
// blocks only runs its valid blocks, so the summation is exactly sum over real blocks.
// Measured on the H100 (bench/notes-gguf.md) this kernel loses everywhere: at M = 16..64 the
// 64-row N tiles give only N/64 CTAs (64 for N = 4096, fewer than the 132 SMs), and at large M
// DP4A peaks near 52 TOP/s while cuBLAS fp16 runs 600+ TFLOP/s on tensor cores, so the dispatch
// (gguf.py, MMQ_MAX_M = 0) never picks it: MMVQ up to M = 8, then wgmma (Hopper), the int8
// tensor-core GEMM (gguf_mma.cu) or fp16 dequant + cuBLAS. It is kept, tested (path="mmq"), as
// the readable integer-domain GEMM that gguf_mma.cu grew from: mma.sync m16n8k32.s8 has K = 32 =
// one GGUF block, so each MMA yields exactly one block's sumi and the per-block term is applied
// to the accumulator fragment with the same exact arithmetic.
#include "gguf_common.cuh"

constexpr int MMQ_BM = 64, MMQ_BN = 64, MMQ_BK = 4, MMQ_THREADS = 256, MMQ_PAD = 12;

template <class F>
__global__ void __launch_bounds__(MMQ_THREADS)
mmq(const uint8_t* __restrict__ W, const uint8_t* __restrict__ A, __half* __restrict__ y, int M, int N, int nb) {
    pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
    __shared__ __align__(16) int sW[MMQ_BK][MMQ_BN][MMQ_PAD];
    __shared__ __align__(16) int sA[MMQ_BK][MMQ_BM][MMQ_PAD];
    __shared__ float sWd[MMQ_BK][MMQ_BN], sWm[MMQ_BK][MMQ_BN], sAd[MMQ_BK][MMQ_BM], sAs[MMQ_BK][MMQ_BM];

    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const int n0 = blockIdx.x * MMQ_BN, m0 = blockIdx.y * MMQ_BM;
    const int lr = tid / MMQ_BK, lc = tid % MMQ_BK;  // this thread's loader row and block

    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

    for (int k0 = 0; k0 < nb; k0 += MMQ_BK) {
        const int kb = k0 + lc;
        {  // one weight block -> shared
            int q[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            float d = 0.0f, m = 0.0f;
            const int n = n0 + lr;
            if (n < N && kb < nb) F::unpack(W + ((long long)n * nb + kb) * F::BYTES, d, m, q);
            int4* dst = reinterpret_cast<int4*>(&sW[lc][lr][0]);
            dst[0] = make_int4(q[0], q[1], q[2], q[3]);
            dst[1] = make_int4(q[4], q[5], q[6], q[7]);
            sWd[lc][lr] = d;
            sWm[lc][lr] = m;
        }
        {  // one activation block -> shared
            int a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            float d = 0.0f, s = 0.0f;
            const int m = m0 + lr;
            if (m < M && kb < nb) load_q8_1(A + ((long long)m * nb + kb) * Q8_1_BYTES, d, s, a);
            int4* dst = reinterpret_cast<int4*>(&sA[lc][lr][0]);
            dst[0] = make_int4(a[0], a[1], a[2], a[3]);
            dst[1] = make_int4(a[4], a[5], a[6], a[7]);
            sAd[lc][lr] = d;
            sAs[lc][lr] = s;
        }
        __syncthreads();

        const int steps = min(MMQ_BK, nb - k0);
        for (int c = 0; c < steps; ++c) {
            int w[4][8];
            float wd[4], wm[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int r = tx + 16 * j;
                const int4 lo = *reinterpret_cast<const int4*>(&sW[c][r][0]);
                const int4 hi = *reinterpret_cast<const int4*>(&sW[c][r][4]);
                w[j][0] = lo.x; w[j][1] = lo.y; w[j][2] = lo.z; w[j][3] = lo.w;
                w[j][4] = hi.x; w[j][5] = hi.y; w[j][6] = hi.z; w[j][7] = hi.w;
                wd[j] = sWd[c][r];
                wm[j] = sWm[c][r];
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = ty + 16 * i;
                const int4 lo = *reinterpret_cast<const int4*>(&sA[c][r][0]);
                const int4 hi = *reinterpret_cast<const int4*>(&sA[c][r][4]);
                const float ad = sAd[c][r], as = sAs[c][r];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    int sumi = __dp4a(w[j][0], lo.x, 0);
                    sumi = __dp4a(w[j][1], lo.y, sumi);
                    sumi = __dp4a(w[j][2], lo.z, sumi);
                    sumi = __dp4a(w[j][3], lo.w, sumi);
                    sumi = __dp4a(w[j][4], hi.x, sumi);
                    sumi = __dp4a(w[j][5], hi.y, sumi);
                    sumi = __dp4a(w[j][6], hi.z, sumi);
                    sumi = __dp4a(w[j][7], hi.w, sumi);
                    acc[i][j] += F::term(sumi, wd[j], wm[j], ad, as);
                }
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int m = m0 + ty + 16 * i;
        if (m >= M) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = n0 + tx + 16 * j;
            if (n < N) y[(long long)m * N + n] = __float2half_rn(acc[i][j]);
        }
    }
}
