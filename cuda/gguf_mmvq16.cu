// gguf_mmvq16.cu -- y (M, N) = x (M, K) @ W (N, K)^T for small M (1..8) with wide loads:
// the decode-time GEMV, same math as gguf_mmvq.cu, different memory access.
//
// Math (unchanged, gguf_common.cuh): per output y[m, n] and 32-block b,
//   sumi_b = sum_{j<32} q_w[n, b, j] * q_a[m, b, j]      int32, 8 x __dp4a
//   y[m, n] = sum_b term(sumi_b, d_w, m_w, d_a, s_a)      fp32, term = the format's block dot
// Each lane finishes whole blocks, so every term is formed from the full block's sumi and is
// bit-identical to the numpy emulation's term; only the fp32 order of the sum differs.
//
// Why this kernel exists. gguf_mmvq.cu reads an 18/22/34-byte block with 2-byte loads (the
// blocks are only 2-byte aligned) and a Q8_1 block with nine 4-byte loads. A warp's load
// instruction then covers 32 blocks spread over ~576 (weight) or 1152 (activation) bytes, i.e.
// 5 or 9 L1 cache lines ("wavefronts") for 64 or 128 useful bytes; at M = 1 that is ~170
// wavefronts per 1152 weight bytes, and the SM's load pipeline -- not DRAM -- set the speed
// (66-78 % of the H100's copy bandwidth). Here:
//  * Weights (gguf_window.cuh): lane l still owns block b = 32 i + l of its row, but reads the
//    16-byte-aligned window that covers the block with 16-byte `ld.global.nc` loads (LW = 16;
//    8-byte loads were slower): 2 loads for Q4_0/Q4_1/Q5_1, 3 for Q8_0, 2 for Q5_0 plus a third
//    where the block crosses byte 32 (ptxas narrows it to the one 4-byte word used), each
//    spanning the same ~5 lines as before but carrying 8x the bytes. The block sits at a run-time
//    byte offset o (even) inside that window; it is shifted into place in registers with selects
//    on the word index (o / 4: 2 levels) and one byte_perm per word for the half-word part
//    (o & 2) -- no dynamic register indexing (that would spill to local memory).
//  * Activations: the Q8_1 workspace is in a split layout (q8_1_quantize.cu,
//    quantize_q8_1_split): qs of block i at 32 i (two aligned 16-byte loads; a warp reads one
//    contiguous 1 KB run), (d, s) as a half2 array after all qs. Same bytes, same values as the
//    codec's 36-byte blocks, only placed differently: 3 loads per block instead of 9.
//  * One warp owns R whole rows (4 warps per CTA): no shared memory and no __syncthreads, the
//    fp32 sums are reduced with xor shuffles and lane (m R + r) stores y[m, n0 + r].
// The loop is software-pipelined: a lane loads its next weight window once it has decoded the
// current one (measured without it, bench/notes-gguf.md: the wide loads alone did not move
// M = 1 -- the limit was a warp's chain of serial memory latencies, not the LSU).
// In the SASS (nvcc 13, sm_90) ptxas puts that reload, under its `if`, after the block's DP4As:
// at U = 1 it overlaps only the term and the next block's activation loads, and the next trip's
// decode waits for it; at U = 2 the other slot's block runs while it is in flight.
// Weight loads may use L1::no_allocate (NOALLOC): the weight is streamed once, the activation
// is what every warp of the SM re-reads, so the weight should not evict it from L1.
//
// Requirements (checked in quantzoo/kernels/gguf.py, which otherwise runs gguf_mmvq.cu): the
// weight's base address and its total size N * nb * bytes are multiples of LW, so every
// LW-aligned window that covers a block lies inside the tensor. Rows themselves need not be
// aligned (the window offset is computed per block). Rows past N (the last warp when R does
// not divide N) are computed on row N - 1 and not stored.
#include "gguf_window.cuh"

constexpr int MMVQ16_WARPS = 4;


// W: GGUF block bytes (N rows of nb blocks). Aqs: Q8_1 qs, block (m, b) at 32 (m nb + b);
// Ads: half2 (d, s) of block (m, b) at index m nb + b. y: fp16 (M, N). U: the pipeline depth,
// blocks per row a lane has in flight (U = 1: the next block loads while this one is used;
// dispatch takes U = 2 only at M = 1 on rows of >= 256 blocks, for q4_0 and q8_0:
// gguf.MMVQ1_LONG). U does not change the order of a lane's sum: blocks lane, lane + 32, ...
template <class F, int M, int R, bool NOALLOC, int U = 1>
__global__ void __launch_bounds__(MMVQ16_WARPS * 32)
mmvq16(const uint8_t* __restrict__ W, const uint8_t* __restrict__ Aqs, const __half2* __restrict__ Ads,
       __half* __restrict__ y, int N, int nb) {
    pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
    const int lane = threadIdx.x % 32;
    const int n0 = (blockIdx.x * MMVQ16_WARPS + threadIdx.x / 32) * R;
    if (n0 >= N) return;  // whole warps: the shuffles below stay full
    long long row_off[R];
#pragma unroll
    for (int r = 0; r < R; ++r) row_off[r] = (long long)min(n0 + r, N - 1) * nb * F::BYTES;

    float acc[M][R];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;

    // Software pipelining: a ring of U windows per row. Window u holds this lane's block
    // lane + 32 (i U + u) of step i; once it is decoded, the same slot loads the block U steps
    // ahead, so each warp always has U loads per row in flight (with none, a warp's K loop was
    // a chain of nb/32 full memory latencies with idle gaps between; where ptxas places the
    // reload: the header).
    vec16::Window<F, NOALLOC> win[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (lane + 32 * u < nb) {
#pragma unroll
            for (int r = 0; r < R; ++r) win[u][r].load_raw(W, row_off[r] + (long long)(lane + 32 * u) * F::BYTES);
        }
    for (int kb0 = lane; kb0 < nb; kb0 += 32 * U) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int kb = kb0 + 32 * u;
            if (kb >= nb) break;
            float dw[R], mw[R];
            int q[R][8];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                win[u][r].finish();
                const vec16::Window<F, NOALLOC>& wr = win[u][r];
                F::unpack_from([&](int k) { return wr.get(k); }, dw[r], mw[r], q[r]);
            }
            if (kb + 32 * U < nb) {
#pragma unroll
                for (int r = 0; r < R; ++r) win[u][r].load_raw(W, row_off[r] + (long long)(kb + 32 * U) * F::BYTES);
            }
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const long long ab = (long long)m * nb + kb;
                const uint4 a0 = __ldg(reinterpret_cast<const uint4*>(Aqs + ab * 32));
                const uint4 a1 = __ldg(reinterpret_cast<const uint4*>(Aqs + ab * 32 + 16));
                const float2 ds = __half22float2(__ldg(Ads + ab));
                const int a[8] = {int(a0.x), int(a0.y), int(a0.z), int(a0.w), int(a1.x), int(a1.y), int(a1.z), int(a1.w)};
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    int sumi = 0;
#pragma unroll
                    for (int i = 0; i < 8; ++i) sumi = __dp4a(q[r][i], a[i], sumi);
                    acc[m][r] += F::term(sumi, dw[r], mw[r], ds.x, ds.y);
                }
            }
        }
    }

    float mine = 0.0f;  // lane m R + r keeps y[m, n0 + r]
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float v = warp_sum(acc[m][r]);
            if (lane == m * R + r) mine = v;
        }
    if (lane < M * R) {
        const int m = lane / R, n = n0 + lane % R;
        if (n < N) y[(long long)m * N + n] = __float2half_rn(mine);
    }
}
